"""Sources: the SOURCES of a command -> the files to read and their one format.

Design
------
Files, directories (searched recursively) and globs are resolved first (`resolve`), each
file's format detected from its path (formats.detect: `step_<n>/rank_<r>.jsonl` prime-rl,
`train_data_step<N>.jsonl` NeMo-RL, `.pt` slime, other `.jsonl` canonical JSONL, `.parquet`;
an unknown suffix sniffed from the first bytes) or forced with `--format`. One call reads one
format (a mix is refused: the schemas would not agree); a directory holding one framework's
files and other files reads the framework's and says what it ignored, and slime's rollout
dumps beside its train dumps are skipped with a note. Framework files are ordered by
`natural_key` (step_2 before step_10). Hidden files and directories under a directory
source are skipped, among them the temporaries of a write still running or killed
(`output.temp_name`); a source that is not a regular file (a FIFO, a socket) is named for
what it is, not as missing (`_not_a_file`).

Markers: prime-rl steps without a `STABLE` marker are still being written and are skipped
with a note unless `include_unstable`; so are the step directories `step=N/` of
`capture.TokenWriter` (`rank=R.parquet` files) without a `COMMIT_MARKER` (`_SUCCESS`) yet,
when found through a directory or a glob (a file named on its own is read). The notes become
the plan's warnings.

Object stores: a source with a scheme (`s3://bucket/prefix/`, `gs://...`, `hdfs://...`,
`file://...`) goes through `pyarrow.fs`: an object, every .parquet under a prefix, or a glob;
the files are `RemotePath`s (the key as a path, the filesystem alongside) and are opened
through that filesystem (`parquet_file`), here or on a Ray worker. Object stores hold
Parquet only (the other formats' readers want local files: convert first). Every request to
one is bounded by `ReadOptions.io_timeout` (default IO_TIMEOUT_S = 30 s, `--io-timeout`): the
S3 client's connect and request timeouts, the GCS client's retry limit
(`filesystem_from_uri`), and `remote_call`, which runs each metadata request in a daemon
thread so that Ctrl-C stops a stuck connect at once (pyarrow's C++ client does not return to
Python until it gives up: 674 s for gs:// without a network). `stuck_requests` counts the
requests given up on that still run (output.exit_process then ends the process at once).
"""

from __future__ import annotations

import errno
import glob as _glob
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataError, UsageError
from ..output import is_temp
from . import formats
from .canonical import IO_TIMEOUT_S, ReadOptions
from .formats import FORMATS

# capture.TokenWriter's layout: step=N/rank=R.parquet, committed by a COMMIT_MARKER file in step=N/
COMMIT_MARKER = "_SUCCESS"
CAPTURE_FILE = re.compile(r"rank=\d+\.parquet")
CAPTURE_DIR = re.compile(r"step=\d+")


def resolve_sources(
    sources: Sequence[str | Path], options: ReadOptions | None = None
) -> list[Path]:
    """Expand files, directories (recursively) and globs; keep order, no dups."""
    return resolve(sources, options or ReadOptions())[0]


