"""Writing results: CSV, Parquet or JSON by suffix, atomically, never over an existing file.

Design
------
Every output of every command (tables, figures, the report page, `convert`'s Parquet file or
hive directory, `simulate`'s log) goes through `atomic_write`: the bytes are written to a
temporary name in the target's directory, then published in one step:

- without `force`, exclusively: a file by `os.link(tmp, target)` (fails with EEXIST if the
  target appeared meanwhile, say from a second `convert` to the same path) then unlinking
  tmp; a directory by `renameat2(RENAME_NOREPLACE)` (Linux), else `rename` (which refuses a
  non-empty target). On a file system without hard links a file falls back to
  renameat2, then to claiming the name with `O_CREAT | O_EXCL` before `os.replace`.
  So a target that appears while a command runs is never replaced: the command says so;
- with `force`, by `os.replace` (a directory: the old one is moved aside first, removed after).

The temporary name is `.<target name>.<host>-<pid>-<random>.tmp`: hidden, so every reader
skips it (io skips hidden files and directories), and it says who wrote it. A run killed
before it could clean up (SIGKILL, a power cut) leaves one behind; the next write into that
directory on the same host removes the temporaries of processes that no longer exist
(`reclaim`). SIGINT and SIGTERM (`terminate_as_interrupt`) unwind normally and remove theirs.

Failures become one sentence (`output_error`): a read-only directory, a full disk, a name too
long, a parent that is a file, each naming the path and the fix; nothing is left behind.
JSON carries `schema_version` and writes null for every undefined number: NaN and infinities
never reach a JSON file.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import OutputError, ReplayError, UsageError

if TYPE_CHECKING:  # polars is imported by whoever made the frame: --help stays fast
    import polars as pl

SCHEMA_VERSION = 1
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".json": "json"}

# who wrote a temporary file: this host (6 hex digits of a hash of its name) and process id
HOST_TAG = hashlib.blake2s(socket.gethostname().encode(), digest_size=3).hexdigest()
# .<name>.<host>-<pid>-<random>.tmp ; the name part is cut so the whole stays within 255 bytes
TEMP_NAME = re.compile(r"^\..*\.(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$", re.S)
_NAME_ROOM = 200  # bytes of the target's name kept in a temporary name


def check_target(path: str | Path, force: bool) -> Path:
    """Refuse an existing file (unless force) or an unknown suffix, before any work is done."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise UsageError(
            f"-o {p}: unknown output format '{p.suffix}'. Use .csv, .parquet or .json."
        )
    try:
        exists, is_dir = p.exists(), p.is_dir()
    except OSError as exc:  # a name too long, a parent that is a file, ...
        raise output_error(exc, p) from None
    if exists and not force:
        raise UsageError(f"-o {p}: the file exists. Pass --force to overwrite it.")
    if is_dir:
        raise UsageError(f"-o {p}: that is a directory; give a file name.")
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def normal_mode(path: str | Path) -> None:
    """Give a temporary file (mkstemp: 0600) or directory (mkdtemp: 0700) the permissions a
    plainly created one would have (0666 / 0777 minus the umask) before it is renamed."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())


# ----------------------------------------------------------------------------- temporaries


def temp_name(target: str | Path) -> Path:
    """A fresh temporary name beside target: hidden, tagged with this host and process."""
    p = Path(target)
    stem = p.name.encode()[:_NAME_ROOM].decode("utf-8", "ignore")
    return p.parent / f".{stem}.{HOST_TAG}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def is_temp(name: str) -> bool:
    """Is this a temporary file or directory of mismatch-replay (any process, any host)?"""
    return TEMP_NAME.match(name) is not None


def pid_alive(pid: int) -> bool:
    """Does process `pid` exist on this host? (A process of another user counts.)"""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def stale(name: str) -> bool:
    """A temporary of this host whose process has ended (killed before it could clean up)."""
    m = TEMP_NAME.match(name)
    return (
        m is not None
        and m["host"] == HOST_TAG
        and int(m["pid"]) != os.getpid()
        and not pid_alive(int(m["pid"]))
    )


def remove(path: str | Path) -> None:
    """Remove a file or a directory tree; quietly, if it is gone already."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError, OSError):
            p.unlink()


def reclaim(directory: str | Path) -> list[Path]:
    """Remove the temporaries that killed runs of this host left in `directory`; returns them.
    Cheap (one directory listing); every error is ignored (it is housekeeping)."""
    gone = []
    try:
        with os.scandir(directory) as it:
            names = [e.name for e in it if e.name.startswith(".") and e.name.endswith(".tmp")]
    except OSError:
        return gone
    for name in names:
        if stale(name):
            remove(Path(directory) / name)
            gone.append(Path(directory) / name)
    return gone


