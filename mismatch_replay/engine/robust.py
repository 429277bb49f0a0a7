"""--robust: each group's log10 k3 histogram and top tokens, in one compiled pass per chunk.

What is accumulated (`add_robust_numpy`, the reference, `Tally._add_robust`'s code): per
group g, the count and the k3 sum of every bin of `bins.k3_bin` (k3 = expm1(c) - c, c = l
clipped to +-LOG_CLAMP, pmath's expm1), and the TOP_TOKENS tokens of largest k3 with their
p, q and step / sample_id / position columns. The reference pays, per 1M-token batch, a
full `np.lexsort((-k3, g))`, two `np.bincount`s, np.clip, a numpy-pass pmath.expm1 and
k3_bin's log, and the whole batch's p and q (TokenBatch.p, .q): ~0.25 s per 1M tokens, the
largest single cost of a report.

Design
------
`add_robust` computes the same thing, bit for bit, with one numba kernel (`_chunk`) that
reads each token once, BLOCK (512) tokens at a time: their k3 and bins in two vectorised
loops into block buffers, then, in token order, into the counts, sums and top tokens
(`_add_one`); a few numpy operations per group present follow.

* k3, bit for bit: l = lp - lq (or TokenBatch.l when it is cached or not float64), clipped
  with NaN and -0.0 passing through as np.clip lets them, then `fast.vmath.vexpm1(c) - c`:
  vexpm1 is bit-identical to pmath.expm1 (tests/test_pmath.py), so k3 is the reference's.
* The bin, without a logarithm. bins.k3_bin takes log10 as pmath's log over ln 10 (the same
  bits on every CPU; numpy's own log10 differed in the last bit between its AVX-512 loops
  and others, which could move a k3 within a few ulps of a bin edge). The kernel never
  evaluates a log10: it compares k3 with the edges
  E[b] = 10^(K3_LOG10_MIN + (b - 1) * 0.01) (b = 2 .. K3_BINS; a 20 KB table indexed by
  k3's exponent and top 7 mantissa bits gives the candidate, one or two comparisons finish
  it). A k3 within relative 2^-36 (1.5e-11) of an edge is *flagged* (bin -1) and binned by
  `bins.k3_bin` itself on this machine, so every bin is exactly the reference's: outside
  the windows, k3_bin's answer cannot depend on how log10 rounds (any log10 within ~1e3
  ulps of the true one, and the floor arithmetic after it, decide the same; the windows
  are 4e-12 wide in log10 space, over a thousand ulps), inside them the reference decides.
  At a chunk's first flagged token the kernel stops adding: it writes the k3 and bins of
  the rest of the chunk out, k3_bin bins the flagged ones, and `_accumulate` adds the rest
  in token order, so the order of addition is unchanged. Real logs put no token in a
  window (none of 20M in the benchmark log).
* Counts and sums: each token's (group, bin) count and k3 added to per-batch arrays in
  token order (side by side in one float64 array: counts are exact there), each bin's sum
  starting from 0.0 -- exactly the order in which np.bincount(idx, weights=k3) adds --
  then the batch's rows added to the state's, as the reference does: counts and sums are
  bit-identical, not merely close. (Only the rows of the groups present are added to: the
  reference adds 0.0 to the others, which changes nothing, a state's sums starting at +0.0
  and so never being -0.0.)
* Top tokens without a sort: per group, the batch's best TOP_TOKENS (k3, token index),
  kept sorted; a token is inserted only if its group has fewer, or if it beats the
  current last entry strictly (an equal k3 arriving later loses to the one kept, as with
  the reference's stable lexsort), NaN below every number and kept in arrival order (as
  numpy sorts NaN last): the first TOP_TOKENS in the order (k3 descending, NaN last,
  token index). A per-group bar (the last kept k3 once there are TOP_TOKENS) is the one
  test most tokens stop at. Then, per group present, the reference's own merge with the
  kept entries (concatenate old + new, stable argsort of -k3, first TOP_TOKENS), in
  ascending group order (the `top` dict's insertion order is the reference's too). p and
  q are computed for the selected tokens only (`TokenBatch.X.exp` of their log-probs:
  pmath is elementwise, so the same bits as TokenBatch.p), unless the batch has them.
* Threads. A batch of at least 2 x MIN_CHUNK tokens with more than one group is cut into
  4 chunks per thread (`fast.threads()`), each cut where the group changes (`_cuts`: a
  bisection between two tokens of different groups within half a chunk of the even cut;
  none where one group fills that span), and the chunks are taken by whichever of the
  project's worker threads (`fast.executor`) is free, each thread adding into its own
  count and sum arrays, each chunk into its own top tokens. Counts are integers: any
  split gives the same. A group whose tokens all went to one thread has its sums added in
  token order there (a thread takes its chunks in ascending order), so its rows are the
  serial pass's bit for bit; a log sorted by step never puts a group in two chunks, so
  this is the rule. If some group's tokens did go to two threads (groups interleaved), the
  threads' sums are dropped and the batch is redone in one chunk here (`paths` counts
  batches by path). The chunks' top tokens merge exactly (`_merge_tops`: the first
  TOP_TOKENS in the same total order, an earlier chunk first on ties). No result depends
  on the number of threads or on which thread took which chunk.

Without numba (or on the numpy backend: `fast.backend()`), `add_robust` is the reference.
One difference: on an empty batch the reference raises IndexError (its loop over groups
reads gs[0]); `add_robust` grows the state and adds nothing.
The kernels are compiled on first use into numba's cache next to this module (~1.5 s,
once; later processes load them in ~0.15 s), with read-only inputs always (one
specialisation each); numba's cache does not notice an edit of fast/vmath.py, the same as
fast/jit.py's (clear __pycache__ after changing vmath). Their indices into the tables and
the count arrays are unsigned (numba wraps a negative signed index: a select each, ~20%
of the kernel's time); every one is in range by construction (groups are checked first).

Measured (benchmarks/robust_bench.py: 20M tokens, 153 groups, 1M-token batches, 2-core
AMD EPYC VM, shared): the reference 5.4-5.6 s a replay; `add_robust` on one thread 0.13 s
(6.6 ns a token; the three whole-batch loops it replaced took 0.17 s, 8.7 ns), on the two
threads 0.09-0.11 s (4.7-5.4 ns): 41x and 51-59x. In the report's shared read (the
default sweep's Tally and the per-step one, 20M tokens) the per-step Tally's add_robust
went from 0.155 to 0.08 s of the main thread's time.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading

import numpy as np

from .. import fast, pmath
from ..rules import LOG_CLAMP
from .bins import K3_BINS, K3_LOG10_MAX, K3_LOG10_MIN, TOP_TOKENS, k3_bin

EXTRA_COLUMNS = ("step", "sample_id", "position")
WINDOW = 2.0**-36  # relative half-width of the flag window around each bin edge
LUT_BITS = 7  # mantissa bits of the candidate table's index
BLOCK = 512  # tokens whose k3 and bins the chunk kernel computes before adding them

# E[b]: the smallest k3 of bin b (b = 2 .. K3_BINS), approximately (the windows cover the
# rounding); E[0] = E[1] = 0 and E[K3_BINS + 1] = inf are sentinels.
_STEP = (K3_LOG10_MAX - K3_LOG10_MIN) / K3_BINS
EDGES = np.array(
    [0.0, 0.0]
    + [10.0 ** (K3_LOG10_MIN + (b - 1) * _STEP) for b in range(2, K3_BINS + 1)]
    + [math.inf]
)
LO_SAFE = EDGES * (1.0 + WINDOW)  # k3 >= LO_SAFE[b]: surely in bin b or above
HI_SAFE = EDGES * (1.0 - WINDOW)  # k3 < HI_SAFE[b]: surely below bin b


def _candidate_table() -> tuple[np.ndarray, int]:
    """The bin of the lower end of each (exponent, top LUT_BITS mantissa bits) cell from
    E[2]'s to E[K3_BINS]'s exponent: a cell is 2^-7 wide in relative terms, a bin 2.3%, so
    the true bin is the cell's or the next one. Returns the table and its first cell."""
    e_lo = int(np.frexp(EDGES[2])[1]) - 1 + 1023  # biased exponent of E[2]
    e_hi = int(np.frexp(EDGES[K3_BINS])[1]) - 1 + 1023
    cells = np.arange(e_lo << LUT_BITS, (e_hi + 1) << LUT_BITS, dtype=np.uint64)
    lower = (cells << np.uint64(52 - LUT_BITS)).view(np.float64)
    b = np.searchsorted(EDGES[2 : K3_BINS + 1], lower, side="right") + 1
    # what the kernel's clamping of the cell index relies on
    assert b[0] == 1 and b[-1] == K3_BINS and np.all(np.diff(EDGES[2:]) > EDGES[2:-1] / 64)
    return b.astype(np.int32), e_lo << LUT_BITS


