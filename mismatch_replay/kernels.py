"""Fused kernels: every token rule, the metrics, the scatter and the sequence sums in one loop.

Design
------
The engine's simple path (engine.py, `Tally._add_batch_numpy`) is numpy, rule by rule: each
rule's `score()` builds its float64 arrays with one temporary per operation, then
`np.searchsorted` bins them against the sorted thresholds and `np.bincount` adds the bins:
~3.5 us a token for the default sweep (22 token jobs x 121 values, m2po, 10 sequence jobs),
220x the time polars takes to read the two log-prob columns (the *scan floor*,
benchmarks/README.md). It is the reference; this module is the fast path.

Coordinates. Every token rule's score is a function of one of four per-token values -- its
*coordinate* -- and of at most the signs of the advantage and of l: |dp| and +-dp are the
signed difference dp; l, r = e^l, k2, k3 and the ratio bands are functions of l; kpop and
dppo-kl are a binary KL (one coordinate per clamp). So the kernel does not bin rules: it bins
each coordinate once per token, against the merged *critical points* of all the rules on it
(every threshold mapped onto the coordinate: log t for a ratio, the two roots of k3 = t, +-t
for |dp|, and each rule's fixed sides), and adds the token's count, |dp| mass, 1/n and
clamped-ratio sums to its (group, class, interval). Between two critical points every rule's
bin is constant; `Program` works out which bin, interval by interval and class by class
(class = sign of the advantage, and of l for dppo-kl), by running the rule's own comparisons
(`slot_bins`, the rules' `score()` in numpy) on points of the interval, and checks it on 16
points spread over each interval. `Program.expand` turns the interval sums into each rule's
per-threshold bins at the end; a sequence's highest bin per rule comes from its lowest and
highest interval per class (every rule's bins fall then rise along a coordinate, checked).
The default sweep's 20 distinct jobs are 4 coordinates (~1,000 intervals on l), so the work
per token no longer grows with the number of rules and thresholds.

Exactness. Each critical point carries a window of uncertainty; a token whose coordinate
falls inside one (a tie with a threshold, or closer to it than rounding can settle) is not
added by the kernel but sent to the simple path (`BatchOut.flagged` -> engine), so counts
are exactly the simple path's at every grid point, ties, strict `>` and inclusive `>=`
included. Windows: 0 for thresholds on l itself (l = lp - lq on both paths); 1e-9 of the
point plus 1e-14 where the rule's score is exp, expm1 - l or a square of l (their float
rounding is ~1e-16 of l); 1e-13 relative for |dp| and 1e-13 (3 |log clamp| + 2) absolute for
a clamped binary KL. The kernel's exp, expm1 and log (`_vmath`, call-free so that its
per-token loops vectorise) are bit-identical to `pmath`'s, which rules.py uses, so a token's
coordinate is the simple path's own value and the windows are a second guard, not a
correction. Real logs put almost no token in a window (4 of 20M in the benchmark log).

Binning a coordinate is direct indexing: the value's order-preserving 64-bit key, with the
~2000 binades of tiny values squeezed out (`make_coord_binner`: |x| below half the smallest
critical point bins without the table, far outliers such as the 1.9e154 where l^2/2
overflows are scanned) indexes a table of 16384 buckets (`flag_lut`, uint16): a bucket
without an edge holds its bin, so most tokens take one load and no comparison (4-5 ns vs
~12 for comparing with the bucket's edges, measured in isolation); a flagged bucket (2-9%
of tokens here) compares the value with its few edges.

The kernels that loop over tokens (`coord_pass`, `m2po_step`) are compiled without numba's
reference counting and allocate nothing (their scratch comes from the caller): numba put
atomic increments and decrements of the arrays' reference counts around every token's
additions (inlined helpers with branches defeat its pruning), which cost more than the
additions, and more still with two threads sharing the arrays.

Per token, in blocks of 512: p, q, |dp|, the clamped ratio, k3 and the binary KLs in
vectorised loops (~1.5-2 ns per exp/expm1/log on AVX2); metrics, sequence sums and m2po's
inputs one token at a time; then, coordinate by coordinate, one loop bins the block's
tokens (a table load each) and a second adds them to their intervals' sums (count and |dp|
mass side by side in one float64 array, so a token's two additions share a cache line):
apart, each loop keeps more tokens' memory accesses in flight. About 91-92 ns a token on one
core for the whole default sweep (sequences ~10 of it, the scatter ~10, the metrics ~4;
1M-token batch, best of 15), vs 100-101 with one loop and separate arrays, ~155 before the
two changes above, ~300 for the previous per-rule kernel and 3.5 us for the simple path.
Metric maxima and the scatter's bins are exactly the simple path's (the same per-token bits,
on every CPU); sums differ from the simple path's in the last bits (another order of
addition).

Presets with their framework's arithmetic (rules.py `preset_arith`) are compiled as the
stable form they equal away from their thresholds, with wider windows (`JobCode.fuzzy`): a
ratio-space bound exp(l) > B is l > log B outside a 1e-9-relative window around log B (our exp
is within 3 ulps); exp(lp) - exp(lq) is within 2e-15 of the stable |dp| (window + 1e-14);
prime-rl's and AReaL's binary KL on clamped probabilities within ~4e-16 / c of ours (window
+ 2e-14 / c; measured: 0.3% of it at worst, tests/test_presets.py). Tokens in a window take the
simple path, which runs the framework's formula, so counts are the framework arithmetic's
exactly. The others (dppo-kl@verl's +1e-8 binary KL, verl's k1/k2/k3 presets, m2po@areal)
and every float32 replay run on the simple path, job by job, as do rules the program does
not know (a new rule, a subclass). `MISMATCH_REPLAY_KERNEL=numpy` forces the simple path
everywhere.

Threads: a batch is split into one contiguous chunk per thread (MISMATCH_REPLAY_THREADS,
default: the usable cores); each thread adds into its own accumulators (interval sums persist
across batches and are expanded once, at `Tally.flush`; past ACCUM_BUDGET, 512 MiB of them --
e.g. --by step over thousands of steps on many cores -- fewer threads keep their own). Integer
counts never depend on the split; floating-point sums (mass, weights, metrics) differ in the
last bits, as they already do with how the log is cut into files and batches.

numba is optional (the `fast` extra). Without it everything runs on the simple path with the
same counts. The first call compiles the kernel (~30-60 s), which numba caches on disk next
to the module (`__pycache__`); later processes start numba and load it in 0.45-0.8 s
(1.0-1.1 s before its BLAS probe was skipped: `_start_numba_target`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from . import pmath
from ._recycle import Recycler

# ----------------------------------------------------------------------------- backend

_ENV = "MISMATCH_REPLAY_KERNEL"
_THREADS_ENV = "MISMATCH_REPLAY_THREADS"
_forced: str | None = None
_jit = None


def backend() -> str:
    """'numba' (the fused path) or 'numpy' (the simple path)."""
    want = _forced or os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "numba", "numpy"):
        raise ValueError(f"{_ENV}={want}: use auto, numba or numpy")
    if want == "numpy":
        return "numpy"
    if importlib.util.find_spec("numba") is None:
        if want == "numba":
            raise RuntimeError(f"{_ENV}=numba but numba is not installed (pip install numba)")
        _note_fallback()
        return "numpy"
    return "numba"


class KernelWarning(UserWarning):
    """The fused kernel cannot run: the numpy path does the work (same counts, slower)."""


_fallback_noted = False


def _note_fallback() -> None:
    """Say once per process that numba is missing (a core dependency: a broken install)."""
    global _fallback_noted
    if _fallback_noted:
        return
    _fallback_noted = True
    import warnings

    warnings.warn(
        "numba is not installed, so the numpy reference path runs every rule: the same "
        "counts, ~10x slower. Install it (pip install numba) for the fused kernel.",
        KernelWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def use_backend(name: str):
    """Force 'numba', 'numpy' or 'auto' within a block (tests compare the two paths)."""
    global _forced
    old = _forced
    _forced = name
    try:
        yield
    finally:
        _forced = old


def jit():
    """The compiled module (imports numba on first use), or None on the numpy backend."""
    global _jit
    if backend() != "numba":
        return None
    if _jit is None:
        with _jit_lock:  # the reader's thread and the main one may both get here first
            if _jit is None:
                from . import _kernels_jit

                _start_numba_target()
                _jit = _kernels_jit
    return _jit


_jit_lock = threading.Lock()
_BLAS_PROBE = "scipy.linalg.cython_blas"


def _start_numba_target() -> None:
    """Start numba's CPU target (its registries) now, without its BLAS probe.

    When its target starts, numba imports scipy.linalg to learn whether BLAS is there for
    np.dot and the like. No kernel here uses BLAS, and where scipy is installed that import
    costs 0.2-0.3 s (it pulls in numpy.f2py and charset_normalizer; `python -X importtime`),
    a third of numba's start. So while the target starts, importing the probe fails at once
    (a None entry in sys.modules, removed right after). The one effect on other jitted code
    in this process: numba's np.correlate and np.convolve use its own loop instead of BLAS;
    np.dot still imports scipy's BLAS when it is compiled. Where scipy.linalg is loaded
    already the probe costs nothing and nothing is changed."""
    from numba.core.registry import cpu_target

    block = _BLAS_PROBE not in sys.modules and "scipy.linalg" not in sys.modules
    if block:
        sys.modules[_BLAS_PROBE] = None
    try:
        cpu_target.typing_context.refresh()
        cpu_target.target_context.refresh()
    finally:
        if block and _BLAS_PROBE in sys.modules and sys.modules[_BLAS_PROBE] is None:
            del sys.modules[_BLAS_PROBE]


def threads() -> int:
    """Threads for the fused pass: MISMATCH_REPLAY_THREADS, else the usable cores."""
    env = os.environ.get(_THREADS_ENV)
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


_pool: ThreadPoolExecutor | None = None


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < n:
        _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mismatch-replay")
    return _pool


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


def bin_scores(score: np.ndarray, thr_sorted: np.ndarray, inclusive: bool) -> np.ndarray:
    """Bin j = number of thresholds the score exceeds (>= when inclusive); +inf -> K + 1.

    The reference is `np.searchsorted` (the numpy backend); the fused backend indexes
    directly (`make_binner`) and gives the same bins.
    """
    score = np.ascontiguousarray(score, dtype=np.float64)
    k = thr_sorted.shape[0]
    j = jit()
    if j is None or score.shape[0] < 4096:
        if np.isnan(score).any():  # a rule must never produce NaN; fail loudly if one does
            raise AssertionError("internal error: a rule produced NaN scores")
        b = np.searchsorted(thr_sorted, score, side="right" if inclusive else "left")
        b[score == math.inf] = k + 1
        return b
    bn = make_binner(thr_sorted, inclusive)
    out = np.empty(score.shape[0], dtype=np.int64)
    if j.bin_array(score, k, bn.thr, bn.incl, bn.lut, bn.nl, bn.klo, bn.khi, bn.shift, out):
        raise AssertionError("internal error: a rule produced NaN scores")
    return out


# ----------------------------------------------------------------------------- programs

# op codes, mirrored in _kernels_jit
OPS = (
    "abs_dp",
    "ipo-v1:high",
    "ipo-v1:low",
    "band:high",
    "band:low",
    "kpop",
    "k2",
    "k3",
    "dppo-tv:high",
    "dppo-tv:low",
    "dppo-kl:high",
    "dppo-kl:low",
    "ppo:high",
    "ppo:low",
    "ppo:c",
    "l",
)
OP = {name: i for i, name in enumerate(OPS)}
W_NONE, W_RCLAMP, W_CISPO_HIGH, W_CISPO_LOW = 0, 1, 2, 3


@dataclass(frozen=True)
class JobCode:
    op: int
    wop: int = W_NONE
    clamp: float | None = None
    fp: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # A preset with its framework's arithmetic, compiled as the stable form it equals away
    # from its thresholds: `thr_log` maps ratio-space thresholds onto l (1: log t, -1:
    # -log(-t)), and `fuzzy` (> 0) widens every window to cover the two forms' difference,
    # so the tokens they could decide differently take the simple path (rules.py's score).
    thr_log: int = 0
    fuzzy: float = 0.0


# exp(l) against a bound decides as l against log(bound) except within a few ulps of it (pmath
# is within 3 ulps); exp(lp) - exp(lq) is within ~2e-15 (absolute) of the stable |dp| (a few
# ulps of each exp of a number <= 1). The windows take a margin over both.
FUZZY_RATIO = 1e-14  # + 1e-9 relative (_mapped)
FUZZY_PROB = 1e-14  # + ERR_REL relative
FUZZY_KL = 2e-14  # / clamp, + the binary KL's own window
_RATIO_OK = math.exp(19.9)  # ratio-clamp = ratio for bounds inside (e^-19.9, e^19.9)


def _compile_arith(rule, param, values) -> JobCode | None:
    """A preset's job (rule.arith set) as the stable op plus windows, or None."""
    from .rules import _log

    name, a = rule.name, rule.arith
    v = rule.values()
    if a in ("prime-rl", "areal") and name == "kpop" and v.get("clamp"):
        # prime-rl's and AReaL's p log(p/q) + (1 - p) log((1 - p)/(1 - q)) on clamped
        # probabilities is the stable binary KL but for 1 - p's rounding (<= 4e-16 absolute,
        # relative to 1 - q >= c): within 4e-16 (|log c| + 1 + 1/c) of it; in float64 it
        # never gives NaN
        c = float(rule.clamp)
        return JobCode(OP["kpop"], clamp=c, fuzzy=FUZZY_KL / c)
    if a == "prob" and name in ("ipo", "ipo-v1", "dppo-tv"):
        code = compile_job(_Bare(rule, param))
        return None if code is None else replace(code, fuzzy=FUZZY_PROB)
    if a not in ("ratio", "ratio-clamp") or name not in ("icepop", "token-mis", "tis", "cispo"):
        return None
    bounds = [x for k, x in v.items() if k in ("low", "high", "cap") and x]
    bounds += [float(x) for x in values if x]  # the swept values too
    if a == "ratio-clamp" and any(not 1 / _RATIO_OK < x < _RATIO_OK for x in bounds):
        return None  # the clamp decides there: the simple path
    if name == "tis":
        if any(x <= 0 for x in values):
            return None
        return JobCode(OP["l"], W_RCLAMP, thr_log=1, fuzzy=FUZZY_RATIO)
    if v.get("low") is None or v.get("high") is None:
        return None
    side = 1 if param == "high" else -1
    if name == "cispo":
        if param == "high":
            fp = (_log(rule.low), float(rule.low), 0.0, 0.0)
            return JobCode(OP["band:high"], W_CISPO_HIGH, fp=fp, thr_log=side, fuzzy=FUZZY_RATIO)
        fp = (_log(rule.high), float(rule.high), 0.0, 0.0)
        return JobCode(OP["band:low"], W_CISPO_LOW, fp=fp, thr_log=side, fuzzy=FUZZY_RATIO)
    if param == "high":
        return JobCode(
            OP["band:high"], fp=(_log(rule.low), 0.0, 0.0, 0.0), thr_log=1, fuzzy=FUZZY_RATIO
        )
    return JobCode(
        OP["band:low"], fp=(_log(rule.high), 0.0, 0.0, 0.0), thr_log=-1, fuzzy=FUZZY_RATIO
    )