# ----------------------------------------------------------------------------- publishing

_RENAME_NOREPLACE = 1
_libc = None


def _renameat2(src: Path, dst: Path) -> bool:
    """rename(src, dst) failing with EEXIST if dst exists (Linux renameat2); False when the
    system has no renameat2 (the caller falls back)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.renameat2  # noqa: B018 -- glibc >= 2.28
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    at_fdcwd = -100
    rc = _libc.renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _RENAME_NOREPLACE)
    if rc == 0:
        return True
    e = ctypes.get_errno()
    if e in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # kernel or file system lacks it
        return False
    raise OSError(e, os.strerror(e), str(dst))


def _appeared(target: Path) -> UsageError:
    return UsageError(
        f"-o {target}: it appeared while this command ran (another process wrote it), so it "
        "was left as it is and this result was not written. Pass --force to overwrite it, or "
        "choose another name."
    )


def publish(tmp: Path, target: Path, force: bool = False) -> None:
    """Move a finished temporary file or directory to target: exclusively unless force."""
    if tmp.is_dir():
        if force and target.exists():
            _replace_dir(tmp, target)
            return
        try:
            if not _renameat2(tmp, target):
                os.rename(tmp, target)  # refuses a non-empty directory or a file there
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise _appeared(target) from None
            raise
        return
    if force:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)  # atomic, and fails instead of overwriting
    except FileExistsError:
        raise _appeared(target) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        try:  # a file system without hard links
            if _renameat2(tmp, target):
                return
        except FileExistsError:
            raise _appeared(target) from None
        try:  # claim the name first: a second writer's O_EXCL fails
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        except FileExistsError:
            raise _appeared(target) from None
        os.replace(tmp, target)
        return
    os.unlink(tmp)


def _replace_dir(tmp: Path, target: Path) -> None:
    """--force for a directory: the old one is moved aside, the new one in, the old removed."""
    old = temp_name(target)
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    remove(old)


# ----------------------------------------------------------------------------- errors

_ERRNO_TEXT = re.compile(r"(?:os error|errno)\s*(\d+)", re.I)


def errno_of(exc: BaseException) -> int | None:
    """The errno behind an exception: OSError.errno, or `(os error N)` / `[Errno N]` in the
    message (polars and pyarrow wrap I/O errors in their own exception types)."""
    e = getattr(exc, "errno", None)
    if isinstance(e, int):
        return e
    m = _ERRNO_TEXT.search(str(exc))
    return int(m.group(1)) if m else None


def _free(d: Path) -> str:
    try:
        st = os.statvfs(d)
    except OSError:
        return "unknown"
    b = st.f_bavail * st.f_frsize
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "bytes" else f"{b:.1f} {unit}"
        b /= 1024
    return "unknown"


def _existing_parent(p: Path) -> Path:
    for a in p.parents:
        if a.exists():
            return a
    return Path(".")


def output_error(exc: BaseException, target: str | Path, what: str = "-o") -> ReplayError:
    """One sentence for an OSError (or an I/O error wrapped by polars / pyarrow) met while
    writing target: the path, what went wrong, the fix. `what` names the option (`-o`) or
    the thing written (`m2po's spill directory`)."""
    p = Path(target)
    e = errno_of(exc)
    parent = p.parent
    if e in (errno.ENOSPC, errno.EDQUOT):
        kind = "the disk quota" if e == errno.EDQUOT else "the disk"
        return OutputError(
            f"{what} {p}: {kind} holding {parent} is full ({_free(parent)} free); the partial "
            "output was removed. Free some space, or write elsewhere."
        )
    if e in (errno.EACCES, errno.EPERM):
        return UsageError(
            f"{what} {p}: no permission to write in {parent}. Choose a directory you can "
            "write to, or fix its permissions."
        )
    if e == errno.EROFS:
        return UsageError(
            f"{what} {p}: {parent} is on a read-only file system. Choose a directory you can "
            "write to."
        )
    if e == errno.ENAMETOOLONG:
        n = len(os.fsencode(p.name))
        return UsageError(
            f"{what} {p}: the name is too long for the file system ({n} bytes; most allow 255 "
            "bytes a name and 4096 a path). Choose a shorter name."
        )
    if e in (errno.ENOTDIR, errno.EEXIST) and not parent.is_dir():
        blocker = _existing_parent(p)
        return UsageError(
            f"{what} {p}: {blocker} is a file, not a directory, so nothing can be written "
            "under it. Choose another path."
        )
    if e == errno.EISDIR:
        return UsageError(f"{what} {p}: that is a directory; give a file name.")
    reason = getattr(exc, "strerror", None) or str(exc)
    return OutputError(
        f"{what} {p}: writing failed ({reason}); the partial output was removed. Check the "
        "disk and the path, or write elsewhere."
    )


def _is_io_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or (isinstance(exc, Exception) and errno_of(exc) is not None)


def exists(path: str | Path, what: str = "-o") -> bool:
    """Path.exists(), with a one-sentence error where the path cannot even be looked up (a
    name too long, a parent that is a file is just False)."""
    try:
        return Path(path).exists()
    except OSError as exc:
        raise output_error(exc, path, what) from None


def ensure_dir(path: str | Path, what: str = "-o") -> Path:
    """mkdir -p, with a one-sentence error (read-only, a parent that is a file, ...)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, p, what) from None
    return p


