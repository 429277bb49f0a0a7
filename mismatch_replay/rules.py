"""The rule catalogue: every masking / truncation rule of RULES.md as a small frozen dataclass.

Design
------
Each rule, for fixed values of its other parameters, is "masked iff score > threshold" for a
per-token (or per-sequence) score. A rule therefore implements only two things:

* `score(batch, param)`: the score against which `param` is swept, as a float64 array. The
  other, fixed conditions of the rule are folded in: a token already masked by the fixed side
  of a two-sided band scores `+inf` (masked at every threshold), a token the swept side cannot
  reach (e.g. the wrong advantage sign) scores `-inf` (never masked).
* `threshold(param, value)`: the parameter value mapped into score space (monotone; may be
  decreasing, e.g. IcePop's `low` is swept as `-l > -log(low)`).

The engine does the rest: bin the scores against the sorted thresholds once and read every
grid point's count off a suffix sum. Comparisons follow each framework: strict `>` by default,
`inclusive = True` for `>=` (m2po). Scores are computed in the space the definition uses
(|dp| in probability space, IcePop in log space as prime-rl and verl test it), in float64.

Token rules read a `TokenBatch`; sequence rules read `SeqStats` (per-sequence sums that add
across batches and files); `m2po` is per step and handled by the engine. Weight rules
(`kind == "weight"`) truncate instead of mask and also give the natural weight of each token.

Rule SPECs: `ipo:eps=0.3`, `icepop:low=0.2,high=5`, `icepop@verl`, `icepop@verl:high=3`.
Grids: `a,b,c` or `start:stop:num[:log]`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np

from . import pmath
from .errors import UsageError

LOG_CLAMP = 20.0  # |log ratio| clamp before exp for weights and metrics (verl, slime, SkyRL)


# ----------------------------------------------------------------------------- inputs


class TokenBatch:
    """Per-token quantities of one batch, derived lazily from the two log-prob columns.

    All arrays are float64 of shape (n,). `p`, `q` are probabilities, `l = lp - lq`.
    """

    def __init__(self, lp: np.ndarray, lq: np.ndarray, advantage: np.ndarray | None = None):
        self.lp = np.asarray(lp, dtype=np.float64)
        self.lq = np.asarray(lq, dtype=np.float64)
        self.advantage = None if advantage is None else np.asarray(advantage, dtype=np.float64)

    def __len__(self) -> int:
        return self.lp.shape[0]

    @cached_property
    def l(self) -> np.ndarray:  # noqa: E743 - the log ratio is called l in RULES.md
        return self.lp - self.lq

    @cached_property
    def p(self) -> np.ndarray:
        return pmath.exp(self.lp)

    @cached_property
    def q(self) -> np.ndarray:
        return pmath.exp(self.lq)

    @cached_property
    def abs_dp(self) -> np.ndarray:
        """|p - q| without cancellation: exp(max) * (-expm1(min - max))."""
        hi = np.maximum(self.lp, self.lq)
        lo = np.minimum(self.lp, self.lq)
        return pmath.exp(hi) * -pmath.expm1(lo - hi)

    @cached_property
    def dp(self) -> np.ndarray:
        """p - q (signed), from the stable |dp|."""
        return np.copysign(self.abs_dp, self.l)

    @cached_property
    def r(self) -> np.ndarray:
        """Importance ratio exp(l), unclamped (may be inf only for absurd logs)."""
        return pmath.exp(self.l)

    @cached_property
    def r_clamped(self) -> np.ndarray:
        """exp(clip(l, -20, 20)): the ratio frameworks use as a weight."""
        return pmath.exp(np.clip(self.l, -LOG_CLAMP, LOG_CLAMP))

    @cached_property
    def k2(self) -> np.ndarray:
        return 0.5 * self.l * self.l

    @cached_property
    def k3(self) -> np.ndarray:
        """r - 1 - l, computed as expm1(l) - l (exact near 0; inf only if l > 709)."""
        return pmath.expm1(self.l) - self.l

    def adv(self, rule: str) -> np.ndarray:
        if self.advantage is None:
            raise UsageError(
                f"rule '{rule}' depends on the sign of the advantage, and the log has no "
                "advantage column. Map one with --map advantage=COLUMN, or choose a rule that "
                "does not need it."
            )
        return self.advantage


def binary_kl(la: np.ndarray, lb: np.ndarray, clamp: float) -> np.ndarray:
    """BKL(a||b) on the split {this token, the rest}, a and b given as logs, clamped to [c, 1-c].

    Complements come from expm1 (1 - a = -expm1(log a)) so that confident tokens keep their
    precision.
    """
    lo, hi = math.log(clamp), math.log1p(-clamp)
    la = np.clip(la, lo, hi)
    lb = np.clip(lb, lo, hi)
    a = pmath.exp(la)
    ca = np.clip(-pmath.expm1(la), clamp, 1.0 - clamp)
    cb = np.clip(-pmath.expm1(lb), clamp, 1.0 - clamp)
    return a * (la - lb) + ca * (pmath.log(ca) - pmath.log(cb))


@dataclass
class SeqStats:
    """Per-sequence sums (shape (S,)), additive across batches: what sequence rules read."""

    n: np.ndarray  # loss tokens
    sum_l: np.ndarray  # S_i
    sum_k3: np.ndarray
    max_k2: np.ndarray
    min_l: np.ndarray
    sum_exp_abs_l: np.ndarray
    sum_adv: np.ndarray
    has_adv: bool = True

    @property
    def G(self) -> np.ndarray:
        return self.sum_l / self.n

    def adv(self, rule: str) -> np.ndarray:
        if not self.has_adv:
            raise UsageError(
                f"rule '{rule}' needs the sequence's advantage, and the log has no advantage "
                "column. Map one with --map advantage=COLUMN."
            )
        return self.sum_adv / self.n


def _log(x: float) -> float:
    return -math.inf if x <= 0 else math.log(x)


def _where(cond, a, b):
    return np.where(cond, a, b).astype(np.float64, copy=False)


INF = math.inf


# ----------------------------------------------------------------------------- catalogue


@dataclass(frozen=True)
class Param:
    name: str
    doc: str
    grid: str  # default sweep grid (GRID syntax)
    threshold: bool = True  # sweeping it is a one-pass threshold sweep


class Rule:
    """Base of every rule; subclasses are frozen dataclasses whose fields are the parameters."""

    name: ClassVar[str]
    title: ClassVar[str]
    level: ClassVar[str] = "token"  # token | sequence | step
    kind: ClassVar[str] = "mask"  # mask | weight
    needs: ClassVar[tuple[str, ...]] = ()
    source: ClassVar[str] = ""
    definition: ClassVar[str] = ""
    params: ClassVar[tuple[Param, ...]] = ()
    presets: ClassVar[dict[str, dict[str, float]]] = {}
    preset_notes: ClassVar[dict[str, str]] = {}  # informative, shown by `rules`
    # Presets that follow a framework's code where it differs from its docs: the warning
    # printed whenever the preset is used.
    preset_quirks: ClassVar[dict[str, str]] = {}
    inclusive: ClassVar[bool] = False
    # The parameter `choose --budget` / `compare --budget` moves (default: the first threshold
    # parameter); two-sided bands move their upper side with the lower one fixed.
    primary: ClassVar[str | None] = None

    # -- parameters
    @classmethod
    def primary_param(cls) -> str:
        if cls.primary:
            return cls.primary
        return next(p.name for p in cls.params if p.threshold)

    @classmethod
    def param_names(cls) -> tuple[str, ...]:
        return tuple(p.name for p in cls.params)

    @classmethod
    def param(cls, name: str) -> Param:
        for p in cls.params:
            if p.name == name:
                return p
        raise UsageError(
            f"rule '{cls.name}' has no parameter '{name}'; its parameters: "
            f"{', '.join(cls.param_names())}."
        )

    @classmethod
    def defaults(cls) -> dict[str, float | None]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def values(self) -> dict[str, float | None]:
        return {p: getattr(self, p) for p in self.param_names()}

    def replace(self, **kw) -> Rule:
        return dataclasses.replace(self, **kw)

    def spec(self) -> str:
        vals = ",".join(f"{k}={_fmt(v)}" for k, v in self.values().items() if v is not None)
        return f"{self.name}:{vals}" if vals else self.name

    def setting(self, exclude: str | None = None) -> str:
        """The fixed parameters as `k=v,...` (the swept one left out)."""
        return ",".join(
            f"{k}={_fmt(v)}" for k, v in self.values().items() if k != exclude and v is not None
        )

    def require(self, *names: str) -> None:
        for n in names:
            if getattr(self, n) is None:
                raise UsageError(
                    f"rule '{self.name}' has no default for '{n}': give one "
                    f"(--rule {self.name}:{n}=VALUE) or sweep it (--sweep {self.name}.{n}=GRID)."
                )

    # -- what the engine calls
    def threshold(self, param: str, value: float) -> float:
        return float(value)

    def score(self, b, param: str) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def weight(self, b, param: str) -> np.ndarray:
        """Weight rules: each token's weight when the swept side does not truncate it."""
        raise NotImplementedError