@dataclass(frozen=True)
class _Bare:
    """A job of the same rule in the stable form (for compile_job)."""

    rule: object
    param: str

    def __post_init__(self):
        object.__setattr__(self, "rule", self.rule.replace(preset=""))


def compile_job(job) -> JobCode | None:
    """A token job as an op code and its constants, or None (the simple path runs it).

    Mirrors each rule's `score()` / `weight()` in rules.py; only the catalogue's own classes
    are compiled (a subclass may override score()).
    """
    from .rules import REGISTRY, _log

    rule, param = job.rule, job.param
    if rule.level != "token" or rule.inclusive or REGISTRY.get(rule.name) is not type(rule):
        return None  # the kernel compares strictly (every token rule of the catalogue does)
    if rule.precision != "float64":
        return None  # float32: the simple path
    if rule.arith:  # a framework's own arithmetic (a preset's): compiled where it can be
        return _compile_arith(rule, param, job.values)
    v = rule.values()

    def need(*names):
        return all(v.get(n) is not None for n in names)

    name = rule.name
    if name == "ipo" and param == "eps":
        return JobCode(OP["abs_dp"])
    if name == "ipo-v1" and need("low", "high"):
        if param == "high":
            return JobCode(OP["ipo-v1:high"], fp=(float(rule.low), 0.0, 0.0, 0.0))
        return JobCode(OP["ipo-v1:low"], fp=(float(rule.high), 0.0, 0.0, 0.0))
    if name in ("icepop", "token-mis") and need("low", "high"):
        if param == "high":
            return JobCode(OP["band:high"], fp=(_log(rule.low), 0.0, 0.0, 0.0))
        return JobCode(OP["band:low"], fp=(_log(rule.high), 0.0, 0.0, 0.0))
    if name == "kpop" and need("clamp"):
        return JobCode(OP["kpop"], clamp=float(rule.clamp))
    if name == "token-k2":
        return JobCode(OP["k2"])
    if name == "token-k3":
        return JobCode(OP["k3"])
    if name == "dppo-tv" and need("low", "high"):
        if param == "high":
            return JobCode(OP["dppo-tv:high"], fp=(float(rule.low), 0.0, 0.0, 0.0))
        return JobCode(OP["dppo-tv:low"], fp=(float(rule.high), 0.0, 0.0, 0.0))
    if name == "dppo-kl" and need("low", "high", "clamp"):
        c = float(rule.clamp)
        if param == "high":
            return JobCode(OP["dppo-kl:high"], clamp=c, fp=(float(rule.low), 0.0, 0.0, 0.0))
        return JobCode(OP["dppo-kl:low"], clamp=c, fp=(float(rule.high), 0.0, 0.0, 0.0))
    if name in ("ppo-clip", "dual-clip") and need("eps_low", "eps_high"):
        has_c = name == "dual-clip"
        if has_c and not need("c"):
            return None
        fp = (1.0 + rule.eps_high, 1.0 - rule.eps_low, float(v.get("c") or 0.0), float(has_c))
        op = {"eps_high": "ppo:high", "eps_low": "ppo:low", "c": "ppo:c"}[param]
        return JobCode(OP[op], fp=fp)
    if name == "tis" and param == "cap":
        return JobCode(OP["l"], W_RCLAMP)
    if name == "cispo" and need("low", "high"):
        if param == "high":
            return JobCode(
                OP["band:high"], W_CISPO_HIGH, fp=(_log(rule.low), float(rule.low), 0.0, 0.0)
            )
        return JobCode(
            OP["band:low"], W_CISPO_LOW, fp=(_log(rule.high), float(rule.high), 0.0, 0.0)
        )
    return None


