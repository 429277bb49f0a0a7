"""pmath: one exp/expm1/log for both engine paths, the same bits on every CPU.

Three claims, each tested: (1) pmath's numpy functions and the fused kernel's `fast.vmath`
functions are bit-identical; (2) both are within a few ulps of the C library (Python's
`math`, not numpy's dispatched loops); (3) no engine result depends on numpy's own exp,
expm1 or log: with those replaced by versions that differ in the last bit on a share of the
values (what numpy's AVX-512 loops do against the C library), every count, sum, maximum and
histogram of a sweep is bit-for-bit unchanged, on both paths.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import random_log, write_log

from mismatch_replay import engine, fast, ingest, pmath

needs_numba = pytest.mark.skipif(fast.backend() != "numba", reason="numba is not installed")

RNG = np.random.default_rng(2026)
X = np.r_[
    RNG.uniform(-745.0, 709.0, 200_000),
    RNG.normal(0.0, 1e-3, 100_000),
    RNG.uniform(-40.0, 40.0, 200_000),
    RNG.normal(0.0, 1e-12, 10_000),
    [0.0, -0.0, 1e-300, -1e-300, 709.78, -745.1, -745.2, 1e-17],
]
POS = np.r_[
    np.exp(RNG.uniform(-745.0, 709.0, 200_000)),
    RNG.uniform(0.0, 1.0, 200_000),
    1.0 - RNG.uniform(0.0, 1e-6, 10_000),
    [5e-324, 1e-310, 2.2250738585072014e-308, 1.0, 2.0, 0.5, 1.7976931348623157e308],
]
CASES = (("exp", 0, X, math.exp), ("expm1", 1, X, math.expm1), ("log", 2, POS, math.log))


def _ulps(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    ok = np.isfinite(ref) & (ref != 0)
    return np.abs(y[ok] - ref[ok]) / np.spacing(np.abs(ref[ok]))


@needs_numba
@pytest.mark.parametrize(("name", "kind", "x", "_"), CASES)
def test_pmath_is_bit_identical_to_the_kernels_functions(name, kind, x, _):
    from mismatch_replay.fast import vmath

    out = np.empty_like(x)
    vmath.apply(kind, x, out)
    y = getattr(pmath, f"{name}_numpy")(x)
    same = out.view(np.uint64) == y.view(np.uint64)
    assert same.all(), (name, x[~same][:5], out[~same][:5], y[~same][:5])


@needs_numba
@pytest.mark.parametrize(("name", "kind", "x", "_"), CASES)
def test_pmath_hands_long_arrays_to_the_kernel_only_on_the_fused_backend(
    monkeypatch, name, kind, x, _
):
    """Once the fused backend has loaded, pmath's functions run vmath's loops on arrays of
    KERNEL_MIN values or more (the same bits as the numpy code), and never while the numpy
    backend is forced (the reference path runs numpy's code)."""
    from mismatch_replay.fast import vmath

    fast.compiled()
    calls = []
    real = vmath.apply

    def counted(k, a, out):
        calls.append((k, a.shape[0]))
        return real(k, a, out)

    monkeypatch.setattr(vmath, "apply", counted)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 5e-324, 1e-310, 1e308, -1e3, 1e3]
    x = np.r_[x, np.tile(special, 500)]  # also where the kernel's own callers never go
    f, ref = getattr(pmath, name), getattr(pmath, f"{name}_numpy")(x)
    y = f(x)
    assert calls == [(kind, x.shape[0])]
    assert np.array_equal(np.isnan(y), np.isnan(ref))
    assert (y[~np.isnan(y)].view(np.uint64) == ref[~np.isnan(ref)].view(np.uint64)).all()
    two_d = f(x[: 2 * pmath.KERNEL_MIN].reshape(2, -1))  # any shape, the same values
    assert two_d.shape == (2, pmath.KERNEL_MIN)
    assert (two_d.reshape(-1).view(np.uint64) == ref[: 2 * pmath.KERNEL_MIN].view(np.uint64)).all()
    calls.clear()
    f(x[: pmath.KERNEL_MIN - 1])  # short arrays: numpy
    with fast.use_backend("numpy"):
        z = f(x)
    assert calls == []
    assert np.array_equal(z, ref, equal_nan=True)


