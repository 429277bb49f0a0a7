"""viz, the figures: assertions on their structure (artists, data, labels), not pixels.

The figure data of the golden log is computed once for the module. Boundary lines are checked
against the rules' definitions; every curve, marker and bar against the tables it draws.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from matplotlib.collections import Collection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from polars.testing import assert_frame_equal

from mismatch_replay import analysis, viz
from mismatch_replay.engine import Q_BUCKET_EDGES
from mismatch_replay.errors import UsageError
from mismatch_replay.rules import REGISTRY, binary_kl, parse_rule
from mismatch_replay.viz import render

GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"


@pytest.fixture(scope="module")
def data():
    return analysis.figure_data([str(GOLDEN)])


def lines_by_gid(ax) -> dict[str, Line2D]:
    return {ln.get_gid(): ln for ln in ax.get_lines() if ln.get_gid()}


def legend_texts(legend) -> list[str]:
    return [t.get_text() for t in legend.get_texts()]


def assert_no_nan(fig: Figure) -> None:
    """Nothing handed to matplotlib is NaN: lines, bars, images, collections."""
    for ax in fig.axes:
        for ln in ax.get_lines():
            xy = np.asarray(ln.get_xydata(), float)
            assert not np.isnan(xy).any(), ln.get_gid()
        for patch in ax.patches:
            if isinstance(patch, Rectangle):
                vals = [patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()]
                assert all(math.isfinite(v) for v in vals), patch.get_gid()
        for im in ax.images:
            arr = np.ma.getdata(im.get_array())
            assert not np.isnan(arr[~np.ma.getmaskarray(im.get_array())]).any()
        for coll in ax.collections:
            for path in getattr(coll, "get_paths", list)():
                assert not np.isnan(path.vertices).any()


def fraction_of(table: pl.DataFrame, rule: str, setting: str, param: str) -> pl.DataFrame:
    return table.filter(
        (pl.col("rule") == rule) & (pl.col("setting") == setting) & (pl.col("param") == param)
    ).sort("value")


# ----------------------------------------------------------------------------- scatter


def test_scatter_linear_structure(data):
    fig = viz.scatter(data, log=False)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 2  # the panel and its colourbar
    ax = fig.axes[0]
    assert ax.get_xlabel() == "inference probability q (sampler)"
    assert ax.get_ylabel() == "trainer probability p"
    assert ax.get_xscale() == ax.get_yscale() == "linear"
    assert ax.get_xlim() == (0.0, 1.0) and ax.get_ylim() == (0.0, 1.0)
    assert "19,598" in ax.get_title()
    # the density image is the histogram, [p bin, q bin], zeros masked; a colourbar labels it
    (im,) = ax.images
    arr = im.get_array()
    assert arr.shape == data.hist_lin.T.shape
    assert int(arr.sum()) == data.tokens
    np.testing.assert_array_equal(np.ma.filled(arr, 0), data.hist_lin.T)
    assert im.colorbar is not None
    assert im.colorbar.ax.get_ylabel() == "tokens per bin"
    assert im.norm.__class__.__name__ == "LogNorm"
    assert legend_texts(ax.get_legend()) == ["p = q", "IPO |p−q| ≤ 0.3", "IcePop r ∈ [0.2, 5]"]
    assert_no_nan(fig)


def test_scatter_linear_boundaries_follow_the_definitions(data):
    ax = viz.scatter(data, log=False).axes[0]
    ln = lines_by_gid(ax)
    x, y = ln["ipo-upper|eps=0.3"].get_data()
    np.testing.assert_allclose(y, np.clip(x + 0.3, 0, 1))
    assert x.min() == 0 and x.max() == 1
    x, y = ln["ipo-lower|eps=0.3"].get_data()
    np.testing.assert_allclose(y, x - 0.3, atol=1e-12)
    assert x.min() == pytest.approx(0.3) and (y >= 0).all()
    x, y = ln["icepop-low|low=0.2,high=5"].get_data()
    np.testing.assert_allclose(y, 0.2 * x)
    assert x.max() == 1.0
    x, y = ln["icepop-high|low=0.2,high=5"].get_data()
    np.testing.assert_allclose(y, 5.0 * x)
    assert y.max() == pytest.approx(1.0)
    x, y = ln["diagonal"].get_data()
    np.testing.assert_array_equal(x, y)
    assert ln["diagonal"].get_linestyle() == "--"
    # one colour per rule, shared with every other figure
    assert ln["ipo-upper|eps=0.3"].get_color() == REGISTRY["ipo"].color
    assert ln["icepop-low|low=0.2,high=5"].get_color() == REGISTRY["icepop"].color


def test_scatter_log_axes(data):
    fig = viz.scatter(data, log=True, ipo_eps=(0.1, 0.3), icepop=((0.5, 5.0),))
    ax = fig.axes[0]
    assert "log scale" in ax.get_xlabel() and "inference probability q" in ax.get_xlabel()
    assert "log scale" in ax.get_ylabel() and "trainer probability p" in ax.get_ylabel()
    assert ax.get_xlim() == (-8.0, 0.0)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["1e-8", "1e-7", "1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "1e-1", "1"]
    assert int(ax.images[0].get_array().sum()) == data.tokens
    ln = lines_by_gid(ax)
    # the IcePop cone is two straight lines: log10 p = log10 q + log10(bound)
    x, y = ln["icepop-low|low=0.5,high=5"].get_data()
    np.testing.assert_allclose(y, x + math.log10(0.5))
    x, y = ln["icepop-high|low=0.5,high=5"].get_data()
    np.testing.assert_allclose(y, x + math.log10(5.0))
    for eps in (0.1, 0.3):
        x, y = ln[f"ipo-upper|eps={eps:g}"].get_data()
        np.testing.assert_allclose(y, np.log10(np.minimum(10**x + eps, 1.0)))
        x, y = ln[f"ipo-lower|eps={eps:g}"].get_data()
        np.testing.assert_allclose(10**y, 10**x - eps, rtol=1e-6, atol=1e-15)
    # a second setting of the same rule: same colour, another line style
    assert ln["ipo-upper|eps=0.1"].get_color() == ln["ipo-upper|eps=0.3"].get_color()
    assert ln["ipo-upper|eps=0.1"].get_linestyle() != ln["ipo-upper|eps=0.3"].get_linestyle()
    assert legend_texts(ax.get_legend()) == [
        "p = q",
        "IPO |p−q| ≤ 0.1",
        "IPO |p−q| ≤ 0.3",
        "IcePop r ∈ [0.5, 5]",
    ]
    assert_no_nan(fig)


@pytest.mark.parametrize("log", [False, True])
def test_scatter_extra_rules(data, log):
    kpop = parse_rule("kpop@prime-rl")
    fig = viz.scatter(data, log=log, extra=[kpop, parse_rule("dppo-tv@prime-rl")])
    ax = fig.axes[0]
    texts = legend_texts(ax.get_legend())
    assert "KPop max BKL ≤ 0.1" in texts
    assert "DPPO-TV p−q ≤ 0.2 (A>0), q−p ≤ 0.2 (A≤0)" in texts
    ln = lines_by_gid(ax)
    to_p = (lambda v: 10**v) if log else (lambda v: v)
    x, y = ln["dppo-tv-upper|low=0.2,high=0.2"].get_data()
    np.testing.assert_allclose(to_p(y), to_p(x) + 0.2, rtol=1e-9)
    x, y = ln["dppo-tv-lower|low=0.2,high=0.2"].get_data()
    np.testing.assert_allclose(to_p(y), to_p(x) - 0.2, rtol=1e-6, atol=1e-15)
    # the KPop contour lies on max(BKL(p||q), BKL(q||p)) = phi
    (cs,) = [c for c in ax.collections if (c.get_gid() or "").startswith("kpop-contour")]
    assert isinstance(cs, Collection)
    v = np.concatenate([p.vertices for p in cs.get_paths()])
    q, p = to_p(v[:, 0]), to_p(v[:, 1])
    inside = (q > 1e-6) & (q < 0.999) & (p > 1e-6) & (p < 0.999)
    lq, lp = np.log(q[inside]), np.log(p[inside])
    z = np.maximum(binary_kl(lp, lq, kpop.clamp), binary_kl(lq, lp, kpop.clamp))
    assert inside.sum() > 50
    assert np.median(np.abs(z / kpop.phi - 1)) < 0.01
    assert_no_nan(fig)


def test_scatter_rejects_rules_without_a_boundary(data):
    with pytest.raises(UsageError, match=r"no boundary.*drawable rules: ipo, ipo-v1, icepop"):
        viz.scatter(data, log=False, extra=[parse_rule("tis")])


def test_scatter_draws_a_rule_by_its_declared_boundary(data):
    """A rule outside the catalogue draws as its `boundary` says, not by its name."""
    from dataclasses import dataclass
    from typing import ClassVar

    from mismatch_replay.rules import IcePop

    @dataclass(frozen=True)
    class Band(IcePop):
        name: ClassVar[str] = "my-band"
        label: ClassVar[str] = "my band"

    fig = viz.scatter(data, log=False, extra=[Band(low=0.25, high=4.0)])
    ax = fig.axes[0]
    x, y = lines_by_gid(ax)["my-band-high|low=0.25,high=4"].get_data()
    np.testing.assert_allclose(y[y < 1], 4.0 * x[y < 1], rtol=1e-9)
    assert any("my band r ∈ [0.25, 4]" in t for t in legend_texts(ax.get_legend()))


def test_scatter_panels(data):
    fig = viz.scatter_panels(data)
    assert len(fig.axes) == 4  # two panels, two colourbars
    lin, log = (ax for ax in fig.axes if ax.images)
    assert lin.get_xlim() == (0.0, 1.0) and log.get_xlim() == (-8.0, 0.0)
    assert lin.get_legend() is None and log.get_legend() is None
    (leg,) = fig.legends
    assert legend_texts(leg) == ["p = q", "IPO |p−q| ≤ 0.3", "IcePop r ∈ [0.2, 5]"]
    assert "19,598" in fig.get_suptitle()


def test_scatter_into_given_axes(data):
    fig = Figure()
    ax = fig.add_subplot()
    assert viz.scatter(data, ax, log=True) is fig
    assert ax.images


# ----------------------------------------------------------------------------- sweep curves


def sweep_lines(fig) -> dict[str, Line2D]:
    out = {}
    for ax in fig.axes:
        for ln in ax.get_lines():
            gid = ln.get_gid() or ""
            if gid.startswith("sweep|"):
                out[gid] = ln
    return out


def test_masked_fraction_one_line_per_rule_setting_param(data):
    table = data.sweep
    fig = viz.masked_fraction(table, target_fraction=0.01)
    lines = sweep_lines(fig)
    keys = table.select("rule", "setting", "param").unique().rows()
    assert set(lines) == {f"sweep|{r}|{s}|{p}" for r, s, p in keys}
    for gid, ln in lines.items():
        _, rule, setting, param = gid.split("|")
        rows = fraction_of(table, rule, setting, param)
        col = "truncated_fraction" if rows["kind"][0] == "weight" else "masked_fraction"
        x, y = ln.get_data()
        np.testing.assert_allclose(x, rows["value"].to_numpy())
        floor = 0.5 / rows["tokens"].to_numpy()
        np.testing.assert_allclose(y, np.maximum(rows[col].to_numpy(), floor))
    assert_no_nan(fig)


def test_masked_fraction_panels_scales_and_labels(data):
    fig = viz.masked_fraction(data.sweep, target_fraction=0.01)
    panels = [ax for ax in fig.axes if ax.get_lines()]
    titles = [ax.get_title() for ax in panels]
    assert titles == [f.title for f in viz.FAMILIES]
    for ax in panels:
        assert ax.get_yscale() == "log"
        assert ax.get_xscale() == "log"  # every default grid is log-spaced
        assert ax.get_ylabel() == "fraction of tokens masked"
        assert ax.get_xlabel()
        # the target line, at the target, in every panel
        (target,) = [ln for ln in ax.get_lines() if ln.get_gid() == "target"]
        assert set(target.get_ydata()) == {0.01}
        assert "target 0.01" in legend_texts(ax.get_legend())
    dp = panels[0]
    assert "|p − q|" in dp.get_xlabel() and "probability" in dp.get_xlabel()
    assert "r = p / q" in panels[1].get_xlabel()
    assert {ln.get_gid().split("|")[1] for ln in dp.get_lines() if "sweep|" in ln.get_gid()} == {
        "ipo",
        "ipo-v1",
        "dppo-tv",
    }
    assert "IPO eps" in legend_texts(dp.get_legend())
    # zero fractions exist in the golden sweep: they sit on the floor, which is drawn
    assert any(ln.get_gid() == "floor" for ax in panels for ln in ax.get_lines())
    notes = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "note"]
    assert len(notes) == 1 and "0.5/N" in notes[0] and "target fraction 0.01" in notes[0]


def test_masked_fraction_markers_at_presets(data):
    table = data.sweep
    fig = viz.masked_fraction(table)
    marks = {}
    for ax in fig.axes:
        for ln in ax.get_lines():
            gid = ln.get_gid() or ""
            if gid.startswith("preset|"):
                marks[gid] = ln
    ipo = fraction_of(table, "ipo", "", "eps")
    # eps = 0.1 is a grid point: a filled marker at the table's fraction there
    m01 = marks["preset|ipo||eps|0.1|prime-rl-legacy"]
    assert m01.get_xdata()[0] == 0.1
    at = ipo.filter(pl.col("value").is_close(0.1, rel_tol=1e-9))["masked_fraction"][0]
    assert m01.get_ydata()[0] == at
    assert m01.get_markerfacecolor() == m01.get_markeredgecolor()
    # eps = 0.3 falls between grid points: an open marker between its neighbours
    m03 = marks["preset|ipo||eps|0.3|prime-rl"]
    assert m03.get_markerfacecolor() == "white"
    below = ipo.filter(pl.col("value") < 0.3)["masked_fraction"][-1]
    above = ipo.filter(pl.col("value") > 0.3)["masked_fraction"][0]
    assert above <= m03.get_ydata()[0] <= below
    # IcePop's presets lie on the line whose fixed side they share
    # prime-rl's IcePopLoss and its legacy ratio-space test share [0.2, 5] (issue 30)
    assert "preset|icepop|high=5|low|0.2|prime-rl, prime-rl-legacy" in marks
    assert "preset|icepop|high=5|low|0.5|verl, areal, paper" in marks
    assert "preset|icepop|low=0.5|high|5|verl, areal, paper" in marks
    assert not any(k.startswith("preset|icepop|low=0.5|high|5|prime-rl") for k in marks)
    # every exact marker sits on the table's value
    pts = viz.preset_points(table)
    for r in pts.filter(pl.col("exact")).iter_rows(named=True):
        rows = fraction_of(table, r["rule"], r["setting"], r["param"])
        col = "truncated_fraction" if r["kind"] == "weight" else "masked_fraction"
        hit = rows.filter(pl.col("value").is_close(r["value"], rel_tol=1e-9))
        assert hit[col][0] == r["fraction"]
    assert pts["presets"].str.contains("prime-rl").any()


def test_masked_fraction_rules_filter_and_axes(data):
    fig = viz.masked_fraction(data.sweep, rules=["ipo", parse_rule("icepop@verl")])
    panels = [ax for ax in fig.axes if ax.get_lines()]
    assert len(panels) == 2
    assert {g.split("|")[1] for g in sweep_lines(fig)} == {"ipo", "icepop"}
    # a single Axes works for one family, and refuses several
    one = Figure().add_subplot()
    viz.masked_fraction(data.sweep, one, rules=["ipo"])
    assert {g.split("|")[1] for g in sweep_lines(one.figure)} == {"ipo"}
    with pytest.raises(UsageError, match="parameter families"):
        viz.masked_fraction(data.sweep, Figure().add_subplot(), rules=["ipo", "icepop"])
    with pytest.raises(UsageError):
        viz.masked_fraction(data.sweep, rules=["no-such-rule"])


def test_masked_fraction_grouped_table_is_summed(data):
    """A by-step table draws one point per setting: the exact overall fraction."""
    fig = viz.masked_fraction(data.steps, rules=["ipo"])
    lines = sweep_lines(fig)
    (ln,) = lines.values()  # both IPO settings share (rule, setting, param): one line
    t = data.steps.filter(pl.col("rule") == "ipo")
    exact = t.group_by("value").agg(pl.col("masked_tokens").sum() / pl.col("tokens").sum())
    exact = exact.sort("value")
    np.testing.assert_allclose(ln.get_xdata(), exact["value"].to_numpy())
    np.testing.assert_allclose(ln.get_ydata(), exact["masked_tokens"].to_numpy())


def test_masked_fraction_zero_and_null_fractions():
    table = pl.DataFrame(
        {
            "rule": ["ipo"] * 4,
            "setting": [""] * 4,
            "param": ["eps"] * 4,
            "value": [0.1, 0.2, 0.3, 0.4],
            "tokens": [100, 100, 100, 100],
            "masked_tokens": [3, 1, 0, 0],
            "masked_fraction": [0.03, 0.01, 0.0, None],
            "truncated_tokens": [0, 0, 0, 0],
            "truncated_fraction": [0.0] * 4,
            "kind": ["mask"] * 4,
        }
    )
    fig = viz.masked_fraction(table, markers=True)
    (ln,) = sweep_lines(fig).values()
    np.testing.assert_allclose(ln.get_xdata(), [0.1, 0.2, 0.3])  # the null row is dropped
    np.testing.assert_allclose(ln.get_ydata(), [0.03, 0.01, 0.005])  # 0 -> 0.5 / 100
    ax = fig.axes[0]
    (floor,) = [x for x in ax.get_lines() if x.get_gid() == "floor"]
    assert set(floor.get_ydata()) == {0.005}
    assert ax.get_xscale() == "linear"  # a linear grid spanning < 2 decades
    assert "0.5/N" in fig.get_supxlabel()
    assert_no_nan(fig)


def drawn(fig: Figure):
    """The figure drawn as a page shows it: an Agg canvas, then its renderer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def preset_label_boxes(fig: Figure, renderer) -> list[tuple]:
    """(axes, gid, text, display bbox) of every preset label."""
    out = []
    for ax in fig.axes:
        for t in ax.texts:
            gid = t.get_gid() or ""
            if gid.startswith("preset-label|"):
                out.append((ax, gid, t.get_text(), t.get_window_extent(renderer)))
    return out


