"""engine.Tail keeps its tokens in buffers it grows while the replay runs (Tail._append):
what `arrays()` gives must be every batch's kept rows, concatenated in input order, whatever
the batch sizes, growths and calls in between."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import random_log, write_log
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine
from mismatch_replay.engine import Tail


def _batch(rng, n):
    df = pl.DataFrame({"step": rng.integers(0, 5, n), "position": np.arange(n)})
    lp = -rng.random(n)
    lq = -rng.random(n)
    adv = rng.normal(size=n)
    seq = rng.integers(0, 1000, n)
    return df, lp, lq, adv, seq


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    seed=st.integers(0, 2**32 - 1),
    peek=st.booleans(),
    expected=st.sampled_from([0, 1, 500, 5000]),
)
def test_arrays_are_the_kept_rows_in_input_order(sizes, seed, peek, expected):
    rng = np.random.default_rng(seed)
    # expected: the replay's rows, which size the buffers on the first batch (any hint,
    # too small or too large, must give the same arrays)
    tail = Tail(0.01, extra=("step", "position"), expected=expected)
    want: dict[str, list] = {}
    seen = 0
    views = []
    for n in sizes:
        df, lp, lq, adv, seq = _batch(rng, n)
        idx = np.flatnonzero(rng.random(n) < 0.3)
        bits = rng.integers(0, 8, idx.size).astype(np.uint32)
        tail.add(idx, bits, df, lp, lq, adv, seq)
        if idx.size:
            for k, v in {
                "lp": lp[idx],
                "lq": lq[idx],
                "bits": bits,
                "row": idx + seen,
                "advantage": adv[idx],
                "seq": seq[idx],
                "step": df["step"].to_numpy()[idx],
                "position": df["position"].to_numpy()[idx],
            }.items():
                want.setdefault(k, []).append(v)
        seen += n
        if peek:  # a consumer's view taken mid-way must not change under later batches
            got = tail.arrays()
            views.append(({k: v.copy() for k, v in got.items()}, got))
    got = tail.arrays()
    assert tail.tokens == seen
    assert tail.kept == sum(len(v) for v in want.get("lp", []))
    if not want:
        assert got["lp"].size == 0
        return
    assert set(got) == set(want)
    for k, parts in want.items():
        expect = np.concatenate(parts)
        assert got[k].dtype == expect.dtype, k
        np.testing.assert_array_equal(got[k], expect, err_msg=k)
    for copy, view in views:
        for k in view:
            np.testing.assert_array_equal(view[k], copy[k])


def test_the_buffers_grow_by_doubling_and_stop_at_the_limit():
    rng = np.random.default_rng(0)
    tail = Tail(0.01, limit=2500, extra=())
    caps = []
    for _ in range(30):
        df, lp, lq, adv, seq = _batch(rng, 100)
        tail.add(np.arange(100), np.ones(100, np.uint32), df, lp, lq, adv, seq)
        caps.append(tail._cap)
    assert caps[0] == 400  # four batches' worth first
    assert sorted(set(caps)) == [400, 800, 1600, 3200]
    assert tail.off is not None and "2,500" in tail.off  # past the limit: nothing kept
    assert tail.kept == 2500 and tail.parts == []


def test_the_first_batch_sizes_the_buffers_for_the_expected_rows():
    """A replay's plan gives its rows (`expected`): the first batch's share of kept tokens,
    a quarter to spare, sizes the buffers once, so a steady share never grows them (each
    growth copied every buffer into fresh pages: 0.18 s of a 20M report)."""
    rng = np.random.default_rng(1)
    tail = Tail(0.01, extra=(), expected=100 * 1000)
    caps = set()
    for _ in range(100):
        df, lp, lq, adv, seq = _batch(rng, 1000)
        idx = np.sort(rng.choice(1000, 50, replace=False))
        tail.add(idx, np.ones(50, np.uint32), df, lp, lq, adv, seq)
        caps.add(tail._cap)
    assert caps == {int(1.25 * 50 * 100) + 50}  # one capacity, the first batch's estimate
    assert tail.kept == 5000
    more = Tail(0.01, extra=(), expected=10**12, limit=7000)  # never beyond the limit
    df, lp, lq, adv, seq = _batch(rng, 1000)
    more.add(np.arange(50), np.ones(50, np.uint32), df, lp, lq, adv, seq)
    assert more._cap == 7000


def test_a_replay_tells_its_tail_the_rows_it_will_read(tmp_path):
    df = random_log(np.random.default_rng(3), steps=3, seqs=8, max_len=40)
    path = write_log(tmp_path / "log.parquet", df)
    tail = Tail(0.05)
    engine.replay([path], tail=tail, final=True)
    assert tail.expected == df.height  # the plan's rows, before the loss mask
    assert 0 < tail.kept <= tail._cap


def _two_threads(cls):
    def make(program, seqfrac, nthreads=None):
        return cls(program, seqfrac, nthreads=2)

    return make


@pytest.mark.slow  # hypothesis examples through the numba kernel
@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    min_chunk=st.sampled_from([16, 200, 1 << 15]),
    float32=st.booleans(),
    columns=st.sampled_from(["all", "no advantage", "no sample_id"]),
)
def test_the_kernels_kept_columns_are_the_batch_gathered(
    tmp_path_factory, seed, min_chunk, float32, columns
):
    """The fused kernel writes each kept token's lp, lq, advantage and sequence out while
    it has them (jit.coord_pass's tk_*, runner._kept), chunk after chunk in input order: the
    tail must hold the same bytes as when every column is gathered from the batch at the
    kept indices (the way it was kept before), on two threads with chunks of a few tokens
    to one, float32 log-prob columns (gathered as they are) and logs without advantage or
    sample ids."""
    with pytest.MonkeyPatch.context() as mp:
        _check_kept_columns(mp, tmp_path_factory, seed, min_chunk, float32, columns)


def _check_kept_columns(mp, tmp_path_factory, seed, min_chunk, float32, columns):
    from mismatch_replay import fast
    from mismatch_replay.engine import tally
    from mismatch_replay.fast import runner

    df = random_log(np.random.default_rng(seed), steps=3, seqs=40, max_len=60, mismatch=0.2)
    if float32:
        df = df.with_columns(pl.col("trainer_logprob", "inference_logprob").cast(pl.Float32))
    if columns == "no advantage":
        df = df.drop("advantage")
    elif columns == "no sample_id":
        df = df.drop("sample_id")
    path = write_log(tmp_path_factory.mktemp("k") / "log.parquet", df)
    mp.setattr(runner.Fused, "MIN_CHUNK", min_chunk)
    mp.setattr(fast, "Fused", _two_threads(runner.Fused))
    jobs, _ = engine.plan_jobs(None, None, list(df.columns))

    def kept(gather_all: bool) -> dict[str, np.ndarray]:
        real = tally.Tally._keep_tail

        def keep(self, k, d, lp, lq, adv, seq):
            if gather_all and k is not None:  # the kernel's indices and bits, columns ignored
                self.tail.add(k[0], k[1], d, lp, lq, adv, seq[0] if seq is not None else None)
                return
            real(self, k, d, lp, lq, adv, seq)

        mp.setattr(tally.Tally, "_keep_tail", keep)
        tail = Tail(0.05)
        with fast.use_backend("numba"):
            engine.replay([path], jobs=jobs, tail=tail, final=True)
        mp.setattr(tally.Tally, "_keep_tail", real)
        return tail.arrays()

    got, want = kept(False), kept(True)
    assert got["lp"].size > 0
    assert (np.diff(got["row"]) > 0).all()  # input order, every chunk's after the one before
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert got[k].tobytes() == want[k].tobytes(), k
