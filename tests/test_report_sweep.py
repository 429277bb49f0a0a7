"""report / plot -r: the rules given decide what the sweep table holds, as in `sweep -r`
(issue 29 §4): a bare name (`ipo`) its default-grid rows, `ipo:eps=0.3` or `ipo@prime-rl`
one row, no -r every rule; the presets table, which needs the catalogue, stays whole."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import assert_tables_equal
from typer.testing import CliRunner

from mismatch_replay import analysis, engine
from mismatch_replay.analysis.decisions import preset_rules
from mismatch_replay.analysis.figure_data import sweep_plan
from mismatch_replay.cli import app
from mismatch_replay.rules import REGISTRY, parse_grid, parse_rule
from mismatch_replay.viz import render
from mismatch_replay.viz import report as page

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
COLUMNS = ("trainer_logprob", "inference_logprob", "step", "sample_id", "advantage")
# the report's read sums the |p - q| and |A| masses with other jobs: the last bits may differ
REL = 1e-12


def sweep_rows(*args: str) -> pl.DataFrame:
    """The table `sweep GOLDEN *args -o FILE.parquet` writes."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "sweep.parquet"
        res = CliRunner().invoke(app, ["sweep", GOLDEN, *args, "-o", str(out)])
        assert res.exit_code == 0, res.output
        return pl.read_parquet(out)


def rule_args(specs) -> list[str]:
    return [a for s in specs or () for a in ("-r", s)]


_REPORTS: dict = {}


def report_of(specs):
    """report_data on the golden log for `specs` (cached: each costs one read)."""
    key = tuple(specs) if specs else None
    if key not in _REPORTS:
        _REPORTS[key] = analysis.report_data([GOLDEN], specs, 0.0025, bootstrap=0)
    return _REPORTS[key]


@pytest.fixture(scope="module")
def everything() -> pl.DataFrame:
    return sweep_rows()


@pytest.mark.parametrize(
    "specs",
    [None, ["ipo:eps=0.3"], ["ipo"], ["ipo@prime-rl"], ["ipo", "icepop@verl"]],
    ids=["default", "ipo:eps=0.3", "ipo", "ipo@prime-rl", "ipo+icepop@verl"],
)
def test_report_sweep_is_sweep_r(specs):
    """The report's sweep table (sweep.csv) holds the rows `sweep -r SPECS` gives."""
    data, _ = report_of(specs)
    assert_tables_equal(data.sweep, sweep_rows(*rule_args(specs)), rel=REL)


def test_a_setting_is_one_row_a_bare_name_its_grid(everything):
    one = report_of(["ipo:eps=0.3"])[0].sweep
    assert one.height == 1 and one["rule"].to_list() == ["ipo"]
    assert one["value"].to_list() == [0.3]
    bare = report_of(["ipo"])[0].sweep
    assert set(bare["rule"]) == {"ipo"}
    grid = parse_grid(REGISTRY["ipo"].param("eps").grid)
    assert np.array_equal(np.sort(bare["value"].to_numpy()), grid)
    # the bare name's rows are the default report's (and sweep's) ipo rows
    default = report_of(None)[0].sweep
    assert_tables_equal(bare, default.filter(pl.col("rule") == "ipo"), rel=REL)
    assert_tables_equal(default, everything, rel=REL)
    # a preset is one row too, the same setting's
    preset = report_of(["ipo@prime-rl"])[0].sweep
    assert preset["spec"].to_list() == ["ipo@prime-rl:eps=0.3"]
    assert preset["masked_tokens"].to_list() == one["masked_tokens"].to_list()
    mixed = report_of(["ipo", "icepop@verl"])[0].sweep
    assert mixed.filter(pl.col("rule") == "ipo").height == bare.height
    assert mixed.filter(pl.col("rule") == "icepop").height == 1


def test_the_rest_of_the_report_does_not_follow_the_sweep():
    """The presets table still counts every catalogue preset; the chosen settings' tables
    and the Decision are the rules given's, whatever the sweep holds."""
    full, _ = report_of(None)
    one, dec_one = report_of(["ipo:eps=0.3"])
    specs = [r.spec() for r in preset_rules(COLUMNS)]
    assert all(s in one.presets for s in specs)
    assert {s: one.presets[s] for s in specs} == {s: full.presets[s] for s in specs}
    assert page._presets_html(one) == page._presets_html(full)
    assert one.steps["spec"].unique().to_list() == ["ipo:eps=0.3"]
    assert [c.rule for c in dec_one.choose] == ["ipo"]
    assert one.tokens == full.tokens and one.metrics == full.metrics