@pytest.fixture(scope="module")
def sample_data():
    from mismatch_replay.viz.jobs import sample_path

    if not sample_path().exists():
        pytest.skip("bundled sample not built")
    return analysis.figure_data([str(sample_path())])


@pytest.mark.slow  # a real draw of masked_fraction at full size
@pytest.mark.parametrize("which", ["golden", "sample"])
def test_preset_labels_never_overlap(which, data, sample_data):
    """masked_fraction.png's preset labels: no two overlap, none covers a preset marker, each
    stays inside its panel (measured after a real draw, at the figure's size)."""
    d = data if which == "golden" else sample_data
    fig = viz.masked_fraction(d.sweep, target_fraction=0.0025)
    renderer = drawn(fig)
    boxes = preset_label_boxes(fig, renderer)
    assert len(boxes) >= 15
    for i, (ax_a, gid_a, _, a) in enumerate(boxes):
        assert ax_a.get_window_extent(renderer).contains(a.x0, a.y0), gid_a
        assert ax_a.get_window_extent(renderer).contains(a.x1, a.y1), gid_a
        for _, gid_b, _, b in boxes[i + 1 :]:
            assert not a.overlaps(b), (gid_a, gid_b)
        for ln in ax_a.get_lines():
            if (ln.get_gid() or "").startswith("preset|"):
                assert not a.overlaps(ln.get_window_extent(renderer)), (gid_a, ln.get_gid())
    # a leader line ties a label that had to move away to its marker, in its colour
    leaders = [
        t for ax in fig.axes for t in ax.texts if (t.get_gid() or "").startswith("preset-leader|")
    ]
    texts = {t.get_gid(): t for ax in fig.axes for t in ax.texts}
    for t in leaders:
        label = texts[t.get_gid().replace("-leader|", "-label|")]
        assert math.hypot(*t.xyann) > 8 and t.xyann == label.xyann  # from marker to label
        assert to_rgba(t.arrow_patch.get_edgecolor()) == to_rgba(label.get_color())


