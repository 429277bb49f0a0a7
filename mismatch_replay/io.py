"""Ingest: any supported token log -> batches of the canonical token table (DESIGN.md).

Design
------
A *plan* is made once per call from the files' schemas alone (no data read): which source
column feeds each canonical column (`--map canonical=theirs`, else the first known alias),
whether the layout is one row per token or one row per sequence with list columns, and
whether the log holds probabilities instead of log-probabilities. Then the files are
streamed one Parquet record batch at a time (pyarrow reads only the projected columns) and
each batch is canonicalised eagerly with polars: rename, explode list columns, probabilities
-> log-probs, drop `loss_mask == false` rows, validate. Memory is bounded by the batch
(default 1M rows ~ 16 MB per float column), never by the log.

Validation is paid for only when something is wrong: a batch is checked with a handful of
vectorised comparisons; when it holds an invalid row, the whole file is re-read to count
every problem so that the error names the file, the column, how many rows, and the fix.
With `drop_invalid=True` the rows are dropped instead and counted in `ReadReport`.

`read_table()` collects the canonical table in memory for small logs, tests and notebooks.
"""

from __future__ import annotations

import glob as _glob
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

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


@dataclass(frozen=True)
class ReadOptions:
    """How to read sources. `mapping` is canonical -> source column (`--map`)."""

    mapping: dict[str, str] = field(default_factory=dict)
    probs: bool = False  # the mapped log-prob columns hold probabilities
    drop_invalid: bool = False
    batch_rows: int = 1_000_000


@dataclass
class ReadReport:
    """What ingest saw: rows read, loss rows kept, invalid rows dropped (per file, column)."""

    rows: int = 0
    loss_rows: int = 0
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def dropped_rows(self) -> int:
        return sum(v for (f, c), v in self.dropped.items() if c == "*")

    def __iadd__(self, other: ReadReport) -> ReadReport:
        self.rows += other.rows
        self.loss_rows += other.loss_rows
        for k, v in other.dropped.items():
            self.dropped[k] = self.dropped.get(k, 0) + v
        return self


@dataclass(frozen=True)
class Plan:
    """What to read from which files, decided from the schemas alone."""

    files: tuple[Path, ...]
    source: dict[str, str]  # canonical -> source column name
    list_columns: frozenset[str]  # canonical columns stored as lists (one row per sequence)
    probs: frozenset[str]  # canonical log-prob columns that hold probabilities
    rows: tuple[int, ...]  # rows per file (Parquet metadata), for sequence ids
    options: ReadOptions

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


def resolve_sources(sources: Sequence[str | Path]) -> list[Path]:
    """Expand files, directories (recursively, `*.parquet`) and globs; keep order, no dups."""
    if not sources:
        raise UsageError("no SOURCES given: pass a Parquet file, a directory or a glob")
    out: list[Path] = []
    for s in sources:
        text = str(s)
        p = Path(text)
        if any(ch in text for ch in "*?["):
            found = sorted(Path(x) for x in _glob.glob(text, recursive=True) if Path(x).is_file())
            if not found:
                raise DataError(f"{text}: the glob matches no file. Check the pattern and quoting.")
            out.extend(found)
        elif p.is_dir():
            found = sorted(x for x in p.rglob("*.parquet") if x.is_file())
            if not found:
                raise DataError(
                    f"{p}: the directory holds no .parquet file (searched recursively). "
                    "Point at a directory of Parquet token logs, or convert the log first."
                )
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"{p}: no such file or directory.")
    seen: set[Path] = set()
    uniq = []
    for p in out:
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            uniq.append(p)
    return uniq


def _read_schema(path: Path) -> tuple[pa.Schema, int]:
    try:
        meta = pq.ParquetFile(path)
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
    """Resolve sources and decide the column mapping; every file must agree."""
    options = options or ReadOptions()
    files = resolve_sources(sources)
    first: tuple[Path, dict[str, str], dict[str, pa.DataType]] | None = None
    rows = []
    plan_source: dict[str, str] = {}
    probs: set[str] = set()
    for path in files:
        schema, n = _read_schema(path)
        rows.append(n)
        names = list(schema.names)
        source, p = _choose_columns(path, names, options)
        types = {c: schema.field(source[c]).type for c in source}
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
        for c, t in types.items():
            if _is_list(t) != _is_list(ftypes[c]):
                raise DataError(
                    f"schemas differ between files: column '{source[c]}' is {ftypes[c]} in "
                    f"{fpath} but {t} in {path}. Convert one layout to the other first "
                    "(mismatch-replay convert)."
                )
    assert first is not None
    types = first[2]
    list_cols = frozenset(c for c, t in types.items() if _is_list(t))
    for c in REQUIRED:
        if list_cols and c not in list_cols:
            raise DataError(
                f"{first[0]}: column '{plan_source[c]}' is a scalar while "
                f"{', '.join(plan_source[x] for x in sorted(list_cols))} are lists. "
                "Either every per-token column is a list (one row per sequence) or none is."
            )
    return Plan(
        files=tuple(files),
        source=plan_source,
        list_columns=list_cols,
        probs=frozenset(probs),
        rows=tuple(rows),
        options=options,
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
    if "step" not in df.columns:
        exprs.append(pl.lit(0, dtype=pl.Int64).alias("step"))
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


def _invalid_mask(df: pl.DataFrame, plan: Plan) -> pl.Series:
    probs = _problems(df, plan)
    if not probs:
        return pl.Series([False] * df.height)
    return df.select(pl.any_horizontal([e.fill_null(True) for _, _, e in probs])).to_series()


def _loss_filter(df: pl.DataFrame) -> pl.DataFrame:
    if "loss_mask" in df.columns:
        return df.filter(pl.col("loss_mask").fill_null(False))
    return df


def _file_batches(path: Path, plan: Plan, source_cols: list[str]) -> Iterator[pl.DataFrame]:
    try:
        pf = pq.ParquetFile(path)
        for rb in pf.iter_batches(batch_size=plan.options.batch_rows, columns=source_cols):
            yield pl.from_arrow(rb)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(
            f"{path}: reading failed part-way ({exc}). The file may be truncated or still being "
            "written; re-export it or leave it out."
        ) from exc


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
        for raw in _file_batches(path, plan, source_cols):
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
            bad = _invalid_mask(df, plan)
            nbad = int(bad.sum())
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
            for c in LOGPROB_COLUMNS:
                if c in df.columns:
                    df = df.with_columns(pl.col(c).clip(upper_bound=0.0))
            report.loss_rows += df.height
            if columns is not None:
                keep = [c for c in df.columns if c in set(columns) | {*REQUIRED, "step"}]
                df = df.select(keep)
            yield i, df


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