CAND, CAND0 = _candidate_table()


# ----------------------------------------------------------------------------- reference


def _grow(state, G: int) -> None:
    width = K3_BINS + 1
    for name in ("k3_hist", "k3_hist_sum"):
        a = getattr(state, name)
        if a is None:
            a = np.zeros((0, width))
        if a.shape[0] < G:
            a = np.vstack([a, np.zeros((G - a.shape[0], width))])
        setattr(state, name, a)


def _merge_top(state, gi: int, new: dict) -> None:
    """The reference's merge of a group's batch selection into its kept tokens."""
    old = state.top.get(gi)
    if old is not None:
        new = {c: np.concatenate([old[c], new[c]]) for c in new}
    keep = np.argsort(-new["k3"], kind="stable")[:TOP_TOKENS]
    state.top[gi] = {c: v[keep] for c, v in new.items()}


def add_robust_numpy(state, df, tb, g: np.ndarray, G: int) -> None:
    """The reference (Tally._add_robust's numpy code): full lexsort, bincounts."""
    width = K3_BINS + 1
    _grow(state, G)
    k3 = np.clip(tb.l, -LOG_CLAMP, LOG_CLAMP)
    k3 = pmath.expm1(k3) - k3
    idx = g * width + k3_bin(k3)
    state.k3_hist += np.bincount(idx, minlength=G * width).reshape(G, width)
    state.k3_hist_sum += np.bincount(idx, weights=k3, minlength=G * width).reshape(G, width)
    extra = {c: df[c].to_numpy() for c in EXTRA_COLUMNS if c in df.columns}
    order = np.lexsort((-k3, g))  # by group, k3 descending
    gs = g[order]
    starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
    for st in starts:
        gi = int(gs[st])
        sel = order[st : st + TOP_TOKENS]
        sel = sel[g[sel] == gi]
        new = {"k3": k3[sel], "p": tb.p[sel], "q": tb.q[sel]} | {
            c: v[sel] for c, v in extra.items()
        }
        _merge_top(state, gi, new)