@pytest.mark.slow  # a real draw of masked_fraction at full size
def test_preset_labels_are_not_repeated(data):
    """A band's two sides at one preset (IPO-v1 low = high = 0.2, prime-rl-legacy) get one
    label; a curve drawn as another's (token-MIS = IcePop) names only its own presets, with
    its rule."""
    fig = viz.masked_fraction(data.sweep)
    drawn(fig)
    texts = {t.get_gid(): t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid()}
    ipo_v1 = [g for g in texts if g.startswith("preset-label|ipo-v1|")]
    assert len(ipo_v1) == 1 and texts[ipo_v1[0]] == "prime-rl-legacy"
    marks = [
        ln.get_gid()
        for ax in fig.axes
        for ln in ax.get_lines()
        if (ln.get_gid() or "").startswith("preset|ipo-v1|")
    ]
    assert len(marks) == 2  # both markers stay
    mis = {g: t for g, t in texts.items() if g.startswith("preset-label|token-mis|")}
    assert mis and all(t.startswith("token-MIS ") for t in mis.values())
    assert "token-MIS trl, slime" in mis.values()  # high = 2: not an IcePop preset
    assert not any("verl" in t for t in mis.values())  # verl's = IcePop's, labelled there
    # texts of one panel are unique per rule where the markers share their x
    for ax in fig.axes:
        seen = set()
        for t in ax.texts:
            gid = t.get_gid() or ""
            if gid.startswith("preset-label|"):
                _, rule, _, _, value = gid.split("|")
                assert (rule, value, t.get_text()) not in seen, gid
                seen.add((rule, value, t.get_text()))


