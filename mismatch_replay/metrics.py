"""Mismatch metrics: additive per-group sums -> the statistics users already know.

Design
------
Every metric is a function of a few token sums (count, sum, sum of squares, max), so the
engine keeps only those, per group, and they add across batches, files and machines. The
table names each statistic both plainly and by the name a framework logs it under (prime-rl's
`mismatch_kl/all/mean`, verl's `rollout_corr/k3_kl`, ...), so a number can be put next to a
dashboard's, and each is computed as that framework computes it (a metric named after a
dashboard metric must equal it):

* k3 (`kl_k3`, `kl_k3_std`, `kl_k3_max`) is unclamped, as prime-rl's `mismatch_kl`
  (exp(l) - l - 1, loss.py) and verl's `rollout_corr/k3_kl` (rollout_corr_helper.py) are:
  one token at l = -25 among 1,999 at l = 0 gives kl_k3 = 0.0120 (a clamp at +-20 gave
  0.0095). We compute it as expm1(l) - l, which differs from exp(l) - l - 1 only in
  rounding (and is exact near 0). An absurd l > 709 makes it inf, as it does there.
* `chi2_token` clamps l to +-20 before exp, as verl's chi2_token does.
* the std metrics are sample standard deviations (Bessel's n - 1), as torch.std is in
  prime-rl's compute_stats and verl's rollout_probs_diff_std: on 5 tokens the population
  std would be 11% lower. A group of one token has no std (null), as torch.std gives NaN.

All sums are float64. k1 = -l, k2 = l^2/2, k3 = r - 1 - l with l = log p_train - log
p_infer: their token means estimate KL(inference || trainer) with samples from the
inference engine.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from . import pmath
from .rules import TokenBatch

# --by q_bucket: inference-probability buckets, labelled by their lower edge (the engine
# groups by them, the figures label them: here, below both)
Q_BUCKET_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99)
VAR_FLOOR = 1e-9  # a variance below this share of the second moment counts as zero

_SUMS = (
    "n",
    "k1",
    "k2",
    "k3",
    "k3_sq",
    "abs_dp",
    "abs_dp_sq",
    "p",
    "q",
    "pp",
    "qq",
    "pq",
    "r_sq",
    "entropy",
    "entropy_n",
)
_MAXES = ("k3_max", "abs_dp_max")

# metric name -> (framework name(s), description)
NAMES: dict[str, tuple[str, str]] = {
    "tokens": ("", "loss tokens"),
    "kl_k1": ("rollout_corr/kl (verl)", "token mean of k1 = -l"),
    "kl_k2": ("", "token mean of k2 = l^2/2"),
    "kl_k3": (
        "mismatch_kl/all/mean (prime-rl), rollout_corr/k3_kl (verl)",
        "token mean of k3 = r - 1 - l",
    ),
    "kl_k3_std": ("mismatch_kl/all/std (prime-rl)", "token std of k3"),
    "kl_k3_max": ("mismatch_kl/all/max (prime-rl)", "token max of k3"),
    "abs_dp_mean": ("training/rollout_probs_diff_mean (verl)", "token mean of |p - q|"),
    "abs_dp_std": ("training/rollout_probs_diff_std (verl)", "token std of |p - q|"),
    "abs_dp_max": ("training/rollout_probs_diff_max (verl)", "token max of |p - q|"),
    "chi2_token": ("rollout_corr/chi2_token (verl)", "token mean of r^2, minus 1"),
    "ppl_ratio": ("rollout_corr/ppl_ratio (verl, per sequence there)", "exp(token mean of k1)"),
    "probs_pearson": (
        "training/rollout_actor_probs_pearson_corr (verl)",
        "Pearson correlation of p and q over tokens",
    ),
    "entropy_mean": ("entropy/all/mean (prime-rl)", "token mean of the trainer entropy"),
    "kl_ent_ratio": ("kl_ent_ratio/mean (prime-rl, per token there)", "kl_k3 / entropy_mean"),
}


def _std(sum_sq: np.ndarray, mean: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Sample standard deviation (Bessel's n - 1) from a sum of squares and the mean, as
    torch.std computes it (prime-rl's compute_stats, verl's debug metrics); NaN for n < 2,
    as torch.std of one value is."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        nn = np.where(n > 1, n, np.nan)
        var = np.maximum(sum_sq / nn - mean * mean, 0.0) * (nn / (nn - 1.0))
        return np.sqrt(var)


class MetricSums:
    """Per-group sums and maxima; `add` one batch, `absorb` another MetricSums."""

    def __init__(self):
        self.s = {k: np.zeros(0) for k in _SUMS}
        self.m = {k: np.zeros(0) for k in _MAXES}

    def _grow(self, groups: int) -> None:
        for d, fill in ((self.s, 0.0), (self.m, -math.inf)):
            for k, a in d.items():
                if a.shape[0] < groups:
                    d[k] = np.concatenate([a, np.full(groups - a.shape[0], fill)])

    def add(self, tb: TokenBatch, g: np.ndarray, groups: int, entropy=None) -> None:
        self._grow(groups)
        r = tb.r_clamped  # chi2_token: verl clamps l to +-20 before exp
        k3 = tb.k3  # unclamped, as prime-rl's mismatch_kl and verl's k3_kl are
        p, q = tb.p, tb.q
        with np.errstate(over="ignore"):  # an absurd l: k3^2 is inf, as it is there
            k3_sq = k3 * k3
        vals = {
            "n": None,
            "k1": -tb.l,
            "k2": tb.k2,
            "k3": k3,
            "k3_sq": k3_sq,
            "abs_dp": tb.abs_dp,
            "abs_dp_sq": tb.abs_dp * tb.abs_dp,
            "p": p,
            "q": q,
            "pp": p * p,
            "qq": q * q,
            "pq": p * q,
            "r_sq": r * r,
        }
        if entropy is not None:
            ok = np.isfinite(entropy)
            vals["entropy"] = np.where(ok, entropy, 0.0)
            vals["entropy_n"] = ok.astype(float)
        for k, v in vals.items():
            self.s[k] += np.bincount(g, weights=v, minlength=groups)
        np.maximum.at(self.m["k3_max"], g, k3)
        np.maximum.at(self.m["abs_dp_max"], g, tb.abs_dp)

    def add_sums(self, sums: np.ndarray, maxes: np.ndarray, groups: int) -> None:
        """Add per-group sums computed elsewhere (the fused kernel): sums (G, 15) in _SUMS
        order, maxes (G, 2) in _MAXES order."""
        self._grow(groups)
        for i, k in enumerate(_SUMS):
            self.s[k][: sums.shape[0]] += sums[:, i]
        for i, k in enumerate(_MAXES):
            m = self.m[k]
            m[: maxes.shape[0]] = np.maximum(m[: maxes.shape[0]], maxes[:, i])

    def absorb(self, other: MetricSums, gmap: np.ndarray, groups: int) -> None:
        self._grow(groups)
        for k, a in other.s.items():
            np.add.at(self.s[k], gmap[: a.shape[0]], a)
        for k, a in other.m.items():
            np.maximum.at(self.m[k], gmap[: a.shape[0]], a)

    def total(self) -> MetricSums:
        """All groups summed into one."""
        t = MetricSums()
        t.s = {k: np.array([a.sum()]) for k, a in self.s.items()}
        t.m = {k: np.array([a.max() if a.size else -math.inf]) for k, a in self.m.items()}
        return t

    def values(self) -> dict[str, np.ndarray]:
        """Per-group statistics (NaN where undefined, e.g. no entropy logged)."""
        s, m = self.s, self.m
        n = np.where(s["n"] > 0, s["n"], np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            k3 = s["k3"] / n
            out = {
                "tokens": s["n"],
                "kl_k1": s["k1"] / n,
                "kl_k2": s["k2"] / n,
                "kl_k3": k3,
                "kl_k3_std": _std(s["k3_sq"], k3, s["n"]),
                "kl_k3_max": np.where(s["n"] > 0, m["k3_max"], np.nan),
                "abs_dp_mean": s["abs_dp"] / n,
                "abs_dp_std": _std(s["abs_dp_sq"], s["abs_dp"] / n, s["n"]),
                "abs_dp_max": np.where(s["n"] > 0, m["abs_dp_max"], np.nan),
                "chi2_token": s["r_sq"] / n - 1.0,
                "ppl_ratio": pmath.exp(s["k1"] / n),
            }
            cov = s["pq"] / n - (s["p"] / n) * (s["q"] / n)
            vp = s["pp"] / n - (s["p"] / n) ** 2
            vq = s["qq"] / n - (s["q"] / n) ** 2
            # undefined (null) where a column is constant to ~9 digits: there the variance
            # from the sums is rounding noise, and its sign and size depend on the order
            # in which batches, blocks and threads added them
            flat = (vp <= VAR_FLOOR * s["pp"] / n) | (vq <= VAR_FLOOR * s["qq"] / n)
            out["probs_pearson"] = np.where(flat, np.nan, cov / np.sqrt(vp * vq))
            en = np.where(s["entropy_n"] > 0, s["entropy_n"], np.nan)
            out["entropy_mean"] = s["entropy"] / en
            out["kl_ent_ratio"] = k3 / out["entropy_mean"]
        return out

    def table(self, by: str | None, groups: list) -> pl.DataFrame:
        """One row per group (or one row), NaN turned into null."""
        vals = self.values()
        data: dict = {}
        if by is not None:
            data[by] = groups
        for k, v in vals.items():
            data[k] = [None if not np.isfinite(x) else float(x) for x in v]
        df = pl.DataFrame(data)
        df = df.with_columns(pl.col("tokens").cast(pl.Int64))
        return df.sort(by) if by is not None else df
