"""Framework JSON lines: one record per sample (or packed sequence) with per-token arrays.

Design
------
prime-rl's token export and NeMo-RL's train data are both JSON lines whose records hold
per-token arrays under the framework's own keys. A `RecordFormat` says which keys feed which
canonical column (`arrays`), which keys a record must have, the per-record scalars read, the
per-token arrays read only for the loss mask (`extras`: prime-rl's weight streams) and the
run's own decisions (`checks`: prime-rl's is_masked). What differs between the frameworks is
a few hooks the subclasses fill (prime_rl.PrimeExport, nemo_rl.NemoRL): how a record opens
(NeMo-RL wraps every field in a one-element list), what a probe adds (columns, warnings), how
records are trimmed before exploding (NeMo-RL's `input_lengths`), the token columns built
from the exploded arrays (step, sample_id, position, loss_mask), and a check over the whole
file (NeMo-RL's placeholder trainer log-probs).

The shared path: `probe_records` reads the first record (the schema to parse with, the
columns delivered); `read_records` parses each block of lines (jsonl.parse_block), drops
weight streams that are null in every record of a block (prime-rl writes `[null] * n` for a
default stream: such a block costs ~6% over one without the streams), checks each record's structure
(required keys present, arrays of one length: a bad record names its line, or is skipped and
counted with --drop-invalid), explodes the arrays into token rows with canonical names and
projects them to the columns wanted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from ...errors import DataError
from .base import CANON_TYPES, F64, FRAMEWORK_BASE, I64, LOGGED, Drops, Probe, estimate_rows
from .jsonl import blocks, first_record, mask_dtype, parse_block


@dataclass(frozen=True)
class RecordFormat:
    """A JSON-lines framework format: which keys feed which canonical column, and the hooks
    where one framework's layout differs from the others'."""

    name: str
    arrays: dict[str, str]  # per-token array key -> canonical column
    required: tuple[str, ...]  # keys a record must have
    scalars: dict[str, pl.DataType]  # per-record keys read (dtype)
    hint: str  # how to turn the export on, for error messages
    # per-token arrays read for the loss mask only (never a column): key -> inner dtype
    extras: dict[str, pl.DataType] = field(default_factory=dict)
    # per-token keys of the run's own decisions, read by inspect.prime_check only
    checks: dict[str, pl.DataType] = field(default_factory=dict)

    def opened(self, raw: dict) -> tuple[dict, bool]:
        """A file's first record as its fields are probed, and whether the file's layout
        wraps each field (then `file_schema` and `unwrap` open it)."""
        return raw, False

    def probed(
        self,
        path: Path,
        line: int,
        rec: dict,
        wrapped: bool,
        schema: dict[str, pl.DataType],
        columns: dict[str, bool],
    ) -> tuple[dict[str, pl.DataType], list[str]]:
        """The schema the reader parses with, and warnings; may add to `columns`."""
        return schema, []

    def file_schema(
        self, path: Path, schema: dict[str, pl.DataType], drop: bool
    ) -> tuple[dict[str, pl.DataType], bool]:
        """The schema to parse this file's lines with, and whether its fields are wrapped."""
        return schema, False

    def unwrap(
        self, df: pl.DataFrame, lines: list[int], ordinals: list[int], drops: Drops
    ) -> tuple[pl.DataFrame, list[int], list[int]]:
        """The records of a wrapped file, opened (only called when `file_schema` says so)."""
        return df, lines, ordinals

    def trim(self, rec: pl.DataFrame, arrays: list[str], drops: Drops) -> pl.DataFrame:
        """Records whose arrays are cut to the tokens they hold, before exploding."""
        return rec

    def token_columns(self, cols: list[str], lit_step: pl.Expr) -> list[pl.Expr]:
        """The canonical columns built from an exploded record's keys (`_idx`: the token's
        index in its record, `_rec`: the record's in the file): step, sample_id, loss_mask,
        position, ..."""
        raise NotImplementedError

    def watch(self, path: Path):
        """None, or a check over the file's token frames: `add(frame)` for each, then
        `done()` (which may raise)."""
        return None