def _fmt(v) -> str:
    if v is None:
        return "none"
    return f"{v:g}"


REGISTRY: dict[str, type[Rule]] = {}


def register(cls):
    cls = dataclass(frozen=True)(cls)
    REGISTRY[cls.name] = cls
    return cls


def _other(param: str, a: str, b: str) -> str:
    return b if param == a else a


# ---- token rules, advantage-independent


@register
class IPO(Rule):
    name = "ipo"
    title = "INTELLECT Policy Optimization"
    source = "prime-rl (IPO docs, 2026)"
    definition = "|p - q| > eps (strict; two-sided)"
    params = (Param("eps", "probability band half-width", "0.001:1:121:log"),)
    presets = {"prime-rl": {"eps": 0.3}, "prime-rl-legacy": {"eps": 0.1}}
    preset_notes = {"prime-rl-legacy": "prime-rl's IPO default before 2026-09-18"}
    eps: float | None = 0.3

    def score(self, b, param):
        return b.abs_dp


@register
class IPOv1(Rule):
    primary = "high"
    name = "ipo-v1"
    title = "early IPO, one threshold per side"
    source = "prime-rl (early IPO)"
    definition = "p - q > high or p - q < -low"
    params = (
        Param("low", "largest allowed drop of p below q", "0.001:1:121:log"),
        Param("high", "largest allowed rise of p above q", "0.001:1:121:log"),
    )
    presets = {"prime-rl-legacy": {"low": 0.2, "high": 0.2}}
    low: float | None = 0.2
    high: float | None = 0.2

    def score(self, b, param):
        if param == "high":
            return _where(b.dp < -self.low, INF, b.dp)
        return _where(b.dp > self.high, INF, -b.dp)