# ----------------------------------------------------------------------------- steps


@pytest.mark.slow  # a real draw of the steps figure
def test_steps(data):
    fig = viz.steps(data)
    top, bottom = fig.axes
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_yscale() == "log" and bottom.get_yscale() == "log"
    assert "k3" in top.get_ylabel() and "nats" in top.get_ylabel()
    assert bottom.get_xlabel() == "trainer step"
    (k3,) = [ln for ln in top.get_lines() if ln.get_gid() == "k3"]
    sm = data.step_metrics.sort("step")
    np.testing.assert_array_equal(k3.get_xdata(), sm["step"].to_numpy())
    np.testing.assert_allclose(k3.get_ydata(), sm["kl_k3"].to_numpy())
    lines = {ln.get_gid(): ln for ln in bottom.get_lines() if ln.get_gid().startswith("step|")}
    specs = data.steps["spec"].unique(maintain_order=True).to_list()
    assert list(lines) == [f"step|{s}" for s in specs]
    for spec in specs:
        rows = data.steps.filter(pl.col("spec") == spec).sort("step")
        ln = lines[f"step|{spec}"]
        np.testing.assert_array_equal(ln.get_xdata(), rows["step"].to_numpy())
        want = np.maximum(rows["masked_fraction"].to_numpy(), 0.5 / rows["tokens"].to_numpy())
        np.testing.assert_allclose(ln.get_ydata(), want)
        assert ln.get_color() == viz.rule_color(
            spec.split(":")[0].split("@")[0]
        )  # a preset: its rule's
    texts = legend_texts(bottom.get_legend())
    assert "IPO eps=0.3 (prime-rl)" in texts
    assert "IcePop low=0.2, high=5 (prime-rl)" in texts
    assert_no_nan(fig)


