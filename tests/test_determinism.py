"""The fused kernel's float sums do not depend on which thread took which chunk.

A batch is cut into chunks at fixed bounds and the chunks are taken by whichever thread is
free, so their order of arrival differs from run to run. runner.Fused adds each chunk's
bins, metric sums and q-bucket sums into its own rows and adds those up in chunk order
(its "ordered" mode: a chunk's bins cover the groups it holds, within ORDERED_BUDGET).
These tests take every chunk in one thread, in a given order (the executor and the chunk
counter replaced), and compare the bits: the same in every order where ordered; and, with
the ordered mode switched off, the order shows (the check can fail). Chunks of a few
dozen tokens holding several groups each count as the numpy path does.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future

import numpy as np
import polars as pl
import pytest

from mismatch_replay import engine, fast
from mismatch_replay.fast import runner

pytestmark = pytest.mark.skipif(fast.backend() != "numba", reason="the fused kernel's sums")


def _log(path, n_seq=600, length=256, seed=3, envs=False, per_step=100):
    rng = np.random.default_rng(seed)
    n = n_seq * length
    lq = -rng.exponential(0.6, n)
    rare = rng.random(n) < 0.1
    lq[rare] -= rng.uniform(3.0, 12.0, int(rare.sum()))
    lp = lq + rng.normal(0, 0.05, n)
    pl.DataFrame(
        {
            "step": np.repeat(np.arange(n_seq) // per_step, length),
            "sample_id": np.repeat(np.arange(n_seq), length),
            "position": np.tile(np.arange(length), n_seq),
            "trainer_logprob": np.minimum(lp, 0.0),
            "inference_logprob": lq,
            "advantage": np.repeat(rng.normal(size=n_seq), length),
            **({"env": np.repeat(rng.choice(["code", "math"], n_seq), length)} if envs else {}),
        }
    ).write_parquet(path)
    return path


class _Later:
    """An executor whose tasks never run: the calling thread takes every chunk."""

    def submit(self, fn, *a):
        f = Future()
        f.set_result(0)
        return f


def _in_order(monkeypatch, order):
    """Chunks taken in `order` (a function of the chunk count) by the calling thread."""
    monkeypatch.setattr(runner, "executor", lambda k: _Later())

    class Counter:
        def count(self, *a):
            # the chunk loop stops at the first index >= the chunk count: feed a permutation
            # of the 8 chunks a 2-thread batch has, then the end
            return iter([*order(8), 1 << 30])

        def __getattr__(self, name):
            return getattr(itertools, name)

    monkeypatch.setattr(runner, "itertools", Counter())


def _sums(path, **kw) -> tuple[pl.DataFrame, dict]:
    t = engine.replay([path], final=True, **kw)
    res = t.result()
    return res.table.sort(["rule", "setting", "param", "value"]), res.metrics.to_dicts()


def _floats_equal(a: pl.DataFrame, b: pl.DataFrame) -> bool:
    for c in a.columns:
        if a[c].dtype.is_float():
            x, y = a[c].to_numpy(), b[c].to_numpy()
            if not np.array_equal(x, y, equal_nan=True):
                return False
        elif not a[c].equals(b[c]):
            return False
    return True


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    return _log(tmp_path_factory.mktemp("det") / "log.parquet")


@pytest.fixture(scope="module")
def log_env(tmp_path_factory):
    return _log(tmp_path_factory.mktemp("det") / "log_env.parquet", envs=True)


def _orders():
    return {
        "natural": lambda n: list(range(n)),
        "reversed": lambda n: list(range(n))[::-1],
        "interleaved": lambda n: [*range(0, n, 2), *range(1, n, 2)],
    }


def _in_each_order(monkeypatch, replay) -> dict:
    """replay() with the chunks taken in each of `_orders()`, on 2 threads: name -> result."""
    got = {}
    for name, order in _orders().items():
        with monkeypatch.context() as m:
            _in_order(m, order)
            m.setattr(fast, "Fused", _two_threads(runner.Fused))
            got[name] = replay()
    return got


def test_ordered_sums_do_not_depend_on_the_chunks_order(log, monkeypatch):
    got = _in_each_order(monkeypatch, lambda: _sums(log))
    table, metrics = got["natural"]
    assert (table["masked_mass"] > 0).sum() > 1000  # sums that could differ
    for name, (t, mtr) in got.items():
        assert _floats_equal(t, table), name
        assert mtr == metrics, name


def test_without_the_ordered_mode_the_order_shows(log, monkeypatch):
    """The same replays adding per thread (ORDERED_BUDGET 0): another chunk order gives
    other float sums, so the test above can fail."""
    monkeypatch.setattr(runner, "ORDERED_BUDGET", 0)
    got = _in_each_order(monkeypatch, lambda: _sums(log))
    table, _ = got["natural"]
    assert not _floats_equal(got["reversed"][0], table)
    for name, (t, _) in got.items():  # counts never depend on it
        for c in ("tokens", "masked_tokens", "masked_sequences", "fully_masked_groups"):
            assert t[c].equals(table[c]), (name, c)


@pytest.mark.parametrize("by", ["step", "env"])
def test_grouped_sums_do_not_depend_on_the_chunks_order(log_env, monkeypatch, by):
    """By step (each chunk holds one or two steps) and by env (every chunk holds both): each
    chunk's bins cover only its own groups, added in chunk order."""

    def replay():
        t = engine.replay([log_env], by=by, final=True)
        assert t._fused.ordered
        return t.result().table.sort(["rule", "setting", "param", "value", by])

    got = _in_each_order(monkeypatch, replay)
    for name, table in got.items():
        assert _floats_equal(table, got["natural"]), name


