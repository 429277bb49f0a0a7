"""masked_fraction.png keeps the curves where rules are given at a setting (issue 36 §10):
the sweep table (sweep.csv) holds the setting's one row, the figure's own table
(`FigureData.curves`, `figure_data.curve_plan` / `curve_table`) each given setting's
threshold curves over the default grid with its other parameters at the setting's values,
its value a grid point (marked, labelled with its preset or SPEC), counted in the same read;
a bare name is its sweep rows as they are; no -r: the figure draws the sweep."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import assert_tables_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import analysis, engine, sweep
from mismatch_replay.analysis.figure_data import curve_plan, sweep_plan
from mismatch_replay.rules import REGISTRY, parse_grid, parse_rule
from mismatch_replay.rules.spec import sweep_specs
from mismatch_replay.viz import curves as viz_curves
from mismatch_replay.viz import render

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
COLUMNS = ("trainer_logprob", "inference_logprob", "step", "sample_id", "advantage")
COUNTS = ["rule", "setting", "param", "value", "tokens", "masked_tokens", "truncated_tokens"]
REL = 1e-12
_DATA: dict = {}


def data_of(specs, report=False):
    """figure_data (or report_data's figure data) on the golden log, cached: one read each."""
    key = (tuple(specs or ()), report)
    if key not in _DATA:
        if report:
            _DATA[key] = analysis.report_data([GOLDEN], specs, 0.0025, bootstrap=0)[0]
        else:
            _DATA[key] = analysis.figure_data([GOLDEN], specs)
    return _DATA[key]


def line(table: pl.DataFrame, rule: str, param: str, setting: str = "") -> pl.DataFrame:
    return table.filter(
        (pl.col("rule") == rule)
        & (pl.col("param") == param)
        & (pl.col("setting").fill_null("") == setting)
    ).sort("value")


def with_value(grid: np.ndarray, v: float) -> np.ndarray:
    return np.unique(np.append(grid[~np.isclose(grid, v, rtol=1e-9, atol=0.0)], v))


@pytest.mark.parametrize("report", [False, True], ids=["plot", "report"])
def test_a_preset_is_drawn_on_its_curve(report):
    """-r ipo@prime-rl: sweep.csv one row; the figure's ipo eps curve is the default grid
    plus 0.3, its grid rows `sweep -r ipo`'s, the whole curve `sweep -r ipo@prime-rl
    --sweep ipo.eps=GRID,0.3`'s, 0.3 marked with the preset and the sweep row's count."""
    data = data_of(["ipo@prime-rl"], report)
    assert data.sweep.height == 1 and data.sweep["value"].to_list() == [0.3]
    grid = parse_grid(REGISTRY["ipo"].param("eps").grid)
    want_x = with_value(grid, 0.3)
    got = line(data.curves, "ipo", "eps")
    assert got.height == data.curves.height  # ipo's panel alone
    assert np.array_equal(got["value"].to_numpy(), want_x)
    bare = sweep([GOLDEN], rules=sweep_specs(["ipo"])).table.select(COUNTS)
    on_grid = got.filter(pl.col("mark").is_null()).select(COUNTS)
    assert_tables_equal(on_grid, bare, rel=REL)
    at = sweep([GOLDEN], rules=["ipo@prime-rl"], sweeps={"ipo.eps": want_x}).table
    assert_tables_equal(got.drop("given", "mark"), at, rel=REL)
    marked = got.filter(pl.col("mark").is_not_null())
    assert marked["value"].to_list() == [0.3] and marked["mark"].to_list() == ["ipo@prime-rl"]
    assert marked["masked_tokens"].to_list() == data.sweep["masked_tokens"].to_list()
    assert got["given"].all()


def test_a_setting_stays_one_row_of_sweep_csv_and_is_a_marked_point():
    data = data_of(["ipo:eps=0.3"], report=True)
    assert data.sweep.height == 1 and data.sweep["spec"].to_list() == ["ipo:eps=0.3"]
    fig = render.figures(data, None, render.panel_rules(data.settings, data.given))
    drawn = fig["masked_fraction"]()
    lines = {ln.get_gid(): ln for ax in drawn.axes for ln in ax.get_lines()}
    x = np.asarray(lines["sweep|ipo||eps"].get_xdata(), float)
    assert np.array_equal(x, with_value(parse_grid("0.001:1:121:log"), 0.3))
    mark = lines["given|ipo||eps|0.3|ipo:eps=0.3"]
    assert list(mark.get_xdata()) == [0.3]
    assert math.isclose(mark.get_ydata()[0], data.sweep["masked_fraction"][0], rel_tol=1e-12)
    assert mark.get_markerfacecolor() != "white"  # filled: a grid point
    assert not [g for g in lines if g.startswith("preset|")]  # the setting's, not presets
    texts = [t.get_text() for ax in drawn.axes for t in ax.texts]
    assert "ipo:eps=0.3" in texts
    assert drawn.axes[0].get_xscale() == "log"


def test_two_settings_of_a_rule_and_a_bare_name():
    """icepop@prime-rl [0.2, 5] and icepop@verl [0.5, 5] share the low line (high=5), each
    has its high line (low at its value); a bare ipo is its sweep rows, with its presets."""
    data = data_of(["ipo", "icepop@prime-rl", "icepop@verl"])
    c = data.curves
    low_grid = parse_grid(REGISTRY["icepop"].param("low").grid)
    high_grid = parse_grid(REGISTRY["icepop"].param("high").grid)
    low = line(c, "icepop", "low", "high=5")
    assert np.array_equal(low["value"].to_numpy(), with_value(with_value(low_grid, 0.2), 0.5))
    marks = dict(low.filter(pl.col("mark").is_not_null()).select("value", "mark").iter_rows())
    assert marks == {0.2: "icepop@prime-rl", 0.5: "icepop@verl"}
    for lo in (0.2, 0.5):
        hi = line(c, "icepop", "high", f"low={lo:g}")
        assert np.array_equal(hi["value"].to_numpy(), with_value(high_grid, 5.0))
        want = sweep(
            [GOLDEN],
            rules=[f"icepop@{'prime-rl' if lo == 0.2 else 'verl'}"],
            sweeps={"icepop.high": hi["value"].to_numpy()},
        ).table
        assert_tables_equal(hi.drop("given", "mark"), want, rel=REL)
    ipo = line(c, "ipo", "eps")
    assert not ipo["given"].any() and ipo["mark"].null_count() == ipo.height
    assert_tables_equal(ipo.drop("given", "mark"), line(data.sweep, "ipo", "eps"), rel=REL)
    # the figure: settings' markers on icepop, catalogue presets on the bare ipo
    fig = viz_curves.masked_fraction(c)
    gids = [ln.get_gid() or "" for ax in fig.axes for ln in ax.get_lines()]
    assert sorted(g for g in gids if g.startswith("given|icepop")) == sorted(
        [
            "given|icepop|high=5|low|0.2|icepop@prime-rl",
            "given|icepop|high=5|low|0.5|icepop@verl",
            "given|icepop|low=0.2|high|5|icepop@prime-rl",
            "given|icepop|low=0.5|high|5|icepop@verl",
        ]
    )
    assert any(g.startswith("preset|ipo|") for g in gids)
    assert not any(g.startswith("preset|icepop|") for g in gids)


def test_counts_against_numpy():
    """The float64 IcePop low line at high=5 and its marked 0.3, brute force: masked where
    l < log(low) or l > log(5), l = lp - lq."""
    data = data_of(["icepop:low=0.3,high=5"])
    df = pl.read_parquet(GOLDEN)
    df = df.filter(pl.col("loss_mask")) if "loss_mask" in df.columns else df
    lr = (df["trainer_logprob"] - df["inference_logprob"]).to_numpy()
    low = line(data.curves, "icepop", "low", "high=5")
    want = [int(((lr < math.log(v)) | (lr > math.log(5.0))).sum()) for v in low["value"]]
    assert low["masked_tokens"].to_list() == want
    assert 0.3 in low["value"].to_list()


def test_no_rule_or_bare_names_draw_the_sweep():
    assert data_of(None).curves is None
    assert data_of(["ipo"]).curves is None  # its default curves, as before
    assert data_of(["ipo"], report=True).curves is None


def test_the_figure_jobs_ride_the_same_read(monkeypatch):
    """A setting's curves cost no read of their own: report_data and figure_data make the
    same replays with -r ipo:eps=0.3 as with -r ipo (whose figure is its sweep)."""
    calls: list[str] = []
    real_replay, real_together = engine.replay, engine.replay_together

    def replay(*a, **k):
        calls.append("replay")
        return real_replay(*a, **k)

    def together(*a, **k):
        calls.append("together")
        return real_together(*a, **k)

    monkeypatch.setattr(engine, "replay", replay)
    monkeypatch.setattr(engine, "replay_together", together)
    counts = {}
    for specs in (["ipo"], ["ipo:eps=0.3"]):
        calls.clear()
        analysis.report_data([GOLDEN], specs, 0.0025, bootstrap=0)
        counts[("report", specs[0])] = list(calls)
        calls.clear()
        analysis.figure_data([GOLDEN], specs)
        counts[("plot", specs[0])] = list(calls)
    assert counts[("report", "ipo")] == counts[("report", "ipo:eps=0.3")]
    assert counts[("plot", "ipo")] == counts[("plot", "ipo:eps=0.3")]
    assert counts[("report", "ipo")].count("together") == 1


# ----------------------------------------------------------------------------- the plan

_LOWS = [0.2, 0.5, 0.01, float(parse_grid("0.01:0.99:121:log")[40])]  # two grid points
_HIGHS = [5.0, 2.0, 1.01]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(_LOWS), st.sampled_from(_HIGHS)), min_size=1, max_size=4),
    st.booleans(),
)
def test_plan_against_brute_force(pairs, bare):
    """curve_plan for icepop settings (and the bare name first or not): one line per (swept
    parameter, the other's value), the default grid with the settings' values on it, marks
    at those values; a bare name's two lines are its sweep jobs, the values added where a
    setting falls on them."""
    specs = (["icepop"] if bare else []) + [f"icepop:low={lo},high={hi}" for lo, hi in pairs]
    sweep_jobs, _ = sweep_plan(COLUMNS, specs)
    plan = curve_plan(COLUMNS, specs, sweep_jobs)
    grids = {p: parse_grid(REGISTRY["icepop"].param(p).grid) for p in ("low", "high")}
    want: dict[tuple, set] = {}
    marks: dict[tuple, dict] = {}
    if bare:  # the default's lines: low at high=5, high at low=0.5
        want[("low", "high=5")] = set()
        want[("high", "low=0.5")] = set()
    for lo, hi in pairs:
        rule = parse_rule(f"icepop:low={lo},high={hi}")  # its names: SPEC and settings
        for p, v in (("low", lo), ("high", hi)):
            other = rule.setting(p)
            want.setdefault((p, other), set()).add(v)
            marks.setdefault((p, other), {}).setdefault(v, []).append(rule.spec())
    got = {}
    for (where, k), is_given, at in zip(plan.lines, plan.given, plan.marks, strict=True):
        job = sweep_jobs[k] if where == "sweep" else plan.jobs[k]
        key = (job.param, job.rule.setting(job.param))
        assert key not in got  # one line each
        got[key] = job.values
        assert is_given == (key in marks)
        assert {v: sorted(labs) for v, labs in at.items()} == {
            v: sorted(labs) for v, labs in marks.get(key, {}).items()
        }
        if where == "sweep":  # untouched: no setting on it
            assert key not in marks
    assert set(got) == set(want)
    for key, added in want.items():
        expect = grids[key[0]]
        for v in added:
            expect = with_value(expect, v)
        assert np.array_equal(got[key], expect), key


