"""The fused runner: the backend switch, the threads, and one call per batch.

Design
------
The engine's simple path (engine/, `Tally._add_batch_numpy`) is numpy, rule by rule: each
rule's `score()` builds its float64 arrays with one temporary per operation, then
`np.searchsorted` bins them against the sorted thresholds and `np.bincount` adds the bins:
~3.5 us a token for the default sweep (22 token jobs x 121 values, m2po, 10 sequence jobs),
220x the time polars takes to read the two log-prob columns (the *scan floor*,
benchmarks/README.md). It is the reference; `Fused` is the fast path.

`Fused.run` hands a batch to `jit.coord_pass`, which bins each token once per coordinate
of the `Program` (program.py: the tables derived from the rules' own score()) and adds its
count, |dp| mass, 1/n and clamped-ratio sums to its (group, class, interval); the metrics,
the scatter, the sequence sums and m2po's inputs come out of the same loop. A token inside
a window is not added but sent to the simple path (`BatchOut.flagged` -> engine), so
counts are exactly the simple path's at every grid point, ties, strict `>` and inclusive
`>=` included (4 of 20M tokens in a window in the benchmark log). `take()` turns the
interval sums into each job's per-threshold bins (Program.expand).

The kernels that loop over tokens (`coord_pass`, `m2po_step`) are compiled without numba's
reference counting and allocate nothing: their scratch comes from here (`_scratch`, per
thread), because numba put atomic increments and decrements of the arrays' reference
counts around every token's additions, which cost more than the additions.

Per token, in blocks of 512: p, q, |dp|, the clamped ratio, k3 and the binary KLs in
vectorised loops (~1.5-2 ns per exp/expm1/log on AVX2, `vmath`); metrics, sequence sums and
m2po's inputs one token at a time; then, per coordinate, one loop bins the block's tokens
(a table load each) and a second adds them to their intervals' sums (count and |dp| mass
side by side: one cache line): apart, each loop keeps more memory accesses in flight.
About 91-92 ns a token on one core for the whole default sweep (sequences ~10 of it, the
scatter ~10, the metrics ~4; 1M-token batch, best of 15). Metric maxima and the scatter's
bins are the simple path's bits (on every CPU); sums differ from its sums in the last bits
(another order of addition).

Buffers. Each runner owns its per-batch arrays that never leave `run()` (the window flags,
the scatter counts: `_zeros`, grown once and zeroed per batch, since an array of megabytes
fresh from the system faults in every page on first touch) and its per-thread scratch;
m2po's inputs (l^2 and |dp|) are written where the caller says (`m2po_into`: the engine
passes a slab leased from m2po's store, which keeps it until the step is resolved, so they
are never copied), else into arrays of the runner's own (`_reused`, not zeroed).

Threads: a batch is cut into 4 chunks per thread (MISMATCH_REPLAY_THREADS, default: the
usable cores), taken by whichever thread is free; each thread adds into its own
accumulators, padded apart so that no two threads write to one cache line (interval sums
persist across batches and are expanded once, at `Tally.flush`; past ACCUM_BUDGET, 512 MiB
of them -- e.g. --by step over thousands of steps on many cores -- fewer threads keep their
own). Counts never depend on the split; float sums are added per chunk and folded in
chunk order (`ordered`), so they depend on the thread count (the chunks), not on which
thread took which chunk (tests/test_determinism.py).

A follower's metrics. One read may feed a second Tally that needs only the metrics and
sequence sums of the same tokens under another grouping (the report's per-step Tally:
`Tally.lead_metrics`). `run(follow=(g2, groups2, entropy))` sums each run of one g2 group
within a block into per-chunk rows (flags[F_METRICS2]; a run of both groupings is summed
once), added up in chunk order as the follower's own run() would: with the same threads
(chunks, blocks) its sums and maxima bit for bit (tests/test_shared_metrics.py). Sequence
sums do not depend on the grouping and each sequence's first token is kept, so the
follower runs no pass: ~0.6 ms a 1M-token batch instead of its ~14 ms (2 threads).

Backend: `backend()` is "numba" where numba is installed (a core dependency; without it
everything runs on the simple path with the same counts and one KernelWarning), "numpy"
with MISMATCH_REPLAY_KERNEL=numpy or inside `use_backend("numpy")`. `compiled()` imports
`jit` on first use: the first process compiles it (~30-60 s) into numba's cache next to the
module (`__pycache__`); later ones start numba and load it in 0.45-0.8 s, numba's target
started without its BLAS probe (`_start_numba_target`).
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
from dataclasses import dataclass

import numpy as np

from .. import pmath
from .program import Program, make_binner, reference_bins

# ----------------------------------------------------------------------------- backend

_ENV = "MISMATCH_REPLAY_KERNEL"
_THREADS_ENV = "MISMATCH_REPLAY_THREADS"
_forced: str | None = None
_compiled = None


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


def compiled():
    """The compiled kernels (the `jit` module: imports numba on first use), or None on the
    numpy backend."""
    global _compiled
    if backend() != "numba":
        return None
    if _compiled is None:
        with _compiled_lock:  # the reader's thread and the main one may both get here first
            if _compiled is None:
                _start_numba_target()
                from . import jit

                _compiled = jit
                pmath.use_kernel(_vmath_apply)  # pmath's arrays go to vmath: the same bits
    return _compiled


def _vmath_apply():
    """vmath's compiled exp/expm1/log for pmath, or None while the numpy backend is forced
    (the simple path then runs pmath's numpy code, as a reference must)."""
    if backend() != "numba":
        return None
    from . import vmath

    return vmath.apply


_compiled_lock = threading.Lock()
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
_pool_size = 0


def executor(n: int) -> ThreadPoolExecutor:
    """The process's worker threads for the fused pass and m2po's steps (at least n)."""
    global _pool, _pool_size
    if _pool is None or _pool_size < n:
        _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="mismatch-replay")
        _pool_size = n
    return _pool


