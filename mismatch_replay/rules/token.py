"""Token rules: 13 rules scored on a `TokenBatch`, one frozen dataclass each.

Three groups, in catalogue order: rules on the log-probs alone (ipo, ipo-v1, icepop,
token-mis, kpop, token-k2, token-k3), rules that also read the sign of the advantage
(dppo-tv, dppo-kl, ppo-clip, dual-clip), and weight rules (tis, cispo: `kind = "weight"`,
they truncate a weight and give each token's natural weight too).

Each `score()` first takes the batch in the rule's precision (`Rule.at_precision`), then
computes the score in the space its definition uses (|dp| in probability space, icepop in
log space) or, for a preset with `preset_arith`, in its framework's arithmetic (ratio
space, exp(lp) - exp(lq), verl's clamps, AReaL's NaN handling). A two-sided band swept on
one side scores a token the fixed side masks as +inf and one the swept side cannot reach
(the wrong advantage sign) as -inf.
"""

from __future__ import annotations

import math

import numpy as np

from .base import (
    AREAL_FN,
    AT_LEAST_1,
    CLAMP,
    INF,
    POSITIVE,
    PRIME_LOSS,
    PRIME_LOSS_NOW,
    RATIO_HIGH,
    RATIO_LOW,
    SKYRL_OPC,
    SLIME_LOSS,
    SLIME_TIS,
    TRL_GRPO,
    UNIT,
    VERL_CORE,
    VERL_RC,
    Domain,
    Param,
    Rule,
    as_f64,
    band,
    binary_kl_prob,
    nan_to,
    reciprocal_spec,
    register,
    safe_log,
    select,
    tensor_log,
)

# How far a preset's arithmetic is from its stable form, on the coordinate of the quantity it
# thresholds (Rule.arith_margins; the fused path widens its windows by it): exp(l) against a
# bound B decides as l against log B except within a few ulps of it (pmath's exp is within 3
# ulps): 1e-9 relative plus FUZZY_RATIO; exp(lp) - exp(lq) is within ~2e-15 of the stable
# p - q (FUZZY_PROB); prime-rl's and AReaL's binary KL on clamped probabilities is the
# stable one but for 1 - p's rounding, within 4e-16 (|log c| + 1 + 1/c) of it (FUZZY_KL /
# c). tests/test_presets.py measures the last two on a million tokens.
FUZZY_RATIO = 1e-14
FUZZY_PROB = 1e-14
FUZZY_KL = 2e-14
RATIO_MARGIN = (1e-9, FUZZY_RATIO)
PROB_MARGIN = (0.0, FUZZY_PROB)
RATIO_CLAMP_OK = math.exp(19.9)  # exp(clip(l, -20, 20)) = exp(l) against bounds inside


def ratio_margin(rule: Rule, values) -> tuple[float, float] | None:
    """A ratio preset's margin (Rule.arith_margin), None for ratio-clamp where a bound (a
    swept value or a fixed side) lies outside (e^-19.9, e^19.9): the clamp decides there."""
    margin = type(rule).arith_margins.get(rule.arith)
    if margin is not None and rule.arith == "ratio-clamp":
        fixed = [getattr(rule, p) for p in type(rule).quantities]
        bounds = [float(x) for x in (*values, *fixed) if x]
        if any(not 1 / RATIO_CLAMP_OK < x < RATIO_CLAMP_OK for x in bounds):
            return None
    return margin


# ---- token rules, advantage-independent


@register
class IPO(Rule):
    name = "ipo"
    boundary = "band"
    label = "IPO"
    color = "#D55E00"  # Okabe-Ito vermillion
    title = "INTELLECT Policy Optimization"
    source = "prime-rl (IPO docs, 2026)"
    definition = "|p - q| > eps (strict; two-sided)"
    params = (Param("eps", "probability band half-width", "0.001:1:121:log"),)
    presets = {"prime-rl": {"eps": 0.3}, "prime-rl-legacy": {"eps": 0.1}}
    preset_notes = {
        "prime-rl": "IPOLoss: exp(max(lp, lq)) * -expm1(min - max) > eps, the stable form, "
        "in prime-rl's float32",
        "prime-rl-legacy": "ipo_loss_fn, prime-rl's IPO before 2026-09-18: "
        "|exp(lp) - exp(lq)| > 0.1",
    }
    preset_arith = {"prime-rl": "", "prime-rl-legacy": "prob"}
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS_NOW} IPOLoss.loss @ main",
        "prime-rl-legacy": f"{PRIME_LOSS} ipo_loss_fn @ 559b447 (ipo_threshold 0.1)",
    }
    quantities = {"eps": "|dp|"}
    arith_margins = {"prob": PROB_MARGIN}
    eps: float | None = 0.3

    def score(self, b, param):
        b = self.at_precision(b)
        if self.arith == "prob":
            return as_f64(np.abs(b.dp_prob))
        return as_f64(b.abs_dp)


