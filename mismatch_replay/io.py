"""Ingest: any supported token log -> batches of the canonical token table (DESIGN.md).

Design
------
Sources are resolved first: files, directories (searched recursively) and globs, each file's
format detected from its path (`adapters.detect`: `step_<n>/rank_<r>.jsonl` prime-rl,
`train_data_step<N>.jsonl` NeMo-RL, `.pt` slime, other `.jsonl` canonical JSONL, `.parquet`)
or forced with `--format`. One call reads one format (a mix is refused: the schemas would
not agree); a directory holding one framework's files and other files reads the framework's
and says what it ignored. prime-rl steps without a `STABLE` marker are still being written
and are skipped with a warning unless `include_unstable`; so are the step directories
`step=N/` of `capture.TokenWriter` (`rank=R.parquet` files) without a `_SUCCESS` marker yet
(when found through a directory or a glob; a file named on its own is read). Warnings go to
`Plan.warnings`, every `ReadReport.warnings`, and Python's warnings (`IngestWarning`; the CLI
prints them).
A hive directory `step=N/` supplies the step of a Parquet file that has no step column.
A source with a scheme (`s3://bucket/prefix/`, `gs://...`, `hdfs://...`, `file://...`) goes
through `pyarrow.fs`: an object, every .parquet under a prefix, or a glob; the files are
`RemotePath`s (the key as a path, the filesystem alongside) and are opened through that
filesystem, here or on a Ray worker. Object stores hold Parquet only (the other formats'
readers want local files: convert first). Every request to one is bounded by
`ReadOptions.io_timeout` (default 30 s, `--io-timeout`): the S3 client's connect and request
timeouts, the GCS client's retry limit, and `remote_call`, which runs each metadata request
in a daemon thread so that Ctrl-C stops a stuck connect at once (pyarrow's C++ client does
not return to Python until it gives up: 674 s for gs:// without a network).
Hidden files and directories under a directory source are skipped, among them the
temporaries of a write still running or killed (`output.temp_name`); a source that is not a
regular file (a FIFO, a socket) is named for what it is, not as missing.

A *plan* is made once per call from the files' schemas alone (no data read; for JSON lines,
each file's first record; for slime, the first dump): which source
column feeds each canonical column (`--map canonical=theirs`, else the first known alias),
whether the layout is one row per token or one row per sequence with list columns, and
whether the log holds probabilities instead of log-probabilities. Then the files are
streamed a batch at a time (pyarrow reads only the projected columns: runs of whole row groups
up to the batch size, decoded column by column in parallel, ~40% less CPU than its batch
iterator; a row group larger than a batch is streamed in batches through a buffered reader,
page by page, so that a 300M-row group costs a batch, not its 4.8 GB of column chunks) and
each batch is canonicalised eagerly with polars: rename, explode list columns, probabilities
-> log-probs, drop `loss_mask == false` rows, validate. Memory is bounded by the batch
(default 1M rows ~ 16 MB per float column), never by the log. The other formats go through
`adapters`, which yield frames of every token of a block of records (JSON lines: ~48 MB of
text at a time; slime: one dump, tensors memory-mapped), then the same canonicalisation,
loss-mask filter and validation as Parquet.

Validation is paid for only when something is wrong: a batch is checked with one pass per
column (`_quick_check`: finite, not above 1e-6, no nulls); only when that fails do the
per-problem polars expressions run, and when a batch holds an invalid row, the whole file is
re-read to count every problem so that the error names the file, the column, how many rows,
and the fix.
With `drop_invalid=True` the rows are dropped instead and counted in `ReadReport`. A row
counts once per column (a null log-prob is "null", not also NaN, infinite and above 0). A
null `loss_mask`, step, sample_id or position is an invalid row like a NaN (never taken as
false, or as step 0). Types are checked from the schema before anything is read: text where
numbers belong, nested structs and lists of lists are one sentence (an optional payload
column such as `advantage` is left out with a warning instead); a float step or position
must hold whole numbers (0.25 is refused: truncating it would merge steps). Warned about: a
canonical column present under two accepted names (which one was read), both log-prob
columns mapped to one source column, and a file under a hive `step=N/` whose own step
column disagrees (`_HiveCheck`); `DuplicateCheck` (inspect, convert) counts rows repeating a
(step, sample_id, position).

`read_table()` collects the canonical table in memory for small logs, tests and notebooks.
"""

from __future__ import annotations

import errno
import glob as _glob
import math
import re
import warnings as _warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from . import adapters
from .adapters import FORMATS
from .errors import DataError, UsageError
from .output import is_temp

REQUIRED = ("trainer_logprob", "inference_logprob")
OPTIONAL = (
    "step",
    "sample_id",
    "position",
    "advantage",
    "loss_mask",
    "env",
    "old_logprob",
    "entropy",
    "token_id",
    "group_id",
)
CANONICAL = REQUIRED + OPTIONAL
LOGPROB_COLUMNS = ("trainer_logprob", "inference_logprob", "old_logprob")
POSITIVE_TOLERANCE = 1e-6  # log-probs in (0, 1e-6] are rounding noise and clipped to 0
IO_TIMEOUT_S = 30.0  # default connect / request timeout of object-store sources
STREAM_BUFFER = 1 << 20  # bytes read at a time from a row group larger than a batch
# capture.TokenWriter's layout: step=N/rank=R.parquet, committed by a COMMIT_MARKER file in step=N/
COMMIT_MARKER = "_SUCCESS"
CAPTURE_FILE = re.compile(r"rank=\d+\.parquet")
CAPTURE_DIR = re.compile(r"step=\d+")

# Names real trainers use, in priority order (the canonical name itself always wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "trainer_logprob": ("trainer_logprobs", "log_probs", "prev_logprobs", "train_logprob"),
    "inference_logprob": (
        "inference_logprobs",
        "rollout_log_probs",
        "generation_logprobs",
        "rollout_logprobs",
        "sampler_logprobs",
    ),
    "advantage": ("advantages",),
    "env": ("env_name", "environment", "task"),
    "step": ("global_step", "rollout_id", "train_step"),
    "sample_id": ("sequence_id", "seq_id", "sample_idx", "sample_index"),
    "position": ("position_ids", "positions", "pos"),
    "loss_mask": ("loss_masks", "token_loss_mask", "response_mask"),
    "old_logprob": ("old_logprobs", "old_log_probs"),
    "entropy": ("entropies", "token_entropy"),
    "token_id": ("token_ids", "tokens"),
    # the prompt (GRPO group) a sample was drawn for: verl's non_tensor_batch['uid']
    "group_id": ("uid", "group_index", "prompt_id", "prompt_uid"),
}
# Probability columns recognised by name: canonical log-prob column -> names.
PROB_ALIASES: dict[str, tuple[str, ...]] = {
    "trainer_logprob": ("trainer_prob", "trainer_probs", "train_prob", "train_probs"),
    "inference_logprob": ("inference_prob", "inference_probs", "rollout_probs", "sampler_probs"),
    "old_logprob": ("old_prob", "old_probs"),
}