def bin_scores(score: np.ndarray, thr_sorted: np.ndarray, inclusive: bool) -> np.ndarray:
    """Bin j = number of thresholds the score exceeds (>= when inclusive); +inf -> K + 1.

    The reference is `np.searchsorted` (the numpy backend); the fused backend indexes
    directly (`make_binner`) and gives the same bins.
    """
    score = np.ascontiguousarray(score, dtype=np.float64)
    k = thr_sorted.shape[0]
    j = compiled()
    if j is None or score.shape[0] < 4096:
        if np.isnan(score).any():  # a rule must never produce NaN; fail loudly if one does
            raise AssertionError("internal error: a rule produced NaN scores")
        return reference_bins(score, thr_sorted, inclusive)
    bn = make_binner(thr_sorted, inclusive)
    out = np.empty(score.shape[0], dtype=np.int64)
    if j.bin_array(score, k, bn.thr, bn.incl, bn.lut, bn.nl, bn.klo, bn.khi, bn.shift, out):
        raise AssertionError("internal error: a rule produced NaN scores")
    return out


def replicate_bins(unit, bins, mult, wt: np.ndarray, width: int) -> np.ndarray:
    """(B, width) per-replicate sums: entry i adds mult[i] * wt[unit[i], r] to bin bins[i] of
    replicate r (wt: (units, B) bootstrap weights, float64 or uint8). Weights and
    multiplicities are integers,
    so the sums are exact in any order: the kernel (`jit.add_replicates`) and numpy agree."""
    unit = np.ascontiguousarray(unit, dtype=np.int64)
    bins = np.ascontiguousarray(bins, dtype=np.int64)
    mult = np.ascontiguousarray(mult, dtype=np.float64)
    j = compiled()
    if j is None:
        out = np.zeros((width, wt.shape[1]))
        np.add.at(out, bins, mult[:, None] * wt[unit])
        return out.T
    wt = np.ascontiguousarray(wt)
    if wt.dtype not in (np.uint8, np.float64):
        wt = wt.astype(np.float64)
    out = np.zeros((width, wt.shape[1]))
    j.add_replicates(unit, bins, mult, wt, out)
    return out.T


