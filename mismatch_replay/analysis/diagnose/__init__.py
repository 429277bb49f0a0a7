"""`diagnose`: why is this run mismatched? Seven findings, each a signature in the two
log-prob columns, from one streamed read of the log.

Design
------
`collect(sources)` streams the log once (ingest's batches, read ahead in a thread as the
engine's replay reads them; invalid rows are counted, never raised: diagnosing is reading
what is wrong) into a `DiagnoseStats`: additive sums only, so memory is bounded by the batch,
by a few arrays per position (4,096 exact positions, then 64 power-of-two buckets), per step
and per bootstrap replicate, and by ~24 bytes per sequence (its key hash, loss tokens so far;
the first-token and last-token questions need them). Each finding is then a function of the
stats (`truncation`, `temperature`, `staleness`, `position`, `placeholders`, `noise_floor`,
`alignment`), returning a `Diagnosis`: verdict `found`, `clear` or `can't tell` (naming the
missing column), the evidence with its numbers, what to do; `diagnose(sources)` is all seven
in a `DiagnoseResult` (`.table`, `.to_dict()`, a summary).

Intervals are a Poisson bootstrap over sequences (steps where the log has no sample_id):
replicate b gives sequence g the weight w_gb ~ Poisson(1), a function of the sequence's key
hash and b alone (splitmix64 -> uniform -> Poisson inverse CDF), so the rows of one sequence
get the same weight in every batch they fall into and each replicate is a sum of weighted
per-run sums: B = 200 replicates cost one [runs x B] weight matrix per batch (2k sequences x
200 for a 1M-token batch of 512-token sequences), not a pass per replicate. A replicate of a
ratio of sums (the token-mean ratio, the slope) is the ratio of its weighted sums; the 95%
interval is its 2.5th and 97.5th percentiles.

The signatures (l = lp - lq, r = p/q = exp(l), lp the trainer's log-prob, lq the engine's):

1. truncation: for any p and q on the same support E_q[p/q] = 1, whatever the staleness or
   kernel noise; an engine logging the renormalised truncated distribution (top-p, top-k,
   min-p) multiplies every ratio by the kept mass S, so the token-mean ratio estimates S.
   Found when its interval lies below 0.99 (the fix: `--map kept_mass=COLUMN`).
2. temperature: one side at temperature T, the other at 1: l = (T - 1) lq + c(context), so
   the least-squares slope of l on lq is T - 1. Found when |slope| > 0.05 and its interval
   excludes 0. (Rounding noise e on lq alone gives -var(e)/var(lq): ~1e-3.)
3. staleness against engine: with old_logprob (the trainer at the rollout's weights) k1 and
   k3 of trainer vs old (the policy lag) and of old vs inference (the engine) say which
   dominates; with a `version` column the lag step - version. An attribution, not a defect:
   `clear` with the split in the evidence.
4. position: mean |l| and k3 by position (`position`, else the token's index among its
   sequence's loss tokens); a changepoint P where the mean |l| of the next 64 positions is
   >= 3x the previous 64 (argmax of that ratio, its 95% interval by the delta method on the
   two window means, tokens as independent), and the first loss token against the rest.
5. placeholders: exactly 0.0 on one side while the other is below log 0.5; sentinels <= -1e4;
   NaN / inf rows (counted by ingest, which other commands refuse); one exact value (not 0)
   on more than 1% of loss tokens (candidates from a strided sample of each batch, counted
   exactly from the batch they appear in); and where they sit: first / last / inner token.
6. noise floor: whether each column lies on the bf16 or fp16 grid, and the 50th and 90th
   percentiles of |l| on tokens with p, q > 0.9 (a 4,000-bin log histogram, 0.8% bins); a
   setting (`-r`, `--from-config`) whose per-token threshold, at the floor tokens' median q,
   lies below the 90th percentile masks rounding noise.
7. alignment: inspect's off-by-one check (`ingest.alignment.AlignmentCheck`) on the same
   batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ...errors import DataError
from ...ingest import ReadOptions, ReadReport, iter_batches, plan_sources
from ...ingest.alignment import AlignmentCheck
from ...present import Presentable
from ...rules import Rule, TokenBatch, parse_rule

SCHEMA_VERSION = 1
VERDICTS = ("found", "clear", "can't tell")
BOOT = 200  # bootstrap replicates
SEED = 0x5EED_D1A6
EXACT_POS = 4096  # positions kept one by one; beyond, power-of-two buckets
POS_BUCKETS = 64
WINDOW = 64  # changepoint windows (positions)
MIN_WINDOW = 8  # positions a window needs at the edges of the range
MIN_WINDOW_TOKENS = 100
JUMP = 3.0  # changepoint and first-token factor
RATIO_FLOOR = 0.99  # truncation: the interval's top below this
SLOPE_LIMIT = 0.05  # temperature
SENTINEL = -1e4
LOG_HALF = math.log(0.5)
FREQ_LIMIT = 0.01  # one exact value on more than this share of loss tokens
FREQ_SAMPLE = 16384  # strided sample per batch for frequent-value candidates
MAX_TRACKED = 16
ZERO_MIN = 3  # zero-vs-low tokens that make a finding: at least 3 and 0.05% of tokens
ZERO_SHARE = 5e-4
MAX_LOCATED = 1 << 22  # placeholder tokens whose place in the sequence is kept
FLOOR_LP = math.log(0.9)
HIST_DECADES = (-12.0, 1.5)
HIST_BINS = 4000
STEP_BOOT_MAX = 4096  # steps with their own bootstrap interval
MOMENTS = 10
FINDINGS = (
    "truncation",
    "temperature",
    "staleness",
    "position",
    "placeholders",
    "noise_floor",
    "alignment",
)
TITLES = {
    "truncation": "Truncated sampling",
    "temperature": "Temperature",
    "staleness": "Staleness vs engine",
    "position": "Position effects",
    "placeholders": "Placeholder log-probs",
    "noise_floor": "Noise floor",
    "alignment": "Alignment",
}

# ----------------------------------------------------------------------------- helpers

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
# Poisson(1) CDF: an inverse-CDF table (P(X > 17) < 1e-15)
_POIS_CDF = np.cumsum([math.exp(-1) / math.factorial(k) for k in range(18)])


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * _M1
        x = x ^ (x >> np.uint64(27))
        x = x * _M2
        return x ^ (x >> np.uint64(31))


def poisson_weights(keys: np.ndarray, replicates: int = BOOT, seed: int = SEED) -> np.ndarray:
    """[len(keys), replicates] float64 Poisson(1) weights, a function of (key, replicate,
    seed) alone: the same sequence gets the same weights in every batch."""
    k = np.asarray(keys, dtype=np.uint64)[:, None]
    b = np.arange(replicates, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = _mix(k ^ _mix(b * _GOLD + np.uint64(seed)))
    u = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return np.searchsorted(_POIS_CDF, u, side="right").astype(np.float64)


def _pos_bin(pos: np.ndarray) -> np.ndarray:
    """Position -> bin: exact below EXACT_POS, then [2^k, 2^(k+1)) buckets after it."""
    pos = np.maximum(pos, 0)
    out = pos.copy()
    big = pos >= EXACT_POS
    if big.any():
        k = np.floor(np.log2(pos[big].astype(np.float64))).astype(np.int64) - 12
        out[big] = EXACT_POS + np.minimum(k, POS_BUCKETS - 1)
    return out


def pos_bin_start(b: int) -> int:
    return b if b < EXACT_POS else 1 << (b - EXACT_POS + 12)


def _ci(reps: np.ndarray) -> tuple[float, float]:
    reps = reps[np.isfinite(reps)]
    if reps.size < 10:
        return math.nan, math.nan
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


def g(v: float | None, digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return "0" if v == 0 else f"{v:.{digits}g}"


def _pct(f: float) -> str:
    return "0%" if f == 0 else f"{100 * f:.3g}%"


def _kernel():
    """kernel.py (numba started by `fast.compiled()`), or None on the numpy backend."""
    from ... import fast

    if fast.backend() != "numba" or fast.compiled() is None:
        return None
    from . import kernel

    return kernel


# ----------------------------------------------------------------------------- sequences


class _Sequences:
    """Every sequence seen: its key hash (sorted) and its loss tokens so far (~16 bytes a
    sequence). `place(run_keys, run_lengths)` gives each run of rows its offset in its
    sequence (tokens of that sequence before it, in earlier batches or earlier runs)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.uint64)
        self.n = np.zeros(0, np.int64)

    def place(self, rk: np.ndarray, rl: np.ndarray) -> np.ndarray:
        uniq, inv = np.unique(rk, return_inverse=True)
        at = np.searchsorted(self.keys, uniq)
        if self.keys.size:
            known = (at < self.keys.size) & (self.keys[np.minimum(at, self.keys.size - 1)] == uniq)
        else:
            known = np.zeros(uniq.size, bool)
        if not known.all():  # insert the new keys
            new = uniq[~known]
            self.keys = np.concatenate([self.keys, new])
            self.n = np.concatenate([self.n, np.zeros(new.size, np.int64)])
            order = np.argsort(self.keys, kind="stable")
            self.keys, self.n = self.keys[order], self.n[order]
            at = np.searchsorted(self.keys, uniq)
        base = self.n[at][inv]  # tokens before this batch
        # runs of one key in this batch: the lengths of its earlier runs
        order = np.argsort(inv, kind="stable")
        cs = np.cumsum(rl[order]) - rl[order]
        first = np.r_[0, np.flatnonzero(np.diff(inv[order])) + 1]
        grp_start = np.repeat(cs[first], np.diff(np.r_[first, order.size]))
        within = np.empty_like(cs)
        within[order] = cs - grp_start
        np.add.at(self.n, at[inv], rl)
        return base + within

    def length(self, keys: np.ndarray) -> np.ndarray:
        at = np.searchsorted(self.keys, keys)
        return self.n[np.minimum(at, self.keys.size - 1)]


