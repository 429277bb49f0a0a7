"""Reading: a Plan made once from the files' schemas, then the files streamed a batch at a
time through the canonical table's checks (DESIGN.md).

Design
------
`plan_sources` resolves the sources (sources.resolve: the files and their one format) and
decides, from the schemas alone (no data read; for JSON lines, each file's first record; for
slime, the first dump), which source column feeds each canonical column, whether the layout
is one row per token or one row per sequence with list columns, and whether the log holds
probabilities instead of log-probabilities; every file must agree (`_agree`). The framework
formats deliver fixed columns, so only their first non-empty file is probed; their row
counts are estimates from file sizes, for progress only. Warnings about the sources go to
`Plan.warnings`, every `ReadReport.warnings`, and Python's warnings (`IngestWarning`; the CLI
prints them).

`iter_batches` then streams each file. Parquet is read here, projected to the columns needed:
runs of whole row groups up to the batch size, decoded column by column in parallel (~40%
less CPU than pyarrow's batch iterator, `_group_runs`); a row group larger than a batch is
streamed in batches through a buffered reader, page by page, so that a 300M-row group costs a
batch, not its 4.8 GB of column chunks. A plan may name row-group ranges per file (the Ray
engine cuts a large file into shards so). The other formats go through `formats.read`, which
yields frames of every token of a block of records (JSON lines: ~48 MB of text at a time;
slime: one dump, tensors memory-mapped). Each batch is canonicalised eagerly with polars
(canonical.canonicalise, loss_filter), checked (quick_check, and the per-problem counts only
when it fails) and clipped. Memory is bounded by the batch (default 1M rows ~ 16 MB per float
column), never by the log. When a batch holds an invalid row, the whole file is re-read to
count every problem (`_describe_problems`), so that the error names the file, the column,
how many rows, and the fix; with `drop_invalid=True` the rows are dropped instead and counted
in `ReadReport`. A file under a hive `step=N/` whose own step column disagrees is warned about
once it is read (`_HiveCheck`).

`step_bounds` gives the local engine, from Parquet row-group statistics, the step below which
no row is still to come (m2po resolves its steps as soon as they are complete).
`read_table()` collects the canonical table in memory for small logs, tests and notebooks.
"""

from __future__ import annotations

import math
import warnings as _warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import polars as pl
import pyarrow as pa

from ..errors import DataError
from . import formats
from .canonical import (
    ALIASES,
    CANONICAL,
    INVALID_ROWS_FIX,
    LOGPROB_COLUMNS,
    PROB_ALIASES,
    REQUIRED,
    IngestWarning,
    Plan,
    ReadOptions,
    ReadReport,
    UnequalLists,
    canonicalise,
    check_types,
    choose_columns,
    drop_unequal,
    invalid_mask,
    is_list_type,
    loss_filter,
    problems,
    quick_check,
)
from .sources import RemotePath, parquet_file, remote_call, resolve

STREAM_BUFFER = 1 << 20  # bytes read at a time from a row group larger than a batch

# ----------------------------------------------------------------------------- plans


def plan_sources(sources: Sequence[str | Path], options: ReadOptions | None = None) -> Plan:
    """Resolve sources, detect their format and decide the column mapping; every file must
    agree. Warnings about the sources are issued here (IngestWarning) and kept in the plan."""
    options = options or ReadOptions()
    files, fmt, notes = resolve(sources, options)
    if fmt == "parquet":
        plan = _plan_parquet(files, options, notes)
    else:
        plan = _plan_records(files, fmt, options, notes)
    steps = tuple(formats.path_step(f, fmt) for f in files)
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
        source, p = choose_columns(path, names, options, notes if first is None else None)
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


def _fmt_map(items) -> str:
    return ", ".join(f"{c}<-{s}" for c, s in items)


def _read_schema(path: Path) -> tuple[pa.Schema, int]:
    try:
        meta = parquet_file(path)
        return meta.schema_arrow, meta.metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"{path}: cannot read it as Parquet ({exc}). Is the file complete and a Parquet "
            "token log? Re-export it, or leave it out of SOURCES."
        ) from exc


