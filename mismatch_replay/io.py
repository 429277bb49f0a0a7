"""Ingest: any supported token log -> batches of the canonical token table (DESIGN.md).

Design
------
Sources are resolved first: files, directories (searched recursively) and globs, each file's
format detected from its path (`adapters.detect`: `step_<n>/rank_<r>.jsonl` prime-rl,
`train_data_step<N>.jsonl` NeMo-RL, `.pt` slime, other `.jsonl` canonical JSONL, `.parquet`)
or forced with `--format`. One call reads one format (a mix is refused: the schemas would
not agree); a directory holding one framework's files and other files reads the framework's
and says what it ignored. prime-rl steps without a `STABLE` marker are still being written
and are skipped with a warning unless `include_unstable`. Warnings go to `Plan.warnings`,
every `ReadReport.warnings`, and Python's warnings (`IngestWarning`; the CLI prints them).
A hive directory `step=N/` supplies the step of a Parquet file that has no step column.
A source with a scheme (`s3://bucket/prefix/`, `gs://...`, `hdfs://...`, `file://...`) goes
through `pyarrow.fs`: an object, every .parquet under a prefix, or a glob; the files are
`RemotePath`s (the key as a path, the filesystem alongside) and are opened through that
filesystem, here or on a Ray worker. Object stores hold Parquet only (the other formats'
readers want local files: convert first).

A *plan* is made once per call from the files' schemas alone (no data read; for JSON lines,
each file's first record; for slime, the first dump): which source
column feeds each canonical column (`--map canonical=theirs`, else the first known alias),
whether the layout is one row per token or one row per sequence with list columns, and
whether the log holds probabilities instead of log-probabilities. Then the files are
streamed a batch at a time (pyarrow reads only the projected columns: runs of whole row groups
up to the batch size, decoded column by column in parallel, ~40% less CPU than its batch
iterator; a row group larger than a batch is streamed in batches) and
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
With `drop_invalid=True` the rows are dropped instead and counted in `ReadReport`.

`read_table()` collects the canonical table in memory for small logs, tests and notebooks.
"""

from __future__ import annotations

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
)
CANONICAL = REQUIRED + OPTIONAL
LOGPROB_COLUMNS = ("trainer_logprob", "inference_logprob", "old_logprob")
POSITIVE_TOLERANCE = 1e-6  # log-probs in (0, 1e-6] are rounding noise and clipped to 0

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


def _walk(d: Path, forced: str | None, notes: list[str]) -> tuple[list[Path], str]:
    """The token-log files under a directory, and their format."""
    kinds: dict[str, list[Path]] = {}
    others = 0
    for x in sorted(d.rglob("*")):
        if not x.is_file() or x.name.startswith("."):
            continue
        k = adapters.detect(x)
        if k is None:
            others += 1
        else:
            kinds.setdefault(k, []).append(x)
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
            f"recursively for .parquet, .jsonl, .pt, prime-rl step_<n>/rank_<r>.jsonl; found "
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

    @classmethod
    def make(cls, scheme: str, key: str, fs) -> RemotePath:
        p = cls(key)
        p.scheme = scheme
        p.fs = fs
        return p

    def __str__(self) -> str:
        return f"{self.scheme}://{PurePosixPath.__str__(self)}"

    def __reduce__(self):
        return (RemotePath.make, (self.scheme, PurePosixPath.__str__(self), self.fs))

    def resolve(self) -> RemotePath:
        return self


_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_uri(text: str) -> bool:
    """A URI with a scheme (s3://, gs://, file:// ...), as opposed to a local path."""
    return _URI.match(text) is not None


def row_group_rows(path: Path) -> list[int]:
    """Rows of each row group of a Parquet file (from its footer)."""
    meta = pq.ParquetFile(_open(path)).metadata
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
            meta = pq.ParquetFile(_open(path)).metadata
        except (OSError, pa.ArrowException):
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


