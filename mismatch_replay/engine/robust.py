"""--robust: each group's log10 k3 histogram and top tokens, in three compiled loops.

What is accumulated (`add_robust_numpy`, the reference, `Tally._add_robust`'s code): per
group g, the count and the k3 sum of every bin of `bins.k3_bin` (k3 = expm1(c) - c, c = l
clipped to +-LOG_CLAMP, pmath's expm1), and the TOP_TOKENS tokens of largest k3 with their
p, q and step / sample_id / position columns. The reference pays, per 1M-token batch, a
full `np.lexsort((-k3, g))`, two `np.bincount`s, np.clip, a numpy-pass pmath.expm1 and
k3_bin's log, and the whole batch's p and q (TokenBatch.p, .q): ~0.25 s per 1M tokens, the
largest single cost of a report.

Design
------
`add_robust` computes the same thing in three numba loops over the batch (`_k3_values`,
`_k3_binning`, `_accumulate`) and a few numpy operations per group present:

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
  Real logs put no token in a window (none of 20M in the benchmark log).
* Counts and sums: each token's (group, bin) count and k3 added to per-batch arrays in
  token order, each bin's sum starting from 0.0 -- exactly the order in which
  np.bincount(idx, weights=k3) adds -- then the batch's rows added to the state's, as the
  reference does: counts and sums are bit-identical, not merely close. (Only the rows of
  the groups present are added to: the reference adds 0.0 to the others, which changes
  nothing, a state's sums starting at +0.0 and so never being -0.0.)
* Top tokens without a sort: per group, the batch's best TOP_TOKENS (k3, token index),
  kept sorted; a token is inserted only if its group has fewer, or if it beats the
  current last entry strictly (an equal k3 arriving later loses to the one kept, as with
  the reference's stable lexsort), NaN below every number and kept in arrival order (as
  numpy sorts NaN last). Then, per group present, the reference's own merge with the kept
  entries (concatenate old + new, stable argsort of -k3, first TOP_TOKENS), in ascending
  group order (the `top` dict's insertion order is the reference's too). p and q are
  computed for the selected tokens only (`TokenBatch.X.exp` of their log-probs: pmath is
  elementwise, so the same bits as TokenBatch.p), unless the batch has them already.

Without numba (or on the numpy backend: `fast.backend()`), `add_robust` is the reference.
One difference: on an empty batch the reference raises IndexError (its loop over groups
reads gs[0]); `add_robust` grows the state and adds nothing.
The kernels are compiled on first use into numba's cache next to this module (under a
second, once); numba's cache does not notice an edit of fast/vmath.py, the same as
fast/jit.py's (clear __pycache__ after changing vmath).

Measured (benchmarks/robust_bench.py: 20M tokens, 153 groups, 1M-token batches, one core,
2-core AMD EPYC VM, shared): the reference 4.3-4.5 s a replay, `add_robust` 0.16 s (8 ns a
token: k3 ~2, the bins ~2.5, the sums and top tokens ~2.3, the rest numpy), 27-28x; runs
under load from other work measured 21-26x.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .. import fast, pmath
from ..rules import LOG_CLAMP
from .bins import K3_BINS, K3_LOG10_MAX, K3_LOG10_MIN, TOP_TOKENS, k3_bin

EXTRA_COLUMNS = ("step", "sample_id", "position")
WINDOW = 2.0**-36  # relative half-width of the flag window around each bin edge
LUT_BITS = 7  # mantissa bits of the candidate table's index

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
# import numba); the names they call (`vexpm1`, `f2u`: fast.vmath's; `k3_of`, `bin_of`:
# the functions below, inlined) are bound there.

vexpm1 = f2u = k3_of = bin_of = None


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
    c = np.int64(cand[j])
    c = min(c + np.int64(v >= edges[c + 1]), top)  # inf: stays at the top (flagged)
    near = (v < lo_safe[c]) | (v >= hi_safe[c + 1])
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


def _accumulate(g, k3, bins, lo, hi, G, width, cnt, ksum, topk, topi, topn, T):
    """Tokens lo .. hi-1 into the counts and k3 sums per (group, bin), added in token order,
    and each group's best T tokens by (k3 descending, NaN last, arrival). Returns -1, or
    the index of a token whose group is outside 0 .. G - 1 (nothing from it on is added)."""
    for i in range(lo, hi):
        gi = g[i]
        if gi < 0 or gi >= G:
            return i
        v = k3[i]
        j = gi * width + bins[i]
        cnt[j] += 1
        ksum[j] += v
        base = gi * T
        m = topn[gi]
        if v != v:  # NaN: below every number, after the NaNs kept
            if m < T:
                topk[base + m] = v
                topi[base + m] = i
                topn[gi] = m + 1
            continue
        if m < T:
            pos = m
            topn[gi] = m + 1
        else:
            last = topk[base + T - 1]
            if not (v > last or last != last):  # an equal k3 keeps the earlier token
                continue
            pos = T - 1
        while pos > 0:
            prev = topk[base + pos - 1]
            if not (prev < v or prev != prev):
                break
            topk[base + pos] = prev
            topi[base + pos] = topi[base + pos - 1]
            pos -= 1
        topk[base + pos] = v
        topi[base + pos] = i
    return -1


def _k3_values(lp, lq, use_l, clamp, k3):
    """k3 of every token: l = lp - lq, or lp itself if use_l (a vectorised loop)."""
    for i in range(k3.shape[0]):
        k3[i] = k3_of(lp[i] if use_l else lp[i] - lq[i], clamp)


class Kernels:
    """The compiled loops."""

    def __init__(self, values, binning, accumulate):
        self.values = values
        self.binning = binning
        self.accumulate = accumulate


_kernels: Kernels | None = None
_kernels_lock = threading.Lock()


def kernels() -> Kernels | None:
    """The compiled loops, or None on the numpy backend (numba missing or not chosen)."""
    global _kernels, vexpm1, f2u, k3_of, bin_of
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
                _kernels = Kernels(jit(_k3_values), jit(_k3_binning), jit(_accumulate))
    return _kernels


# ----------------------------------------------------------------------------- fast path


_scratch = threading.local()
KEEP_CELLS = 1 << 20  # (group, bin) cells of the count and sum scratch kept between batches


def _buffers(n: int, cells: int) -> tuple[np.ndarray, ...]:
    """This thread's per-batch arrays: k3 and bins (n), reused (fresh arrays of megabytes
    would fault in every page on first touch, each batch); the count and sum arrays
    (cells, all zero: add_robust zeroes the rows it used), reused up to KEEP_CELLS cells
    (16 MiB: 436 groups), fresh beyond (then only the pages of the groups present are
    touched)."""
    b = getattr(_scratch, "b", None)
    if b is None or b[0].shape[0] < n:
        m = max(n, 2 * b[0].shape[0]) if b is not None else n
        b = (np.empty(m), np.empty(m, dtype=np.int32), *(b[2:] if b else (None, None)))
    if cells > KEEP_CELLS:
        _scratch.b = b
        return b[0][:n], b[1][:n], np.zeros(cells, dtype=np.int64), np.zeros(cells)
    if b[2] is None or b[2].shape[0] < cells:
        b = (*b[:2], np.zeros(cells, dtype=np.int64), np.zeros(cells))
    _scratch.b = b
    return b[0][:n], b[1][:n], b[2][:cells], b[3][:cells]


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


def add_robust(state, df, tb, g: np.ndarray, G: int) -> None:
    """Tally._add_robust, bit for bit, into state's k3_hist, k3_hist_sum and top: compiled
    where numba runs, else the reference itself."""
    k = kernels()
    if k is None:
        add_robust_numpy(state, df, tb, g, G)
        return
    width = K3_BINS + 1
    _grow(state, G)
    lp, lq = tb.lp, tb.lq
    use_l = "l" in tb.__dict__ or lp.dtype != np.float64 or lq.dtype != np.float64
    if use_l:  # the batch's own l (a float32 l is exact in float64)
        lp = lq = np.ascontiguousarray(tb.l, dtype=np.float64)
    else:
        lp, lq = np.ascontiguousarray(lp), np.ascontiguousarray(lq)
    n = lp.shape[0]
    k3, bins, cnt, ksum = _buffers(n, G * width)
    g = np.ascontiguousarray(g, dtype=np.int64)
    topk, topi = np.empty(G * TOP_TOKENS), np.empty(G * TOP_TOKENS, dtype=np.int64)
    topn = np.zeros(G, dtype=np.int64)
    k.values(lp, lq, use_l, LOG_CLAMP, k3)
    if k.binning(k3, EDGES, LO_SAFE, HI_SAFE, CAND, CAND0, bins):
        f = np.flatnonzero(bins < 0)  # within a window of an edge: the reference decides
        bins[f] = k3_bin(k3[f])
    try:
        bad = k.accumulate(g, k3, bins, 0, n, G, width, cnt, ksum, topk, topi, topn, TOP_TOKENS)
        if bad >= 0:
            raise ValueError(f"group code {g[bad]} outside 0 .. {G - 1}")
        rows = np.flatnonzero(topn)  # the groups present, ascending
        state.k3_hist[rows] += cnt.reshape(G, width)[rows]
        state.k3_hist_sum[rows] += ksum.reshape(G, width)[rows]
    finally:  # the scratch stays all zero
        rows = np.flatnonzero(topn)
        cnt.reshape(G, width)[rows] = 0
        ksum.reshape(G, width)[rows] = 0.0
    if not rows.shape[0]:
        return
    extra = {c: df[c].to_numpy() for c in EXTRA_COLUMNS if c in df.columns}
    ns = topn[rows]
    sel = np.concatenate(
        [topi[r * TOP_TOKENS : r * TOP_TOKENS + m] for r, m in zip(rows, ns, strict=True)]
    )
    cols = {"k3": k3[sel], "p": _probs(tb, "p", sel), "q": _probs(tb, "q", sel)}
    cols |= {c: v[sel] for c, v in extra.items()}
    at = 0
    for r, m in zip(rows.tolist(), ns.tolist(), strict=True):
        _merge_top(state, r, {c: v[at : at + m] for c, v in cols.items()})
        at += m


def _probs(tb, name: str, sel: np.ndarray) -> np.ndarray:
    """tb.p[sel] (or .q): from the batch's array if it has one, else the selected tokens'
    exp alone (TokenBatch.X.exp is elementwise: the same bits)."""
    have = tb.__dict__.get(name)
    if have is not None or not hasattr(tb, "X"):
        return getattr(tb, name)[sel]
    return tb.X.exp((tb.lp if name == "p" else tb.lq)[sel])
