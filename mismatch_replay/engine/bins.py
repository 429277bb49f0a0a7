"""Per-bin sums: the additive arrays a Tally is made of, and the bucketings it uses.

Design
------
A job of K values keeps arrays of shape (groups, K + 2) (`JobBins`): bin j holds the tokens
whose score exceeds exactly j of the K sorted thresholds, and bin K + 1 the tokens a fixed
side of the rule masks at every value (score +inf). The tokens masked at the k-th smallest
threshold are the suffix sum over bins j > k (`suffix`): exact at every grid point, whatever
K. Per bin: the token count and the |dp| mass; for weight rules the sum, square sum and max
of the natural weight (from which weight mean, max and ESS at every cap follow exactly);
sequences per bin and, with prime-rl's conventions, the sum of 1/n over the bin's tokens.
Where the log has an advantage, what a mask costs the gradient (RULES.md "What a mask
costs"): the bin's corrective and divergent tokens (A * dp < 0, > 0; the rest neutral; the
sign of dp is the sign of lp - lq, exact, no exp) and its |A| sum; with an entropy column,
the sum and count of its finite entropies. Each is a sum per bin, so the masked ones at
every grid point are suffix sums, exact like the counts (`direction_class`).

Everything here is a sum, a max or a min, so bins of two shards add (`JobBins.absorb`).
The fixed bucketings beside them: the scatter's 200 x 200 (q, p) histograms on linear and
log10 axes, the --robust log10 k3 histogram (0.01-decade bins), the q buckets of
`--by q_bucket`, the power-of-two length buckets of `--by length`, and the counter-based
Poisson(1) bootstrap weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import fast, pmath
from ..metrics import Q_BUCKET_EDGES  # --by q_bucket (the figures read it there too)

# The scatter: fixed 2-D histograms of (q, p), additive like everything else in a Tally.
SCATTER_BINS = 200
SCATTER_LOG10_MIN = -8.0  # log panel spans 1e-8 .. 1; smaller probabilities go to the edge bin
# --robust: per-group histogram of log10 k3 (k3 = 0 goes to bin 0), for medians and trimmed
# means that a handful of extreme tokens cannot move; and each group's top tokens by k3.
K3_LOG10_MIN, K3_LOG10_MAX, K3_BINS = -20.0, 4.0, 2400  # 0.01-decade bins
_LN10 = math.log(10.0)
TOP_TOKENS = 5


def scatter_edges(log: bool) -> np.ndarray:
    """Bin edges of the scatter histograms (probability, or log10 probability)."""
    lo = SCATTER_LOG10_MIN if log else 0.0
    hi = 0.0 if log else 1.0
    return np.linspace(lo, hi, SCATTER_BINS + 1)


def scatter_index(x: np.ndarray, log: bool) -> np.ndarray:
    """Each value's scatter bin (0 .. SCATTER_BINS - 1; values beyond the edges clip)."""
    lo = SCATTER_LOG10_MIN if log else 0.0
    width = ((0.0 if log else 1.0) - lo) / SCATTER_BINS
    hi = 0.0 if log else 1.0
    i = np.floor((np.clip(x, lo, hi) - lo) / width).astype(np.int64)  # no overflow warning
    return np.clip(i, 0, SCATTER_BINS - 1)


def k3_bin(k3: np.ndarray) -> np.ndarray:
    """--robust: each k3's bin of the log10 histogram, 1 .. K3_BINS (k3 = 0: bin 0). log10
    is pmath's log divided by ln 10: the same bits on every CPU (numpy's log10 differs in
    the last bit between its AVX-512 loops and others, which moved a k3 within ~1e-14 of a
    bin edge from one bin to the next)."""
    with np.errstate(divide="ignore"):
        x = pmath.log(np.where(k3 > 0, k3, 1.0)) / _LN10  # k3 = 0 goes to bin 0 below
    x = np.clip(
        x, K3_LOG10_MIN - 1.0, K3_LOG10_MAX + 1.0
    )  # inf (l > 709): the top bin, no cast warning
    i = np.floor((x - K3_LOG10_MIN) / (K3_LOG10_MAX - K3_LOG10_MIN) * K3_BINS).astype(np.int64)
    return np.where(k3 > 0, np.clip(i, 0, K3_BINS - 1) + 1, 0)


