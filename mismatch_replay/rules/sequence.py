"""Sequence rules: 9 rules scored on `SeqStats`, the per-sequence statistics of SEQ_STATS.

A sequence rule masks (or truncates) every loss token of a sequence together; its score
is a function of sums, maxima and minima over the sequence (S_i = the sum of l, the mean
G_i = S_i / n_i, the max of k2, the min of l, the mean exp|l|, the mean advantage), so
that it adds across batches and files. The sums are float64; a float32 replay rounds
each once before its float32 arithmetic (`_seq_mean`, `_seq_ratio`). seq-mis and geo-mis
share one band (`_SeqBand`, on S_i or G_i); verl's presets read the sums of l clamped to
+-20 (`sum_lc`, `sum_k3c`), which the engine keeps only when such a job runs.
"""

from __future__ import annotations

import numpy as np

from .. import pmath
from .base import (
    AT_LEAST_1,
    INF,
    LOG_CLAMP,
    NEMO_GRPO,
    POSITIVE,
    PRIME_LOSS,
    RATIO_HIGH,
    RATIO_LOW,
    REAL,
    SKYRL_OPC,
    SLIME_TIS,
    TRL_GRPO,
    UNIT,
    VERL_RC,
    Param,
    Rule,
    as_f64,
    band,
    reciprocal_spec,
    register,
    safe_log,
    select,
    tensor_log,
)

# ---- sequence rules (read SeqStats)


def _seq_ratio(rule, x, clamp: bool) -> np.ndarray:
    """exp(x) of a per-sequence log quantity in the rule's precision (clip to +-20 first)."""
    X = rule.X
    x = X.cast(x)
    if clamp:
        x = np.clip(x, -LOG_CLAMP, LOG_CLAMP)
    return X.exp(x)


def _seq_mean(rule, total, n) -> np.ndarray:
    """total / n in the rule's precision (a float32 replay rounds the float64 sum once)."""
    X = rule.X
    return X.cast(total) / X.cast(n)


@register
class SeqTIS(Rule):
    name = "seq-tis"
    label = "seq-TIS"
    color = "#000000"  # Okabe-Ito black
    panel = "seqratio"
    bound_on = "exp(S_i) cap"
    title = "sequence-level truncated IS"
    source = "verl; SkyRL; TRL"
    definition = "weight min(exp(S_i), cap) on every token of i; truncated when exp(S_i) > cap"
    level = "sequence"
    kind = "weight"
    needs = ("sample_id",)
    params = (Param("cap", "weight cap", "1.01:100:121:log", domain=POSITIVE),)
    presets = {"verl": {"cap": 2.0}, "skyrl": {"cap": 5.0}, "trl": {"cap": 3.0}}
    preset_notes = {
        "verl": "exp(clip(S_i, -20, 20)) > cap, in ratio space",
        "skyrl": "exp(clip(S_i, -20, 20)) > cap, in ratio space (float32 exp in SkyRL)",
        "trl": "sequence_truncate: exp(S_i) > C_max, in ratio space",
    }
    preset_arith = {"verl": "ratio-clamp", "skyrl": "ratio-clamp", "trl": "ratio"}
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_correction_weights (sequence) @ b178a3c",
        "skyrl": f"{SKYRL_OPC} compute_tis_ratio (sequence)",
        "trl": f"{TRL_GRPO} sequence_truncate",
    }
    cap: float | None = 2.0

    def threshold(self, param, value):
        return float(value) if self.arith else safe_log(value)

    def score(self, s, param):
        sum_l = self.seq_stat(s, "sum_l")
        if self.arith in ("ratio", "ratio-clamp"):
            return as_f64(_seq_ratio(self, sum_l, self.arith == "ratio-clamp"))
        return as_f64(self.X.cast(sum_l))

    def weight(self, s, param):
        return pmath.exp(np.clip(s.sum_l, -LOG_CLAMP, LOG_CLAMP))


