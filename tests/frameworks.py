"""Each preset's decision as its framework's code computes it, re-derived in torch.

Written from the frameworks' source (file and commit named per function), not from
mismatch_replay: nothing here imports the rules or the engine. Each function takes the loss
tokens of a log (`Log`, in file order), the rule's values (the preset's, or overridden) and a
torch dtype, and returns, per loss token, whether the framework masks it (for weight rules:
whether its weight is truncated). torch runs the arithmetic, as in the frameworks: ratio-space
comparisons exp(l) against a bound, exp(lp) - exp(lq), clamps, the +1e-8 terms, which side
A == 0 takes, NaN in comparisons, and float32 when dtype=torch.float32 (the log-probs rounded
to float32 first, as the frameworks hold them; Python floats compared with a float32 tensor
are rounded to float32 by torch, as on the GPU).

Two deliberate departures, both documented in docs/presets.md:
- dtype float64 replaces every dtype a framework sets explicitly (SkyRL's safe_exp_delta
  casts to float32, AReaL upcasts with .float()): "float64" replays the framework's formula
  in float64; `dtype=torch.float32` replays it as the GPU runs it.
- Sequences: the frameworks hold a (batch, seq) tensor with a response mask; `Log` pads each
  sequence (step, sample_id) of loss tokens into such a tensor, so masked sums, means and
  maxima are taken exactly as there (torch's own summation order included).

verl 1dda039 (named by issue 17 for compute_policy_loss_dppo_{tv,kl}) is not in the mirror
available here (its newest snapshot, b178a3c, predates DPPO); those two functions follow
core_algos.py as copied in indexed forks of verl at a DPPO-era commit, which agree with the
issue's description (A == 0 to the low side; unclamped binary KL with +1e-8).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import polars as pl
import torch

SAFETY_BOUND = 20.0  # verl's SAFETY_BOUND / SkyRL's clip / verl core_algos' clamp


class Log:
    """The loss tokens of a canonical log, in file order, and their sequences padded."""

    def __init__(self, df: pl.DataFrame):
        if "loss_mask" in df.columns:
            df = df.filter(pl.col("loss_mask"))
        if "step" not in df.columns:
            df = df.with_columns(step=pl.lit(0, pl.Int64))
        self.df = df
        self.n = df.height
        self.lp = df["trainer_logprob"].to_numpy().astype(np.float64)
        self.lq = df["inference_logprob"].to_numpy().astype(np.float64)
        self.adv = (
            df["advantage"].to_numpy().astype(np.float64) if "advantage" in df.columns else None
        )
        self.step = df["step"].to_numpy()
        if "sample_id" in df.columns:
            keys = list(zip(df["step"].to_list(), df["sample_id"].to_list(), strict=True))
            ids: dict = {}
            self.seq = np.array([ids.setdefault(k, len(ids)) for k in keys], dtype=np.int64)
            self.n_seq = len(ids)
            counts = np.bincount(self.seq, minlength=self.n_seq)
            self.width = int(counts.max()) if self.n_seq else 0
            order = np.argsort(self.seq, kind="stable")
            pos = np.empty(self.n, dtype=np.int64)
            starts = np.r_[0, np.cumsum(counts)[:-1]]
            pos[order] = np.arange(self.n) - np.repeat(starts, counts)
            self.pos = pos
        else:
            self.seq = None

    def t(self, x: np.ndarray, dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float64).to(dtype)

    def pad(self, x: np.ndarray, dtype, fill: float = 0.0) -> torch.Tensor:
        """Per-token values -> (sequences, longest) with `fill` in the padding."""
        out = torch.full((self.n_seq, self.width), fill, dtype=torch.float64)
        out[torch.tensor(self.seq), torch.tensor(self.pos)] = torch.tensor(x, dtype=torch.float64)
        return out.to(dtype)

    def mask(self) -> torch.Tensor:
        """The response mask, int64 as verl's attention-derived masks are."""
        m = torch.zeros((self.n_seq, self.width), dtype=torch.int64)
        m[torch.tensor(self.seq), torch.tensor(self.pos)] = 1
        return m

    def unpad(self, per_seq: torch.Tensor) -> np.ndarray:
        """A per-sequence decision (sequences,) or (sequences, 1) -> per token."""
        return per_seq.reshape(-1).cpu().numpy().astype(bool)[self.seq]

    def seq_adv(self) -> np.ndarray:
        """The sequence's advantage (the tests broadcast one per sequence): its first token's."""
        first = np.full(self.n_seq, np.nan)
        for i in range(self.n - 1, -1, -1):
            first[self.seq[i]] = self.adv[i]
        return first