def test_an_unset_preset_sweeps_its_open_threshold():
    """token-k3@verl leaves hi unset (choose sets it for the report): its sweep rows are hi
    over its default grid, `sweep -r token-k3@verl --sweep token-k3.hi=GRID`'s."""
    grid = REGISTRY["token-k3"].param("hi").grid
    data, _ = report_of(["token-k3@verl"])
    want = sweep_rows("-r", "token-k3@verl", "--sweep", f"token-k3.hi={grid}")
    assert_tables_equal(data.sweep, want, rel=REL)
    assert data.sweep.height == len(parse_grid(grid))
    assert [r.name for r in data.settings] == ["token-k3"]  # at choose's value
    assert data.settings[0].hi is not None


def test_sweep_plan_plans_as_sweep_r():
    def labels(jobs):
        return [(j.label, list(j.values)) for j in jobs]

    assert labels(sweep_plan(COLUMNS)[0]) == labels(engine.plan_jobs(None, None, COLUMNS)[0])
    for specs in (["ipo"], ["ipo:eps=0.3", "kpop"], ["icepop@verl", "seq-mis"]):
        want = engine.plan_jobs([REGISTRY.get(s, s) for s in specs], None, COLUMNS)[0]
        assert labels(sweep_plan(COLUMNS, specs)[0]) == labels(want)
    rule = parse_rule("ipo:eps=0.2")  # a Rule is one setting, as a SPEC with values
    assert [len(j.values) for j in sweep_plan(COLUMNS, [rule])[0]] == [1]
    # --sweep over the rules given: its grid replaces the default one
    jobs, _ = sweep_plan(COLUMNS, ["ipo"], {"eps": "0.1,0.2"})
    assert labels(jobs) == labels(engine.plan_jobs([REGISTRY["ipo"]], {"eps": "0.1,0.2"})[0])


def test_plot_data_follows_the_rules_given():
    """plot's figure data: the sweep of the rules given; masked_fraction draws a setting
    marked on its curve (the default grid and 0.3: FigureData.curves, issue 36 §10,
    tests/test_figure_curves.py) and a bare name as its curve."""
    one = analysis.figure_data([GOLDEN], ["ipo:eps=0.3"])
    assert_tables_equal(one.sweep, sweep_rows("-r", "ipo:eps=0.3"), rel=REL)
    fig = render.figures(one, None, render.panel_rules(one.settings, one.given))
    lines = [ln for ax in fig["masked_fraction"]().axes for ln in ax.get_lines()]
    ipo = [ln for ln in lines if ln.get_gid() == "sweep|ipo||eps"]
    grid = parse_grid(REGISTRY["ipo"].param("eps").grid)
    assert len(ipo) == 1 and 0.3 in list(ipo[0].get_xdata())
    assert len(ipo[0].get_xdata()) == len(grid) + (0 if np.isclose(grid, 0.3).any() else 1)
    mark = [ln for ln in lines if ln.get_gid() == "given|ipo||eps|0.3|ipo:eps=0.3"]
    assert len(mark) == 1 and list(mark[0].get_xdata()) == [0.3]


def test_help_says_so():
    for cmd in ("report", "plot"):
        res = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        text = " ".join(res.output.replace("│", " ").split())  # rich's box, unwrapped
        assert "read as `sweep -r` reads them: a bare name (ipo) sweeps" in text, cmd
        assert "is that one setting, one row" in text, cmd


@pytest.mark.slow  # two whole reports and a plot through the CLI, figures drawn
def test_report_and_plot_cli(tmp_path, everything):
    for specs in (["ipo:eps=0.3"], ["ipo"], None):
        out = tmp_path / ("r-" + "-".join(specs or ["default"]))
        res = CliRunner().invoke(app, ["report", GOLDEN, *rule_args(specs), "-o", str(out)])
        assert res.exit_code == 0, res.output
        csv = pl.read_csv(out / "sweep.csv")
        with tempfile.TemporaryDirectory() as d:  # the sweep's CSV, read back the same way
            f = Path(d) / "sweep.csv"
            r = CliRunner().invoke(app, ["sweep", GOLDEN, *rule_args(specs), "-o", str(f)])
            assert r.exit_code == 0, r.output
            want = pl.read_csv(f)
        assert_tables_equal(csv, want, rel=REL)
        if specs == ["ipo:eps=0.3"]:
            assert csv.height == 1 and csv["rule"].to_list() == ["ipo"]
        if specs is None:
            assert csv.height == everything.height
    out = tmp_path / "plot"
    res = CliRunner().invoke(app, ["plot", GOLDEN, "-r", "ipo:eps=0.3", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "masked_fraction.png").stat().st_size > 0