def _keys_error(path: Path, where: str, spec: RecordFormat, found) -> DataError:
    optional = [k for k in [*spec.arrays, *spec.scalars] if k not in spec.required]
    return DataError(
        f"{path}, {where}: not a {spec.name} record: required key(s) "
        f"{', '.join(k for k in spec.required if k not in found)} missing. Keys found: "
        f"{', '.join(sorted(found)) or 'none'}. Keys expected: {', '.join(spec.required)} "
        f"(optional: {', '.join(optional)}). {spec.hint}; pass --format to read the file as "
        "another format."
    )


def probe_records(spec: RecordFormat, path: Path, drop: bool) -> Probe | None:
    """Columns a framework JSON-lines file delivers, from its first record (None: empty)."""
    first = first_record(path, drop)
    if first is None:
        return None
    raw, line, nbytes = first
    missing = [k for k in spec.required if k not in raw]
    if missing:
        raise _keys_error(path, f"line {line}", spec, raw)
    rec, wrapped = spec.opened(raw)
    schema: dict[str, pl.DataType] = {}
    columns = dict.fromkeys(FRAMEWORK_BASE, False)
    for key, canon in spec.arrays.items():
        if key not in rec:
            continue
        v = rec[key]
        if canon == "loss_mask":
            schema[key] = pl.List(mask_dtype(v))
        elif (
            canon in ("advantage", "reward")
            and isinstance(v, int | float)
            and not isinstance(v, bool)
        ):
            schema[key] = CANON_TYPES[canon]  # a per-sample value (reward; some advantages)
        else:
            schema[key] = pl.List(CANON_TYPES[canon])
        columns[canon] = False
    for key, dtype in spec.scalars.items():
        if key in rec:
            schema[key] = dtype
    for key, dtype in spec.extras.items():
        if key in rec:
            schema[key] = pl.List(dtype)
    columns["loss_mask"] = False
    schema, warnings = spec.probed(path, line, rec, wrapped, schema, columns)
    ref = rec[spec.required[0]]
    tokens = len(ref) if isinstance(ref, list) else 1
    return Probe(
        columns=columns, schema=schema, rows=estimate_rows(path, tokens, nbytes), warnings=warnings
    )


def read_records(
    spec: RecordFormat,
    path: Path,
    file_step: int | None,
    schema: dict[str, pl.DataType],
    wanted: set[str] | None,
    drop: bool,
    report,
    block_bytes: int,
) -> Iterator[pl.DataFrame]:
    """Framework JSON lines -> canonical token frames, one per block."""
    drops = Drops(path, drop, report)
    schema, wrapped = spec.file_schema(path, schema, drop)
    watch = spec.watch(path)
    rec_base = 0
    for block, first_line in blocks(path, block_bytes):
        df, lines, ordinals, n = parse_block(block, first_line, schema, drops)
        if df.height and wrapped:
            df, lines, ordinals = spec.unwrap(df, lines, ordinals, drops)
        if df.height and spec.extras:
            df = _drop_null_streams(df, spec)
        if df.height:
            rec = df.with_columns(
                _line=pl.Series(lines, dtype=I64),
                _rec=pl.Series(ordinals, dtype=I64) + rec_base,
            )
            out = _explode(spec, rec, file_step, drops)
            if watch is not None and out.height:
                watch.add(out)
            if out.height:
                if wanted is not None:
                    keep = wanted | {"step", "logged_is_masked", "logged_mismatch_kl"}
                    out = out.select([c for c in out.columns if c in keep])
                yield out
        rec_base += n
    if watch is not None:
        watch.done()


