"""exp, expm1 and log on float64 arrays with the same bits on every CPU.

Design
------
numpy's `np.exp`, `np.expm1` and `np.log` are dispatched at run time: on a CPU with AVX-512
numpy 2.x runs its own vectorised versions, elsewhere the C library's. The two differ in the
last bit on a few percent of values, so a maximum, a histogram bin, a correlation or a tie
with a threshold could depend on the machine a test ran on.

Every derived quantity of the tool (p, q, |dp|, the ratio, k3, exp|l|, the binary KLs) is
therefore computed with the functions below. They use only IEEE-754 additions,
multiplications, one division (log), comparisons and bit operations, each correctly rounded
on every CPU whatever the SIMD width, so their results are one fixed function of the input.
The fused kernel (`fast.vmath`, compiled by numba without floating-point contraction) runs the
very same operations in the same order, which makes the two engine paths bit-identical per
token: tests/test_pmath.py checks both against each other and against the C library.

The algorithms (the same as `fast.vmath`'s; see there for the derivations):

* exp(x) = 2^k exp(r), k = round(x / ln 2) by the 1.5 * 2^52 shifter, r = x - k ln 2 in two
  parts, exp(r) - 1 by its Taylor series to r^12 (Estrin's scheme), 2^k as two normal
  factors (subnormal and overflowing results right: 0 below -745.2, inf above 709.78).
* expm1(x) = 2^k expm1(r) + (2^k - 1) for |k| <= 60 (no cancellation near 0), else
  (expm1(r) + 1) 2^k - 1.
* log(x) = e ln 2 + 2 atanh(f / (2 + f)), m = 1 + f in [sqrt(1/2), sqrt(2)), series to
  s^21; subnormals scaled first. Positive x (log(0) = -inf, log(inf) = inf, log(x < 0) = NaN
  as in the C library).

Accuracy: within 2-3 ulps of the correctly rounded result (measured on millions of values in
tests/test_pmath.py). Speed: ~10-20 numpy passes per call, ~15-30 ns a value. Once the fused
backend has loaded (fast.compiled()), it registers its compiled loops (`use_kernel`: fast.vmath's
`apply`, the same bits), and `exp`, `expm1` and `log` hand arrays of KERNEL_MIN values or more
to them, ~10x faster: the rules' `score()` on a replay's kept tokens, a sample, the simple path
after a fused replay. `exp_numpy`, `expm1_numpy` and `log_numpy` are the numpy code, always
(the tests compare the two). pmath imports nothing of the project: the kernel comes to it.
"""

from __future__ import annotations

import numpy as np

SHIFTER = 6755399441055744.0  # 1.5 * 2^52
_SHIFT_BITS = np.uint64(0x4338000000000000)
INV_LN2 = 1.4426950408889634
LN2_HI = 0.6931471803691238  # 32 significant bits: k * LN2_HI is exact
LN2_LO = 1.9082149292705877e-10
_MANT = np.uint64((1 << 52) - 1)
_ONE_BITS = np.uint64(0x3FF0000000000000)
_S52 = np.uint64(52)
_BIAS = np.uint64(1023)
SQRT2 = 1.4142135623730951
TWO54 = 18014398509481984.0
TINY = 2.2250738585072014e-308  # smallest normal float64

_F = [1.0 / f for f in (2.0, 6.0, 24.0, 120.0, 720.0, 5040.0, 40320.0, 362880.0)]
_F += [1.0 / 3628800.0, 1.0 / 39916800.0, 1.0 / 479001600.0]
_F2, _F3, _F4, _F5, _F6, _F7, _F8, _F9, _F10, _F11, _F12 = _F


KERNEL_MIN = 4096  # values from which a call goes to the registered kernel
_kernel = None  # a function returning the kernel's apply(kind, x, out), or None (use_kernel)


def use_kernel(source) -> None:
    """Register where the compiled exp/expm1/log are: `source()` returns a function
    apply(kind, x, out) (kind 0 exp, 1 expm1, 2 log; out = f(x) on 1-D float64 arrays, the
    same bits as the numpy code here), or None where it may not run now (the numpy
    backend forced). None unregisters."""
    global _kernel
    _kernel = source


def _kernel_call(kind: int, x: np.ndarray) -> np.ndarray | None:
    if _kernel is None or x.size < KERNEL_MIN:
        return None
    apply = _kernel()
    if apply is None:
        return None
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty_like(flat)
    apply(kind, flat, out)
    if kind == 2:  # the kernel's log takes positive finite values (its callers clamp)
        odd = ~((flat > 0.0) & (flat < np.inf))
        if odd.any():
            out[odd] = log_numpy(flat[odd])
    return out.reshape(x.shape)


def _arr(x) -> tuple[np.ndarray, bool]:
    a = np.asarray(x, dtype=np.float64)
    return np.atleast_1d(a), a.ndim == 0


def _out(y: np.ndarray, scalar: bool):
    return float(y[0]) if scalar else y