# the quantity each op bins (its "base"); the op's conditions only move bins to 0 and K + 1
BASE_OF_OP = {
    "abs_dp": "adp",
    "ipo-v1:high": "dp",
    "ipo-v1:low": "-dp",
    "band:high": "l",
    "band:low": "-l",
    "kpop": "kpop",
    "k2": "k2",
    "k3": "k3",
    "dppo-tv:high": "dp",
    "dppo-tv:low": "-dp",
    "dppo-kl:high": "bkl_qp",
    "dppo-kl:low": "bkl_qp",
    "ppo:high": "r",
    "ppo:low": "-r",
    "ppo:c": "r",
    "l": "l",
}
# ... and the coordinate the kernel bins it on: every base is a function of one of these
COORDS = ("dp", "l", "kpop", "bkl_qp")
COORD_OF_BASE = {
    "adp": "dp",
    "dp": "dp",
    "-dp": "dp",
    "l": "l",
    "-l": "l",
    "r": "l",
    "-r": "l",
    "k2": "l",
    "k3": "l",
    "kpop": "kpop",
    "bkl_qp": "bkl_qp",
}
ADV_OPS = frozenset(
    OP[o]
    for o in (
        *("dppo-tv:high", "dppo-tv:low", "dppo-kl:high", "dppo-kl:low"),
        *("ppo:high", "ppo:low", "ppo:c"),
    )
)
LSIGN_OPS = frozenset((OP["dppo-kl:high"], OP["dppo-kl:low"]))
COORD_LUT = 1 << 14  # buckets of a coordinate's table (32 KiB as uint16)
_LOG_MAX = math.log(np.finfo(np.float64).max)  # exp() overflows above (709.78)
_LOG_TINY = -745.2  # exp() is 0 below (-745.13), subnormal up to -708.4
_K2_MAX = math.sqrt(2.0) * math.sqrt(np.finfo(np.float64).max)  # 0.5 * l * l overflows above
_A_OF_CLASS = (0.0, 1.0, -1.0)  # advantage class 0: a == 0, 1: a > 0, 2: a < 0
_L_OF_CLASS = (0.0, 1.0, -1.0)  # the same for the sign of l (binary-KL coordinates)


