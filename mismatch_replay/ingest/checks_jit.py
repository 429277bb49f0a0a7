"""The numba kernels of inspect's per-batch checks: `AlignmentCheck` and `DuplicateCheck`.

Design
------
inspect feeds every batch of a log to two checks (analysis/inspect.py: Checks). Their polars
code (a select of eight aggregates; a sort by (step, sample_id, position), shifts and a
filter; numpy run boundaries for the duplicates) is the reference and stays the path taken
wherever a batch is not what these kernels take. Here each is a loop or two over the batch's
buffers, written so that LLVM vectorizes them (no fast-math: the bits are the reference's):

* `column_stats` (alignment.py): the degenerate-column statistics of the two log-prob
  columns (tokens, lp == lq, zeros, min and max of each), read as their int64 bits: the
  tests are integer ones, and min and max are taken over an order-preserving integer key of
  the float (`_key`, its own inverse), where float min/max reductions would not vectorize.
  A value that is not finite, or a column holding both 0.0 and -0.0 (polars' min or max
  picks either sign), is reported: the caller takes the statistics from polars.
* `lag_sums` (alignment.py): the pairs of consecutive rows of one sequence (same step and
  sample_id, and next position where the log has one) and the sums of |lp - lq| at lags 0,
  +1 and -1 over them. Trainers write a sequence's tokens in order, so a batch is usually
  sorted by (step, sample_id, position) already: the first loop checks that every key is
  strictly above the one before (a repeated key is refused too: the order of ties after
  polars' sort is its own) and marks the pairs; on a refusal the caller sorts with polars.
  The second loop sums the marked terms in blocks of 128 added into compensated (Neumaier)
  sums: the same terms as polars', in another order, within a few ulps of its sums.
* `seq_runs` (canonical.py, DuplicateCheck): the runs of rows of one (step, sample_id), with
  each run's row count and lowest and highest position; it gives up (-1) past `limit` runs,
  where polars' group_by is the cheaper path. A vectorized pass over blocks of 64 rows
  (`_blocks`: one key within the block? its lowest and highest position) lets the row loop
  skip every block inside a run: a run is ~500 rows in a trainer's log.

Imported only once `fast.compiled()` has started numba (the numba backend); with the backend
forced to numpy the checks run their polars (and numpy) code. The signatures are declared
(readonly C arrays, so that zero-copy polars buffers and copies share one compiled version)
and cached next to the module like fast/jit.py's kernels; keys arrive as int64. They run
in the read-ahead thread (canonical's validation, and inspect's checks as the replay's
observers: engine/replay.py `_observed`) and release the GIL, so the thread that feeds the
Tallies is not held up behind them. (When they ran in that thread themselves they kept the
GIL: a call that released it for about a millisecond then waited to get it back behind
the read-ahead thread.)
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

# column_stats' outputs
N, EQUAL, ZT, ZI, ZT_NEG, ZI_NEG, NONFINITE, LOT, HIT, LOI, HII = range(11)
# lag_sums' float outputs
D0, DP, DM = range(3)
BLOCK = 128  # terms summed plainly before they join the compensated sums
RUN_BLOCK = 64  # rows seq_runs takes whole where they lie inside one run

_ABS = np.int64(0x7FFF_FFFF_FFFF_FFFF)
_EXP = np.int64(0x7FF0_0000_0000_0000)  # the bits of +inf: above it NaN, at it inf
_NEG0 = np.int64(-0x8000_0000_0000_0000)  # the bits of -0.0
_KMAX = np.int64(0x7FFF_FFFF_FFFF_FFFF)
_KMIN = np.int64(-0x8000_0000_0000_0000)

_i64 = types.Array(types.int64, 1, "C", readonly=True)
_f64 = types.Array(types.float64, 1, "C", readonly=True)
_oi = types.Array(types.int64, 1, "C")
_of = types.Array(types.float64, 1, "C")
_ob = types.Array(types.boolean, 1, "C")


@njit(inline="always")
def _key(u):
    """An int64 key in the order of the float64 whose bits are u (-0.0 just below 0.0);
    its own inverse."""
    return u ^ ((u >> 63) & _ABS)


@njit(types.void(_i64, _i64, _oi), cache=True, nogil=True)
def column_stats(ua, ub, out):
    """out[N, EQUAL, ZT, ZI]: the rows, lp == lq, lp == 0, lq == 0 for lp and lq given by
    their bits (ua, ub: the float64 arrays viewed as int64); ZT_NEG, ZI_NEG: the zeros that
    are -0.0; NONFINITE: the rows with a NaN or an infinity; LOT, HIT, LOI, HII: the bits of
    the min and max of lp and of lq (meaningful when NONFINITE is 0)."""
    eq = zt = zi = ztn = zin = bad = 0
    lot = loi = _KMAX
    hit = hii = _KMIN
    for i in range(ua.shape[0]):
        a = ua[i]
        b = ub[i]
        ma = a & _ABS
        mb = b & _ABS
        bad += (ma >= _EXP) | (mb >= _EXP)
        za = ma == 0
        zb = mb == 0
        zt += za
        zi += zb
        ztn += a == _NEG0
        zin += b == _NEG0
        eq += (a == b) | (za & zb)
        ka = _key(a)
        kb = _key(b)
        lot = min(lot, ka)
        hit = max(hit, ka)
        loi = min(loi, kb)
        hii = max(hii, kb)
    out[N] = ua.shape[0]
    out[EQUAL] = eq
    out[ZT] = zt
    out[ZI] = zi
    out[ZT_NEG] = ztn
    out[ZI_NEG] = zin
    out[NONFINITE] = bad
    out[LOT] = _key(lot)
    out[HIT] = _key(hit)
    out[LOI] = _key(loi)
    out[HII] = _key(hii)


@njit(inline="always")
def _neumaier(s, c, x):
    """s + x with the rounding error carried in c (the sum is s + c at the end)."""
    t = s + x
    if abs(s) >= abs(x):
        c += (s - t) + x
    else:
        c += (x - t) + s
    return t, c


@njit(types.int64(_i64, _i64, _i64, types.boolean, _f64, _f64, _ob, _of), cache=True, nogil=True)
def lag_sums(step, sid, pos, has_pos, lp, lq, adj, out):
    """The pairs (t, t + 1) of rows of one sequence: step[t + 1] == step[t] and sid[t + 1]
    == sid[t] (a log without step passes sid twice), and with has_pos pos[t + 1] == pos[t]
    + 1; out[D0, DP, DM] the sums of |lp[t+1] - lq[t+1]|, |lp[t+1] - lq[t]|, |lp[t] -
    lq[t+1]| over them (the finite values of column_stats). Returns the number of pairs, or
    -1 (out not written) when has_pos and the (step, sid, pos) keys do not strictly ascend.
    adj (as long as the arrays) is scratch: adj[t + 1] marks the pairs."""
    n = lp.shape[0]
    bad = 0
    pairs = 0
    if has_pos:
        for j in range(1, n):
            st = step[j] == step[j - 1]
            si = sid[j] == sid[j - 1]
            up = (step[j] > step[j - 1]) | (
                st & ((sid[j] > sid[j - 1]) | (si & (pos[j] > pos[j - 1])))
            )
            bad += 1 - up
            a = st & si & (pos[j] == pos[j - 1] + 1)
            pairs += a
            adj[j] = a
        if bad:
            return -1
    else:
        for j in range(1, n):
            a = (step[j] == step[j - 1]) & (sid[j] == sid[j - 1])
            pairs += a
            adj[j] = a
    s0 = c0 = sp = cp = sm = cm = 0.0
    i = 1
    while i < n:
        e = min(n, i + BLOCK)
        t0 = tp = tm = 0.0
        for j in range(i, e):
            w = 1.0 if adj[j] else 0.0  # x * 0.0 == 0.0 for finite x: a term left out
            a1 = lp[j]
            b1 = lq[j]
            t0 += abs(a1 - b1) * w
            tp += abs(a1 - lq[j - 1]) * w
            tm += abs(lp[j - 1] - b1) * w
        s0, c0 = _neumaier(s0, c0, t0)
        sp, cp = _neumaier(sp, cp, tp)
        sm, cm = _neumaier(sm, cm, tm)
        i = e
    out[D0] = s0 + c0
    out[DP] = sp + cp
    out[DM] = sm + cm
    return pairs


@njit(cache=True, nogil=True)
def _blocks(step, sid, pos, flag, blo, bhi):
    """For each whole block b of RUN_BLOCK rows: flag[b] whether its rows share one (step,
    sid), blo[b] and bhi[b] its lowest and highest position (a loop LLVM vectorizes)."""
    for b in range(step.shape[0] // RUN_BLOCK):
        i = b * RUN_BLOCK
        cs = step[i]
        ci = sid[i]
        d = 0
        lo = hi = pos[i]
        for k in range(RUN_BLOCK):
            d |= (step[i + k] ^ cs) | (sid[i + k] ^ ci)
            p = pos[i + k]
            lo = p if p < lo else lo
            hi = p if p > hi else hi
        flag[b] = d == 0
        blo[b] = lo
        bhi[b] = hi


@njit(inline="always")
def _emit(o_step, o_sid, o_n, o_lo, o_hi, r, step, sid, rows, lo, hi):
    """Run r's entries."""
    o_step[r] = step
    o_sid[r] = sid
    o_n[r] = rows
    o_lo[r] = lo
    o_hi[r] = hi