class _SeqBand(Rule):
    """exp(x) outside [low, high], x a per-sequence log quantity; low = 0 means no low bound."""

    level = "sequence"
    needs = ("sample_id",)
    mean = False  # x = S_i (False) or G_i = S_i / n_i (True)

    def _x(self, s) -> np.ndarray:
        sum_l = self.seq_stat(s, "sum_l")
        return _seq_mean(self, sum_l, s.n) if self.mean else self.X.cast(sum_l)

    def _k1(self, s) -> np.ndarray:
        """verl's k1 statistic: -sum of clip(l, -20, 20), or its mean over the tokens."""
        lc = self.seq_stat(s, "sum_lc")
        y = _seq_mean(self, lc, s.n) if self.mean else self.X.cast(lc)
        return -y

    def threshold(self, param, value):
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            return float(value) if param == "high" else -float(value)
        if a == "verl-k1":
            if param == "high":
                return -safe_log(reciprocal_spec(value))
            return safe_log(reciprocal_spec(value))
        return safe_log(value) if param == "high" else -safe_log(value)

    def score(self, s, param):
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            g = _seq_ratio(self, self._x(s), a == "ratio-clamp")
            return band(param, g, self.low, self.high)
        if a == "verl-k1":
            k1 = self._k1(s)
            if param == "high":
                return select(k1 > safe_log(reciprocal_spec(self.low)), INF, -k1)
            return select(k1 < safe_log(reciprocal_spec(self.high)), INF, k1)
        x = self._x(s)
        if param == "high":
            return select(x < safe_log(self.low), INF, x)
        return select(x > safe_log(self.high), INF, -x)


@register
class SeqMIS(_SeqBand):
    primary = "high"
    name = "seq-mis"
    label = "seq-MIS"
    color = "#E69F00"  # Okabe-Ito orange
    panel = "seqratio"
    bound_on = "exp(S_i)"
    title = "sequence importance-ratio rejection"
    source = "verl rollout correction; TRL"
    definition = "exp(S_i) outside [low, high] (low = 0: no lower bound)"
    params = (
        Param("low", "lower bound on the product ratio", "0.0001:0.99:121:log", domain=RATIO_LOW),
        Param("high", "upper bound on the product ratio", "1.01:10000:121:log", domain=RATIO_HIGH),
    )
    presets = {
        "verl": {"low": 0.5, "high": 2.0},
        "trl": {"low": 0.0, "high": 3.0},
        "slime": {"low": 0.5, "high": 2.0},
        "skyrl": {"low": 0.5, "high": 2.0},
    }
    preset_notes = {
        "slime": "compute_mis_weights, rs_level sequence: exp(clip(S_i, -20, 20)) kept in "
        "[0.5, 2.0] (mis.yaml's bounds)",
        "skyrl": "compute_sequence_mask (product): exp(clip(S_i, -20, 20)) outside "
        "[product_mask_low, product_mask_high], float32",
        "verl": "seq_sum_k1 '0.5_2.0': -sum of clip(l, -20, 20) against [log 0.5, log 2] "
        "(verl's k1 bands are inverted, but this one is symmetric)",
        "trl": "sequence_mask: exp(S_i) > C_max (no C_min), in ratio space",
    }
    preset_arith = {
        "verl": "verl-k1",
        "trl": "ratio",
        "slime": "ratio-clamp",
        "skyrl": "ratio-clamp",
    }
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (seq_sum_k1) @ b178a3c",
        "trl": f"{TRL_GRPO} sequence_mask",
        "slime": f"{SLIME_TIS} compute_mis_weights (rs_level sequence, mask())",
        "skyrl": f"{SKYRL_OPC} compute_sequence_mask (product)",
    }
    low: float | None = 0.5
    high: float | None = 2.0