def _mapped(x: float, floor: float = 1e-14) -> tuple[float, float]:
    """A point where a float function of l (exp, expm1, a square) crosses a threshold, with
    a window wide enough for that function's rounding: the float score and the exact one
    differ by a few ulps, which is ~1e-16 of l for exp and expm1 - l, ~1e-16 relative for a
    square; 1e-9 relative plus `floor` covers it many times over."""
    return x, 1e-9 * abs(x) + floor


def _k3_root(t: float, sign: float) -> float | None:
    """l with expm1(l) - l = t on the side of `sign` (bisection on the float function)."""
    lo, hi = 0.0, 1.0

    def f(x: float) -> float:
        if sign > 0:
            return math.expm1(x) - x if x < _LOG_MAX else math.inf
        return math.expm1(-x) + x

    while f(hi) <= t:
        if hi >= _FMAX:
            return None  # k3 stays <= t on this side
        hi = min(2.0 * hi, _FMAX)
    for _ in range(2000):
        mid = lo + 0.5 * (hi - lo)
        if mid in (lo, hi):
            break
        if f(mid) > t:
            hi = mid
        else:
            lo = mid
    return sign * hi


# The kernel computes |dp| and the binary KLs with _vmath's exp/expm1/log, a few ulps (<= 1e-15
# relative, measured) off the C library the simple path uses; windows around their critical
# points absorb the difference many times over. |dp| = max(p, q) (-expm1(-|l|)): a product,
# so the error is relative. A clamped binary KL a (la - lb) + ca (log ca - log cb) sums terms
# no larger than L = |log clamp| (la, lb in [log c, log1p(-c)], ca in [c, 1 - c]), so its
# error is below 1e-15 (3 L + 2) in absolute terms, however small the KL.
ERR_REL = 1e-13


def _dp_window(x: float) -> tuple[float, float]:
    return x, ERR_REL * abs(x) + 1e-300


def _kl_window(x: float, clamp: float) -> tuple[float, float]:
    return x, ERR_REL * (3.0 * abs(math.log(clamp)) + 2.0) + 1e-300


def critical_points(code: JobCode, bname: str, thr: np.ndarray) -> list[tuple[float, float]]:
    """Where on its coordinate a slot's bin can change, as (point, half-width of the window
    of uncertainty). Thresholds on l itself are exact (width 0: l is lp - lq on both paths);
    |dp| and the binary KLs get the windows above; points mapped through exp, expm1 or a
    square get `_mapped` windows. Tokens inside a window go to the simple path; between
    windows a slot's bin is constant (build_coord checks that on samples of each interval)."""
    pts: list[tuple[float, float]] = []
    t = [float(x) for x in thr if math.isfinite(x)]
    fz = code.fuzzy

    def dpw(x):  # |dp|'s window, widened for a preset's exp(lp) - exp(lq)
        return _dp_window(x) if not fz else (x, ERR_REL * abs(x) + fz)

    def _exact(x):  # a threshold on l itself: exact, or a ratio preset's window
        return _mapped(x, fz) if fz else (x, 0.0)

    if bname == "adp":
        pts += [dpw(x) for x in t] + [dpw(-x) for x in t]
    elif bname == "dp":
        pts += [dpw(x) for x in t]
    elif bname == "-dp":
        pts += [dpw(-x) for x in t]
    elif bname in ("kpop", "bkl_qp"):
        pts += [(x, _kl_window(x, code.clamp)[1] + fz) for x in t]
    elif bname == "l":
        pts += [_exact(x) for x in t]
    elif bname == "-l":
        pts += [_exact(-x) for x in t]
    elif bname in ("r", "-r"):
        s = 1.0 if bname == "r" else -1.0
        pts += [_mapped(math.log(s * x)) for x in t if s * x > 0]
    elif bname == "k2":
        for x in t:
            if x >= 0:
                root = math.sqrt(2.0 * x)
                pts += [_mapped(root, 0.0), _mapped(-root, 0.0)]
        pts += [_mapped(_K2_MAX, 0.0), _mapped(-_K2_MAX, 0.0)]
        if any(x < 0 for x in t) or 0.0 in t:  # 0.5 * l * l underflows to 0 near 0
            pts.append((0.0, 1e-150))
    elif bname == "k3":
        roots = [_k3_root(x, s) for x in t if x > 0 for s in (1.0, -1.0)]
        pts += [_mapped(x) for x in roots if x is not None]
        if any(x <= 0 for x in t):
            pts.append((0.0, 1e-7))  # k3 = 0 up to rounding near l = 0
    if bname in ("r", "-r", "k3"):  # exp / expm1 overflow and underflow
        pts += [_mapped(_LOG_MAX), (_LOG_TINY, 1.0)]
    o = OPS[code.op]
    f0, f1, f2, f3 = code.fp
    if o in ("ipo-v1:high", "dppo-tv:high"):
        pts.append(dpw(-f0))
    elif o in ("ipo-v1:low", "dppo-tv:low"):
        pts.append(dpw(f0))
    elif o in ("band:high", "band:low"):
        pts.append(_exact(f0))
    elif o in ("dppo-kl:high", "dppo-kl:low"):
        pts.append(_kl_window(f0, code.clamp))
    elif o.startswith("ppo:"):
        pts += [_mapped(math.log(v)) for v in (f0, f1) if v > 0]
        if f3 and f2 > 0:
            pts.append(_mapped(math.log(f2)))
    return [(x, w) for x, w in pts if math.isfinite(x)]


def slot_bins(code: JobCode, bname: str, thr: np.ndarray, x, a: float, lsign: float):
    """A slot's bins for coordinate values x (numpy), advantage a and sign of l: the
    kernel's former per-job program, i.e. each rule's score() on a token with this
    coordinate, binned as the simple path bins it."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        base = {
            "adp": np.abs,
            "dp": lambda v: v,
            "-dp": np.negative,
            "l": lambda v: v,
            "-l": np.negative,
            "r": pmath.exp,
            "-r": lambda v: -pmath.exp(v),
            "k2": lambda v: 0.5 * v * v,
            "k3": lambda v: pmath.expm1(v) - v,
            "kpop": lambda v: v,
            "bkl_qp": lambda v: v,
        }[bname](x)
        r = pmath.exp(x)
    k = thr.shape[0]
    k1 = k + 1
    b = np.searchsorted(thr, base, side="left")
    b[base == math.inf] = k1
    o = OPS[code.op]
    f0, f1, f2, f3 = code.fp
    zero = np.zeros_like(b)
    if o == "ipo-v1:high":
        b = np.where(x < -f0, k1, b)
    elif o == "ipo-v1:low":
        b = np.where(x > f0, k1, b)
    elif o == "band:high":
        b = np.where(x < f0, k1, b)
    elif o == "band:low":
        b = np.where(x > f0, k1, b)
    elif o == "dppo-tv:high":
        b = np.where((a <= 0) & (x < -f0), k1, b if a > 0 else zero)
    elif o == "dppo-tv:low":
        b = np.where((a > 0) & (x > f0), k1, b if a <= 0 else zero)
    elif o in ("dppo-kl:high", "dppo-kl:low"):
        up = a > 0 and lsign > 0
        down = a < 0 and lsign < 0
        valid, other = (up, down) if o == "dppo-kl:high" else (down, up)
        b = np.where(other & (x > f0), k1, b if valid else zero)
    elif o.startswith("ppo:"):
        up = (a > 0) & (r > f0)
        down = (a < 0) & (r < f1)
        extra = (f3 != 0) & (a < 0) & (r > f2)
        if o == "ppo:high":
            valid, inf = a > 0, down | extra
        elif o == "ppo:low":
            valid, inf = a < 0, up | extra
        else:
            valid, inf = a < 0, up | down
        b = np.where(inf, k1, b if valid else zero)
    return b


def _key_floats(keys: np.ndarray) -> np.ndarray:
    """float_keys' inverse (key 0x8000... gives +0.0)."""
    keys = keys.astype(np.uint64)
    pos = (keys & _SIGN) != 0
    bits = np.where(pos, keys ^ _SIGN, ~keys)
    return bits.view(np.float64)