def q_bucket(q: np.ndarray) -> np.ndarray:
    """--by q_bucket: the index into Q_BUCKET_EDGES of each inference probability."""
    return np.searchsorted(np.asarray(Q_BUCKET_EDGES), q, side="right") - 1


def length_bucket(n: np.ndarray) -> np.ndarray:
    """--by length: floor(log2 n) of each positive count, exactly (frexp, no rounding): the
    bucket [2^b, 2^(b+1)) is labelled by its lower edge 2^b."""
    _, e = np.frexp(np.asarray(n, dtype=np.float64))
    return (e - 1).astype(np.int64)


class Grow:
    """A 1-D float array that grows by doubling (per-sequence accumulators): `a` holds it,
    positions never written hold `fill`."""

    def __init__(self, fill: float):
        self.fill = fill
        self.a = np.full(1024, fill)

    def ensure(self, n: int) -> None:
        """At least n positions."""
        if n > self.a.shape[0]:
            new = np.full(max(n, 2 * self.a.shape[0]), self.fill)
            new[: self.a.shape[0]] = self.a
            self.a = new


_ADDED = ("count", "mass", "wsum", "wsq", "seq_count", "seqfrac")
# what a mask costs (direction_class): per bin, corrective and divergent tokens, |A| sum,
# entropy sum and finite-entropy count; None where the log lacks the column
DIRECTION = ("corr", "div", "amass")
ENTROPY = ("ent", "ent_n")
COST = (*DIRECTION, *ENTROPY)
NEUTRAL, CORRECTIVE, DIVERGENT = 0, 1, 2