def _reduce(x: np.ndarray):
    """(k's bits as uint64, r) with x = k ln 2 + r, |r| <= ~0.347."""
    x = np.minimum(np.maximum(x, -746.0), 710.0)
    kd = x * INV_LN2 + SHIFTER
    kbits = kd.view(np.uint64) - _SHIFT_BITS
    kf = kd - SHIFTER
    r = (x - kf * LN2_HI) - kf * LN2_LO
    return kbits, r


def _expm1_series(r: np.ndarray) -> np.ndarray:
    r2 = r * r
    r4 = r2 * r2
    r8 = r4 * r4
    a0 = _F2 + r * _F3
    a1 = _F4 + r * _F5
    a2 = _F6 + r * _F7
    a3 = _F8 + r * _F9
    a4 = _F10 + r * _F11
    b0 = a0 + r2 * a1
    b1 = a2 + r2 * a3
    b2 = a4 + r2 * _F12
    p = (b0 + r4 * b1) + r8 * b2
    return r + r2 * p


def _pow2(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """2^k as two normal factors 2^(k >> 1) and 2^(k - (k >> 1)); k an int64 array."""
    k1 = k >> 1
    k2 = k - k1
    s1 = ((k1 + 1023).astype(np.uint64) << _S52).view(np.float64)
    s2 = ((k2 + 1023).astype(np.uint64) << _S52).view(np.float64)
    return s1, s2


def exp(x):
    """exp(x), elementwise, float64; the same bits on every CPU."""
    x, scalar = _arr(x)
    y = _kernel_call(0, x)
    return _out(exp_numpy(x) if y is None else y, scalar)


def expm1(x):
    """exp(x) - 1, elementwise, float64, accurate near 0; the same bits on every CPU."""
    x, scalar = _arr(x)
    y = _kernel_call(1, x)
    return _out(expm1_numpy(x) if y is None else y, scalar)


def log(x):
    """log(x), elementwise, float64; the same bits on every CPU. log(0) = -inf, log(inf) =
    inf, NaN for x < 0 or NaN."""
    x, scalar = _arr(x)
    y = _kernel_call(2, x)
    return _out(log_numpy(x) if y is None else y, scalar)


def exp_numpy(x):
    """`exp` in numpy, whatever kernel is registered."""
    x, scalar = _arr(x)
    kbits, r = _reduce(x)
    e = 1.0 + _expm1_series(r)
    s1, s2 = _pow2(kbits.view(np.int64))
    with np.errstate(over="ignore", invalid="ignore"):
        y = e * s1 * s2
    return _out(y, scalar)


def expm1_numpy(x):
    """`expm1` in numpy, whatever kernel is registered."""
    x, scalar = _arr(x)
    kbits, r = _reduce(x)
    em = _expm1_series(r)
    k = kbits.view(np.int64)
    near = (k >= -60) & (k <= 60)
    kc = np.minimum(np.maximum(k, -60), 60)
    s = ((kc + 1023).astype(np.uint64) << _S52).view(np.float64)
    s1, s2 = _pow2(k)
    with np.errstate(over="ignore", invalid="ignore"):
        small = s * em + (s - 1.0)
        big = (em + 1.0) * s1 * s2 - 1.0
    return _out(np.where(near, small, big), scalar)


def log_numpy(x):
    """`log` in numpy, whatever kernel is registered."""
    x, scalar = _arr(x)
    sub = x < TINY
    with np.errstate(over="ignore", invalid="ignore"):
        xs = np.where(sub, x * TWO54, x)
    bits = xs.view(np.uint64)
    ebits = (bits >> _S52) - _BIAS
    m = ((bits & _MANT) | _ONE_BITS).view(np.float64)
    hi = m > SQRT2
    m = np.where(hi, m * 0.5, m)
    e = ebits.view(np.int64) + hi.astype(np.int64) - np.where(sub, 54, 0)
    ef = (_SHIFT_BITS + e.astype(np.uint64)).view(np.float64) - SHIFTER
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    z2 = z * z
    z4 = z2 * z2
    a0 = 1.0 / 3.0 + z * (1.0 / 5.0)
    a1 = 1.0 / 7.0 + z * (1.0 / 9.0)
    a2 = 1.0 / 11.0 + z * (1.0 / 13.0)
    a3 = 1.0 / 15.0 + z * (1.0 / 17.0)
    a4 = 1.0 / 19.0 + z * (1.0 / 21.0)
    p = (a0 + z2 * a1) + z4 * ((a2 + z2 * a3) + z4 * a4)
    lm = f - s * (f - 2.0 * z * p)
    with np.errstate(invalid="ignore"):
        y = ef * LN2_HI + (lm + ef * LN2_LO)
    # the special values the bit manipulation above does not produce
    y = np.where(x == 0.0, -np.inf, y)
    y = np.where(x == np.inf, np.inf, y)
    y = np.where((x < 0.0) | np.isnan(x), np.nan, y)
    return _out(y, scalar)
