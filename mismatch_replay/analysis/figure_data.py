"""The data behind the figures: three views of a log, no raw tokens kept.

Design
------
`figure_data` makes four replays of the log: the sweep (`sweep_plan`: the rules given, as
`sweep -r` reads them, else every rule the log supports over its default grids; with the
scatter histograms: 200 x 200 token counts on probability and on log10-probability
axes), the chosen settings per step, the chosen settings per inference-probability
bucket, and `LENGTH_SETTINGS` per sequence-length bucket (`length_table`: only where the
log has sequence ids; that replay reads the log twice, its pre-pass counting each
sequence's loss tokens). The settings default to `DEFAULT_SETTINGS` (the two IPO defaults,
the two IcePop bands, KPop, DPPO-TV) minus those the log cannot support. `FigureData` is
what viz draws and what the report's tables read; `decisions.report_data` builds the same
record sharing its passes with the Decision section.

masked_fraction.png does not follow the sweep where a rule is given at a setting: one row
(`ipo@prime-rl`: eps 0.3) is a dot on an empty axis that tells a reader nothing. Its own
table (`FigureData.curves`: `curve_plan`, `curve_table`) holds each given setting's
threshold parameters over their default grids with its other parameters at its values
(121 values a parameter, the setting's own value added so that its marker is an exact
count), read as more jobs of the sweep's pass; a bare name or an unset threshold is its
sweep rows as they are, and where only those are given (or none) the figure draws the
sweep. Two settings on one line share it (the first one's arithmetic and precision).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, ingest
from ..errors import DataError
from ..present import Presentable
from ..rules import Rule, parse_grid, parse_rule
from ..rules.spec import is_bare, sweep_specs
from . import summaries
from .mask_cost import COST_PRESETS, cost_table

# The settings drawn by default: the two IPO defaults, the two IcePop bands, KPop, DPPO-TV.
DEFAULT_SETTINGS = (
    "ipo@prime-rl",
    "ipo@prime-rl-legacy",
    "icepop@prime-rl",
    "icepop@verl",
    "kpop@prime-rl",
    "dppo-tv@prime-rl",
)
# The settings of masked_by_length.png (`--by length`): two product-ratio sequence masks
# (verl's [0.5, 2], TRL's cap 3: trl#4772), a geometric-mean one (SkyRL's [0.99, 1.01]) and
# a token rule for reference. A product exp(S_i) drifts with a sequence's length, a mean
# exp(G_i) does not: the figure tells them apart.
LENGTH_SETTINGS = ("seq-mis@verl", "seq-mis@trl", "geo-mis@skyrl", "icepop@verl")
NO_LENGTH_NOTE = (
    "masked_by_length: not drawn, the log has no sequence ids (sample_id) to bucket "
    "sequences by length; map one with --map sample_id=COLUMN."
)


@dataclass
class FigureData(Presentable):
    """Everything the figures draw, computed from a log (no raw tokens kept); `.table`: the
    full sweep (`sweep`)."""

    hist_lin: np.ndarray  # (200, 200) token counts, [q bin, p bin], probability axes
    hist_log: np.ndarray  # (200, 200) token counts, [log10 q bin, log10 p bin]
    edges_lin: np.ndarray  # (201,) probability bin edges
    edges_log10: np.ndarray  # (201,) log10-probability bin edges
    sweep: pl.DataFrame  # the sweep (ungrouped): the rules given (`sweep_plan`), else all
    settings: list[Rule]  # the chosen settings (IPO eps, IcePop band, ...)
    steps: pl.DataFrame  # the chosen settings' sweep table by step
    step_metrics: pl.DataFrame  # mismatch metrics by step
    buckets: pl.DataFrame  # the chosen settings' sweep table by q_bucket
    metrics: dict  # overall mismatch metrics
    tokens: int
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # LENGTH_SETTINGS' sweep table by length bucket (None: the log has no sample_id)
    by_length: pl.DataFrame | None = None
    given: bool = False  # `settings` are the rules the user gave (else DEFAULT_SETTINGS)
    # spec -> exact masked (truncated) fraction at each catalogue preset (report_data)
    presets: dict[str, float] = field(default_factory=dict)
    # what each setting's mask costs (analysis/mask_cost.py: the chosen settings and
    # COST_PRESETS, one row each; None: the log has no advantage column)
    mask_cost: pl.DataFrame | None = None
    # masked_fraction.png's own table where rules are given (`curve_table`: each given
    # setting's curves over the default grid, its point marked); None: the figure draws
    # `sweep`
    curves: pl.DataFrame | None = None

    @property
    def table(self) -> pl.DataFrame:
        return self.sweep

    def to_dict(self) -> dict:
        """The tables as rows and the scalars (the histograms as nested lists)."""
        frames = ("sweep", "steps", "step_metrics", "buckets", "by_length", "mask_cost", "curves")
        d = {k: None if getattr(self, k) is None else getattr(self, k).to_dicts() for k in frames}
        d.update(metrics=dict(self.metrics), tokens=self.tokens, sources=list(self.sources))
        d.update(settings=[r.spec() for r in self.settings], notes=list(self.notes))
        d.update(hist_lin=self.hist_lin.tolist(), hist_log=self.hist_log.tolist())
        return d

    def summary_lines(self) -> list[str]:
        return summaries.figure_lines(self)


def default_settings(columns: Sequence[str]) -> list[Rule]:
    """DEFAULT_SETTINGS minus the rules the log cannot support."""
    rules = [parse_rule(s) for s in DEFAULT_SETTINGS]
    return [r for r in rules if all(c in columns for c in r.needs)]


def sweep_plan(
    columns: Sequence[str],
    settings: Sequence[str | Rule] | None = None,
    sweeps: dict[str, str] | None = None,
) -> tuple[list[engine.Job], list[str]]:
    """The sweep table's jobs and notes, as `sweep -r` plans them (`rules.sweep_specs`, then
    `engine.plan_jobs`): no settings, every rule the log supports, each threshold parameter
    over its default grid; else the rules given alone: a bare name (`ipo`) its threshold
    parameters over their default grids, a SPEC with values or a preset (`ipo:eps=0.3`,
    `ipo@prime-rl`) or a Rule one row. A preset that leaves a threshold unset
    (`token-k3@verl`, which the report's choose sets) has that threshold over its default
    grid (the rows of `sweep -r token-k3@verl --sweep token-k3.hi=GRID`). `sweeps`: as
    `sweep --sweep`, over the rules given together (an unset threshold must be among them)."""
    if not settings:
        return engine.plan_jobs(None, sweeps, columns)
    specs = sweep_specs(settings)
    if sweeps:
        return engine.plan_jobs(specs, sweeps, columns)
    jobs: list[engine.Job] = []
    for s in specs:  # one by one: an unset threshold's grid is its own rule's alone
        rule = parse_rule(s) if isinstance(s, str) else s
        unset = {}
        if isinstance(rule, Rule):
            values = rule.values()
            unset = {
                f"{rule.name}.{p.name}": p.grid
                for p in rule.params
                if p.threshold and values.get(p.name) is None
            }
        jobs += engine.plan_jobs([rule], unset or None, columns)[0]
    return jobs, []  # rules given: no rule is skipped, so no note (a lacking column raises)


def setting_label(rule: Rule) -> str:
    """How masked_fraction.png names a given setting: `name@preset` where the rule is that
    preset's values, else its SPEC (`ipo:eps=0.3`, `icepop@verl:low=0.3,high=5`)."""
    if rule.preset:
        with contextlib.suppress(Exception):
            if parse_rule(f"{rule.name}@{rule.preset}").values() == rule.values():
                return f"{rule.name}@{rule.preset}"
    return rule.spec()


@dataclass
class CurvePlan:
    """masked_fraction.png's own lines where rules are given (`curve_plan`), in draw order:
    each the rows of one of the sweep's jobs (`("sweep", i)`: a bare name's grid, an unset
    threshold's) or of a job of the figure's own (`("own", k)`: `jobs[k]`, replayed in the
    same read after every other job), whether the line is a given setting's (its markers
    are the settings', not the catalogue presets), and per line the given settings' points
    on it (value -> their labels)."""

    lines: list[tuple[str, int]]
    given: list[bool]
    marks: list[dict[float, list[str]]]
    jobs: list[engine.Job]


def curve_plan(
    columns: Sequence[str],
    settings: Sequence[str | Rule] | None,
    sweep_jobs: Sequence[engine.Job],
    rules: Sequence[Rule] | None = None,
) -> CurvePlan | None:
    """The lines masked_fraction.png draws where rules are given (None where none are: the
    figure draws the sweep, every rule). The sweep table (`sweep_plan`) holds one row for a
    setting; the figure keeps the curves as context. For each rule given at a setting
    (`name:p=v`, `name@preset`, a Rule), each threshold parameter over its default grid
    with the other parameters at the setting's values (the lines the default sweep draws
    for the rule's defaults), the setting's own value a grid point (exact: a filled marker,
    the count the sweep's row has); a bare name or an unset threshold: its sweep job's
    rows as they are (bare names alone: None, the sweep is the figure's). Settings that
    fall on one line (icepop@prime-rl and icepop@verl on
    `low` with high=5) share it, at the first one's arithmetic and precision. `rules`: the
    settings as parsed (precision applied), in the order given."""
    if not settings:
        return None
    parsed = (
        list(rules)
        if rules is not None
        else [parse_rule(s) if isinstance(s, str) else s for s in settings]
    )
    keys: dict[tuple, int] = {}  # (rule, param, setting) -> line
    lines: list[tuple[str, int]] = []
    given: list[bool] = []
    marks: list[dict[float, list[str]]] = []
    own: list[tuple[Rule, str, list[float]]] = []  # a line of its own: rule, param, values
    placed: set[int] = set()

    def add_sweep(name: str) -> None:
        for i, j in enumerate(sweep_jobs):
            if i in placed or j.rule.name != name or len(j.values) < 2:
                continue
            placed.add(i)
            key = (j.rule.name, j.param, j.rule.setting(j.param))
            if key not in keys:
                keys[key] = len(lines)
                lines.append(("sweep", i))
                given.append(False)
                marks.append({})

    for spec, rule in zip(settings, parsed, strict=True):
        if is_bare(spec) or any(v is None for v in rule.values().values()):
            add_sweep(rule.name)
            continue
        label = setting_label(rule)
        for p in rule.params:
            if not p.threshold:
                continue
            v = float(getattr(rule, p.name))
            grid = parse_grid(p.grid)
            key = (rule.name, p.name, rule.setting(p.name))
            at = keys.get(key)
            if at is None:
                at = keys[key] = len(lines)
                lines.append(("own", len(own)))
                given.append(False)
                marks.append({})
                own.append((rule, p.name, list(grid)))
            elif lines[at][0] == "sweep":  # a bare name's line: its grid, the value added
                j = sweep_jobs[lines[at][1]]
                lines[at] = ("own", len(own))
                own.append((j.rule, j.param, list(j.values)))
            given[at] = True
            values = own[lines[at][1]][2]
            if not np.isfinite(v) or (v <= 0 < min(values)):  # "off" (cispo's low 0)
                continue
            close = [x for x in values if math.isclose(x, v, rel_tol=1e-9, abs_tol=0.0)]
            if close:  # the grid's point is the setting's value, exactly
                values.remove(close[0])
            values.append(v)
            marks[at].setdefault(v, []).append(label)
    if not any(given):  # bare names alone: the figure draws the sweep, as it holds them
        return None
    jobs = []
    for rule, param, values in own:
        jobs.append(engine.Job(rule, param, np.unique(np.asarray(values, float))))
    for j in jobs:
        lacking = [c for c in j.rule.needs if c not in columns]
        if lacking:  # sweep_plan has refused it already; kept for a direct call
            raise DataError(f"rule '{j.rule.name}' needs the column(s) {', '.join(lacking)}.")
    return CurvePlan(lines, given, marks, jobs)


def curve_table(
    table: pl.DataFrame, jobs: Sequence[engine.Job], plan: CurvePlan | None
) -> pl.DataFrame | None:
    """masked_fraction.png's table from the read's whole (ungrouped) table: the plan's
    lines, each its job's rows (`jobs`: the read's, the sweep's first and the figure's own
    last), with two columns: `given` (the line is a given setting's) and
    `mark` (the labels of the given settings at that row's value, else null). None
    without a plan."""
    if plan is None:
        return None
    ends = np.cumsum([len(j.values) for j in jobs])
    starts = ends - np.array([len(j.values) for j in jobs])
    first_own = len(jobs) - len(plan.jobs)
    parts = []
    for (where, k), is_given, at in zip(plan.lines, plan.given, plan.marks, strict=True):
        ji = k if where == "sweep" else first_own + k
        part = table.slice(int(starts[ji]), int(ends[ji] - starts[ji]))
        mark = [_labels_at(at, x) for x in part["value"].to_list()]
        parts.append(
            part.with_columns(given=pl.lit(is_given), mark=pl.Series("mark", mark, dtype=pl.String))
        )
    return pl.concat(parts, how="vertical_relaxed") if parts else None


def _labels_at(marks: dict[float, list[str]], x: float) -> str | None:
    """The labels of the settings at value x of a line ("a, b"), None where there is none."""
    for v, labels in marks.items():
        if math.isclose(x, v, rel_tol=1e-9, abs_tol=0.0):
            return ", ".join(labels)
    return None


def length_rules(columns: Sequence[str], given: Sequence[Rule] | None = None) -> list[Rule]:
    """The settings of masked_by_length: the token and sequence mask rules of `given` (the
    user's rules; the figure follows them), else LENGTH_SETTINGS; none where the log has no
    sequence ids (no length to bucket)."""
    if "sample_id" not in columns:
        return []
    if given:
        rules = [r for r in given if r.kind == "mask" and r.level in ("token", "sequence")]
    else:
        rules = [parse_rule(s) for s in LENGTH_SETTINGS]
    return [r for r in rules if all(c in columns for c in r.needs)]


def length_table(
    plan: ingest.Plan,
    progress: Callable[[int, int], None] | None = None,
    lengths: tuple[dict, np.ndarray] | None = None,
    rules: Sequence[Rule] | None = None,
) -> pl.DataFrame | None:
    """LENGTH_SETTINGS by sequence-length bucket (`engine.replay(by="length")`: a pre-pass
    that counts each sequence's loss tokens, unless `lengths` gives them, then the replay,
    both on the few columns these rules read); None where the log has no sample_id."""
    rules = length_rules(plan.columns) if rules is None else list(rules)
    if not rules:
        return None
    tally = engine.replay(
        plan,
        rules=rules,
        by="length",
        progress=progress,
        final=True,
        seq_lengths=lengths,
        scatter=False,
    )
    return tally.result().table


def figure_data(
    sources: Sequence[str | Path],
    settings: Sequence[str | Rule] | None = None,
    sweeps: dict[str, str] | None = None,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
) -> FigureData:
    """Four replays of the log: the sweep (`sweep_plan`: of the settings given, as `sweep
    -r`) + scatter, with masked_fraction's own lines where settings are given
    (`curve_plan`: their jobs in the same read), settings by step, settings by bucket,
    `LENGTH_SETTINGS` by sequence length (`length_table`; none without sample_id, a note).
    `precision="float32"`: every rule decision in the frameworks' float32 arithmetic
    (engine.replay; the full sweep then runs on the simple path)."""
    plan = ingest.plan_sources(sources, options)
    chosen = (
        [parse_rule(s) if isinstance(s, str) else s for s in settings]
        if settings
        else default_settings(plan.columns)
    )
    costed = cost_settings(plan.columns, chosen)
    with engine.use_precision(precision):
        # the sweep, and the settings whose mask cost the figure draws as one-value jobs
        sweep_jobs, sweep_notes = sweep_plan(plan.columns, settings, sweeps)
        extra = [engine.single_job(r) for r in costed if r.level != "step"]
        # masked_fraction's own lines (the rules given at a setting: their curves), last
        curves = None if sweeps else curve_plan(plan.columns, settings, sweep_jobs, chosen)
        own = curves.jobs if curves is not None else []
        full = engine.replay(plan, jobs=[*sweep_jobs, *extra, *own], progress=progress, final=True)
        full.notes = [*sweep_notes, *full.notes]
        res = full.result()
        cost = cost_table(res.table, costed)
        figure_table = curve_table(res.table, full.jobs, curves)
        res.table = res.table.head(sum(len(j.values) for j in full.jobs[: len(sweep_jobs)]))
        by_step = engine.replay(plan, rules=chosen, by="step", progress=progress, final=True)
        by_bucket = engine.replay(plan, rules=chosen, by="q_bucket", progress=progress, final=True)
        by_length = length_table(
            plan, progress, None, length_rules(plan.columns, settings and chosen)
        )
    notes = list(full.notes) + ([NO_LENGTH_NOTE] if by_length is None else [])
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
        notes=notes,
        by_length=by_length,
        given=bool(settings),
        mask_cost=cost,
        curves=figure_table,
    )


def cost_settings(columns: Sequence[str], chosen: Sequence[Rule]) -> list[Rule]:
    """The settings whose mask cost the report draws: the chosen ones (at a setting), then
    mask_cost.COST_PRESETS, those the log's columns support."""
    out = [r for r in chosen if all(v is not None for v in r.values().values())]
    out += [parse_rule(s) for s in COST_PRESETS]
    return [r for r in out if all(c in columns for c in r.needs) and r.level != "step"]
