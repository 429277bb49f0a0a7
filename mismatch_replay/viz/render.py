"""The figures of a log as files: which figures, built how, written where.

Design
------
FIGURES names the six figures a report and `plot` write (scatter, masked_fraction, steps,
where_masked, masked_by_length, and masked_direction: what each setting's mask costs, where
the log has an advantage column); `figures(data)` maps each name the data can draw to a
function that builds it from one FigureData (the headline scatter's boundaries come from the
chosen settings: `scatter_kwargs`; masked_by_length needs `data.by_length`, absent where the
log has no sequence ids, and a note says so). `render_all` checks the format and every
target before drawing anything (an existing file is refused unless `force`), then builds and
writes the figures one at a time, so at most one Figure is alive; given a `pool.FigurePool`,
its helper process draws masked_fraction meanwhile (pool.py). `save` writes
one figure through `output.atomic_write` (a hidden temporary file in the same folder, then
an exclusive publish unless `force`) with fixed metadata: no creation date in SVG or PDF,
the version in PNG.

The figures' cost does not depend on the log's size (they draw aggregated tables) but on
matplotlib's work per artist: ticks, texts, legends, measured by the layout and again by the
draw. A PNG is therefore laid out once and drawn once (`_png`: savefig alone would draw it
twice, once only to lay it out), on the Agg canvas whose renderers share parsed mathtext
(`style.agg_canvas`), at zlib level PNG_COMPRESS_LEVEL (the pixels are savefig's own). SVG
and PDF go through plain savefig: their layout must be measured with their own renderers.
Every format is encoded with the garbage collector paused and each axis's ticks computed
once per layout pass and draw (`style.gc_paused`, `style.steady_ticks`): the same pixels.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

import matplotlib as mpl
import polars as pl
from matplotlib.figure import Figure

from .. import __version__
from ..errors import UsageError
from ..gcpause import paused as gc_paused
from ..output import atomic_write, ensure_dir
from .curves import masked_fraction
from .direction import masked_direction
from .groups import masked_by_length, steps, where_masked
from .plane import scatter_panels
from .style import AggCanvas, agg_canvas, steady_ticks

if TYPE_CHECKING:
    from ..analysis import FigureData


class Helper(Protocol):
    """What `render_all` needs of a process that draws some figures (`pool.FigurePool`)."""

    offload: tuple[str, ...]  # the figures it draws

    def ask(self, name: str, data, fmt: str, dpi: int, kw: dict) -> bool: ...

    def result(self, name: str) -> bytes | None: ...  # None: draw it here


FIGURES = (
    "scatter",
    "masked_fraction",
    "steps",
    "where_masked",
    "masked_by_length",
    "masked_direction",
)
FORMATS = ("png", "svg", "pdf")
# zlib level of the PNGs: 3 encodes in 0.7x the time of the default 6, the files 3-10%
# larger, the pixels the same
PNG_COMPRESS_LEVEL = 3


def scatter_kwargs(data: FigureData) -> dict:
    """The headline scatter's boundaries: the rules the user gave, each that has one in the
    (q, p) plane (`Rule.boundary`: token-MIS@verl's cone, not prime-rl's IcePop); by default
    the first IPO eps and the first IcePop band of the settings (the IPO docs' figure: eps
    0.3 and [0.2, 5])."""
    if getattr(data, "given", False):
        drawn = [r for r in data.settings if type(r).boundary]
        return {"ipo_eps": (), "icepop": (), "extra": drawn}
    ipo = [float(r.eps) for r in data.settings if r.name == "ipo" and r.eps is not None]
    ice = [
        (float(r.low or 0.0), float(r.high))
        for r in data.settings
        if r.name == "icepop" and r.high is not None
    ]
    return {"ipo_eps": tuple(ipo[:1]) or (0.3,), "icepop": tuple(ice[:1]) or ((0.2, 5.0),)}


def panel_rules(settings, given: bool) -> list[str] | None:
    """The rules masked_fraction draws panels for: those the user gave (names, sorted), or
    None (every rule) where the settings are the defaults."""
    if not given:
        return None
    return sorted(
        {(s if isinstance(s, str) else s.spec()).split(":")[0].split("@")[0] for s in settings}
    )


def curve_source(data) -> pl.DataFrame:
    """The table masked_fraction draws: the figure's own (`FigureData.curves`: the rules
    given at a setting, on their curves) where the data has one, else the sweep."""
    curves = getattr(data, "curves", None)
    return data.sweep if curves is None else curves


def figures(
    data: FigureData, target_fraction: float | None = None, rules: list[str] | None = None
) -> dict[str, Callable]:
    """name -> a function that builds that figure (what `render_all` writes), in FIGURES
    order; masked_by_length only where the data has its by-length table. `rules`: the
    rule names masked_fraction draws (`panel_rules`; None: every rule)."""
    out = {
        "scatter": lambda: scatter_panels(data, **scatter_kwargs(data)),
        "masked_fraction": lambda: masked_fraction(
            curve_source(data), target_fraction=target_fraction, rules=rules
        ),
        "steps": lambda: steps(data),
        "where_masked": lambda: where_masked(data),
    }
    if getattr(data, "by_length", None) is not None:
        out["masked_by_length"] = lambda: masked_by_length(data.by_length)
    if getattr(data, "mask_cost", None) is not None:  # what each mask costs (an advantage)
        out["masked_direction"] = lambda: masked_direction(data.mask_cost)
    return out


def save(fig: Figure, path: Path, fmt: str, dpi: int = 150, force: bool = True) -> Path:
    """Write a figure atomically (output.atomic_write: a hidden temporary file in the same
    folder, then an exclusive publish unless force): the bytes of `encode`."""
    return write(encode(fig, fmt, dpi), path, force)


def write(image: bytes, path: Path, force: bool = True) -> Path:
    """Publish an encoded figure at path, as `save` does (a helper process's: pool.py)."""
    return atomic_write(Path(path), lambda tmp: tmp.write_bytes(image), force)


def encode(fig: Figure, fmt: str, dpi: int = 150) -> bytes:
    """The figure's file as bytes, with fixed metadata (no creation date in SVG or PDF, the
    version in PNG). A PNG goes through `_png`."""
    meta = {
        "png": {"Software": f"mismatch-replay {__version__}"},
        "svg": {"Date": None},
        "pdf": {"CreationDate": None},
    }[fmt]
    out = io.BytesIO()
    with gc_paused(), steady_ticks(fig):
        if fmt == "png":
            _png(fig, out, dpi, meta)
        else:
            fig.savefig(out, format=fmt, dpi=dpi, metadata=meta)
    return out.getvalue()


def _png(fig: Figure, tmp: IO[bytes], dpi: int, meta: dict) -> None:
    """savefig's PNG, laid out once and drawn once, compressed at PNG_COMPRESS_LEVEL.

    savefig draws a figure that has a layout engine twice: once with drawing disabled, to
    run the engine (and to find the bounding box for bbox_inches="tight"), then for the
    pixels; even an engine switched off ("none": masked_fraction's, laid out for its
    labels) costs that first draw, 10-30% of the figures' saving time. Here, on the
    figures' Agg canvas (`style.agg_canvas`), the engine runs once at the file's resolution,
    savefig finds none and draws once; the figure gets its engine and resolution back. A
    figure on another canvas, or where rcParams could make savefig lay it out anyway (an
    engine set by rc, bbox "tight"), is saved by plain savefig.
    """
    root = agg_canvas(fig)
    engine = root.get_layout_engine()
    kw = {"format": "png", "dpi": dpi, "metadata": meta}
    kw["pil_kwargs"] = {"compress_level": PNG_COMPRESS_LEVEL}
    plain = (
        engine is None
        or not isinstance(root.canvas, AggCanvas)
        or mpl.rcParams["figure.autolayout"]
        or mpl.rcParams["figure.constrained_layout.use"]
        or mpl.rcParams["savefig.bbox"] == "tight"
    )
    if plain:
        root.savefig(tmp, **kw)
        return
    figure_dpi = root.dpi
    try:
        root.dpi = dpi
        with contextlib.suppress(ValueError):  # as Figure.draw: too small to lay out
            engine.execute(root)
        root.set_layout_engine(None)  # no engine (rc checked above), not "none"
        root.savefig(tmp, **kw)
    finally:
        root.set_layout_engine(engine)
        root.dpi = figure_dpi


def render_all(
    data: FigureData,
    outdir: Path,
    fmt: str = "png",
    target_fraction: float | None = None,
    force: bool = False,
    dpi: int = 150,
    progress: Callable[[int, int], None] | None = None,
    pool: Helper | None = None,
) -> dict[str, Path]:
    """Write scatter, masked_fraction, steps, where_masked and (where the log has sequence
    ids) masked_by_length (.png/.svg/.pdf) into outdir; returns name -> path of each written.

    Refuses (before writing anything) if any of the files exists, unless `force`.
    `progress(done, total)` is called after each figure. `pool` (a `Helper`: `pool.FigurePool`):
    the figures of its `offload` are drawn in its helper process meanwhile, the same files.
    """
    fmt = fmt.lower().lstrip(".")
    if fmt not in FORMATS:
        raise UsageError(f"figure format '{fmt}': use one of {', '.join(FORMATS)}.")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UsageError(f"-o {outdir}: that is a file; give a directory for the figures.")
    kw = {
        "target_fraction": target_fraction,
        "rules": panel_rules(getattr(data, "settings", ()), getattr(data, "given", False)),
    }
    # (rules only when given: a caller's own `figures` may take the target alone)
    builds = figures(data, target_fraction, *([kw["rules"]] if kw["rules"] else []))
    targets = {name: outdir / f"{name}.{fmt}" for name in builds}
    existing = [p for p in targets.values() if p.exists()]
    if existing and not force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise UsageError(f"{existing[0]}: the file exists{more}; pass --force to overwrite it.")
    ensure_dir(outdir)
    drawn = 0

    def tick() -> None:
        nonlocal drawn
        drawn += 1
        if progress is not None:
            progress(drawn, len(builds))

    away = set()
    if pool is not None:  # the helper's figures (one it was sent early is kept: `ready`)
        away = {n for n in pool.offload if n in builds and pool.ask(n, data, fmt, dpi, kw)}
    for name, build in builds.items():
        if name not in away:
            save(build(), targets[name], fmt, dpi, force=force)
            tick()
    for name in sorted(away, key=list(builds).index):
        image = pool.result(name)
        if image is None:  # the helper could not: drawn here
            save(builds[name](), targets[name], fmt, dpi, force=force)
        else:
            write(image, targets[name], force=force)
        tick()
    return targets
