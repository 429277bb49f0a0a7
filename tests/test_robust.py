"""engine.robust: the compiled --robust accumulation is the reference's, bit for bit.

`add_robust` (numba) against `add_robust_numpy` (the reference: the Tally's former numpy code)
on random batches: groups sorted and not, ties in k3, k3 = 0, l beyond the clamp, NaN and
infinite log-probs, several batches into one state with groups appearing late, with and
without the step / sample_id / position columns, float32 batches, cached p / q / l.
Counts, sums (the same order of addition: compared bit for bit) and the top tokens (values,
dtypes, tie order, the dict's order) are all compared exactly. The binning is checked on
every bin edge's neighbourhood against bins.k3_bin.
"""

from __future__ import annotations

import contextlib
import math
import os
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mismatch_replay import fast, pmath
from mismatch_replay.engine import robust
from mismatch_replay.engine.bins import K3_BINS, TOP_TOKENS, k3_bin
from mismatch_replay.rules import LOG_CLAMP, TokenBatch

needs_numba = pytest.mark.skipif(fast.backend() != "numba", reason="numba is not installed")


def _state():
    return SimpleNamespace(k3_hist=None, k3_hist_sum=None, top={})


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same(a, b) -> None:
    """Two states bit for bit: histograms, sums, top tokens (order, dtypes)."""
    assert a.k3_hist.shape == b.k3_hist.shape and a.k3_hist.dtype == b.k3_hist.dtype
    assert np.array_equal(a.k3_hist, b.k3_hist)
    assert a.k3_hist_sum.dtype == b.k3_hist_sum.dtype
    assert np.array_equal(_bits(a.k3_hist_sum), _bits(b.k3_hist_sum))
    assert list(a.top) == list(b.top)
    for gi in a.top:
        ta, tb = a.top[gi], b.top[gi]
        assert list(ta) == list(tb), gi
        for c in ta:
            assert ta[c].dtype == tb[c].dtype, (gi, c)
            assert np.array_equal(_bits(ta[c]), _bits(tb[c])), (gi, c, ta[c], tb[c])


def assert_scratch_zero() -> None:
    """Every count and sum array kept for later batches is all zero."""
    for cs in robust._kept_scratch():
        assert not cs.any()


# ----------------------------------------------------------------------------- batches

# log ratios that repeat (ties in k3: l and -l do not tie, l and l do), k3 = 0 (l = 0 or
# tiny), at and beyond the clamp, and k3 near bin edges (l small: k3 ~ l^2 / 2)
L_POOL = [0.0, -0.0, 1e-200, -1e-12, 1e-9, 0.01, -0.01, 0.5, -0.5, 1.0, 3.0, -3.0]
L_POOL += [19.999, 20.0, 20.5, -20.0, -21.0, 45.0, -700.0, math.inf, -math.inf]
LQ_POOL = [0.0, -1e-12, -0.1, -2.0, -30.0]

ls = st.one_of(st.sampled_from(L_POOL), st.floats(-30.0, 30.0), st.floats(-1e-4, 1e-4))
lqs = st.one_of(st.sampled_from(LQ_POOL), st.floats(-40.0, 0.0))


@st.composite
def batches(draw, nan: bool = False):
    """A list of (lp, lq, g, G) batches of one replay: G never shrinks, groups new in a
    later batch get the next codes."""
    out = []
    G = draw(st.integers(1, 4))
    for _ in range(draw(st.integers(1, 4))):
        G += draw(st.integers(0, 3))
        n = draw(st.integers(1, 120))
        lval = ls | st.just(math.nan) if nan else ls
        lr = np.array(draw(st.lists(lval, min_size=n, max_size=n)))
        lq = np.array(draw(st.lists(lqs, min_size=n, max_size=n)))
        mode = draw(st.sampled_from(["random", "sorted", "one", "late"]))
        if mode == "one":
            g = np.full(n, draw(st.integers(0, G - 1)), dtype=np.int64)
        else:
            g = np.array(draw(st.lists(st.integers(0, G - 1), min_size=n, max_size=n)))
            if mode == "sorted":
                g = np.sort(g)
            elif mode == "late":  # only the newest groups
                g = np.maximum(g, G - 2)
        with np.errstate(invalid="ignore"):
            lp = lq + lr
        if draw(st.booleans()):  # make k3 ties certain: repeat a prefix
            k = n // 2
            lp[k : 2 * k], lq[k : 2 * k] = lp[:k], lq[:k]
        out.append((lp, lq, g.astype(np.int64), G, draw(st.integers(0, 2**32))))
    return out


