"""Every command's --help shows its help text whole: no `[word]` eaten as rich markup.

typer renders help in rich markup mode (cli/core.py), where `[tensorboard]` is a style tag
and vanishes unless escaped (`\\[tensorboard]`), leaving "Needs the  extra". The test takes
each command's own text (its docstring and every option's help, as the source holds them),
and checks that the rendered --help holds every bracketed word of it and the text itself,
whitespace collapsed; and that no line has a hole: a word, two spaces, a word, where the
source has one space.
"""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from mismatch_replay.cli import app

BRACKET = re.compile(r"(?<!\\)\[[^\]\s]*\]")
BORDER = re.compile(r"[│╭╮╰╯─┃━]")


def _commands() -> dict[str, click.Command]:
    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


def _texts(cmd: click.Command) -> list[str]:
    """The command's help and each option's, as written (rich escapes undone)."""
    out = [cmd.help or ""]
    out += [getattr(p, "help", None) or "" for p in cmd.params]
    return [t.replace("\\[", "[") for t in out if t]


def _flat(s: str) -> str:
    return " ".join(BORDER.sub(" ", s).split())


def _render(name: str) -> str:
    got = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "400", "TERM": "dumb"})
    assert got.exit_code == 0, got.output
    return got.output


@pytest.mark.parametrize("name", sorted(_commands()))
def test_help_keeps_every_bracket(name):
    cmd = _commands()[name]
    shown = _render(name)
    flat = _flat(shown)
    for text in _texts(cmd):
        for word in BRACKET.findall(text):
            assert word in flat, f"{name} --help lost {word!r}"
        # the whole text, as a reader sees it (the option table rewraps it)
        assert _flat(text) in flat, f"{name} --help does not show: {text[:80]!r}"
    for line in shown.splitlines():
        cell = BORDER.sub("|", line)
        for part in cell.split("|"):
            # within one cell of help text, two spaces between words mark an eaten bracket
            hole = re.search(r"\b(the|Needs|a|an|with)  \S", part)
            assert hole is None, f"{name} --help has a hole: {part.strip()!r}"


def test_the_check_finds_an_unescaped_bracket():
    """The same check on a throwaway command with an unescaped tag: it must fail."""
    demo = typer.Typer(rich_markup_mode="rich")

    @demo.command()
    def one(x: str = typer.Option("", help="Needs the [tensorboard] extra.")) -> None:
        """A command."""

    @demo.command()
    def two() -> None:
        """Another."""

    got = CliRunner().invoke(demo, ["one", "--help"], env={"COLUMNS": "400"})
    flat = _flat(got.output)
    assert "[tensorboard]" not in flat and "Needs the extra." in flat