# ----------------------------------------------------------------------------- kernels
# Plain functions, compiled by `kernels()` on first use (importing this module does not
# import numba); the names they call (`vexpm1`, `f2u`: fast.vmath's; `k3_of`, `bin_of`,
# `add_one`: the functions below, inlined) are bound there. `_k3_values` and `_k3_binning`
# (whole arrays) serve `k3_bins` and the tests; the pass itself is `_chunk`.

vexpm1 = f2u = k3_of = bin_of = add_one = None


def _k3_of(x, clamp):
    """k3 = expm1(c) - c, c = x clipped to +-clamp, NaN and -0.0 passing as np.clip lets
    them (selects, no branch: the loops using it are vectorised)."""
    x = -clamp if x < -clamp else x
    x = clamp if x > clamp else x
    return vexpm1(x) - x


def _bin_of(v, edges, lo_safe, hi_safe, cand, cand0):
    """k3's bin (bins.k3_bin's), or -1 within a window of an edge. Branch-free: the cell of
    v's exponent and top mantissa bits (clamped to the table: below it bin 1, above it bin
    K3_BINS), one comparison with the next edge (a cell holds at most one), the window
    test, and bin 0 for v <= 0 or NaN."""
    last = cand.shape[0] - 1
    top = edges.shape[0] - 2  # K3_BINS
    j = np.int64(f2u(v) >> np.uint64(52 - LUT_BITS)) - cand0
    j = 0 if j < 0 else j
    j = last if j > last else j
    # unsigned indices (all in range): numba wraps negative signed ones, a select each
    c = np.int64(cand[np.uint64(j)])
    c = min(c + np.int64(v >= edges[np.uint64(c + 1)]), top)  # inf: the top (flagged)
    near = (v < lo_safe[np.uint64(c)]) | (v >= hi_safe[np.uint64(c + 1)])
    b = np.int64(-1) if near else c
    return b if v > 0.0 else np.int64(0)


