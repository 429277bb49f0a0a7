"""Are the two log-prob columns about the same tokens? Lag checks and degenerate logs.

Design
------
A log whose rollout log-probs are shifted one position against the trainer's (ms-swift#8196:
found by hand) looks like an enormous mismatch to every rule, and nothing else in the tool
would say why. Within a sequence, consecutive tokens' log-probs differ a lot (a confident
token next to a rare one), while the trainer and the sampler agree on the same token to ~1e-3;
so the mean |trainer - inference| at lag 0 is far below the mean at lags +-1 on an aligned log,
and a shifted log shows the opposite. `AlignmentCheck` accumulates, over pairs of consecutive
loss tokens of one sequence (same step and sample id, positions t and t + 1, or consecutive
rows where the log has no position column):

    D(0)  = mean |lp[t+1] - lq[t+1]|   the same token
    D(+1) = mean |lp[t+1] - lq[t]|     trainer one position ahead of inference
    D(-1) = mean |lp[t]   - lq[t+1]|   trainer one position behind

and calls the log shifted by s when D(s) < D(0) / 4 (and D(0) is more than rounding:
above 1e-6); the evidence (the three means, the number of pairs) goes into the message. It also
flags the degenerate logs: both columns identical on every token (no mismatch to replay: the
same column logged twice?), a column constant, or a column zero on every token (p = 1: a
placeholder, like NeMo-RL's prev_logprobs under force_on_policy_ratio).

Sums add across batches (pairs that straddle two batches are left out); `inspect` checks the
degenerate columns on every token and the lags on the first MAX_PAIRS pairs (a shift is
a property of the logging code, the same in every batch: 4M pairs decide it, and a batch
out of order costs a sort by position); every other command checks the lag on the first
batch it reads (`first_batch_warnings`, at most `SAMPLE_ROWS` rows, a few milliseconds)
and warns on stderr.

On the numba backend a batch is a pass of `checks_jit.column_stats` over its two log-prob
columns and, while the lag check wants pairs, two of `checks_jit.lag_sums`, with no sort
where the batch is in (step, sample_id, position) order already, as trainers write it. The
polars code (`_stats_polars`, `_lags_polars`) is the reference and the path taken for what
the kernels do not take: the numpy backend, nulls, values not finite, keys not integers, a
batch out of order or repeating a key (sorted by polars). The counts, min and max are the
reference's exactly; the sums behind D(0), D(+1), D(-1) add the same terms in another order
(compensated: within a few ulps of polars' sums, 1e-12 relative in the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import polars as pl

SAMPLE_ROWS = 200_000
RATIO = 4.0  # a lag must fit this many times better than lag 0 to call the log shifted
FLOOR = 1e-6  # D(0) below this is rounding: nothing to compare
MAX_PAIRS = 1 << 22  # token pairs the lag check reads before it has seen enough


@dataclass
class AlignmentCheck:
    pairs: int = 0
    d: dict[int, float] = field(default_factory=lambda: {0: 0.0, 1: 0.0, -1: 0.0})
    tokens: int = 0
    equal: int = 0  # tokens with lp == lq exactly
    zero: dict[str, int] = field(default_factory=lambda: {"trainer": 0, "inference": 0})
    lo: dict[str, float] = field(
        default_factory=lambda: {"trainer": math.inf, "inference": math.inf}
    )
    hi: dict[str, float] = field(
        default_factory=lambda: {"trainer": -math.inf, "inference": -math.inf}
    )

    @staticmethod
    def possible(columns) -> bool:
        return "sample_id" in columns

    def add(self, df: pl.DataFrame) -> None:
        """One batch of canonical rows (loss_mask false rows are left out here)."""
        if self._add_fast(df):
            return
        if "loss_mask" in df.columns:
            df = df.filter(pl.col("loss_mask"))
        if df.height == 0:
            return
        self._stats_polars(df)
        if "sample_id" not in df.columns or self.pairs >= MAX_PAIRS:
            return
        self._lags_polars(df)

    def _add_fast(self, df: pl.DataFrame) -> bool:
        """The batch through checks_jit (`column_stats`, and `lag_sums` while the lag check
        wants pairs), or False where it is not theirs: the numpy backend, a log-prob column
        not Float64 or with nulls, a loss_mask not Boolean or with nulls, a value not finite;
        `add` then runs the polars code. The lags come from polars (`_lags_polars`) where a
        key column is not an integer that int64 holds (UInt64) without nulls, or the rows
        are not in (step, sample_id, position) order, or repeat a key; the statistics
        (`_stats_polars`) where a column holds both 0.0 and -0.0, whose sign at the min or
        max polars picks its own way."""
        j = _kernels()
        if j is None:
            return False
        if "loss_mask" in df.columns:
            m = df["loss_mask"]
            if m.dtype != pl.Boolean or m.null_count():
                return False
            df = df.filter(m)
        lp, lq = _floats(df, "trainer_logprob"), _floats(df, "inference_logprob")
        if lp is None or lq is None:
            return False
        if lp.shape[0] == 0:
            return True
        out = np.zeros(11, np.int64)
        j.column_stats(lp.view(np.int64), lq.view(np.int64), out)
        if out[j.NONFINITE]:
            return False
        if out[j.ZT_NEG] not in (0, out[j.ZT]) or out[j.ZI_NEG] not in (0, out[j.ZI]):
            self._stats_polars(df)
        else:
            lot, hit, loi, hii = out[j.LOT :].view(np.float64).tolist()
            self.tokens += int(out[j.N])
            self.equal += int(out[j.EQUAL])
            self.zero["trainer"] += int(out[j.ZT])
            self.zero["inference"] += int(out[j.ZI])
            self.lo["trainer"] = min(self.lo["trainer"], lot)
            self.hi["trainer"] = max(self.hi["trainer"], hit)
            self.lo["inference"] = min(self.lo["inference"], loi)
            self.hi["inference"] = max(self.hi["inference"], hii)
        if "sample_id" not in df.columns or self.pairs >= MAX_PAIRS:
            return True
        keys = {c: _ints(df[c]) for c in ("step", "sample_id", "position") if c in df.columns}
        if any(v is None for v in keys.values()):
            self._lags_polars(df)
            return True
        sums = np.zeros(3, np.float64)
        adj = np.empty(lp.shape[0], np.bool_)
        sid = keys["sample_id"]
        pos = keys.get("position", sid)
        pairs = j.lag_sums(keys.get("step", sid), sid, pos, "position" in keys, lp, lq, adj, sums)
        if pairs < 0:
            self._lags_polars(df)
        elif pairs:
            self.pairs += pairs
            self.d[0] += float(sums[j.D0])
            self.d[1] += float(sums[j.DP])
            self.d[-1] += float(sums[j.DM])
        return True

    def _stats_polars(self, df: pl.DataFrame) -> None:
        """The degenerate-column statistics of a batch of loss tokens (at least one)."""
        lp, lq = pl.col("trainer_logprob"), pl.col("inference_logprob")
        s = df.select(
            n=pl.len(),
            equal=(lp == lq).sum(),
            zt=(lp == 0).sum(),
            zi=(lq == 0).sum(),
            lot=lp.min(),
            hit=lp.max(),
            loi=lq.min(),
            hii=lq.max(),
        ).row(0, named=True)
        self.tokens += s["n"]
        self.equal += s["equal"]
        self.zero["trainer"] += s["zt"]
        self.zero["inference"] += s["zi"]
        self.lo["trainer"] = min(self.lo["trainer"], s["lot"])
        self.hi["trainer"] = max(self.hi["trainer"], s["hit"])
        self.lo["inference"] = min(self.lo["inference"], s["loi"])
        self.hi["inference"] = max(self.hi["inference"], s["hii"])

    def _lags_polars(self, df: pl.DataFrame) -> None:
        """The lag sums of a batch of loss tokens with a sample_id column (the reference)."""
        if df.height == 0:
            return
        lp, lq = pl.col("trainer_logprob"), pl.col("inference_logprob")
        keys = [c for c in ("step", "sample_id", "position") if c in df.columns]
        d = df.select([*keys, "trainer_logprob", "inference_logprob"])
        if "position" in keys:
            d = d.sort(keys)
        nxt = pl.col("sample_id").shift(-1) == pl.col("sample_id")
        if "step" in keys:
            nxt = nxt & (pl.col("step").shift(-1) == pl.col("step"))
        if "position" in keys:
            nxt = nxt & (pl.col("position").shift(-1) == pl.col("position") + 1)
        pairs = d.with_columns(
            lp1=lp.shift(-1), lq1=lq.shift(-1), adjacent=nxt.fill_null(False)
        ).filter(pl.col("adjacent"))
        if pairs.height == 0:
            return
        sums = pairs.select(
            d0=(pl.col("lp1") - pl.col("lq1")).abs().sum(),
            dp=(pl.col("lp1") - lq).abs().sum(),
            dm=(lp - pl.col("lq1")).abs().sum(),
        ).row(0, named=True)
        self.pairs += pairs.height
        self.d[0] += sums["d0"]
        self.d[1] += sums["dp"]
        self.d[-1] += sums["dm"]

    # -- readout
    def means(self) -> dict[int, float] | None:
        if not self.pairs:
            return None
        return {k: v / self.pairs for k, v in self.d.items()}

    def shift(self) -> int:
        """+1 or -1 when the trainer's column looks shifted against the sampler's, else 0."""
        m = self.means()
        if m is None or m[0] <= FLOOR:
            return 0
        best = min((1, -1), key=lambda s: m[s])
        return best if m[best] * RATIO < m[0] else 0

    def line(self) -> str:
        """One line for `inspect`."""
        m = self.means()
        if m is None:
            return "not checked (no two consecutive loss tokens of one sequence)"
        s = self.shift()
        verdict = "aligned" if s == 0 else f"SHIFTED by {s:+d} position"
        return (
            f"{verdict}: mean |trainer - inference| log-prob {m[0]:.3g} at lag 0, "
            f"{m[1]:.3g} at +1, {m[-1]:.3g} at -1 ({self.pairs:,} pairs)"
        )

    def warnings(self) -> list[str]:
        out = []
        s = self.shift()
        if s:
            m = self.means()
            out.append(
                f"trainer log-probs look shifted by {s:+d} position against inference: mean "
                f"|trainer - inference| is {m[s]:.3g} when the trainer's value at t "
                f"{'+ 1' if s > 0 else '- 1'} is compared with the sampler's at t, against "
                f"{m[0]:.3g} for the same token ({self.pairs:,} pairs of consecutive loss "
                "tokens). Every mismatch figure of this log is then an artefact: check how the "
                "two columns were cut (the trainer's logits predict the next token)."
            )
        if self.tokens and self.equal == self.tokens:
            out.append(
                f"trainer_logprob and inference_logprob are identical on all {self.tokens:,} "
                "loss tokens: the log carries no mismatch to replay (the same column logged "
                "twice?)."
            )
            return out
        for name in ("trainer", "inference"):
            col = f"{name}_logprob"
            if self.tokens and self.zero[name] == self.tokens:
                out.append(
                    f"{col} is 0 on all {self.tokens:,} loss tokens (p = 1 everywhere): a "
                    "placeholder, not a log-prob; every mismatch figure would be fake."
                )
            elif self.tokens > 1 and self.lo[name] == self.hi[name]:
                out.append(
                    f"{col} is the same value ({self.lo[name]:.6g}) on all {self.tokens:,} "
                    "loss tokens: a constant, not a per-token log-prob."
                )
        return out


def _kernels():
    """checks_jit (numba started by `fast.compiled()`), or None on the numpy backend."""
    from .. import fast

    if fast.compiled() is None:
        return None
    from . import checks_jit

    return checks_jit


def _floats(df: pl.DataFrame, c: str) -> np.ndarray | None:
    """A Float64 column without nulls as a contiguous float64 array, else None."""
    s = df[c]
    if s.dtype != pl.Float64 or s.null_count():
        return None
    return np.ascontiguousarray(s.to_numpy())


def _ints(s: pl.Series) -> np.ndarray | None:
    """An integer column without nulls whose values int64 holds (not UInt64) as a
    contiguous int64 array, else None."""
    if not s.dtype.is_integer() or s.dtype == pl.UInt64 or s.null_count():
        return None
    return np.ascontiguousarray(s.to_numpy(), dtype=np.int64)


def first_batch_warnings(df: pl.DataFrame) -> list[str]:
    """The lag check on (the first SAMPLE_ROWS rows of) one batch: what every command warns.
    The degenerate-column checks need the whole log (a run may start on-policy): inspect."""
    check = AlignmentCheck()
    check.add(df.head(SAMPLE_ROWS))
    if check.pairs < 64 or not check.shift():  # too few pairs to call anything
        return []
    return check.warnings()[:1]
