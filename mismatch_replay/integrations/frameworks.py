"""Each trainer's mismatch-correction keys, mapped both ways onto the rule catalogue.

Design
------
One class per framework, each with two inverse halves:

* `read(settings) -> TrainerConfig`: the framework's dotted keys (from `config_in`) -> the
  catalogue rules they select, using the defaults the framework's code uses for a key the
  config leaves out. Every key it does not know in its own sections is an error that names
  the key, the file and the known keys (a typo would otherwise replay a default).
* `write(rules, base) -> [(key, value)]`: a set of rules -> the keys that select them, the
  full set for each rule (the chosen threshold and the others), so that the text `emit`
  prints is self-contained: read back alone it gives the same rules.

A framework holds a few *slots* (verl: one IS weight and any number of rejection options;
AReaL: one `rejection_sampling` and M2PO; prime-rl: one loss); emitting a choice replaces the
rule in the chosen rule's slot and keeps the others of the base config.

Where a framework's arithmetic differs from the rule's plain reading, the mapping follows the
code and says so in a note: verl's `*_k1` options with a "lo_hi" threshold keep
1/hi <= r <= 1/lo; AReaL's `kl_k1` bounds apply to log r; NeMo-RL's `icepop` on
sequence-level ratios is a product-ratio band. Where no catalogue rule replays a setting
(AReaL's `kl_k3`, which is q/p - 1 - log(q/p); verl's `seq_sum_k2`), reading fails and says
so rather than replaying something else.

`CHECKED` names, per framework, the repository, files and commit each mapping was read from
(docs/integrations.md prints the same table).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import UsageError
from ..rules import REGISTRY, Rule
from .config_in import ConfigRule, Settings, TrainerConfig


@dataclass(frozen=True)
class Checked:
    """Where a mapping was checked: repository, files, commit (and its date)."""

    repo: str
    commit: str
    date: str
    files: tuple[str, ...]
    note: str = ""


def _rule(name: str, preset: str = "", **values: float) -> Rule:
    """A catalogue rule; `preset` is kept when the catalogue has that framework's arithmetic
    for the rule (`Rule.preset_arith`: its clamps, ratio-space tests), so the replay computes
    what the framework computes."""
    cls = REGISTRY[name]
    kw: dict = {k: float(v) for k, v in values.items()}
    if preset and preset in getattr(cls, "preset_arith", {}):
        kw["preset"] = preset
    return cls(**kw)


def _g(v: float) -> str:
    """A float as its shortest exact text (round trips through float())."""
    f = float(v)
    return repr(int(f)) + ".0" if f.is_integer() and abs(f) < 1e16 else repr(f)


def _recip(v: float) -> str:
    """1/v as the shortest decimal whose reciprocal is v again, exactly (a verl 'lo_hi'
    bound written for a rule bound v: 1/1.001001001001001 -> '0.999', not 0.9989999...)."""
    target = float(v)
    for digits in range(1, 18):
        text = f"{1.0 / target:.{digits}g}"
        if 1.0 / float(text) == target:
            return text if any(c in text for c in ".e") else text + ".0"
    return _g(1.0 / target)


# ----------------------------------------------------------------------------- base


class Framework:
    name: ClassVar[str]
    title: ClassVar[str]
    hint: ClassVar[str]  # the keys that identify it, for the detection message
    checked: ClassVar[tuple[Checked, ...]]
    token_style: ClassVar[str] = "hydra"  # how a shell text is read: hydra | flags
    syntaxes: ClassVar[tuple[str, ...]] = ("hydra", "yaml")  # emit syntaxes, default first
    strict: ClassVar[dict[str, tuple[str, ...]]] = {}  # section -> every key it may hold
    families: ClassVar[dict[str, tuple[str, ...]]] = {}  # key prefix -> every key with it
    flag_arity: ClassVar[dict[str, int]] = {}  # flags: values after the flag (0: a switch)
    slots: ClassVar[dict[str, str]] = {}  # rule name -> slot (default: the rule name)

    # -- detection and unknown keys
    def detect(self, keys: set[str]) -> bool:
        bare = {k.lstrip("-") for k in keys}
        if any(k == s or k.startswith(s + ".") for k in bare for s in self.strict):
            return True
        return any(k.startswith(p) for k in bare for p in self.families)

    def owns_flag(self, key: str) -> bool:
        return (
            key in self.flag_arity
            or any(key.startswith(p) for p in self.families)
            or any(key == s or key.startswith(s + ".") for s in self.strict)
        )

    def check(self, s: Settings) -> None:
        """Every key in the framework's sections and families must be one it knows."""
        for section, known in self.strict.items():
            for rel in s.under(section):
                if rel.split(".")[0] not in known:
                    self._unknown(s, f"{section}.{rel}", f"{section}.", known, section)
        for prefix, known in self.families.items():
            for key in s:
                if key.startswith(prefix) and key not in known:
                    self._unknown(s, key, "", known, f"the {prefix}* keys")

    def _unknown(self, s, key, prefix, known, where) -> None:
        rel = key[len(prefix) :].split(".")[0]
        close = difflib.get_close_matches(rel, known, n=1, cutoff=0.6)
        hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
        src = self.checked[0]
        raise UsageError(
            f"{s.origin(key)}: unknown key '{key}' in {self.title}'s {where} (known: "
            f"{', '.join(known)}; from {src.repo} {src.files[0]} at {src.commit[:7]}).{hint} "
            "Fix or remove the key; mismatch-replay will not guess what it meant."
        )

    # -- reading values
    @staticmethod
    def _raw(s: Settings, key: str, default):
        v = s.get(key, default)
        if isinstance(v, str) and "$" in v:
            raise UsageError(
                f"{s.origin(key)}: {key} = '{v}' refers to a variable (a shell $NAME the file "
                "does not define, or an OmegaConf ${...} interpolation) that mismatch-replay "
                "does not resolve; give the value itself."
            )
        return v

    def num(self, s: Settings, key: str, default, *, none: bool = False, positive=False):
        v = self._raw(s, key, default)
        if isinstance(v, str) and v.strip().lower() in ("null", "none", "~", ""):
            v = None
        if v is None:
            if none:
                return None
            raise UsageError(f"{s.origin(key)}: {key} is null; {self.title} needs a number here.")
        if isinstance(v, bool) or not isinstance(v, int | float | str):
            raise UsageError(f"{s.origin(key)}: {key} = {v!r} is not a number.")
        try:
            f = float(v)
        except ValueError:
            raise UsageError(f"{s.origin(key)}: {key} = {v!r} is not a number.") from None
        if not math.isfinite(f):
            raise UsageError(f"{s.origin(key)}: {key} = {v!r} must be finite.")
        if positive and f <= 0:
            raise UsageError(f"{s.origin(key)}: {key} = {v!r} must be positive.")
        return f

    def flag(self, s: Settings, key: str, default: bool) -> bool:
        v = self._raw(s, key, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
            return v.strip().lower() in ("true", "1", "yes")
        raise UsageError(f"{s.origin(key)}: {key} = {v!r} is not true or false.")

    def choice(self, s: Settings, key: str, default, options: Sequence[str | None]):
        v = self._raw(s, key, default)
        if isinstance(v, str) and v.strip().lower() in ("null", "none", "~"):
            v = None
        if v not in options:
            shown = ", ".join("null" if o is None else str(o) for o in options)
            raise UsageError(
                f"{s.origin(key)}: {key} = {v!r}: {self.title} accepts {shown} "
                f"({self.checked[0].files[0]} at {self.checked[0].commit[:7]})."
            )
        return v

    def result(self, s: Settings, rules: list[ConfigRule], notes: list[str]) -> TrainerConfig:
        mine = {
            k: v
            for k, v in s.items()
            if any(k == p or k.startswith(p + ".") for p in self.strict)
            or any(k.startswith(p) for p in self.families)
            or k in self.flag_arity
            or k in self.extra_keys
        }
        return TrainerConfig(self.name, [], rules, mine, notes)

    extra_keys: ClassVar[tuple[str, ...]] = ()

    # -- both ways
    def read(self, s: Settings) -> TrainerConfig:  # pragma: no cover - abstract
        raise NotImplementedError

    def write(self, rules: Sequence[Rule], base: dict) -> tuple[list[tuple[str, Any]], list]:
        """(key, value) pairs that select `rules`, and notes."""
        raise NotImplementedError  # pragma: no cover - abstract

    arith: ClassVar[dict[str, str]] = {}  # rule -> preset whose arithmetic it follows

    def make(self, name: str, **values: float) -> Rule:
        """The rule `name` with the framework's own arithmetic where the catalogue has it."""
        return _rule(name, self.arith.get(name, self.name), **values)

    def slot(self, rule_name: str) -> str:
        return self.slots.get(rule_name, rule_name)

    def supported(self) -> list[str]:
        return sorted(self.slots)

    def cannot(self, rule: Rule) -> UsageError:
        return UsageError(
            f"{self.title} has no setting that replays rule '{rule.name}' ({rule.spec()}); "
            f"it can express: {', '.join(self.supported())}."
        )

    # -- command-line spelling (syntax "cli")
    def flag_text(self, key: str) -> str:
        return "--" + key

    def is_switch(self, key: str) -> bool:
        return self.flag_arity.get(key) == 0


def _low(v: float | None) -> float:
    """A missing or null lower ratio bound: no lower bound (the band rules read 0 as off)."""
    return 0.0 if v is None else v


# ----------------------------------------------------------------------------- prime-rl


class PrimeRL(Framework):
    name = "prime-rl"
    title = "prime-rl"
    hint = "prime-rl: [trainer.loss] (or [loss] in a trainer TOML)"
    checked = (
        Checked(
            "PrimeIntellect-ai/prime-rl",
            "559b44772e471d1538537b8805cc77f3824a5e64",
            "2026-08-21",
            (
                "packages/prime-rl-configs/src/prime_rl/configs/trainer.py",
                "src/prime_rl/trainer/rl/loss.py",
            ),
            "main: DefaultLossConfig (DPPO), IPOLossConfig",
        ),
        Checked(
            "PrimeIntellect-ai/prime-rl",
            "489621ac422b13124533e35b7d4fb1d4d973c47d",
            "2026-08-16",
            (
                "packages/prime-rl-configs/src/prime_rl/configs/trainer.py",
                "src/prime_rl/trainer/rl/loss.py",
            ),
            "branch feat/kpop-loss: KPopLossConfig (clamp 1e-6 in kpop_loss_fn)",
        ),
        Checked(
            "PrimeIntellect-ai/prime-rl",
            "db604193b42c14232fd0bb13b74a3e67a72b6f81",
            "2026-05-02",
            ("src/prime_rl/configs/trainer.py", "src/prime_rl/trainer/rl/loss.py"),
            "unmerged commit: the IcePop default loss (icepop_ratio_low / icepop_ratio_high)",
        ),
    )
    token_style = "flags"
    syntaxes = ("toml", "cli")
    TYPES: ClassVar[dict[str, tuple[str, ...]]] = {
        "default": (
            "type",
            "dppo_mask_low",
            "dppo_mask_high",
            "icepop_ratio_low",
            "icepop_ratio_high",
            "adv_tau",
            "kl_tau",
        ),
        "ipo": ("type", "ipo_threshold", "adv_tau", "kl_tau"),
        "kpop": ("type", "kpop_threshold", "adv_tau", "kl_tau"),
        "custom": ("type", "import_path", "kwargs"),
    }
    strict = {"trainer.loss": tuple(dict.fromkeys(k for v in TYPES.values() for k in v))}
    slots = dict.fromkeys(("ipo", "dppo-tv", "kpop", "icepop", "token-mis"), "loss")
    KPOP_CLAMP = 1e-6  # prime-rl's kpop_loss_fn clamps probabilities to [1e-6, 1 - 1e-6]

    @staticmethod
    def section(keys) -> str:
        keys = list(keys)
        if any(k == "trainer.loss" or k.startswith("trainer.loss.") for k in keys):
            return "trainer.loss"
        if any(k.startswith("loss.") for k in keys):
            return "loss"
        return "trainer.loss"

    def detect(self, keys):
        bare = {k.lstrip("-") for k in keys}
        return any(k.startswith("trainer.loss.") for k in bare) or (
            "loss.type" in bare and not any(k.startswith("loss_fn") for k in bare)
        )

    def owns_flag(self, key):
        return key.startswith(("trainer.loss.", "loss."))

    def read(self, s):
        sec = self.section(s)
        vals = s.under(sec)
        kind = self.choice(s, f"{sec}.type", "default", tuple(self.TYPES))
        known = self.TYPES[kind]
        for rel in vals:
            if rel.split(".")[0] not in known:
                self._unknown(s, f"{sec}.{rel}", f"{sec}.", known, f"[{sec}] type = '{kind}'")
        notes: list[str] = []
        k = f"{sec}."
        if kind == "custom":
            raise UsageError(
                f"{s.origin(k + 'type')}: [{sec}] type = 'custom' ({vals.get('import_path')}): "
                "a custom loss is your own code; replay it with --rule SPEC instead."
            )
        if kind == "ipo":
            if f"{k}ipo_threshold" in s:
                eps = self.num(s, f"{k}ipo_threshold", None, positive=True)
            else:
                eps = REGISTRY["ipo"].presets["prime-rl"]["eps"]
                notes.append(
                    f"{k}ipo_threshold not set: using prime-rl's default as the catalogue has "
                    f"it (ipo@prime-rl, eps={eps:g}); prime-rl's code had 0.1 at 559b447 "
                    "(2026-08-21). Set it in the config to be sure."
                )
            rule = ConfigRule(self.make("ipo", eps=eps), {"eps": f"{k}ipo_threshold"}, "type=ipo")
        elif kind == "kpop":
            phi = self.num(s, f"{k}kpop_threshold", 0.1, positive=True)
            rule = ConfigRule(
                self.make("kpop", phi=phi, clamp=self.KPOP_CLAMP),
                {"phi": f"{k}kpop_threshold"},
                "type=kpop",
                ["prime-rl's kpop_loss_fn clamps probabilities to [1e-6, 1 - 1e-6] (clamp=1e-06)."],
            )
        elif any(f"{k}icepop_ratio_{side}" in s for side in ("low", "high")):
            if any(f"{k}dppo_mask_{side}" in s for side in ("low", "high")):
                raise UsageError(
                    f"{s.origin(k + 'icepop_ratio_low')}: [{sec}] sets both icepop_ratio_* and "
                    "dppo_mask_*: one prime-rl version has one or the other as its default loss. "
                    "Keep the keys of the version you run."
                )
            low = self.num(s, f"{k}icepop_ratio_low", 0.2)
            high = self.num(s, f"{k}icepop_ratio_high", 5.0, positive=True)
            rule = ConfigRule(
                self.make("icepop", low=low, high=high),
                {"low": f"{k}icepop_ratio_low", "high": f"{k}icepop_ratio_high"},
                "type=default (IcePop)",
                [
                    "icepop_ratio_* are the IcePop default loss of prime-rl commit db60419 (not on "
                    "main at 559b447, where the default loss is DPPO)."
                ],
            )
        else:
            low = self.num(s, f"{k}dppo_mask_low", 0.2)
            high = self.num(s, f"{k}dppo_mask_high", 0.2)
            rule = ConfigRule(
                self.make("dppo-tv", low=low, high=high),
                {"low": f"{k}dppo_mask_low", "high": f"{k}dppo_mask_high"},
                "type=default (DPPO)",
                [
                    "prime-rl's default loss masks by the advantage sign (A == 0 on the low side): "
                    "the log needs an advantage column."
                ],
            )
        mine = {key: v for key, v in s.items() if key == sec or key.startswith(k)}
        return TrainerConfig(self.name, [], [rule], mine, notes)

    def write(self, rules, base):
        if len(rules) != 1:
            raise UsageError(
                f"prime-rl's [trainer.loss] selects one loss; got {len(rules)} rules "
                f"({', '.join(r.spec() for r in rules)})."
            )
        r = rules[0]
        sec = self.section(base)
        notes = []
        if r.name == "ipo":
            pairs = [("type", "ipo"), ("ipo_threshold", r.eps)]
        elif r.name == "dppo-tv":
            pairs = [("type", "default"), ("dppo_mask_low", r.low), ("dppo_mask_high", r.high)]
        elif r.name == "kpop":
            if not math.isclose(r.clamp, self.KPOP_CLAMP, rel_tol=1e-9):
                raise UsageError(
                    f"prime-rl's KPop clamps probabilities at 1e-06; {r.spec()} uses "
                    f"clamp={r.clamp:g}, which no prime-rl key sets."
                )
            pairs = [("type", "kpop"), ("kpop_threshold", r.phi)]
        elif r.name in ("icepop", "token-mis"):
            pairs = [
                ("type", "default"),
                ("icepop_ratio_low", r.low),
                ("icepop_ratio_high", r.high),
            ]
            notes.append(
                "icepop_ratio_* exist only in prime-rl versions whose default loss is "
                "IcePop (commit db60419); on main (559b447) the default loss is DPPO."
            )
        else:
            raise self.cannot(r)
        return [(f"{sec}.{k}", v) for k, v in pairs], notes

    def flag_text(self, key):
        return "--" + key.replace("_", "-")


# ----------------------------------------------------------------------------- verl


class Verl(Framework):
    name = "verl"
    title = "verl"
    hint = "verl: algorithm.rollout_correction.*"
    checked = (
        Checked(
            "volcengine/verl",
            "b178a3cd56f58b2d502255daba591e92833930a7",
            "2026-01-29",
            (
                "verl/trainer/config/algorithm.py",
                "verl/trainer/config/algorithm/rollout_correction.yaml",
                "verl/trainer/ppo/rollout_corr_helper.py",
            ),
            "RolloutCorrectionConfig; the YAML defaults (rollout_is: null) apply",
        ),
    )
    SECTION = "algorithm.rollout_correction"
    strict = {
        SECTION: (
            "rollout_is",
            "rollout_is_threshold",
            "rollout_is_batch_normalize",
            "rollout_rs",
            "rollout_rs_threshold",
            "bypass_mode",
            "loss_type",
        )
    }
    K1 = {"token_k1": "token-mis", "seq_sum_k1": "seq-mis", "seq_mean_k1": "geo-mis"}
    UPPER = {
        "token_k2": "token-k2",
        "token_k3": "token-k3",
        "seq_mean_k3": "seq-mean-k3",
        "seq_max_k2": "seq-max-k2",
    }
    RS_OPTIONS = (
        "token_k1",
        "token_k2",
        "token_k3",
        "seq_sum_k1",
        "seq_sum_k2",
        "seq_sum_k3",
        "seq_mean_k1",
        "seq_mean_k2",
        "seq_mean_k3",
        "seq_max_k2",
        "seq_max_k3",
    )
    IS = {"token": "tis", "sequence": "seq-tis"}
    arith = {"token-mis": "verl-k1"}
    slots = {"tis": "is", "seq-tis": "is", "icepop": "token-mis"} | {
        r: r for r in (*K1.values(), *UPPER.values())
    }

    def read(self, s):
        self.check(s)
        k = self.SECTION + "."
        rules: list[ConfigRule] = []
        level = self.choice(s, k + "rollout_is", None, (None, "token", "sequence"))
        if level is not None:
            cap = self.num(s, k + "rollout_is_threshold", 2.0, positive=True)
            rules.append(
                ConfigRule(
                    self.make(self.IS[level], cap=cap),
                    {"cap": k + "rollout_is_threshold"},
                    f"rollout_is={level}",
                )
            )
        rs = self._raw(s, k + "rollout_rs", None)
        if isinstance(rs, str) and rs.strip().lower() in ("null", "none", ""):
            rs = None
        if rs is not None:
            rules += self._read_rs(s, k, str(rs))
        return self.result(s, rules, [])

    def _read_rs(self, s, k, rs: str) -> list[ConfigRule]:
        opts = list(dict.fromkeys(o.strip() for o in rs.split(",") if o.strip()))
        for o in opts:
            if o not in self.RS_OPTIONS:
                raise UsageError(
                    f"{s.origin(k + 'rollout_rs')}: {k}rollout_rs: '{o}' is not a verl rejection "
                    f"option ({', '.join(self.RS_OPTIONS)})."
                )
        spec = self._raw(s, k + "rollout_rs_threshold", None)
        if spec is None:
            raise UsageError(
                f"{s.origin(k + 'rollout_rs')}: {k}rollout_rs is set and rollout_rs_threshold "
                "is not; verl requires one threshold per option."
            )
        specs = (
            [str(spec)]
            if isinstance(spec, int | float)
            else [p.strip() for p in str(spec).split(",") if p.strip()]
        )
        if len(specs) == 1:
            specs = specs * len(opts)
        if len(specs) != len(opts):
            raise UsageError(
                f"{s.origin(k + 'rollout_rs_threshold')}: {k}rollout_rs_threshold has "
                f"{len(specs)} thresholds for {len(opts)} options; give one, or one per option."
            )
        out = []
        for opt, t in zip(opts, specs, strict=True):
            where = f"{s.origin(k + 'rollout_rs_threshold')}: {k}rollout_rs_threshold '{t}'"
            if opt in self.K1:
                try:
                    lo, hi = (float(x) for x in t.split("_", 1)) if "_" in t else (None, float(t))
                    if lo is None:
                        lo = 1.0 / hi
                except (ValueError, ZeroDivisionError):
                    raise UsageError(f"{where}: not a number or 'lower_upper' pair.") from None
                if lo <= 0 or hi <= 0:
                    raise UsageError(f"{where}: verl needs positive bounds.")
                rule = self.make(self.K1[opt], low=1.0 / hi, high=1.0 / lo)
                notes = []
                if "_" in t and not math.isclose(lo * hi, 1.0, rel_tol=1e-12):
                    notes.append(
                        f"verl's {opt} with '{t}' keeps 1/{hi:g} <= r <= 1/{lo:g} (it bounds "
                        f"-log r by [log {lo:g}, log {hi:g}], rollout_corr_helper.py): replayed "
                        f"as {rule.spec()}, as verl computes it."
                    )
                keys = {"low": k + "rollout_rs_threshold", "high": k + "rollout_rs_threshold"}
            elif opt in self.UPPER:
                try:
                    hi = float(t)
                except ValueError:
                    raise UsageError(f"{where}: {opt} takes one upper bound.") from None
                if hi <= 0:
                    raise UsageError(f"{where}: verl needs a positive upper bound.")
                rule = self.make(self.UPPER[opt], hi=hi)
                notes = ["verl clamps log r to ±20 before k2 / k3 (SAFETY_BOUND)."]
                keys = {"hi": k + "rollout_rs_threshold"}
            else:
                raise UsageError(
                    f"{s.origin(k + 'rollout_rs')}: verl's rejection option '{opt}' has no rule "
                    "in the catalogue yet (replayable: "
                    f"{', '.join([*self.K1, *self.UPPER])}); replay a neighbour with --rule."
                )
            out.append(ConfigRule(rule, keys, f"rollout_rs={opt}", notes))
        return out

    def write(self, rules, base):
        k = self.SECTION + "."
        pairs: list[tuple[str, Any]] = []
        weights = [r for r in rules if r.name in self.IS.values()]
        if len(weights) > 1:
            raise UsageError("verl applies one IS weight (rollout_is); got " + str(len(weights)))
        for r in weights:
            level = "token" if r.name == "tis" else "sequence"
            pairs += [(k + "rollout_is", level), (k + "rollout_is_threshold", r.cap)]
        opts, specs = [], []
        inv = {v: o for o, v in self.K1.items()} | {"icepop": "token_k1"}
        inv_up = {v: o for o, v in self.UPPER.items()}
        for r in rules:
            if r in weights:
                continue
            if r.name in inv:
                if not r.low or r.low <= 0:
                    raise UsageError(
                        f"verl's {inv[r.name]} needs both ratio bounds; {r.spec()} has no lower "
                        "bound (low=0)."
                    )
                opts.append(inv[r.name])
                specs.append(f"{_recip(r.high)}_{_recip(r.low)}")
            elif r.name in inv_up:
                opts.append(inv_up[r.name])
                specs.append(_g(r.hi))
            else:
                raise self.cannot(r)
        notes = []
        if opts:
            pairs += [
                (k + "rollout_rs", ",".join(opts)),
                (k + "rollout_rs_threshold", ",".join(specs)),
            ]
            if any(o.endswith("k1") for o in opts):
                notes.append(
                    "verl's *_k1 'lower_upper' keeps 1/upper <= r <= 1/lower: the "
                    "pair written is (1/high, 1/low) of the rule."
                )
        return pairs, notes


# ----------------------------------------------------------------------------- AReaL


class AReaL(Framework):
    name = "areal"
    title = "AReaL"
    hint = "AReaL: actor.rejection_sampling.*, actor.m2_threshold"
    checked = (
        Checked(
            "inclusionAI/AReaL",
            "4aef98d8d818af55b43621aaadba047ae10f4e77",
            "2026-05-21",
            (
                "areal/api/cli_args.py",
                "areal/utils/functional/functional.py",
                "areal/utils/data.py",
                "areal/trainer/ppo/actor.py",
            ),
            "RejectionSamplingConfig, apply_rejection_sampling, KLEstimator, M2PO",
        ),
    )
    syntaxes = ("yaml", "hydra")
    SECTION = "actor.rejection_sampling"
    strict = {SECTION: ("level", "action", "metric", "agg", "upper", "lower")}
    extra_keys = ("actor.m2_threshold", "actor.use_decoupled_loss")
    slots = {"m2po": "m2po"} | dict.fromkeys(
        ("icepop", "token-mis", "tis", "cispo", "geo-mis", "seq-mis", "token-k2", "seq-max-k2"),
        "rejection",
    )

    def detect(self, keys):
        bare = {k.lstrip("-") for k in keys}
        return any(k == self.SECTION or k.startswith(self.SECTION + ".") for k in bare) or (
            "actor.m2_threshold" in bare
        )

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        k = self.SECTION + "."
        present = s.has(self.SECTION) and s.get(self.SECTION, {}) is not None
        if present:
            rules.append(self._read_rs(s, k))
            if not self.flag(s, "actor.use_decoupled_loss", False):
                notes.append(
                    "AReaL applies actor.rejection_sampling only with actor.use_decoupled_loss: "
                    "true (its default is false)."
                )
        tau = self.num(s, "actor.m2_threshold", None, none=True, positive=True)
        if tau is not None:
            rules.append(
                ConfigRule(
                    self.make("m2po", tau=tau), {"tau": "actor.m2_threshold"}, "m2_threshold"
                )
            )
        return self.result(s, rules, notes)

    def _read_rs(self, s, k) -> ConfigRule:
        level = self.choice(s, k + "level", "token", ("token", "sequence"))
        action = self.choice(s, k + "action", "mask", ("mask", "clamp"))
        metric = self.choice(s, k + "metric", "ratio", ("ratio", "kl_k1", "kl_k2", "kl_k3"))
        agg = self.choice(s, k + "agg", "mean", ("sum", "mean", "max"))
        upper = self.num(s, k + "upper", 5.0)
        lower = self.num(s, k + "lower", None, none=True)
        at = s.origin(k + "upper")
        if lower is not None and lower > upper:
            raise UsageError(f"{at}: {k}lower ({lower:g}) > upper ({upper:g}); AReaL rejects it.")
        if metric == "ratio" and upper <= 1.0:
            raise UsageError(f"{at}: {k}upper = {upper:g}: AReaL needs upper > 1 for 'ratio'.")
        if metric == "ratio" and lower is not None and lower <= 0:
            raise UsageError(f"{at}: {k}lower = {lower:g}: AReaL needs lower > 0 for 'ratio'.")
        if metric in ("kl_k2", "kl_k3") and upper <= 0:
            raise UsageError(f"{at}: {k}upper = {upper:g}: AReaL needs upper > 0 for {metric}.")
        if action == "clamp" and metric != "ratio":
            raise UsageError(f"{at}: {k}action = clamp: AReaL clamps only metric 'ratio'.")
        origin = f"rejection_sampling level={level} action={action} metric={metric}" + (
            f" agg={agg}" if level == "sequence" else ""
        )
        band = {"low": k + "lower", "high": k + "upper"}
        notes: list[str] = []
        rule = None
        if metric == "kl_k3":
            raise UsageError(
                f"{at}: {k}metric = kl_k3: AReaL's k3 is q/p - 1 - log(q/p) (KLEstimator with "
                "the ratio inverted), not the catalogue's token-k3 (r - 1 - log r); no rule "
                "replays it yet. Use metric ratio or kl_k2, or replay token-k3 with --rule."
            )
        if metric == "kl_k1":  # bounds on log r: the ratio band exp(lower) .. exp(upper)
            lo = 0.0 if lower is None else math.exp(lower)
            hi = math.exp(upper)
            notes.append(
                f"AReaL's kl_k1 bounds log r: replayed as the ratio band [{lo:g}, {hi:g}]."
            )
            metric, lower, upper = "ratio", lo, hi
        if metric == "ratio":
            if level == "token" and action == "mask":
                rule = self.make("icepop", low=_low(lower), high=upper)
            elif level == "token":
                rule = (
                    self.make("tis", cap=upper)
                    if not lower
                    else self.make("cispo", low=lower, high=upper)
                )
                band = {"cap": k + "upper"} if not lower else band
            elif action == "mask" and agg in ("mean", "sum"):
                rule = self.make(
                    "geo-mis" if agg == "mean" else "seq-mis", low=_low(lower), high=upper
                )
        elif metric == "kl_k2" and action == "mask" and lower is None:
            if level == "token":
                rule = self.make("token-k2", hi=upper)
            elif agg == "max":
                rule = self.make("seq-max-k2", hi=upper)
            band = {"hi": k + "upper"}
        if rule is None:
            raise UsageError(
                f"{at}: AReaL's {origin} has no rule in the catalogue yet (replayable: token "
                "ratio mask/clamp, sequence ratio mask with agg mean or sum, kl_k1 at the same "
                "levels, kl_k2 token mask or sequence max)."
            )
        notes.append(
            "AReaL compares the proximal (recomputed) and behaviour (inference) "
            "log-probs in float32; map the recomputed column as trainer_logprob."
        )
        return ConfigRule(rule, band, origin, notes)

    def write(self, rules, base):
        k = self.SECTION + "."
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "m2po":
                pairs.append(("actor.m2_threshold", r.tau))
                continue
            if r.name in ("icepop", "token-mis"):
                vals = ("token", "mask", "ratio", "mean", r.high, r.low or None)
            elif r.name == "tis":
                vals = ("token", "clamp", "ratio", "mean", r.cap, None)
            elif r.name == "cispo":
                vals = ("token", "clamp", "ratio", "mean", r.high, r.low or None)
            elif r.name in ("geo-mis", "seq-mis"):
                agg = "mean" if r.name == "geo-mis" else "sum"
                vals = ("sequence", "mask", "ratio", agg, r.high, r.low or None)
            elif r.name == "token-k2":
                vals = ("token", "mask", "kl_k2", "mean", r.hi, None)
            elif r.name == "seq-max-k2":
                vals = ("sequence", "mask", "kl_k2", "max", r.hi, None)
            else:
                raise self.cannot(r)
            if vals[2] == "ratio" and vals[4] <= 1.0:
                raise UsageError(
                    f"AReaL needs upper > 1 for metric 'ratio'; {r.spec()} has {vals[4]:g}."
                )
            names = ("level", "action", "metric", "agg", "upper", "lower")
            pairs += [(k + n, v) for n, v in zip(names, vals, strict=True)]
        return pairs, []


# ----------------------------------------------------------------------------- TRL


class TRL(Framework):
    name = "trl"
    title = "TRL"
    hint = "TRL: vllm_importance_sampling_*, off_policy_mask_threshold (GRPOConfig)"
    checked = (
        Checked(
            "huggingface/trl",
            "f2cd57710ae345ea6428ae95363267fcf38a3dc8",
            "2026-07-24",
            ("trl/trainer/grpo_config.py", "trl/trainer/grpo_trainer.py"),
            "GRPOConfig fields; the field default mode is sequence_mask (its docstring says "
            "token_truncate: the code wins)",
        ),
    )
    token_style = "flags"
    syntaxes = ("cli", "yaml")
    KEYS = (
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_cap",
    )
    families = {
        "vllm_importance_sampling_": KEYS,
        "off_policy_mask": ("off_policy_mask_threshold",),
    }
    extra_keys = ("use_vllm",)
    flag_arity = {"off_policy_mask_threshold": 1}
    MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    slots = dict.fromkeys(("token-mis", "icepop", "seq-mis", "tis", "cispo", "seq-tis"), "is") | {
        "opsm": "opsm"
    }

    def owns_flag(self, key):
        return key == "use_vllm" or super().owns_flag(key)

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        p = "vllm_importance_sampling_"
        if self.flag(s, p + "correction", True):
            mode = self.choice(s, p + "mode", "sequence_mask", self.MODES)
            hi = self.num(s, p + "clip_max", 3.0, none=True, positive=True)
            cap = self.num(s, p + "cap", None, none=True, positive=True)
            hi_key = p + "clip_max"
            if cap is not None:
                hi, hi_key = cap, p + "cap"
                notes.append(f"{p}cap is deprecated; TRL copies it into {p}clip_max.")
            lo = self.num(s, p + "clip_min", None, none=True)
            at = s.origin(p + "mode")
            if hi is None:
                raise UsageError(
                    f"{at}: {p}clip_max is null (no upper bound): no catalogue rule replays a "
                    "band open above; set clip_max."
                )
            if lo is not None and lo > hi:
                raise UsageError(f"{at}: {p}clip_min ({lo:g}) > clip_max ({hi:g}).")
            band = {"low": p + "clip_min", "high": hi_key}
            if mode == "token_mask":
                rule = self.make("token-mis", low=_low(lo), high=hi)
            elif mode == "sequence_mask":
                rule = self.make("seq-mis", low=_low(lo), high=hi)
            elif mode == "token_truncate":
                rule = self.make("tis", cap=hi) if not lo else self.make("cispo", low=lo, high=hi)
                band = {"cap": hi_key} if not lo else band
            else:
                if lo:
                    raise UsageError(
                        f"{at}: sequence_truncate with clip_min {lo:g}: no catalogue rule "
                        "clips a sequence weight from below; replay seq-tis with --rule."
                    )
                rule, band = self.make("seq-tis", cap=hi), {"cap": hi_key}
            rules.append(ConfigRule(rule, band, f"{p}mode={mode}"))
            if not self.flag(s, "use_vllm", False):
                notes.append(
                    "TRL computes the vLLM importance-sampling correction only with use_vllm: true."
                )
        delta = self.num(s, "off_policy_mask_threshold", None, none=True, positive=True)
        if delta is not None:
            rules.append(
                ConfigRule(
                    self.make("opsm", delta=delta),
                    {"delta": "off_policy_mask_threshold"},
                    "off_policy_mask_threshold",
                )
            )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        p = "vllm_importance_sampling_"
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "opsm":
                pairs.append(("off_policy_mask_threshold", r.delta))
                continue
            if r.name in ("token-mis", "icepop"):
                mode, lo, hi = "token_mask", r.low, r.high
            elif r.name == "seq-mis":
                mode, lo, hi = "sequence_mask", r.low, r.high
            elif r.name == "tis":
                mode, lo, hi = "token_truncate", 0.0, r.cap
            elif r.name == "cispo":
                mode, lo, hi = "token_truncate", r.low, r.high
            elif r.name == "seq-tis":
                mode, lo, hi = "sequence_truncate", 0.0, r.cap
            else:
                raise self.cannot(r)
            pairs += [
                (p + "correction", True),
                (p + "mode", mode),
                (p + "clip_min", float(lo)),
                (p + "clip_max", hi),
            ]
        return pairs, []


# ----------------------------------------------------------------------------- NeMo-RL


class NeMoRL(Framework):
    name = "nemo-rl"
    title = "NeMo-RL"
    hint = "NeMo-RL: loss_fn.truncated_importance_sampling_*, grpo.seq_logprob_error_threshold"
    checked = (
        Checked(
            "NVIDIA-NeMo/RL",
            "7ea279abfbeb698b092856d0dab61e7cf39bc909",
            "2026-08-22",
            (
                "nemo_rl/algorithms/loss/loss_functions.py",
                "nemo_rl/algorithms/grpo.py",
                "examples/configs/grpo_math_1B.yaml",
            ),
            "ClippedPGLossConfig (extra keys allowed: only the IS keys are checked), "
            "seq_logprob_error_threshold",
        ),
    )
    TIS = (
        "truncated_importance_sampling_type",
        "truncated_importance_sampling_ratio",
        "truncated_importance_sampling_ratio_min",
    )
    families = {
        "loss_fn.truncated_importance_sampling": tuple(f"loss_fn.{k}" for k in TIS),
        "loss_fn.use_importance_sampling": ("loss_fn.use_importance_sampling_correction",),
        "grpo.seq_logprob_error": ("grpo.seq_logprob_error_threshold",),
    }
    extra_keys = ("loss_fn.sequence_level_importance_ratios",)
    slots = dict.fromkeys(
        ("tis", "cispo", "seq-tis", "icepop", "token-mis", "seq-mis", "geo-mis"), "tis"
    ) | {"prob-error": "prob-error"}

    def detect(self, keys):
        return super().detect(keys) or any(k.lstrip("-").startswith("loss_fn.") for k in keys)

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        k = "loss_fn."
        ttype = self.choice(
            s,
            k + "truncated_importance_sampling_type",
            None,
            (None, "tis", "icepop", "seq-mask-tis"),
        )
        ratio = self.num(s, k + "truncated_importance_sampling_ratio", None, none=True)
        rmin = self.num(s, k + "truncated_importance_sampling_ratio_min", None, none=True)
        seq = self.flag(s, k + "sequence_level_importance_ratios", False)
        at = s.origin(k + "truncated_importance_sampling_type")
        if ttype is not None:
            if not self.flag(s, k + "use_importance_sampling_correction", False):
                raise UsageError(
                    f"{at}: {k}truncated_importance_sampling_type = {ttype} needs "
                    f"{k}use_importance_sampling_correction: true (NeMo-RL asserts it)."
                )
            if ratio is None:
                notes.append(
                    f"{k}truncated_importance_sampling_type = {ttype} is ignored: "
                    "NeMo-RL applies it only when truncated_importance_sampling_ratio "
                    "is set."
                )
            else:
                rules.append(self._read_tis(at, k, ttype, ratio, rmin, seq))
        elif ratio is not None:
            notes.append(
                f"{k}truncated_importance_sampling_ratio is set without a type: "
                "NeMo-RL applies no truncation."
            )
        tau = self.num(s, "grpo.seq_logprob_error_threshold", None, none=True, positive=True)
        if tau is not None:
            rules.append(
                ConfigRule(
                    self.make("prob-error", tau=tau),
                    {"tau": "grpo.seq_logprob_error_threshold"},
                    "seq_logprob_error_threshold",
                )
            )
        return self.result(s, rules, notes)

    def _read_tis(self, at, k, ttype, ratio, rmin, seq) -> ConfigRule:
        if ratio <= 0:
            raise UsageError(f"{at}: {k}truncated_importance_sampling_ratio must be positive.")
        if rmin is not None and rmin > ratio:
            raise UsageError(f"{at}: {k}truncated_importance_sampling_ratio_min > ratio.")
        if ttype in ("icepop", "seq-mask-tis") and rmin is None:
            raise UsageError(
                f"{at}: {k}truncated_importance_sampling_type = {ttype} needs "
                f"{k}truncated_importance_sampling_ratio_min (NeMo-RL asserts it)."
            )
        band = {"low": k + self.TIS[2], "high": k + self.TIS[1]}
        origin = f"truncated_importance_sampling_type={ttype}" + (
            " (sequence-level ratios)" if seq else ""
        )
        notes = []
        if ttype == "tis":
            if seq:
                if rmin:
                    raise UsageError(
                        f"{at}: tis on sequence-level ratios with ratio_min {rmin:g}: no "
                        "catalogue rule clips a sequence weight from below."
                    )
                return ConfigRule(self.make("seq-tis", cap=ratio), {"cap": k + self.TIS[1]}, origin)
            if not rmin:
                return ConfigRule(self.make("tis", cap=ratio), {"cap": k + self.TIS[1]}, origin)
            return ConfigRule(self.make("cispo", low=rmin, high=ratio), band, origin)
        if ttype == "icepop":
            if seq:
                notes.append(
                    "with sequence_level_importance_ratios, NeMo-RL's icepop bounds "
                    "the product ratio exp(S_i): replayed as seq-mis."
                )
                return ConfigRule(self.make("seq-mis", low=rmin, high=ratio), band, origin, notes)
            return ConfigRule(self.make("icepop", low=rmin, high=ratio), band, origin)
        if seq:
            raise UsageError(
                f"{at}: seq-mask-tis is incompatible with "
                f"{k}sequence_level_importance_ratios (NeMo-RL asserts it)."
            )
        return ConfigRule(self.make("geo-mis", low=rmin, high=ratio), band, origin)

    def write(self, rules, base):
        k = "loss_fn."
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "prob-error":
                pairs.append(("grpo.seq_logprob_error_threshold", r.tau))
                continue
            if r.name == "tis":
                vals = ("tis", r.cap, None, False)
            elif r.name == "cispo":
                vals = ("tis", r.high, r.low, False)
            elif r.name == "seq-tis":
                vals = ("tis", r.cap, None, True)
            elif r.name in ("icepop", "token-mis"):
                vals = ("icepop", r.high, r.low, False)
            elif r.name == "seq-mis":
                vals = ("icepop", r.high, r.low, True)
            elif r.name == "geo-mis":
                vals = ("seq-mask-tis", r.high, r.low, False)
            else:
                raise self.cannot(r)
            pairs += [
                (k + "use_importance_sampling_correction", True),
                (k + self.TIS[0], vals[0]),
                (k + self.TIS[1], vals[1]),
                (k + self.TIS[2], vals[2]),
                (k + "sequence_level_importance_ratios", vals[3]),
            ]
        return pairs, []


# ----------------------------------------------------------------------------- slime


class Slime(Framework):
    name = "slime"
    title = "slime"
    hint = "slime: --use-tis, --tis-clip, --tis-clip-low, --use-opsm, --opsm-delta"
    checked = (
        Checked(
            "THUDM/slime",
            "624b824a898ab0ec1fcb4d373004c7f3852bf515",
            "2026-08-21",
            (
                "slime/utils/arguments.py",
                "slime/backends/megatron_utils/loss.py",
                "slime/utils/ppo_utils.py",
            ),
            "vanilla_tis_function, icepop_function, compute_opsm_mask",
        ),
    )
    token_style = "flags"
    syntaxes = ("cli",)
    ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
    flag_arity = {
        "use_tis": 0,
        "tis_clip": 1,
        "tis_clip_low": 1,
        "custom_tis_function_path": 1,
        "use_opsm": 0,
        "opsm_delta": 1,
        "get_mismatch_metrics": 0,
        "use_rollout_logprobs": 0,
    }
    families = {
        "tis_": ("tis_clip", "tis_clip_low"),
        "use_tis": ("use_tis",),
        "custom_tis_": ("custom_tis_function_path",),
        "opsm_": ("opsm_delta",),
        "use_opsm": ("use_opsm",),
    }
    slots = dict.fromkeys(("tis", "cispo", "icepop", "token-mis"), "tis") | {"opsm": "opsm"}

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        use = self.flag(s, "use_tis", False)
        metrics = self.flag(s, "get_mismatch_metrics", False)
        path = self._raw(s, "custom_tis_function_path", None)
        if use or metrics:
            at = s.origin("use_tis" if use else "get_mismatch_metrics")
            hi = self.num(s, "tis_clip", 2.0, positive=True)
            lo = self.num(s, "tis_clip_low", 0.0)
            band = {"low": "tis_clip_low", "high": "tis_clip"}
            if path is None and not use:
                raise UsageError(
                    f"{at}: --get-mismatch-metrics needs "
                    "--custom-tis-function-path (slime asserts it)."
                )
            if path is None:
                rule = self.make("tis", cap=hi) if not lo else self.make("cispo", low=lo, high=hi)
                band = {"cap": "tis_clip"} if not lo else band
                origin = "--use-tis (vanilla_tis_function)"
            elif path == self.ICEPOP:
                rule, origin = self.make("icepop", low=lo, high=hi), "icepop_function"
            else:
                raise UsageError(
                    f"{at}: --custom-tis-function-path {path}: a custom TIS function is your "
                    f"own code; replay it with --rule SPEC (slime's own {self.ICEPOP} is read)."
                )
            rules.append(ConfigRule(rule, band, origin))
            if self.flag(s, "use_rollout_logprobs", False):
                notes.append("slime: --use-rollout-logprobs and --use-tis cannot be set together.")
        if self.flag(s, "use_opsm", False):
            delta = self.num(s, "opsm_delta", 1e-4, positive=True)
            rules.append(
                ConfigRule(self.make("opsm", delta=delta), {"delta": "opsm_delta"}, "--use-opsm")
            )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "opsm":
                pairs += [("use_opsm", True), ("opsm_delta", r.delta)]
            elif r.name == "tis":
                pairs += [("use_tis", True), ("tis_clip", r.cap), ("tis_clip_low", 0.0)]
            elif r.name == "cispo":
                pairs += [("use_tis", True), ("tis_clip", r.high), ("tis_clip_low", r.low)]
            elif r.name in ("icepop", "token-mis"):
                pairs += [
                    ("use_tis", True),
                    ("custom_tis_function_path", self.ICEPOP),
                    ("tis_clip", r.high),
                    ("tis_clip_low", r.low),
                ]
            else:
                raise self.cannot(r)
        return pairs, []

    def flag_text(self, key):
        return "--" + key.replace("_", "-")


# ----------------------------------------------------------------------------- SkyRL


class SkyRL(Framework):
    name = "skyrl"
    title = "SkyRL"
    hint = "SkyRL: trainer.algorithm.off_policy_correction.*"
    checked = (
        Checked(
            "NovaSky-AI/SkyRL",
            "a9564572eb8e91076be43c1bd5e4615e3de17265",
            "2026-08-21",
            (
                "skyrl/train/config/config.py",
                "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py",
                "skyrl/train/utils/utils.py",
            ),
            "OffPolicyCorrectionConfig; the deprecated trainer.algorithm.use_tis is migrated",
        ),
    )
    SECTION = "trainer.algorithm.off_policy_correction"
    strict = {
        SECTION: (
            "tis_ratio_type",
            "token_tis_ratio_clip_high",
            "sequence_tis_ratio_clip_high",
            "sequence_mask_metric",
            "geo_mask_high",
            "geo_mask_low",
            "product_mask_high",
            "product_mask_low",
            "outlier_token_is_threshold_low",
            "outlier_token_is_threshold_high",
            "token_mask_is_threshold_low",
            "token_mask_is_threshold_high",
        )
    }
    extra_keys = ("trainer.algorithm.use_tis", "trainer.algorithm.tis_imp_ratio_cap")
    slots = {
        "tis": "tis",
        "seq-tis": "tis",
        "geo-mis": "seqmask",
        "seq-mis": "seqmask",
        "veto": "veto",
        "token-mis": "tokenmask",
        "icepop": "tokenmask",
    }

    def read(self, s):
        self.check(s)
        k = self.SECTION + "."
        rules: list[ConfigRule] = []
        notes: list[str] = []
        ttype = self.choice(s, k + "tis_ratio_type", None, (None, "token", "sequence"))
        cap_key = k + ("token" if ttype == "token" else "sequence") + "_tis_ratio_clip_high"
        cap = None
        if self.flag(s, "trainer.algorithm.use_tis", False):
            cap_key = "trainer.algorithm.tis_imp_ratio_cap"
            ttype, cap = "token", self.num(s, cap_key, -1.0, positive=True)
            notes.append(
                "trainer.algorithm.use_tis is deprecated: SkyRL turns it into "
                "tis_ratio_type=token with token_tis_ratio_clip_high = tis_imp_ratio_cap."
            )
        if ttype == "token":
            cap = cap if cap is not None else self.num(s, cap_key, 2.0, positive=True)
            rules.append(
                ConfigRule(self.make("tis", cap=cap), {"cap": cap_key}, "tis_ratio_type=token")
            )
        elif ttype == "sequence":
            cap = self.num(s, cap_key, 5.0, positive=True)
            rules.append(
                ConfigRule(
                    self.make("seq-tis", cap=cap), {"cap": cap_key}, "tis_ratio_type=sequence"
                )
            )
        metric = self.choice(s, k + "sequence_mask_metric", None, (None, "geometric", "product"))
        if metric is not None:
            pre, name, dlo, dhi = (
                ("geo", "geo-mis", 0.99, 1.01)
                if metric == "geometric"
                else ("product", "seq-mis", 0.5, 2.0)
            )
            lo = self.num(s, f"{k}{pre}_mask_low", dlo)
            hi = self.num(s, f"{k}{pre}_mask_high", dhi, positive=True)
            rules.append(
                ConfigRule(
                    self.make(name, low=lo, high=hi),
                    {"low": f"{k}{pre}_mask_low", "high": f"{k}{pre}_mask_high"},
                    f"sequence_mask_metric={metric}",
                )
            )
        v = self.num(s, k + "outlier_token_is_threshold_low", None, none=True, positive=True)
        if v is not None:
            rules.append(
                ConfigRule(
                    self.make("veto", v=v),
                    {"v": k + "outlier_token_is_threshold_low"},
                    "outlier_token_is_threshold_low",
                )
            )
        if self.num(s, k + "outlier_token_is_threshold_high", None, none=True) is not None:
            raise UsageError(
                f"{s.origin(k + 'outlier_token_is_threshold_high')}: "
                f"{k}outlier_token_is_threshold_high (mask a sequence when any token's ratio is "
                "above it) has no rule in the catalogue yet; replay veto or seq-max-k2 with --rule."
            )
        tlo = self.num(s, k + "token_mask_is_threshold_low", None, none=True)
        thi = self.num(s, k + "token_mask_is_threshold_high", None, none=True)
        if tlo is not None and thi is not None:
            rules.append(
                ConfigRule(
                    self.make("token-mis", low=tlo, high=thi),
                    {
                        "low": k + "token_mask_is_threshold_low",
                        "high": k + "token_mask_is_threshold_high",
                    },
                    "token_mask_is_threshold_*",
                )
            )
        elif tlo is not None or thi is not None:
            notes.append(
                "SkyRL applies token_mask_is_threshold_low/high only when both are set: "
                "the one given is ignored."
            )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        k = self.SECTION + "."
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "tis":
                pairs += [(k + "tis_ratio_type", "token"), (k + "token_tis_ratio_clip_high", r.cap)]
            elif r.name == "seq-tis":
                pairs += [
                    (k + "tis_ratio_type", "sequence"),
                    (k + "sequence_tis_ratio_clip_high", r.cap),
                ]
            elif r.name in ("geo-mis", "seq-mis"):
                metric, pre = (
                    ("geometric", "geo") if r.name == "geo-mis" else ("product", "product")
                )
                pairs += [
                    (k + "sequence_mask_metric", metric),
                    (f"{k}{pre}_mask_low", r.low),
                    (f"{k}{pre}_mask_high", r.high),
                ]
            elif r.name == "veto":
                pairs.append((k + "outlier_token_is_threshold_low", r.v))
            elif r.name in ("token-mis", "icepop"):
                pairs += [
                    (k + "token_mask_is_threshold_low", r.low),
                    (k + "token_mask_is_threshold_high", r.high),
                ]
            else:
                raise self.cannot(r)
        return pairs, []


# ----------------------------------------------------------------------------- OpenRLHF


class OpenRLHF(Framework):
    name = "openrlhf"
    title = "OpenRLHF"
    hint = "OpenRLHF: --algo.advantage.is_correction_*"
    checked = (
        Checked(
            "OpenRLHF/OpenRLHF",
            "3c3be6234e0cb353e76bb8019947db9dfe99fca7",
            "2026-08-13",
            ("openrlhf/cli/train_ppo_ray.py", "openrlhf/models/loss.py"),
            "vLLM IS correction of PolicyLoss (policy_loss_type ppo only)",
        ),
    )
    token_style = "flags"
    syntaxes = ("cli",)
    P = "algo.advantage.is_correction_"
    families = {P: (P + "enable", P + "threshold", P + "type")}
    extra_keys = ("actor.policy_loss_type",)
    flag_arity = {P + "enable": 0, P + "threshold": 2, P + "type": 1, "actor.policy_loss_type": 1}
    slots = dict.fromkeys(("tis", "cispo", "icepop", "token-mis", "geo-mis"), "is")

    def read(self, s):
        self.check(s)
        rules: list[ConfigRule] = []
        notes: list[str] = []
        p = self.P
        if self.flag(s, p + "enable", False):
            kind = self.choice(s, p + "type", "tis", ("tis", "icepop", "seq-mask-tis"))
            thr = self._raw(s, p + "threshold", [0.5, 5.0])
            at = s.origin(p + "threshold")
            if not isinstance(thr, list | tuple) or len(thr) != 2:
                raise UsageError(f"{at}: --{p}threshold takes two numbers, LOW HIGH.")
            try:
                lo, hi = (float(x) for x in thr)
            except (TypeError, ValueError):
                raise UsageError(f"{at}: --{p}threshold {thr}: not two numbers.") from None
            band = {"low": p + "threshold", "high": p + "threshold"}
            if kind == "tis":
                rule = self.make("tis", cap=hi) if not lo else self.make("cispo", low=lo, high=hi)
            elif kind == "icepop":
                rule = self.make("icepop", low=lo, high=hi)
            else:
                rule = self.make("geo-mis", low=lo, high=hi)
            rules.append(ConfigRule(rule, band, f"is_correction_type={kind}"))
            if self.choice(s, "actor.policy_loss_type", "ppo", ("ppo", "gspo")) != "ppo":
                notes.append(
                    "OpenRLHF applies the vLLM IS correction only with "
                    "--actor.policy_loss_type ppo."
                )
        return self.result(s, rules, notes)

    def write(self, rules, base):
        p = self.P
        pairs: list[tuple[str, Any]] = []
        for r in rules:
            if r.name == "tis":
                kind, lo, hi = "tis", 0.0, r.cap
            elif r.name == "cispo":
                kind, lo, hi = "tis", r.low, r.high
            elif r.name in ("icepop", "token-mis"):
                kind, lo, hi = "icepop", r.low, r.high
            elif r.name == "geo-mis":
                kind, lo, hi = "seq-mask-tis", r.low, r.high
            else:
                raise self.cannot(r)
            pairs += [(p + "enable", True), (p + "type", kind), (p + "threshold", [lo, hi])]
        return pairs, []


# ----------------------------------------------------------------------------- registry

FRAMEWORKS: dict[str, Framework] = {
    fw.name: fw
    for fw in (PrimeRL(), Verl(), AReaL(), TRL(), NeMoRL(), Slime(), SkyRL(), OpenRLHF())
}
ALIASES = {"prime": "prime-rl", "primerl": "prime-rl", "nemo": "nemo-rl", "nemorl": "nemo-rl"}


def get_framework(name: str) -> Framework:
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    try:
        return FRAMEWORKS[key]
    except KeyError:
        raise UsageError(f"unknown framework '{name}'; known: {', '.join(FRAMEWORKS)}.") from None


__all__ = ["FRAMEWORKS", "Checked", "Framework", "get_framework"]
