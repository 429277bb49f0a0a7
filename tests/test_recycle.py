"""The Recycler hands an array out again only when nothing refers to it any more."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from conftest import assert_tables_equal, random_log

from mismatch_replay import engine, io
from mismatch_replay._recycle import Recycler


def _owner(a: np.ndarray) -> np.ndarray:
    return a if a.base is None else a.base


def test_an_array_in_use_is_never_handed_out_again():
    r = Recycler()
    a = r.empty("x", 1000)
    a[:] = 1.0
    b = r.empty("x", 1000)  # `a` is alive: a second array
    assert not np.shares_memory(a, b)
    kept = a[10:20]  # a view of a view: keeps the owner alive
    del a
    c = r.empty("x", 1000)
    assert not np.shares_memory(c, kept) and not np.shares_memory(c, b)
    assert r.reused == 0
    del kept, c
    d = r.empty("x", 500)  # every earlier array idle now: one of them again
    assert r.reused == 1
    assert d.shape == (500,) and d.flags.c_contiguous


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_idle_array_is_reused_and_zeros_are_zero():
    r = Recycler()
    a = r.zeros("h", (3, 4), np.int64)
    where = _addr(a)
    a[:] = 7
    del a
    b = r.zeros("h", (2, 5), np.int64)
    assert _addr(b) == where and r.reused == 1  # the same memory, zeroed again
    assert b.shape == (2, 5) and b.dtype == np.int64 and not b.any()
    held = _owner(b)  # a reference to the owner itself also counts as use
    del b
    c = r.zeros("h", (2, 2), np.int64)
    assert _addr(c) != where and r.reused == 1
    del held, c
    d = r.zeros("h", (20, 20), np.int64)  # larger than any idle array: a new one
    assert _addr(d) != where and d.shape == (20, 20) and not d.any()
    e = r.empty("h", 4, np.float64)  # another dtype: never the int64 arrays
    assert e.dtype == np.float64 and _addr(e) != where


def test_names_are_separate_and_keep_bounds_the_pool():
    r = Recycler(keep=2)
    live = [r.empty("a", 10) for _ in range(5)]  # more live arrays than kept: all distinct
    for i, x in enumerate(live):
        x[:] = i
    assert [float(x[0]) for x in live] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert len(r._pools["a"]) == 2
    other = r.empty("b", 10)
    assert not any(np.shares_memory(other, x) for x in live)


def test_pickled_recycler_arrives_empty():
    r = Recycler(keep=3)
    x = r.empty("a", 10)
    s = pickle.loads(pickle.dumps(r))
    assert s.keep == 3 and s._pools == {} and s.reused == 0
    del x


@pytest.mark.parametrize("final", [False, True])
def test_replay_reuses_batch_arrays_and_counts_do_not_change(tmp_path, final):
    """m2po's store keeps views of a batch's arrays (l^2, |dp|, sequence ids) across batches:
    the recycled arrays must never overwrite what it still holds. The numpy path, which
    allocates afresh, gives the same table; a mutant recycler that ignores the reference
    count fails this test."""
    import pyarrow.parquet as pq

    from mismatch_replay import kernels

    if kernels.backend() != "numba":
        pytest.skip("the recycler serves the fused path")
    df = random_log(np.random.default_rng(41), steps=5, seqs=6, max_len=40)
    df = df.sort("step", maintain_order=True)
    path = tmp_path / "log.parquet"
    pq.write_table(df.to_arrow(), path, row_group_size=30)
    kw = dict(rules=["m2po", "ipo", "seq-mis"], options=io.ReadOptions(batch_rows=20))
    fast = engine.replay([path], final=final, **kw)
    assert fast._fused is not None and fast._fused.bufs.reused > 0
    if final:  # steps resolved on the way: their sequence ids' arrays come free
        assert fast._bufs.reused > 0
    with kernels.use_backend("numpy"):
        simple = engine.replay([path], final=final, **kw)
    keys = ("rule", "setting", "param", "value")
    assert_tables_equal(simple.result().table, fast.result().table, keys=keys)