def _frame(n: int, cols, seed: int) -> pl.DataFrame:
    """The batch's other columns (a seed of its own: the same frame whichever run)."""
    rng = np.random.default_rng(seed)
    data = {"step": rng.integers(0, 50, n), "sample_id": rng.integers(0, 9, n)}
    data["position"] = np.arange(n, dtype=np.int32)  # another dtype: kept as the column's
    data["trainer_logprob"] = np.zeros(n)
    return pl.DataFrame({c: data[c] for c in (*cols, "trainer_logprob")})


cols_st = st.sampled_from([(), ("step",), ("step", "sample_id", "position"), ("position",)])


def _run(fn, bs, cols, precision="float64", state=None):
    state = state or _state()
    for lp, lq, g, G, seed in bs:
        fn(state, _frame(len(lp), cols, seed), TokenBatch(lp, lq, None, precision), g, G)
    return state


# ----------------------------------------------------------------------------- properties


@pytest.mark.slow  # hypothesis examples through the numba kernel
@needs_numba
@given(batches(), cols_st)
def test_add_robust_is_the_reference_bit_for_bit(bs, cols):
    with np.errstate(all="ignore"):
        ref = _run(robust.add_robust_numpy, bs, cols)
    assert_same(_run(robust.add_robust, bs, cols), ref)


@pytest.mark.slow  # hypothesis examples through the numba kernel
@needs_numba
@given(batches(nan=True), cols_st)
def test_nan_log_ratios_too(bs, cols):
    """NaN k3 (a NaN or inf - inf log-prob): bin 0, sums NaN, below every number in top."""
    with np.errstate(all="ignore"):
        ref = _run(robust.add_robust_numpy, bs, cols)
    assert_same(_run(robust.add_robust, bs, cols), ref)


@pytest.mark.slow  # hypothesis examples through the numba kernel
@needs_numba
@given(batches(), cols_st)
def test_float32_batches(bs, cols):
    with np.errstate(all="ignore"):
        ref = _run(robust.add_robust_numpy, bs, cols, precision="float32")
        got = _run(robust.add_robust, bs, cols, precision="float32")
    assert_same(got, ref)


@pytest.mark.slow  # hypothesis examples through the numba kernel
@needs_numba
@given(batches(), st.booleans(), st.booleans())
def test_batches_with_cached_arrays(bs, want_l, want_p):
    """A TokenBatch that has l, p, q already (the simple path's): used as they are."""

    def warm(fn):
        def call(state, df, tb, g, G):
            if want_l:
                _ = tb.l
            if want_p:
                _ = tb.p, tb.q
            fn(state, df, tb, g, G)

        return call

    with np.errstate(all="ignore"):
        ref = _run(warm(robust.add_robust_numpy), bs, ("step",))
    assert_same(_run(warm(robust.add_robust), bs, ("step",)), ref)


@pytest.mark.slow  # hypothesis examples through the numba kernel
@needs_numba
@given(batches(), batches())
def test_into_a_state_from_the_other_path(first, then):
    """The two paths can take turns on one state (a state the reference began)."""
    G0 = first[-1][3]
    then = [(lp, lq, g, max(G, G0), seed) for lp, lq, g, G, seed in then]
    with np.errstate(all="ignore"):
        ref = _run(robust.add_robust_numpy, first + then, ("step",))
        got = _run(robust.add_robust_numpy, first, ("step",))
        got = _run(robust.add_robust, then, ("step",), state=got)
    assert_same(got, ref)


