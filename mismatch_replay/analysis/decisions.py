"""The report's Decision section: choose, compare and drift on one log, sharing passes.

Design
------
`decisions` answers the three questions users bring (which eps masks the target fraction,
which tokens IPO and IcePop mask at their defaults and at an equal budget, did the run
drift) by calling `choose`, `compare` (twice) and `drift`. `report_data` answers the same
and builds the figure data and the inspect summary in two reads of the log. One read feeds
two Tallies (`engine.replay_together`) and inspect's checks. The full sweep also holds
choose's first grids, the two compared settings and the chosen settings, and keeps its
tail, so that choose's refinement and bootstrap, both compare tables (the budget pair at
the settings choose found), the chosen settings' table per q bucket
(`TailCounts.by_q_bucket`) and per step are counted from the kept tokens (tail_counts.py).
The other Tally is by step, robust, with no job: its metrics and k3 histograms are drift's,
and the chosen settings per step are attached to it from the tail
(`TailCounts.attach_by_step`: the masked-sequence and prompt-group counts too). Where the
replay keeps no tail (the simple path, a float32 replay) the shared read holds the per-step
and per-bucket Tallies with their jobs instead, and where a tail cannot say, their own
replays run: the same tables either way (tests/test_tail.py). The second read is the
by-length replay of masked_by_length.png, on the few columns of
`figure_data.LENGTH_SETTINGS`, with each sequence's length from the first read (none where
the log has no sample_id): a length bucket needs every sequence's length before its first
token is counted, so no Tally of the first read can hold it. Both return a `Decisions`.

The rules given drive every answer (`decision_rules`): choose chooses a threshold for each
of them, compare takes the first two that mask tokens (token or sequence rules: none, or
one, and the section says why there is no comparison), drift watches the given mask rules,
masked_by_length buckets the given token and sequence mask rules, and the sweep table
(sweep.csv) holds the rules given as `sweep -r` does (`figure_data.sweep_plan`: a bare
name over its default grids, a setting one row; the presets table still counts every
catalogue preset), and masked_fraction.png draws each setting on its curves
(`figure_data.curve_plan`: its jobs last in the same read, FigureData.curves). Only when
no rule is given do the defaults apply: prime-rl's IPO, IcePop [0.2, 5] and KPop chosen,
IPO against IcePop compared, `figure_data.LENGTH_SETTINGS` by length, every rule the log
supports swept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, fast, ingest
from ..engine import readout
from ..errors import DataError
from ..rules import Rule, TokenBatch, parse_rule
from .choose import Choice, ChooseResult, choose
from .compare import CompareResult, compare, compare_pass, compare_setup
from .drift import DriftResult, drift, drift_from, drift_rules
from .figure_data import (
    NO_LENGTH_NOTE,
    FigureData,
    cost_settings,
    curve_plan,
    curve_table,
    default_settings,
    length_rules,
    length_table,
    sweep_plan,
)
from .mask_cost import cost_table
from .search import choice_jobs, first_jobs, job_key, tail_fraction
from .tail_counts import TailCounts

DECISION_RULES = ("ipo", "icepop@prime-rl", "kpop@prime-rl")
BUDGET_PAIR = ("ipo", "icepop@prime-rl")
BY_STEP = {"by": "step", "robust": True, "scatter": False}  # the report's per-step Tally


@dataclass
class Decisions:
    """The Decision section's answers (drift None, with a note, on a single-step log)."""

    target_fraction: float
    choose: ChooseResult
    compare: CompareResult | None  # the pair at its settings (None: fewer than two rules)
    compare_budget: CompareResult | None  # both at the target fraction
    drift: DriftResult | None
    drift_note: str | None = None
    pair: tuple[str, str] | None = None  # the compared SPECs, as given
    compare_note: str | None = None  # why there is no comparison
    given: bool = False  # the rules were the user's (else the defaults)

    def to_dict(self) -> dict:
        d = {
            "target_fraction": self.target_fraction,
            "choose": [c.to_dict() for c in self.choose],
            "compare": None if self.compare is None else self.compare.to_dict(),
            "compare_budget": None
            if self.compare_budget is None
            else self.compare_budget.to_dict(),
            "drift": None if self.drift is None else self.drift.to_dict(),
            "pair": None if self.pair is None else list(self.pair),
        }
        if self.drift_note is not None:
            d["drift_note"] = self.drift_note
        if self.compare_note is not None:
            d["compare_note"] = self.compare_note
        return d


