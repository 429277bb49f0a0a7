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

Presets are a framework's values, and where its code computes the rule differently from
the stable form in a way that can change a decision, its arithmetic too (`preset_arith`:
ratio-space comparisons, exp(lp) - exp(lq), verl's clamps and inverted k1 bands, the A == 0
side, AReaL's NaN handling; README "Matching your dashboard"). Such a rule keeps the preset's
name (`rule.preset`, in its SPEC: `icepop@verl:low=0.5,high=5`); the bare rule keeps the
stable form. `precision="float32"` (a field of every rule, set by engine.replay) computes the
scores in float32 as the frameworks do on the GPU (`_F32`, `TokenBatch.at`).

Rule SPECs: `ipo:eps=0.3`, `icepop:low=0.2,high=5`, `icepop@verl`, `icepop@verl:high=3`.
Grids: `a,b,c` or `start:stop:num[:log]`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np

from . import pmath
from .errors import UsageError

LOG_CLAMP = 20.0  # |log ratio| clamp before exp for weights and metrics (verl, slime, SkyRL)
PRECISIONS = ("float64", "float32")


# ----------------------------------------------------------------------------- arithmetic


class _F64:
    """float64 arithmetic: pmath's exp/expm1/log (the same bits on every CPU)."""

    name = "float64"
    dtype = np.float64
    exp = staticmethod(pmath.exp)
    expm1 = staticmethod(pmath.expm1)
    log = staticmethod(pmath.log)

    @staticmethod
    def cast(x) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)


