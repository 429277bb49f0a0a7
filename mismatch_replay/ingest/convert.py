"""`convert`: any supported token log -> the canonical token table as zstd Parquet, once.

Design
------
Reading a framework's export costs ~2-6 s per million tokens (prime-rl writes ~150 bytes of
JSON a token; slime dumps go through torch's safe unpickler); reading the canonical Parquet
table costs well under a second. So a user converts once and replays many times. The
conversion is the ingest path itself (`read.iter_batches`: same detection, mapping, validation
and `--drop-invalid` accounting), streamed into a pyarrow writer:

- one file: `pq.ParquetWriter`, zstd, batches buffered into row groups of `row_group_rows`
  (default 1M rows, ~10-20 MB compressed: big enough for fast scans, small enough that a
  reader's memory stays bounded);
- `partition_by="step"`: a hive layout `DIR/step=N/part-0.parquet` written by
  `pyarrow.dataset.write_dataset` (the step lives in the directory name, as hive readers
  expect; `read` takes it back from there). At most 8 partitions are open at a time, so memory
  stays at a few row groups even for thousands of steps.

The output holds the loss tokens only (rows with `loss_mask` false are dropped on the way, so
the `loss_mask` column is left out), with every canonical column the source delivers, in
canonical order. It is written to a temporary file (or directory) beside the target, hidden
from every reader, and published at the end by `output.atomic_write`: an interrupted or failed
conversion leaves nothing behind (SIGKILL: a hidden temporary that readers skip and the next
write into that directory removes), and an existing target, or one that appears while the
conversion runs (a second `convert` to the same path), is replaced only with `force` (a
directory only if it holds nothing but a partitioned table, so `--force` can never delete
unrelated files).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ..errors import DataError, UsageError
from ..output import atomic_write, output_error
from . import read
from .canonical import CANONICAL, DuplicateCheck, IngestWarning, Plan, ReadOptions, ReadReport

PARTITIONS = ("step",)
ROW_GROUP_ROWS = 1_000_000
PARQUET_SUFFIXES = (".parquet", ".pq")
MAX_OPEN_PARTITIONS = 8


def check_output(out: str | Path, partition_by: str | None, force: bool) -> Path:
    """Refuse a bad or existing target (unless force) before anything is read."""
    p = Path(out)
    try:
        p.exists()
    except OSError as exc:  # a name too long, ...
        raise output_error(exc, p) from None
    if partition_by is not None and partition_by not in PARTITIONS:
        raise UsageError(
            f"--partition-by {partition_by}: convert partitions by {', '.join(PARTITIONS)}."
        )
    if partition_by is None:
        if p.suffix.lower() not in PARQUET_SUFFIXES:
            raise UsageError(
                f"-o {p}: convert writes Parquet; name the output FILE.parquet (or pass "
                "--partition-by step to write a directory of Parquet files)."
            )
        if p.is_dir():
            raise UsageError(
                f"-o {p}: that is a directory; give a file name, or pass --partition-by step."
            )
        if p.exists() and not force:
            raise UsageError(f"-o {p}: the file exists. Pass --force to overwrite it.")
        return p
    if p.exists() and not p.is_dir():
        raise UsageError(
            f"-o {p}: that is a file, and --partition-by step writes a directory. Name a new "
            "directory."
        )
    if p.exists() and not force:
        raise UsageError(f"-o {p}: the directory exists. Pass --force to replace it.")
    if p.exists() and not _is_partitioned_table(p):
        raise UsageError(
            f"-o {p}: the directory holds files other than a step-partitioned Parquet table, "
            "so --force will not replace it. Name a new directory."
        )
    return p


def _is_partitioned_table(d: Path) -> bool:
    for x in d.rglob("*"):
        rel = x.relative_to(d)
        if x.is_dir():
            if len(rel.parts) != 1 or not rel.parts[0].startswith("step="):
                return False
        elif len(rel.parts) != 2 or x.suffix.lower() not in PARQUET_SUFFIXES:
            return False
    return True


def _canonical_batches(
    plan: Plan, report: ReadReport, progress: Callable[[int, int], None] | None
) -> Iterator[pl.DataFrame]:
    """Loss-token batches in canonical column order, one schema for all."""
    total = sum(plan.rows)
    schema: dict[str, pl.DataType] | None = None
    dups = DuplicateCheck()
    for _, df in read.iter_batches(plan, None, report):
        if progress is not None:
            progress(report.rows, max(total, report.rows))
        if df.height == 0:
            continue
        dups.add(df)
        cols = [c for c in CANONICAL if c in df.columns and c != "loss_mask"]
        df = df.select(cols)
        if schema is None:
            schema = dict(df.schema)
        elif dict(df.schema) != schema:
            try:
                df = df.select([pl.col(c).cast(t) for c, t in schema.items()])
            except (pl.exceptions.PolarsError, pl.exceptions.ColumnNotFoundError) as exc:
                raise DataError(
                    f"column types changed part-way through the sources ({exc}); convert the "
                    "files in separate calls."
                ) from exc
        yield df
    note = dups.warning(plan.files)  # copied as they are: the user should know
    if note is not None:
        report.warnings.append(note)
        warnings.warn(note, IngestWarning, stacklevel=2)


def _no_tokens(plan: Plan, report: ReadReport) -> DataError:
    more = " and others" if len(plan.files) > 1 else ""
    return DataError(
        f"{plan.files[0]}{more}: no loss tokens to convert ({report.rows:,} row(s) read, none "
        "with loss_mask true and valid). Check the loss_mask column and the --map options."
    )


def _write_file(batches: Iterator[pl.DataFrame], tmp: Path, row_group_rows: int) -> int:
    """Stream batches into one zstd Parquet file; returns the number of row groups."""
    writer: pq.ParquetWriter | None = None
    buf: list[pl.DataFrame] = []
    nbuf = 0
    groups = 0

    def flush(final: bool) -> None:
        nonlocal writer, buf, nbuf, groups
        table = pl.concat(buf, how="vertical").to_arrow()
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
        full = (table.num_rows // row_group_rows) * row_group_rows
        upto = table.num_rows if final else full
        if upto:
            writer.write_table(table.slice(0, upto), row_group_size=row_group_rows)
            groups += -(-upto // row_group_rows)
        rest = table.slice(upto)
        buf = [pl.from_arrow(rest)] if rest.num_rows else []
        nbuf = rest.num_rows

    try:
        for df in batches:
            buf.append(df)
            nbuf += df.height
            if nbuf >= row_group_rows:
                flush(final=False)
        if nbuf:
            flush(final=True)
    finally:
        if writer is not None:
            writer.close()
    return groups


def _write_partitioned(
    batches: Iterator[pl.DataFrame], tmp: Path, partition_by: str, row_group_rows: int
) -> None:
    it = iter(batches)
    first = next(it, None)
    if first is None:
        return
    schema = first.to_arrow().schema

    def arrow() -> Iterator[pa.RecordBatch]:
        yield from first.to_arrow().to_batches()
        for df in it:
            yield from df.to_arrow().cast(schema).to_batches()

    ds.write_dataset(
        arrow(),
        tmp,
        schema=schema,
        format="parquet",
        partitioning=ds.partitioning(pa.schema([schema.field(partition_by)]), flavor="hive"),
        basename_template="part-{i}.parquet",
        file_options=ds.ParquetFileFormat().make_write_options(compression="zstd"),
        max_open_files=MAX_OPEN_PARTITIONS,
        min_rows_per_group=min(row_group_rows, 1 << 20),
        max_rows_per_group=row_group_rows,
        existing_data_behavior="overwrite_or_ignore",
    )


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(x.stat().st_size for x in p.rglob("*") if x.is_file())


def convert(
    sources: Sequence[str | Path] | Plan,
    out: str | Path,
    options: ReadOptions | None = None,
    partition_by: str | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    row_group_rows: int = ROW_GROUP_ROWS,
) -> dict:
    """Convert sources to the canonical table at `out` (zstd Parquet; a hive directory with
    `partition_by="step"`), atomically. Returns a summary: tokens, steps, files, bytes,
    seconds, tokens_per_s, dropped rows and records, warnings."""
    if row_group_rows < 1:
        raise UsageError(f"--row-group-rows {row_group_rows}: give a positive number of rows.")
    target = check_output(out, partition_by, force)
    t0 = time.perf_counter()
    plan = sources if isinstance(sources, Plan) else read.plan_sources(sources, options)
    report = ReadReport()
    steps: set[int] = set()
    columns: list[str] = []

    def counted() -> Iterator[pl.DataFrame]:
        for df in _canonical_batches(plan, report, progress):
            steps.update(df["step"].unique().to_list())
            if not columns:
                columns.extend(df.columns)
            yield df

    groups = None

    def write(tmp: Path) -> None:
        nonlocal groups
        if partition_by is None:
            groups = _write_file(counted(), tmp, row_group_rows)
        else:
            _write_partitioned(counted(), tmp, partition_by, row_group_rows)
        if report.loss_rows == 0:
            raise _no_tokens(plan, report)
        if force and partition_by is not None and target.is_dir():
            check_output(target, partition_by, force)  # still only a partitioned table?

    # a temporary name the readers skip, then an exclusive publish (unless force): a target
    # that appears meanwhile (a second convert) is never replaced
    atomic_write(target, write, force=force, directory=partition_by is not None)
    seconds = time.perf_counter() - t0
    return {
        "output": str(target),
        "format": plan.format,
        "files": len(plan.files),
        "partition_by": partition_by,
        "columns": columns,
        "rows_read": report.rows,
        "tokens": report.loss_rows,
        "steps": len(steps),
        "row_groups": groups,
        "bytes": _size(target),
        "seconds": seconds,
        "tokens_per_s": report.loss_rows / seconds if seconds > 0 else None,
        "dropped_rows": report.dropped_rows,
        "dropped_records": report.dropped_records,
        "dropped": {
            f"{f}: {'sequence rows with unequal list lengths' if c == '*lists' else c}": n
            for (f, c), n in report.dropped.items()
            if c != "*"
        },
        "warnings": list(report.warnings),
    }