# ----------------------------------------------------------------------------- buckets


def test_bucket_labels():
    assert viz.bucket_labels() == [
        "[0, 1e-4)",
        "[1e-4, 1e-3)",
        "[1e-3, 0.01)",
        "[0.01, 0.1)",
        "[0.1, 0.3)",
        "[0.3, 0.5)",
        "[0.5, 0.7)",
        "[0.7, 0.9)",
        "[0.9, 0.99)",
        "[0.99, 1]",
    ]


def test_where_masked(data):
    fig = viz.where_masked(data)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log"
    ticks = [t.get_text().split("\n")[0] for t in ax.get_xticklabels()]
    assert ticks == viz.bucket_labels()
    assert "inference probability q" in ax.get_xlabel()
    specs = data.buckets["spec"].unique(maintain_order=True).to_list()
    for spec in specs:
        bars = [p for p in ax.patches if p.get_gid() == f"bucket|{spec}"]
        if not bars:  # matplotlib puts the gid on the container; fall back to the label
            (cont,) = [c for c in ax.containers if c.get_label() == viz.spec_label(spec)]
            bars = list(cont)
        rows = data.buckets.filter(pl.col("spec") == spec)
        assert len(bars) == rows.height
        order = np.argsort([b.get_x() for b in bars])
        heights = np.array([bars[i].get_height() for i in order])
        want = rows.sort("q_bucket")["masked_fraction"].to_numpy()
        np.testing.assert_allclose(heights, want)
        # each bar sits over its bucket
        centers = np.array([bars[i].get_x() + bars[i].get_width() / 2 for i in order])
        idx = [list(Q_BUCKET_EDGES).index(b) for b in rows.sort("q_bucket")["q_bucket"]]
        assert np.all(np.abs(centers - np.array(idx)) < 0.5)
    assert len(legend_texts(ax.get_legend())) == len(specs)
    assert_no_nan(fig)


