"""Questions over Tallies: the data behind the figures (and, later, choose / compare / drift).

Design
------
Functions here take sources or Tallies and return tables and arrays; they never draw. The
figure data needs three views of a log: every rule swept over its grid (ungrouped, with the
scatter histograms), the chosen settings per step, and the chosen settings per inference-
probability bucket. Each view is one streaming pass of the engine (three passes in all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from . import engine, io
from .rules import Rule, parse_rule

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
) -> FigureData:
    """Three passes over the log: full sweep + scatter, settings by step, settings by bucket."""
    plan = io.plan_sources(sources, options)
    chosen = (
        [parse_rule(s) if isinstance(s, str) else s for s in settings]
        if settings
        else default_settings(plan.columns)
    )
    full = engine.replay(plan, rules=None, sweeps=sweeps, progress=progress)
    res = full.result()
    by_step = engine.replay(plan, rules=chosen, by="step", progress=progress)
    by_bucket = engine.replay(plan, rules=chosen, by="q_bucket", progress=progress)
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