@register
class IPOv1(Rule):
    primary = "high"
    name = "ipo-v1"
    boundary = "shift"
    label = "IPO-v1"
    color = "#E69F00"  # Okabe-Ito orange
    title = "early IPO, one threshold per side"
    source = "prime-rl (early IPO)"
    definition = "p - q > high or p - q < -low"
    params = (
        Param("low", "largest allowed drop of p below q", "0.001:1:121:log"),
        Param("high", "largest allowed rise of p above q", "0.001:1:121:log"),
    )
    presets = {"prime-rl-legacy": {"low": 0.2, "high": 0.2}}
    preset_notes = {"prime-rl-legacy": "exp(lp) - exp(lq) against both sides, as prime-rl did"}
    preset_arith = {"prime-rl-legacy": "prob"}
    preset_sources = {"prime-rl-legacy": f"{PRIME_LOSS} default_loss_fn @ 02bdca2"}
    quantities = {"low": "-dp", "high": "dp"}
    arith_margins = {"prob": PROB_MARGIN}
    low: float | None = 0.2
    high: float | None = 0.2

    def score(self, b, param):
        b = self.at_precision(b)
        dp = b.dp_prob if self.arith == "prob" else b.dp
        if param == "high":
            return select(dp < -self.low, INF, dp)
        return select(dp > self.high, INF, -dp)


@register
class IcePop(Rule):
    primary = "high"
    name = "icepop"
    boundary = "cone"
    label = "IcePop"
    color = "#0072B2"  # Okabe-Ito blue
    title = "IcePop ratio band"
    source = "Ring-1T, arXiv 2510.18855"
    definition = "r < low or r > high (band [low, high] kept, inclusive; tested in log space)"
    params = (
        Param("low", "lower ratio bound (kept if r >= low)", "0.01:0.99:121:log", domain=RATIO_LOW),
        Param(
            "high", "upper ratio bound (kept if r <= high)", "1.01:100:121:log", domain=RATIO_HIGH
        ),
    )
    presets = {
        "prime-rl": {"low": 0.2, "high": 5.0},
        "prime-rl-legacy": {"low": 0.2, "high": 5.0},
        "verl": {"low": 0.5, "high": 5.0},
        "areal": {"low": 0.5, "high": 5.0},
        "slime": {"low": 0.0, "high": 2.0},
        "paper": {"low": 0.5, "high": 5.0},
    }
    preset_notes = {
        "slime": "icepop_function: exp(l) kept in [tis_clip_low, tis_clip] (defaults 0 and 2), "
        "ratio space, unclamped",
        "prime-rl": "IcePopLoss: l < log(low) or l > log(high), the logs computed as tensors "
        "of the log-probs' dtype (log space, strict)",
        "prime-rl-legacy": "default_loss_fn before the 2026-09 refactor: exp(l) against "
        "[low, high] in ratio space",
        "verl": "exp(clip(l, -20, 20)) against [low, high] in ratio space",
        "areal": "exp(l) against [lower, upper] in ratio space (metric 'ratio')",
    }
    preset_arith = {
        "prime-rl": "log-tensor",
        "prime-rl-legacy": "ratio",
        "verl": "ratio-clamp",
        "areal": "ratio",
        "slime": "ratio",
    }
    precision_causes = {
        "areal": "its log ratio is float32 (.float() before the subtraction): a ratio within "
        "float32 rounding of a bound lands on it, and the band is inclusive",
    }
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS_NOW} IcePopLoss.loss @ main",
        "prime-rl-legacy": f"{PRIME_LOSS} default_loss_fn @ 3c3248d",
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (token) @ 7522bef",
        "areal": f"{AREAL_FN} apply_rejection_sampling",
        "slime": f"{SLIME_LOSS} icepop_function (line 908)",
    }
    quantities = {"low": "log r", "high": "log r"}
    arith_margins = {
        "ratio": RATIO_MARGIN,
        "ratio-clamp": RATIO_MARGIN,
        "log-tensor": RATIO_MARGIN,
    }
    low: float | None = 0.5
    high: float | None = 5.0

    def arith_margin(self, param, values):
        return ratio_margin(self, values)

    def threshold(self, param, value):
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            return float(value) if param == "high" else -float(value)
        if a == "verl-k1":  # keep iff log(1/high) <= -clip(l) <= log(1/low)
            if param == "high":
                return -safe_log(reciprocal_spec(value))
            return safe_log(reciprocal_spec(value))
        if a == "log-tensor":
            t = tensor_log(value, self.precision)
            return t if param == "high" else -t
        return safe_log(value) if param == "high" else -safe_log(value)

    def score(self, b, param):
        b = self.at_precision(b)
        a = self.arith
        if a == "log-tensor":  # strict on both sides, the bounds' logs in the dtype
            lo, hi = tensor_log(self.low, self.precision), tensor_log(self.high, self.precision)
            if param == "high":
                return select(b.l < lo, INF, b.l)
            return select(b.l > hi, INF, -b.l)
        if a in ("ratio", "ratio-clamp"):
            r = b.r if a == "ratio" else b.r_clamped
            return band(param, r, self.low, self.high)
        if a == "verl-k1":
            k1 = -b.lc
            if param == "high":  # masked iff k1 < log(lo): -k1 = lc > -log(lo)
                return select(k1 > safe_log(reciprocal_spec(self.low)), INF, b.lc)
            return select(k1 < safe_log(reciprocal_spec(self.high)), INF, k1)
        if param == "high":
            return select(b.l < safe_log(self.low), INF, b.l)
        return select(b.l > safe_log(self.high), INF, -b.l)