def direction_class(lp: np.ndarray, lq: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """Each token's class (RULES.md "What a mask costs"): CORRECTIVE where A * dp < 0 (the
    update moves p back toward q), DIVERGENT where A * dp > 0, NEUTRAL where A == 0 or
    dp == 0. sign(dp) = sign(p - q) = sign(lp - lq), and lp - lq is 0 only when lp == lq:
    the class is exact, with no exp. int64."""
    l = np.asarray(lp, dtype=np.float64) - np.asarray(lq, dtype=np.float64)  # noqa: E741
    a = np.asarray(adv, dtype=np.float64)
    ap, an, lpos, lneg = a > 0, a < 0, l > 0, l < 0
    out = ((ap & lneg) | (an & lpos)).astype(np.int64)  # CORRECTIVE = 1
    out += 2 * ((ap & lpos) | (an & lneg))  # DIVERGENT = 2
    return out


@dataclass
class JobBins:
    """Per-bin sums of one job, shape (groups, K + 2)."""

    count: np.ndarray
    mass: np.ndarray
    wsum: np.ndarray | None = None
    wsq: np.ndarray | None = None
    wmax: np.ndarray | None = None
    seq_count: np.ndarray | None = None  # sequences per bin (sequence-level counts)
    seqfrac: np.ndarray | None = None  # sum of 1/n_i per bin (prime-rl's is_masked/mean)
    # each sequence's bin (sequence rules) or highest bin over its tokens (token rules, m2po),
    # by global sequence id: what the prompt-group counts read (readout.py); not additive
    seq_bin: np.ndarray | None = None
    # what a mask costs (COST): corrective, divergent tokens, |A| sum (with an advantage);
    # entropy sum and finite-entropy count (with an entropy column); per bin
    corr: np.ndarray | None = None
    div: np.ndarray | None = None
    amass: np.ndarray | None = None
    ent: np.ndarray | None = None
    ent_n: np.ndarray | None = None

    def grow(self, groups: int) -> None:
        """At least `groups` rows (new groups: empty bins)."""
        for name in (*_ADDED, *COST, "wmax"):
            a = getattr(self, name)
            if a is not None and a.shape[0] < groups:
                fill = -math.inf if name == "wmax" else 0
                pad = np.full((groups - a.shape[0], a.shape[1]), fill, dtype=a.dtype)
                setattr(self, name, np.vstack([a, pad]))

    def absorb(self, other: JobBins, gmap: np.ndarray) -> None:
        """Add another shard's bins of the same job; its group g is this one's gmap[g]."""
        for name in ("count", "mass", "wsum", "wsq", "seqfrac", *COST):
            a, into = getattr(other, name), getattr(self, name)
            if a is not None and into is None and name in COST:
                into = self._cost(name)
            if a is not None and into is not None and a.shape[0]:
                np.add.at(into, gmap[: a.shape[0]], a)
        if other.wmax is not None and self.wmax is not None and other.wmax.shape[0]:
            np.maximum.at(self.wmax, gmap[: other.wmax.shape[0]], other.wmax)

    def _cost(self, name: str) -> np.ndarray:
        """The COST array `name`, created empty (like count) on first use."""
        a = getattr(self, name)
        if a is None:
            dt = np.int64 if name in ("corr", "div", "ent_n") else np.float64
            a = np.zeros(self.count.shape, dtype=dt)
            setattr(self, name, a)
        return a

    def add_cost(self, idx: np.ndarray, size: int, dirn=None, absadv=None, ent=None,
                 cnt=None) -> None:  # fmt: skip
        """Add items at flat (group * width + bin) `idx`: their direction classes and |A|
        (`dirn`, `absadv`), their entropies (`ent`, non-finite ones left out); or, for
        items that are sequences (`cnt` given), their per-sequence sums: dirn = (corrective,
        divergent) tokens, absadv the |A| sum, ent = (entropy sum, finite count)."""
        shape = self.count.shape

        def add(name, w):
            a = self._cost(name)
            a += np.bincount(idx, weights=w, minlength=size).reshape(shape).astype(a.dtype)

        if dirn is not None:
            if cnt is None:
                add("corr", (dirn == CORRECTIVE).astype(np.float64))
                add("div", (dirn == DIVERGENT).astype(np.float64))
            else:
                add("corr", dirn[0])
                add("div", dirn[1])
            add("amass", absadv)
        if ent is not None:
            if cnt is None:
                ok = np.isfinite(ent)
                add("ent", np.where(ok, ent, 0.0))
                add("ent_n", ok.astype(np.float64))
            else:
                add("ent", ent[0])
                add("ent_n", ent[1])


def new_bins(k: int, groups: int, weight: bool, seqfrac: bool = False) -> JobBins:
    """Empty bins of a job of k values: the weight sums for weight rules, the 1/n sums
    with prime-rl's conventions."""
    z = np.zeros((groups, k + 2))
    return JobBins(
        count=np.zeros((groups, k + 2), dtype=np.int64),
        mass=z.copy(),
        wsum=z.copy() if weight else None,
        wsq=z.copy() if weight else None,
        wmax=np.full((groups, k + 2), -math.inf) if weight else None,
        seqfrac=z.copy() if seqfrac else None,
    )


def accumulate(
    bins: JobBins,
    b: np.ndarray,
    g: np.ndarray,
    groups: int,
    mass,
    weight=None,
    count=None,
    inv_n=None,
    dirn=None,
    absadv=None,
    ent=None,
) -> None:
    """Add items (tokens, or sequences with `count` tokens each) of bins b and groups g:
    their count, |dp| mass, natural weights (weight rules), 1/n sums (`inv_n`) and what a
    mask costs (`dirn`, `absadv`, `ent`: JobBins.add_cost)."""
    width = bins.count.shape[1]
    idx = g * width + b
    size = groups * width
    cnt = np.ones_like(b, dtype=float) if count is None else count
    bins.count += (
        np.bincount(idx, weights=cnt, minlength=size).reshape(groups, width).astype(np.int64)
    )
    bins.mass += np.bincount(idx, weights=mass, minlength=size).reshape(groups, width)
    if weight is not None:
        bins.wsum += np.bincount(idx, weights=weight * cnt, minlength=size).reshape(groups, width)
        bins.wsq += np.bincount(idx, weights=weight * weight * cnt, minlength=size).reshape(
            groups, width
        )
        flat = bins.wmax.reshape(-1)
        np.maximum.at(flat, idx, weight)
    if inv_n is not None and bins.seqfrac is not None:
        bins.seqfrac += np.bincount(idx, weights=inv_n, minlength=size).reshape(groups, width)
    if dirn is not None or ent is not None:
        bins.add_cost(idx, size, dirn, absadv, ent, count)


def seq_count(seq_group: np.ndarray, seq_bin: np.ndarray, width: int, G: int) -> np.ndarray:
    """Sequences per (group, bin): each sequence's --by group and bin (-1, a sequence with
    no token in the job: bin 0)."""
    b = np.maximum(seq_bin, 0).astype(np.int64)
    idx = seq_group * width + b
    return np.bincount(idx, minlength=G * width).reshape(G, width).astype(np.int64)


def suffix(a: np.ndarray) -> np.ndarray:
    """s[:, j] = sum of a[:, j:], with a trailing zero column."""
    rev = np.cumsum(a[:, ::-1], axis=1)[:, ::-1]
    return np.concatenate([rev, np.zeros((a.shape[0], 1), dtype=a.dtype)], axis=1)


_POISSON1_CDF = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(25)])
# u * 2**-53 >= cdf[k] iff the integer u >= ceil(cdf[k] * 2**53) (a power-of-two scaling:
# exact), so the kernel's search compares integers (cdf[k] < 1: fits in uint64)
_POISSON1_ICDF = np.array([math.ceil(c * 2.0**53) for c in _POISSON1_CDF], dtype=np.uint64)


