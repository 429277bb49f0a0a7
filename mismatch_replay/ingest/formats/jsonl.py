"""JSON lines: the block reader every JSON-lines format shares, and the plain `jsonl` format.

Design
------
JSON lines are read in blocks of whole lines (`blocks`; `ReadOptions.block_bytes`, ~48 MB
for the default 1M-row batch: memory is bounded by the block, never by the file or the
tree) and parsed by polars' NDJSON reader with a fixed schema, ~70 MB/s. A block it rejects
(a truncated line, `NaN`, `1e400`, a value of the wrong type) is re-parsed line by line with
the standard library, ~4x slower, which names the offending line (`parse_block`): the error
gives file and line, or with `--drop-invalid` the record is skipped and counted
(`ReadReport.dropped`, column `records: <why>`). `json` reads `NaN`, `Infinity` and `1e400`
(-> inf), so such values reach the value checks, which report them per column with counts.

The plain format (`jsonl`: any other `.jsonl` / `.ndjson`, e.g. a verl-style dump of the
canonical rows) keeps the file's own key names: one frame of raw rows per block, which then
goes through the same alias / `--map` / list-explode path as Parquet (token rows, or sequence
rows of lists). `probe_jsonl` takes the schema from the first record, with the dtype of each
known canonical role fixed (`_ROLE_TYPES`: a log-prob written as `0` is still a float).
Plain JSONL token rows read at ~0.2M tokens/s on 2 shared cores. The framework JSON-lines
formats (records.py) parse their blocks with the same `parse_block`.

Hostile input (issue 37): a file is opened only when `os.stat` says it is a regular file (a
FIFO would block, `/dev/zero` never ends: `base.open_local`), and one line is at most
`safe_read.LINE_CAP` (256 MB; a prime-rl record of a 128k-token sequence is ~25 MB), so a
file without newlines is refused at the cap instead of read into memory whole. A line nested
deeper than the standard library's parser follows (RecursionError) is a bad record like any
line that is not JSON (polars refuses such a block first: its depth limit is 128).
"""

from __future__ import annotations

import io as _bytesio
import json
import math
from collections.abc import Iterator
from pathlib import Path

import polars as pl

from ...errors import DataError
from ..safe_read import line_cap, line_too_long
from .base import BOOL, F64, I64, STR, Drops, Probe, estimate_rows, open_local


def loads(raw: bytes):
    """One JSON line -> its value; ValueError (with the reason) when it cannot be."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested deeper than the JSON parser follows") from None


def blocks(path: Path, block_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(block of whole lines, number of its first line); the last line may lack a newline.
    A line that runs past `safe_read.line_cap()` bytes without a newline is refused (a file
    without newlines): the pieces of a line in progress are kept in a list, so memory is the
    cap plus one block, never a copy per read."""
    cap = line_cap()
    with open_local(path) as f:
        line = 1
        parts: list[bytes] = []  # the line in progress, no newline yet
        pending = 0
        while True:
            try:
                data = f.read(block_bytes)
            except OSError as exc:
                raise DataError(
                    f"{path}: reading failed part-way ({exc}). The file may have been removed "
                    "or truncated while being read; re-run when the trainer is done with it."
                ) from exc
            if not data:
                tail = b"".join(parts)
                if tail.strip():
                    yield tail, line
                return
            cut = data.rfind(b"\n")
            if cut < 0:
                pending += len(data)
                if pending > cap:
                    raise line_too_long(path, line, cap)
                parts.append(data)
                continue
            block = b"".join([*parts, data[: cut + 1]]) if parts else data[: cut + 1]
            rest = data[cut + 1 :]
            parts, pending = ([rest] if rest else []), len(rest)
            if pending > cap:
                raise line_too_long(path, line + block.count(b"\n"), cap)
            yield block, line
            line += block.count(b"\n")


def record_lines(block: bytes, first_line: int) -> list[int]:
    """The line numbers of a block's non-empty lines (its records)."""
    return [first_line + i for i, raw in enumerate(block.split(b"\n")) if raw.strip()]


def _lines(block: bytes) -> list[bytes]:
    return [r for r in block.split(b"\n") if r.strip()]


