"""One answer of `choose`, and how its bootstrap interval is read off the replicates.

Design
------
`choose --of tokens` (choose.py) and `choose --of adv-mass` (choose_mass.py) search
differently (the tail and passes; exact |A| suffix sums and plain replays) and answer the
same way: a `Choice` per rule and threshold parameter (`choice_row` builds it from the job
and the search's result), its interval read from Poisson(1) replicates by `ci_from`. Both
take these from here, so that neither imports the other's internals (choose.py calls
choose_mass, never the reverse).

The interval is the 2.5% and 97.5% quantiles, over replicates, of the value where the
replicate's masked fraction (or masked |A| share) crosses the target (`crossings`:
interpolated between the two columns around it, geometrically on a positive grid); an
interval reaching an end of the columns says so in its note. `CurvePoint` is one point of
a choice's `curve` (choose.py's `_curve`, the report's table).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .. import engine


@dataclass
class CurvePoint:
    """The exact masked fraction at one value near the choice."""

    value: float
    masked_tokens: int
    masked_fraction: float
    chosen: bool

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Choice:
    """choose's answer for one rule and threshold parameter (or one setting, no target)."""

    rule: str
    setting: str  # the rule's other parameters, as in the sweep table
    param: str
    value: float
    masked_fraction: float
    target_fraction: float | None
    ci_low: float | None  # 95% bootstrap interval (of the value; of the fraction without target)
    ci_high: float | None
    kind: str  # "mask" or "weight"
    status: str  # ok | ties | out of range | not converged
    note: str
    tokens: int
    masked_tokens: int
    passes: int  # passes over the log the answer took
    spec: str  # the rule at the chosen value
    curve: list[CurvePoint] | None = None  # with curve=True
    # what the target is a share of: "tokens", or "adv-mass" (choose_mass.py: sum |A|)
    of: str = "tokens"
    masked_adv_mass_fraction: float | None = None  # with of="adv-mass": at the value

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "curve"}
        if self.curve is not None:
            d["curve"] = [p.to_dict() for p in self.curve]
        return d


def choice_row(job, value, frac, target, lo, hi, status, note, tokens, passes) -> Choice:
    rule = job.rule
    return Choice(
        rule=rule.name,
        setting=rule.setting(job.param),
        param=job.param,
        value=float(value),
        masked_fraction=float(frac),
        target_fraction=target,
        ci_low=lo,
        ci_high=hi,
        kind=rule.kind,
        status=status,
        note=note,
        tokens=tokens,
        masked_tokens=round(frac * tokens),
        passes=passes,
        spec=rule.replace(**{job.param: float(value)}).spec(),
    )


def no_boot_note(job: engine.Job) -> str:
    if job.rule.level == "step":
        return "m2po is batch-adaptive per step: no bootstrap"
    return "no bootstrap"


def ci_from(job, reps, tokens, target, level: float = 0.95):
    """Interval of the value where the replicate masked fraction crosses the target."""
    ok = tokens > 0
    if ok.sum() < 2:
        return None, None, "too few units to resample"
    f = reps[ok] / tokens[ok, None]
    lo, hi = interval(crossings(job, f, target), level)
    note = ""
    if lo <= job.values[0] or hi >= job.values[-1]:
        note = "bootstrap interval reaches the searched range's edge"
    return lo, hi, note


def crossings(job: engine.Job, f: np.ndarray, target: float) -> np.ndarray:
    """Per replicate (rows of f, (B, K) masked fractions at job.values), the value where the
    fraction crosses `target`: between the two grid values around it, interpolated
    (geometrically on a positive grid), so that the interval is not limited to the grid's
    resolution; the grid's end where it does not cross."""
    v = job.values[job.order]  # threshold ascending: the fraction does not increase
    ft = f[:, job.order]
    k = (ft > target).sum(axis=1)  # grid points still above the target
    inner = (k > 0) & (k < v.size)
    out = np.where(k == 0, v[0], v[-1]).astype(float)
    r = np.flatnonzero(inner)
    a, b = k[r] - 1, k[r]
    fa, fb = ft[r, a], ft[r, b]
    w = np.where(fa > fb, (fa - target) / np.where(fa > fb, fa - fb, 1.0), 1.0)
    va, vb = v[a], v[b]
    geo = (va > 0) & (vb > 0)
    lin = va + w * (vb - va)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.exp(np.log(np.where(geo, va, 1.0)) * (1 - w) + np.log(np.where(geo, vb, 1.0)) * w)
    out[r] = np.where(geo, log, lin)
    return out


def interval(x: np.ndarray, level: float) -> tuple[float, float]:
    q = (1 - level) / 2
    return float(np.quantile(x, q)), float(np.quantile(x, 1 - q))
