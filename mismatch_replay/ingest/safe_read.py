"""Bounded reading of a file the tool reads whole: regular files only, a size cap, a line cap.

Design
------
A file that is parsed in one piece (a trainer config, a pickled SkyRL batch, a torch dump,
prime-rl's trace annotations) or line by line (JSON lines) is only as safe as its worst
input: `/dev/zero` or `/dev/urandom` given as a config grows memory until MemoryError (3 GB
in 2 s), a FIFO blocks `open()` forever, a 40 GB file with no newline is one "line". So
every such reader goes through here first:

* `check_file` looks with `os.stat` (never `open`, which blocks on a FIFO until a writer
  comes) and refuses a directory, a FIFO, a socket or a device, and a file over its cap,
  with one sentence naming the file, what it is, the cap and the fix.
* `read_bytes` / `read_text` then open with `O_NONBLOCK` (a FIFO swapped in after the stat
  cannot block either), check the opened descriptor again with `fstat`, and read at most
  cap + 1 bytes: a file that grows past its cap while being read is refused, not followed.
* `open_checked` is the same for a reader that streams the file (JSON lines);
  `LINE_CAP` bounds one line of it (a record of a 128k-token packed sequence is ~25 MB).

Caps (bytes): a trainer config is kilobytes, so `CONFIG_CAP` is 10 MB; a data file read
whole (`DATA_CAP`, 4 GiB: a SkyRL step is tens to hundreds of MB) or a JSON line is held in
memory at about its size on disk (SkyRL's float32 arrays become float64: ~2x), so its cap is
about what a laptop holds; `MISMATCH_REPLAY_MAX_FILE_MB` raises (or lowers) the data caps
for a bigger machine. The config cap is fixed: no real config comes near it.

Each error is the caller's type (`UsageError` for a config, exit 2; `DataError` for a token
log, exit 1) so the CLI prints one line.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import DataError, ReplayError

MB = 1 << 20
CONFIG_CAP = 10 * MB  # a trainer config is kilobytes: 10 MB is generous
DATA_CAP = 4 << 30  # a file a data reader holds whole (SkyRL pickle, slime dump, annotations)
LINE_CAP = 256 * MB  # one JSON line (a prime-rl record of a 128k-token sequence: ~25 MB)
ENV_CAP = "MISMATCH_REPLAY_MAX_FILE_MB"


def data_cap(default: int = DATA_CAP) -> int:
    """The cap for a data file read whole: `default`, or MISMATCH_REPLAY_MAX_FILE_MB."""
    text = os.environ.get(ENV_CAP, "").strip()
    if not text:
        return default
    try:
        mb = float(text)
    except ValueError:
        raise DataError(
            f"{ENV_CAP}={text!r} is not a number of megabytes; set it to e.g. 16384, or unset it."
        ) from None
    if not mb > 0:
        raise DataError(f"{ENV_CAP}={text!r}: give a positive number of megabytes, or unset it.")
    return int(mb * MB)


def size_text(n: int) -> str:
    """Bytes as a short, exact-enough text: 10 MB, 4 GB, 512 bytes."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.3g} GB"
    if n >= MB:
        return f"{n / MB:.3g} MB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.3g} kB"
    return f"{n} bytes"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _stat_error(what: str, exc: OSError, error: type[ReplayError]) -> ReplayError:
    if exc.errno == errno.ENOENT:
        return error(f"{what}: no such file.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return error(f"{what}: no permission to read it. Check its permissions.")
    if exc.errno == errno.ENAMETOOLONG:
        return error(f"{what}: the name is too long for the file system. Check the path.")
    if exc.errno == errno.ELOOP:
        return error(f"{what}: a loop of symbolic links. Point at the file itself.")
    return error(f"{what}: cannot read it ({exc.strerror or exc}).")


def _refuse_kind(what: str, mode: int, kind: str, error: type[ReplayError]) -> ReplayError:
    k = _kind(mode)
    fix = (
        "give the file inside it"
        if stat.S_ISDIR(mode)
        else "write it to a regular file first and give that file"
    )
    return error(f"{what}: that is {k}, not a regular file; a {kind} is read from a file: {fix}.")


def _refuse_size(what: str, size: int, cap: int, kind: str, fix: str, error) -> ReplayError:
    """`size` > `cap`: the file's size from stat, or -1 when it grew while being read."""
    found = "grew while being read, past" if size < 0 else f"{size_text(size)}, over"
    return error(f"{what}: {found} the {size_text(cap)} limit for a {kind}. {fix}")


def check_file(
    path: str | os.PathLike,
    cap: int | None,
    kind: str,
    fix: str,
    error: type[ReplayError] = DataError,
    what: str | None = None,
) -> os.stat_result:
    """The file's stat, after refusing anything but a regular file of at most `cap` bytes.
    `kind` names what the file should be ("trainer config"), `fix` is the sentence that says
    what to do about a file over the cap, `what` how the file is named in messages (default:
    its path). Never opens the file (a FIFO would block)."""
    what = what or str(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _stat_error(what, exc, error) from None
    except ValueError as exc:  # an embedded NUL
        raise error(f"{what}: not a valid path ({exc}).") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_kind(what, st.st_mode, kind, error)
    if cap is not None and st.st_size > cap:
        raise _refuse_size(what, st.st_size, cap, kind, fix, error)
    return st


def open_checked(
    path: str | os.PathLike,
    cap: int | None,
    kind: str,
    fix: str,
    error: type[ReplayError] = DataError,
    what: str | None = None,
):
    """A binary file object for a regular file of at most `cap` bytes (None: any size, for a
    reader that streams it), checked before and after opening (`O_NONBLOCK`, so a FIFO
    swapped in after the check cannot block)."""
    what = what or str(path)
    check_file(path, cap, kind, fix, error, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _stat_error(what, exc, error) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse_kind(what, st.st_mode, kind, error)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(
    path: str | os.PathLike,
    cap: int,
    kind: str,
    fix: str,
    error: type[ReplayError] = DataError,
    what: str | None = None,
) -> bytes:
    """The whole of a regular file of at most `cap` bytes (a file that grows past the cap
    while it is read is refused too)."""
    what = what or str(path)
    with open_checked(path, cap, kind, fix, error, what) as f:
        try:
            data = f.read(cap + 1)
        except OSError as exc:
            raise error(f"{what}: reading failed part-way ({exc}).") from None
    if len(data) > cap:
        raise _refuse_size(what, -1, cap, kind, fix, error)
    return data


def read_text(
    path: str | os.PathLike,
    cap: int,
    kind: str,
    fix: str,
    error: type[ReplayError] = DataError,
    what: str | None = None,
) -> str:
    """`read_bytes` decoded as UTF-8; bytes that are not UTF-8 name the offset."""
    what = what or str(path)
    data = read_bytes(path, cap, kind, fix, error, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what}: not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}); a {kind} "
            "is a text file: check that this is the right file."
        ) from None


def line_too_long(path: Path, line: int, cap: int = LINE_CAP) -> DataError:
    """A JSON-lines file whose line `line` runs past `cap` bytes without a newline."""
    return DataError(
        f"{path}, line {line}: longer than {size_text(cap)} without a newline, so it is not a "
        "JSON-lines record (a prime-rl record of a 128k-token sequence is ~25 MB). Check that "
        f"this is a JSON-lines token log; {ENV_CAP} raises the limit for longer records."
    )


def line_cap() -> int:
    """The cap on one JSON line: LINE_CAP, or MISMATCH_REPLAY_MAX_FILE_MB when set."""
    return data_cap(LINE_CAP)


__all__ = [
    "CONFIG_CAP",
    "DATA_CAP",
    "ENV_CAP",
    "LINE_CAP",
    "check_file",
    "data_cap",
    "line_cap",
    "line_too_long",
    "open_checked",
    "read_bytes",
    "read_text",
    "size_text",
]