_FMAX = float(np.finfo(np.float64).max)


def _merge(ranges) -> list[list[float]]:
    """Sorted disjoint windows [lo, hi] from ranges; overlapping or touching ones merge."""
    out: list[list[float]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= float(np.nextafter(out[-1][1], math.inf)):
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


@dataclass
class Coord:
    """One coordinate of a Program: its windows, and each of its slots' bin per interval.

    Windows W_0 < ... < W_{M-1} cut the coordinate into intervals I_0 .. I_M (I_i lies
    between W_{i-1} and W_i). The kernel bins a token's coordinate on `edges` = [lo_0,
    next(hi_0), lo_1, next(hi_1), ...] counting the edges <= x: odd = inside a window (the
    token goes to the simple path), even 2i = interval I_i. `jobbin[s, c, i]` is the bin
    of the coordinate's s-th slot for class c in interval I_i (index M + 1: -1, "no token").
    """

    kind: str
    clamp: float | None
    ncls: int  # 1, 3 (sign of the advantage) or 9 (and the sign of l)
    slots: list[int]
    edges: np.ndarray
    binner: Binner
    jobbin: np.ndarray  # (len(slots), ncls, M + 2) int64
    rep: np.ndarray  # (M + 1,) a coordinate value inside each interval

    @property
    def intervals(self) -> int:
        return self.edges.shape[0] // 2 + 1


N_SAMPLES = 16


def _samples(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(intervals, N_SAMPLES) floats from each start to its end (both included), evenly
    spaced in key order (so that an interval spanning many binades is sampled in each)."""
    ka = float_keys(starts)
    kb = float_keys(ends)
    step = (kb - ka) // np.uint64(N_SAMPLES - 1)
    i = np.arange(N_SAMPLES, dtype=np.uint64)
    ks = ka[:, None] + step[:, None] * i[None, :]
    ks[:, -1] = kb
    return _key_floats(ks.reshape(-1)).reshape(ks.shape)


def _classes(ncls: int) -> list[tuple[float, float]]:
    """(advantage, sign of l) standing for each class."""
    if ncls == 9:
        return [(a, s) for a in _A_OF_CLASS for s in _L_OF_CLASS]
    return [(a, 0.0) for a in _A_OF_CLASS[:ncls]]


def build_coord(kind: str, clamp, slots, codes, bnames, thrs) -> Coord:
    """The windows and interval bins of one coordinate shared by `slots`."""
    ncls = 1
    if any(codes[s].op in ADV_OPS for s in slots):
        ncls = 3
    if any(codes[s].op in LSIGN_OPS for s in slots):
        ncls = 9
    points = [pt for s in slots for pt in critical_points(codes[s], bnames[s], thrs[s])]
    if not points:
        points = [(-_FMAX, 0.0)]
    wins = _merge((x - w, x + w) for x, w in points)
    classes = _classes(ncls)
    for _ in range(8):
        lo = np.array([w[0] for w in wins])
        hi = np.array([w[1] for w in wins])
        with np.errstate(over="ignore"):
            starts = np.r_[-_FMAX, np.nextafter(hi, math.inf)]
            ends = np.r_[np.nextafter(lo, -math.inf), _FMAX]
        empty = starts > ends  # no float lies between two windows
        starts = np.where(empty, ends, starts)
        xs = _samples(starts, ends)
        m = lo.shape[0]
        jobbin = np.full((len(slots), ncls, m + 2), -1, dtype=np.int64)
        ok = np.ones(m + 1, dtype=bool)
        for si, s in enumerate(slots):
            for c, (av, ls) in enumerate(classes):
                b = slot_bins(codes[s], bnames[s], thrs[s], xs.reshape(-1), av, ls)
                b = b.reshape(xs.shape)
                ok &= (b == b[:, :1]).all(axis=1) | empty
                jobbin[si, c, : m + 1] = b[:, N_SAMPLES // 2]
        if ok.all():
            break
        # a slot's bin changes inside an interval (a critical point this module does not
        # know): the interval becomes a window, and its tokens go to the simple path
        wins = _merge([*map(tuple, wins), *zip(starts[~ok], ends[~ok], strict=True)])
    else:  # pragma: no cover - the merge above always converges
        raise AssertionError("internal error: coordinate intervals did not settle")
    rep = xs[:, N_SAMPLES // 2].copy()
    # A sequence's highest bin comes from its lowest and highest interval per class (Fused):
    # that needs every slot's bins to fall then rise along the intervals (true of every op).
    d = np.diff(jobbin[:, :, : lo.shape[0] + 1], axis=2)
    rises = np.cumsum(d > 0, axis=2) > 0
    if ((d < 0) & rises).any():  # pragma: no cover - a new op that breaks this
        raise AssertionError(f"internal error: {kind} bins are not quasi-convex")
    with np.errstate(over="ignore"):  # a window up to the largest float ends at +inf
        edges = np.array([v for a, b in wins for v in (a, float(np.nextafter(b, math.inf)))])
    binner = make_coord_binner(edges, COORD_LUT)
    return Coord(kind, clamp, ncls, list(slots), edges, binner, jobbin, rep)


MAX_COORDS = 32  # bits of a token's window flags (uint32)


class TooManyCoordinates(ValueError):
    """More coordinates than flag bits: 15+ distinct binary-KL clamps in one sweep."""


class Program:
    """The compiled token jobs of a Tally, as the arrays the kernel reads.

    `slot[ji]` is the kernel slot of job ji (identical jobs share a slot), or -1 where the
    simple path runs the job (sequence and step rules, unknown rules). Slots are grouped by
    coordinate (`COORDS`; one per clamp for the binary KLs): the default sweep's 20 slots
    are 4 coordinates. Per slot the output layout is the old one: K + 2 bins at `off`
    (and weight bins at `woff`), so `take()` hands the engine (groups, K + 2) arrays.
    """

    def __init__(self, jobs):
        self.slot = []
        sigs: dict = {}
        self.codes: list[JobCode] = []
        self.bnames: list[str] = []
        self.thrs: list[np.ndarray] = []
        for job in jobs:
            code = compile_job(job)
            if code is None:
                self.slot.append(-1)
                continue
            thr = np.ascontiguousarray(job.thresholds[job.order], dtype=np.float64)
            if code.thr_log == 1:  # ratio-space thresholds onto l (the window covers exp's
                thr = pmath.log(thr)  # rounding)
            elif code.thr_log == -1:
                thr = -pmath.log(-thr)
            sig = (code, thr.tobytes())
            if sig not in sigs:
                sigs[sig] = len(self.codes)
                self.codes.append(code)
                self.bnames.append(BASE_OF_OP[OPS[code.op]])
                self.thrs.append(thr)
            self.slot.append(sigs[sig])
        u = len(self.codes)
        self.n = u
        self.k = np.array([t.size for t in self.thrs], dtype=np.int64)
        widths = self.k + 2
        self.off = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        self.width = int(widths.sum())
        self.wop = np.array([c.wop for c in self.codes], dtype=np.int64)
        wmask = self.wop != W_NONE
        wwidths = np.where(wmask, widths, 0)
        woff = np.concatenate([[0], np.cumsum(wwidths)[:-1]]).astype(np.int64)
        self.woff = np.where(wmask, woff, -1).astype(np.int64)
        self.wwidth = int(wwidths.sum())
        if not u:
            self.off = self.woff = np.zeros(0, np.int64)
        # coordinates: slots that bin a function of the same per-token value
        groups: dict[tuple, list[int]] = {}
        for s in range(u):
            kind = COORD_OF_BASE[self.bnames[s]]
            clamp = self.codes[s].clamp if kind in ("kpop", "bkl_qp") else None
            groups.setdefault((COORDS.index(kind), clamp), []).append(s)
        if len(groups) > MAX_COORDS:  # one flag bit a coordinate (engine: the simple path)
            raise TooManyCoordinates(
                f"{len(groups)} coordinates (distinct binary-KL clamps?): the kernel takes "
                f"{MAX_COORDS}"
            )
        self.coords = [
            build_coord(COORDS[kind], clamp, slots, self.codes, self.bnames, self.thrs)
            for (kind, clamp), slots in sorted(groups.items(), key=lambda kv: kv[0][0])
        ]
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
        nc = len(cs)
        self.ckind = np.array([COORDS.index(c.kind) for c in cs], dtype=np.int64)
        self.ccix = np.array(
            [clamps.index(c.clamp) if c.clamp is not None else 0 for c in cs], dtype=np.int64
        )
        self.cma = np.array([{1: 0, 3: 1, 9: 3}[c.ncls] for c in cs], dtype=np.uint64)
        self.cml = np.array([1 if c.ncls == 9 else 0 for c in cs], dtype=np.uint64)
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
        self.weights = bool(wmask.any())
        if not nc:
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
                if out["seqfrac"] is not None:
                    add("seqfrac", h["seqfrac"][:G, span])
                wop = int(self.wop[s])
                if wop == W_NONE:
                    continue
                # w = the clamped ratio, or cispo's constant f1 outside its side
                f0, f1 = self.codes[s].fp[0], self.codes[s].fp[1]
                rep = np.tile(c.rep, c.ncls)
                const = (
                    np.zeros_like(rep, dtype=bool)
                    if wop == W_RCLAMP
                    else (rep < f0 if wop == W_CISPO_HIGH else rep > f0)
                )
                ws = np.where(const, f1 * cnt, h["wsum"][:G, span])
                wq = np.where(const, f1 * f1 * cnt, h["wsq"][:G, span])
                wm = np.where(const & (cnt > 0), f1, h["wmax"][:G, span])
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


# ----------------------------------------------------------------------------- state

N_SUMS = 15  # metrics.MetricSums._SUMS order
N_MAXES = 2
PAD = 16  # rows between threads' copies of the per-batch arrays (>= one 64-byte line)
ACCUM_BUDGET = 512 << 20  # bytes of per-thread bins before fewer threads keep their own


@dataclass
class BatchOut:
    """What one fused call returns for its batch (summed over threads)."""

    smax: np.ndarray  # (m, U) max bin per batch sequence and slot (-1: none off windows)
    flagged: list[tuple[int, np.ndarray]]  # (coordinate, token indices) for the simple path
    msum: np.ndarray  # (G, 15)
    mmax: np.ndarray  # (G, 2)
    hist_lin: np.ndarray  # (bins * bins,)
    hist_log: np.ndarray
    seq_sum: np.ndarray  # (m, 6) n, sum_l, sum_k3, sum_exp_abs_l, mass, sum_adv
    seq_max_k2: np.ndarray  # (m,)
    seq_min_l: np.ndarray  # (m,)
    seq_first: np.ndarray  # (m,) group of the sequence's first token in this batch
    m2po_x: np.ndarray | None  # (n,) l^2
    m2po_mass: np.ndarray | None  # (n,) |dp|


def _ro(a, dtype) -> np.ndarray:
    """A C-contiguous read-only view (one numba specialisation for every input)."""
    a = np.ascontiguousarray(a, dtype=dtype).view()
    a.flags.writeable = False
    return a


_E1 = np.zeros(1, np.float64)
_E2 = np.zeros((1, 1), np.float64)
_EI1 = np.zeros(1, np.int64)
_EMPTY = np.iinfo(np.int64).max  # a sequence's lowest interval before it has one


class Fused:
    """Per-thread accumulators of one Tally's compiled jobs, and the per-batch call.

    The accumulators are per (group, coordinate, class, interval): count, |dp| mass, 1/n
    (prime-rl's per-sequence fractions) and, on l, the clamped ratio's sum, square sum and
    max (the weight rules'). `take()` turns them into per-slot bins (Program.expand).
    """

    MIN_CHUNK = 1 << 15  # tokens per thread below which a batch is not split
    CHUNKS_PER_THREAD = 4

    def __init__(self, program: Program, seqfrac: bool, nthreads: int | None = None):
        self.p = program
        self.t = nthreads or threads()
        self.seqfrac = seqfrac
        self.gcap = 0
        hw = max(program.hwidth, 1)
        ww = hw if program.weights else 1
        # count and |dp| mass side by side (a token's two additions share a cache line);
        # counts as float64 are exact up to 2**53 tokens
        self.cm = np.zeros((self.t, 0, hw, 2))
        self.sfrac = np.zeros((self.t, 0, hw if seqfrac else 1))
        self.wsum = np.zeros((self.t, 0, ww))
        self.wsq = np.zeros_like(self.wsum)
        self.wmax = np.full_like(self.wsum, -math.inf)
        self.dirty = False
        self.flagged_tokens = 0  # tokens sent to the simple path (inside a window)
        self.bufs = Recycler()  # per-batch arrays, reused once idle (fresh pages are slow)

    def __getstate__(self):  # pickling (Ray): the scratch is rebuilt where it is used
        state = self.__dict__.copy()
        state.pop("_scr", None)
        return state

    def _scratch(self, t: int, nclamp: int) -> tuple[np.ndarray, ...]:
        """Thread t's scratch rows for coord_pass (which allocates nothing itself): float64
        and uint64 rows of a block, the uint64 rows it reads before writing zeroed."""
        scr = self.__dict__.setdefault("_scr", {})
        key = (t, nclamp)
        if key not in scr:
            from ._kernels_jit import BLOCK, N_FSCRATCH, N_USCRATCH

            c = max(nclamp, 1)
            scr[key] = (
                np.empty((N_FSCRATCH, BLOCK)),
                np.empty((N_USCRATCH, BLOCK), np.uint64),
                np.empty((c, BLOCK)),
                np.empty((c, BLOCK)),
            )
        out = scr[key]
        out[1][:] = 0
        return out

    def _grow(self, groups: int) -> None:
        if groups <= self.gcap:
            return
        cap = max(groups, 2 * self.gcap, 1)
        # Each thread's sums take groups x (classes x intervals) x ~16-40 bytes: with --by
        # step on a long log and many cores that adds up, so past ACCUM_BUDGET fewer threads
        # keep sums (the others' are folded into thread 0 first; counts do not change).
        row = 8 * (2 * self.cm.shape[2] + self.sfrac.shape[2] + 3 * self.wsum.shape[2])
        keep = max(1, min(self.t, ACCUM_BUDGET // max(1, row * (cap + PAD))))
        if keep < self.t:
            for name in ("cm", "sfrac", "wsum", "wsq"):
                getattr(self, name)[0] += getattr(self, name)[keep:].sum(axis=0)
            np.maximum(self.wmax[0], self.wmax[keep:].max(axis=0), out=self.wmax[0])
            for name in ("cm", "sfrac", "wsum", "wsq", "wmax"):
                setattr(self, name, getattr(self, name)[:keep].copy())
            self.t = keep

        def grow(a, fill):  # PAD spare rows keep the threads' copies off each other's lines
            new = np.full((a.shape[0], cap + PAD, *a.shape[2:]), fill, dtype=a.dtype)
            new[:, : a.shape[1]] = a
            return new

        self.cm = grow(self.cm, 0.0)
        self.sfrac = grow(self.sfrac, 0.0)
        self.wsum = grow(self.wsum, 0.0)
        self.wsq = grow(self.wsq, 0.0)
        self.wmax = grow(self.wmax, -math.inf)
        self.gcap = cap

    def run(
        self,
        lp,
        lq,
        adv,
        g,
        groups: int,
        seq_local,
        n_seq: int,
        inv_n,
        entropy,
        metrics: bool = True,
        scatter: bool = True,
        m2po: bool = False,
        scatter_consts: tuple[float, float, float, float, int] = (0.0, 0.005, -8.0, 0.04, 200),
        log_clamp: float = 20.0,
    ) -> BatchOut:
        j = jit()
        p = self.p
        n = len(lp)
        self._grow(groups)
        self.dirty = True
        has_seq = seq_local is not None
        m = n_seq if has_seq else 1
        nc = len(p.coords)
        nt = max(1, min(self.t, n // self.MIN_CHUNK))
        bins = scatter_consts[4]
        # Per-thread copies are padded apart (PAD rows) so that two threads never write to
        # the same cache line: false sharing on the metric sums cost 2x.
        gm = groups if metrics else 1
        sw = max(p.swidth, 1) if has_seq else 1
        ms = m + PAD if has_seq else 1
        smn = np.full((nt, ms, sw), _EMPTY, np.int64)
        smx = np.full((nt, ms, sw), -1, np.int64)
        tflag = self.bufs.zeros("tflag", n, np.uint32)
        nflag = np.zeros((nt, max(nc, 1) + PAD), np.int64)
        msum = np.zeros((nt, gm + PAD, N_SUMS))
        mmax = np.full((nt, gm + PAD, N_MAXES), -math.inf)
        hl = self.bufs.zeros("hist_lin", (nt, bins * bins if scatter else 1), np.int64)
        hg = self.bufs.zeros("hist_log", hl.shape, np.int64)
        sq_sum = np.zeros((nt, m + PAD, 6))
        sq_mx = np.full((nt, m + PAD), -math.inf)
        sq_mn = np.full((nt, m + PAD), math.inf)
        # chunks taken by whichever thread is free (the reader and m2po's thread share the
        # cores: fixed halves left one thread waiting for the other, ~20 ms a batch)
        nch = nt * self.CHUNKS_PER_THREAD if nt > 1 else 1
        sq_first = np.full((nch, m + PAD), -1, np.int64)  # per chunk: input order decides
        # m2po's store keeps views of these until the step is resolved: reused after that
        m2x = self.bufs.empty("m2po_x", n) if m2po else _E1
        m2m = self.bufs.empty("m2po_mass", n) if m2po else _E1
        flags = np.array(
            [
                adv is not None,
                has_seq,
                entropy is not None,
                inv_n is not None and self.seqfrac,
                metrics,
                scatter,
                m2po,
                p.weights,
            ],
            dtype=np.int64,
        )
        consts = np.array([log_clamp, *scatter_consts[:4], math.log(10), bins], np.float64)
        lp = _ro(lp, np.float64)
        lq = _ro(lq, np.float64)
        adv_a = _ro(adv, np.float64) if adv is not None else _ro(_E1, np.float64)
        g = _ro(g, np.int64)
        sl = _ro(seq_local, np.int64) if has_seq else _ro(_EI1, np.int64)
        invn = _ro(inv_n, np.float64) if flags[3] else _ro(_E1, np.float64)
        ent = _ro(entropy, np.float64) if entropy is not None else _ro(_E1, np.float64)
        bounds = np.linspace(0, n, nch + 1).astype(np.int64)
        chunks = itertools.count()  # next() is atomic under the GIL

        def call(t: int) -> int:
            err = 0
            while (c := next(chunks)) < nch:
                err |= chunk(t, c)
            return err

        def chunk(t: int, c: int) -> int:
            return j.coord_pass(
                bounds[c],
                bounds[c + 1],
                lp,
                lq,
                adv_a,
                g,
                sl,
                invn,
                ent,
                flags,
                p.ckind,
                p.ccix,
                p.cma,
                p.cml,
                p.ck,
                p.ct0,
                p.cl0,
                p.cnl,
                p.cklo,
                p.ckhi,
                p.cshift,
                p.ctiny,
                p.cnz,
                p.cgap,
                p.ckpos,
                p.choff,
                p.cm1,
                p.csoff,
                p.edges,
                p.lut,
                p.lflag,
                p.clamps,
                consts,
                self.cm[t],
                self.sfrac[t],
                self.wsum[t],
                self.wsq[t],
                self.wmax[t],
                smn[t],
                smx[t],
                tflag,
                nflag[t],
                msum[t],
                mmax[t],
                hl[t],
                hg[t],
                sq_sum[t],
                sq_mx[t],
                sq_mn[t],
                sq_first[c],
                m2x,
                m2m,
                *self._scratch(t, p.clamps.shape[0]),
            )

        if nt == 1:
            errs = [call(0)]
        else:
            futs = [_executor(nt - 1).submit(call, t) for t in range(1, nt)]
            errs = [call(0)] + [f.result() for f in futs]
        if any(errs):
            raise AssertionError("internal error: a rule produced NaN scores")
        first = sq_first[0, :m].copy()
        for c in range(1, nch):  # the first token in input order: the lowest chunk wins
            first = np.where(first < 0, sq_first[c, :m], first)
        nf = nflag[:, :nc].sum(axis=0)
        flagged = [(c, np.flatnonzero(tflag & np.uint32(1 << c))) for c in range(nc) if nf[c] > 0]
        self.flagged_tokens += int(nf.sum())
        if has_seq:
            smax = p.seq_max(smn[:, :m].min(axis=0), smx[:, :m].max(axis=0))
        else:
            smax = np.full((1, max(p.n, 1)), -1, np.int64)
        return BatchOut(
            smax=smax,
            flagged=flagged,
            msum=msum[:, :gm].sum(axis=0),
            mmax=mmax[:, :gm].max(axis=0),
            hist_lin=hl.sum(axis=0),
            hist_log=hg.sum(axis=0),
            seq_sum=sq_sum[:, :m].sum(axis=0),
            seq_max_k2=sq_mx[:, :m].max(axis=0),
            seq_min_l=sq_mn[:, :m].min(axis=0),
            seq_first=first,
            m2po_x=m2x if m2po else None,
            m2po_mass=m2m if m2po else None,
        )

    def take(self, groups: int) -> dict[str, np.ndarray]:
        """Sum the threads' accumulators (first `groups` rows), reset them, and return
        per-slot bins (Program.expand)."""
        g = groups
        cm = self.cm[:, :g].sum(axis=0)
        h = {
            "count": np.rint(cm[..., 0]).astype(np.int64),
            "mass": np.ascontiguousarray(cm[..., 1]),
            "wsum": self.wsum[:, :g].sum(axis=0),
            "wsq": self.wsq[:, :g].sum(axis=0),
            "wmax": self.wmax[:, :g].max(axis=0),
        }
        if self.seqfrac:
            h["seqfrac"] = self.sfrac[:, :g].sum(axis=0)
        self.cm[:] = 0.0
        self.sfrac[:] = 0.0
        self.wsum[:] = 0.0
        self.wsq[:] = 0.0
        self.wmax[:] = -math.inf
        self.dirty = False
        return self.p.expand(h, g)

    def job_view(self, taken: dict[str, np.ndarray], slot: int) -> dict[str, np.ndarray]:
        """One slot's (G, K + 2) columns of `take()`'s arrays."""
        p = self.p
        a, b = int(p.off[slot]), int(p.off[slot] + p.k[slot] + 2)
        out = {"count": taken["count"][:, a:b], "mass": taken["mass"][:, a:b]}
        if self.seqfrac and taken.get("seqfrac") is not None:
            out["seqfrac"] = taken["seqfrac"][:, a:b]
        if p.woff[slot] >= 0:
            wa = int(p.woff[slot])
            wb = wa + int(p.k[slot]) + 2
            for k in ("wsum", "wsq", "wmax"):
                out[k] = taken[k][:, wa:wb]
        return out


# ----------------------------------------------------------------------------- m2po


_M2PO_SCRATCH = threading.local()


def _m2po_scratch(n: int) -> tuple[np.ndarray, ...]:
    """This thread's scratch for m2po_step, at least n long (steps reuse it: no fresh pages
    per step)."""
    have = getattr(_M2PO_SCRATCH, "arrays", None)
    if have is None or have[0].shape[0] < n:
        m = max(n, 1024)
        have = _M2PO_SCRATCH.arrays = (
            np.empty(m, np.int64),
            np.empty(m),
            np.empty(m),
            np.empty(m, np.bool_),
            np.empty(m + 1, np.int64),
            np.empty(m, np.int64),
        )
    return have


def m2po_step_bins(
    x: np.ndarray,
    g: np.ndarray,
    mass: np.ndarray,
    seq: np.ndarray,
    inv_n: np.ndarray | None,
    thr_sorted: np.ndarray,
    groups: int,
    n_seq: int,
    out_count: np.ndarray,
    out_mass: np.ndarray,
    out_seqfrac: np.ndarray | None,
    seq_bin: np.ndarray,
    keep_last: bool = False,
    precision: str = "float64",
) -> None:
    """Add one step's m2po bins: out_count/out_mass/out_seqfrac[g, bin], and
    seq_bin[seq] = max(seq_bin[seq], bin). x = l^2 of the step's tokens in input order.

    Rank m (0 = largest l^2, ties in input order) scores the mean l^2 of ranks m.. of the
    step; masked iff score >= tau. Fused backend: `_kernels_jit.m2po_step`; numpy backend:
    a stable argsort (the reference). `keep_last` (m2po@areal): the last rank is never
    masked (AReaL masks all but one token when no tail's mean is under tau).
    `precision="float32"`: the suffix sums, counts and means in float32, as AReaL's torch
    code runs them (a sequential float32 cumsum; a GPU scan adds in another order). Both
    take the numpy path.
    """
    k = thr_sorted.shape[0]
    n = x.shape[0]
    if n == 0:
        return
    j = jit() if not keep_last and precision == "float64" else None
    if j is not None:
        xs = np.sort(x)[::-1].copy()
        thr = np.ascontiguousarray(thr_sorted, dtype=np.float64)
        has_invn = inv_n is not None and out_seqfrac is not None
        brank, suf, bval, btie, level, ties = _m2po_scratch(n)
        x = _ro(x, np.float64)
        tokens = (
            _ro(g, np.int64),
            _ro(mass, np.float64),
            _ro(seq, np.int64),
            _ro(inv_n, np.float64) if has_invn else _ro(_E1, np.float64),
        )
        outs = (out_count, out_mass, out_seqfrac if has_invn else _E2, seq_bin, has_invn)
        nt = j.m2po_step(xs, x, *tokens, k, thr, *outs, brank, suf, bval, btie, level, ties)
        if nt < 0:
            raise AssertionError("internal error: m2po produced NaN scores")
        if nt:  # ties split by a boundary: their input order decides (rare)
            order = np.argsort(x[ties[:nt]], kind="stable")
            j.m2po_ties(xs, x, ties[:nt], order, brank, *tokens, *outs)
        return
    order = np.argsort(-x, kind="stable")
    xs = x[order]
    if precision == "float32":
        xs32 = xs.astype(np.float32)
        suffix32 = np.cumsum(xs32[::-1], dtype=np.float32)[::-1]
        score = (suffix32 / np.arange(n, 0, -1, dtype=np.float32)).astype(np.float64)
    else:
        suffix = np.cumsum(xs[::-1])[::-1]  # from the smallest up: no cancellation
        score = suffix / (n - np.arange(n))
    if keep_last:
        score[-1] = -math.inf
    b = bin_scores(score, thr_sorted, True)
    width = k + 2
    gg = g[order]
    idx = gg * width + b
    size = out_count.shape[0] * width
    out_count += np.bincount(idx, minlength=size).reshape(-1, width)
    out_mass += np.bincount(idx, weights=mass[order], minlength=size).reshape(-1, width)
    if out_seqfrac is not None and inv_n is not None:
        out_seqfrac += np.bincount(idx, weights=inv_n[order], minlength=size).reshape(-1, width)
    np.maximum.at(seq_bin, seq[order], b)
