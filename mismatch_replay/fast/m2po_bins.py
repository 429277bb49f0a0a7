"""m2po's per-step bins: each step's tokens ranked by l^2, a rank's score the mean l^2 of
the ranks after it (engine/m2po.py's store hands a whole step here).

Design
------
`m2po_step_bins` adds one step's bins. Where numba runs it sorts the step's l^2 once and
`jit.m2po_step` walks the ranks against the sorted thresholds (ties split by a boundary go
back to input order: `jit.m2po_ties`); elsewhere, and for AReaL's two variants (the last
rank kept, float32 suffix sums), a stable argsort and cumulative sums are the reference
(tests/test_kernels.py compares the two). Its scratch is per thread (`_scratch`) and
reused from step to step: a step's arrays fresh from the system would fault in every page.
It lives apart from runner.py, which runs the per-token kernel, and uses only runner's
public names.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from .runner import bin_scores, compiled, readonly

_SCRATCH = threading.local()
_NONE1 = np.zeros(1, np.float64)
_NONE2 = np.zeros((1, 1), np.float64)


def _scratch(n: int) -> tuple[np.ndarray, ...]:
    """This thread's scratch for m2po_step, at least n long (steps reuse it: no fresh pages
    per step)."""
    have = getattr(_SCRATCH, "arrays", None)
    if have is None or have[0].shape[0] < n:
        m = max(n, 1024)
        have = _SCRATCH.arrays = (
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
    step; masked iff score >= tau. Fused backend: `jit.m2po_step`; numpy backend:
    a stable argsort (the reference). `keep_last` (m2po@areal): the last rank is never
    masked (AReaL masks all but one token when no tail's mean is under tau).
    `precision="float32"`: the suffix sums, counts and means in float32, as AReaL's torch
    code runs them on the CPU (a sequential cumsum in double, each sum rounded to float32;
    a GPU scan adds in another order). keep_last also masks only the ranks before the first
    whose mean is below tau, as AReaL's `k = first index with mean < tau` does. Both take
    the numpy path.
    """
    k = thr_sorted.shape[0]
    n = x.shape[0]
    if n == 0:
        return
    j = compiled() if not keep_last and precision == "float64" else None
    if j is not None:
        xs = np.sort(x)[::-1].copy()
        thr = np.ascontiguousarray(thr_sorted, dtype=np.float64)
        has_invn = inv_n is not None and out_seqfrac is not None
        brank, suf, bval, btie, level, ties = _scratch(n)
        x = readonly(x, np.float64)
        tokens = (
            readonly(g, np.int64),
            readonly(mass, np.float64),
            readonly(seq, np.int64),
            readonly(inv_n, np.float64) if has_invn else readonly(_NONE1, np.float64),
        )
        outs = (out_count, out_mass, out_seqfrac if has_invn else _NONE2, seq_bin, has_invn)
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
        # torch's CPU cumsum of a float32 tensor adds in double and rounds each partial sum
        # to float32 (its accumulate type); the division is float32
        xs32 = xs.astype(np.float32)
        suffix32 = np.cumsum(xs32[::-1].astype(np.float64))[::-1].astype(np.float32)
        score = (suffix32 / np.arange(n, 0, -1, dtype=np.float32)).astype(np.float64)
    else:
        suffix = np.cumsum(xs[::-1])[::-1]  # from the smallest up: no cancellation
        score = suffix / (n - np.arange(n))
    if keep_last:
        # AReaL masks the ranks before the FIRST whose suffix mean is below tau: where the
        # rounded means dip under tau and come back (ties at tau) a later rank >= tau is
        # kept, so a rank scores the smallest mean up to it (exactly: the means fall)
        score = np.minimum.accumulate(score)
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