@register
class IcePop(Rule):
    primary = "high"
    name = "icepop"
    title = "IcePop ratio band"
    source = "Ring-1T, arXiv 2510.18855"
    definition = "r < low or r > high (band [low, high] kept, inclusive; tested in log space)"
    params = (
        Param("low", "lower ratio bound (kept if r >= low)", "0.01:0.99:121:log"),
        Param("high", "upper ratio bound (kept if r <= high)", "1.01:100:121:log"),
    )
    presets = {
        "prime-rl": {"low": 0.2, "high": 5.0},
        "verl": {"low": 0.5, "high": 5.0},
        "areal": {"low": 0.5, "high": 5.0},
        "paper": {"low": 0.5, "high": 5.0},
    }
    low: float | None = 0.5
    high: float | None = 5.0

    def threshold(self, param, value):
        return _log(value) if param == "high" else -_log(value)

    def score(self, b, param):
        if param == "high":
            return _where(b.l < _log(self.low), INF, b.l)
        return _where(b.l > _log(self.high), INF, -b.l)


@register
class TokenMIS(IcePop):
    name = "token-mis"
    title = "token-level importance-sampling rejection"
    source = "verl rollout correction / TRL"
    definition = "same test as icepop: r < low or r > high"
    presets = {
        "verl": {"low": 0.5, "high": 5.0},
        "trl": {"low": 0.5, "high": 2.0},
        "verl-k1": {"low": 1 / 1.6, "high": 1 / 0.6},
    }
    preset_notes = {
        "verl-k1": "verl's token_k1 rejection at its own example threshold '0.6_1.6'",
    }
    preset_quirks = {
        "verl-k1": "verl's *_k1 rejection with a 'lo_hi' threshold keeps 1/hi <= r <= 1/lo: "
        "its example '0.6_1.6' keeps r in [0.625, 1.667], not [0.6, 1.6]; this preset "
        "follows the code. For another 'lo_hi' use token-mis:low=1/hi,high=1/lo.",
    }
    low: float | None = 0.5
    high: float | None = 5.0


