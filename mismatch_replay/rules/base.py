"""The base of the rule catalogue: what every rule is built from.

A rule is a frozen dataclass (`Rule`) whose fields are its parameters (`Param`, each with
the `Domain` of values it may take). For fixed values of its other parameters a rule is
"masked iff score > threshold": it implements `score(batch, param)`, the float64 score
against which `param` is swept (the fixed conditions folded in: +inf masked at every
threshold, -inf never), and `threshold(param, value)`, the value mapped into score space
(monotone). The engine bins the scores against the sorted thresholds once and reads every
grid point off a suffix sum; `inclusive = True` makes the comparison `>=` (m2po).

Inputs: token rules read a `TokenBatch` (per-token quantities derived lazily from the two
log-prob columns), sequence rules read `SeqStats`, one field per entry of `SEQ_STATS`: the
table of per-sequence statistics (name, the per-token quantity it aggregates, how partial
values combine) that the engine's numpy and fused paths accumulate.

Arithmetic: `F64` (pmath's exp/expm1/log, the same bits on every CPU) or `F32` (every
value in float32, as the frameworks run on the GPU), chosen by a rule's `precision`
(`OPS`); `round_to` rounds thresholds as torch compares them. A preset whose framework
computes a rule differently from the stable form selects an arithmetic variant
(`Rule.preset_arith`, one of `ARITH`) that the rule's score() implements.

`register` adds a rule class to `REGISTRY`, whose order is the catalogue's. The helpers
the rule modules share (`select`, `as_f64`, `safe_log`, `nan_to`, `band`,
`reciprocal_spec`, `fmt_value`) and the framework source paths the presets cite live here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np

from .. import pmath
from ..errors import UsageError

LOG_CLAMP = 20.0  # |log ratio| clamp before exp for weights and metrics (verl, slime, SkyRL)
PRECISIONS = ("float64", "float32")


# ----------------------------------------------------------------------------- arithmetic


class F64:
    """float64 arithmetic: pmath's exp/expm1/log (the same bits on every CPU)."""

    name = "float64"
    dtype = np.float64
    exp = staticmethod(pmath.exp)
    expm1 = staticmethod(pmath.expm1)
    log = staticmethod(pmath.log)

    @staticmethod
    def cast(x) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)


