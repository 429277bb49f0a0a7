"""`check`: a CI gate on a token log, one replay, a verdict per limit.

Design
------
Users assert mismatch limits in CI by hand (slime's `train_rollout_logprob_abs_diff <= 0.1`,
prime-rl's `mismatch_kl`). A limit here is either a mismatch metric (`kl_k3 <= 0.01`, under
the tool's name or a dashboard's: `mismatch_kl/all/mean`, `rollout_corr/k3_kl`, ...) or the
masked fraction of one rule at one setting (`ipo:eps=0.3` masks at most 1%). `check` replays
the log once through the rules named in the limits (the metrics come with every replay), with
`per_step=True` grouped by step as well, and returns one `Verdict` per limit: the log's value,
the worst step and its value, every step over the limit with its value (`violating`,
`--json`'s `violating_steps`), and whether the limit holds. With `per_step` a limit must hold in
every step (the worst step decides); without it, on the whole log. slime's
`train_rollout_logprob_abs_diff` (a mean over samples of each sample's mean |lp - lq|) is no
Tally metric: one more streaming pass computes it when a limit names it.

Nothing here draws or prints: the CLI formats the verdicts (`CheckResult.to_dict()` is its
`--json`) and maps `passed` to the exit code (0 when every limit holds, 3 when one is
exceeded; 1 stays bad data, 2 bad usage).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from .. import engine, ingest
from ..errors import UsageError
from ..metrics import NAMES, MetricSums
from ..present import Presentable
from ..rules import parse_rule
from . import summaries

# dashboard names -> the tool's metric (each equal to it as docs/metrics.md ("Metrics and
# dashboards") states; names for statistics the tool does not compute are refused with a hint)
ALIASES: dict[str, str] = {
    "mismatch_kl": "kl_k3",
    "mismatch_kl/all/mean": "kl_k3",
    "mismatch_kl/all/std": "kl_k3_std",
    "mismatch_kl/all/max": "kl_k3_max",
    "rollout_corr/kl": "kl_k1",
    "rollout_corr/k3_kl": "kl_k3",
    "rollout_corr/chi2_token": "chi2_token",
    "training/rollout_probs_diff_mean": "abs_dp_mean",
    "training/rollout_probs_diff_std": "abs_dp_std",
    "training/rollout_probs_diff_max": "abs_dp_max",
    "training/rollout_actor_probs_pearson_corr": "probs_pearson",
    "entropy/all/mean": "entropy_mean",
}
# slime's CI metric (slime/backends/megatron_utils/loss.py and cp_utils.py, THUDM/slime
# 624b824): |trainer - rollout| log-prob, a mean over each sample's loss tokens, then over the
# samples (`sum_of_sample_mean`, divided by the samples when logged). Not a Tally metric: one
# extra streaming pass computes it, per sequence, when a limit names it.
SAMPLE_MEAN_ABS_L = "train_rollout_logprob_abs_diff"
CHECKABLE = (*(k for k in NAMES if k != "tokens"), SAMPLE_MEAN_ABS_L)


@dataclass(frozen=True)
class Limit:
    """`value <= limit` for a metric (kind "metric") or a rule's masked fraction ("masked")."""

    kind: str
    name: str  # the metric's name, or the rule SPEC as given
    limit: float
    given: str = ""  # the name as the user wrote it (a dashboard alias)

    @property
    def label(self) -> str:
        if self.kind == "masked":
            return f"{self.name} masked fraction"
        return self.given if self.given and self.given != self.name else self.name


@dataclass(frozen=True)
class Verdict:
    limit: Limit
    value: float | None  # on the whole log (None: undefined, e.g. no token)
    worst_step: int | None  # the step with the largest value (per-step checks)
    worst_value: float | None
    ok: bool
    # per-step checks: every step over the limit, [(step, value)] in step order
    violating: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        lim = self.limit
        return {
            "limit": lim.label,
            "kind": lim.kind,
            "metric": lim.name if lim.kind == "metric" else None,
            "rule": lim.name if lim.kind == "masked" else None,
            "max": lim.limit,
            "value": self.value,
            "worst_step": self.worst_step,
            "worst_value": self.worst_value,
            "ok": self.ok,
            "violating_steps": [{"step": s, "value": v} for s, v in self.violating],
        }


@dataclass
class CheckResult(Presentable):
    """A verdict a limit; `passed` when all hold; `.table`: one row a verdict."""

    verdicts: list[Verdict]
    per_step: bool
    tokens: int
    steps: int | None  # with per_step
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(v.ok for v in self.verdicts)

    @property
    def violations(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.ok]

    def to_dict(self) -> dict:
        """What `check --json` prints."""
        return {
            "passed": self.passed,
            "per_step": self.per_step,
            "tokens": self.tokens,
            "steps": self.steps,
            "verdicts": [v.to_dict() for v in self.verdicts],
            "violations": [v.to_dict() for v in self.violations],
        }

    @property
    def table(self) -> pl.DataFrame:
        return summaries.check_table(self)

    def summary_lines(self) -> list[str]:
        return summaries.check_lines(self)