class _F32:
    """float32 arithmetic as the frameworks run it on the GPU: every value and every
    operation in float32 (numpy's float32 +, -, *, / are correctly rounded, as the GPU's
    are), exp/expm1/log correctly rounded to float32 (pmath in float64, then rounded once;
    the GPU's expf/logf are within 1-2 ulp of that, so a value within an ulp of a float32
    threshold may decide differently there)."""

    name = "float32"
    dtype = np.float32

    @staticmethod
    def _round(y) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(y, dtype=np.float64).astype(np.float32)

    @staticmethod
    def exp(x):
        return _F32._round(pmath.exp(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def expm1(x):
        return _F32._round(pmath.expm1(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def log(x):
        return _F32._round(pmath.log(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def cast(x) -> np.ndarray:
        return _F32._round(x)


OPS = {"float64": _F64, "float32": _F32}


def round_to(values, precision: str) -> np.ndarray:
    """Thresholds as a framework compares them: a Python float against a float32 tensor is
    rounded to float32 first (torch's scalar promotion), so a float32 replay rounds them too."""
    v = np.asarray(values, dtype=np.float64)
    if precision == "float32":
        with np.errstate(over="ignore"):
            return v.astype(np.float32).astype(np.float64)
    return v


# ----------------------------------------------------------------------------- inputs


class TokenBatch:
    """Per-token quantities of one batch, derived lazily from the two log-prob columns.

    Arrays have shape (n,). `p`, `q` are probabilities, `l = lp - lq`. `precision` is the
    arithmetic every derived value is computed in: "float64" (the default; float64 arrays,
    pmath's exp/log) or "float32" (`at("float32")`: the log-probs rounded to float32 and
    every value computed in float32, as the frameworks do on the GPU).
    """

    def __init__(
        self,
        lp: np.ndarray,
        lq: np.ndarray,
        advantage: np.ndarray | None = None,
        precision: str = "float64",
    ):
        if precision not in OPS:
            raise UsageError(f"--precision {precision}: use one of {', '.join(PRECISIONS)}.")
        self.precision = precision
        self.X = X = OPS[precision]
        self.lp = X.cast(lp)
        self.lq = X.cast(lq)
        self.advantage = None if advantage is None else X.cast(advantage)
        self._views: dict[str, TokenBatch] = {}

    def __len__(self) -> int:
        return self.lp.shape[0]

    def at(self, precision: str) -> TokenBatch:
        """This batch in another arithmetic (cached): the same log-probs, rounded."""
        if precision == self.precision:
            return self
        view = self._views.get(precision)
        if view is None:
            view = self._views[precision] = TokenBatch(self.lp, self.lq, self.advantage, precision)
        return view

    @cached_property
    def l(self) -> np.ndarray:  # noqa: E743 - the log ratio is called l in RULES.md
        return self.lp - self.lq

    @cached_property
    def p(self) -> np.ndarray:
        return self.X.exp(self.lp)

    @cached_property
    def q(self) -> np.ndarray:
        return self.X.exp(self.lq)

    @cached_property
    def abs_dp(self) -> np.ndarray:
        """|p - q| without cancellation: exp(max) * (-expm1(min - max))."""
        hi = np.maximum(self.lp, self.lq)
        lo = np.minimum(self.lp, self.lq)
        return self.X.exp(hi) * -self.X.expm1(lo - hi)

    @cached_property
    def dp(self) -> np.ndarray:
        """p - q (signed), from the stable |dp|."""
        return np.copysign(self.abs_dp, self.l)

    @cached_property
    def dp_prob(self) -> np.ndarray:
        """exp(lp) - exp(lq), as prime-rl and verl compute it (cancels for confident tokens:
        the frameworks' arithmetic, for their presets)."""
        return self.p - self.q

    @cached_property
    def r(self) -> np.ndarray:
        """Importance ratio exp(l), unclamped (may be inf only for absurd logs)."""
        return self.X.exp(self.l)

    @cached_property
    def lc(self) -> np.ndarray:
        """l clamped to +-20, as verl, slime and SkyRL clamp it before exp."""
        return np.clip(self.l, -LOG_CLAMP, LOG_CLAMP)

    @cached_property
    def r_clamped(self) -> np.ndarray:
        """exp(clip(l, -20, 20)): the ratio frameworks use as a weight."""
        return self.X.exp(self.lc)

    @cached_property
    def k2(self) -> np.ndarray:
        with np.errstate(over="ignore"):  # |l| > 1.3e154 (absurd logs): inf, masked, no warning
            return 0.5 * self.l * self.l

    @cached_property
    def k3(self) -> np.ndarray:
        """r - 1 - l, computed as expm1(l) - l (exact near 0; inf only if l > 709)."""
        with np.errstate(over="ignore", invalid="ignore"):  # float32: inf - inf on absurd l
            return self.X.expm1(self.l) - self.l

    @cached_property
    def k2_verl(self) -> np.ndarray:
        """verl's token_k2: 0.5 * clip(l, -20, 20)^2 (rollout_corr_helper.py)."""
        return 0.5 * self.lc * self.lc

    @cached_property
    def k3_verl(self) -> np.ndarray:
        """verl's token_k3: exp(lc) - 1 - lc with lc = clip(l, -20, 20), in that order."""
        return (self.r_clamped - 1.0) - self.lc

    def adv(self, rule: str) -> np.ndarray:
        if self.advantage is None:
            raise UsageError(
                f"rule '{rule}' depends on the sign of the advantage, and the log has no "
                "advantage column. Map one with --map advantage=COLUMN, or choose a rule that "
                "does not need it."
            )
        return self.advantage


def binary_kl(la: np.ndarray, lb: np.ndarray, clamp: float, X=_F64) -> np.ndarray:
    """BKL(a||b) on the split {this token, the rest}, a and b given as logs, clamped to [c, 1-c].

    Complements come from expm1 (1 - a = -expm1(log a)) so that confident tokens keep their
    precision. `X`: the arithmetic (_F64, or _F32 for a float32 replay).
    """
    lo, hi = math.log(clamp), math.log1p(-clamp)
    la = np.clip(la, lo, hi)
    lb = np.clip(lb, lo, hi)
    a = X.exp(la)
    ca = np.clip(-X.expm1(la), clamp, 1.0 - clamp)
    cb = np.clip(-X.expm1(lb), clamp, 1.0 - clamp)
    return a * (la - lb) + ca * (X.log(ca) - X.log(cb))


def binary_kl_prob(p: np.ndarray, q: np.ndarray, X=_F64) -> np.ndarray:
    """BKL(p||q) from (already clamped) probabilities, as prime-rl's and AReaL's code write
    it: p log(p / q) + (1 - p) log((1 - p) / (1 - q)). In float32 a p or q that rounds to 1
    gives 0 * log(0) = NaN here (AReaL's clamp at 1 - 1e-8 rounds to 1 in float32)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return p * X.log(p / q) + (1.0 - p) * X.log((1.0 - p) / (1.0 - q))


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
    sum_lc: np.ndarray | None = None  # sum of clip(l, -20, 20) (verl's k1 sums)
    sum_k3c: np.ndarray | None = None  # sum of verl's token_k3 (l clamped to +-20)

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

    def clamped(self, name: str) -> np.ndarray:
        v = getattr(self, name)
        if v is None:  # pragma: no cover - the engine keeps them when a job needs them
            raise AssertionError(f"internal error: sequence sums lack {name}")
        return v


def _log(x: float) -> float:
    return -math.inf if x <= 0 else math.log(x)


def _where(cond, a, b):
    return np.where(cond, a, b).astype(np.float64, copy=False)


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _nan_to(x, fill: float) -> np.ndarray:
    """A framework's comparison applied to NaN: fill=+inf where it masks NaN (AReaL's
    `metric <= upper` is False), -inf where it keeps it (`a > phi` is False)."""
    x = np.asarray(x)
    return np.where(np.isnan(x), fill, x)


def reciprocal_spec(x: float) -> float:
    """The number a verl user typed in a "lo_hi" k1 threshold whose reciprocal is the ratio
    bound x: 1/x rounded, or the neighbour with the shortest decimal form whose reciprocal
    rounds to x (1 / (1 / 0.999) is not 0.999 in floats; this gives 0.999 back)."""
    if x <= 0:
        return math.inf
    if math.isinf(x):
        return 0.0
    y = 1.0 / x
    best = y
    cand = y
    for direction in (math.inf, -math.inf):
        cand = y
        for _ in range(4):
            cand = math.nextafter(cand, direction)
            if 1.0 / cand == x and len(repr(cand)) < len(repr(best)):
                best = cand
    return best


INF = math.inf


# ----------------------------------------------------------------------------- catalogue


@dataclass(frozen=True)
class Domain:
    """The values a parameter may take: [lo, hi], either end open; checked when a SPEC or a
    GRID is parsed, so a nonsense setting is a usage error instead of a table of 100%."""

    lo: float = 0.0
    hi: float = INF
    lo_open: bool = False
    hi_open: bool = False
    off: bool = False  # 0 means "this side is off" (it is also inside [lo, hi])

    def __contains__(self, v: float) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def text(self) -> str:
        if self.lo == -INF and self.hi == INF:
            return "a finite number"
        if self.hi == INF:
            where = f"{'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        else:
            where = (
                f"in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}"
                f"{')' if self.hi_open else ']'}"
            )
        return where + (" (0 = off)" if self.off else "")


REAL = Domain(-INF)  # a threshold on a signed mean (opsm's delta)
NONNEG = Domain()  # a threshold on a magnitude: |dp|, a KL, k2, k3, a log-ratio drop
POSITIVE = Domain(lo_open=True)  # a cap, m2po's budget
UNIT = Domain(0.0, 1.0)  # 1 - eps_low >= 0, a veto ratio
RATIO_LOW = Domain(0.0, 1.0, off=True)  # a band's lower ratio bound: r = 1 is always kept
RATIO_HIGH = Domain(1.0)  # a band's upper ratio bound
AT_LEAST_1 = Domain(1.0)  # dual-clip's c; prob-error's mean exp|l| is >= 1 by construction
CLAMP = Domain(0.0, 0.5, lo_open=True, hi_open=True)  # clamp c: [c, 1 - c] must be an interval


@dataclass(frozen=True)
class Param:
    name: str
    doc: str
    grid: str  # default sweep grid (GRID syntax)
    threshold: bool = True  # sweeping it is a one-pass threshold sweep
    domain: Domain = NONNEG

    def check(self, rule: str, value: float, where: str) -> None:
        """A usage error naming the parameter and its domain when `value` lies outside."""
        if value not in self.domain:
            raise UsageError(
                f"{where}: {rule}'s {self.name} must be {self.domain.text()}, got {_fmt(value)}."
            )


@dataclass(frozen=True)
class Rule:
    """Base of every rule; subclasses are frozen dataclasses whose fields are the parameters.

    Two keyword-only fields are not parameters: `preset` names the framework preset whose
    arithmetic the rule follows (set by `name@preset` when that framework computes the rule
    differently from the stable form: a ratio-space comparison, exp(lp) - exp(lq), a clamp,
    +1e-8, the A == 0 side; `arith` says which), and `precision` the arithmetic of the replay
    ("float64", or "float32" as the frameworks run it).
    """

    preset: str = field(default="", kw_only=True)
    precision: str = field(default="float64", kw_only=True)

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
    # Presets whose framework computes the rule differently from the stable form: preset ->
    # the arithmetic variant (ARITH) that `score()` then runs.
    preset_arith: ClassVar[dict[str, str]] = {}
    # Where each preset's values and arithmetic were read: preset -> "file @ commit".
    preset_sources: ClassVar[dict[str, str]] = {}
    inclusive: ClassVar[bool] = False
    # The parameter `choose --budget` / `compare --budget` moves (default: the first threshold
    # parameter); two-sided bands move their upper side with the lower one fixed.
    primary: ClassVar[str | None] = None

    def __post_init__(self):
        if self.precision not in OPS:
            raise UsageError(f"--precision {self.precision}: use one of {', '.join(PRECISIONS)}.")
        for p in self.params:
            v = getattr(self, p.name)
            if v is not None:
                p.check(self.name, float(v), f"rule '{self.name}'")

    # -- arithmetic
    @property
    def arith(self) -> str:
        """The arithmetic variant score() runs: "" (the stable form) or one of ARITH."""
        return type(self).preset_arith.get(self.preset, "")

    @property
    def X(self):
        return OPS[self.precision]

    def _tb(self, b):
        """The batch in this rule's precision (a TokenBatch; SeqStats pass through)."""
        return b.at(self.precision) if isinstance(b, TokenBatch) else b

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
        name = f"{self.name}@{self.preset}" if self.preset else self.name
        return f"{name}:{vals}" if vals else name

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


# The arithmetic variants a preset can select (Rule.preset_arith); every rule's score()
# implements the ones its presets use.
ARITH = {
    "prob": "p - q as exp(lp) - exp(lq) (cancels for confident tokens), not the stable |dp|",
    "ratio": "the ratio exp(l) compared with the bounds (ratio space), l unclamped",
    "ratio-clamp": "the ratio exp(clip(l, -20, 20)) compared with the bounds (ratio space)",
    "verl-k1": "verl's *_k1 test: -clip(l, -20, 20) (summed or averaged) against "
    "[log lo, log hi] of its 'lo_hi' threshold, lo = 1/high, hi = 1/low",
    "verl": "verl's own formula (see the preset note)",
    "prime-rl": "prime-rl's formula: probabilities clamped, then p log(p/q) + ...; NaN kept",
    "areal": "AReaL's formula (see the preset note); NaN masked",
}


def _fmt(v) -> str:
    """A parameter value as SPECs write it: short (%g) where that reads back as the same
    float, else the shortest repr that does (1/0.999 -> 1.001001001001001)."""
    if v is None:
        return "none"
    s = f"{v:g}"
    return s if float(s) == v else repr(float(v))


REGISTRY: dict[str, type[Rule]] = {}


def register(cls):
    cls = dataclass(frozen=True)(cls)
    REGISTRY[cls.name] = cls
    return cls


def _other(param: str, a: str, b: str) -> str:
    return b if param == a else a


# ---- token rules, advantage-independent

# Where the presets' arithmetic was read (file @ commit); tests/frameworks.py re-derives each.
PRIME_LOSS = "prime-rl src/prime_rl/trainer/rl/loss.py"
VERL_RC = "verl verl/trainer/ppo/rollout_corr_helper.py"
VERL_CORE = "verl verl/trainer/ppo/core_algos.py"
AREAL_FN = "AReaL areal/utils/functional/functional.py @ cbff54d"
AREAL_ACTOR = "AReaL areal/trainer/ppo/actor.py @ cbff54d"
TRL_GRPO = "trl trl/trainer/grpo_trainer.py @ f2cd577"
SKYRL_OPC = "SkyRL skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py @ a956457"
NEMO_GRPO = "NeMo-RL nemo_rl/algorithms/grpo.py @ 7ea279a"


def _band(param: str, x: np.ndarray, lo: float, hi: float):
    """A two-sided band on a ratio x, swept on one side: x < lo or x > hi (ratio space)."""
    if param == "high":
        return _where(x < lo, INF, x)
    return _where(x > hi, INF, -x)


@register
class IPO(Rule):
    name = "ipo"
    title = "INTELLECT Policy Optimization"
    source = "prime-rl (IPO docs, 2026)"
    definition = "|p - q| > eps (strict; two-sided)"
    params = (Param("eps", "probability band half-width", "0.001:1:121:log"),)
    presets = {"prime-rl": {"eps": 0.3}, "prime-rl-legacy": {"eps": 0.1}}
    preset_notes = {
        "prime-rl": "|exp(lp) - exp(lq)| > eps as prime-rl computes it (ipo_loss_fn)",
        "prime-rl-legacy": "prime-rl's IPO default before 2026-09-18; |exp(lp) - exp(lq)|",
    }
    preset_arith = {"prime-rl": "prob", "prime-rl-legacy": "prob"}
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS} ipo_loss_fn @ 559b447",
        "prime-rl-legacy": f"{PRIME_LOSS} ipo_loss_fn @ 559b447 (ipo_threshold 0.1)",
    }
    eps: float | None = 0.3

    def score(self, b, param):
        b = self._tb(b)
        if self.arith == "prob":
            return _f64(np.abs(b.dp_prob))
        return _f64(b.abs_dp)


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
    preset_notes = {"prime-rl-legacy": "exp(lp) - exp(lq) against both sides, as prime-rl did"}
    preset_arith = {"prime-rl-legacy": "prob"}
    preset_sources = {"prime-rl-legacy": f"{PRIME_LOSS} default_loss_fn @ 02bdca2"}
    low: float | None = 0.2
    high: float | None = 0.2

    def score(self, b, param):
        b = self._tb(b)
        dp = b.dp_prob if self.arith == "prob" else b.dp
        if param == "high":
            return _where(dp < -self.low, INF, dp)
        return _where(dp > self.high, INF, -dp)


@register
class IcePop(Rule):
    primary = "high"
    name = "icepop"
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
        "verl": {"low": 0.5, "high": 5.0},
        "areal": {"low": 0.5, "high": 5.0},
        "paper": {"low": 0.5, "high": 5.0},
    }
    preset_notes = {
        "prime-rl": "exp(l) against [low, high] in ratio space",
        "verl": "exp(clip(l, -20, 20)) against [low, high] in ratio space",
        "areal": "exp(l) against [lower, upper] in ratio space (metric 'ratio')",
    }
    preset_arith = {"prime-rl": "ratio", "verl": "ratio-clamp", "areal": "ratio"}
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS} default_loss_fn @ 3c3248d",
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (token) @ 7522bef",
        "areal": f"{AREAL_FN} apply_rejection_sampling",
    }
    low: float | None = 0.5
    high: float | None = 5.0

    def threshold(self, param, value):
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            return float(value) if param == "high" else -float(value)
        if a == "verl-k1":  # keep iff log(1/high) <= -clip(l) <= log(1/low)
            if param == "high":
                return -_log(reciprocal_spec(value))
            return _log(reciprocal_spec(value))
        return _log(value) if param == "high" else -_log(value)

    def score(self, b, param):
        b = self._tb(b)
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            r = b.r if a == "ratio" else b.r_clamped
            return _band(param, r, self.low, self.high)
        if a == "verl-k1":
            k1 = -b.lc
            if param == "high":  # masked iff k1 < log(lo): -k1 = lc > -log(lo)
                return _where(k1 > _log(reciprocal_spec(self.low)), INF, b.lc)
            return _where(k1 < _log(reciprocal_spec(self.high)), INF, k1)
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
        "verl": "exp(clip(l, -20, 20)) against [low, high] in ratio space",
        "trl": "token_mask: exp(l) against [C_min, C_max] in ratio space (TRL's docs' example)",
        "verl-k1": "verl's token_k1 rejection at its own example threshold '0.6_1.6'",
    }
    preset_quirks = {
        "verl-k1": "verl's *_k1 rejection with a 'lo_hi' threshold keeps 1/hi <= r <= 1/lo: "
        "its example '0.6_1.6' keeps r in [0.625, 1.667], not [0.6, 1.6]; this preset "
        "follows the code. For another 'lo_hi' use token-mis@verl-k1:low=1/hi,high=1/lo.",
    }
    preset_arith = {"verl": "ratio-clamp", "trl": "ratio", "verl-k1": "verl-k1"}
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (token) @ 7522bef",
        "trl": f"{TRL_GRPO} token_mask",
        "verl-k1": f"{VERL_RC} compute_rollout_rejection_mask (token_k1) @ b178a3c",
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
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS} kpop_loss_fn @ b9ba060 (branch feat/kpop-loss)",
        "areal": f"{AREAL_FN} compute_binary_kl_divergence, apply_rejection_sampling",
    }
    phi: float | None = 0.1
    clamp: float | None = 1e-6

    def score(self, b, param):
        b = self._tb(b)
        X = b.X
        if self.arith in ("prime-rl", "areal"):
            c = self.clamp
            p = np.clip(b.p, c, 1.0 - c)
            q = np.clip(b.q, c, 1.0 - c)
            fwd = binary_kl_prob(p, q, X)
            rev = binary_kl_prob(q, p, X)
            if self.arith == "prime-rl":  # fwd > phi | rev > phi: a NaN side never masks
                return _f64(_nan_to(np.fmax(fwd, rev), -INF))
            return _f64(_nan_to(np.maximum(fwd, rev), INF))  # not (max <= upper)
        s = np.maximum(binary_kl(b.lp, b.lq, self.clamp, X), binary_kl(b.lq, b.lp, self.clamp, X))
        return _f64(_nan_to(s, -INF))


