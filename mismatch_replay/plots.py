"""Figures from computed results: the probability scatter, masked-fraction sweeps, drift, buckets.

Design
------
Drawing never reads raw tokens or files: every function takes a `FigureData` (analysis.py) or a
sweep table and draws what is already counted. The scatter is a fixed 200 x 200 histogram, so a
figure of 1.8M tokens costs the same as one of 20k (~0.1 s on a laptop); rule boundaries are
drawn analytically from the rule's definition (IPO: p = q +- eps; IcePop: p = low q, p = high q;
KPop: the binary-KL contour; DPPO-TV: one-sided lines), never inferred from the tokens.

Every function takes `ax=None` (or `axes=None`) and returns the matplotlib `Figure`. It builds
`matplotlib.figure.Figure` objects directly, never the pyplot state machine, and passes styles
per artist instead of through rcParams, so it is headless (Agg), thread-safe and leaves the
caller's matplotlib settings alone.

Conventions shared by all figures:
* one colour per rule everywhere (`RULE_COLORS`, Okabe-Ito first, Paul Tol's muted set for the
  rest: both colour-blind safe); a second setting of the same rule changes the line style;
* masked fractions are drawn on log axes (the tail is the point). A fraction of 0 cannot be
  shown there, so it is drawn at the floor 0.5 / N (N = tokens of that row) and the figure says
  so; undefined fractions (no tokens) are dropped: no NaN is ever handed to matplotlib;
* weight rules (tis, cispo, seq-tis) mask nothing: their curve is the truncated fraction;
* legends sit outside the data (below or beside the axes).
Artists carry a `gid` ("ipo-upper|eps=0.3", "sweep|icepop|high=5|low", "preset|...", "target",
"floor", "k3", "step|<spec>", "bucket|<spec>") so tests and callers can find them.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter

from .engine import Q_BUCKET_EDGES
from .errors import UsageError
from .rules import REGISTRY, Rule, binary_kl, parse_rule

if TYPE_CHECKING:
    from .analysis import FigureData

# ----------------------------------------------------------------------------- style

# Okabe & Ito (2008) and Paul Tol's "muted" set: distinguishable under the common colour-vision
# deficiencies. The four rules of the headline figure get the strongest Okabe-Ito colours.
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
_TOL = {
    "indigo": "#332288",
    "teal": "#44AA99",
    "green": "#117733",
    "olive": "#999933",
    "rose": "#CC6677",
    "wine": "#882255",
    "purple": "#AA4499",
    "grey": "#777777",
}
# rule name -> colour, the same in every figure. Rules drawn in the same masked-fraction panel
# have different colours; a few colours repeat across panels that never share an axis.
RULE_COLORS: dict[str, str] = {
    "ipo": OKABE_ITO["vermillion"],
    "ipo-v1": OKABE_ITO["orange"],
    "dppo-tv": OKABE_ITO["reddish_purple"],
    "icepop": OKABE_ITO["blue"],
    "token-mis": OKABE_ITO["sky_blue"],
    "tis": OKABE_ITO["black"],
    "cispo": _TOL["grey"],
    "dual-clip": _TOL["wine"],
    "kpop": OKABE_ITO["bluish_green"],
    "token-k2": _TOL["olive"],
    "token-k3": _TOL["indigo"],
    "dppo-kl": _TOL["purple"],
    "m2po": _TOL["rose"],
    "ppo-clip": _TOL["green"],
    "gspo": OKABE_ITO["orange"],
    "seq-mis": OKABE_ITO["orange"],
    "geo-mis": OKABE_ITO["sky_blue"],
    "seq-tis": OKABE_ITO["black"],
    "veto": OKABE_ITO["reddish_purple"],
    "prob-error": OKABE_ITO["bluish_green"],
    "seq-mean-k3": _TOL["indigo"],
    "seq-max-k2": _TOL["olive"],
    "opsm": _TOL["purple"],
}
_SPARE = list(_TOL.values())

DISPLAY: dict[str, str] = {
    "ipo": "IPO",
    "ipo-v1": "IPO-v1",
    "icepop": "IcePop",
    "token-mis": "token-MIS",
    "kpop": "KPop",
    "m2po": "M2PO",
    "dppo-tv": "DPPO-TV",
    "dppo-kl": "DPPO-KL",
    "ppo-clip": "PPO-clip",
    "tis": "TIS",
    "cispo": "CISPO",
    "seq-tis": "seq-TIS",
    "seq-mis": "seq-MIS",
    "geo-mis": "geo-MIS",
    "opsm": "OPSM",
    "gspo": "GSPO",
}
_STYLES = ("-", "--", ":", "-.")
# how the swept parameter is drawn in the masked-fraction panels (two sides of a band differ)
_PARAM_STYLE = {"low": "--", "eps_low": "--", "c": ":", "clamp": "-."}
_DENSITY_CMAP = ListedColormap(colormaps["Greys"](np.linspace(0.35, 1.0, 256)), name="tokens")
_LABEL = 10  # font sizes (points): axis labels, ticks/legends, notes
_SMALL = 8.5
_NOTE = 7.5


def rule_color(name: str) -> str:
    """The rule's colour in every figure (rules unknown here get a stable spare colour)."""
    if name in RULE_COLORS:
        return RULE_COLORS[name]
    return _SPARE[sum(map(ord, name)) % len(_SPARE)]


def display_name(name: str) -> str:
    return DISPLAY.get(name, name)


def _g(v: float) -> str:
    return f"{v:g}"


def _fig_ax(ax: Axes | None, figsize: tuple[float, float]) -> tuple[Figure, Axes]:
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _light_log_ticks(ax: Axes) -> None:
    """Minor ticks at 2 and 5 only, unlabelled, on the log axes of `ax`: matplotlib makes a
    Tick object per minor tick, and 9 per decade over 12 decades triple the drawing time."""
    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_minor_locator(LogLocator(10.0, subs=(2.0, 5.0), numticks=12))
            axis.set_minor_formatter(NullFormatter())