class IngestWarning(UserWarning):
    """Something about the sources the user should know (skipped unstable steps, ignored
    files, a missing mask). Also collected in `ReadReport.warnings`; the CLI prints it."""


@dataclass(frozen=True)
class ReadOptions:
    """How to read sources. `mapping` is canonical -> source column (`--map`)."""

    mapping: dict[str, str] = field(default_factory=dict)
    probs: bool = False  # the mapped log-prob columns hold probabilities
    drop_invalid: bool = False
    batch_rows: int = 1_000_000
    format: str | None = None  # one of FORMATS; None: detect from the paths
    include_unstable: bool = False  # prime-rl: read steps without a STABLE marker too
    # seconds an object store (s3://, gs:// ...) may take to connect or answer one request
    # before the read fails (--io-timeout); None: no limit
    io_timeout: float | None = IO_TIMEOUT_S

    @property
    def block_bytes(self) -> int:
        """Bytes of JSON lines parsed at a time (~48 bytes a row, 64 KiB .. 64 MiB)."""
        return max(1 << 16, min(64 << 20, self.batch_rows * 48))


@dataclass
class ReadReport:
    """What ingest saw: rows read, loss rows kept, invalid rows dropped (per file, column),
    records skipped (column `records: <why>`) and warnings about the sources."""

    rows: int = 0
    loss_rows: int = 0
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def dropped_rows(self) -> int:
        return sum(v for (f, c), v in self.dropped.items() if c == "*")

    @property
    def dropped_records(self) -> int:
        """Whole records (JSON lines, dump samples) skipped with --drop-invalid."""
        return sum(v for (f, c), v in self.dropped.items() if c.startswith(adapters.RECORDS))

    def __iadd__(self, other: ReadReport) -> ReadReport:
        self.rows += other.rows
        self.loss_rows += other.loss_rows
        for k, v in other.dropped.items():
            self.dropped[k] = self.dropped.get(k, 0) + v
        for w in other.warnings:
            if w not in self.warnings:
                self.warnings.append(w)
        return self


@dataclass(frozen=True)
class Plan:
    """What to read from which files, decided from the schemas alone."""

    files: tuple[Path, ...]
    source: dict[str, str]  # canonical -> source column name
    list_columns: frozenset[str]  # canonical columns stored as lists (one row per sequence)
    probs: frozenset[str]  # canonical log-prob columns that hold probabilities
    rows: tuple[int, ...]  # rows per file (Parquet: exact; other formats: an estimate)
    options: ReadOptions
    format: str = "parquet"  # one of FORMATS, the same for every file
    file_steps: tuple[int | None, ...] = ()  # step implied by each file's path, if any
    warnings: tuple[str, ...] = ()  # about the sources, also copied into each ReadReport
    read_schema: dict[str, pl.DataType] = field(default_factory=dict)  # JSON key -> dtype
    # Parquet: the row groups [start, stop) to read of each file (None: all); the Ray engine
    # cuts a large file into several shards this way
    row_groups: tuple[tuple[int, int] | None, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        """Canonical columns this plan can deliver."""
        cols = set(self.source)
        if self.list_columns:
            cols |= {"sample_id", "position"}
        return tuple(c for c in CANONICAL if c in cols)

    @property
    def per_sequence(self) -> bool:
        return bool(self.list_columns)


# ----------------------------------------------------------------------------- sources


def parse_mapping(items: Sequence[str]) -> dict[str, str]:
    """`--map canonical=theirs` items -> {canonical: theirs}."""
    out: dict[str, str] = {}
    for item in items:
        canon, sep, theirs = item.partition("=")
        if not sep or not canon.strip() or not theirs.strip():
            raise UsageError(
                f"--map {item}: use canonical=theirs, e.g. --map trainer_logprob=lp_train."
            )
        out[canon.strip()] = theirs.strip()
    return out


def resolve_sources(
    sources: Sequence[str | Path], options: ReadOptions | None = None
) -> list[Path]:
    """Expand files, directories (recursively) and globs; keep order, no dups."""
    return _resolve(sources, options or ReadOptions())[0]


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
        k = adapters.detect(x)
        if k is None:
            others += 1
        elif k == "slime" and forced in (None, "slime") and adapters.is_slime_rollout_dump(x):
            rollout_dumps.append(x)
        else:
            kinds.setdefault(k, []).append(x)
    if rollout_dumps and kinds.get("slime"):
        notes.append(_rollout_note(rollout_dumps))
    elif rollout_dumps:  # only rollout dumps: the reader says what they are
        kinds["slime"] = rollout_dumps
    if forced is not None:
        found = kinds.get(forced, [])
        if not found and forced in adapters.JSON_FORMATS:  # --format names the layout
            found = sorted(x for k in adapters.JSON_FORMATS for x in kinds.get(k, []))
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
    frameworks = [k for k in kinds if k in adapters.FRAMEWORKS]
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


def row_group_rows(path: Path) -> list[int]:
    """Rows of each row group of a Parquet file (from its footer)."""
    meta = _parquet_file(path).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def step_bounds(plan: Plan) -> tuple[list[int], list[float]] | None:
    """(ends, floor): after `ends[k]` raw rows of the plan (its files in order) every row
    still to come has a step >= floor[k]; floor[-1] = inf. From Parquet row-group statistics
    of the step column (or each file's hive step); None when a file cannot tell (other
    formats, row-group shards, statistics missing or not integers). The local engine uses it
    to resolve m2po's steps as soon as they are complete (engine.Tally.seal_m2po)."""
    if plan.format != "parquet" or any(part is not None for part in plan.row_groups):
        return None
    src = plan.source.get("step")
    ends: list[int] = []
    mins: list[float] = []
    total = 0
    for i, path in enumerate(plan.files):
        try:
            meta = _parquet_file(path).metadata
        except (OSError, pa.ArrowException, DataError):
            return None
        col = None
        if src is not None:
            names = [meta.schema.column(j).path for j in range(meta.num_columns)]
            if src not in names:
                return None
            col = names.index(src)
        fixed = plan.file_steps[i] if i < len(plan.file_steps) else None
        for r in range(meta.num_row_groups):
            rg = meta.row_group(r)
            if col is None:
                low = fixed or 0
            else:
                st = rg.column(col).statistics
                if st is None or not st.has_min_max or not isinstance(st.min, int):
                    return None
                low = st.min
            total += rg.num_rows
            ends.append(total)
            mins.append(float(low))
    floor = [math.inf] * len(mins)
    for k in range(len(mins) - 2, -1, -1):
        floor[k] = min(mins[k + 1], floor[k + 1])
    return ends, floor


def _open(path: Path):
    """What pyarrow's Parquet reader opens: a local path, or a remote file's stream."""
    if isinstance(path, RemotePath):
        return path.fs.open_input_file(PurePosixPath.__str__(path))
    return path


def _parquet_file(path: Path, **kw) -> pq.ParquetFile:
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


def _resolve(
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
                k = adapters.detect(x)
                if k == "slime" and forced in (None, "slime") and adapters.is_slime_rollout_dump(x):
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
            if fmts & set(adapters.FRAMEWORKS):
                found.sort(key=lambda e: adapters.natural_key(e[0]))
            kept = set(_committed_only(text, [x for x, _, _ in found], options, notes))
            out.extend(e for e in found if e[0] in kept)
        elif _is_dir(p):
            files, k = _walk(p, forced, notes)
            if k != "parquet":
                files = sorted(files, key=adapters.natural_key)
            files = _committed_only(text, files, options, notes)
            out.extend((x, k, text) for x in files)
        elif _is_file(p):
            out.append((p, forced or adapters.detect(p) or adapters.sniff(p), text))
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


def _committed_only(
    source: str, files: list[Path], options: ReadOptions, notes: list[str]
) -> list[Path]:
    """capture.TokenWriter commits a step directory `step=N/` by writing COMMIT_MARKER into it
    once every rank's `rank=R.parquet` is in; until then the step is still being written and
    its files are left out, with a note (read anyway with `include_unstable`)."""
    pending = sorted(
        {
            f.parent
            for f in files
            if CAPTURE_FILE.fullmatch(f.name)
            and CAPTURE_DIR.fullmatch(f.parent.name)
            and not (f.parent / COMMIT_MARKER).exists()
        },
        key=adapters.natural_key,
    )
    if not pending:
        return files
    names = ", ".join(str(d) for d in pending[:5]) + (" ..." if len(pending) > 5 else "")
    if options.include_unstable:
        notes.append(
            f"reading {len(pending)} captured step(s) without a {COMMIT_MARKER} marker "
            f"(--include-unstable): {names}. Some ranks may not have written theirs yet."
        )
        return files
    skip = set(pending)
    kept = [f for f in files if f.parent not in skip]
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


def _stable_only(files: list[Path], include: bool, notes: list[str]) -> list[Path]:
    """prime-rl writes a STABLE file into a step directory once the step is complete."""
    dirs = {adapters.prime_step_dir(f) for f in files} - {None}
    unstable = sorted((d for d in dirs if not (d / "STABLE").exists()), key=adapters.natural_key)
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
    kept = [f for f in files if adapters.prime_step_dir(f) not in set(unstable)]
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


def _read_schema(path: Path) -> tuple[pa.Schema, int]:
    try:
        meta = _parquet_file(path)
        return meta.schema_arrow, meta.metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"{path}: cannot read it as Parquet ({exc}). Is the file complete and a Parquet "
            "token log? Re-export it, or leave it out of SOURCES."
        ) from exc


def _is_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_fixed_size_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    )