@register
class TokenK2(Rule):
    name = "token-k2"
    title = "token k2 rejection"
    source = "verl rollout correction"
    definition = "k2 = l^2/2 > hi"
    params = (Param("hi", "k2 threshold", "0.0001:10:121:log"),)
    presets = {"verl": {}}
    preset_notes = {"verl": "token_k2: l clamped to +-20 first (k2 <= 200); no default hi"}
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_RC} compute_rollout_rejection_mask (token_k2) @ b178a3c"}
    hi: float | None = None

    def score(self, b, param):
        b = self._tb(b)
        return _f64(b.k2_verl if self.arith == "verl" else b.k2)


@register
class TokenK3(Rule):
    name = "token-k3"
    title = "token k3 rejection"
    source = "verl rollout correction"
    definition = "k3 = r - 1 - l > hi"
    params = (Param("hi", "k3 threshold", "0.0001:10:121:log"),)
    presets = {"verl": {}}
    preset_notes = {"verl": "token_k3: exp(lc) - 1 - lc with lc = clip(l, -20, 20); no default hi"}
    preset_arith = {"verl": "verl"}
    preset_sources = {"verl": f"{VERL_RC} compute_rollout_rejection_mask (token_k3) @ b178a3c"}
    hi: float | None = None

    def score(self, b, param):
        b = self._tb(b)
        return _f64(b.k3_verl if self.arith == "verl" else b.k3)


