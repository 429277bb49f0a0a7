"""The small numba kernels beside the fused pass, row by row: sequence runs, a column's
fast validation, the bootstrap's Poisson weights and replicate sums, q-bucket codes.

jit.py re-exports them, so `runner.compiled()` hands out one module with every kernel; like
jit.py, this module is imported only once numba runs. Each docstring names the numpy
computation it reproduces bit for bit (tests/test_kernels.py, tests/test_checks_fast.py).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .vmath import vexp

INF = math.inf


@njit(nogil=True, cache=True)
def seq_runs(step, sid, run):
    """Runs of equal (step, sample_id): run[i] = the run of token i; returns the runs'
    first token indices."""
    n = step.shape[0]
    starts = np.empty(n, np.int64)
    r = -1
    for i in range(n):
        if i == 0 or step[i] != step[i - 1] or sid[i] != sid[i - 1]:
            r += 1
            starts[r] = i
        run[i] = r
    return starts[: r + 1]


@njit(nogil=True, cache=True)
def take_runs(run, a, b, out_a, out_b):
    """out_a[i] = a[run[i]], out_b[i] = b[run[i]] (each token's sequence ids, GIL free)."""
    for i in range(run.shape[0]):
        out_a[i] = a[run[i]]
        out_b[i] = b[run[i]]


@njit(nogil=True, cache=True)
def check_column(x, limit):
    """2 if some value is NaN, infinite or above limit; else 1 if some value is above 0;
    else 0 (ingest's fast validation, canonical.quick_check)."""
    pos = False
    for i in range(x.shape[0]):
        v = x[i]
        if not (v <= limit) or v == -INF or v == INF:
            return 2
        pos |= v > 0
    return 1 if pos else 0


_PW_C1 = np.uint64(0x9E3779B97F4A7C15)
_PW_C2 = np.uint64(0xD1B54A32D192ED03)
_PW_C3 = np.uint64(0xBF58476D1CE4E5B9)
_PW_C4 = np.uint64(0x94D049BB133111EB)
_PW_SEED = np.uint64(1_000_003)


@njit(nogil=True, cache=True)
def poisson_weights_t(units, replicates, seed, icdf, out):
    """out[i, r] = the Poisson(1) weight of unit units[i] in replicate r: engine.bins'
    poisson_weights (the same splitmix64 hash, bit for bit), written units-major. icdf[k]
    = ceil(cdf[k] * 2**53): u * 2**-53 >= cdf[k] iff u >= icdf[k] (exact), so the inverse-
    CDF search compares integers (len(icdf) > 8)."""
    s = np.uint64(seed) * _PW_SEED
    nc = icdf.shape[0]
    rterm = np.empty(replicates, np.uint64)
    for r in range(replicates):
        rterm[r] = (np.uint64(r) + s) * _PW_C2
    for i in range(units.shape[0]):
        uz = np.uint64(units[i]) * _PW_C1
        for r in range(replicates):
            z = uz + rterm[r]
            z ^= z >> np.uint64(30)
            z *= _PW_C3
            z ^= z >> np.uint64(27)
            z *= _PW_C4
            z ^= z >> np.uint64(31)
            m = z >> np.uint64(11)
            # the entries <= m, counted without a branch over the first 8 (icdf ascends:
            # the linear search's answer; Poisson(1) passes 8 once in ~10^6 draws), where a
            # search's unpredictable exits cost ~15 ns a draw
            k = 0
            for c in range(8):
                k += m >= icdf[c]
            if k == 8:
                while k < nc and m >= icdf[k]:
                    k += 1
            out[i, r] = k


@njit(nogil=True, cache=True)
def add_replicates(unit, bins, mult, wt, out):
    """out[bins[i], r] += mult[i] * wt[unit[i], r] for every entry i and replicate r: a
    bootstrap's replicate counts per bin, entry by entry (integers in float64: exact in any
    order)."""
    nr = wt.shape[1]
    for i in range(unit.shape[0]):
        u = unit[i]
        b = bins[i]
        m = mult[i]
        for r in range(nr):
            out[b, r] += m * wt[u, r]


@njit(nogil=True, cache=True)
def q_bucket_codes(lq, edges, out, first):
    """out[i] = np.searchsorted(edges, q, "right") - 1 for q = exp(lq[i]) (vmath's exp, the
    bits of pmath's): each token's inference-probability bucket (edges ascending from 0);
    first[k] = the first token in bucket k (-1: none; the caller fills it with -1)."""
    ne = edges.shape[0]
    for i in range(lq.shape[0]):
        q = vexp(lq[i])
        k = 0
        while k + 1 < ne and q >= edges[k + 1]:
            k += 1
        out[i] = k
        if first[k] < 0:
            first[k] = i


@njit(nogil=True, cache=True)
def seq_cost(lp, lq, adv, ent, local, has_adv, has_ent, out):
    """What a mask costs, per sequence of a batch (engine.Sequences.add_cost's numpy):
    out[s] += (corrective tokens, divergent tokens, sum |A|, sum of the finite entropies,
    their count) over the tokens i with local[i] == s. A run of one sequence's tokens is
    summed in registers starting from out[s], token by token: the additions np.bincount
    makes, in its order (the same sums, bit for bit). Corrective: A * (lp - lq) < 0,
    divergent > 0 (bins.direction_class)."""
    n = local.shape[0]
    i = 0
    while i < n:
        s = local[i]
        r0 = out[s, 0]
        r1 = out[s, 1]
        r2 = out[s, 2]
        r3 = out[s, 3]
        r4 = out[s, 4]
        while i < n and local[i] == s:
            if has_adv:  # selects, not branches: the signs are random token to token
                a = adv[i]
                d = lp[i] - lq[i]
                ap = 1.0 if a > 0.0 else 0.0
                an = 1.0 if a < 0.0 else 0.0
                dp = 1.0 if d > 0.0 else 0.0
                dn = 1.0 if d < 0.0 else 0.0
                r0 += ap * dn + an * dp
                r1 += ap * dp + an * dn
                r2 += abs(a)
            if has_ent:
                e = ent[i]
                fin = e - e == 0.0  # finite
                r3 += e if fin else 0.0
                r4 += 1.0 if fin else 0.0
            i += 1
        out[s, 0] = r0
        out[s, 1] = r1
        out[s, 2] = r2
        out[s, 3] = r3
        out[s, 4] = r4
