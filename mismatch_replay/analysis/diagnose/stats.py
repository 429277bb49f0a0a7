"""diagnose's one read: `DiagnoseStats`, the additive sums the findings are computed from,
and `collect`, the streamed read that fills them (the package docstring has the design)."""

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
NEAR_ZERO = 1e-6  # |log-prob| at most this: p = 1 to rounding, not a fill value
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


def ci(reps: np.ndarray) -> tuple[float, float]:
    reps = reps[np.isfinite(reps)]
    if reps.size < 10:
        return math.nan, math.nan
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return float(lo), float(hi)


def g(v: float | None, digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return "n/a"
    return "0" if v == 0 else f"{v:.{digits}g}"


def pct_text(f: float) -> str:
    return "0%" if f == 0 else f"{100 * f:.3g}%"


def _kernel():
    """kernel.py (numba started by `fast.compiled()`), or None on the numpy backend."""
    from ... import fast

    if fast.backend() != "numba" or fast.compiled() is None:
        return None
    from . import kernel

    return kernel


def _grown(a: np.ndarray, n: int, inner: tuple = ()) -> np.ndarray:
    """`a` (rows of shape `inner`) with room for at least n rows: capacity doubles, so k
    new steps cost O(k) copies, not O(k^2)."""
    if a.shape[0] >= n and a.shape[1:] == (inner or a.shape[1:]):
        return a
    shape = inner or a.shape[1:]
    out = np.zeros((max(n, 2 * a.shape[0], 8), *shape))
    out[: a.shape[0]] = a if a.size else 0
    return out


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
    step_boot_n: int = 0  # steps with their own replicates (the first STEP_BOOT_MAX)
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
        starts, rk = self.runs(df, step)
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
                self.step_mom = _grown(self.step_mom, i + 1)
                if i < STEP_BOOT_MAX and self.unit == "sequence":
                    self.step_boot = _grown(self.step_boot, i + 1, (self.replicates, 2))
                    self.step_boot_n = i + 1
            sel = rs == s
            self.step_mom[i] += runm[sel][:, :2].sum(axis=0)
            if i < self.step_boot_n:
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

    def runs(self, df: pl.DataFrame, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
            # 0 and values within rounding of it (p = 1 in float32) are no placeholder
            keep = (c >= max(2, FREQ_LIMIT / 2 * sample.size)) & (np.abs(u) > NEAR_ZERO)
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