@register
class M2PO(Rule):
    name = "m2po"
    title = "M2PO second-moment budget"
    source = "arXiv 2510.01161"
    definition = "per step: mask the largest l^2 until the mean l^2 of the rest is < tau"
    level = "step"
    inclusive = True  # the token of rank m is masked iff mean(rest from m on) >= tau
    params = (Param("tau", "budget on the mean of l^2 per step", "0.0001:1:121:log"),)
    presets = {"paper": {"tau": 0.04}, "areal": {"tau": 0.04}}
    preset_notes = {
        "areal": "AReaL's _apply_m2po_masking: when no tail brings the mean under tau, all "
        "but one token (the smallest l^2) are masked, where the bare rule masks all; AReaL "
        "ranks each micro-batch, the replay each step",
    }
    preset_arith = {"areal": "areal"}
    preset_sources = {"areal": f"{AREAL_ACTOR} _get_m2po_loss_mask"}
    tau: float | None = 0.04

    @property
    def keep_last(self) -> bool:
        """AReaL never masks a step's last-ranked token (smallest l^2)."""
        return self.arith == "areal"

    def score(self, b, param):
        b = self._tb(b)
        return _f64(b.l * b.l)  # the engine turns per-step sorted l^2 into suffix means


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
    preset_notes = {
        "prime-rl": "A == 0 goes to the low side, as prime-rl's code does; exp(lp) - exp(lq)",
        "verl": "A <= 0 on the low side (torch.where(A > 0, ...)); exp(lp) - exp(lq)",
    }
    preset_arith = {"prime-rl": "prob", "verl": "prob"}
    preset_sources = {
        "prime-rl": f"{PRIME_LOSS} default_loss_fn @ 559b447",
        "verl": f"{VERL_CORE} compute_policy_loss_dppo_tv @ 1dda039",
    }
    low: float | None = 0.2
    high: float | None = 0.2

    def score(self, b, param):
        b = self._tb(b)
        a = b.adv(self.name)
        dp = b.dp_prob if self.arith == "prob" else b.dp
        if param == "high":
            return _where((a <= 0) & (dp < -self.low), INF, _where(a > 0, dp, -INF))
        return _where((a > 0) & (dp > self.high), INF, _where(a <= 0, -dp, -INF))


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
    low: float | None = 0.05
    high: float | None = 0.05
    clamp: float | None = 1e-6

    def _verl(self, b):
        p, q = b.p, b.q
        with np.errstate(divide="ignore", invalid="ignore"):
            bkl = q * (b.lq - b.lp) + (1.0 - q) * b.X.log(((1.0 - q) + 1e-8) / ((1.0 - p) + 1e-8))
        # verl keeps a token iff bkl <= bound | p <= q (resp. p >= q): a NaN bkl fails
        return _nan_to(bkl, INF), p > q, p < q

    def score(self, b, param):
        b = self._tb(b)
        a = b.adv(self.name)
        if self.arith == "verl":
            bkl, rise, drop = self._verl(b)
            up = (a > 0) & rise
            down = (a <= 0) & drop
        else:
            bkl = _nan_to(binary_kl(b.lq, b.lp, self.clamp, b.X), -INF)
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
        Param("eps_low", "lower clip 1 - eps_low", "0.001:0.999:121:log", domain=UNIT),
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
        b = self._tb(b)
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
    params = (
        *PPOClip.params,
        Param("c", "dual-clip bound for A < 0", "1.01:100:121:log", domain=AT_LEAST_1),
    )
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
    params = (Param("cap", "weight cap", "1.01:100:121:log", domain=POSITIVE),)
    presets = {"verl": {"cap": 2.0}, "paper": {"cap": 2.0}, "trl": {"cap": 3.0}}
    preset_notes = {
        "verl": "exp(clip(l, -20, 20)) > cap, in ratio space",
        "trl": "token_truncate: exp(l) > C_max, in ratio space",
    }
    preset_arith = {"verl": "ratio-clamp", "trl": "ratio"}
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_correction_weights (token) @ b178a3c",
        "trl": f"{TRL_GRPO} token_truncate",
    }
    cap: float | None = 2.0

    def threshold(self, param, value):
        return float(value) if self.arith else _log(value)

    def score(self, b, param):
        b = self._tb(b)
        if self.arith == "ratio":
            return _f64(b.r)
        if self.arith == "ratio-clamp":
            return _f64(b.r_clamped)
        return _f64(b.l)

    def weight(self, b, param):
        return _f64(b.r_clamped)