@register
class KPop(Rule):
    name = "kpop"
    title = "KPop binary-KL mask"
    source = "Ant Group, 2026"
    definition = "max(BKL(p||q), BKL(q||p)) > phi, probabilities clamped to [clamp, 1-clamp]"
    params = (
        Param("phi", "binary-KL threshold (nats)", "0.0001:10:121:log"),
        Param("clamp", "probability clamp c", "1e-8,1e-6,1e-4", threshold=False),
    )
    presets = {
        "prime-rl": {"phi": 0.1, "clamp": 1e-6},
        "paper": {"phi": 0.1, "clamp": 1e-6},
        "areal": {"phi": 2.0, "clamp": 1e-8},
    }
    phi: float | None = 0.1
    clamp: float | None = 1e-6

    def score(self, b, param):
        return np.maximum(binary_kl(b.lp, b.lq, self.clamp), binary_kl(b.lq, b.lp, self.clamp))


@register
class TokenK2(Rule):
    name = "token-k2"
    title = "token k2 rejection"
    source = "verl rollout correction"
    definition = "k2 = l^2/2 > hi"
    params = (Param("hi", "k2 threshold", "0.0001:10:121:log"),)
    hi: float | None = None

    def score(self, b, param):
        return b.k2


@register
class TokenK3(Rule):
    name = "token-k3"
    title = "token k3 rejection"
    source = "verl rollout correction"
    definition = "k3 = r - 1 - l > hi"
    params = (Param("hi", "k3 threshold", "0.0001:10:121:log"),)
    hi: float | None = None

    def score(self, b, param):
        return b.k3


@register
class M2PO(Rule):
    name = "m2po"
    title = "M2PO second-moment budget"
    source = "arXiv 2510.01161"
    definition = "per step: mask the largest l^2 until the mean l^2 of the rest is < tau"
    level = "step"
    inclusive = True  # the token of rank m is masked iff mean(rest from m on) >= tau
    params = (Param("tau", "budget on the mean of l^2 per step", "0.0001:1:121:log"),)
    presets = {"paper": {"tau": 0.04}}
    tau: float | None = 0.04

    def score(self, b, param):
        return b.l * b.l  # the engine turns per-step sorted l^2 into suffix means


# ---- token rules, advantage-dependent


@register
class DPPOTV(Rule):
    primary = "high"
    name = "dppo-tv"
    title = "DPPO binary total variation"
    source = "arXiv 2602.04879"
    definition = "A > 0 and p - q > high, or A <= 0 and p - q < -low"
    needs = ("advantage",)
    params = (
        Param("low", "allowed drop when A <= 0", "0.001:1:121:log"),
        Param("high", "allowed rise when A > 0", "0.001:1:121:log"),
    )
    presets = {"prime-rl": {"low": 0.2, "high": 0.2}, "verl": {"low": 0.15, "high": 0.15}}
    preset_notes = {"prime-rl": "A == 0 goes to the low side, as prime-rl's code does"}
    low: float | None = 0.2
    high: float | None = 0.2

    def score(self, b, param):
        a = b.adv(self.name)
        if param == "high":
            return _where((a <= 0) & (b.dp < -self.low), INF, _where(a > 0, b.dp, -INF))
        return _where((a > 0) & (b.dp > self.high), INF, _where(a <= 0, -b.dp, -INF))


