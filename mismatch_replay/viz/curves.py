"""Masked fraction against each rule's threshold: the small multiples of masked_fraction.png.

Design
------
`masked_fraction` draws a sweep table (grouped tables summed: `tables.ungrouped`): one curve
per (rule, setting, param), in one panel per unit (FAMILIES: probability differences,
ratio bounds, token divergences, PPO clips, three kinds of sequence statistics; OTHER for
the rest). Which panel a parameter goes to comes from the rule (`family_of`): its `panel`
where it declares one (the sequence and step rules), else the unit of the per-token
quantity the parameter thresholds (`Rule.quantities`: |dp| -> probability differences,
log r -> ratio bounds, k3 -> divergences; PANEL_OF_QUANTITY), so a new token rule on an
existing quantity is drawn where it belongs without a line here; what a value bounds where
a panel mixes statistics is the rule's `bound_on` ("[exp(S_i)]").

Masked fractions are drawn on log axes (the tail is the point): a fraction of 0 sits on the
floor 0.5 / N (N: the line's tokens) and the figure says so; weight rules (tis, cispo,
seq-tis) mask nothing and draw their truncated fraction. Markers sit at the rules' presets
(`tables.preset_points`: filled on a grid point, open between two), labelled with their
frameworks, placed last by `labels.place_labels` on the final layout: one label for a rule's
markers that name the same frameworks at one value or side by side, each where it covers no
other label and no marker and the least of the curves, inside its panel, tied to its marker
by a thin leader line where it had to move away. A curve identical to one already drawn
(token-mis = IcePop) keeps its data but no ink, its legend entry reading "= IcePop low", and
labels only the presets the first does not mark, with its rule's name ("token-MIS trl"). One
colour per rule (`style.rule_color`, `colors` overriding), the swept side of a band by line
style. Gids: "sweep|rule|setting|param", "preset|...", "given|...", "preset-label|...",
"preset-leader|...", "target", "floor", "unit", and "note" on the text.

Where the rules were given at a setting, the table is the figure's own
(`analysis.figure_data.curve_table`): each setting's threshold curves over the default grid,
with a `given` column (the line is a setting's: no catalogue presets on it) and a `mark`
column (the settings' labels, `icepop@verl` or a SPEC, at the rows of their values). Those
rows get a filled marker ("given|rule|setting|param|value|label"), labelled like the
presets. x is log where the grid is log-spaced (a setting's value added still is one: the
tails are the point) or spans two decades; a linear x (a sweep table's lone setting) gets at
most five short tick labels.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..errors import UsageError
from ..gcpause import paused as gc_paused
from ..rules import REGISTRY, Rule
from .labels import Label, place_labels
from .style import (
    LABEL,
    NOTE,
    SMALL,
    display_name,
    fmt_g,
    light_log_ticks,
    rule_color,
)
from .tables import preset_points, sweep_lines, ungrouped


@dataclass(frozen=True)
class Family:
    """A panel of the masked-fraction grid: parameters in the same unit share an x axis. The
    rules say which panel their parameters go to (`Rule.panel`, by this `key`)."""

    key: str
    title: str
    xlabel: str
    unit_line: float | None = None  # a vertical reference (r = 1 for ratio bounds)


FAMILIES: tuple[Family, ...] = (  # in the order the panels are drawn
    Family("dp", "Probability-difference thresholds", "threshold on |p − q| (probability)"),
    Family(
        "ratio",
        "Token ratio bounds (low < 1 < high)",
        "bound on the ratio r = p / q (tis, cispo: weight cap)",
        unit_line=1.0,
    ),
    Family("kl", "Token divergence thresholds", "threshold (nats; m2po: mean l² per step)"),
    Family("clip", "PPO-style clip (advantage sign)", "clip ε: r > 1 + ε_high or r < 1 − ε_low"),
    Family(
        "seqratio",
        "Sequence product-ratio bounds",
        "bound on exp(S_i) (veto: on each token's r)",
        unit_line=1.0,
    ),
    Family(
        "seqmean",
        "Sequence mean-ratio bounds",
        "bound on exp(G_i) (prob-error: on mean exp|l|)",
        unit_line=1.0,
    ),
    Family("seqkl", "Sequence divergence thresholds", "threshold on the sequence statistic (nats)"),
)
OTHER = Family("other", "Other rules", "swept value")
_BY_KEY = {f.key: f for f in (*FAMILIES, OTHER)}
# how the swept parameter is drawn (the two sides of a band differ)
_PARAM_STYLE = {"low": "--", "eps_low": "--", "c": ":", "clamp": "-."}


# A threshold's unit follows from the per-token quantity it thresholds (`Rule.quantities`,
# names of fast.coordinates.QUANTITIES): the panel of that unit, for a rule that declares
# no `panel` of its own.
PANEL_OF_QUANTITY = {
    "dp": "dp",
    "-dp": "dp",
    "|dp|": "dp",
    "log r": "ratio",  # a ratio bound t, compared in log space
    "r": "ratio",
    "r-1": "clip",
    "1-r": "clip",
    "l": "kl",  # nats
    "|l|": "kl",
    "k2": "kl",
    "k3": "kl",
    "bkl": "kl",
    "bkl(q||p)": "kl",
}


def panel_key(cls: type[Rule], param: str) -> str:
    """The panel key of a rule class's `param`: its `panel` (one, or per parameter), else
    the panel of the quantity the parameter thresholds (a parameter that thresholds none,
    kpop's clamp, goes with the rule's thresholds), else "other"."""
    panel = cls.panel.get(param) if isinstance(cls.panel, dict) else cls.panel
    quantity = cls.quantities.get(param) or next(iter(cls.quantities.values()), "")
    return panel or PANEL_OF_QUANTITY.get(quantity, OTHER.key)


def family_of(rule: str, param: str) -> Family:
    """The panel the rule's `param` is drawn in (`panel_key`); OTHER for a rule the
    registry does not know or a panel key this figure does not draw."""
    cls = REGISTRY.get(rule)
    if cls is None:
        return OTHER
    return _BY_KEY.get(panel_key(cls, param), OTHER)


def _bound_on(rule: str) -> str:
    cls = REGISTRY.get(rule)
    return cls.bound_on if cls is not None else ""


def _is_log_grid(x: np.ndarray) -> bool:
    """Whether the values are a log-spaced grid: most steps in log x equal (a grid with a
    few values added, a given setting's, still is: `analysis.figure_data.curve_plan`)."""
    if x.size < 3 or np.any(x <= 0):
        return False
    d = np.diff(np.log(x))
    if np.any(d <= 0):
        return False
    step = float(np.max(d))  # an added value splits one step in two: the others are whole
    whole = np.abs(d - step) <= 1e-6 * step
    return bool(whole.sum() >= max(2, int(0.75 * d.size)))


def _rule_names(rules) -> list[str] | None:
    """Rule names from names, SPECs or Rule instances (None: every rule)."""
    if rules is None:
        return None
    names = {r if isinstance(r, str) else r.name for r in rules}
    return sorted({n.split(":")[0].split("@")[0].strip() for n in names})


@gc_paused()
def masked_fraction(
    table: pl.DataFrame,
    ax: Axes | Sequence[Axes] | None = None,
    *,
    rules: Iterable[str | Rule] | None = None,
    target_fraction: float | None = None,
    markers: bool = True,
    colors: dict[str, str] | None = None,
) -> Figure:
    """Masked (weight rules: truncated) fraction of tokens against each swept parameter.

    One line per (rule, setting, param) of the sweep table (grouped tables are summed over
    their groups), in small-multiple panels, one per parameter family (FAMILIES): parameters
    in the same unit share an axis. Log y; log x where the grid is log-spaced. `rules`
    restricts the rules drawn (names or Rule instances). Markers at the rules' presets
    (`preset_points`; open markers: between grid points, interpolated). A dashed line at
    `target_fraction`. Zero fractions are drawn at the floor 0.5 / tokens (dotted line).
    `ax`: None (a new grid), one Axes (only if a single family is drawn) or a list of Axes,
    one per family drawn. `colors`: rule name -> colour, overriding the rules' own.
    """
    names = _rule_names(rules)
    flat = ungrouped(table)
    if flat.height and names is not None:
        flat = flat.filter(pl.col("rule").is_in(names))
    lines = sweep_lines(flat)
    given, marks = _given(flat)
    if not lines:
        raise UsageError("masked_fraction: the sweep table has no rows to draw (check --rule).")
    fams: dict[str, list[dict]] = {}
    fam_of: dict[str, Family] = {}
    for ln in lines:
        fam = family_of(ln["rule"], ln["param"])
        fams.setdefault(fam.key, []).append(ln)
        fam_of[fam.key] = fam
    order = [f.key for f in (*FAMILIES, OTHER) if f.key in fams]
    n = len(order)
    spare = None
    if ax is None:
        ncols = min(4, n)
        nrows = math.ceil(n / ncols)
        fig = Figure(figsize=(4.3 * ncols, 4.6 * nrows + 0.5), layout="constrained")
        grid = list(np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel()))
        axes = grid[:n]
        for extra_ax in grid[n:]:
            extra_ax.axis("off")
        spare = grid[n] if len(grid) > n else None
    else:
        axes = [ax] if isinstance(ax, Axes) else list(ax)
        if len(axes) < n:
            raise UsageError(
                f"masked_fraction: the table spans {n} parameter families "
                f"({', '.join(order)}); pass {n} axes or restrict `rules`."
            )
        fig = axes[0].figure
    points = preset_points(flat) if markers else None
    if points is not None and given:  # a given setting's line: its markers are the settings'
        keep = [(r, s, p) not in given for r, s, p in points.select(_KEYS).iter_rows()]
        points = points.filter(pl.Series(keep, dtype=pl.Boolean))
    if not markers:
        marks = {}
    floored_any = False
    labels: list[Label] = []
    for a, key in zip(axes, order, strict=False):
        floored_any |= _draw_family(
            a, fam_of[key], fams[key], points, target_fraction, colors, labels, marks
        )
    tokens = int(max(ln["tokens"].max() for ln in lines))
    presets = (
        "Markers: the rules' presets (defaults), filled where the preset is a grid point, "
        "open where it falls between two (interpolated)."
    )
    if given:  # the rules given at a setting, on their curves
        presets = (
            "Filled markers, labelled with their preset or SPEC: the settings given, each on "
            "the curves of its thresholds (over the default grid, its other parameters at "
            "the setting's)."
        )
        if points is not None and points.height:
            presets += (
                " Markers labelled with frameworks: the presets of a rule given by name "
                "(open: between two grid points, interpolated)."
            )
    note = (
        f"{tokens:,} tokens. Each curve sweeps one parameter with the others fixed (in "
        f"brackets). {presets} Dashed: the lower side of a "
        "band (low, eps_low); solid: the upper side or the only threshold. Weight rules (tis, "
        "cispo, seq-tis) mask nothing: their curve is the truncated fraction."
    )
    if floored_any:
        note += f" A fraction of 0 is drawn at 0.5/N = {0.5 / tokens:.2g} (dotted line)."
    if target_fraction is not None:
        note += f" Dashed black: the target fraction {target_fraction:.3g}."
    if ax is None:
        fig.suptitle(
            "Fraction of tokens masked as a function of each rule's threshold", fontsize=LABEL + 1
        )
        if spare is not None:
            spare.text(
                0.02,
                0.98,
                textwrap.fill(note, 48),
                transform=spare.transAxes,
                va="top",
                ha="left",
                fontsize=SMALL,
                color="0.25",
                gid="note",
            )
        else:
            # wrapped to the figure's width (~14 characters an inch at NOTE size): a note
            # wider than the panels would be cut at both edges of the PNG
            width = max(60, int(fig.get_figwidth() * 14))
            fig.supxlabel(textwrap.fill(note, width), fontsize=NOTE, color="0.25")
    # last: where a label goes depends on the final layout
    if place_labels(fig, labels, size=NOTE, prefix="preset") and ax is None:
        fig.set_layout_engine("none")  # laid out once, for the labels: saving keeps it
    return fig


