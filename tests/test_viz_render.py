"""viz.render's PNGs: laid out once and drawn once, yet the pixels of plain savefig.

`render._png` runs the layout engine itself and hides it from savefig (which would draw the
figure twice), `style.agg_canvas` shares parsed mathtext between renderers, and
`render.encode` draws with the garbage collector paused and each axis's ticks computed once
per pass (`style.gc_paused`, `style.steady_ticks`: tests/test_figure_cost.py). None of it
may change a pixel, the file's metadata or the figure handed in.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter
from PIL import Image

from mismatch_replay import __version__, analysis, viz
from mismatch_replay.viz import render, style

GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"
DPI = 40  # small: the pixels are compared, not looked at


@pytest.fixture(scope="module")
def data():
    return analysis.figure_data([str(GOLDEN)])


def pixels(png: bytes | Path) -> np.ndarray:
    src = io.BytesIO(png) if isinstance(png, bytes) else png
    with Image.open(src) as im:
        return np.asarray(im.convert("RGBA"))


@pytest.mark.slow  # each figure drawn twice at full size
@pytest.mark.parametrize("name", list(viz.FIGURES))
def test_png_has_the_pixels_of_plain_savefig(name, data, tmp_path):
    """Each figure as render writes it and as savefig alone draws it (the same build)."""
    build = viz.figures(data, 0.0025)[name]
    path = render.save(build(), tmp_path / f"{name}.png", "png", DPI)
    plain = io.BytesIO()
    build().savefig(plain, format="png", dpi=DPI)
    assert np.array_equal(pixels(path), pixels(plain.getvalue()))
    with Image.open(path) as im:
        assert im.format == "PNG" and im.info["Software"] == f"mismatch-replay {__version__}"


@pytest.mark.slow  # figures drawn and saved at full size
def test_save_gives_the_figure_back_as_it_was(data, tmp_path):
    """The layout engine and the resolution are the figure's own again after a save."""
    fig = viz.steps(data)
    engine, dpi = fig.get_layout_engine(), fig.dpi
    render.save(fig, tmp_path / "steps.png", "png", 150)
    assert fig.get_layout_engine() is engine and fig.dpi == dpi
    assert isinstance(fig.canvas, style.AggCanvas)
    # masked_fraction switched its engine off after placing its labels: still off
    fig = viz.masked_fraction(data.sweep)
    engine = fig.get_layout_engine()
    render.save(fig, tmp_path / "masked_fraction.png", "png", 150)
    assert fig.get_layout_engine() is engine and fig.dpi == dpi


def test_a_canvas_of_its_own_is_kept(tmp_path):
    """A figure on another canvas (a pyplot window's) keeps it, and is saved by savefig."""

    class Window(FigureCanvasAgg):
        pass

    fig = Figure(figsize=(2, 2), layout="constrained")
    fig.add_subplot().plot([1, 2], [3, 4])
    Window(fig)
    path = render.save(fig, tmp_path / "own.png", "png", DPI)
    assert type(fig.canvas) is Window
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("ylim", [(2e-8, 1.3), (3e-4, 7e-4)])
def test_in_view_log_locator_draws_the_ticks_of_log_locator(ylim):
    """light_log_ticks' locators leave out only ticks beyond the view: the same pixels."""

    def drawn(locator):
        fig = Figure(figsize=(3, 3))
        ax = fig.add_subplot()
        ax.plot([1e-3, 10], [1e-7, 1])
        ax.set(xscale="log", yscale="log", ylim=ylim)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(locator(10.0))
            axis.set_minor_locator(locator(10.0, subs=(2.0, 5.0), numticks=12))
            axis.set_minor_formatter(NullFormatter())
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=DPI)
        return ax, pixels(png.getvalue())

    (plain, a), (trimmed, b) = drawn(LogLocator), drawn(style.InViewLogLocator)
    assert np.array_equal(a, b)
    assert len(trimmed.yaxis.get_majorticklocs()) < len(plain.yaxis.get_majorticklocs())
    lo, hi = trimmed.get_ylim()
    for locs in (trimmed.yaxis.get_majorticklocs(), trimmed.yaxis.get_minorticklocs()):
        assert all(lo * 0.99 <= t <= hi * 1.01 for t in locs)


def test_renderers_share_parsed_mathtext():
    a, b = Figure(figsize=(2, 2)), Figure(figsize=(3, 2), dpi=150)
    style.agg_canvas(a)
    style.agg_canvas(b)
    assert a.canvas.get_renderer().mathtext_parser is b.canvas.get_renderer().mathtext_parser
