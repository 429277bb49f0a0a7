"""plot / report / demo from the command line: files written, refusals, the Decision section."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_replay.cli import app
from mismatch_replay.pipeline import FIGURES, sample_path

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
runner = CliRunner()


def test_plot_writes_the_four_figures_and_refuses_to_overwrite(tmp_path):
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
