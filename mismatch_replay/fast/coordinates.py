"""Coordinates and quantities: where on the kernel's coordinates a rule's thresholds fall.

Design
------
The fused kernel (`jit.coord_pass`) bins every token on four per-token *coordinates*
(`COORDINATES`): the signed difference `dp` = p - q, the log ratio `l`, and, one per
probability clamp c, the binary KLs `bkl` = max(BKL(p||q), BKL(q||p)) and `bkl_qp` =
BKL(q||p), whose tokens are also classed by the sign of l. A token rule says, per threshold
parameter, which per-token *quantity* that parameter thresholds (`Rule.quantities`, e.g.
ipo: {"eps": "|dp|"}; a clamped quantity is taken at the rule's own `clamp`). This module
holds, once per quantity (`QUANTITIES`, 13 of them):

* its coordinate;
* the *preimage* of a parameter value t: the points of the coordinate where the
  quantity crosses t (|dp| = t at dp = +-t, log r = log t at l = log t, k3 = t at the two
  roots of expm1(l) - l = t), each with the half-width of its *window*: how close to the
  point rounding could make the kernel's value and the simple path's compare differently
  with t;
* its *fixed points*: where the float function a rule evaluates changes regime whatever
  the threshold (exp and expm1 overflow above l = 709.78 and vanish below -745.2,
  0.5 l^2 overflows at |l| = 1.9e154).

The program (program.py) bins each rule's own score() between these points; tokens inside a
window take the simple path, so the windows only have to be wide enough, never exact. A new
quantity on one of the four coordinates is one `_quantity` entry here; a new coordinate is
a new case in jit.coord_pass's coordinate loop.

Windows. 0 for thresholds on l itself (`l`, `|l|`, `log r`: l = lp - lq on both paths and
the comparison is with the very float log t); 1e-9 of the point plus 1e-14 where the
quantity is exp(l), expm1(l) - l or 0.5 l^2 (their float rounding is ~1e-16 of l); 1e-13
relative for dp (the kernel's |dp| is max(p, q) (-expm1(-|l|)), a product of values within
1e-15 relative of the C library's); 1e-13 (3 |log c| + 2) absolute for a binary KL clamped
at c (a sum of terms no larger than |log c|). The kernel's exp, expm1 and log (`vmath`) are
bit-identical to `pmath`'s, which the rules use, so a token's coordinate is the simple
path's own value and the windows are a second guard, not a correction. A preset computed
as its stable form (program.py) widens them by the rule's `arith_margin`.

`SampleBatch` is a TokenBatch at given coordinate values: the coordinate's own quantities
are the values given (l, or dp and |dp|, or a binary KL) and every other input (lp, lq, p,
q, the advantage's magnitude, and for `bkl_qp` the magnitude of l) is junk of one of two
kinds, so that a score() that reads anything but its coordinate gives different bins on the
two kinds (program.py checks it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..rules import TokenBatch, safe_log

# ----------------------------------------------------------------------------- coordinates


@dataclass(frozen=True)
class Coordinate:
    """A per-token value the kernel bins (`code`: jit's C_* constant)."""

    name: str
    code: int
    clamped: bool  # one coordinate per probability clamp (the rule's `clamp` field)
    lsign: bool  # tokens also classed by the sign of l
    doc: str


COORDINATES = {
    c.name: c
    for c in (
        Coordinate("dp", 0, False, False, "p - q, signed (the stable |dp| with l's sign)"),
        Coordinate("l", 1, False, False, "l = lp - lq"),
        Coordinate("bkl", 2, True, False, "max(BKL(p||q), BKL(q||p)) at clamp c"),
        Coordinate("bkl_qp", 3, True, True, "BKL(q||p) at clamp c, classed by the sign of l"),
    )
}

# ----------------------------------------------------------------------------- windows

FMAX = float(np.finfo(np.float64).max)
LOG_MAX = math.log(FMAX)  # exp() overflows above (709.78)
LOG_TINY = -745.2  # exp() is 0 below (-745.13), subnormal up to -708.4
K2_MAX = math.sqrt(2.0) * math.sqrt(FMAX)  # 0.5 * l * l overflows above
# The kernel's |dp| and binary KLs are within ~1e-15 relative of the C library's (vmath, a
# few ulps); the windows take a hundred times that.
ERR_REL = 1e-13

Point = tuple[float, float]  # (point on the coordinate, half-width of its window)


def mapped(x: float, floor: float = 1e-14) -> Point:
    """A point where a float function of l (exp, expm1, a square) crosses a threshold, with
    a window for that function's rounding: the float score and the exact one differ by a
    few ulps, ~1e-16 of l for exp and expm1 - l, ~1e-16 relative for a square; 1e-9
    relative plus `floor` covers it many times over."""
    return x, 1e-9 * abs(x) + floor


def dp_window(x: float) -> Point:
    return x, ERR_REL * abs(x) + 1e-300


def kl_window(x: float, clamp: float) -> Point:
    """A binary KL a (la - lb) + ca (log ca - log cb) at clamp c sums terms no larger than
    |log c| (la, lb in [log c, log1p(-c)], ca in [c, 1 - c]): its error is below
    1e-15 (3 |log c| + 2) in absolute terms, however small the KL."""
    return x, ERR_REL * (3.0 * abs(math.log(clamp)) + 2.0) + 1e-300


def k3_root(t: float, sign: float) -> float | None:
    """l with expm1(l) - l = t on the side of `sign` (bisection on the float function)."""
    lo, hi = 0.0, 1.0

    def f(x: float) -> float:
        if sign > 0:
            return math.expm1(x) - x if x < LOG_MAX else math.inf
        return math.expm1(-x) + x

    while f(hi) <= t:
        if hi >= FMAX:
            return None  # k3 stays <= t on this side
        hi = min(2.0 * hi, FMAX)
    for _ in range(2000):
        mid = lo + 0.5 * (hi - lo)
        if mid in (lo, hi):
            break
        if f(mid) > t:
            hi = mid
        else:
            lo = mid
    return sign * hi


# ----------------------------------------------------------------------------- quantities


@dataclass(frozen=True)
class Quantity:
    """A per-token quantity a threshold parameter compares with its value t."""

    name: str
    coordinate: str
    doc: str
    preimage: Callable[[float, float | None], list[Point]]  # (t, clamp) -> points
    fixed: tuple[Point, ...] = ()

    def points(self, t: float, clamp: float | None, margin=(0.0, 0.0)) -> list[Point]:
        """The preimage of t, each window widened by margin = (relative, absolute)."""
        rel, ab = margin
        out = self.preimage(float(t), clamp)
        if rel or ab:
            out = [(x, w + (rel * abs(x) + ab)) for x, w in out]
        return out


QUANTITIES: dict[str, Quantity] = {}
_OVERFLOW = (mapped(LOG_MAX), (LOG_TINY, 1.0))  # exp / expm1 overflow and underflow


def _quantity(name: str, coordinate: str, doc: str, fixed: tuple[Point, ...] = ()):
    def add(fn):
        QUANTITIES[name] = Quantity(name, coordinate, doc, fn, fixed)
        return fn

    return add


@_quantity("l", "l", "l itself (exact: l = lp - lq on both paths)")
def _l(t, clamp):
    return [(t, 0.0)]


@_quantity("|l|", "l", "|l| (exact: -t and t)")
def _abs_l(t, clamp):
    return [(t, 0.0), (-t, 0.0)]


@_quantity("log r", "l", "the ratio bound t compared in log space: l against log t (exact)")
def _log_r(t, clamp):
    return [(safe_log(t), 0.0)]


@_quantity("r", "l", "the ratio exp(l) against t", _OVERFLOW)
def _r(t, clamp):
    return [mapped(math.log(t))] if t > 0 else []


@_quantity("r-1", "l", "the ratio's rise r - 1 against t: r > 1 + t", _OVERFLOW)
def _r_rise(t, clamp):
    return [mapped(math.log(1.0 + t))] if 1.0 + t > 0 else []


@_quantity("1-r", "l", "the ratio's drop 1 - r against t: r < 1 - t", _OVERFLOW)
def _r_drop(t, clamp):
    return [mapped(math.log(1.0 - t))] if 1.0 - t > 0 else []


@_quantity("k2", "l", "k2 = 0.5 l^2", (mapped(K2_MAX, 0.0), mapped(-K2_MAX, 0.0)))
def _k2(t, clamp):
    out = []
    if t >= 0:
        root = math.sqrt(2.0 * t)
        out += [mapped(root, 0.0), mapped(-root, 0.0)]
    if t <= 0:  # 0.5 * l * l underflows to 0 near 0
        out.append((0.0, 1e-150))
    return out


@_quantity("k3", "l", "k3 = expm1(l) - l", _OVERFLOW)
def _k3(t, clamp):
    if t <= 0:
        return [(0.0, 1e-7)]  # k3 = 0 up to rounding near l = 0
    roots = (k3_root(t, s) for s in (1.0, -1.0))
    return [mapped(x) for x in roots if x is not None]


@_quantity("dp", "dp", "p - q: a rise of p above q")
def _dp(t, clamp):
    return [dp_window(t)]


@_quantity("-dp", "dp", "q - p: a drop of p below q")
def _neg_dp(t, clamp):
    return [dp_window(-t)]


@_quantity("|dp|", "dp", "|p - q|")
def _abs_dp(t, clamp):
    return [dp_window(t), dp_window(-t)]


@_quantity("bkl", "bkl", "max(BKL(p||q), BKL(q||p)) at the rule's clamp")
def _bkl(t, clamp):
    return [kl_window(t, clamp)]


@_quantity("bkl(q||p)", "bkl_qp", "BKL(q||p) at the rule's clamp (with the sign of l)")
def _bkl_qp(t, clamp):
    return [kl_window(t, clamp)]


# ----------------------------------------------------------------------------- samples

A_OF_CLASS = (0.0, 1.0, -1.0)  # the kernel's classes of the advantage: a == 0, a > 0, a < 0
L_OF_CLASS = (0.0, 1.0, -1.0)  # ... and of the sign of l (bkl_qp)
JUNK_KINDS = 2


_JUNK: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}


