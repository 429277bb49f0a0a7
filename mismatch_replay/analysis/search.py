"""The threshold search that `choose` and `compare --budget` share, and its passes.

Design
------
A `Search` holds one job (a rule, one threshold parameter, a grid) and the exact masked
tokens at every value evaluated so far; `Search.state` reads it against a target fraction:
within `tol` ("ok"), out of the grid's range, a tie in the data (the fraction jumps at one
value), or a bracket still to refine. Values are ordered by the rule's threshold, so the
masked fraction never increases along them.

`one_pass` is one streaming pass over the log, on the fused path, for two sets of jobs:
refinement grids (exact counts, an ungrouped Tally) and bootstrap columns (a Tally grouped
by unit, fed sub-batches of SUB_BATCH = 2^18 tokens, ~512 units, so that its accumulators
stay small; each sub-batch's per-unit counts are multiplied by the units' Poisson weights,
the weights `engine.replay(bootstrap=)` draws, and added). Sequence rules of either set
are scored from the first replay's per-sequence statistics, with no pass (`seq_hits`);
m2po (it ranks whole steps) is refined, never resampled. `refine` runs such passes, with
REFINE_POINTS = 64 new points per open bracket, until none is open. Where the first
replay kept its tail (engine.Tail), the token jobs it covers are counted from the kept
tokens instead (tail_counts.py: the same counts and replicates), and a pass is made only
for what is left, often nothing; `tail_fraction` sizes that tail for a target.

A search's first replay runs `first_jobs`: the default grids, with FIRST_DENSE points
between two values only in the intervals where a sample of the log's first batch masks
within a factor NEAR of the target, placed when the replay's first batch comes
(`engine.replay(shape=)`: choose, compare and the report's shared read; no read ahead).
There the bracket's ends and the bootstrap's columns will lie, and the tail's coverage is
checked at those values; elsewhere the default grid is enough, so the replay costs what the
default grids cost. The sample only places points: a log whose later batches mask elsewhere
costs a pass, not a wrong answer.

`_Units` numbers bootstrap units as the engine does (sequences by first appearance of
their (step, sample_id), or steps), so the replicates equal the engine's.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl

from .. import engine, ingest
from ..engine import readout
from ..fast import bin_scores
from ..rules import Rule, TokenBatch, parse_grid
from .tail_counts import TailCounts, replicate_tokens, suffix_values

REFINE_POINTS = 64
FIRST_DENSE = {"token": 3, "step": 64}  # ... in a search's first replay (`first_jobs`)
NEAR = 4.0  # first_jobs: grid intervals within this factor of the target get FIRST_DENSE


def tail_fraction(target: float) -> float:
    """The share of tokens per side of each coordinate a search's first replay keeps
    (engine.Tail) for a target fraction: room for the bootstrap's widened range above the
    target, at most 0.25."""
    return min(0.25, 3.0 * target + 0.001)


def dense(values: np.ndarray, m: int) -> np.ndarray:
    """`values` with m points between each two (geometric on a positive range): a search's
    first grid (`first_job`)."""
    pieces = [values] + [grid_between(a, b, m + 2)[1:-1] for a, b in itertools.pairwise(values)]
    return np.unique(np.concatenate(pieces))


def grid_between(a: float, b: float, n: int) -> np.ndarray:
    """n points from a to b: geometric on a positive range, else linear."""
    lo, hi = min(a, b), max(a, b)
    if lo > 0 and hi / lo > 1.0 + 1e-9:
        return np.geomspace(lo, hi, n)
    return np.linspace(lo, hi, n)


def first_job(job: engine.Job) -> engine.Job:
    """A search's first-replay job without a sample to shape it: the default grid with
    FIRST_DENSE points between each two values (token rules: so that a bracket's ends sit
    close to the target and the replay's tail covers them, tail_counts.py; m2po: it
    refines in passes of its own); sequence rules refine from the sequence sums for free
    and keep their grid."""
    m = FIRST_DENSE.get(job.rule.level)
    return job if m is None else engine.Job(job.rule, job.param, dense(job.values, m))


def first_jobs(
    jobs: Sequence[engine.Job], target: float, sample: TokenBatch | None
) -> list[engine.Job]:
    """The first-replay jobs of searches for `target`, shaped on `sample` (the tokens the
    replay's tail sets its cutoffs on, engine.sample_of its first batch): a token or step
    rule's default
    grid gets FIRST_DENSE points only between the two values of each grid interval where
    the sample's masked fraction meets [target / NEAR, target x NEAR] (and the interval on
    each side), where the bracket and the bootstrap's columns will lie: the replay costs
    about what the default grid costs. The sample only places points; whether the tail
    covers them is checked on the replay's exact counts, and a search whose bracket lies
    elsewhere costs a pass (m2po: its refinement passes), with an answer as exact. No
    sample: `first_job`'s grid."""
    out = []
    for job in jobs:
        m = FIRST_DENSE.get(job.rule.level)
        if m is None or sample is None or not len(sample) or len(job.values) < 2:
            out.append(first_job(job))
            continue
        f = _sample_fractions(job, sample)
        lo, hi = np.minimum(f[:-1], f[1:]), np.maximum(f[:-1], f[1:])  # per interval
        meet = (hi >= target / NEAR) & (lo <= target * NEAR)
        near = meet.copy()
        meet[1:] |= near[:-1]
        meet[:-1] |= near[1:]
        pieces = [job.values]
        for i in np.flatnonzero(meet):
            pieces.append(grid_between(job.values[i], job.values[i + 1], m + 2)[1:-1])
        out.append(engine.Job(job.rule, job.param, np.unique(np.concatenate(pieces))))
    return out


