"""`choose --of adv-mass`: the threshold that removes a target share of the advantage mass.

Design
------
`choose --of tokens` (choose.py) aims at a masked fraction of the tokens; `--of adv-mass` at
`masked_adv_mass_fraction`, the share of sum |A| over the loss tokens that a rule's mask
removes (a zero-advantage token costs nothing: RULES.md "What a mask costs"). The same
`Search` runs on it: its "hits" are the masked |A| mass at each value and its "tokens" the
total |A|, both exact suffix sums of the per-bin |A| sums every replay keeps (engine/bins.py),
so the fraction still never increases along the threshold and the brackets, ties and
statuses read as choose's. The passes are plain replays (no tail: the tail keeps no group
totals of |A|): the default grids, then 2 x REFINE_POINTS points in every open bracket, round
after round, until within `tol` (relative) of the target or a tie, at most `max_passes`.

The interval: one more replay with Poisson(1) replicates over sequences (or steps) whose
counts sum |A| instead of counting tokens (`bootstrap=(B, unit, seed, "adv")`,
`Tally.boot_weight`), on BOOT_COLUMNS values around the answer (where the fraction is
the target times BOOT_FACTOR .. divided by it), read as choose reads its replicates
(choice.py's `ci_from`: the 2.5% and 97.5% quantiles of each replicate's crossing). m2po
(batch-adaptive per step, its rows carry no |A| sums) is refused.
"""

from __future__ import annotations

import numpy as np

from .. import engine
from ..engine import readout
from ..engine.bins import suffix
from ..errors import DataError, UsageError
from .choice import choice_row, ci_from, no_boot_note
from .search import REFINE_POINTS, Search, choice_jobs, grid_between

OF = ("tokens", "adv-mass")
BOOT_COLUMNS = 25  # values the replicates are read at (choose.BOOT_COLUMNS)
BOOT_FACTOR = 1.5  # the bootstrap columns span the fractions target * 1.5 .. target / 1.5


def mass_counts(tally: engine.Tally, ji: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(values ascending, masked |A| mass at each, total |A|, masked tokens at each) of job
    ji, all groups (suffix sums of the per-bin sums, like readout.job_counts)."""
    job = tally.jobs[ji]
    bins = tally.job_bins(ji)
    if bins.amass is None:
        raise DataError("internal error: the replay kept no |A| sums (no advantage column?)")
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    a = bins.amass.sum(axis=0, keepdims=True)
    c = bins.count.sum(axis=0, keepdims=True)
    return job.values, suffix(a)[0][inv + 1], float(a.sum()), suffix(c)[0][inv + 1]


def choose_mass(plan, chosen, target, bootstrap, unit, seed, tol, max_passes, progress):
    """The Choices for `--of adv-mass` (the module docstring), in rule order."""
    if "advantage" not in plan.columns:
        raise DataError(
            f"{plan.files[0]}: --of adv-mass aims at a share of the advantage mass, and the "
            "log has no advantage column. Map one with --map advantage=COLUMN."
        )
    chosen = [r for r in chosen if r.level != "step" or _refuse_m2po(r)]
    jobs = choice_jobs(chosen, True)
    tally = engine.replay(plan, jobs=jobs, progress=progress, final=True)
    searches, tokens, masked = [], int(tally.report.loss_rows), []
    for ji, job in enumerate(jobs):
        values, mass, total, hits = mass_counts(tally, ji)
        if total <= 0:
            raise DataError(f"{plan.files[0]}: every advantage is 0: no mass to remove.")
        searches.append(Search(job, values.copy(), mass.copy(), total))
        masked.append(dict(zip(values.tolist(), hits.tolist(), strict=True)))
    for _ in range(max(0, max_passes - 1)):  # refine the open brackets, a replay a round
        open_ = [(i, st[3]) for i, s in enumerate(searches) if (st := s.state(target, tol))[2]
                 == "refine"]  # fmt: skip
        if not open_:
            break
        fine = [
            engine.Job(s.job.rule, s.job.param, grid_between(a, b, 2 * REFINE_POINTS))
            for i, (a, b) in open_
            for s in [searches[i]]
        ]
        t = engine.replay(plan, jobs=fine, progress=progress, final=True)
        for k, (i, _) in enumerate(open_):
            values, mass, _, hits = mass_counts(t, k)
            searches[i].add(values, mass)
            masked[i].update(zip(values.tolist(), hits.tolist(), strict=True))
        for s in searches:
            s.passes += 1
    states = [s.state(target, tol) for s in searches]
    boot = {}
    if bootstrap:
        idx = [i for i, st in enumerate(states) if not st[2].startswith("out of range")]
        bjobs = [_boot_job(searches[i], states[i][0], target) for i in idx]
        if bjobs:
            bt = engine.replay(
                plan, jobs=bjobs, bootstrap=(bootstrap, unit, seed, "adv"), progress=progress,
                final=True,
            )  # fmt: skip
            for k, i in enumerate(idx):
                got = readout.boot_counts(bt, k)
                boot[i] = (bjobs[k], *got) if got is not None else None
            for s in searches:
                s.passes += 1
    rows = []
    for i, (s, (best, frac, status, _)) in enumerate(zip(searches, states, strict=True)):
        if status == "refine":
            status = f"not converged: not within {tol:.0%} after {s.passes} passes"
        status, _, note = status.partition(": ")
        lo = hi = None
        if bootstrap and status != "out of range":
            got = boot.get(i)
            if got is None:
                extra = no_boot_note(s.job)
            else:
                lo, hi, extra = ci_from(got[0], got[1], got[2], target)
            note = "; ".join(x for x in (note, extra) if x)
        row = choice_row(s.job, best, frac, target, lo, hi, status, note, tokens, s.passes)
        row.masked_tokens = int(masked[i][float(best)])
        row.masked_fraction = row.masked_tokens / tokens if tokens else float("nan")
        row.of = "adv-mass"
        row.masked_adv_mass_fraction = float(frac)
        rows.append(row)
    return rows


def _refuse_m2po(rule) -> bool:
    raise UsageError(
        f"--of adv-mass: {rule.spec()} ranks whole steps (m2po): its rows carry no |A| sums; "
        "choose it with --of tokens."
    )


def _boot_job(s: Search, best: float, target: float) -> engine.Job:
    """BOOT_COLUMNS values around the answer: from the last evaluated value (in threshold
    order) whose fraction is still BOOT_FACTOR times the target to the first at the target
    divided by it (every replicate's crossing lies inside on a log of any size but a tiny
    one), and the answer itself."""
    rule, param = s.job.rule, s.job.param
    thr = np.array([rule.threshold(param, v) for v in s.values])
    order = np.argsort(thr, kind="stable")  # threshold ascending: the fraction falls
    v, f = s.values[order], s.hits[order] / s.tokens
    above = np.flatnonzero(f >= target * BOOT_FACTOR)
    below = np.flatnonzero(f <= target / BOOT_FACTOR)
    lo = v[above[-1]] if above.size else v[0]
    hi = v[below[0]] if below.size else v[-1]
    a, b = min(lo, hi), max(lo, hi)
    return engine.Job(rule, param, np.unique(np.r_[grid_between(a, b, BOOT_COLUMNS), best]))