class F32:
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
        return F32._round(pmath.exp(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def expm1(x):
        return F32._round(pmath.expm1(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def log(x):
        return F32._round(pmath.log(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def cast(x) -> np.ndarray:
        return F32._round(x)


OPS = {"float64": F64, "float32": F32}


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
        self._kl: dict[tuple[str, float], np.ndarray] = {}

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
    def exp_abs_l(self) -> np.ndarray:
        """exp(|l|): prob-error's per-token multiplicative error (its sequence sum)."""
        return self.X.exp(np.abs(self.l))

    @cached_property
    def k2_verl(self) -> np.ndarray:
        """verl's token_k2: 0.5 * clip(l, -20, 20)^2 (rollout_corr_helper.py)."""
        return 0.5 * self.lc * self.lc

    @cached_property
    def k3_verl(self) -> np.ndarray:
        """verl's token_k3: exp(lc) - 1 - lc with lc = clip(l, -20, 20), in that order."""
        return (self.r_clamped - 1.0) - self.lc

    def bkl_qp(self, clamp: float) -> np.ndarray:
        """BKL(q||p) with probabilities clamped to [clamp, 1 - clamp] (binary_kl): dppo-kl's
        quantity, cached per clamp."""
        key = ("qp", clamp)
        if key not in self._kl:
            self._kl[key] = binary_kl(self.lq, self.lp, clamp, self.X)
        return self._kl[key]

    def bkl(self, clamp: float) -> np.ndarray:
        """max(BKL(p||q), BKL(q||p)) at clamp c: kpop's quantity, cached per clamp."""
        key = ("max", clamp)
        if key not in self._kl:
            fwd = binary_kl(self.lp, self.lq, clamp, self.X)
            self._kl[key] = np.maximum(fwd, self.bkl_qp(clamp))
        return self._kl[key]

    def adv(self, rule: str) -> np.ndarray:
        if self.advantage is None:
            raise UsageError(
                f"rule '{rule}' depends on the sign of the advantage, and the log has no "
                "advantage column. Map one with --map advantage=COLUMN, or choose a rule that "
                "does not need it."
            )
        return self.advantage


def binary_kl(la: np.ndarray, lb: np.ndarray, clamp: float, X=F64) -> np.ndarray:
    """BKL(a||b) on the split {this token, the rest}, a and b given as logs, clamped to [c, 1-c].

    Complements come from expm1 (1 - a = -expm1(log a)) so that confident tokens keep their
    precision. `X`: the arithmetic (F64, or F32 for a float32 replay).
    """
    lo, hi = math.log(clamp), math.log1p(-clamp)
    la = np.clip(la, lo, hi)
    lb = np.clip(lb, lo, hi)
    a = X.exp(la)
    ca = np.clip(-X.expm1(la), clamp, 1.0 - clamp)
    cb = np.clip(-X.expm1(lb), clamp, 1.0 - clamp)
    return a * (la - lb) + ca * (X.log(ca) - X.log(cb))


def binary_kl_prob(p: np.ndarray, q: np.ndarray, X=F64) -> np.ndarray:
    """BKL(p||q) from (already clamped) probabilities, as prime-rl's and AReaL's code write
    it: p log(p / q) + (1 - p) log((1 - p) / (1 - q)). In float32 a p or q that rounds to 1
    gives 0 * log(0) = NaN here (AReaL's clamp at 1 - 1e-8 rounds to 1 in float32)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return p * X.log(p / q) + (1.0 - p) * X.log((1.0 - p) / (1.0 - q))


@dataclass(frozen=True)
class SeqStat:
    """One per-sequence statistic the sequence rules read: the per-token quantity it
    aggregates over a sequence's loss tokens and how two partial values of one sequence
    (two batches, two files, two workers) combine."""

    name: str  # the SeqStats field
    combine: str  # "sum" | "max" | "min"
    quantity: str | None  # the TokenBatch attribute aggregated; None: counts the tokens
    optional: bool = False  # kept only when a job reads it (verl's clamped sums)
    replay_precision: bool = True  # read from the batch in the replay's arithmetic
    doc: str = ""

    @property
    def fill(self) -> float:
        """The value of a sequence with no tokens yet: the identity of `combine`."""
        return {"sum": 0.0, "max": -math.inf, "min": math.inf}[self.combine]

    def per_token(self, batch: TokenBatch) -> np.ndarray | None:
        """The per-token values this statistic aggregates (None: it counts tokens)."""
        return None if self.quantity is None else getattr(batch, self.quantity)


# The sequence statistics, in SeqStats' field order. A token whose batch has no advantage
# column adds nothing to sum_adv (SeqStats.has_adv is then False); `sum_adv` reads the
# float64 batch, the others the batch in the replay's precision.
SEQ_STATS: tuple[SeqStat, ...] = (
    SeqStat("n", "sum", None, doc="loss tokens n_i"),
    SeqStat("sum_l", "sum", "l", doc="S_i, the sum of l"),
    SeqStat("sum_k3", "sum", "k3", doc="sum of k3"),
    SeqStat("max_k2", "max", "k2", doc="largest k2"),
    SeqStat("min_l", "min", "l", doc="smallest l (veto)"),
    SeqStat("sum_exp_abs_l", "sum", "exp_abs_l", doc="sum of exp(|l|) (prob-error)"),
    SeqStat("sum_adv", "sum", "advantage", replay_precision=False, doc="sum of the advantage"),
    SeqStat("sum_lc", "sum", "lc", optional=True, doc="sum of clip(l, -20, 20) (verl's k1)"),
    SeqStat("sum_k3c", "sum", "k3_verl", optional=True, doc="sum of verl's token_k3"),
)


@dataclass
class SeqStats:
    """Per-sequence statistics (shape (S,)), one field per entry of SEQ_STATS in its order
    (a test keeps them equal; the optional ones default to None), combinable across
    batches: what sequence rules read."""

    n: np.ndarray  # loss tokens
    sum_l: np.ndarray  # S_i
    sum_k3: np.ndarray
    max_k2: np.ndarray
    min_l: np.ndarray
    sum_exp_abs_l: np.ndarray
    sum_adv: np.ndarray
    has_adv: bool = True  # False: the log has no advantage column (sum_adv stays 0)
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


def safe_log(x: float) -> float:
    """log x, and -inf for x <= 0 (a threshold of 0 is "this side is off")."""
    return -math.inf if x <= 0 else math.log(x)


def select(cond, a, b):
    """np.where(cond, a, b) as float64: how a score folds in a rule's fixed conditions
    (+inf: masked at every threshold, -inf: never masked)."""
    return np.where(cond, a, b).astype(np.float64, copy=False)


def as_f64(x) -> np.ndarray:
    """x as a float64 array: every score() returns float64, whatever its precision."""
    return np.asarray(x, dtype=np.float64)


def nan_to(x, fill: float) -> np.ndarray:
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
            where = f"{'>' if self.lo_open else '>='} {fmt_value(self.lo)}"
        else:
            where = (
                f"in {'(' if self.lo_open else '['}{fmt_value(self.lo)}, {fmt_value(self.hi)}"
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
                f"{where}: {rule}'s {self.name} must be {self.domain.text()}, "
                f"got {fmt_value(value)}."
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
    # The per-token quantity each threshold parameter thresholds, a name of
    # fast.coordinates.QUANTITIES ("|dp|", "log r", "k3", "bkl", ...): with it the fused path
    # bins this rule's own score() on the quantity's coordinate (checked there); without,
    # the rule runs on the simple path.
    quantities: ClassVar[dict[str, str]] = {}
    # Presets whose arithmetic equals the stable form `replace(preset="")` but for rounding
    # near a threshold: arith -> (relative, absolute) bound on the two forms' difference on
    # the quantity's coordinate (`arith_margin`); an arith not listed is another function.
    arith_margins: ClassVar[dict[str, tuple[float, float]]] = {}
    # The parameter `choose --budget` / `compare --budget` moves (default: the first threshold
    # parameter); two-sided bands move their upper side with the lower one fixed.
    primary: ClassVar[str | None] = None
    # How figures show the rule (viz/): `label` the name they print (the rule's `name` when
    # a class sets none: __init_subclass__), `color` its colour in every figure (None: a
    # spare palette colour picked from the name), `panel` the masked-fraction panel its
    # thresholds are drawn in (a key of viz.curves.FAMILIES, or {param: key}; None: the
    # panel of the unit of the quantity the parameter thresholds, `quantities`, else
    # "other"), `bound_on` what its thresholds bound where a panel mixes statistics,
    # `boundary` how the scatter draws its boundary in the (q, p) plane: "band" (|p - q| <=
    # eps), "cone" (low <= p / q <= high), "shift" (p - q <= high, q - p <= low), "bkl" (a
    # binary-KL contour at its phi and clamp), or None (no boundary: not drawable).
    label: ClassVar[str] = ""
    color: ClassVar[str | None] = None
    panel: ClassVar[str | dict[str, str] | None] = None
    bound_on: ClassVar[str] = ""
    boundary: ClassVar[str | None] = None

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "label" not in cls.__dict__ and "name" in cls.__dict__:
            cls.label = cls.name  # a subclass with its own name does not inherit a label

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

    def at_precision(self, b):
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
        vals = ",".join(f"{k}={fmt_value(v)}" for k, v in self.values().items() if v is not None)
        name = f"{self.name}@{self.preset}" if self.preset else self.name
        return f"{name}:{vals}" if vals else name

    def setting(self, exclude: str | None = None) -> str:
        """The fixed parameters as `k=v,...` (the swept one left out)."""
        return ",".join(
            f"{k}={fmt_value(v)}"
            for k, v in self.values().items()
            if k != exclude and v is not None
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

    def arith_margin(self, param: str, values) -> tuple[float, float] | None:
        """How far this preset's arithmetic can be from the stable form's near the
        thresholds `values` of `param`, as (relative, absolute) on the coordinate (the fused
        path runs the stable form and widens its windows by it; the simple path decides the
        tokens inside them with the preset's own formula); None where the two forms can
        differ elsewhere (the simple path runs the job)."""
        return type(self).arith_margins.get(self.arith)


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


def fmt_value(v) -> str:
    """A parameter value as SPECs write it: short (%g) where that reads back as the same
    float, else the shortest repr that does (1/0.999 -> 1.001001001001001)."""
    if v is None:
        return "none"
    s = f"{v:g}"
    return s if float(s) == v else repr(float(v))


REGISTRY: dict[str, type[Rule]] = {}


def register(cls=None, *, after: str | None = None):
    """Make `cls` a frozen dataclass and add it to REGISTRY under `cls.name`.

    The catalogue (`mismatch-replay rules`, README's table) and a sweep's default jobs list
    the rules in REGISTRY's order: registration order, or right after the rule named
    `after` (m2po, in its own module, is listed with the token rules). A class registered
    again under a known name replaces it in place.
    """

    def add(c):
        c = dataclass(frozen=True)(c)
        if after is None or c.name in REGISTRY:
            REGISTRY[c.name] = c
            return c
        items = list(REGISTRY.items())
        at = [k for k, _ in items].index(after) + 1
        items.insert(at, (c.name, c))
        REGISTRY.clear()
        REGISTRY.update(items)
        return c

    return add if cls is None else add(cls)


# Where the presets' arithmetic was read (file @ commit); tests/frameworks.py re-derives each.
PRIME_LOSS = "prime-rl src/prime_rl/trainer/rl/loss.py"
VERL_RC = "verl verl/trainer/ppo/rollout_corr_helper.py"
VERL_CORE = "verl verl/trainer/ppo/core_algos.py"
AREAL_FN = "AReaL areal/utils/functional/functional.py @ cbff54d"
AREAL_ACTOR = "AReaL areal/trainer/ppo/actor.py @ cbff54d"
TRL_GRPO = "trl trl/trainer/grpo_trainer.py @ f2cd577"
SKYRL_OPC = "SkyRL skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py @ a956457"
NEMO_GRPO = "NeMo-RL nemo_rl/algorithms/grpo.py @ 7ea279a"


def band(param: str, x: np.ndarray, lo: float, hi: float):
    """A two-sided band on a ratio x, swept on one side: x < lo or x > hi (ratio space)."""
    if param == "high":
        return select(x < lo, INF, x)
    return select(x > hi, INF, -x)