# ----------------------------------------------------------------------------- state

N_SUMS = 15  # metrics.MetricSums._SUMS order
N_MAXES = 2
PAD = 16  # rows between threads' copies of the per-batch arrays (>= one 64-byte line)
ACCUM_BUDGET = 512 << 20  # bytes of per-thread bins before fewer threads keep their own
# bytes of a batch's per-chunk bins (chunks x groups) up to which they are added up in chunk
# order (`Fused`: the same float sums on every run); past it, per thread
ORDERED_BUDGET = 16 << 20
FOLLOW_ROWS = 1 << 13  # chunks x groups of a follower's metric rows kept whole (_follow_rows)


@dataclass
class BatchOut:
    """What one fused call returns for its batch (summed over threads)."""

    smax: np.ndarray  # (m, U) max bin per batch sequence and slot (-1: none off windows)
    flagged: list[tuple[int, np.ndarray]]  # (coordinate, token indices) for the simple path
    msum: np.ndarray  # (G, 15)
    mmax: np.ndarray  # (G, 2)
    hist_lin: np.ndarray  # (bins * bins,)
    hist_log: np.ndarray
    # (m,) per sequence statistic the kernel accumulates, by its SEQ_STATS name (jit.SEQ_SUMS,
    # SEQ_MAX, SEQ_MIN: n, sum_l, sum_k3, sum_exp_abs_l, sum_adv, max_k2, min_l; and mass)
    seq: dict[str, np.ndarray]
    seq_first: np.ndarray  # (m,) group of the sequence's first token in this batch
    m2po_x: np.ndarray | None  # (n,) l^2
    m2po_mass: np.ndarray | None  # (n,) |dp|
    # with tail_cut: the tokens beyond a cutoff (indices), their coordinates' bits, and
    # their lp, lq, adv and batch-local sequence (seq_local's; "seq") as the kernel read them
    tail: tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None = None
    q_counts: np.ndarray | None = None  # with q_edges: tokens per q bucket
    q_mass: np.ndarray | None = None  # ... and their |dp| summed
    # ... and what a mask costs per bucket: {"amass": |A| sums (with an advantage), "ent",
    # "ent_n": finite entropies' sums and counts (with an entropy column)}
    q_cost: dict[str, np.ndarray] | None = None
    # with follow=: (msum (G2, 15), mmax (G2, 2), seq_first by g2 group or None), a follower
    # Tally's metrics and first groups (Fused.run)
    follow: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None


def readonly(a, dtype) -> np.ndarray:
    """A C-contiguous read-only view of `a` as `dtype`: the kernels' inputs (one numba
    specialisation for every input; m2po_bins.py passes its own through it too)."""
    a = np.ascontiguousarray(a, dtype=dtype).view()
    a.flags.writeable = False
    return a


_BINS = ("cm", "sfrac", "wsum", "wsq", "wmax")  # Fused's accumulators, coord_pass's order
_E1 = np.zeros(1, np.float64)
_E2 = np.zeros((1, 1), np.float64)
_EI1 = np.zeros(1, np.int64)
_EU1 = np.zeros(1, np.uint32)
_EM2 = (np.zeros((1, N_SUMS)), np.full((1, N_MAXES), -math.inf))  # no follower: unused
_EMPTY = np.iinfo(np.int64).max  # a sequence's lowest interval before it has one


