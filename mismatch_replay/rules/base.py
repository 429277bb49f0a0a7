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

from .. import crmath, pmath
from ..errors import UsageError

EXACT_MARGIN = (1e-13, 0.0)  # crmath's exp/expm1 against pmath's (3 ulps), relative
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


class F64CR(F64):
    """float64 arithmetic with correctly rounded exp and expm1 (crmath): a framework preset's
    formula in exact arithmetic, deciding its ties as torch does (exp(log 0.8) is
    0.7999999999999999, pmath's 0.8). log and cast are F64's."""

    exp = staticmethod(crmath.exp)
    expm1 = staticmethod(crmath.expm1)


def _round32(y64: np.ndarray, x: np.ndarray, exact) -> np.ndarray:
    """y64 (pmath, within 3 ulps of f(x)) rounded to float32, correctly: where y64 lies
    within 16 float64 ulps of a float32 rounding boundary the correctly rounded float64
    `exact(x)` is rounded instead (a few values in a million)."""
    with np.errstate(over="ignore", invalid="ignore"):
        y32 = y64.astype(np.float32)
        back = y32.astype(np.float64)
        half = (
            np.minimum(
                np.abs(np.spacing(y32)), np.abs(np.spacing(np.nextafter(y32, np.float32(0))))
            ).astype(np.float64)
            * 0.5
        )
        near = np.abs(half - np.abs(y64 - back)) <= 16.0 * np.abs(np.spacing(y64))
        near &= np.isfinite(y64) & (y64 != 0.0)
    if near.any():
        y32[near] = exact(x[near]).astype(np.float32)
    return y32


class F32:
    """float32 arithmetic as the frameworks run it on the GPU: every value and every
    operation in float32 (numpy's float32 +, -, *, / are correctly rounded, as the GPU's
    are), exp/expm1/log correctly rounded to float32 (pmath in float64, rounded once; near
    a float32 rounding boundary the correctly rounded float64 of crmath, rounded: torch's
    expf on these values; a GPU's expf is within 1-2 ulp of it, so a value within an ulp of
    a float32 threshold may decide differently there)."""

    name = "float32"
    dtype = np.float32

    @staticmethod
    def _round(y) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(y, dtype=np.float64).astype(np.float32)

    @staticmethod
    def exp(x):
        x = np.asarray(x, dtype=np.float64)
        x1 = np.atleast_1d(x)
        return _round32(np.asarray(pmath.exp(x1)), x1, crmath.exp).reshape(x.shape)

    @staticmethod
    def expm1(x):
        x = np.asarray(x, dtype=np.float64)
        x1 = np.atleast_1d(x)
        return _round32(np.asarray(pmath.expm1(x1)), x1, crmath.expm1).reshape(x.shape)

    @staticmethod
    def log(x):
        return F32._round(pmath.log(np.asarray(x, dtype=np.float64)))

    @staticmethod
    def cast(x) -> np.ndarray:
        return F32._round(x)