def test_plan_leaves_an_off_side_unmarked():
    """cispo@prime-rl's low 0 is "off": its low line is drawn, unmarked; an unset
    threshold (token-k3@verl) is its sweep's grid, as a bare name."""
    specs = ["cispo@prime-rl", "token-k3@verl"]
    sweep_jobs, _ = sweep_plan(COLUMNS, specs)
    plan = curve_plan(COLUMNS, specs, sweep_jobs)
    by = {}
    for (where, k), at in zip(plan.lines, plan.marks, strict=True):
        job = sweep_jobs[k] if where == "sweep" else plan.jobs[k]
        by[(job.rule.name, job.param)] = (where, at, job.values)
    assert by[("cispo", "low")][1] == {} and 0.0 not in by[("cispo", "low")][2]
    assert by[("cispo", "high")][1] == {5.0: ["cispo@prime-rl"]}
    assert by[("token-k3", "hi")][:2] == ("sweep", {})
    assert curve_plan(COLUMNS, None, []) is None


# ----------------------------------------------------------------------------- drawing


def test_log_grid_with_a_value_added_keeps_log_x():
    grid = parse_grid("1.01:100:121:log")
    assert viz_curves._is_log_grid(grid)
    assert viz_curves._is_log_grid(with_value(grid, 2.0))
    assert viz_curves._is_log_grid(with_value(with_value(grid, 2.0), 3.0))
    assert not viz_curves._is_log_grid(np.linspace(1.01, 100, 121))
    data = data_of(["tis@verl:cap=2"])  # 1.01..100: a ratio under 100, log by its grid
    fig = viz_curves.masked_fraction(data.curves)
    assert [a.get_xscale() for a in fig.axes if a.get_title()] == ["log"]