class Fused:
    """The accumulators of one Tally's compiled jobs, and the per-batch call.

    The accumulators are per (group, coordinate, class, interval): count, |dp| mass, 1/n
    (prime-rl's per-sequence fractions) and, on l, the clamped ratio's sum, square sum and
    max (the weight rules'). `take()` turns them into per-slot bins (Program.expand).

    A batch is cut into chunks at fixed token bounds, taken by whichever thread is free.
    Float sums depend on the order of their additions, so each chunk adds into bins of its
    own over the groups it holds (`_windows`: from its lowest group, which the chunk's
    tokens see subtracted from theirs), zeroed per batch, and these are then added up in
    chunk order into one copy (`ordered`; a batch too small to split adds straight into
    it): the masked mass, the weights' sums and the metric sums are the same on every run
    (for a given thread count, which sets the chunks). An ungrouped replay, a few groups, or
    a log in step order by step (a chunk holds one or two steps) stays ordered; where a
    batch's chunks would need more than ORDERED_BUDGET of bins (many groups in every chunk:
    a log out of step order, by step), each thread keeps its own copy from then on, and
    those sums may differ in the last bit from run to run; counts never do.
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
        self.ordered = True  # one copy, chunks added in order (the class docstring)
        # what a mask costs: with an advantage also |A| and the corrective and divergent
        # tokens (5 wide), with an entropy column also its finite sum and count (7 wide)
        self.cost = bool(program.direction or program.entropy)
        self.cm = np.zeros((1, 0, hw, 7 if program.entropy else 5 if self.cost else 2))
        self.sfrac = np.zeros((1, 0, hw if seqfrac else 1))
        self.wsum = np.zeros((1, 0, ww))
        self.wsq = np.zeros_like(self.wsum)
        self.wmax = np.full_like(self.wsum, -math.inf)
        self.dirty = False
        self.flagged_tokens = 0  # tokens sent to the simple path (inside a window)
        self._scr: dict = {}  # per-thread block scratch of coord_pass
        self._own: dict[str, np.ndarray] = {}  # per-batch arrays that never leave run()

    def __getstate__(self):  # pickling (Ray): the scratch is rebuilt where it is used
        state = self.__dict__.copy()
        state["_scr"] = {}
        state["_own"] = {}
        return state

    def _zeros(self, name: str, shape, dtype) -> np.ndarray:
        """A zeroed array of this runner's own, reused batch after batch (a fresh array of
        megabytes faults in every page on first touch). Only for arrays that run() reads
        back before it returns: nothing it hands out refers to them."""
        shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        size = math.prod(shape)
        buf = self._own.get(name)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = self._own[name] = np.empty(max(size, 1), dtype)
        out = buf[:size].reshape(shape)
        out.fill(0)
        return out

    def _reused(self, name: str, n: int) -> np.ndarray:
        """A float64 array of this runner's own, not zeroed (the kernel writes every entry),
        reused batch after batch: for outputs whose reader copies them before the next
        run() (m2po's store does)."""
        return self._kept_rows(name, (n,), np.float64)

    def _kept_rows(self, name: str, shape: tuple, dtype) -> np.ndarray:
        """`_reused`'s array of any shape and type (C-contiguous, its last axis the batch's)."""
        size = math.prod(shape)
        buf = self._own.get(name)
        if buf is None or buf.dtype != dtype or buf.size < size:
            buf = self._own[name] = np.empty(max(size, 1), dtype)
        return buf[:size].reshape(shape)

    def _scratch(self, t: int, nclamp: int) -> tuple[np.ndarray, ...]:
        """Thread t's scratch rows for coord_pass (which allocates nothing itself): float64
        and uint64 rows of a block, the uint64 rows it reads before writing zeroed."""
        scr = self._scr
        key = (t, nclamp)
        if key not in scr:
            from .jit import BLOCK, N_FSCRATCH, N_USCRATCH

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
        row = self._row()
        # Each thread's sums take groups x (classes x intervals) x ~16-40 bytes: with --by
        # step on a long log and many cores that adds up, so past ACCUM_BUDGET fewer threads
        # keep sums (the others' are folded into thread 0 first; counts do not change).
        keep = max(1, min(self.t, ACCUM_BUDGET // max(1, row * (cap + PAD))))
        if not self.ordered and keep < self.t:
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
        m2po_into: tuple[np.ndarray, np.ndarray] | None = None,
        tail_cut: np.ndarray | None = None,
        q_edges: np.ndarray | None = None,
        clamped_seq: bool = False,
        follow: tuple[np.ndarray, int, bool] | None = None,
    ) -> BatchOut:
        """One batch through the kernel. `m2po_into`: two float64 arrays of len(lp) that
        m2po's l^2 and |dp| are written into (its store's leased slab), else the runner's.
        `tail_cut` ((coordinates, 2) float64, in `coords` order): the tokens whose coordinate
        c is <= tail_cut[c, 0] or >= tail_cut[c, 1], or that a job's fixed side masks
        (`Program.fixed_side`), or inside a window, come back in `BatchOut.tail`. `q_edges`
        (ascending, from 0): `BatchOut.q_counts` holds the tokens of each q bucket, `q_mass`
        their |dp| sums. `follow` = (g2, groups2, entropy2): a follower Tally's group codes
        of the same tokens, its number of groups and whether its metrics see the entropy
        (`entropy` given); `BatchOut.follow` then holds the metric sums and maxima per g2
        group and each sequence's first g2 group, as that Tally's own run() with the same
        thread count would give them, bit for bit (the module docstring)."""
        j = compiled()
        p = self.p
        n = len(lp)
        g_in = g  # the caller's group codes (g is shifted by the chunks' goff below)
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
        tflag = self._zeros("tflag", n, np.uint32)
        tail = tail_cut is not None and nc > 0
        tbits = self._zeros("tbits", n, np.uint32) if tail else _EU1
        # the kept tokens, each chunk's written from its first index on (`_kept`)
        tk_i = self._kept_rows("tk_i", (2, n), np.int64) if tail else np.zeros((2, 1), np.int64)
        tk_f = self._kept_rows("tk_f", (3, n), np.float64) if tail else np.zeros((3, 1))
        tk_b = self._kept_rows("tk_b", (n,), np.uint32) if tail else np.zeros(1, np.uint32)
        tcut = readonly(tail_cut, np.float64) if tail else readonly(_E2, np.float64)
        qb = q_edges is not None
        qe = readonly(q_edges, np.float64) if qb else readonly(_E1, np.float64)
        # chunks taken by whichever thread is free (the reader and m2po's thread share the
        # cores: fixed halves left one thread waiting for the other, ~20 ms a batch); float
        # sums every chunk adds to (metrics, q buckets, ordered bins) are per chunk, then
        # added up in chunk order: the same bits whichever thread took which chunk
        nch = nt * self.CHUNKS_PER_THREAD if nt > 1 else 1
        bounds = np.linspace(0, n, nch + 1).astype(np.int64)
        # ordered: each chunk adds into bins of its own over the groups it holds (goff: its
        # lowest group; a chunk sees its tokens' groups less goff), added up afterwards in
        # chunk order; one chunk adds straight into the copy, token after token, as a batch
        # did before (a small log's sums then do not depend on where its batches end)
        goff = None
        span = gm
        if self.ordered and nch > 1:
            got = self._windows(g, bounds, groups)
            if got is None:  # too many groups in a chunk: per-thread copies from now on
                self._per_thread()
            else:
                goff, span = got
                if groups > 1:
                    g = np.asarray(g, np.int64) - np.repeat(goff, np.diff(bounds))
        # counts, |dp| sums, |A| sums, entropy sums and counts (jit's docstring)
        qcnt = np.zeros((nch, 5 * (qe.shape[0] if qb else 1) + PAD))
        tk_n = np.zeros(nch, np.int64)  # each chunk's kept tokens
        nflag = np.zeros((nt, max(nc, 1) + PAD), np.int64)
        ms_rows = span if metrics else 1
        msum = np.zeros((nch, ms_rows + PAD, N_SUMS))
        mmax = np.full((nch, ms_rows + PAD, N_MAXES), -math.inf)
        hl = self._zeros("hist_lin", (nt, bins * bins if scatter else 1), np.int64)
        hg = self._zeros("hist_log", hl.shape, np.int64)
        # per sequence: per thread (a sequence's parts in two chunks add the same either way)
        sq_sum = np.zeros((nt, m + PAD, j.N_SEQ_SUMS))
        sq_mx = np.full((nt, m + PAD), -math.inf)
        sq_mn = np.full((nt, m + PAD), math.inf)
        # per chunk: each sequence's first token (input order decides)
        sq_first = np.full((nch, m + PAD), -1, np.int64)
        m2 = follow is not None and metrics
        if m2:
            g2, groups2, ent2 = follow
            ent2 = bool(ent2) and entropy is not None
            g2 = readonly(g2, np.int64)
            off2, span2 = self._follow_rows(g2, bounds, groups2)
            msum2 = np.zeros((nch, span2 + PAD, N_SUMS))
            mmax2 = np.full((nch, span2 + PAD, N_MAXES), -math.inf)
        else:
            g2, ent2, off2 = readonly(_EI1, np.int64), False, np.zeros(nch, np.int64)
            msum2, mmax2 = _EM2[0], _EM2[1]
        acc = self._chunk_bins(nch, span) if goff is not None else None
        # m2po's inputs: into the store's slab, else the runner's own (overwritten next batch)
        if m2po and m2po_into is not None:
            m2x, m2m = m2po_into
        else:
            m2x = self._reused("m2po_x", n) if m2po else _E1
            m2m = self._reused("m2po_mass", n) if m2po else _E1
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
                tail,
                qb,
                clamped_seq and has_seq,
                m2,
                ent2,
            ],
            dtype=np.int64,
        )
        consts = np.array([log_clamp, *scatter_consts[:4], math.log(10), bins], np.float64)
        lp = readonly(lp, np.float64)
        lq = readonly(lq, np.float64)
        adv_a = readonly(adv, np.float64) if adv is not None else readonly(_E1, np.float64)
        g = readonly(g, np.int64)
        sl = readonly(seq_local, np.int64) if has_seq else readonly(_EI1, np.int64)
        invn = readonly(inv_n, np.float64) if flags[3] else readonly(_E1, np.float64)
        ent = readonly(entropy, np.float64) if entropy is not None else readonly(_E1, np.float64)
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
                *(self._thread_bins(t) if acc is None else [a[c] for a in acc]),
                smn[t],
                smx[t],
                tflag,
                nflag[t],
                msum[c],
                mmax[c],
                g2,
                off2[c],
                msum2[c] if m2 else msum2,
                mmax2[c] if m2 else mmax2,
                hl[t],
                hg[t],
                sq_sum[t],
                sq_mx[t],
                sq_mn[t],
                sq_first[c],
                m2x,
                m2m,
                *self._scratch(t, p.clamps.shape[0]),
                tcut,
                p.fixed_side,
                tbits,
                qe,
                qcnt[c],
                tk_i,
                tk_f,
                tk_b,
                tk_n[c : c + 1],
            )

        if nt == 1:
            errs = [call(0)]
        else:
            futs = [executor(nt - 1).submit(call, t) for t in range(1, nt)]
            errs = [call(0)] + [f.result() for f in futs]
        if any(errs):
            raise AssertionError("internal error: a rule produced NaN scores")
        if goff is not None:  # the chunks' bins, metric sums, first groups: in chunk order
            ms_g = np.zeros((gm, N_SUMS))
            mx_g = np.full((gm, N_MAXES), -math.inf)
            for c in range(nch):
                a = int(goff[c])
                r = min(span, groups - a)
                for name, b in zip(_BINS[:4], acc[:4], strict=True):
                    getattr(self, name)[0, a : a + r] += b[c, :r]
                np.maximum(self.wmax[0, a : a + r], acc[4][c, :r], out=self.wmax[0, a : a + r])
                if metrics:
                    ms_g[a : a + r] += msum[c, :r]
                    np.maximum(mx_g[a : a + r], mmax[c, :r], out=mx_g[a : a + r])
            if not metrics:
                ms_g, mx_g = msum[:, :1].sum(axis=0), mmax[:, :1].max(axis=0)
        else:
            ms_g, mx_g = msum[:, :gm].sum(axis=0), mmax[:, :gm].max(axis=0)
        first = sq_first[0, :m].copy()
        for c in range(1, nch):  # the first token in input order: the lowest chunk wins
            first = np.where(first < 0, sq_first[c, :m], first)
        seen = first >= 0
        at = np.where(seen, first, 0)
        followed = None
        if m2:  # the follower's sums per chunk, added up in chunk order (as its run's)
            ms2 = np.zeros((groups2, N_SUMS))
            mx2 = np.full((groups2, N_MAXES), -math.inf)
            for c in range(nch):
                a = int(off2[c])
                r = min(span2, groups2 - a)
                ms2[a : a + r] += msum2[c, :r]
                np.maximum(mx2[a : a + r], mmax2[c, :r], out=mx2[a : a + r])
            followed = (ms2, mx2, np.where(seen, g2[at], -1) if has_seq else None)
        nf = nflag[:, :nc].sum(axis=0)
        flagged = [(c, np.flatnonzero(tflag & np.uint32(1 << c))) for c in range(nc) if nf[c] > 0]
        self.flagged_tokens += int(nf.sum())
        if has_seq:
            smax = p.seq_max(smn[:, :m].min(axis=0), smx[:, :m].max(axis=0))
        else:
            smax = np.full((1, max(p.n, 1)), -1, np.int64)
        sums = sq_sum[:, :m].sum(axis=0)
        names = j.SEQ_SUMS if clamped_seq else j.SEQ_SUMS[: -j.N_CLAMPED_SUMS]
        seq = {name: sums[:, i] for i, name in enumerate(names)}
        seq[j.SEQ_MAX] = sq_mx[:, :m].max(axis=0)
        seq[j.SEQ_MIN] = sq_mn[:, :m].min(axis=0)
        return BatchOut(
            smax=smax,
            flagged=flagged,
            msum=ms_g,
            mmax=mx_g,
            hist_lin=hl.sum(axis=0),
            hist_log=hg.sum(axis=0),
            seq=seq,
            seq_first=np.where(seen, np.asarray(g_in)[at], -1) if has_seq else first,
            follow=followed,
            m2po_x=m2x if m2po else None,
            m2po_mass=m2m if m2po else None,
            tail=_kept(bounds, tk_n, tk_i, tk_f, tk_b) if tail else None,
            q_counts=qcnt[:, : qe.shape[0]].sum(axis=0) if qb else None,
            q_mass=qcnt[:, qe.shape[0] : 2 * qe.shape[0]].sum(axis=0) if qb else None,
            q_cost=_q_cost(qcnt, qe.shape[0], adv is not None, entropy is not None) if qb else None,
        )

    def _row(self) -> int:
        """Bytes of one group's bins."""
        cw = self.cm.shape[3]
        return 8 * (cw * self.cm.shape[2] + self.sfrac.shape[2] + 3 * self.wsum.shape[2])

    def _per_thread(self) -> None:
        """From the one ordered copy to a copy per thread (copy 0 keeps the sums so far)."""
        self.ordered = False
        for name in _BINS:
            a = getattr(self, name)
            fill = -math.inf if name == "wmax" else 0.0
            setattr(self, name, np.concatenate([a, np.full((self.t - 1, *a.shape[1:]), fill)]))

    def _windows(self, g, bounds: np.ndarray, groups: int) -> tuple[np.ndarray, int] | None:
        """(each chunk's lowest group, the widest chunk's number of groups), where every
        chunk's groups fit ordered bins (the chunks' bins then cover only lowest .. lowest +
        span - 1), else None."""
        nch = bounds.shape[0] - 1
        if groups <= 1:  # one group (an ungrouped replay): nothing to look at
            lo, span = np.zeros(nch, np.int64), 1
        else:
            g = np.asarray(g, np.int64)
            lo = np.minimum.reduceat(g, bounds[:-1])
            span = int((np.maximum.reduceat(g, bounds[:-1]) - lo).max()) + 1
        if nch * span * self._row() > ORDERED_BUDGET:
            return None
        return lo, span

    def _follow_rows(self, g2, bounds: np.ndarray, groups2: int) -> tuple[np.ndarray, int]:
        """(each chunk's lowest g2 group, the rows of a chunk's follower sums): every group
        in every chunk where that is small (FOLLOW_ROWS), else each chunk's window of the
        groups it holds. The rows change no bit: a chunk's sums are added to each group's
        in chunk order either way, and a group a chunk lacks gets +0.0."""
        nch = bounds.shape[0] - 1
        g2 = np.asarray(g2)
        if nch == 1 or groups2 <= 1 or nch * groups2 <= FOLLOW_ROWS or g2.shape[0] == 0:
            return np.zeros(nch, np.int64), max(groups2, 1)
        lo = np.minimum.reduceat(g2, bounds[:-1])
        return lo, int((np.maximum.reduceat(g2, bounds[:-1]) - lo).max()) + 1

    def _thread_bins(self, t: int) -> list[np.ndarray]:
        """Thread t's copy of the bins (per-thread mode)."""
        return [getattr(self, name)[t] for name in _BINS]

    def _chunk_bins(self, nch: int, groups: int) -> list[np.ndarray]:
        """Per-chunk bins for one batch (ordered mode), zeroed (wmax: -inf), in _BINS
        order: (chunks, groups, ...) each (groups: the widest chunk's), reused batch after
        batch."""
        out = []
        for name in _BINS:
            a = getattr(self, name)
            b = self._zeros(f"chunk_{name}", (nch, max(groups, 1), *a.shape[2:]), a.dtype)
            if name == "wmax":
                b.fill(-math.inf)
            out.append(b)
        return out

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
        if self.p.direction:
            for i, k in ((2, "amass"), (3, "corr"), (4, "div")):
                h[k] = np.ascontiguousarray(cm[..., i])
        if self.p.entropy:
            h["ent"] = np.ascontiguousarray(cm[..., 5])
            h["ent_n"] = np.ascontiguousarray(cm[..., 6])
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
        for k in ("corr", "div", "amass", "ent", "ent_n"):  # what a mask costs
            if k in taken:
                out[k] = taken[k][:, a:b]
        if p.woff[slot] >= 0:
            wa = int(p.woff[slot])
            wb = wa + int(p.k[slot]) + 2
            for k in ("wsum", "wsq", "wmax"):
                out[k] = taken[k][:, wa:wb]
        return out