def _k3_binning(k3, edges, lo_safe, hi_safe, cand, cand0, bins):
    """bin_of over an array (k3_bins); returns the number flagged."""
    flagged = 0
    for i in range(k3.shape[0]):
        b = bin_of(k3[i], edges, lo_safe, hi_safe, cand, cand0)
        flagged += np.int64(b < 0)
        bins[i] = b
    return flagged


def _add_one(i, gi, v, b, width, cs, topk, topi, topn, bar, T):
    """Token i (group gi in 0 .. G - 1, k3 v, bin b in 0 .. width - 1: unchecked, the
    indices are unsigned) into the counts and sums and its group's best T by (k3
    descending, NaN last, arrival). bar[gi]: the group's last kept k3 once it has T (NaN
    before): a token not above it is not kept, the test most tokens stop at."""
    j = np.uint64(2 * (gi * width + b))
    cs[j] += 1.0
    cs[j + np.uint64(1)] += v
    u = np.uint64(gi)
    if v <= bar[u]:  # T kept, the last not NaN, v not above it (NaN v goes on)
        return
    base = gi * T
    m = topn[u]
    if v != v:  # NaN: below every number, after the NaNs kept
        if m < T:
            topk[np.uint64(base + m)] = v
            topi[np.uint64(base + m)] = i
            topn[u] = m + 1
            if m + 1 == T:
                bar[u] = v
        return
    if m < T:
        pos = m
        topn[u] = m + 1
    else:
        last = topk[np.uint64(base + T - 1)]
        if not (v > last or last != last):  # an equal k3 keeps the earlier token
            return
        pos = T - 1
    while pos > 0:
        prev = topk[np.uint64(base + pos - 1)]
        if not (prev < v or prev != prev):
            break
        topk[np.uint64(base + pos)] = prev
        topi[np.uint64(base + pos)] = topi[np.uint64(base + pos - 1)]
        pos -= 1
    topk[np.uint64(base + pos)] = v
    topi[np.uint64(base + pos)] = i
    if topn[u] == T:
        bar[u] = topk[np.uint64(base + T - 1)]


def _accumulate(g, k3, bins, lo, hi, G, width, cs, topk, topi, topn, bar, T):
    """Tokens lo .. hi-1 into the counts and k3 sums per (group, bin), added in token order,
    and each group's best T tokens by (k3 descending, NaN last, arrival). Returns -1, or
    the index of a token whose group is outside 0 .. G - 1 or whose bin is outside
    0 .. width - 1 (nothing from it on is added)."""
    for i in range(lo, hi):
        gi = g[i]
        b = bins[i]
        if gi < 0 or gi >= G or b < 0 or b >= width:
            return i
        add_one(i, gi, k3[i], b, width, cs, topk, topi, topn, bar, T)
    return -1