@register
class DPPOKL(Rule):
    primary = "high"
    name = "dppo-kl"
    title = "DPPO binary KL"
    source = "arXiv 2602.04879"
    definition = "A > 0 and p > q and BKL(q||p) > high, or A < 0 and p < q and BKL(q||p) > low"
    needs = ("advantage",)
    params = (
        Param("low", "binary-KL threshold when A < 0", "0.0001:10:121:log"),
        Param("high", "binary-KL threshold when A > 0", "0.0001:10:121:log"),
        Param("clamp", "probability clamp c", "1e-8,1e-6,1e-4", threshold=False),
    )
    presets = {"verl": {"low": 0.05, "high": 0.05}}
    low: float | None = 0.05
    high: float | None = 0.05
    clamp: float | None = 1e-6

    def score(self, b, param):
        a = b.adv(self.name)
        bkl = binary_kl(b.lq, b.lp, self.clamp)
        up = (a > 0) & (b.l > 0)
        down = (a < 0) & (b.l < 0)
        if param == "high":
            return _where(down & (bkl > self.low), INF, _where(up, bkl, -INF))
        return _where(up & (bkl > self.high), INF, _where(down, bkl, -INF))


@register
class PPOClip(Rule):
    primary = "eps_high"
    name = "ppo-clip"
    title = "PPO clip (zero-gradient tokens)"
    source = "Schulman et al. 2017; DAPO"
    definition = "A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low"
    needs = ("advantage",)
    params = (
        Param("eps_low", "lower clip 1 - eps_low", "0.001:0.999:121:log"),
        Param("eps_high", "upper clip 1 + eps_high", "0.001:10:121:log"),
    )
    presets = {
        "paper": {"eps_low": 0.2, "eps_high": 0.2},
        "dapo": {"eps_low": 0.2, "eps_high": 0.28},
        "prime-rl": {"eps_low": 0.2, "eps_high": 0.2},
    }
    eps_low: float | None = 0.2
    eps_high: float | None = 0.2

    def _extra(self, b, a):
        return np.zeros(len(b), dtype=bool)

    def threshold(self, param, value):
        return 1.0 + value if param == "eps_high" else value - 1.0

    def score(self, b, param):
        a = b.adv(self.name)
        r = b.r
        up = (a > 0) & (r > 1.0 + self.eps_high)
        down = (a < 0) & (r < 1.0 - self.eps_low)
        extra = self._extra(b, a)
        if param == "eps_high":
            return _where(down | extra, INF, _where(a > 0, r, -INF))
        if param == "eps_low":
            return _where(up | extra, INF, _where(a < 0, -r, -INF))
        return _where(up | down, INF, _where(a < 0, r, -INF))  # dual-clip's c


@register
class DualClip(PPOClip):
    name = "dual-clip"
    title = "dual-clip PPO"
    source = "Ye et al. 2020"
    definition = "ppo-clip, plus A < 0 and r > c"
    params = (*PPOClip.params, Param("c", "dual-clip bound for A < 0", "1.01:100:121:log"))
    presets = {"paper": {"eps_low": 0.2, "eps_high": 0.2, "c": 3.0}}
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
    title = "truncated importance sampling"
    source = "verl / TIS paper; TRL"
    definition = "weight min(r, cap), detached; truncated when r > cap"
    kind = "weight"
    params = (Param("cap", "weight cap", "1.01:100:121:log"),)
    presets = {"verl": {"cap": 2.0}, "paper": {"cap": 2.0}, "trl": {"cap": 3.0}}
    cap: float | None = 2.0

    def threshold(self, param, value):
        return _log(value)

    def score(self, b, param):
        return b.l

    def weight(self, b, param):
        return b.r_clamped


@register
class CISPO(Rule):
    primary = "high"
    name = "cispo"
    title = "CISPO clipped IS weight"
    source = "MiniMax-M1"
    definition = "weight clip(r, low, high), detached; truncated when r < low or r > high"
    kind = "weight"
    params = (
        Param("low", "lower weight clip (0 = off)", "0.01:0.99:121:log"),
        Param("high", "upper weight clip", "1.01:100:121:log"),
    )
    presets = {"prime-rl": {"low": 0.0, "high": 5.0}}
    preset_notes = {"prime-rl": "prime-rl clips CISPO weights above only (low off)"}
    low: float | None = 0.0
    high: float | None = 5.0

    def threshold(self, param, value):
        return _log(value) if param == "high" else -_log(value)

    def score(self, b, param):
        if param == "high":
            return _where(b.l < _log(self.low), INF, b.l)
        return _where(b.l > _log(self.high), INF, -b.l)

    def weight(self, b, param):
        if param == "high":
            return _where(b.l < _log(self.low), self.low, b.r_clamped)
        return _where(b.l > _log(self.high), self.high, b.r_clamped)