@pytest.mark.parametrize(("name", "kind", "x", "libm"), CASES)
def test_pmath_is_within_a_few_ulps_of_the_c_library(name, kind, x, libm):
    sample = x[:: max(1, x.shape[0] // 60_000)]
    ref = np.array([libm(float(v)) if (v < 709.78 or name == "log") else math.inf for v in sample])
    y = getattr(pmath, name)(sample)
    u = _ulps(y, ref)
    assert u.max() <= 8, (name, u.max())  # measured: exp 2, expm1 7, log 1
    assert np.mean(u <= 1) > 0.98, name
    # underflow and overflow where the C library has them
    assert np.array_equal(np.isinf(y), np.isinf(ref)), name
    assert np.array_equal(y == 0, ref == 0), name


def test_pmath_special_values():
    assert pmath.exp(-np.inf) == 0.0 and pmath.exp(np.inf) == np.inf
    assert pmath.exp(0.0) == 1.0 and pmath.expm1(0.0) == 0.0 and pmath.log(1.0) == 0.0
    assert pmath.expm1(-1000.0) == -1.0 and pmath.expm1(1000.0) == np.inf
    assert pmath.log(0.0) == -np.inf and pmath.log(np.inf) == np.inf
    assert math.isnan(pmath.log(-1.0)) and math.isnan(pmath.log(math.nan))
    assert pmath.expm1(1e-300) == 1e-300  # no cancellation near 0
    assert isinstance(pmath.exp(1.0), float)
    assert pmath.exp(np.array([1.0, 2.0])).shape == (2,)


def _nudged(f):
    """f with a last-bit error on ~5% of the values, the way numpy's AVX-512 loops differ."""

    def g(x, *args, **kw):
        y = f(x, *args, **kw)
        if not isinstance(y, np.ndarray) or y.dtype != np.float64 or y.ndim == 0:
            return y
        y = y.copy()
        sel = np.isfinite(y) & (np.arange(y.size).reshape(y.shape) % 19 == 3)
        y[sel] = np.nextafter(y[sel], np.inf)
        return y

    return g


def _everything(res):
    t = res.tally
    return (
        res.table.sort(["rule", "setting", "param", "value"]),
        res.metrics,
        {k: v.copy() for k, v in t.metrics.s.items()},
        {k: v.copy() for k, v in t.metrics.m.items()},
        t.hist_lin.copy(),
        t.hist_log.copy(),
    )


def _same(a, b) -> None:
    ta, ma, sa, xa, hla, hga = a
    tb, mb, sb, xb, hlb, hgb = b
    assert ta.equals(tb, null_equal=True)
    assert ma.equals(mb, null_equal=True)
    for k in sa:
        assert np.array_equal(sa[k], sb[k]), k
    for k in xa:
        assert np.array_equal(xa[k], xb[k]), k
    assert np.array_equal(hla, hlb) and np.array_equal(hga, hgb)


@pytest.mark.parametrize("backend", ["numpy", pytest.param("numba", marks=needs_numba)])
def test_no_result_depends_on_numpys_dispatched_exp_and_log(tmp_path, monkeypatch, backend):
    """A second CPU emulated: numpy's exp/expm1/log nudged by one ulp on 1 value in 19."""
    rng = np.random.default_rng(11)
    path = write_log(tmp_path / "log.parquet", random_log(rng, steps=3, seqs=10, max_len=40))
    opts = ingest.ReadOptions(batch_rows=113)
    with fast.use_backend(backend):
        before = _everything(engine.sweep([path], by="step", options=opts))
        for name in ("exp", "expm1", "log", "log1p"):
            monkeypatch.setattr(np, name, _nudged(getattr(np, name)))
        after = _everything(engine.sweep([path], by="step", options=opts))
    _same(before, after)
