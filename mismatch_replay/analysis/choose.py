"""`choose`: per rule, the threshold that masks a target fraction of tokens, with an interval.

Design
------
`choose` finds, per rule and threshold parameter, the value whose masked fraction is
closest to a target. ONE replay, as a rule: the default grids, denser near the target
(`search.first_jobs`: 3 points between two grid values for token rules, 64 for m2po, in the
grid intervals where a sample of the log's first batch masks about the target: the replay
places them when that batch comes, `engine.replay(shape=)`),
bracket the answer, and the replay keeps its tail (engine.Tail, sized by
`search.tail_fraction`): the tokens beyond per-coordinate cutoffs. Then, with no pass and
in the process's worker threads where it helps (`_with_tail`, `TailCounts.map`):

* every open bracket is refined with 2 x REFINE_POINTS = 128 grid points, then rounds of
  REFINE_POINTS, until the fraction is within `tol` (relative) of the target or the bracket
  shrinks to a tie in the data; each grid's counts come from the kept tokens wherever they
  are every masked token (analysis/tail_counts.py checks it against the replay's exact
  counts), else from a pass (`search.one_pass`, which also scores sequence rules from the
  sequence sums, free);
* the bootstrap: Poisson(1) replicates over sequences (or steps) of the masked tokens on
  BOOT_TAIL_COLUMNS = 256 values around the answer (`_boot_job`: between the evaluated values
  where the fraction is the target times 1 +- (BOOT_SIGMAS relative standard errors +
  BOOT_MARGIN), so that every replicate's crossing lies inside), from the kept tokens too.

m2po ranks whole steps: it refines on its first grid (the sample ranked as one step places
the dense points), in passes of its own if that is not enough, and is not resampled. Where
the replay keeps no tail (the simple path, a float32 replay, the Ray engine, a tail past
its memory limit) the same refinement runs in passes and
the bootstrap columns span the coarse bracket widened by BOOT_WIDEN grid points each side,
in the same pass as the first refinement (the exact counts are the same; the intervals,
read at other columns, agree to a fraction of their width: tests/test_tail.py). `tally=`: a
replay that holds these jobs already (the report's shared read, with its tail).

The interval is the 2.5% and 97.5% quantiles, over replicates, of the value where the
replicate's masked fraction crosses the target (choice.py's `crossings`: interpolated
between the two columns around it, geometrically on a positive grid): how much the answer
would move on another log of the same run. Without a target, `choose` gives the masked
fraction at each given setting, with the interval of that fraction (one replay with
`bootstrap=`).

The answer is a `ChooseResult`: a sequence of `Choice` (one per rule and parameter), each
optionally with its `curve` (exact fractions at the grid values around the choice, the
report's table); `to_dict()` is the JSON `choose --json` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, ingest
from ..engine import readout
from ..errors import DataError, UsageError
from ..gcpause import frozen
from ..present import Presentable
from ..rules import REGISTRY, Rule, parse_rule
from . import summaries
from .choice import Choice, CurvePoint, choice_row, ci_from, interval, no_boot_note
from .choose_mass import OF, choose_mass
from .search import (
    REFINE_POINTS,
    Search,
    choice_jobs,
    find_job,
    first_replay,
    grid_between,
    one_pass,
    refine,
    tail_fraction,
)
from .tail_counts import TailCounts

BOOT_COLUMNS = 25  # grid points a replicate is read at (the interval's resolution)
# ... where the tail counts them: its range can be wide (a fraction flat far from the
# answer, as token-mis low's between 0.5 and 0.93), and a replicate's crossing, interpolated
# between two columns, moved by a spacing of 25 points over it (0.9386 for 0.9441 at the
# 2.5% end on the golden log); columns counted from the kept tokens cost little
BOOT_TAIL_COLUMNS = 256
BOOT_WIDEN = 2  # default grid points the bootstrap's range extends the bracket by, each side
BOOT_SIGMAS = 6.0  # with the tail: relative standard errors the columns span, each side
BOOT_MARGIN = 0.02  # ... plus this relative margin on the fraction
BOOT_SEARCH = 64  # points between an end of the columns and the answer it is pulled in on
CURVE_POINTS = 11  # the report's table: masked fraction at grid values around the choice


@dataclass
class ChooseResult(Sequence, Presentable):
    """The choices, in rule order (a sequence of `Choice`), and the target they aim at;
    `.table`: one row a choice; `print()`: one line a choice (analysis/summaries.py)."""

    target_fraction: float | None
    rows: list[Choice]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def __iter__(self) -> Iterator[Choice]:
        return iter(self.rows)

    def to_dict(self) -> dict:
        return {"target_fraction": self.target_fraction, "rows": [r.to_dict() for r in self.rows]}

    @property
    def table(self) -> pl.DataFrame:
        return summaries.choose_table(self)

    def summary_lines(self) -> list[str]:
        return summaries.choose_lines(self)


def _default_choice_rules(columns: Sequence[str]) -> list[Rule]:
    return [
        cls()
        for cls in REGISTRY.values()
        if all(c in columns for c in cls.needs) and cls.kind == "mask"
    ]


def _boot_grid(s: Search, c: tuple) -> np.ndarray:
    """The bootstrap columns of a search: BOOT_COLUMNS points over its coarse bracket
    widened by BOOT_WIDEN default grid points each side, and the coarse best value."""
    base = s.job.values
    a, b = c[3] if c[3] is not None else (c[0], c[0])
    ia = int(np.searchsorted(base, min(a, b)))
    ib = int(np.searchsorted(base, max(a, b)))
    lo, hi = base[max(ia - BOOT_WIDEN, 0)], base[min(ib + BOOT_WIDEN, base.size - 1)]
    return np.unique(np.r_[grid_between(lo, hi, BOOT_COLUMNS), c[0]])


@frozen()  # a whole job: the collector's passes skip what it found (gcpause.py)
def choose(
    sources: Sequence[str | Path],
    target_fraction: float | None = None,
    rules: Sequence[str | Rule] | None = None,
    bootstrap: int = 200,
    unit: str | None = None,
    seed: int = 0,
    tol: float = 0.01,
    max_passes: int = 8,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
    tally: engine.Tally | None = None,
    curve: bool = False,
    of: str = "tokens",
) -> ChooseResult:
    """For each rule (and each of its threshold parameters), the value whose masked fraction
    is closest to `target_fraction`, with a bootstrap interval. Without a target: the masked
    fraction at each given setting, with its interval. `precision="float32"`: the rules
    decide in the frameworks' float32 arithmetic (engine.replay).

    One read of the log, as a rule: the first grids, keeping the tail that settles the
    refinement and the bootstrap (or `tally`, a replay that already holds these jobs, e.g.
    the report's shared read: then none). Without a tail, two or more passes (the module
    docstring). `curve=True` adds to each choice its `curve`: the exact masked fraction at
    the default grid values around the chosen one (`_curve`, the report's table).
    `of="adv-mass"`: the target is a share of the advantage mass sum |A| the mask removes
    (masked_adv_mass_fraction), not of the tokens (choose_mass.py; plain replays, no tail).
    """
    plan = ingest.plan_sources(sources, options)
    if of not in OF:
        raise UsageError(f"--of {of}: use {' or '.join(OF)}.")
    if target_fraction is not None and not 0.0 < target_fraction < 1.0:
        raise UsageError(f"--target-fraction {target_fraction}: give a fraction in (0, 1).")
    if rules:
        chosen = [parse_rule(r) if isinstance(r, str) else r for r in rules]
    elif target_fraction is not None:
        chosen = _default_choice_rules(plan.columns)
    else:
        raise UsageError("give --target-fraction F, or --rule SPEC to get a setting's fraction.")
    precision = precision if precision is not None else engine.current_precision()
    if precision is not None:
        p = engine.check_precision(precision)
        chosen = [r.replace(precision=p) for r in chosen]
    unit = unit or ("sequence" if "sample_id" in plan.columns else "step")
    if unit not in ("sequence", "step"):
        raise UsageError(f"--bootstrap-unit {unit}: use 'sequence' or 'step'.")
    if bootstrap and unit == "sequence" and "sample_id" not in plan.columns:
        raise DataError(
            f"{plan.files[0]}: a bootstrap over sequences needs a sample_id column; "
            "use --bootstrap-unit step, or map one with --map sample_id=COLUMN."
        )
    if of == "adv-mass":
        if target_fraction is None:
            raise UsageError("--of adv-mass needs --target-fraction F (a share of sum |A|).")
        if not rules:  # m2po ranks whole steps: no |A| sums (choose_mass.py)
            chosen = [r for r in chosen if r.level != "step"]
        rows = choose_mass(
            plan, chosen, target_fraction, bootstrap, unit, seed, tol, max_passes, progress
        )
        return ChooseResult(target_fraction, rows)
    jobs = choice_jobs(chosen, target_fraction is not None)
    rows: list[Choice] = []
    if target_fraction is None:
        boot = (bootstrap, unit, seed) if bootstrap else None
        tally = engine.replay(plan, jobs=jobs, bootstrap=boot, progress=progress, final=True)
        for ji, job in enumerate(jobs):
            values, hits, tokens = readout.job_counts(tally, ji)
            frac = hits[0] / tokens
            lo, hi, note = _ci_fraction(tally, ji)
            rows.append(choice_row(job, values[0], frac, None, lo, hi, "ok", note, tokens, 1))
        return ChooseResult(None, rows)
    target = target_fraction
    # 1. the default grids, denser near the target (search.first_jobs), keeping the tail
    # that settles the token rules' refinement and bootstrap with no second pass
    if tally is None:
        tail = engine.Tail(
            tail_fraction(target),
            count_steps=unit == "step",
            extra=("step",) if unit == "step" else (),  # the bootstrap's units: no more
            count_q=False,
        )
        tally = first_replay(plan, jobs, target, tail, progress)
        index = list(range(len(jobs)))
    else:  # the caller's replay (its first jobs, or the default grids): find each job
        index = [find_job(tally.jobs, j) for j in jobs]
        missing = [j.label for j, i in zip(jobs, index, strict=True) if i is None]
        if missing:
            raise ValueError(f"choose(tally=...): the replay lacks the job(s) {missing}")
    searches = []
    for job, ji in zip(jobs, index, strict=True):
        values, hits, tokens = readout.job_counts(tally, ji)
        searches.append(Search(job, values.copy(), hits.copy(), tokens))
    coarse = [s.state(target, tol) for s in searches]
    tc = TailCounts.of(tally)
    if tc is not None and bootstrap and not tc.can_resample(unit):
        tc = None
    if tc is not None:
        rows = _with_tail(
            plan,
            searches,
            coarse,
            tc,
            target,
            tol,
            max_passes,
            bootstrap,
            unit,
            seed,
            tally,
            progress,
        )
        if curve:
            for row, s in zip(rows, searches, strict=True):
                row.curve = _curve(s, row.value)
        return ChooseResult(target, rows)
    # 2. one pass: refinement points in every open bracket, and the bootstrap columns
    fine_of = [i for i, c in enumerate(coarse) if c[2] == "refine"]
    fine = [
        engine.Job(s.job.rule, s.job.param, grid_between(*coarse[i][3], 2 * REFINE_POINTS))
        for i in fine_of
        for s in [searches[i]]
    ]
    inpass = [
        i
        for i, (s, c) in enumerate(zip(searches, coarse, strict=True))
        if bootstrap and s.job.rule.level != "step" and not c[2].startswith("out of range")
    ]
    bjobs = [
        engine.Job(s.job.rule, s.job.param, _boot_grid(s, coarse[i]))
        for i in inpass
        for s in [searches[i]]
    ]
    bp = None
    if fine or bjobs:
        bp = one_pass(plan, fine, bjobs, bootstrap, unit, seed, tally, progress)
        for i, job, hits in zip(fine_of, fine, bp.hits, strict=True):
            searches[i].add(job.values, hits)
        for s in searches:
            s.passes += bp.read
    # 3. what is still open (m2po; a bracket those points could not settle)
    refine(plan, searches, target, tol, max_passes - 2, tally, progress)
    boot = {}
    if bp is not None:
        boot = {i: (bjobs[k], bp.reps[k], bp.tokens[k]) for k, i in enumerate(inpass)}
    rows = _rows(searches, target, tol, bootstrap, boot)
    if curve:
        for row, s in zip(rows, searches, strict=True):
            row.curve = _curve(s, row.value)
    return ChooseResult(target, rows)


def _with_tail(
    plan, searches, coarse, tc, target, tol, max_passes, bootstrap, unit, seed, tally, progress
) -> list[Choice]:
    """Steps 2 and 3 where the first replay kept its tail: the refinement first (counted
    from the tail where it covers: no pass), then each answer's bootstrap on columns placed
    around it (`_boot_job`: the tail's replicates; a pass only for what it does not cover)."""
    tc.prepare([s.job for s in searches], (bootstrap, unit, seed))
    fine_of = [i for i, c in enumerate(coarse) if c[2] == "refine"]
    fine = [
        engine.Job(s.job.rule, s.job.param, grid_between(*coarse[i][3], 2 * REFINE_POINTS))
        for i in fine_of
        for s in [searches[i]]
    ]
    if fine:
        bp = one_pass(plan, fine, [], 0, None, 0, tally, progress)
        for i, job, hits in zip(fine_of, fine, bp.hits, strict=True):
            searches[i].add(job.values, hits)
        for s in searches:
            s.passes += bp.read
    refine(plan, searches, target, tol, max_passes - 2, tally, progress)
    states = [s.state(target, tol) for s in searches]
    todo = [
        i
        for i, (s, st) in enumerate(zip(searches, states, strict=True))
        if bootstrap and s.job.rule.level != "step" and not st[2].startswith("out of range")
    ]

    def columns(i: int):  # the bootstrap columns around answer i, counted where covered
        s = searches[i]
        bj = _boot_job(s, states[i][0], target, tc, unit) if s.job.rule.level == "token" else None
        if bj is not None and tc.covers(bj):
            return bj, tc.replicates(bj, bootstrap, unit, seed)
        return bj, None

    boot: dict[int, tuple] = {}
    pending: list[tuple[int, engine.Job]] = []
    for i, (bj, reps) in zip(todo, tc.map(columns, todo), strict=True):
        if reps is not None:
            boot[i] = (bj, *reps)
        else:
            s = searches[i]
            pending.append((i, bj or engine.Job(s.job.rule, s.job.param, _boot_grid(s, coarse[i]))))
    if pending:
        bp = one_pass(plan, [], [j for _, j in pending], bootstrap, unit, seed, tally, progress)
        for k, (i, bj) in enumerate(pending):
            boot[i] = (bj, bp.reps[k], bp.tokens[k])
        for s in searches:
            s.passes += bp.read
    return _rows(searches, target, tol, bootstrap, boot)


def _rows(searches, target, tol, bootstrap, boot: dict) -> list[Choice]:
    """Each search's Choice, its interval from `boot` (search index -> (bootstrap job,
    (B, K) replicate counts or None, (B,) replicate tokens))."""
    rows = []
    for i, s in enumerate(searches):
        best, frac, status, _ = s.state(target, tol)
        if status == "refine":
            status = f"not converged: not within {tol:.0%} after {s.passes} passes"
        status, _, note = status.partition(": ")
        lo = hi = None
        if bootstrap and status != "out of range":
            got = boot.get(i)
            if got is None or got[1] is None:
                boot_note = no_boot_note(s.job)
            else:
                lo, hi, boot_note = ci_from(got[0], got[1], got[2], target)
            note = "; ".join(x for x in (note, boot_note) if x)
        rows.append(choice_row(s.job, best, frac, target, lo, hi, status, note, s.tokens, s.passes))
    return rows


def _boot_job(s: Search, best: float, target: float, tc: TailCounts, unit: str):
    """The bootstrap columns around a token rule's answer: BOOT_COLUMNS points between the
    values where the masked fraction is target (1 + d) and target (1 - d), d = BOOT_SIGMAS
    relative standard errors of the fraction at the answer (the tail's `spread`) +
    BOOT_MARGIN, so that every replicate's crossing lies inside. Each end is the evaluated
    value past that fraction, then pulled in to the last of BOOT_SEARCH points between it
    and the answer still past it (counted from the tail: the range stays as narrow as the
    data allow, and inside what the tail covers). None where the tail cannot say (the
    answer's masked tokens not all kept)."""
    rule, param = s.job.rule, s.job.param
    one = engine.Job(rule, param, np.array([best]))
    if not tc.covers(one):
        return None
    se = tc.spread(one, unit)
    if se is None:
        return None
    d = min(0.9, BOOT_SIGMAS * se + BOOT_MARGIN)
    thr = np.array([rule.threshold(param, v) for v in s.values])
    order = np.argsort(thr, kind="stable")  # threshold ascending: fraction non-increasing
    vt, ft = s.values[order], s.hits[order] / s.tokens
    above = np.flatnonzero(ft >= target * (1 + d))
    below = np.flatnonzero(ft <= target * (1 - d))
    lo = _pull_in(s, tc, vt[above[-1]] if above.size else vt[0], best, target * (1 + d), True)
    hi = _pull_in(s, tc, vt[below[0]] if below.size else vt[-1], best, target * (1 - d), False)
    return engine.Job(rule, param, np.unique(np.r_[grid_between(lo, hi, BOOT_TAIL_COLUMNS), best]))


def _pull_in(s: Search, tc: TailCounts, end: float, best: float, f: float, loose: bool):
    """The value nearest the answer, of BOOT_SEARCH points from `end` to it, whose masked
    fraction is still past `f` (at least f on the loose side, at most f on the strict
    side), counted from the tail; `end` itself where none is."""
    job = engine.Job(s.job.rule, s.job.param, grid_between(end, best, BOOT_SEARCH))
    frac = tc.hits(job) / s.tokens  # a lower bound where the tail does not cover
    thr = job.thresholds
    ok = frac >= f if loose else frac <= f
    if not ok.any():
        return end
    pick = np.flatnonzero(ok)
    i = pick[np.argmax(thr[pick])] if loose else pick[np.argmin(thr[pick])]
    return float(job.values[i])


def _curve(s: Search, best: float, n: int = CURVE_POINTS) -> list[CurvePoint]:
    """Exact masked fractions around the chosen value, in masking order: the chosen value,
    the default grid's two values on each side, and between the chosen value and its two
    grid neighbours the evaluated (refinement) values nearest the quarter points, so that
    the table shows how the fraction moves near the choice even where the grid is coarse.
    At most `n` points."""
    rule, param = s.job.rule, s.job.param
    known = dict(zip(s.values.tolist(), s.hits.tolist(), strict=True))

    def t(v):
        return rule.threshold(param, v)

    grid = sorted((v for v in s.job.values.tolist() if v in known), key=t)
    tg = np.array([t(v) for v in grid])
    k = int(np.searchsorted(tg, t(best)))
    pick = {best, *grid[max(0, k - 2) : k + 2]}
    ev = np.array(sorted(known, key=t))
    te = np.array([t(v) for v in ev])
    for nb in (grid[k - 1] if k > 0 else None, grid[k] if k < len(grid) else None):
        if nb is None or nb == best:
            continue
        for w in (0.25, 0.5, 0.75):
            goal = t(best) + w * (t(nb) - t(best))
            pick.add(ev[int(np.argmin(np.abs(te - goal)))].item())
    pts = sorted(pick, key=t)
    c = pts.index(best)
    lo = max(0, min(c - n // 2, len(pts) - n))
    return [
        CurvePoint(float(v), int(known[v]), known[v] / s.tokens, bool(v == best))
        for v in pts[lo : lo + n]
    ]


def _ci_fraction(tally, ji, level: float = 0.95):
    """Interval of the masked fraction at a single setting (over replicates with tokens)."""
    res = readout.boot_counts(tally, ji)
    if res is None:
        return None, None, no_boot_note(tally.jobs[ji])
    counts, tokens = res
    ok = tokens > 0
    if ok.sum() < 2:
        return None, None, "too few units to resample"
    return (*interval((counts[ok] / tokens[ok, None])[:, 0], level), "")
