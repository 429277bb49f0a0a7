"""exp, expm1 and log for the fused kernel, written so that LLVM vectorises the loops using them.

Design
------
numba turns `math.exp` into a call to the C library: one value at a time, ~5-10 ns, and a
loop with a call in it is never vectorised. The kernel's per-token quantities need nine such
calls (p, q, |dp|, k3, the ratio, a binary-KL pair), which was most of its time. These are
branch-free (selects only), call-free versions built from multiplications, additions and bit
operations, so that a loop of them runs four tokens at a time on AVX2:

* exp(x) = 2^k exp(r), k = round(x / ln 2) (the 1.5 * 2^52 shifter: no float->int
  conversion, which AVX2 lacks), r = x - k ln 2 in two parts (|r| <= 0.347), exp(r) by its
  Taylor series to r^12 (Estrin's scheme), 2^k built in the exponent bits in two halves
  (so that subnormal and overflowing results come out right: 0 below -745.2, inf above
  709.78).
* expm1(x) = 2^k expm1(r) + (2^k - 1) with the same reduction and the same series: no
  cancellation near 0, relative error a few ulps everywhere.
* log(x) = e ln 2 + log(m), m in [sqrt(1/2), sqrt(2)), log(m) = 2 atanh(f / (2 + f)) with
  f = m - 1, series to s^21; subnormal x scaled first. Positive finite x only (the kernel
  takes logs of clamped probabilities).

They are within a few ulps of the C library (exp 2, expm1 7, log 1, measured in
tests/test_pmath.py) and, compiled without floating-point contraction (no `fastmath`
anywhere in the kernels), bit-identical to `pmath`, their numpy twin that the simple path
and the rules use: so both engine paths see the same bits for every per-token quantity, on
every CPU, whatever numpy's own exp and log dispatch to.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def f2u(typingctx, x):
    """The bits of a float64 as a uint64 (a bitcast)."""
    if not isinstance(x, types.Float) or x.bitwidth != 64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.uint64(types.float64), codegen


@intrinsic
def u2f(typingctx, x):
    """A uint64's bits as a float64 (a bitcast)."""
    if not isinstance(x, types.Integer) or x.bitwidth != 64:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(x), codegen


SHIFTER = 6755399441055744.0  # 1.5 * 2^52: x + SHIFTER rounds x to an integer in the low bits
_SHIFT_BITS = np.uint64(0x4338000000000000)  # its bits
INV_LN2 = 1.4426950408889634
LN2_HI = 0.6931471803691238  # ln 2 with 32 significant bits: k * LN2_HI is exact
LN2_LO = 1.9082149292705877e-10
_BIAS = np.uint64(1023)
_S52 = np.uint64(52)
_MANT = np.uint64((1 << 52) - 1)
_ONE_BITS = np.uint64(0x3FF0000000000000)
SQRT2 = 1.4142135623730951
TWO54 = 18014398509481984.0

# 1 / n!
_F2 = 1.0 / 2.0
_F3 = 1.0 / 6.0
_F4 = 1.0 / 24.0
_F5 = 1.0 / 120.0
_F6 = 1.0 / 720.0
_F7 = 1.0 / 5040.0
_F8 = 1.0 / 40320.0
_F9 = 1.0 / 362880.0
_F10 = 1.0 / 3628800.0
_F11 = 1.0 / 39916800.0
_F12 = 1.0 / 479001600.0


@njit(inline="always")
def _reduce(x):
    """(k as a float, k's bits offset, r): x = k ln 2 + r, |r| <= ~0.347, x in [-746, 710]."""
    x = min(max(x, -746.0), 710.0)
    kd = x * INV_LN2 + SHIFTER
    kbits = f2u(kd) - _SHIFT_BITS  # k as a two's-complement uint64
    kf = kd - SHIFTER
    r = (x - kf * LN2_HI) - kf * LN2_LO
    return kf, kbits, r