def _sample_fractions(job: engine.Job, sample: TokenBatch) -> np.ndarray:
    """The masked fraction of `sample` at each of a token or step rule's values (value
    order). A step rule (m2po) ranks the sample as one step: the token of rank m is masked
    when the mean of its score and every lower one reaches the threshold."""
    with np.errstate(over="ignore", invalid="ignore"):  # absurd logs: inf, as the engine's
        score = np.asarray(job.rule.score(sample, job.param), dtype=np.float64)
    if job.rule.level == "step":
        xs = np.sort(score)[::-1]
        means = np.cumsum(xs[::-1])[::-1] / np.arange(xs.shape[0], 0, -1)  # non-increasing
        thr = job.thresholds
        masked = np.array([np.count_nonzero(means >= t) for t in thr], dtype=np.float64)
        return masked / len(sample)
    b = bin_scores(score, job.sorted_thresholds, job.rule.inclusive)
    return suffix_values(job, np.bincount(b, minlength=len(job.values) + 2)) / len(sample)


def choice_jobs(rules: Sequence[Rule], target: bool) -> list[engine.Job]:
    """choose's jobs: with a target, one per threshold parameter on its default grid (the
    other thresholds at their values); without, each rule at its one setting."""
    jobs = []
    for rule in rules:
        if target:
            for p in rule.params:
                if p.threshold:
                    others = [q.name for q in rule.params if q.threshold and q.name != p.name]
                    rule.require(*others)
                    jobs.append(engine.Job(rule, p.name, parse_grid(p.grid)))
        else:
            jobs.append(engine.single_job(rule))
    return jobs


