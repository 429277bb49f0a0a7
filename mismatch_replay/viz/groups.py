"""Figures of the chosen settings over groups: per trainer step, per q bucket, per length.

Design
------
Each figure draws a grouped table that the replay already counted, never tokens: `steps`
the per-step metrics (`FigureData.step_metrics`, the k3 token mean) over each chosen
setting's per-step masked fraction (`FigureData.steps`); `where_masked` the per-bucket
table (`FigureData.buckets`, buckets of the inference probability q at
`metrics.Q_BUCKET_EDGES`) as grouped bars; `masked_by_length` a `--by length` sweep table,
one line per setting over buckets [2^k, 2^(k+1)) of loss tokens per sequence.

A setting keeps its rule's colour (`style.rule_color`; `colors` overrides) and a second
setting of the same rule changes the line style (or hatches its bars). Zero fractions
cannot sit on log axes: they are drawn on a floor (0.5 / the group's tokens; `steps` and
`masked_by_length` mark it with a dotted line and a note beside the data), and undefined
fractions (no tokens) are dropped. A sequence rule has no per-bucket counts: its bars are
absent and its legend entry says so. Gids: "k3", "k3-median", "step|<spec>",
"bucket|<spec>", "length|<spec>", "floor", "floor|<spec>", "zero-note".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..errors import UsageError
from ..gcpause import paused as gc_paused
from ..metrics import Q_BUCKET_EDGES  # not engine's: a figure process imports no engine
from .style import (
    LABEL,
    NOTE,
    SMALL,
    draw_line,
    fig_ax,
    fmt_g,
    fraction_column,
    settings_of,
    spec_label,
    style_for,
)

if TYPE_CHECKING:
    from ..analysis import FigureData


@gc_paused()
def steps(
    data: FigureData, ax: Sequence[Axes] | None = None, *, colors: dict[str, str] | None = None
) -> Figure:
    """Per step: the mismatch KL (k3 token mean, log y) on top, each setting's masked fraction
    below, on a shared step axis. A dotted line marks the median k3 over steps, so a run that
    drifts away from it shows at a glance. `ax`: None or a pair of Axes (top, bottom);
    `colors`: rule name -> colour, overriding the rules' own."""
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
    top.set_ylabel("mismatch KL k3\n(token mean, nats)", fontsize=LABEL)
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=SMALL, frameon=False)
    top.grid(True, color="0.92", lw=0.6)
    top.set_title(
        f"Per-step mismatch and masked fraction ({len(x)} steps, {data.tokens:,} tokens)",
        fontsize=LABEL + 1,
    )

    settings = settings_of(data.steps)
    styles = style_for([s for s, _ in settings], colors)
    floor = 0.5 / max(float(tokens.max()) if tokens.size else 1.0, 1.0)
    floored = False
    for spec, part in settings:
        kind = part["kind"][0]
        col = fraction_column(kind)
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
            fontsize=NOTE,
            color="0.35",
            va="bottom",
            ha="left",
            gid="zero-note",
        )
    bottom.set_yscale("log")
    bottom.set_ylabel("fraction of the step's\ntokens masked", fontsize=LABEL)
    bottom.set_xlabel("trainer step", fontsize=LABEL)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(True, color="0.92", lw=0.6)
    bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=SMALL, frameon=False)
    for a in (top, bottom):
        a.tick_params(labelsize=SMALL)
    return fig


# ----------------------------------------------------------------------------- by bucket


def _p_text(v: float) -> str:
    if v == 0:
        return "0"
    if v < 0.01 and abs(math.log10(v) - round(math.log10(v))) < 1e-9:
        return f"1e{round(math.log10(v))}"
    return fmt_g(v)


def bucket_labels(edges: Sequence[float] = Q_BUCKET_EDGES) -> list[str]:
    """Bucket labels from lower edges: '[0, 1e-4)', ..., '[0.9, 0.99)', '[0.99, 1]'."""
    out = []
    for i, lo in enumerate(edges):
        if i + 1 < len(edges):
            out.append(f"[{_p_text(lo)}, {_p_text(edges[i + 1])})")
        else:
            out.append(f"[{_p_text(lo)}, 1]")
    return out


