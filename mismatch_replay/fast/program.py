"""Programs: a Tally's token jobs compiled, from the rules' own score(), into the kernel's tables.

Design
------
The simple path (engine) bins each job's `score()` against its sorted thresholds
(`np.searchsorted`, the rule's `inclusive` side, +inf to bin K + 1). The fused kernel does
not run the rules: it bins each token once per *coordinate* (coordinates.py: dp, l and the
binary KLs at each clamp) and adds it to its (group, class, interval) sums. This module
works out, from the rules themselves, which bin each interval of a coordinate means for
each job:

1. `plan_job`: a token job whose rule declares, for the swept parameter, the quantity it
   thresholds (`Rule.quantities`) becomes a `Plan`: its coordinate, its thresholds in score
   space and its *critical points*, the preimages (coordinates.py) of the swept values and
   of the fixed values of the rule's other threshold parameters, plus their quantities'
   fixed points, each with its window. A preset with its framework's arithmetic
   (`rule.arith`) is planned as its stable form `rule.replace(preset="")` with every window
   widened by `rule.arith_margin(...)`, where the rule says the two forms agree but for
   rounding near a threshold (tokens in a window take the simple path, which runs the
   framework's own formula); a preset without one, a float32 replay, a sequence or step
   rule and a rule without declarations run on the simple path. `Program.reasons` says why,
   job by job (None: fused).
2. `build_coordinate`: the windows of all the plans on a coordinate cut it into intervals;
   on 16 points spread over each interval (in key order, so that an interval spanning many
   binades is sampled in each) every plan's bins come from its rule's own score() on a
   `SampleBatch` (the coordinate's values given, everything else junk), class by class
   (class = sign of the advantage, and of l on bkl_qp), binned as the simple path bins.
   The derivation is checked, not trusted: a plan whose bins differ on the two kinds of
   junk is not a function of its coordinate; one whose bin changes inside an interval
   changes away from its declared critical points; one whose bins do not fall then rise
   along the coordinate would break the sequence maxima below; a weight rule's weight()
   must be, interval by interval, the clamped ratio (summed by the kernel) or a constant.
   Such a job runs on the simple path (with the reason) and the coordinate is rebuilt
   without it. So a rule defined anywhere, on an existing quantity, is one class: its
   score() is the only implementation, on both paths.
3. `Program`: jobs with the same bins in every interval and class share a kernel slot (the
   same counts: icepop and token-mis on the same band); per slot the output is K + 2 bins,
   so `expand` hands the engine (groups, K + 2) arrays. A sequence's highest bin comes from
   its lowest and highest interval per class (`seq_max`: quasi-convex bins, checked above).

The default sweep's 22 token jobs compile to 19 slots (icepop and token-mis share theirs, as
do tis and cispo with low = 0) on 4 coordinates of 245 (dp), 977 (l), 122 and 123 intervals,
in ~0.04 s of CPU, once per Tally; the work per token does not grow with the number of rules
and thresholds.

Binning a coordinate is direct indexing: the value's order-preserving 64-bit key, with the
~2000 binades of tiny values squeezed out (`make_coord_binner`: |x| below half the smallest
critical point bins without the table, far outliers such as the 1.9e154 where l^2/2
overflows are scanned) indexes a table of 16384 buckets (`flag_lut`, uint16): a bucket
without an edge holds its bin, so most tokens take one load and no comparison (4-5 ns vs
~12 for comparing with the bucket's edges, measured in isolation); a flagged bucket (2-9%
of tokens on the benchmark log) compares the value with its few edges. `make_binner` is the
same table for a sequence rule's sorted thresholds (runner.bin_scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .coordinates import (
    A_OF_CLASS,
    COORDINATES,
    FMAX,
    JUNK_KINDS,
    L_OF_CLASS,
    QUANTITIES,
    Point,
    Quantity,
    SampleBatch,
)

# ----------------------------------------------------------------------------- binning

_SIGN = np.uint64(1 << 63)
MAX_LUT = 2048


def float_keys(x: np.ndarray) -> np.ndarray:
    """uint64 keys with the order of the float64 values (-0.0 and 0.0 share a key)."""
    u = (np.asarray(x, dtype=np.float64) + 0.0).view(np.uint64)
    return np.where((u >> np.uint64(63)) == 1, ~u, u | _SIGN)


_U64_0 = np.uint64(0)


@dataclass(frozen=True)
class Binner:
    """Direct binning against sorted thresholds: see the module docstring."""

    thr: np.ndarray  # (K,) float64, ascending
    incl: bool
    lut: np.ndarray  # (nl + 3,) int64: [0, thresholds with a key below each bucket..., K, K]
    nl: int  # buckets
    klo: np.uint64
    khi: np.uint64
    shift: np.uint64
    # compact keys (coordinates): |x| <= tiny bins to nz without the table, and keys of
    # x >= tiny drop by gap, so the ~2000 binades of tiny values take no table entries
    tiny: float = -1.0
    nz: int = 0
    gap: np.uint64 = _U64_0
    kpos: np.uint64 = _U64_0


_BINNERS: dict = {}


def make_binner(thr_sorted: np.ndarray, inclusive: bool, max_lut: int = MAX_LUT) -> Binner:
    thr = np.ascontiguousarray(thr_sorted, dtype=np.float64)
    ck = (thr.tobytes(), bool(inclusive), max_lut)
    hit = _BINNERS.get(ck)
    if hit is not None:
        return hit
    if len(_BINNERS) > 256:
        _BINNERS.clear()
    _BINNERS[ck] = b = _make_binner(thr, inclusive, max_lut)
    return b


def make_coord_binner(edges: np.ndarray, max_lut: int) -> Binner:
    """An inclusive binner (edges <= x) on compact keys: see Binner.tiny."""
    edges = np.ascontiguousarray(edges, dtype=np.float64)
    fin = np.abs(edges[np.isfinite(edges)])
    smallest = fin.min() if fin.size else 0.0
    if smallest < 1e-300:  # an edge at or near 0: plain keys
        return _make_binner(edges, True, max_lut)
    tiny = 0.5 * float(smallest)
    kneg, kpos = (int(k) for k in float_keys(np.array([-tiny, tiny])))
    gap = kpos - kneg - 1
    nz = int(np.searchsorted(edges, 0.0, side="right"))
    # the table spans the core of the edges: far outliers (overflow points such as the
    # 1.9e154 where l^2/2 overflows) would stretch every bucket; values beyond the core
    # scan the few outliers instead
    big = 1e4 * float(np.median(fin))
    core = edges[np.abs(edges) <= big]
    span = (float(core[0]), float(core[-1])) if core.size else None
    return _make_binner(edges, True, max_lut, (tiny, nz, gap, kpos), span)


def compact_keys(x: np.ndarray, bn: Binner) -> np.ndarray:
    k = float_keys(x)
    return np.where(k >= bn.kpos, k - bn.gap, k)


def _make_binner(thr: np.ndarray, inclusive: bool, max_lut: int, compact=None, span=None) -> Binner:
    if thr.size == 0 or np.isnan(thr).any():
        raise ValueError("thresholds must be non-empty and not NaN")
    max_lut = max(int(max_lut), 4)  # span >> shift < 3 needs shift <= 63 (a shift of 64
    keys = float_keys(thr)  # is undefined on uint64)
    if compact is not None:
        keys = np.where(keys >= np.uint64(compact[3]), keys - np.uint64(compact[2]), keys)
    klo, khi = int(keys[0]), int(keys[-1])
    if span is not None:  # the table covers [span]; keys outside it scan the rest
        ks = float_keys(np.array(span, dtype=np.float64))
        if compact is not None:
            ks = np.where(ks >= np.uint64(compact[3]), ks - np.uint64(compact[2]), ks)
        klo, khi = int(ks[0]), int(ks[1])
    span = khi - klo
    shift = 0
    while (span >> shift) >= max_lut - 1:
        shift += 1
    nl = (span >> shift) + 1
    # bucket u starts at key klo + u << shift (the last start may pass 2**64 - 1: clip it)
    idx = np.arange(nl + 1, dtype=np.uint64)
    u = idx << np.uint64(shift)
    starts = np.uint64(klo) + u
    over = (starts < u) | (idx >= np.uint64(1 << (64 - shift)) if shift else False)
    starts[over] = np.uint64((1 << 64) - 1)  # past the last key
    below = np.searchsorted(keys, starts, side="left")
    lut = np.concatenate([[0], below, [thr.size]]).astype(np.int64)
    b = Binner(thr, bool(inclusive), lut, nl, np.uint64(klo), np.uint64(khi), np.uint64(shift))
    if compact is not None:
        tiny, nz, gap, kpos = compact
        b = replace(b, tiny=float(tiny), nz=int(nz), gap=np.uint64(gap), kpos=np.uint64(kpos))
    return b


def flag_lut(lut: np.ndarray, flag: int) -> np.ndarray:
    """A coordinate's table for the kernel: entry u is the bin of every value in bucket u
    (lut[u]) when the bucket holds no edge, else lut[u] | flag (then lut[u + 1], unflagged,
    ends the edges to compare). Most tokens fall in buckets without an edge: one load."""
    lut = np.asarray(lut, dtype=np.int64)
    if lut.size and int(lut.max()) >= flag:
        raise ValueError(f"internal error: {int(lut.max())} edges do not fit under flag {flag}")
    out = lut.copy()
    out[:-1][lut[:-1] < lut[1:]] |= flag
    return out


def flagged_bins(score: np.ndarray, bn: Binner, flagged: np.ndarray, flag: int) -> np.ndarray:
    """The kernel's binning on a flagged table (flag_lut), in numpy: the tests check it
    against np.searchsorted, and the kernel against the simple path."""
    score = np.asarray(score, dtype=np.float64)
    keys = compact_keys(score, bn) if bn.tiny >= 0 else float_keys(score)
    below = keys < bn.klo
    above = keys > bn.khi
    d = np.where(below | above, np.uint64(0), keys - bn.klo) >> bn.shift
    idx = np.where(below, 0, np.where(above, bn.nl + 1, d.astype(np.int64) + 1))
    v = flagged[idx].astype(np.int64)
    slow = (v & flag) != 0
    b = v & (flag - 1)
    e = np.where(
        slow, flagged[np.minimum(idx + 1, flagged.size - 1)].astype(np.int64) & (flag - 1), b
    )
    k = bn.thr.shape[0]
    while True:
        open_ = b < e
        if not open_.any():
            break
        step = open_ & (score >= bn.thr[np.minimum(b, k - 1)])
        b = b + step
        e = np.where(step, e, b)
    b = np.where(score == math.inf, k + 1, b)
    if bn.tiny >= 0:
        b = np.where(np.abs(score) <= bn.tiny, bn.nz, b)
    return b


def lut_bins(score: np.ndarray, bn: Binner) -> np.ndarray:
    """The kernel's direct binning, in numpy (tests check it against np.searchsorted on
    machines without numba too)."""
    score = np.asarray(score, dtype=np.float64)
    keys = compact_keys(score, bn) if bn.tiny >= 0 else float_keys(score)
    k = bn.thr.shape[0]
    below = keys < bn.klo
    above = keys > bn.khi
    d = np.where(below | above, np.uint64(0), keys - bn.klo) >> bn.shift
    idx = np.where(below, 0, np.where(above, bn.nl + 1, d.astype(np.int64) + 1))
    b = bn.lut[idx].copy()
    e = bn.lut[idx + 1]
    while True:
        open_ = b < e
        if not open_.any():
            break
        t = bn.thr[np.minimum(b, k - 1)]
        step = open_ & ((score >= t) if bn.incl else (score > t))
        if not step.any():
            break
        b += step
        e = np.where(step, e, b)  # a failed comparison closes the range
    b[score == math.inf] = k + 1
    if bn.tiny >= 0:
        b[np.abs(score) <= bn.tiny] = bn.nz
    return b


def key_floats(keys: np.ndarray) -> np.ndarray:
    """float_keys' inverse (key 0x8000... gives +0.0)."""
    keys = keys.astype(np.uint64)
    pos = (keys & _SIGN) != 0
    bits = np.where(pos, keys ^ _SIGN, ~keys)
    return bits.view(np.float64)


