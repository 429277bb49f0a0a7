"""Questions over Tallies: which eps (`choose`), which rule (`compare`), did it drift (`drift`),
and the data behind the figures.

Design
------
Functions here take sources, run the engine (each call is one or a few streaming passes) and
return plain records and tables; they never draw and never print.

* `choose` finds, per rule, the threshold whose masked fraction is closest to a target: a
  first pass on the default grid brackets the answer, and each further pass refines the
  bracket with 64 new grid points (all rules at once), until the fraction is within `tol`
  (relative) of the target or the bracket shrinks to a tie in the data. A last pass
  accumulates a streaming Poisson bootstrap over sequences (or steps) on a grid spanning
  the bracket, giving an interval for the answer: how much it would move on another log of
  the same run.
* `compare` puts two rules side by side on the same tokens: the 2 x 2 table of masked by
  both / only A / only B / neither, with counts, mean probabilities and |dp| mass, where
  (inference-probability buckets) they disagree, and the most disputed tokens; `budget` first
  sets both rules to mask the same fraction (iso-budget comparison).
* `drift` tracks per-step mismatch with statistics a handful of extreme tokens cannot move
  (median and 1%-trimmed mean of k3), flags sustained departures from an early-step baseline
  as drift, reports lone outlier steps as spikes with the tokens that caused them, and says
  whether each rule's masked fraction followed the mismatch or stayed flat.

The figure data needs three views of a log: every rule swept over its grid (with the scatter
histograms), the chosen settings per step, and the chosen settings per inference-probability
bucket.
"""