def _np(x: torch.Tensor) -> np.ndarray:
    return x.cpu().numpy().astype(bool)


# ----------------------------------------------------------------------------- prime-rl
# prime-rl src/prime_rl/trainer/rl/loss.py


def prime_ipo(L: Log, v: dict, dt) -> np.ndarray:
    """ipo_loss_fn @ 559b447: is_masked = |exp(lp) - exp(lq)| > ipo_threshold."""
    diff = torch.abs(torch.exp(L.t(L.lp, dt)) - torch.exp(L.t(L.lq, dt)))
    return _np(diff > v["eps"])


def prime_ipo_v1(L: Log, v: dict, dt) -> np.ndarray:
    """default_loss_fn @ 02bdca2: probs_diff > ipo_mask_high or < -ipo_mask_low."""
    diff = torch.exp(L.t(L.lp, dt)) - torch.exp(L.t(L.lq, dt))
    return _np((diff > v["high"]) | (diff < -v["low"]))


def prime_icepop(L: Log, v: dict, dt) -> np.ndarray:
    """default_loss_fn @ 3c3248d: ratio = exp(lp - lq); in_range = low <= ratio <= high."""
    ratio = torch.exp(L.t(L.lp, dt) - L.t(L.lq, dt))
    return _np(~((ratio >= v["low"]) & (ratio <= v["high"])))


# prime-rl's loss module after its 2026-09 refactor (IPOLoss, IcePopLoss, PPOLoss), read in
# the public code index (src/prime_rl/trainer/rl/loss.py; that commit is not in the mirror)


def _prime_log_bound(value: float, dt) -> torch.Tensor:
    """log_importance_ratio.new_tensor(value).log(): the bound in the tensor's dtype."""
    return torch.tensor(value, dtype=dt).log()


def prime_ipo_now(L: Log, v: dict, dt) -> np.ndarray:
    """IPOLoss.loss: abs_probs_diff = exp(max(lp, lq)) * -expm1(min - max); masked iff
    abs_probs_diff > eps."""
    lp, lq = L.t(L.lp, dt), L.t(L.lq, dt)
    hi, lo = torch.maximum(lp, lq), torch.minimum(lp, lq)
    return _np(torch.exp(hi) * -torch.expm1(lo - hi) > v["eps"])


def prime_icepop_now(L: Log, v: dict, dt) -> np.ndarray:
    """IcePopLoss.loss: masked iff l < log(ratio_low) or l > log(ratio_high), the logs of
    tensors of l's dtype."""
    lr = L.t(L.lp, dt) - L.t(L.lq, dt)
    return _np((lr < _prime_log_bound(v["low"], dt)) | (lr > _prime_log_bound(v["high"], dt)))


def prime_ppo_now(L: Log, v: dict, dt) -> np.ndarray:
    """PPOLoss.loss's `clipped`: (A > 0 and l > log(ratio_high)) or (A < 0 and l <
    log(ratio_low)); ratio_low = 1 - eps_low, ratio_high = 1 + eps_high."""
    lr = L.t(L.lp, dt) - L.t(L.lq, dt)
    a = L.t(L.adv, dt)
    hi = _prime_log_bound(1.0 + v["eps_high"], dt)
    lo = _prime_log_bound(1.0 - v["eps_low"], dt)
    return _np(((a > 0) & (lr > hi)) | ((a < 0) & (lr < lo)))


def prime_kpop(L: Log, v: dict, dt) -> np.ndarray:
    """kpop_loss_fn @ b9ba060: probabilities clamped to [1e-6, 1 - 1e-6], then
    p log(p/q) + (1 - p) log((1 - p)/(1 - q)) both ways; masked iff either > threshold."""
    eps = v["clamp"]
    p = torch.exp(L.t(L.lp, dt)).clamp(min=eps, max=1 - eps)
    q = torch.exp(L.t(L.lq, dt)).clamp(min=eps, max=1 - eps)

    def bkl(a, b):
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    return _np((bkl(p, q) > v["phi"]) | (bkl(q, p) > v["phi"]))


def prime_dppo_tv(L: Log, v: dict, dt) -> np.ndarray:
    """default_loss_fn @ 559b447: where(A > 0, probs_diff > high, probs_diff < -low)."""
    diff = torch.exp(L.t(L.lp, dt)) - torch.exp(L.t(L.lq, dt))
    a = L.t(L.adv, dt)
    return _np(torch.where(a > 0, diff > v["high"], diff < -v["low"]))


def prime_cispo(L: Log, v: dict, dt) -> np.ndarray:
    """compute_loss @ ce50092: is_clipped = importance_ratio > clip_ratio (no lower clip)."""
    ratio = torch.exp(L.t(L.lp, dt) - L.t(L.lq, dt))
    return _np(ratio > v["high"])


