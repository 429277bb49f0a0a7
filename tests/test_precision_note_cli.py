"""drift and plot print the precision note (issue 30): a preset whose float32 count differs
from its exact one by more than 1% or 10 tokens gets one line with both numbers and the
cause; a preset whose counts agree gets none. On the golden log, kpop@areal masks 1,980
tokens in AReaL's float32 arithmetic and 13 in exact arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mismatch_replay.cli import app
from mismatch_replay.engine import precision_notes_for

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
runner = CliRunner()


def invoke(*args):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res


def expected(spec: str):
    """The note the engine gives for `spec` alone (both counts replayed here)."""
    return precision_notes_for([GOLDEN], [spec])


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_golden_log_counts():
    """The counts the notes below print: kpop@areal differs, ipo@prime-rl agrees."""
    (n,) = expected("kpop@areal")
    assert (n.float32, n.exact) == (1980, 13)
    assert expected("ipo@prime-rl") == []


def test_drift_prints_the_note_for_a_differing_preset_only():
    res = invoke("drift", GOLDEN, "-r", "kpop@areal", "-r", "ipo@prime-rl")
    err = one_line(res.stderr)
    assert "note: kpop@areal masks 1,980 tokens in AReaL's float32 arithmetic; 13 in exact" in err
    assert "clamp 1 - 1e-8 is 1.0 in float32" in err
    assert "ipo@prime-rl masks" not in err
    assert "note:" not in res.stdout  # results on stdout, the note on stderr
    doc = json.loads(invoke("drift", GOLDEN, "-r", "kpop@areal", "--json").stdout)
    assert [(n["spec"], n["float32"], n["exact"]) for n in doc["precision_notes"]] == [
        (expected("kpop@areal")[0].spec, 1980, 13)
    ]
    agree = invoke("drift", GOLDEN, "-r", "ipo@prime-rl")
    assert "in exact arithmetic" not in agree.stderr


@pytest.mark.slow
def test_plot_prints_the_note_after_its_file_list(tmp_path):
    res = invoke("plot", GOLDEN, "-r", "kpop@areal", "-r", "ipo@prime-rl", "-o", tmp_path / "a")
    err = one_line(res.stderr)
    assert "note: kpop@areal masks 1,980 tokens in AReaL's float32 arithmetic; 13 in exact" in err
    assert "ipo@prime-rl masks" not in err
    assert "masked_fraction" in res.stdout and "note:" not in res.stdout
    agree = invoke("plot", GOLDEN, "-r", "ipo@prime-rl", "-o", tmp_path / "b")
    assert "in exact arithmetic" not in agree.stderr
