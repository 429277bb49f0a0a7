"""The `mismatch-replay` command line: parse, call one library function, format.

Design
------
No computation lives here. Each command turns its options into library arguments, calls one
function (`engine.sweep`, `analysis.inspect.inspect_log`, ...) and formats the result: a
rich table on stdout by default, machine-readable output with `--json` or `-o FILE`.
Progress bars and notes go to stderr so that stdout can be piped. Library errors
(`ReplayError`) become one readable line on stderr and exit code 1 (bad data) or 2 (bad
usage); no traceback.
Heavy modules are imported inside the commands so that `--help` starts fast.

The modules, each with one job:

- core.py: the Typer app, command registration (`@command`), `run` (errors -> exit codes),
  the rebuilt command line, `--version` and `main`, the console script;
- options.py: every option that several commands share, declared once, and the group of
  seven read options that a command takes as one parameter (`read: Reads`);
- commands.py: the commands that read a log, each a signature (its interface) and a
  short body; logs.py: the three that write one (simulate, demo, convert);
- render.py: what a terminal shows: the progress line, tables fitted to the terminal
  without cutting a number or a rule parameter, one `print_*` per result.

On a terminal (tests/test_pty.py runs every command in one, 80 and 120 columns) the progress
line counts rows per pass over the log; a sweep that cannot fit as one table is folded into
one table per rule setting. Text from the library is printed without rich markup (`[torch]`
in an install hint is not a style tag).
"""

from __future__ import annotations

from . import commands, logs  # noqa: F401  (register the commands on `app`, in this order)
from .core import app, main

__all__ = ["app", "main"]