def _fraction_column(kind: str) -> str:
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


# ----------------------------------------------------------------------------- scatter


def _log_ticks(ax: Axes) -> None:
    ticks = list(range(-8, 1))
    labels = [f"1e{k}" if k < 0 else "1" for k in ticks]
    ax.set_xticks(ticks, labels)
    ax.set_yticks(ticks, labels)


def _line(ax: Axes, x, y, *, gid: str, label: str | None, **kw) -> Line2D:
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    ok = np.isfinite(x) & np.isfinite(y)
    (ln,) = ax.plot(x[ok], y[ok], label=label if label else "_nolegend_", gid=gid, **kw)
    return ln


def _ipo_lines(ax: Axes, eps: float, log: bool, style: str, label: str) -> None:
    """IPO keeps |p - q| <= eps: the band p = q + eps (clipped at 1) and p = q - eps (p >= 0)."""
    color = rule_color("ipo")
    kw = {"color": color, "lw": 1.7, "ls": style}
    if log:
        q_up = np.logspace(-8, 0, 401)
        q_lo = eps + np.geomspace(1e-8, 1 - eps, 401) if eps < 1 else np.array([])
        _line(
            ax,
            np.log10(q_up),
            np.log10(np.minimum(q_up + eps, 1.0)),
            gid=f"ipo-upper|eps={_g(eps)}",
            label=label,
            **kw,
        )
        _line(
            ax,
            np.log10(q_lo),
            np.log10(q_lo - eps),
            gid=f"ipo-lower|eps={_g(eps)}",
            label=None,
            **kw,
        )
    else:
        x = np.linspace(0.0, 1.0, 401)
        x_lo = np.linspace(min(eps, 1.0), 1.0, 401)
        _line(ax, x, np.clip(x + eps, 0, 1), gid=f"ipo-upper|eps={_g(eps)}", label=label, **kw)
        if eps < 1:  # eps >= 1 masks nothing below the diagonal: no lower line
            _line(ax, x_lo, x_lo - eps, gid=f"ipo-lower|eps={_g(eps)}", label=None, **kw)


def _shift_lines(
    ax: Axes, name: str, low: float, high: float, log: bool, style: str, label: str
) -> None:
    """One-sided probability-difference lines p = q + high and p = q - low (DPPO-TV, IPO-v1)."""
    kw = {"color": rule_color(name), "lw": 1.6, "ls": style}
    if log:
        q_up = np.logspace(-8, math.log10(max(1 - high, 1e-8)), 401)
        q_lo = low + np.geomspace(1e-8, max(1 - low, 1e-8), 401)
        up = (np.log10(q_up), np.log10(q_up + high))
        lo = (np.log10(q_lo), np.log10(q_lo - low))
    else:
        x_up = np.linspace(0, max(1 - high, 0), 401)
        x_lo = np.linspace(min(low, 1), 1, 401)
        up, lo = (x_up, x_up + high), (x_lo, x_lo - low)
    tag = f"low={_g(low)},high={_g(high)}"
    _line(ax, *up, gid=f"{name}-upper|{tag}", label=label, **kw)
    _line(ax, *lo, gid=f"{name}-lower|{tag}", label=None, **kw)


def _cone_lines(
    ax: Axes, name: str, low: float, high: float, log: bool, style: str, label: str
) -> None:
    """IcePop keeps low <= p/q <= high: the lines p = low q and p = high q (straight in log-log)."""
    kw = {"color": rule_color(name), "lw": 1.7, "ls": style}
    tag = f"low={_g(low)},high={_g(high)}"
    if log:
        if low > 0:
            x = np.linspace(max(-8.0, -8.0 - math.log10(low)), 0.0, 2)
            _line(ax, x, x + math.log10(low), gid=f"{name}-low|{tag}", label=label, **kw)
            label = None
        x = np.linspace(-8.0, min(0.0, -math.log10(high)), 2)
        _line(ax, x, x + math.log10(high), gid=f"{name}-high|{tag}", label=label, **kw)
    else:
        if low > 0:
            x = np.linspace(0.0, 1.0, 2)
            _line(ax, x, low * x, gid=f"{name}-low|{tag}", label=label, **kw)
            label = None
        x = np.linspace(0.0, min(1.0, 1.0 / high), 2)
        _line(ax, x, high * x, gid=f"{name}-high|{tag}", label=label, **kw)


def _kpop_contour(ax: Axes, rule: Rule, log: bool, style: str) -> Line2D:
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
    color = rule_color(rule.name)
    cs = ax.contour(g, g, z, levels=[rule.phi], colors=[color], linewidths=1.6, linestyles=style)
    cs.set_gid(f"kpop-contour|phi={_g(rule.phi)},clamp={_g(rule.clamp)}")
    return Line2D([], [], color=color, lw=1.6, ls=style)


def scatter(
    data: FigureData,
    ax: Axes | None = None,
    *,
    log: bool,
    ipo_eps: Sequence[float] = (0.3,),
    icepop: Sequence[tuple[float, float]] = ((0.2, 5.0),),
    extra: Sequence[Rule] = (),
    colorbar: bool = True,
) -> Figure:
    """Inference probability q (x) vs trainer probability p (y): token density with rule bounds.

    `log=True` draws log10 probabilities (ticks 1e-8 .. 1): the IcePop cone becomes two
    straight lines and the rare tokens become visible. Boundaries: the IPO band p = q +- eps for
    each `ipo_eps`, the IcePop cone for each (low, high) in `icepop`, and for `extra` rules
    (ipo, ipo-v1, icepop, token-mis, kpop, dppo-tv instances) their own boundaries.
    """
    fig, ax = _fig_ax(ax, (5.4, 5.6))
    handles, labels = _scatter(data, ax, log, ipo_eps, icepop, extra, colorbar)
    ax.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.13),
        ncol=2,
        fontsize=_SMALL,
        frameon=False,
    )
    return fig