# ----------------------------------------------------------------------------- by length


def length_reference(path) -> pl.DataFrame:
    from mismatch_replay import engine
    from mismatch_replay.analysis.figure_data import LENGTH_SETTINGS

    return engine.sweep([str(path)], rules=list(LENGTH_SETTINGS), by="length").table


@pytest.mark.parametrize("which", ["golden", "sample"])
def test_masked_by_length_is_drawn_from_engine_sweep_by_length(which, data, sample_data):
    """FigureData.by_length is `engine.sweep(..., by="length")` of the length settings (a
    product and a geometric sequence rule, a token rule), and masked_by_length.png draws
    it: one line per setting, each point the bucket's masked fraction (zeros on the
    floor)."""
    from mismatch_replay.analysis.figure_data import LENGTH_SETTINGS
    from mismatch_replay.viz.jobs import sample_path

    d, path = (data, GOLDEN) if which == "golden" else (sample_data, sample_path())
    ref = length_reference(path)
    assert d.by_length is not None
    assert_frame_equal(d.by_length, ref)  # NaN where a column is undefined, as there
    specs = d.by_length["spec"].unique(maintain_order=True).to_list()
    assert [s.split(":")[0] for s in specs] == list(LENGTH_SETTINGS)
    assert "masked_by_length" in viz.figures(d)
    fig = viz.figures(d)["masked_by_length"]()
    (ax,) = fig.axes
    lines = lines_by_gid(ax)
    for spec in specs:
        rows = ref.filter(pl.col("spec") == spec).sort("length")
        y = rows["masked_fraction"].to_numpy()
        got = lines[f"length|{spec}"].get_ydata()
        np.testing.assert_allclose(got[y > 0], y[y > 0])
        if (y == 0).any():  # zeros sit on one floor row, hollow
            assert set(lines[f"floor|{spec}"].get_ydata()) == {got[y == 0][0]}
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert all("seq" in t for t in ticks)
    assert_no_nan(fig)
    if which == "golden":  # the story: the product climbs with length, the mean does not
        frac = {
            s.split("@")[0] + "@" + s.split("@")[1].split(":")[0]: ref.filter(
                pl.col("spec") == s
            ).sort("length")["masked_fraction"]
            for s in specs
        }
        assert frac["seq-mis@verl"][-1] > frac["geo-mis@skyrl"][-1]
        assert frac["seq-mis@verl"].is_sorted()
        assert len(ticks) == 5
    else:  # every sequence of the sample has 40 loss tokens: one bucket, said in the title
        assert len(ticks) == 1 and "one bucket" in ax.get_title()