def atomic_write(
    path: str | Path,
    write: Callable[[Path], None],
    force: bool = False,
    directory: bool = False,
) -> Path:
    """Call write(tmp) and publish tmp at path (exclusively unless force); remove tmp on any
    failure or interruption. `directory`: tmp is a directory created beforehand (write fills
    it). I/O failures become one-sentence ReplayErrors (`output_error`)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, p) from None
    reclaim(p.parent)
    tmp = temp_name(p)
    try:
        if directory:
            os.mkdir(tmp)  # 0777 minus the umask, as a plain mkdir
        else:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError as exc:
        raise output_error(exc, p) from None
    try:
        write(tmp)
        publish(tmp, p, force)
    except BaseException as exc:
        remove(tmp)
        if isinstance(exc, ReplayError) or not _is_io_error(exc):
            raise
        raise output_error(exc, p) from exc
    return p


# ----------------------------------------------------------------------------- signals


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that everything unwinds the same
    way (temporaries removed, m2po's spill directory removed)."""


def _terminated(signum, frame):
    raise Terminated(f"terminated by signal {signum}")


def terminate_as_interrupt() -> None:
    """Make SIGTERM behave like SIGINT (Ctrl-C): it raises `Terminated` (a KeyboardInterrupt)
    in the main thread, so temporary files and m2po's spill directory are removed on the way
    out. Call it once from the main thread of a command-line entry point."""
    with contextlib.suppress(ValueError, OSError):  # not the main thread, or no SIGTERM
        signal.signal(signal.SIGTERM, _terminated)


# directories to remove however the process ends short of SIGKILL (m2po's spills register
# theirs): at exit, and in exit_process before os._exit skips the atexit handlers
SCRATCH_DIRS: set[str] = set()


def remove_scratch() -> None:
    for d in list(SCRATCH_DIRS):
        shutil.rmtree(d, ignore_errors=True)
        SCRATCH_DIRS.discard(d)


atexit.register(remove_scratch)


def exit_process(code: int | None) -> None:
    """End a command-line process with `code`, now. Normally sys.exit; but when an object-store
    request is still running after a timeout or Ctrl-C (ingest.stuck_requests), pyarrow's S3
    finalizer would wait for it (seconds to minutes) at exit, so the streams are flushed,
    scratch directories removed and the process ended with os._exit(code)."""
    import sys

    sources = sys.modules.get("mismatch_replay.ingest.sources")
    if sources is not None and sources.stuck_requests():
        remove_scratch()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))
    sys.exit(code)


# ----------------------------------------------------------------------------- formats


def clean(obj):
    """Recursively replace non-finite floats by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    return obj


def to_json(payload: dict) -> str:
    return json.dumps(clean({"schema_version": SCHEMA_VERSION, **payload}), indent=2)


def write_table(
    df: pl.DataFrame, path: str | Path, force: bool = False, meta: dict | None = None
) -> Path:
    """Write a table by suffix (.csv, .parquet, .json), atomically; an existing file (or one
    that appears meanwhile) is replaced only with force."""
    p = check_target(path, force)
    fmt = FORMATS[p.suffix.lower()]
    if fmt == "csv":
        return atomic_write(p, lambda t: df.write_csv(t), force)
    if fmt == "parquet":
        return atomic_write(p, lambda t: df.write_parquet(t, compression="zstd"), force)
    text = to_json({**(meta or {}), "rows": df.to_dicts()})
    return atomic_write(p, lambda t: t.write_text(text + "\n"), force)