def json_lines(path: Path, drops: Drops) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) of every non-empty line of a file (prime-rl's trace
    files), read in 16 MB blocks; a line that is not JSON is a bad record (`drops`)."""
    for block, first_line in blocks(path, 16 << 20):
        for n, raw in zip(record_lines(block, first_line), _lines(block), strict=True):
            try:
                obj = loads(raw)
            except ValueError as exc:
                drops.bad(f"line {n}", "not valid JSON", f"not valid JSON ({exc})")
                continue
            yield n, obj


def first_record(path: Path, drop: bool) -> tuple[dict, int, int] | None:
    """(first parseable JSON object, its line number, its size in bytes); None: no record.
    Reads line by line, each at most `safe_read.line_cap()` bytes."""
    drops = Drops(path, drop, report=None)  # the read counts drops; the probe only peeks
    cap = line_cap()
    with open_local(path) as f:
        n = 0
        while True:
            raw = f.readline(cap + 1)
            if not raw:
                return None
            n += 1
            if len(raw) > cap and not raw.endswith(b"\n"):
                raise line_too_long(path, n, cap)
            if not raw.strip():
                continue
            try:
                obj = loads(raw)
            except ValueError as exc:
                drops.bad(f"line {n}", "not valid JSON", f"not valid JSON ({exc})")
                continue
            if not isinstance(obj, dict):
                drops.bad(f"line {n}", "not a JSON object", "not a JSON object")
                continue
            return obj, n, len(raw)


def value_dtype(v) -> pl.DataType | None:
    """The dtype of one JSON value (None for null)."""
    if isinstance(v, bool):
        return BOOL
    if isinstance(v, int):
        return I64
    if isinstance(v, float):
        return F64
    if isinstance(v, str):
        return STR
    return None


def list_dtype(values: list) -> pl.DataType:
    """The dtype that holds every value of a JSON array (strings when they mix)."""
    kinds = {value_dtype(x) for x in values} - {None}
    if kinds <= {BOOL}:
        return BOOL
    if kinds <= {I64}:
        return I64
    if kinds <= {I64, F64}:
        return F64
    return STR


def mask_dtype(v) -> pl.DataType:
    """Masks are bools in some exports and 0/1 numbers in others."""
    inner = list_dtype(v) if isinstance(v, list) else (value_dtype(v) or BOOL)
    return BOOL if inner == BOOL else F64


# ----------------------------------------------------------------------------- plain JSONL


# Canonical roles with a fixed dtype in plain JSONL; the rest is inferred from the values.
_ROLE_TYPES = {
    "trainer_logprob": F64,
    "inference_logprob": F64,
    "old_logprob": F64,
    "advantage": F64,
    "entropy": F64,
    "step": I64,
    "position": I64,
    "token_id": I64,
    "env": STR,
}


def probe_jsonl(path: Path, drop: bool, roles: dict[str, str]) -> Probe | None:
    """Columns of a plain JSONL file from its first record. `roles`: key -> canonical role
    (for the keys that are known aliases), which fixes the dtype of float columns."""
    first = first_record(path, drop)
    if first is None:
        return None
    rec, _line, nbytes = first
    schema: dict[str, pl.DataType] = {}
    columns: dict[str, bool] = {}
    tokens = 1
    for key, v in rec.items():
        is_list = isinstance(v, list)
        role = roles.get(key)
        if role == "loss_mask":
            inner = mask_dtype(v)
        elif role in _ROLE_TYPES:
            inner = _ROLE_TYPES[role]
        elif is_list:
            inner = list_dtype(v)
        elif isinstance(v, dict):
            continue  # nested objects are never a token column
        else:
            inner = value_dtype(v) or STR
        if role == "sample_id" and inner == F64:
            inner = I64
        schema[key] = pl.List(inner) if is_list else inner
        columns[key] = is_list
        if is_list:
            tokens = max(tokens, len(v))
    return Probe(columns=columns, schema=schema, rows=estimate_rows(path, tokens, nbytes))


def _coerce(v, dtype: pl.DataType):
    """One JSON value -> the Python value of dtype (slow path); ValueError when impossible."""
    if v is None:
        return None
    if isinstance(dtype, pl.List):
        if not isinstance(v, list):
            raise ValueError(f"expected an array, found {type(v).__name__} {_short(v)}")
        inner = dtype.inner
        return [_coerce(x, inner) for x in v]
    if dtype == F64:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"expected a number, found {_short(v)}")
        return float(v)
    if dtype == I64:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"expected an integer, found {_short(v)}")
        if isinstance(v, float):
            if not v.is_integer():
                raise ValueError(f"expected an integer, found {_short(v)}")
            v = int(v)
        return v
    if dtype == BOOL:
        if isinstance(v, bool):
            return v
        if isinstance(v, int | float):
            return v != 0
        raise ValueError(f"expected true/false or 0/1, found {_short(v)}")
    if isinstance(v, list | dict):
        raise ValueError(f"expected a scalar, found {type(v).__name__}")
    return str(v)


def _short(v) -> str:
    try:
        s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    except (RecursionError, ValueError, TypeError):  # too deep to show
        return f"a {type(v).__name__}"
    return s if len(s) <= 40 else s[:37] + "..."


def parse_block(
    block: bytes, first_line: int, schema: dict[str, pl.DataType], drops: Drops
) -> tuple[pl.DataFrame, list[int], list[int], int]:
    """Parse a block: (one row per good record, their lines, their ordinals among the block's
    records, number of records incl. skipped ones).

    Fast path: polars' NDJSON reader. A block it rejects is re-read line by line.
    """
    lines = record_lines(block, first_line)
    if schema:
        try:
            df = pl.read_ndjson(_bytesio.BytesIO(block), schema=schema)
        except Exception:  # any rejection: the slow path names the line
            df = None
        if df is not None and df.height == len(lines):
            return df, lines, list(range(len(lines))), len(lines)
    rows: list[dict] = []
    kept: list[int] = []
    ordinals: list[int] = []
    records = (r for r in block.split(b"\n") if r.strip())
    for k, (raw, line) in enumerate(zip(records, lines, strict=True)):
        try:
            obj = loads(raw)
        except ValueError as exc:
            drops.bad(f"line {line}", "not valid JSON", f"not valid JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            drops.bad(f"line {line}", "not a JSON object", f"not a JSON object: {_short(obj)}")
            continue
        row = {}
        try:
            for key, dtype in schema.items():
                row[key] = _coerce(obj.get(key), dtype)
        except ValueError as exc:
            drops.bad(f"line {line}", "values of the wrong type", f"key '{key}': {exc}")
            continue
        rows.append(row)
        kept.append(line)
        ordinals.append(k)
    return pl.DataFrame(rows, schema=schema, orient="row"), kept, ordinals, len(lines)


def read_jsonl(
    path: Path,
    schema: dict[str, pl.DataType],
    drop: bool,
    report,
    block_bytes: int,
) -> Iterator[pl.DataFrame]:
    """Plain JSONL: one frame of raw rows (the file's own names) per block."""
    drops = Drops(path, drop, report)
    for block, first_line in blocks(path, block_bytes):
        df, _lines, _ords, _n = parse_block(block, first_line, schema, drops)
        if df.height:
            yield df