from __future__ import annotations

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
BOOT_POINTS = 161


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
) -> list[dict]:
    """For each rule (and each of its threshold parameters), the value whose masked fraction
    is closest to `target_fraction`, with a bootstrap interval. Without a target: the masked
    fraction at each given setting, with its interval. `precision="float32"`: the rules
    decide in the frameworks' float32 arithmetic (engine.replay).
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
    # 1. the default grids
    tally = engine.replay(plan, jobs=jobs, progress=progress, final=True)
    searches = []
    for ji, job in enumerate(jobs):
        values, hits, tokens = tables.job_counts(tally, ji)
        searches.append(_Search(job, values.copy(), hits.copy(), tokens))
    coarse = [s.state(target_fraction, tol) for s in searches]
    # 2. refine every unfinished bracket, all rules in one pass per round
    for _ in range(max_passes - 1):
        todo = [
            (i, s) for i, s in enumerate(searches) if s.state(target_fraction, tol)[2] == "refine"
        ]
        if not todo:
            break
        rjobs = []
        for _, s in todo:
            a, b = s.state(target_fraction, tol)[3]
            rjobs.append(engine.Job(s.job.rule, s.job.param, _grid_between(a, b, REFINE_POINTS)))
        t = engine.replay(plan, jobs=rjobs, progress=progress, final=True)
        for k, (_, s) in enumerate(todo):
            values, hits, _ = tables.job_counts(t, k)
            s.add(values, hits)
            s.passes += 1
    # 3. bootstrap on a grid spanning the coarse bracket, widened
    bjobs = []
    for s, c in zip(searches, coarse, strict=True):
        base = s.job.values
        if c[3] is not None:
            a, b = c[3]
        else:
            a = b = c[0]
        ia = int(np.searchsorted(base, min(a, b)))
        ib = int(np.searchsorted(base, max(a, b)))
        lo, hi = base[max(ia - 3, 0)], base[min(ib + 3, base.size - 1)]
        best = s.state(target_fraction, tol)[0]
        grid = np.unique(np.r_[_grid_between(lo, hi, BOOT_POINTS), best])
        bjobs.append(engine.Job(s.job.rule, s.job.param, grid))
    bt = None
    if bootstrap:
        bt = engine.replay(
            plan, jobs=bjobs, bootstrap=(bootstrap, unit, seed), progress=progress, final=True
        )
    for i, s in enumerate(searches):
        best, frac, status, _ = s.state(target_fraction, tol)
        if status == "refine":
            status = f"not converged: not within {tol:.0%} after {s.passes} passes"
        status, _, note = status.partition(": ")
        lo = hi = None
        if bt is not None and status != "out of range":
            lo, hi, boot_note = _ci_value(bt, i, target_fraction)
            note = "; ".join(x for x in (note, boot_note) if x)
        hits = round(frac * s.tokens)
        row = _choice_row(
            s.job,
            best,
            frac,
            target_fraction,
            lo,
            hi,
            status,
            note,
            s.tokens,
            s.passes + (1 if bt is not None else 0),
        )
        row["masked_tokens"] = hits
        rows.append(row)
    return rows


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


def _budget_rule(plan, rule: Rule, budget: float, progress) -> tuple[Rule, dict]:
    param = rule.primary_param()
    res = choose_one(plan, rule, param, budget, progress)
    return rule.replace(**{param: res["value"]}), res


def choose_one(plan, rule: Rule, param: str, target: float, progress=None) -> dict:
    """`choose` for one rule and parameter on an existing plan (no bootstrap)."""
    job = engine.Job(rule, param, parse_grid(rule.param(param).grid))
    t = engine.replay(plan, jobs=[job], progress=progress, final=True)
    values, hits, tokens = tables.job_counts(t, 0)
    s = _Search(job, values.copy(), hits.copy(), tokens)
    for _ in range(7):
        st = s.state(target, 0.01)
        if st[2] != "refine":
            break
        t = engine.replay(
            plan, jobs=[engine.Job(rule, param, _grid_between(*st[3], REFINE_POINTS))]
        )
        v, h, _ = tables.job_counts(t, 0)
        s.add(v, h)
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
) -> dict:
    """The 2 x 2 table of two rules on the same tokens (see the module docstring).
    `precision="float32"`: both rules decide in the frameworks' float32 arithmetic."""
    plan = io.plan_sources(sources, options)
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
        a, settings["a"] = _budget_rule(plan, a, budget, progress)
        b, settings["b"] = _budget_rule(plan, b, budget, progress)
    # sequence rules: which sequences they mask (one pass), then the token pass
    seq_rules = [r for r in (a, b) if r.level == "sequence"]
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
    acc = {c: np.zeros(4) for c in ("count", "q", "p", "mass")}
    bucket = np.zeros((4, nb))
    top: dict[str, dict[str, np.ndarray]] = {}
    report = io.ReadReport()
    total = sum(plan.rows)
    for _, df in io.iter_batches(plan, cols, report):
        if not df.height:
            continue
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy(), adv)
        gid = keys._seq_codes(df)[0] if pre is not None else None
        ma = seq_masked[id(a)][gid] if a.level == "sequence" else _token_mask(a, tb)
        mb = seq_masked[id(b)][gid] if b.level == "sequence" else _token_mask(b, tb)
        cell = np.where(ma & mb, 0, np.where(ma, 1, np.where(mb, 2, 3)))
        for name, w in (("count", None), ("q", tb.q), ("p", tb.p), ("mass", tb.abs_dp)):
            acc[name] += np.bincount(cell, weights=w, minlength=4)
        qb = np.searchsorted(edges, tb.q, side="right") - 1
        bucket += np.bincount(cell * nb + qb, minlength=4 * nb).reshape(4, nb)
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
        "budget": budget,
        "settings": settings,
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
    for ji, job in enumerate(tally.jobs):
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
    for job in tally.jobs:
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
    equal budget (compare), and whether the run drifted (drift; needs several steps)."""
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
    )
    try:
        out["drift"] = drift(plan.files, options=options, progress=progress)
    except DataError as exc:  # a single-step log: no drift to speak of
        out["drift"] = None
        out["drift_note"] = str(exc)
    return out


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