@register
class CISPO(Rule):
    primary = "high"
    name = "cispo"
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
    low: float | None = 0.0
    high: float | None = 5.0

    def threshold(self, param, value):
        if self.arith == "ratio":
            return float(value) if param == "high" else -float(value)
        return _log(value) if param == "high" else -_log(value)

    def score(self, b, param):
        b = self._tb(b)
        if self.arith == "ratio":
            return _band(param, b.r, self.low, self.high)
        if param == "high":
            return _where(b.l < _log(self.low), INF, b.l)
        return _where(b.l > _log(self.high), INF, -b.l)

    def weight(self, b, param):
        if param == "high":
            return _where(b.l < _log(self.low), self.low, b.r_clamped)
        return _where(b.l > _log(self.high), self.high, b.r_clamped)


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
        return float(value) if self.arith else _log(value)

    def score(self, s, param):
        if self.arith in ("ratio", "ratio-clamp"):
            return _f64(_seq_ratio(self, s.sum_l, self.arith == "ratio-clamp"))
        return _f64(self.X.cast(s.sum_l))

    def weight(self, s, param):
        return pmath.exp(np.clip(s.sum_l, -LOG_CLAMP, LOG_CLAMP))


class _SeqBand(Rule):
    """exp(x) outside [low, high], x a per-sequence log quantity; low = 0 means no low bound."""

    level = "sequence"
    needs = ("sample_id",)
    mean = False  # x = S_i (False) or G_i = S_i / n_i (True)

    def _x(self, s) -> np.ndarray:
        return _seq_mean(self, s.sum_l, s.n) if self.mean else self.X.cast(s.sum_l)

    def _k1(self, s) -> np.ndarray:
        """verl's k1 statistic: -sum of clip(l, -20, 20), or its mean over the tokens."""
        lc = s.clamped("sum_lc")
        y = _seq_mean(self, lc, s.n) if self.mean else self.X.cast(lc)
        return -y

    def threshold(self, param, value):
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            return float(value) if param == "high" else -float(value)
        if a == "verl-k1":
            if param == "high":
                return -_log(reciprocal_spec(value))
            return _log(reciprocal_spec(value))
        return _log(value) if param == "high" else -_log(value)

    def score(self, s, param):
        a = self.arith
        if a in ("ratio", "ratio-clamp"):
            g = _seq_ratio(self, self._x(s), a == "ratio-clamp")
            return _band(param, g, self.low, self.high)
        if a == "verl-k1":
            k1 = self._k1(s)
            if param == "high":
                return _where(k1 > _log(reciprocal_spec(self.low)), INF, -k1)
            return _where(k1 < _log(reciprocal_spec(self.high)), INF, k1)
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
        Param("low", "lower bound on the product ratio", "0.0001:0.99:121:log", domain=RATIO_LOW),
        Param("high", "upper bound on the product ratio", "1.01:10000:121:log", domain=RATIO_HIGH),
    )
    presets = {"verl": {"low": 0.5, "high": 2.0}, "trl": {"low": 0.0, "high": 3.0}}
    preset_notes = {
        "verl": "seq_sum_k1 '0.5_2.0': -sum of clip(l, -20, 20) against [log 0.5, log 2] "
        "(verl's k1 bands are inverted, but this one is symmetric)",
        "trl": "sequence_mask: exp(S_i) > C_max (no C_min), in ratio space",
    }
    preset_arith = {"verl": "verl-k1", "trl": "ratio"}
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (seq_sum_k1) @ b178a3c",
        "trl": f"{TRL_GRPO} sequence_mask",
    }
    low: float | None = 0.5
    high: float | None = 2.0


