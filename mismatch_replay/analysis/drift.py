"""`drift`: did the run's mismatch drift, and did the masking follow it?

Design
------
One robust replay by step (`engine.replay(by="step", robust=True)`: per step a log
histogram of k3 with per-bin sums, and the top-k3 tokens) gives per-step statistics a
handful of extreme tokens cannot move: the median of k3 (`_hist_quantile`, a bin centre)
and its TRIM = 1%-trimmed mean (`_trimmed_mean`, boundary bins pro rata), beside the plain
means. The baseline is the median over the first steps (20%, at least 3, or
`baseline_steps`). A step is elevated when its trimmed mean exceeds `factor` x the
baseline's; `min_run` consecutive elevated steps are drift. A step whose plain mean (or
trimmed mean) is elevated outside a drift run is a spike, reported with the tokens that
caused it. Per rule, the verdict compares its masked fraction over the drift steps with the
baseline's: "rose with the mismatch" (x2 or more, and up by at least `min_rise` of the
tokens, MIN_RISE = 0.05 percentage points by default: a rise from 0 to 0.01% is no rise anyone
would act on, however large its ratio), "flat while the mismatch rose (the collapse
signature)" (the k3 ratio reached `factor`), or "flat".

The answer is a `DriftResult` (`StepRow`s, `Spike`s, a `RuleVerdict` per rule);
`to_dict()` is the JSON `drift --json` prints, each rule's per-step masked fraction as a
`masked:<spec>` column of the step rows. `drift_from` reads a replay the caller already
made (the report's per-step pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, ingest
from ..engine import readout
from ..errors import DataError, UsageError
from ..present import Presentable
from ..rules import Rule, parse_rule
from . import summaries
from .figure_data import default_settings

TRIM = 0.01  # trimmed mean of k3: drop this fraction of tokens at each end, per step
MIN_RISE = 5e-4  # a rule "rose" only if its masked fraction rose by this much (of tokens)


@dataclass
class StepRow:
    """One step's mismatch and each rule's masked fraction (None: the rule saw no token)."""

    step: int
    tokens: int
    kl_k1: float
    kl_k3: float
    kl_k3_median: float
    kl_k3_trimmed: float
    abs_dp_mean: float
    masked: dict[str, float | None] = field(default_factory=dict)  # rule SPEC -> fraction
    elevated: bool = False  # trimmed mean above factor x the baseline's
    mean_elevated: bool = False  # plain mean above factor x the baseline's
    drift: bool = False  # in a run of min_run elevated steps
    spike: bool = False  # elevated, not in a drift run

    def to_dict(self) -> dict:
        head = ("step", "tokens", "kl_k1", "kl_k3", "kl_k3_median", "kl_k3_trimmed", "abs_dp_mean")
        return {
            **{k: getattr(self, k) for k in head},
            **{f"masked:{label}": v for label, v in self.masked.items()},
            "elevated": self.elevated,
            "mean_elevated": self.mean_elevated,
            "drift": self.drift,
            "spike": self.spike,
        }


@dataclass
class Spike:
    step: int
    kl_k3: float
    kl_k3_trimmed: float
    tokens: list[dict]  # the step's top-k3 tokens (k3, q, p and the log's id columns)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class RuleVerdict:
    rule: str  # the rule SPEC
    baseline_fraction: float
    drift_fraction: float | None  # None: no drift step
    ratio: float | None  # masked fraction, drift steps over baseline (floored)
    verdict: str
    kl_ratio: float | None = None  # trimmed k3, drift steps over baseline (with drift)
    rise: float | None = None  # drift_fraction - baseline_fraction (with drift)

    def to_dict(self) -> dict:
        d = {
            "rule": self.rule,
            "baseline_fraction": self.baseline_fraction,
            "drift_fraction": self.drift_fraction,
            "ratio": self.ratio,
        }
        if self.rise is not None:
            d["rise"] = self.rise
        if self.kl_ratio is not None:
            d["kl_ratio"] = self.kl_ratio
        d["verdict"] = self.verdict
        return d


@dataclass
class Baseline:
    kl_k3_trimmed: float  # median over the baseline steps
    kl_k3: float


@dataclass
class DriftResult(Presentable):
    """Per-step mismatch, drift and spikes, a verdict a rule; `.table`: one row a step."""

    factor: float
    min_run: int
    baseline_steps: list[int]
    baseline: Baseline
    statistic: str  # what departs, in words
    flagged_steps: list[int]  # the drift steps
    spikes: list[Spike]
    rules: list[RuleVerdict]
    steps: list[StepRow]  # step ascending
    min_rise: float = MIN_RISE

    @property
    def spike_steps(self) -> list[int]:
        return [s.step for s in self.spikes]

    def to_dict(self) -> dict:
        return {
            "factor": self.factor,
            "min_run": self.min_run,
            "min_rise": self.min_rise,
            "baseline_steps": self.baseline_steps,
            "baseline": {
                "kl_k3_trimmed": self.baseline.kl_k3_trimmed,
                "kl_k3": self.baseline.kl_k3,
            },
            "statistic": self.statistic,
            "flagged_steps": self.flagged_steps,
            "spike_steps": self.spike_steps,
            "spikes": [s.to_dict() for s in self.spikes],
            "rules": [v.to_dict() for v in self.rules],
            "steps": [r.to_dict() for r in self.steps],
        }

    @property
    def table(self) -> pl.DataFrame:
        return summaries.drift_table(self)

    def summary_lines(self) -> list[str]:
        return summaries.drift_lines(self)


def _hist_quantile(counts: np.ndarray, q: float) -> float:
    """The q-quantile of k3 from its per-step log histogram (bin centre; 0 for the zero bin)."""
    c = np.cumsum(counts)
    if c[-1] == 0:
        return math.nan
    j = int(np.searchsorted(c, q * c[-1], side="left"))
    if j == 0:
        return 0.0
    lo = engine.K3_LOG10_MIN + (j - 1) * (engine.K3_LOG10_MAX - engine.K3_LOG10_MIN) / (
        engine.K3_BINS
    )
    return 10 ** (lo + 0.5 * (engine.K3_LOG10_MAX - engine.K3_LOG10_MIN) / engine.K3_BINS)


def _trimmed_mean(counts: np.ndarray, sums: np.ndarray, trim: float) -> float:
    """Mean of k3 without the lowest and highest `trim` of tokens; boundary bins pro rata."""
    n = counts.sum()
    if n == 0:
        return math.nan
    lo_cut, hi_cut = trim * n, (1 - trim) * n
    c_hi = np.cumsum(counts)
    c_lo = c_hi - counts
    keep = np.clip(np.minimum(c_hi, hi_cut) - np.maximum(c_lo, lo_cut), 0, None)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_in_bin = np.where(counts > 0, sums / np.where(counts > 0, counts, 1), 0.0)
    total = keep.sum()
    return float((keep * mean_in_bin).sum() / total) if total > 0 else math.nan


def _plain(x):
    """A numpy scalar as a Python value; a string sample id (an object array's) as it is."""
    return x.item() if hasattr(x, "item") else x


def drift_rules(columns: Sequence[str]) -> list[Rule]:
    """The settings drift watches by default: the report's IPO and IcePop settings."""
    return [r for r in default_settings(columns) if r.name in ("ipo", "icepop")]


def drift(
    sources: Sequence[str | Path],
    rules: Sequence[str | Rule] | None = None,
    factor: float = 3.0,
    baseline_steps: int | None = None,
    min_run: int = 3,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    min_rise: float = MIN_RISE,
) -> DriftResult:
    """Per-step mismatch and masked fractions; sustained departures flagged as drift, lone
    heavy-tail steps as spikes; whether each rule's masked fraction followed the mismatch."""
    if factor <= 1:
        raise UsageError(f"--factor {factor}: give a factor above 1.")
    if min_run < 1:
        raise UsageError(f"--min-run {min_run}: give at least 1.")
    if not 0 <= min_rise <= 1:
        raise UsageError(f"--min-rise {min_rise}: give a fraction of tokens in [0, 1].")
    plan = ingest.plan_sources(sources, options)
    chosen = (
        [parse_rule(r) if isinstance(r, str) else r for r in rules]
        if rules
        else drift_rules(plan.columns)
    )
    jobs = [engine.single_job(r) for r in chosen]
    tally = engine.replay(plan, jobs=jobs, by="step", robust=True, progress=progress, final=True)
    return drift_from(plan, tally, range(len(jobs)), factor, baseline_steps, min_run, min_rise)


def drift_from(
    plan, tally, which, factor, baseline_steps, min_run, min_rise=MIN_RISE
) -> DriftResult:
    """`drift`'s answer from a robust Tally by step; `which`: the jobs to give verdicts for;
    a rule rose only when its masked fraction rose by `min_rise` (of tokens) or more."""
    steps = list(tally.groups)
    order = np.argsort(steps)
    m = tally.metrics.values()
    n_steps = len(steps)
    if n_steps < 2:
        raise DataError(
            f"{plan.files[0]}: drift needs several steps; the log has {n_steps} "
            "(map a step column with --map step=COLUMN)."
        )
    nb = baseline_steps or max(3, round(0.2 * n_steps))
    nb = min(nb, n_steps)
    rows = []
    for gi in order:
        counts, sums = tally.k3_hist[gi], tally.k3_hist_sum[gi]
        rows.append(
            StepRow(
                step=steps[gi],
                tokens=int(m["tokens"][gi]),
                kl_k1=float(m["kl_k1"][gi]),
                kl_k3=float(m["kl_k3"][gi]),
                kl_k3_median=_hist_quantile(counts, 0.5),
                kl_k3_trimmed=_trimmed_mean(counts, sums, TRIM),
                abs_dp_mean=float(m["abs_dp_mean"][gi]),
            )
        )
    labels = []
    for ji in which:
        frame = readout.job_frame(tally, ji)
        label = tally.jobs[ji].rule.spec()
        labels.append(label)
        by_step = dict(
            zip(frame["step"].to_list(), frame["masked_fraction"].to_list(), strict=True)
        )
        for r in rows:
            r.masked[label] = by_step.get(r.step)
    base = rows[:nb]
    base_trim = float(np.median([r.kl_k3_trimmed for r in base]))
    base_mean = float(np.median([r.kl_k3 for r in base]))
    for r in rows:
        r.elevated = bool(r.kl_k3_trimmed > factor * base_trim)
        r.mean_elevated = bool(r.kl_k3 > factor * base_mean)
    # sustained: runs of >= min_run consecutive elevated steps
    flagged: list = []
    run: list = []
    for r in [*rows, None]:
        if r is not None and r.elevated:
            run.append(r.step)
            continue
        if len(run) >= min_run:
            flagged.extend(run)
        run = []
    flagged_set = set(flagged)
    spikes = []
    for r in rows:
        r.drift = r.step in flagged_set
        r.spike = (r.mean_elevated or r.elevated) and not r.drift
        if r.spike:
            gi = tally.groups.index(r.step)
            top = tally.top.get(gi, {})
            tokens = (
                [{c: _plain(v[i]) for c, v in top.items()} for i in range(len(top["k3"]))]
                if top
                else []
            )
            spikes.append(Spike(r.step, r.kl_k3, r.kl_k3_trimmed, tokens))
    verdicts = []
    drift_rows = [r for r in rows if r.drift]
    for label in labels:

        def frac(rs, label=label):
            tok = sum(r.tokens for r in rs)
            hit = sum((r.masked[label] or 0) * r.tokens for r in rs)
            return hit / tok if tok else math.nan, tok

        fb, tb_ = frac(base)
        if not drift_rows:
            verdicts.append(RuleVerdict(label, fb, None, None, "no drift"))
            continue
        fd, td = frac(drift_rows)
        floor = 0.5 / max(min(tb_, td), 1)
        ratio = max(fd, floor) / max(fb, floor)
        kl_ratio = float(np.median([r.kl_k3_trimmed for r in drift_rows])) / base_trim
        if ratio >= 2 and fd - fb >= min_rise:
            verdict = "rose with the mismatch"
        elif kl_ratio >= factor:
            verdict = "flat while the mismatch rose (the collapse signature)"
        else:
            verdict = "flat"
        verdicts.append(RuleVerdict(label, fb, fd, ratio, verdict, kl_ratio, fd - fb))
    return DriftResult(
        factor=factor,
        min_run=min_run,
        baseline_steps=[r.step for r in base],
        baseline=Baseline(base_trim, base_mean),
        statistic=f"per-step {TRIM:.0%}-trimmed mean of k3 (and its plain mean for spikes)",
        flagged_steps=flagged,
        spikes=spikes,
        rules=verdicts,
        steps=rows,
        min_rise=min_rise,
    )
