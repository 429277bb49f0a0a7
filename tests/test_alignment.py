"""The lag check (trainer log-probs shifted against inference) and the degenerate-log flags,
on both paths (`kernel_backend`: the numba kernels of checks_jit, and the polars reference);
tests/test_checks_fast.py compares the two on random batches."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import GOLDEN_LOG, random_log, write_log
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mismatch_replay import engine, ingest
from mismatch_replay.cli import app
from mismatch_replay.ingest.alignment import AlignmentCheck, first_batch_warnings


def _golden() -> pl.DataFrame:
    return pl.read_parquet(GOLDEN_LOG).filter(pl.col("loss_mask"))


def _shifted(df: pl.DataFrame, s: int) -> pl.DataFrame:
    """The trainer's column moved s positions within each sequence (the ends dropped)."""
    keys = ["step", "sample_id"]
    return (
        df.sort([*keys, "position"])
        .with_columns(pl.col("trainer_logprob").shift(s).over(keys))
        .drop_nulls("trainer_logprob")
    )


def _brute_means(df: pl.DataFrame) -> dict[int, float]:
    """D(0), D(+1), D(-1) by a loop over sequences (independent of the polars expressions)."""
    sums, n = {0: 0.0, 1: 0.0, -1: 0.0}, 0
    for _, g in df.sort("position").group_by(["step", "sample_id"], maintain_order=True):
        pos = g["position"].to_numpy()
        lp, lq = g["trainer_logprob"].to_numpy(), g["inference_logprob"].to_numpy()
        for t in range(len(pos) - 1):
            if pos[t + 1] != pos[t] + 1:
                continue
            n += 1
            sums[0] += abs(lp[t + 1] - lq[t + 1])
            sums[1] += abs(lp[t + 1] - lq[t])
            sums[-1] += abs(lp[t] - lq[t + 1])
    return {k: v / n for k, v in sums.items()}, n


def test_an_aligned_log_is_aligned(kernel_backend):
    c = AlignmentCheck()
    c.add(_golden())
    assert c.shift() == 0 and c.warnings() == []
    assert c.line().startswith("aligned:")
    want, n = _brute_means(_golden())
    assert c.pairs == n
    for k in (0, 1, -1):
        assert c.means()[k] == pytest.approx(want[k], rel=1e-12)


@pytest.mark.parametrize("s", [1, -1])
def test_a_shifted_log_is_named_with_its_shift_and_the_evidence(s, kernel_backend):
    df = _shifted(_golden(), s)
    c = AlignmentCheck()
    c.add(df)
    assert c.shift() == s
    (w,) = c.warnings()
    assert f"shifted by {s:+d} position" in w and f"{c.pairs:,} pairs" in w
    assert c.line().startswith(f"SHIFTED by {s:+d}")
    assert first_batch_warnings(df) == [w]


@settings(max_examples=15)
@given(seed=st.integers(0, 10_000), shift=st.sampled_from([0, 1, -1]), split=st.integers(1, 4))
def test_the_verdict_ignores_row_order_and_adds_across_batches(seed, shift, split):
    rng = np.random.default_rng(seed)
    df = random_log(rng, steps=2, seqs=8, max_len=30, mismatch=0.02).filter(pl.col("loss_mask"))
    if shift:
        df = _shifted(df, shift)
    df = df.sample(fraction=1.0, shuffle=True, seed=seed)
    whole = AlignmentCheck()
    whole.add(df)
    parts = AlignmentCheck()  # batches that keep each sequence whole: the same pairs
    for _, g in df.group_by(pl.col("sample_id") % split, maintain_order=True):
        parts.add(g.select(df.columns))
    assert parts.pairs == whole.pairs
    assert parts.means() == pytest.approx(whole.means(), rel=1e-12)
    if whole.pairs >= 64:
        assert whole.shift() == shift


def test_degenerate_columns_are_flagged(kernel_backend):
    df = _golden()
    same = df.with_columns(pl.col("inference_logprob").alias("trainer_logprob"))
    c = AlignmentCheck()
    c.add(same)
    assert any("identical on all" in w for w in c.warnings())
    zero = df.with_columns(trainer_logprob=pl.lit(0.0))
    c = AlignmentCheck()
    c.add(zero)
    assert any("trainer_logprob is 0 on all" in w for w in c.warnings())
    const = df.with_columns(inference_logprob=pl.lit(-0.5))
    c = AlignmentCheck()
    c.add(const)
    assert any("inference_logprob is the same value (-0.5)" in w for w in c.warnings())


def test_inspect_shows_the_verdict_and_every_command_warns_once(tmp_path):
    path = write_log(tmp_path / "shifted.parquet", _shifted(_golden(), 1))
    res = CliRunner().invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0
    assert "SHIFTED by +1" in res.stdout
    assert res.stderr.count("look shifted by +1 position") == 1
    for cmd in (["sweep", "-r", "ipo", "-r", "seq-mis"], ["choose", "-t", "0.01", "-r", "ipo"]):
        res = CliRunner().invoke(app, [cmd[0], str(path), *cmd[1:]])
        assert res.exit_code == 0, res.output
        assert res.stderr.count("look shifted by +1 position") <= 1
    engine.clear_alignment_warnings()
    with pytest.warns(ingest.IngestWarning, match="shifted by \\+1"):
        engine.sweep([path], rules=["ipo", "seq-mis"])
    aligned = CliRunner().invoke(app, ["sweep", str(GOLDEN_LOG), "-r", "ipo", "-r", "seq-mis"])
    assert "shifted" not in aligned.stderr