def _chunk(lo, hi, lp, lq, use_l, clamp, g, G, width, edges, lo_safe, hi_safe, cand, cand0,
           cs, topk, topi, topn, bar, T, kb, bb, k3, bins, ret):  # fmt: skip
    """Tokens lo .. hi-1 in one read, BLOCK tokens at a time: their k3 and bins into the
    block buffers kb, bb (vectorised loops), then into the counts, sums and top tokens in
    token order (`_accumulate`'s). ret[0] = -1, or the first token inside a window (bin
    -1): the tokens before it are added, it and the rest of the chunk are not, their k3 and
    bins written to k3[ret[0]:hi], bins[ret[0]:hi] for the caller to finish. ret[1] = -1,
    or the first token with a group outside 0 .. G - 1 (nothing from it on is added)."""
    ret[0] = -1
    ret[1] = -1
    s = lo
    while s < hi:
        e = min(s + BLOCK, hi)
        m = e - s
        a, b, gs = lp[s:e], lq[s:e], g[s:e]  # views: s + i would be wrapped if negative
        for i in range(m):
            kb[i] = k3_of(a[i] if use_l else a[i] - b[i], clamp)
        flagged = 0
        for i in range(m):
            c = bin_of(kb[i], edges, lo_safe, hi_safe, cand, cand0)
            flagged += np.int64(c < 0)
            bb[i] = c
        stop = m
        if flagged:
            stop = 0
            while bb[stop] >= 0:
                stop += 1
        for i in range(stop):
            gi = gs[i]
            if gi < 0 or gi >= G:
                ret[1] = s + i
                return
            add_one(s + i, gi, kb[i], bb[i], width, cs, topk, topi, topn, bar, T)
        if flagged:  # the rest for the caller: k3_bin decides the flagged bins
            ret[0] = s + stop
            for i in range(stop, m):
                k3[s + i] = kb[i]
                bins[s + i] = bb[i]
            for i in range(e, hi):
                k3[i] = k3_of(lp[i] if use_l else lp[i] - lq[i], clamp)
            for i in range(e, hi):
                bins[i] = bin_of(k3[i], edges, lo_safe, hi_safe, cand, cand0)
            return
        s = e


def _merge_tops(ck, ci, cn, G, T, pos, topk, topi, topn):
    """Each group's best T over the chunks' own (ck, ci, cn: one row per chunk, in token
    order), by (k3 descending, NaN last, then the earlier chunk: the earlier token)."""
    nch = cn.shape[0]
    for gi in range(G):
        base = gi * T
        for c in range(nch):
            pos[c] = 0
        m = 0
        while m < T:
            best = -1
            bv = 0.0
            for c in range(nch):
                if pos[c] < cn[c, gi]:
                    v = ck[c, base + pos[c]]
                    if best < 0 or v > bv or (bv != bv and v == v):
                        best = c
                        bv = v
            if best < 0:
                break
            topk[base + m] = bv
            topi[base + m] = ci[best, base + pos[best]]
            pos[best] += 1
            m += 1
        topn[gi] = m


def _k3_values(lp, lq, use_l, clamp, k3):
    """k3 of every token: l = lp - lq, or lp itself if use_l (a vectorised loop)."""
    for i in range(k3.shape[0]):
        k3[i] = k3_of(lp[i] if use_l else lp[i] - lq[i], clamp)


class Kernels:
    """The compiled loops."""

    def __init__(self, values, binning, accumulate, chunk, merge_tops):
        self.values = values
        self.binning = binning
        self.accumulate = accumulate
        self.chunk = chunk
        self.merge_tops = merge_tops


_kernels: Kernels | None = None
_kernels_lock = threading.Lock()


def kernels() -> Kernels | None:
    """The compiled loops, or None on the numpy backend (numba missing or not chosen)."""
    global _kernels, vexpm1, f2u, k3_of, bin_of, add_one
    if fast.backend() != "numba":
        return None
    if _kernels is None:
        with _kernels_lock:  # the reader's thread and the main one may both get here
            if _kernels is None:
                from numba import njit

                from ..fast import vmath

                vexpm1, f2u = vmath.vexpm1, vmath.f2u
                inline = njit(inline="always")
                jit = njit(nogil=True, cache=True, error_model="numpy", _nrt=False)
                k3_of = inline(_k3_of)
                bin_of = inline(_bin_of)
                add_one = inline(_add_one)
                _kernels = Kernels(
                    jit(_k3_values),
                    jit(_k3_binning),
                    jit(_accumulate),
                    jit(_chunk),
                    jit(_merge_tops),
                )
    return _kernels


# ----------------------------------------------------------------------------- fast path


KEEP_CELLS = 1 << 20  # (group, bin) cells of a worker's count and sum scratch kept
MIN_CHUNK = 1 << 16  # tokens per thread below which a batch is not split
CHUNKS_PER_THREAD = 4
STATIC = False  # tests: chunk c to "thread" c % threads, one after the other, in this thread
# batches by path, since import: "serial" (one chunk), "threads" (chunks in the workers),
# "redone" (a group in two workers' chunks: redone serially); tests read it
paths: collections.Counter = collections.Counter()