def test_narrow_linear_ticks_do_not_overlap():
    """A one-row sweep table drawn as it is (a notebook's): a point on a narrow linear
    axis, a few short tick labels that do not overlap."""
    table = data_of(["icepop:low=0.2,high=5"]).sweep
    assert table.height == 1
    fig = viz_curves.masked_fraction(table, markers=False)
    ax = next(a for a in fig.axes if a.get_title())
    assert ax.get_xscale() == "linear"
    renderer = render.agg_canvas(fig).canvas.get_renderer()
    fig.draw_without_rendering()
    boxes = [
        t.get_window_extent(renderer)
        for t in ax.get_xticklabels()
        if t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]
    ]
    assert 2 <= len(boxes) <= 6
    boxes.sort(key=lambda b: b.x0)
    assert all(a.x1 < b.x0 for a, b in itertools.pairwise(boxes))  # apart, left to right
    assert all(len(t.get_text()) <= 6 for t in ax.get_xticklabels())


def test_setting_label():
    from mismatch_replay.analysis.figure_data import setting_label

    assert setting_label(parse_rule("icepop@verl")) == "icepop@verl"
    assert setting_label(parse_rule("ipo:eps=0.3")) == "ipo:eps=0.3"
    assert setting_label(parse_rule("icepop@verl:low=0.3")).startswith("icepop@verl:low=0.3")


def test_a_curve_with_a_value_added_still_hides_its_twin():
    """CISPO's low line (high=5) counts IcePop's tokens: drawn once even where icepop@verl
    adds 0.5 to IcePop's grid and not to CISPO's."""
    data = data_of(["icepop@verl", "cispo@prime-rl"])
    fig = viz_curves.masked_fraction(data.curves)
    lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.get_lines()}
    twin = lines["sweep|cispo|high=5|low"]
    assert twin.get_linestyle() == "None" and twin.get_label().endswith("= IcePop low")
    assert lines["sweep|icepop|high=5|low"].get_linestyle() == "--"