# ----------------------------------------------------------------------------- the stats


@dataclass
class DiagnoseStats:
    """What one read of a log accumulates for the findings (additive sums; see the module
    docstring). Build with `collect`, or `DiagnoseStats(columns)` and `add(batch)`."""

    columns: tuple[str, ...]
    replicates: int = BOOT
    tokens: int = 0
    unit: str = "sequence"  # bootstrap unit: sequence, or step
    # truncation / temperature: n, sum r, sum x, sum y, sum xx, sum xy (x = lq, y = l),
    # and with the entropy h: sum h, sum xh, sum hh, sum hy
    mom: np.ndarray = field(default_factory=lambda: np.zeros(MOMENTS))
    boot: np.ndarray | None = None  # [B, MOMENTS]
    units: int = 0  # bootstrap units seen (runs merged by key: approx. for split ones)
    step_index: dict = field(default_factory=dict)
    step_mom: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))  # n, sum r
    step_boot: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 2)))
    kept_mass_sum: float = 0.0
    # staleness: sums of l_to, k3_to, l_oi, k3_oi (trainer-old, old-inference), n
    stale: np.ndarray = field(default_factory=lambda: np.zeros(5))
    lag: dict = field(default_factory=dict)  # lag -> [n, sum k3]
    # position: per bin n, sum |l|, sum l^2, sum k3
    pos: np.ndarray = field(default_factory=lambda: np.zeros((EXACT_POS + POS_BUCKETS, 4)))
    first: np.ndarray = field(default_factory=lambda: np.zeros(6))  # n, |l|, l^2 first; rest
    # placeholders
    zero_low: dict = field(default_factory=lambda: {"trainer": 0, "inference": 0})
    sentinel: dict = field(default_factory=lambda: {"trainer": 0, "inference": 0})
    tracked: dict = field(default_factory=lambda: {"trainer": {}, "inference": {}})
    located: list = field(default_factory=list)  # (category, key hashes, indices)
    located_n: int = 0
    # noise floor
    grid: dict = field(default_factory=lambda: {"trainer": [0, 0], "inference": [0, 0]})
    floor_hist: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS + 2))
    floor_lq: np.ndarray = field(default_factory=lambda: np.zeros(2))  # n, sum lq
    abs_l_sum: float = 0.0
    report: ReadReport = field(default_factory=ReadReport)
    alignment: AlignmentCheck | None = None

    def __post_init__(self) -> None:
        if self.boot is None:
            self.boot = np.zeros((self.replicates, MOMENTS))
        self.unit = "sequence" if "sample_id" in self.columns else "step"
        self.seqs = _Sequences() if "sample_id" in self.columns else None
        if self.alignment is None and AlignmentCheck.possible(self.columns):
            self.alignment = AlignmentCheck()

    # -- accumulation
    def add(self, df: pl.DataFrame) -> None:
        """One batch of canonical loss tokens."""
        n = df.height
        if n == 0:
            return
        lp = np.ascontiguousarray(df["trainer_logprob"].to_numpy(), dtype=np.float64)
        lq = np.ascontiguousarray(df["inference_logprob"].to_numpy(), dtype=np.float64)
        step = df["step"].to_numpy().astype(np.int64, copy=False)
        self.tokens += n
        if "kept_mass" in df.columns:
            self.kept_mass_sum += float(df["kept_mass"].sum())
        starts, rk = self._runs(df, step)
        rl = np.diff(np.r_[starts, n])
        off = self.seqs.place(rk, rl) if self.seqs is not None else None
        pos = None
        if "position" in df.columns:
            pos = np.ascontiguousarray(df["position"].to_numpy(), dtype=np.int64)
        runm = np.zeros((rk.size, MOMENTS))
        ent = None
        if "entropy" in df.columns:
            ent = np.ascontiguousarray(df["entropy"].to_numpy(), dtype=np.float64)
        counts = np.zeros(9, np.int64)
        floats = np.zeros(2)
        first = np.zeros(6)
        hist = np.zeros(HIST_BINS + 2)
        posacc = np.zeros_like(self.pos)
        jit = _kernel()
        args = (lp, lq, pos, ent, starts, off, runm, posacc, first, hist, counts, floats)
        if jit is not None:
            self._jit_pass(jit, *args)
        else:
            self._numpy_pass(*args)
        self.pos += posacc
        self.first += first
        self.floor_hist += hist
        self.floor_lq += [counts[8], floats[0]]
        self.abs_l_sum += floats[1]
        for j, side in enumerate(("trainer", "inference")):
            self.zero_low[side] += int(counts[j])
            self.sentinel[side] += int(counts[2 + j])
            self.grid[side][0] += int(counts[4 + j])
            self.grid[side][1] += int(counts[6 + j])
        # truncation and temperature: the bootstrap over the runs' moments, per step too
        # (runs never cross steps: the key holds the step)
        self.mom += runm.sum(axis=0)
        self.units += int(np.unique(rk).size)
        rs = step[starts]
        srow = np.full(rk.size, -1, np.int64)
        for s in np.unique(rs).tolist():
            i = self.step_index.get(s)
            if i is None:
                i = self.step_index[s] = len(self.step_index)
                self.step_mom = np.vstack([self.step_mom, np.zeros((1, 2))])
                if len(self.step_index) <= STEP_BOOT_MAX and self.unit == "sequence":
                    pad = np.zeros((1, self.replicates, 2))
                    sb = self.step_boot
                    self.step_boot = pad if sb.size == 0 else np.concatenate([sb, pad])
            sel = rs == s
            self.step_mom[i] += runm[sel][:, :2].sum(axis=0)
            if i < self.step_boot.shape[0]:
                srow[sel] = i
        if jit is not None:
            sb = self.step_boot if self.step_boot.size else np.zeros((1, self.replicates, 2))
            jit.boot_add(rk, runm, self.boot, srow, sb, SEED, _POIS_CDF)
        else:
            w = poisson_weights(rk, self.replicates)
            self.boot += w.T @ runm
            for i in np.unique(srow[srow >= 0]).tolist():
                sel = srow == i
                self.step_boot[i] += w[sel].T @ runm[sel][:, :2]
        # staleness
        with np.errstate(over="ignore", invalid="ignore"):
            if "old_logprob" in df.columns:
                lo = df["old_logprob"].to_numpy().astype(np.float64, copy=False)
                a = lp - lo
                b = lo - lq
                self.stale += [
                    float(a.sum()),
                    float((np.expm1(np.minimum(a, 700.0)) - a).sum()),
                    float(b.sum()),
                    float((np.expm1(np.minimum(b, 700.0)) - b).sum()),
                    n,
                ]
            if "version" in df.columns:
                el = lp - lq
                k3 = np.expm1(np.minimum(el, 700.0)) - el
                lag = step - df["version"].to_numpy().astype(np.int64, copy=False)
                u, inv = np.unique(lag, return_inverse=True)
                cnt = np.bincount(inv, minlength=u.size)
                s3 = np.bincount(inv, weights=k3, minlength=u.size)
                for v, c, s in zip(u.tolist(), cnt.tolist(), s3.tolist(), strict=True):
                    acc = self.lag.setdefault(v, [0, 0.0])
                    acc[0] += c
                    acc[1] += s
        # placeholders: where they sit (only batches that hold some), frequent values
        where = None
        if off is not None:
            run_of = None

            def where():
                nonlocal run_of
                if run_of is None:
                    run_of = np.repeat(np.arange(rk.size), rl)
                return run_of

        for j, (side, x, other) in enumerate((("trainer", lp, lq), ("inference", lq, lp))):
            if counts[j]:
                self._locate(
                    f"zero:{side}", (x == 0.0) & (other < LOG_HALF), rk, starts, off, where
                )
            if counts[2 + j]:
                self._locate(f"sentinel:{side}", x <= SENTINEL, rk, starts, off, where)
            self._frequent(side, x, rk, starts, off, where)
        if self.alignment is not None:
            self.alignment.add(df)

    def _runs(self, df: pl.DataFrame, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first row of each run of rows with one unit key, the run's key hash): units are
        sequences (step, sample_id), else steps."""
        if self.seqs is None:
            starts = np.r_[0, np.flatnonzero(step[1:] != step[:-1]) + 1]
            return starts, _mix(step[starts].astype(np.uint64) + _GOLD)
        sid = df["sample_id"]
        if sid.dtype.is_integer():
            s = sid.to_numpy()
            change = (step[1:] != step[:-1]) | (s[1:] != s[:-1])
            starts = np.r_[0, np.flatnonzero(change) + 1]
            hs = s[starts].astype(np.uint64)
        else:  # strings: their polars hash
            hsid = sid.hash(SEED).to_numpy()
            change = (step[1:] != step[:-1]) | (hsid[1:] != hsid[:-1])
            starts = np.r_[0, np.flatnonzero(change) + 1]
            hs = hsid[starts]
        return starts, _mix(_mix(step[starts].astype(np.uint64) + _GOLD) ^ hs)

    def _jit_pass(
        self, jit, lp, lq, pos, ent, starts, off, runm, posacc, first, hist, counts, floats
    ):
        lp32, lq32 = lp.astype(np.float32), lq.astype(np.float32)
        lo, hi = HIST_DECADES
        jit.token_pass(
            lp, lq, lp32, lq32, lp32.view(np.uint32), lq32.view(np.uint32),
            pos if pos is not None else np.zeros(0, np.int64), pos is not None,
            starts.astype(np.int64), off if off is not None else np.zeros(0, np.int64),
            ent if ent is not None else np.zeros(0), ent is not None,
            runm, posacc, first, hist, counts, floats,
            EXACT_POS, POS_BUCKETS, SENTINEL, LOG_HALF, FLOOR_LP, lo, HIST_BINS / (hi - lo),
            HIST_BINS,
        )  # fmt: skip

    def _numpy_pass(self, lp, lq, pos, ent, starts, off, runm, posacc, first, hist, counts, floats):
        """The reference for kernel.token_pass (same outputs, numpy)."""
        n = lp.shape[0]
        rl = np.diff(np.r_[starts, n])
        with np.errstate(over="ignore", invalid="ignore"):
            el = lp - lq
            r = np.exp(np.maximum(np.minimum(el, 20.0), -20.0))
            k3 = np.expm1(np.minimum(el, 700.0)) - el
        absl = np.abs(el)
        floats[1] += absl.sum()
        runm[:, 0] = rl
        for j, v in enumerate((r, lq, el, lq * lq, lq * el), start=1):
            runm[:, j] = np.add.reduceat(v, starts)
        if ent is not None:
            for j, v in enumerate((ent, lq * ent, ent * ent, ent * el), start=6):
                runm[:, j] = np.add.reduceat(v, starts)
        idx = None
        if off is not None:
            run_of = np.repeat(np.arange(starts.size), rl)
            idx = off[run_of] + (np.arange(n) - starts[run_of])
        p = pos if pos is not None else idx
        if p is not None:
            ok = p >= 0
            b = _pos_bin(p[ok])
            size = posacc.shape[0]
            posacc[:, 0] += np.bincount(b, minlength=size)
            posacc[:, 1] += np.bincount(b, weights=absl[ok], minlength=size)
            posacc[:, 2] += np.bincount(b, weights=(el * el)[ok], minlength=size)
            posacc[:, 3] += np.bincount(b, weights=k3[ok], minlength=size)
        if idx is not None:
            f = idx == 0
            first[:3] += [f.sum(), absl[f].sum(), (el[f] ** 2).sum()]
            first[3:] += [(~f).sum(), absl[~f].sum(), (el[~f] ** 2).sum()]
        for j, (x, other) in enumerate(((lp, lq), (lq, lp))):
            counts[j] += int(((x == 0.0) & (other < LOG_HALF)).sum())
            counts[2 + j] += int((x <= SENTINEL).sum())
            x32 = x.astype(np.float32)
            on32 = x32.astype(np.float64) == x
            counts[4 + j] += int((on32 & ((x32.view(np.uint32) & np.uint32(0xFFFF)) == 0)).sum())
            with np.errstate(over="ignore"):
                counts[6 + j] += int((x.astype(np.float16).astype(np.float64) == x).sum())
        conf = (lp > FLOOR_LP) & (lq > FLOOR_LP)
        a = absl[conf]
        counts[8] += a.size
        floats[0] += lq[conf].sum()
        z = a == 0
        hist[0] += int(z.sum())
        if (~z).any():
            lo_, hi_ = HIST_DECADES
            with np.errstate(divide="ignore"):
                k = np.floor((np.log10(a[~z]) - lo_) * (HIST_BINS / (hi_ - lo_)))
            k = np.clip(k, -1, HIST_BINS).astype(np.int64) + 1
            k[k == 0] = 1
            hist += np.bincount(k, minlength=HIST_BINS + 2)[: HIST_BINS + 2]

    def _locate(self, cat: str, mask: np.ndarray, rk, starts, off, where) -> None:
        """Keep the key and in-sequence index of the tokens in `mask` (capped)."""
        if where is None or self.located_n >= MAX_LOCATED or not mask.any():
            return
        rows = np.flatnonzero(mask)
        run = where()[rows]
        self.located.append((cat, rk[run], off[run] + rows - starts[run]))
        self.located_n += rows.size

    def _frequent(self, side: str, x: np.ndarray, rk, starts, off, where) -> None:
        tracked = self.tracked[side]
        stride = max(1, x.size // FREQ_SAMPLE)
        sample = x[::stride]
        if len(tracked) < MAX_TRACKED:
            u, c = np.unique(sample, return_counts=True)
            keep = (c >= max(2, FREQ_LIMIT / 2 * sample.size)) & (u != 0.0)
            for v in u[keep][np.argsort(-c[keep], kind="stable")][: MAX_TRACKED - len(tracked)]:
                tracked.setdefault(float(v), 0)
        for v in list(tracked):
            m = x == v
            tracked[v] += int(m.sum())
            self._locate(f"value:{side}:{v!r}", m, rk, starts, off, where)


def collect(
    sources: Sequence[str | Path] | str | Path,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DiagnoseStats:
    """One streamed read of the log into a `DiagnoseStats`. Invalid rows (NaN, inf, null,
    positive log-probs) are counted per column (`stats.report.dropped`), not raised."""
    from ...engine.stream import prefetch

    if isinstance(sources, str | Path):
        sources = [sources]
    opts = options or ReadOptions()
    if not opts.drop_invalid:
        opts = ReadOptions(**{**opts.__dict__, "drop_invalid": True})
    plan = plan_sources(list(sources), opts)
    want = ["trainer_logprob", "inference_logprob", "step"]
    want += [
        c
        for c in ("sample_id", "position", "entropy", "old_logprob", "kept_mass", "version")
        if c in plan.columns
    ]
    stats = DiagnoseStats(tuple(want))
    stats.files = [str(f) for f in plan.files]
    total = sum(plan.rows)
    for _, df in prefetch(iter_batches(plan, want, stats.report)):
        stats.add(df)
        if progress is not None:
            progress(stats.report.rows, total)
    if stats.tokens == 0:
        raise DataError(
            f"{plan.files[0]}: no loss tokens to diagnose ({stats.report.rows:,} row(s) read, "
            "none with loss_mask true and valid). Check the loss_mask column and --map."
        )
    return stats


# ----------------------------------------------------------------------------- findings


@dataclass
class Diagnosis:
    """One finding: its verdict (found / clear / can't tell), the evidence in words with
    its numbers, what to do, and its numbers (`numbers`) and rows (`rows`: per step, per
    position, per lag) for --json."""

    key: str
    verdict: str
    evidence: str
    action: str
    numbers: dict = field(default_factory=dict)
    rows: pl.DataFrame | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"diagnosis {self.key}: verdict {self.verdict!r}")

    @property
    def title(self) -> str:
        return TITLES.get(self.key, self.key)

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None
            return v

        return {
            "finding": self.key,
            "title": self.title,
            "verdict": self.verdict,
            "evidence": self.evidence,
            "action": self.action,
            "numbers": {k: clean(v) for k, v in self.numbers.items()},
            "rows": None if self.rows is None else _rows(self.rows),
        }


def _rows(t: pl.DataFrame) -> list[dict]:
    out = []
    for r in t.iter_rows(named=True):
        out.append(
            {
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in r.items()
            }
        )
    return out


def truncation(st: DiagnoseStats) -> Diagnosis:
    """Token-mean p/q with its bootstrap interval, overall and per step."""
    n, sr = st.mom[0], st.mom[1]
    mean = sr / n
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = st.boot[:, 1] / st.boot[:, 0]
    lo, hi = _ci(reps)
    steps = sorted(st.step_index)
    rows = []
    for s in steps:
        i = st.step_index[s]
        sn, ss = st.step_mom[i]
        slo = shi = math.nan
        if i < st.step_boot.shape[0]:
            with np.errstate(invalid="ignore", divide="ignore"):
                slo, shi = _ci(st.step_boot[i, :, 1] / st.step_boot[i, :, 0])
        rows.append((s, int(sn), ss / sn, slo, shi))
    table = pl.DataFrame(
        rows,
        schema={"step": pl.Int64, "tokens": pl.Int64, "mean_ratio": pl.Float64,
                "ci_low": pl.Float64, "ci_high": pl.Float64},
        orient="row",
    )  # fmt: skip
    nums = {"mean_ratio": mean, "ci_low": lo, "ci_high": hi, "units": st.units}
    kept = "kept_mass" in st.columns
    if kept:
        nums["kept_mass_mean"] = st.kept_mass_sum / st.tokens
    unit = "sequences" if st.unit == "sequence" else "steps"
    if st.units < 10 or not math.isfinite(lo):
        return Diagnosis(
            "truncation",
            "can't tell",
            f"mean p/q {g(mean, 4)} over {st.tokens:,} tokens, but only {st.units} {unit}: "
            "too few for an interval (needs sample_id, or more steps)",
            "map a sample_id column (--map sample_id=COLUMN)",
            nums,
            table,
        )
    ev = f"mean p/q {g(mean, 4)} (95% CI {g(lo, 4)}–{g(hi, 4)}, {st.units:,} {unit})"
    if len(rows) > 1:
        per = table["mean_ratio"]
        ev += f"; per step {g(per.min(), 3)}–{g(per.max(), 3)}"
    if hi < RATIO_FLOOR:
        nums["kept_mass"] = mean
        return Diagnosis(
            "truncation",
            "found",
            f"{ev}: below 1, as when the engine logs a renormalised top-p/top-k "
            f"distribution; estimated kept mass {g(mean, 3)}",
            "log each token's kept mass and replay with --map kept_mass=COLUMN (or log the "
            "unprocessed log-probs)",
            nums,
            table,
        )
    if kept:
        ev += f"; kept_mass applied (mean {g(nums['kept_mass_mean'], 3)})"
    return Diagnosis("truncation", "clear", ev + ": E_q[p/q] = 1 holds", "nothing", nums, table)


def regression_slope(m: np.ndarray, with_entropy: bool) -> np.ndarray:
    """The least-squares slope of l on lq from moment sums `m` (..., MOMENTS): plain, or
    controlling for the trainer's entropy h (l ~ lq + h + 1), which absorbs most of the
    per-context offset c (see `temperature`)."""
    n = m[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        sx, sy = m[..., 2], m[..., 3]
        cxx = m[..., 4] - sx * sx / n
        cxy = m[..., 5] - sx * sy / n
        if not with_entropy:
            return cxy / cxx
        sh = m[..., 6]
        cxh = m[..., 7] - sx * sh / n
        chh = m[..., 8] - sh * sh / n
        chy = m[..., 9] - sh * sy / n
        return (cxy * chh - cxh * chy) / (cxx * chh - cxh * cxh)


def temperature(st: DiagnoseStats) -> Diagnosis:
    """The least-squares slope of l on lq with its bootstrap interval: T - 1.

    Within one context l = (T - 1) lq + c with c = T logsumexp(z / T) - logsumexp(z); across
    contexts of different shapes c correlates with lq and pulls the plain slope toward 0
    (measured on 20,000 constructed contexts at T = 0.7: 0.757 plain). Where the log has the
    trainer's entropy, the slope is taken with it as a second regressor (0.704 there)."""
    ent = "entropy" in st.columns
    b = float(regression_slope(st.mom, ent))
    lo, hi = _ci(regression_slope(st.boot, ent))
    nums = {"slope": b, "ci_low": lo, "ci_high": hi, "temperature_ratio": 1 + b}
    nums["controls_entropy"] = ent
    if not math.isfinite(b) or not math.isfinite(lo):
        return Diagnosis(
            "temperature",
            "can't tell",
            f"slope {g(b)}: too few {st.unit}s or a constant inference log-prob",
            "map a sample_id column (--map sample_id=COLUMN)",
            nums,
        )
    how = ", entropy held fixed" if ent else ""
    ev = (
        f"slope of l on lq {g(b)} (95% CI {g(lo)}–{g(hi)}{how}): implied temperature ratio "
        f"T_engine/T_trainer {g(1 + b)}"
    )
    if abs(b) > SLOPE_LIMIT and (lo > 0 or hi < 0):
        if not ent:
            ev += " (no entropy column: contexts of different shapes pull it toward 1)"
        return Diagnosis(
            "temperature",
            "found",
            ev,
            "log the log-probs at the temperature the trainer uses (or recompute the "
            "trainer's at the sampler's temperature)",
            nums,
        )
    return Diagnosis("temperature", "clear", ev, "nothing", nums)


def staleness(st: DiagnoseStats) -> Diagnosis:
    """Trainer vs old (policy lag) against old vs inference (engine), and the lag."""
    nums: dict = {}
    parts = []
    rows = None
    if st.lag:
        lags = sorted(st.lag)
        rows = pl.DataFrame(
            {
                "lag": lags,
                "tokens": [st.lag[k][0] for k in lags],
                "kl_k3": [st.lag[k][1] / st.lag[k][0] for k in lags],
            }
        )
        w = np.array([st.lag[k][0] for k in lags], float)
        mean_lag = float(np.dot(lags, w) / w.sum())
        nums.update(lag_min=lags[0], lag_max=lags[-1], lag_mean=mean_lag)
        parts.append(f"lag step − version {lags[0]}–{lags[-1]} (mean {g(mean_lag)})")
    if st.stale[4] > 0:
        n = st.stale[4]
        k1_to, k3_to, k1_oi, k3_oi = (
            -st.stale[0] / n,
            st.stale[1] / n,
            -st.stale[2] / n,
            st.stale[3] / n,
        )
        nums.update(k1_lag=k1_to, k3_lag=k3_to, k1_engine=k1_oi, k3_engine=k3_oi)
        if k3_to >= 2 * k3_oi:
            dom, act = "staleness dominates", "shorten the lag (off-policy steps) or correct for it"
        elif k3_oi >= 2 * k3_to:
            dom, act = (
                "the engine dominates",
                "look at the engine: kernels, precision, sampler settings",
            )
        else:
            dom, act = "both contribute", "both the lag and the engine"
        nums["dominant"] = dom
        parts.insert(
            0,
            f"k3 trainer‖old {g(k3_to)} (k1 {g(k1_to)}) vs old‖inference {g(k3_oi)} "
            f"(k1 {g(k1_oi)}): {dom}",
        )
        return Diagnosis("staleness", "clear", "; ".join(parts), act, nums, rows)
    if parts:
        return Diagnosis(
            "staleness",
            "clear",
            "; ".join(parts) + " (no old_logprob: the split by cause needs it)",
            "log old_logprob to split staleness from the engine",
            nums,
            rows,
        )
    return Diagnosis(
        "staleness",
        "can't tell",
        "no old_logprob column (the trainer's log-prob at the rollout's weights) and no "
        "version column",
        "log old_logprob (--map old_logprob=COLUMN) or the policy version",
        nums,
    )


def position_table(st: DiagnoseStats) -> pl.DataFrame:
    """Mean |l| and k3 by position bin (exact below 4,096, then power-of-two buckets)."""
    have = np.flatnonzero(st.pos[:, 0])
    c = st.pos[have]
    return pl.DataFrame(
        {
            "position": [pos_bin_start(int(b)) for b in have],
            "tokens": c[:, 0].astype(np.int64),
            "mean_abs_l": c[:, 1] / c[:, 0],
            "kl_k3": c[:, 3] / c[:, 0],
        }
    )


def changepoint(st: DiagnoseStats) -> dict | None:
    """The position P maximising mean |l| over [P, P+64) / over [P-64, P) (exact positions;
    windows cut at the ends of the range, at least 8 positions and 100 tokens each), with
    the ratio's 95% interval (delta method on the two means, tokens independent)."""
    c = st.pos[:EXACT_POS]
    have = np.flatnonzero(c[:, 0])
    if have.size < 2 * MIN_WINDOW:
        return None
    lo_p, hi_p = int(have[0]), int(have[-1])
    cs = np.vstack([np.zeros((1, 4)), np.cumsum(c, axis=0)])
    best = None
    for p in range(lo_p + MIN_WINDOW, hi_p - MIN_WINDOW + 2):
        a, b = max(lo_p, p - WINDOW), min(hi_p + 1, p + WINDOW)
        prev, nxt = cs[p] - cs[a], cs[b] - cs[p]
        if min(prev[0], nxt[0]) < MIN_WINDOW_TOKENS or prev[1] <= 0:
            continue
        ratio = (nxt[1] / nxt[0]) / (prev[1] / prev[0])
        if best is None or ratio > best[0]:
            best = (ratio, p, prev, nxt)
    if best is None:
        return None
    ratio, p, prev, nxt = best

    def rel_var(s):
        m = s[1] / s[0]
        var = max(s[2] / s[0] - m * m, 0.0)
        return var / (s[0] * m * m)

    se = math.sqrt(rel_var(prev) + rel_var(nxt))
    return {
        "position": p,
        "ratio": ratio,
        "ci_low": ratio * math.exp(-1.96 * se),
        "ci_high": ratio * math.exp(1.96 * se),
        "before": prev[1] / prev[0],
        "after": nxt[1] / nxt[0],
    }


def position(st: DiagnoseStats) -> Diagnosis:
    """Position effects: a changepoint of mean |l|, and the first token against the rest."""
    if not st.pos[:, 0].any():
        return Diagnosis(
            "position",
            "can't tell",
            "no position column and no sample_id to count positions by",
            "map a position or sample_id column",
        )
    table = position_table(st)
    nums: dict = {}
    parts = []
    found = []
    cp = changepoint(st)
    if cp is not None:
        nums.update({f"changepoint_{k}": v for k, v in cp.items()})
        text = (
            f"largest jump at position {cp['position']}: mean |l| {g(cp['after'])} over the "
            f"next {WINDOW} vs {g(cp['before'])} over the previous {WINDOW} "
            f"({g(cp['ratio'])}×, 95% CI {g(cp['ci_low'])}–{g(cp['ci_high'])})"
        )
        parts.append(text)
        if cp["ratio"] >= JUMP and cp["ci_low"] > 1:
            found.append(f"mismatch jumps at position {cp['position']}")
    else:
        parts.append("positions too few for a changepoint")
    f = st.first
    if f[0] >= MIN_WINDOW_TOKENS and f[3] >= MIN_WINDOW_TOKENS and f[4] > 0:
        m1, m2 = f[1] / f[0], f[4] / f[3]
        ratio = m1 / m2
        v1 = max(f[2] / f[0] - m1 * m1, 0) / (f[0] * m1 * m1) if m1 > 0 else math.inf
        v2 = max(f[5] / f[3] - m2 * m2, 0) / (f[3] * m2 * m2)
        se = math.sqrt(v1 + v2)
        lo = ratio * math.exp(-1.96 * se) if math.isfinite(se) else 0.0
        nums.update(first_token_ratio=ratio, first_token_ci_low=lo, first_tokens=int(f[0]))
        parts.append(f"first token {g(ratio)}× the rest (mean |l| {g(m1)} vs {g(m2)})")
        if ratio >= JUMP and lo > 1:
            found.append("the first token is off")
    if found:
        return Diagnosis(
            "position",
            "found",
            "; ".join(parts),
            "look at what changes there: a KV-cache dtype or paged-attention block (from "
            "that position), the prefill/decode split (first token)",
            nums,
            table,
        )
    return Diagnosis("position", "clear", "; ".join(parts), "nothing", nums, table)


def _where(st: DiagnoseStats, prefix: str) -> tuple[str, dict]:
    """Where the located tokens of categories starting with `prefix` sit."""
    if st.seqs is None:
        return "", {}
    hs = [h for c, h, _ in st.located if c.startswith(prefix)]
    if not hs:
        return "", {}
    h = np.concatenate(hs)
    i = np.concatenate([x for c, _, x in st.located if c.startswith(prefix)])
    last = i == st.seqs.length(h) - 1
    first = i == 0
    nl, nf = int(last.sum()), int((first & ~last).sum())
    seqs = int(np.unique(h).size)
    parts = []
    if nl:
        parts.append(f"on the last token of {int(np.unique(h[last]).size):,} sequences")
    if nf:
        parts.append(f"on the first token of {int(np.unique(h[first & ~last]).size):,}")
    inner = i.size - nl - nf
    if inner:
        parts.append(f"{inner:,} inside sequences")
    text = ", ".join(parts)
    if nl and nl >= 0.9 * i.size:
        text += ": an appended stop token?"
    return text, {"last": nl, "first": nf, "inner": inner, "sequences": seqs}


def placeholders(st: DiagnoseStats) -> Diagnosis:
    """Exact 0.0 against a low log-prob, sentinels, invalid rows, one over-frequent value."""
    nums: dict = {}
    found, notes = [], []
    share_min = max(ZERO_MIN, ZERO_SHARE * st.tokens)
    for side in ("inference", "trainer"):
        other = "trainer" if side == "inference" else "inference"
        z = st.zero_low[side]
        nums[f"zero_{side}"] = z
        if z:
            where, w = _where(st, f"zero:{side}")
            text = f"{side} log-prob exactly 0.0 while {other} < log 0.5 on {z:,} tokens"
            text += f" ({where})" if where else ""
            (found if z >= share_min else notes).append(text)
            nums.update({f"zero_{side}_{k}": v for k, v in w.items()})
        s = st.sentinel[side]
        nums[f"sentinel_{side}"] = s
        if s:
            where, _ = _where(st, f"sentinel:{side}")
            found.append(
                f"{side} log-prob ≤ {SENTINEL:g} (a sentinel) on {s:,} tokens"
                + (f" ({where})" if where else "")
            )
        bad = sum(v for (f, c), v in st.report.dropped.items() if c == f"{side}_logprob")
        nums[f"invalid_{side}"] = bad
        if bad:
            found.append(f"{bad:,} rows with {side}_logprob NaN, ±inf or null (-inf: a sentinel?)")
        for v, cnt in st.tracked[side].items():
            if cnt > FREQ_LIMIT * st.tokens:
                where, _ = _where(st, f"value:{side}:{v!r}")
                nums[f"value_{side}"] = v
                nums[f"value_{side}_tokens"] = cnt
                found.append(
                    f"{side} log-prob {v:.6g} on {cnt:,} tokens ({_pct(cnt / st.tokens)})"
                    + (f" ({where})" if where else "")
                )
    if found:
        return Diagnosis(
            "placeholders",
            "found",
            "; ".join(found + notes),
            "fix the export: these are fill values, not log-probs (mask those tokens out of "
            "the loss, or log the engine's real log-prob)",
            nums,
        )
    ev = "no exact-0.0-vs-low pairs, sentinels or over-frequent values"
    if notes:
        ev = "; ".join(notes) + f" (below {ZERO_SHARE:.2%} of tokens: not a pattern)"
    return Diagnosis("placeholders", "clear", ev, "nothing", nums)


def _quantile(hist: np.ndarray, q: float) -> float:
    tot = hist.sum()
    if tot == 0:
        return math.nan
    cum = np.cumsum(hist)
    k = int(np.searchsorted(cum, q * tot, side="left"))
    if k == 0:
        return 0.0
    lo_, hi_ = HIST_DECADES
    width = (hi_ - lo_) / HIST_BINS
    below = cum[k - 1]
    frac = (q * tot - below) / hist[k] if hist[k] else 0.5
    return 10 ** (lo_ + (k - 1 + frac) * width)


def rule_threshold_l(rule: Rule, q: float) -> float | None:
    """The smallest |l| at which `rule` (a token rule at one setting) masks a token whose
    inference probability is q (either sign of l, advantage of either sign); None where it
    never does within |l| < 20 or is not a token rule."""
    if rule.level != "token":
        return None
    names = [p.name for p in rule.params if p.threshold]
    if not names or any(getattr(rule, n) is None for n in names):
        return None
    d = np.geomspace(1e-9, 20.0, 4001)
    lq = np.full(d.size, math.log(q))
    best = math.inf
    for sign in (1.0, -1.0):
        lp = np.minimum(lq + sign * d, 0.0)
        for adv in (1.0, -1.0):
            b = TokenBatch(lp, lq, np.full(d.size, adv))
            hit = np.zeros(d.size, bool)
            for p in names:
                s = rule.score(b, p)
                t = rule.threshold(p, getattr(rule, p))
                hit |= (s >= t) if getattr(rule, "inclusive", False) else (s > t)
            ok = np.flatnonzero(hit & (np.abs(lp - lq) > 0))
            if ok.size:
                best = min(best, float(np.abs(lp - lq)[ok[0]]))
    return best if math.isfinite(best) else None


def noise_floor(st: DiagnoseStats, settings: Sequence[str | Rule] = ()) -> Diagnosis:
    """bf16 / fp16 grids, the floor's p50 / p90 of |l| on p, q > 0.9, settings below it."""
    nums: dict = {}
    grids = []
    for side in ("trainer", "inference"):
        bf, hf = st.grid[side]
        nums[f"{side}_bf16"] = bf / st.tokens
        nums[f"{side}_fp16"] = hf / st.tokens
        if bf == st.tokens:
            grids.append(f"{side} on the bf16 grid")
        elif hf == st.tokens:
            grids.append(f"{side} on the fp16 grid")
    n_floor = int(st.floor_lq[0])
    if n_floor < MIN_WINDOW_TOKENS:
        return Diagnosis(
            "noise_floor",
            "can't tell",
            f"only {n_floor} tokens with p, q > 0.9",
            "nothing",
            nums,
        )
    p50, p90 = _quantile(st.floor_hist, 0.5), _quantile(st.floor_hist, 0.9)
    q_med = math.exp(st.floor_lq[1] / n_floor)
    nums.update(p50=p50, p90=p90, floor_tokens=n_floor)
    ev = f"|l| on {n_floor:,} tokens with p, q > 0.9: p50 {g(p50)}, p90 {g(p90)}; " + (
        ", ".join(grids) if grids else "log-probs on no bf16/fp16 grid"
    )
    below = []
    for s in settings:
        rule = parse_rule(s) if isinstance(s, str) else s
        t = rule_threshold_l(rule, q_med)
        if t is not None and t < p90:
            below.append(f"{rule.spec()} (masks at |l| ≥ {g(t)} there)")
    nums["below_floor"] = len(below)
    if below:
        return Diagnosis(
            "noise_floor",
            "found",
            ev + "; below the p90: " + ", ".join(below) + ": masks rounding noise",
            "raise the threshold above the floor's p90 (choose picks one for a target)",
            nums,
        )
    tail = f"; {len(settings)} setting(s) above it" if settings else ""
    return Diagnosis("noise_floor", "clear", ev + tail, "nothing", nums)


def alignment(st: DiagnoseStats) -> Diagnosis:
    """inspect's off-by-one check and degenerate columns."""
    a = st.alignment
    if a is None or a.means() is None:
        return Diagnosis(
            "alignment",
            "can't tell",
            "no sample_id column: consecutive tokens of a sequence cannot be paired",
            "map a sample_id column (--map sample_id=COLUMN)",
        )
    m = a.means()
    nums = {"d0": m[0], "d_plus1": m[1], "d_minus1": m[-1], "pairs": a.pairs, "shift": a.shift()}
    warn = a.warnings()
    if warn:
        return Diagnosis(
            "alignment",
            "found",
            a.line() + "; " + " ".join(warn),
            "check how the two columns were cut (the logits at t predict token t + 1)",
            nums,
        )
    return Diagnosis("alignment", "clear", a.line(), "nothing", nums)


# ----------------------------------------------------------------------------- result


@dataclass
class DiagnoseResult(Presentable):
    """The seven findings in order; `.table`: finding, verdict, evidence, what to do."""

    files: list[str]
    tokens: int
    findings: list[Diagnosis]

    def get(self, key: str) -> Diagnosis:
        return next(d for d in self.findings if d.key == key)

    @property
    def table(self) -> pl.DataFrame:
        return pl.DataFrame(
            {
                "finding": [d.title for d in self.findings],
                "verdict": [d.verdict for d in self.findings],
                "evidence": [d.evidence for d in self.findings],
                "what_to_do": [d.action for d in self.findings],
            }
        )

    @property
    def found(self) -> list[Diagnosis]:
        return [d for d in self.findings if d.verdict == "found"]

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "files": self.files,
            "tokens": self.tokens,
            "findings": [d.to_dict() for d in self.findings],
        }

    def summary_lines(self) -> list[str]:
        head = (
            f"diagnose: {len(self.found)} of {len(self.findings)} findings found on "
            f"{self.tokens:,} loss tokens"
        )
        return [head, *(f"  {d.title}: {d.verdict}: {d.evidence}" for d in self.findings)]


def diagnose_stats(st: DiagnoseStats, settings: Sequence[str | Rule] = ()) -> DiagnoseResult:
    """The seven findings from accumulated stats."""
    out = [
        truncation(st),
        temperature(st),
        staleness(st),
        position(st),
        placeholders(st),
        noise_floor(st, settings),
        alignment(st),
    ]
    return DiagnoseResult(list(getattr(st, "files", [])), st.tokens, out)


def diagnose(
    sources: Sequence[str | Path] | str | Path,
    settings: Sequence[str | Rule] = (),
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> DiagnoseResult:
    """One streamed read of the log, then the seven findings (`settings`: the -r /
    --from-config rules the noise floor judges)."""
    rules = [parse_rule(s) if isinstance(s, str) else s for s in settings]
    return diagnose_stats(collect(sources, options, progress), rules)


__all__ = [
    "DiagnoseResult",
    "DiagnoseStats",
    "Diagnosis",
    "alignment",
    "changepoint",
    "collect",
    "diagnose",
    "diagnose_stats",
    "noise_floor",
    "placeholders",
    "poisson_weights",
    "position",
    "position_table",
    "rule_threshold_l",
    "staleness",
    "temperature",
    "truncation",
]