@register
class TokenMIS(IcePop):
    name = "token-mis"
    label = "token-MIS"
    color = "#56B4E9"  # Okabe-Ito sky blue
    title = "token-level importance-sampling rejection"
    source = "verl rollout correction / TRL"
    definition = "same test as icepop: r < low or r > high"
    presets = {
        "verl": {"low": 0.5, "high": 5.0},
        "trl": {"low": 0.5, "high": 2.0},
        "verl-k1": {"low": 1 / 1.6, "high": 1 / 0.6},
        "slime": {"low": 0.5, "high": 2.0},
        "skyrl": {"low": None, "high": None},
    }
    preset_notes = {
        "verl": "exp(clip(l, -20, 20)) against [low, high] in ratio space",
        "trl": "token_mask: exp(l) against [C_min, C_max] in ratio space (TRL's docs' example)",
        "verl-k1": "verl's token_k1 rejection at its own example threshold '0.6_1.6'",
        "slime": "compute_mis_weights, rs_level token (mis.yaml: rs bounds = tis bounds 0.5 "
        "and 2.0): exp(clip(l, -20, 20)) kept in [low, high]",
        "skyrl": "compute_token_mask: exp(clip(l, -20, 20)) (safe_exp_delta, float32) kept in "
        "[low, high]; SkyRL's token_mask_is_threshold_low/high default to None: give both",
    }
    preset_quirks = {
        "verl-k1": "verl's *_k1 rejection with a 'lo_hi' threshold keeps 1/hi <= r <= 1/lo: "
        "its example '0.6_1.6' keeps r in [0.625, 1.667], not [0.6, 1.6]; this preset "
        "follows the code. For another 'lo_hi' use token-mis@verl-k1:low=1/hi,high=1/lo.",
    }
    preset_arith = {
        "verl": "ratio-clamp",
        "trl": "ratio",
        "verl-k1": "verl-k1",
        "slime": "ratio-clamp",
        "skyrl": "ratio-clamp",
    }
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (token) @ 7522bef",
        "trl": f"{TRL_GRPO} token_mask",
        "slime": f"{SLIME_TIS} compute_mis_weights (rs_level token, mask())",
        "skyrl": f"{SKYRL_OPC} compute_token_mask",
        "verl-k1": f"{VERL_RC} compute_rollout_rejection_mask (token_k1) @ b178a3c",
    }
    low: float | None = 0.5
    high: float | None = 5.0