class _Scratch:
    """One worker's arrays, leased for a batch: the count and sum of each (group, bin)
    cell side by side in one float64 array (a token's two additions share a cache line;
    counts are exact in float64 and the state's k3_hist is float64), all zero between
    batches (add_robust zeroes the rows used), reused up to KEEP_CELLS cells (16 MiB: 436
    groups), fresh beyond (then only the pages of the groups present are touched); the
    block buffers; the kernel's two return values."""

    def __init__(self) -> None:
        self.cs: np.ndarray | None = None
        self.kb = np.empty(BLOCK)
        self.bb = np.empty(BLOCK, dtype=np.int32)
        self.ret = np.empty(2, dtype=np.int64)

    def sums(self, cells: int) -> np.ndarray:
        if cells > KEEP_CELLS:
            return np.zeros(2 * cells)
        if self.cs is None or self.cs.shape[0] < 2 * cells:
            self.cs = np.zeros(2 * cells)
        return self.cs[: 2 * cells]


_pool: list[_Scratch] = []  # the scratch not leased now
_pool_lock = threading.Lock()


def _lease(k: int) -> list[_Scratch]:
    with _pool_lock:
        got = [_pool.pop() for _ in range(min(k, len(_pool)))]
    return got + [_Scratch() for _ in range(k - len(got))]


def _release(scratch: list[_Scratch]) -> None:
    with _pool_lock:
        _pool.extend(scratch)


def _kept_scratch() -> list[np.ndarray]:
    """The count and sum arrays kept for the next batches (tests: all zero)."""
    with _pool_lock:
        return [s.cs for s in _pool if s.cs is not None]


_local = threading.local()


def _batch_arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's k3 and bins arrays of n tokens, reused (written only from a chunk's
    first flagged token on: real logs never touch them)."""
    b = getattr(_local, "b", None)
    if b is None or b[0].shape[0] < n:
        m = max(n, 2 * b[0].shape[0]) if b is not None else n
        b = _local.b = (np.empty(m), np.empty(m, dtype=np.int32))
    return b[0][:n], b[1][:n]


def _ro(a, dtype) -> np.ndarray:
    """A C-contiguous read-only view: one numba specialisation of the kernels for every
    input (the log's arrays are read-only views of polars', others are not)."""
    a = np.ascontiguousarray(a, dtype=dtype).view()
    a.flags.writeable = False
    return a


def _cuts(g: np.ndarray, n: int, nch: int) -> list[int]:
    """Chunk boundaries 0 < ... < n near the nch-way split, each where the group changes
    (g[c] != g[c - 1]): within half a chunk of its target, found by bisection between two
    tokens of different groups (a change lies between them, whatever the order); a target
    with one group all around it has none. A log sorted by step then never puts a group in
    two chunks."""
    cuts = [0]
    half = max(n // (2 * nch), 1)
    for c in range(1, nch):
        b = c * n // nch
        x, y = max(b - half, cuts[-1]), min(b + half, n - 1)
        if x >= y or g[x] == g[y]:
            continue
        gx = g[x]
        while y - x > 1:  # g[x] == gx != g[y]
            mid = (x + y) // 2
            if g[mid] == gx:
                x = mid
            else:
                y = mid
        cuts.append(y)
    cuts.append(n)
    return cuts


def k3_bins(k3: np.ndarray) -> np.ndarray:
    """bins.k3_bin(k3) as the kernel computes it (the same values; tests)."""
    k = kernels()
    k3 = np.ascontiguousarray(k3, dtype=np.float64)
    if k is None:
        return k3_bin(k3)
    bins = np.empty(k3.shape[0], dtype=np.int64)
    if k.binning(k3, EDGES, LO_SAFE, HI_SAFE, CAND, CAND0, bins):
        f = np.flatnonzero(bins < 0)  # within a window: the reference decides
        bins[f] = k3_bin(k3[f])
    return bins


class _Batch:
    """One batch's inputs to the chunk kernel, and its per-chunk top tokens."""

    def __init__(self, k: Kernels, lp, lq, use_l: bool, g, G: int, nch: int) -> None:
        self.k, self.lp, self.lq, self.use_l, self.g, self.G = k, lp, lq, use_l, g, G
        self.k3, self.bins = _batch_arrays(lp.shape[0])
        self.ck = np.empty((nch, G * TOP_TOKENS))
        self.ci = np.empty((nch, G * TOP_TOKENS), dtype=np.int64)
        self.cn = np.zeros((nch, G), dtype=np.int64)
        self.cb = np.full((nch, G), np.nan)  # each group's bar (_add_one)

    def chunk(self, c: int, lo: int, hi: int, s: _Scratch, cs) -> int:
        """Tokens lo .. hi-1 into cs and chunk c's top tokens, in token order;
        returns -1 or the first token whose group is out of range."""
        k, width, T = self.k, K3_BINS + 1, TOP_TOKENS
        ck, ci, cn, cb = self.ck[c], self.ci[c], self.cn[c], self.cb[c]
        k.chunk(lo, hi, self.lp, self.lq, self.use_l, LOG_CLAMP, self.g, self.G, width,
                EDGES, LO_SAFE, HI_SAFE, CAND, CAND0, cs, ck, ci, cn, cb, T,
                s.kb, s.bb, self.k3, self.bins, s.ret)  # fmt: skip
        stop, bad = int(s.ret[0]), int(s.ret[1])
        if stop >= 0:  # a token within a window of an edge: the reference bins it
            bins = self.bins[stop:hi]
            f = np.flatnonzero(bins < 0)
            bins[f] = k3_bin(self.k3[stop:hi][f])
            bad = k.accumulate(self.g, self.k3, self.bins, stop, hi, self.G, width,
                               cs, ck, ci, cn, cb, T)  # fmt: skip
        return bad


