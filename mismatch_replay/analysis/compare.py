"""`compare`: two rules side by side on the same tokens.

Design
------
`compare` answers "which tokens does each rule mask that the other keeps?": the 2 x 2 table
of masked by both / only A / only B / neither (a `Cell` each: tokens, fraction, mean
inference and trainer probabilities, |p - q| mass), where they disagree (`BucketRow`s over
the engine's inference-probability buckets), the Jaccard overlap of the masked sets and,
with `examples=K`, per side the K disputed tokens with the largest |log p - log q|.

For two token rules it is one replay that keeps its tail (engine.Tail: here every token
either setting masks), and the table is counted from the kept tokens (`_from_tail`): the
cells' sums over them, "neither" as the replay's totals (its metric sums, the kernel's
q-bucket counts) minus the rest. Otherwise (a sequence rule, numba missing, a float32
replay) it is one numpy pass over the log (`compare_pass`, several pairs at once: the
report's two), scoring each rule with its own `score()` on each batch; a sequence rule
first needs which sequences it masks (one more replay, shared by the pairs, read from its
sequence statistics). The counts are the same either way (tests/test_tail.py). `budget`
first sets both rules' primary parameters to mask the same fraction (iso-budget comparison:
both searched in one replay on choose's first grids, `search.first_jobs`, then refined like
`choose` from that replay's tail, which then also holds both settings' masked tokens), or
takes settings already found (`budget_settings`, e.g. choose's, as the report does). m2po
(it ranks whole steps) and weight rules (they mask nothing) are refused.

The answer is a `CompareResult`; `to_dict()` is the JSON `compare --json` prints. The
disputed tokens are plain records (`dict`: masked_by, q, p, abs_dp, log_ratio, direction
and the step / sample_id / position the log has), as drift's spike tokens are.

What a mask costs (RULES.md, engine/bins.direction_class): where the log has an advantage,
each cell also counts its corrective, divergent and neutral tokens and its |A| mass, and each
disputed token says its direction ("corrective", "divergent", "neutral"; None without an
advantage). From the tail, "neither" is again the replay's totals minus the rest (its token
job's per-bin direction sums).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, ingest
from ..engine import readout
from ..errors import DataError, UsageError
from ..gcpause import frozen
from ..present import Presentable
from ..rules import Rule, TokenBatch, parse_grid, parse_rule
from . import summaries
from .search import Search, first_replay, refine, tail_fraction
from .tail_counts import TailCounts

CELLS = ("both", "only_a", "only_b", "neither")


def _plain(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass
class BudgetSetting:
    """A rule's primary parameter set to mask the budget."""

    param: str
    value: float
    masked_fraction: float
    status: str

    def to_dict(self) -> dict:
        return _plain(self)


@dataclass
class Cell:
    """One cell of the 2 x 2 table."""

    tokens: int
    fraction: float
    mean_q: float | None  # None: no token in the cell
    mean_p: float | None
    mass: float  # sum of |p - q|
    # what masking the cell costs (None: the log has no advantage column)
    corrective: int | None = None  # A * (p - q) < 0: the update moves p back toward q
    divergent: int | None = None  # A * (p - q) > 0
    neutral: int | None = None  # A == 0 or p == q
    adv_mass: float | None = None  # sum of |A|

    def to_dict(self) -> dict:
        return _plain(self)


_DIRECTION = np.array(["neutral", "corrective", "divergent"], dtype=object)


def _cost_acc(acc: dict, cell: np.ndarray, lp, lq, adv) -> None:
    """Add the tokens' direction classes and |A| per cell (4) into acc (corr, div, amass)."""
    d = engine.direction_class(lp, lq, adv)
    for name, w in (("corr", d == 1), ("div", d == 2), ("amass", np.abs(adv))):
        acc[name] = acc.get(name, np.zeros(4)) + np.bincount(cell, weights=w, minlength=4)


@dataclass
class BucketRow:
    """The cells' tokens in one inference-probability bucket."""

    q_bucket: str
    q_low: float
    tokens: int
    both: int
    only_a: int
    only_b: int
    neither: int

    def to_dict(self) -> dict:
        return _plain(self)