def _scatter(data, ax, log, ipo_eps, icepop, extra, colorbar) -> tuple[list, list[str]]:
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
        cb.set_label("tokens per bin", fontsize=_SMALL + 0.5)
        cb.ax.tick_params(labelsize=_SMALL)
    # under the density (zorder < image): visible where there are no tokens, never over them
    _line(
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
    for rule in extra:
        if rule.name == "ipo":
            ipo.append(float(rule.eps))
        elif rule.name in ("icepop", "token-mis"):
            cones.append((rule.name, float(rule.low or 0.0), float(rule.high)))
        elif rule.name in ("dppo-tv", "ipo-v1"):
            shifts.append((rule.name, float(rule.low), float(rule.high)))
        elif rule.name == "kpop":
            kpops.append(rule)
        else:
            raise UsageError(
                f"scatter: rule '{rule.name}' has no boundary in the (q, p) plane; drawable "
                "rules: ipo, ipo-v1, icepop, token-mis, kpop, dppo-tv."
            )
    for i, eps in enumerate(dict.fromkeys(ipo)):
        _ipo_lines(ax, eps, log, _STYLES[i % 4], f"IPO |p−q| ≤ {_g(eps)}")
    seen: dict[str, int] = {}
    for name, a, b in dict.fromkeys(cones):
        k = seen[name] = seen.get(name, -1) + 1
        bounds = f"[{_g(a)}, {_g(b)}]" if a > 0 else f"≤ {_g(b)}"
        _cone_lines(ax, name, a, b, log, _STYLES[k % 4], f"{display_name(name)} r ∈ {bounds}")
    for name, a, b in dict.fromkeys(shifts):
        k = seen[name] = seen.get(name, -1) + 1
        if name == "dppo-tv":
            label = f"DPPO-TV p−q ≤ {_g(b)} (A>0), q−p ≤ {_g(a)} (A≤0)"
        else:
            label = f"{display_name(name)} p−q ≤ {_g(b)}, q−p ≤ {_g(a)}"
        _shift_lines(ax, name, a, b, log, _STYLES[(k + 2) % 4], label)
    handles, labels = ax.get_legend_handles_labels()
    for i, rule in enumerate(kpops):
        handles.append(_kpop_contour(ax, rule, log, _STYLES[(i + 3) % 4]))
        labels.append(f"KPop max BKL ≤ {_g(rule.phi)}")

    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    scale = ", log scale" if log else ""
    ax.set_xlabel(f"inference probability q (sampler){scale}", fontsize=_LABEL)
    ax.set_ylabel(f"trainer probability p{scale}", fontsize=_LABEL)
    ax.tick_params(labelsize=_SMALL)
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
                fontsize=_NOTE,
                color="0.3",
            )
    ax.set_title(
        f"{data.tokens:,} sampled tokens, {'log-log' if log else 'linear'} axes",
        fontsize=_LABEL,
    )
    return handles, labels


def scatter_panels(
    data: FigureData,
    axes: Sequence[Axes] | None = None,
    *,
    ipo_eps: Sequence[float] = (0.3,),
    icepop: Sequence[tuple[float, float]] = ((0.2, 5.0),),
    extra: Sequence[Rule] = (),
) -> Figure:
    """The linear and the log-log scatter side by side, one shared legend below (scatter.png)."""
    if axes is None:
        fig = Figure(figsize=(11.0, 5.6), layout="constrained")
        axes = fig.subplots(1, 2)
    else:
        fig = axes[0].figure
    for ax, log in zip(axes, (False, True), strict=True):
        handles, labels = _scatter(data, ax, log, ipo_eps, icepop, extra, True)
        ax.set_title("linear axes" if not log else "log-log axes: rare tokens", fontsize=_LABEL)
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncol=min(len(labels), 4),
        fontsize=_SMALL,
        frameon=False,
    )
    fig.suptitle(
        f"Trainer vs inference probability of {data.tokens:,} sampled tokens, "
        "with the rule boundaries (masked outside)",
        fontsize=_LABEL + 1,
    )
    return fig


# ----------------------------------------------------------------------------- sweep curves


@dataclass(frozen=True)
class Family:
    """A panel of the masked-fraction grid: parameters in the same unit share an x axis."""

    key: str
    title: str
    xlabel: str
    members: tuple[str, ...]  # "rule.param" or "rule.*"
    unit_line: float | None = None  # a vertical reference (r = 1 for ratio bounds)


FAMILIES: tuple[Family, ...] = (
    Family(
        "dp",
        "Probability-difference thresholds",
        "threshold on |p − q| (probability)",
        ("ipo.*", "ipo-v1.*", "dppo-tv.*"),
    ),
    Family(
        "ratio",
        "Token ratio bounds (low < 1 < high)",
        "bound on the ratio r = p / q (tis, cispo: weight cap)",
        ("icepop.*", "token-mis.*", "tis.*", "cispo.*", "dual-clip.c"),
        unit_line=1.0,
    ),
    Family(
        "kl",
        "Token divergence thresholds",
        "threshold (nats; m2po: mean l² per step)",
        ("kpop.*", "token-k2.*", "token-k3.*", "dppo-kl.*", "m2po.*"),
    ),
    Family(
        "clip",
        "PPO-style clip (advantage sign)",
        "clip ε: r > 1 + ε_high or r < 1 − ε_low",
        ("ppo-clip.*", "dual-clip.eps_low", "dual-clip.eps_high", "gspo.*"),
    ),
    Family(
        "seqratio",
        "Sequence product-ratio bounds",
        "bound on exp(S_i) (veto: on each token's r)",
        ("seq-mis.*", "seq-tis.*", "veto.*"),
        unit_line=1.0,
    ),
    Family(
        "seqmean",
        "Sequence mean-ratio bounds",
        "bound on exp(G_i) (prob-error: on mean exp|l|)",
        ("geo-mis.*", "prob-error.*"),
        unit_line=1.0,
    ),
    Family(
        "seqkl",
        "Sequence divergence thresholds",
        "threshold on the sequence statistic (nats)",
        ("seq-mean-k3.*", "seq-max-k2.*", "opsm.*"),
    ),
)
_OTHER = Family("other", "Other rules", "swept value", ())
# what the x value means for the sequence-ratio rules (their panel mixes statistics)
_SEQ_X = {
    "seq-mis": "exp(S_i)",
    "geo-mis": "exp(G_i)",
    "seq-tis": "exp(S_i) cap",
    "veto": "min token r",
    "prob-error": "mean exp|l|",
    "seq-mean-k3": "mean k3",
    "seq-max-k2": "max k2",
    "opsm": "mean (lq − lp), A<0",
    "gspo": "on exp(G_i)",
}