@register
class GeoMIS(_SeqBand):
    primary = "high"
    name = "geo-mis"
    label = "geo-MIS"
    color = "#56B4E9"  # Okabe-Ito sky blue
    panel = "seqmean"
    bound_on = "exp(G_i)"
    title = "geometric-mean ratio rejection (Geo-RS)"
    source = "verl rollout correction; SkyRL; prime-rl (pre-2026)"
    definition = "exp(G_i) outside [low, high], G_i = S_i / n_i"
    mean = True
    params = (
        Param(
            "low", "lower bound on the geometric-mean ratio", "0.1:0.9999:121:log", domain=RATIO_LOW
        ),
        Param(
            "high",
            "upper bound on the geometric-mean ratio",
            "1.0001:10:121:log",
            domain=RATIO_HIGH,
        ),
    )
    presets = {
        "verl": {"low": 1 / 1.001, "high": 1 / 0.999},
        "skyrl": {"low": 0.99, "high": 1.01},
        "slime": {"low": 0.9999, "high": 1.0001},
        "prime-rl-legacy": {"low": 0.1, "high": 10.0},
    }
    preset_notes = {
        "verl": "seq_mean_k1 '0.999_1.001' (verl's default): -mean of clip(l, -20, 20) "
        "against [log 0.999, log 1.001], i.e. exp(G) kept in [1/1.001, 1/0.999]",
        "skyrl": "geometric: exp(clip(G_i, -20, 20)) outside [low, high], ratio space",
        "slime": "compute_mis_weights, rs_level geometric: exp(clip(G_i, -20, 20)) kept in "
        "[0.9999, 1.0001] (mis.yaml: 'for Geometry level')",
        "prime-rl-legacy": "exp(G_i) outside [geo_mask_low, geo_mask_high], ratio space",
    }
    preset_quirks = {
        "verl": "verl's seq_mean_k1 with a 'lo_hi' threshold keeps 1/hi <= exp(G) <= 1/lo: "
        "its default '0.999_1.001' keeps exp(G) in [0.999001, 1.001001]; this preset "
        "follows the code.",
    }
    preset_arith = {
        "verl": "verl-k1",
        "skyrl": "ratio-clamp",
        "slime": "ratio-clamp",
        "prime-rl-legacy": "ratio",
    }
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (seq_mean_k1) @ b178a3c",
        "skyrl": f"{SKYRL_OPC} compute_sequence_mask (geometric)",
        "slime": f"{SLIME_TIS} compute_mis_weights (rs_level geometric, mask())",
        "prime-rl-legacy": f"{PRIME_LOSS} compute_loss (geo_mask) @ 5f47740",
    }
    low: float | None = 0.999
    high: float | None = 1.001


@register
class SeqMeanK3(Rule):
    name = "seq-mean-k3"
    color = "#332288"  # Tol indigo
    panel = "seqkl"
    bound_on = "mean k3"
    title = "sequence mean-k3 rejection (K3-RS)"
    source = "verl rollout correction"
    definition = "mean over the sequence of k3 > hi"
    level = "sequence"
    needs = ("sample_id",)
    params = (Param("hi", "threshold on the sequence's mean k3", "0.00001:1:121:log"),)
    presets = {"verl": {"hi": 0.01}}
    preset_notes = {"verl": "seq_mean_k3: k3 of l clamped to +-20 (exp(lc) - 1 - lc), averaged"}
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_RC} compute_rollout_rejection_mask (seq_mean_k3) @ b178a3c"}
    hi: float | None = 0.01

    def score(self, s, param):
        total = self.seq_stat(s, "sum_k3c" if self.arith == "verl" else "sum_k3")
        return as_f64(_seq_mean(self, total, s.n))


@register
class SeqMaxK2(Rule):
    name = "seq-max-k2"
    color = "#999933"  # Tol olive
    panel = "seqkl"
    bound_on = "max k2"
    title = "sequence max-k2 rejection"
    source = "verl rollout correction"
    definition = "max over the sequence of k2 > hi"
    level = "sequence"
    needs = ("sample_id",)
    params = (Param("hi", "threshold on the sequence's max k2", "0.001:100:121:log"),)
    presets = {"verl": {"hi": 2.5}}
    preset_notes = {"verl": "seq_max_k2: k2 of l clamped to +-20, so at most 200"}
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_RC} compute_rollout_rejection_mask (seq_max_k2) @ b178a3c"}
    hi: float | None = 2.5

    def score(self, s, param):
        m = self.X.cast(self.seq_stat(s, "max_k2"))
        return as_f64(np.minimum(m, 0.5 * LOG_CLAMP * LOG_CLAMP) if self.arith == "verl" else m)


@register
class Veto(Rule):
    name = "veto"
    color = "#CC79A7"  # Okabe-Ito reddish purple
    panel = "seqratio"
    bound_on = "min token r"
    title = "catastrophic-token veto"
    source = "verl rollout correction"
    definition = "any token of the sequence with r < v"
    level = "sequence"
    needs = ("sample_id",)
    params = (
        Param(
            "v", "ratio below which one token vetoes its sequence", "1e-8:0.99:121:log", domain=UNIT
        ),
    )
    presets = {"slime": {"v": 1e-4}, "skyrl": {"v": 1e-4}}
    preset_notes = {
        "slime": "calculate_veto_mask: l < log(torch.tensor(1e-4)), the log of a float32 "
        "tensor whatever the log-probs' dtype (rs_veto_threshold 1.0e-4 in mis.yaml)",
        "skyrl": "compute_outlier_token_mask with outlier_token_is_threshold_low only: a "
        "sequence is masked when any token has exp(clip(l, -20, 20)) < low (safe_exp_delta, "
        "float32), strict; 1e-4 is SkyRL's docs' example (its default is None: off). Its "
        "outlier_token_is_threshold_high side (any token's ratio > high) has no rule here",
    }
    preset_arith = {"slime": "log-tensor", "skyrl": "ratio-clamp"}
    preset_sources = {
        "slime": f"{SLIME_TIS} calculate_veto_mask",
        "skyrl": f"{SKYRL_OPC} compute_outlier_token_mask (token_under_low, line 114)",
    }
    v: float | None = 1e-4

    def threshold(self, param, value):
        if self.arith == "log-tensor":  # torch.tensor(v) is float32, its log too
            return -tensor_log(value, "float32")
        if self.arith == "ratio-clamp":  # masked iff min_t exp(clip(l_t)) < v
            return -float(value)
        return -safe_log(value)

    def score(self, s, param):
        m = self.seq_stat(s, "min_l")
        if self.arith == "ratio-clamp":  # exp is monotone: the min ratio is exp(min l)
            return as_f64(-_seq_ratio(self, m, True))
        return as_f64(-self.X.cast(m))