@dataclass
class CompareResult(Presentable):
    """Two rules on the same tokens; `.table`: the 2 x 2 cells (analysis/summaries.py)."""

    rule_a: str  # the SPECs as set (at the budget, the found values)
    rule_b: str
    budget: float | None
    settings: dict[str, BudgetSetting]  # "a", "b" with a budget; else empty
    tokens: int
    cells: dict[str, Cell]  # CELLS -> Cell
    masked_a: int
    masked_b: int
    jaccard: float | None
    where: list[BucketRow]  # the buckets that hold tokens
    examples: list[dict] = field(default_factory=list)  # the disputed tokens, side a then b

    @property
    def both(self) -> int:
        return self.cells["both"].tokens

    @property
    def only_a(self) -> int:
        return self.cells["only_a"].tokens

    @property
    def only_b(self) -> int:
        return self.cells["only_b"].tokens

    @property
    def neither(self) -> int:
        return self.cells["neither"].tokens

    def to_dict(self) -> dict:
        return {
            "rule_a": self.rule_a,
            "rule_b": self.rule_b,
            "budget": self.budget,
            "settings": {k: s.to_dict() for k, s in self.settings.items()},
            "tokens": self.tokens,
            **{c: self.cells[c].tokens for c in CELLS},
            "cells": {c: v.to_dict() for c, v in self.cells.items()},
            "masked_a": self.masked_a,
            "masked_b": self.masked_b,
            "jaccard": self.jaccard,
            "where": [w.to_dict() for w in self.where],
            "examples": self.examples,
        }

    @property
    def table(self) -> pl.DataFrame:
        return summaries.compare_table(self)

    def summary_lines(self) -> list[str]:
        return summaries.compare_lines(self)


@dataclass
class Pair:
    """Two rules checked and set for `compare_pass` (`compare_setup`'s answer)."""

    a: Rule
    b: Rule
    settings: dict[str, BudgetSetting]
    budget: float | None
    tally: engine.Tally | None = None  # the budget search's replay (its tail: compare_pass)


def _token_mask(rule: Rule, tb: TokenBatch) -> np.ndarray:
    job = engine.single_job(rule)
    thr = job.thresholds[0]
    s = rule.score(tb, job.param)
    return s >= thr if rule.inclusive else s > thr


def _budget_rules(
    plan, rules: Sequence[Rule], budget: float, progress
) -> tuple[list[tuple[Rule, BudgetSetting]], engine.Tally]:
    """Each rule set to mask `budget` of the tokens (its primary parameter), all rules in one
    replay on choose's first grids (`search.first_jobs`), then refined like `choose` (from
    the replay's tail, with no pass, where it covers). Also returns that
    replay: its tail holds both settings' masked tokens, as a rule (`compare_pass`)."""
    jobs = []
    for rule in rules:
        param = rule.primary_param()
        jobs.append(engine.Job(rule, param, parse_grid(rule.param(param).grid)))
    tail = engine.Tail(tail_fraction(budget))  # refinement and the table from its tokens
    tally = first_replay(plan, jobs, budget, tail, progress)
    jobs = tally.jobs
    searches = []
    for ji, job in enumerate(jobs):
        values, hits, tokens = readout.job_counts(tally, ji)
        searches.append(Search(job, values.copy(), hits.copy(), tokens))
    refine(plan, searches, budget, 0.01, 7, tally, progress)
    out = []
    for s in searches:
        best, frac, status, _ = s.state(budget, 0.01)
        if status == "refine":
            status = "not within 1% after 8 passes"
        res = BudgetSetting(s.job.param, float(best), float(frac), status)
        out.append((s.job.rule.replace(**{s.job.param: res.value}), res))
    return out, tally


