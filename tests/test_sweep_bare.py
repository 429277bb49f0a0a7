"""`sweep -r NAME`: a bare rule name sweeps the rule's thresholds over their default grids,
as the sweep without -r does; `-r NAME:p=v` and `-r NAME@preset` are one setting, one row."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_replay import engine
from mismatch_replay.cli import app
from mismatch_replay.errors import UsageError
from mismatch_replay.rules import REGISTRY, parse_grid
from mismatch_replay.rules.spec import is_bare, sweep_specs

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
COLUMNS = ("trainer_logprob", "inference_logprob", "step", "sample_id", "advantage")
KEY = ["rule", "setting", "param", "value"]


def rows(*args: str) -> pl.DataFrame:
    """The table `sweep GOLDEN *args -o FILE.parquet` writes."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "sweep.parquet"
        res = CliRunner().invoke(app, ["sweep", GOLDEN, *args, "-o", str(out)])
        assert res.exit_code == 0, res.output
        return pl.read_parquet(out)


@pytest.fixture(scope="module")
def everything() -> pl.DataFrame:
    return rows()


@pytest.mark.parametrize("name", ["ipo", "icepop", "kpop", "seq-mis"])
def test_bare_name_gives_the_default_sweeps_rows(everything, name):
    got = rows("-r", name)
    want = everything.filter(pl.col("rule") == name)
    assert got.height > 1 and set(got["rule"]) == {name}
    # the same rows as the sweep without -r: every count exactly; the |p - q| mass sums to
    # the last bits (a float sum, in the order the jobs ran together)
    got, want = got.sort(KEY), want.sort(KEY).select(got.columns)
    floats = [c for c, t in got.schema.items() if t == pl.Float64 and c != "value"]
    assert got.drop(floats).equals(want.drop(floats))
    for c in floats:
        a, b = got[c].to_numpy(), want[c].to_numpy()
        assert np.allclose(a, b, rtol=1e-12, atol=0, equal_nan=True), c
    # every threshold parameter over its default grid
    cls = REGISTRY[name]
    for p in (p for p in cls.params if p.threshold):
        vals = got.filter(pl.col("param") == p.name)["value"].to_numpy()
        assert np.array_equal(np.sort(vals), parse_grid(p.grid)), p.name


def test_values_or_a_preset_give_one_row(everything):
    one = rows("-r", "ipo:eps=0.3")
    assert one.height == 1 and one["value"].to_list() == [0.3]
    preset = rows("-r", "ipo@prime-rl")
    assert preset.height == 1 and preset["spec"].to_list() == ["ipo@prime-rl:eps=0.3"]
    assert preset["masked_tokens"].to_list() == one["masked_tokens"].to_list()
    both = rows("-r", "ipo", "-r", "icepop:low=0.2,high=5")
    ipo = everything.filter(pl.col("rule") == "ipo")
    assert both.filter(pl.col("rule") == "ipo").height == ipo.height
    assert both.filter(pl.col("rule") == "icepop").height == 1


def test_plan_jobs_sweeps_a_rule_class_only():
    default, _ = engine.plan_jobs(None, None, COLUMNS)
    cls = REGISTRY["icepop"]
    jobs, _ = engine.plan_jobs([cls], None, COLUMNS)
    assert [(j.label, list(j.values)) for j in jobs] == [
        (j.label, list(j.values)) for j in default if j.rule.name == "icepop"
    ]
    assert [len(j.values) for j in engine.plan_jobs(["icepop"], None, COLUMNS)[0]] == [1]
    assert [len(j.values) for j in engine.plan_jobs([cls()], None, COLUMNS)[0]] == [1]
    # --sweep on a bare name: its grid replaces the default one
    jobs, _ = engine.plan_jobs([REGISTRY["ipo"]], {"eps": "0.1,0.2"}, COLUMNS)
    assert [list(j.values) for j in jobs] == [[0.1, 0.2]]


def test_sweep_specs():
    assert [is_bare(s) for s in ("ipo", " ipo ", "ipo:eps=0.3", "ipo@prime-rl", "ipo:")] == [
        True,
        True,
        False,
        False,
        False,
    ]
    assert sweep_specs(["ipo", "icepop@verl"]) == [REGISTRY["ipo"], "icepop@verl"]
    with pytest.raises(UsageError, match="unknown rule 'nope'"):
        sweep_specs(["nope"])


def test_a_bare_name_the_log_cannot_support_is_an_error(tmp_path):
    log = tmp_path / "noadv.parquet"
    pl.read_parquet(GOLDEN).drop("advantage").write_parquet(log)
    res = CliRunner().invoke(app, ["sweep", str(log), "-r", "dppo-tv"])
    assert res.exit_code == 1 and "advantage" in res.output


def test_help_says_so():
    res = CliRunner().invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.output.split())
    assert "A bare name (ipo) sweeps the rule's threshold parameters" in text


@pytest.mark.slow
def test_plot_and_report_sweep_a_bare_name_in_the_masked_fraction_panel():
    """plot / report -r ipo: ipo's panel over its default grid (the rows `sweep -r ipo`
    gives), ipo drawn at its default; -r ipo:eps=0.2: the sweep the one row `sweep -r
    ipo:eps=0.2` gives (tests/test_report_sweep.py: report's sweep.csv), the panel that
    setting marked on its curve, the default grid and 0.2 (tests/test_figure_curves.py)."""
    from mismatch_replay import analysis
    from mismatch_replay.viz import render

    grid = parse_grid(REGISTRY["ipo"].param("eps").grid)
    for specs, drawn, xs in (
        (["ipo"], ["ipo:eps=0.3"], grid),
        (["ipo:eps=0.2"], ["ipo:eps=0.2"], np.unique(np.append(grid, 0.2))),
    ):
        data = analysis.figure_data([GOLDEN], specs)
        assert [r.spec() for r in data.settings] == drawn
        ipo = data.sweep.filter(pl.col("rule") == "ipo")
        want = rows("-r", specs[0]).sort("value").select(KEY)
        assert ipo.sort("value").select(KEY).equals(want)
        rules = render.panel_rules(data.settings, data.given)
        fig = render.figures(data, None, rules)["masked_fraction"]()
        lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "IPO eps"]
        assert len(fig.axes) >= 1 and len(lines) == 1
        assert np.array_equal(np.asarray(lines[0].get_xdata(), float), xs)