@register
class KPop(Rule):
    name = "kpop"
    boundary = "bkl"
    label = "KPop"
    color = "#009E73"  # Okabe-Ito bluish green
    title = "KPop binary-KL mask"
    source = "Ant Group, 2026"
    definition = "max(BKL(p||q), BKL(q||p)) > phi, probabilities clamped to [clamp, 1-clamp]"
    params = (
        Param("phi", "binary-KL threshold (nats)", "0.0001:10:121:log"),
        Param("clamp", "probability clamp c", "1e-8,1e-6,1e-4", threshold=False, domain=CLAMP),
    )
    presets = {
        "prime-rl": {"phi": 0.1, "clamp": 1e-6},
        "paper": {"phi": 0.1, "clamp": 1e-6},
        "areal": {"phi": 2.0, "clamp": 1e-8},
    }
    preset_notes = {
        "prime-rl": "p, q = clamp(exp(lp|lq), c, 1-c); masked iff BKL(p||q) > phi or "
        "BKL(q||p) > phi (a NaN side is not masked)",
        "areal": "metric 'binary_kl': p, q = clamp(exp(.), 1e-8, 1 - 1e-8); masked unless "
        "max(BKL) <= upper, so a NaN is masked (in float32, p = 1 gives NaN: 1 - 1e-8 rounds "
        "to 1). AReaL's own config validation rejects metric='binary_kl' (not in "
        "_VALID_METRICS) although its docs, help text and example list it",
    }
    preset_arith = {"prime-rl": "prime-rl", "areal": "areal"}
    precision_causes = {
        "areal": "its clamp 1 - 1e-8 is 1.0 in float32: a token with p or q = 1 gives "
        "0 * log(0) = NaN, and AReaL masks NaN",
    }
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS} kpop_loss_fn @ b9ba060 (branch feat/kpop-loss)",
        "areal": f"{AREAL_FN} compute_binary_kl_divergence, apply_rejection_sampling",
    }
    quantities = {"phi": "bkl"}
    arith_margins = {"prime-rl": (0.0, FUZZY_KL), "areal": (0.0, FUZZY_KL)}  # / clamp
    phi: float | None = 0.1
    clamp: float | None = 1e-6

    def arith_margin(self, param, values):
        m = super().arith_margin(param, values)
        return None if m is None or not self.clamp else (m[0], m[1] / self.clamp)

    def score(self, b, param):
        b = self.at_precision(b)
        X = b.X
        if self.arith in ("prime-rl", "areal"):
            c = self.clamp
            p = np.clip(b.p, c, 1.0 - c)
            q = np.clip(b.q, c, 1.0 - c)
            fwd = binary_kl_prob(p, q, X)
            rev = binary_kl_prob(q, p, X)
            if self.arith == "prime-rl":  # fwd > phi | rev > phi: a NaN side never masks
                return as_f64(nan_to(np.fmax(fwd, rev), -INF))
            return as_f64(nan_to(np.maximum(fwd, rev), INF))  # not (max <= upper)
        return as_f64(nan_to(b.bkl(self.clamp), -INF))


@register
class TokenK2(Rule):
    name = "token-k2"
    color = "#999933"  # Tol olive
    title = "token k2 rejection"
    source = "verl rollout correction"
    definition = "k2 = l^2/2 > hi"
    params = (Param("hi", "k2 threshold", "0.0001:10:121:log"),)
    presets = {"verl": {}}
    preset_notes = {"verl": "token_k2: l clamped to +-20 first (k2 <= 200); no default hi"}
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_RC} compute_rollout_rejection_mask (token_k2) @ b178a3c"}
    quantities = {"hi": "k2"}
    hi: float | None = None

    def score(self, b, param):
        b = self.at_precision(b)
        return as_f64(b.k2_verl if self.arith == "verl" else b.k2)


@register
class TokenK3(Rule):
    name = "token-k3"
    color = "#332288"  # Tol indigo
    title = "token k3 rejection"
    source = "verl rollout correction"
    definition = "k3 = r - 1 - l > hi"
    params = (Param("hi", "k3 threshold", "0.0001:10:121:log"),)
    presets = {"verl": {}}
    preset_notes = {"verl": "token_k3: exp(lc) - 1 - lc with lc = clip(l, -20, 20); no default hi"}
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_RC} compute_rollout_rejection_mask (token_k3) @ b178a3c"}
    quantities = {"hi": "k3"}
    hi: float | None = None

    def score(self, b, param):
        b = self.at_precision(b)
        return as_f64(b.k3_verl if self.arith == "verl" else b.k3)


# ---- token rules, advantage-dependent