def resolve(
    sources: Sequence[str | Path], options: ReadOptions
) -> tuple[list[Path], str, list[str]]:
    """(files, their one format, warnings). Detects each source's format (or takes
    --format), refuses a mix, and skips prime-rl steps that are still being written."""
    if not sources:
        raise UsageError("no SOURCES given: pass a Parquet file, a directory or a glob")
    forced = _check_format(options.format)
    notes: list[str] = []
    out: list[tuple[Path, str, str]] = []  # (file, format, the SOURCE it came from)
    for s in sources:
        text = str(s)
        p = Path(text)
        if is_uri(text):
            out.extend(_resolve_uri(text, forced, options.io_timeout))
        elif any(ch in text for ch in "*?["):
            matched = [
                Path(x)
                for x in _glob.glob(text, recursive=True)
                if Path(x).is_file() and not any(is_temp(part) for part in Path(x).parts)
            ]
            if not matched:
                raise DataError(f"{text}: the glob matches no file. Check the pattern and quoting.")
            found = []
            rollout_dumps = []
            for x in sorted(matched):
                k = formats.detect(x)
                if k == "slime" and forced in (None, "slime") and formats.is_slime_rollout_dump(x):
                    rollout_dumps.append(x)
                elif k is not None:
                    found.append((x, forced or k, text))
            if rollout_dumps and any(k == "slime" for _, k, _ in found):
                notes.append(_rollout_note(rollout_dumps))
            elif rollout_dumps:
                found += [(x, "slime", text) for x in rollout_dumps]
            if not found:
                raise DataError(
                    f"{text}: the glob matches {len(matched)} file(s) but none is a token log "
                    "(.parquet, .jsonl, .pt). Narrow the pattern, or pass --format."
                )
            fmts = {k for _, k, _ in found}
            if fmts & set(formats.FRAMEWORKS):
                found.sort(key=lambda e: natural_key(e[0]))
            kept = set(_committed_only(text, [x for x, _, _ in found], options, notes))
            out.extend(e for e in found if e[0] in kept)
        elif _is_dir(p):
            files, k = _walk(p, forced, notes)
            if k != "parquet":
                files = sorted(files, key=natural_key)
            files = _committed_only(text, files, options, notes)
            out.extend((x, k, text) for x in files)
        elif _is_file(p):
            out.append((p, forced or formats.detect(p) or formats.sniff(p), text))
        else:
            raise _not_a_file(p)
    seen: set[Path] = set()
    uniq = []
    for e in out:
        r = e[0].resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(e)
    by_format: dict[str, str] = {}
    for _, k, src in uniq:
        by_format.setdefault(k, src)
    if len(by_format) > 1:
        parts = "; ".join(f"{src} is {k}" for k, src in by_format.items())
        raise DataError(
            f"SOURCES mix formats ({parts}). Read one format per call (convert the others to "
            "Parquet first with mismatch-replay convert), or pass --format NAME."
        )
    fmt = uniq[0][1]
    files = [e[0] for e in uniq]
    if fmt == "prime-rl":
        files = _stable_only(files, options.include_unstable, notes)
    return files, fmt, notes


def _check_format(fmt: str | None) -> str | None:
    if fmt in (None, "", "auto"):
        return None
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: known formats: auto, {', '.join(FORMATS)}.")
    return fmt


def _kinds_text(kinds: dict[str, list[Path]]) -> str:
    return ", ".join(f"{len(v)} {k} file(s) (e.g. {v[0]})" for k, v in kinds.items())


def _rollout_note(skipped: list[Path]) -> str:
    return (
        f"skipped {len(skipped)} slime rollout dump(s) under {skipped[0].parent} (e.g. "
        f"{skipped[0].name}): --dump-details writes the sampler's samples there, without "
        "trainer log-probs; the train dumps beside them (train_data/) are read."
    )


def _walk(d: Path, forced: str | None, notes: list[str]) -> tuple[list[Path], str]:
    """The token-log files under a directory, and their format."""
    kinds: dict[str, list[Path]] = {}
    others = 0
    rollout_dumps: list[Path] = []
    for x in sorted(d.rglob("*")):
        # hidden files and directories are skipped: among them the temporaries of a write
        # still running or killed (output.temp_name: .NAME.HOST-PID-RANDOM.tmp, a file or a
        # partitioned convert's directory of step=N/ files)
        if any(part.startswith(".") for part in x.relative_to(d).parts) or not x.is_file():
            continue
        k = formats.detect(x)
        if k is None:
            others += 1
        elif k == "slime" and forced in (None, "slime") and formats.is_slime_rollout_dump(x):
            rollout_dumps.append(x)
        else:
            kinds.setdefault(k, []).append(x)
    if rollout_dumps and kinds.get("slime"):
        notes.append(_rollout_note(rollout_dumps))
    elif rollout_dumps:  # only rollout dumps: the reader says what they are
        kinds["slime"] = rollout_dumps
    if forced is not None:
        found = kinds.get(forced, [])
        if not found and forced in formats.JSON_FORMATS:  # --format names the layout
            found = sorted(x for k in formats.JSON_FORMATS for x in kinds.get(k, []))
        if not found:
            seen = _kinds_text(kinds) if kinds else f"{others} other file(s)"
            raise DataError(
                f"{d}: no {forced} file under it (searched recursively; found {seen}). "
                "Point at the directory the trainer wrote, or drop --format to detect it."
            )
        return found, forced
    if not kinds:
        raise DataError(
            f"{d}: the directory holds no .parquet file and no other token log (searched "
            f"recursively for .parquet, .jsonl, .pt, .pkl, prime-rl step_<n>/rank_<r>.jsonl; found "
            f"{others} other file(s)). Point at a directory of token logs, or convert the log "
            "first."
        )
    frameworks = [k for k in kinds if k in formats.FRAMEWORKS]
    if len(frameworks) > 1 or (not frameworks and len(kinds) > 1):
        raise DataError(
            f"{d}: the directory mixes formats: {_kinds_text(kinds)}. Pass --format NAME to "
            "read one of them, or point at a subdirectory."
        )
    fmt = frameworks[0] if frameworks else next(iter(kinds))
    ignored = {k: v for k, v in kinds.items() if k != fmt}
    if ignored:
        notes.append(
            f"{d}: read the {len(kinds[fmt])} {fmt} file(s) and ignored "
            f"{_kinds_text(ignored)}; pass --format to read those instead."
        )
    return kinds[fmt], fmt