@frozen()  # a whole job: the collector's passes skip what it found (gcpause.py)
def compare(
    sources: Sequence[str | Path],
    rule_a: str | Rule,
    rule_b: str | Rule,
    budget: float | None = None,
    examples: int = 0,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
    budget_settings: tuple | None = None,
) -> CompareResult:
    """The 2 x 2 table of two rules on the same tokens (see the module docstring).
    `precision="float32"`: both rules decide in the frameworks' float32 arithmetic.
    `budget_settings`: with `budget`, the two settings already found for it (two `Choice`
    or `BudgetSetting`: param, value, masked_fraction, status), so no pass searches them
    again."""
    plan = ingest.plan_sources(sources, options)
    pair = compare_setup(plan, rule_a, rule_b, budget, precision, budget_settings, progress)
    tally = pair.tally
    if tally is None and pair.a.level == pair.b.level == "token":
        # one replay of the two settings whose tail keeps every token either masks: the
        # table with no numpy pass (on the fused path; else compare_pass makes its pass)
        jobs = [engine.single_job(pair.a), engine.single_job(pair.b)]
        tally = engine.replay(
            plan, jobs=jobs, progress=progress, final=True, tail=engine.Tail(0.0), scatter=False
        )
    return compare_pass(plan, [pair], examples, progress, tally)[0]


def compare_setup(plan, rule_a, rule_b, budget, precision, budget_settings, progress) -> Pair:
    """compare's rules checked and set (at the budget: searched, or `budget_settings`)."""
    a = parse_rule(rule_a) if isinstance(rule_a, str) else rule_a
    b = parse_rule(rule_b) if isinstance(rule_b, str) else rule_b
    precision = precision if precision is not None else engine.current_precision()
    if precision is not None:
        p = engine.check_precision(precision)
        a, b = a.replace(precision=p), b.replace(precision=p)
    settings: dict[str, BudgetSetting] = {}
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
                settings[key] = BudgetSetting(s.param, s.value, s.masked_fraction, s.status)
            a = a.replace(**{settings["a"].param: settings["a"].value})
            b = b.replace(**{settings["b"].param: settings["b"].value})
        else:
            found, tally = _budget_rules(plan, [a, b], budget, progress)
            (a, settings["a"]), (b, settings["b"]) = found
            return Pair(a, b, settings, budget, tally)
    return Pair(a, b, settings, budget)


@dataclass
class _Acc:
    """One pair's sums over the pass."""

    acc: dict[str, np.ndarray]  # count, q, p, mass: per cell
    bucket: np.ndarray  # (4, buckets) tokens
    top: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # side -> columns


def compare_pass(
    plan, pairs: list[Pair], examples: int, progress, tally: engine.Tally | None = None
) -> list[CompareResult]:
    """`compare`'s tables for several pairs at once (the report's two): per pair, its
    result. A pair of token rules whose masked tokens `tally`'s tail holds (tail_counts.py)
    is counted from the kept tokens, with no pass (`_from_tail`); the others take one numpy
    pass over the log, shared. Sequence rules first need which sequences they mask (one
    more replay, shared)."""
    tc = TailCounts.of(tally)
    done = [_from_tail(plan, pr, tc, examples) if tc is not None else None for pr in pairs]
    rest = [pr for pr, d in zip(pairs, done, strict=True) if d is None]
    out = iter(_compare_pass(plan, rest, examples, progress) if rest else [])
    return [d if d is not None else next(out) for d in done]