def test_a_robust_replay_is_the_reference():
    """A Tally's robust replay (add_robust, wired in engine/tally.py) holds exactly what
    the reference accumulates batch by batch."""
    from mismatch_replay import engine

    rng = np.random.default_rng(5)
    n = 6000
    lq = np.log(rng.uniform(1e-6, 1.0, n))
    df = pl.DataFrame(
        {
            "step": np.repeat(np.arange(6), n // 6),
            "sample_id": np.tile(np.repeat(np.arange(10), n // 60), 6),
            "position": np.tile(np.arange(n // 60), 60),
            "trainer_logprob": lq + rng.normal(0, 0.4, n),
            "inference_logprob": lq,
        }
    )
    tally = engine.Tally([], "step")
    tally.robust = True
    tally.add_batch(df)
    ref = _state()
    g = df["step"].to_numpy()
    tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy())
    robust.add_robust_numpy(ref, df, tb, g, 6)
    assert_same(tally, ref)


# ----------------------------------------------------------------------------- pieces


@needs_numba
def test_bins_at_every_edge_are_k3_bins():
    """Around each bin edge (the windows where the kernel asks k3_bin and just outside
    them, where it decides alone), far from the edges, and at the special values."""
    e = robust.EDGES[2 : K3_BINS + 1]
    rel = np.r_[np.linspace(-4e-11, 4e-11, 161), [-1e-15, -2e-16, 0.0, 2e-16, 1e-15]]
    k3 = (e[:, None] * (1.0 + rel[None, :])).ravel()
    ulps = np.arange(-40, 41, dtype=np.int64)
    near = (e.view(np.int64)[:, None] + ulps[None, :]).ravel().view(np.float64)
    rng = np.random.default_rng(3)
    wide = 10.0 ** rng.uniform(-25.0, 10.0, 300_000)
    special = np.array([0.0, -0.0, -1e-300, 5e-324, 1e-310, 1e-20, 1e4, 1e300, np.inf, np.nan])
    for x in (k3, near, wide, special):
        assert np.array_equal(robust.k3_bins(x), k3_bin(x))


def _l_at(k3: float) -> float:
    """An l > 0 whose k3 is k3 (bisection on pmath's)."""
    lo, hi = 0.0, LOG_CLAMP
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if pmath.expm1(mid) - mid < k3:
            lo = mid
        else:
            hi = mid
    return hi


@needs_numba
def test_tokens_on_bin_edges():
    """Tokens whose k3 lies within a window of an edge (k3_bin decides them in add_robust)
    next to tokens outside: the reference's bins, counts and sums."""
    edges = robust.EDGES[[800, 1500, 1990, 2000, 2001, 2100, 2300]]
    base = np.array([_l_at(e) for e in edges])
    lr = (base.view(np.int64)[:, None] + np.arange(-30, 31)[None, :]).ravel().view(np.float64)
    lr = np.r_[lr, -lr, base * (1 + 1e-9), base * (1 - 1e-9)]
    c = np.clip(lr, -LOG_CLAMP, LOG_CLAMP)
    k3 = pmath.expm1(c) - c
    b = np.empty(k3.shape[0], dtype=np.int64)
    flagged = robust.kernels().binning(
        k3, robust.EDGES, robust.LO_SAFE, robust.HI_SAFE, robust.CAND, robust.CAND0, b
    )
    assert 0 < flagged < k3.shape[0]
    rng = np.random.default_rng(4)
    g = rng.integers(0, 3, lr.shape[0])
    bs = [(lr, np.zeros_like(lr), g, 3, 1), (lr[::-1].copy(), np.zeros_like(lr), g, 3, 2)]
    ref = _run(robust.add_robust_numpy, bs, ("position",))
    assert_same(_run(robust.add_robust, bs, ("position",)), ref)


@needs_numba
def test_k3_is_pmath_bit_for_bit():
    rng = np.random.default_rng(9)
    x = np.r_[rng.normal(0, 1, 100_000), rng.normal(0, 1e-6, 10_000), rng.uniform(-40, 40, 10_000)]
    x = np.r_[x, L_POOL, math.nan, -math.nan]
    c = np.clip(x, -LOG_CLAMP, LOG_CLAMP)
    ref = pmath.expm1(c) - c
    out = np.empty_like(x)
    robust.kernels().values(x, x, True, LOG_CLAMP, out)
    assert np.array_equal(_bits(out), _bits(ref))


@needs_numba
def test_ties_keep_the_earliest_tokens():
    """Equal k3: the earlier batch, then the earlier token, as the stable sorts keep."""
    n = 3 * TOP_TOKENS
    lp = np.full(n, 0.5)
    lq = np.zeros(n)
    g = np.zeros(n, dtype=np.int64)
    for fn in (robust.add_robust, robust.add_robust_numpy):
        s = _state()
        for b in range(2):
            df = pl.DataFrame({"position": np.arange(n) + 100 * b})
            fn(s, df, TokenBatch(lp, lq), g, 1)
        assert s.top[0]["position"].tolist() == list(range(TOP_TOKENS))


@needs_numba
def test_a_real_sized_batch(tmp_path):
    rng = np.random.default_rng(11)
    n = 300_000
    lq = np.log(rng.uniform(1e-8, 1.0, n))
    lp = lq + rng.standard_t(2, n) * 0.05
    g = rng.integers(0, 40, n)
    df = pl.DataFrame({"step": g, "sample_id": rng.integers(0, 1000, n), "position": np.arange(n)})
    zeros = np.zeros(n, dtype=np.int64)
    zeros.flags.writeable = False  # the Tally's read-only zeros (no --by)
    for gg, G in ((g, 40), (zeros, 1)):
        a, b = _state(), _state()
        lpr, lqr = pl.Series(lp).to_numpy(), pl.Series(lq).to_numpy()  # read-only views
        robust.add_robust(a, df, TokenBatch(lpr, lqr), gg, G)
        robust.add_robust_numpy(b, df, TokenBatch(lp, lq), gg, G)
        assert_same(a, b)


@needs_numba
def test_many_groups(monkeypatch):
    """Past KEEP_CELLS the count and sum arrays are fresh each batch: the same results,
    and the kept scratch stays all zero between batches either way."""
    rng = np.random.default_rng(8)
    bs = []
    for G in (50, 700, 700):
        lq = np.log(rng.uniform(1e-6, 1.0, 20_000))
        bs.append((lq + rng.normal(0, 0.3, 20_000), lq, rng.integers(0, G, 20_000), G, G))
    ref = _run(robust.add_robust_numpy, bs, ("step",))
    assert_same(_run(robust.add_robust, bs, ("step",)), ref)
    monkeypatch.setattr(robust, "KEEP_CELLS", 1 << 30)
    assert_same(_run(robust.add_robust, bs, ("step",)), ref)
    assert_scratch_zero()


@needs_numba
def test_group_codes_out_of_range_are_refused():
    s = _state()
    with pytest.raises(ValueError, match="outside"):
        robust.add_robust(
            s,
            pl.DataFrame({"x": [0, 0]}),
            TokenBatch(np.zeros(2), -np.ones(2)),
            np.array([0, 2]),
            2,
        )
    assert_scratch_zero()  # the refused batch left the scratch zero


def test_the_numpy_backend_runs_the_reference():
    rng = np.random.default_rng(2)
    lq = np.log(rng.uniform(1e-6, 1.0, 1000))
    bs = [(lq + rng.normal(0, 1, 1000), lq, rng.integers(0, 3, 1000), 3, 0)]
    with fast.use_backend("numpy"):
        assert robust.kernels() is None
        got = _run(robust.add_robust, bs, ("step",))
    assert_same(got, _run(robust.add_robust_numpy, bs, ("step",)))


@needs_numba
def test_an_empty_batch_adds_nothing():
    """(The reference raises IndexError there: its loop over groups reads gs[0].)"""
    s = _state()
    empty = np.zeros(0)
    robust.add_robust(s, pl.DataFrame({"step": []}), TokenBatch(empty, empty), empty.astype(int), 2)
    assert s.k3_hist.shape == (2, K3_BINS + 1) and not s.k3_hist.any() and s.top == {}
    with pytest.raises(IndexError):
        robust.add_robust_numpy(
            _state(), pl.DataFrame(), TokenBatch(empty, empty), empty.astype(int), 2
        )


def test_k3_bin_does_not_depend_on_numpys_log10(monkeypatch):
    """k3_bin takes its log from pmath (the same bits on every CPU): with numpy's log10
    made unusable it bins as before, edges, zero and inf included."""
    k3 = np.r_[0.0, 1e-300, robust.EDGES[2:50], robust.EDGES[2:50] * (1 + 2e-16), 0.3, np.inf]
    want = k3_bin(k3)

    def no(*a, **k):
        raise AssertionError("np.log10 called")

    monkeypatch.setattr(np, "log10", no)
    assert np.array_equal(k3_bin(k3), want)
    assert want[0] == 0 and want[-1] == K3_BINS


# ----------------------------------------------------------------------------- chunks, threads


@contextlib.contextmanager
def chunked(threads: int, static: bool):
    """Batches of any size split into chunks (MIN_CHUNK 1) over `threads` threads: real
    ones taking whichever chunk is next, or (static) chunk c to thread c % threads, run one
    after the other here (a split of the groups over threads that is known in advance)."""
    old = (robust.MIN_CHUNK, robust.STATIC, os.environ.get("MISMATCH_REPLAY_THREADS"))
    robust.MIN_CHUNK, robust.STATIC = 1, static
    os.environ["MISMATCH_REPLAY_THREADS"] = str(threads)
    try:
        yield
    finally:
        robust.MIN_CHUNK, robust.STATIC = old[0], old[1]
        if old[2] is None:
            del os.environ["MISMATCH_REPLAY_THREADS"]
        else:
            os.environ["MISMATCH_REPLAY_THREADS"] = old[2]


# l whose k3 lies within a window of a bin edge (bins.k3_bin decides those) or just outside
EDGE_L = [_l_at(e) for e in robust.EDGES[[800, 1500, 1990, 2001, 2300]]]
EDGE_L = (
    np.array(EDGE_L).view(np.int64)[:, None] + np.array([-(1 << 20), -9, 0, 4, 1 << 20])
).ravel()
EDGE_L = EDGE_L.view(np.float64).tolist()

edge_ls = st.one_of(ls, st.sampled_from(EDGE_L), st.sampled_from(EDGE_L).map(lambda x: -x))


@st.composite
def chunk_batches(draw):
    """batches() whose groups come in runs (a log sorted by step: chunks never split a
    group), interleaved, or mixed, with log ratios near bin edges too."""
    out = []
    G = draw(st.integers(1, 5))
    for _ in range(draw(st.integers(1, 3))):
        G += draw(st.integers(0, 2))
        runs = draw(st.lists(st.tuples(st.integers(0, G - 1), st.integers(1, 60)), max_size=8))
        g = np.array([gi for gi, k in runs for _ in range(k)] or [0], dtype=np.int64)
        if draw(st.booleans()):  # some tokens moved into other groups' runs
            flip = np.array(draw(st.lists(st.booleans(), min_size=g.size, max_size=g.size)))
            g[flip] = draw(st.integers(0, G - 1))
        n = g.size
        lr = np.array(draw(st.lists(edge_ls, min_size=n, max_size=n)))
        lq = np.array(draw(st.lists(lqs, min_size=n, max_size=n)))
        if draw(st.booleans()):  # l = lp - lq exactly the drawn ratio (edges stay edges)
            lq[:] = 0.0
        with np.errstate(invalid="ignore"):
            lp = lq + lr
        out.append((lp, lq, g, G, draw(st.integers(0, 2**32))))
    return out


@pytest.mark.slow  # hypothesis examples through the numba kernel, over threads
@needs_numba
@given(chunk_batches(), cols_st, st.integers(2, 5), st.booleans(), st.booleans())
def test_chunks_over_threads_are_the_reference_bit_for_bit(bs, cols, threads, static, nan):
    """Any split over chunks and threads (groups kept by one thread, or split and the
    batch redone), tokens near edges in any chunk, NaN: counts, sums, top tokens and ties
    exactly the reference's."""
    if nan:
        bs = [(np.where(np.arange(lp.size) % 7 == 3, np.nan, lp), *rest) for lp, *rest in bs]
    with np.errstate(all="ignore"):
        ref = _run(robust.add_robust_numpy, bs, cols)
    with chunked(threads, static):
        got = _run(robust.add_robust, bs, cols)
    assert_same(got, ref)
    assert_scratch_zero()


@pytest.mark.slow  # hypothesis examples through the numba kernel, over threads
@needs_numba
@given(batches(), cols_st, st.integers(2, 4))
def test_random_batches_over_threads(bs, cols, threads):
    with np.errstate(all="ignore"):
        ref = _run(robust.add_robust_numpy, bs, cols)
    for static in (True, False):
        with chunked(threads, static):
            assert_same(_run(robust.add_robust, bs, cols), ref)


def _runs_log(rng, pattern: list[int], run: int):
    """Groups in runs of `run` tokens, in the order `pattern` gives."""
    g = np.repeat(np.array(pattern, dtype=np.int64), run)
    lq = np.log(rng.uniform(1e-6, 1.0, g.size))
    return lq + rng.normal(0, 0.5, g.size), lq, g


@needs_numba
def test_each_path_runs_and_is_the_reference():
    """Sorted runs: the threads' sums kept ("threads"); a group in two threads' chunks:
    the batch redone ("redone"); one group: one chunk ("serial"). All the reference's."""
    rng = np.random.default_rng(12)
    cases = [
        ([0, 1, 2, 3, 4, 5, 6, 7], 4, "threads"),  # one group per chunk
        ([0, 1, 0, 1, 0, 1, 0, 1], 2, "threads"),  # chunk c's group c % 2: thread c % 2's
        ([0, 1, 2, 0, 1, 2, 0, 1], 2, "redone"),  # group 0 in chunks 0 and 3: both threads
        ([0] * 8, 2, "serial"),
    ]
    for pattern, threads, path in cases:
        lp, lq, g = _runs_log(rng, pattern, 50)
        G = int(g.max()) + 1
        bs = [(lp, lq, g, G, 1), (lp[::-1].copy(), lq[::-1].copy(), g, G, 2)]
        ref = _run(robust.add_robust_numpy, bs, ("position",))
        before = robust.paths[path]
        with chunked(threads, static=True):
            got = _run(robust.add_robust, bs, ("position",))
        assert robust.paths[path] == before + 2, (pattern, dict(robust.paths))
        assert_same(got, ref)
        assert_scratch_zero()


@needs_numba
def test_ties_across_chunks_keep_the_earliest_tokens():
    """Equal k3 in every chunk of a group (its chunks all one thread's): the merge of the
    chunks' top tokens keeps the earliest, as the stable sorts do."""
    n = 400
    lp, lq = np.full(n, 0.5), np.zeros(n)
    g = np.repeat(np.array([0, 1] * 4), 50)
    with chunked(2, static=True):
        s = _state()
        robust.add_robust(s, pl.DataFrame({"position": np.arange(n)}), TokenBatch(lp, lq), g, 2)
    assert s.top[0]["position"].tolist() == list(range(TOP_TOKENS))
    assert s.top[1]["position"].tolist() == list(range(50, 50 + TOP_TOKENS))


@needs_numba
def test_group_codes_out_of_range_in_a_chunk_are_refused():
    rng = np.random.default_rng(13)
    lp, lq, g = _runs_log(rng, [0, 1, 2, 3, 4, 5, 6, 7], 50)
    g[330] = 8
    for static in (True, False):
        s = _state()
        with chunked(2, static), pytest.raises(ValueError, match="outside"):
            robust.add_robust(s, pl.DataFrame({"x": g}), TokenBatch(lp, lq), g, 8)
        assert not s.k3_hist.any() and s.top == {}
        assert_scratch_zero()


@needs_numba
def test_a_real_sized_batch_over_real_threads():
    """300k tokens in sorted runs and interleaved, on the worker threads (MIN_CHUNK as it
    is), with tokens near edges scattered in."""
    rng = np.random.default_rng(14)
    n = 300_000
    lq = np.log(rng.uniform(1e-8, 1.0, n))
    lp = lq + rng.standard_t(2, n) * 0.05
    near = rng.integers(0, n, 40)
    lp[near] = lq[near] + rng.choice(EDGE_L, 40)
    old = os.environ.get("MISMATCH_REPLAY_THREADS")
    os.environ["MISMATCH_REPLAY_THREADS"] = "3"
    try:
        for g in (np.repeat(np.arange(30), n // 30), rng.integers(0, 30, n)):
            df = pl.DataFrame({"step": g, "position": np.arange(n)})
            a, b = _state(), _state()
            robust.add_robust(a, df, TokenBatch(lp, lq), g, 30)
            robust.add_robust_numpy(b, df, TokenBatch(lp, lq), g, 30)
            assert_same(a, b)
    finally:
        if old is None:
            del os.environ["MISMATCH_REPLAY_THREADS"]
        else:
            os.environ["MISMATCH_REPLAY_THREADS"] = old
    assert_scratch_zero()


# ----------------------------------------------------------------------------- shared codes


def _seq_log(tmp_path, seed: int, sorted_log: bool):
    """random_log with prompt groups; unsorted: sequences interleaved and split, so that
    sequences span batches and runs repeat (the codes' general path)."""
    from conftest import random_log

    df = random_log(np.random.default_rng(seed), steps=5, seqs=14, max_len=40)
    df = df.with_columns(group_id=pl.col("sample_id") // 4)
    if not sorted_log:
        rng = np.random.default_rng(seed + 1)
        order = np.argsort(np.arange(df.height) // 7 + rng.integers(0, 4, df.height) * 5)
        df = df[order]
    path = tmp_path / f"log_{seed}_{sorted_log}.parquet"
    df.write_parquet(path)
    return path


def _assert_same_tally(a, b) -> None:
    """Two Tallies of the same rows: sequences (keys, codes, sums), bins, tables, robust."""
    assert list(a.seq_keys.items()) == list(b.seq_keys.items())
    assert list(a.sequences.pgroup_keys.items()) == list(b.sequences.pgroup_keys.items())
    for name in a.sequences.sums:
        x, y = a.sequences.column(name), b.sequences.column(name)
        if name in ("group", "pgroup", "n"):
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:  # the fused kernel's sums: their threads' order may differ
            np.testing.assert_allclose(x, y, rtol=1e-12, err_msg=name)
    assert sorted(a.seq_max) == sorted(b.seq_max)
    for ji in a.seq_max:
        np.testing.assert_array_equal(
            a.seq_max[ji].a[: len(a.sequences)], b.seq_max[ji].a[: len(b.sequences)]
        )
    ta, tb = a.result().table, b.result().table
    assert ta.columns == tb.columns and ta.height == tb.height
    for c in ta.columns:
        if ta[c].dtype.is_float():
            np.testing.assert_allclose(ta[c].to_numpy(), tb[c].to_numpy(), rtol=1e-12, err_msg=c)
        else:
            assert ta[c].to_list() == tb[c].to_list(), c
    if a.robust:
        assert_same(a, b)


@pytest.mark.parametrize("sorted_log", [True, False])
def test_one_reads_tallies_share_sequence_codes(tmp_path, monkeypatch, sorted_log):
    """replay_together: the first Tally's sequence codes serve the others (one computation
    a batch), and every Tally is the one its own replay gives: sequence ids, prompt groups,
    per-sequence sums and highest bins, tables, robust statistics."""
    from mismatch_replay import engine, ingest
    from mismatch_replay.analysis.figure_data import DEFAULT_SETTINGS
    from mismatch_replay.engine.sequences import Sequences

    path = _seq_log(tmp_path, 21, sorted_log)
    opts = ingest.ReadOptions(batch_rows=97)
    rules = list(DEFAULT_SETTINGS)
    parts = [
        {"rules": None, "tail": engine.Tail(0.01)},  # m2po: its ids go into its store's slab
        {"rules": rules, "by": "step", "robust": True, "scatter": False},
        {"rules": rules, "by": "env", "scatter": False},
    ]
    computed = []
    codes = Sequences._codes

    def counting(self, df, into, new):
        computed.append(df.height)
        return codes(self, df, into, new)

    monkeypatch.setattr(Sequences, "_codes", counting)
    together = engine.replay_together([path], parts, options=opts, final=True)
    batches = len(computed)
    assert batches > 5
    assert all(t.sequences._leader is None for t in together)  # unlinked after the read
    alone = [
        engine.replay([path], options=opts, final=True, tail=engine.Tail(0.01)),
        engine.replay([path], rules=rules, by="step", robust=True, options=opts, final=True),
        engine.replay([path], rules=rules, by="env", options=opts, final=True),
    ]
    assert len(computed) == 4 * batches  # each replay alone computes its own
    for got, ref in zip(together, alone, strict=True):
        _assert_same_tally(got, ref)


def test_a_follower_fed_other_rows_computes_its_own():
    """Sequences.lead: a follower whose batch is not its leader's last (another height or
    other ends, or a call too many) computes its own codes, then and from then on."""
    from mismatch_replay.engine.sequences import Sequences

    def batch(steps, sids):
        return pl.DataFrame({"step": steps, "sample_id": sids})

    b1 = batch([0, 0, 0, 1, 1], [0, 0, 1, 0, 0])
    b2 = batch([1, 2, 2], [0, 5, 5])
    b3 = batch([1, 2, 2, 3], [0, 5, 5, 9])
    lead, follow, ref = Sequences(), Sequences(), Sequences()
    lead.lead([follow])
    with pytest.raises(ValueError, match="before the first batch"):
        ref.codes(b1)
        Sequences().lead([ref])
    ref = Sequences()
    got = []
    for x, y in ((b1, b1), (b2, b3), (b3, b2)):
        lead.codes(x)
        g, (u, loc) = follow.codes(y)
        gr, (ur, lr) = ref.codes(y)
        got.append(follow._leader is lead)
        np.testing.assert_array_equal(g, gr)
        np.testing.assert_array_equal(u[loc], ur[lr])
    assert got == [True, False, False]
    assert list(follow.keys.items()) == list(ref.keys.items())
    lead.lead([])
    assert follow._leader is None and lead._last is None
