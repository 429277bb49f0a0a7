"""inspect's per-batch checks on the numba kernels (ingest/checks_jit.py) against their polars
reference (the numpy backend): AlignmentCheck's counts, min, max and pairs exactly, its lag
sums to 1e-12 relative, the same line() and warnings(); DuplicateCheck's table and counts
exactly; and that an ordinary sorted batch takes the kernels, so the speedup cannot go."""

from __future__ import annotations

import itertools
import math

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import fast
from mismatch_replay.ingest import alignment
from mismatch_replay.ingest.alignment import AlignmentCheck
from mismatch_replay.ingest.canonical import DuplicateCheck

pytestmark = pytest.mark.skipif(
    fast.backend() != "numba", reason="the kernels run on the numba backend"
)

# values with exact ties, zeros and dyadic sums (exact in any order), and others; the
# arbitrary floats drawn besides bring -0.0 at times (a column with both zeros)
VALUES = [0.0, -0.5, -1.0, -2.25, -1e-3, -7.125, -0.1, -3.3]


@st.composite
def batches(draw):
    """A log as a list of batches: sequences of (step, sample_id) with runs of positions
    (gaps, repeats), in order or shuffled, with or without step / position / loss_mask,
    log-probs from VALUES or arbitrary negative floats, a column constant at times."""
    nseq = draw(st.integers(1, 8))
    ids = draw(st.sampled_from([0, 3]))  # 0: one sample id, told apart by the step alone
    rows = []
    p = 0
    for _ in range(nseq):
        step = draw(st.integers(0, 2))
        sid = draw(st.integers(0, ids))
        if draw(st.booleans()):  # else on from the sequence before: a pair only if keyed
            p = draw(st.integers(-3, 20))
        for _ in range(draw(st.integers(1, 4))):  # runs of positions, gaps between
            n = draw(st.integers(1, 12))
            rows += [(step, sid, p + k) for k in range(n)]
            p += n + draw(st.sampled_from([0, 0, 1, 3]))
    if draw(st.booleans()):  # rows repeated (a file read twice, a rank logged twice)
        k = draw(st.integers(1, len(rows)))
        at = draw(st.integers(0, len(rows)))
        rows = rows[:at] + rows[:k] + rows[at:]
    order = draw(st.sampled_from(["as drawn", "sorted", "shuffled"]))
    if order == "sorted":
        rows.sort()
    elif order == "shuffled":
        perm = draw(st.permutations(range(len(rows))))
        rows = [rows[i] for i in perm]
    m = len(rows)
    step, sid, pos = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
    floats = st.floats(-30.0, 0.0, allow_nan=False, allow_infinity=False)
    value = st.one_of(st.sampled_from(VALUES), floats)
    cols = {}
    for name in ("trainer_logprob", "inference_logprob"):
        how = draw(st.sampled_from(["values", "values", "constant", "zero", "copy"]))
        if how == "constant":
            x = np.full(m, draw(value))
        elif how == "zero":
            x = np.zeros(m)
        elif how == "copy" and name == "inference_logprob":
            x = cols["trainer_logprob"].copy()
        else:
            x = np.array(draw(st.lists(value, min_size=m, max_size=m)))
        cols[name] = x
    df = pl.DataFrame(cols)
    if draw(st.booleans()):
        df = df.with_columns(step=pl.Series(step))
    df = df.with_columns(sample_id=pl.Series(sid))
    if draw(st.booleans()):
        df = df.with_columns(position=pl.Series(pos))
    if draw(st.booleans()):
        mask = draw(st.lists(st.booleans(), min_size=m, max_size=m))
        df = df.with_columns(loss_mask=pl.Series(mask, dtype=pl.Boolean))
    split = draw(st.integers(1, 3))
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=split - 1, max_size=split - 1)))
    edges = [0, *cuts, m]
    return [df.slice(a, b - a) for a, b in itertools.pairwise(edges)]


def _run(parts, backend):
    with fast.use_backend(backend):
        c = AlignmentCheck()
        for p in parts:
            c.add(p)
    return c


