"""Questions over Tallies: which eps (`choose`), which rule (`compare`), did it drift (`drift`),
and the data behind the figures.

Design
------
Functions here take sources, run the engine (each call is one or a few streaming passes) and
return plain records and tables; they never draw and never print.

* `choose` finds, per rule, the threshold whose masked fraction is closest to a target in
  two passes, as a rule: the default grids bracket the answer (or a replay that holds them
  already: the report's full sweep), then ONE pass both refines every bracket with 128 new
  grid points and accumulates a streaming Poisson bootstrap over sequences (or steps) on
  25 points spanning the bracket, widened (`_one_pass`). The bootstrap runs on the fused
  path: a Tally grouped by unit, fed sub-batches of 2^18 tokens (~512 units, so its
  accumulators stay small), each sub-batch's per-unit counts multiplied by the units'
  Poisson weights (the same weights, so the same replicates, as `engine.replay(bootstrap=)`
  on the simple path, ~30x slower: 9.5 s against 0.8 s for the sweep on 2M tokens).
  A bracket those points leave open gets further passes until the fraction is within `tol`
  (relative) of the target or the bracket shrinks to a tie in the data: the answers are
  exact on a grid refined until within 1%. Sequence rules refine from the sequence sums
  with no pass; m2po (it ranks whole steps) refines in passes of its own, unresampled.
  The interval says how much the answer would move on another log of the same run.
* `compare` puts two rules side by side on the same tokens: the 2 x 2 table of masked by
  both / only A / only B / neither, with counts, mean probabilities and |dp| mass, where
  (inference-probability buckets) they disagree, and the most disputed tokens; `budget` first
  sets both rules to mask the same fraction (iso-budget comparison: both searched in one pass
  on their default grids made 16x finer, rarely a second).
* `drift` tracks per-step mismatch with statistics a handful of extreme tokens cannot move
  (median and 1%-trimmed mean of k3), flags sustained departures from an early-step baseline
  as drift, reports lone outlier steps as spikes with the tokens that caused them, and says
  whether each rule's masked fraction followed the mismatch or stayed flat.

The figure data needs three views of a log: every rule swept over its grid (with the scatter
histograms), the chosen settings per step, and the chosen settings per inference-probability
bucket.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from . import engine, io, tables
from .errors import DataError, UsageError
from .rules import REGISTRY, Rule, TokenBatch, parse_grid, parse_rule

# The settings drawn by default: the two IPO defaults, the two IcePop bands, KPop, DPPO-TV.
DEFAULT_SETTINGS = (
    "ipo@prime-rl",
    "ipo@prime-rl-legacy",
    "icepop@prime-rl",
    "icepop@verl",
    "kpop@prime-rl",
    "dppo-tv@prime-rl",
)


@dataclass
class FigureData:
    """Everything the figures draw, computed from a log (no raw tokens kept)."""

    hist_lin: np.ndarray  # (200, 200) token counts, [q bin, p bin], probability axes
    hist_log: np.ndarray  # (200, 200) token counts, [log10 q bin, log10 p bin]
    edges_lin: np.ndarray  # (201,) probability bin edges
    edges_log10: np.ndarray  # (201,) log10-probability bin edges
    sweep: pl.DataFrame  # every supported rule over its default grid (ungrouped)
    settings: list[Rule]  # the chosen settings (IPO eps, IcePop band, ...)
    steps: pl.DataFrame  # the chosen settings' sweep table by step
    step_metrics: pl.DataFrame  # mismatch metrics by step
    buckets: pl.DataFrame  # the chosen settings' sweep table by q_bucket
    metrics: dict  # overall mismatch metrics
    tokens: int
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_settings(columns: Sequence[str]) -> list[Rule]:
    """DEFAULT_SETTINGS minus the rules the log cannot support."""
    rules = [parse_rule(s) for s in DEFAULT_SETTINGS]
    return [r for r in rules if all(c in columns for c in r.needs)]


def figure_data(
    sources: Sequence[str | Path],
    settings: Sequence[str | Rule] | None = None,
    sweeps: dict[str, str] | None = None,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
) -> FigureData:
    """Three passes over the log: full sweep + scatter, settings by step, settings by bucket.
    `precision="float32"`: every rule decision in the frameworks' float32 arithmetic
    (engine.replay; the full sweep then runs on the simple path)."""
    plan = io.plan_sources(sources, options)
    chosen = (
        [parse_rule(s) if isinstance(s, str) else s for s in settings]
        if settings
        else default_settings(plan.columns)
    )
    with engine.use_precision(precision):
        full = engine.replay(plan, rules=None, sweeps=sweeps, progress=progress, final=True)
        res = full.result()
        by_step = engine.replay(plan, rules=chosen, by="step", progress=progress, final=True)
        by_bucket = engine.replay(plan, rules=chosen, by="q_bucket", progress=progress, final=True)
    return FigureData(
        hist_lin=full.hist_lin,
        hist_log=full.hist_log,
        edges_lin=engine.scatter_edges(log=False),
        edges_log10=engine.scatter_edges(log=True),
        sweep=res.table,
        settings=chosen,
        steps=by_step.result().table,
        step_metrics=by_step.metrics.table("step", by_step.groups),
        buckets=by_bucket.result().table,
        metrics=res.metrics.to_dicts()[0],
        tokens=full.report.loss_rows,
        sources=[str(p) for p in plan.files],
        notes=list(full.notes),
    )


# ----------------------------------------------------------------------------- choose

REFINE_POINTS = 64


def _grid_between(a: float, b: float, n: int) -> np.ndarray:
    lo, hi = min(a, b), max(a, b)
    if lo > 0 and hi / lo > 1.0 + 1e-9:
        return np.geomspace(lo, hi, n)
    return np.linspace(lo, hi, n)


def _choice_jobs(rules: Sequence[Rule], target: bool) -> list[engine.Job]:
    jobs = []
    for rule in rules:
        if target:
            for p in rule.params:
                if p.threshold:
                    others = [q.name for q in rule.params if q.threshold and q.name != p.name]
                    rule.require(*others)
                    jobs.append(engine.Job(rule, p.name, parse_grid(p.grid)))
        else:
            jobs.append(engine._single(rule))
    return jobs


def _default_choice_rules(columns: Sequence[str]) -> list[Rule]:
    return [
        cls()
        for cls in REGISTRY.values()
        if all(c in columns for c in cls.needs) and cls.kind == "mask"
    ]


@dataclass
class _Search:
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
        if abs(b - a) <= 1e-12 * max(abs(a), abs(b), 1e-300):
            msg = f"ties: the fraction jumps from {ft[k]:.3g} to {ft[k + 1]:.3g} at one value"
            return vt[best], ft[best], msg, None
        return vt[best], ft[best], "refine", (a, b)


BOOT_COLUMNS = 25  # grid points a replicate is read at (the interval's resolution)
BOOT_WIDEN = 2  # default grid points the bootstrap's range extends the bracket by, each side
# The grouped pass's cost is units x (its jobs' grid points): kernels.Program.expand turns
# each sub-batch's per-interval sums into per-job bins in time ~ units x slots x intervals of
# a coordinate, 6 s on 20M tokens at 49 columns for choose's 19 token jobs (2.5 s at 25).
SUB_BATCH = 1 << 18  # tokens a grouped sub-batch holds: ~512 units of 512 tokens


def _suffix_values(job: engine.Job, a: np.ndarray) -> np.ndarray:
    """Per-bin counts (..., K + 2) in threshold order -> masked at each value (..., K), values
    ascending (bin j holds the tokens that pass exactly j thresholds)."""
    rev = np.cumsum(a[..., ::-1], axis=-1)[..., ::-1]
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    return rev[..., inv + 1]


def _seq_hits(st, job: engine.Job, weights: np.ndarray | None = None) -> np.ndarray:
    """A sequence rule's masked tokens at each value of `job`, from per-sequence statistics
    (the same bins as the engine's); `weights` (B, sequences): per replicate, (B, K)."""
    from .kernels import bin_scores

    b = bin_scores(
        np.asarray(job.rule.score(st, job.param), float),
        job.thresholds[job.order],
        job.rule.inclusive,
    )
    width = len(job.values) + 2
    if weights is None:
        return _suffix_values(job, np.bincount(b, weights=st.n, minlength=width))
    w = weights * st.n[None, :]
    return _suffix_values(job, np.stack([np.bincount(b, weights=wb, minlength=width) for wb in w]))


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
class _Pass:
    """One pass's results: exact masked tokens at every value of the refinement jobs, and
    per replicate the masked tokens at every value of the bootstrap jobs."""

    hits: list[np.ndarray | None]  # per refinement job, at each of its values
    reps: list[np.ndarray | None]  # per bootstrap job, (B, K)
    tokens: list[np.ndarray | None]  # per bootstrap job, (B,) replicate tokens


def _zero_bins(bins) -> None:
    for name in ("count", "mass", "wsum", "wsq", "seqfrac"):
        a = getattr(bins, name)
        if a is not None:
            a[:] = 0
    if bins.wmax is not None:
        bins.wmax[:] = -math.inf


def _one_pass(plan, fine, boot, bootstrap, unit, seed, main, progress) -> _Pass:
    """One pass over the log, on the fused path, for two sets of jobs: `fine` (refinement
    grids; exact counts, an ungrouped Tally) and `boot` (the bootstrap columns; a Tally
    grouped by unit, in sub-batches of ~SUB_BATCH tokens so that the groups stay few: each
    sub-batch's per-unit counts are multiplied by the units' Poisson weights and added).
    Sequence rules of either set are scored from `main`'s sequence statistics, with no
    pass; m2po (step) is refined, never resampled."""
    B = bootstrap
    out = _Pass([None] * len(fine), [None] * len(boot), [None] * len(boot))
    tf = [i for i, j in enumerate(fine) if j.rule.level != "sequence"]
    tb = [i for i, j in enumerate(boot) if j.rule.level == "token"] if B else []
    if tf or tb:
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
        bounds = io.step_bounds(plan) if m2po else None
        total = sum(plan.rows)
        report = io.ReadReport()
        keep = ["trainer_logprob", "inference_logprob"] + (["advantage"] if adv else [])
        for _, df in io.iter_batches(plan, sorted(need), report):
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
                    parts.append(_suffix_values(job, c))
                w = engine.poisson_weights(uniq, B, seed)
                rtok += w @ np.bincount(local, minlength=uniq.shape[0]).astype(float)
                rep += w @ np.hstack(parts)
            if progress is not None:
                progress(report.rows, total)
        if ftally is not None:
            ftally.wait_m2po()
            for k, i in enumerate(tf):
                out.hits[i] = tables.job_counts(ftally, k)[1]
        for k, i in enumerate(tb):
            out.reps[i] = rep[:, edges[k] : edges[k + 1]]
            out.tokens[i] = rtok
    sf = [i for i, j in enumerate(fine) if j.rule.level == "sequence"]
    sb = [i for i, j in enumerate(boot) if j.rule.level == "sequence"] if B else []
    if sf or sb:
        st = main.seq_stats()
        for i in sf:
            out.hits[i] = _seq_hits(st, fine[i])
        if sb:
            main.boot_replicates, main.boot_unit, main.boot_seed = B, unit, seed
            try:
                w = main.seq_unit_weights()
            finally:
                main.boot_replicates = 0
            for i in sb:
                out.reps[i] = _seq_hits(st, boot[i], w)
                out.tokens[i] = (w * st.n[None, :]).sum(axis=1)
    return out


def _refine(plan, searches, target: float, tol: float, rounds: int, main, progress) -> None:
    """Refine every open bracket with REFINE_POINTS new grid points, all searches in one
    pass per round (`_one_pass`; sequence rules from `main`'s sequence statistics, with no
    pass), until none is open or `rounds` rounds are spent."""
    for _ in range(rounds):
        todo = [s for s in searches if s.state(target, tol)[2] == "refine"]
        if not todo:
            return
        fine = [
            engine.Job(
                s.job.rule, s.job.param, _grid_between(*s.state(target, tol)[3], REFINE_POINTS)
            )
            for s in todo
        ]
        res = _one_pass(plan, fine, [], 0, None, 0, main, progress)
        for s, job, hits in zip(todo, fine, res.hits, strict=True):
            s.add(job.values, hits)
            s.passes += job.rule.level != "sequence"


def _boot_grid(s: _Search, c: tuple) -> np.ndarray:
    """The bootstrap columns of a search: BOOT_COLUMNS points over its coarse bracket
    widened by BOOT_WIDEN default grid points each side, and the coarse best value."""
    base = s.job.values
    a, b = c[3] if c[3] is not None else (c[0], c[0])
    ia = int(np.searchsorted(base, min(a, b)))
    ib = int(np.searchsorted(base, max(a, b)))
    lo, hi = base[max(ia - BOOT_WIDEN, 0)], base[min(ib + BOOT_WIDEN, base.size - 1)]
    return np.unique(np.r_[_grid_between(lo, hi, BOOT_COLUMNS), c[0]])


def choose(
    sources: Sequence[str | Path],
    target_fraction: float | None = None,
    rules: Sequence[str | Rule] | None = None,
    bootstrap: int = 200,
    unit: str | None = None,
    seed: int = 0,
    tol: float = 0.01,
    max_passes: int = 8,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
    tally: engine.Tally | None = None,
    curve: bool = False,
) -> list[dict]:
    """For each rule (and each of its threshold parameters), the value whose masked fraction
    is closest to `target_fraction`, with a bootstrap interval. Without a target: the masked
    fraction at each given setting, with its interval. `precision="float32"`: the rules
    decide in the frameworks' float32 arithmetic (engine.replay).

    Two passes in all, as a rule: the default grids (or `tally`, a replay that already holds
    these rules' default-grid jobs, e.g. the report's full sweep: then one pass), then one
    pass that both refines every bracket with REFINE_POINTS points and accumulates the
    bootstrap (`_boot_pass`). A bracket those points cannot settle within `tol` gets further
    refinement passes (m2po always does: its steps are ranked whole). `curve=True` adds
    to each row `curve`: the exact masked fraction at the default grid values around the
    chosen one (`_curve`, the report's table).
    """
    plan = io.plan_sources(sources, options)
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
    jobs = _choice_jobs(chosen, target_fraction is not None)
    rows: list[dict] = []
    if target_fraction is None:
        boot = (bootstrap, unit, seed) if bootstrap else None
        tally = engine.replay(plan, jobs=jobs, bootstrap=boot, progress=progress, final=True)
        for ji, job in enumerate(jobs):
            values, hits, tokens = tables.job_counts(tally, ji)
            frac = hits[0] / tokens
            lo, hi, note = _ci_fraction(tally, ji)
            rows.append(_choice_row(job, values[0], frac, None, lo, hi, "ok", note, tokens, 1))
        return rows
    target = target_fraction
    # 1. the default grids
    if tally is None:
        tally = engine.replay(plan, jobs=jobs, progress=progress, final=True)
        index = list(range(len(jobs)))
    else:  # the caller's replay: find each job in it
        keys = {_job_key(j): i for i, j in enumerate(tally.jobs)}
        missing = [j.label for j in jobs if _job_key(j) not in keys]
        if missing:
            raise ValueError(f"choose(tally=...): the replay lacks the job(s) {missing}")
        index = [keys[_job_key(j)] for j in jobs]
    searches = []
    for job, ji in zip(jobs, index, strict=True):
        values, hits, tokens = tables.job_counts(tally, ji)
        searches.append(_Search(job, values.copy(), hits.copy(), tokens))
    coarse = [s.state(target, tol) for s in searches]
    # 2. one pass: refinement points in every open bracket, and the bootstrap columns
    fine_of = [i for i, c in enumerate(coarse) if c[2] == "refine"]
    fine = [
        engine.Job(s.job.rule, s.job.param, _grid_between(*coarse[i][3], 2 * REFINE_POINTS))
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
        bp = _one_pass(plan, fine, bjobs, bootstrap, unit, seed, tally, progress)
        for i, job, hits in zip(fine_of, fine, bp.hits, strict=True):
            searches[i].add(job.values, hits)
        read = any(j.rule.level != "sequence" for j in [*fine, *bjobs])
        for s in searches:
            s.passes += read
    # 3. what is still open (m2po; a bracket those points could not settle)
    _refine(plan, searches, target, tol, max_passes - 2, tally, progress)
    where = {i: k for k, i in enumerate(inpass)}
    for i, s in enumerate(searches):
        best, frac, status, _ = s.state(target, tol)
        if status == "refine":
            status = f"not converged: not within {tol:.0%} after {s.passes} passes"
        status, _, note = status.partition(": ")
        lo = hi = None
        if bootstrap and status != "out of range":
            k = where.get(i)
            if k is None or bp is None or bp.reps[k] is None:
                boot_note = _no_boot_note_job(s.job)
            else:
                lo, hi, boot_note = _ci_from(bjobs[k], bp.reps[k], bp.tokens[k], target)
            note = "; ".join(x for x in (note, boot_note) if x)
        row = _choice_row(s.job, best, frac, target, lo, hi, status, note, s.tokens, s.passes)
        row["masked_tokens"] = round(frac * s.tokens)
        if curve:
            row["curve"] = _curve(s, best)
        rows.append(row)
    return rows


def _no_boot_note_job(job) -> str:
    if job.rule.level == "step":
        return "m2po is batch-adaptive per step: no bootstrap"
    return "no bootstrap"


def _crossings(job: engine.Job, f: np.ndarray, target: float) -> np.ndarray:
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


def _ci_from(job, reps, tokens, target, level: float = 0.95):
    """Interval of the value where the replicate masked fraction crosses the target."""
    ok = tokens > 0
    if ok.sum() < 2:
        return None, None, "too few units to resample"
    f = reps[ok] / tokens[ok, None]
    lo, hi = _interval(_crossings(job, f, target), level)
    note = ""
    if lo <= job.values[0] or hi >= job.values[-1]:
        note = "bootstrap interval reaches the searched range's edge"
    return lo, hi, note


CURVE_POINTS = 11  # the report's table: masked fraction at grid values around the choice


def _curve(s: _Search, best: float, n: int = CURVE_POINTS) -> list[dict]:
    """Exact masked fractions around the chosen value, in masking order: the chosen value,
    the default grid's two values on each side, and between the chosen value and its two
    grid neighbours the evaluated (refinement) values nearest the quarter points, so that
    the table shows how the fraction moves near the choice even where the grid is coarse.
    At most `n` rows."""
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
        {
            "value": float(v),
            "masked_tokens": int(known[v]),
            "masked_fraction": known[v] / s.tokens,
            "chosen": bool(v == best),
        }
        for v in pts[lo : lo + n]
    ]


def _choice_row(job, value, frac, target, lo, hi, status, note, tokens, passes) -> dict:
    rule = job.rule
    return {
        "rule": rule.name,
        "setting": rule.setting(job.param),
        "param": job.param,
        "value": float(value),
        "masked_fraction": float(frac),
        "target_fraction": target,
        "ci_low": lo,
        "ci_high": hi,
        "kind": rule.kind,
        "status": status,
        "note": note,
        "tokens": tokens,
        "masked_tokens": round(frac * tokens),
        "passes": passes,
        "spec": rule.replace(**{job.param: float(value)}).spec(),
    }


def _boot_fractions(tally, ji):
    """(B', K) bootstrap masked fractions of job ji over replicates with tokens, or a note."""
    res = tables.boot_counts(tally, ji)
    if res is None:
        return None, _no_boot_note(tally, ji)
    counts, tokens = res
    ok = tokens > 0
    if ok.sum() < 2:
        return None, "too few units to resample"
    return counts[ok] / tokens[ok, None], ""


def _interval(x: np.ndarray, level: float) -> tuple[float, float]:
    q = (1 - level) / 2
    return float(np.quantile(x, q)), float(np.quantile(x, 1 - q))


def _ci_fraction(tally, ji, level: float = 0.95):
    """Interval of the masked fraction at a single setting."""
    f, note = _boot_fractions(tally, ji)
    if f is None:
        return None, None, note
    return (*_interval(f[:, 0], level), "")


def _ci_value(tally, ji, target, level: float = 0.95):
    """Interval of the value whose masked fraction is closest to the target."""
    f, note = _boot_fractions(tally, ji)
    if f is None:
        return None, None, note
    values = tally.jobs[ji].values
    lo, hi = _interval(values[np.argmin(np.abs(f - target), axis=1)], level)
    note = ""
    if lo <= values[0] or hi >= values[-1]:
        note = "bootstrap interval reaches the searched range's edge"
    return lo, hi, note


def _no_boot_note(tally, ji) -> str:
    if tally.jobs[ji].rule.level == "step":
        return "m2po is batch-adaptive per step: no bootstrap"
    return "no bootstrap"


# ----------------------------------------------------------------------------- compare


def _token_mask(rule: Rule, tb: TokenBatch) -> np.ndarray:
    job = engine._single(rule)
    thr = job.thresholds[0]
    s = rule.score(tb, job.param)
    return s >= thr if rule.inclusive else s > thr


DENSE = 16  # points a budget search puts between two default grid points (one pass)


def _dense(values: np.ndarray, m: int = DENSE) -> np.ndarray:
    pieces = [values] + [_grid_between(a, b, m + 2)[1:-1] for a, b in itertools.pairwise(values)]
    return np.unique(np.concatenate(pieces))


def _budget_rules(plan, rules: Sequence[Rule], budget: float, progress) -> list[tuple[Rule, dict]]:
    """Each rule set to mask `budget` of the tokens (its primary parameter), all rules in one
    pass on the default grids made DENSE times finer, then refined like `choose` (rarely a
    second pass)."""
    jobs = []
    for rule in rules:
        param = rule.primary_param()
        jobs.append(engine.Job(rule, param, _dense(parse_grid(rule.param(param).grid))))
    tally = engine.replay(plan, jobs=jobs, progress=progress, final=True)
    searches = []
    for ji, job in enumerate(jobs):
        values, hits, tokens = tables.job_counts(tally, ji)
        searches.append(_Search(job, values.copy(), hits.copy(), tokens))
    _refine(plan, searches, budget, 0.01, 7, tally, progress)
    out = []
    for s in searches:
        best, frac, status, _ = s.state(budget, 0.01)
        if status == "refine":
            status = "not within 1% after 8 passes"
        res = {"param": s.job.param, "value": float(best), "masked_fraction": float(frac)}
        res["status"] = status
        out.append((s.job.rule.replace(**{s.job.param: res["value"]}), res))
    return out


def choose_one(plan, rule: Rule, param: str, target: float, progress=None) -> dict:
    """`choose` for one rule and parameter on an existing plan (no bootstrap)."""
    job = engine.Job(rule, param, parse_grid(rule.param(param).grid))
    t = engine.replay(plan, jobs=[job], progress=progress, final=True)
    values, hits, tokens = tables.job_counts(t, 0)
    s = _Search(job, values.copy(), hits.copy(), tokens)
    _refine(plan, [s], target, 0.01, 7, t, progress)
    best, frac, status, _ = s.state(target, 0.01)
    if status == "refine":
        status = "not within 1% after 8 passes"
    return {"param": param, "value": float(best), "masked_fraction": float(frac), "status": status}


CELLS = ("both", "only_a", "only_b", "neither")


def compare(
    sources: Sequence[str | Path],
    rule_a: str | Rule,
    rule_b: str | Rule,
    budget: float | None = None,
    examples: int = 0,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
    budget_settings: tuple[dict, dict] | None = None,
) -> dict:
    """The 2 x 2 table of two rules on the same tokens (see the module docstring).
    `precision="float32"`: both rules decide in the frameworks' float32 arithmetic.
    `budget_settings`: with `budget`, the two settings already found for it (`choose`
    rows: param, value, masked_fraction, status), so no pass searches them again."""
    plan = io.plan_sources(sources, options)
    pair = _compare_setup(plan, rule_a, rule_b, budget, precision, budget_settings, progress)
    return _compare_pass(plan, [pair], examples, progress)[0]


def _compare_setup(plan, rule_a, rule_b, budget, precision, budget_settings, progress) -> dict:
    """compare's rules checked and set (at the budget: searched, or `budget_settings`)."""
    a = parse_rule(rule_a) if isinstance(rule_a, str) else rule_a
    b = parse_rule(rule_b) if isinstance(rule_b, str) else rule_b
    precision = precision if precision is not None else engine.current_precision()
    if precision is not None:
        p = engine.check_precision(precision)
        a, b = a.replace(precision=p), b.replace(precision=p)
    settings = {}
    for r in (a, b):
        if r.level == "step":
            raise UsageError(
                f"compare: '{r.name}' is batch-adaptive per step; compare token or sequence "
                "rules (sweep --by step shows m2po per step)."
            )
        if r.kind == "weight":
            raise UsageError(f"compare: '{r.name}' truncates weights and masks no token.")
        lacking = [c for c in r.needs if c not in plan.columns]
        if lacking:
            raise DataError(
                f"{plan.files[0]}: rule '{r.name}' needs the column(s) {', '.join(lacking)} "
                f"(found: {', '.join(plan.columns)}). Map one with --map."
            )
    if budget is not None:
        if not 0.0 < budget < 1.0:
            raise UsageError(f"--budget {budget}: give a fraction in (0, 1).")
        if budget_settings is not None:
            for key, s in zip("ab", budget_settings, strict=True):
                settings[key] = {k: s[k] for k in ("param", "value", "masked_fraction", "status")}
            a = a.replace(**{settings["a"]["param"]: settings["a"]["value"]})
            b = b.replace(**{settings["b"]["param"]: settings["b"]["value"]})
        else:
            (a, settings["a"]), (b, settings["b"]) = _budget_rules(plan, [a, b], budget, progress)
    return {"a": a, "b": b, "settings": settings, "budget": budget}


def _compare_pass(plan, pairs: list[dict], examples: int, progress) -> list[dict]:
    """The token pass of `compare` for several pairs at once (the report's two): per pair
    {a, b, settings, budget}, its result. Sequence rules first need which sequences they
    mask (one more pass, shared)."""
    seq_rules = [r for pr in pairs for r in (pr["a"], pr["b"]) if r.level == "sequence"]
    pre = None
    seq_masked: dict[int, np.ndarray] = {}
    if seq_rules:
        pre = engine.replay(
            plan, jobs=[engine._single(r) for r in seq_rules], progress=progress, final=True
        )
        st = pre.seq_stats()
        for k, r in enumerate(seq_rules):
            job = pre.jobs[k]
            sc = r.score(st, job.param)
            thr = job.thresholds[0]
            seq_masked[id(r)] = sc >= thr if r.inclusive else sc > thr
    cols = ["trainer_logprob", "inference_logprob", "step"]
    cols += [c for c in ("sample_id", "position", "advantage") if c in plan.columns]
    if pre is not None and "sample_id" not in cols:
        cols.append("sample_id")
    keys = engine.Tally([], None, has_seq=pre is not None)
    if pre is not None:
        keys.seq_keys = dict(pre.seq_keys)
    edges = np.asarray(engine.Q_BUCKET_EDGES)
    nb = edges.size
    for pr in pairs:
        pr["acc"] = {c: np.zeros(4) for c in ("count", "q", "p", "mass")}
        pr["bucket"] = np.zeros((4, nb))
        pr["top"] = {}
    report = io.ReadReport()
    total = sum(plan.rows)
    for _, df in io.iter_batches(plan, cols, report):
        if not df.height:
            continue
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy(), adv)
        gid = keys._seq_codes(df)[0] if pre is not None else None
        qb = np.searchsorted(edges, tb.q, side="right") - 1
        masks: dict[str, np.ndarray] = {}  # the same setting in two pairs: scored once

        def mask(r, gid=gid, tb=tb, masks=masks):
            key = r.spec() + r.precision
            if key not in masks:
                masks[key] = seq_masked[id(r)][gid] if r.level == "sequence" else _token_mask(r, tb)
            return masks[key]

        for pr in pairs:
            acc, top = pr["acc"], pr["top"]
            ma, mb = mask(pr["a"]), mask(pr["b"])
            cell = np.where(ma & mb, 0, np.where(ma, 1, np.where(mb, 2, 3)))
            for name, w in (("count", None), ("q", tb.q), ("p", tb.p), ("mass", tb.abs_dp)):
                acc[name] += np.bincount(cell, weights=w, minlength=4)
            pr["bucket"] += np.bincount(cell * nb + qb, minlength=4 * nb).reshape(4, nb)
            for side, code in (("a", 1), ("b", 2)):
                dis = np.flatnonzero(cell == code) if examples else np.zeros(0, np.int64)
                if dis.size:
                    new = {
                        "masked_by": np.full(dis.size, side),
                        "q": tb.q[dis],
                        "p": tb.p[dis],
                        "abs_dp": tb.abs_dp[dis],
                        "log_ratio": tb.l[dis],
                    } | {
                        c: df[c].to_numpy()[dis]
                        for c in ("step", "sample_id", "position")
                        if c in df.columns
                    }
                    if side in top:
                        new = {c: np.concatenate([top[side][c], new[c]]) for c in new}
                    keep = np.argsort(-np.abs(new["log_ratio"]), kind="stable")[:examples]
                    top[side] = {c: v[keep] for c, v in new.items()}
        if progress is not None:
            progress(report.rows, total)
    return [_compare_result(plan, pr, edges) for pr in pairs]


