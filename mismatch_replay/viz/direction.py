"""masked_direction.png: what each setting's mask costs the learning signal.

Design
------
One row per setting (FigureData.mask_cost, analysis/mask_cost.py: the chosen settings and
the presets of the IPO-vs-DPPO debate; computed data only, no token), three panels sharing
the rows:

1. the masked (weight rules: truncated) tokens split by the direction of their update --
   corrective (A * (p - q) < 0: the step pulls p back toward q), divergent (A * (p - q) > 0)
   and neutral (A == 0 or p == q) -- as shares of that setting's masked tokens (100%
   stacked bars, so a rule that masks few tokens reads as well as one that masks many), the
   masked count and its share of the loss tokens at the bar's end;
2. the share of the advantage mass sum |A| the mask removes beside its share of the tokens
   (log axis: the settings span decades), the gradient signal lost against the budget;
3. the masked tokens' mean entropy against the log's (a dashed line): whether a rule masks
   the high-entropy "forking" tokens disproportionately (absent without an entropy column).

DPPO and PPO-clip mask divergent updates only, so their first bar has no corrective part:
the figure shows at a glance which rules throw away corrective gradient.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from ..gcpause import paused as gc_paused
from .style import LABEL, NOTE, OKABE_ITO, SMALL, spec_label

GREEN, RED = OKABE_ITO["bluish_green"], OKABE_ITO["vermillion"]
PARTS = (  # column, legend label, colour
    ("masked_corrective", "corrective: A·(p−q) < 0, pulls p back toward q", GREEN),
    ("masked_divergent", "divergent: A·(p−q) > 0, pushes p away from q", RED),
    ("masked_neutral", "neutral: A = 0 or p = q", "#BBBBBB"),
)


def _pct(f: float) -> str:
    if f == 0:
        return "0%"
    return f"{100 * f:.2g}%" if f < 0.001 else f"{100 * f:.3g}%"


def _legend_below(ax) -> None:
    """The panel's legend under its axis label, one entry a line (never over the bars)."""
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, -0.2), fontsize=NOTE, frameon=False)


@gc_paused()
def masked_direction(cost: pl.DataFrame) -> Figure:
    """The figure (module docstring) from a mask-cost table (analysis.mask_cost.cost_table)."""
    n = cost.height
    ent = "masked_entropy_mean" in cost.columns and cost["masked_entropy_mean"].null_count() < n
    ncol = 3 if ent else 2
    fig = Figure(figsize=(4.6 * ncol + 1.6, 2.0 + 0.52 * max(n, 1)), layout="constrained")
    axes = fig.subplots(1, ncol, sharey=True, width_ratios=[1.25, 1.0, 0.9][:ncol])
    y = np.arange(n)[::-1].astype(float)  # the first setting on top
    labels = [spec_label(s) for s in cost["spec"].to_list()]
    rows = cost.to_dicts()
    # 1. direction of the masked tokens' updates, as shares of the masked tokens
    ax = axes[0]
    left = np.zeros(n)
    masked = np.array([max(r["masked_tokens"] or 0, 0) for r in rows], dtype=float)
    for col, label, color in PARTS:
        v = np.array([r[col] or 0 for r in rows], dtype=float)
        share = np.where(masked > 0, v / np.where(masked > 0, masked, 1.0), 0.0)
        ax.barh(y, share, left=left, color=color, height=0.62, label=label, gid=f"dir|{col}")
        left += share
    for yi, r, m in zip(y, rows, masked, strict=True):
        frac = m / r["tokens"] if r["tokens"] else math.nan
        text = f"{int(m):,} masked ({_pct(frac)} of tokens)" if m else "nothing masked"
        ax.text(1.02, yi, text, va="center", ha="left", fontsize=NOTE, clip_on=False)
    ax.set_xlim(0, 1)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0], ["0%", "25%", "50%", "75%", "100%"])
    ax.set_yticks(y, labels, fontsize=SMALL)
    ax.set_xlabel("share of the masked tokens, by the update's direction", fontsize=LABEL)
    ax.set_title("Which updates the mask removes", fontsize=LABEL)
    _legend_below(ax)
    # 2. advantage mass removed vs tokens removed (log axis)
    ax = axes[1]
    tok = np.array([(r["masked_tokens"] or 0) / r["tokens"] if r["tokens"] else 0 for r in rows])
    mass = np.array([r["masked_adv_mass_fraction"] or 0.0 for r in rows], dtype=float)
    h = 0.34
    ax.barh(y + h / 2, tok, height=h, color=OKABE_ITO["sky_blue"], label="tokens masked",
            gid="share|tokens")  # fmt: skip
    ax.barh(y - h / 2, mass, height=h, color=OKABE_ITO["blue"], label="advantage mass Σ|A| removed",
            gid="share|adv_mass")  # fmt: skip
    pos = np.r_[tok[tok > 0], mass[mass > 0]]
    if pos.size:
        ax.set_xscale("log")
        ax.set_xlim(10 ** math.floor(math.log10(pos.min()) - 0.3), min(1.0, pos.max() * 6))
        for yi, m in zip(y, mass, strict=True):
            if m > 0:
                ax.text(m * 1.15, yi - h / 2, _pct(m), va="center", fontsize=NOTE)
    ax.xaxis.set_major_formatter(lambda v, _: _pct(v))
    ax.set_xlabel("share of the loss tokens / of Σ|A| over them", fontsize=LABEL)
    ax.set_title("Gradient signal removed", fontsize=LABEL)
    _legend_below(ax)
    # 3. masked tokens' mean entropy vs the log's
    if ent:
        ax = axes[2]
        me = np.array([np.nan if r["masked_entropy_mean"] is None else r["masked_entropy_mean"]
                       for r in rows])  # fmt: skip
        base = next((r["entropy_mean"] for r in rows if r["entropy_mean"] is not None), None)
        ok = np.isfinite(me)
        ax.hlines(y[ok], 0, me[ok], color="#888888", lw=1.0)
        ax.plot(me[ok], y[ok], "o", color=OKABE_ITO["reddish_purple"], ms=6,
                label="masked tokens' mean", gid="entropy|masked")  # fmt: skip
        if base is not None:
            ax.axvline(base, color="black", ls="--", lw=1.0, gid="entropy|log",
                       label=f"every loss token's mean ({base:.3g})")  # fmt: skip
        top = np.nanmax(np.r_[me[ok], base or 0.0]) if ok.any() or base else 1.0
        ax.set_xlim(0, top * 1.25)
        ax.set_xlabel("mean entropy of the trainer (nats)", fontsize=LABEL)
        ax.set_title("Entropy of the masked tokens", fontsize=LABEL)
        _legend_below(ax)
    for a in axes:
        a.tick_params(labelsize=SMALL)
        a.set_ylim(-0.6, n - 0.4)
        a.grid(axis="x", color="#EEEEEE", lw=0.6)
        a.set_axisbelow(True)
    fig.suptitle("What each setting's mask costs the policy gradient", fontsize=LABEL + 1)
    return fig