def _committed_only(
    source: str, files: list[Path], options: ReadOptions, notes: list[str]
) -> list[Path]:
    """capture.TokenWriter commits a step directory `step=N/` by publishing COMMIT_MARKER into
    it once every rank of one run has committed its `rank=R.parquet`; until then the step is
    still being written and its files are left out, with a note (read anyway with
    `include_unstable`). Of a committed step only the files of the run that published the
    marker are read (`_current`): a directory rewritten by a rerun may still hold another
    run's files (ranks beyond the new world size, a rank that has not rewritten the step);
    those are left out with a note, whatever `include_unstable` says."""
    steps: dict[Path, list[Path]] = {}
    for f in files:
        if CAPTURE_FILE.fullmatch(f.name) and CAPTURE_DIR.fullmatch(f.parent.name):
            steps.setdefault(f.parent, []).append(f)
    if not steps:
        return files
    pending: list[Path] = []
    mixed: list[tuple[Path, str]] = []  # committed steps whose files disagree with the marker
    stale: list[tuple[Path, int]] = []  # (file, the world size of the step's marker)
    for d, found in steps.items():
        marker = d / COMMIT_MARKER
        if not marker.exists():
            pending.append(d)
            continue
        bad, why = _current(d, found, _read_marker(marker))
        if why is not None:
            mixed.append((d, why))
        stale.extend(bad)
    leave = {f for f, _ in stale}
    if mixed:
        leave |= {f for d, _ in mixed for f in steps[d]}
        names = "; ".join(f"{d}: {why}" for d, why in mixed[:3]) + (
            " ..." if len(mixed) > 3 else ""
        )
        notes.append(
            f"skipped {len(mixed)} captured step(s) whose {COMMIT_MARKER} belongs to another run "
            f"than their files (a rerun is rewriting them): {names}."
        )
    if stale:
        ranks = sorted({int(f.name[5:-8]) for f, _ in stale})
        sizes = sorted({ws for _, ws in stale})
        notes.append(
            f"left out {len(stale)} file(s) of an earlier run in "
            f"{len({f.parent for f, _ in stale})} captured step(s): rank(s) "
            f"{', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''} at or beyond "
            f"the world size {', '.join(map(str, sizes))} that the step's {COMMIT_MARKER} "
            f"records (e.g. {stale[0][0].parent.name}/{stale[0][0].name}). A rerun with fewer "
            "ranks in the same directory left them; delete them, or name one on its own to "
            "read it."
        )
    if not pending:
        kept = [f for f in files if f not in leave]
        if not kept:
            raise DataError(
                f"{source}: every captured file belongs to another run than the "
                f"{COMMIT_MARKER} marker of its step; nothing to read. Delete the step "
                "directories of the earlier run, or name a file on its own."
            )
        return kept
    pending.sort(key=natural_key)
    names = ", ".join(str(d) for d in pending[:5]) + (" ..." if len(pending) > 5 else "")
    if options.include_unstable:
        notes.append(
            f"reading {len(pending)} captured step(s) without a {COMMIT_MARKER} marker "
            f"(--include-unstable): {names}. Some ranks may not have written theirs yet."
        )
        return [f for f in files if f not in leave]
    skip = set(pending)
    kept = [f for f in files if f.parent not in skip and f not in leave]
    if not kept:
        raise DataError(
            f"{source}: every captured step is still being written (no {COMMIT_MARKER} marker "
            f"in {names}). Wait for the writer to commit a step (TokenWriter.flush() or "
            "close()), or pass --include-unstable to read them as they are."
        )
    notes.append(
        f"skipped {len(pending)} captured step(s) without a {COMMIT_MARKER} marker (still "
        f"being written, or a rank has not committed): {names}. Pass --include-unstable to "
        "read them."
    )
    return kept


