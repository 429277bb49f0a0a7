"""`diagnose`: why is this run mismatched? Seven findings, each a signature in the two
log-prob columns, from one streamed read of the log.

Design
------
`collect(sources)` streams the log once (ingest's batches, read ahead in a thread as the
engine's replay reads them; invalid rows are counted, never raised: diagnosing is reading
what is wrong) into a `DiagnoseStats`: additive sums only, so memory is bounded by the batch,
by a few arrays per position (4,096 exact positions, then 64 power-of-two buckets), per step
and per bootstrap replicate, and by ~24 bytes per sequence (its key hash, loss tokens so far;
the first-token and last-token questions need them). Each finding is then a function of the
stats (`truncation`, `temperature`, `staleness`, `position`, `placeholders`, `noise_floor`,
`alignment`), returning a `Diagnosis`: verdict `found`, `clear` or `can't tell` (naming the
missing column), the evidence with its numbers, what to do; `diagnose(sources)` is all seven
in a `DiagnoseResult` (`.table`, `.to_dict()`, a summary).

Intervals are a Poisson bootstrap over sequences (steps where the log has no sample_id):
replicate b gives sequence g the weight w_gb ~ Poisson(1), a function of the sequence's key
hash and b alone (splitmix64 -> uniform -> Poisson inverse CDF), so the rows of one sequence
get the same weight in every batch they fall into and each replicate is a sum of weighted
per-run sums: B = 200 replicates cost [runs x B] weights per batch (2k sequences x 200 for
a 1M-token batch of 512-token sequences), drawn inside kernel.boot_add and never held as a
matrix, not a pass per replicate. A replicate of a
ratio of sums (the token-mean ratio, the slope) is the ratio of its weighted sums; the 95%
interval is its 2.5th and 97.5th percentiles.

The signatures (l = lp - lq, r = p/q = exp(l), lp the trainer's log-prob, lq the engine's):

1. truncation: for any p and q on the same support E_q[p/q] = 1, whatever the staleness or
   kernel noise; an engine logging the renormalised truncated distribution (top-p, top-k,
   min-p) multiplies every ratio by the kept mass S, so the token-mean ratio estimates S.
   Found when its interval lies below 0.99 (the fix: `--map kept_mass=COLUMN`).
2. temperature: one side at temperature T, the other at 1: l = (T - 1) lq + c(context), so
   the least-squares slope of l on lq is T - 1 within a context; c varies with the
   context's shape and pulls the plain slope toward 0 (T 0.7 read as 0.757), so where the
   log has the trainer's entropy it is a second regressor (0.704). Found when |slope| >
   0.05 and its interval excludes 0; `can't tell` where truncation is found (the
   renormalisation moves the slope too). (Rounding noise e on lq alone: -var(e)/var(lq).)
3. staleness against engine: with old_logprob (the trainer at the rollout's weights) k1 and
   k3 of trainer vs old (the policy lag) and of old vs inference (the engine) say which
   dominates; with a `version` column the lag step - version. An attribution, not a defect:
   `clear` with the split in the evidence.
4. position: mean |l| and k3 by position (`position`, else the token's index among its
   sequence's loss tokens); a changepoint P where the mean |l| of the next 64 positions is
   >= 3x the previous 64 (argmax of that ratio, its 95% interval by the delta method on the
   two window means, tokens as independent), and the first loss token against the rest.
5. placeholders: exactly 0.0 on one side while the other is below log 0.5; sentinels <= -1e4;
   NaN / inf rows (counted by ingest, which other commands refuse); one exact value (not
   within 1e-6 of 0) on more than 1% of loss tokens (candidates from a strided sample of
   each batch, counted exactly from the batch they appear in); and where they sit: first /
   last / inner token of their sequences.
6. noise floor: whether each column lies on the bf16 or fp16 grid, and the 50th and 90th
   percentiles of |l| on tokens with p, q > 0.9 (a 4,000-bin log histogram, 0.8% bins); a
   setting (`-r`, `--from-config`) whose per-token threshold, at the floor tokens' median q,
   lies below the 90th percentile masks rounding noise.
7. alignment: inspect's off-by-one check (`ingest.alignment.AlignmentCheck`) on the same
   batches.

Layout: stats.py (the one read: DiagnoseStats, collect), kernel.py (the per-token pass and
the bootstrap as numba loops; stats.py's numpy pass is their reference and the path without
numba), findings.py (the seven functions), this module (the result, `diagnose`). Cost:
benchmarks/diagnose_bench.py, 0.67x a default sweep on 20M tokens (docs/commands/diagnose.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from ...ingest import ReadOptions
from ...present import Presentable
from ...rules import Rule, parse_rule
from .findings import (
    Diagnosis,
    alignment,
    changepoint,
    noise_floor,
    placeholders,
    position,
    position_table,
    regression_slope,
    rule_threshold_l,
    staleness,
    temperature,
    truncation,
)
from .stats import (
    EXACT_POS,
    FINDINGS,
    SCHEMA_VERSION,
    VERDICTS,
    DiagnoseStats,
    collect,
    poisson_weights,
)

# ----------------------------------------------------------------------------- result


@dataclass
class DiagnoseResult(Presentable):
    """The seven findings in order; `.table`: finding, verdict, evidence, what to do."""

    files: list[str]
    tokens: int
    findings: list[Diagnosis]

    def get(self, key: str) -> Diagnosis:
        return next(d for d in self.findings if d.key == key)

    @property
    def table(self) -> pl.DataFrame:
        return pl.DataFrame(
            {
                "finding": [d.title for d in self.findings],
                "verdict": [d.verdict for d in self.findings],
                "evidence": [d.evidence for d in self.findings],
                "what_to_do": [d.action for d in self.findings],
            }
        )

    @property
    def found(self) -> list[Diagnosis]:
        return [d for d in self.findings if d.verdict == "found"]

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "files": self.files,
            "tokens": self.tokens,
            "findings": [d.to_dict() for d in self.findings],
        }

    def summary_lines(self) -> list[str]:
        head = (
            f"diagnose: {len(self.found)} of {len(self.findings)} findings found on "
            f"{self.tokens:,} loss tokens"
        )
        return [head, *(f"  {d.title}: {d.verdict}: {d.evidence}" for d in self.findings)]


def diagnose_stats(st: DiagnoseStats, settings: Sequence[str | Rule] = ()) -> DiagnoseResult:
    """The seven findings from accumulated stats."""
    out = [
        truncation(st),
        temperature(st),
        staleness(st),
        position(st),
        placeholders(st),
        noise_floor(st, settings),
        alignment(st),
    ]
    return DiagnoseResult(list(getattr(st, "files", [])), st.tokens, out)


def diagnose(
    sources: Sequence[str | Path] | str | Path,
    settings: Sequence[str | Rule] = (),
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DiagnoseResult:
    """One streamed read of the log, then the seven findings (`settings`: the -r /
    --from-config rules the noise floor judges)."""
    rules = [parse_rule(s) if isinstance(s, str) else s for s in settings]
    return diagnose_stats(collect(sources, options, progress), rules)


__all__ = [
    "EXACT_POS",
    "FINDINGS",
    "VERDICTS",
    "DiagnoseResult",
    "DiagnoseStats",
    "Diagnosis",
    "alignment",
    "changepoint",
    "collect",
    "diagnose",
    "diagnose_stats",
    "noise_floor",
    "placeholders",
    "poisson_weights",
    "position",
    "position_table",
    "regression_slope",
    "rule_threshold_l",
    "staleness",
    "temperature",
    "truncation",
]