# What each canonical column may hold (a list column: its values): (one value, several,
# the arrow kinds accepted)
_FLOAT = ("a number", "numbers", ("float", "integer", "decimal", "null"))
_INT = ("an integer", "integers", ("integer", "float", "decimal", "null"))  # whole floats only
COLUMN_KINDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trainer_logprob": _FLOAT,
    "inference_logprob": _FLOAT,
    "old_logprob": _FLOAT,
    "advantage": _FLOAT,
    "entropy": _FLOAT,
    "step": _INT,
    "position": _INT,
    "token_id": _INT,
    "sample_id": ("an integer or a string", "integers or strings", ("integer", "string", "null")),
    "loss_mask": ("a boolean", "booleans (or 0/1)", ("boolean", "integer", "float", "null")),
    "env": ("a string", "strings", ("string", "integer", "boolean", "null")),
    "group_id": ("an integer or a string", "integers or strings", ("integer", "string", "null")),
}


def _arrow_kind(t: pa.DataType) -> str:
    """float, integer, decimal, string, boolean, null, list, struct, map, or the type."""
    if pa.types.is_dictionary(t):
        return _arrow_kind(t.value_type)
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_decimal(t):
        return "decimal"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_null(t):
        return "null"
    if _is_list(t):
        return "list"
    if pa.types.is_struct(t):
        return "struct"
    if pa.types.is_map(t):
        return "map"
    return str(t)


_KIND_TEXT = {
    "string": "text (strings)",
    "boolean": "booleans",
    "list": "lists of lists",
    "struct": "nested structs",
    "map": "maps",
    "decimal": "decimals",
}


# payload columns only some rules need: one of the wrong type is left out with a warning
# (the rules that need it say so); every other column of the wrong type is an error
_LEAVE_OUT = ("advantage", "entropy", "old_logprob", "env", "token_id", "group_id")


def _check_types(
    path: Path,
    schema: pa.Schema,
    source: dict[str, str],
    rows: int,
    options: ReadOptions,
    notes: list[str] | None,
) -> list[str]:
    """Refuse, from the schema alone, a column whose type cannot hold its canonical column
    (text log-probs or steps, nested structs, lists of lists): one sentence, before reading.
    A payload column (_LEAVE_OUT) found by its name is left out instead, with a note; returns
    those canonical names."""
    out = []
    for canon, src in source.items():
        one, several, kinds = COLUMN_KINDS.get(canon, ("", "", ()))
        if not kinds:
            continue
        t = schema.field(src).type
        inner = t.value_type if _is_list(t) else t
        kind = _arrow_kind(inner)
        if kind in kinds:
            continue
        what = _KIND_TEXT.get(kind, f"values of type {inner}")
        if _is_list(t) and kind != "list":
            what += " inside its lists"
        name = f"'{src}'" + (f" (read as {canon})" if src != canon else "")
        fix = (
            f"Flatten it in the export ({one} per token, or one flat list per sequence)"
            if kind in ("list", "struct", "map")
            else f"Write {several} in the export (cast the column)"
        )
        text = (
            f"{path}: column {name} holds {what} (type {t}) in all {rows:,} rows, but {canon} "
            f"takes {one} per token."
        )
        if canon in _LEAVE_OUT and canon not in options.mapping:
            out.append(canon)
            if notes is not None:
                notes.append(
                    f"{text} Left it out (rules that need {canon} will say so); {fix[0].lower()}"
                    f"{fix[1:]} to use it."
                )
            continue
        raise DataError(f"{text} {fix}, or --map {canon}=COLUMN to read another column.")
    return out