def decisions(
    sources: Sequence[str | Path],
    target_fraction: float = 0.0025,
    bootstrap: int = 200,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    settings: Sequence[str | Rule] | None = None,
) -> Decisions:
    """The three questions of the report's Decision section, on one log: which threshold
    masks the target fraction (choose), which tokens two rules mask at their settings and at
    an equal budget (compare, at the settings choose found), and whether the run drifted
    (drift; needs several steps), for the rules given (`settings`; else prime-rl's IPO,
    IcePop and KPop: `decision_rules`). `report_data` answers the same sharing the report's
    passes."""
    plan = ingest.plan_sources(sources, options)
    given = [parse_rule(r) if isinstance(r, str) else r for r in settings or []]
    rules = decision_rules(plan.columns, given)[0]
    chosen = choose(
        plan.files,
        target_fraction,
        rules,
        bootstrap=bootstrap,
        options=options,
        progress=progress,
    )
    # a rule with no default threshold is compared and watched at the value chosen
    _, pair, why, watched = decision_rules(plan.columns, resolve(given, chosen, []))
    at_defaults = at_budget = None
    if pair is not None:
        at_defaults = compare(plan.files, *pair, examples=5, options=options, progress=progress)
        at_budget = compare(
            plan.files,
            *_at_budget(pair, given),
            budget=target_fraction,
            examples=5,
            options=options,
            progress=progress,
            budget_settings=_budget_pair(chosen, _at_budget(pair, given)),
        )
    note = None
    try:
        drifted = drift(plan.files, watched, options=options, progress=progress)
    except DataError as exc:  # a single-step log: no drift to speak of
        drifted, note = None, str(exc)
    names = None if pair is None else (pair[0].spec(), pair[1].spec())
    return Decisions(
        target_fraction, chosen, at_defaults, at_budget, drifted, note, names, why, bool(given)
    )


def decision_rules(
    columns: Sequence[str], settings: Sequence[Rule] | None
) -> tuple[list[Rule], tuple[Rule, Rule] | None, str | None, list[Rule] | None]:
    """What the Decision section asks, from the rules given (`settings`; None or empty: the
    defaults): (the rules choose chooses for, the compared pair or None, why there is no
    pair, the rules drift watches: None for its defaults). A given rule the log cannot
    support (a column it needs) is left out of choose and compare."""
    if not settings:
        rules = [parse_rule(r) for r in DECISION_RULES]
        rules = [r for r in rules if all(c in columns for c in r.needs)]
        pair = (parse_rule("ipo@prime-rl"), parse_rule(BUDGET_PAIR[1]))
        return rules, pair, None, None
    rules = [r for r in settings if all(c in columns for c in r.needs)]
    masks = [r for r in rules if r.kind == "mask" and r.level in ("token", "sequence")]
    pair = (masks[0], masks[1]) if len(masks) >= 2 else None
    note = None
    if pair is None:
        have = ", ".join(r.spec() for r in masks) or "none"
        note = (
            "compare needs two rules that mask tokens (token or sequence rules; weight rules "
            f"such as TIS truncate and mask none); the rules given have {len(masks)} "
            f"({have}). Give another --rule to compare them."
        )
    watched = [r for r in rules if r.kind == "mask"]
    return rules, pair, note, watched


_PROBE = TokenBatch(  # two tokens, one near p = 1: a rule's score must be defined on them
    np.array([-0.1, -1e-12]), np.array([-0.2, -1e-9]), np.array([1.0, -1.0])
)


def preset_rules(columns: Sequence[str]) -> list[Rule]:
    """Every catalogue preset (a rule's default where it has none) at its values, in the
    stable form (the sweep's arithmetic), one per distinct setting; token and sequence rules
    the log supports (m2po, per step, has its own figure)."""
    from ..rules import REGISTRY

    out: dict[str, Rule] = {}
    for cls in REGISTRY.values():
        if cls.level not in ("token", "sequence") or any(c not in columns for c in cls.needs):
            continue
        for vals in [*cls.presets.values()] or [{}]:
            try:
                r = cls(**vals)
                job = engine.single_job(r)
                if r.level == "token":  # a stable form that cannot score (clamp 0): left out
                    r.score(_PROBE, job.param)
            except Exception:  # a rule with no default threshold (token-k2: user sets)
                continue
            out.setdefault(r.spec(), r)
    return list(out.values())


