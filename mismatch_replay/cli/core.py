"""The typer application: how a command is registered, run, and turned into an exit code.

Design
------
`app` is the `mismatch-replay` Typer group; `command` registers a function on it with its
docstring, reflowed, as its --help (typer's rich mode keeps a docstring's line breaks, which
would break sentences at any width but the source's), its read options spread out
(`options.with_read_group`), and flags shown plainly (`--json`, not `--json <bool>`).

`run(body)` runs a command's body: a library error (`ReplayError`) becomes one line on stderr
and its exit code (1 bad data, 2 bad usage), Ctrl-C exits 130 and SIGTERM 143, never a
traceback; the library's own warnings print as they happen. `command_line(ctx)` rebuilds the
command line of the call (the sweep table's and the report's provenance). `main` is the
console script: SIGTERM unwinds like Ctrl-C, so temporaries and spills are removed.
"""

from __future__ import annotations

from collections.abc import Callable
from inspect import cleandoc
from typing import Annotated

import typer
import typer.core

from .. import __version__
from ..errors import ReplayError
from . import render
from .options import with_read_group


class _PlainFlags:
    """Flags render as plain flags in --help: `--json`, not `--json <bool>` (typer 0.29 shows
    a flag's type unless it has a metavar; an empty metavar shows nothing)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Command(_PlainFlags, typer.core.TyperCommand):
    pass


class _Group(_PlainFlags, typer.core.TyperGroup):
    pass


app = typer.Typer(
    name="mismatch-replay",
    cls=_Group,
    help=(
        "Replay logged trainer/inference token probabilities through every masking rule "
        "(IPO, IcePop, KPop, DPPO, TIS, sequence rules, ...) across threshold sweeps. "
        "Results go to stdout, progress and notes to stderr."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _reflow(doc: str) -> str:
    """A docstring's paragraphs as single lines. In rich markup mode typer keeps a
    docstring's line breaks, so text wrapped at 100 columns in the source would break
    mid-sentence at any other width; rich rewraps single-line paragraphs to the terminal."""
    paragraphs = cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def command(fn: Callable) -> Callable:
    """Register a command: its docstring (reflowed) is its --help; its `Reads` parameter
    becomes the read options; flags print plainly."""
    return app.command(cls=_Command, help=_reflow(fn.__doc__ or ""))(with_read_group(fn))


def run(fn: Callable[[], None]) -> None:
    """Run a command body; library errors become one line on stderr and an exit code.
    Warnings the library issues (mismatch_replay's own categories) print as they happen."""
    import warnings

    show = warnings.showwarning
    said: set[str] = set()  # a warning once a command (a log planned twice warns twice)

    def _show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("mismatch_replay"):
            if str(message) not in said:
                said.add(str(message))
                render.warn(str(message))
        else:
            show(message, category, filename, lineno, file, line)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show
            warnings.filterwarnings("always", module=r"mismatch_replay\.")  # every call
            fn()
    except ReplayError as exc:
        render.error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (output.terminate_as_interrupt)
        from ..output import Terminated

        term = isinstance(exc, Terminated)
        render.say("terminated" if term else "interrupted", to_err=True)
        raise typer.Exit(143 if term else 130) from None


def command_line(ctx: typer.Context) -> str:
    """The command line that reproduces this call, rebuilt from the parsed parameters."""
    import shlex

    words = ["mismatch-replay", ctx.info_name or ""]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if v is None or v == p.default or v == [] or (v is False and p.default is None):
            continue
        if getattr(p, "param_type_name", "") == "argument":
            words += [str(x) for x in (v if isinstance(v, list | tuple) else [v])]
        elif getattr(p, "is_flag", False):
            words.append(p.opts[0])
        else:
            for x in v if isinstance(v, list | tuple) else [v]:
                words += [p.opts[0], str(x)]
    return shlex.join(words)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        print(f"mismatch-replay {__version__}")
        raise typer.Exit(0)


def main() -> None:
    """The console script (`mismatch-replay`, `python -m mismatch_replay`)."""
    from ..output import exit_process, terminate_as_interrupt

    terminate_as_interrupt()  # SIGTERM unwinds like Ctrl-C: temporaries and m2po spills removed
    try:
        app(prog_name="mismatch-replay")
    except SystemExit as exc:
        exit_process(exc.code)  # os._exit where an object-store request is still stuck
    exit_process(0)