def family_of(rule: str, param: str) -> Family:
    for fam in FAMILIES:
        if f"{rule}.{param}" in fam.members or f"{rule}.*" in fam.members:
            return fam
    return _OTHER


_LINE_KEYS = ["rule", "setting", "param"]
_GROUP_KEYS = ("step", "env", "q_bucket")


def _ungrouped(table: pl.DataFrame) -> pl.DataFrame:
    """A sweep table with one row per (rule, setting, param, value): groups summed."""
    groups = [c for c in _GROUP_KEYS if c in table.columns]
    if not groups:
        return table
    keys = [*_LINE_KEYS, "value", "kind"]
    return (
        table.group_by(keys, maintain_order=True)
        .agg(pl.col("tokens", "masked_tokens", "truncated_tokens").sum())
        .with_columns(
            masked_fraction=pl.when(pl.col("tokens") > 0).then(
                pl.col("masked_tokens") / pl.col("tokens")
            ),
            truncated_fraction=pl.when(pl.col("tokens") > 0).then(
                pl.col("truncated_tokens") / pl.col("tokens")
            ),
        )
    )


def _lines(table: pl.DataFrame) -> list[dict]:
    """Per (rule, setting, param): kind, values, fractions (NaN-free), tokens."""
    out = []
    for (rule, setting, param), part in table.group_by(_LINE_KEYS, maintain_order=True):
        kind = part["kind"][0] if "kind" in part.columns else "mask"
        col = _fraction_column(kind)
        part = part.filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan()).sort("value")
        if part.height == 0:
            continue
        out.append(
            {
                "rule": rule,
                "setting": setting or "",
                "param": param,
                "kind": kind,
                "x": part["value"].to_numpy().astype(float),
                "y": part[col].to_numpy().astype(float),
                "tokens": part["tokens"].to_numpy().astype(float),
            }
        )
    return out


def _is_log_grid(x: np.ndarray) -> bool:
    if x.size < 3 or np.any(x <= 0):
        return False
    d = np.diff(np.log(x))
    return bool(np.all(d > 0) and np.ptp(d) <= 1e-6 * max(abs(float(d.mean())), 1e-300))


def preset_points(table: pl.DataFrame) -> pl.DataFrame:
    """The rules' presets (or their default, when a rule has none) on each sweep line.

    A preset lies on the line (rule, setting, param) when its other parameters equal the
    line's setting. `fraction` is the table's value there when the preset value is a grid
    point (`exact` true); otherwise it is interpolated between the two neighbouring grid
    points (the true value lies between them: masked fractions are monotone in a threshold).
    Presets outside the grid are left out. Columns: rule, setting, param, value, presets,
    kind, fraction, exact.
    """
    rows = []
    for line in _lines(_ungrouped(table)):
        cls = REGISTRY.get(line["rule"])
        if cls is None:
            continue
        cands = list(cls.presets.items()) or [("default", {})]
        by_value: dict[float, list[str]] = {}
        for pname, vals in cands:
            try:
                r = cls(**vals)
            except TypeError:
                continue
            v = getattr(r, line["param"], None)
            if v is None or r.setting(line["param"]) != line["setting"]:
                continue
            by_value.setdefault(float(v), []).append(pname)
        x, y = line["x"], line["y"]
        for v, names in by_value.items():
            hit = np.flatnonzero(np.isclose(x, v, rtol=1e-9, atol=0.0))
            if hit.size:
                frac, exact = float(y[hit[0]]), True
            elif x.size >= 2 and x[0] < v < x[-1]:
                lx = np.log(x) if np.all(x > 0) else x
                lv = math.log(v) if np.all(x > 0) else v
                frac, exact = float(np.interp(lv, lx, y)), False
            else:
                continue
            rows.append(
                {
                    "rule": line["rule"],
                    "setting": line["setting"],
                    "param": line["param"],
                    "value": v,
                    "presets": ", ".join(names),
                    "kind": line["kind"],
                    "fraction": frac,
                    "exact": exact,
                }
            )
    schema = {
        "rule": pl.String,
        "setting": pl.String,
        "param": pl.String,
        "value": pl.Float64,
        "presets": pl.String,
        "kind": pl.String,
        "fraction": pl.Float64,
        "exact": pl.Boolean,
    }
    return pl.DataFrame(rows, schema=schema)


def _rule_names(rules) -> list[str] | None:
    """Rule names from names, SPECs or Rule instances (None: every rule)."""
    if rules is None:
        return None
    names = {r if isinstance(r, str) else r.name for r in rules}
    return sorted({n.split(":")[0].split("@")[0].strip() for n in names})