def reference_bins(score: np.ndarray, thr_sorted: np.ndarray, inclusive: bool) -> np.ndarray:
    """The simple path's bins: the number of thresholds a score exceeds (>= when inclusive),
    K + 1 for +inf (a token the rule's fixed side masks at every value)."""
    b = np.searchsorted(thr_sorted, score, side="right" if inclusive else "left")
    b[score == math.inf] = thr_sorted.shape[0] + 1
    return b


# ----------------------------------------------------------------------------- plans


@dataclass
class Plan:
    """A token job as the program compiles it: `rule` (the job's, or its preset's stable
    form) decides with its own score() and weight(); `thr` are its thresholds in score
    space, ascending (the job's order); `points` its critical points with their windows."""

    rule: object
    param: str
    quantity: Quantity
    clamp: float | None
    thr: np.ndarray
    inclusive: bool
    points: list[Point]
    weighted: bool

    @property
    def coordinate(self) -> tuple[str, float | None]:
        return self.quantity.coordinate, self.clamp


def plan_job(job) -> Plan | str:
    """A job (rule, param, values, order) as a Plan, or why the simple path runs it."""
    rule, param = job.rule, job.param
    if rule.level != "token":
        return f"{rule.level} rule"
    if rule.precision != "float64":
        return f"{rule.precision} replay"
    basis, margin = rule, (0.0, 0.0)
    if rule.arith or rule.ops == "exact":  # a preset's formula, or its correctly rounded exp
        margin = rule.arith_margin(param, job.values)
        if margin is None:
            return f"preset arithmetic '{rule.arith}' (its own formula)"
        basis = rule.replace(preset="")
    declared = basis.quantities
    if param not in declared:
        return "no declared quantity"
    q = QUANTITIES.get(declared[param])
    if q is None:
        return f"unknown quantity '{declared[param]}'"
    coord = COORDINATES[q.coordinate]
    clamp = getattr(basis, "clamp", None) if coord.clamped else None
    if coord.clamped:
        if clamp is None or not 0.0 < float(clamp) < 0.5:
            return "no probability clamp in (0, 0.5)"
        clamp = float(clamp)
    if rule.kind == "weight" and coord.name != "l":
        return "a weight off l (the kernel sums weights on l)"
    values = np.asarray(job.values, dtype=np.float64)
    thr = np.array([basis.threshold(param, v) for v in values], dtype=np.float64)
    order = np.argsort(thr, kind="stable")
    if not np.array_equal(order, job.order):
        return "the stable form orders the thresholds differently"
    points = [pt for v in values for pt in q.points(v, clamp, margin)] + list(q.fixed)
    for other, name in declared.items():
        if other == param:
            continue
        value, q2 = getattr(basis, other, None), QUANTITIES.get(name)
        if q2 is None:
            return f"unknown quantity '{name}'"
        if value is None:
            return f"{other} has no value"
        if q2.coordinate != q.coordinate:
            return f"{param} and {other} threshold different coordinates"
        points += q2.points(value, clamp, margin) + list(q2.fixed)
    points = [(x, w) for x, w in points if math.isfinite(x)]
    return Plan(
        basis, param, q, clamp, thr[order], bool(rule.inclusive), points, rule.kind == "weight"
    )


