"""Error types that carry a user-facing message.

Library code raises these with a complete sentence naming the file, the column, how many rows
and the fix; the CLI prints the message (no traceback) and exits with `exit_code`: 1 for bad
data, 2 for bad usage. Anything else escaping to the CLI is a bug in mismatch-replay.
"""

from __future__ import annotations


class ReplayError(Exception):
    """Base class: `str(err)` is the whole message shown to the user."""

    exit_code = 1


class DataError(ReplayError):
    """The input data cannot be used as it is (missing columns, NaN, bad files, ...)."""

    exit_code = 1


class UsageError(ReplayError):
    """The request is malformed (bad rule SPEC, bad grid, output exists without --force, ...)."""

    exit_code = 2


class OutputError(ReplayError):
    """An output could not be written (a full disk, an I/O error); nothing was left behind."""

    exit_code = 1