def prime_geo(L: Log, v: dict, dt) -> np.ndarray:
    """compute_loss @ 5f47740: geo_seq_ratio = exp(_safe_mean(l, mask)) per sample
    (sum / clamp_min(count, 1)); masked iff < geo_mask_low or > geo_mask_high."""
    lr = L.pad(L.lp - L.lq, dt)
    m = L.mask().bool()
    mean = torch.where(m, lr, torch.zeros_like(lr)).sum(-1) / torch.clamp_min(m.sum(-1), 1)
    geo = torch.exp(mean)
    return L.unpad((geo < v["low"]) | (geo > v["high"]))


# ----------------------------------------------------------------------------- verl


def _verl_log_ratio(L: Log, dt):
    return L.t(L.lp, dt) - L.t(L.lq, dt)


def verl_token_rs(L: Log, v: dict, dt) -> np.ndarray:
    """rollout_corr_helper.py compute_rollout_rejection_mask(rollout_rs="token") @ 7522bef
    (and the IcePop IS weights of 'lo_hi' rollout_is_threshold later): weights
    exp(clamp(l, -20, 20)) kept iff lower <= w <= upper."""
    w = torch.exp(torch.clamp(_verl_log_ratio(L, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND))
    return _np(~((w >= v["low"]) & (w <= v["high"])))


def _verl_k1_spec(v: dict) -> tuple[float, float]:
    """The 'lo_hi' spec verl is given: the preset stores the ratio bounds it keeps."""
    return v["_spec"]


def verl_token_k1(L: Log, v: dict, dt) -> np.ndarray:
    """compute_rollout_rejection_mask(rollout_rs="token_k1") @ b178a3c: token_k1 =
    -clamp(l, -20, 20); keep iff log(lo) <= k1 <= log(hi) for the spec 'lo_hi'."""
    lo, hi = _verl_k1_spec(v)
    k1 = -torch.clamp(_verl_log_ratio(L, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return _np(~((k1 >= math.log(lo)) & (k1 <= math.log(hi))))


def verl_token_k2(L: Log, v: dict, dt) -> np.ndarray:
    """token_k2 @ b178a3c: 0.5 * clamp(l)**2 <= upper kept."""
    lc = torch.clamp(_verl_log_ratio(L, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return _np(~(0.5 * lc**2 <= v["hi"]))


def verl_token_k3(L: Log, v: dict, dt) -> np.ndarray:
    """token_k3 @ b178a3c: exp(lc) - 1.0 - lc <= upper kept."""
    lc = torch.clamp(_verl_log_ratio(L, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return _np(~(torch.exp(lc) - 1.0 - lc <= v["hi"]))


def _verl_seq(L: Log, dt, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's per-sequence statistic of clamped k1/k2/k3, with verl_F.masked_sum / mean."""
    lc = torch.clamp(L.pad(L.lp - L.lq, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    mask = L.mask()
    token = {"k1": -lc, "k2": 0.5 * lc**2, "k3": torch.exp(lc) - 1.0 - lc}
    return token, mask


def _masked_sum(values, mask, axis=-1):
    """verl_F.masked_sum: values where mask, zeros elsewhere (NaN outside masked away)."""
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (valid * mask).sum(axis)


def _masked_mean(values, mask, axis=-1):
    """verl_F.masked_mean: masked_sum / (mask.sum(axis) + 1e-8) (an int mask: the
    denominator is float32, in which n + 1e-8 rounds to n)."""
    return _masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def verl_seq_sum_k1(L: Log, v: dict, dt) -> np.ndarray:
    """seq_sum_k1 @ b178a3c: keep iff log(lo) <= masked_sum(-clamp(l)) <= log(hi)."""
    lo, hi = _verl_k1_spec(v)
    token, mask = _verl_seq(L, dt, "k1")
    s = _masked_sum(token["k1"], mask)
    return L.unpad(~((s >= math.log(lo)) & (s <= math.log(hi))))


def verl_seq_mean_k1(L: Log, v: dict, dt) -> np.ndarray:
    """seq_mean_k1 @ b178a3c: keep iff log(lo) <= masked_mean(-clamp(l)) <= log(hi)."""
    lo, hi = _verl_k1_spec(v)
    token, mask = _verl_seq(L, dt, "k1")
    s = _masked_mean(token["k1"], mask)
    return L.unpad(~((s >= math.log(lo)) & (s <= math.log(hi))))


def verl_seq_mean_k3(L: Log, v: dict, dt) -> np.ndarray:
    """seq_mean_k3 @ b178a3c: keep iff masked_mean(exp(lc) - 1 - lc) <= upper."""
    token, mask = _verl_seq(L, dt, "k3")
    return L.unpad(~(_masked_mean(token["k3"], mask) <= v["hi"]))


def verl_seq_max_k2(L: Log, v: dict, dt) -> np.ndarray:
    """seq_max_k2 @ b178a3c: max over the mask of 0.5 clamp(l)^2 (-inf padding), <= upper."""
    token, mask = _verl_seq(L, dt, "k2")
    vals = token["k2"].masked_fill(~mask.bool(), float("-inf"))
    mx = vals.max(dim=-1).values
    return L.unpad(~(mx <= v["hi"]))


def verl_tis(L: Log, v: dict, dt) -> np.ndarray:
    """compute_rollout_correction_weights(rollout_is="token") @ b178a3c: weights
    exp(clamp(l)) clamped at max=threshold: truncated iff weight > threshold."""
    w = torch.exp(torch.clamp(_verl_log_ratio(L, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND))
    return _np(w > v["cap"])


def verl_seq_tis(L: Log, v: dict, dt) -> np.ndarray:
    """rollout_is="sequence" @ b178a3c: exp(clamp(masked_sum(l), -20, 20)) > threshold."""
    s = _masked_sum(L.pad(L.lp - L.lq, dt), L.mask())
    w = torch.exp(torch.clamp(s, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    return L.unpad(w > v["cap"])


def verl_ppo(L: Log, v: dict, dt) -> np.ndarray:
    """core_algos.py compute_policy_loss_vanilla @ b178a3c: ratio = exp(clamp(l, -20, 20));
    pg_losses1 = -A ratio, pg_losses2 = -A clamp(ratio, 1 - low, 1 + high); a token's
    gradient is clipped where pg_losses2 > pg_losses1 (its pg_clipfrac), and, with
    clip_ratio_c, where A < 0 and max(pg_losses1, pg_losses2) > -A c (pg_clipfrac_lower)."""
    ratio = torch.exp(torch.clamp(_verl_log_ratio(L, dt), min=-SAFETY_BOUND, max=SAFETY_BOUND))
    a = L.t(L.adv, dt)
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, 1 - v["eps_low"], 1 + v["eps_high"])
    clipped = torch.gt(pg2, pg1)
    if "c" in v:
        lower = torch.gt(torch.maximum(pg1, pg2), -a * v["c"]) & (a < 0)
        clipped = clipped | lower
    return _np(clipped)


def verl_dppo_tv(L: Log, v: dict, dt) -> np.ndarray:
    """core_algos.py compute_policy_loss_dppo_tv @ 1dda039: valid = where(A > 0,
    prob - old_prob <= high, prob - old_prob >= -low); the rest masked."""
    prob, old = torch.exp(L.t(L.lp, dt)), torch.exp(L.t(L.lq, dt))
    a = L.t(L.adv, dt)
    valid = torch.where(a > 0, (prob - old) <= v["high"], (prob - old) >= -v["low"])
    return _np(~valid)


def verl_dppo_kl(L: Log, v: dict, dt) -> np.ndarray:
    """compute_policy_loss_dppo_kl @ 1dda039: binary_kl = old_prob (old_lp - lp) +
    (1 - old_prob) log((1 - old_prob + 1e-8) / (1 - prob + 1e-8)); valid = where(A > 0,
    bkl <= high | prob <= old_prob, bkl <= low | prob >= old_prob)."""
    lp, old_lp = L.t(L.lp, dt), L.t(L.lq, dt)
    prob, old = torch.exp(lp), torch.exp(old_lp)
    bkl = old * (old_lp - lp) + (1 - old) * torch.log((1.0 - old + 1e-8) / (1.0 - prob + 1e-8))
    a = L.t(L.adv, dt)
    pos = (bkl <= v["high"]) | (prob <= old)
    neg = (bkl <= v["low"]) | (prob >= old)
    return _np(~torch.where(a > 0, pos, neg))


# ----------------------------------------------------------------------------- AReaL
# areal-project/AReaL @ cbff54d


def areal_ratio(L: Log, v: dict, dt) -> np.ndarray:
    """functional.py apply_rejection_sampling, metric 'ratio', level token, action mask:
    log_ratio = proximal - old (non-finite -> 0), metric = exp(log_ratio),
    in_bounds = lower <= metric <= upper."""
    lr = L.t(L.lp, dt) - L.t(L.lq, dt)
    lr = torch.where(torch.isfinite(lr), lr, 0.0)
    m = torch.exp(lr)
    return _np(~((m >= v["low"]) & (m <= v["high"])))


def areal_binary_kl(L: Log, v: dict, dt) -> np.ndarray:
    """metric 'binary_kl': compute_binary_kl_divergence(log_p, log_q, eps=1e-8) both ways
    (p, q = clamp(exp(.), eps, 1 - eps); p log(p/q) + (1 - p) log((1 - p)/(1 - q))),
    metric = maximum(fwd, rev) (NaN propagates), in_bounds = metric <= upper."""
    lp, lq = L.t(L.lp, dt), L.t(L.lq, dt)
    eps = v["clamp"]

    def bkl(log_p, log_q):
        p = torch.clamp(torch.exp(log_p), eps, 1.0 - eps)
        q = torch.clamp(torch.exp(log_q), eps, 1.0 - eps)
        return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))

    metric = torch.maximum(bkl(lp, lq), bkl(lq, lp))
    return _np(~(metric <= v["phi"]))


def areal_m2po(L: Log, v: dict, dt) -> np.ndarray:
    """actor.py _apply_m2po_masking / _get_m2po_loss_mask, one micro-batch per step: m2 =
    (old - prox)^2 sorted descending, suffix means A[i] = sum(m2[i:]) / (n - i); mask the
    first k, k = the first index with A[k] < tau, else n - 1 (all but one)."""
    out = np.zeros(L.n, dtype=bool)
    for s in np.unique(L.step):
        idx = np.flatnonzero(L.step == s)
        delta = L.t(L.lq[idx], dt) - L.t(L.lp[idx], dt)
        m2 = delta * delta
        sorted_m2, indices = torch.sort(m2, descending=True, stable=True)
        n = sorted_m2.numel()
        suffix = sorted_m2.flip(0).cumsum(0).flip(0)
        counts = torch.arange(n, 0, -1, dtype=sorted_m2.dtype)
        avg = suffix / counts
        below = torch.where(avg < v["tau"])[0]
        k = below[0].item() if len(below) > 0 else n - 1
        keep = torch.ones(n, dtype=torch.bool)
        keep[:k] = False
        kept = keep[torch.argsort(indices)]
        out[idx] = ~kept.numpy()
    return out


# ----------------------------------------------------------------------------- TRL
# huggingface/trl trl/trainer/grpo_trainer.py @ f2cd577


def trl_token_mask(L: Log, v: dict, dt) -> np.ndarray:
    """vllm_importance_sampling_mode="token_mask": ratio = exp(l * mask); masked iff
    ratio < C_min or ratio > C_max (C_min None -> -inf)."""
    r = torch.exp(L.t(L.lp, dt) - L.t(L.lq, dt))
    lo = v["low"] if v["low"] else -math.inf
    return _np((r < lo) | (r > v["high"]))


def trl_token_truncate(L: Log, v: dict, dt) -> np.ndarray:
    """token_truncate: clamp(exp(l), max=C_max): truncated iff exp(l) > C_max."""
    return _np(torch.exp(L.t(L.lp, dt) - L.t(L.lq, dt)) > v["cap"])


def _trl_seq_ratio(L: Log, dt) -> torch.Tensor:
    diff = L.pad(L.lp - L.lq, dt) * L.mask().to(dt)
    return torch.exp(diff.sum(dim=-1, keepdim=True))


def trl_sequence_mask(L: Log, v: dict, dt) -> np.ndarray:
    """sequence_mask: exp(sum(l * mask)) outside [C_min, C_max] (None: unbounded)."""
    r = _trl_seq_ratio(L, dt)
    lo = v["low"] if v["low"] else -math.inf
    return L.unpad((r < lo) | (r > v["high"]))


def trl_sequence_truncate(L: Log, v: dict, dt) -> np.ndarray:
    """sequence_truncate: truncated iff exp(sum(l * mask)) > C_max."""
    return L.unpad(_trl_seq_ratio(L, dt) > v["cap"])


def trl_opsm(L: Log, v: dict, dt) -> np.ndarray:
    """get_off_policy_mask: kl = lq - lp; avg = sum(kl * mask) / clamp(n, 1); keep iff
    A >= 0 or avg <= delta."""
    mask = L.mask().to(dt)
    kl = L.pad(L.lq - L.lp, dt)
    avg = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    a = torch.tensor(L.seq_adv(), dtype=torch.float64).to(dt).reshape(-1, 1)
    keep = (a >= 0) | (avg <= v["delta"])
    return L.unpad(~keep)


# ----------------------------------------------------------------------------- SkyRL
# NovaSky-AI/SkyRL off_policy_correction_utils.py @ a956457


def _skyrl_exp(x: torch.Tensor, dt) -> torch.Tensor:
    """safe_exp_delta: clamp(x.to(float32), -20, 20).exp() (float32 there; dt here)."""
    return torch.clamp(x.to(dt), -SAFETY_BOUND, SAFETY_BOUND).exp()


def skyrl_seq_tis(L: Log, v: dict, dt) -> np.ndarray:
    """compute_tis_ratio("sequence"): seq_tis_ratio = safe_exp(sum(l * mask)) > cap."""
    s = (L.pad(L.lp - L.lq, dt) * L.mask().to(dt)).sum(dim=-1, keepdim=True)
    return L.unpad(_skyrl_exp(s, dt) > v["cap"])


def skyrl_geo(L: Log, v: dict, dt) -> np.ndarray:
    """compute_sequence_mask("geometric"): safe_exp(sum(l * mask) / clamp(n, 1)) outside
    [geo_mask_low, geo_mask_high] (strict)."""
    mask = L.mask().to(dt)
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    s = (L.pad(L.lp - L.lq, dt) * mask).sum(dim=-1, keepdim=True)
    g = _skyrl_exp(s / n, dt)
    return L.unpad((g > v["high"]) | (g < v["low"]))


def skyrl_tis_token(L: Log, v: dict, dt) -> np.ndarray:
    """compute_tis_ratio("token"): tokens_capped = safe_exp(l) > token_tis_ratio_clip_high."""
    return _np(_skyrl_exp(L.t(L.lp, dt) - L.t(L.lq, dt), dt) > v["cap"])


def skyrl_token_mask(L: Log, v: dict, dt) -> np.ndarray:
    """compute_token_mask: in_bounds = (safe_exp(l) >= low) & (safe_exp(l) <= high)."""
    r = _skyrl_exp(L.t(L.lp, dt) - L.t(L.lq, dt), dt)
    return _np(~((r >= v["low"]) & (r <= v["high"])))


def skyrl_product(L: Log, v: dict, dt) -> np.ndarray:
    """compute_sequence_mask("product"): safe_exp(sum(l * mask)) > product_mask_high or
    < product_mask_low."""
    s = (L.pad(L.lp - L.lq, dt) * L.mask().to(dt)).sum(dim=-1, keepdim=True)
    r = _skyrl_exp(s, dt)
    return L.unpad((r > v["high"]) | (r < v["low"]))


def skyrl_outlier(L: Log, v: dict, dt) -> np.ndarray:
    """compute_outlier_token_mask (line 114): a sequence is kept iff every loss token has
    safe_exp(l) in bounds: token_under_low = safe_exp(l) < outlier_token_is_threshold_low;
    outlier_token_is_threshold_high None (veto@skyrl: nothing is over high)."""
    mask = L.mask()
    r = _skyrl_exp(L.pad(L.lp, dt) - L.pad(L.lq, dt), dt)  # old - rollout, in dt
    under = (r < v["v"]) & (mask > 0)
    over = torch.zeros_like(mask, dtype=torch.bool)
    keep = ((~over & ~under) | (mask == 0)).all(dim=-1, keepdim=True)
    return L.unpad(~keep)


# ----------------------------------------------------------------------------- slime
# THUDM/slime @ 624b824: slime/backends/megatron_utils/loss.py (vanilla_tis_function,
# icepop_function) and examples/train_infer_mismatch_helper/mis.py (compute_mis_weights)


def slime_vanilla_tis(L: Log, v: dict, dt) -> np.ndarray:
    """vanilla_tis_function: tis = exp(l); weights = clamp(tis, tis_clip_low=0, tis_clip);
    truncated where weights != tis (its tis_clipfrac)."""
    tis = torch.exp(L.t(L.lp, dt) - L.t(L.lq, dt))
    return _np(torch.clamp(tis, min=0.0, max=v["cap"]) != tis)


def slime_icepop(L: Log, v: dict, dt) -> np.ndarray:
    """icepop_function: ice_weight = where(low <= exp(l) <= high, exp(l), 0): masked (weight
    0) outside the band."""
    r = torch.exp(L.t(L.lp, dt) - L.t(L.lq, dt))
    return _np(~((r >= v["low"]) & (r <= v["high"])))


def _slime_rows(L: Log, dt):
    """compute_mis_weights handles each sequence as its own 1-D tensor: (rows, masks)."""
    lr, m = L.pad(L.lp - L.lq, dt), L.mask().to(dt)
    return [(lr[i, : int(m[i].sum())], m[i, : int(m[i].sum())]) for i in range(L.n_seq)]


def slime_mis(level: str):
    def ref(L: Log, v: dict, dt) -> np.ndarray:
        """compute_mis_weights, rs_level=<level>: log ratio per token, masked_sum or
        masked_mean (sum / clamp_min(n, 1)) per sequence; clamp to +-20; exp; mask() keeps
        lower <= w <= upper."""
        out = []
        for x, m in _slime_rows(L, dt):
            if level == "token":
                lr = x
            elif level == "sequence":
                lr = (x * m).sum().expand_as(x)
            else:
                lr = ((x * m).sum() / torch.clamp_min(m.sum(), 1)).expand_as(x)
            w = torch.exp(torch.clamp(lr, min=-SAFETY_BOUND, max=SAFETY_BOUND))
            out.append(~((w >= v["low"]) & (w <= v["high"])))
        return _slime_unrows(L, out)

    return ref


def slime_veto(L: Log, v: dict, dt) -> np.ndarray:
    """calculate_veto_mask: a sequence with any loss token l < log(torch.tensor(threshold))
    (a float32 tensor, whatever l's dtype) is masked."""
    t = torch.log(torch.tensor(v["v"]))
    out = []
    for x, m in _slime_rows(L, dt):
        out.append(((x < t) & m.bool()).any().expand_as(x))
    return _slime_unrows(L, out)


def _slime_unrows(L: Log, rows) -> np.ndarray:
    per = np.zeros((L.n_seq, max(L.width, 1)), dtype=bool)
    for i, r in enumerate(rows):
        per[i, : r.numel()] = r.numpy()
    return per[L.seq, L.pos]


# ----------------------------------------------------------------------------- NeMo-RL


def nemo_prob_error(L: Log, v: dict, dt) -> np.ndarray:
    """nemo_rl/algorithms/grpo.py compute_and_apply_seq_logprob_error_masking @ 7ea279a:
    sum(exp(|lq - lp| * mask) * mask) / n; kept iff <= threshold."""
    mask = L.mask().to(dt)
    err = torch.abs(L.pad(L.lq, dt) - L.pad(L.lp, dt))
    num = (torch.exp(err * mask) * mask).sum(dim=-1)
    return L.unpad(~(num / mask.sum(dim=-1).clamp(min=1) <= v["tau"]))


# ----------------------------------------------------------------------------- catalogue

# preset SPEC -> (reference, "framework file @ commit"); the presets with no framework code
# (a paper's or docs' values) are checked against tests/brute.py, written from RULES.md.
Ref = Callable[[Log, dict, object], np.ndarray]
REFERENCES: dict[str, tuple[Ref, str]] = {
    "ipo@prime-rl": (prime_ipo_now, "prime-rl loss.py IPOLoss (2026-09 refactor)"),
    "ipo@prime-rl-legacy": (prime_ipo, "prime-rl loss.py ipo_loss_fn @ 559b447"),
    "ipo-v1@prime-rl-legacy": (prime_ipo_v1, "prime-rl loss.py default_loss_fn @ 02bdca2"),
    "icepop@prime-rl": (prime_icepop_now, "prime-rl loss.py IcePopLoss (2026-09 refactor)"),
    "icepop@prime-rl-legacy": (prime_icepop, "prime-rl loss.py default_loss_fn @ 3c3248d"),
    "ppo-clip@prime-rl": (prime_ppo_now, "prime-rl loss.py PPOLoss (2026-09 refactor)"),
    "ppo-clip@paper": (verl_ppo, "verl core_algos.py compute_policy_loss_vanilla @ b178a3c"),
    "ppo-clip@dapo": (verl_ppo, "verl core_algos.py compute_policy_loss_vanilla @ b178a3c"),
    "dual-clip@paper": (verl_ppo, "verl core_algos.py compute_policy_loss_vanilla @ b178a3c"),
    "icepop@verl": (verl_token_rs, "verl rollout_corr_helper.py (token) @ 7522bef"),
    "icepop@areal": (areal_ratio, "AReaL functional.py apply_rejection_sampling @ cbff54d"),
    "token-mis@verl": (verl_token_rs, "verl rollout_corr_helper.py (token) @ 7522bef"),
    "token-mis@trl": (trl_token_mask, "trl grpo_trainer.py token_mask @ f2cd577"),
    "token-mis@verl-k1": (verl_token_k1, "verl rollout_corr_helper.py token_k1 @ b178a3c"),
    "kpop@prime-rl": (prime_kpop, "prime-rl loss.py kpop_loss_fn @ b9ba060"),
    "kpop@areal": (areal_binary_kl, "AReaL functional.py binary_kl @ cbff54d"),
    "token-k2@verl": (verl_token_k2, "verl rollout_corr_helper.py token_k2 @ b178a3c"),
    "token-k3@verl": (verl_token_k3, "verl rollout_corr_helper.py token_k3 @ b178a3c"),
    "m2po@areal": (areal_m2po, "AReaL actor.py _get_m2po_loss_mask @ cbff54d"),
    "dppo-tv@prime-rl": (prime_dppo_tv, "prime-rl loss.py default_loss_fn @ 559b447"),
    "dppo-tv@verl": (verl_dppo_tv, "verl core_algos.py compute_policy_loss_dppo_tv @ 1dda039"),
    "dppo-kl@verl": (verl_dppo_kl, "verl core_algos.py compute_policy_loss_dppo_kl @ 1dda039"),
    "tis@verl": (verl_tis, "verl rollout_corr_helper.py (token IS) @ b178a3c"),
    "tis@trl": (trl_token_truncate, "trl grpo_trainer.py token_truncate @ f2cd577"),
    "cispo@prime-rl": (prime_cispo, "prime-rl loss.py compute_loss @ ce50092"),
    "seq-tis@verl": (verl_seq_tis, "verl rollout_corr_helper.py (sequence IS) @ b178a3c"),
    "seq-tis@skyrl": (skyrl_seq_tis, "SkyRL off_policy_correction_utils.py @ a956457"),
    "seq-tis@trl": (trl_sequence_truncate, "trl grpo_trainer.py sequence_truncate @ f2cd577"),
    "seq-mis@verl": (verl_seq_sum_k1, "verl rollout_corr_helper.py seq_sum_k1 @ b178a3c"),
    "seq-mis@trl": (trl_sequence_mask, "trl grpo_trainer.py sequence_mask @ f2cd577"),
    "geo-mis@verl": (verl_seq_mean_k1, "verl rollout_corr_helper.py seq_mean_k1 @ b178a3c"),
    "geo-mis@skyrl": (skyrl_geo, "SkyRL off_policy_correction_utils.py @ a956457"),
    "geo-mis@prime-rl-legacy": (prime_geo, "prime-rl loss.py compute_loss @ 5f47740"),
    "seq-mean-k3@verl": (verl_seq_mean_k3, "verl rollout_corr_helper.py seq_mean_k3 @ b178a3c"),
    "seq-max-k2@verl": (verl_seq_max_k2, "verl rollout_corr_helper.py seq_max_k2 @ b178a3c"),
    "opsm@trl": (trl_opsm, "trl grpo_trainer.py get_off_policy_mask @ f2cd577"),
    "prob-error@nemo-rl": (nemo_prob_error, "NeMo-RL grpo.py @ 7ea279a"),
    "tis@slime": (slime_vanilla_tis, "slime loss.py vanilla_tis_function @ 624b824"),
    "icepop@slime": (slime_icepop, "slime loss.py icepop_function @ 624b824"),
    "token-mis@slime": (slime_mis("token"), "slime mis.py compute_mis_weights @ 624b824"),
    "seq-mis@slime": (slime_mis("sequence"), "slime mis.py compute_mis_weights @ 624b824"),
    "geo-mis@slime": (slime_mis("geometric"), "slime mis.py compute_mis_weights @ 624b824"),
    "veto@slime": (slime_veto, "slime mis.py calculate_veto_mask @ 624b824"),
    "tis@skyrl": (skyrl_tis_token, "SkyRL off_policy_correction_utils.py @ a956457"),
    "token-mis@skyrl": (skyrl_token_mask, "SkyRL off_policy_correction_utils.py @ a956457"),
    "seq-mis@skyrl": (skyrl_product, "SkyRL off_policy_correction_utils.py @ a956457"),
    "veto@skyrl": (
        skyrl_outlier,
        "SkyRL off_policy_correction_utils.py compute_outlier_token_mask @ a956457",
    ),
}
# the 'lo_hi' threshold each verl k1 preset stands for (verl's own spelling)
VERL_K1_SPECS = {
    "token-mis@verl-k1": (0.6, 1.6),
    "seq-mis@verl": (0.5, 2.0),
    "geo-mis@verl": (0.999, 1.001),
}
# presets whose values come from a paper or docs with no framework code to mirror
DOCS_ONLY = (
    "icepop@paper",
    "kpop@paper",
    "m2po@paper",
    "tis@paper",
    "gspo@paper",
)
# thresholds the tests give presets without a default (verl's token_k2/k3 need one)
EXTRA_VALUES = {
    "token-k2@verl": {"hi": 0.5},
    "token-k3@verl": {"hi": 0.5},
    "token-mis@skyrl": {"low": 0.5, "high": 2.0},  # SkyRL's defaults are None (off)
}