@register
class GeoMIS(_SeqBand):
    primary = "high"
    name = "geo-mis"
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
        "prime-rl-legacy": {"low": 0.1, "high": 10.0},
    }
    preset_notes = {
        "verl": "seq_mean_k1 '0.999_1.001' (verl's default): -mean of clip(l, -20, 20) "
        "against [log 0.999, log 1.001], i.e. exp(G) kept in [1/1.001, 1/0.999]",
        "skyrl": "geometric: exp(clip(G_i, -20, 20)) outside [low, high], ratio space",
        "prime-rl-legacy": "exp(G_i) outside [geo_mask_low, geo_mask_high], ratio space",
    }
    preset_quirks = {
        "verl": "verl's seq_mean_k1 with a 'lo_hi' threshold keeps 1/hi <= exp(G) <= 1/lo: "
        "its default '0.999_1.001' keeps exp(G) in [0.999001, 1.001001]; this preset "
        "follows the code.",
    }
    preset_arith = {"verl": "verl-k1", "skyrl": "ratio-clamp", "prime-rl-legacy": "ratio"}
    preset_sources = {
        "verl": f"{VERL_RC} compute_rollout_rejection_mask (seq_mean_k1) @ b178a3c",
        "skyrl": f"{SKYRL_OPC} compute_sequence_mask (geometric)",
        "prime-rl-legacy": f"{PRIME_LOSS} compute_loss (geo_mask) @ 5f47740",
    }
    low: float | None = 0.999
    high: float | None = 1.001


