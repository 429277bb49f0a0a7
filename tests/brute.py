"""A deliberately naive, independent float64 reference for every rule of RULES.md.

Written from /work/shared/RULES.md only: it never imports `mismatch_replay.rules` or the engine
(only `mismatch_replay.pmath`, the exp/expm1 every part of the tool uses).
One rule at one setting (one threshold) at a time, plain Python loops over tokens and sequences.
It is slow on purpose and meant for small logs (tests, the golden log).

Conventions taken from RULES.md, and where RULES.md leaves a choice, the one stated here:
- `loss_mask == false` rows are ignored everywhere; a missing `step` is 0; a sequence is
  (`step`, `sample_id`).
- `l = lp - lq`, `|dp|` computed as RULES.md asks: exp(max(lp, lq)) * (-expm1(min - max)),
  `dp = sign(l) * |dp|`. `k2 = l^2 / 2`, `k3 = expm1(l) - l` (r - 1 - l in float64, without the
  cancellation of exp(l) - 1). "p > q" is read as `lp > lq` (exp is monotone).
- Ratio tests of icepop / token-mis / tis / cispo / seq-tis / seq-mis / geo-mis / veto are done
  in log space (`r > high` as `l > log(high)`, RULES.md: IcePop is "tested in log space"), so
  that a ratio of e^800 compares without overflow; `log(0) = -inf` (a bound of 0 is "off").
  ppo-clip, dual-clip and gspo compare the ratio itself against `1 + eps`, `c`, as PPO does.
- Weights (tis, cispo, seq-tis) use `r = exp(clip(l, -20, 20))` (RULES.md: clamp l to +-20
  before exp where the frameworks do), then `min(r, cap)` / `clip(r, low, high)`.
- A sequence's advantage is the sign of the sum of its tokens' advantages (the tests broadcast
  one advantage per sequence, so this is "the sequence advantage").
- m2po: per step, tokens sorted by l^2 descending (ties keep input order, i.e. file order), the
  largest masked one by one while the mean of the remaining ones is >= tau; the mean of the rest
  is `fsum(rest) / len(rest)` (a correctly rounded sum).
- Sums over a sequence use `math.fsum`. Grouping (`by`): a token counts in its own group; a
  sequence (for sequence rules) in the group of its first token in file order.

Result per group: tokens, masked_tokens, truncated_tokens, sequences, masked_sequences,
masked_mass (sum of |dp| over masked tokens), masked_mass_fraction (None when the total is 0),
weight_mean / weight_max / weight_ess (None for mask rules).
What a mask costs (RULES.md), over the masked tokens (a weight rule's truncated ones; a
sequence rule's masked sequences' tokens), None without an advantage column:
masked_corrective (A * dp < 0), masked_divergent (A * dp > 0), masked_neutral (the rest),
masked_corrective_fraction, masked_adv_mass (sum of |A|), masked_adv_mass_fraction (over
every token's |A|); with an `entropy` column, entropy_mean and masked_entropy_mean (finite
entropies only; None where there are none).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import polars as pl

# The elementary functions are the tool's own (pmath: the same bits on every CPU), as they must
# be for a reference that decides ties: a token "on" a threshold is on it for one computed value
# of exp, not for another. Everything above them -- the rules, the sums, the loops -- is written
# here independently.
from mismatch_replay.pmath import exp, expm1

CLAMP = 20.0

TOKEN_RULES = (
    "ipo",
    "ipo-v1",
    "icepop",
    "token-mis",
    "kpop",
    "token-k2",
    "token-k3",
    "dppo-tv",
    "dppo-kl",
    "ppo-clip",
    "dual-clip",
)
WEIGHT_TOKEN_RULES = ("tis", "cispo")
SEQUENCE_RULES = (
    "seq-mis",
    "geo-mis",
    "seq-mean-k3",
    "seq-max-k2",
    "veto",
    "opsm",
    "gspo",
    "prob-error",
)
ALL_RULES = (*TOKEN_RULES, "m2po", *WEIGHT_TOKEN_RULES, "seq-tis", *SEQUENCE_RULES)
WEIGHT_RULES = ("tis", "cispo", "seq-tis")

# Every parameter of every rule (RULES.md), and which ones are thresholds that can be swept.
PARAMS: dict[str, tuple[str, ...]] = {
    "ipo": ("eps",),
    "ipo-v1": ("low", "high"),
    "icepop": ("low", "high"),
    "token-mis": ("low", "high"),
    "kpop": ("phi", "clamp"),
    "token-k2": ("hi",),
    "token-k3": ("hi",),
    "m2po": ("tau",),
    "dppo-tv": ("low", "high"),
    "dppo-kl": ("low", "high", "clamp"),
    "ppo-clip": ("eps_low", "eps_high"),
    "dual-clip": ("eps_low", "eps_high", "c"),
    "tis": ("cap",),
    "cispo": ("low", "high"),
    "seq-tis": ("cap",),
    "seq-mis": ("low", "high"),
    "geo-mis": ("low", "high"),
    "seq-mean-k3": ("hi",),
    "seq-max-k2": ("hi",),
    "veto": ("v",),
    "opsm": ("delta",),
    "gspo": ("eps_low", "eps_high"),
    "prob-error": ("tau",),
}
NON_THRESHOLD = {"kpop": ("clamp",), "dppo-kl": ("clamp",)}
NEEDS_ADVANTAGE = ("dppo-tv", "dppo-kl", "ppo-clip", "dual-clip", "opsm", "gspo")


def threshold_params(rule: str) -> tuple[str, ...]:
    return tuple(p for p in PARAMS[rule] if p not in NON_THRESHOLD.get(rule, ()))


def parse_spec(spec: str) -> tuple[str, dict[str, float]]:
    """`name:k=v,...` -> (name, params). Only the explicit form (the golden file uses it)."""
    m = re.fullmatch(r"([a-z0-9\-]+)(?::(.*))?", spec.strip())
    assert m, spec
    params = {}
    if m.group(2):
        for item in m.group(2).split(","):
            k, v = item.split("=")
            params[k.strip()] = float(v)
    return m.group(1), params


# ----------------------------------------------------------------------------- tokens


def _log(x: float) -> float:
    return -math.inf if x <= 0 else math.log(x)


def _fsum(xs) -> float:
    xs = list(xs)
    try:
        return math.fsum(xs)
    except OverflowError:  # fsum raises on intermediate overflow; the true sum is +-inf
        return math.inf if sum(x > 0 for x in xs) >= sum(x < 0 for x in xs) else -math.inf


class Log:
    """The loss tokens of a canonical log as float64 arrays (+ keys), in file order."""

    def __init__(self, df: pl.DataFrame):
        if "loss_mask" in df.columns:
            df = df.filter(pl.col("loss_mask"))
        self.n = df.height
        self.lp = np.minimum(df["trainer_logprob"].cast(pl.Float64).to_numpy(), 0.0)
        self.lq = np.minimum(df["inference_logprob"].cast(pl.Float64).to_numpy(), 0.0)
        self.step = df["step"].to_list() if "step" in df.columns else [0] * self.n
        self.sid = df["sample_id"].to_list() if "sample_id" in df.columns else None
        self.env = df["env"].to_list() if "env" in df.columns else None
        self.adv = (
            df["advantage"].cast(pl.Float64).to_numpy() if "advantage" in df.columns else None
        )
        self.ent = df["entropy"].cast(pl.Float64).to_list() if "entropy" in df.columns else None
        lp, lq = self.lp, self.lq
        with np.errstate(over="ignore"):
            self.l = lp - lq
            hi, lo = np.maximum(lp, lq), np.minimum(lp, lq)
            self.abs_dp = exp(hi) * -expm1(lo - hi)
            self.dp = np.where(self.l > 0, self.abs_dp, np.where(self.l < 0, -self.abs_dp, 0.0))
            self.r = exp(self.l)
            self.r_clamped = exp(np.clip(self.l, -CLAMP, CLAMP))
            self.k2 = self.l * self.l / 2.0
            self.k3 = expm1(self.l) - self.l
            self.exp_abs_l = exp(np.abs(self.l))
        # sequences in order of first appearance
        self.seqs: dict[tuple, list[int]] = {}
        if self.sid is not None:
            for i in range(self.n):
                self.seqs.setdefault((self.step[i], self.sid[i]), []).append(i)

    def group_of(self, i: int, by: str | None):
        if by is None:
            return None
        if by == "step":
            return self.step[i]
        return self.env[i]


def bkl(la: float, lb: float, c: float) -> float:
    """BKL(a||b) on {this token, the rest}, a and b clamped into [c, 1 - c] (given as logs)."""

    def clamped(lx):
        x, rest = math.exp(lx), -math.expm1(lx)
        if x < c:
            return c, 1.0 - c
        if rest < c:
            return 1.0 - c, c
        return x, rest

    a, ca = clamped(la)
    b, cb = clamped(lb)
    return a * math.log(a / b) + ca * math.log(ca / cb)


def _token_masked(rule: str, P: dict, L: Log, i: int) -> bool:
    lp, lq, lr, dp, absdp = L.lp[i], L.lq[i], L.l[i], L.dp[i], L.abs_dp[i]
    r = L.r[i]
    if rule == "ipo":
        return absdp > P["eps"]
    if rule == "ipo-v1":
        return dp > P["high"] or dp < -P["low"]
    if rule in ("icepop", "token-mis"):
        return lr < _log(P["low"]) or lr > _log(P["high"])
    if rule == "kpop":
        c = P["clamp"]
        return max(bkl(lp, lq, c), bkl(lq, lp, c)) > P["phi"]
    if rule == "token-k2":
        return L.k2[i] > P["hi"]
    if rule == "token-k3":
        return L.k3[i] > P["hi"]
    a = L.adv[i]
    if rule == "dppo-tv":
        return (a > 0 and dp > P["high"]) or (a <= 0 and dp < -P["low"])
    if rule == "dppo-kl":
        d = bkl(lq, lp, P["clamp"])
        return (a > 0 and lp > lq and d > P["high"]) or (a < 0 and lp < lq and d > P["low"])
    if rule in ("ppo-clip", "dual-clip"):
        clip = (a > 0 and r > 1.0 + P["eps_high"]) or (a < 0 and r < 1.0 - P["eps_low"])
        if rule == "dual-clip":
            clip = clip or (a < 0 and r > P["c"])
        return bool(clip)
    raise KeyError(rule)


def _token_weight(rule: str, P: dict, L: Log, i: int) -> tuple[bool, float]:
    """(truncated, weight) of token i for tis / cispo."""
    lr, rc = L.l[i], L.r_clamped[i]
    if rule == "tis":
        return bool(lr > _log(P["cap"])), min(rc, P["cap"])
    if rule == "cispo":
        low, high = P["low"], P["high"]
        trunc = lr < _log(low) or lr > _log(high)
        return bool(trunc), min(max(rc, low), high)
    raise KeyError(rule)


def _m2po_masked(P: dict, L: Log) -> list[bool]:
    tau = P["tau"]
    masked = [False] * L.n
    steps: dict = {}
    for i in range(L.n):
        steps.setdefault(L.step[i], []).append(i)
    for idx in steps.values():
        x = {i: float(L.l[i] * L.l[i]) for i in idx}
        order = sorted(idx, key=lambda i: -x[i])  # stable: ties keep file order
        m = 0
        while m < len(order):
            rest = [x[i] for i in order[m:]]
            if _fsum(rest) / len(rest) < tau:
                break
            masked[order[m]] = True
            m += 1
    return masked


def _seq_stats(L: Log, idx: list[int]) -> dict:
    n = len(idx)
    S = _fsum(L.l[i] for i in idx)
    st = {
        "n": n,
        "S": S,
        "G": S / n,
        "mean_k3": _fsum(L.k3[i] for i in idx) / n,
        "max_k2": max(L.k2[i] for i in idx),
        "min_l": min(L.l[i] for i in idx),
        "mean_exp_abs_l": _fsum(L.exp_abs_l[i] for i in idx) / n,
        "mean_neg_l": _fsum(-L.l[i] for i in idx) / n,
    }
    if L.adv is not None:
        st["adv"] = _fsum(L.adv[i] for i in idx)
    return st


def _seq_masked(rule: str, P: dict, s: dict) -> bool:
    if rule == "seq-mis":
        return s["S"] < _log(P["low"]) or s["S"] > _log(P["high"])
    if rule == "geo-mis":
        return s["G"] < _log(P["low"]) or s["G"] > _log(P["high"])
    if rule == "seq-mean-k3":
        return s["mean_k3"] > P["hi"]
    if rule == "seq-max-k2":
        return s["max_k2"] > P["hi"]
    if rule == "veto":
        return s["min_l"] < _log(P["v"])  # some token with r < v
    if rule == "opsm":
        return s["adv"] < 0 and s["mean_neg_l"] > P["delta"]
    if rule == "gspo":
        g, a = math.exp(s["G"]), s["adv"]
        return (a > 0 and g > 1.0 + P["eps_high"]) or (a < 0 and g < 1.0 - P["eps_low"])
    if rule == "prob-error":
        return s["mean_exp_abs_l"] > P["tau"]
    raise KeyError(rule)


# ----------------------------------------------------------------------------- evaluate


def evaluate(
    log: pl.DataFrame | Log, rule: str, params: dict[str, float], by: str | None = None
) -> dict:
    """Every output quantity of `rule` at one setting, per group (key None when by is None)."""
    L = log if isinstance(log, Log) else Log(log)
    P = dict(params)
    missing = [p for p in PARAMS[rule] if p not in P]
    assert not missing, f"brute: give every parameter of {rule}: {missing}"
    masked = [False] * L.n
    trunc = [False] * L.n
    weight: list[float] | None = None
    seq_masked: dict[tuple, bool] = {}
    if rule in TOKEN_RULES:
        masked = [_token_masked(rule, P, L, i) for i in range(L.n)]
    elif rule == "m2po":
        masked = _m2po_masked(P, L)
    elif rule in WEIGHT_TOKEN_RULES:
        tw = [_token_weight(rule, P, L, i) for i in range(L.n)]
        trunc = [t for t, _ in tw]
        weight = [w for _, w in tw]
    elif rule == "seq-tis":
        weight = [0.0] * L.n
        for idx in L.seqs.values():
            s_i = _seq_stats(L, idx)["S"]
            t = s_i > _log(P["cap"])
            w = min(math.exp(min(max(s_i, -CLAMP), CLAMP)), P["cap"])
            for i in idx:
                trunc[i], weight[i] = t, w
    elif rule in SEQUENCE_RULES:
        for key, idx in L.seqs.items():
            m = _seq_masked(rule, P, _seq_stats(L, idx))
            seq_masked[key] = m
            for i in idx:
                masked[i] = m
    else:
        raise KeyError(rule)

    groups: dict = {}
    for i in range(L.n):
        g = groups.setdefault(L.group_of(i, by), {"tok": [], "seqs": []})
        g["tok"].append(i)
    for idx in L.seqs.values():
        groups[L.group_of(idx[0], by)]["seqs"].append(idx)

    out = {}
    for gkey, g in groups.items():
        tok = g["tok"]
        total_mass = _fsum(L.abs_dp[i] for i in tok)
        mmass = _fsum(L.abs_dp[i] for i in tok if masked[i])
        res = {
            "tokens": len(tok),
            "masked_tokens": sum(masked[i] for i in tok),
            "truncated_tokens": sum(trunc[i] for i in tok),
            "masked_mass": mmass,
            "masked_mass_fraction": mmass / total_mass if total_mass > 0 else None,
            "weight_mean": None,
            "weight_max": None,
            "weight_ess": None,
        }
        res |= _cost(L, [i for i in tok if masked[i] or trunc[i]], tok)
        if L.sid is not None:
            seqs = g["seqs"]
            res["sequences"] = len(seqs)
            res["masked_sequences"] = sum(any(masked[i] for i in idx) for idx in seqs)
        else:
            res["sequences"] = res["masked_sequences"] = None
        if weight is not None:
            w = [weight[i] for i in tok]
            s1, s2 = _fsum(w), _fsum(x * x for x in w)
            res["weight_mean"] = s1 / len(w)
            res["weight_max"] = max(w)
            res["weight_ess"] = s1 * s1 / (len(w) * s2) if s2 > 0 else None
        out[gkey] = res
    return out


def _cost(L: Log, hit: list[int], tok: list[int]) -> dict:
    """What masking the tokens `hit` of the group's tokens `tok` costs, token by token."""
    out = dict.fromkeys(COST_KEYS)
    if L.adv is not None:
        corr = div = 0
        for i in hit:
            a, d = L.adv[i], L.l[i]  # sign(p - q) = sign(lp - lq)
            if (a > 0 and d < 0) or (a < 0 and d > 0):
                corr += 1
            elif (a > 0 and d > 0) or (a < 0 and d < 0):
                div += 1
        am = _fsum(abs(L.adv[i]) for i in hit)
        tot = _fsum(abs(L.adv[i]) for i in tok)
        out |= {
            "masked_corrective": corr,
            "masked_divergent": div,
            "masked_neutral": len(hit) - corr - div,
            "masked_corrective_fraction": corr / (corr + div) if corr + div else None,
            "masked_adv_mass": am,
            "masked_adv_mass_fraction": am / tot if tot > 0 else None,
        }
    if L.ent is not None:

        def mean(idx):
            v = [L.ent[i] for i in idx if L.ent[i] is not None and math.isfinite(L.ent[i])]
            return _fsum(v) / len(v) if v else None

        out["entropy_mean"] = mean(tok)
        out["masked_entropy_mean"] = mean(hit)
    return out


COST_KEYS = (
    "masked_corrective",
    "masked_divergent",
    "masked_neutral",
    "masked_corrective_fraction",
    "masked_adv_mass",
    "masked_adv_mass_fraction",
    "entropy_mean",
    "masked_entropy_mean",
)


def sweep(
    log: pl.DataFrame | Log,
    rule: str,
    fixed: dict[str, float],
    param: str,
    values: Sequence[float],
    by: str | None = None,
) -> dict[float, dict]:
    """One call of `evaluate` per value of `param` (the naive way to sweep)."""
    L = log if isinstance(log, Log) else Log(log)
    return {float(v): evaluate(L, rule, {**fixed, param: float(v)}, by) for v in values}


def kl_k3_mean(lp: np.ndarray, lq: np.ndarray) -> float:
    """Token mean of k3 = r - 1 - l in float64: expm1(l) - l (no exp(l) - 1 cancellation)."""
    lp = np.asarray(lp, dtype=np.float64)
    lq = np.asarray(lq, dtype=np.float64)
    vals = []
    for a, b in zip(lp.tolist(), lq.tolist(), strict=True):
        lr = min(max(a - b, -CLAMP), CLAMP)
        vals.append(math.expm1(lr) - lr)
    return math.fsum(vals) / len(vals)
