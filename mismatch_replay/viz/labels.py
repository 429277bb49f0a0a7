"""Labels beside points, off the data: where a figure names its markers (masked_fraction's
presets with their frameworks).

Design
------
A figure collects `Label`s while it draws (the point, in data coordinates, and its text) and
calls `place_labels` last, once: the layout is run first, and only the layout (the figure's
layout engine, on the Agg canvas savefig's PNG draws with: `style.agg_canvas`; constrained
layout measures the panels' decorations itself, each axis's ticks computed once per pass:
`style.steady_ticks`; nothing is drawn), so the search works on
the final display coordinates and text sizes; the labels are then kept out of the layout, so
placing them moves no panel (a figure that made its own Figure may then switch its layout
engine off, as masked_fraction does: saving it does not lay it out again). Each label may go
at one of `_RADII` x `_ANGLES` offsets (points) around its point, aligned so that its
nearest corner or edge faces the point. A place is allowed when the label stays inside its
panel, keeps `_GAP_PT` from every other label, covers no marker and no leader line, and its
own leader crosses no other label; among those, the cost counts the drawn lines it covers
(curves 6 per 1.5 px of line, reference lines such as the target 1.5), the curves its leader
crosses (3), the distance (1 per point) and a small preference for the upper right. Labels
are placed greedily, in a few orders (the most crowded first, by x, by y), the cheapest
arrangement kept and then improved one label at a time. What a place costs and whether the
panel allows it (inside, off the markers) do not depend on the other labels: that is
computed once per label (`_Panel.fixed`), and each step of the search checks only the labels
already placed. A label placed further than `_LEADER_PT` from its point gets a thin leader
line in its colour. Labels of one `group` with the same text at the same x or within
`merge_pt` points of each other become one label (a band's two sides at one preset): the
text is not repeated.

Gids: "<prefix>-label|<key>" on the text, "<prefix>-leader|<key>" on the leader line.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.text import Text

from .style import agg_canvas, steady_ticks

# where a label may go: rings of offsets (points) around its point, nearest first
_RADII = (6.0, 11.0, 17.0, 25.0, 35.0, 48.0, 64.0)
_ANGLES = np.deg2rad(np.arange(0.0, 360.0, 22.5))
_LEADER_PT = 8.0  # further than this from its point: a leader line
_REFERENCE_GIDS = ("target", "floor", "unit")  # lines a label may cover more cheaply
_FALLBACK = 1e6  # the cost of a label that found no allowed place
# the least space between two labels (points), side by side and one above the other:
# two labels on one line must not read as one ("prime-rl-legacy prime-rl")
_GAP_PT = (9.0, 2.5)


@dataclass
class Label:
    """A text to draw beside a point of `ax` (data coordinates), placed by `place_labels`."""

    ax: Axes
    text: str
    xy: tuple[float, float]
    color: str
    key: str  # the gids' tail
    group: str = ""  # labels of one group with the same text close together merge
    also: list[str] = field(default_factory=list)  # the keys merged into this one


# the candidate offsets, flattened: radius, direction, and the text's alignment there
_R = np.repeat(np.asarray(_RADII), len(_ANGLES))
_A = np.tile(_ANGLES, len(_RADII))
_C, _S = np.cos(_A), np.sin(_A)
_FX = np.where(_C > 0.38, 0.0, np.where(_C < -0.38, 1.0, 0.5))  # left, right, center
_FY = np.where(_S > 0.38, 0.0, np.where(_S < -0.38, 1.0, 0.5))  # bottom, top, center
_HA = {0.0: "left", 1.0: "right", 0.5: "center"}
_VA = {0.0: "bottom", 1.0: "top", 0.5: "center"}
_PREFER = _R + 2.0 * (1.0 - np.cos(_A - 0.6))  # near first, then the upper right
_LEAD = _R > _LEADER_PT
_T = np.linspace(0.0, 1.0, 12)  # points along a leader, for the label-crossing test


def _renderer(fig: Figure, axes: Sequence[Axes]):
    """Lay `fig` out as drawing it would and return the renderer to measure text with,
    drawing nothing: the layout engine (constrained layout places the panels at draw time)
    measures the panels' decorations itself, and the labels need only where the panels are
    and their final limits (`axes`' autoscaling and aspect, as Axes.draw begins)."""
    root = agg_canvas(fig)  # a Figure made without pyplot: measured as savefig's PNG draws
    engine = root.get_layout_engine()
    if root.axes and engine is not None:
        # as Figure.draw: a figure too small to lay out is drawn as it is
        with contextlib.suppress(ValueError), steady_ticks(root):
            engine.execute(root)
    renderer = root._get_renderer()  # the layout's own (Agg keeps one per size and dpi)
    for ax in axes:
        ax._unstale_viewLim()
        locator = ax.get_axes_locator()
        ax.apply_aspect(locator(ax, renderer) if locator else None)
    return renderer


def _obstacles(ax: Axes, px: float) -> tuple[np.ndarray, ...]:
    """What a label must not cover in `ax`: the drawn lines as display points at most
    1.5 px apart (n, 2), their weights (n,), whether each is on a curve rather than a
    reference line (n,), and every marker's box (m, 4)."""
    pts, curve, boxes = [], [], []
    for ln in ax.get_lines():
        if not ln.get_visible():
            continue
        xy = ln.get_transform().transform(np.asarray(ln.get_xydata(), float))
        xy = xy[np.all(np.isfinite(xy), axis=1)]
        if xy.shape[0] == 0:
            continue
        if ln.get_marker() not in (None, "", " ", "None", "none"):
            r = (ln.get_markersize() / 2 + ln.get_markeredgewidth()) * px
            boxes.append(np.column_stack([xy - r, xy + r]))
        if ln.get_linestyle() in ("None", "none", "", " ") or xy.shape[0] < 2:
            continue
        seg = np.diff(xy, axis=0)
        n = np.clip(np.ceil(np.hypot(seg[:, 0], seg[:, 1]) / 1.5).astype(int), 1, 2000)
        t = np.concatenate([np.arange(k) / k for k in n])
        i = np.repeat(np.arange(len(n)), n)
        pts += [xy[i] + seg[i] * t[:, None], xy[-1:]]
        curve.append(np.full(len(i) + 1, (ln.get_gid() or "") not in _REFERENCE_GIDS))
    if pts:
        p, c = np.concatenate(pts), np.concatenate(curve)
    else:
        p, c = np.zeros((0, 2)), np.zeros(0, bool)
    b = np.concatenate(boxes) if boxes else np.zeros((0, 4))
    return p, np.where(c, 6.0, 1.5), c, b


def _hits(boxes: np.ndarray, others: np.ndarray, pad: float, pady: float | None = None):
    """(k,) whether each of the k boxes overlaps any of the others, grown by `pad` across
    (and `pady` up and down, default `pad`)."""
    if others.shape[0] == 0:
        return np.zeros(boxes.shape[0], bool)
    pady = pad if pady is None else pady
    b, o = boxes[:, None, :], others[None, :, :]
    return np.any(
        (b[..., 0] < o[..., 2] + pad)
        & (o[..., 0] < b[..., 2] + pad)
        & (b[..., 1] < o[..., 3] + pady)
        & (o[..., 1] < b[..., 3] + pady),
        axis=1,
    )


def _covers(boxes: np.ndarray, pts: np.ndarray, pad: float) -> np.ndarray:
    """(k, n) whether each box (grown by pad) covers each point."""
    x, y = pts[None, :, 0], pts[None, :, 1]
    return (
        (x >= boxes[:, None, 0] - pad)
        & (x <= boxes[:, None, 2] + pad)
        & (y >= boxes[:, None, 1] - pad)
        & (y <= boxes[:, None, 3] + pad)
    )


class _Panel:
    """The search state of one panel: its frame, obstacles, and per label what does not
    depend on the other labels (`_fixed`)."""

    def __init__(self, ax: Axes, px: float, renderer, font: FontProperties, labs: list[Label]):
        frame = ax.get_window_extent(renderer)
        self.inner = (frame.x0 + 2, frame.y0 + 2, frame.x1 - 2, frame.y1 - 2)
        self.px = px
        self.pts, self.weight, self.curve, self.marks = _obstacles(ax, px)
        self.anchors = np.array([ax.transData.transform(lab.xy) for lab in labs], float)
        self.size = [
            renderer.get_text_width_height_descent(lab.text, font, ismath=False)[:2] for lab in labs
        ]
        self._fixed: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def fixed(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Label i at each offset: its box (k, 4), its leader's points (k, len(_T), 2) and
        what it costs there (k,) given the lines alone, inf where the panel forbids it
        (outside the frame, on a marker). Computed once per label: `best` asks for it in
        every order tried and every improving pass."""
        got = self._fixed.get(i)
        if got is not None:
            return got
        (ax_, ay), (w, h), px = self.anchors[i], self.size[i], self.px
        tx, ty = ax_ + _R * _C * px, ay + _R * _S * px  # the text's anchor: the leader's end
        x0, y0 = tx - _FX * w, ty - _FY * h
        boxes = np.column_stack([x0, y0, x0 + w, y0 + h])
        lo, hi = self.inner[:2], self.inner[2:]
        ok = (x0 >= lo[0]) & (y0 >= lo[1]) & (x0 + w <= hi[0]) & (y0 + h <= hi[1])
        ok &= ~_hits(boxes, self.marks, 1.0)
        seg = np.stack([ax_ + (tx - ax_)[:, None] * _T, ay + (ty - ay)[:, None] * _T], axis=-1)
        cost = np.full(len(_R), np.inf)
        if ok.any():
            near = (np.abs(self.pts[:, 0] - ax_) < 64 * px + w + 4) & (
                np.abs(self.pts[:, 1] - ay) < 64 * px + h + 4
            )
            pts, wt, curve = self.pts[near], self.weight[near], self.curve[near]
            k = np.flatnonzero(ok)
            c = _covers(boxes[k], pts, 1.0).astype(float) @ wt
            # a leader across curves (not the curve through its own point)
            d = np.column_stack([tx[k] - ax_, ty[k] - ay])
            rel = pts - (ax_, ay)
            t = np.clip((rel @ d.T) / np.maximum((d * d).sum(1), 1e-12), 0.0, 1.0)  # (n, k)
            dist = np.hypot(rel[:, :1] - t * d[:, 0], rel[:, 1:] - t * d[:, 1])
            far = np.hypot(rel[:, 0], rel[:, 1]) > 6.0 * px
            crossed = ((dist <= 1.5) & (curve & far)[:, None]).sum(0)
            cost[k] = c + 3.0 * crossed * _LEAD[k] + _PREFER[k]
        self._fixed[i] = got = (boxes, seg, cost)
        return got

    def best(self, i: int, placed: dict[int, tuple[int, np.ndarray, np.ndarray]]):
        """The cheapest allowed offset for label i given the others `placed` (label ->
        (offset index, box, leader points)): (cost, offset index, box, leader points)."""
        boxes, seg, fixed = self.fixed(i)
        px = self.px
        ok = np.isfinite(fixed)
        others = [v for j, v in placed.items() if j != i]
        boxes_o = np.array([b for _, b, _ in others]).reshape(-1, 4)
        leads_o = np.concatenate([lp for _, _, lp in others] + [np.zeros((0, 2))])
        ok &= ~_hits(boxes, boxes_o, _GAP_PT[0] * px, _GAP_PT[1] * px)
        if leads_o.shape[0]:
            ok &= ~_covers(boxes, leads_o, 1.0).any(axis=1)
        # its own leader must cross no other label
        if boxes_o.shape[0]:
            inside = _covers(boxes_o, seg.reshape(-1, 2), 1.0).reshape(-1, len(_R), len(_T))
            ok &= ~(_LEAD & inside.any(axis=(0, 2)))
        cost = np.where(ok, fixed, np.inf)
        j = int(np.argmin(cost))
        if not np.isfinite(cost[j]):  # no allowed place: beside the point, upper right
            j = 1
            return _FALLBACK, j, boxes[j], np.zeros((0, 2))
        lead = seg[j] if _LEAD[j] else np.zeros((0, 2))
        return float(cost[j]), j, boxes[j], lead


def _arrange(panel: _Panel, n: int) -> dict[int, tuple[int, np.ndarray, np.ndarray]]:
    """Greedy placements in a few orders, the cheapest kept, then improved one label at a
    time (a label moves where it costs less, the others fixed)."""
    a = panel.anchors
    near = [int((np.hypot(*(a - a[i]).T) < 40 * panel.px).sum()) for i in range(n)]
    orders = {
        tuple(sorted(range(n), key=lambda i: (-near[i], a[i][0]))),
        tuple(sorted(range(n), key=lambda i: a[i][0])),
        tuple(sorted(range(n), key=lambda i: -a[i][0])),
        tuple(sorted(range(n), key=lambda i: -a[i][1])),
        tuple(sorted(range(n), key=lambda i: a[i][1])),
    }
    best_total, best, best_costs = math.inf, {}, {}
    for order in sorted(orders):
        placed: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        costs = {}
        for i in order:
            cost, j, box, lead = panel.best(i, placed)
            placed[i], costs[i] = (j, box, lead), cost
        total = sum(costs.values())
        if total < best_total:
            best_total, best, best_costs = total, placed, costs
    for _ in range(2):
        moved = False
        for i in range(n):
            cost, j, box, lead = panel.best(i, best)
            if cost < best_costs[i] - 1e-9:
                best[i], best_costs[i], moved = (j, box, lead), cost, True
        if not moved:
            break
    return best


def _merge(labels: Sequence[Label], px: float, merge_pt: float) -> list[Label]:
    out: list[Label] = []
    for lab in labels:
        p = lab.ax.transData.transform(lab.xy)
        for kept in out:
            if (kept.ax is not lab.ax) or kept.group != lab.group or kept.text != lab.text:
                continue
            q = kept.ax.transData.transform(kept.xy)
            if (
                math.isclose(kept.xy[0], lab.xy[0], rel_tol=1e-9)
                or math.hypot(*(p - q)) <= merge_pt * px
            ):
                if lab.xy[1] > kept.xy[1]:  # the label goes with the upper point
                    kept.xy, lab.xy = lab.xy, kept.xy
                    kept.key, lab.key = lab.key, kept.key
                kept.also.append(lab.key)
                break
        else:
            out.append(lab)
    return out


def place_labels(
    fig: Figure,
    labels: Sequence[Label],
    *,
    size: float,
    prefix: str = "label",
    merge_pt: float = 16.0,
) -> list[Text]:
    """Draw `labels` (font `size` points) where they cover no other label, no marker and
    the least of the drawn lines, inside their panels (see the module's Design); returns
    the texts drawn. Call it after everything else is drawn: it runs the figure's layout."""
    if not labels:
        return []
    renderer = _renderer(fig, list({id(lab.ax): lab.ax for lab in labels}.values()))
    px = fig.dpi / 72.0  # display pixels per point
    font = FontProperties(size=size)
    by_ax: dict[int, list[Label]] = {}
    for lab in _merge(labels, px, merge_pt):
        by_ax.setdefault(id(lab.ax), []).append(lab)
    texts = []
    for labs in by_ax.values():
        ax = labs[0].ax
        panel = _Panel(ax, px, renderer, font, labs)
        for i, (j, _, _) in sorted(_arrange(panel, len(labs)).items()):
            lab = labs[i]
            offset = (float(_R[j] * _C[j]), float(_R[j] * _S[j]))
            text = ax.annotate(
                lab.text,
                lab.xy,
                xytext=offset,
                textcoords="offset points",
                ha=_HA[float(_FX[j])],
                va=_VA[float(_FY[j])],
                fontsize=size,
                color=lab.color,
                zorder=6,
                annotation_clip=False,
                gid=f"{prefix}-label|{lab.key}",
            )
            text.set_in_layout(False)
            texts.append(text)
            if _LEAD[j]:
                leader = ax.annotate(
                    "",
                    lab.xy,
                    xytext=offset,
                    textcoords="offset points",
                    arrowprops={
                        "arrowstyle": "-",
                        "color": lab.color,
                        "lw": 0.6,
                        "shrinkA": 0.5,
                        "shrinkB": 4.0,
                    },
                    zorder=5.5,
                    annotation_clip=False,
                    gid=f"{prefix}-leader|{lab.key}",
                )
                leader.set_in_layout(False)
    return texts