def _preset_fractions(table: pl.DataFrame) -> dict[str, float]:
    """spec -> the exact masked (weight rules: truncated) fraction of each one-value row of
    the full replay's table (the presets and chosen settings among them)."""
    out: dict[str, float] = {}
    if table.height == 0 or "spec" not in table.columns:
        return out
    for r in table.iter_rows(named=True):
        col = "truncated_fraction" if r["kind"] == "weight" else "masked_fraction"
        if r[col] is not None:
            out.setdefault(r["spec"], float(r[col]))
    return out


def _unset(rule: Rule) -> bool:
    """A rule with a parameter that has no default (verl's token-k2 / token-k3: the user
    sets hi): choose can answer for it, no figure or table can show it at a setting."""
    return any(v is None for v in rule.values().values())


def resolve(rules: Sequence[Rule], choices: Sequence[Choice], notes: list[str]) -> list[Rule]:
    """The rules at a setting: each unset one (`_unset`) at the value choose found for the
    target (a note says so); one choose could not set is left out, with a note."""
    out = []
    for r in rules:
        if not _unset(r):
            out.append(r)
            continue
        head = r.spec().partition(":")[0]
        vals = {}
        for k in (k for k, v in r.values().items() if v is None):
            hit = [
                c
                for c in choices
                if c.rule == r.name
                and c.param == k
                and c.spec.partition(":")[0] == head
                and c.status != "out of range"
            ]
            if hit:
                vals[k] = hit[0].value
        if vals and all(v is not None for v in r.replace(**vals).values().values()):
            got = r.replace(**vals)
            out.append(got)
            notes.append(
                f"{head} has no default threshold: its figures and tables show it at the "
                f"value choose found for the target, {got.spec()}."
            )
        else:
            notes.append(
                f"{head} has no default threshold and choose found none for the target: "
                f"left out of the figures (give one: --rule {head}:PARAM=VALUE)."
            )
    return out


def _at_budget(pair: tuple[Rule, Rule], given) -> tuple[Rule, Rule]:
    """The pair compared at the budget: the given pair, or by default BUDGET_PAIR (IPO in
    the stable form choose searched, and prime-rl's IcePop)."""
    return pair if given else (parse_rule(BUDGET_PAIR[0]), parse_rule(BUDGET_PAIR[1]))


def _budget_pair(
    rows: Sequence[Choice], names: Sequence[str | Rule]
) -> tuple[Choice, Choice] | None:
    """choose's rows for the two rules' primary parameters (compare --budget's settings)."""
    out = []
    for spec in names:
        rule = parse_rule(spec) if isinstance(spec, str) else spec
        param = rule.primary_param()
        head = rule.spec().partition(":")[0]  # name@preset: two presets of one rule differ
        hit = [
            r
            for r in rows
            if r.rule == rule.name
            and r.param == param
            and r.setting == rule.setting(param)
            and r.spec.partition(":")[0] == head
        ]
        if not hit or hit[0].status == "out of range":
            return None
        out.append(hit[0])
    return out[0], out[1]


def _bucket_table(plan, full, by_bucket, chosen, progress) -> pl.DataFrame:
    """The chosen settings' table by q bucket: the shared read's Tally of it, else from the
    full replay's tail, else (the tail cannot say) a replay of its own."""
    if by_bucket:
        return by_bucket[0].result().table
    tc = TailCounts.of(full)
    tally = tc.by_q_bucket(chosen) if tc is not None else None
    if tally is not None:
        return readout.sweep_table(tally)
    by = engine.replay(
        plan, rules=chosen, by="q_bucket", progress=progress, final=True, scatter=False
    )
    return by.result().table


def _length_table(plan, full, rules, progress) -> pl.DataFrame | None:
    """LENGTH_SETTINGS by sequence-length bucket (None without sample_id): from the shared
    read's sequences and tail (`TailCounts.by_length`), else a replay of its own, each
    sequence's length from the shared read where it dropped no row (with --drop-invalid,
    which rows drop depends on the columns read: that replay's pre-pass then)."""
    if not rules:
        return None
    clean = full.has_seq and not full.report.dropped
    tc = TailCounts.of(full) if clean else None
    tally = tc.by_length(rules) if tc is not None else None
    if tally is not None:
        return readout.sweep_table(tally)
    lengths = (dict(full.seq_keys), full.seq_stats().n.copy()) if clean else None
    return length_table(plan, progress, lengths, rules)