def _same(fast_c: AlignmentCheck, ref: AlignmentCheck) -> None:
    assert fast_c.tokens == ref.tokens
    assert fast_c.equal == ref.equal
    assert fast_c.zero == ref.zero
    for side in ("trainer", "inference"):  # the same floats, to the sign of a zero
        for got, want in ((fast_c.lo[side], ref.lo[side]), (fast_c.hi[side], ref.hi[side])):
            assert got == want and math.copysign(1, got) == math.copysign(1, want)
    assert fast_c.pairs == ref.pairs
    for k in (0, 1, -1):
        if math.isnan(ref.d[k]):  # a NaN the kernels refuse: polars' sums, both sides
            assert math.isnan(fast_c.d[k])
        else:
            assert fast_c.d[k] == pytest.approx(ref.d[k], rel=1e-12, abs=0)
    assert fast_c.line() == ref.line()
    assert fast_c.warnings() == ref.warnings()


@pytest.mark.slow  # 300 hypothesis examples, numba against polars
@settings(max_examples=300, deadline=None)
@given(parts=batches())
def test_alignment_kernels_give_the_polars_figures(parts):
    _same(_run(parts, "numba"), _run(parts, "numpy"))


@pytest.mark.slow  # 150 hypothesis examples, numba against polars
@settings(max_examples=150, deadline=None)
@given(parts=batches())
def test_duplicate_kernel_gives_the_polars_table(parts):
    def run(backend):
        c = DuplicateCheck()
        with fast.use_backend(backend):
            for p in parts:
                if "position" in p.columns and "step" in p.columns:
                    c.add(p.select("step", "sample_id", "position"))
            c._merge()
        return c

    got, want = run("numba"), run("numpy")
    assert got.counts() == want.counts()
    if want.table is None:
        assert got.table is None
        return
    keys = ["step", "sample_id"]
    assert got.table.schema == want.table.schema
    assert got.table.sort(keys).equals(want.table.sort(keys))


def test_duplicate_runs_are_numpy_runs_in_rows_and_dtypes():
    rng = np.random.default_rng(0)
    for dtype in (pl.Int64, pl.Int32, pl.UInt32, pl.Int16):
        step = np.repeat(rng.integers(0, 3, 40), rng.integers(1, 30, 40))
        df = pl.DataFrame(
            {
                "step": step,
                "sample_id": rng.integers(0, 4, step.size),
                "position": rng.integers(0, 50, step.size),
            }
        ).with_columns(pl.all().cast(dtype))
        got, want = DuplicateCheck._runs_jit(df), DuplicateCheck._runs(df)
        assert (got is None) == (want is None)
        if got is not None:
            assert got.schema == want.schema and got.equals(want)


@settings(max_examples=150, deadline=None)
@given(
    runs=st.lists(  # (step, sample_id, rows): some ending on a block's end
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 2),
            st.one_of(st.integers(1, 200), st.sampled_from([64, 128])),
        ),
        min_size=1,
    ),
    jitter=st.integers(0, 5),
    seed=st.integers(0, 100),
)
def test_long_runs_give_the_numpy_runs(runs, jitter, seed):
    """Runs longer than seq_runs' blocks of 64 rows, ending anywhere in a block, a run
    continuing across blocks or followed by one of the same key after another."""
    rng = np.random.default_rng(seed)
    step = np.repeat([r[0] for r in runs], [r[2] for r in runs])
    sid = np.repeat([r[1] for r in runs], [r[2] for r in runs])
    pos = np.concatenate([np.arange(r[2]) for r in runs]) + rng.integers(0, jitter + 1, step.size)
    df = pl.DataFrame({"step": step, "sample_id": sid, "position": pos})
    got, want = DuplicateCheck._runs_jit(df), DuplicateCheck._runs(df)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.schema == want.schema and got.equals(want)