def _read_marker(path: Path | str) -> dict:
    """A marker's JSON object; {} for an empty or foreign one (a `touch _SUCCESS`, Spark's)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        out = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _current(d: Path, found: list[Path], marker: dict) -> tuple[list[tuple[Path, int]], str | None]:
    """(files of step directory `d` to leave out, with the world size that leaves them out;
    a reason to skip the whole step, or None). The step's COMMIT_MARKER names the world size
    and run id that committed it (one written before run ids has the world size alone, an
    empty one neither): a rank at or beyond the world size is an earlier run's. A rank below
    it whose own marker (`_SUCCESS.rank=R`) names another run, while the step's marker says
    complete, means the step is being rewritten: the whole step is skipped."""
    ws = marker.get("world_size")
    ws = ws if isinstance(ws, int) and not isinstance(ws, bool) else None
    has_run = "run_id" in marker
    run = marker.get("run_id")
    out: list[tuple[Path, int]] = []
    base = f"{d}{os.sep}{COMMIT_MARKER}.rank="
    for f in found:
        rank = int(f.name[len("rank=") : -len(".parquet")])
        if ws is not None and rank >= ws:
            out.append((f, ws))
            continue
        if has_run:
            mine = _read_marker(f"{base}{rank}")
            if mine.get("run_id") != run or mine.get("world_size") != ws:
                return out, (
                    f"rank {rank}'s marker names run {mine.get('run_id')} (world size "
                    f"{mine.get('world_size')}), {COMMIT_MARKER} run {run} (world size {ws})"
                )
    return out, None


def _stable_only(files: list[Path], include: bool, notes: list[str]) -> list[Path]:
    """prime-rl writes a STABLE file into a step directory once the step is complete."""
    dirs = {formats.prime_step_dir(f) for f in files} - {None}
    unstable = sorted((d for d in dirs if not (d / "STABLE").exists()), key=natural_key)
    if not unstable:
        return files
    names = ", ".join(str(d) for d in unstable[:5]) + (" ..." if len(unstable) > 5 else "")
    if include:
        notes.append(
            f"reading {len(unstable)} prime-rl step(s) without a STABLE marker "
            f"(--include-unstable): {names}. They may still be written to; a cut-off last "
            "line is an error (or skipped with --drop-invalid)."
        )
        return files
    kept = [f for f in files if formats.prime_step_dir(f) not in set(unstable)]
    if not kept:
        raise DataError(
            f"every prime-rl step given is still being written (no STABLE marker): {names}. "
            "Wait for the trainer to finish a step, or pass --include-unstable to read them "
            "as they are."
        )
    notes.append(
        f"skipped {len(unstable)} prime-rl step(s) without a STABLE marker (still being "
        f"written): {names}. Pass --include-unstable to read them."
    )
    return kept


def _is_dir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError as exc:  # a name too long, no permission to look
        raise _not_a_file(p, exc) from None


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except OSError as exc:
        raise _not_a_file(p, exc) from None


def _not_a_file(p: Path, exc: OSError | None = None) -> DataError:
    """What a source that is neither a regular file nor a directory is: missing, a FIFO, a
    socket, a device, a name too long, or out of reach."""
    import stat

    if exc is None:
        try:
            mode = p.stat().st_mode
        except FileNotFoundError:
            return DataError(f"{p}: no such file or directory.")
        except OSError as e:
            exc = e
        else:
            kind = (
                "a named pipe (FIFO)"
                if stat.S_ISFIFO(mode)
                else "a socket"
                if stat.S_ISSOCK(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file"
            )
            return DataError(
                f"{p}: that is {kind}, not a regular file; mismatch-replay reads token logs "
                "from regular files only. Write the log to a file first."
            )
    if exc.errno == errno.ENAMETOOLONG:
        return DataError(f"{p}: the name is too long for the file system. Check the path.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return DataError(f"{p}: no permission to read it. Check its permissions.")
    if exc.errno == errno.ELOOP:
        return DataError(f"{p}: a loop of symbolic links. Point at the file itself.")
    return DataError(f"{p}: cannot be read ({exc.strerror or exc}). Check the path.")


def natural_key(path: Path) -> tuple:
    """Sort key with digit runs compared as numbers (step_2 before step_10)."""
    return tuple(
        (0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(path)) if t
    )


# ----------------------------------------------------------------------------- object stores


class RemotePath(PurePosixPath):
    """A file in an object store or other pyarrow filesystem (`s3://bucket/key`, `gs://`,
    `hdfs://`, `file://` ...): the key as a path (so names, suffixes and hive `step=N` parts
    read as for local files), with the URI's scheme and the pyarrow filesystem that opens it.
    str() gives the URI back; pickling keeps the filesystem (Ray ships plans to workers)."""

    scheme: str
    fs: object
    timeout: float | None = IO_TIMEOUT_S  # seconds a metadata request may take (--io-timeout)

    @classmethod
    def make(cls, scheme: str, key: str, fs, timeout: float | None = IO_TIMEOUT_S) -> RemotePath:
        p = cls(key)
        p.scheme = scheme
        p.fs = fs
        p.timeout = timeout
        return p

    def __str__(self) -> str:
        return f"{self.scheme}://{PurePosixPath.__str__(self)}"

    def __reduce__(self):
        key = PurePosixPath.__str__(self)
        return (RemotePath.make, (self.scheme, key, self.fs, self.timeout))

    def resolve(self) -> RemotePath:
        return self


_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_uri(text: str) -> bool:
    """A URI with a scheme (s3://, gs://, file:// ...), as opposed to a local path."""
    return _URI.match(text) is not None


def _open(path: Path):
    """What pyarrow's Parquet reader opens: a local path, or a remote file's stream."""
    if isinstance(path, RemotePath):
        return path.fs.open_input_file(PurePosixPath.__str__(path))
    return path


def parquet_file(path: Path, **kw) -> pq.ParquetFile:
    """pq.ParquetFile of a local or remote file; a remote one (its footer is a request) within
    the path's timeout, and Ctrl-C stops the wait at once (`remote_call`)."""
    if isinstance(path, RemotePath):
        return remote_call(lambda: pq.ParquetFile(_open(path), **kw), path.timeout, str(path))
    return pq.ParquetFile(path, **kw)


def remote_call(fn, timeout: float | None, what: str):
    """fn() for a request to an object store, run in a daemon thread while this thread waits
    in 0.1 s slices: Ctrl-C (KeyboardInterrupt, delivered to the main thread between those
    slices) stops the command at once even when pyarrow's C++ client is stuck in a connect or
    a read, and after `timeout` seconds (None: never) the call is abandoned with a DataError
    naming --io-timeout. The client's own timeouts (S3: connect and request; GCS: retries)
    are set to the same value (`filesystem_from_uri`); this is the backstop for the steps
    they do not cover (credential lookup, region resolution). ~50 us a call."""
    import threading
    import time

    box: dict = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc
        finally:
            done.set()

    worker = threading.Thread(target=run, daemon=True, name="mismatch-replay-io")
    worker.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not done.wait(0.1):
            if deadline is not None and time.monotonic() > deadline:
                raise DataError(
                    f"{what}: no answer within {timeout:g} s (--io-timeout {timeout:g}). Check "
                    "the network connection, the endpoint and the credentials, or pass a "
                    "longer --io-timeout."
                )
    except BaseException:  # timed out or interrupted: the request is left to finish alone
        _ABANDONED.append(worker)
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


_ABANDONED: list = []  # threads of requests given up on (timeout, Ctrl-C), maybe still running


def stuck_requests() -> int:
    """Object-store requests given up on that are still running. pyarrow's S3 finalizer
    (atexit) waits for them, up to the client's own timeouts: a command line that must stop
    now ends the process with os._exit instead (output.exit_process)."""
    return sum(t.is_alive() for t in _ABANDONED)


_S3_KEYS = ("region", "scheme", "endpoint_override", "anonymous")


_GCS_KEYS = ("scheme", "endpoint_override", "anonymous", "project_id")


def filesystem_from_uri(text: str, timeout: float | None = IO_TIMEOUT_S):
    """(pyarrow filesystem, key) for a URI: S3, GCS, HDFS, Azure, local, as pyarrow has them.
    s3:// and gs:// are built here with `timeout` as the client's connect / request timeout
    (S3) and retry limit (GCS), which FileSystem.from_uri leaves at their defaults (minutes
    without a network); a URI with other query options goes to from_uri as it is."""
    from urllib.parse import parse_qsl, urlsplit

    from pyarrow import fs as pafs

    u = urlsplit(text)
    scheme = u.scheme.lower()
    query = dict(parse_qsl(u.query))
    key = (u.netloc + u.path).rstrip("/") if scheme in ("s3", "gs", "gcs") else None
    flag = query.get("anonymous", "false").lower() in ("1", "true", "yes")
    if (
        scheme == "s3"
        and "@" not in u.netloc
        and set(query) <= set(_S3_KEYS)
        and hasattr(pafs, "S3FileSystem")
    ):
        kw: dict = {k: query[k] for k in ("region", "scheme", "endpoint_override") if k in query}
        if timeout is not None:
            kw |= {"connect_timeout": timeout, "request_timeout": timeout}
            kw["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=3)
        if "region" not in kw and "endpoint_override" not in kw:
            bucket = u.netloc
            kw["region"] = remote_call(lambda: pafs.resolve_s3_region(bucket), timeout, text)
        return pafs.S3FileSystem(anonymous=flag, **kw), key
    if scheme in ("gs", "gcs") and set(query) <= set(_GCS_KEYS) and hasattr(pafs, "GcsFileSystem"):
        import datetime

        kw = {k: query[k] for k in ("scheme", "endpoint_override", "project_id") if k in query}
        if timeout is not None:
            kw["retry_time_limit"] = datetime.timedelta(seconds=timeout)
        return pafs.GcsFileSystem(anonymous=flag, **kw), key
    return remote_call(lambda: pafs.FileSystem.from_uri(text), timeout, text)


def _resolve_uri(
    text: str, forced: str | None, timeout: float | None = IO_TIMEOUT_S
) -> list[tuple[Path, str, str]]:
    """A URI source through pyarrow.fs: one file, a prefix (every .parquet under it) or a glob.
    Parquet only: the other formats' readers want local files. Every request is bounded by
    `timeout` seconds and stops on Ctrl-C (`remote_call`)."""
    import fnmatch

    from pyarrow import fs as pafs

    scheme = _URI.match(text).group(1).lower()
    try:
        filesystem, key = remote_call(
            lambda: filesystem_from_uri(text, timeout=timeout), timeout, text
        )
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise DataError(
            f"{text}: cannot open this location ({exc}). Check the URI, the credentials "
            "(e.g. AWS_PROFILE / GOOGLE_APPLICATION_CREDENTIALS) and that pyarrow supports "
            f"the {scheme}:// scheme here; or copy the files locally."
        ) from exc
    if forced not in (None, "parquet"):
        raise UsageError(
            f"{text}: --format {forced} reads local files only; object-store sources must be "
            "Parquet (mismatch-replay convert the logs first)."
        )

    def hidden(path: str, base: str) -> bool:  # .temporaries (output.temp_name), _markers
        rel = PurePosixPath(path).relative_to(base) if base else PurePosixPath(path)
        return any(part.startswith((".", "_")) for part in rel.parts)

    def listing(base: str) -> list[str]:
        sel = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        infos = remote_call(lambda: filesystem.get_file_info(sel), timeout, text)
        return sorted(
            i.path for i in infos if i.type == pafs.FileType.File and not hidden(i.path, base)
        )

    try:
        if any(ch in key for ch in "*?["):
            parts = PurePosixPath(key).parts
            fixed = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
            base = str(PurePosixPath(*parts[:fixed])) if fixed else ""
            keys = [k for k in listing(base) if fnmatch.fnmatchcase(k, key)]
            if not keys:
                raise DataError(f"{text}: the glob matches no object. Check the pattern.")
        else:
            info = remote_call(lambda: filesystem.get_file_info(key), timeout, text)
            if info.type == pafs.FileType.NotFound:
                raise DataError(f"{text}: no such object or prefix.")
            keys = listing(key) if info.type == pafs.FileType.Directory else [key]
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{text}: listing failed ({exc}). Check the URI and credentials.") from exc
    paths = [RemotePath.make(scheme, k, filesystem, timeout) for k in keys]
    parquet = [x for x in paths if x.suffix.lower() == ".parquet" or forced == "parquet"]
    if not parquet:
        raise DataError(
            f"{text}: no .parquet object there ({len(paths)} other object(s)). Object-store "
            "sources must be Parquet; convert other logs first (mismatch-replay convert)."
        )
    return [(x, "parquet", text) for x in sorted(parquet)]
