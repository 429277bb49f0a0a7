"""capture: the TokenWriter round trip (padded bf16/fp32 tensors in, the same counts out,
sequence rules included), input kinds, sampling, metadata, the commit protocol and the readers'
_SUCCESS rule, errors on the background thread, back-pressure, and each framework hook driven
by a stand-in object with the framework's attribute names and shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from conftest import assert_tables_equal
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, ingest
from mismatch_replay.capture import (
    META_KEY,
    CaptureError,
    CaptureWarning,
    TokenWriter,
    hooks,
    inputs,
    rank_file,
    read_meta,
    step_dir,
)
from mismatch_replay.capture import writer as writer_mod
from mismatch_replay.errors import DataError

# token rules and sequence rules (the latter need every loss token of a sequence)
RULES = [
    "ipo:eps=0.1",
    "icepop",
    "seq-mis:low=0.8,high=1.25",
    "geo-mis",
    "veto:v=0.5",
    "opsm:delta=0.01",
]
SWEEPS = {"ipo.eps": "0.001:1:9:log", "geo-mis.high": "1.001:2:7:log"}
COLUMNS = ["step", "sample_id", "position", "trainer_logprob", "inference_logprob", "advantage"]


def _writer(root, **kw) -> TokenWriter:
    kw.setdefault("fsync", False)  # tmpfs in tests; the commit protocol is the same
    return TokenWriter(root, **kw)


def _padded(rng: np.random.Generator, rows: int, width: int, side: str):
    """A padded batch: (lp, lq, mask) numpy [rows, width], padding full of garbage (NaN in
    the trainer column, +5 in the inference one) that must never be read."""
    lengths = rng.integers(0, width + 1, rows)
    mask = np.zeros((rows, width), dtype=bool)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = True
        else:
            mask[i, width - n :] = True
    lq = -rng.exponential(0.7, (rows, width))
    jump = (rng.random((rows, width)) < 0.1) * rng.normal(0.0, 1.5, (rows, width))
    lp = np.minimum(lq + rng.normal(0.0, 0.08, (rows, width)) + jump, 0.0)
    lp[~mask] = np.nan
    lq[~mask] = 5.0
    return lp, lq, mask


def _read(root) -> pl.DataFrame:
    return ingest.read_table([root]).sort("step", "sample_id", "position")


def _grid_frame(step, lp, lq, mask, adv, sample_base=0) -> pl.DataFrame:
    """The canonical table of one padded batch, every position with its loss_mask (what a
    trainer that logs its whole grid would write): the reference the capture is compared to."""
    rows, width = mask.shape
    r, c = np.divmod(np.arange(rows * width), width)
    return pl.DataFrame(
        {
            "trainer_logprob": np.asarray(lp, dtype=np.float64).reshape(-1),
            "inference_logprob": np.asarray(lq, dtype=np.float64).reshape(-1),
            "step": np.full(rows * width, step, dtype=np.int64),
            "sample_id": (r + sample_base).astype(np.int64),
            "position": c.astype(np.int64),
            "advantage": np.asarray(adv, dtype=np.float64)[r],
            "loss_mask": np.asarray(mask).reshape(-1),
        }
    )


def _as_f64(t: torch.Tensor) -> np.ndarray:
    return t.double().numpy()


# ----------------------------------------------------------------------------- round trip


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rows=st.integers(1, 6),
    width=st.integers(1, 9),
    steps=st.integers(1, 3),
    side=st.sampled_from(["left", "right"]),
    trainer_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_round_trip_padded_tensors_give_the_same_counts(
    seed, rows, width, steps, side, trainer_dtype
):
    rng = np.random.default_rng(seed)
    grids = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "tokens"
        with _writer(root, meta={"trainer_logprob": "old"}) as w:
            for step in range(steps):
                lp, lq, mask = _padded(rng, rows, width, side)
                tl = torch.tensor(lp).to(trainer_dtype)  # the trainer's bf16 / fp32
                il = torch.tensor(lq, dtype=torch.float32)  # the sampler's fp32
                adv = torch.tensor(rng.normal(size=rows), dtype=torch.float32)
                n = w.write(step, tl, il, mask=torch.tensor(mask), advantages=adv)
                assert n == mask.sum()
                grids.append(_grid_frame(step, _as_f64(tl), _as_f64(il), mask, _as_f64(adv)))
        ref = pl.concat(grids)
        ref_path = Path(d) / "reference.parquet"
        ref.write_parquet(ref_path)

        got = _read(root)
        want = ref.filter("loss_mask").drop("loss_mask").sort("step", "sample_id", "position")
        assert got.select(COLUMNS).equals(want.select(COLUMNS))  # exact: bf16/fp32 -> f64

        a = engine.sweep([root], rules=RULES, sweeps=SWEEPS)
        b = engine.sweep([ref_path], rules=RULES, sweeps=SWEEPS)
        assert_tables_equal(a.table, b.table, rel=0.0)
        tokens = a.table.filter(pl.col("rule") == "geo-mis")["tokens"]
        assert (tokens == int(ref["loss_mask"].sum())).all()
        seqs = a.table.filter(pl.col("rule") == "seq-mis")["sequences"]
        assert (seqs == want.select("step", "sample_id").unique().height).all()


def test_bf16_and_fp32_are_stored_exactly_as_float32_and_float64_stays_float64(tmp_path):
    rng = np.random.default_rng(0)
    lp, lq, mask = _padded(rng, 4, 6, "right")
    with _writer(tmp_path) as w:
        w.write(0, torch.tensor(lp).bfloat16(), torch.tensor(lq).float(), mask=mask)
        w.write(1, lp, lq, mask=mask)  # numpy float64
        w.write(2, torch.tensor(lp).half(), lq.astype(np.float32), mask=mask)
    schemas = [pq.read_schema(rank_file(tmp_path, s, 0)) for s in range(3)]
    assert [str(s.field("trainer_logprob").type) for s in schemas] == ["float", "double", "float"]
    got = _read(tmp_path)
    for step, conv in ((0, lambda x: torch.tensor(x).bfloat16()), (1, torch.tensor)):
        vals = got.filter(pl.col("step") == step)["trainer_logprob"].to_numpy()
        np.testing.assert_array_equal(vals, conv(lp)[torch.tensor(mask)].double().numpy())


def test_positions_are_column_indices_with_left_padding(tmp_path):
    mask = np.array([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=bool)
    lp = np.full(mask.shape, -0.5)
    with _writer(tmp_path) as w:
        w.write(3, lp, lp.copy(), mask=mask)
    got = _read(tmp_path)
    assert got["position"].to_list() == [2, 3, 1, 2, 3, 0, 1, 2, 3]
    assert got["sample_id"].to_list() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert got["step"].unique().to_list() == [3]


def test_row_and_token_advantages_write_the_same_table(tmp_path):
    rng = np.random.default_rng(1)
    lp, lq, mask = _padded(rng, 5, 7, "right")
    adv = rng.normal(size=5)
    with _writer(tmp_path / "a") as w:
        w.write(0, lp, lq, mask=mask, advantages=torch.tensor(adv))
    with _writer(tmp_path / "b") as w:
        w.write(0, lp, lq, mask=mask, advantages=np.repeat(adv[:, None], 7, axis=1))
    with _writer(tmp_path / "c") as w:
        w.write(0, lp, lq, mask=mask, advantages=adv[:, None])  # [B, 1]
    a, b, c = (_read(tmp_path / x) for x in "abc")
    assert a.equals(b) and a.equals(c)


@pytest.mark.parametrize("kind", ["lists", "numpy", "tensors", "bf16 tensors"])
def test_ragged_inputs_match_the_padded_batch(tmp_path, kind):
    rng = np.random.default_rng(2)
    lp, lq, mask = _padded(rng, 6, 5, "right")
    if kind == "bf16 tensors":
        lp = torch.tensor(lp).bfloat16().double().numpy()  # the values a bf16 trainer holds
    adv = rng.normal(size=6)
    lengths = mask.sum(axis=1)

    def seqs(x):
        rows = [x[i, :n] for i, n in enumerate(lengths)]
        if kind == "lists":
            return [r.tolist() for r in rows]
        if kind == "numpy":
            return rows
        if kind == "bf16 tensors" and x is lp:
            return [torch.tensor(r).bfloat16() for r in rows]
        return [torch.tensor(r) for r in rows]

    with _writer(tmp_path / "ragged") as w:
        w.write(0, seqs(lp), seqs(lq), advantages=adv.tolist())
    with _writer(tmp_path / "padded") as w:
        w.write(0, lp, lq, mask=mask, advantages=adv)
    assert _read(tmp_path / "ragged").equals(_read(tmp_path / "padded"))


def test_ragged_mask_and_token_advantages(tmp_path):
    lp = [[-0.1, -0.2, -0.3], [], [-0.4, -0.5]]
    mask = [[1, 0, 1], [], [0, 1]]
    adv = [[1.0, 2.0, 3.0], [], [4.0, 5.0]]
    with _writer(tmp_path) as w:
        w.write(0, lp, [s[:] for s in lp], mask=mask, advantages=adv)
    got = _read(tmp_path)
    assert got["position"].to_list() == [0, 2, 1]
    assert got["sample_id"].to_list() == [0, 0, 2]
    assert got["advantage"].to_list() == [1.0, 3.0, 5.0]
    assert got["trainer_logprob"].to_list() == [-0.1, -0.3, -0.5]


def test_ragged_lengths_must_agree(tmp_path):
    with _writer(tmp_path) as w, pytest.raises(ValueError, match="sequence 1 has 1 tokens"):
        w.write(0, [[-0.1, -0.2], [-0.3, -0.1]], [[-0.1, -0.2], [-0.3]])


def test_numpy_inputs_and_cpu_tensors_write_the_same_table(tmp_path):
    rng = np.random.default_rng(3)
    lp, lq, mask = _padded(rng, 4, 8, "left")
    adv = rng.normal(size=4)
    with _writer(tmp_path / "np") as w:
        w.write(0, lp, lq, mask=mask.astype(np.int64), advantages=adv, env="math")
    with _writer(tmp_path / "torch") as w:
        w.write(
            0,
            torch.tensor(lp),
            torch.tensor(lq),
            mask=torch.tensor(mask).float(),  # a float 0/1 mask, like SkyRL's loss_mask
            advantages=torch.tensor(adv),
            env="math",
        )
    a, b = _read(tmp_path / "np"), _read(tmp_path / "torch")
    assert a.equals(b)
    assert a["env"].unique().to_list() == ["math"]


def test_the_device_path_selects_the_same_tokens():
    """The accelerator path (select on the device, copy only those) run on CPU tensors."""
    rng = np.random.default_rng(4)
    lp, lq, mask = _padded(rng, 5, 9, "left")
    values = {
        "trainer_logprob": torch.tensor(lp).bfloat16(),
        "inference_logprob": torch.tensor(lq).float(),
        "advantage": torch.tensor(rng.normal(size=5)),
    }
    kw = dict(sample_base=0, budget=None, rng_seed=(0,))
    dense = inputs.prepare(0, values, torch.tensor(mask), None, None, **kw)
    dev = inputs._prepare_device(
        0, values, torch.tensor(mask), None, None, 0, None, (0,), device=torch.device("cpu")
    )
    assert dev.index[0] == "grid" and dense.index[0] == "mask"
    for name in ("trainer_logprob", "inference_logprob"):
        np.testing.assert_array_equal(
            inputs.to_disk(dense.tokens[name]), inputs.to_disk(dev.tokens[name])
        )
    for a, b in zip(inputs.token_rows(dense), inputs.token_rows(dev), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(dense.per_row["advantage"], dev.per_row["advantage"])


def test_the_caller_may_change_its_tensors_after_write(tmp_path):
    lp = torch.full((2, 3), -0.5)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with _writer(tmp_path) as w:
        w.write(0, lp, lp.clone(), mask=mask)
        lp.fill_(-9.0)
        mask.fill_(False)
    got = _read(tmp_path)
    assert got.height == 6 and (got["trainer_logprob"] == -0.5).all()


# ----------------------------------------------------------------------------- sample ids


def test_sample_ids_default_to_the_row_index_counted_over_the_step(tmp_path):
    lp = np.full((3, 2), -0.1)
    with _writer(tmp_path / "r0") as w:
        w.write(0, lp, lp.copy())
        w.write(0, lp[:2], lp[:2].copy())  # a second micro-batch of step 0 continues the count
        w.write(1, lp, lp.copy())
    got = _read(tmp_path / "r0")
    assert got.filter(pl.col("step") == 0)["sample_id"].unique().to_list() == [0, 1, 2, 3, 4]
    # the step's small batches went into one row group
    assert pq.ParquetFile(rank_file(tmp_path / "r0", 0, 0)).metadata.num_row_groups == 1
    assert got.filter(pl.col("step") == 1)["sample_id"].unique().to_list() == [0, 1, 2]
    with _writer(tmp_path / "r1", rank=1, world_size=2, run_id="r1") as w:
        w.write(0, lp, lp.copy())
    sids = pq.read_table(rank_file(tmp_path / "r1", 0, 1))["sample_id"].to_pylist()
    assert sorted(set(sids)) == [10**9, 10**9 + 1, 10**9 + 2]  # ranks never collide


def test_explicit_sample_ids_ints_and_strings(tmp_path):
    lp = np.full((2, 2), -0.1)
    with _writer(tmp_path / "i") as w:
        w.write(0, lp, lp.copy(), sample_ids=[17, 4])
    with _writer(tmp_path / "s") as w:
        w.write(0, lp, lp.copy(), sample_ids=np.array(["b", "a"], dtype=object), env=["x", "y"])
    assert _read(tmp_path / "i")["sample_id"].to_list() == [4, 4, 17, 17]
    s = _read(tmp_path / "s")
    assert s["sample_id"].to_list() == ["a", "a", "b", "b"]
    assert s["env"].to_list() == ["y", "y", "x", "x"]
    with _writer(tmp_path / "bad") as w, pytest.raises(ValueError, match="one value per sequence"):
        w.write(0, lp, lp.copy(), sample_ids=[1, 2, 3])


def test_columns_must_stay_the_same_over_a_log(tmp_path):
    lp = np.full((2, 2), -0.1)
    with _writer(tmp_path) as w:
        w.write(0, lp, lp.copy(), advantages=[1.0, 2.0])
        with pytest.raises(ValueError, match="needs the same ones"):
            w.write(1, lp, lp.copy())
        w.write(1, lp, lp.copy(), advantages=[1.0, 2.0])
    assert _read(tmp_path).height == 8


# ----------------------------------------------------------------------------- sampling


def test_every_writes_only_the_multiples_and_commits_on_the_step_change(tmp_path):
    lp = np.full((2, 3), -0.2)
    w = _writer(tmp_path, every=3)
    try:
        for step in range(7):
            n = w.write(step, lp, lp.copy())
            assert n == (6 if step % 3 == 0 else 0)
            if step == 1:
                w._queue.join()  # step 0 was handed over for commit when step 1 began
                assert (step_dir(tmp_path, 0) / "_SUCCESS").exists()
    finally:
        w.close()
    steps = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert steps == ["step=0", "step=3", "step=6"]  # beside the rank's lock file
    assert _read(tmp_path)["step"].unique().sort().to_list() == [0, 3, 6]


def test_token_cap_keeps_whole_sequences(tmp_path):
    rng = np.random.default_rng(5)
    lp, lq, mask = _padded(rng, 40, 12, "right")
    lengths = mask.sum(axis=1)
    cap = int(lengths.sum()) // 3
    with _writer(tmp_path, max_tokens_per_step=cap, seed=7) as w:
        first = w.write(0, lp[:20], lq[:20], mask=mask[:20])
        second = w.write(0, lp[20:], lq[20:], mask=mask[20:])  # shares the step's budget
    got = _read(tmp_path)
    assert got.height == first + second <= cap
    per_seq = got.group_by("sample_id").agg(pl.len().alias("n"), pl.col("position").max())
    for sid, n, last in per_seq.iter_rows():
        assert n == lengths[sid] and last == lengths[sid] - 1  # every token of the sequence
    counts = read_meta(rank_file(tmp_path, 0, 0))["step_counts"]
    assert counts["tokens_seen"] == lengths.sum() and counts["tokens_written"] == got.height
    assert counts["sequences_seen"] == 40 and counts["calls"] == 2
    # the same seed chooses the same sequences
    with _writer(tmp_path / "again", max_tokens_per_step=cap, seed=7) as w:
        w.write(0, lp[:20], lq[:20], mask=mask[:20])
        w.write(0, lp[20:], lq[20:], mask=mask[20:])
    assert _read(tmp_path / "again").equals(got)


def test_token_cap_sequence_rules_on_the_sample_match_a_direct_log(tmp_path):
    rng = np.random.default_rng(6)
    lp, lq, mask = _padded(rng, 30, 10, "left")
    adv = rng.normal(size=30)
    with _writer(tmp_path / "cap", max_tokens_per_step=60) as w:
        w.write(0, lp, lq, mask=mask, advantages=adv)
    kept = sorted(_read(tmp_path / "cap")["sample_id"].unique().to_list())
    ref = _grid_frame(0, lp, lq, mask, adv).filter(pl.col("sample_id").is_in(kept))
    ref.write_parquet(tmp_path / "ref.parquet")
    a = engine.sweep([tmp_path / "cap"], rules=RULES)
    b = engine.sweep([tmp_path / "ref.parquet"], rules=RULES)
    assert_tables_equal(a.table, b.table, rel=0.0)


def test_choose_rows_is_a_random_prefix_that_fits():
    rng = np.random.default_rng(0)
    counts = np.array([5, 1, 1, 9, 2, 3])
    assert inputs.choose_rows(counts, 21, rng) is None
    keep = inputs.choose_rows(counts, 6, rng)
    assert counts[keep].sum() <= 6 and np.all(np.diff(keep) > 0)
    assert inputs.choose_rows(np.array([7, 8]), 5, rng).size == 0  # longer than the cap


# ----------------------------------------------------------------------------- metadata


def test_metadata_is_in_the_parquet_key_value_metadata(tmp_path):
    meta = {"trainer_logprob": "proximal", "temperature": 0.7, "top_p": 0.95}
    meta |= {"framework": "areal", "framework_version": "1.2.3", "run": "exp1"}
    with _writer(tmp_path, meta=meta) as w:
        w.write(5, np.full((1, 2), -0.1), np.full((1, 2), -0.2))
    kv = pq.read_metadata(rank_file(tmp_path, 5, 0)).metadata
    got = json.loads(kv[META_KEY.encode()])
    assert {k: got[k] for k in meta} == meta
    assert got["step"] == 5 and got["rank"] == 0 and got["world_size"] == 1
    assert read_meta(rank_file(tmp_path, 5, 0))["step_counts"]["tokens_written"] == 2
    # the framework's version is looked up when not given (None when not installed)
    with _writer(tmp_path / "v", meta={"framework": "polars"}) as w:
        assert w.meta["framework_version"] == pl.__version__
    with pytest.raises(ValueError, match="current, old, proximal"):
        TokenWriter(tmp_path / "x", meta={"trainer_logprob": "new"})


def test_no_torch_import_at_import_time():
    code = (
        "import sys, numpy as np\n"
        "import mismatch_replay.capture, mismatch_replay.capture.hooks\n"
        "from mismatch_replay.capture import TokenWriter\n"
        "import tempfile\n"
        "with TokenWriter(tempfile.mkdtemp(), fsync=False) as w:\n"
        "    w.write(0, -np.ones((2, 3)), -np.ones((2, 3)))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- commit protocol


def test_step_layout_and_the_open_step_is_invisible_to_readers(tmp_path):
    lp = np.full((2, 2), -0.3)
    w = _writer(tmp_path)
    try:
        w.write(0, lp, lp.copy())
        w.write(1, lp, lp.copy())
        w._queue.join()  # step 1 is in its temp file, not committed
        assert sorted(os.listdir(step_dir(tmp_path, 0))) == [
            "_SUCCESS",
            "_SUCCESS.rank=0",
            "rank=0.parquet",
        ]
        assert os.listdir(step_dir(tmp_path, 1)) == [".rank=0.parquet.tmp"]
        assert _read(tmp_path)["step"].unique().to_list() == [0]
        w.flush()  # commits step 1
        assert _read(tmp_path)["step"].unique().sort().to_list() == [0, 1]
        with pytest.raises(ValueError, match="already committed"):
            w.write(1, lp, lp.copy())
    finally:
        w.close()
    with pytest.raises(ValueError, match="after close"):
        w.write(2, lp, lp.copy())


def test_commit_hands_the_step_over_without_waiting(tmp_path):
    lp = np.full((2, 2), -0.3)
    w = _writer(tmp_path)
    try:
        w.write(4, lp, lp.copy())
        w.commit()
        w._queue.join()
        assert (step_dir(tmp_path, 4) / "_SUCCESS").exists()
        with pytest.raises(ValueError, match="already committed"):
            w.write(4, lp, lp.copy())
        w.write(5, lp, lp.copy())  # the next step is fine
    finally:
        w.close()
    assert _read(tmp_path)["step"].unique().sort().to_list() == [4, 5]


def test_a_step_without_its_marker_is_skipped_with_a_note(tmp_path):
    lp = np.full((2, 2), -0.3)
    with _writer(tmp_path) as w:
        for step in range(3):
            w.write(step, lp, lp.copy())
    (step_dir(tmp_path, 1) / "_SUCCESS").unlink()  # as if a rank had not committed yet
    with pytest.warns(ingest.IngestWarning, match=r"skipped 1 captured step.*step=1"):
        got = _read(tmp_path)
    assert got["step"].unique().sort().to_list() == [0, 2]
    report = ingest.ReadReport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ingest.IngestWarning)
        ingest.read_table([tmp_path], report=report)
        assert any("_SUCCESS" in x for x in report.warnings)
        # the same rule for a glob; --include-unstable reads the step; a file named is read
        glob = ingest.read_table([str(tmp_path / "step=*" / "*.parquet")])
        assert glob["step"].unique().sort().to_list() == [0, 2]
        unstable = ingest.read_table([tmp_path], ingest.ReadOptions(include_unstable=True))
        assert unstable["step"].unique().sort().to_list() == [0, 1, 2]
        assert ingest.read_table([rank_file(tmp_path, 1, 0)]).height == 4
    for step in (0, 2):
        (step_dir(tmp_path, step) / "_SUCCESS").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ingest.IngestWarning)
        with pytest.raises(DataError, match="every captured step is still being written"):
            ingest.read_table([tmp_path])


def test_a_step_is_complete_once_every_rank_has_committed(tmp_path):
    lp = np.full((2, 2), -0.3)
    w0 = _writer(tmp_path, rank=0, world_size=2, run_id="run-a")
    w1 = _writer(tmp_path, rank=1, world_size=2, run_id="run-a")
    w0.write(0, lp, lp.copy())
    w0.flush()
    assert (step_dir(tmp_path, 0) / "_SUCCESS.rank=0").exists()
    assert not (step_dir(tmp_path, 0) / "_SUCCESS").exists()
    with pytest.raises(DataError, match="still being written"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ingest.IngestWarning)
        ingest.read_table([tmp_path])
    w1.write(0, lp, lp.copy())
    w1.close()
    w0.close()
    assert (step_dir(tmp_path, 0) / "_SUCCESS").exists()
    got = _read(tmp_path)
    assert got.height == 8 and got["sample_id"].n_unique() == 4


def test_a_rewritten_step_replaces_the_old_one(tmp_path):
    with _writer(tmp_path) as w:
        w.write(0, np.full((1, 3), -0.3), np.full((1, 3), -0.3))
    with _writer(tmp_path) as w:  # a resumed run writes step 0 again
        w.write(0, np.full((1, 2), -0.1), np.full((1, 2), -0.1))
    got = _read(tmp_path)
    assert got.height == 2 and (got["trainer_logprob"] == -0.1).all()


def test_rank_and_world_size_are_checked(tmp_path):
    with pytest.raises(ValueError, match="world_size"):
        TokenWriter(tmp_path, rank=1)
    with pytest.raises(ValueError, match="every"):
        TokenWriter(tmp_path, every=0)


# ----------------------------------------------------------------------------- the thread


class _NoSpace(pq.ParquetWriter):  # creating the step's file fails
    def __init__(self, *a, **kw):
        raise OSError(28, "No space left on device")


class _DiskFull(pq.ParquetWriter):  # writing a row group fails
    def write_table(self, *a, **kw):
        raise OSError(28, "No space left on device")


def test_strict_an_error_on_the_thread_raises_from_the_next_write(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod.pq, "ParquetWriter", _NoSpace)
    lp = np.full((2, 2), -0.3)
    w = _writer(tmp_path, strict=True)
    w.write(0, lp, lp.copy())
    w._queue.join()
    with pytest.raises(CaptureError, match="No space left") as e:
        w.write(0, lp, lp.copy())
    assert isinstance(e.value.__cause__, OSError)
    with pytest.raises(CaptureError, match="failed earlier"):
        w.write(1, lp, lp.copy())
    w.close()  # already reported: close() does not raise it again
    assert not list(step_dir(tmp_path, 0).iterdir())


def test_strict_an_error_on_the_thread_raises_from_close(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod.pq, "ParquetWriter", _DiskFull)
    w = _writer(tmp_path, strict=True)
    w.write(0, np.full((2, 2), -0.3), np.full((2, 2), -0.3))
    with pytest.raises(CaptureError, match="No space left") as e:
        w.close()  # the row group is written at the commit, which fails
    assert isinstance(e.value.__cause__, OSError)
    assert not list(step_dir(tmp_path, 0).iterdir())  # the temp file is gone, no marker
    with _writer(tmp_path / "flush", strict=True) as w2:
        w2.write(0, np.full((2, 2), -0.3), np.full((2, 2), -0.3))
        with pytest.raises(CaptureError, match="No space left"):
            w2.flush()


class _FailOnStep(pq.ParquetWriter):  # the disk is full while step 1 is written
    def write_table(self, table, *a, **kw):
        if table["step"][0].as_py() == 1:
            raise OSError(28, "No space left on device")
        return super().write_table(table, *a, **kw)


def test_by_default_a_failure_on_the_thread_skips_the_step_and_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod.pq, "ParquetWriter", _FailOnStep)
    lp = np.full((2, 2), -0.3)
    w = _writer(tmp_path)
    w.write(0, lp, lp.copy())
    w.write(1, lp, lp.copy())
    w.write(1, lp, lp.copy())  # a second micro-batch of the failing step
    # the failure happens on the thread; flush() waits for it and warns, without raising
    with pytest.warns(CaptureWarning, match=r"could not write step 1 \(OSError.*No space left"):
        w.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w.write(2, lp, lp.copy())  # the loop goes on: the next step is written
        w.close()
    assert w.failed_steps == [(1, "OSError: [Errno 28] No space left on device")]
    assert not (step_dir(tmp_path, 1) / "_SUCCESS").exists()
    assert not [p.name for p in step_dir(tmp_path, 1).iterdir()]  # no temp file, no marker
    got = _read(tmp_path)
    assert got["step"].unique().sort().to_list() == [0, 2] and got.height == 8


def test_a_failure_warns_on_close_when_no_call_follows(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod.pq, "ParquetWriter", _DiskFull)
    w = _writer(tmp_path)
    w.write(0, np.full((2, 2), -0.3), np.full((2, 2), -0.3))
    with pytest.warns(CaptureWarning, match="could not write step 0"):
        w.close()
    assert not list(step_dir(tmp_path, 0).iterdir())


def test_many_failed_steps_are_warned_five_times_then_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_mod.pq, "ParquetWriter", _NoSpace)
    lp = np.full((2, 2), -0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _writer(tmp_path) as w:
            for step in range(12):
                w.write(step, lp, lp.copy())
                w.flush()
    said = [str(c.message) for c in caught if issubclass(c.category, CaptureWarning)]
    assert len(w.failed_steps) == 12
    assert len(said) == writer_mod.WARN_EACH + 1 and "skipped 12 step(s) in all" in said[-1]


def test_a_full_queue_makes_write_wait(tmp_path, monkeypatch):
    release = threading.Event()
    table = TokenWriter._table

    def slow_table(self, p):
        release.wait(10)
        return table(self, p)

    monkeypatch.setattr(TokenWriter, "_table", slow_table)
    lp = np.full((2, 2), -0.3)
    w = _writer(tmp_path, max_pending=1)
    w.write(0, lp, lp.copy())  # taken by the thread, which now waits
    time.sleep(0.05)
    w.write(0, lp, lp.copy())  # waits in the queue
    third = threading.Thread(target=w.write, args=(0, lp, lp.copy()))
    third.start()
    time.sleep(0.2)
    assert third.is_alive()  # back-pressure: the queue is full
    release.set()
    third.join(10)
    w.close()
    assert _read(tmp_path).height == 12


# ----------------------------------------------------------------------------- crashes, close


def _micro_batches(w, step, n, rows=64):
    """n micro-batches of `rows` x 2 tokens of one step."""
    for _ in range(n):
        w.write(step, np.full((rows, 2), -0.2), np.full((rows, 2), -0.3))


def test_an_exception_inside_with_does_not_publish_the_step_in_flight(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), _writer(tmp_path) as w:
        _micro_batches(w, 0, 4)  # a whole step, handed over when step 1 begins
        _micro_batches(w, 1, 2)  # 2 of 4 micro-batches
        raise RuntimeError("boom")
    assert (step_dir(tmp_path, 0) / "_SUCCESS").exists()
    assert os.listdir(step_dir(tmp_path, 1)) == []  # no _SUCCESS, no rank file, no temp
    assert _read(tmp_path).height == 4 * 128
    with pytest.raises(KeyboardInterrupt), _writer(tmp_path / "ctrl-c") as w:
        _micro_batches(w, 0, 2)
        raise KeyboardInterrupt
    assert os.listdir(step_dir(tmp_path / "ctrl-c", 0)) == []
    with _writer(tmp_path / "exit0") as w:  # a clean exit still commits the last step
        _micro_batches(w, 0, 2)
    assert _read(tmp_path / "exit0").height == 2 * 128


def test_close_in_a_finally_after_an_exception_drops_the_step_in_flight(tmp_path):
    w = _writer(tmp_path)
    with pytest.raises(RuntimeError):
        try:
            _micro_batches(w, 0, 2)
            raise RuntimeError("the optimiser step failed")
        finally:
            w.close()  # as the docs' framework snippets do
    assert os.listdir(step_dir(tmp_path, 0)) == []
    w = _writer(tmp_path / "forced")
    with pytest.raises(RuntimeError):
        try:
            _micro_batches(w, 0, 2)
            raise RuntimeError
        finally:
            w.close(commit=True)  # committed on purpose
    assert _read(tmp_path / "forced").height == 2 * 128
    w = _writer(tmp_path / "abort")
    _micro_batches(w, 0, 3)
    w.commit()  # handed over: committed even by abort()
    _micro_batches(w, 1, 1)
    w.abort()
    assert _read(tmp_path / "abort")["step"].unique().to_list() == [0]
    assert os.listdir(step_dir(tmp_path / "abort", 1)) == []


_EXIT_SCRIPT = """
import sys, numpy as np
from mismatch_replay.capture import TokenWriter
w = TokenWriter(sys.argv[1], fsync=False)  # never closed: atexit decides
for step in range(2):
    for _ in range(4 if step == 0 else 2):
        w.write(step, np.full((64, 2), -0.2), np.full((64, 2), -0.3))