def masked_fraction(
    table: pl.DataFrame,
    ax: Axes | Sequence[Axes] | None = None,
    *,
    rules: Iterable[str | Rule] | None = None,
    target_fraction: float | None = None,
    markers: bool = True,
) -> Figure:
    """Masked (weight rules: truncated) fraction of tokens against each swept parameter.

    One line per (rule, setting, param) of the sweep table (grouped tables are summed over
    their groups), in small-multiple panels, one per parameter family (FAMILIES): parameters
    in the same unit share an axis. Log y; log x where the grid is log-spaced. `rules`
    restricts the rules drawn (names or Rule instances). Markers at the rules' presets
    (`preset_points`; open markers: between grid points, interpolated). A dashed line at
    `target_fraction`. Zero fractions are drawn at the floor 0.5 / tokens (dotted line).
    `ax`: None (a new grid), one Axes (only if a single family is drawn) or a list of Axes,
    one per family drawn.
    """
    names = _rule_names(rules)
    flat = _ungrouped(table)
    if flat.height and names is not None:
        flat = flat.filter(pl.col("rule").is_in(names))
    lines = _lines(flat)
    if not lines:
        raise UsageError("masked_fraction: the sweep table has no rows to draw (check --rule).")
    fams: dict[str, list[dict]] = {}
    fam_of: dict[str, Family] = {}
    for ln in lines:
        fam = family_of(ln["rule"], ln["param"])
        fams.setdefault(fam.key, []).append(ln)
        fam_of[fam.key] = fam
    order = [f.key for f in (*FAMILIES, _OTHER) if f.key in fams]
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
    floored_any = False
    for a, key in zip(axes, order, strict=False):
        floored_any |= _draw_family(a, fam_of[key], fams[key], points, target_fraction)
    tokens = int(max(ln["tokens"].max() for ln in lines))
    note = (
        f"{tokens:,} tokens. Each curve sweeps one parameter with the others fixed (in "
        "brackets). Markers: the rules' presets (defaults), filled where the preset is a grid "
        "point, open where it falls between two (interpolated). Dashed: the lower side of a "
        "band (low, eps_low); solid: the upper side or the only threshold. Weight rules (tis, "
        "cispo, seq-tis) mask nothing: their curve is the truncated fraction."
    )
    if floored_any:
        note += f" A fraction of 0 is drawn at 0.5/N = {0.5 / tokens:.2g} (dotted line)."
    if target_fraction is not None:
        note += f" Dashed black: the target fraction {target_fraction:.3g}."
    if ax is None:
        fig.suptitle(
            "Fraction of tokens masked as a function of each rule's threshold", fontsize=_LABEL + 1
        )
        if spare is not None:
            spare.text(
                0.02,
                0.98,
                textwrap.fill(note, 48),
                transform=spare.transAxes,
                va="top",
                ha="left",
                fontsize=_SMALL,
                color="0.25",
                gid="note",
            )
        else:
            fig.supxlabel(note, fontsize=_NOTE, color="0.25")
    return fig


def _framework_text(presets: str) -> str:
    """A preset marker's label: its frameworks ('default' for the rule's own default)."""
    names = [n.strip() for n in presets.split(",") if n.strip()]
    return ", ".join(names[:2]) + (" …" if len(names) > 2 else "")


def _draw_family(
    ax: Axes,
    fam: Family,
    lines: list[dict],
    points: pl.DataFrame | None,
    target: float | None,
) -> bool:
    xs = np.concatenate([ln["x"] for ln in lines])
    logx = bool(
        np.all(xs > 0)
        and (any(_is_log_grid(ln["x"]) for ln in lines) or xs.max() / xs.min() >= 100)
    )
    floor = min(0.5 / ln["tokens"].max() for ln in lines)
    floored = False
    drawn: dict[tuple[bytes, bytes], tuple[str, int]] = {}  # identical curves: label, count
    n_marks = 0
    for ln in lines:
        rule, param = ln["rule"], ln["param"]
        y = np.maximum(ln["y"], 0.5 / ln["tokens"])
        floored |= bool(np.any(ln["y"] <= 0))
        style = _PARAM_STYLE.get(param, "-")
        short = f"{display_name(rule)} {param}"
        label = short
        if fam.key in ("seqratio", "seqmean", "seqkl", "clip") and rule in _SEQ_X:
            label += f" [{_SEQ_X[rule]}]"
        if ln["setting"]:
            label += f" ({ln['setting'].replace(',', ', ')})"
        if ln["kind"] == "weight":
            label += ", truncated"
        # A curve equal to one already drawn (token-mis = icepop, cispo's = icepop's tokens)
        # is not drawn again (it would hide under the first): its line keeps its data but
        # no ink, and its legend entry says whose curve it is.
        key = (ln["x"].tobytes(), y.tobytes())
        first, dup = drawn.get(key, (short, 0))
        drawn[key] = (first, dup + 1)
        if dup:
            label += f" = {first}"
        gid = f"sweep|{rule}|{ln['setting']}|{param}"
        color = rule_color(rule)
        if dup:
            ax.plot(ln["x"], y, ls="none", color=color, label=label, gid=gid)
        elif ln["x"].size == 1:
            ax.plot(ln["x"], y, ls="none", marker="o", ms=5, color=color, label=label, gid=gid)
        else:
            ax.plot(ln["x"], y, ls=style, lw=1.6, color=color, label=label, gid=gid, zorder=2)
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
                    gid=f"preset|{rule}|{ln['setting']}|{param}|{_g(p['value'])}|{p['presets']}",
                    label="_nolegend_",
                )
                if not dup:  # the framework(s) whose preset this is, beside the marker
                    n_marks += 1  # alternate above / below: neighbours' labels do not collide
                    ax.annotate(
                        _framework_text(p["presets"]),
                        (p["value"], yv),
                        xytext=(5, 5) if n_marks % 2 else (5, -11),
                        textcoords="offset points",
                        fontsize=_NOTE - 1,
                        color=color,
                        zorder=6,
                        gid=f"preset-label|{rule}|{ln['setting']}|{param}|{_g(p['value'])}",
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
    _light_log_ticks(ax)
    ax.set_title(fam.title, fontsize=_LABEL)
    ax.set_xlabel(fam.xlabel, fontsize=_LABEL - 0.5)
    ax.set_ylabel("fraction of tokens masked", fontsize=_LABEL - 0.5)
    ax.tick_params(labelsize=_SMALL)
    ax.grid(True, which="major", color="0.92", lw=0.6)
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=1,
        fontsize=_NOTE,
        frameon=False,
        handlelength=2.6,
    )
    return floored


