"""Config in: the masking rule and its thresholds, read from the trainer's own config.

Design
------
Every framework keeps its mismatch correction in a handful of keys (prime-rl `[trainer.loss]`,
verl `algorithm.rollout_correction.*`, AReaL `actor.rejection_sampling`, TRL
`vllm_importance_sampling_*`, ...), but each spells them in its own file format. Reading is
therefore two steps, and only the second knows a framework:

1. *Files to dotted keys.* A file becomes a flat `{dotted.key: value}` map, whatever its
   syntax: TOML (`tomllib`), YAML or JSON (nested mappings flattened: `algorithm:
   rollout_correction: rollout_is: token` -> `algorithm.rollout_correction.rollout_is`), or
   a shell text (a training script, a file of overrides, one command line), which is
   tokenized like a shell would (`shlex`, `\\`-newline continuations, comments, simple
   `NAME=value` variables expanded into `$NAME` / `${NAME}` / `${NAME:-default}`) and read
   as Hydra overrides (`key=value`, `+key=value`, `++key=value`, `~key`) or as argparse
   flags (`--tis-clip 2`, `--name=value`, switches), as the framework's own launcher does.
   Several files merge in order, the later winning, with Hydra's semantics for a key set to
   null or deleted (its children go too), so `--from-config base.yaml --from-config
   overrides.txt` reads what the trainer would.
2. *Dotted keys to rules* (`frameworks`): each framework maps its keys to the rule SPECs
   of the catalogue, with the defaults its code uses for a key the file leaves out, and names
   every key it does not know in its sections (a typo like `rollout_rs_treshold` would
   otherwise silently fall back to the default and replay the wrong rule).

The framework is detected from the keys (each owns distinct sections or flag families); two
candidates, or none, is a usage error that lists them (`--framework NAME` decides).

Values keep the type the file gave them; a framework converts (and names the key, the value
and the file when a value is not a number where one is needed). YAML is read with PyYAML
(the `[config]` extra; most trainers already install it), TOML with the standard library.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .frameworks import FRAMEWORKS, get_framework
from .settings import ConfigRule, Settings, TrainerConfig


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys. An empty mapping or a null is kept as a leaf."""
    out: dict[str, Any] = {}
    if isinstance(tree, dict):
        if not tree and prefix:
            out[prefix] = {}
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(flatten(v, key))
            else:
                out[key] = v
    elif prefix:
        out[prefix] = tree
    return out


def unflatten(pairs: Iterable[tuple[str, Any]]) -> dict:
    root: dict = {}
    for key, value in pairs:
        node = root
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return root


# ----------------------------------------------------------------------------- files


TREE_SUFFIXES = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


@dataclass
class Loaded:
    """One file (or text): a nested mapping, or shell-like tokens."""

    name: str
    tree: dict | None = None
    tokens: list[str] | None = None