if sys.argv[2] == "crash":
    raise RuntimeError("the training loop crashed")
"""


@pytest.mark.slow  # two interpreters: ~1.5 s on two idle cores
def test_without_close_an_uncaught_exception_drops_the_step_a_normal_exit_commits(tmp_path):
    for how in ("crash", "normal"):
        root = tmp_path / how
        out = subprocess.run(
            [sys.executable, "-c", _EXIT_SCRIPT, str(root), how],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == (1 if how == "crash" else 0), out.stderr
        assert (step_dir(root, 0) / "_SUCCESS").exists()
        step1 = sorted(os.listdir(step_dir(root, 1)))
        if how == "crash":
            assert step1 == [], step1  # 128 of 256 tokens: not published
            assert _read(root).height == 4 * 128
        else:
            assert "_SUCCESS" in step1
            assert _read(root).height == 4 * 128 + 2 * 128


def test_a_second_close_after_an_interrupted_one_waits_for_the_thread(tmp_path, monkeypatch):
    release = threading.Event()
    table = TokenWriter._table

    def slow_table(self, p):
        release.wait(10)
        return table(self, p)

    monkeypatch.setattr(TokenWriter, "_table", slow_table)
    w = _writer(tmp_path)
    _micro_batches(w, 0, 1)
    join = w._thread.join
    calls = []

    def interrupted_join(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C while close() waits
        return join(timeout)

    monkeypatch.setattr(w._thread, "join", interrupted_join)
    with pytest.raises(KeyboardInterrupt):
        w.close()
    assert w._thread.is_alive()
    threading.Timer(0.2, release.set).start()
    w.close()  # waits for the thread again
    assert len(calls) == 2 and not w._thread.is_alive()
    assert _read(tmp_path).height == 128
    w.close()  # done: nothing more to do
    with pytest.raises(ValueError, match="after close"):
        _micro_batches(w, 1, 1)


# ----------------------------------------------------------------------------- write() checks


@pytest.mark.parametrize(
    "bad",
    [
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(2, 3, dtype=torch.uint8),
        torch.zeros(2, 3, dtype=torch.int64),
        torch.zeros(2, 3, dtype=torch.int32),
        np.ones((2, 3), dtype=bool),
        np.ones((2, 3), dtype=np.uint8),
        np.zeros((2, 3), dtype=np.int64),
        [[0, -1, 0], [0, 0, -2]],  # ragged Python ints
    ],
    ids=["bool", "uint8", "int64", "int32", "np-bool", "np-uint8", "np-int64", "ragged-ints"],
)
@pytest.mark.parametrize("which", ["trainer", "inference", "old"])
def test_write_refuses_non_float_log_probs(tmp_path, bad, which):
    good = np.full((2, 3), -0.5)
    args = {"trainer": good, "inference": good.copy(), "old": None}
    args[which if which != "old" else "old"] = bad
    with _writer(tmp_path) as w:
        with pytest.raises(TypeError, match=r"must be floating point.*\.float\(\)"):
            w.write(0, args["trainer"], args["inference"], old_logprobs=args["old"])
        w.write(1, good, good.copy())  # the writer is fine afterwards
    assert _read(tmp_path)["step"].unique().to_list() == [1]


def test_write_refuses_bool_or_int_entropy(tmp_path):
    good = np.full((2, 3), -0.5)
    with _writer(tmp_path) as w, pytest.raises(TypeError, match="entropy: entropies must be"):
        w.write(0, good, good.copy(), entropy=np.zeros((2, 3), dtype=bool))


@pytest.mark.parametrize(
    ("step", "error", "match"),
    [
        (1.7, ValueError, "not a whole number"),
        (np.float64(0.5), ValueError, "not a whole number"),
        (2**63, ValueError, r"outside 0 \.\. 2\*\*63-1"),
        (-1, ValueError, r"outside 0 \.\. 2\*\*63-1"),
        (True, TypeError, "a bool"),
        ("3", TypeError, "expected an integer"),
        (float("nan"), ValueError, "not a whole number"),
    ],
)
def test_write_refuses_a_step_that_is_not_an_int64_count(tmp_path, step, error, match):
    lp = np.full((1, 2), -0.5)
    with _writer(tmp_path) as w, pytest.raises(error, match=match):
        w.write(step, lp, lp.copy())


def test_write_takes_integral_steps_of_any_kind(tmp_path):
    lp = np.full((1, 2), -0.5)
    with _writer(tmp_path) as w:
        for step in (np.int64(0), 1.0, torch.tensor(2), np.uint8(3), 2**63 - 1):
            w.write(step, lp, lp.copy())
    steps = _read(tmp_path)["step"].unique().sort().to_list()
    assert steps == [0, 1, 2, 3, 2**63 - 1]


def test_write_refuses_one_tensor_as_both_log_probs(tmp_path):
    t = torch.full((2, 3), -0.5)
    a = np.full((2, 3), -0.5)
    ragged = [[-0.1, -0.2], [-0.3]]
    with _writer(tmp_path) as w:
        for x, y in (
            (t, t),
            (t, t.view(2, 3)),  # one storage under two names
            (t.bfloat16(), None),
            (a, a),
            (a, a[:, :]),
            (ragged, ragged),
            (ragged, list(ragged)),  # the same sequences
        ):
            y = x if y is None else y
            with pytest.raises(ValueError, match=r"the same .*pass a copy \(x\.clone\(\)\)"):
                w.write(0, x, y)
        # equal values in separate memory, or different views of one buffer, are fine
        w.write(0, t, t.clone())
        w.write(1, a[:, :2], a[:, 1:])
        w.write(2, ragged, [list(s) for s in ragged])
    assert _read(tmp_path).height == 6 + 4 + 3


# ----------------------------------------------------------------------------- hooks


def _tokens_of(lp, lq, mask, adv=None, step=0):
    """The expected canonical table of [B, T] tensors (advantage [B] or [B, T])."""
    m = torch.as_tensor(mask) != 0
    rows, cols = (x.numpy() for x in m.nonzero(as_tuple=True))
    out = {
        "trainer_logprob": torch.as_tensor(lp)[m].double().numpy(),
        "inference_logprob": torch.as_tensor(lq)[m].double().numpy(),
        "step": np.full(rows.shape[0], step, dtype=np.int64),
        "sample_id": rows.astype(np.int64),
        "position": cols.astype(np.int64),
    }
    if adv is not None:
        a = torch.as_tensor(adv).double()
        out["advantage"] = (a[m] if a.dim() == 2 else a[torch.as_tensor(rows)]).numpy()
    return pl.DataFrame(out).sort("step", "sample_id", "position")


def _batch(seed=0, rows=4, width=6, side="right"):
    rng = np.random.default_rng(seed)
    lp, lq, mask = _padded(rng, rows, width, side)
    return (
        torch.tensor(np.nan_to_num(lp, nan=0.0)).float(),
        torch.tensor(lq).float(),
        torch.tensor(mask).long(),
        torch.tensor(rng.normal(size=rows)).float(),
    )


@dataclass
class _DataProto:  # verl.protocol.DataProto: .batch (a TensorDict) and .non_tensor_batch
    batch: dict
    non_tensor_batch: dict


def test_verl_hook(tmp_path):
    lp, lq, mask, adv = _batch(0)
    token_adv = adv[:, None] * mask  # verl's advantages are [B, response_length]
    sources = np.array(["gsm8k", "math", "gsm8k", "math"], dtype=object)
    batch = _DataProto(
        {
            "old_log_probs": lp,
            "rollout_log_probs": lq,
            "response_mask": mask,
            "advantages": token_adv,
            "attention_mask": torch.ones(4, 12),
        },
        {"data_source": sources, "uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )
    with _writer(tmp_path) as w:
        assert hooks.verl_batch(w, batch, step=3) == int(mask.sum())
    got = _read(tmp_path)
    assert got.drop("env").equals(_tokens_of(lp, lq, mask, token_adv, step=3))
    assert got["env"].to_list() == [sources[s] for s in got["sample_id"].to_list()]
    with _writer(tmp_path / "bypass") as w:
        bypass = _DataProto(dict(batch.batch, old_log_probs=lq), {})
        with pytest.raises(ValueError, match="bypass_mode"):
            hooks.verl_batch(w, bypass, step=0)
        with pytest.raises(ValueError, match="calculate_log_probs=True"):
            hooks.verl_batch(w, _DataProto({"old_log_probs": lp, "response_mask": mask}, {}), 0)


def test_trl_hook(tmp_path):
    lp, lq, mask, adv = _batch(1)
    tool = torch.ones_like(mask)
    tool[:, 1] = 0  # a tool output token inside the completion
    output = {
        "prompt_ids": torch.zeros(4, 3, dtype=torch.long),
        "completion_mask": mask,
        "old_per_token_logps": lp,
        "sampling_per_token_logps": lq,
        "advantages": adv,  # one per completion
        "tool_mask": tool,
    }
    with _writer(tmp_path) as w:
        hooks.trl_output(w, output, step=2)
    assert _read(tmp_path).equals(_tokens_of(lp, lq, mask * tool, adv, step=2))
    with _writer(tmp_path / "x") as w, pytest.raises(ValueError, match="use_vllm"):
        hooks.trl_output(w, {k: v for k, v in output.items() if "sampling" not in k}, 0)


class _TrainingInputBatch(dict):  # SkyRL's TensorBatch is a dict with .metadata
    metadata: dict


def test_skyrl_hook_leaves_out_the_padding_rows(tmp_path):
    lp, lq, mask, adv = _batch(2, rows=5)
    batch = _TrainingInputBatch(
        action_log_probs=lp,
        rollout_logprobs=lq,
        loss_mask=mask.float(),
        advantages=adv[:, None] * mask,
        response_mask=mask,
    )
    batch.metadata = {"pad_size": 2}
    with _writer(tmp_path) as w:
        hooks.skyrl_batch(w, batch, step=7)
    want = _tokens_of(lp[:3], lq[:3], mask[:3], (adv[:, None] * mask)[:3], step=7)
    assert _read(tmp_path).equals(want)
    batch["action_log_probs"] = None
    with _writer(tmp_path / "x") as w, pytest.raises(ValueError, match="policy forward"):
        hooks.skyrl_batch(w, batch, step=0)


def test_areal_hook(tmp_path):
    lp, lq, mask, adv = _batch(3, side="left")
    data = {
        "input_ids": torch.zeros(4, 6, dtype=torch.long),
        "prox_logp": lp,
        "logprobs": lq * mask,  # AReaL multiplies the shifted log-probs by the loss mask
        "loss_mask": mask.float(),
        "advantages": adv[:, None].expand(4, 6),
        "versions": torch.zeros(4, 6, dtype=torch.int32),
    }
    with _writer(tmp_path) as w:
        hooks.areal_batch(w, data, step=4)
    assert _read(tmp_path).equals(_tokens_of(lp, lq * mask, mask, adv[:, None].expand(4, 6), 4))
    same = dict(data, logprobs=data["prox_logp"])  # use_decoupled_loss=False
    with _writer(tmp_path / "x") as w, pytest.raises(ValueError, match="use_decoupled_loss"):
        hooks.areal_batch(w, same, step=0)


def test_areal_hook_on_the_per_trajectory_list(tmp_path):
    """compute_advantages returns one dict per trajectory, each [group, L], unpadded."""
    trajs, want = [], []
    base = 0
    for i, (g, width) in enumerate([(2, 5), (1, 3), (3, 4)]):
        lp, lq, mask, adv = _batch(10 + i, rows=g, width=width, side="left")
        tok_adv = adv[:, None].expand(g, width)
        trajs.append(
            {"prox_logp": lp, "logprobs": lq * mask, "loss_mask": mask, "advantages": tok_adv}
        )
        part = _tokens_of(lp, lq * mask, mask, tok_adv, step=2)
        want.append(part.with_columns(pl.col("sample_id") + base))
        base += g
    with _writer(tmp_path) as w:
        hooks.areal_batch(w, trajs, step=2)
    assert _read(tmp_path).equals(pl.concat(want).sort("step", "sample_id", "position"))


@dataclass
class _Experience:  # openrlhf.trainer.ppo_utils.experience.Experience (the fields used)
    sequences: torch.Tensor
    action_mask: torch.Tensor
    action_log_probs: torch.Tensor
    rollout_log_probs: torch.Tensor | None
    advantages: torch.Tensor


def test_openrlhf_hook_writes_every_micro_batch_of_the_step(tmp_path):
    parts = [_batch(4 + i) for i in range(2)]
    exps = []
    for lp, lq, mask, adv in parts:
        lq = lq * mask  # agent mode: observation tokens carry 0.0, outside action_mask
        exps.append(_Experience(torch.zeros(4, 9), mask.bool(), lp, lq, adv[:, None] * mask))
    with _writer(tmp_path) as w:
        n = hooks.openrlhf_experiences(w, exps, step=1)
    got = _read(tmp_path)
    assert n == got.height == sum(int(p[2].sum()) for p in parts)
    first = _tokens_of(exps[0].action_log_probs, exps[0].rollout_log_probs, parts[0][2], None, 1)
    assert got.filter(pl.col("sample_id") < 4).drop("advantage").equals(first)
    exps[0].rollout_log_probs = None
    with _writer(tmp_path / "x") as w, pytest.raises(ValueError, match="is_correction_enable"):
        hooks.openrlhf_experiences(w, exps[0], step=0)


def test_slime_hook(tmp_path):
    lp, lq, mask, adv = _batch(6)
    lengths = mask.sum(1).tolist()
    cut = [n for n in lengths]
    data = {
        "log_probs": [lp[i, :n] for i, n in enumerate(cut)],
        "rollout_log_probs": [lq[i, :n] for i, n in enumerate(cut)],
        "loss_masks": [torch.ones(n, dtype=torch.int) for n in cut],
        "advantages": [torch.full((n,), float(adv[i])) for i, n in enumerate(cut)],
        "partition": [11, 3, 7, 20],
    }
    with _writer(tmp_path) as w:
        hooks.slime_rollout_data(w, data, step=9)
    got = _read(tmp_path)
    want = _tokens_of(lp, lq, mask, adv, step=9)
    ids = {0: 11, 1: 3, 2: 7, 3: 20}
    want = want.with_columns(pl.col("sample_id").replace_strict(ids)).sort(
        "step", "sample_id", "position"
    )
    assert got.equals(want)
    cp = dict(data, log_probs=[x[: max(len(x) - 1, 0)] for x in data["log_probs"]])
    with _writer(tmp_path / "x") as w, pytest.raises(ValueError, match="context-parallel"):
        hooks.slime_rollout_data(w, cp, step=0)