def _refusal(g: np.ndarray, bad: int, G: int) -> Exception:
    """What a token the kernel refused raises: its group out of range, else a bin."""
    if 0 <= g[bad] < G:
        return AssertionError(f"internal error: token {bad}'s k3 bin out of range")
    return ValueError(f"group code {g[bad]} outside 0 .. {G - 1}")


def _count(state, rows: np.ndarray, cs: np.ndarray, G: int) -> None:
    """A worker's rows (the groups it saw) into the state, then its scratch zeroed."""
    cs = cs.reshape(G, K3_BINS + 1, 2)
    if state is not None:
        got = cs[rows]
        state.k3_hist[rows] += got[:, :, 0]
        state.k3_hist_sum[rows] += got[:, :, 1]
    cs[rows] = 0.0


def add_robust(state, df, tb, g: np.ndarray, G: int) -> None:
    """Tally._add_robust, bit for bit, into state's k3_hist, k3_hist_sum and top: compiled
    where numba runs, else the reference itself."""
    k = kernels()
    if k is None:
        add_robust_numpy(state, df, tb, g, G)
        return
    _grow(state, G)
    lp, lq = tb.lp, tb.lq
    use_l = "l" in tb.__dict__ or lp.dtype != np.float64 or lq.dtype != np.float64
    if use_l:  # the batch's own l (a float32 l is exact in float64)
        lp = lq = _ro(tb.l, np.float64)
    else:
        lp, lq = _ro(lp, np.float64), _ro(lq, np.float64)
    n = lp.shape[0]
    g = _ro(g, np.int64)
    nt = max(1, min(fast.threads(), n // max(MIN_CHUNK, 1))) if G > 1 else 1
    cuts = _cuts(g, n, nt * CHUNKS_PER_THREAD) if nt > 1 else [0, n]
    nt = min(nt, len(cuts) - 1)
    scratch = _lease(nt)
    try:
        topk, topi, topn = _accumulate_batch(state, k, lp, lq, use_l, g, G, cuts, scratch)
    finally:
        _release(scratch)
    rows = np.flatnonzero(topn)  # the groups present, ascending
    if not rows.shape[0]:
        return
    extra = {c: df[c].to_numpy() for c in EXTRA_COLUMNS if c in df.columns}
    ns = topn[rows]
    T = TOP_TOKENS
    sel = np.concatenate([topi[r * T : r * T + m] for r, m in zip(rows, ns, strict=True)])
    k3 = np.concatenate([topk[r * T : r * T + m] for r, m in zip(rows, ns, strict=True)])
    cols = {"k3": k3, "p": _probs(tb, "p", sel), "q": _probs(tb, "q", sel)}
    cols |= {c: v[sel] for c, v in extra.items()}
    at = 0
    for r, m in zip(rows.tolist(), ns.tolist(), strict=True):
        _merge_top(state, r, {c: v[at : at + m] for c, v in cols.items()})
        at += m


def _accumulate_batch(state, k, lp, lq, use_l, g, G, cuts, scratch):
    """The batch's counts and sums into the state; returns its best tokens per group
    (topk, topi, topn). One chunk: in this thread. Several: taken by whichever of the
    len(scratch) threads is free, each into its own scratch; a group whose tokens all went
    to one thread has its sums in token order there, so its rows are the serial pass's bit
    for bit; if a group's tokens went to two threads, the batch is redone in one chunk."""
    cells = G * (K3_BINS + 1)
    nch = len(cuts) - 1
    nt = len(scratch)
    sums = [s.sums(cells) for s in scratch]
    if nt > 1:
        batch = _Batch(k, lp, lq, use_l, g, G, nch)
        owner = np.full(nch, -1, dtype=np.int64)
        chunks = itertools.count()  # next() is atomic under the GIL

        def call(t: int) -> int:
            while (c := next(chunks)) < nch:
                owner[c] = t
                bad = batch.chunk(c, cuts[c], cuts[c + 1], scratch[t], sums[t])
                if bad >= 0:
                    return bad
            return -1

        try:
            if STATIC:  # chunk c to thread c % nt, all in this thread (tests)
                bads = [-1] * nt
                for c in range(nch):
                    t = owner[c] = c % nt
                    if bads[t] < 0:
                        bads[t] = batch.chunk(c, cuts[c], cuts[c + 1], scratch[t], sums[t])
            else:
                futs = [fast.executor(nt - 1).submit(call, t) for t in range(1, nt)]
                bads = [call(0)] + [f.result() for f in futs]
        except BaseException:  # the scratch back to zero (every row any chunk saw)
            seen = (batch.cn > 0).any(axis=0)
            for cs in sums:
                _count(None, np.flatnonzero(seen), cs, G)
            raise
        seen = np.zeros((nt, G), dtype=bool)  # the groups each thread saw
        for c in range(nch):
            if owner[c] >= 0:
                seen[owner[c]] |= batch.cn[c] > 0
        bad = min((b for b in bads if b >= 0), default=-1)
        if bad < 0 and (seen.sum(axis=0) <= 1).all():
            paths["threads"] += 1
            topk, topi = np.empty(G * TOP_TOKENS), np.empty(G * TOP_TOKENS, dtype=np.int64)
            topn = np.zeros(G, dtype=np.int64)
            pos = np.empty(nch, dtype=np.int64)
            k.merge_tops(batch.ck, batch.ci, batch.cn, G, TOP_TOKENS, pos, topk, topi, topn)
            for t in range(nt):
                _count(state, np.flatnonzero(seen[t]), sums[t], G)
            return topk, topi, topn
        for t in range(nt):  # nothing counted: the scratch back to zero
            _count(None, np.flatnonzero(seen[t]), sums[t], G)
        if bad >= 0:
            raise _refusal(g, bad, G)
        paths["redone"] += 1
    else:
        paths["serial"] += 1
    batch = _Batch(k, lp, lq, use_l, g, G, 1)
    cs = sums[0]
    try:
        bad = batch.chunk(0, 0, lp.shape[0], scratch[0], cs)
        if bad >= 0:
            raise _refusal(g, bad, G)
    except BaseException:  # the scratch stays all zero
        _count(None, np.flatnonzero(batch.cn[0]), cs, G)
        raise
    _count(state, np.flatnonzero(batch.cn[0]), cs, G)
    return batch.ck[0], batch.ci[0], batch.cn[0]


def _probs(tb, name: str, sel: np.ndarray) -> np.ndarray:
    """tb.p[sel] (or .q): from the batch's array if it has one, else the selected tokens'
    exp alone (TokenBatch.X.exp is elementwise: the same bits)."""
    have = tb.__dict__.get(name)
    if have is not None or not hasattr(tb, "X"):
        return getattr(tb, name)[sel]
    return tb.X.exp((tb.lp if name == "p" else tb.lq)[sel])
