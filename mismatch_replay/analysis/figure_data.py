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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from .. import engine, ingest
from ..present import Presentable
from ..rules import Rule, parse_rule
from ..rules.spec import sweep_specs
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

    @property
    def table(self) -> pl.DataFrame:
        return self.sweep

    def to_dict(self) -> dict:
        """The tables as rows and the scalars (the histograms as nested lists)."""
        frames = ("sweep", "steps", "step_metrics", "buckets", "by_length", "mask_cost")
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
    -r`) + scatter, settings by step, settings by bucket,
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
        full = engine.replay(plan, jobs=[*sweep_jobs, *extra], progress=progress, final=True)
        full.notes = [*sweep_notes, *full.notes]
        res = full.result()
        cost = cost_table(res.table, costed)
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
    )


def cost_settings(columns: Sequence[str], chosen: Sequence[Rule]) -> list[Rule]:
    """The settings whose mask cost the report draws: the chosen ones (at a setting), then
    mask_cost.COST_PRESETS, those the log's columns support."""
    out = [r for r in chosen if all(v is not None for v in r.values().values())]
    out += [parse_rule(s) for s in COST_PRESETS]
    return [r for r in out if all(c in columns for c in r.needs) and r.level != "step"]
