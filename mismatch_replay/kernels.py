"""Fused kernels: every token rule, the metrics, the scatter and the sequence sums in one loop.

Design
------
The engine's simple path (engine.py, `Tally._add_batch_numpy`) is numpy, rule by rule: each
rule's `score()` builds its float64 arrays with one temporary per operation, then
`np.searchsorted` bins them against the sorted thresholds and `np.bincount` adds the bins:
~3.5 us a token for the default sweep (22 token jobs x 121 values, m2po, 10 sequence jobs),
69 s for 20M tokens, 220x the time polars takes to read the two log-prob columns (the *scan
floor*, benchmarks/README.md).

The fused path compiles the jobs into a small program (an op code and a few constants per
job, `compile_job`) and runs one numba loop over the tokens of a batch (`_kernels_jit`),
block by block (512 tokens, so that the block's arrays stay in cache):

* per token, the shared quantities once: p, q, l, |dp|, k2, k3, r, the clamped ratio, and a
  binary-KL pair per distinct clamp -- 5 libm calls (~40 ns) plus 4 per clamp (~45 ns),
  whatever the number of rules -- with the metric sums, the scatter and the sequence sums;
* per *base* (a quantity and a grid: |dp|, dp, l, r, k2, k3, a binary KL ...; 12 bases serve
  the default sweep's 20 distinct jobs), the bin of every token by *direct indexing*: the top
  bits of the value's order-preserving 64-bit key index a table (<= 2048 entries per grid,
  built once from the sorted thresholds, `make_binner`) that gives the range of thresholds it
  can fall between; comparing with those thresholds themselves settles the bin, so counts are
  exact at every grid point -- ties at a threshold, strict `>` and inclusive `>=`, signed
  zeros and infinities included -- for any grid, uniform, log-uniform or not. A 121-value
  grid puts at most one threshold in a bucket: a table load and a comparison, ~3.5 ns;
* per job, the base's bin moved to 0 or K + 1 by the job's own conditions (the fixed side of
  a band, the sign of the advantage), then the bin's count, |dp| mass, weight sums and each
  sequence's highest bin, added in place (no temporaries, no `np.maximum.at`): ~8 ns a job
  with its share of the bases.
  Identical jobs (`token-mis` and `icepop` at their defaults) are one job.

About 300 ns a token on one core for the whole default sweep (metrics, scatter, sequences
and m2po's inputs included): ~11x less than the simple path. What made the difference, as
measured here: job-major blocks instead of token-major loops, selects instead of branches
(range checks mispredicted on every other token), unsigned flat indices (numba's
negative-index checks cost a third), shared bases, and threads' accumulators kept apart (false
sharing of the metric sums cost 2x).

Every score is computed with the same float64 operations, in the same order and with the same
libm functions as the rule's numpy `score()` (no fast-math), so both paths bin bit-identical
values and their counts agree exactly (tests/test_kernels.py checks it on random logs with
ties; `MISMATCH_REPLAY_KERNEL=numpy` forces the simple path everywhere). Rules the program
does not know (a new rule, a subclass) fall back to the simple path, job by job.

Threads: a batch is split into one contiguous chunk per thread (MISMATCH_REPLAY_THREADS,
default: the usable cores); each thread adds into its own accumulators (the jobs' bins persist
across batches and are summed once, at `Tally.flush`; past ACCUM_BUDGET, 512 MiB of them --
e.g. --by step over thousands of steps on many cores -- fewer threads keep their own). Integer
counts never depend on the split; floating-point sums (mass, weights, metrics) differ in the
last bits, as they already do with how the log is cut into files and batches.

numba is optional (the `fast` extra). Without it everything runs on the simple path with the
same counts. The first call compiles the kernel (~20-30 s), which numba caches on disk next
to the module (`__pycache__`); later processes load it in ~0.5 s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

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
        return "numpy"
    return "numba"


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
        from . import _kernels_jit

        _jit = _kernels_jit
    return _jit


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


def _make_binner(thr: np.ndarray, inclusive: bool, max_lut: int) -> Binner:
    if thr.size == 0 or np.isnan(thr).any():
        raise ValueError("thresholds must be non-empty and not NaN")
    max_lut = max(int(max_lut), 4)  # span >> shift < 3 needs shift <= 63 (a shift of 64
    keys = float_keys(thr)  # is undefined on uint64)
    klo, khi = int(keys[0]), int(keys[-1])
    span = khi - klo
    shift = 0
    while (span >> shift) >= max_lut - 1:
        shift += 1
    nl = (span >> shift) + 1
    top = (1 << 64) - 1
    starts = np.array([min(klo + (u << shift), top) for u in range(nl + 1)], dtype=np.uint64)
    below = np.searchsorted(keys, starts, side="left")
    lut = np.concatenate([[0], below, [thr.size]]).astype(np.int64)
    return Binner(thr, bool(inclusive), lut, nl, np.uint64(klo), np.uint64(khi), np.uint64(shift))


def lut_bins(score: np.ndarray, bn: Binner) -> np.ndarray:
    """The kernel's direct binning, in numpy (tests check it against np.searchsorted on
    machines without numba too)."""
    score = np.asarray(score, dtype=np.float64)
    keys = float_keys(score)
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


def compile_job(job) -> JobCode | None:
    """A token job as an op code and its constants, or None (the simple path runs it).

    Mirrors each rule's `score()` / `weight()` in rules.py; only the catalogue's own classes
    are compiled (a subclass may override score()).
    """
    from .rules import REGISTRY, _log

    rule, param = job.rule, job.param
    if rule.level != "token" or rule.inclusive or REGISTRY.get(rule.name) is not type(rule):
        return None  # the kernel compares strictly (every token rule of the catalogue does)
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


# the quantity each op bins (its "base"); the op's conditions only add bins 0 and K + 1
BASES = ("adp", "dp", "-dp", "l", "-l", "r", "-r", "k2", "k3", "kpop", "bkl_qp")
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


class Program:
    """The compiled token jobs of a Tally: flat arrays the kernel reads.

    `slot[ji]` is the kernel slot of job ji (identical jobs share a slot), or -1 where the
    simple path runs the job (sequence and step rules, unknown rules). Slots that bin the
    same quantity against the same thresholds share a *base*: in the default sweep, 20 slots
    need 12 binnings (e.g. ipo-v1:high and dppo-tv:high both bin dp; tis, cispo:high and
    icepop:high bin l on one grid).
    """

    def __init__(self, jobs):
        self.slot = []
        sigs: dict = {}
        specs: list[tuple[JobCode, int]] = []  # (code, base index)
        bases: dict = {}
        base_specs: list[tuple[int, float | None, Binner]] = []
        for job in jobs:
            code = compile_job(job)
            if code is None:
                self.slot.append(-1)
                continue
            thr = job.thresholds[job.order]
            sig = (code, thr.tobytes())
            if sig not in sigs:
                bname = BASE_OF_OP[OPS[code.op]]
                bsig = (bname, code.clamp, thr.tobytes())
                if bsig not in bases:
                    bases[bsig] = len(base_specs)
                    base_specs.append((BASES.index(bname), code.clamp, make_binner(thr, False)))
                sigs[sig] = len(specs)
                specs.append((code, bases[bsig]))
            self.slot.append(sigs[sig])
        u = len(specs)
        self.n = u
        self.nbase = len(base_specs)
        clamps = sorted(
            {c.clamp for c, _ in specs if c.clamp is not None}
            | {c for _, c, _ in base_specs if c is not None}
        )
        self.clamps = np.array(
            [[c, math.log(c), math.log1p(-c), 1.0 - c] for c in clamps], dtype=np.float64
        ).reshape(len(clamps), 4)

        def cidx(c):
            return clamps.index(c) if c is not None else 0

        # slots
        self.op = np.array([c.op for c, _ in specs], dtype=np.int64)
        self.wop = np.array([c.wop for c, _ in specs], dtype=np.int64)
        self.cix = np.array([cidx(c.clamp) for c, _ in specs], dtype=np.int64)
        self.fp = np.array([c.fp for c, _ in specs], dtype=np.float64).reshape(u, 4)
        self.base = np.array([b for _, b in specs], dtype=np.int64)
        self.k = np.array([base_specs[b][2].thr.size for _, b in specs], dtype=np.int64)
        widths = self.k + 2
        self.off = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        self.width = int(widths.sum())
        wmask = self.wop != W_NONE
        wwidths = np.where(wmask, widths, 0)
        woff = np.concatenate([[0], np.cumsum(wwidths)[:-1]]).astype(np.int64)
        self.woff = np.where(wmask, woff, -1).astype(np.int64)
        self.wwidth = int(wwidths.sum())
        # bases
        bns = [b for _, _, b in base_specs]
        self.bop = np.array([o for o, _, _ in base_specs], dtype=np.int64)
        self.bcix = np.array([cidx(c) for _, c, _ in base_specs], dtype=np.int64)
        self.bk = np.array([b.thr.size for b in bns], dtype=np.int64)
        self.bt0 = np.concatenate([[0], np.cumsum(self.bk)[:-1]]).astype(np.int64)
        self.bnl = np.array([b.nl for b in bns], dtype=np.int64)
        self.bklo = np.array([b.klo for b in bns], dtype=np.uint64)
        self.bkhi = np.array([b.khi for b in bns], dtype=np.uint64)
        self.bshift = np.array([b.shift for b in bns], dtype=np.uint64)
        self.thr = np.concatenate([b.thr for b in bns]) if bns else np.zeros(0, np.float64)
        sizes = [b.lut.size for b in bns]
        self.bl0 = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self.lut = (
            np.concatenate([b.lut for b in bns]).astype(np.int64) if bns else np.zeros(0, np.int64)
        )
        if not specs:
            self.off = self.woff = np.zeros(0, np.int64)
        if not bns:
            self.bt0 = self.bl0 = np.zeros(0, np.int64)

    @property
    def jobs_compiled(self) -> int:
        return sum(1 for s in self.slot if s >= 0)


# ----------------------------------------------------------------------------- state

N_SUMS = 15  # metrics.MetricSums._SUMS order
N_MAXES = 2
PAD = 16  # rows between threads' copies of the per-batch arrays (>= one 64-byte line)
ACCUM_BUDGET = 512 << 20  # bytes of per-thread bins before fewer threads keep their own


@dataclass
class BatchOut:
    """What one fused call returns for its batch (summed over threads)."""

    smax: np.ndarray  # (m, U) max bin per batch sequence and slot
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


class Fused:
    """Per-thread accumulators of one Tally's compiled jobs, and the per-batch call."""

    MIN_CHUNK = 1 << 15  # tokens per thread below which a batch is not split

    def __init__(self, program: Program, seqfrac: bool, nthreads: int | None = None):
        self.p = program
        self.t = nthreads or threads()
        self.seqfrac = seqfrac
        self.gcap = 0
        self.cnt = np.zeros((self.t, 0, program.width), np.int64)
        self.mass = np.zeros((self.t, 0, program.width))
        self.sfrac = np.zeros((self.t, 0, program.width if seqfrac else 1))
        self.wsum = np.zeros((self.t, 0, max(program.wwidth, 1)))
        self.wsq = np.zeros_like(self.wsum)
        self.wmax = np.full_like(self.wsum, -math.inf)
        self.dirty = False

    def _grow(self, groups: int) -> None:
        if groups <= self.gcap:
            return
        cap = max(groups, 2 * self.gcap, 1)
        # Each thread's bins take groups x (sum of K + 2) x ~16 bytes: with --by step on a long
        # log and many cores that adds up, so past ACCUM_BUDGET fewer threads keep bins (the
        # others' are folded into thread 0 first; counts do not change).
        row = 8 * (2 * self.cnt.shape[2] + self.sfrac.shape[2] + 3 * self.wsum.shape[2])
        keep = max(1, min(self.t, ACCUM_BUDGET // max(1, row * (cap + PAD))))
        if keep < self.t:
            self.cnt[0] += self.cnt[keep:].sum(axis=0)
            for name in ("mass", "sfrac", "wsum", "wsq"):
                getattr(self, name)[0] += getattr(self, name)[keep:].sum(axis=0)
            np.maximum(self.wmax[0], self.wmax[keep:].max(axis=0), out=self.wmax[0])
            for name in ("cnt", "mass", "sfrac", "wsum", "wsq", "wmax"):
                setattr(self, name, getattr(self, name)[:keep].copy())
            self.t = keep

        def grow(a, fill):  # PAD spare rows keep the threads' copies off each other's lines
            new = np.full((a.shape[0], cap + PAD, a.shape[2]), fill, dtype=a.dtype)
            new[:, : a.shape[1]] = a
            return new

        self.cnt = grow(self.cnt, 0)
        self.mass = grow(self.mass, 0.0)
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
        u = max(p.n, 1)
        nt = max(1, min(self.t, n // self.MIN_CHUNK))
        bins = scatter_consts[4]
        # Per-thread copies are padded apart (PAD rows) so that two threads never write to
        # the same cache line: false sharing on the metric sums cost 2x.
        gm = groups if metrics else 1
        smax = np.zeros((nt, m + PAD, u), np.int64)
        msum = np.zeros((nt, gm + PAD, N_SUMS))
        mmax = np.full((nt, gm + PAD, N_MAXES), -math.inf)
        hl = np.zeros((nt, bins * bins if scatter else 1), np.int64)
        hg = np.zeros_like(hl)
        sq_sum = np.zeros((nt, m + PAD, 6))
        sq_mx = np.full((nt, m + PAD), -math.inf)
        sq_mn = np.full((nt, m + PAD), math.inf)
        sq_first = np.full((nt, m + PAD), -1, np.int64)
        m2x = np.empty(n) if m2po else _E1
        m2m = np.empty(n) if m2po else _E1
        flags = np.array(
            [
                adv is not None,
                has_seq,
                entropy is not None,
                inv_n is not None and self.seqfrac,
                metrics,
                scatter,
                m2po,
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
        bounds = np.linspace(0, n, nt + 1).astype(np.int64)

        def call(t: int) -> int:
            return j.token_pass(
                bounds[t],
                bounds[t + 1],
                lp,
                lq,
                adv_a,
                g,
                sl,
                invn,
                ent,
                flags,
                p.op,
                p.wop,
                p.cix,
                p.fp,
                p.k,
                p.base,
                p.off,
                p.woff,
                p.bop,
                p.bcix,
                p.bk,
                p.bt0,
                p.bl0,
                p.bnl,
                p.bklo,
                p.bkhi,
                p.bshift,
                p.thr,
                p.lut,
                p.clamps,
                consts,
                self.cnt[t],
                self.mass[t],
                self.sfrac[t],
                self.wsum[t],
                self.wsq[t],
                self.wmax[t],
                smax[t],
                msum[t],
                mmax[t],
                hl[t],
                hg[t],
                sq_sum[t],
                sq_mx[t],
                sq_mn[t],
                sq_first[t],
                m2x,
                m2m,
            )

        if nt == 1:
            errs = [call(0)]
        else:
            futs = [_executor(nt - 1).submit(call, t) for t in range(1, nt)]
            errs = [call(0)] + [f.result() for f in futs]
        if any(errs):
            raise AssertionError("internal error: a rule produced NaN scores")
        first = sq_first[0, :m].copy()
        for t in range(1, nt):  # the first token in input order: the lowest chunk wins
            first = np.where(first < 0, sq_first[t, :m], first)
        return BatchOut(
            smax=smax[:, :m].max(axis=0),
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
        """Sum the threads' accumulators (first `groups` rows) and reset them."""
        g = groups
        out = {
            "count": self.cnt[:, :g].sum(axis=0),
            "mass": self.mass[:, :g].sum(axis=0),
            "seqfrac": self.sfrac[:, :g].sum(axis=0),
            "wsum": self.wsum[:, :g].sum(axis=0),
            "wsq": self.wsq[:, :g].sum(axis=0),
            "wmax": self.wmax[:, :g].max(axis=0),
        }
        self.cnt[:] = 0
        self.mass[:] = 0.0
        self.sfrac[:] = 0.0
        self.wsum[:] = 0.0
        self.wsq[:] = 0.0
        self.wmax[:] = -math.inf
        self.dirty = False
        return out

    def job_view(self, taken: dict[str, np.ndarray], slot: int) -> dict[str, np.ndarray]:
        """One slot's (G, K + 2) columns of `take()`'s arrays."""
        p = self.p
        a, b = int(p.off[slot]), int(p.off[slot] + p.k[slot] + 2)
        out = {"count": taken["count"][:, a:b], "mass": taken["mass"][:, a:b]}
        if self.seqfrac:
            out["seqfrac"] = taken["seqfrac"][:, a:b]
        if p.woff[slot] >= 0:
            wa = int(p.woff[slot])
            wb = wa + int(p.k[slot]) + 2
            for k in ("wsum", "wsq", "wmax"):
                out[k] = taken[k][:, wa:wb]
        return out


# ----------------------------------------------------------------------------- m2po


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
) -> None:
    """Add one step's m2po bins: out_count/out_mass/out_seqfrac[g, bin], and
    seq_bin[seq] = max(seq_bin[seq], bin). x = l^2 of the step's tokens in input order.

    Rank m (0 = largest l^2, ties in input order) scores the mean l^2 of ranks m.. of the
    step; masked iff score >= tau. Fused backend: `_kernels_jit.m2po_step`; numpy backend:
    a stable argsort (the reference).
    """
    k = thr_sorted.shape[0]
    n = x.shape[0]
    if n == 0:
        return
    j = jit()
    if j is not None:
        xs = np.sort(x)[::-1].copy()
        bn = make_binner(thr_sorted, True)
        has_invn = inv_n is not None and out_seqfrac is not None
        err = j.m2po_step(
            xs,
            _ro(x, np.float64),
            _ro(g, np.int64),
            _ro(mass, np.float64),
            _ro(seq, np.int64),
            _ro(inv_n, np.float64) if has_invn else _ro(_E1, np.float64),
            k,
            bn.thr,
            bn.lut,
            bn.nl,
            bn.klo,
            bn.khi,
            bn.shift,
            out_count,
            out_mass,
            out_seqfrac if has_invn else _E2,
            seq_bin,
            has_invn,
        )
        if err:
            raise AssertionError("internal error: m2po produced NaN scores")
        return
    order = np.argsort(-x, kind="stable")
    xs = x[order]
    suffix = np.cumsum(xs[::-1])[::-1]  # from the smallest up: no cancellation
    score = suffix / (n - np.arange(n))
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