def poisson_weights(
    units: np.ndarray, replicates: int, seed: int, transposed: bool = False, dtype=np.float64
) -> np.ndarray:
    """Poisson(1) bootstrap weights, shape (replicates, units), a pure function of the unit id
    (`transposed`: (units, replicates)); `dtype` uint8 holds them in an eighth of the memory
    (a weight is at most ~15; first touching 100k units x 200 float64 weights cost more than
    drawing them).

    A counter-based hash (splitmix64 of unit id, replicate and seed) makes each unit's weight
    the same in every batch and file it appears in, so the bootstrap streams: the weighted
    counts of each replicate are accumulated batch by batch, with no second pass. On the
    fused backend the kernel `jit.poisson_weights_t` draws the same weights bit for bit
    (integer hashing, an exact conversion, the same search); numpy otherwise.
    """
    j = fast.compiled()
    if j is not None and units.size * replicates >= 1 << 16:
        out = np.empty((units.shape[0], replicates), dtype=dtype)
        ids = units.astype(np.int64)
        cuts = np.linspace(0, ids.shape[0], fast.threads() + 1).astype(np.int64)

        def part(k: int) -> None:  # the kernel releases the GIL: one slice per core
            a, b = cuts[k], cuts[k + 1]
            j.poisson_weights_t(ids[a:b], replicates, seed, _POISSON1_ICDF, out[a:b])

        list(fast.executor(len(cuts) - 1).map(part, range(len(cuts) - 1)))
        return out if transposed else out.T
    w = poisson_weights_numpy(units, replicates, seed).astype(dtype)
    return np.ascontiguousarray(w.T) if transposed else w


def poisson_weights_numpy(units: np.ndarray, replicates: int, seed: int) -> np.ndarray:
    """`poisson_weights` in numpy, (replicates, units): the reference."""
    u = units.astype(np.uint64)[None, :]
    r = np.arange(replicates, dtype=np.uint64)[:, None]
    with np.errstate(over="ignore"):
        z = u * np.uint64(0x9E3779B97F4A7C15) + (r + np.uint64(seed) * np.uint64(1_000_003)) * (
            np.uint64(0xD1B54A32D192ED03)
        )
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    uni = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.searchsorted(_POISSON1_CDF, uni, side="right").astype(np.float64)
