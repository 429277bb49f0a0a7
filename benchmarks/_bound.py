"""A lower bound for any full sweep on this stack: the reading and the arithmetic it cannot skip.

Used by sweep_bench.py (`read5` and `bound`). Every output of the default sweep is built from
per-token p = e^lp, q = e^lq, |dp|, the clamped ratio, k3 and one clamp's pair of binary KLs
(kpop, dppo-kl): whatever an engine does with them, it has to read the five columns and
compute these. `bound` does only that -- the engine's own reader with its read-ahead thread,
and the kernel's vectorised exp/expm1/log (mismatch_replay.fast.vmath) over each batch, one
half per core -- and sums them so that nothing is optimised away. No binning, no per-interval
sums, no sequences, no m2po sort, no table. It is timed after numba has started and the
kernel is loaded, so it is a bound for a warm process.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit

from mismatch_replay import engine, ingest
from mismatch_replay.fast.vmath import vexp, vexpm1, vlog

FIVE = ["trainer_logprob", "inference_logprob", "step", "sample_id", "advantage"]
BLOCK = 512


@njit(nogil=True, cache=True, fastmath={"contract"}, error_model="numpy")
def per_token(lp, lq, lo, hi, clampv, cv, clo, chi, c1, out):
    """Sums of p, q, |dp|, the clamped ratio, k3 and both binary KLs over tokens lo..hi-1,
    computed in blocks as coord_pass computes them (vectorised loops into scratch rows)."""
    x = np.empty((7, BLOCK))
    for start in range(lo, hi, BLOCK):
        nb = min(BLOCK, hi - start)
        for t in range(nb):
            i = start + t
            lpi = lp[i]
            lqi = lq[i]
            ll = lpi - lqi
            p = vexp(lpi)
            q = vexp(lqi)
            lc = min(max(ll, -clampv), clampv)
            la = min(max(lpi, clo), chi)
            lb = min(max(lqi, clo), chi)
            ca = min(max(-vexpm1(la), cv), c1)
            cb = min(max(-vexpm1(lb), cv), c1)
            lca = vlog(ca)
            lcb = vlog(cb)
            d = la - lb
            x[0, t] = p
            x[1, t] = q
            x[2, t] = (p if lpi >= lqi else q) * -vexpm1(-abs(ll))
            x[3, t] = vexp(lc)
            x[4, t] = vexpm1(lc) - lc
            x[5, t] = vexp(la) * d + ca * (lca - lcb)
            x[6, t] = vexp(lb) * -d + cb * (lcb - lca)
        for k in range(7):
            s = 0.0
            for t in range(nb):
                s += x[k, t]
            out[k] += s


def _args(clamp: float = 1e-6, log_clamp: float = 20.0) -> tuple[float, ...]:
    return (log_clamp, clamp, math.log(clamp), math.log1p(-clamp), 1.0 - clamp)


def warm() -> None:
    """Load (or compile, once) the kernel before anything is timed."""
    a = np.zeros(8)
    per_token(a, a, 0, 8, *_args(), np.zeros(7))


def run(path: str, compute: bool) -> dict:
    """Read the five columns as the engine does; with `compute`, the per-token arithmetic
    on every core too. Returns seconds, CPU seconds and the sums (a check)."""
    warm()
    pool = ThreadPoolExecutor(1)
    args = _args()
    t = time.perf_counter()
    c = time.process_time()
    plan = ingest.plan_sources([path])
    out = np.zeros((2, 7))
    rows = 0
    for _, df in engine.prefetch(ingest.iter_batches(plan, FIVE)):
        cols = [df[k].to_numpy() for k in FIVE]
        rows += len(cols[0])
        if compute:
            lp, lq = cols[0], cols[1]
            half = len(lp) // 2
            fut = pool.submit(per_token, lp, lq, half, len(lp), *args, out[1])
            per_token(lp, lq, 0, half, *args, out[0])
            fut.result()
    return {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": time.process_time() - c,
        "tokens": rows,
        "check": float(out.sum()),
    }