# ---- sequence rules (read SeqStats)


@register
class SeqTIS(Rule):
    name = "seq-tis"
    title = "sequence-level truncated IS"
    source = "verl; SkyRL; TRL"
    definition = "weight min(exp(S_i), cap) on every token of i; truncated when exp(S_i) > cap"
    level = "sequence"
    kind = "weight"
    needs = ("sample_id",)
    params = (Param("cap", "weight cap", "1.01:100:121:log"),)
    presets = {"verl": {"cap": 2.0}, "skyrl": {"cap": 5.0}, "trl": {"cap": 3.0}}
    cap: float | None = 2.0

    def threshold(self, param, value):
        return _log(value)

    def score(self, s, param):
        return s.sum_l

    def weight(self, s, param):
        return pmath.exp(np.clip(s.sum_l, -LOG_CLAMP, LOG_CLAMP))


class _SeqBand(Rule):
    """exp(x) outside [low, high], x a per-sequence log quantity; low = 0 means no low bound."""

    level = "sequence"
    needs = ("sample_id",)

    def _x(self, s) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def threshold(self, param, value):
        return _log(value) if param == "high" else -_log(value)

    def score(self, s, param):
        x = self._x(s)
        if param == "high":
            return _where(x < _log(self.low), INF, x)
        return _where(x > _log(self.high), INF, -x)


@register
class SeqMIS(_SeqBand):
    primary = "high"
    name = "seq-mis"
    title = "sequence importance-ratio rejection"
    source = "verl rollout correction; TRL"
    definition = "exp(S_i) outside [low, high] (low = 0: no lower bound)"
    params = (
        Param("low", "lower bound on the product ratio", "0.0001:0.99:121:log"),
        Param("high", "upper bound on the product ratio", "1.01:10000:121:log"),
    )
    presets = {"verl": {"low": 0.5, "high": 2.0}, "trl": {"low": 0.0, "high": 3.0}}
    low: float | None = 0.5
    high: float | None = 2.0

    def _x(self, s):
        return s.sum_l


@register
class GeoMIS(_SeqBand):
    primary = "high"
    name = "geo-mis"
    title = "geometric-mean ratio rejection (Geo-RS)"
    source = "verl rollout correction; SkyRL; prime-rl (pre-2026)"
    definition = "exp(G_i) outside [low, high], G_i = S_i / n_i"
    params = (
        Param("low", "lower bound on the geometric-mean ratio", "0.1:0.9999:121:log"),
        Param("high", "upper bound on the geometric-mean ratio", "1.0001:10:121:log"),
    )
    presets = {
        "verl": {"low": 0.999, "high": 1.001},
        "skyrl": {"low": 0.99, "high": 1.01},
        "prime-rl-legacy": {"low": 0.1, "high": 10.0},
    }
    low: float | None = 0.999
    high: float | None = 1.001

    def _x(self, s):
        return s.G


@register
class SeqMeanK3(Rule):
    name = "seq-mean-k3"
    title = "sequence mean-k3 rejection (K3-RS)"
    source = "verl rollout correction"
    definition = "mean over the sequence of k3 > hi"
    level = "sequence"
    needs = ("sample_id",)
    params = (Param("hi", "threshold on the sequence's mean k3", "0.00001:1:121:log"),)
    hi: float | None = 0.01

    def score(self, s, param):
        return s.sum_k3 / s.n


@register
class SeqMaxK2(Rule):
    name = "seq-max-k2"
    title = "sequence max-k2 rejection"
    source = "verl rollout correction"
    definition = "max over the sequence of k2 > hi"
    level = "sequence"
    needs = ("sample_id",)
    params = (Param("hi", "threshold on the sequence's max k2", "0.001:100:121:log"),)
    hi: float | None = 2.5

    def score(self, s, param):
        return s.max_k2