@register
class OPSM(Rule):
    name = "opsm"
    label = "OPSM"
    color = "#AA4499"  # Tol purple
    panel = "seqkl"
    bound_on = "mean (lq − lp), A<0"
    title = "off-policy sequence masking"
    source = "DeepSeek-V3.2"
    definition = "A < 0 and mean over the sequence of (lq - lp) > delta"
    level = "sequence"
    needs = ("sample_id", "advantage")
    params = (
        Param("delta", "threshold on the mean log-ratio drop", "0.0001:10:121:log", domain=REAL),
    )
    presets = {"trl": {"delta": 0.5}}
    preset_notes = {"trl": "no published delta; TRL's docs suggest 0.5"}
    preset_sources = {"trl": f"{TRL_GRPO} get_off_policy_mask"}
    delta: float | None = None

    def score(self, s, param):
        mean = _seq_mean(self, self.seq_stat(s, "sum_l"), s.n)
        return select(s.adv(self.name) < 0, -mean, -INF)


@register
class GSPO(Rule):
    primary = "eps_high"
    name = "gspo"
    label = "GSPO"
    color = "#E69F00"  # Okabe-Ito orange
    panel = "clip"
    bound_on = "on exp(G_i)"
    title = "GSPO sequence clip"
    source = "arXiv 2507.18071"
    definition = "ppo-clip on exp(G_i) with the sequence advantage"
    level = "sequence"
    needs = ("sample_id", "advantage")
    params = (
        Param("eps_low", "lower clip 1 - eps_low on exp(G_i)", "0.00001:0.5:121:log", domain=UNIT),
        Param("eps_high", "upper clip 1 + eps_high on exp(G_i)", "0.00001:10:121:log"),
    )
    presets = {"paper": {"eps_low": 3e-4, "eps_high": 4e-4}}
    eps_low: float | None = 3e-4
    eps_high: float | None = 4e-4

    def threshold(self, param, value):
        return 1.0 + value if param == "eps_high" else value - 1.0

    def score(self, s, param):
        a = s.adv(self.name)
        g = self.X.exp(_seq_mean(self, self.seq_stat(s, "sum_l"), s.n))
        if param == "eps_high":
            down = (a < 0) & (g < 1.0 - self.eps_low)
            return select(down, INF, select(a > 0, g, -INF))
        up = (a > 0) & (g > 1.0 + self.eps_high)
        return select(up, INF, select(a < 0, -g, -INF))


@register
class ProbError(Rule):
    name = "prob-error"
    color = "#009E73"  # Okabe-Ito bluish green
    panel = "seqmean"
    bound_on = "mean exp|l|"
    title = "NeMo-RL token multiplicative probability error"
    source = "NeMo-RL"
    definition = "mean over the sequence of exp(|l|) > tau"
    level = "sequence"
    needs = ("sample_id",)
    params = (
        Param("tau", "threshold on the mean of exp(|l|)", "1.0001:10:121:log", domain=AT_LEAST_1),
    )
    presets = {"nemo-rl": {"tau": 1.5}}
    preset_notes = {"nemo-rl": "the same arithmetic as the bare rule (mean of exp|l| > tau)"}
    preset_sources = {"nemo-rl": f"{NEMO_GRPO} compute_and_apply_seq_logprob_error_masking"}
    tau: float | None = 1.5

    def score(self, s, param):
        return as_f64(_seq_mean(self, self.seq_stat(s, "sum_exp_abs_l"), s.n))