@gc_paused()
def where_masked(
    data: FigureData, ax: Axes | None = None, *, colors: dict[str, str] | None = None
) -> Figure:
    """Masked fraction per inference-probability bucket for each chosen setting (grouped bars,
    log y). IcePop's cone cuts rare tokens; IPO's band cuts likely ones. `colors` as in
    `steps`."""
    fig, ax = fig_ax(ax, (10.0, 5.6))
    edges = list(Q_BUCKET_EDGES)
    labels = bucket_labels(edges)
    table = data.buckets
    settings = settings_of(table)
    styles = style_for([s for s, _ in settings], colors)
    n = max(len(settings), 1)
    width = 0.84 / n
    bucket_tokens = np.zeros(len(edges))
    # tokens per bucket from the first setting that counts them (a sequence rule has no
    # per-bucket counts: engine.readout)
    counted = [part for _, part in settings if part["tokens"].null_count() < part.height]
    for part in counted[:1]:
        for row in part.iter_rows(named=True):
            bucket_tokens[edges.index(row["q_bucket"])] = row["tokens"] or 0
    ymin, ymax = 1.0, 1e-7
    for j, (spec, part) in enumerate(settings):
        kind = part["kind"][0]
        col = fraction_column(kind)
        uncounted = part[col].null_count() == part.height  # a sequence rule: engine.readout
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
    ax.set_xticks(np.arange(len(edges)), ticks, fontsize=NOTE + 0.5)
    ax.set_xlabel(
        "inference probability q of the sampled token (bucket; tokens in it)", fontsize=LABEL
    )
    ax.set_ylabel("fraction of the bucket's tokens masked", fontsize=LABEL)
    ax.tick_params(axis="y", labelsize=SMALL)
    ax.grid(True, axis="y", color="0.92", lw=0.6)
    ax.set_axisbelow(True)
    ax.set_title(
        "Where each setting masks: by the sampler's probability of the token "
        "(no bar: nothing masked)",
        fontsize=LABEL + 1,
    )
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=min(3, n),
        fontsize=SMALL,
        frameon=False,
    )
    return fig


# ----------------------------------------------------------------------------- by length


@gc_paused()
def masked_by_length(
    table: pl.DataFrame,
    ax: Axes | None = None,
    column: str | None = None,
    max_lines: int = 12,
    *,
    colors: dict[str, str] | None = None,
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
    or sequences), marked by a dotted line. `colors` as in `steps`."""
    if "length" not in table.columns:
        raise UsageError("masked_by_length draws a sweep table made with --by length.")
    fig, ax = fig_ax(ax, (8.0, 5.2))
    specs = table["spec"].unique(maintain_order=True).to_list()
    left_out = specs[max_lines:]
    specs = specs[:max_lines]
    styles = style_for(specs, colors)
    seqs: dict[int, int] = {}
    rows = []
    for spec in specs:
        part = table.filter(pl.col("spec") == spec).sort("length")
        kind = part["kind"][0]
        col = column or fraction_column(kind)
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
        draw_line(
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
        ax.annotate(  # under the floor row, where no point is drawn
            "0: nothing masked (hollow, on the dotted line)",
            (0.005, floor),
            xycoords=("axes fraction", "data"),
            xytext=(0, -4),
            textcoords="offset points",
            va="top",
            fontsize=NOTE,
            color="0.35",
            gid="zero-note",
        )
    if seqs:
        los = sorted(seqs)
        ax.set_xticks(
            [lo * math.sqrt(2.0) for lo in los],  # a bucket's geometric centre
            [f"{lo:,}–{2 * lo - 1:,}\n{seqs[lo]:,} seq" for lo in los],
            fontsize=NOTE,
        )
        ax.set_xticks([], minor=True)
        ax.set_xlim(los[0] * 0.85, los[-1] * 2.0 * 1.2)
    what = "sequences" if column == "masked_sequence_fraction" else "loss tokens"
    ax.set_xlabel(
        "sequence length: loss tokens per sequence (bucket [2^k, 2^(k+1)); sequences in it)",
        fontsize=LABEL,
    )
    ax.set_ylabel(f"fraction of the bucket's {what} masked", fontsize=LABEL)
    ax.tick_params(axis="y", labelsize=SMALL)
    ax.grid(True, which="major", color="0.92", lw=0.6)
    ax.set_axisbelow(True)
    title = "Masked fraction by sequence length"
    if len(seqs) == 1:  # nothing to compare across lengths: say so where it is read first
        (lo,) = seqs
        title += f"\n(one bucket: every sequence has {lo:,}–{2 * lo - 1:,} loss tokens)"
    if left_out:  # named where it cannot cover a line
        title += f" ({len(left_out)} more setting(s) not drawn)"
    ax.set_title(title, fontsize=LABEL + 1)
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=min(2, max(len(specs), 1)),
        fontsize=SMALL,
        frameon=False,
    )
    return fig