def yaml_module():
    """PyYAML, or a usage error that says how to install it."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML ships with most trainers
        raise UsageError(
            "reading a YAML config needs PyYAML: pip install 'mismatch-replay[config]' "
            "(or pip install pyyaml)."
        ) from None
    return yaml


def parse_tree(text: str, syntax: str, name: str) -> dict:
    """TOML / YAML / JSON text -> a mapping; a syntax error names the file and the line."""
    try:
        if syntax == "toml":
            tree = tomllib.loads(text)
        elif syntax == "json":
            tree = json.loads(text)
        else:
            yaml = yaml_module()
            try:
                tree = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ValueError(str(exc).replace("\n", " ")) from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise UsageError(f"{name}: not valid {syntax.upper()}: {exc}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UsageError(
            f"{name}: the {syntax.upper()} holds a {type(tree).__name__}, not a mapping of "
            "config keys."
        )
    return tree


_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_SHELL_SYNTAX = {"(", ")", ";", "&&", "||", "|", "&", "\\"}


def shell_tokens(text: str) -> list[str]:
    """A script or override file -> tokens, as a shell would split them.

    Simple `NAME=value` lines define variables that later `$NAME`, `${NAME}` and
    `${NAME:-default}` expand to; a variable the text does not define stays as written (a
    framework then names it if one of its keys needs the value).
    """
    text = re.sub(r"\\\r?\n", " ", text)
    env: dict[str, str] = {}
    lines = []
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if m and not m.group(2).lstrip().startswith("("):
            try:
                parts = shlex.split(_expand(m.group(2), env), comments=True)
            except ValueError:
                parts = []
            if len(parts) <= 1:
                env[m.group(1)] = parts[0] if parts else ""
                continue
        lines.append(_expand(line, env))
    try:
        tokens = shlex.split("\n".join(lines), comments=True)
    except ValueError as exc:  # unbalanced quotes
        raise UsageError(f"cannot split the text into arguments: {exc}.") from None
    return [t for t in tokens if t not in _SHELL_SYNTAX]


def _expand(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        if name in env:
            return env[name]
        if m.group(1) and m.group(2) is not None:
            return m.group(2)
        return m.group(0)

    return _VAR.sub(sub, text)


def load_text(text: str, name: str, syntax: str | None = None) -> Loaded:
    """Text in a given syntax (toml, yaml, json; anything else: shell-like tokens)."""
    if syntax in ("toml", "yaml", "json"):
        return Loaded(name, tree=parse_tree(text, syntax, name))
    try:
        return Loaded(name, tokens=shell_tokens(text))
    except UsageError as exc:
        raise UsageError(f"{name}: {exc}") from None


def load_file(path: str | Path) -> Loaded:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--from-config {p}: no such file.") from None
    except IsADirectoryError:
        raise UsageError(f"--from-config {p}: a directory; give the config file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--from-config {p}: cannot read it ({exc}).") from None
    return load_text(text, str(p), TREE_SUFFIXES.get(p.suffix.lower()))


# ----------------------------------------------------------------------------- tokens

_HYDRA = re.compile(r"^(?P<op>\+\+|\+|~)?(?P<key>[A-Za-z_][\w\-]*(?:\.[\w\-]+)*)(?:=(?P<v>.*))?$")
_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?$|^[+-]?(?:inf|nan)$", re.I)


def scalar(text: str) -> Any:
    """A Hydra / command-line value: null, true/false, an int, a float, or a string
    (quotes removed: a quoted value is always a string)."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    low = t.lower()
    if low in ("null", "none", "~"):
        return None
    if low == "true":
        return True
    if low == "false":
        return False
    if _INT.match(t):
        return int(t)
    if _FLOAT.match(t):
        return float(t)
    return t


def hydra_overrides(tokens: Sequence[str]) -> list[tuple[str, str, Any]]:
    """(op, key, value) for every token that reads as a Hydra override of a dotted key.
    op: "=" (set, also `+` / `++`), "~" (delete). Other tokens (the program, its flags) are
    skipped."""
    out = []
    for tok in tokens:
        m = _HYDRA.match(tok)
        if not m or tok.startswith("-"):
            continue
        key, op = m["key"], m["op"] or ""
        if m["v"] is None:
            if op == "~":
                out.append(("~", key, None))
            continue
        if "." not in key and not op:
            continue  # a shell variable or a plain NAME=value, not a config key
        out.append(("~" if op == "~" else "=", key, scalar(m["v"])))
    return out


def flag_name(tok: str) -> str | None:
    """`--tis-clip` / `--tis-clip=2` -> `tis_clip`; dots kept (`--algo.advantage.x`)."""
    if not tok.startswith("--") or len(tok) < 3:
        return None
    name = tok[2:].split("=", 1)[0]
    return name.replace("-", "_")


def parse_flags(tokens: Sequence[str], arity: dict[str, int], owns) -> list[tuple[str, Any]]:
    """(key, value) for the flags a framework owns (`owns(key) -> bool`), as argparse reads
    them: `arity[key]` values follow (0: a switch, True), `--name=value` inline; a flag it
    does not list takes one value when a non-flag token follows, else it is a switch."""
    out = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        key = flag_name(tok)
        i += 1
        if key is None or not owns(key):
            continue
        if "=" in tok:
            out.append((key, scalar(tok.split("=", 1)[1])))
            continue
        n = arity.get(key)
        if n is None:
            n = 1 if i < len(tokens) and not tokens[i].startswith("--") else 0
        vals = []
        while len(vals) < n and i < len(tokens) and not tokens[i].startswith("--"):
            vals.append(scalar(tokens[i]))
            i += 1
        if n == 0:
            out.append((key, True))
        elif n == 1:
            out.append((key, vals[0] if vals else None))
        else:
            out.append((key, vals))
    return out


