"""The canonical token table: its columns, how a log's columns map onto them, and the checks
every batch passes (DESIGN.md).

Design
------
Every format ends here. A source column feeds a canonical column by `--map canonical=theirs`,
else by the first of its accepted names (`ALIASES`; `PROB_ALIASES` for columns that hold
probabilities, read as their log). A log with the inference log-prob, no trainer one by
name and exactly one trainer-side column (`old_log_probs`: verl) reads that one as
trainer_logprob, with a note. `choose_columns` decides this from a file's column names
alone, `check_types` refuses from its schema alone a column whose type cannot hold its
canonical column (text where numbers belong, nested structs, lists of lists: one sentence,
before anything is read; an optional payload column such as `advantage` is left out with a
warning instead). The decisions, made once per call, are a `Plan` (read.plan_sources makes
it; Ray ships it to workers).

`canonicalise` turns a raw batch into canonical columns: rename (one source column may feed
two canonical ones), explode the list columns of a one-row-per-sequence layout together
(numbering sample_id and position where the log has none; lists of unequal lengths raise
`UnequalLists`), probabilities -> log-probs, casts, and the step from a hive `step=N/`
directory when the file has no step column. A float step or position must hold whole numbers
(0.25 is refused: truncating it would merge steps). `loss_filter` then drops
`loss_mask == false` rows.

Validation is paid for only when something is wrong: `quick_check` makes one pass per column
(finite, not above POSITIVE_TOLERANCE = 1e-6, no nulls; numba when installed); only when it
fails do the per-problem polars expressions of `problems` run (`invalid_mask`). A row counts
once per column (a null log-prob is "null", not also NaN, infinite and above 0); a null
`loss_mask`, step, sample_id or position is an invalid row like a NaN (never taken as false,
or as step 0). Log-probs in (0, 1e-6] are rounding noise, clipped to 0. `ReadReport` carries
what was read, kept and dropped (per file and column; whole records skipped by a format
reader under `RECORDS + why`) and the warnings (`IngestWarning`). `DuplicateCheck` (inspect,
convert) counts rows repeating a (step, sample_id, position), in memory bounded by the
sequences (~40 bytes a sequence).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from ..errors import DataError, UsageError

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
    "kept_mass",
    "version",
    "reward",
)
CANONICAL = REQUIRED + OPTIONAL
# read only where --map names it: the engine's kept probability mass of a truncated
# (top-p / top-k) sampler, per token; every command then replays lq + log(kept_mass)
MAPPED_ONLY = ("kept_mass",)
LOGPROB_COLUMNS = ("trainer_logprob", "inference_logprob", "old_logprob")
POSITIVE_TOLERANCE = 1e-6  # log-probs in (0, 1e-6] are rounding noise and clipped to 0
IO_TIMEOUT_S = 30.0  # default connect / request timeout of object-store sources
RECORDS = "records: "  # ReadReport.dropped column prefix for records a format reader skipped

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
    "version": ("versions", "policy_version", "weight_version"),
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
    # the sample's reward (one value per sequence, repeated on its tokens): NeMo-RL's
    # `rewards`, verl's `score` (its rollout dumps, trainer.rollout_data_dir)
    "reward": ("rewards", "score", "scores"),
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
        return sum(v for (f, c), v in self.dropped.items() if c.startswith(RECORDS))

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


# ----------------------------------------------------------------------------- mapping


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


def is_list_type(t: pa.DataType) -> bool:
    """Whether an arrow type is a list of any kind (list, large, fixed-size, list view)."""
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
    "kept_mass": _FLOAT,
    "version": _INT,
    "reward": _FLOAT,
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
    if is_list_type(t):
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
_LEAVE_OUT = (
    "advantage",
    "entropy",
    "old_logprob",
    "env",
    "token_id",
    "group_id",
    "version",
    "reward",
)


def check_types(
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
        inner = t.value_type if is_list_type(t) else t
        kind = _arrow_kind(inner)
        if kind in kinds:
            continue
        what = _KIND_TEXT.get(kind, f"values of type {inner}")
        if is_list_type(t) and kind != "list":
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


def choose_columns(
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
        if canon in source or canon in MAPPED_ONLY:
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
    _trainer_side(path, names, options, source, probs, notes)
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


def _trainer_side(path, names, options, source: dict, probs: set, notes) -> None:
    """No trainer log-prob by name, the inference one found, and exactly one trainer-side
    column (an `old_logprob` name: verl's `old_log_probs` is the trainer's recomputed
    log-prob that its rollout correction compares with `rollout_log_probs`): read that one
    as trainer_logprob, and say so (`notes`). Not where --map named old_logprob."""
    if "trainer_logprob" in source or "inference_logprob" not in source:
        return
    if "old_logprob" in options.mapping:
        return
    accepted = ("old_logprob", *ALIASES["old_logprob"], *PROB_ALIASES["old_logprob"])
    present = [c for c in accepted if c in names]
    if len(present) != 1 or source.get("old_logprob") != present[0]:
        return
    rest = {k: v for k, v in source.items() if k != "old_logprob"}
    source.clear()  # trainer_logprob first, where inspect's "columns" lists it
    source.update({"trainer_logprob": present[0], **rest})
    if "old_logprob" in probs:
        probs.discard("old_logprob")
        probs.add("trainer_logprob")
    if notes is not None:
        notes.append(
            f"{path}: no trainer log-prob column by name; read '{present[0]}', the one "
            "trainer-side column, as trainer_logprob (verl's old_log_probs is what its "
            "rollout correction compares with rollout_log_probs). Pass --map "
            "trainer_logprob=COLUMN to read another."
        )


# ----------------------------------------------------------------------------- batches


def canonicalise(df: pl.DataFrame, plan: Plan, file_index: int, row_offset: int) -> pl.DataFrame:
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
            raise UnequalLists(int(bad))
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
    if "kept_mass" in df.columns:
        exprs.append(pl.col("kept_mass").cast(pl.Float64))
    if "reward" in df.columns:
        exprs.append(pl.col("reward").cast(pl.Float64))
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
        df = df.with_columns(exprs)
    except pl.exceptions.PolarsError:  # a value that is not a number (JSON lines: any type)
        raise _cast_error(df, plan, file_index) from None
    if "kept_mass" in df.columns:  # the truncated sampler's log-prob, back on the full support
        df = df.with_columns(pl.col("inference_logprob") + pl.col("kept_mass").log())
    return df


_FLOATS = (*LOGPROB_COLUMNS, "advantage", "entropy", "kept_mass", "reward")
_TARGET = {c: pl.Float64 for c in _FLOATS} | {
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


class UnequalLists(Exception):
    """A batch of sequence rows whose list columns differ in length (`rows` of them)."""

    def __init__(self, rows: int):
        self.rows = rows


_KEY_COLUMNS = ("step", "sample_id", "position")


def problems(df: pl.DataFrame, plan: Plan) -> list[tuple[str, str, pl.Expr]]:
    """Invalid-row predicates on the canonical frame: (column, what is wrong, expression).
    The problems of one column exclude each other (a null is only "null", never also NaN,
    infinite and above 0), so a row counts once per column. Every predicate is false, not
    null, on a null value: fill_null(True) around them changes nothing."""
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
    if "kept_mass" in df.columns:  # a probability mass in (0, 1]
        k = pl.col("kept_mass")
        bad = k.is_null() | (k.is_not_null() & ~((k > 0) & (k <= 1 + POSITIVE_TOLERANCE)))
        out.append(("kept_mass", "null, NaN or outside (0, 1]", bad))
    for c in _KEY_COLUMNS:  # a token without a step or sequence cannot be placed
        if c in df.columns:
            out.append((c, "null", pl.col(c).is_null()))
    if "loss_mask" in df.columns:  # neither in nor out of the loss: never taken as false
        out.append(
            ("loss_mask", "null (neither in nor out of the loss)", pl.col("loss_mask").is_null())
        )
    return out


INVALID_ROWS_FIX = (
    "Fix the export, or pass --drop-invalid to drop these rows (the count is reported on stderr)."
)


def quick_check(df: pl.DataFrame) -> tuple[bool, bool]:
    """(clean, positive): clean when every log-prob is finite and <= POSITIVE_TOLERANCE and
    every advantage finite (no nulls), so that `invalid_mask` would find nothing; positive
    when some log-prob is above 0 (to clip). One pass per column over the batch's buffers
    (numba when installed), instead of a polars expression per problem."""
    from .. import fast

    j = fast.compiled()
    clean = True
    positive = False
    for c in ("loss_mask", *_KEY_COLUMNS):
        if c in df.columns and df[c].null_count():
            return False, True
    if "kept_mass" in df.columns:
        k = df["kept_mass"]
        if k.null_count() or not bool(((k > 0) & (k <= 1 + POSITIVE_TOLERANCE)).all()):
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


def invalid_mask(df: pl.DataFrame, plan: Plan) -> pl.Series:
    """True on every row that one of `problems` flags."""
    probs = problems(df, plan)
    if not probs:
        return pl.Series([False] * df.height)
    return df.select(pl.any_horizontal([e.fill_null(True) for _, _, e in probs])).to_series()


def loss_filter(df: pl.DataFrame) -> pl.DataFrame:
    """Drop loss_mask == false rows; a null mask is kept for validation (problems) to count."""
    if "loss_mask" in df.columns:
        m = df["loss_mask"]
        return df.filter(m.fill_null(True)) if m.null_count() else df.filter(m)
    return df


def drop_unequal(raw: pl.DataFrame, plan: Plan) -> pl.DataFrame:
    """A raw batch of sequence rows without those whose list columns differ in length."""
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
    Used by inspect and convert (a sweep does not pay for it).

    On the numba backend a batch's runs come from one kernel pass (`_run_arrays`,
    checks_jit.seq_runs) and wait as int64 arrays until `_merge` frames them: no polars
    call per batch (building five small Series costs little alone, but inside a read that
    keeps polars' threads busy each one waits for them). The numpy `_runs` and polars'
    group_by remain the reference and the numpy backend's path; the table is the same."""

    KEYS = ("step", "sample_id", "position")
    _NAMES = ("step", "sample_id", "n", "lo", "hi")

    def __init__(self) -> None:
        self.table: pl.DataFrame | None = None
        self.parts: list[pl.DataFrame] = []
        self.runs: list[tuple[tuple, np.ndarray]] = []  # (dtypes, runs) from the kernel
        self.pending = 0

    @classmethod
    def possible(cls, columns: Sequence[str]) -> bool:
        return all(k in columns for k in ("sample_id", "position"))

    def add(self, df: pl.DataFrame) -> None:
        if df.height == 0 or not all(k in df.columns for k in self.KEYS):
            return
        got = self._run_arrays(df)
        if got is not None:
            self.runs.append(got)
            self.pending += got[1].shape[1]
        else:
            part = self._runs(df)
            if part is None:
                part = df.group_by("step", "sample_id").agg(
                    n=pl.len(), lo=pl.col("position").min(), hi=pl.col("position").max()
                )
            self.parts.append(part)
            self.pending += part.height
        if self.pending > (1 << 18) or len(self.parts) + len(self.runs) > 64:
            self._merge()

    @staticmethod
    def _run_arrays(df: pl.DataFrame) -> tuple[tuple, np.ndarray] | None:
        """`_runs` in one pass of checks_jit.seq_runs (the same runs and limit) as (the
        dtypes of `_runs`' columns, an int64 array of its 5 columns by run), or None on
        the numpy backend or where a key column is not an integer that int64 holds (not
        UInt64) without nulls, or the runs are short: `_runs`, then group_by, decide."""
        from .. import fast

        if fast.compiled() is None:
            return None
        cols = [df[k] for k in ("step", "sample_id", "position")]
        if not all(
            c.dtype.is_integer() and c.dtype != pl.UInt64 and c.null_count() == 0 for c in cols
        ):
            return None
        from . import checks_jit

        step, sid, pos = (np.ascontiguousarray(c.to_numpy(), dtype=np.int64) for c in cols)
        limit = 64 + df.height // 16
        out = np.empty((5, limit), np.int64)
        k = checks_jit.seq_runs(step, sid, pos, limit, *out)
        if k < 0:
            return None
        dtypes = (cols[0].dtype, cols[1].dtype, pl.UInt32(), cols[2].dtype, cols[2].dtype)
        return dtypes, out[:, :k].copy()

    @classmethod
    def _runs_frame(cls, dtypes: tuple, runs: np.ndarray) -> pl.DataFrame:
        """The (step, sample_id, n, lo, hi) frame of `_run_arrays`' output."""
        return pl.DataFrame(
            [pl.Series(nm, a, dtype=t) for nm, a, t in zip(cls._NAMES, runs, dtypes, strict=True)]
        )

    @classmethod
    def _runs_jit(cls, df: pl.DataFrame) -> pl.DataFrame | None:
        """`_run_arrays` as `_runs`' frame (None where it is None)."""
        got = cls._run_arrays(df)
        return None if got is None else cls._runs_frame(*got)

    @staticmethod
    def _runs(df: pl.DataFrame) -> pl.DataFrame | None:
        """The batch's (step, sample_id, n, lo, hi) per run of rows of one sequence, in
        numpy (a sequence's rows are usually one run; `_merge` adds up a sequence's runs),
        or None where a key column is not an integer without nulls, or the runs are short
        (polars' group_by is then faster)."""
        cols = [df[k] for k in ("step", "sample_id", "position")]
        if not all(c.dtype.is_integer() and c.null_count() == 0 for c in cols):
            return None
        step, sid, pos = (c.to_numpy() for c in cols)
        new = np.r_[True, (step[1:] != step[:-1]) | (sid[1:] != sid[:-1])]
        starts = np.flatnonzero(new)
        if starts.shape[0] > 64 + df.height // 16:
            return None
        return pl.DataFrame(
            {
                "step": pl.Series(step[starts], dtype=cols[0].dtype),
                "sample_id": pl.Series(sid[starts], dtype=cols[1].dtype),
                "n": pl.Series(np.diff(np.r_[starts, df.height]), dtype=pl.UInt32),
                "lo": pl.Series(np.minimum.reduceat(pos, starts), dtype=cols[2].dtype),
                "hi": pl.Series(np.maximum.reduceat(pos, starts), dtype=cols[2].dtype),
            }
        )

    def _merge(self) -> None:
        if not self.parts and not self.runs:
            return
        by_dtypes: dict[tuple, list[np.ndarray]] = {}
        for dtypes, runs in self.runs:
            by_dtypes.setdefault(dtypes, []).append(runs)
        kernel = [self._runs_frame(d, np.concatenate(r, axis=1)) for d, r in by_dtypes.items()]
        frames = ([self.table] if self.table is not None else []) + self.parts + kernel
        both = pl.concat(frames, how="vertical_relaxed")
        self.table = both.group_by("step", "sample_id").agg(
            n=pl.col("n").sum(), lo=pl.col("lo").min(), hi=pl.col("hi").max()
        )
        self.parts, self.runs, self.pending = [], [], 0

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