# ----------------------------------------------------------------------------- per step


def _settings(table: pl.DataFrame) -> list[tuple[str, pl.DataFrame]]:
    """(spec, rows) for each chosen setting of a grouped settings table, in order."""
    out = []
    for (spec,), part in table.group_by(["spec"], maintain_order=True):
        out.append((spec, part))
    return out


def _style_for(specs: Sequence[str]) -> dict[str, tuple[str, str, int]]:
    """spec -> (colour, line style, index within its rule): a 2nd setting of a rule is dashed."""
    seen: dict[str, int] = {}
    out = {}
    for spec in specs:
        rule = spec.split(":")[0].split("@")[0]  # a preset keeps its rule's colour
        k = seen[rule] = seen.get(rule, -1) + 1
        out[spec] = (rule_color(rule), _STYLES[k % 4], k)
    return out


def steps(data: FigureData, ax: Sequence[Axes] | None = None) -> Figure:
    """Per step: the mismatch KL (k3 token mean, log y) on top, each setting's masked fraction
    below, on a shared step axis. A dotted line marks the median k3 over steps, so a run that
    drifts away from it shows at a glance. `ax`: None or a pair of Axes (top, bottom)."""
    if ax is None:
        fig = Figure(figsize=(9.0, 6.4), layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1.0, 1.5])
    else:
        top, bottom = ax
        fig = top.figure
    sm = data.step_metrics.sort("step")
    sm = sm.filter(pl.col("kl_k3").is_not_null() & pl.col("kl_k3").is_not_nan())
    x = sm["step"].to_numpy()
    k3 = sm["kl_k3"].to_numpy().astype(float)
    tokens = sm["tokens"].to_numpy().astype(float)
    pos = k3 > 0
    mk = "o" if x.size <= 60 else None
    top.plot(
        x[pos],
        k3[pos],
        color="0.1",
        lw=1.5,
        marker=mk,
        ms=3.5,
        gid="k3",
        label="mismatch KL k3, token mean\n(prime-rl mismatch_kl/all/mean)",
    )
    if pos.any():
        med = float(np.median(k3[pos]))
        top.axhline(
            med, color="0.55", lw=0.9, ls=":", gid="k3-median", label=f"median over steps {med:.2g}"
        )
    top.set_yscale("log")
    top.set_ylabel("mismatch KL k3\n(token mean, nats)", fontsize=_LABEL)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=_SMALL, frameon=False)
    top.grid(True, color="0.92", lw=0.6)
    top.set_title(
        f"Per-step mismatch and masked fraction ({len(x)} steps, {data.tokens:,} tokens)",
        fontsize=_LABEL + 1,
    )

    settings = _settings(data.steps)
    styles = _style_for([s for s, _ in settings])
    floor = 0.5 / max(float(tokens.max()) if tokens.size else 1.0, 1.0)
    floored = False
    for spec, part in settings:
        kind = part["kind"][0]
        col = _fraction_column(kind)
        part = part.filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan()).sort("step")
        sx = part["step"].to_numpy()
        sy = part[col].to_numpy().astype(float)
        st = part["tokens"].to_numpy().astype(float)
        floored |= bool(np.any(sy <= 0))
        color, ls, _ = styles[spec]
        label = spec_label(spec) + (" (truncated)" if kind == "weight" else "")
        bottom.plot(
            sx,
            np.maximum(sy, 0.5 / st),
            color=color,
            ls=ls,
            lw=1.5,
            marker=mk,
            ms=3.5,
            label=label,
            gid=f"step|{spec}",
        )
        floor = min(floor, float((0.5 / st).min()) if st.size else floor)
    if floored:
        bottom.axhline(floor, color="0.55", lw=0.8, ls=":", gid="floor", label="_nolegend_")
        bottom.text(  # beside the axes, under the legend: never on the data
            1.02,
            0.0,
            "0 masked: drawn at\n0.5 / tokens of the step\n(dotted line)",
            transform=bottom.transAxes,
            fontsize=_NOTE,
            color="0.35",
            va="bottom",
            ha="left",
            gid="zero-note",
        )
    bottom.set_yscale("log")
    bottom.set_ylabel("fraction of the step's\ntokens masked", fontsize=_LABEL)
    bottom.set_xlabel("trainer step", fontsize=_LABEL)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(True, color="0.92", lw=0.6)
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=_SMALL, frameon=False)
    for a in (top, bottom):
        a.tick_params(labelsize=_SMALL)
    return fig


# ----------------------------------------------------------------------------- by bucket


def _p_text(v: float) -> str:
    if v == 0:
        return "0"
    if v < 0.01 and abs(math.log10(v) - round(math.log10(v))) < 1e-9:
        return f"1e{round(math.log10(v))}"
    return _g(v)


def bucket_labels(edges: Sequence[float] = Q_BUCKET_EDGES) -> list[str]:
    """Bucket labels from lower edges: '[0, 1e-4)', ..., '[0.9, 0.99)', '[0.99, 1]'."""
    out = []
    for i, lo in enumerate(edges):
        if i + 1 < len(edges):
            out.append(f"[{_p_text(lo)}, {_p_text(edges[i + 1])})")
        else:
            out.append(f"[{_p_text(lo)}, 1]")
    return out