@register
class Veto(Rule):
    name = "veto"
    title = "catastrophic-token veto"
    source = "verl rollout correction"
    definition = "any token of the sequence with r < v"
    level = "sequence"
    needs = ("sample_id",)
    params = (Param("v", "ratio below which one token vetoes its sequence", "1e-8:0.99:121:log"),)
    v: float | None = 1e-4

    def threshold(self, param, value):
        return -_log(value)

    def score(self, s, param):
        return -s.min_l


@register
class OPSM(Rule):
    name = "opsm"
    title = "off-policy sequence masking"
    source = "DeepSeek-V3.2"
    definition = "A < 0 and mean over the sequence of (lq - lp) > delta"
    level = "sequence"
    needs = ("sample_id", "advantage")
    params = (Param("delta", "threshold on the mean log-ratio drop", "0.0001:10:121:log"),)
    presets = {"trl": {"delta": 0.5}}
    preset_notes = {"trl": "no published delta; TRL's docs suggest 0.5"}
    delta: float | None = None

    def score(self, s, param):
        return _where(s.adv(self.name) < 0, -s.G, -INF)


@register
class GSPO(Rule):
    primary = "eps_high"
    name = "gspo"
    title = "GSPO sequence clip"
    source = "arXiv 2507.18071"
    definition = "ppo-clip on exp(G_i) with the sequence advantage"
    level = "sequence"
    needs = ("sample_id", "advantage")
    params = (
        Param("eps_low", "lower clip 1 - eps_low on exp(G_i)", "0.00001:0.5:121:log"),
        Param("eps_high", "upper clip 1 + eps_high on exp(G_i)", "0.00001:10:121:log"),
    )
    presets = {"paper": {"eps_low": 3e-4, "eps_high": 4e-4}}
    eps_low: float | None = 3e-4
    eps_high: float | None = 4e-4

    def threshold(self, param, value):
        return 1.0 + value if param == "eps_high" else value - 1.0

    def score(self, s, param):
        a = s.adv(self.name)
        g = pmath.exp(s.G)
        if param == "eps_high":
            down = (a < 0) & (g < 1.0 - self.eps_low)
            return _where(down, INF, _where(a > 0, g, -INF))
        up = (a > 0) & (g > 1.0 + self.eps_high)
        return _where(up, INF, _where(a < 0, -g, -INF))


@register
class ProbError(Rule):
    name = "prob-error"
    title = "NeMo-RL token multiplicative probability error"
    source = "NeMo-RL"
    definition = "mean over the sequence of exp(|l|) > tau"
    level = "sequence"
    needs = ("sample_id",)
    params = (Param("tau", "threshold on the mean of exp(|l|)", "1.0001:10:121:log"),)
    presets = {"nemo-rl": {"tau": 1.5}}
    tau: float | None = 1.5

    def score(self, s, param):
        return s.sum_exp_abs_l / s.n


# ----------------------------------------------------------------------------- parsing

_SPEC = re.compile(r"^(?P<name>[a-z0-9\-]+)(?:@(?P<preset>[a-z0-9\-]+))?(?::(?P<kv>.*))?$")


def _number(text: str, what: str) -> float:
    t = text.strip().lower()
    if t in ("off", "none", "0"):
        return 0.0
    try:
        v = float(t)
    except ValueError:
        raise UsageError(f"{what}: '{text}' is not a number.") from None
    if not math.isfinite(v):
        raise UsageError(f"{what}: '{text}' must be finite.")
    return v


def get_rule_class(name: str) -> type[Rule]:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"unknown rule '{name}'. Known rules: {', '.join(REGISTRY)} "
            "(mismatch-replay rules lists them)."
        ) from None


