"""What every figure shares: the palette, a rule's colour and name, font sizes, small helpers.

Design
------
A rule's look comes from the rule itself: its class declares `label` (the name figures
print: "IPO", "IcePop"; its registry name when it sets none) and `color` (None: a colour of
the spare palette, picked from its name so that it is the same in every figure and every
run). `rule_color(name, colors)` resolves one colour in that order: the caller's `colors`
(rule name -> colour, as rliable's plots take it), the rule's own, the spare palette. The
palettes are Okabe & Ito (2008) and Paul Tol's "muted" set, both distinguishable under the
common colour-vision deficiencies; the built-in rules use their hex values directly
(rules/ is below viz/ and imports nothing from it).

The rest is shared drawing plumbing, public so that the figure modules (plane, curves,
groups) take it from one place: three font sizes (LABEL, SMALL, NOTE points), four line
styles (a second setting of a rule changes the style, never the colour), `fig_ax` (a new
Figure, never pyplot, or the caller's Axes), `draw_line` (drops non-finite points: no NaN
reaches matplotlib), `light_log_ticks` (few minor ticks, none beyond the view:
`InViewLogLocator`), and the settings helpers `settings_of` / `style_for` over the chosen
settings' grouped tables. Labels of SPECs (`spec_label`) name the catalogue presets a
setting equals ("IPO eps=0.3 (prime-rl)").

`agg_canvas` puts a Figure made without pyplot on the canvas its text is measured and its
PNG drawn with (labels' layout, render's PNGs): matplotlib's Agg canvas, whose renderers
share one mathtext parser (`AggCanvas`), so a log axis's tick labels are parsed once per
process and size rather than once per figure; a pyplot figure keeps its own canvas.

Two contexts cut what matplotlib repeats, without changing a pixel: `steady_ticks(fig)`,
around a layout engine's run or a draw, has each axis locate, format and move its ticks
once per state (view, size, resolution) instead of at every measure of the axis, its label,
its siblings and its spines; `gcpause.paused()` (a decorator on every figure function, a
context around render's `encode`) keeps the cyclic garbage collector's full passes, which
walk every object of the process, out of building and drawing a figure. `in_view(locator)` is a
LogLocator trimmed to the view (a colour bar's, with its own subs).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.mathtext import MathTextParser
from matplotlib.ticker import LogLocator, NullFormatter

from ..rules import REGISTRY, Rule, parse_rule

OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}
TOL_MUTED = {
    "indigo": "#332288",
    "teal": "#44AA99",
    "green": "#117733",
    "olive": "#999933",
    "rose": "#CC6677",
    "wine": "#882255",
    "purple": "#AA4499",
    "grey": "#777777",
}
SPARE = tuple(TOL_MUTED.values())  # rules that declare no colour get one of these

STYLES = ("-", "--", ":", "-.")  # the k-th setting of one rule: STYLES[k % 4]
LABEL = 10  # font sizes (points): axis labels, ticks/legends, notes
SMALL = 8.5
NOTE = 7.5


def rule_color(name: str, colors: dict[str, str] | None = None) -> str:
    """The rule's colour in every figure: `colors[name]` when given, else the rule's own
    `color`, else a spare colour picked from the name (stable across runs)."""
    if colors and name in colors:
        return colors[name]
    cls = REGISTRY.get(name)
    if cls is not None and cls.color:
        return cls.color
    return SPARE[sum(map(ord, name)) % len(SPARE)]


def display_name(name: str) -> str:
    """The rule's `label` ("IPO", "token-MIS"); a name the registry does not know, as is."""
    cls = REGISTRY.get(name)
    return cls.label if cls is not None else name


def fmt_g(v: float) -> str:
    """A number as figures and gids write it (%g)."""
    return f"{v:g}"