@register
class DPPOTV(Rule):
    primary = "high"
    name = "dppo-tv"
    boundary = "shift"
    label = "DPPO-TV"
    color = "#CC79A7"  # Okabe-Ito reddish purple
    title = "DPPO binary total variation"
    source = "arXiv 2602.04879"
    definition = "A > 0 and p - q > high, or A <= 0 and p - q < -low"
    needs = ("advantage",)
    params = (
        Param("low", "allowed drop when A <= 0", "0.001:1:121:log"),
        Param("high", "allowed rise when A > 0", "0.001:1:121:log"),
    )
    presets = {"prime-rl": {"low": 0.2, "high": 0.2}, "verl": {"low": 0.15, "high": 0.15}}
    preset_notes = {
        "prime-rl": "A == 0 goes to the low side, as prime-rl's code does; exp(lp) - exp(lq)",
        "verl": "A <= 0 on the low side (torch.where(A > 0, ...)); exp(lp) - exp(lq)",
    }
    preset_arith = {"prime-rl": "prob", "verl": "prob"}
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS} default_loss_fn @ 559b447",
        "verl": f"{VERL_CORE} compute_policy_loss_dppo_tv @ 1dda039",
    }
    quantities = {"low": "-dp", "high": "dp"}
    arith_margins = {"prob": PROB_MARGIN}
    low: float | None = 0.2
    high: float | None = 0.2

    def score(self, b, param):
        b = self.at_precision(b)
        a = b.adv(self.name)
        dp = b.dp_prob if self.arith == "prob" else b.dp
        if param == "high":
            return select((a <= 0) & (dp < -self.low), INF, select(a > 0, dp, -INF))
        return select((a > 0) & (dp > self.high), INF, select(a <= 0, -dp, -INF))


@register
class DPPOKL(Rule):
    primary = "high"
    name = "dppo-kl"
    label = "DPPO-KL"
    color = "#AA4499"  # Tol purple
    title = "DPPO binary KL"
    source = "arXiv 2602.04879"
    definition = "A > 0 and p > q and BKL(q||p) > high, or A < 0 and p < q and BKL(q||p) > low"
    needs = ("advantage",)
    params = (
        Param("low", "binary-KL threshold when A < 0", "0.0001:10:121:log"),
        Param("high", "binary-KL threshold when A > 0", "0.0001:10:121:log"),
        Param(
            "clamp",
            "probability clamp c (0: unclamped, verl's +1e-8 form)",
            "1e-8,1e-6,1e-4",
            threshold=False,
            domain=Domain(0.0, 0.5, hi_open=True),
        ),
    )
    presets = {"verl": {"low": 0.05, "high": 0.05, "clamp": 0.0}}
    preset_notes = {
        "verl": "verl's code: A <= 0 (A == 0 too) goes to the low-side test, and its binary "
        "KL is q (lq - lp) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)), unclamped "
        "(clamp 0), with p > q and p < q compared as probabilities",
    }
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_CORE} compute_policy_loss_dppo_kl @ 1dda039"}
    quantities = {"low": "bkl(q||p)", "high": "bkl(q||p)"}
    low: float | None = 0.05
    high: float | None = 0.05
    clamp: float | None = 1e-6

    def _verl(self, b):
        p, q = b.p, b.q
        with np.errstate(divide="ignore", invalid="ignore"):
            bkl = q * (b.lq - b.lp) + (1.0 - q) * b.X.log(((1.0 - q) + 1e-8) / ((1.0 - p) + 1e-8))
        # verl keeps a token iff bkl <= bound | p <= q (resp. p >= q): a NaN bkl fails
        return nan_to(bkl, INF), p > q, p < q

    def score(self, b, param):
        b = self.at_precision(b)
        a = b.adv(self.name)
        if self.arith == "verl":
            bkl, rise, drop = self._verl(b)
            up = (a > 0) & rise
            down = (a <= 0) & drop
        else:
            bkl = nan_to(b.bkl_qp(self.clamp), -INF)
            up = (a > 0) & (b.l > 0)
            down = (a < 0) & (b.l < 0)
        if param == "high":
            return select(down & (bkl > self.low), INF, select(up, bkl, -INF))
        return select(up & (bkl > self.high), INF, select(down, bkl, -INF))