def _compare_result(plan, pr: dict, edges: np.ndarray) -> dict:
    a, b, acc, bucket, top = pr["a"], pr["b"], pr["acc"], pr["bucket"], pr["top"]
    nb = edges.size
    n = acc["count"]
    tokens = int(n.sum())
    if tokens == 0:
        raise DataError(f"{plan.files[0]}: no loss tokens to compare.")
    cells = {}
    for i, c in enumerate(CELLS):
        cnt = int(n[i])
        cells[c] = {
            "tokens": cnt,
            "fraction": cnt / tokens,
            "mean_q": acc["q"][i] / cnt if cnt else None,
            "mean_p": acc["p"][i] / cnt if cnt else None,
            "mass": float(acc["mass"][i]),
        }
    union = n[0] + n[1] + n[2]
    labels = [_bucket_label(i) for i in range(nb)]
    where = [
        {
            "q_bucket": labels[j],
            "q_low": float(edges[j]),
            "tokens": int(bucket[:, j].sum()),
            **{c: int(bucket[i, j]) for i, c in enumerate(CELLS)},
        }
        for j in range(nb)
        if bucket[:, j].sum() > 0
    ]
    out = {
        "rule_a": a.spec(),
        "rule_b": b.spec(),
        "budget": pr["budget"],
        "settings": pr["settings"],
        "tokens": tokens,
        **{c: cells[c]["tokens"] for c in CELLS},
        "cells": cells,
        "masked_a": int(n[0] + n[1]),
        "masked_b": int(n[0] + n[2]),
        "jaccard": float(n[0] / union) if union else None,
        "where": where,
        # per side, the disputed tokens the engines disagree on most (largest |log p - log q|)
        "examples": [
            {c: (v[i].item() if hasattr(v[i], "item") else v[i]) for c, v in t.items()}
            for side in ("a", "b")
            if side in top
            for t in [top[side]]
            for i in range(t["q"].size)
        ],
    }
    return out