@njit(inline="always")
def _pow2_halves(kbits):
    """2^k as two factors 2^(k >> 1) and 2^(k - (k >> 1)), each a normal float."""
    k = np.int64(kbits)
    k1 = k >> 1
    k2 = k - k1
    s1 = u2f(np.uint64(k1 + 1023) << _S52)
    s2 = u2f(np.uint64(k2 + 1023) << _S52)
    return s1, s2


@njit(inline="always")
def _expm1_series(r):
    """expm1(r) for |r| <= 0.35: r + r^2 (1/2! + r/3! + ... + r^10/12!), truncation < 5e-16
    relative, evaluated by Estrin's scheme (a short dependency chain: the loop's latency)."""
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


@njit(inline="always")
def vexp(x):
    """exp(x), a few ulps; 0 below -745.2, inf above 709.78."""
    _, kbits, r = _reduce(x)
    e = 1.0 + _expm1_series(r)
    s1, s2 = _pow2_halves(kbits)
    return e * s1 * s2


@njit(inline="always")
def vexpm1(x):
    """expm1(x), a few ulps relative (also near 0); -1 below -40, inf above 709.78."""
    _, kbits, r = _reduce(x)
    em = _expm1_series(r)
    k = np.int64(kbits)
    # |k| <= 60: 2^k exactly, 2^k expm1(r) + (2^k - 1) (no cancellation: k = 0 is em)
    kc = min(max(k, -60), 60)
    s = u2f(np.uint64(kc + 1023) << _S52)
    small = s * em + (s - 1.0)
    # otherwise: (expm1(r) + 1) 2^k - 1 in two halves (overflow to inf, or -1)
    s1, s2 = _pow2_halves(kbits)
    big = (em + 1.0) * s1 * s2 - 1.0
    return small if (k >= -60) & (k <= 60) else big


@njit(inline="always")
def vlog(x):
    """log(x) for positive finite x (subnormals included), a few ulps."""
    sub = x < 2.2250738585072014e-308
    xs = x * TWO54 if sub else x
    bits = f2u(xs)
    ebits = (bits >> _S52) - _BIAS  # exponent as a two's-complement uint64
    m = u2f((bits & _MANT) | _ONE_BITS)  # in [1, 2)
    hi = m > SQRT2
    m = m * 0.5 if hi else m
    e = np.int64(ebits) + (1 if hi else 0) - (54 if sub else 0)
    ef = u2f(_SHIFT_BITS + np.uint64(e)) - SHIFTER  # e as a float, no int->float conversion
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    # 2 atanh(s) = 2 s (1 + z/3 + z^2/5 + ... + z^9/21), z <= 0.0295: truncation < 1e-15
    z2 = z * z
    z4 = z2 * z2
    a0 = 1.0 / 3.0 + z * (1.0 / 5.0)
    a1 = 1.0 / 7.0 + z * (1.0 / 9.0)
    a2 = 1.0 / 11.0 + z * (1.0 / 13.0)
    a3 = 1.0 / 15.0 + z * (1.0 / 17.0)
    a4 = 1.0 / 19.0 + z * (1.0 / 21.0)
    p = (a0 + z2 * a1) + z4 * ((a2 + z2 * a3) + z4 * a4)
    # log(m) = f - f + 2s(...): keep f's digits: 2s = f - s f, so log(m) = f - s (f - 2 s z p)
    lm = f - s * (f - 2.0 * z * p)
    return ef * LN2_HI + (lm + ef * LN2_LO)


@njit(nogil=True, cache=True, error_model="numpy")
def apply(kind, x, out):
    """out = f(x) for kind 0: exp, 1: expm1, 2: log (tests measure the error)."""
    if kind == 0:
        for i in range(x.shape[0]):
            out[i] = vexp(x[i])
    elif kind == 1:
        for i in range(x.shape[0]):
            out[i] = vexpm1(x[i])
    else:
        for i in range(x.shape[0]):
            out[i] = vlog(x[i])
