"""What the figures skip of matplotlib's repeated work, and that skipping changes no pixel.

`style.steady_ticks` computes each axis's ticks once per state during a layout or a draw,
`gcpause.paused` keeps the collector's passes out of building and drawing a figure, and
`style.in_view` trims a colour bar's log locators to its counts.
"""

from __future__ import annotations

import gc
import io

import numpy as np
import pytest
from matplotlib.axis import Axis
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator
from PIL import Image

from mismatch_replay.viz import groups, style

DPI = 40


def pixels(fig: Figure) -> np.ndarray:
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    with Image.open(io.BytesIO(out.getvalue())) as im:
        return np.asarray(im.convert("RGBA"))


def log_panels() -> Figure:
    fig = Figure(figsize=(6, 3), layout="constrained")
    for k, ax in enumerate(fig.subplots(1, 2)):
        ax.plot([1e-3, 10], [1e-7 * (k + 1), 1], label=f"line {k}")
        ax.set(xscale="log", yscale="log", xlabel="x", ylabel="y", title=f"panel {k}")
        style.light_log_ticks(ax)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2))
    return fig


@pytest.fixture
def computed(monkeypatch):
    """How often matplotlib's own Axis._update_ticks runs."""
    calls = []
    own = Axis._update_ticks

    def counted(self):
        calls.append(self)
        return own(self)

    monkeypatch.setattr(Axis, "_update_ticks", counted)
    return calls


def test_steady_ticks_draws_the_same_pixels_computing_ticks_fewer_times(computed):
    plain = pixels(log_panels())
    n_plain = len(computed)
    computed.clear()
    fig = log_panels()
    with style.steady_ticks(fig):
        steady = pixels(fig)
    assert np.array_equal(plain, steady)
    assert 0 < len(computed) < n_plain / 2
    for ax in fig.axes:  # the axes' own method again
        assert "_update_ticks" not in vars(ax.xaxis) and "_update_ticks" not in vars(ax.yaxis)


def test_steady_ticks_follows_a_new_view(computed):
    fig = Figure(figsize=(3, 3))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1])
    with style.steady_ticks(fig):
        first = [t.get_loc() for t in ax.xaxis._update_ticks()]
        again = [t.get_loc() for t in ax.xaxis._update_ticks()]
        assert len(computed) == 1 and again == first
        ax.set_xlim(0, 50)
        moved = [t.get_loc() for t in ax.xaxis._update_ticks()]
    assert len(computed) == 2 and max(moved) > max(first)


def test_a_figure_is_built_with_the_collector_paused(monkeypatch):
    seen = []
    own = groups.settings_of

    def spy(table):
        seen.append(gc.isenabled())
        return own(table)

    monkeypatch.setattr(groups, "settings_of", spy)

    class Data:  # what where_masked reads
        import polars as pl

        buckets = pl.DataFrame(
            {
                "spec": ["ipo:eps=0.3"] * 2,
                "kind": ["mask"] * 2,
                "q_bucket": [0.0, 0.5],
                "tokens": [10, 20],
                "masked_fraction": [0.1, 0.2],
            }
        )

    groups.where_masked(Data())
    assert seen == [False] and gc.isenabled()


def test_in_view_keeps_a_colour_bars_ticks_and_drops_the_rest():
    def drawn(trim: bool):
        fig = Figure(figsize=(3, 3))
        ax = fig.add_subplot()
        im = ax.imshow(np.geomspace(1, 3e5, 16).reshape(4, 4), norm=LogNorm(1, 3e5))
        cb = fig.colorbar(im, ax=ax)
        if trim:
            cb.locator, cb.minorlocator = style.in_view(cb.locator), style.in_view(cb.minorlocator)
        return cb, pixels(fig)

    (plain, a), (trimmed, b) = drawn(False), drawn(True)
    assert np.array_equal(a, b)
    assert isinstance(trimmed.minorlocator, style.InViewLogLocator)
    assert len(trimmed.ax.yaxis.get_minorticklocs()) < len(plain.ax.yaxis.get_minorticklocs())
    assert len(trimmed.ax.yaxis.get_majorticklocs()) < len(plain.ax.yaxis.get_majorticklocs())
    other = LogLocator(2.0, subs=(1.5,), numticks=7)  # base, subs and count carried over
    kept = style.in_view(other)
    assert kept._base == 2.0 and list(kept._subs) == [1.5] and kept.numticks == 7
