"""The (q, p) plane: token density of inference vs trainer probability, with rule boundaries.

Design
------
The scatter never reads tokens: it draws `FigureData.hist_lin` / `hist_log`, fixed 200 x 200
histograms counted during the replay, so a figure of 1.8M tokens costs what one of 20k does
(~0.1 s). Rule boundaries are drawn analytically from the rules' definitions, never inferred
from the tokens: IPO the band p = q +- eps; IcePop and token-MIS the cone p = low q,
p = high q (straight lines on log-log axes); DPPO-TV and IPO-v1 the one-sided lines
p = q + high, p = q - low; KPop the level set max(BKL(p||q), BKL(q||p)) = phi on a 300^2
grid. Other rules have no boundary in this plane and are refused by name. The colour bar's
log ticks stop at its counts (`style.in_view`: no Tick objects for the decades beyond).

`scatter` draws one panel (linear or log10 axes) with its legend below; `scatter_panels`
the linear and log-log panels side by side with one shared legend (scatter.png). Both take
`ax`/`axes=None`, return the Figure and take `colors` (rule name -> colour) over the rules'
own. Artists carry gids: "density", "diagonal", "ipo-upper|eps=0.3",
"icepop-low|low=0.2,high=5", "dppo-tv-upper|low=..,high=..", "kpop-contour|phi=..,clamp=..".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..errors import UsageError
from ..gcpause import paused as gc_paused
from ..rules import REGISTRY, Rule, binary_kl
from .style import (
    LABEL,
    NOTE,
    SMALL,
    STYLES,
    display_name,
    draw_line,
    fig_ax,
    fmt_g,
    in_view,
    rule_color,
)

if TYPE_CHECKING:
    from ..analysis import FigureData

# the density: greys from light to black, zero bins left blank (masked)
_DENSITY_CMAP = ListedColormap(colormaps["Greys"](np.linspace(0.35, 1.0, 256)), name="tokens")


def _log_ticks(ax: Axes) -> None:
    ticks = list(range(-8, 1))
    labels = [f"1e{k}" if k < 0 else "1" for k in ticks]
    ax.set_xticks(ticks, labels)
    ax.set_yticks(ticks, labels)


def _ipo_lines(ax: Axes, eps: float, log: bool, style: str, label: str, colors) -> None:
    """IPO keeps |p - q| <= eps: the band p = q + eps (clipped at 1) and p = q - eps (p >= 0)."""
    color = rule_color("ipo", colors)
    kw = {"color": color, "lw": 1.7, "ls": style}
    if log:
        q_up = np.logspace(-8, 0, 401)
        q_lo = eps + np.geomspace(1e-8, 1 - eps, 401) if eps < 1 else np.array([])
        draw_line(
            ax,
            np.log10(q_up),
            np.log10(np.minimum(q_up + eps, 1.0)),
            gid=f"ipo-upper|eps={fmt_g(eps)}",
            label=label,
            **kw,
        )
        draw_line(
            ax,
            np.log10(q_lo),
            np.log10(q_lo - eps),
            gid=f"ipo-lower|eps={fmt_g(eps)}",
            label=None,
            **kw,
        )
    else:
        x = np.linspace(0.0, 1.0, 401)
        x_lo = np.linspace(min(eps, 1.0), 1.0, 401)
        draw_line(
            ax, x, np.clip(x + eps, 0, 1), gid=f"ipo-upper|eps={fmt_g(eps)}", label=label, **kw
        )
        if eps < 1:  # eps >= 1 masks nothing below the diagonal: no lower line
            draw_line(ax, x_lo, x_lo - eps, gid=f"ipo-lower|eps={fmt_g(eps)}", label=None, **kw)


def _shift_lines(
    ax: Axes, name: str, low: float, high: float, log: bool, style: str, label: str, colors
) -> None:
    """One-sided probability-difference lines p = q + high and p = q - low (DPPO-TV, IPO-v1)."""
    kw = {"color": rule_color(name, colors), "lw": 1.6, "ls": style}
    if log:
        q_up = np.logspace(-8, math.log10(max(1 - high, 1e-8)), 401)
        q_lo = low + np.geomspace(1e-8, max(1 - low, 1e-8), 401)
        up = (np.log10(q_up), np.log10(q_up + high))
        lo = (np.log10(q_lo), np.log10(q_lo - low))
    else:
        x_up = np.linspace(0, max(1 - high, 0), 401)
        x_lo = np.linspace(min(low, 1), 1, 401)
        up, lo = (x_up, x_up + high), (x_lo, x_lo - low)
    tag = f"low={fmt_g(low)},high={fmt_g(high)}"
    draw_line(ax, *up, gid=f"{name}-upper|{tag}", label=label, **kw)
    draw_line(ax, *lo, gid=f"{name}-lower|{tag}", label=None, **kw)


def _cone_lines(
    ax: Axes, name: str, low: float, high: float, log: bool, style: str, label: str, colors
) -> None:
    """IcePop keeps low <= p/q <= high: the lines p = low q and p = high q (straight in log-log)."""
    kw = {"color": rule_color(name, colors), "lw": 1.7, "ls": style}
    tag = f"low={fmt_g(low)},high={fmt_g(high)}"
    if log:
        if low > 0:
            x = np.linspace(max(-8.0, -8.0 - math.log10(low)), 0.0, 2)
            draw_line(ax, x, x + math.log10(low), gid=f"{name}-low|{tag}", label=label, **kw)
            label = None
        x = np.linspace(-8.0, min(0.0, -math.log10(high)), 2)
        draw_line(ax, x, x + math.log10(high), gid=f"{name}-high|{tag}", label=label, **kw)
    else:
        if low > 0:
            x = np.linspace(0.0, 1.0, 2)
            draw_line(ax, x, low * x, gid=f"{name}-low|{tag}", label=label, **kw)
            label = None
        x = np.linspace(0.0, min(1.0, 1.0 / high), 2)
        draw_line(ax, x, high * x, gid=f"{name}-high|{tag}", label=label, **kw)


def _kpop_contour(ax: Axes, rule: Rule, log: bool, style: str, colors) -> Line2D:
    """KPop keeps max(BKL(p||q), BKL(q||p)) <= phi: that level set, computed on a 300^2 grid."""
    n = 300
    if log:
        g = np.linspace(-8.0, 0.0, n)
        lg = g * math.log(10)
    else:
        g = np.linspace(0.0, 1.0, n)
        with np.errstate(divide="ignore"):
            lg = np.log(g)
    lq, lp = np.meshgrid(lg, lg)  # rows: p, columns: q
    z = np.maximum(binary_kl(lp, lq, rule.clamp), binary_kl(lq, lp, rule.clamp))
    color = rule_color(rule.name, colors)
    cs = ax.contour(g, g, z, levels=[rule.phi], colors=[color], linewidths=1.6, linestyles=style)
    cs.set_gid(f"kpop-contour|phi={fmt_g(rule.phi)},clamp={fmt_g(rule.clamp)}")
    return Line2D([], [], color=color, lw=1.6, ls=style)


@gc_paused()
def scatter(
    data: FigureData,
    ax: Axes | None = None,
    *,
    log: bool,
    ipo_eps: Sequence[float] = (0.3,),
    icepop: Sequence[tuple[float, float]] = ((0.2, 5.0),),
    extra: Sequence[Rule] = (),
    colorbar: bool = True,
    colors: dict[str, str] | None = None,
) -> Figure:
    """Inference probability q (x) vs trainer probability p (y): token density with rule bounds.

    `log=True` draws log10 probabilities (ticks 1e-8 .. 1): the IcePop cone becomes two
    straight lines and the rare tokens become visible. Boundaries: the IPO band p = q +- eps for
    each `ipo_eps`, the IcePop cone for each (low, high) in `icepop`, and for `extra` rules
    their own boundaries, drawn as their class's `boundary` says (ipo, ipo-v1, icepop,
    token-mis, kpop and dppo-tv have one).
    `colors`: rule name -> colour, overriding the rules' own (style.rule_color).
    """
    fig, ax = fig_ax(ax, (5.4, 5.6))
    handles, labels = _scatter(data, ax, log, ipo_eps, icepop, extra, colorbar, colors)
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.13),
        ncol=2,
        fontsize=SMALL,
        frameon=False,
    )
    return fig


def _scatter(data, ax, log, ipo_eps, icepop, extra, colorbar, colors) -> tuple[list, list[str]]:
    """Draw one scatter panel; return its legend (handles, labels), contour proxies included."""
    fig = ax.figure
    hist = data.hist_log if log else data.hist_lin
    edges = data.edges_log10 if log else data.edges_lin
    lo, hi = float(edges[0]), float(edges[-1])
    counts = np.ma.masked_equal(np.asarray(hist, float).T, 0.0)  # [p bin, q bin]
    vmax = max(float(np.max(hist)), 2.0)
    im = ax.imshow(
        counts,
        origin="lower",
        extent=(lo, hi, lo, hi),
        cmap=_DENSITY_CMAP,
        norm=LogNorm(vmin=1.0, vmax=vmax),
        interpolation="nearest",
        aspect="equal",
        gid="density",
    )
    if colorbar:
        cb = fig.colorbar(im, ax=ax, shrink=0.8, pad=0.02)
        # a log colour scale's decades beyond the counts: no Tick objects for them
        cb.locator, cb.minorlocator = in_view(cb.locator), in_view(cb.minorlocator)
        cb.set_label("tokens per bin", fontsize=SMALL + 0.5)
        cb.ax.tick_params(labelsize=SMALL)
    # under the density (zorder < image): visible where there are no tokens, never over them
    draw_line(
        ax,
        [lo, hi],
        [lo, hi],
        gid="diagonal",
        label="p = q",
        color="0.55",
        lw=0.8,
        ls="--",
        zorder=-1,
    )

    ipo = list(ipo_eps)
    cones = [("icepop", float(a), float(b)) for a, b in icepop]
    shifts: list[tuple[str, float, float]] = []
    kpops: list[Rule] = []
    classes = {rule.name: type(rule) for rule in extra}

    def shown(name: str) -> str:  # a rule's own label (one outside the catalogue too)
        return classes[name].label if name in classes else display_name(name)

    for rule in extra:  # each rule says how its boundary is drawn (Rule.boundary)
        kind = type(rule).boundary
        if kind == "band":
            ipo.append(float(rule.eps))
        elif kind == "cone":
            cones.append((rule.name, float(rule.low or 0.0), float(rule.high)))
        elif kind == "shift":
            shifts.append((rule.name, float(rule.low), float(rule.high)))
        elif kind == "bkl":
            kpops.append(rule)
        else:
            drawable = ", ".join(n for n, c in REGISTRY.items() if c.boundary)
            raise UsageError(
                f"scatter: rule '{rule.name}' has no boundary in the (q, p) plane; drawable "
                f"rules: {drawable}."
            )
    for i, eps in enumerate(dict.fromkeys(ipo)):
        _ipo_lines(ax, eps, log, STYLES[i % 4], f"IPO |p−q| ≤ {fmt_g(eps)}", colors)
    seen: dict[str, int] = {}
    for name, a, b in dict.fromkeys(cones):
        k = seen[name] = seen.get(name, -1) + 1
        bounds = f"[{fmt_g(a)}, {fmt_g(b)}]" if a > 0 else f"≤ {fmt_g(b)}"
        _cone_lines(ax, name, a, b, log, STYLES[k % 4], f"{shown(name)} r ∈ {bounds}", colors)
    for name, a, b in dict.fromkeys(shifts):
        k = seen[name] = seen.get(name, -1) + 1
        if "advantage" in classes[name].needs:  # each side for one sign of A (DPPO-TV)
            label = f"{shown(name)} p−q ≤ {fmt_g(b)} (A>0), q−p ≤ {fmt_g(a)} (A≤0)"
        else:
            label = f"{shown(name)} p−q ≤ {fmt_g(b)}, q−p ≤ {fmt_g(a)}"
        _shift_lines(ax, name, a, b, log, STYLES[(k + 2) % 4], label, colors)
    handles, labels = ax.get_legend_handles_labels()
    for i, rule in enumerate(kpops):
        handles.append(_kpop_contour(ax, rule, log, STYLES[(i + 3) % 4], colors))
        labels.append(f"KPop max BKL ≤ {fmt_g(rule.phi)}")

    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    scale = ", log scale" if log else ""
    ax.set_xlabel(f"inference probability q (sampler){scale}", fontsize=LABEL)
    ax.set_ylabel(f"trainer probability p{scale}", fontsize=LABEL)
    ax.tick_params(labelsize=SMALL)
    if log:
        _log_ticks(ax)
        edge = int(np.asarray(hist)[0, :].sum() + np.asarray(hist)[1:, 0].sum())
        if edge:
            ax.text(
                0.98,
                0.02,
                f"{edge:,} tokens in the edge bins (q or p < 1e-8 go there)",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=NOTE,
                color="0.3",
            )
    ax.set_title(
        f"{data.tokens:,} sampled tokens, {'log-log' if log else 'linear'} axes",
        fontsize=LABEL,
    )
    return handles, labels


@gc_paused()
def scatter_panels(
    data: FigureData,
    axes: Sequence[Axes] | None = None,
    *,
    ipo_eps: Sequence[float] = (0.3,),
    icepop: Sequence[tuple[float, float]] = ((0.2, 5.0),),
    extra: Sequence[Rule] = (),
    colors: dict[str, str] | None = None,
) -> Figure:
    """The linear and the log-log scatter side by side, one shared legend below (scatter.png).
    Boundaries and `colors` as in `scatter`."""
    if axes is None:
        fig = Figure(figsize=(11.0, 5.6), layout="constrained")
        axes = fig.subplots(1, 2)
    else:
        fig = axes[0].figure
    for ax, log in zip(axes, (False, True), strict=True):
        handles, labels = _scatter(data, ax, log, ipo_eps, icepop, extra, True, colors)
        ax.set_title("linear axes" if not log else "log-log axes: rare tokens", fontsize=LABEL)
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=min(len(labels), 4),
        fontsize=SMALL,
        frameon=False,
    )
    fig.suptitle(
        f"Trainer vs inference probability of {data.tokens:,} sampled tokens, "
        "with the rule boundaries (masked outside)",
        fontsize=LABEL + 1,
    )
    return fig