@dataclass
class Search:
    """One threshold search: a job on a grid and the exact masked tokens at every value
    evaluated so far (the default grid's, then each refinement's)."""

    job: engine.Job
    values: np.ndarray  # every value evaluated so far, ascending
    hits: np.ndarray  # masked tokens at each
    tokens: int
    passes: int = 1

    def add(self, values, hits) -> None:
        v = np.concatenate([self.values, values])
        h = np.concatenate([self.hits, hits])
        order = np.argsort(v, kind="stable")
        v, h = v[order], h[order]
        keep = np.r_[True, v[1:] != v[:-1]]
        self.values, self.hits = v[keep], h[keep]

    def _adjacent32(self, a: float, b: float) -> bool:
        """A float32 replay compares float32 thresholds (engine.Job.thresholds), some made
        from the value rounded to float32 first (a log of a float32 bound): a bracket whose
        ends, or their thresholds, round to the same or to adjacent float32 values cannot
        be split."""
        if self.job.rule.precision != "float32":
            return False

        def adjacent(x, y) -> bool:
            lo, hi = min(x, y), max(x, y)
            return bool(lo == hi or np.nextafter(lo, np.float32(np.inf)) == hi)

        with np.errstate(over="ignore"):
            ta, tb = (np.float32(self.job.rule.threshold(self.job.param, v)) for v in (a, b))
            return adjacent(np.float32(a), np.float32(b)) or adjacent(ta, tb)

    def state(self, target: float, tol: float):
        """(best value, its fraction, status, bracket or None)."""
        f = self.hits / self.tokens
        thr = np.array([self.job.rule.threshold(self.job.param, v) for v in self.values])
        order = np.argsort(thr, kind="stable")  # threshold ascending: f non-increasing
        ft, vt = f[order], self.values[order]
        best = int(np.argmin(np.abs(ft - target)))
        if abs(ft[best] - target) <= tol * target:
            return vt[best], ft[best], "ok", None
        above = np.flatnonzero(ft >= target)
        if above.size == 0:
            msg = f"out of range: at most {ft.max():.3g} masked on the default grid"
            return vt[best], ft[best], msg, None
        if above[-1] == ft.size - 1:
            msg = (
                f"out of range: at least {ft.min():.3g} masked on the default grid (the "
                "fixed parameters alone may mask more)"
            )
            return vt[best], ft[best], msg, None
        k = int(above[-1])
        a, b = vt[k], vt[k + 1]
        if abs(b - a) <= 1e-12 * max(abs(a), abs(b), 1e-300) or self._adjacent32(a, b):
            msg = f"ties: the fraction jumps from {ft[k]:.3g} to {ft[k + 1]:.3g} at one value"
            return vt[best], ft[best], msg, None
        return vt[best], ft[best], "refine", (a, b)


# The grouped pass's cost is units x (its jobs' grid points): fast.Program.expand turns
# each sub-batch's per-interval sums into per-job bins in time ~ units x slots x intervals of
# a coordinate, 6 s on 20M tokens at 49 columns for choose's 19 token jobs (2.5 s at 25).
SUB_BATCH = 1 << 18  # tokens a grouped sub-batch holds: ~512 units of 512 tokens


def seq_hits(st, job: engine.Job, weights: np.ndarray | None = None) -> np.ndarray:
    """A sequence rule's masked tokens at each value of `job`, from per-sequence statistics
    (the same bins as the engine's); `weights` (B, sequences): per replicate, (B, K)."""
    from ..fast import bin_scores, replicate_bins

    b = bin_scores(
        np.asarray(job.rule.score(st, job.param), float),
        job.thresholds[job.order],
        job.rule.inclusive,
    )
    width = len(job.values) + 2
    if weights is None:
        return suffix_values(job, np.bincount(b, weights=st.n, minlength=width))
    # weights and token counts are integers: the sums are exact in any order
    seqs = np.arange(b.shape[0])
    return suffix_values(job, replicate_bins(seqs, b, st.n, weights.T, width))