@register
class PPOClip(Rule):
    primary = "eps_high"
    name = "ppo-clip"
    label = "PPO-clip"
    color = "#117733"  # Tol green
    title = "PPO clip (zero-gradient tokens)"
    source = "Schulman et al. 2017; DAPO"
    definition = "A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low"
    needs = ("advantage",)
    params = (
        Param("eps_low", "lower clip 1 - eps_low", "0.001:0.999:121:log", domain=UNIT),
        Param("eps_high", "upper clip 1 + eps_high", "0.001:10:121:log"),
    )
    presets = {
        "paper": {"eps_low": 0.2, "eps_high": 0.2},
        "dapo": {"eps_low": 0.2, "eps_high": 0.28},
        "prime-rl": {"eps_low": 0.2, "eps_high": 0.2},
    }
    # r = exp(l) against 1 - eps_low and 1 + eps_high in ratio space, as every trainer's
    # loss compares it (a tie at r = 0.7999999999999999 is clipped)
    preset_arith = {"paper": "ratio", "dapo": "ratio", "prime-rl": "log-tensor"}
    preset_notes = {
        "prime-rl": "PPOLoss's is_clipped: A > 0 and l > log(1.2), or A < 0 and l < log(0.8), "
        "the logs as tensors of the log-probs' dtype",
        "paper": "exp(clip(l, -20, 20)) against [1 - eps_low, 1 + eps_high] in ratio space, "
        "as verl's compute_policy_loss_vanilla",
        "dapo": "exp(clip(l, -20, 20)) against [0.8, 1.28] in ratio space (DAPO's "
        "clip-higher, verl's compute_policy_loss_vanilla)",
    }
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS_NOW} PPOLoss.loss @ main",
        "paper": f"{VERL_CORE} compute_policy_loss_vanilla @ b178a3c",
        "dapo": f"{VERL_CORE} compute_policy_loss_vanilla @ b178a3c (clip_ratio_high 0.28)",
    }
    quantities = {"eps_low": "1-r", "eps_high": "r-1"}
    arith_margins = {"ratio": RATIO_MARGIN, "log-tensor": RATIO_MARGIN}
    eps_low: float | None = 0.2
    eps_high: float | None = 0.2

    def _extra(self, b, a):
        return np.zeros(len(b), dtype=bool)

    def threshold(self, param, value):
        if self.arith == "log-tensor":  # on l: log(1 + eps_high), -log(1 - eps_low)
            if param == "eps_high":
                return tensor_log(1.0 + value, self.precision)
            return -tensor_log(1.0 - value, self.precision)
        return 1.0 + value if param == "eps_high" else value - 1.0

    def score(self, b, param):
        b = self.at_precision(b)
        a = b.adv(self.name)
        if self.arith == "log-tensor":  # prime-rl's PPOLoss: the log ratio, strict
            hi = tensor_log(1.0 + self.eps_high, self.precision)
            lo = tensor_log(1.0 - self.eps_low, self.precision)
            up = (a > 0) & (b.l > hi)
            down = (a < 0) & (b.l < lo)
            if param == "eps_high":
                return select(down, INF, select(a > 0, b.l, -INF))
            return select(up, INF, select(a < 0, -b.l, -INF))
        r = b.r
        up = (a > 0) & (r > 1.0 + self.eps_high)
        down = (a < 0) & (r < 1.0 - self.eps_low)
        extra = self._extra(b, a)
        if param == "eps_high":
            return select(down | extra, INF, select(a > 0, r, -INF))
        if param == "eps_low":
            return select(up | extra, INF, select(a < 0, -r, -INF))
        return select(up | down, INF, select(a < 0, r, -INF))  # dual-clip's c


@register
class DualClip(PPOClip):
    name = "dual-clip"
    color = "#882255"  # Tol wine
    title = "dual-clip PPO"
    source = "Ye et al. 2020"
    definition = "ppo-clip, plus A < 0 and r > c"
    params = (
        *PPOClip.params,
        Param("c", "dual-clip bound for A < 0", "1.01:100:121:log", domain=AT_LEAST_1),
    )
    presets = {"paper": {"eps_low": 0.2, "eps_high": 0.2, "c": 3.0}}
    preset_arith = {"paper": "ratio"}
    preset_notes = {
        "paper": "exp(clip(l, -20, 20)) against the bounds and c in ratio space, as verl's "
        "compute_policy_loss_vanilla (clip_ratio_c 3)",
    }
    preset_sources = {"paper": f"{VERL_CORE} compute_policy_loss_vanilla @ b178a3c"}
    quantities = {"eps_low": "1-r", "eps_high": "r-1", "c": "r"}
    eps_low: float | None = 0.2
    eps_high: float | None = 0.2
    c: float | None = 3.0

    def _extra(self, b, a):
        return (a < 0) & (b.r > self.c)

    def threshold(self, param, value):
        return float(value) if param == "c" else super().threshold(param, value)


