"""Rule SPECs and GRIDs: the text a user types, parsed into a Rule or a grid of values.

SPEC: `name`, `name:k=v,...`, `name@preset` or `name@preset:k=v` (`ipo:eps=0.3`,
`icepop@verl:high=3`); a preset whose framework computes the rule differently, or in
float32, keeps its name on the rule (`rule.preset`), and replays in its framework's
precision (`Rule.native_precision`; --precision overrides). Each value is checked
against its parameter's Domain.
GRID: `a,b,c` or `start:stop:num[:log]`, sorted and unique, at most MAX_GRID values.
`spec_warnings` gives the one-line warning of every preset that follows a framework's
quirk. `sweep_specs` reads SPECs as `sweep` does: a bare rule name (`ipo`, no preset, no
values) stands for the rule itself, its class, which `engine.plan_jobs` sweeps over every
threshold parameter's default grid; a SPEC with values or a preset is one setting.
"""

from __future__ import annotations

import math
import re

import numpy as np

from ..errors import UsageError
from .base import REGISTRY, Rule

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
    """A rule SPEC -> a Rule instance (a frozen dataclass whose fields are its parameters,
    plus `preset` and `precision`).

    spec: `name`, `name:k=v,...`, `name@preset` or `name@preset:k=v` (`ipo:eps=0.3`,
      `icepop@verl`); a usage error names what is wrong and how to write it.
    """
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
        native = cls.native_precision(m["preset"])
        # the preset follows its framework's arithmetic, in its framework's precision
        if cls.preset_arith.get(m["preset"]) or native != "float64":
            values["preset"] = m["preset"]
        values["precision"] = native
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


def is_bare(spec) -> bool:
    """A SPEC that is a rule name alone (`ipo`): no preset, no parameter values."""
    return (
        isinstance(spec, str)
        and _SPEC.match(spec.strip()) is not None
        and ("@" not in spec and ":" not in spec)
    )


def sweep_specs(specs):
    """SPECs as `sweep`, `plot` and `report` read them: a bare rule name becomes its rule
    class (swept over its default grids by `engine.plan_jobs`), anything else stays a SPEC
    (one setting). An unknown name is a usage error listing the known ones."""
    return [get_rule_class(s.strip()) if is_bare(s) else s for s in specs]


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


def given_label(spec: str, exclude: str | None = None, fmt=str) -> str:
    """A rule SPEC named as the user gave it, for a table's first column: the name with its
    preset ('token-mis@verl'), and in brackets the fixed parameters that differ from that
    preset's (all of them without a preset), each value written by `fmt`; `exclude`: the swept
    or chosen parameter, left out. 'token-mis@verl:low=0.5,high=5' -> 'token-mis@verl';
    'icepop@verl:low=0.3,high=5' with exclude 'high' -> 'icepop@verl [low=0.3]'."""
    head, _, vals = spec.partition(":")
    name, _, preset = head.partition("@")
    ref = REGISTRY[name].presets.get(preset, {}) if preset and name in REGISTRY else {}
    shown = []
    for kv in filter(None, vals.split(",")):
        k, _, v = kv.partition("=")
        if k == exclude:
            continue
        try:
            x = float(v)
        except ValueError:
            shown.append(kv)
            continue
        if ref.get(k) is not None and math.isclose(x, ref[k], rel_tol=1e-12):
            continue  # the preset's own value: its name says it
        shown.append(f"{k}={fmt(x)}")
    return head + (f" [{', '.join(shown)}]" if shown else "")


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