def _from_tail(plan, pr: Pair, tc: TailCounts, examples: int) -> CompareResult | None:
    """A pair's result from a replay's kept tokens, or None where they are not every
    masked token of both rules (or the replay counted no q buckets). The cells' sums over
    the kept tokens are the pass's; "neither" is the replay's totals (its metric sums, the
    kernel's q-bucket counts) minus the other three."""
    if pr.a.level != "token" or pr.b.level != "token" or tc.tail.q_counts is None:
        return None
    ja, jb = _covered_job(pr.a, tc), _covered_job(pr.b, tc)
    if ja is None or jb is None:
        return None
    # the tokens either masks (kept-token indices, ascending) and their per-token values
    # only: the same values, in the same order, as read from every kept token's
    ra, rb = tc.masked_rows(ja), tc.masked_rows(jb)
    rows = np.concatenate([ra, rb])  # both ascending: their union, ascending
    rows.sort(kind="stable")
    rows = rows[np.r_[True, rows[1:] != rows[:-1]]] if rows.size else rows
    ma, mb = np.zeros(rows.size, dtype=bool), np.zeros(rows.size, dtype=bool)
    ma[np.searchsorted(rows, ra)] = True
    mb[np.searchsorted(rows, rb)] = True
    tb = tc.batch(rows)
    c = np.where(ma & mb, 0, np.where(ma, 1, 2))
    a = tc.tail.arrays()
    adv = a["advantage"][rows] if "advantage" in a and tc.main.has_adv else None
    edges = np.asarray(engine.Q_BUCKET_EDGES)
    nb = edges.size
    qb = np.searchsorted(edges, tb.q, side="right") - 1
    w = {"q": tb.q, "p": tb.p, "mass": tb.abs_dp}
    acc = {"count": np.bincount(c, minlength=4).astype(np.float64)}
    acc |= {k: np.bincount(c, weights=v, minlength=4) for k, v in w.items()}
    totals = _cost_totals(tc.main) if adv is not None else None
    if totals is not None:
        _cost_acc(acc, c, tb.lp, tb.lq, adv)
        for k, total in totals.items():
            acc[k][3] = total - acc[k][:3].sum()
    tot = tc.main.metrics.total().s
    n = float(tc.tail.tokens)
    for k, total in (
        ("count", n),
        ("q", tot["q"][0]),
        ("p", tot["p"][0]),
        ("mass", tot["abs_dp"][0]),
    ):
        acc[k][3] = total - acc[k][:3].sum()
    bucket = np.bincount(c * nb + qb, minlength=4 * nb).reshape(4, nb).astype(np.float64)
    bucket[3] = tc.tail.q_counts - bucket[:3].sum(axis=0)
    top: dict[str, dict[str, np.ndarray]] = {}
    dirn = _DIRECTION[engine.direction_class(tb.lp, tb.lq, adv)] if totals is not None else None
    for side, code in (("a", 1), ("b", 2)):
        dis = np.flatnonzero(c == code) if examples else np.zeros(0, np.int64)
        if dis.size:
            keep = dis[np.argsort(-np.abs(tb.l[dis]), kind="stable")[:examples]]
            top[side] = {
                "masked_by": np.full(keep.size, side),
                "q": tb.q[keep],
                "p": tb.p[keep],
                "abs_dp": tb.abs_dp[keep],
                "log_ratio": tb.l[keep],
                "direction": dirn[keep] if dirn is not None else np.full(keep.size, None),
            } | {col: a[col][rows[keep]] for col in ("step", "sample_id", "position") if col in a}
    return _compare_result(plan, pr, _Acc(acc, bucket, top), edges)


def _cost_totals(main: engine.Tally) -> dict[str, float] | None:
    """Every loss token's corrective and divergent count and |A| sum, from a token job's
    bins (each token is in one bin of each job), or None where none holds them."""
    for ji, job in enumerate(main.jobs):
        if job.rule.level != "token":
            continue
        b = main.job_bins(ji)
        if b.corr is not None and b.div is not None and b.amass is not None:
            return {"corr": b.corr.sum(), "div": b.div.sum(), "amass": b.amass.sum()}
    return None


def _covered_job(rule: Rule, tc: TailCounts) -> engine.Job | None:
    """The rule at its setting as a one-value job on a threshold parameter the tail's
    replay swept (the masked tokens are the same whichever parameter holds the value), if
    the kept tokens are all its masked ones."""
    for p in rule.params:
        if p.threshold and getattr(rule, p.name) is not None:
            job = engine.Job(rule, p.name, np.array([float(getattr(rule, p.name))]))
            if tc.covers(job):
                return job
    return None


