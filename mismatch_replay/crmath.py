"""Correctly rounded exp and expm1 on float64 arrays: the frameworks' ties, bit for bit.

Design
------
A preset reproduces its framework's comparison at a tie: `exp(l) > cap` with exp(l) one
ulp from cap, `exp(lp) - exp(lq) < -low` with the difference exactly -low. There the
decision is the last bit of exp. torch's exp (and CUDA's, and glibc's) returns the
correctly rounded result on such values; pmath's (2-3 ulps, the same bits on every CPU) is
off by one ulp on some of them: pmath.exp(-0.2231435513142098) = 0.8, the correctly
rounded value is 0.7999999999999999, and ppo-clip's `r < 0.8` decides the other way.

`exp` and `expm1` here compute exp(x) in double-double arithmetic (~104 bits) and round
once: the correctly rounded float64 unless the true value lies within ~2^-100 (relative)
of a midpoint between two floats (exp's hardest float64 cases lie 2^-112 from one; none is
a log-prob a run produces). They use only IEEE additions and multiplications (Dekker's
products, no fused multiply-add), so the bits are the same on every CPU. About 250 numpy
passes a call (~50 ns a value): the presets' replays in exact arithmetic call them, on the
tokens the fused path could not decide or, on the simple path, on whole batches.

Algorithm: x = k ln 2 + r (ln 2 in three parts, 32 + 53 + 53 bits: k ln2_hi is exact),
r in double-double, |r| <= 0.35; s = r / 2^10; expm1(s) by its Taylor series to s^9 in
double-double (|s| < 3.4e-4: the remainder is below 2^-120); ten doublings
expm1(2s) = expm1(s) (expm1(s) + 2); then 2^k (1 + e) (exp) or 2^k (1 + e) - 1 (expm1),
rounded once. Results below the normal range (x < -708) and above it are pmath's (0 and
inf to the last bit at the extremes; a subnormal p decides no threshold).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from . import pmath

_SPLIT = 134217729.0  # 2^27 + 1 (Dekker's split)
LN2_HI = 0.6931471803691238  # 32 significant bits: k * LN2_HI is exact for |k| < 2^21
_LN2 = Fraction(
    "0.693147180559945309417232121458176568075500134360255254120680009493393621969694715605863"
)
LN2_MID = float(_LN2 - Fraction(LN2_HI))
LN2_LO = float(_LN2 - Fraction(LN2_HI) - Fraction(LN2_MID))
SCALE = 10  # r / 2^SCALE before the series, then SCALE doublings
# 1/n! as double-doubles (hi, lo), n = 2..9
_INV_FACT = []
_f = Fraction(1)
for _n in range(1, 10):
    _f /= _n
    if _n >= 2:
        _hi = float(_f)
        _INV_FACT.append((_hi, float(_f - Fraction(_hi))))
X_MIN = -708.0  # below: the result is near or below the normal range (pmath's)
X_MAX = 709.7  # above: near overflow (pmath's)


def _two_sum(a, b):
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _fast_two_sum(a, b):
    s = a + b
    return s, b - (s - a)


def _split(a):
    c = _SPLIT * a
    hi = c - (c - a)
    return hi, a - hi


def _two_prod(a, b):
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _dd_add(ah, al, bh, bl):
    s, e = _two_sum(ah, bh)
    t, f = _two_sum(al, bl)
    e = e + t
    s, e = _fast_two_sum(s, e)
    e = e + f
    return _fast_two_sum(s, e)


def _dd_mul(ah, al, bh, bl):
    p, e = _two_prod(ah, bh)
    e = e + (ah * bl + al * bh)
    return _fast_two_sum(p, e)


def _expm1_dd(x: np.ndarray):
    """(k, eh, el): exp(x) = 2^k (1 + eh + el), the double-double eh + el ~ expm1(r)."""
    k = np.rint(x * 1.4426950408889634)
    rh = x - k * LN2_HI  # exact (Cody and Waite)
    ph, pl = _two_prod(k, LN2_MID)
    rh, rl = _dd_add(rh, np.zeros_like(rh), -ph, -pl)
    rl = rl - k * LN2_LO
    rh, rl = _fast_two_sum(rh, rl)
    scale = 2.0**-SCALE
    sh, sl = rh * scale, rl * scale  # exact
    # Horner on 1/2! + s (1/3! + s (... 1/9!)) in double-double, then e = s + s^2 * that
    ch, cl = _INV_FACT[-1]
    ch = np.full_like(sh, ch)
    cl = np.full_like(sh, cl)
    for fh, fl in reversed(_INV_FACT[:-1]):
        ch, cl = _dd_mul(ch, cl, sh, sl)
        ch, cl = _dd_add(ch, cl, np.full_like(sh, fh), np.full_like(sh, fl))
    ch, cl = _dd_mul(ch, cl, sh, sl)  # s (1/2 + ...)
    ch, cl = _dd_add(ch, cl, np.ones_like(sh), np.zeros_like(sh))  # 1 + s/2 + ...
    eh, el = _dd_mul(ch, cl, sh, sl)  # expm1(s)
    for _ in range(SCALE):  # expm1(2s) = expm1(s) (expm1(s) + 2)
        th, tl = _dd_add(eh, el, np.full_like(eh, 2.0), np.zeros_like(eh))
        eh, el = _dd_mul(eh, el, th, tl)
    return k, eh, el


def _arr(x):
    a = np.asarray(x, dtype=np.float64)
    return np.atleast_1d(a).astype(np.float64, copy=True), a.ndim == 0


def exp(x):
    """exp(x), correctly rounded (module docstring), elementwise, float64."""
    x, scalar = _arr(x)
    out = pmath.exp_numpy(x)
    mid = (x >= X_MIN) & (x <= X_MAX)
    if mid.any():
        xm = x[mid]
        k, eh, el = _expm1_dd(xm)
        yh, yl = _dd_add(np.ones_like(eh), np.zeros_like(eh), eh, el)
        # 2^k is exact for the normal results here; hi + lo rounds once
        out[mid] = np.ldexp(yh + yl, k.astype(np.int64))
    return float(out[0]) if scalar else out


def expm1(x):
    """exp(x) - 1, correctly rounded (module docstring), elementwise, float64."""
    x, scalar = _arr(x)
    out = pmath.expm1_numpy(x)
    mid = (x >= X_MIN) & (x <= X_MAX) & (x != 0.0)
    if mid.any():
        xm = x[mid]
        k, eh, el = _expm1_dd(xm)
        yh, yl = _dd_add(np.ones_like(eh), np.zeros_like(eh), eh, el)
        ki = k.astype(np.int64)
        yh, yl = np.ldexp(yh, ki), np.ldexp(yl, ki)  # exact (|k| <= 1022 here)
        zh, zl = _dd_add(yh, yl, -np.ones_like(yh), np.zeros_like(yh))
        # k == 0: e itself (no cancellation to fear); else 2^k (1 + e) - 1
        out[mid] = np.where(ki == 0, eh + el, zh + zl)
    return float(out[0]) if scalar else out