def filesystem_from_uri(text: str):
    """(pyarrow filesystem, key) for a URI: S3, GCS, HDFS, Azure, local, as pyarrow has them."""
    from pyarrow import fs as pafs

    return pafs.FileSystem.from_uri(text)


def _resolve_uri(text: str, forced: str | None) -> list[tuple[Path, str, str]]:
    """A URI source through pyarrow.fs: one file, a prefix (every .parquet under it) or a glob.
    Parquet only: the other formats' readers want local files."""
    import fnmatch

    from pyarrow import fs as pafs

    scheme = _URI.match(text).group(1).lower()
    try:
        filesystem, key = filesystem_from_uri(text)
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

    def listing(base: str) -> list[str]:
        sel = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        return sorted(
            i.path
            for i in filesystem.get_file_info(sel)
            if i.type == pafs.FileType.File
            and not PurePosixPath(i.path).name.startswith((".", "_"))
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
            info = filesystem.get_file_info(key)
            if info.type == pafs.FileType.NotFound:
                raise DataError(f"{text}: no such object or prefix.")
            keys = listing(key) if info.type == pafs.FileType.Directory else [key]
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{text}: listing failed ({exc}). Check the URI and credentials.") from exc
    paths = [RemotePath.make(scheme, k, filesystem) for k in keys]
    parquet = [x for x in paths if x.suffix.lower() == ".parquet" or forced == "parquet"]
    if not parquet:
        raise DataError(
            f"{text}: no .parquet object there ({len(paths)} other object(s)). Object-store "
            "sources must be Parquet; convert other logs first (mismatch-replay convert)."
        )
    return [(x, "parquet", text) for x in sorted(parquet)]


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
            out.extend(_resolve_uri(text, forced))
        elif any(ch in text for ch in "*?["):
            matched = [Path(x) for x in _glob.glob(text, recursive=True) if Path(x).is_file()]
            if not matched:
                raise DataError(f"{text}: the glob matches no file. Check the pattern and quoting.")
            found = []
            for x in sorted(matched):
                k = adapters.detect(x)
                if k is not None:
                    found.append((x, forced or k, text))
            if not found:
                raise DataError(
                    f"{text}: the glob matches {len(matched)} file(s) but none is a token log "
                    "(.parquet, .jsonl, .pt). Narrow the pattern, or pass --format."
                )
            fmts = {k for _, k, _ in found}
            if fmts & set(adapters.FRAMEWORKS):
                found.sort(key=lambda e: adapters.natural_key(e[0]))
            out.extend(found)
        elif p.is_dir():
            files, k = _walk(p, forced, notes)
            if k != "parquet":
                files = sorted(files, key=adapters.natural_key)
            out.extend((x, k, text) for x in files)
        elif p.is_file():
            out.append((p, forced or adapters.detect(p) or adapters.sniff(p), text))
        else:
            raise DataError(f"{p}: no such file or directory.")
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
        meta = pq.ParquetFile(_open(path))
        return meta.schema_arrow, meta.metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"{path}: cannot read it as Parquet ({exc}). Is the file complete and a Parquet "
            "token log? Re-export it, or leave it out of SOURCES."
        ) from exc


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _choose_columns(
    path: Path, names: list[str], options: ReadOptions
) -> tuple[dict[str, str], set[str]]:
    """canonical -> source column, and which log-prob columns are probabilities."""
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
        plan = _plan_parquet(files, options)
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
) -> tuple[Path, dict[str, str], set[str], frozenset[str]] | None:
    """Column mapping every file agrees on. `entries`: (path, column names, name -> (is a
    list, type shown in errors)). Returns (first path, source, probs, list columns), or None
    when there is no entry."""
    first = None
    plan_source: dict[str, str] = {}
    probs: set[str] = set()
    for path, names, kinds in entries:
        source, p = _choose_columns(path, names, options)
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