def fig_ax(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    """The caller's Axes and its figure, or a new constrained-layout Figure with one Axes."""
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def draw_line(ax: Axes, x, y, *, gid: str, label: str | None, **kw) -> Line2D:
    """`ax.plot` of the finite points only, tagged `gid`; no label: kept out of the legend."""
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    (ln,) = ax.plot(x[ok], y[ok], label=label if label else "_nolegend_", gid=gid, **kw)
    return ln


class InViewLogLocator(LogLocator):
    """LogLocator's ticks, less those the axis would not draw: matplotlib's LogLocator also
    returns the decades beyond the view (a quarter of a log axis's ticks here), and the axis
    makes a Tick object for each and moves it at every layout pass, only to leave it out of
    the drawing. Kept: every tick within 0.1% of the view's log range of it (matplotlib
    draws those within 1e-8 %), so what is drawn is the same."""

    def __call__(self):
        locs = np.asarray(super().__call__(), float)
        vmin, vmax = self.axis.get_view_interval()
        if locs.size == 0 or not (vmin > 0 and vmax > 0):
            return locs
        lo, hi = sorted((math.log(vmin), math.log(vmax)))
        tol = 1e-3 * (hi - lo)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.log(locs)
        return locs[~((t < lo - tol) | (t > hi + tol))]


def in_view(locator):
    """A LogLocator's ticks with those beyond the view left out (`InViewLogLocator`, the
    same base, subs and tick count: the same ticks drawn); any other locator as it is."""
    if type(locator) is not LogLocator:
        return locator
    return InViewLogLocator(locator._base, locator._subs, numticks=locator.numticks)


def light_log_ticks(ax: Axes) -> None:
    """Minor ticks at 2 and 5 only, unlabelled, on the log axes of `ax`: matplotlib makes a
    Tick object per minor tick, and 9 per decade over 12 decades triple the drawing time;
    both locators stop at the view (`InViewLogLocator`)."""
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_major_locator(InViewLogLocator(axis.get_transform().base))
            axis.set_minor_locator(InViewLogLocator(10.0, subs=(2.0, 5.0), numticks=12))
            axis.set_minor_formatter(NullFormatter())


# One mathtext parser for every Agg renderer that draws these figures. matplotlib gives each
# renderer its own, and makes a renderer per figure and resolution, so every figure would
# parse its log-axis tick labels ("$\mathdefault{10^{-3}}$", ~3 ms each) again; a parse is
# a pure function of the text, font, size and resolution, cached by the parser. Keyed by the
# parser's output type: the first renderer's parser of each kind serves the later ones.
_MATHTEXT: dict[object, MathTextParser] = {}


class AggCanvas(FigureCanvasAgg):
    """The Agg canvas, its renderers sharing one mathtext parser (`_MATHTEXT`)."""

    def get_renderer(self):
        renderer = super().get_renderer()
        own = getattr(renderer, "mathtext_parser", None)
        if isinstance(own, MathTextParser):
            kind = getattr(own, "_output_type", None)
            renderer.mathtext_parser = _MATHTEXT.setdefault(kind, own)
        return renderer


def agg_canvas(fig: Figure) -> Figure:
    """Put the root figure of `fig` on an `AggCanvas` (savefig's PNG pixels, the renderer
    kept while the size and resolution stay, parsed mathtext shared between figures) where
    it has no canvas of its own: a Figure made without pyplot (on the base canvas, or on
    Agg without a window manager). A pyplot figure keeps its canvas. Returns the root."""
    root = fig.get_figure(root=True)
    canvas = root.canvas
    if type(canvas) in (FigureCanvasBase, FigureCanvasAgg) and canvas.manager is None:
        AggCanvas(root)
    return root


def _memo_ticks(axis: Axis):
    """`axis._update_ticks` that computes once per state: the view interval, the Axes'
    size in pixels and the resolution (what the locators' tick counts depend on), the
    locators, formatters and tick lists. matplotlib calls it for every measure of the
    axis, its label, its siblings' labels and each spine (13 times per axis in one
    constrained layout, 4-5 times per draw), each time locating, formatting and moving
    every tick again to the same place."""
    compute = type(axis)._update_ticks.__get__(axis)
    memo: list = [None, []]

    def update_ticks():
        ax = axis.axes
        key = (
            tuple(axis.get_view_interval()),
            tuple(ax.bbox.bounds),
            ax.figure.dpi,
            *map(id, (axis.major.locator, axis.minor.locator)),
            *map(id, (axis.major.formatter, axis.minor.formatter)),
            id(axis.majorTicks),
            id(axis.minorTicks),
        )
        if memo[0] != key:
            memo[:] = [key, compute()]
        return list(memo[1])

    return update_ticks


@contextlib.contextmanager
def steady_ticks(fig: Figure) -> Iterator[None]:
    """While a layout engine runs or a draw lasts (nothing else changes the figure then),
    each axis of the figure's Axes locates and formats its ticks once per state
    (`_memo_ticks`) rather than at every measure: the same ticks, the same pixels. The
    axes get their own method back afterwards; an axis already patched is left alone."""
    patched = []
    for ax in fig.get_figure(root=True).get_axes():
        for axis in (ax.xaxis, ax.yaxis):
            if "_update_ticks" not in vars(axis) and hasattr(type(axis), "_update_ticks"):
                axis._update_ticks = _memo_ticks(axis)
                patched.append(axis)
    try:
        yield
    finally:
        for axis in patched:
            vars(axis).pop("_update_ticks", None)


def fraction_column(kind: str) -> str:
    """The column a rule's curve draws: weight rules mask nothing, their truncated fraction."""
    return "truncated_fraction" if kind == "weight" else "masked_fraction"


def preset_names(rule: Rule) -> list[str]:
    """The catalogue presets that this exact setting equals (e.g. ['verl', 'areal', 'paper'])."""
    cls = type(rule)
    out = []
    for name, vals in cls.presets.items():
        if cls(**vals).spec() == rule.spec():
            out.append(name)
    return out


def spec_label(spec: str, with_preset: bool = True) -> str:
    """`icepop:low=0.2,high=5` -> `IcePop low=0.2, high=5 (prime-rl)`."""
    name, _, vals = spec.partition(":")
    name, _, preset = name.partition("@")  # a preset with its own arithmetic is named
    text = f"{display_name(name)} {vals.replace(',', ', ')}".strip()
    if preset:
        return f"{text} ({preset})" if with_preset else text
    if with_preset and name in REGISTRY:
        try:
            names = preset_names(parse_rule(spec))
        except Exception:  # a spec this version cannot parse: label it as it is
            names = []
        if names:
            text += f" ({', '.join(names[:2])}{', …' if len(names) > 2 else ''})"
    return text


def settings_of(table: pl.DataFrame) -> list[tuple[str, pl.DataFrame]]:
    """(spec, rows) for each chosen setting of a grouped settings table, in order."""
    out = []
    for (spec,), part in table.group_by(["spec"], maintain_order=True):
        out.append((spec, part))
    return out


def style_for(
    specs: Sequence[str], colors: dict[str, str] | None = None
) -> dict[str, tuple[str, str, int]]:
    """spec -> (colour, line style, index within its rule): a 2nd setting of a rule is dashed."""
    seen: dict[str, int] = {}
    out = {}
    for spec in specs:
        rule = spec.split(":")[0].split("@")[0]  # a preset keeps its rule's colour
        k = seen[rule] = seen.get(rule, -1) + 1
        out[spec] = (rule_color(rule, colors), STYLES[k % 4], k)
    return out