def _choose_columns(
    path: Path, names: list[str], options: ReadOptions, notes: list[str] | None = None
) -> tuple[dict[str, str], set[str]]:
    """canonical -> source column, and which log-prob columns are probabilities. `notes`
    (the first file's call) gets a warning for a canonical column present under two accepted
    names, and for one source column feeding both log-prob columns."""
    source: dict[str, str] = {}
    probs: set[str] = set()
    for canon, theirs in options.mapping.items():
        if canon not in CANONICAL:
            raise UsageError(
                f"--map {canon}={theirs}: '{canon}' is not a canonical column. "
                f"Canonical columns: {', '.join(CANONICAL)}."
            )
        if theirs not in names:
            raise DataError(
                f"{path}: --map {canon}={theirs} names column '{theirs}', which is not in the "
                f"file. Columns found: {', '.join(names)}."
            )
        source[canon] = theirs
    for canon in CANONICAL:
        if canon in source:
            continue
        for cand in (canon, *ALIASES.get(canon, ())):
            if cand in names:
                source[canon] = cand
                break
        else:
            for cand in PROB_ALIASES.get(canon, ()):
                if cand in names:
                    source[canon] = cand
                    probs.add(canon)
                    break
        cands = (canon, *ALIASES.get(canon, ()), *PROB_ALIASES.get(canon, ()))
        present = [c for c in cands if c in names]
        if notes is not None and len(present) > 1:
            others = ", ".join(f"'{c}'" for c in present[1:])
            notes.append(
                f"{path}: the log has {canon} under {len(present)} accepted names ("
                f"{', '.join(repr(c) for c in present)}); read '{present[0]}' and ignored "
                f"{others}. Pass --map {canon}={present[1]} to read the other."
            )
    lp = [source.get(c) for c in ("trainer_logprob", "inference_logprob")]
    if notes is not None and lp[0] is not None and lp[0] == lp[1]:
        notes.append(
            f"{path}: trainer_logprob and inference_logprob both read column '{lp[0]}', so "
            "every token's mismatch is 0 and no rule masks anything. Check the --map options "
            "(--map trainer_logprob=... --map inference_logprob=... name two columns)."
        )
    if options.probs:
        probs |= {c for c in LOGPROB_COLUMNS if c in source}
    missing = [c for c in REQUIRED if c not in source]
    if missing:
        hints = ", ".join(f"{c} (or {', '.join(ALIASES[c][:3])})" for c in missing)
        raise DataError(
            f"{path}: required column(s) missing: {hints}. Columns found: {', '.join(names)}. "
            "Name yours with --map, e.g. --map trainer_logprob=my_trainer_lp "
            "(add --probs if they are probabilities)."
        )
    return source, probs


def plan_sources(sources: Sequence[str | Path], options: ReadOptions | None = None) -> Plan:
    """Resolve sources, detect their format and decide the column mapping; every file must
    agree. Warnings about the sources are issued here (IngestWarning) and kept in the plan."""
    options = options or ReadOptions()
    files, fmt, notes = _resolve(sources, options)
    if fmt == "parquet":
        plan = _plan_parquet(files, options, notes)
    else:
        plan = _plan_records(files, fmt, options, notes)
    steps = tuple(adapters.path_step(f, fmt) for f in files)
    plan = replace(plan, format=fmt, file_steps=steps, warnings=tuple(notes))
    for note in notes:
        _warnings.warn(note, IngestWarning, stacklevel=2)
    return plan


def _agree(
    entries: Iterator[tuple[Path, list[str], dict[str, tuple[bool, str]]]],
    options: ReadOptions,
    notes: list[str] | None = None,
) -> tuple[Path, dict[str, str], set[str], frozenset[str]] | None:
    """Column mapping every file agrees on. `entries`: (path, column names, name -> (is a
    list, type shown in errors)). Returns (first path, source, probs, list columns), or None
    when there is no entry."""
    first = None
    plan_source: dict[str, str] = {}
    probs: set[str] = set()
    for path, names, kinds in entries:
        source, p = _choose_columns(path, names, options, notes if first is None else None)
        types = {c: kinds[source[c]] for c in source}
        if first is None:
            first = (path, source, types)
            plan_source, probs = source, p
            continue
        fpath, fsource, ftypes = first
        if source != fsource:
            only_a = sorted(set(fsource.items()) - set(source.items()))
            only_b = sorted(set(source.items()) - set(fsource.items()))
            raise DataError(
                f"schemas differ between files: {fpath} maps {_fmt_map(only_a) or 'nothing more'}"
                f" but {path} maps {_fmt_map(only_b) or 'nothing more'}. Read them in separate "
                "calls, or --map the columns so that every file has the same ones."
            )
        for c, (is_list, shown) in types.items():
            if is_list != ftypes[c][0]:
                raise DataError(
                    f"schemas differ between files: column '{source[c]}' is {ftypes[c][1]} in "
                    f"{fpath} but {shown} in {path}. Convert one layout to the other first "
                    "(mismatch-replay convert)."
                )
    if first is None:
        return None
    list_cols = frozenset(c for c, (is_list, _) in first[2].items() if is_list)
    for c in REQUIRED:
        if list_cols and c not in list_cols:
            raise DataError(
                f"{first[0]}: column '{plan_source[c]}' is a scalar while "
                f"{', '.join(plan_source[x] for x in sorted(list_cols))} are lists. "
                "Either every per-token column is a list (one row per sequence) or none is."
            )
    return first[0], plan_source, probs, list_cols


def _plan_parquet(files: list[Path], options: ReadOptions, notes: list[str] | None = None) -> Plan:
    rows: list[int] = []
    schemas: list[pa.Schema] = []

    def entries():
        for path in files:
            schema, n = _read_schema(path)
            rows.append(n)
            schemas.append(schema)
            kinds = {f.name: (_is_list(f.type), str(f.type)) for f in schema}
            yield path, list(schema.names), kinds

    agreed = _agree(entries(), options, notes)
    assert agreed is not None  # resolve_sources never returns an empty list
    _, source, probs, list_cols = agreed
    for path, schema, n in zip(files, schemas, rows, strict=True):
        for canon in _check_types(path, schema, source, n, options, notes):
            source.pop(canon, None)
    list_cols = frozenset(c for c in list_cols if c in source)
    return Plan(
        files=tuple(files),
        source=source,
        list_columns=list_cols,
        probs=frozenset(probs),
        rows=tuple(rows),
        options=options,
    )


