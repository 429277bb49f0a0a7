"""Whole jobs built from the library's parts: the figures, the HTML report, the demo.

Design
------
`plot`, `report` and `demo` are compositions: figure data (analysis.figure_data, four
replays), the decisions, the inspect summary, then drawing (`render.render_all`) and page
assembly (`report.write_report`, with `report.decision_html` as its Decision section).
`report` takes figure data, decisions and the inspect summary from `analysis.report_data`,
which reads the log once for all of them (on the fused path; elsewhere the grouped
tables take replays of their own), writes `sweep.csv` beside `index.html`, and drives one
progress bar through every pass (`Stages`); `plot` and `report` start a `pool.FigurePool`
(a second process that draws masked_fraction, which `report` sends it as soon as the
sweep is counted) where the machine has two cores; `plot` and `report` run inside
`gcpause.frozen()` (the collector's passes skip what existed before the job); `demo`
writes that summary as inspect.json. A log without sequence ids gets no masked_by_length
figure: `plot` warns (`FigureNote`), the report says so in the figure's place. They live
here rather than in the CLI so that a notebook gets the same result with one call, and the
CLI stays a thin formatter.

Existing outputs are never overwritten without `force`: every check happens before the
first pass over the log, so a refused call costs nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

from .. import analysis, engine, ingest
from ..analysis.figure_data import NO_LENGTH_NOTE
from ..errors import UsageError
from ..gcpause import frozen
from ..output import atomic_write, ensure_dir, exists, to_json, write_table
from . import pool
from . import report as page
from .render import FIGURES, figures, render_all

SAMPLE = "sample_drift.parquet"
SWEEP_CSV = "sweep.csv"  # the report's sweep table, beside index.html
REPORT_FILES = ("index.html", SWEEP_CSV)


class FigureNote(UserWarning):
    """A figure left out, and why (the CLI prints it as a note)."""


def sample_path() -> Path:
    """The bundled sample log (made by `mismatch-replay simulate`, see data/README.md)."""
    return Path(str(resources.files("mismatch_replay") / "data" / SAMPLE))


def _refuse_existing(outdir: Path, names: Sequence[str], force: bool) -> None:
    exists(outdir)  # a name too long: one sentence, before any work
    if force:
        return
    present = [n for n in names if exists(outdir / n)]
    if present:
        raise UsageError(
            f"{outdir}: {', '.join(present)} already exist(s). Pass --force to overwrite, or "
            "choose another -o directory."
        )


@frozen()  # the collector's passes walk only what the job makes (gcpause.py)
def plot(
    sources: Sequence[str | Path],
    outdir: str | Path,
    settings: Sequence[str] | None = None,
    fmt: str = "png",
    target_fraction: float | None = None,
    force: bool = False,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    figure_process: bool | None = None,
) -> dict[str, Path]:
    """The figures of a log, written into outdir: name -> path of each written
    (masked_by_length only where the log has sequence ids; a `FigureNote` otherwise).
    `figure_process`: draw part of the figures in a second process (`pool.FigurePool`;
    None: where `pool.wanted()`, i.e. two cores or more)."""
    outdir = Path(outdir)
    if fmt not in ("png", "svg", "pdf"):
        raise UsageError(f"--image-format {fmt}: use png, svg or pdf.")
    _refuse_existing(outdir, [f"{n}.{fmt}" for n in FIGURES], force)
    with _pool(figure_process) as helper:  # starts now: its imports overlap the replays
        data = analysis.figure_data(sources, settings, options=options, progress=progress)
        if data.by_length is None:
            warnings.warn(NO_LENGTH_NOTE, FigureNote, stacklevel=2)
        ensure_dir(outdir)
        return render_all(
            data, outdir, fmt, target_fraction=target_fraction, force=force, pool=helper
        )


@frozen()
def report(
    sources: Sequence[str | Path],
    outdir: str | Path,
    command: str,
    settings: Sequence[str] | None = None,
    target_fraction: float = 0.0025,
    bootstrap: int = 200,
    force: bool = False,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    precision: str | None = None,
    precision_threshold: float = analysis.PRECISION_THRESHOLD,
    keep: dict | None = None,  # receives data, decisions, summary, findings (W&B, CLI)
    figure_process: bool | None = None,  # as plot's
    config: tuple[str, Sequence[str]] | None = None,  # --from-config: (framework, its SPECs)
) -> Path:
    """index.html with the figures, the tables, the Decision section and the command.

    `precision="float32"`: the figures and tables replay the rules in the frameworks'
    float32 arithmetic (engine.replay), and a "float32 vs float64" section gives a line for
    every setting whose two masked fractions differ by more than `precision_threshold`.
    None (default): each preset in its framework's precision, and the same section, led by
    the precision notes of the presets whose float32 and exact counts differ."""
    outdir = Path(outdir)
    if precision is not None:
        engine.check_precision(precision)
    _refuse_existing(outdir, [*REPORT_FILES, *[f"{n}.png" for n in FIGURES]], force)
    # report_data's one read (a replay it makes where a tail cannot say stretches the bar),
    # the float32 check's 2, and drawing the figures
    # the float32 check: with --precision float32, and by default where a framework preset
    # replays in its float32 (its precision notes lead the section); one read
    check_precision = precision == "float32" or (
        precision is None and analysis.has_float32_preset(settings)
    )
    passes = 3 + (1 if check_precision else 0)  # + diagnose's read
    bar = Stages(progress, passes)
    with _pool(figure_process) as helper:  # starts now: its imports overlap the read
        got: dict = {}
        data, dec = analysis.report_data(
            sources,
            settings,
            target_fraction,
            bootstrap=bootstrap,
            options=options,
            progress=bar,
            precision=precision,
            summary=got,
            on_sweep=None
            if helper is None
            else lambda t, curves: _early(helper, t, curves, target_fraction, settings),
        )
        summary = got["summary"]
        from ..analysis.diagnose import diagnose as run_diagnose

        diagnosis = run_diagnose(sources, settings or (), options, bar)  # one more read
        found = analysis.findings(
            data,
            dec,
            log_format=summary.format,
            config_framework=config[0] if config else None,
            own_specs=config[1] if config else (),
            diagnosis=diagnosis,
        )
        sections = [("Decision", page.decision_html(dec))]
        if check_precision:
            check = analysis.precision_check(
                sources,
                data.settings if settings else None,  # at a setting (token-k3: choose's)
                precision_threshold,
                options=options,
                progress=bar,
            )
            sections.append(page.precision_section(check))
        if keep is not None:
            keep.update(
                data=data, decisions=dec, summary=summary, findings=found, diagnosis=diagnosis
            )
        ensure_dir(outdir)
        write_table(data.sweep, outdir / SWEEP_CSV, force=force)
        return page.write_report(
            data,
            outdir,
            command=command,
            summary=summary.to_dict(),
            force=force,
            target_fraction=target_fraction,
            sections=sections,
            choices=dec.choose,
            progress=bar.last_stage,
            pool=helper,
            findings=found.sentences,
        )


def _early(helper: pool.FigurePool, table, curves, target_fraction: float, settings=None) -> None:
    """masked_fraction sent to the helper as soon as its tables exist (the sweep and the
    figure's own, `FigureData.curves`; write_report's PNG at its resolution, the panels of
    the rules given: `render_all` picks it up)."""
    from .render import panel_rules

    kw = {"target_fraction": target_fraction, "rules": panel_rules(settings or (), bool(settings))}
    part = pool.Part(sweep=table, curves=curves)
    helper.send("masked_fraction", part, "png", page.DPI, kw)


def _pool(figure_process: bool | None):
    """A `FigurePool` where wanted (`figure_process`, else `pool.wanted()`), else a no-op
    context giving None."""
    use = pool.wanted() if figure_process is None else figure_process
    return pool.FigurePool() if use else contextlib.nullcontext()


class Stages:
    """One progress bar over the several passes of a job: pass k's `(done, total)` is
    reported as `((k * total + done) / passes, total)`, so the line fills once, left to
    right, through every pass, and its count reads in rows of the log (the rate: the whole
    job's). A pass starts when the count falls back; `passes` is the number expected (a job
    that needs more stretches the bar as it goes)."""

    def __init__(self, progress: Callable[[int, int], None] | None, passes: int):
        self.progress = progress
        self.passes = max(1, passes)
        self.k = 0
        self.last = 0
        self.total = 0

    def _report(self, done: float) -> None:
        self.progress(min(int(done), self.total), self.total)

    def __call__(self, done: int, total: int) -> None:
        if self.progress is None:
            return
        if done < self.last:
            self.k += 1
        self.last = done
        self.total = max(self.total, total, 1)
        self.passes = max(self.passes, self.k + 2)  # the last stage is still to come
        self._report((self.k * self.total + done) / self.passes)

    def last_stage(self, done: int, total: int) -> None:
        """The last stage (drawing the figures), `done` of `total` parts."""
        if self.progress is None or not self.total:
            return
        start = (self.k + 1) / self.passes
        self._report(self.total * (start + (1 - start) * done / max(total, 1)))


def demo(
    outdir: str | Path = "mismatch-replay-demo",
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    keep: dict | None = None,  # receives what report's keeps (findings: the CLI prints them)
) -> dict[str, Path]:
    """inspect + sweep + figures + report on the bundled sample, into outdir."""
    outdir = Path(outdir)
    src = [sample_path()]
    _refuse_existing(
        outdir, ["inspect.json", "sweep.csv", "index.html", *[f"{n}.png" for n in FIGURES]], force
    )
    ensure_dir(outdir)
    keep = {} if keep is None else keep
    index = report(
        src,
        outdir,
        command=f"mismatch-replay demo -o {outdir}",
        force=force,
        progress=progress,
        keep=keep,
    )
    summary = keep["summary"]  # the report's own read made it
    inspect_json = atomic_write(
        outdir / "inspect.json", lambda t: t.write_text(to_json(summary.to_dict()) + "\n"), force
    )
    out = {"inspect": inspect_json, "sweep": outdir / SWEEP_CSV, "report": index}
    out |= {n: outdir / f"{n}.png" for n in figures(keep["data"])}
    return out


__all__ = ["FIGURES", "FigureNote", "demo", "plot", "report", "sample_path"]
