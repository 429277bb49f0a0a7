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

Hostile or broken files (issue 37) are refused in one line, within a second: only a regular
file is opened (`ingest.safe_read`: `/dev/zero`, `/dev/urandom` and a FIFO are refused from
`os.stat`, before any read), of at most 10 MB (`CONFIG_CAP`: a trainer config is kilobytes);
a tree is at most `MAX_DEPTH` (64) levels deep and `MAX_NODES` (100,000) nodes once YAML
aliases are expanded (a trainer config has hundreds). YAML is first walked as libyaml's
event stream (iterative: 100,000-deep nesting costs nothing, where composing it overflows
the C stack), which counts the expanded nodes of every anchor as it closes, so a "billion
laughs" (9 levels of 9 aliases: 3.9e8 nodes) is refused after its 10 lines, and an alias
inside its own anchor (a cycle) is refused by name; only then is the text loaded, with
`yaml.CSafeLoader` where PyYAML has libyaml (~6x the pure-Python loader). A parser that
still recurses too deep (tomllib, json) is caught at this boundary (RecursionError). Merging
is linear in the keys (`Settings` indexes each key under its prefixes). A shell text is at
most `MAX_WORDS` (20,000) words.
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
from ..ingest import safe_read
from .frameworks import FRAMEWORKS, get_framework
from .settings import ConfigRule, Settings, TrainerConfig


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> dotted keys. An empty mapping or a null is kept as a leaf.
    Iterative (depth-first, in the mapping's order), so no depth makes it recurse; a
    mapping inside itself is refused (one shared by two keys is read under both)."""
    out: dict[str, Any] = {}
    if not isinstance(tree, dict):
        if prefix:
            out[prefix] = tree
        return out
    if not tree and prefix:
        out[prefix] = {}
    stack = [(prefix, id(tree), iter(tree.items()))]
    on_path = {id(tree)}
    while stack:
        base, ident, items = stack[-1]
        for k, v in items:
            key = f"{base}.{k}" if base else str(k)
            if isinstance(v, dict):
                if id(v) in on_path:
                    raise UsageError(f"the config refers to itself at '{key}' (a cycle).")
                if not v:
                    out[key] = {}
                stack.append((key, id(v), iter(v.items())))
                on_path.add(id(v))
                break
            out[key] = v
        else:
            stack.pop()
            on_path.discard(ident)
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


MAX_DEPTH = 64  # levels of nesting in a config tree (a trainer config has 3 to 6)
MAX_NODES = 100_000  # nodes of a tree, YAML aliases expanded (a trainer config: hundreds)
_SHAPE_FIX = "check that this is the config file."


def _too_deep(name: str, syntax: str, parser: bool = False) -> UsageError:
    where = "deeper than its parser can follow" if parser else f"more than {MAX_DEPTH} levels deep"
    return UsageError(
        f"{name}: the {syntax.upper()} nests {where} (the limit is {MAX_DEPTH}; a trainer "
        f"config nests 3 to 6): {_SHAPE_FIX}"
    )


def _too_many(name: str, syntax: str, what: str) -> UsageError:
    return UsageError(
        f"{name}: the {syntax.upper()} holds more than {MAX_NODES:,} {what} (the limit; a "
        f"trainer config has hundreds of keys): {_SHAPE_FIX}"
    )


def check_shape(tree: dict, name: str, syntax: str) -> None:
    """Refuse a parsed tree deeper than MAX_DEPTH or with more than MAX_NODES values
    (iterative, so the check itself cannot recurse)."""
    nodes = 1
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep(name, syntax)
        for v in node.values() if isinstance(node, dict) else node:
            nodes += 1
            if isinstance(v, dict | list):
                stack.append((v, depth + 1))
        if nodes > MAX_NODES:
            raise _too_many(name, syntax, "values")


def _yaml_loader(yaml):
    """libyaml's safe loader where PyYAML was built with it (~6x faster), else PyYAML's."""
    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def check_yaml_events(text: str, name: str, yaml, loader) -> None:
    """Walk the YAML's event stream (libyaml's parser is iterative, nothing is built) and
    refuse nesting over MAX_DEPTH, more than MAX_NODES nodes with every alias expanded (the
    size of each anchor's node is counted when it closes, so a billion laughs costs its few
    lines), and an alias inside its own anchor (a cycle, which recursion would never end)."""
    sizes: dict[str, int] = {}  # anchor -> nodes of its node, its aliases expanded
    open_anchors: set[str] = set()
    stack: list[list] = [[0, None]]  # per open collection: [nodes so far, its anchor]
    total = 0
    for ev in yaml.parse(text, Loader=loader):
        if isinstance(ev, yaml.AliasEvent):
            if ev.anchor in open_anchors:
                line = ev.start_mark.line + 1 if ev.start_mark else "?"
                raise UsageError(
                    f"{name}: line {line}: the alias *{ev.anchor} is inside its own anchor "
                    f"&{ev.anchor}, so the value would contain itself without end. Replace the "
                    "alias with the value it should have."
                )
            n = sizes.get(ev.anchor, 1)  # an undefined alias: the loader names it
        elif isinstance(ev, yaml.ScalarEvent):
            n = 1
            if ev.anchor:
                sizes[ev.anchor] = 1
        elif isinstance(ev, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            if len(stack) > MAX_DEPTH:
                raise _too_deep(name, "yaml")
            stack.append([1, ev.anchor])
            if ev.anchor:
                open_anchors.add(ev.anchor)
            total += 1
            if total > MAX_NODES:
                raise _too_many(name, "yaml", "nodes with its aliases expanded")
            continue
        elif isinstance(ev, yaml.SequenceEndEvent | yaml.MappingEndEvent):
            n, anchor = stack.pop()
            if anchor:
                sizes[anchor] = n
                open_anchors.discard(anchor)
            stack[-1][0] += n
            continue
        else:
            continue
        stack[-1][0] += n
        total += n
        if total > MAX_NODES:
            raise _too_many(name, "yaml", "nodes with its aliases expanded")


def parse_tree(text: str, syntax: str, name: str) -> dict:
    """TOML / YAML / JSON text -> a mapping; a syntax error names the file and the line.
    Bounded: MAX_DEPTH levels, MAX_NODES nodes (YAML aliases expanded), no cycle."""
    if syntax == "toml" and text.count("=") + text.count(",") > MAX_NODES:
        # tomllib (pure Python) takes seconds on a 10 MB file: count its values first
        raise _too_many(name, syntax, "keys and array items")
    try:
        if syntax == "toml":
            tree = tomllib.loads(text)
        elif syntax == "json":
            tree = json.loads(text)
        else:
            yaml = yaml_module()
            loader = _yaml_loader(yaml)
            try:
                check_yaml_events(text, name, yaml, loader)
                tree = yaml.load(text, Loader=loader)  # a safe loader
            except yaml.YAMLError as exc:
                raise ValueError(str(exc).replace("\n", " ")) from None
    except RecursionError:
        raise _too_deep(name, syntax, parser=True) from None
    except (ValueError, TypeError, OverflowError) as exc:  # TOMLDecodeError, JSONDecodeError
        raise UsageError(f"{name}: not valid {syntax.upper()}: {str(exc)[:300]}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UsageError(
            f"{name}: the {syntax.upper()} holds a {type(tree).__name__}, not a mapping of "
            "config keys."
        )
    if syntax != "yaml":  # YAML's shape was checked on its events, aliases expanded
        check_shape(tree, name, syntax)
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


MAX_WORDS = 20_000  # words of a shell text (a launch command or override file has hundreds)


def load_text(text: str, name: str, syntax: str | None = None) -> Loaded:
    """Text in a given syntax (toml, yaml, json; anything else: shell-like tokens). A shell
    text over MAX_WORDS words is refused before it is tokenized (shlex takes ~20 s on a
    9.5 MB override file)."""
    if syntax in ("toml", "yaml", "json"):
        return Loaded(name, tree=parse_tree(text, syntax, name))
    words = len(text.split())
    if words > MAX_WORDS:
        raise UsageError(
            f"{name}: {words:,} words, over the limit of {MAX_WORDS:,} for a training script "
            "or a file of overrides (a launch command has hundreds): check that this is the "
            "config file."
        )
    try:
        return Loaded(name, tokens=shell_tokens(text))
    except UsageError as exc:
        raise UsageError(f"{name}: {exc}") from None


def load_file(path: str | Path) -> Loaded:
    """One config file, read whole: a regular file of at most CONFIG_CAP bytes (checked
    with os.stat before it is opened, so a FIFO or a device never blocks or streams)."""
    p = Path(path)
    text = safe_read.read_text(
        p,
        safe_read.CONFIG_CAP,
        "trainer config",
        "A trainer config is kilobytes: check that this is the config file (not a log, a "
        "checkpoint or a dump).",
        error=UsageError,
        what=f"--from-config {p}",
    )
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