def _json_roles(options: ReadOptions) -> dict[str, str]:
    """JSON key -> the canonical column it would feed (fixes float dtypes in plain JSONL)."""
    roles = {}
    for canon in CANONICAL:
        for name in (*PROB_ALIASES.get(canon, ()), *ALIASES.get(canon, ()), canon):
            roles[name] = canon
    for canon, theirs in options.mapping.items():
        roles[theirs] = canon
    return roles


def _plan_records(files: list[Path], fmt: str, options: ReadOptions, notes: list[str]) -> Plan:
    """Plan for JSON lines and slime dumps. Plain JSONL: every file's first record (their
    columns must agree, as for Parquet). Framework formats deliver fixed columns, so only the
    first non-empty file is probed (a slime dump is not free to load; prime-rl trees hold
    thousands of files). Row counts are estimates from file sizes, for progress only."""
    rows: list[int] = []
    empties: list[Path] = []
    probe: adapters.Probe | None = None
    first_size = 1
    roles = _json_roles(options)

    def entries():
        nonlocal probe, first_size
        for path in files:
            if fmt != "jsonl" and probe is not None:
                # framework adapters deliver fixed columns: one probe is enough
                size = adapters._file_size(path)
                if size == 0:
                    empties.append(path)
                rows.append(int(probe.rows * size / first_size))
                continue
            if fmt in adapters.FILE_FORMATS:
                pr = adapters.probe_file(fmt, path, options.drop_invalid)
            elif fmt == "jsonl":
                pr = adapters.probe_jsonl(path, options.drop_invalid, roles)
            else:
                pr = adapters.probe_framework(fmt, path, options.drop_invalid)
            if pr is None:
                empties.append(path)
                rows.append(0)
                continue
            rows.append(pr.rows)
            if probe is None:
                probe, first_size = pr, max(adapters._file_size(path), 1)
                notes.extend(pr.warnings)
            shown = {k: (v, "a list" if v else "a scalar") for k, v in pr.columns.items()}
            yield path, list(pr.columns), shown

    agreed = _agree(entries(), options, notes)
    if agreed is None or probe is None:
        more = f" and {len(files) - 1} other file(s)" if len(files) > 1 else ""
        raise DataError(
            f"{files[0]}{more}: no record to read (every file is empty). Point at files the "
            "trainer has finished writing."
        )
    _, source, probs, list_cols = agreed
    if empties:
        notes.append(
            f"{len(empties)} empty file(s) hold no record and were skipped, e.g. {empties[0]}."
        )
    return Plan(
        files=tuple(files),
        source=source,
        list_columns=list_cols,
        probs=frozenset(probs),
        rows=tuple(rows),
        options=options,
        read_schema=dict(probe.schema),
    )


def _fmt_map(items) -> str:
    return ", ".join(f"{c}<-{s}" for c, s in items)


# ----------------------------------------------------------------------------- batches


def _canonicalise(df: pl.DataFrame, plan: Plan, file_index: int, row_offset: int) -> pl.DataFrame:
    """Source batch -> canonical columns (all rows, loss_mask not applied yet)."""
    # The same source column may feed two canonical columns (through --map): select copies.
    cols = [pl.col(s).alias(c) for c, s in plan.source.items() if s in df.columns]
    df = df.select(cols)
    if plan.list_columns:
        lists = sorted(plan.list_columns)
        if "sample_id" not in df.columns:
            df = df.with_columns(
                sample_id=pl.int_range(row_offset, row_offset + df.height, dtype=pl.Int64)
            )
        ref = "trainer_logprob"
        lens = df.select([pl.col(c).list.len().alias(c) for c in lists])
        bad = lens.select(
            pl.any_horizontal([pl.col(c) != pl.col(ref) for c in lists]).fill_null(True).sum()
        ).item()
        if bad:
            raise _UnequalLists(int(bad))
        if "position" not in plan.list_columns:
            df = df.with_columns(position=pl.int_ranges(0, pl.col(ref).list.len(), dtype=pl.Int64))
            lists.append("position")
        df = df.explode(lists)
    exprs = []
    for c in plan.probs:
        exprs.append(pl.col(c).cast(pl.Float64).log().alias(c))
    for c in LOGPROB_COLUMNS:
        if c in df.columns and c not in plan.probs:
            exprs.append(pl.col(c).cast(pl.Float64))
    if "advantage" in df.columns:
        exprs.append(pl.col("advantage").cast(pl.Float64))
    if "entropy" in df.columns:
        exprs.append(pl.col("entropy").cast(pl.Float64))
    if "step" not in df.columns:  # a hive directory step=N, else 0
        step = plan.file_steps[file_index] if file_index < len(plan.file_steps) else None
        exprs.append(pl.lit(step or 0, dtype=pl.Int64).alias("step"))
    else:
        _whole_numbers(df, "step", plan, file_index)
        exprs.append(pl.col("step").cast(pl.Int64))
    if "position" in df.columns:
        _whole_numbers(df, "position", plan, file_index)
    if "loss_mask" in df.columns:
        exprs.append(pl.col("loss_mask").cast(pl.Boolean))
    try:
        return df.with_columns(exprs)
    except pl.exceptions.PolarsError:  # a value that is not a number (JSON lines: any type)
        raise _cast_error(df, plan, file_index) from None


_TARGET = {c: pl.Float64 for c in (*LOGPROB_COLUMNS, "advantage", "entropy")} | {
    "step": pl.Int64,
    "loss_mask": pl.Boolean,
}


def _file_name(plan: Plan, file_index: int) -> str:
    return str(plan.files[file_index]) if file_index < len(plan.files) else "SOURCES"


def _column_name(plan: Plan, canon: str) -> str:
    src = plan.source.get(canon, canon)
    return f"'{canon}'" + (f" (source column '{src}')" if src != canon else "")


def _whole_numbers(df: pl.DataFrame, c: str, plan: Plan, file_index: int) -> None:
    """A float step (or position) column must hold whole numbers: a cast would truncate 0.25,
    0.5 and 0.75 into step 0 without a word."""
    x = df[c]
    if not x.dtype.is_float():
        return
    bad = x.is_not_null() & (~x.is_finite() | (x != x.floor()))
    n = int(bad.sum())
    if not n:
        return
    example = x.filter(bad)[0]
    raise DataError(
        f"{_file_name(plan, file_index)}: column {_column_name(plan, c)}: {n:,} of "
        f"{df.height:,} rows are not whole numbers (e.g. {example!r}); a {c} is an integer, "
        f"and rounding would merge different {c}s. Write integer {c}s in the export (e.g. "
        f"the {c}'s index), or --map {c}=COLUMN to read another column."
    )


