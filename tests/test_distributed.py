"""The Ray engine on a local Ray instance with several workers: the same tables as the local
engine (counts exact, floats to 1e-9), whatever the split into files; skipped without Ray."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import assert_tables_equal, random_log, write_log
from typer.testing import CliRunner

from mismatch_replay import engine, ingest
from mismatch_replay.errors import UsageError

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # a local Ray cluster: worker processes

WORKERS = 3


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    from mismatch_replay.engine import ray as distributed

    started = not ray.is_initialized()
    distributed.init(num_cpus=WORKERS)
    yield
    if started:
        ray.shutdown()


def _split(tmp_path, df: pl.DataFrame, parts: int, name: str = "split"):
    """Contiguous pieces: sequences and steps span files."""
    cuts = np.linspace(0, df.height, parts + 1).astype(int)
    d = tmp_path / name
    for i in range(parts):
        write_log(d / f"part{i:02d}.parquet", df[cuts[i] : cuts[i + 1]])
    return d


def _same(a, b, by=None):
    keys = ("rule", "setting", "param", "value", *([by] if by else []))
    assert_tables_equal(a.table, b.table, keys=keys, rel=1e-9)
    assert_tables_equal(a.metrics, b.metrics, keys=[by] if by else [], rel=1e-9)
    assert np.array_equal(a.tally.hist_lin, b.tally.hist_lin)
    assert np.array_equal(a.tally.hist_log, b.tally.hist_log)


@pytest.mark.parametrize("by", [None, "step"])
def test_ray_engine_equals_local_engine(tmp_path, by):
    """Every rule the log supports over its default grid (m2po and sequence rules too)."""
    rng = np.random.default_rng(21)
    df = random_log(rng, steps=4, seqs=10, max_len=40)
    d = _split(tmp_path, df, 5)
    local = engine.sweep([d], by=by)
    on_ray = engine.sweep([d], by=by, engine="ray")
    assert local.table.height > 2000
    _same(on_ray, local, by)
    assert on_ray.tally.report.loss_rows == local.tally.report.loss_rows
    assert len(on_ray.tally.seq_keys) == len(local.tally.seq_keys)


def test_ray_engine_on_sequence_rows_with_numbered_sample_ids(tmp_path):
    """One row per sequence, no sample_id column: ingest numbers sequences by row, and the
    shards keep the local engine's numbering."""
    rng = np.random.default_rng(22)
    rows = []
    for s in range(3):
        for _ in range(6):
            n = int(rng.integers(2, 12))
            lq = (-rng.exponential(0.5, n)).tolist()
            lp = [min(x + float(rng.normal(0, 0.1)), 0.0) for x in lq]
            rows.append({"step": s, "trainer_logprobs": lp, "inference_logprobs": lq})
    df = pl.DataFrame(rows)
    d = _split(tmp_path, df, 4)
    local = engine.sweep([d], by="step")
    on_ray = engine.sweep([d], by="step", engine="ray")
    _same(on_ray, local, "step")
    assert len(on_ray.tally.seq_keys) == df.height


def test_ray_engine_with_small_batches_and_one_file_per_worker(tmp_path):
    rng = np.random.default_rng(23)
    df = random_log(rng, steps=2, seqs=6, max_len=30)
    d = _split(tmp_path, df, WORKERS)
    opts = ingest.ReadOptions(batch_rows=17)
    rules = ["ipo", "icepop@verl", "seq-mis@verl", "m2po", "tis"]
    local = engine.sweep([d], rules=rules, options=opts)
    on_ray = engine.sweep([d], rules=rules, options=opts, engine="ray")
    _same(on_ray, local)


def test_ray_engine_refuses_what_only_the_local_engine_does(tmp_path):
    d = _split(tmp_path, random_log(np.random.default_rng(24)), 2)
    with pytest.raises(UsageError, match="local engine"):
        engine.sweep([d], engine="ray", match="prime-rl")
    with pytest.raises(UsageError, match="--engine"):
        engine.sweep([d], engine="spark")


def test_cli_sweep_engine_ray(tmp_path):
    from mismatch_replay.cli import app

    d = _split(tmp_path, random_log(np.random.default_rng(25)), 3)
    out = {}
    for name in ("local", "ray"):
        target = tmp_path / f"{name}.csv"
        res = CliRunner().invoke(
            app, ["sweep", str(d), "--rule", "ipo", "--engine", name, "-o", str(target)]
        )
        assert res.exit_code == 0, res.output
        out[name] = pl.read_csv(target)
    assert_tables_equal(out["ray"], out["local"])


def test_one_large_file_is_split_by_row_groups_with_identical_results(tmp_path):
    """A single Parquet file of 6 row groups: shards of row-group runs cover every row once,
    in order, and the Ray engine (2 tasks per CPU) gives the local engine's tables."""
    from mismatch_replay.engine import ray as distributed

    rng = np.random.default_rng(25)
    df = random_log(rng, steps=4, seqs=10, max_len=40)
    path = tmp_path / "one.parquet"
    df.write_parquet(path, row_group_size=-(-df.height // 6))
    plan = ingest.plan_sources([path])
    parts = distributed.shards(plan, per_file=4)
    assert len(parts) == 4
    assert [p.row_groups[0] for p, _ in parts] == [(0, 1), (1, 3), (3, 4), (4, 6)]
    assert sum(p.rows[0] for p, _ in parts) == df.height
    local = engine.sweep([path], by="step")
    on_ray = engine.sweep([path], by="step", engine="ray")
    _same(on_ray, local, "step")
    assert len(on_ray.tally.seq_keys) == len(local.tally.seq_keys)