@register
class SeqMeanK3(Rule):
    name = "seq-mean-k3"
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
        total = s.clamped("sum_k3c") if self.arith == "verl" else s.sum_k3
        return _f64(_seq_mean(self, total, s.n))


@register
class SeqMaxK2(Rule):
    name = "seq-max-k2"
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
        m = self.X.cast(s.max_k2)
        return _f64(np.minimum(m, 0.5 * LOG_CLAMP * LOG_CLAMP) if self.arith == "verl" else m)


@register
class Veto(Rule):
    name = "veto"
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
    v: float | None = 1e-4

    def threshold(self, param, value):
        return -_log(value)

    def score(self, s, param):
        return _f64(-self.X.cast(s.min_l))


@register
class OPSM(Rule):
    name = "opsm"
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
        return _where(s.adv(self.name) < 0, -_seq_mean(self, s.sum_l, s.n), -INF)


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
        g = self.X.exp(_seq_mean(self, s.sum_l, s.n))
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
    params = (
        Param("tau", "threshold on the mean of exp(|l|)", "1.0001:10:121:log", domain=AT_LEAST_1),
    )
    presets = {"nemo-rl": {"tau": 1.5}}
    preset_notes = {"nemo-rl": "the same arithmetic as the bare rule (mean of exp|l| > tau)"}
    preset_sources = {"nemo-rl": f"{NEMO_GRPO} compute_and_apply_seq_logprob_error_masking"}
    tau: float | None = 1.5

    def score(self, s, param):
        return _f64(_seq_mean(self, s.sum_exp_abs_l, s.n))


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
    values: dict[str, float | str] = {}
    if m["preset"]:
        try:
            values.update(cls.presets[m["preset"]])
        except KeyError:
            known = ", ".join(cls.presets) or "none"
            raise UsageError(
                f"rule '{cls.name}' has no preset '{m['preset']}'; its presets: {known}."
            ) from None
        if cls.preset_arith.get(m["preset"]):  # the preset follows its framework's arithmetic
            values["preset"] = m["preset"]
    if m["kv"]:
        given: set[str] = set()
        for item in m["kv"].split(","):
            if not item.strip():
                continue
            if "=" not in item:
                raise UsageError(f"bad rule SPEC '{spec}': '{item}' is not param=value.")
            k, v = item.split("=", 1)
            k = k.strip()
            param = cls.param(k)
            if k in given:
                raise UsageError(f"bad rule SPEC '{spec}': {k} is given twice; give it once.")
            given.add(k)
            values[k] = _number(v, f"rule SPEC '{spec}', {k}")
            param.check(cls.name, values[k], f"rule SPEC '{spec}'")
    return cls(**values)