@pytest.mark.slow  # every figure drawn and written
def test_masked_by_length_absent_with_a_note_without_sequence_ids(tmp_path):
    from mismatch_replay.analysis.figure_data import NO_LENGTH_NOTE

    log = tmp_path / "no_ids.parquet"
    pl.read_parquet(GOLDEN).drop("sample_id").write_parquet(log)
    d = analysis.figure_data([str(log)])
    assert d.by_length is None and NO_LENGTH_NOTE in d.notes
    assert "masked_by_length" not in viz.figures(d)
    paths = viz.render_all(d, tmp_path / "figs", dpi=30)
    assert set(paths) == set(viz.FIGURES) - {"masked_by_length"}
    assert not (tmp_path / "figs" / "masked_by_length.png").exists()


# ----------------------------------------------------------------------------- files


@pytest.mark.slow  # every figure drawn and written
def test_render_all_writes_and_refuses_overwrite(data, tmp_path):
    out = tmp_path / "figs"
    paths = viz.render_all(data, out, dpi=40)
    assert (
        set(paths)
        == set(viz.FIGURES)
        == {
            "scatter",
            "masked_fraction",
            "steps",
            "where_masked",
            "masked_by_length",
            "masked_direction",
        }
    )
    for name, p in paths.items():
        assert p == out / f"{name}.png"
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
    before = paths["scatter"].stat().st_mtime_ns
    with pytest.raises(UsageError, match="pass --force") as err:
        viz.render_all(data, out, dpi=40)
    assert "scatter.png" in str(err.value)
    assert paths["scatter"].stat().st_mtime_ns == before


def test_render_all_force_and_formats(data, tmp_path, monkeypatch):
    """File handling only: the figures are stubbed to keep this fast."""

    def tiny(*_a, **_k):
        fig = Figure(figsize=(1, 1))
        fig.add_subplot().plot([0, 1], [0, 1])
        return fig

    monkeypatch.setattr(render, "figures", lambda d, t=None: {n: tiny for n in viz.FIGURES})
    (tmp_path / "steps.svg").write_text("old")
    with pytest.raises(UsageError, match=r"steps\.svg.*pass --force"):
        viz.render_all(data, tmp_path, fmt="svg")
    paths = viz.render_all(data, tmp_path, fmt="svg", force=True)
    assert paths["steps"].read_text().lstrip().startswith("<?xml")
    with pytest.raises(UsageError, match="figure format"):
        viz.render_all(data, tmp_path, fmt="jpg")


