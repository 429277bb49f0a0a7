"""plot / report / demo from the command line: files written, refusals, the Decision section."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_replay.cli import app
from mismatch_replay.viz.jobs import FIGURES, sample_path

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
runner = CliRunner()


@pytest.mark.slow  # a whole plot/report: every figure drawn, the figure helper process
def test_plot_writes_the_figures_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "figs"
    r = runner.invoke(app, ["plot", GOLDEN, "-o", str(out), "-t", "0.0025"])
    assert r.exit_code == 0, r.stderr
    for name in FIGURES:
        assert (out / f"{name}.png").stat().st_size > 10_000
    before = (out / "scatter.png").stat().st_mtime_ns
    r = runner.invoke(app, ["plot", GOLDEN, "-o", str(out)])
    assert r.exit_code == 2 and "--force" in r.stderr
    assert (out / "scatter.png").stat().st_mtime_ns == before
    r = runner.invoke(app, ["plot", GOLDEN, "-o", str(out), "--image-format", "svg"])
    assert r.exit_code == 0 and (out / "steps.svg").exists()
    r = runner.invoke(app, ["plot", GOLDEN, "-o", str(out), "--image-format", "gif"])
    assert r.exit_code == 2 and "png, svg or pdf" in r.stderr
    # --format is the log's format, as in every command; the old image-format use says so
    r = runner.invoke(app, ["plot", GOLDEN, "-o", str(out), "--format", "pdf"])
    assert r.exit_code == 2 and "--image-format pdf" in r.stderr
    r = runner.invoke(app, ["plot", GOLDEN, "-o", str(out), "--format", "parquet", "--force"])
    assert r.exit_code == 0, r.stderr


@pytest.mark.slow  # a whole plot/report: every figure drawn, the figure helper process
def test_report_has_figures_command_version_and_decision(tmp_path):
    out = tmp_path / "rep"
    r = runner.invoke(app, ["report", GOLDEN, "-o", str(out), "--bootstrap", "20"])
    assert r.exit_code == 0, r.stderr
    page = (out / "index.html").read_text()
    assert page.count("data:image/png;base64,") >= 4
    assert "mismatch-replay report" in page and "--bootstrap 20" in page
    from mismatch_replay import __version__

    assert __version__ in page
    assert "Decision" in page and "Which threshold masks" in page
    assert "IPO and IcePop at their prime-rl defaults" in page and "Did the run drift?" in page
    r = runner.invoke(app, ["report", GOLDEN, "-o", str(out)])
    assert r.exit_code == 2 and "index.html" in r.stderr and "--force" in r.stderr


@pytest.mark.slow  # a whole plot/report: every figure drawn, the figure helper process
@pytest.mark.skipif(not sample_path().exists(), reason="bundled sample not built")
def test_demo_runs_on_the_bundled_sample(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["demo"])
    assert r.exit_code == 0, r.stderr
    out = tmp_path / "mismatch-replay-demo"
    for name in ("index.html", "sweep.csv", "inspect.json", *[f"{n}.png" for n in FIGURES]):
        assert (out / name).exists(), name
    assert "Open" in r.stdout and "index.html" in r.stdout
    r = runner.invoke(app, ["demo"])
    assert r.exit_code == 2 and "--force" in r.stderr


@pytest.mark.slow  # a whole plot/report: every figure drawn, the figure helper process
def test_report_writes_sweep_csv_and_lists_what_choose_chose(tmp_path):
    import polars as pl

    from mismatch_replay import analysis, engine
    from mismatch_replay.viz import jobs

    out = tmp_path / "rep"
    seen: list[tuple[int, int]] = []
    keep: dict = {}
    jobs.report(
        [GOLDEN],
        out,
        command="c",
        bootstrap=20,
        progress=lambda d, t: seen.append((d, t)),
        keep=keep,
    )
    # sweep.csv beside index.html: the full default sweep, exactly engine.sweep's rows
    table = pl.read_csv(out / "sweep.csv")
    ref = engine.sweep([GOLDEN]).table
    assert table.height == ref.height
    assert table["masked_tokens"].to_list() == ref["masked_tokens"].to_list()
    # one progress bar through every pass: never falls back, ends full
    counts = [d for d, _ in seen]
    assert counts == sorted(counts) and seen[-1][0] == seen[-1][1]
    # "Chosen settings" lists choose's thresholds, and a table around each
    page = (out / "index.html").read_text()
    chosen = page[page.index("<h2>Chosen settings</h2>") : page.index("<h2>Plotted settings</h2>")]
    rows = keep["decisions"].choose
    assert rows and all(r.spec in chosen for r in rows)
    assert chosen.count('<div class="curve">') == sum(1 for r in rows if r.curve)
    # the by-length figure's table is engine.sweep's, by length, and the page embeds it
    from polars.testing import assert_frame_equal

    from mismatch_replay.analysis.figure_data import LENGTH_SETTINGS

    ref = engine.sweep([GOLDEN], rules=list(LENGTH_SETTINGS), by="length").table
    assert_frame_equal(keep["data"].by_length, ref)
    assert (out / "masked_by_length.png").stat().st_size > 10_000
    assert "Masked fraction by sequence length" in page
    # the shared passes give what the separate calls give
    alone = analysis.choose([GOLDEN], 0.0025, list(analysis.DECISION_RULES), bootstrap=20)
    assert [(r.value, r.masked_tokens, r.ci_low, r.ci_high) for r in alone] == [
        (r.value, r.masked_tokens, r.ci_low, r.ci_high) for r in rows
    ]
    assert keep["decisions"].drift == analysis.drift([GOLDEN])
    budget = analysis.compare([GOLDEN], "ipo", "icepop@prime-rl", budget=0.0025, examples=5)
    mine = keep["decisions"].compare_budget
    assert {c: mine.cells[c].tokens for c in analysis.CELLS} == {
        c: budget.cells[c].tokens for c in analysis.CELLS
    }
    r = runner.invoke(app, ["report", GOLDEN, "-o", str(out)])
    assert r.exit_code == 2 and "--force" in r.stderr


@pytest.mark.slow  # a whole plot/report: every figure drawn, the figure helper process
def test_plot_and_report_without_sequence_ids_skip_the_length_figure_with_a_note(tmp_path):
    import polars as pl

    log = tmp_path / "no_ids.parquet"
    pl.read_parquet(GOLDEN).drop("sample_id").write_parquet(log)
    out = tmp_path / "figs"
    r = runner.invoke(app, ["plot", str(log), "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    assert "no sequence ids" in r.stderr and "masked_by_length" not in r.stdout
    assert not (out / "masked_by_length.png").exists()
    assert all((out / f"{n}.png").exists() for n in FIGURES if n != "masked_by_length")
    rep = tmp_path / "rep"
    r = runner.invoke(app, ["report", str(log), "-o", str(rep), "--bootstrap", "0"])
    assert r.exit_code == 0, r.stderr
    page = (rep / "index.html").read_text()
    assert page.count("data:image/png;base64,") == len(FIGURES) - 1
    assert "Not drawn: the log has no sequence ids" in page
    assert not (rep / "masked_by_length.png").exists()


def test_the_reports_shared_read_gives_inspects_summary():
    """report_data's one read also gives inspect's summary: the same as inspect_log's own
    pass (counts, metrics overall and per step, alignment, warnings)."""
    import polars as pl

    from mismatch_replay import analysis
    from mismatch_replay.analysis.inspect import inspect_log

    got: dict = {}
    analysis.report_data([GOLDEN], bootstrap=0, summary=got)
    mine, ref = got["summary"].to_dict(), inspect_log([GOLDEN]).to_dict()
    for k in ("files", "format", "rows", "loss_tokens", "steps", "sequences", "invalid"):
        assert mine[k] == ref[k], k
    assert mine["alignment"] == ref["alignment"] and mine["warnings"] == ref["warnings"]
    for k, v in ref["metrics"].items():
        if v is None or isinstance(v, str):
            assert mine["metrics"][k] == v, k
        else:
            assert mine["metrics"][k] == pytest.approx(v, rel=1e-12, nan_ok=True), k
    a, b = pl.DataFrame(mine["per_step"]), pl.DataFrame(ref["per_step"])
    assert a.columns == b.columns and a["step"].to_list() == b["step"].to_list()
    assert a["tokens"].to_list() == b["tokens"].to_list()


def test_report_data_reads_the_log_once(reads, tmp_path):
    """One read for the sweep, choose, both compares, drift, the per-step, per-bucket and
    by-length tables and inspect's summary, with no read ahead (on the fused path; the
    simple path keeps no tail: choose and compare make their passes, the grouped tables
    their replays). The log has 240k tokens: on a much smaller one the
    bootstrap's spread can reach past what the tail keeps, and choose then makes the pass
    (tests/test_tail.py)."""

    from test_analysis import random_log

    from mismatch_replay import analysis, fast

    log = random_log(tmp_path / "log.parquet", 5, steps=10, seqs=120, length=200)

    # in exact arithmetic: the framework presets' float32 (their default) runs on the
    # simple path, which keeps no tail (choose and the grouped tables then read again)
    _, dec = analysis.report_data([log], bootstrap=50, precision="float64")
    if fast.backend() == "numba":
        assert len(reads) == 1 and reads.partial == 0
        assert all(r.passes == 1 for r in dec.choose if r.rule != "m2po")
    else:
        assert len(reads) > 2