# "exact": a framework preset's formula in float64 with correctly rounded exp (F64CR); the
# user-facing names are PRECISIONS ("float64" selects it for a preset, F64 for a bare rule)
OPS = {"float64": F64, "float32": F32, "exact": F64CR}


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
    (two batches, two files, two workers) combine. `extras`: the kinds of job that need it
    kept (empty: always kept; "clamped": verl's clamped sums; "f32": a sequence rule
    replayed in float32, whose statistics come from the float32 batch, `f32`)."""

    name: str  # the SeqStats field
    combine: str  # "sum" | "max" | "min"
    quantity: str | None  # the TokenBatch attribute aggregated; None: counts the tokens
    extras: frozenset = frozenset()
    f32: bool = False  # from the batch in float32 (else the float64 batch)
    doc: str = ""

    @property
    def optional(self) -> bool:
        return bool(self.extras)

    def kept(self, extras) -> bool:
        """Whether a Tally with these extras (a set of kinds) keeps this statistic."""
        return self.extras <= set(extras)

    @property
    def fill(self) -> float:
        """The value of a sequence with no tokens yet: the identity of `combine`."""
        return {"sum": 0.0, "max": -math.inf, "min": math.inf}[self.combine]

    def per_token(self, batch: TokenBatch) -> np.ndarray | None:
        """The per-token values this statistic aggregates (None: it counts tokens), from
        `batch` (float64) or, for a float32 statistic, the batch in float32."""
        if self.quantity is None:
            return None
        return getattr(batch.at("float32") if self.f32 else batch, self.quantity)


_CLAMPED = frozenset({"clamped"})
_F32 = frozenset({"f32"})
# The sequence statistics, in SeqStats' field order. A token whose batch has no advantage
# column adds nothing to sum_adv (SeqStats.has_adv is then False). Each statistic of the
# log ratio has a float32 twin (`_f32`, from the float32 batch: lp and lq rounded, l and
# its functions in float32, added in float64), kept when a sequence rule replays in float32.
_BASE_STATS = (
    SeqStat("n", "sum", None, doc="loss tokens n_i"),
    SeqStat("sum_l", "sum", "l", doc="S_i, the sum of l"),
    SeqStat("sum_k3", "sum", "k3", doc="sum of k3"),
    SeqStat("max_k2", "max", "k2", doc="largest k2"),
    SeqStat("min_l", "min", "l", doc="smallest l (veto)"),
    SeqStat("sum_exp_abs_l", "sum", "exp_abs_l", doc="sum of exp(|l|) (prob-error)"),
    SeqStat("sum_adv", "sum", "advantage", doc="sum of the advantage"),
    SeqStat("sum_lc", "sum", "lc", _CLAMPED, doc="sum of clip(l, -20, 20) (verl's k1)"),
    SeqStat("sum_k3c", "sum", "k3_verl", _CLAMPED, doc="sum of verl's token_k3"),
)
F32_TWINS = (
    "sum_l",
    "sum_k3",
    "max_k2",
    "min_l",
    "sum_exp_abs_l",
    "sum_lc",
    "sum_k3c",
)
SEQ_STATS: tuple[SeqStat, ...] = (
    *_BASE_STATS,
    *(
        dataclasses.replace(
            s, name=f"{s.name}_f32", extras=s.extras | _F32, f32=True, doc=f"{s.doc}, float32"
        )
        for s in _BASE_STATS
        if s.name in F32_TWINS
    ),
)


@dataclass
class SeqStats:
    """Per-sequence statistics (shape (S,)), one field per entry of SEQ_STATS in its order
    (a test keeps them equal; the optional ones default to None), combinable across
    batches: what sequence rules read (`Rule.seq_stat` picks the float32 twin for a rule
    replayed in float32)."""

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
    sum_l_f32: np.ndarray | None = None  # the float32 twins (kept for float32 replays)
    sum_k3_f32: np.ndarray | None = None
    max_k2_f32: np.ndarray | None = None
    min_l_f32: np.ndarray | None = None
    sum_exp_abs_l_f32: np.ndarray | None = None
    sum_lc_f32: np.ndarray | None = None
    sum_k3c_f32: np.ndarray | None = None

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


def seq_extras(jobs) -> frozenset:
    """The optional sequence statistics (SeqStat.extras kinds) the jobs' rules read."""
    out = set()
    for j in jobs:
        r = j.rule
        if r.level != "sequence":
            continue
        if r.arith in ("verl", "verl-k1"):
            out.add("clamped")
        if r.precision == "float32":
            out.add("f32")
    return frozenset(out)


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
    """One parameter of a rule, as `Rule.params` declares it.

    name: the parameter's name in a SPEC (`eps` in `ipo:eps=0.3`).
    doc: what it bounds, in a few words (`mismatch-replay rules` shows it).
    grid: its default sweep grid, in GRID syntax (`0.01:0.5:50`, `a,b,c`).
    threshold: sweeping it is a one-pass threshold sweep (keyword-only).
    domain: the values it may take (`Domain`; keyword-only).
    """

    name: str
    doc: str
    grid: str  # default sweep grid (GRID syntax)
    threshold: bool = field(default=True, kw_only=True)  # a one-pass threshold sweep
    domain: Domain = field(default=NONNEG, kw_only=True)

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
    # Presets whose precision is not their framework's (FRAMEWORK_PRECISION): preset ->
    # "float64" | "float32" (native_precision)
    preset_precision: ClassVar[dict[str, str]] = {}
    # Why a preset's float32 count differs from its exact one (the precision note)
    precision_causes: ClassVar[dict[str, str]] = {}
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
        if self.precision not in PRECISIONS:
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
    def ops(self) -> str:
        """The key of OPS this rule computes in: a framework preset's formula in float64
        takes the correctly rounded exp ("exact": its ties decide as torch's), a bare rule
        pmath's (the fused kernel's bits)."""
        if self.precision == "float64" and self.preset:
            return "exact"
        return self.precision

    @property
    def X(self):
        return OPS[self.ops]

    def at_precision(self, b):
        """The batch in this rule's arithmetic (a TokenBatch; SeqStats pass through)."""
        return b.at(self.ops) if isinstance(b, TokenBatch) else b

    def seq_stat(self, s: SeqStats, name: str) -> np.ndarray:
        """A sequence statistic in this rule's precision: the float32 twin for float32."""
        return s.clamped(f"{name}_f32" if self.precision == "float32" else name)

    @classmethod
    def native_precision(cls, preset: str) -> str:
        """The precision a preset replays in by default: its framework's (float32 where its
        code computes on float32 tensors, as a real run holds them: FRAMEWORK_PRECISION),
        "float64" for a paper's or docs' values (no framework code)."""
        if preset in cls.preset_precision:
            return cls.preset_precision[preset]
        fw = (
            FRAMEWORK_OF.get(preset)
            if (preset in cls.preset_arith or preset in cls.preset_sources)
            else None
        )
        return FRAMEWORK_PRECISION[fw][0] if fw else "float64"

    @classmethod
    def precision_source(cls, preset: str) -> str:
        """Where the preset's precision was read (file:line @ commit, what it shows)."""
        fw = FRAMEWORK_OF.get(preset)
        if cls.native_precision(preset) == "float64" or not fw:
            return "no framework code: exact arithmetic"
        return FRAMEWORK_PRECISION[fw][1]

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
        differ elsewhere (the simple path runs the job). A preset in exact arithmetic with
        the stable form's formula differs from it by the correctly rounded exp only
        (EXACT_MARGIN: pmath is within 3 ulps)."""
        if not self.arith and self.ops == "exact":
            return EXACT_MARGIN
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
    "log-tensor": "the log ratio against log(bound) computed as a tensor of the log-probs' "
    "dtype (log of the bound rounded to float32 in a float32 replay), strict",
}


def tensor_log(value: float, precision: str) -> float:
    """log(value) as torch computes `t.new_tensor(value).log()` for a tensor t of that
    precision: the bound rounded to float32 first in float32 (then its log rounded), the
    correctly rounded log in float64 (-inf for 0)."""
    if value <= 0:
        return -math.inf
    if precision == "float32":
        return float(np.float32(math.log(float(np.float32(value)))))
    return math.log(value)


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

    The catalogue (`mismatch-replay rules`, docs/rules.md) and a sweep's default jobs list
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
# prime-rl's loss module after its 2026-09 refactor (IPOLoss, IcePopLoss, PPOLoss classes),
# read in the public code index (its commit is not in the mirror here)
PRIME_LOSS_NOW = f"{PRIME_LOSS} (2026-09 refactor, public index)"
VERL_RC = "verl verl/trainer/ppo/rollout_corr_helper.py"
VERL_CORE = "verl verl/trainer/ppo/core_algos.py"
AREAL_FN = "AReaL areal/utils/functional/functional.py @ cbff54d"
AREAL_ACTOR = "AReaL areal/trainer/ppo/actor.py @ cbff54d"
TRL_GRPO = "trl trl/trainer/grpo_trainer.py @ f2cd577"
SKYRL_OPC = "SkyRL skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py @ a956457"
NEMO_GRPO = "NeMo-RL nemo_rl/algorithms/grpo.py @ 7ea279a"
SLIME_LOSS = "slime slime/backends/megatron_utils/loss.py @ 624b824"
SLIME_TIS = "slime examples/train_infer_mismatch_helper/mis.py @ 624b824"

# The framework a preset name belongs to (a paper's or docs' values belong to none).
FRAMEWORK_OF = {
    "prime-rl": "prime-rl",
    "prime-rl-legacy": "prime-rl",
    "verl": "verl",
    "verl-k1": "verl",
    "areal": "AReaL",
    "trl": "TRL",
    "skyrl": "SkyRL",
    "nemo-rl": "NeMo-RL",
    "slime": "slime",
}
# Each framework's arithmetic on the tensors a real run holds: (precision, where the code
# shows it). Every one computes its masks on float32 log-prob tensors.
FRAMEWORK_PRECISION = {
    "prime-rl": (
        "float32",
        "prime-rl src/prime_rl/trainer/models/layers/lm_head.py:115 @ 559b447 (trainer "
        "logprobs allocated float32; loss.py computes on them and the float32 inference "
        "logprobs)",
    ),
    "verl": (
        "float32",
        "verl verl/workers/actor/dp_actor.py:435 @ b178a3c (log_probs torch.float32; "
        "rollout_corr_helper.py subtracts the float32 rollout_log_probs from them)",
    ),
    "AReaL": (
        "float32",
        "AReaL areal/utils/functional/vocab_parallel.py:19 (log_softmax(logits.float())) "
        "and functional.py:231 (.float() before the log ratio) @ cbff54d",
    ),
    "TRL": (
        "float32",
        "trl trl/trainer/grpo_trainer.py:2399 @ f2cd577 (torch.tensor(logps): vLLM's "
        "sampling logprobs as float32, torch's default dtype)",
    ),
    "SkyRL": (
        "float32",
        "SkyRL skyrl/backends/skyrl_train/utils/torch_utils.py:191 @ a956457 "
        "(safe_exp_delta: delta.to(torch.float32) before clamp and exp)",
    ),
    "NeMo-RL": (
        "float32",
        "NeMo-RL nemo_rl/algorithms/loss/utils.py:82 @ 7ea279a (logprobs.to(torch.float32); "
        "grpo.py:2513 masks on them)",
    ),
    "slime": (
        "float32",
        "slime slime/backends/megatron_utils/loss.py:128 @ 624b824 (assert logits.dtype == "
        "torch.float32: the log-probs the TIS/MIS functions read are float32)",
    ),
}


def band(param: str, x: np.ndarray, lo: float, hi: float):
    """A two-sided band on a ratio x, swept on one side: x < lo or x > hi (ratio space)."""
    if param == "high":
        return select(x < lo, INF, x)
    return select(x > hi, INF, -x)