def _cast_error(df: pl.DataFrame, plan: Plan, file_index: int) -> DataError:
    """The column whose values cannot be cast, how many rows and an example."""
    for c, t in _TARGET.items():
        if c not in df.columns:
            continue
        x = df[c]
        try:
            got = x.cast(t, strict=False)
        except pl.exceptions.PolarsError:  # not castable at all (a nested value)
            got = pl.Series([None] * x.len(), dtype=t)
        bad = got.is_null() & x.is_not_null()
        n = int(bad.sum())
        if n:
            example = x.filter(bad)[0]
            several = COLUMN_KINDS[c][1]
            return DataError(
                f"{_file_name(plan, file_index)}: column {_column_name(plan, c)}: {n:,} of "
                f"{df.height:,} rows cannot be read as {several} (e.g. {example!r}). Write "
                f"{several} in the export, or --map {c}=COLUMN to read another column."
            )
    return DataError(  # pragma: no cover -- a cast failed, but no column says why
        f"{_file_name(plan, file_index)}: a column cannot be converted to its canonical type "
        f"({', '.join(f'{c}: {df[c].dtype}' for c in df.columns)}). Check the export's types."
    )


class _UnequalLists(Exception):
    def __init__(self, rows: int):
        self.rows = rows


_KEY_COLUMNS = ("step", "sample_id", "position")


# Invalid-row predicates on the canonical frame, per column: (label, expression, fix)
def _problems(df: pl.DataFrame, plan: Plan) -> list[tuple[str, str, pl.Expr]]:
    # The problems of one column exclude each other (a null is only "null", never also NaN,
    # infinite and above 0), so a row counts once per column. Every predicate is false, not
    # null, on a null value: fill_null(True) around them changes nothing.
    out = []
    for c in LOGPROB_COLUMNS:
        if c not in df.columns:
            continue
        x = pl.col(c)
        v = x.is_not_null()
        if c in plan.probs:
            # before the log: the source held probabilities, now log(p); p<0 -> NaN, p>1 -> >0
            out.append((c, "null", x.is_null()))
            out.append((c, "NaN or a probability below 0", v & x.is_nan()))
            out.append((c, "a probability of 0 (log-prob -inf)", v & x.is_infinite() & (x < 0)))
            above = v & x.is_finite() & (x > POSITIVE_TOLERANCE)
            out.append((c, "a probability above 1", above))
        else:
            out.append((c, "null", x.is_null()))
            out.append((c, "NaN", v & x.is_nan()))
            out.append((c, "+inf or -inf", v & x.is_infinite()))
            above = v & x.is_finite() & (x > POSITIVE_TOLERANCE)  # polars orders NaN above all
            out.append((c, f"above 0 by more than {POSITIVE_TOLERANCE:g}", above))
    if "advantage" in df.columns:
        a = pl.col("advantage")
        bad = a.is_null() | (a.is_not_null() & ~a.is_finite())
        out.append(("advantage", "null, NaN or infinite", bad))
    for c in _KEY_COLUMNS:  # a token without a step or sequence cannot be placed
        if c in df.columns:
            out.append((c, "null", pl.col(c).is_null()))
    if "loss_mask" in df.columns:  # neither in nor out of the loss: never taken as false
        out.append(
            ("loss_mask", "null (neither in nor out of the loss)", pl.col("loss_mask").is_null())
        )
    return out


_FIX = (
    "Fix the export, or pass --drop-invalid to drop these rows (the count is reported on stderr)."
)


def _quick_check(df: pl.DataFrame) -> tuple[bool, bool]:
    """(clean, positive): clean when every log-prob is finite and <= POSITIVE_TOLERANCE and
    every advantage finite (no nulls), so that `_invalid_mask` would find nothing; positive
    when some log-prob is above 0 (to clip). One pass per column over the batch's buffers
    (numba when installed), instead of a polars expression per problem."""
    from . import kernels

    j = kernels.jit()
    clean = True
    positive = False
    for c in ("loss_mask", *_KEY_COLUMNS):
        if c in df.columns and df[c].null_count():
            return False, True
    for c in (*LOGPROB_COLUMNS, "advantage"):
        if c not in df.columns:
            continue
        col = df[c]
        if col.null_count() or col.dtype != pl.Float64:
            return False, True
        x = col.to_numpy()
        if j is not None:
            code = j.check_column(x, POSITIVE_TOLERANCE if c != "advantage" else math.inf)
        else:
            fin = bool(np.isfinite(x).all())
            top = float(x.max()) if x.size else 0.0
            limit = POSITIVE_TOLERANCE if c != "advantage" else math.inf
            code = 2 if not fin or top > limit else (1 if top > 0 else 0)
        clean &= code != 2
        positive |= c != "advantage" and code != 0
    return clean, positive


def _invalid_mask(df: pl.DataFrame, plan: Plan) -> pl.Series:
    probs = _problems(df, plan)
    if not probs:
        return pl.Series([False] * df.height)
    return df.select(pl.any_horizontal([e.fill_null(True) for _, _, e in probs])).to_series()


def _loss_filter(df: pl.DataFrame) -> pl.DataFrame:
    """Drop loss_mask == false rows; a null mask is kept for validation (_problems) to count."""
    if "loss_mask" in df.columns:
        m = df["loss_mask"]
        return df.filter(m.fill_null(True)) if m.null_count() else df.filter(m)
    return df


