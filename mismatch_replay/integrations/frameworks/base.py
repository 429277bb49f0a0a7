"""What every framework mapping shares: the `Framework` base class and its helpers.

Design
------
A framework is a class with two inverse halves (the package docstring says which):
`read(settings) -> TrainerConfig` and `write(rules, base) -> [(key, value)]`. The base
class holds what they share: detecting a framework from its keys (`strict` sections,
`families` of key prefixes, `flag_arity` for argparse flags), refusing every unknown key in
its own sections (`check`, `reject_unknown`: a typo would otherwise replay a default), reading
a value as the framework's code would (`raw`, `num`, `flag`, `choice`), and building the
catalogue rule with the framework's own arithmetic where the catalogue has it (`make`,
`make_rule`). `float_text` and `reciprocal_text` write numbers that read back exactly;
`low_bound` reads a missing lower ratio bound as none (0).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import UsageError
from ...rules import REGISTRY, Rule
from ..settings import ConfigRule, Settings, TrainerConfig


@dataclass(frozen=True)
class Checked:
    """Where a mapping was checked: repository, files, commit (and its date)."""

    repo: str
    commit: str
    date: str
    files: tuple[str, ...]
    note: str = ""


def make_rule(name: str, preset: str = "", **values: float) -> Rule:
    """A catalogue rule; `preset` is kept when the catalogue has that framework's arithmetic
    for the rule (`Rule.preset_arith`: its clamps, ratio-space tests), so the replay computes
    what the framework computes."""
    cls = REGISTRY[name]
    kw: dict = {k: float(v) for k, v in values.items()}
    if preset and preset in getattr(cls, "preset_arith", {}):
        kw["preset"] = preset
    return cls(**kw)


def float_text(v: float) -> str:
    """A float as its shortest exact text (round trips through float())."""
    f = float(v)
    return repr(int(f)) + ".0" if f.is_integer() and abs(f) < 1e16 else repr(f)


def reciprocal_text(v: float) -> str:
    """1/v as the shortest decimal whose reciprocal is v again, exactly (a verl 'lo_hi'
    bound written for a rule bound v: 1/1.001001001001001 -> '0.999', not 0.9989999...)."""
    target = float(v)
    for digits in range(1, 18):
        text = f"{1.0 / target:.{digits}g}"
        if 1.0 / float(text) == target:
            return text if any(c in text for c in ".e") else text + ".0"
    return float_text(1.0 / target)


class Framework:
    """One trainer's keys, both ways: `read(settings)` and `write(rules, base)`; the
    helpers here read a key's value as the framework's code would (`num`, `flag`,
    `choice`) and name the key, the file and the known keys when it is wrong."""

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
                    self.reject_unknown(s, f"{section}.{rel}", f"{section}.", known, section)
        for prefix, known in self.families.items():
            for key in s:
                if key.startswith(prefix) and key not in known:
                    self.reject_unknown(s, key, "", known, f"the {prefix}* keys")

    def reject_unknown(self, s, key, prefix, known, where) -> None:
        """Raise the usage error for a key the framework does not know (with a close match)."""
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
    def raw(s: Settings, key: str, default):
        """The key's value as the file gave it (a variable it does not define refused)."""
        v = s.get(key, default)
        if isinstance(v, str) and "$" in v:
            raise UsageError(
                f"{s.origin(key)}: {key} = '{v}' refers to a variable (a shell $NAME the file "
                "does not define, or an OmegaConf ${...} interpolation) that mismatch-replay "
                "does not resolve; give the value itself."
            )
        return v

    def num(self, s: Settings, key: str, default, *, none: bool = False, positive=False):
        v = self.raw(s, key, default)
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
        v = self.raw(s, key, default)
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
            return v.strip().lower() in ("true", "1", "yes")
        raise UsageError(f"{s.origin(key)}: {key} = {v!r} is not true or false.")

    def choice(self, s: Settings, key: str, default, options: Sequence[str | None]):
        v = self.raw(s, key, default)
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
        return make_rule(name, self.arith.get(name, self.name), **values)

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


def low_bound(v: float | None) -> float:
    """A missing or null lower ratio bound: no lower bound (the band rules read 0 as off)."""
    return 0.0 if v is None else v