def _plan_parquet(files: list[Path], options: ReadOptions) -> Plan:
    rows: list[int] = []

    def entries():
        for path in files:
            schema, n = _read_schema(path)
            rows.append(n)
            kinds = {f.name: (_is_list(f.type), str(f.type)) for f in schema}
            yield path, list(schema.names), kinds

    agreed = _agree(entries(), options)
    assert agreed is not None  # resolve_sources never returns an empty list
    _, source, probs, list_cols = agreed
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
            if fmt == "slime":
                pr = adapters.probe_slime(path)
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

    agreed = _agree(entries(), options)
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
        exprs.append(pl.col("step").cast(pl.Int64))
    if "loss_mask" in df.columns:
        exprs.append(pl.col("loss_mask").cast(pl.Boolean))
    return df.with_columns(exprs)


class _UnequalLists(Exception):
    def __init__(self, rows: int):
        self.rows = rows


# Invalid-row predicates on the canonical frame, per column: (label, expression, fix)
def _problems(df: pl.DataFrame, plan: Plan) -> list[tuple[str, str, pl.Expr]]:
    out = []
    for c in LOGPROB_COLUMNS:
        if c not in df.columns:
            continue
        x = pl.col(c)
        if c in plan.probs:
            # before the log: the source held probabilities, now log(p); p<0 -> NaN, p>1 -> >0
            out.append((c, "null", x.is_null()))
            out.append((c, "NaN or a probability below 0", x.is_nan()))
            out.append((c, "a probability of 0 (log-prob -inf)", x.is_infinite() & (x < 0)))
            out.append((c, "a probability above 1", x.is_finite() & (x > POSITIVE_TOLERANCE)))
        else:
            out.append((c, "null", x.is_null()))
            out.append((c, "NaN", x.is_nan()))
            out.append((c, "+inf or -inf", x.is_infinite()))
            above = x.is_finite() & (x > POSITIVE_TOLERANCE)  # polars orders NaN above all
            out.append((c, f"above 0 by more than {POSITIVE_TOLERANCE:g}", above))
    if "advantage" in df.columns:
        a = pl.col("advantage")
        out.append(("advantage", "null, NaN or infinite", a.is_null() | ~a.is_finite()))
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
    if "loss_mask" in df.columns:
        return df.filter(pl.col("loss_mask").fill_null(False))
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
        pf = pq.ParquetFile(_open(path), pre_buffer=False)
        part = plan.row_groups[file_index] if file_index < len(plan.row_groups) else None
        groups = range(pf.metadata.num_row_groups) if part is None else range(*part)
        for run in _group_runs(pf.metadata, groups, plan.options.batch_rows):
            if isinstance(run, list):  # whole row groups: decoded column by column in parallel
                yield pl.from_arrow(pf.read_row_groups(run, columns=source_cols)).rechunk()
            else:  # a row group larger than a batch: streamed, memory stays flat
                for rb in pf.iter_batches(
                    batch_size=plan.options.batch_rows, columns=source_cols, row_groups=[run]
                ):
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
    if plan.format == "slime":
        yield from adapters.read_slime(path, wanted, opts.drop_invalid, report, opts.batch_rows)
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
    step = plan.file_steps[file_index] if file_index < len(plan.file_steps) else None
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
    for raw in _file_batches(path, plan, source_cols):
        try:
            df = _loss_filter(_canonicalise(raw, plan, 0, offset))
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
        if plan.format != "parquet":
            offset = row_offset  # row counts were estimates: number by what was read


def _drop_unequal(raw: pl.DataFrame, plan: Plan) -> pl.DataFrame:
    lists = [plan.source[c] for c in sorted(plan.list_columns)]
    ref = plan.source["trainer_logprob"]
    ok = pl.all_horizontal([pl.col(c).list.len() == pl.col(ref).list.len() for c in lists])
    return raw.filter(ok.fill_null(False))


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