def metric_limit(text: str) -> Limit:
    """`NAME=V` (the tool's metric names or a dashboard alias) -> a Limit."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name:
        raise UsageError(f"--max {text}: write METRIC=VALUE, e.g. --max kl_k3=0.01.")
    metric = ALIASES.get(name, name)
    if metric not in CHECKABLE:
        known = ", ".join(CHECKABLE)
        raise UsageError(
            f"--max {text}: unknown metric '{name}'. Use one of {known}, or a dashboard name: "
            f"{', '.join(ALIASES)}."
        )
    return Limit("metric", metric, _value(value, f"--max {text}"), given=name)


def masked_limit(spec: str, value: float | str) -> Limit:
    """The rule SPEC at its one setting masks at most `value` (a fraction in [0, 1])."""
    parse_rule(spec)  # a usage error now, not after the replay
    v = _value(value, f"--max-masked {value} (for {spec})")
    if not 0.0 <= v <= 1.0:
        raise UsageError(f"--max-masked {value}: a fraction of tokens, between 0 and 1.")
    return Limit("masked", spec, v)


def _value(text, what: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise UsageError(f"{what}: '{text}' is not a number.") from None
    if math.isnan(v):
        raise UsageError(f"{what}: the limit must be a number, not NaN.")
    return v


def check(
    sources: Sequence[str | Path],
    limits: Sequence[Limit],
    per_step: bool = False,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> CheckResult:
    """Replay once and judge every limit (see the module docstring)."""
    if not limits:
        raise UsageError(
            "check: give at least one limit (--max METRIC=V or -r SPEC --max-masked F)."
        )
    specs = list(dict.fromkeys(lim.name for lim in limits if lim.kind == "masked"))
    res = engine.sweep(
        sources,
        rules=specs,
        by="step" if per_step else None,
        options=options,
        progress=progress,
    )
    whole = res.metrics if not per_step else _whole_metrics(res)
    if any(lim.name == SAMPLE_MEAN_ABS_L for lim in limits):
        extra = _sample_mean_abs_l(sources, options)
        whole = whole.with_columns(pl.lit(extra["whole"]).alias(SAMPLE_MEAN_ABS_L))
        if per_step:
            res.metrics = res.metrics.join(extra["steps"], on="step", how="left")
    table = res.table
    tokens = int(res.tally.report.loss_rows)
    verdicts = []
    for lim in limits:
        if lim.kind == "metric":
            value = _num(whole[lim.name][0]) if whole.height else None
            per = res.metrics.select("step", lim.name) if per_step else None
        else:
            rows = table.filter(pl.col("spec") == parse_rule(lim.name).spec())
            value = _fraction(rows)
            per = (
                rows.group_by("step").agg(
                    (pl.col("masked_tokens").sum() / pl.col("tokens").sum()).alias(lim.name)
                )
                if per_step
                else None
            )
        worst_step = worst = None
        violating: list[tuple[int, float]] = []
        if per is not None and per.height:
            per = per.drop_nulls(lim.name).sort([lim.name, "step"], descending=[True, False])
            if per.height:
                worst_step, worst = int(per["step"][0]), float(per[lim.name][0])
            over = per.filter(pl.col(lim.name) > lim.limit).sort("step")
            violating = [
                (int(s), float(v)) for s, v in zip(over["step"], over[lim.name], strict=True)
            ]
        decisive = worst if per_step else value
        ok = decisive is None or decisive <= lim.limit
        verdicts.append(Verdict(lim, value, worst_step, worst, ok, violating))
    steps = res.metrics.height if per_step else None
    return CheckResult(verdicts, per_step, tokens, steps, list(getattr(res, "notes", [])))


def _whole_metrics(res) -> pl.DataFrame:
    """The whole log's metrics from a Tally grouped by step: one more readout, no replay."""
    m = res.tally.metrics
    total = MetricSums()
    total.s = {k: v.sum(keepdims=True) for k, v in m.s.items()}
    total.m = {k: v.max(keepdims=True) for k, v in m.m.items()}
    return total.table(None, [None])


def _fraction(rows: pl.DataFrame) -> float | None:
    n = rows["tokens"].sum() if rows.height else 0
    return None if not n else float(rows["masked_tokens"].sum()) / float(n)


def _num(x) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def _sample_mean_abs_l(sources, options) -> dict:
    """slime's train_rollout_logprob_abs_diff on the whole log and per step: the mean over
    sequences of each sequence's mean |lp - lq| (memory: one pair of sums a sequence)."""
    plan = ingest.plan_sources(sources, options)
    if "sample_id" not in plan.columns:
        raise UsageError(
            f"--max {SAMPLE_MEAN_ABS_L}: slime averages per sample first, and "
            f"{plan.files[0]} has no sample_id column (map one with --map sample_id=COLUMN)."
        )
    parts = []
    for _, df in ingest.iter_batches(plan, ["step", "sample_id"], ingest.ReadReport()):
        parts.append(
            df.group_by("step", "sample_id").agg(
                s=(pl.col("trainer_logprob") - pl.col("inference_logprob")).abs().sum(),
                n=pl.len(),
            )
        )
        if len(parts) > 8:  # fold: bounded by the sequences, not the batches
            parts = [pl.concat(parts).group_by("step", "sample_id").agg(pl.sum("s", "n"))]
    seqs = pl.concat(parts).group_by("step", "sample_id").agg(pl.sum("s", "n"))
    seqs = seqs.with_columns(m=pl.col("s") / pl.col("n"))
    steps = seqs.group_by("step").agg(pl.col("m").mean().alias(SAMPLE_MEAN_ABS_L))
    return {"whole": float(seqs["m"].mean()), "steps": steps}