def parse_rule(spec: str) -> Rule:
    """`name`, `name:k=v,...`, `name@preset` or `name@preset:k=v` -> a Rule instance."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise UsageError(
            f"bad rule SPEC '{spec}': use name[:param=value,...] or name@preset, "
            "e.g. ipo:eps=0.3 or icepop@verl."
        )
    cls = get_rule_class(m["name"])
    values: dict[str, float] = {}
    if m["preset"]:
        try:
            values.update(cls.presets[m["preset"]])
        except KeyError:
            known = ", ".join(cls.presets) or "none"
            raise UsageError(
                f"rule '{cls.name}' has no preset '{m['preset']}'; its presets: {known}."
            ) from None
    if m["kv"]:
        for item in m["kv"].split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise UsageError(f"bad rule SPEC '{spec}': '{item}' is not param=value.")
            k, v = item.split("=", 1)
            cls.param(k.strip())
            values[k.strip()] = _number(v, f"rule SPEC '{spec}', {k.strip()}")
    return cls(**values)


def spec_warnings(specs) -> list[str]:
    """One-line warnings for the presets among `specs` that follow a framework's quirk."""
    out = []
    for spec in specs:
        if not isinstance(spec, str):
            continue
        m = _SPEC.match(spec.strip())
        if m and m["preset"] and m["name"] in REGISTRY:
            quirk = REGISTRY[m["name"]].preset_quirks.get(m["preset"])
            if quirk:
                out.append(f"{m['name']}@{m['preset']}: {quirk}")
    return out


def parse_grid(text: str) -> np.ndarray:
    """`a,b,c` or `start:stop:num[:log]` -> float64 values (sorted, unique)."""
    t = text.strip()
    if ":" in t:
        parts = t.split(":")
        if len(parts) not in (3, 4) or (len(parts) == 4 and parts[3] not in ("log", "lin")):
            raise UsageError(f"bad GRID '{text}': use start:stop:num or start:stop:num:log.")
        start = _number(parts[0], f"GRID '{text}'")
        stop = _number(parts[1], f"GRID '{text}'")
        try:
            num = int(parts[2])
        except ValueError:
            raise UsageError(f"bad GRID '{text}': num '{parts[2]}' is not an integer.") from None
        if num < 1:
            raise UsageError(f"bad GRID '{text}': num must be at least 1.")
        if len(parts) == 4 and parts[3] == "log":
            if start <= 0 or stop <= 0:
                raise UsageError(f"bad GRID '{text}': a log grid needs start and stop > 0.")
            vals = np.geomspace(start, stop, num)
        else:
            vals = np.linspace(start, stop, num)
    else:
        vals = np.array([_number(x, f"GRID '{text}'") for x in t.split(",") if x.strip()])
        if vals.size == 0:
            raise UsageError(f"bad GRID '{text}': no values.")
    return np.unique(vals.astype(np.float64))


def catalogue() -> list[type[Rule]]:
    return list(REGISTRY.values())


def catalogue_records() -> list[dict]:
    """The catalogue as plain records (what `mismatch-replay rules` prints)."""
    recs = []
    for cls in REGISTRY.values():
        defaults = cls.defaults()
        recs.append(
            {
                "name": cls.name,
                "title": cls.title,
                "level": cls.level,
                "kind": cls.kind,
                "needs": list(cls.needs),
                "definition": cls.definition,
                "source": cls.source,
                "params": [
                    {
                        "name": p.name,
                        "default": defaults[p.name],
                        "doc": p.doc,
                        "grid": p.grid,
                        "threshold": p.threshold,
                    }
                    for p in cls.params
                ],
                "presets": {k: dict(v) for k, v in cls.presets.items()},
                "preset_notes": dict(cls.preset_notes),
                "preset_quirks": dict(cls.preset_quirks),
            }
        )
    return recs


def catalogue_markdown() -> str:
    """The catalogue as the Markdown table README.md carries (a test keeps them equal)."""

    def num(v) -> str:
        return "—" if v is None else f"{v:g}"

    lines = [
        "| rule | level | masked (or truncated) when | parameters (default) | presets | source |",
        "|---|---|---|---|---|---|",
    ]
    for r in catalogue_records():
        params = ", ".join(f"`{p['name']}`={num(p['default'])}" for p in r["params"])
        presets = "; ".join(
            f"`@{k}` " + ",".join(f"{a}={num(b)}" for a, b in v.items())
            for k, v in r["presets"].items()
        )
        kind = "weight" if r["kind"] == "weight" else r["level"]
        needs = f" (needs {', '.join(r['needs'])})" if r["needs"] else ""
        definition = r["definition"].replace("|", "\\|")
        lines.append(
            f"| `{r['name']}` | {kind} | {definition}{needs} | {params} | {presets or '—'} "
            f"| {r['source']} |"
        )
    return "\n".join(lines)