_KEYS = ["rule", "setting", "param"]


def _given(flat: pl.DataFrame) -> tuple[set[tuple], dict[tuple, list[tuple[float, str]]]]:
    """The lines of a figure table (`analysis.figure_data.curve_table`) drawn for a given
    setting (its `given` column), and the settings' points on them (its `mark` column):
    (rule, setting, param) -> [(value, label)]. None of either for a plain sweep table."""
    if not {"given", "mark"} <= set(flat.columns) or flat.height == 0:
        return set(), {}
    keyed = flat.with_columns(pl.col("setting").fill_null(""))
    given = {tuple(k) for k in keyed.filter(pl.col("given")).select(_KEYS).unique().iter_rows()}
    marks: dict[tuple, list[tuple[float, str]]] = {}
    for r in keyed.filter(pl.col("mark").is_not_null()).iter_rows(named=True):
        marks.setdefault((r["rule"], r["setting"], r["param"]), []).append(
            (float(r["value"]), r["mark"])
        )
    return given, marks


def _covering(drawn: dict[tuple[bytes, bytes], tuple[str, int]], x: np.ndarray, y: np.ndarray):
    """The key of a curve already drawn that holds every point (x, y) (its own key where
    none does): the same curve, or one on a grid with values added."""
    own = (x.tobytes(), y.tobytes())
    if own in drawn:
        return own
    for kx, ky in drawn:
        dx, dy = np.frombuffer(kx), np.frombuffer(ky)
        if dx.size <= x.size or dx.size > x.size + 8:  # a few values added at most
            continue
        at = np.searchsorted(dx, x)
        if np.all(at < dx.size) and np.array_equal(dx[at], x) and np.array_equal(dy[at], y):
            return (kx, ky)
    return own


