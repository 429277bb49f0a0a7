"""The documentation: README's length, links that resolve, and the generated pages current.

docs/gen_reference.py writes docs/rules.md from `mismatch-replay rules --json`, and the
marked blocks of the framework and command pages from the catalogue and the commands'
definitions; these tests fail when a committed page is not what the generator writes now
(the fix: `python docs/gen_reference.py`). `mkdocs build --strict` (.ci/run) checks the
site's links and anchors; here every relative link of README.md and docs/ must name a file.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _gen()
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^(```|~~~).*?^\1[ \t]*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def relative_links(text: str) -> list[str]:
    prose = _prose(text)
    targets = LINK.findall(prose) + HTML_LINK.findall(prose)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and t[0] != "#"]


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_readme_is_at_most_300_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines; issue 29 caps it at 300: move detail to docs/"


def test_link_finder_finds_links_and_skips_code():
    text = (
        "see [a](docs/a.md#x) and ![fig](img/b.png \"t\") and <img src='c.png'>\n"
        "`[not](code.md)` [web](https://x.org) [here](#anchor)\n```\n[no](fenced.md)\n```\n"
    )
    assert relative_links(text) == ["docs/a.md#x", "img/b.png", "c.png"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_to_a_file(page):
    missing = []
    for target in relative_links(page.read_text()):
        path = target.split("#", 1)[0].split("?", 1)[0]
        if not path:
            continue
        if not (page.parent / path).resolve().is_file():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to files that do not exist: {missing}"


def test_generated_pages_are_current():
    """docs/rules.md (from `rules --json`) and every marked block (presets, options)."""
    stale = [
        str(page.relative_to(ROOT))
        for page, text in GEN.pages().items()
        if not page.exists() or page.read_text() != text
    ]
    assert not stale, f"out of date: {stale}; run `python docs/gen_reference.py` and commit"


def test_rules_page_lists_every_rule_and_preset_of_rules_json():
    records = GEN.rules_json()
    text = (DOCS / "rules.md").read_text()
    for r in records:
        assert f"### `{r['name']}`" in text, r["name"]
        for preset in r["presets"]:
            assert f"`{r['name']}@{preset}`" in text, (r["name"], preset)
    # the generator is fed `rules --json`, not the registry behind it: a changed record
    # changes the page
    changed = json.loads(json.dumps(records))
    changed[0]["params"][0]["default"] = 12345.0
    assert "12345" in GEN.rules_page(changed) and "12345" not in text


def test_command_options_follow_the_command_definitions():
    import typer

    from mismatch_replay.cli import app

    cmd = typer.main.get_command(app).commands["sweep"]
    block = GEN.command_options("sweep")
    for p in cmd.params:
        if p.param_type_name == "option":
            assert f"`{p.opts[0]}`" in block, p.opts
    assert "1000000" in block  # --batch-rows' default


def test_every_command_and_framework_has_its_page_in_the_nav():
    import typer

    from mismatch_replay.cli import app
    from mismatch_replay.integrations.frameworks import FRAMEWORKS

    nav_files = []

    def walk(node):
        if isinstance(node, str):
            nav_files.append(node)
        elif isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for x in node.values():
                walk(x)

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    commands = set(typer.main.get_command(app).commands)
    missing = sorted(commands - set(GEN.COMMANDS))
    assert not missing, (
        f"command(s) {missing} have no page: add docs/commands/NAME.md (with an options block),"
        " list NAME in docs/gen_reference.py COMMANDS and in mkdocs.yml's nav"
    )
    wanted = [f"commands/{c}.md" for c in commands] + [f"{fw}.md" for fw in FRAMEWORKS]
    assert not set(wanted) - set(nav_files), set(wanted) - set(nav_files)
    readme = (ROOT / "README.md").read_text()
    assert not [fw for fw in FRAMEWORKS if f"(docs/{fw}.md)" not in readme]
