"""What a report produced, in the form the loggers take: paths, tables, per-step series.

Design
------
The W&B and TensorBoard loggers never draw and never read tokens: they take a
`ReportOutputs`, the figures (PNG paths), the HTML page, the sweep table, the choose rows
and the per-step series of a report, and forward them. `collect(outdir, data, decisions)`
builds one from what `viz.jobs.report` already computed (its `analysis.FigureData` and
`analysis.decisions`); given only the report directory it picks up the page and the figures,
and with `sources` it recomputes the figure data (three passes over the log) when the report's
own data is not at hand.

The per-step series is one row per trainer step (wide, as trackers plot it): the mismatch
metrics of `FigureData.step_metrics` (`kl_k3` is prime-rl's `mismatch_kl/all/mean`, ...) and,
per chosen setting, its masked fraction (`masked_fraction/<spec>`; weight rules:
`truncated_fraction/<spec>`). Steps are the log's own step numbers, so a tracker can plot
them against the training run's steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

FIGURE_NAMES = (
    "scatter",
    "masked_fraction",
    "steps",
    "where_masked",
    "masked_by_length",
    "masked_direction",  # where the log has an advantage column
)
INDEX = "index.html"


@dataclass
class ReportOutputs:
    """The pieces of a report that trackers log (any may be missing)."""

    html: Path | None = None  # the self-contained page
    figures: dict[str, Path] = field(default_factory=dict)  # name -> PNG
    sweep: pl.DataFrame | None = None  # the long sweep table (rule, param, value, ...)
    steps: pl.DataFrame | None = None  # per-step series: step + one column per series
    choose: list[dict] = field(default_factory=list)  # analysis.choose rows, as dicts
    metrics: dict = field(default_factory=dict)  # overall mismatch metrics
    sources: list[str] = field(default_factory=list)
    command: str | None = None

    @property
    def last_step(self) -> int | None:
        if self.steps is None or self.steps.height == 0:
            return None
        return int(self.steps["step"].max())


def _fraction(kind: str) -> str:
    return "truncated_fraction" if kind == "weight" else "masked_fraction"


def step_series(data) -> pl.DataFrame:
    """The per-step series of a FigureData: step, the mismatch metrics, and one
    `masked_fraction/<spec>` (or `truncated_fraction/<spec>`) column per chosen setting."""
    out = data.step_metrics.sort("step")
    t = data.steps
    if t.height and "step" in t.columns:
        for spec in t["spec"].unique(maintain_order=True).to_list():
            part = t.filter(pl.col("spec") == spec)
            col = _fraction(part["kind"][0])
            name = f"{col}/{spec}"
            out = out.join(part.select("step", pl.col(col).alias(name)), on="step", how="left")
    return out


def collect(
    outdir: str | Path | None = None,
    data=None,
    decisions=None,
    *,
    sources: Sequence[str | Path] | None = None,
    settings: Sequence[str] | None = None,
    options=None,
    command: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReportOutputs:
    """A ReportOutputs from a report directory (`index.html`, `<figure>.png`) and, when at
    hand, the report's FigureData (`data`) and `analysis.Decisions` (`decisions`). Without
    `data`, `sources` recomputes it (`analysis.figure_data`: three passes over the log)."""
    out = ReportOutputs(command=command)
    if outdir is not None:
        d = Path(outdir)
        if (d / INDEX).is_file():
            out.html = d / INDEX
        out.figures = {n: d / f"{n}.png" for n in FIGURE_NAMES if (d / f"{n}.png").is_file()}
    if data is None and sources:
        from .. import analysis

        data = analysis.figure_data(sources, settings, options=options, progress=progress)
    if data is not None:
        out.sweep = data.sweep
        out.steps = step_series(data)
        out.metrics = {k: v for k, v in data.metrics.items() if _finite(v)}
        out.sources = list(data.sources)
    if decisions is not None:
        out.choose = [c.to_dict() for c in decisions.choose]
    return out


def _finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def clean(v):
    """A table cell for a tracker: NaN and infinities become None (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def series_rows(steps: pl.DataFrame) -> list[tuple[int, dict[str, float]]]:
    """(step, {series: value}) per step, finite values only."""
    cols = [c for c in steps.columns if c != "step"]
    rows = []
    for r in steps.sort("step").iter_rows(named=True):
        vals = {c: float(r[c]) for c in cols if _finite(r[c])}
        rows.append((int(r["step"]), vals))
    return rows


__all__ = ["FIGURE_NAMES", "ReportOutputs", "clean", "collect", "series_rows", "step_series"]
