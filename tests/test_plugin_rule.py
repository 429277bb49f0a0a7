"""tests/plugin_rule_example.py, run as a user runs it: a subprocess on a log, its one JSON
line checked against counts computed here with plain numpy, and its path "fused"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from mismatch_replay import fast

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "plugin_rule_example.py"


def _brute(log: Path) -> dict[str, int]:
    df = pl.read_parquet(log)
    if "loss_mask" in df.columns:
        df = df.filter(pl.col("loss_mask"))
    l = df["trainer_logprob"].to_numpy() - df["inference_logprob"].to_numpy()  # noqa: E741
    return {e: int(np.count_nonzero(np.abs(l) > float(e))) for e in ("0.1", "0.5", "1.0")}


def _run(log: Path) -> dict:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True, check=True
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0])


@pytest.mark.skipif(fast.backend() != "numba", reason="the fused path needs numba")
def test_plugin_rule_runs_fused_with_exact_counts(golden_log):
    got = _run(golden_log)
    assert got["path"] == "fused"
    assert got["masked_tokens"] == _brute(golden_log)
    assert got["masked_tokens"]["0.1"] > got["masked_tokens"]["1.0"] > 0


def test_plugin_rule_counts_on_a_log_with_ties(tmp_path):
    """Log ratios exactly at the thresholds (strict >: not masked) and one ulp past them."""
    ties = []
    for e in (0.1, 0.5, 1.0):
        for x in (e, -e, np.nextafter(e, 2.0), -np.nextafter(e, 2.0)):
            ties.append(x)
    rng = np.random.default_rng(3)
    l = np.concatenate([np.array(ties), rng.normal(0, 0.6, 5000)])  # noqa: E741
    lq = np.log(rng.uniform(0.05, 1.0, l.size))
    lp = lq + l
    ok = lp <= 0
    log = tmp_path / "ties.parquet"
    pl.DataFrame({"trainer_logprob": lp[ok], "inference_logprob": lq[ok]}).write_parquet(log)
    got = _run(log)
    assert got["masked_tokens"] == _brute(log)
    if fast.backend() == "numba":
        assert got["path"] == "fused"