def _compare_pass(plan, pairs: list[Pair], examples: int, progress) -> list[CompareResult]:
    """The numpy pass over the log for pairs the tail does not settle."""
    seq_rules = [r for pr in pairs for r in (pr.a, pr.b) if r.level == "sequence"]
    pre = None
    seq_masked: dict[int, np.ndarray] = {}
    if seq_rules:
        pre = engine.replay(
            plan, jobs=[engine.single_job(r) for r in seq_rules], progress=progress, final=True
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
    sums = [
        _Acc({c: np.zeros(4) for c in ("count", "q", "p", "mass")}, np.zeros((4, nb)))
        for _ in pairs
    ]
    report = ingest.ReadReport()
    total = sum(plan.rows)
    for _, df in ingest.iter_batches(plan, cols, report):
        if not df.height:
            continue
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy(), adv)
        gid = keys.seq_codes(df)[0] if pre is not None else None
        qb = np.searchsorted(edges, tb.q, side="right") - 1
        masks: dict[str, np.ndarray] = {}  # the same setting in two pairs: scored once

        def mask(r, gid=gid, tb=tb, masks=masks):
            key = r.spec() + r.precision
            if key not in masks:
                masks[key] = seq_masked[id(r)][gid] if r.level == "sequence" else _token_mask(r, tb)
            return masks[key]

        for pr, s in zip(pairs, sums, strict=True):
            acc, top = s.acc, s.top
            ma, mb = mask(pr.a), mask(pr.b)
            cell = np.where(ma & mb, 0, np.where(ma, 1, np.where(mb, 2, 3)))
            for name, w in (("count", None), ("q", tb.q), ("p", tb.p), ("mass", tb.abs_dp)):
                acc[name] += np.bincount(cell, weights=w, minlength=4)
            if adv is not None:
                _cost_acc(acc, cell, tb.lp, tb.lq, adv)
            s.bucket += np.bincount(cell * nb + qb, minlength=4 * nb).reshape(4, nb)
            for side, code in (("a", 1), ("b", 2)):
                dis = np.flatnonzero(cell == code) if examples else np.zeros(0, np.int64)
                if dis.size:
                    new = {
                        "masked_by": np.full(dis.size, side),
                        "q": tb.q[dis],
                        "p": tb.p[dis],
                        "abs_dp": tb.abs_dp[dis],
                        "log_ratio": tb.l[dis],
                        "direction": _DIRECTION[
                            engine.direction_class(tb.lp[dis], tb.lq[dis], adv[dis])
                        ]
                        if adv is not None
                        else np.full(dis.size, None),
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
    return [_compare_result(plan, pr, s, edges) for pr, s in zip(pairs, sums, strict=True)]


def _compare_result(plan, pr: Pair, s: _Acc, edges: np.ndarray) -> CompareResult:
    acc, bucket, top = s.acc, s.bucket, s.top
    nb = edges.size
    n = acc["count"]
    tokens = int(n.sum())
    if tokens == 0:
        raise DataError(f"{plan.files[0]}: no loss tokens to compare.")
    cells = {}
    for i, c in enumerate(CELLS):
        cnt = int(n[i])
        cells[c] = Cell(
            tokens=cnt,
            fraction=cnt / tokens,
            mean_q=acc["q"][i] / cnt if cnt else None,
            mean_p=acc["p"][i] / cnt if cnt else None,
            mass=float(acc["mass"][i]),
            **_cell_cost(acc, i, cnt),
        )
    union = n[0] + n[1] + n[2]
    labels = [_bucket_label(i) for i in range(nb)]
    where = [
        BucketRow(
            labels[j],
            float(edges[j]),
            int(bucket[:, j].sum()),
            *(int(bucket[i, j]) for i in range(len(CELLS))),
        )
        for j in range(nb)
        if bucket[:, j].sum() > 0
    ]
    return CompareResult(
        rule_a=pr.a.spec(),
        rule_b=pr.b.spec(),
        budget=pr.budget,
        settings=pr.settings,
        tokens=tokens,
        cells=cells,
        masked_a=int(n[0] + n[1]),
        masked_b=int(n[0] + n[2]),
        jaccard=float(n[0] / union) if union else None,
        where=where,
        # per side, the disputed tokens the engines disagree on most (largest |log p - log q|)
        examples=[
            {c: (v[i].item() if hasattr(v[i], "item") else v[i]) for c, v in t.items()}
            for side in ("a", "b")
            if side in top
            for t in [top[side]]
            for i in range(t["q"].size)
        ],
    )


def _cell_cost(acc: dict, i: int, cnt: int) -> dict:
    """Cell i's direction counts and |A| mass (nothing where the log has no advantage)."""
    if "corr" not in acc:
        return {}
    corr, div = int(np.rint(acc["corr"][i])), int(np.rint(acc["div"][i]))
    return {
        "corrective": corr,
        "divergent": div,
        "neutral": cnt - corr - div,
        "adv_mass": float(acc["amass"][i]),
    }


def _bucket_label(j: int) -> str:
    edges = engine.Q_BUCKET_EDGES
    hi = edges[j + 1] if j + 1 < len(edges) else 1.0
    close = "]" if j + 1 == len(edges) else ")"
    return f"[{edges[j]:g}, {hi:g}{close}"