@njit(types.int64(_i64, _i64, _i64, types.int64, _oi, _oi, _oi, _oi, _oi), cache=True, nogil=True)
def seq_runs(step, sid, pos, limit, o_step, o_sid, o_n, o_lo, o_hi):
    """The runs of rows of equal (step, sid): run r has step o_step[r] and sid o_sid[r] and
    holds o_n[r] rows, positions o_lo[r] to o_hi[r]. Returns the number of runs, or -1 when
    there are more than limit (the outputs hold limit entries). A block of rows inside the
    current run is taken whole from `_blocks`; a block where a run ends, row by row."""
    n = step.shape[0]
    if n == 0:
        return 0
    nb = n // RUN_BLOCK
    flag = np.empty(nb, np.bool_)
    blo = np.empty(nb, np.int64)
    bhi = np.empty(nb, np.int64)
    _blocks(step, sid, pos, flag, blo, bhi)
    r = 0
    start = 0
    cs = step[0]
    ci = sid[0]
    lo = hi = pos[0]
    for b in range(nb + 1):  # the last one: the rows after the whole blocks
        i = b * RUN_BLOCK
        if b < nb and flag[b] and step[i] == cs and sid[i] == ci:
            lo = min(lo, blo[b])
            hi = max(hi, bhi[b])
            continue
        for k in range(i, min(n, i + RUN_BLOCK)):
            s = step[k]
            d = sid[k]
            p = pos[k]
            if s != cs or d != ci:
                if r >= limit:
                    return -1
                _emit(o_step, o_sid, o_n, o_lo, o_hi, r, cs, ci, k - start, lo, hi)
                r += 1
                cs = s
                ci = d
                start = k
                lo = hi = p
            else:
                lo = min(lo, p)
                hi = max(hi, p)
    if r >= limit:
        return -1
    _emit(o_step, o_sid, o_n, o_lo, o_hi, r, cs, ci, n - start, lo, hi)
    return r + 1