def _sorted_batch(n_seq=40, length=50, seed=0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    n = n_seq * length
    lq = -rng.exponential(1.0, n)
    return pl.DataFrame(
        {
            "trainer_logprob": lq + rng.normal(0, 1e-3, n),
            "inference_logprob": lq,
            "step": np.repeat(np.arange(n_seq) // 8, length),
            "sample_id": np.repeat(np.arange(n_seq), length),
            "position": np.tile(np.arange(length), n_seq),
        }
    )


def test_a_sorted_batch_takes_the_kernels(monkeypatch):
    """No polars sort, select or group_by on an ordinary batch: the speedup is checked."""
    from mismatch_replay.ingest import checks_jit

    calls = {"column_stats": 0, "lag_sums": 0, "seq_runs": 0}
    for name in calls:
        real = getattr(checks_jit, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        monkeypatch.setattr(checks_jit, name, counted)

    def refused(*a, **k):
        raise AssertionError("the polars path ran on a sorted batch")

    monkeypatch.setattr(AlignmentCheck, "_stats_polars", refused)
    monkeypatch.setattr(AlignmentCheck, "_lags_polars", refused)
    monkeypatch.setattr(DuplicateCheck, "_runs", staticmethod(refused))
    df = _sorted_batch()
    a, d = AlignmentCheck(), DuplicateCheck()
    a.add(df)
    a.add(df.with_columns(loss_mask=pl.Series([True, False] * (df.height // 2))))
    d.add(df)
    assert calls == {"column_stats": 2, "lag_sums": 2, "seq_runs": 1}
    assert a.pairs == 40 * 49  # none from the second: no two consecutive loss tokens
    assert a.tokens == df.height * 3 // 2 and a.shift() == 0
    assert d.counts() == (0, 0)


def test_what_the_kernels_do_not_take_goes_to_polars(monkeypatch):
    """Out of order, repeated keys, text ids, both zeros: polars, and the same figures."""
    ran = {"stats": 0, "lags": 0}
    real_stats, real_lags = AlignmentCheck._stats_polars, AlignmentCheck._lags_polars

    def stats(self, df):
        ran["stats"] += 1
        real_stats(self, df)

    def lags(self, df):
        ran["lags"] += 1
        real_lags(self, df)

    monkeypatch.setattr(AlignmentCheck, "_stats_polars", stats)
    monkeypatch.setattr(AlignmentCheck, "_lags_polars", lags)
    df = _sorted_batch()
    cases = {
        "shuffled": (df.sample(fraction=1.0, shuffle=True, seed=1), 0, 1),
        "repeated": (pl.concat([df.head(10), df]), 0, 1),
        "a row twice in a row": (pl.concat([df.head(10), df.slice(9)]), 0, 1),  # a tie
        "text ids": (df.with_columns(pl.col("sample_id").cast(pl.Utf8)), 0, 1),
        "both zeros": (
            df.with_columns(
                trainer_logprob=pl.Series([0.0, -0.0] * (df.height // 2)),
            ),
            1,
            0,
        ),
    }
    for name, (batch, n_stats, n_lags) in cases.items():
        ran.update(stats=0, lags=0)
        got = _run([batch], "numba")
        assert ran == {"stats": n_stats, "lags": n_lags}, name
        _same(got, _run([batch], "numpy"))


def _frame(lp, lq, **keys) -> pl.DataFrame:
    return pl.DataFrame({"trainer_logprob": lp, "inference_logprob": lq, **keys})


EDGES = {
    "a pair never crosses steps": _frame(
        [-1.0, -2.0, -3.0, -4.0],
        [-1.0, -2.5, -3.0, -4.5],
        step=[0, 0, 1, 1],
        sample_id=[1, 1, 1, 1],
        position=[0, 1, 2, 3],
    ),
    "nor sequences": _frame(
        [-1.0, -2.0, -3.0, -4.0],
        [-1.0, -2.5, -3.0, -4.5],
        step=[0, 0, 0, 0],
        sample_id=[1, 1, 2, 2],
        position=[0, 1, 2, 3],
    ),
    "nor sequences without position": _frame(
        [-1.0, -2.0, -3.0, -4.0], [-1.0, -2.5, -3.0, -4.5], sample_id=[1, 1, 2, 2]
    ),
    "nor steps without position": _frame(
        [-1.0, -2.0, -3.0, -4.0],
        [-1.0, -2.5, -3.0, -4.5],
        step=[0, 0, 1, 1],
        sample_id=[1, 1, 1, 1],
    ),
    "positions descending": _frame(
        [-1.0, -2.0, -3.0], [-1.5, -2.5, -3.0], sample_id=[1, 1, 1], position=[2, 1, 0]
    ),
    "a gap": _frame(
        [-1.0, -2.0, -3.0], [-1.5, -2.5, -3.0], sample_id=[1, 1, 1], position=[0, 1, 3]
    ),
    "0.0 against -0.0": _frame([0.0] * 3, [-0.0] * 3, sample_id=[1, 1, 1]),
    "-0.0 alone": _frame([-0.0, -0.0, -1.0], [-0.0, -2.0, -0.0], sample_id=[1, 1, 1]),
    "int32 keys": _frame(
        [-1.0, -2.0, -3.0],
        [-1.5, -2.5, -3.0],
        step=pl.Series([0, 0, 0], dtype=pl.Int32),
        sample_id=pl.Series([1, 1, 1], dtype=pl.UInt8),
        position=pl.Series([0, 1, 2], dtype=pl.Int16),
    ),
    "uint64 keys": _frame(
        [-1.0, -2.0, -3.0],
        [-1.5, -2.5, -3.0],
        sample_id=pl.Series([1, 1, 1], dtype=pl.UInt64),
        position=pl.Series([0, 1, 2], dtype=pl.UInt64),
    ),
    "float32 log-probs": _frame(
        pl.Series([-1.0, -2.0], dtype=pl.Float32), [-1.5, -2.5], sample_id=[1, 1]
    ),
    "a null log-prob": _frame([-1.0, None, -2.0], [-1.5, -2.5, -3.0], sample_id=[1, 1, 1]),
    "a null mask": _frame(
        [-1.0, -2.0, -3.0],
        [-1.5, -2.5, -3.0],
        sample_id=[1, 1, 1],
        loss_mask=[True, None, True],
    ),
    "a NaN": _frame([-1.0, math.nan, -2.0], [-1.5, -2.5, -3.0], sample_id=[1, 1, 1]),
    "an infinity": _frame([-1.0, -math.inf, -2.0], [-1.5, -2.5, -3.0], sample_id=[1, 1, 1]),
    "no loss token": _frame([-1.0], [-1.5], sample_id=[1], loss_mask=[False]),
    "one row": _frame([-1.0], [-1.5], step=[3], sample_id=[1], position=[9]),
    "null keys": _frame(
        [-1.0, -2.0, -3.0], [-1.5, -2.5, -3.0], sample_id=[1, 1, 1], position=[0, None, 2]
    ),
}


@pytest.mark.parametrize("name", list(EDGES))
def test_edge_batches_give_the_polars_figures(name):
    df = EDGES[name]
    _same(_run([df, df], "numba"), _run([df, df], "numpy"))


def test_the_numpy_backend_runs_no_kernel(monkeypatch):
    from mismatch_replay.ingest import checks_jit

    def refused(*a):
        raise AssertionError("a kernel ran on the numpy backend")

    for name in ("column_stats", "lag_sums", "seq_runs"):
        monkeypatch.setattr(checks_jit, name, refused)
    with fast.use_backend("numpy"):
        AlignmentCheck().add(_sorted_batch())
        DuplicateCheck().add(_sorted_batch())
        assert alignment._kernels() is None


def test_the_lag_sums_stop_at_max_pairs_as_polars_does(monkeypatch):
    monkeypatch.setattr(alignment, "MAX_PAIRS", 1000)
    df = _sorted_batch()
    parts = [df[i : i + 300] for i in range(0, df.height, 300)]
    got, want = _run(parts, "numba"), _run(parts, "numpy")
    _same(got, want)
    assert 1000 <= got.pairs < 1000 + 300 and got.tokens == df.height