def _bucket_label(j: int) -> str:
    edges = engine.Q_BUCKET_EDGES
    hi = edges[j + 1] if j + 1 < len(edges) else 1.0
    close = "]" if j + 1 == len(edges) else ")"
    return f"[{edges[j]:g}, {hi:g}{close}"


# ----------------------------------------------------------------------------- drift

TRIM = 0.01  # trimmed mean of k3: drop this fraction of tokens at each end, per step


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


def drift(
    sources: Sequence[str | Path],
    rules: Sequence[str | Rule] | None = None,
    factor: float = 3.0,
    baseline_steps: int | None = None,
    min_run: int = 3,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Per-step mismatch and masked fractions; sustained departures flagged as drift, lone
    heavy-tail steps as spikes; whether each rule's masked fraction followed the mismatch."""
    if factor <= 1:
        raise UsageError(f"--factor {factor}: give a factor above 1.")
    if min_run < 1:
        raise UsageError(f"--min-run {min_run}: give at least 1.")
    plan = io.plan_sources(sources, options)
    chosen = (
        [parse_rule(r) if isinstance(r, str) else r for r in rules]
        if rules
        else [r for r in default_settings(plan.columns) if r.name in ("ipo", "icepop")]
    )
    jobs = [engine._single(r) for r in chosen]
    tally = engine.replay(plan, jobs=jobs, by="step", robust=True, progress=progress, final=True)
    return _drift_from(plan, tally, range(len(jobs)), factor, baseline_steps, min_run)


def _drift_from(plan, tally, which, factor, baseline_steps, min_run) -> dict:
    """`drift`'s answer from a robust Tally by step; `which`: the jobs to give verdicts for."""
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
            {
                "step": steps[gi],
                "tokens": int(m["tokens"][gi]),
                "kl_k1": float(m["kl_k1"][gi]),
                "kl_k3": float(m["kl_k3"][gi]),
                "kl_k3_median": _hist_quantile(counts, 0.5),
                "kl_k3_trimmed": _trimmed_mean(counts, sums, TRIM),
                "abs_dp_mean": float(m["abs_dp_mean"][gi]),
            }
        )
    masked = {}
    djobs = [tally.jobs[ji] for ji in which]
    for ji in which:
        job = tally.jobs[ji]
        frame = tables.job_frame(tally, ji)
        label = job.rule.spec()
        by_step = dict(
            zip(frame["step"].to_list(), frame["masked_fraction"].to_list(), strict=True)
        )
        masked[label] = by_step
        for r in rows:
            r[f"masked:{label}"] = by_step.get(r["step"])
    base = rows[:nb]
    base_trim = float(np.median([r["kl_k3_trimmed"] for r in base]))
    base_mean = float(np.median([r["kl_k3"] for r in base]))
    for r in rows:
        r["elevated"] = bool(r["kl_k3_trimmed"] > factor * base_trim)
        r["mean_elevated"] = bool(r["kl_k3"] > factor * base_mean)
    # sustained: runs of >= min_run consecutive elevated steps
    flagged: list = []
    run: list = []
    for r in [*rows, {"elevated": False, "step": None}]:
        if r["elevated"]:
            run.append(r["step"])
            continue
        if len(run) >= min_run:
            flagged.extend(run)
        run = []
    flagged_set = set(flagged)
    spikes = []
    for r in rows:
        r["drift"] = r["step"] in flagged_set
        r["spike"] = (r["mean_elevated"] or r["elevated"]) and not r["drift"]
        if r["spike"]:
            gi = tally.groups.index(r["step"])
            top = tally.top.get(gi, {})
            spikes.append(
                {
                    "step": r["step"],
                    "kl_k3": r["kl_k3"],
                    "kl_k3_trimmed": r["kl_k3_trimmed"],
                    "tokens": [
                        {c: v[i].item() for c, v in top.items()} for i in range(len(top["k3"]))
                    ]
                    if top
                    else [],
                }
            )
    verdicts = []
    drift_rows = [r for r in rows if r["drift"]]
    for job in djobs:
        label = job.rule.spec()

        def frac(rs, label=label):
            tok = sum(r["tokens"] for r in rs)
            hit = sum((r[f"masked:{label}"] or 0) * r["tokens"] for r in rs)
            return hit / tok if tok else math.nan, tok

        fb, tb_ = frac(base)
        if not drift_rows:
            verdicts.append(
                {
                    "rule": label,
                    "baseline_fraction": fb,
                    "drift_fraction": None,
                    "ratio": None,
                    "verdict": "no drift",
                }
            )
            continue
        fd, td = frac(drift_rows)
        floor = 0.5 / max(min(tb_, td), 1)
        ratio = max(fd, floor) / max(fb, floor)
        kl_ratio = float(np.median([r["kl_k3_trimmed"] for r in drift_rows])) / base_trim
        if ratio >= 2:
            verdict = "rose with the mismatch"
        elif kl_ratio >= factor:
            verdict = "flat while the mismatch rose (the collapse signature)"
        else:
            verdict = "flat"
        verdicts.append(
            {
                "rule": label,
                "baseline_fraction": fb,
                "drift_fraction": fd,
                "ratio": ratio,
                "kl_ratio": kl_ratio,
                "verdict": verdict,
            }
        )
    return {
        "factor": factor,
        "min_run": min_run,
        "baseline_steps": [r["step"] for r in base],
        "baseline": {"kl_k3_trimmed": base_trim, "kl_k3": base_mean},
        "statistic": f"per-step {TRIM:.0%}-trimmed mean of k3 (and its plain mean for spikes)",
        "flagged_steps": flagged,
        "spike_steps": [s["step"] for s in spikes],
        "spikes": spikes,
        "rules": verdicts,
        "steps": rows,
    }