# ----------------------------------------------------------------------------- m2po


def _q_cost(qcnt: np.ndarray, K: int, adv: bool, ent: bool) -> dict[str, np.ndarray]:
    """Each q bucket's |A| sum and finite entropies' sum and count, summed over the
    chunks in chunk order (BatchOut.q_cost; only those of the columns the log has)."""
    out = {}
    if adv:
        out["amass"] = qcnt[:, 2 * K : 3 * K].sum(axis=0)
    if ent:
        out["ent"] = qcnt[:, 3 * K : 4 * K].sum(axis=0)
        out["ent_n"] = qcnt[:, 4 * K : 5 * K].sum(axis=0)
    return out


def _kept(bounds, tk_n, tk_i, tk_f, tk_b) -> tuple[np.ndarray, np.ndarray, dict]:
    """BatchOut.tail from the kernel's compacted stretches (chunk c's: tk_n[c] tokens from
    bounds[c] on), in input order: indices, bits, and the columns the kernel wrote (copies:
    the runner reuses its arrays)."""
    runs = [(int(a), int(k)) for a, k in zip(bounds[:-1].tolist(), tk_n.tolist(), strict=True) if k]

    def join(a):
        return np.concatenate([a[s : s + k] for s, k in runs]) if runs else a[:0].copy()

    cols = {"lp": join(tk_f[0]), "lq": join(tk_f[1]), "adv": join(tk_f[2]), "seq": join(tk_i[1])}
    return join(tk_i[0]), join(tk_b), cols