# ----------------------------------------------------------------------------- rule metadata


def test_rules_declare_their_look_and_panels_keep_colours_apart():
    """Label, colour and panel come from the rule classes; rules drawn in one masked-fraction
    panel never share a colour."""
    assert REGISTRY["ipo"].label == "IPO" and viz.display_name("ipo") == "IPO"
    assert REGISTRY["veto"].label == "veto"  # no label set: the rule's name
    assert viz.display_name("not-a-rule") == "not-a-rule"
    panels: dict[str, dict[str, str]] = {}
    for name, cls in REGISTRY.items():
        assert cls.color and viz.rule_color(name) == cls.color, name
        for p in cls.params:
            fam = viz.family_of(name, p.name)
            assert fam in viz.FAMILIES, (name, p.name)  # every built-in has its panel
            panels.setdefault(fam.key, {})[name] = cls.color
    for key, colors in panels.items():
        assert len(set(colors.values())) == len(colors), (key, colors)
    assert viz.family_of("dual-clip", "c").key == "ratio"
    assert viz.family_of("dual-clip", "eps_high").key == "clip"


def test_a_rule_defined_outside_the_package_gets_a_default_look():
    from dataclasses import dataclass

    from mismatch_replay.rules import IPO, Rule

    @dataclass(frozen=True)
    class Wide(IPO):  # a subclass with its own name: not "IPO", not IPO's colour
        name = "wide-ipo-test"

    assert Wide.label == "wide-ipo-test"
    assert viz.curves.panel_key(Wide, "eps") == "dp"  # from the quantity it thresholds

    @dataclass(frozen=True)
    class Plain(Rule):
        name = "plain-test"

    assert Plain.label == "plain-test" and Plain.color is None
    assert viz.curves.panel_key(Plain, "x") == "other"
    # not registered: a stable spare colour, the "Other rules" panel
    assert viz.rule_color("plain-test") == viz.rule_color("plain-test") in viz.style.SPARE
    assert viz.family_of("plain-test", "x") is viz.OTHER

    @dataclass(frozen=True)
    class AbsL(Rule):  # |l| > eps: a token rule on a declared quantity, no panel of its own
        name = "abs-l-test"
        quantities = {"eps": "|l|"}

    assert viz.curves.panel_key(AbsL, "eps") == "kl"  # nats: the divergence panel


def test_every_quantity_has_a_panel_and_token_rules_take_theirs_from_it():
    from mismatch_replay.fast import QUANTITIES

    assert set(viz.curves.PANEL_OF_QUANTITY) == set(QUANTITIES)
    assert REGISTRY["ipo"].panel is None and viz.family_of("ipo", "eps").key == "dp"
    assert viz.family_of("icepop", "low").key == "ratio"
    assert viz.family_of("seq-mis", "low").key == "seqratio"  # declared: no token quantity


def test_colors_override_the_rules_own(data):
    mine = {"ipo": "#123456", "icepop": "#abcdef"}
    ln = lines_by_gid(viz.scatter(data, log=True, colors=mine).axes[0])
    assert ln["ipo-upper|eps=0.3"].get_color() == "#123456"
    assert ln["icepop-high|low=0.2,high=5"].get_color() == "#abcdef"
    lines = sweep_lines(viz.masked_fraction(data.sweep, rules=["ipo", "kpop"], colors=mine))
    assert lines["sweep|ipo||eps"].get_color() == "#123456"
    assert lines["sweep|kpop|clamp=1e-06|phi"].get_color() == REGISTRY["kpop"].color
    bottom = viz.steps(data, colors=mine).axes[1]
    ipo = [x for x in bottom.get_lines() if (x.get_gid() or "").startswith("step|ipo")]
    assert ipo and all(x.get_color() == "#123456" for x in ipo)
    bars = viz.where_masked(data, colors=mine).axes[0].patches
    assert any(b.get_facecolor()[:3] == (0x12 / 255, 0x34 / 255, 0x56 / 255) for b in bars)