# ---- weight rules


@register
class TIS(Rule):
    name = "tis"
    label = "TIS"
    color = "#000000"  # Okabe-Ito black
    title = "truncated importance sampling"
    source = "verl / TIS paper; TRL"
    definition = "weight min(r, cap), detached; truncated when r > cap"
    kind = "weight"
    params = (Param("cap", "weight cap", "1.01:100:121:log", domain=POSITIVE),)
    presets = {
        "verl": {"cap": 2.0},
        "paper": {"cap": 2.0},
        "trl": {"cap": 3.0},
        "slime": {"cap": 2.0},
        "skyrl": {"cap": 2.0},
    }
    preset_notes = {
        "verl": "exp(clip(l, -20, 20)) > cap, in ratio space",
        "trl": "token_truncate: exp(l) > C_max, in ratio space",
        "slime": "vanilla_tis_function: exp(l) clamped to [tis_clip_low, tis_clip] (0, 2), "
        "truncated where the clamp changes it (exp(l) > 2), unclamped l",
        "skyrl": "compute_tis_ratio (token): exp(clip(l, -20, 20)) > token_tis_ratio_clip_high",
    }
    preset_arith = {"verl": "ratio-clamp", "trl": "ratio", "slime": "ratio", "skyrl": "ratio-clamp"}
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_correction_weights (token) @ b178a3c",
        "trl": f"{TRL_GRPO} token_truncate",
        "slime": f"{SLIME_LOSS} vanilla_tis_function (line 884)",
        "skyrl": f"{SKYRL_OPC} compute_tis_ratio (token)",
    }
    quantities = {"cap": "log r"}
    arith_margins = {"ratio": RATIO_MARGIN, "ratio-clamp": RATIO_MARGIN}
    cap: float | None = 2.0

    def arith_margin(self, param, values):
        return ratio_margin(self, values)

    def threshold(self, param, value):
        return float(value) if self.arith else safe_log(value)

    def score(self, b, param):
        b = self.at_precision(b)
        if self.arith == "ratio":
            return as_f64(b.r)
        if self.arith == "ratio-clamp":
            return as_f64(b.r_clamped)
        return as_f64(b.l)

    def weight(self, b, param):
        return as_f64(b.r_clamped)


@register
class CISPO(Rule):
    primary = "high"
    name = "cispo"
    label = "CISPO"
    color = "#777777"  # Tol grey
    title = "CISPO clipped IS weight"
    source = "MiniMax-M1"
    definition = "weight clip(r, low, high), detached; truncated when r < low or r > high"
    kind = "weight"
    params = (
        Param("low", "lower weight clip (0 = off)", "0.01:0.99:121:log", domain=RATIO_LOW),
        Param("high", "upper weight clip", "1.01:100:121:log", domain=RATIO_HIGH),
    )
    presets = {"prime-rl": {"low": 0.0, "high": 5.0}}
    preset_notes = {"prime-rl": "prime-rl clips CISPO weights above only (low off), exp(l) > high"}
    preset_arith = {"prime-rl": "ratio"}
    preset_sources = {"prime-rl": f"{PRIME_LOSS} compute_loss (is_clipped) @ ce50092"}
    quantities = {"low": "log r", "high": "log r"}
    arith_margins = {"ratio": RATIO_MARGIN}
    low: float | None = 0.0
    high: float | None = 5.0

    def arith_margin(self, param, values):
        return ratio_margin(self, values)

    def threshold(self, param, value):
        if self.arith == "ratio":
            return float(value) if param == "high" else -float(value)
        return safe_log(value) if param == "high" else -safe_log(value)

    def score(self, b, param):
        b = self.at_precision(b)
        if self.arith == "ratio":
            return band(param, b.r, self.low, self.high)
        if param == "high":
            return select(b.l < safe_log(self.low), INF, b.l)
        return select(b.l > safe_log(self.high), INF, -b.l)

    def weight(self, b, param):
        if param == "high":
            return select(b.l < safe_log(self.low), self.low, b.r_clamped)
        return select(b.l > safe_log(self.high), self.high, b.r_clamped)