def _junk(n: int, kind: int) -> tuple[np.ndarray, ...]:
    """lp, lq, the advantage's magnitude and l's magnitude, junk of one of two kinds (the
    same arrays for every plan of a program: cached, read-only)."""
    got = _JUNK.get((n, kind))
    if got is None:
        if len(_JUNK) > 8:
            _JUNK.clear()
        got = _JUNK[n, kind] = _draw_junk(n, kind)
        for a in got:
            a.flags.writeable = False
    return got


def _draw_junk(n: int, kind: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1000 + kind)
    if kind == 0:
        return rng.uniform(-8.0, 0.0, n), rng.uniform(-8.0, 0.0, n), np.ones(n), np.ones(n)
    lp, lq = rng.uniform(-40.0, 0.0, n), rng.uniform(-40.0, 0.0, n)
    return lp, lq, 10.0 ** rng.uniform(-3.0, 3.0, n), 10.0 ** rng.uniform(-6.0, 2.0, n)


class SampleBatch(TokenBatch):
    """A float64 TokenBatch at coordinate values `x` (see the module docstring): `l`, or
    `dp` and `abs_dp`, or `bkl(clamp)` / `bkl_qp(clamp)` are x; the advantage has the sign
    `adv` and, for bkl_qp, l the sign `lsign` (numbers, or arrays like x); everything else
    is junk of kind `junk`."""

    def __init__(self, coordinate: str, x, clamp, adv, lsign, junk: int):
        x = np.asarray(x, dtype=np.float64)
        lp, lq, amag, lmag = _junk(x.shape[0], junk)
        super().__init__(lp, lq, adv * amag)
        self.coordinate = coordinate
        self.clamp = clamp
        self.x = x
        # a cached_property is set by assigning to it: the derived quantities (r, k3, ...)
        # then follow from the given value
        if coordinate == "l":
            self.l = x
        elif coordinate == "dp":
            self.dp = x
            self.abs_dp = np.abs(x)
        elif coordinate == "bkl_qp":
            self.l = lsign * lmag

    def bkl(self, clamp: float) -> np.ndarray:
        if self.coordinate == "bkl" and clamp == self.clamp:
            return self.x
        return super().bkl(clamp)

    def bkl_qp(self, clamp: float) -> np.ndarray:
        if self.coordinate == "bkl_qp" and clamp == self.clamp:
            return self.x
        return super().bkl_qp(clamp)