# ----------------------------------------------------------------------------- reading


def keys_of(loaded: Loaded) -> set[str]:
    """Every key a file mentions (dotted keys and flag names), for detection."""
    if loaded.tree is not None:
        return set(flatten(loaded.tree))
    toks = loaded.tokens or []
    keys = {k for _, k, _ in hydra_overrides(toks)}
    keys |= {f"--{n}" for t in toks if (n := flag_name(t))}
    return keys


def detect(loaded: Sequence[Loaded]) -> str:
    keys: set[str] = set()
    for ld in loaded:
        keys |= keys_of(ld)
    found = [name for name, fw in FRAMEWORKS.items() if fw.detect(keys)]
    names = ", ".join(ld.name for ld in loaded)
    if len(found) == 1:
        return found[0]
    if not found:
        raise UsageError(
            f"{names}: no trainer config keys found that mismatch-replay knows "
            f"({'; '.join(fw.hint for fw in FRAMEWORKS.values())}). Give --framework NAME "
            f"({', '.join(FRAMEWORKS)}) if the file is one of them."
        )
    raise UsageError(
        f"{names}: the keys fit several frameworks ({', '.join(found)}); give --framework NAME."
    )


def settings_of(loaded: Sequence[Loaded], fw) -> Settings:
    """Merge the files in order into one flat map of the framework's keys."""
    s = Settings()
    for ld in loaded:
        if ld.tree is not None:
            for k, v in flatten(ld.tree).items():
                s.assign(k, v, ld.name)
        elif fw.token_style == "flags":
            for k, v in parse_flags(ld.tokens or [], fw.flag_arity, fw.owns_flag):
                s.assign(k, v, ld.name)
        else:
            for op, k, v in hydra_overrides(ld.tokens or []):
                if op == "~":
                    s.delete(k)
                else:
                    s.assign(k, v, ld.name)
    return s


def read_loaded(
    loaded: Sequence[Loaded], framework: str | None = None, require: bool = False
) -> TrainerConfig:
    if not loaded:
        raise UsageError("--from-config: give at least one config file.")
    name = get_framework(framework).name if framework else detect(loaded)
    fw = get_framework(name)
    s = settings_of(loaded, fw)
    cfg = fw.read(s)
    cfg.files = [ld.name for ld in loaded]
    if require and not cfg.rules:
        raise UsageError(
            f"{', '.join(cfg.files)}: this {fw.title} config turns on no masking or weighting "
            f"rule ({fw.hint}), so there is nothing to replay; give --rule SPEC, or set one."
        )
    return cfg


def read_config(
    paths: str | Path | Sequence[str | Path], framework: str | None = None, require: bool = False
) -> TrainerConfig:
    """The rules a trainer config selects: one file or several, merged in order (the later
    wins), e.g. a base YAML and a file of Hydra overrides. `framework`: one of
    `frameworks.FRAMEWORKS` (default: detected from the keys). `require`: a config that
    selects no rule is a usage error (what `--from-config` wants)."""
    if isinstance(paths, str | Path):
        paths = [paths]
    return read_loaded([load_file(p) for p in paths], framework, require)


def read_text(text: str, framework: str, syntax: str | None = None, name: str = "<text>"):
    """Like read_config, for text (e.g. what `emit` printed) in a given syntax: toml, yaml,
    json, or hydra / cli (shell-like tokens)."""
    return read_loaded([load_text(text, name, syntax)], framework)


__all__ = [
    "ConfigRule",
    "Settings",
    "TrainerConfig",
    "detect",
    "flatten",
    "hydra_overrides",
    "load_file",
    "load_text",
    "parse_flags",
    "read_config",
    "read_text",
    "scalar",
    "shell_tokens",
    "unflatten",
]