def _file_batches(
    path: Path,
    plan: Plan,
    source_cols: list[str],
    file_index: int = 0,
    report: ReadReport | None = None,
) -> Iterator[pl.DataFrame]:
    """Raw batches of one file: source column names (Parquet, JSONL) or canonical names
    (framework adapters), every row (loss_mask not applied). Skipped records (with
    --drop-invalid) are counted in `report`."""
    if plan.format != "parquet":
        yield from _record_batches(path, plan, source_cols, file_index, report)
        return
    try:
        # pre_buffer=False: with it, pyarrow keeps every row group read so far until the file is
        # closed (~16 bytes a token: 3 GiB at 200M tokens); without it memory stays flat.
        pf = _parquet_file(path, pre_buffer=False)
        streamed = None
        remote = isinstance(path, RemotePath)
        part = plan.row_groups[file_index] if file_index < len(plan.row_groups) else None
        groups = range(pf.metadata.num_row_groups) if part is None else range(*part)
        for run in _group_runs(pf.metadata, groups, plan.options.batch_rows):
            if isinstance(run, list):  # whole row groups: decoded column by column in parallel
                read = lambda run=run: pf.read_row_groups(run, columns=source_cols)  # noqa: E731
                table = remote_call(read, None, str(path)) if remote else read()
                yield pl.from_arrow(table).rechunk()
                continue
            # a row group larger than a batch: streamed through a buffered reader, which
            # reads its pages as they are decoded (unbuffered, pyarrow reads each column
            # chunk whole: 16 bytes a row of two float columns, 4.8 GB for a 300M-row group)
            if streamed is None:
                streamed = _parquet_file(path, pre_buffer=False, buffer_size=STREAM_BUFFER)
            it = streamed.iter_batches(
                batch_size=plan.options.batch_rows, columns=source_cols, row_groups=[run]
            )
            while True:
                rb = (
                    remote_call(lambda it=it: next(it, None), None, str(path))
                    if remote
                    else next(it, None)
                )
                if rb is None:
                    break
                yield pl.from_arrow(rb)
    except FileNotFoundError:
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is something still writing or rotating the logs? Leave the file out."
        ) from None
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"{path}: reading failed part-way ({exc}). The file may be truncated or still being "
            "written; re-export it or leave it out."
        ) from exc


def _group_runs(meta, groups: range, batch_rows: int) -> Iterator[list[int] | int]:
    """Consecutive row groups as batches of at most batch_rows rows (a list of groups, read
    whole), and each group larger than that on its own (an int, streamed in batches).

    Reading whole row groups costs ~40% less CPU than pyarrow's batch iterator over the
    same rows (0.7 vs 1.15 s for the five columns of the 20M-token benchmark log:
    benchmarks/README.md), which copies every column into batches of its own size."""
    run: list[int] = []
    rows = 0
    for g in groups:
        n = meta.row_group(g).num_rows
        if n > batch_rows:
            if run:
                yield run
                run, rows = [], 0
            yield g
            continue
        if run and rows + n > batch_rows:
            yield run
            run, rows = [], 0
        run.append(g)
        rows += n
    if run:
        yield run


def _record_batches(
    path: Path, plan: Plan, source_cols: list[str], file_index: int, report: ReadReport | None
) -> Iterator[pl.DataFrame]:
    opts = plan.options
    wanted = set(source_cols)
    step = plan.file_steps[file_index] if file_index < len(plan.file_steps) else None
    if plan.format in adapters.FILE_FORMATS:
        yield from adapters.read_file(
            plan.format, path, step, wanted, opts.drop_invalid, report, opts.batch_rows
        )
        return
    if plan.format == "jsonl":
        schema = {k: t for k, t in plan.read_schema.items() if k in wanted}
        yield from adapters.read_jsonl(path, schema, opts.drop_invalid, report, opts.block_bytes)
        return
    arrays = adapters.SPECS[plan.format].arrays
    schema = {
        k: t
        for k, t in plan.read_schema.items()
        if k not in arrays or arrays[k] in wanted or arrays[k] in REQUIRED
    }
    yield from adapters.read_framework(
        plan.format, path, step, schema, wanted, opts.drop_invalid, report, opts.block_bytes
    )


def _needed_sources(plan: Plan, columns: Sequence[str] | None) -> list[str]:
    want = set(CANONICAL if columns is None else columns) | set(REQUIRED) | {"loss_mask"}
    if plan.list_columns:
        want |= set(plan.list_columns)  # every list must be exploded together
    return sorted({s for c, s in plan.source.items() if c in want})


def _describe_problems(path: Path, plan: Plan, source_cols: list[str]) -> str:
    """Count every problem in a whole file (called only when one was seen)."""
    counts: dict[tuple[str, str], int] = {}
    loss_rows = 0
    unequal = 0
    offset = 0
    i = plan.files.index(path) if path in plan.files else 0
    for raw in _file_batches(path, plan, source_cols, i):
        try:
            df = _loss_filter(_canonicalise(raw, plan, i, offset))
        except _UnequalLists as e:
            unequal += e.rows
            offset += raw.height
            continue
        offset += raw.height
        loss_rows += df.height
        for col, what, expr in _problems(df, plan):
            n = df.select(expr.fill_null(True).sum()).item()
            if n:
                counts[(col, what)] = counts.get((col, what), 0) + int(n)
    if unequal:
        return (
            f"{path}: {unequal:,} of {offset:,} sequence rows have list columns "
            f"({', '.join(plan.source[c] for c in sorted(plan.list_columns))}) of unequal "
            "lengths, so tokens cannot be aligned. Fix the export, or pass --drop-invalid to "
            "drop these sequences."
        )
    parts = []
    for (col, what), n in counts.items():
        src = plan.source.get(col, col)
        name = f"'{col}'" + (f" (source column '{src}')" if src != col else "")
        parts.append(f"column {name}: {n:,} of {loss_rows:,} loss rows are {what}")
    return f"{path}: " + "; ".join(parts) + ". " + _FIX


