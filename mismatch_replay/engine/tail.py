"""The tail: the tokens a replay keeps beyond per-coordinate cutoffs, for exact counts later.

Design
------
A decision made after a replay -- the threshold that masks a target fraction, the bootstrap
interval of that threshold, two rules' 2 x 2 table -- needs, per token rule, the masked
tokens at thresholds nobody knew before the pass: a second pass over the log, as a rule.
But those thresholds mask few tokens, and only the tokens far out on some coordinate of the
fused kernel (fast/coordinates.py: dp, l, the binary KLs) can be masked at all. So a Tally
given a `Tail` keeps, for every coordinate of its program, the tokens at or beyond two
cutoffs (`cut`, one per side), with their log-probs, advantage, entropy, sequence id, step and
the position columns the log has: the kernel sets a bit per coordinate in one pass it already
makes (`jit.coord_pass`, flags[F_TAIL]) and writes the kept tokens' log-probs, advantage
and sequence out while it holds them (a gather from the batch's columns afterwards missed
the cache on every token); `add` copies those and gathers the log's other kept columns. The kernel
also counts every token's inference-probability bucket (`q_counts`, with each bucket's
|dp|, |A| and entropy sums: `q_mass`, `q_cost`) and, asked to, `add`
counts each step's tokens (`step_counts`): the totals a 2 x 2 table or a bootstrap over
steps needs besides the kept tokens.

The kernel also keeps every token that a job's fixed side masks (its other threshold, e.g.
IcePop's high bound while low is swept: `Program.fixed_side`) and every token a single
setting (a one-value job) masks, whatever the cutoffs. The cutoffs are set on the first
batch: the `fraction`-quantiles of each coordinate on a sample of it (SAMPLE tokens evenly
spaced; two-sided for the signed coordinates dp and l), so the tail holds about 2 x
fraction of the tokens per coordinate. Nothing depends on the cutoffs being right: a
consumer scores the kept tokens with the rule's own `score()` (the simple path's
arithmetic) and checks them against the replay's exact counts on the job's grid
(analysis/tail_counts.py, `TailCounts.cover`): where the kept tokens' count equals the
replay's at a grid value, every masked token there is kept, and so at every stricter value
(a token rule's masked set shrinks as its threshold rises). A job the tail does not cover
where a consumer needs it falls back to a pass over the log: the same counts either way.

Memory: 44 bytes a kept token (log-probs, advantage, bits, row, sequence id; 8 more with
an entropy column, the masked tokens' cost in the grouped tables), 68 with the
`extra` columns compare's examples name (step, sample id, position; `choose` keeps step
only for a bootstrap over steps, and counts no q buckets: `count_q`): in `choose` with a
0.25% target on the benchmark log, 4.4% of the tokens, 37 MiB at 20M tokens and 93 MiB at
50M. `limit` (MAX_TOKENS, 16M tokens, ~1.1 GB) stops
keeping beyond it (`off` says why, the kept ones are dropped, and consumers make their
passes instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from ..rules import TokenBatch

SAMPLE = 1 << 16  # tokens of the first batch the cutoffs are set on
MAX_TOKENS = 1 << 24  # kept tokens before the tail stops keeping (~1.1 GB)
EXTRA = ("step", "sample_id", "position")  # columns kept as they are in the log


def coordinate_values(kind: str, clamp: float | None, tb: TokenBatch) -> np.ndarray:
    """A fused-kernel coordinate in numpy (fast/coordinates.COORDINATES), as the rules'
    TokenBatch computes it."""
    if kind == "dp":
        return tb.dp
    if kind == "l":
        return tb.l
    if kind == "bkl":
        return tb.bkl(clamp)
    if kind == "bkl_qp":
        return tb.bkl_qp(clamp)
    raise ValueError(f"unknown coordinate {kind!r}")


def sample_of(tb: TokenBatch) -> TokenBatch:
    """SAMPLE tokens of a batch, evenly spaced (all of a smaller one): what a Tail sets its
    cutoffs on."""
    n = len(tb)
    pick = np.linspace(0, max(n - 1, 0), min(n, SAMPLE)).astype(np.int64)
    adv = None if tb.advantage is None else tb.advantage[pick]
    return TokenBatch(tb.lp[pick], tb.lq[pick], adv)


@dataclass
class Tail:
    """The kept tokens of one replay (see the module docstring). `fraction`: per side of a
    coordinate, the share of the first batch's tokens beyond each cutoff (0: no cutoff,
    only the fixed sides' and single settings' masked tokens)."""

    fraction: float
    limit: int = MAX_TOKENS
    cut: np.ndarray | None = None  # (coordinates, 2): keep x <= cut[c, 0] or x >= cut[c, 1]
    coords: list[tuple[str, float | None]] = field(default_factory=list)
    off: str | None = None  # why nothing (more) is kept: consumers fall back
    tokens: int = 0  # loss tokens the replay saw
    kept: int = 0
    parts: list[dict[str, np.ndarray]] = field(default_factory=list)  # [the buffers] or []
    step_counts: dict = field(default_factory=dict)  # step -> loss tokens (count_steps)
    count_steps: bool = False
    extra: tuple[str, ...] = EXTRA  # the log's columns kept with each token (those it has)
    count_q: bool = True  # count every token's q bucket (q_counts: compare's table)
    # the rows the replay will read (its plan's; 0: unknown): the first batch's share of
    # kept tokens times this sizes the buffers once (`_append`)
    expected: int = 0
    # tokens per inference-probability bucket (bins.Q_BUCKET_EDGES), counted by the kernel
    q_counts: np.ndarray | None = None
    q_mass: np.ndarray | None = None  # ... and the |dp| of those tokens, summed
    # ... and what a mask costs per bucket (runner.BatchOut.q_cost): "amass" the |A| sums,
    # "ent", "ent_n" the finite entropies' sums and counts (those of the log's columns)
    q_cost: dict[str, np.ndarray] = field(default_factory=dict)
    keep_entropy: bool = True  # keep each kept token's entropy (where the log has one)
    # what consumers derive from the kept tokens once per replay (analysis/tail_counts.py)
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    _joined: dict[str, np.ndarray] | None = None
    _cap: int = 0  # the buffers' capacity (parts[0]: one array per column, kept in front)

    def set_cutoffs(self, coords, tb: TokenBatch) -> np.ndarray:
        """The cutoffs of `coords` ((kind, clamp) per kernel coordinate) from a sample of the
        first batch `tb`."""
        self.coords = [(c.kind, c.clamp) for c in coords]
        n = len(tb)
        sub = sample_of(tb)
        cut = np.empty((len(self.coords), 2))
        f = min(max(self.fraction, 0.0), 0.5)
        if f == 0.0:  # no quantile: only the fixed sides and single settings' masked tokens
            cut[:, 0], cut[:, 1] = -np.inf, np.inf
            self.cut = cut
            return cut
        for i, (kind, clamp) in enumerate(self.coords):
            x = coordinate_values(kind, clamp, sub)
            hi = float(np.quantile(x, 1.0 - f, method="inverted_cdf")) if n else np.inf
            cut[i, 1] = hi
            signed = kind in ("dp", "l")
            lo = float(np.quantile(x, f, method="inverted_cdf")) if n and signed else -np.inf
            cut[i, 0] = min(lo, hi) if signed else -np.inf
        self.cut = cut
        return cut

    def add(
        self,
        idx: np.ndarray,
        bits: np.ndarray,
        df: pl.DataFrame,
        lp,
        lq,
        adv,
        seq,
        gathered: dict[str, np.ndarray] | None = None,
    ) -> None:
        """Keep a batch's tokens `idx` (their coordinate bits `bits`); `seq`: the batch's
        global sequence ids (None without sample_id). `gathered`: columns of `src` ("lp",
        "lq", "advantage", "seq") already taken at `idx` (the fused kernel writes them out
        while it has them: no gather from the batch's columns, which are out of cache by
        then)."""
        self.tokens += df.height
        if self.count_steps:
            vc = df["step"].value_counts()
            for s, c in zip(vc["step"].to_list(), vc["count"].to_list(), strict=True):
                self.step_counts[s] = self.step_counts.get(s, 0) + c
        if self.off is not None or idx.shape[0] == 0:
            return
        if self.kept + idx.shape[0] > self.limit:
            self.off = (
                f"the tail outgrew {self.limit:,} tokens (cutoffs at {self.fraction:.3g} of "
                "the first batch per side)"
            )
            self.parts.clear()
            return
        src = {"lp": lp, "lq": lq}
        if adv is not None:
            src["advantage"] = adv
        if seq is not None:
            src["seq"] = seq
        if self.keep_entropy and "entropy" in df.columns:  # what a masked token costs
            src["entropy"] = df["entropy"].to_numpy()
        for c in self.extra:
            if c in df.columns:
                src[c] = df[c].to_numpy()
        self._append(idx, bits, self.tokens - df.height, src, df.height, gathered or {})

    def _append(
        self,
        idx: np.ndarray,
        bits: np.ndarray,
        first: int,
        src: dict,
        rows: int = 0,
        gathered: dict | None = None,
    ) -> None:
        """Gather a batch's kept tokens `idx` of each column in `src` (and their bits and
        rows: idx + first) straight into the buffers: the copying, and the first touch of
        the buffers' pages, happen during the replay, batch by batch, not in one
        concatenation when the first consumer asks (~0.1 s at 20M). The first batch (of
        `rows` tokens) sizes them for the whole replay (`expected`), with a quarter to
        spare: pages never written cost nothing, while each doubling cost a copy and fresh
        pages (0.18 s of a 20M report's 0.28 s here); past that capacity they double."""
        n = idx.shape[0]
        end = self.kept + n
        dtypes = {"bits": bits.dtype, "row": idx.dtype, **{k: v.dtype for k, v in src.items()}}
        if self.parts and set(self.parts[0]) != set(dtypes):
            raise ValueError("Tail.add: every batch must keep the same columns")
        if not self.parts or end > self._cap:
            cap = max(end, 2 * self._cap, 4 * n)
            if not self.parts and rows and self.expected > rows:
                cap = max(cap, min(self.limit, int(1.25 * n * (self.expected / rows)) + n))
            old = self.parts[0] if self.parts else {}
            types = {k: v.dtype for k, v in old.items()} or dtypes  # the first batch's
            buf = {k: np.empty(cap, dtype=t) for k, t in types.items()}
            for k, v in old.items():
                buf[k][: self.kept] = v[: self.kept]
            self.parts = [buf]
            self._cap = cap
        buf = self.parts[0]
        at = slice(self.kept, end)
        buf["bits"][at] = bits
        np.add(idx, first, out=buf["row"][at], casting="unsafe")
        for k, v in src.items():
            got = gathered.get(k) if gathered else None
            if got is not None and got.dtype == buf[k].dtype and got.shape[0] == n:
                buf[k][at] = got  # taken at idx already
            elif v.dtype == buf[k].dtype:
                np.take(v, idx, out=buf[k][at], mode="clip")  # (raise: buffered, slower)
            else:  # a column whose type changed between batches: cast as an assignment does
                buf[k][at] = v[idx]
        self.kept = end
        self._joined = None

    def add_q_counts(
        self, counts: np.ndarray | None, mass: np.ndarray | None = None, cost: dict | None = None
    ) -> None:
        """Add a batch's tokens per q bucket, their |dp| sums and their `cost` sums (q_cost;
        None: the kernel counted none)."""
        for k, v in (cost or {}).items():
            self.q_cost[k] = v.copy() if k not in self.q_cost else self.q_cost[k] + v
        if counts is not None:
            self.q_counts = counts.copy() if self.q_counts is None else self.q_counts + counts
        if mass is not None:
            self.q_mass = mass.copy() if self.q_mass is None else self.q_mass + mass

    def refuse(self, why: str) -> None:
        """Keep nothing (this replay cannot: e.g. it runs on the simple path)."""
        if self.off is None:
            self.off = why
        self.parts.clear()

    def arrays(self) -> dict[str, np.ndarray]:
        """The kept tokens in input order (views of the buffers; cached)."""
        if self._joined is None:
            if not self.parts:
                self._joined = {"lp": np.zeros(0), "lq": np.zeros(0), "row": np.zeros(0, int)}
            else:
                self._joined = {k: v[: self.kept] for k, v in self.parts[0].items()}
        return self._joined


__all__ = [
    "EXTRA",
    "MAX_TOKENS",
    "SAMPLE",
    "Tail",
    "coordinate_values",
    "sample_of",
]