def _plan_parquet(files: list[Path], options: ReadOptions, notes: list[str] | None = None) -> Plan:
    rows: list[int] = []
    schemas: list[pa.Schema] = []

    def entries():
        for path in files:
            schema, n = _read_schema(path)
            rows.append(n)
            schemas.append(schema)
            kinds = {f.name: (is_list_type(f.type), str(f.type)) for f in schema}
            yield path, list(schema.names), kinds

    agreed = _agree(entries(), options, notes)
    assert agreed is not None  # resolve_sources never returns an empty list
    _, source, probs, list_cols = agreed
    for path, schema, n in zip(files, schemas, rows, strict=True):
        for canon in check_types(path, schema, source, n, options, notes):
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
    probe: formats.Probe | None = None
    first_size = 1
    roles = _json_roles(options)

    def entries():
        nonlocal probe, first_size
        for path in files:
            if fmt != "jsonl" and probe is not None:
                # framework formats deliver fixed columns: one probe is enough
                size = formats.file_size(path)
                if size == 0:
                    empties.append(path)
                rows.append(int(probe.rows * size / first_size))
                continue
            pr = formats.probe(fmt, path, options.drop_invalid, roles)
            if pr is None:
                empties.append(path)
                rows.append(0)
                continue
            rows.append(pr.rows)
            if probe is None:
                probe, first_size = pr, max(formats.file_size(path), 1)
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


# ----------------------------------------------------------------------------- batches


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
                df = canonicalise(raw, plan, i, row_offset)
            except UnequalLists as e:
                if not plan.options.drop_invalid:
                    raise DataError(_describe_problems(path, plan, source_cols)) from None
                raw = drop_unequal(raw, plan)
                report.dropped[(str(path), "*lists")] = (
                    report.dropped.get((str(path), "*lists"), 0) + e.rows
                )
                df = canonicalise(raw, plan, i, row_offset)
            row_offset += raw.height
            hive.add(df)
            df = loss_filter(df)
            clean, positive = quick_check(df)
            bad = None if clean else invalid_mask(df, plan)
            nbad = 0 if bad is None else int(bad.sum())
            if nbad:
                if not plan.options.drop_invalid:
                    raise DataError(_describe_problems(path, plan, source_cols))
                for col, _what, expr in problems(df, plan):
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


def _needed_sources(plan: Plan, columns: Sequence[str] | None) -> list[str]:
    # kept_mass (where --map names it) always: it corrects the inference log-prob
    want = set(CANONICAL if columns is None else columns) | set(REQUIRED) | {"loss_mask"}
    want.add("kept_mass")
    if plan.list_columns:
        want |= set(plan.list_columns)  # every list must be exploded together
    return sorted({s for c, s in plan.source.items() if c in want})


def _file_batches(
    path: Path,
    plan: Plan,
    source_cols: list[str],
    file_index: int = 0,
    report: ReadReport | None = None,
) -> Iterator[pl.DataFrame]:
    """Raw batches of one file: source column names (Parquet, JSONL) or canonical names
    (framework formats), every row (loss_mask not applied). Skipped records (with
    --drop-invalid) are counted in `report`."""
    if plan.format != "parquet":
        yield from _record_batches(path, plan, source_cols, file_index, report)
        return
    try:
        # pre_buffer=False: with it, pyarrow keeps every row group read so far until the file is
        # closed (~16 bytes a token: 3 GiB at 200M tokens); without it memory stays flat.
        pf = parquet_file(path, pre_buffer=False)
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
                streamed = parquet_file(path, pre_buffer=False, buffer_size=STREAM_BUFFER)
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
    yield from formats.read(
        plan.format,
        path,
        step,
        plan.read_schema,
        wanted,
        opts.drop_invalid,
        report,
        opts.batch_rows,
        opts.block_bytes,
    )


def _describe_problems(path: Path, plan: Plan, source_cols: list[str]) -> str:
    """Count every problem in a whole file (called only when one was seen)."""
    counts: dict[tuple[str, str], int] = {}
    loss_rows = 0
    unequal = 0
    offset = 0
    i = plan.files.index(path) if path in plan.files else 0
    for raw in _file_batches(path, plan, source_cols, i):
        try:
            df = loss_filter(canonicalise(raw, plan, i, offset))
        except UnequalLists as e:
            unequal += e.rows
            offset += raw.height
            continue
        offset += raw.height
        loss_rows += df.height
        for col, what, expr in problems(df, plan):
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
    return f"{path}: " + "; ".join(parts) + ". " + INVALID_ROWS_FIX


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


# ----------------------------------------------------------------------------- Parquet footers


def row_group_rows(path: Path) -> list[int]:
    """Rows of each row group of a Parquet file (from its footer)."""
    meta = parquet_file(path).metadata
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
            meta = parquet_file(path).metadata
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