def iter_batches(
    plan: Plan,
    columns: Sequence[str] | None = None,
    report: ReadReport | None = None,
) -> Iterator[tuple[int, pl.DataFrame]]:
    """Yield (file_index, canonical loss-token batch) for every file of the plan, in order.

    `columns` limits the canonical columns produced (projection); the two log-prob columns
    and `step` are always there. Raises DataError on invalid rows unless drop_invalid.
    """
    report = report if report is not None else ReadReport()
    for w in plan.warnings:
        if w not in report.warnings:
            report.warnings.append(w)
    if columns is not None:
        missing = [c for c in columns if c not in plan.columns and c != "step"]
        if missing:
            raise DataError(
                f"{plan.files[0]}: column(s) {', '.join(missing)} needed here are not in the log "
                f"(found: {', '.join(plan.columns)}). Add them to the export or --map them."
            )
    source_cols = _needed_sources(plan, columns)
    offset = 0
    for i, path in enumerate(plan.files):
        row_offset = offset
        offset += plan.rows[i]
        hive = _HiveCheck(plan, i)
        for raw in _file_batches(path, plan, source_cols, i, report):
            report.rows += raw.height
            try:
                df = _canonicalise(raw, plan, i, row_offset)
            except _UnequalLists as e:
                if not plan.options.drop_invalid:
                    raise DataError(_describe_problems(path, plan, source_cols)) from None
                raw = _drop_unequal(raw, plan)
                report.dropped[(str(path), "*lists")] = (
                    report.dropped.get((str(path), "*lists"), 0) + e.rows
                )
                df = _canonicalise(raw, plan, i, row_offset)
            row_offset += raw.height
            hive.add(df)
            df = _loss_filter(df)
            clean, positive = _quick_check(df)
            bad = None if clean else _invalid_mask(df, plan)
            nbad = 0 if bad is None else int(bad.sum())
            if nbad:
                if not plan.options.drop_invalid:
                    raise DataError(_describe_problems(path, plan, source_cols))
                for col, _what, expr in _problems(df, plan):
                    n = int(df.select(expr.fill_null(True).sum()).item())
                    if n:
                        key = (str(path), col)
                        report.dropped[key] = report.dropped.get(key, 0) + n
                report.dropped[(str(path), "*")] = report.dropped.get((str(path), "*"), 0) + nbad
                df = df.filter(~bad)
            clip = [pl.col(c).clip(upper_bound=0.0) for c in LOGPROB_COLUMNS if c in df.columns]
            if positive and clip:  # log-probs in (0, 1e-6]: rounding noise, set to 0
                df = df.with_columns(clip)
            report.loss_rows += df.height
            if columns is not None:
                keep = [c for c in df.columns if c in set(columns) | {*REQUIRED, "step"}]
                df = df.select(keep)
            yield i, df
        hive.warn(report)
        if plan.format != "parquet":
            offset = row_offset  # row counts were estimates: number by what was read


class _HiveCheck:
    """A Parquet file under a hive directory `step=N/` that has a step column of its own:
    the column is used; the rows where it disagrees with N are counted and warned about
    once the file is read (a file moved between step directories, a writer's off-by-one)."""

    def __init__(self, plan: Plan, i: int):
        self.path = plan.files[i]
        self.step = plan.file_steps[i] if i < len(plan.file_steps) else None
        self.src = plan.source.get("step")
        self.active = plan.format == "parquet" and self.step is not None and self.src is not None
        self.rows = self.bad = 0
        self.example: int | None = None

    def add(self, df: pl.DataFrame) -> None:
        if not self.active or "step" not in df.columns:
            return
        off = df["step"] != self.step
        n = int(off.sum())
        self.rows += df.height
        if n:
            self.bad += n
            if self.example is None:
                self.example = int(df["step"].filter(off)[0])

    def warn(self, report: ReadReport) -> None:
        if not self.bad:
            return
        note = (
            f"{self.path}: the directory step={self.step} disagrees with the file's step "
            f"column '{self.src}' on {self.bad:,} of {self.rows:,} rows (e.g. step "
            f"{self.example}); used the column. Check which is right (a file moved between "
            "step directories?)."
        )
        if note not in report.warnings:
            report.warnings.append(note)
            _warnings.warn(note, IngestWarning, stacklevel=3)


def _drop_unequal(raw: pl.DataFrame, plan: Plan) -> pl.DataFrame:
    lists = [plan.source[c] for c in sorted(plan.list_columns)]
    ref = plan.source["trainer_logprob"]
    ok = pl.all_horizontal([pl.col(c).list.len() == pl.col(ref).list.len() for c in lists])
    return raw.filter(ok.fill_null(False))


class DuplicateCheck:
    """Rows that repeat a (step, sample_id, position) already seen, counted in memory bounded
    by the sequences, not the tokens: per sequence (step, sample_id), its token count n and
    its lowest and highest position; a sequence with n > highest - lowest + 1 holds at
    least that many repeated rows (exact when positions run without gaps, as trainers write
    them; a lower bound otherwise). Needs sample_id and position (a per-sequence layout
    numbers its positions, so a repeated sequence row is found too). ~40 bytes a sequence.
    Used by inspect and convert (a sweep does not pay for it)."""

    KEYS = ("step", "sample_id", "position")

    def __init__(self) -> None:
        self.table: pl.DataFrame | None = None
        self.parts: list[pl.DataFrame] = []
        self.pending = 0

    @classmethod
    def possible(cls, columns: Sequence[str]) -> bool:
        return all(k in columns for k in ("sample_id", "position"))

    def add(self, df: pl.DataFrame) -> None:
        if df.height == 0 or not all(k in df.columns for k in self.KEYS):
            return
        part = df.group_by("step", "sample_id").agg(
            n=pl.len(), lo=pl.col("position").min(), hi=pl.col("position").max()
        )
        self.parts.append(part)
        self.pending += part.height
        if self.pending > (1 << 18) or len(self.parts) > 64:
            self._merge()

    def _merge(self) -> None:
        if not self.parts:
            return
        frames = ([self.table] if self.table is not None else []) + self.parts
        both = pl.concat(frames, how="vertical_relaxed")
        self.table = both.group_by("step", "sample_id").agg(
            n=pl.col("n").sum(), lo=pl.col("lo").min(), hi=pl.col("hi").max()
        )
        self.parts, self.pending = [], 0

    def counts(self) -> tuple[int, int]:
        """(repeated rows at least, sequences holding them)."""
        self._merge()
        if self.table is None:
            return 0, 0
        extra = (pl.col("n") - (pl.col("hi") - pl.col("lo") + 1)).clip(lower_bound=0)
        got = self.table.select(rows=extra.sum(), seqs=(extra > 0).sum())
        return int(got["rows"][0] or 0), int(got["seqs"][0] or 0)

    def warning(self, files: Sequence[Path | str]) -> str | None:
        rows, seqs = self.counts()
        if not rows:
            return None
        where = f"{files[0]}" + (f" and {len(files) - 1} other file(s)" if len(files) > 1 else "")
        return (
            f"{where}: at least {rows:,} rows repeat a (step, sample_id, position) already "
            f"seen, in {seqs:,} sequence(s), so their tokens count twice in every figure. Remove "
            "the duplicates in the export (a file or rank read twice?), or --map sample_id to "
            "the column that tells the sequences apart."
        )


def read_table(
    sources: Sequence[str | Path] | Plan,
    options: ReadOptions | None = None,
    columns: Sequence[str] | None = None,
    report: ReadReport | None = None,
) -> pl.DataFrame:
    """Read the whole canonical table into memory (for small logs, tests and notebooks)."""
    plan = sources if isinstance(sources, Plan) else plan_sources(sources, options)
    frames = [df for _, df in iter_batches(plan, columns, report)]
    if not frames:
        return pl.DataFrame(schema={c: pl.Float64 for c in REQUIRED} | {"step": pl.Int64})
    return pl.concat(frames, how="vertical_relaxed")