def where_masked(data: FigureData, ax: Axes | None = None) -> Figure:
    """Masked fraction per inference-probability bucket for each chosen setting (grouped bars,
    log y). IcePop's cone cuts rare tokens; IPO's band cuts likely ones."""
    fig, ax = _fig_ax(ax, (10.0, 5.6))
    edges = list(Q_BUCKET_EDGES)
    labels = bucket_labels(edges)
    table = data.buckets
    settings = _settings(table)
    styles = _style_for([s for s, _ in settings])
    n = max(len(settings), 1)
    width = 0.84 / n
    bucket_tokens = np.zeros(len(edges))
    # tokens per bucket from the first setting that counts them (a sequence rule has no
    # per-bucket counts: tables.py)
    counted = [part for _, part in settings if part["tokens"].null_count() < part.height]
    for part in counted[:1]:
        for row in part.iter_rows(named=True):
            bucket_tokens[edges.index(row["q_bucket"])] = row["tokens"] or 0
    ymin, ymax = 1.0, 1e-7
    for j, (spec, part) in enumerate(settings):
        kind = part["kind"][0]
        col = _fraction_column(kind)
        uncounted = part[col].null_count() == part.height  # a sequence rule: tables.py
        part = part.filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan())
        idx = np.array([edges.index(b) for b in part["q_bucket"].to_list()], dtype=float)
        h = part[col].to_numpy().astype(float)
        pos = h[h > 0]
        if pos.size:
            ymin = min(ymin, float(pos.min()))
            ymax = max(ymax, float(pos.max()))
        color, _, k = styles[spec]
        label = spec_label(spec) + (" (truncated)" if kind == "weight" else "")
        label += " (a sequence rule: not counted per bucket)" if uncounted else ""
        ax.bar(
            idx + (j - (n - 1) / 2) * width,
            h,
            width=width * 0.95,
            color=color,
            edgecolor="white" if k == 0 else color,
            hatch=None if k == 0 else "////",
            fill=k == 0,
            lw=0.6 if k == 0 else 1.0,
            label=label,
            gid=f"bucket|{spec}",
        )
    ax.set_yscale("log")
    if ymax > 1e-7:
        ax.set_ylim(bottom=max(ymin * 0.4, 1e-7), top=min(1.6, ymax * 3.0))
    else:  # nothing masked anywhere: an empty panel, but a sane scale
        ax.set_ylim(1e-4, 1.0)
    ax.set_xlim(-0.6, len(edges) - 0.4)
    ticks = [
        f"{lab}\n{int(t):,} tok" if t else lab for lab, t in zip(labels, bucket_tokens, strict=True)
    ]
    ax.set_xticks(np.arange(len(edges)), ticks, fontsize=_NOTE + 0.5)
    ax.set_xlabel(
        "inference probability q of the sampled token (bucket; tokens in it)", fontsize=_LABEL
    )
    ax.set_ylabel("fraction of the bucket's tokens masked", fontsize=_LABEL)
    ax.tick_params(axis="y", labelsize=_SMALL)
    ax.grid(True, axis="y", color="0.92", lw=0.6)
    ax.set_axisbelow(True)
    ax.set_title(
        "Where each setting masks: by the sampler's probability of the token "
        "(no bar: nothing masked)",
        fontsize=_LABEL + 1,
    )
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=min(3, n),
        fontsize=_SMALL,
        frameon=False,
    )
    return fig


# ----------------------------------------------------------------------------- files

FIGURES = ("scatter", "masked_fraction", "steps", "where_masked")
FORMATS = ("png", "svg", "pdf")


def scatter_kwargs(data: FigureData) -> dict:
    """The headline scatter's boundaries from the chosen settings: the first IPO eps and the
    first IcePop band (the IPO docs' figure: eps 0.3 and [0.2, 5] by default)."""
    ipo = [float(r.eps) for r in data.settings if r.name == "ipo" and r.eps is not None]
    ice = [
        (float(r.low or 0.0), float(r.high))
        for r in data.settings
        if r.name == "icepop" and r.high is not None
    ]
    return {"ipo_eps": tuple(ipo[:1]) or (0.3,), "icepop": tuple(ice[:1]) or ((0.2, 5.0),)}


def figures(data: FigureData, target_fraction: float | None = None) -> dict[str, Callable]:
    """name -> a function that builds that figure (what `render_all` writes)."""
    return {
        "scatter": lambda: scatter_panels(data, **scatter_kwargs(data)),
        "masked_fraction": lambda: masked_fraction(data.sweep, target_fraction=target_fraction),
        "steps": lambda: steps(data),
        "where_masked": lambda: where_masked(data),
    }


def save(fig: Figure, path: Path, fmt: str, dpi: int = 150, force: bool = True) -> Path:
    """Write a figure atomically (output.atomic_write: a hidden temporary file in the same
    folder, then an exclusive publish unless force)."""
    from . import __version__
    from .output import atomic_write

    meta = {
        "png": {"Software": f"mismatch-replay {__version__}"},
        "svg": {"Date": None},
        "pdf": {"CreationDate": None},
    }[fmt]
    return atomic_write(
        Path(path), lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi, metadata=meta), force
    )


def render_all(
    data: FigureData,
    outdir: Path,
    fmt: str = "png",
    target_fraction: float | None = None,
    force: bool = False,
    dpi: int = 150,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Path]:
    """Write scatter, masked_fraction, steps and where_masked (.png/.svg/.pdf) into outdir.

    Refuses (before writing anything) if any of the files exists, unless `force`.
    `progress(done, total)` is called after each figure.
    """
    fmt = fmt.lower().lstrip(".")
    if fmt not in FORMATS:
        raise UsageError(f"figure format '{fmt}': use one of {', '.join(FORMATS)}.")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UsageError(f"-o {outdir}: that is a file; give a directory for the figures.")
    targets = {name: outdir / f"{name}.{fmt}" for name in FIGURES}
    existing = [p for p in targets.values() if p.exists()]
    if existing and not force:
        more = f" (and {len(existing) - 1} more)" if len(existing) > 1 else ""
        raise UsageError(f"{existing[0]}: the file exists{more}; pass --force to overwrite it.")
    from .output import ensure_dir

    ensure_dir(outdir)
    builds = figures(data, target_fraction)
    for i, (name, build) in enumerate(builds.items()):
        save(build(), targets[name], fmt, dpi, force=force)
        if progress is not None:
            progress(i + 1, len(builds))
    return targets