class _Units:
    """Bootstrap units of a stream: per batch, the distinct unit ids and each token's index
    into them. Sequences are numbered by first appearance of their (step, sample_id), as
    the engine numbers them, so the Poisson weights (engine.poisson_weights, a function of
    the id) are the ones a bootstrap replay would draw."""

    def __init__(self, unit: str):
        self.unit = unit
        self.keys: dict = {}

    def codes(self, df: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        if self.unit == "step":
            uniq, local = np.unique(df["step"].to_numpy(), return_inverse=True)
            return uniq.astype(np.int64), local.reshape(-1)
        new = (
            (pl.col("step") != pl.col("step").shift(1))
            | (pl.col("sample_id") != pl.col("sample_id").shift(1))
        ).fill_null(True)
        flags = df.select(new.alias("r"))["r"].to_numpy()
        starts = np.flatnonzero(flags)
        keys = zip(
            df["step"].gather(starts).to_list(),
            df["sample_id"].gather(starts).to_list(),
            strict=True,
        )
        gid = np.empty(starts.shape[0], dtype=np.int64)
        for i, key in enumerate(keys):
            g = self.keys.get(key)
            if g is None:
                g = self.keys[key] = len(self.keys)
            gid[i] = g
        run = np.cumsum(flags) - 1
        uniq, inv = np.unique(gid, return_inverse=True)
        return uniq, inv.reshape(-1)[run]


@dataclass
class Pass:
    """One pass's results: exact masked tokens at every value of the refinement jobs, and
    per replicate the masked tokens at every value of the bootstrap jobs."""

    hits: list[np.ndarray | None]  # per refinement job, at each of its values
    reps: list[np.ndarray | None]  # per bootstrap job, (B, K)
    tokens: list[np.ndarray | None]  # per bootstrap job, (B,) replicate tokens
    read: bool = False  # did it read the log (else main's tail and sequences settled all)


def _zero_bins(bins) -> None:
    for name in ("count", "mass", "wsum", "wsq", "seqfrac"):
        a = getattr(bins, name)
        if a is not None:
            a[:] = 0
    if bins.wmax is not None:
        bins.wmax[:] = -math.inf


def one_pass(plan, fine, boot, bootstrap, unit, seed, main, progress) -> Pass:
    """One pass over the log, on the fused path, for two sets of jobs: `fine` (refinement
    grids; exact counts, an ungrouped Tally) and `boot` (the bootstrap columns; a Tally
    grouped by unit, in sub-batches of ~SUB_BATCH tokens so that the groups stay few: each
    sub-batch's per-unit counts are multiplied by the units' Poisson weights and added).
    Sequence rules of either set are scored from `main`'s sequence statistics, with no
    pass; m2po (step) is refined, never resampled. Token jobs that `main`'s tail covers
    (tail_counts.py) are counted from it, with no pass: the same counts and replicates."""
    B = bootstrap
    out = Pass([None] * len(fine), [None] * len(boot), [None] * len(boot))
    tc = TailCounts.of(main)
    if tc is not None:  # what main's tail settles needs no pass (tail_counts.py)
        tc.prepare([*fine, *boot], (B, unit, seed) if B else None)
        cov = [i for i, j in enumerate(fine) if tc.covers(j)]
        for i, hits in zip(cov, tc.map(tc.hits, [fine[i] for i in cov]), strict=True):
            out.hits[i] = hits
        cov = [i for i, j in enumerate(boot if B and tc.can_resample(unit) else []) if tc.covers(j)]
        reps = tc.map(lambda j: tc.replicates(j, B, unit, seed), [boot[i] for i in cov])
        for i, (r, tokens) in zip(cov, reps, strict=True):
            out.reps[i], out.tokens[i] = r, tokens
    tf = [i for i, j in enumerate(fine) if j.rule.level != "sequence" and out.hits[i] is None]
    tb = (
        [i for i, j in enumerate(boot) if j.rule.level == "token" and out.reps[i] is None]
        if B
        else []
    )
    if tf or tb:
        out.read = True
        need = {"trainer_logprob", "inference_logprob", "step"}
        if tb and unit == "sequence":
            need.add("sample_id")
        for j in [*fine, *boot]:
            need |= set(j.rule.needs)
        adv = "advantage" in need
        ftally = engine.Tally([fine[i] for i in tf], None, has_adv=adv) if tf else None
        btally = engine.Tally([boot[i] for i in tb], "step", has_adv=adv) if tb else None
        bjobs = [boot[i] for i in tb]
        edges = np.cumsum([0] + [len(j.values) for j in bjobs])
        rep = np.zeros((B, int(edges[-1])))
        rtok = np.zeros(B)
        units = _Units(unit)
        m2po = ftally is not None and any(fine[i].rule.level == "step" for i in tf)
        bounds = ingest.step_bounds(plan) if m2po else None
        total = sum(plan.rows)
        report = ingest.ReadReport()
        keep = ["trainer_logprob", "inference_logprob"] + (["advantage"] if adv else [])
        for _, df in ingest.iter_batches(plan, sorted(need), report):
            if not df.height:
                continue
            if ftally is not None:
                ftally.add_batch(df)
                if bounds is not None:
                    done = bisect.bisect_right(bounds[0], report.rows)
                    if done:
                        ftally.seal_m2po(bounds[1][done - 1], background=True)
            for s in range(0, df.height if btally is not None else 0, SUB_BATCH):
                sub = df.slice(s, SUB_BATCH)
                uniq, local = units.codes(sub)
                btally.add_batch(sub.select(keep).with_columns(step=pl.Series(local)))
                btally.flush()
                order = np.asarray(btally.groups, dtype=np.int64)
                here = order < uniq.shape[0]
                parts = []
                for k, job in enumerate(bjobs):
                    bins = btally.bins[k]
                    c = np.zeros((uniq.shape[0], bins.count.shape[1]))
                    c[order[here]] = bins.count[: order.shape[0]][here]
                    _zero_bins(bins)
                    parts.append(suffix_values(job, c))
                w = engine.poisson_weights(uniq, B, seed)
                rtok += w @ np.bincount(local, minlength=uniq.shape[0]).astype(float)
                rep += w @ np.hstack(parts)
            if progress is not None:
                progress(report.rows, total)
        if ftally is not None:
            ftally.wait_m2po()
            for k, i in enumerate(tf):
                out.hits[i] = readout.job_counts(ftally, k)[1]
        for k, i in enumerate(tb):
            out.reps[i] = rep[:, edges[k] : edges[k + 1]]
            out.tokens[i] = rtok
    sf = [i for i, j in enumerate(fine) if j.rule.level == "sequence"]
    sb = [i for i, j in enumerate(boot) if j.rule.level == "sequence"] if B else []
    if sf or sb:
        st = main.seq_stats()
        for i in sf:
            out.hits[i] = seq_hits(st, fine[i])
        if sb and tc is not None and unit == "sequence" and tc.can_resample(unit):
            w = tc.sequence_weights(B, seed)  # the same draws, made once
        elif sb:
            main.boot_replicates, main.boot_unit, main.boot_seed = B, unit, seed
            try:
                w = main.seq_unit_weights()
            finally:
                main.boot_replicates = 0
        tokens = replicate_tokens(st.n, w.T) if sb else None  # the same for every job
        for i in sb:
            out.reps[i] = seq_hits(st, boot[i], w)
            out.tokens[i] = tokens
    return out


def refine(plan, searches, target: float, tol: float, rounds: int, main, progress) -> None:
    """Refine every open bracket with REFINE_POINTS new grid points, all searches in one
    pass per round (`one_pass`; sequence rules from `main`'s sequence statistics, with no
    pass), until none is open or `rounds` rounds are spent."""
    for _ in range(rounds):
        todo = [s for s in searches if s.state(target, tol)[2] == "refine"]
        if not todo:
            return
        fine = [
            engine.Job(
                s.job.rule, s.job.param, grid_between(*s.state(target, tol)[3], REFINE_POINTS)
            )
            for s in todo
        ]
        res = one_pass(plan, fine, [], 0, None, 0, main, progress)
        for s, job, hits in zip(todo, fine, res.hits, strict=True):
            s.add(job.values, hits)
            s.passes += res.read and job.rule.level != "sequence"


def find_job(jobs: Sequence[engine.Job], job: engine.Job) -> int | None:
    """The index in `jobs` of the one that counts `job`'s rule and parameter on a grid
    holding every value of job's (of several, the one with the most values: a search's
    first job), or None."""
    key, want = job_key(job)[:-1], set(job.values.tolist())
    best = None
    for i, j in enumerate(jobs):
        same = job_key(j)[:-1] == key and want <= set(j.values.tolist())
        if same and (best is None or len(j.values) > len(jobs[best].values)):
            best = i
    return best


def first_replay(plan, jobs: Sequence[engine.Job], target: float, tail, progress) -> engine.Tally:
    """A search's first replay: `jobs` on their `first_jobs` grids, placed on the first
    batch as it comes (engine.replay(shape=)), keeping `tail`; no scatter."""
    return engine.replay(
        plan,
        jobs=jobs,
        progress=progress,
        final=True,
        tail=tail,
        scatter=False,
        shape=lambda sample: first_jobs(jobs, target, sample),
    )


def job_key(j: engine.Job) -> tuple:
    """Jobs that count the same tokens the same way have the same key (a preset's name
    aside: its arithmetic and every parameter are in it)."""
    r = j.rule
    return (r.name, r.arith, r.precision, r.setting(j.param), j.param, tuple(j.values.tolist()))