# ----------------------------------------------------------------------------- decisions

DECISION_RULES = ("ipo", "icepop@prime-rl", "kpop@prime-rl")


def decisions(
    sources: Sequence[str | Path],
    target_fraction: float = 0.0025,
    bootstrap: int = 200,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """The three questions of the report's Decision section, on one log: which eps masks the
    target fraction (choose), which tokens IPO and IcePop mask at their defaults and at an
    equal budget (compare, at the settings choose found), and whether the run drifted
    (drift; needs several steps). `report_data` answers the same sharing the report's
    passes."""
    plan = io.plan_sources(sources, options)
    rules = [r for r in DECISION_RULES if all(c in plan.columns for c in parse_rule(r).needs)]
    out: dict = {"target_fraction": target_fraction}
    out["choose"] = choose(
        plan.files,
        target_fraction,
        rules,
        bootstrap=bootstrap,
        options=options,
        progress=progress,
    )
    out["compare"] = compare(
        plan.files,
        "ipo@prime-rl",
        "icepop@prime-rl",
        examples=5,
        options=options,
        progress=progress,
    )
    out["compare_budget"] = compare(
        plan.files,
        "ipo",
        "icepop@prime-rl",
        budget=target_fraction,
        examples=5,
        options=options,
        progress=progress,
        budget_settings=_budget_pair(out["choose"], ("ipo", "icepop@prime-rl")),
    )
    try:
        out["drift"] = drift(plan.files, options=options, progress=progress)
    except DataError as exc:  # a single-step log: no drift to speak of
        out["drift"] = None
        out["drift_note"] = str(exc)
    return out


def _job_key(j: engine.Job) -> tuple:
    """Jobs that count the same tokens the same way have the same key (a preset's name
    aside: its arithmetic and every parameter are in it)."""
    r = j.rule
    return (r.name, r.arith, r.precision, r.setting(j.param), j.param, tuple(j.values.tolist()))


def _budget_pair(rows: list[dict], names: Sequence[str]) -> tuple[dict, dict] | None:
    """choose's rows for the two rules' primary parameters (compare --budget's settings)."""
    out = []
    for spec in names:
        rule = parse_rule(spec)
        param = rule.primary_param()
        hit = [
            r
            for r in rows
            if r["rule"] == rule.name
            and r["param"] == param
            and r["setting"] == rule.setting(param)
        ]
        if not hit or hit[0]["status"] == "out of range":
            return None
        out.append(hit[0])
    return out[0], out[1]


def report_data(
    sources: Sequence[str | Path],
    settings: Sequence[str | Rule] | None = None,
    target_fraction: float = 0.0025,
    bootstrap: int = 200,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
) -> tuple[FigureData, dict]:
    """`figure_data` and `decisions` together, sharing their passes: the full sweep also
    holds choose's default grids (choose then needs one pass: refinement and bootstrap);
    the per-step pass is robust and gives drift; compare --budget takes choose's settings.
    Passes: sweep, choose, per step, per bucket, compare (both pairs, numpy) = 5 (was ~20).
    Returns (figure data, the decisions dict of `decisions`)."""
    plan = io.plan_sources(sources, options)
    chosen = (
        [parse_rule(s) if isinstance(s, str) else s for s in settings]
        if settings
        else default_settings(plan.columns)
    )
    names = [r for r in DECISION_RULES if all(c in plan.columns for c in parse_rule(r).needs)]
    dec: dict = {"target_fraction": target_fraction}
    with engine.use_precision(precision):
        p = engine.current_precision()
        sweep_jobs, notes = engine.plan_jobs(None, None, plan.columns)
        cjobs = _choice_jobs([parse_rule(r) for r in names], True)
        if p is not None:
            sweep_jobs = engine.with_precision(sweep_jobs, p)
            cjobs = engine.with_precision(cjobs, p)
        have = {_job_key(j) for j in sweep_jobs}
        extra = [j for j in cjobs if _job_key(j) not in have]
        full = engine.replay(plan, jobs=sweep_jobs + extra, progress=progress, final=True)
        full.notes = [*notes, *full.notes]
        res = full.result()
        table = res.table
        if extra:  # the table is in job order: choose's own jobs are its last rows
            table = table.head(table.height - sum(len(j.values) for j in extra))
        dec["choose"] = choose(
            plan.files,
            target_fraction,
            names,
            bootstrap=bootstrap,
            options=options,
            progress=progress,
            tally=full,
            curve=True,
        )
        drift_rules = [r for r in default_settings(plan.columns) if r.name in ("ipo", "icepop")]
        specs = {r.spec() for r in chosen}
        step_rules = chosen + [r for r in drift_rules if r.spec() not in specs]
        by_step = engine.replay(
            plan, rules=step_rules, by="step", robust=True, progress=progress, final=True
        )
        steps = by_step.result().table
        if len(step_rules) > len(chosen):
            steps = steps.filter(pl.col("spec").is_in(list(specs)))
        by_bucket = engine.replay(plan, rules=chosen, by="q_bucket", progress=progress, final=True)
        pair = ("ipo", "icepop@prime-rl")
        pairs = [
            _compare_setup(plan, "ipo@prime-rl", pair[1], None, None, None, progress),
            _compare_setup(
                plan,
                pair[0],
                pair[1],
                target_fraction,
                None,
                _budget_pair(dec["choose"], pair),
                progress,
            ),
        ]
        dec["compare"], dec["compare_budget"] = _compare_pass(plan, pairs, 5, progress)
    drift_specs = {r.spec() for r in drift_rules}
    which = [ji for ji, j in enumerate(by_step.jobs) if j.rule.spec() in drift_specs]
    n_steps = len(by_step.groups)
    if n_steps < 2:
        dec["drift"] = None
        dec["drift_note"] = (
            f"{plan.files[0]}: drift needs several steps; the log has {n_steps} "
            "(map a step column with --map step=COLUMN)."
        )
    else:
        dec["drift"] = _drift_from(plan, by_step, which, 3.0, None, 3)
    data = FigureData(
        hist_lin=full.hist_lin,
        hist_log=full.hist_log,
        edges_lin=engine.scatter_edges(log=False),
        edges_log10=engine.scatter_edges(log=True),
        sweep=table,
        settings=chosen,
        steps=steps,
        step_metrics=by_step.metrics.table("step", by_step.groups),
        buckets=by_bucket.result().table,
        metrics=res.metrics.to_dicts()[0],
        tokens=full.report.loss_rows,
        sources=[str(x) for x in plan.files],
        notes=list(full.notes),
    )
    return data, dec


# ----------------------------------------------------------------------------- precision

# The settings `precision_check` replays by default: the report's, and the presets whose
# framework code turns a float32 NaN or rounding into a decision (AReaL's binary KL).
PRECISION_SETTINGS = (*DEFAULT_SETTINGS, "kpop@areal", "icepop@areal", "dppo-kl@verl")
PRECISION_THRESHOLD = 1e-3  # masked-fraction difference (absolute) worth a line


def precision_check(
    sources: Sequence[str | Path],
    rules: Sequence[str | Rule] | None = None,
    threshold: float = PRECISION_THRESHOLD,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Each rule's masked (or truncated) tokens in float64 and in the float32 arithmetic the
    frameworks run on the GPU (engine.replay(precision=...)), and a line for every rule
    whose two fractions differ by more than `threshold` (absolute): a disagreement no
    dashboard shows (AReaL's binary KL turns p = 1 into NaN in float32 and masks it).

    Returns {"threshold", "rows": [{spec, tokens, masked_float64, masked_float32,
    fraction_float64, fraction_float32, difference, flagged}], "lines": [...]}.
    """
    plan = io.plan_sources(sources, options)
    if rules:
        chosen = [parse_rule(r) if isinstance(r, str) else r for r in rules]
    else:
        chosen = [parse_rule(s) for s in PRECISION_SETTINGS]
        chosen = [r for r in chosen if all(c in plan.columns for c in r.needs)]
    jobs = [engine._single(r) for r in chosen]
    counts = {}
    for precision in ("float64", "float32"):
        tally = engine.replay(plan, jobs=jobs, progress=progress, final=True, precision=precision)
        counts[precision] = [tables.job_counts(tally, ji) for ji in range(len(jobs))]
    rows, lines = [], []
    for ji, rule in enumerate(chosen):
        _, h64, tokens = counts["float64"][ji]
        _, h32, _ = counts["float32"][ji]
        n64, n32 = int(h64[0]), int(h32[0])
        f64, f32 = n64 / tokens, n32 / tokens
        diff = f32 - f64
        flagged = abs(diff) > threshold
        what = "truncates" if rule.kind == "weight" else "masks"
        rows.append(
            {
                "spec": rule.spec(),
                "tokens": int(tokens),
                "masked_float64": n64,
                "masked_float32": n32,
                "fraction_float64": f64,
                "fraction_float32": f32,
                "difference": diff,
                "flagged": flagged,
            }
        )
        if flagged:
            lines.append(
                f"{rule.spec()} {what} {f32:.3%} of the tokens in float32 ({n32:,}) against "
                f"{f64:.3%} in float64 ({n64:,}): in the float32 arithmetic the framework "
                "runs on the GPU it decides differently (a NaN, a rounding at a threshold), "
                "and no dashboard shows it."
            )
    return {"threshold": threshold, "rows": rows, "lines": lines}