def report_data(
    sources: Sequence[str | Path],
    settings: Sequence[str | Rule] | None = None,
    target_fraction: float = 0.0025,
    bootstrap: int = 200,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
    summary: dict | None = None,
    on_sweep: Callable[[pl.DataFrame], None] | None = None,
) -> tuple[FigureData, Decisions]:
    """`figure_data` and `decisions` together, from ONE read of the log for all but the
    by-length figure (`engine.replay_together`, the module docstring): the full sweep
    keeping its tail (choose, both compares and the chosen settings per q bucket and per
    step are counted from it), a robust Tally by step (drift's metrics), and inspect's
    checks of the same batches (into `summary["summary"]` when a dict is given). The
    by-length table is its own replay, with each sequence's length from the first read
    (none without sample_id). A tail that does not settle something (the simple path, a
    float32 replay) costs the pass it replaces. `on_sweep(table, curves)` is called with the
    sweep table and masked_fraction's own (FigureData.sweep and .curves, the same objects:
    `figure_data.curve_table`, None where no rule is given) as soon as the read has made
    them (the report starts drawing masked_fraction then, in another process)."""
    from .inspect import Checks, summarize

    plan = ingest.plan_sources(sources, options)
    given = [parse_rule(s) if isinstance(s, str) else s for s in settings or []]
    chosen = given or default_settings(plan.columns)
    # the rules given drive every answer; the defaults only where none are (decision_rules)
    names = decision_rules(plan.columns, given)[0]
    # what the read holds at a setting: the rules with every parameter set (an unset one,
    # token-k3@verl, is shown at choose's value once choose has answered: `resolve`)
    settable = [r for r in chosen if not _unset(r)]
    _, pair0, _, watched0 = decision_rules(plan.columns, [r for r in given if not _unset(r)])
    lengths = length_rules(plan.columns, settable if given else None)
    unit = "sequence" if "sample_id" in plan.columns else "step"
    with engine.use_precision(precision):
        p = engine.current_precision()
        if p is not None:  # --precision: the rules the tail and the grouped tables read too
            chosen = [r.replace(precision=p) for r in chosen]
            settable = [r.replace(precision=p) for r in settable]
            lengths = [r.replace(precision=p) for r in lengths]
        sweep_jobs, notes = sweep_plan(plan.columns, settings)  # the rules given, as sweep -r
        # masked_fraction's own lines (the rules given at a setting: their curves), read
        # in the same pass after every other job
        curves = curve_plan(plan.columns, settings, sweep_jobs, chosen if given else None)
        curve_jobs = curves.jobs if curves is not None else []
        cjobs = choice_jobs(names, True)  # shaped on the 1st batch
        pair_jobs = [engine.single_job(r) for r in pair0 or ()]
        # the chosen settings at their values: the tail then keeps their masked tokens,
        # which give the by-bucket table (TailCounts.by_q_bucket) with no Tally of its own
        set_jobs = [engine.single_job(r) for r in settable if r.level == "token"]
        # ... and the by-length settings (a sequence rule's sums: verl's clamped ones)
        set_jobs += [engine.single_job(r) for r in lengths]
        # every catalogue preset at its values: the report's presets table, exact
        set_jobs += [engine.single_job(r) for r in preset_rules(plan.columns)]
        if p is not None:
            sweep_jobs = engine.with_precision(sweep_jobs, p)
            cjobs = engine.with_precision(cjobs, p)
            pair_jobs = engine.with_precision(pair_jobs, p)
            set_jobs = engine.with_precision(set_jobs, p)
            curve_jobs = engine.with_precision(curve_jobs, p)
        have = {job_key(j) for j in sweep_jobs}
        extra = []
        for j in [*pair_jobs, *set_jobs]:
            if job_key(j) not in have:
                have.add(job_key(j))
                extra.append(j)
        n0 = len(sweep_jobs)

        def shape(sample):  # choose's first grids, placed when the first batch comes
            first = first_jobs(cjobs, target_fraction, sample)
            return [*sweep_jobs, *first, *extra, *curve_jobs]

        watched = drift_rules(plan.columns) if watched0 is None else watched0
        if p is not None:
            watched = [r.replace(precision=p) for r in watched]
        specs = {r.spec() for r in settable}
        step_rules = settable + [r for r in watched if r.spec() not in specs]
        checks = Checks(plan.columns)
        tail = engine.Tail(tail_fraction(target_fraction), count_steps=unit == "step")
        # the by-bucket table and the settings per step from the tail where the replay
        # will keep one (the fused path); else, or if it then cannot say, Tallies of their own
        from_tail = p in (None, "float64") and fast.backend() == "numba"
        bucket_part = {"rules": settable, "by": "q_bucket", "scatter": False}
        step_part = BY_STEP | ({"jobs": []} if from_tail else {"rules": step_rules})
        full, by_step, *by_bucket = engine.replay_together(
            plan,
            [
                {
                    "jobs": [*sweep_jobs, *cjobs, *extra, *curve_jobs],
                    "tail": tail,
                    "shape": shape,
                },
                step_part,
                *([] if from_tail else [bucket_part]),
            ],
            progress=progress,
            final=True,
            observers=[checks],
        )
        full.notes = [*notes, *full.notes]
        res = full.result()
        table = res.table
        presets = _preset_fractions(table)
        mask_cost = cost_table(table, cost_settings(plan.columns, settable))  # one-value rows
        figure_table = curve_table(table, full.jobs, curves)  # the figure's own jobs: last
        if len(full.jobs) > n0:  # in job order: the sweep's jobs first, then choose's and the rest
            table = table.head(sum(len(j.values) for j in full.jobs[:n0]))
        if on_sweep is not None:
            on_sweep(table, figure_table)
        choices = choose(
            plan.files,
            target_fraction,
            names,
            bootstrap=bootstrap,
            options=options,
            progress=progress,
            tally=full,
            curve=True,
        )
        set_notes: list[str] = []
        resolved = resolve(chosen, choices, set_notes)
        moved = len(resolved) != len(settable) or any(_unset(r) for r in chosen)
        if moved:  # the rules choose set: the answers below are for them
            _, pair, why, watched_r = decision_rules(plan.columns, resolved if given else [])
            watched = drift_rules(plan.columns) if watched_r is None else watched_r
            chosen = resolved
            specs = {r.spec() for r in chosen}
            step_rules = chosen + [r for r in watched if r.spec() not in specs]
            lengths = length_rules(plan.columns, chosen if given else None)
        else:
            _, pair, why, _ = decision_rules(plan.columns, given)
        buckets = _bucket_table(plan, full, [] if moved else by_bucket, chosen, progress)
        if from_tail or moved:  # the settings per step from the tail too, else a replay
            tc = TailCounts.of(full) if from_tail else None
            if tc is None or not tc.attach_by_step(step_rules, by_step):
                by_step = engine.replay(
                    plan, rules=step_rules, progress=progress, final=True, **BY_STEP
                )
        steps = by_step.result().table
        if len(step_rules) > len(chosen):
            steps = steps.filter(pl.col("spec").is_in(list(specs)))
        at_defaults = at_budget = None
        if pair is not None:
            pairs = [
                compare_setup(plan, *pair, None, None, None, progress),
                compare_setup(
                    plan,
                    *_at_budget(pair, given),
                    target_fraction,
                    None,
                    _budget_pair(choices, _at_budget(pair, given)),
                    progress,
                ),
            ]
            at_defaults, at_budget = compare_pass(plan, pairs, 5, progress, full)
        by_length = _length_table(plan, full, lengths, progress)
    if summary is not None:
        summary["summary"] = summarize(plan, by_step, full, checks)
    drift_specs = {r.spec() for r in watched}
    which = [ji for ji, j in enumerate(by_step.jobs) if j.rule.spec() in drift_specs]
    n_steps = len(by_step.groups)
    drifted = note = None
    if n_steps < 2:
        note = (
            f"{plan.files[0]}: drift needs several steps; the log has {n_steps} "
            "(map a step column with --map step=COLUMN)."
        )
    else:
        drifted = drift_from(plan, by_step, which, 3.0, None, 3)
    data = FigureData(
        hist_lin=full.hist_lin,
        hist_log=full.hist_log,
        edges_lin=engine.scatter_edges(log=False),
        edges_log10=engine.scatter_edges(log=True),
        sweep=table,
        settings=chosen,
        steps=steps,
        step_metrics=by_step.metrics.table("step", by_step.groups),
        buckets=buckets,
        metrics=res.metrics.to_dicts()[0],
        tokens=full.report.loss_rows,
        sources=[str(x) for x in plan.files],
        notes=list(full.notes) + set_notes + ([NO_LENGTH_NOTE] if by_length is None else []),
        by_length=by_length,
        given=bool(given),
        presets=presets,
        mask_cost=mask_cost,
        curves=figure_table,
    )
    names_ = None if pair is None else (pair[0].spec(), pair[1].spec())
    dec = Decisions(
        target_fraction, choices, at_defaults, at_budget, drifted, note, names_, why, bool(given)
    )
    return data, dec