def _short_setting(setting: str) -> str:
    """A line's fixed parameters as its legend reads them: 'high=1.667, clamp=1e-06' for
    'high=1.6666666666666667,clamp=1e-06' (4 significant digits)."""
    out = []
    for part in setting.split(","):
        k, sep, v = part.partition("=")
        try:
            out.append(f"{k}={float(v):.4g}" if sep else part)
        except ValueError:
            out.append(part)
    return ", ".join(out)


def _framework_text(presets: str) -> str:
    """A preset marker's label: its frameworks ('default' for the rule's own default)."""
    names = [n.strip() for n in presets.split(",") if n.strip()]
    return ", ".join(names)  # every framework named ("verl, areal ..." told a reader nothing)


def _draw_family(
    ax: Axes,
    fam: Family,
    lines: list[dict],
    points: pl.DataFrame | None,
    target: float | None,
    colors: dict[str, str] | None,
    labels: list[Label],
    marks: dict[tuple, list[tuple[float, str]]] | None = None,
) -> bool:
    xs = np.concatenate([ln["x"] for ln in lines])
    logx = bool(
        np.all(xs > 0)
        and (any(_is_log_grid(ln["x"]) for ln in lines) or xs.max() / xs.min() >= 100)
    )
    floor = min(0.5 / ln["tokens"].max() for ln in lines)
    floored = False
    drawn: dict[tuple[bytes, bytes], tuple[str, int]] = {}  # identical curves: label, count
    marked: dict[tuple[bytes, bytes], set[float]] = {}  # preset values labelled on a curve
    for ln in lines:
        rule, param = ln["rule"], ln["param"]
        y = np.maximum(ln["y"], 0.5 / ln["tokens"])
        floored |= bool(np.any(ln["y"] <= 0))
        style = _PARAM_STYLE.get(param, "-")
        short = f"{display_name(rule)} {param}"
        label = short
        if bound_on := _bound_on(rule):  # what the value bounds, in a panel of mixed ones
            label += f" [{bound_on}]"
        if ln["setting"]:
            label += f" ({_short_setting(ln['setting'])})"
        if ln["kind"] == "weight":
            label += ", truncated"
        # A curve equal to one already drawn (token-mis = icepop, cispo's = icepop's tokens)
        # is not drawn again (it would hide under the first): its line keeps its data but
        # no ink, and its legend entry says whose curve it is. Its points may be a subset
        # of the first's (a given setting's value added to icepop's grid, not to cispo's).
        key = _covering(drawn, ln["x"], y)
        first, dup = drawn.get(key, (short, 0))
        drawn[key] = (first, dup + 1)
        if dup:
            label += f" = {first}"
        gid = f"sweep|{rule}|{ln['setting']}|{param}"
        color = rule_color(rule, colors)
        if dup:
            ax.plot(ln["x"], y, ls="none", color=color, label=label, gid=gid)
        elif ln["x"].size == 1:
            ax.plot(ln["x"], y, ls="none", marker="o", ms=5, color=color, label=label, gid=gid)
        else:
            ax.plot(ln["x"], y, ls=style, lw=1.6, color=color, label=label, gid=gid, zorder=2)
        for value, text in (marks or {}).get((rule, ln["setting"], param), []):
            hit = np.flatnonzero(np.isclose(ln["x"], value, rtol=1e-9, atol=0.0))
            if hit.size == 0:  # not a point of the line (a NaN fraction): no marker
                continue
            yv = float(y[hit[0]])
            ax.plot(
                [value],
                [yv],
                ls="none",
                marker="o",
                ms=7.5,
                mew=1.2,
                mec="black",
                mfc=color,
                zorder=6,
                gid=f"given|{rule}|{ln['setting']}|{param}|{fmt_g(value)}|{text}",
                label="_nolegend_",
            )
            labels.append(
                Label(
                    ax,
                    text,
                    (float(value), yv),
                    color,
                    f"{rule}|{ln['setting']}|{param}|{fmt_g(value)}",
                    group=rule,
                )
            )
        if points is not None and points.height:
            mine = points.filter(
                (pl.col("rule") == rule)
                & (pl.col("setting") == ln["setting"])
                & (pl.col("param") == param)
            )
            for p in mine.iter_rows(named=True):
                yv = max(p["fraction"], 0.5 / ln["tokens"].max())
                ax.plot(
                    [p["value"]],
                    [yv],
                    ls="none",
                    marker="o",
                    ms=6.5,
                    mew=1.4,
                    mec=color,
                    mfc=color if p["exact"] else "white",
                    zorder=5,
                    gid=f"preset|{rule}|{ln['setting']}|{param}|{fmt_g(p['value'])}|{p['presets']}",
                    label="_nolegend_",
                )
                # the framework(s) whose preset this is (placed at the end); on a curve
                # drawn as another's, only a preset of its own, named with its rule
                done = marked.setdefault(key, set())
                if dup and any(math.isclose(v, p["value"], rel_tol=1e-9) for v in done):
                    continue
                done.add(float(p["value"]))
                text = _framework_text(p["presets"])
                labels.append(
                    Label(
                        ax,
                        f"{display_name(rule)} {text}" if dup else text,
                        (float(p["value"]), float(yv)),
                        color,
                        f"{rule}|{ln['setting']}|{param}|{fmt_g(p['value'])}",
                        group=rule,
                    )
                )
    if floored:
        ax.axhline(floor, color="0.55", lw=0.8, ls=":", gid="floor", label="_nolegend_")
    if target is not None:
        ax.axhline(
            target, color="0.2", lw=1.0, ls=(0, (6, 3)), gid="target", label=f"target {target:.3g}"
        )
    if fam.unit_line is not None and logx:
        ax.axvline(fam.unit_line, color="0.75", lw=0.8, gid="unit", label="_nolegend_")
    ax.set_yscale("log")
    if logx:
        ax.set_xscale("log")
    ax.set_ylim(bottom=0.7 * min(floor, target or 1.0), top=1.3)
    light_log_ticks(ax)
    if not logx:  # a narrow linear range (one setting): a few short labels, no overlap
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, steps=[1, 2, 2.5, 5, 10]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:.6g}"))
    ax.set_title(fam.title, fontsize=LABEL)
    ax.set_xlabel(fam.xlabel, fontsize=LABEL - 0.5)
    ax.set_ylabel("fraction of tokens masked", fontsize=LABEL - 0.5)
    ax.tick_params(labelsize=SMALL)
    ax.grid(True, which="major", color="0.92", lw=0.6)
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=1,
        fontsize=NOTE,
        frameon=False,
        handlelength=2.6,
    )
    return floored