# ----------------------------------------------------------------------------- by length


def masked_by_length(
    table: pl.DataFrame,
    ax: Axes | None = None,
    column: str | None = None,
    max_lines: int = 12,
) -> Figure:
    """Masked fraction against sequence length, one line per rule setting (`spec`), from a
    `--by length` sweep table (rows: spec x length bucket; pass the settings to draw, e.g.
    the table filtered to a few values; at most `max_lines` are drawn, the rest named in a
    note). x: the length bucket [2^k, 2^(k+1)) of loss tokens, log2 axis, each point at the
    bucket's geometric centre, the bucket's sequences under its tick. y (log): `column`,
    by default each rule's masked token fraction (truncated for weight rules);
    "masked_sequence_fraction" counts sequences instead. A product rule (seq-mis) climbs with
    length, a geometric-mean rule (geo-mis) falls: the figure that tells them apart. Zero
    fractions are drawn hollow on one floor row, 0.5 / the largest N drawn (N: a row's tokens,
    or sequences), marked by a dotted line."""
    if "length" not in table.columns:
        raise UsageError("masked_by_length draws a sweep table made with --by length.")
    fig, ax = _fig_ax(ax, (8.0, 5.2))
    specs = table["spec"].unique(maintain_order=True).to_list()
    left_out = specs[max_lines:]
    specs = specs[:max_lines]
    styles = _style_for(specs)
    seqs: dict[int, int] = {}
    rows = []
    for spec in specs:
        part = table.filter(pl.col("spec") == spec).sort("length")
        kind = part["kind"][0]
        col = column or _fraction_column(kind)
        if col == "masked_sequence_fraction" and kind == "weight":
            continue  # a weight rule masks no sequence
        denom = "sequences" if col == "masked_sequence_fraction" else "tokens"
        part = part.filter(pl.col(col).is_not_null() & pl.col(denom).is_not_null())
        if part.height == 0:
            continue
        for lo, n in zip(part["length"].to_list(), part["sequences"].to_list(), strict=True):
            if n is not None:
                seqs[int(lo)] = max(seqs.get(int(lo), 0), int(n))
        rows.append((spec, kind, part, col, denom))
    # one floor for every zero (0.5 / the largest N drawn): zeros line up on one row
    biggest = max((float(p[d].max()) for _, _, p, _, d in rows), default=1.0)
    floor = 0.5 / max(biggest, 1.0)
    ymin, ymax, floored = 1.0, 0.0, False
    n_rows = max(len(rows), 1)
    for j, (spec, kind, part, col, _denom) in enumerate(rows):
        # the bucket's geometric centre, each line nudged sideways so that points meet less
        nudge = 2.0 ** (0.5 + 0.04 * (j - (n_rows - 1) / 2))
        x = part["length"].to_numpy().astype(float) * nudge
        y = part[col].to_numpy().astype(float)
        zero = y <= 0
        floored |= bool(zero.any())
        yy = np.where(zero, floor, y)
        if (~zero).any():
            ymin = min(ymin, float(yy[~zero].min()))
            ymax = max(ymax, float(yy[~zero].max()))
        color, style, _ = styles[spec]
        label = spec_label(spec) + (" (truncated)" if kind == "weight" else "")
        _line(
            ax,
            x,
            yy,
            gid=f"length|{spec}",
            label=label,
            color=color,
            ls=style,
            lw=1.6,
            marker="o",
            ms=4.5,
            markevery=np.flatnonzero(~zero).tolist(),
        )
        if zero.any():
            ax.plot(
                x[zero],
                yy[zero],
                ls="none",
                marker="o",
                ms=4.5,
                mfc="white",
                mec=color,
                gid=f"floor|{spec}",
                label="_nolegend_",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    low = min(ymin, floor) if floored else ymin
    ax.set_ylim(max(low * 0.4, 1e-12), min(1.6, ymax * 3.0) if ymax > 0 else 1.0)
    if floored:
        ax.axhline(floor, color="0.6", ls=":", lw=0.8, gid="floor")
        ax.annotate(
            "0: nothing masked (hollow)",
            (0.005, floor),
            xycoords=("axes fraction", "data"),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=_NOTE,
            color="0.35",
        )
    if seqs:
        los = sorted(seqs)
        ax.set_xticks(
            [lo * math.sqrt(2.0) for lo in los],  # a bucket's geometric centre
            [f"{lo:,}–{2 * lo - 1:,}\n{seqs[lo]:,} seq" for lo in los],
            fontsize=_NOTE,
        )
        ax.set_xticks([], minor=True)
        ax.set_xlim(los[0] * 0.85, los[-1] * 2.0 * 1.2)
    what = "sequences" if column == "masked_sequence_fraction" else "loss tokens"
    ax.set_xlabel(
        "sequence length: loss tokens per sequence (bucket [2^k, 2^(k+1)); sequences in it)",
        fontsize=_LABEL,
    )
    ax.set_ylabel(f"fraction of the bucket's {what} masked", fontsize=_LABEL)
    ax.tick_params(axis="y", labelsize=_SMALL)
    ax.grid(True, which="major", color="0.92", lw=0.6)
    ax.set_axisbelow(True)
    ax.set_title("Masked fraction by sequence length", fontsize=_LABEL + 1)
    if left_out:  # named where it cannot cover a line
        ax.set_title(
            f"Masked fraction by sequence length ({len(left_out)} more setting(s) not drawn)",
            fontsize=_LABEL + 1,
        )
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=min(2, max(len(specs), 1)),
        fontsize=_SMALL,
        frameon=False,
    )
    return fig