def _drop_null_streams(df: pl.DataFrame, spec: RecordFormat) -> pl.DataFrame:
    """Weight streams that are null in every record of a block (prime-rl writes `[null] * n`
    for a default stream, the common case) mean their default: not exploded at all."""
    keys = [k for k in spec.extras if k in df.columns]
    if not keys:
        return df
    counts = df.select([pl.col(k).list.drop_nulls().list.len().sum() for k in keys]).row(0)
    return df.drop([k for k, n in zip(keys, counts, strict=True) if not n])


def _explode(
    spec: RecordFormat, rec: pl.DataFrame, file_step: int | None, drops: Drops
) -> pl.DataFrame:
    """Records (one row each, list columns) -> token rows with canonical names."""
    keys = [*spec.arrays, *spec.extras, *spec.checks]
    arrays = [k for k in keys if k in rec.columns and isinstance(rec.schema[k], pl.List)]
    ref = spec.required[0]
    # structural checks: required keys present, arrays of one length
    missing = pl.any_horizontal([pl.col(k).is_null() for k in spec.required if k in rec.columns])
    lens = {k: pl.col(k).list.len() for k in arrays}
    unequal = pl.any_horizontal(
        [(lens[k] != lens[ref]).fill_null(False) for k in arrays if k != ref] or [pl.lit(False)]
    )
    checks = rec.select(
        _line=pl.col("_line"),
        missing=missing.fill_null(True),
        unequal=unequal,
        **{f"_len_{k}": lens[k] for k in arrays},
    )
    bad = checks.filter(pl.col("missing") | pl.col("unequal"))
    for row in bad.iter_rows(named=True):
        where = f"line {row['_line']}"
        if row["missing"]:
            absent = [k for k in spec.required if row.get(f"_len_{k}") is None]
            drops.bad(
                where,
                "required keys missing",
                f"{spec.name} record without {', '.join(absent)} (null or absent). Keys "
                f"expected: {', '.join(spec.required)}",
            )
        else:
            sizes = ", ".join(
                f"{k} {row[f'_len_{k}']}" for k in arrays if row[f"_len_{k}"] is not None
            )
            drops.bad(
                where,
                "arrays of unequal length",
                f"per-token arrays of unequal length ({sizes}), so tokens cannot be aligned",
            )
    if bad.height:
        rec = rec.filter(~(checks["missing"] | checks["unequal"]))
    rec = spec.trim(rec, arrays, drops)
    rec = rec.filter(pl.col(ref).list.len() > 0)
    if rec.height == 0:
        return pl.DataFrame(schema={c: CANON_TYPES[c] for c in FRAMEWORK_BASE})
    # an optional array a record leaves out (or writes as null) is null on each of its tokens:
    # exploding a null list beside full ones would be a polars ShapeError (issue 29)
    n = pl.col(ref).list.len()
    rec = rec.with_columns(
        [
            pl.when(pl.col(k).is_null())
            .then(pl.lit(None, dtype=rec.schema[k].inner).repeat_by(n))
            .otherwise(pl.col(k))
            .alias(k)
            for k in arrays
            if k not in spec.required
        ]
    )
    rec = rec.with_columns(_idx=pl.int_ranges(0, pl.col(ref).list.len(), dtype=I64))
    tok = rec.explode([*arrays, "_idx"])
    cols = tok.columns
    exprs: list[pl.Expr] = []
    for key, canon in spec.arrays.items():
        if key not in cols or canon == "loss_mask":
            continue
        exprs.append(pl.col(key).cast(CANON_TYPES[canon]).alias(canon))
    lit_step = pl.lit(file_step if file_step is not None else 0, dtype=I64)
    out = tok.select(exprs + spec.token_columns(cols, lit_step))
    order = [c for c in (*CANON_TYPES, *LOGGED) if c in out.columns]
    return out.select(order)


def as_bool(key: str) -> pl.Expr:
    """A mask key (booleans, or 0/1 numbers) as a boolean expression."""
    return pl.col(key).cast(F64) != 0
