"""diagnose's per-token pass as one numba loop (the numpy code in `DiagnoseStats._numpy_pass`
is the reference and the path without numba).

One loop over a batch's runs of rows (a run: consecutive rows of one sequence, or of one step
without sample ids) computes, per token, l = lp - lq, r = exp(clamp(l, +-20)), k3 =
expm1(l) - l, and adds into: the run's moments (n, r, lq, l, lq^2, lq*l; with the trainer's
entropy h: h, lq*h, h^2, h*l), the position bin's sums (n, |l|, l^2, k3; exact below 4,096,
then power-of-two buckets), the first-token sums,
the placeholder and grid counts, and the noise floor's |l| histogram. numpy needed ~20
elementwise passes and temporaries for the same (0.3 s per million tokens on this machine
against ~0.03 s here). Sums run in row order (float64), so they differ from numpy's
pairwise sums by rounding only (the tests compare to 1e-9 relative).

Imported only once `fast.compiled()` has started numba; released GIL (it runs in the
replay's thread while the read-ahead thread decodes the next batch).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# counts' slots
ZERO_T, ZERO_I, SENT_T, SENT_I, BF_T, BF_I, HF_T, HF_I, FLOOR_N = range(9)
# floats' slots
FLOOR_LQ, ABS_L = range(2)


@njit(inline="always")
def _fp16(x, bits):
    """Whether float64 x (whose float32 rounding has the bits `bits`, exact) is an fp16."""
    if x == 0.0:
        return True
    a = abs(x)
    if a > 65504.0:
        return False
    if a >= 6.103515625e-05:  # 2^-14: normal fp16, 10 mantissa bits of float32's 23
        return (bits & 0x1FFF) == 0
    y = a * 16777216.0  # subnormal: a multiple of 2^-24
    return y == math.floor(y)


@njit(nogil=True, cache=True)
def token_pass(
    lp, lq, lp32, lq32, bt32, bi32, pos, has_pos, starts, off, ent, has_ent,
    runm, posacc, first, hist, counts, floats,
    exact_pos, pos_buckets, sentinel, log_half, floor_lp, hist_lo, hist_scale, hist_bins,
):  # fmt: skip
    n = lp.shape[0]
    nruns = starts.shape[0]
    has_off = off.shape[0] > 0
    for g in range(nruns):
        a = starts[g]
        b = starts[g + 1] if g + 1 < nruns else n
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
        s4 = 0.0
        s5 = 0.0
        s6 = 0.0
        s7 = 0.0
        s8 = 0.0
        for i in range(a, b):
            p = lp[i]
            q = lq[i]
            el = p - q
            c = min(max(el, -20.0), 20.0)
            r = math.exp(c)
            k3 = math.expm1(min(el, 700.0)) - el
            al = abs(el)
            s0 += r
            s1 += q
            s2 += el
            s3 += q * q
            s4 += q * el
            if has_ent:
                h = ent[i]
                s5 += h
                s6 += q * h
                s7 += h * h
                s8 += h * el
            floats[ABS_L] += al
            # position
            idx = off[g] + (i - a) if has_off else -1
            ps = pos[i] if has_pos else idx
            if ps >= 0:
                if ps < exact_pos:
                    bn = ps
                else:
                    k = math.floor(math.log2(float(ps))) - 12
                    bn = exact_pos + min(k, pos_buckets - 1)
                posacc[bn, 0] += 1.0
                posacc[bn, 1] += al
                posacc[bn, 2] += el * el
                posacc[bn, 3] += k3
            if has_off:
                if idx == 0:
                    first[0] += 1.0
                    first[1] += al
                    first[2] += el * el
                else:
                    first[3] += 1.0
                    first[4] += al
                    first[5] += el * el
            # placeholders
            if p == 0.0 and q < log_half:
                counts[ZERO_T] += 1
            if q == 0.0 and p < log_half:
                counts[ZERO_I] += 1
            if p <= sentinel:
                counts[SENT_T] += 1
            if q <= sentinel:
                counts[SENT_I] += 1
            # grids: float32 exact, then bf16 (low 16 bits 0) / fp16
            bt = bt32[i]
            bi = bi32[i]
            if float(lp32[i]) == p:
                if (bt & 0xFFFF) == 0:
                    counts[BF_T] += 1
                if _fp16(p, bt):
                    counts[HF_T] += 1
            if float(lq32[i]) == q:
                if (bi & 0xFFFF) == 0:
                    counts[BF_I] += 1
                if _fp16(q, bi):
                    counts[HF_I] += 1
            # noise floor
            if p > floor_lp and q > floor_lp:
                counts[FLOOR_N] += 1
                floats[FLOOR_LQ] += q
                if al == 0.0:
                    hist[0] += 1
                else:
                    k = math.floor((math.log10(al) - hist_lo) * hist_scale)
                    k = min(max(k, -1), hist_bins) + 1
                    if k == 0:
                        k = 1
                    hist[k] += 1
        runm[g, 0] = b - a
        runm[g, 1] = s0
        runm[g, 2] = s1
        runm[g, 3] = s2
        runm[g, 4] = s3
        runm[g, 5] = s4
        runm[g, 6] = s5
        runm[g, 7] = s6
        runm[g, 8] = s7
        runm[g, 9] = s8


_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_GOLD = 0x9E3779B97F4A7C15


@njit(inline="always")
def _mix(x):
    """splitmix64's finaliser on a uint64 (the same bits as diagnose._mix)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_M1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


@njit(nogil=True, cache=True)
def boot_add(rk, runm, boot, srow, step_boot, seed, cdf):
    """boot[b] += w(rk[g], b) * runm[g] for every run g and replicate b, and the per-step
    replicates of (n, sum r) for runs with srow[g] >= 0: diagnose.poisson_weights' weights
    (the same bits), never held as a matrix."""
    nb = boot.shape[0]
    m = runm.shape[1]
    ncdf = cdf.shape[0]
    for g in range(rk.shape[0]):
        k = rk[g]
        sr = srow[g]
        for b in range(nb):
            h = _mix(k ^ _mix(np.uint64(b) * np.uint64(_GOLD) + np.uint64(seed)))
            u = float(h >> np.uint64(11)) * (1.0 / 9007199254740992.0)
            w = 0
            while w < ncdf and cdf[w] <= u:
                w += 1
            if w == 0:
                continue
            fw = float(w)
            for j in range(m):
                boot[b, j] += fw * runm[g, j]
            if sr >= 0:
                step_boot[sr, b, 0] += fw * runm[g, 0]
                step_boot[sr, b, 1] += fw * runm[g, 1]