@pytest.mark.parametrize("by", [None, "step", "env"])
@pytest.mark.parametrize("min_chunk", [64, 1000])
def test_small_chunks_count_as_the_numpy_path(tmp_path, monkeypatch, by, min_chunk):
    """Chunks of a few dozen tokens, many groups each (the windows of `_windows`), against
    the numpy path: counts exact, sums to rounding, metrics per group too."""
    path = _log(tmp_path / "small.parquet", n_seq=60, length=40, seed=11, envs=True, per_step=7)
    monkeypatch.setattr(runner.Fused, "MIN_CHUNK", min_chunk)
    monkeypatch.setattr(fast, "Fused", _two_threads(runner.Fused))
    spans = []
    real = runner.Fused._windows

    def windows(self, g, bounds, groups):
        got = real(self, g, bounds, groups)
        spans.append(None if got is None else got[1])
        return got

    monkeypatch.setattr(runner.Fused, "_windows", windows)
    keys = ["rule", "setting", "param", "value", *([by] if by else [])]
    with fast.use_backend("numba"):
        fused = engine.sweep([path], by=by)
    with fast.use_backend("numpy"):
        simple = engine.sweep([path], by=by)
    assert spans and None not in spans  # chunked, ordered
    if by is not None:
        assert max(spans) > 1  # chunks holding several groups
    a, b = fused.table.sort(keys), simple.table.sort(keys)
    for c in a.columns:
        if a[c].dtype.is_float():
            np.testing.assert_allclose(a[c].to_numpy(), b[c].to_numpy(), rtol=1e-9, atol=1e-12)
        else:
            assert a[c].equals(b[c]), c
    ma, mb = fused.metrics.sort(by or []) if by else fused.metrics, simple.metrics
    if by:
        mb = mb.sort(by)
    for c in ma.columns:
        if ma[c].dtype.is_float() and not c.endswith(("_std", "pearson")):
            np.testing.assert_allclose(ma[c].to_numpy(), mb[c].to_numpy(), rtol=1e-9, atol=1e-12)


def test_a_grouped_replay_past_the_budget_keeps_per_thread_copies(log, monkeypatch):
    """Past ORDERED_BUDGET the runner switches to per-thread copies, the sums so far kept
    (the same totals as an ordered replay, to rounding)."""
    ordered = engine.replay([log], by="step", final=True).result().table
    monkeypatch.setattr(runner, "ORDERED_BUDGET", 1)
    t = engine.replay([log], by="step", final=True)
    assert not t._fused.ordered
    per_thread = t.result().table
    a = ordered.sort(["step", "rule", "setting", "param", "value"])
    b = per_thread.sort(["step", "rule", "setting", "param", "value"])
    for c in a.columns:
        if a[c].dtype.is_float():
            np.testing.assert_allclose(b[c].to_numpy(), a[c].to_numpy(), rtol=1e-12, atol=0)
        else:
            assert a[c].equals(b[c]), c


def _two_threads(cls):
    """Fused with 2 threads whatever the machine has (8 chunks a batch)."""

    def make(program, seqfrac, nthreads=None):
        return cls(program, seqfrac, nthreads=2)

    return make
