"""The layering DESIGN.md promises, checked on the source: no import cycle between the
package's modules (imports inside functions included), no module reading another's private
names, no module over 900 lines, and the folders the design names."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "mismatch_replay"
MAX_LINES = 900
LAYOUT = ("ingest", "rules", "engine", "fast", "analysis", "viz", "capture")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


@functools.cache
def _tree(mod: str) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks (none of them changes it)."""
    path = MODULES[mod]
    return ast.parse(path.read_text(), str(path))


def _resolve(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _target(name: str) -> str | None:
    """The package module a dotted name lives in (the longest prefix that is one)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        if cand in MODULES:
            return cand
    return None


@functools.cache
def _imports(mod: str) -> tuple[tuple[str, str | None, int], ...]:
    """(module imported, name taken from it or None, line) for every import in `mod`."""
    path = MODULES[mod]
    is_pkg = path.name == "__init__.py"
    tree = _tree(mod)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                t = _target(a.name)
                if t:
                    out.append((t, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, is_pkg, node.level, node.module) if node.level else node.module
            if src is None or not src.startswith("mismatch_replay"):
                continue
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in MODULES:  # `from . import engine`
                    out.append((sub, None, node.lineno))
                else:
                    t = _target(src)
                    if t:
                        out.append((t, a.name, node.lineno))
    return tuple(out)


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for mod in MODULES:
        deps = set()
        for t, _name, _line in _imports(mod):
            if t == mod:
                continue
            # a package's __init__ re-exporting its own modules is not a dependency edge
            # from the modules on their package
            if mod.startswith(t + ".") and MODULES[t].name == "__init__.py":
                continue
            deps.add(t)
        g[mod] = deps
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _private_uses(mod: str) -> list[str]:
    path = MODULES[mod]
    tree = _tree(mod)
    bad = []
    aliases: dict[str, str] = {}  # local name -> package module
    for t, name, line in _imports(mod):
        if t == mod:
            continue
        private = name is not None and name.startswith("_") and not name.startswith("__")
        # a package's __init__ may take its own modules' names
        if private and not (t.startswith(mod + ".") and path.name == "__init__.py"):
            bad.append(f"{mod}:{line} imports {t}.{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            is_pkg = path.name == "__init__.py"
            src = _resolve(mod, is_pkg, node.level, node.module)
            for a in node.names:
                sub = f"{src}.{a.name}"
                if sub in MODULES:
                    aliases[a.asname or a.name] = sub
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases[node.value.id] != mod
        ):
            bad.append(f"{mod}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return bad


def test_no_module_takes_another_modules_private_names():
    bad = [b for mod in MODULES for b in _private_uses(mod)]
    assert not bad, "\n".join(bad)


def test_no_module_over_900_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("folder", LAYOUT)
def test_the_designs_folders_are_packages(folder):
    assert (PKG / folder / "__init__.py").is_file()


def test_every_module_opens_with_a_docstring():
    missing = [m for m in MODULES if ast.get_docstring(_tree(m)) is None]
    assert not missing, f"modules without a docstring: {missing}"


def test_the_public_api_resolves_lazily():
    import subprocess
    import sys

    code = (
        "import sys, mismatch_replay as m\n"
        "assert 'polars' not in sys.modules and 'numpy' not in sys.modules\n"
        "names = [n for n in m.__all__ if n != '__version__']\n"
        "assert all(callable(getattr(m, n)) for n in names), names\n"
        "print(len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 12