def spec_warnings(specs) -> list[str]:
    """One-line warnings for the presets among `specs` that follow a framework's quirk."""
    out = []
    for spec in specs:
        if isinstance(spec, Rule):  # a parsed preset keeps its name when it has arithmetic
            name, preset = spec.name, spec.preset
        elif isinstance(spec, str):
            m = _SPEC.match(spec.strip())
            if not (m and m["preset"] and m["name"] in REGISTRY):
                continue
            name, preset = m["name"], m["preset"]
        else:
            continue
        quirk = REGISTRY[name].preset_quirks.get(preset) if name in REGISTRY else None
        line = f"{name}@{preset}: {quirk}"
        if quirk and line not in out:
            out.append(line)
    return out


MAX_GRID = 100_000  # values in one grid: each costs memory in every group of its job


def _grid_too_large(text: str, n: int) -> UsageError:
    return UsageError(
        f"bad GRID '{text}': {n:,} values; a grid holds at most {MAX_GRID:,} (each value costs "
        "memory in every group of every job: 1e7 values took 20 GiB). Counts are exact at every "
        "grid point whatever the spacing: narrow start:stop to the region that matters, or let "
        "choose refine it."
    )


def check_grid_size(values, text: str) -> None:
    n = int(np.size(values))
    if n > MAX_GRID:
        raise _grid_too_large(text, n)


def parse_grid(text: str) -> np.ndarray:
    """`a,b,c` or `start:stop:num[:log]` -> float64 values (sorted, unique), at most MAX_GRID."""
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
        if num > MAX_GRID:
            raise _grid_too_large(text, num)
        if len(parts) == 4 and parts[3] == "log":
            if start <= 0 or stop <= 0:
                raise UsageError(f"bad GRID '{text}': a log grid needs start and stop > 0.")
            vals = np.geomspace(start, stop, num)
        else:
            vals = np.linspace(start, stop, num)
    else:
        items = [x for x in t.split(",") if x.strip()]
        if len(items) > MAX_GRID:
            raise _grid_too_large(text, len(items))
        vals = np.array([_number(x, f"GRID '{text}'") for x in items])
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
                        "domain": p.domain.text(),
                    }
                    for p in cls.params
                ],
                "presets": {k: dict(v) for k, v in cls.presets.items()},
                "preset_notes": dict(cls.preset_notes),
                "preset_quirks": dict(cls.preset_quirks),
                "preset_arith": {k: v for k, v in cls.preset_arith.items() if v},
                "preset_sources": dict(cls.preset_sources),
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
            (f"`@{k}` " + ",".join(f"{a}={num(b)}" for a, b in v.items())).rstrip()
            + (f" ({r['preset_arith'][k]})" if k in r["preset_arith"] else "")
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


def presets_markdown() -> str:
    """Every preset with its arithmetic and where it was read (README "Matching your
    dashboard"; a test keeps them equal)."""
    lines = [
        "| preset | values | arithmetic | read from |",
        "|---|---|---|---|",
    ]
    for r in catalogue_records():
        for k, v in r["presets"].items():
            vals = ",".join(f"{a}={'—' if b is None else f'{b:g}'}" for a, b in v.items())
            arith = r["preset_arith"].get(k, "")
            note = r["preset_notes"].get(k, "")
            how = f"`{arith}`: {note}" if arith else (note or "the bare rule's arithmetic")
            src = r["preset_sources"].get(k, "— (no code: the paper or docs' values)")
            how = how.replace("|", "\\|")
            lines.append(f"| `{r['name']}@{k}` | {vals or 'defaults'} | {how} | {src} |")
    return "\n".join(lines)