def scores_on(plan: Plan, b: SampleBatch):
    """The plan's score (and weight, for a weight rule) on a SampleBatch: its rule's own
    score() and weight()."""
    with np.errstate(all="ignore"):
        s = np.asarray(plan.rule.score(b, plan.param), dtype=np.float64)
        w = np.asarray(plan.rule.weight(b, plan.param), np.float64) if plan.weighted else None
    return s, w


def sample_bins(plan: Plan, x, adv, lsign, junk: int = 0) -> np.ndarray:
    """The plan's bins at coordinate values x, with the advantage's and l's signs adv and
    lsign (numbers or arrays like x), as the simple path bins its score."""
    b = SampleBatch(plan.quantity.coordinate, x, plan.clamp, adv, lsign, junk)
    return reference_bins(scores_on(plan, b)[0], plan.thr, plan.inclusive)


# ----------------------------------------------------------------------------- coordinates

N_SAMPLES = 16
COORD_LUT = 1 << 14  # buckets of a coordinate's table (32 KiB as uint16)
MAX_COORDS = 32  # bits of a token's window flags (uint32)


def merge(ranges) -> list[list[float]]:
    """Sorted disjoint windows [lo, hi] from ranges; overlapping or touching ones merge."""
    out: list[list[float]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= float(np.nextafter(out[-1][1], math.inf)):
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def samples(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(intervals, N_SAMPLES) floats from each start to its end (both included), evenly
    spaced in key order (so that an interval spanning many binades is sampled in each)."""
    ka = float_keys(starts)
    kb = float_keys(ends)
    step = (kb - ka) // np.uint64(N_SAMPLES - 1)
    i = np.arange(N_SAMPLES, dtype=np.uint64)
    ks = ka[:, None] + step[:, None] * i[None, :]
    ks[:, -1] = kb
    return key_floats(ks.reshape(-1)).reshape(ks.shape)


@dataclass
class Coord:
    """One coordinate of a Program: its windows, and each of its slots' bin per interval.

    Windows W_0 < ... < W_{M-1} cut the coordinate into intervals I_0 .. I_M (I_i lies
    between W_{i-1} and W_i). The kernel bins a token's coordinate on `edges` = [lo_0,
    next(hi_0), lo_1, next(hi_1), ...] counting the edges <= x: odd = inside a window (the
    token goes to the simple path), even 2i = interval I_i. The kernel's class of a token is
    ma * (advantage class) + ml * (class of the sign of l); `classes[c]` = (advantage, sign
    of l) standing for class c. `jobbin[s, c, i]` is the bin of the coordinate's s-th slot
    for class c in interval I_i (index M + 1: -1, "no token"); `wconst[s, c, i]` its weight
    there: NaN for the clamped ratio (the kernel's sums), else a constant.
    """

    kind: str
    clamp: float | None
    classes: list[tuple[float, float]]
    ma: int
    ml: int
    slots: list[int]
    plans: list[Plan]  # the plan of each slot (its first job's)
    edges: np.ndarray
    binner: Binner
    jobbin: np.ndarray  # (len(slots), ncls, M + 2) int64
    wconst: np.ndarray  # (len(slots), ncls, M + 1) float64

    @property
    def ncls(self) -> int:
        return len(self.classes)

    @property
    def intervals(self) -> int:
        return self.edges.shape[0] // 2 + 1


def _derive(plan: Plan, kind: str, batches, shape, empty: np.ndarray) -> str | tuple:
    """A plan's bins (and weights), shape (classes, intervals, N_SAMPLES), from its scores on
    `batches` (one SampleBatch per kind of junk, every class's copy of the samples in one),
    or why they cannot be derived (module docstring, step 2)."""
    got = []
    for b in batches:
        try:
            score, w = scores_on(plan, b)
        except Exception as exc:  # the simple path runs it, and says what fails there
            return f"score() fails on {kind} samples ({type(exc).__name__})"
        if np.isnan(score).any():
            return f"score is NaN at some {kind} values"
        bins = reference_bins(score, plan.thr, plan.inclusive).reshape(shape)
        if w is not None:
            w = np.broadcast_to(w, score.shape).reshape(shape)
        got.append((bins, w))
    (bins, w), (bins2, w2) = got
    if not np.array_equal(bins, bins2):
        return f"score is not a function of {kind} (checked)"
    if w is not None and not np.array_equal(w, w2, equal_nan=True):
        return f"weight is not a function of {kind} (checked)"
    if not ((bins == bins[..., :1]).all(axis=2) | empty).all():
        return "bins change between its critical points (checked)"
    mid = bins[..., N_SAMPLES // 2]
    d = np.diff(mid, axis=1)
    if ((d < 0) & (np.cumsum(d > 0, axis=1) > 0)).any():
        return f"bins are not quasi-convex along {kind} (sequence maxima)"
    if w is None:
        return mid, None
    rat = (w == batches[0].r_clamped.reshape(shape)).all(axis=2)
    const = (w == w[..., :1]).all(axis=2)
    if not (rat | const | empty).all():
        return "weight is neither the clamped ratio nor a constant between critical points"
    return mid, np.where(rat, np.nan, w[..., N_SAMPLES // 2])


def build_coordinate(kind: str, clamp, plans: dict[int, Plan]):
    """The windows and interval bins of one coordinate shared by `plans` (job index ->
    Plan): (edges, classes, ma, ml, {job: (jobbin, wconst)}) or None when no plan is left,
    and {job: reason} for the plans that cannot be derived."""
    lsign = COORDINATES[kind].lsign
    full = [(a, s) for a in A_OF_CLASS for s in (L_OF_CLASS if lsign else (0.0,))]
    rejected: dict[int, str] = {}
    live = dict(plans)
    while live:
        points = [pt for p in live.values() for pt in p.points] or [(-FMAX, 0.0)]
        wins = merge((x - w, x + w) for x, w in points)
        lo = np.array([w[0] for w in wins])
        hi = np.array([w[1] for w in wins])
        with np.errstate(over="ignore"):
            starts = np.r_[-FMAX, np.nextafter(hi, math.inf)]
            ends = np.r_[np.nextafter(lo, -math.inf), FMAX]
        empty = starts > ends  # no float lies between two windows
        starts = np.where(empty, ends, starts)
        xs = samples(starts, ends)
        # every class's copy of the samples, with its signs, in one batch per kind of junk,
        # shared by the plans (the quantities they derive from x are computed once)
        x = np.tile(xs.reshape(-1), len(full))
        x.flags.writeable = False
        adv = np.repeat([a for a, _ in full], xs.size)
        sgn = np.repeat([s for _, s in full], xs.size)
        batches = [SampleBatch(kind, x, clamp, adv, sgn, j) for j in range(JUNK_KINDS)]
        rows = {}
        for ji, p in live.items():
            got = _derive(p, kind, batches, (len(full), *xs.shape), empty)
            if isinstance(got, str):
                rejected[ji] = got
            else:
                rows[ji] = got
        if len(rows) == len(live):
            break
        live = {ji: live[ji] for ji in rows}  # again, without their critical points
    else:
        return None, rejected
    # the classes the plans tell apart: the sign of the advantage, and of l (bkl_qp)
    na, ns = len(A_OF_CLASS), len(full) // len(A_OF_CLASS)
    cubes = [a.reshape(na, ns, -1) for row in rows.values() for a in row if a is not None]
    by_adv = any(not np.array_equal(c, c[:1].repeat(na, 0), equal_nan=True) for c in cubes)
    by_l = any(not np.array_equal(c, c[:, :1].repeat(ns, 1), equal_nan=True) for c in cubes)
    ai = range(na) if by_adv else (0,)
    si = range(ns) if by_l else (0,)
    pick = [a * ns + s for a in ai for s in si]
    classes = [full[i] for i in pick]
    ma, ml = (len(si) if by_adv else 0), (1 if by_l else 0)
    m = lo.shape[0]
    out = {}
    for ji, (mid, wc) in rows.items():
        jb = np.full((len(pick), m + 2), -1, dtype=np.int64)
        jb[:, : m + 1] = mid[pick]
        wt = np.full((len(pick), m + 1), np.nan) if wc is None else wc[pick]
        out[ji] = (jb, wt)
    with np.errstate(over="ignore"):  # a window up to the largest float ends at +inf
        edges = np.array([v for a, b in wins for v in (a, float(np.nextafter(b, math.inf)))])
    return (edges, classes, ma, ml, out), rejected


class TooManyCoordinates(ValueError):
    """More coordinates than flag bits: 15+ distinct binary-KL clamps in one sweep."""


class Program:
    """The compiled token jobs of a Tally, as the arrays the kernel reads.

    `slot[ji]` is the kernel slot of job ji (jobs with the same bins share one), or -1
    where the simple path runs the job, for the reason `reasons[ji]` (None when fused).
    Slots are grouped by coordinate (`coords`, in COORDINATES order, one per clamp for the
    binary KLs). Per slot the output is K + 2 bins at `off` (and weight bins at `woff`), so
    `take()` hands the engine (groups, K + 2) arrays.
    """

    def __init__(self, jobs, direction: bool = False, entropy: bool = False):
        # direction (a log with an advantage): the kernel also sums, per interval, |A| and
        # the corrective and divergent tokens (engine/bins.direction_class), entropy: the
        # finite entropies and their count, beside count and mass (`expand`: what a mask
        # costs, per bin)
        self.direction = bool(direction)
        self.entropy = bool(entropy)  # the log has an entropy column: its sums too
        self.reasons: list[str | None] = [None] * len(jobs)
        groups: dict[tuple, dict[int, Plan]] = {}
        for ji, job in enumerate(jobs):
            got = plan_job(job)
            if isinstance(got, str):
                self.reasons[ji] = got
            else:
                groups.setdefault(got.coordinate, {})[ji] = got
        if len(groups) > MAX_COORDS:  # one flag bit a coordinate (engine: the simple path)
            raise TooManyCoordinates(
                f"{len(groups)} coordinates (distinct binary-KL clamps?): the kernel takes "
                f"{MAX_COORDS}"
            )
        built = []
        for key in sorted(groups, key=lambda k: COORDINATES[k[0]].code):
            got, rejected = build_coordinate(*key, groups[key])
            for ji, why in rejected.items():
                self.reasons[ji] = why
            if got is not None:
                built.append((key, groups[key], got))
        # slots: jobs whose bins and weights agree in every interval and class share one
        self.slot = [-1] * len(jobs)
        where = {ji: ci for ci, (_, _, got) in enumerate(built) for ji in got[4]}
        sigs: dict[tuple, int] = {}
        slot_plan: list[Plan] = []
        slot_rows: list[tuple] = []
        for ji in sorted(where):
            ci = where[ji]
            jb, wc = built[ci][2][4][ji]
            plan = built[ci][1][ji]
            sig = (ci, plan.thr.size, plan.weighted, jb.tobytes(), wc.tobytes())
            if sig not in sigs:
                sigs[sig] = len(slot_plan)
                slot_plan.append(plan)
                slot_rows.append((ci, jb, wc))
            self.slot[ji] = sigs[sig]
        self.coords: list[Coord] = []
        for ci, ((kind, clamp), _, (edges, classes, ma, ml, _rows)) in enumerate(built):
            slots = [s for s, row in enumerate(slot_rows) if row[0] == ci]
            self.coords.append(
                Coord(
                    kind,
                    clamp,
                    classes,
                    ma,
                    ml,
                    slots,
                    [slot_plan[s] for s in slots],
                    edges,
                    make_coord_binner(edges, COORD_LUT),
                    np.stack([slot_rows[s][1] for s in slots]),
                    np.stack([slot_rows[s][2] for s in slots]),
                )
            )
        self.coords = [c for c in self.coords if c.slots]
        self._layout(slot_plan)

    def _layout(self, slot_plan: list[Plan]) -> None:
        """The flat arrays coord_pass reads, and each slot's output columns."""
        u = len(slot_plan)
        self.n = u
        self.k = np.array([p.thr.size for p in slot_plan], dtype=np.int64)
        widths = self.k + 2
        self.off = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        self.width = int(widths.sum())
        self.weighted = np.array([p.weighted for p in slot_plan], dtype=bool)
        wwidths = np.where(self.weighted, widths, 0)
        woff = np.concatenate([[0], np.cumsum(wwidths)[:-1]]).astype(np.int64)
        self.woff = np.where(self.weighted, woff, -1).astype(np.int64)
        self.wwidth = int(wwidths.sum())
        if not u:
            self.off = self.woff = np.zeros(0, np.int64)
        self.coord_of_slot = np.full(u, -1, dtype=np.int64)
        for ci, c in enumerate(self.coords):
            self.coord_of_slot[c.slots] = ci
        # the jobs (indices into `jobs`) each coordinate serves: its window tokens' jobs
        self.coord_jobs = [
            [ji for ji, s in enumerate(self.slot) if s >= 0 and self.coord_of_slot[s] == ci]
            for ci in range(len(self.coords))
        ]
        clamps = sorted({c.clamp for c in self.coords if c.clamp is not None})
        self.clamps = np.array(
            [[c, math.log(c), math.log1p(-c), 1.0 - c] for c in clamps], dtype=np.float64
        ).reshape(len(clamps), 4)
        cs = self.coords
        self.ckind = np.array([COORDINATES[c.kind].code for c in cs], dtype=np.int64)
        self.ccix = np.array(
            [clamps.index(c.clamp) if c.clamp is not None else 0 for c in cs], dtype=np.int64
        )
        self.cma = np.array([c.ma for c in cs], dtype=np.uint64)
        self.cml = np.array([c.ml for c in cs], dtype=np.uint64)
        self.ck = np.array([c.edges.size for c in cs], dtype=np.int64)
        self.ct0 = np.concatenate([[0], np.cumsum(self.ck)[:-1]]).astype(np.int64)
        self.cm1 = np.array([c.intervals for c in cs], dtype=np.uint64)
        hw = np.array([c.ncls * c.intervals for c in cs], dtype=np.int64)
        self.choff = np.concatenate([[0], np.cumsum(hw)[:-1]]).astype(np.uint64)
        self.hwidth = int(hw.sum())
        sw = np.array([c.ncls for c in cs], dtype=np.int64)
        self.csoff = np.concatenate([[0], np.cumsum(sw)[:-1]]).astype(np.uint64)
        self.swidth = int(sw.sum())
        bns = [c.binner for c in cs]
        self.cnl = np.array([b.nl for b in bns], dtype=np.int64)
        self.cklo = np.array([b.klo for b in bns], dtype=np.uint64)
        self.ckhi = np.array([b.khi for b in bns], dtype=np.uint64)
        self.cshift = np.array([b.shift for b in bns], dtype=np.uint64)
        self.ctiny = np.array([b.tiny for b in bns], dtype=np.float64)
        self.cnz = np.array([b.nz for b in bns], dtype=np.uint64)
        self.cgap = np.array([b.gap for b in bns], dtype=np.uint64)
        self.ckpos = np.array([b.kpos for b in bns], dtype=np.uint64)
        sizes = [b.lut.size for b in bns]
        self.cl0 = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.edges = np.concatenate([c.edges for c in cs]) if cs else np.zeros(0)
        wide = any(c.edges.size >= (1 << 15) - 1 for c in cs)
        self.lflag = np.uint64(1 << 31 if wide else 1 << 15)
        dtype = np.uint32 if wide else np.uint16
        luts = [flag_lut(b.lut, int(self.lflag)).astype(dtype) for b in bns]
        self.lut = np.concatenate(luts) if cs else np.zeros(0, dtype)
        # weights (tis, cispo) are functions of l: the l coordinate keeps their sums
        self.weights = bool(self.weighted.any())
        # per (coordinate, class, interval): does some slot's fixed side mask it (bin K + 1,
        # a score of +inf), or a single setting (K = 1) mask it at all? The engine's tail
        # keeps those tokens (engine/tail.py): a setting's masked tokens are all kept
        self.fixed_side = np.zeros(max(self.hwidth, 1), np.uint8)
        for ci, c in enumerate(cs):
            jb = c.jobbin[:, :, : c.intervals]
            k = self.k[c.slots]
            keep_from = np.where(k == 1, 1, k + 1)
            fixed = (jb >= keep_from[:, None, None]).any(axis=0)
            o = int(self.choff[ci])
            self.fixed_side[o : o + fixed.size] = fixed.ravel()
        if not cs:
            self.ct0 = self.cl0 = np.zeros(0, np.int64)
            self.choff = self.csoff = np.zeros(0, np.uint64)

    @property
    def jobs_compiled(self) -> int:
        return sum(1 for s in self.slot if s >= 0)

    def expand(self, h: dict[str, np.ndarray], groups: int) -> dict[str, np.ndarray]:
        """Per-interval sums (groups, hwidth) -> per-slot bins (groups, width): each
        interval's sums go to the bin its slot has there, class by class."""
        G = groups
        out = {
            "count": np.zeros((G, self.width), np.int64),
            "mass": np.zeros((G, self.width)),
            "seqfrac": np.zeros((G, self.width)) if "seqfrac" in h else None,
            "wsum": np.zeros((G, max(self.wwidth, 1))),
            "wsq": np.zeros((G, max(self.wwidth, 1))),
            "wmax": np.full((G, max(self.wwidth, 1)), -math.inf),
        }
        cost = [k for k in ("amass", "corr", "div", "ent", "ent_n") if k in h]
        out |= {k: np.zeros((G, self.width)) for k in cost}
        rows = np.arange(G, dtype=np.int64)[:, None]
        for ci, c in enumerate(self.coords):
            a = int(self.choff[ci])
            span = slice(a, a + c.ncls * c.intervals)
            cnt = h["count"][:G, span]
            for si, s in enumerate(c.slots):
                k2 = int(self.k[s]) + 2
                jb = c.jobbin[si, :, : c.intervals].reshape(-1)  # (ncls * intervals,)
                idx = (rows * k2 + jb[None, :]).reshape(-1)
                o = int(self.off[s])

                def add(name, vals, o=o, k2=k2, idx=idx):
                    s_ = np.bincount(idx, weights=vals.reshape(-1), minlength=G * k2)
                    out[name][:, o : o + k2] += s_.reshape(G, k2).astype(out[name].dtype)

                add("count", cnt)
                add("mass", h["mass"][:G, span])
                for k in cost:
                    add(k, h[k][:G, span])
                if out["seqfrac"] is not None:
                    add("seqfrac", h["seqfrac"][:G, span])
                if not self.weighted[s]:
                    continue
                # the clamped ratio's sums (the kernel's), or the slot's constant weight
                wc = c.wconst[si].reshape(-1)
                const = ~np.isnan(wc)
                v = np.where(const, wc, 0.0)
                ws = np.where(const, v * cnt, h["wsum"][:G, span])
                wq = np.where(const, v * v * cnt, h["wsq"][:G, span])
                wm = np.where(const & (cnt > 0), v, h["wmax"][:G, span])
                wo = int(self.woff[s])
                for name, vals in (("wsum", ws), ("wsq", wq)):
                    s_ = np.bincount(idx, weights=vals.reshape(-1), minlength=G * k2)
                    out[name][:, wo : wo + k2] += s_.reshape(G, k2)
                flat = out["wmax"][:, wo : wo + k2].copy().reshape(-1)
                np.maximum.at(flat, idx, wm.reshape(-1))
                out["wmax"][:, wo : wo + k2] = flat.reshape(G, k2)
        return out

    def seq_max(self, smn: np.ndarray, smx: np.ndarray) -> np.ndarray:
        """(m, slots) highest bin of each sequence from its lowest and highest interval per
        coordinate and class (-1 where a sequence has no token off the windows)."""
        m = smn.shape[0]
        out = np.full((m, max(self.n, 1)), -1, dtype=np.int64)
        for ci, c in enumerate(self.coords):
            M1 = c.intervals
            for cl in range(c.ncls):
                col = int(self.csoff[ci]) + cl
                lo = np.minimum(smn[:, col], M1)  # empty: M1 -> the -1 entry
                hi = np.where(smx[:, col] < 0, M1, smx[:, col])
                for si, s in enumerate(c.slots):
                    jb = c.jobbin[si, cl]
                    np.maximum(out[:, s], np.maximum(jb[lo], jb[hi]), out=out[:, s])
        return out
