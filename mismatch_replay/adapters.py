"""Framework adapters: the token logs trainers write on disk -> canonical frames, streamed.

Design
------
`io.py` owns resolution, planning and validation; this module knows the formats. Each reader
turns one file into a stream of polars frames whose columns are canonical names (for the
framework formats) or the file's own names (plain JSONL, which then goes through the same
alias / `--map` / list-explode path as Parquet). A frame holds every token of the records it
covers, prompt tokens included: io applies `loss_mask` and the value checks exactly as for
Parquet, so a NaN in a prompt token is ignored and a NaN in a loss token is reported.

| format | what is read | detected by |
|---|---|---|
| `prime-rl` | one object per sequence, per-token arrays | `step_<n>/rank_<r>.jsonl` |
| `nemo-rl` | one object per sample, per-token arrays | `train_data_step<N>.jsonl` |
| `slime` | `torch.save` dumps, `format_version` 2, `samples` | the `.pt` suffix |
| `jsonl` | canonical rows (token rows, or sequence rows of lists) | other `.jsonl` / `.ndjson` |
| `parquet` | read in io.py | `.parquet` / `.pq` |

JSON lines are read in blocks of whole lines (`block_bytes`, ~48 MB for the default 1M-row
batch: memory is bounded by the block, never by the file or the tree) and parsed by polars'
NDJSON reader with a fixed schema, ~70 MB/s. A block it rejects (a truncated line, `NaN`,
`1e400`, a value of the wrong type) is re-parsed line by line with the standard library, ~4x
slower, which names the offending line: the error gives file and line, or with
`--drop-invalid` the record is skipped and counted (`ReadReport.dropped`, column
`records: <why>`). `json` reads `NaN`, `Infinity` and `1e400` (-> inf), so such values reach
the value checks, which report them per column with counts.

Per-format conventions (RULES.md, "On-disk token logs in the wild"):
- prime-rl: index 0 of every record is a pad (no prediction for the first token), so its
  `loss_mask` is forced false. `sample_id = rank * 1_000_000 + export_sequence_idx` (unique
  within a step across ranks, and readable: 2000017 is rank 2, sequence 17). The step is the
  record's `step`, else the `step_<n>` directory.
- nemo-rl: arrays cover prompt + response, padded to the batch's longest sample; they are cut
  to `input_lengths`. `loss_mask = token_loss_mask and sample_loss_mask`. The step comes from
  the file name, `sample_id` is the record's index in the file (blank lines not counted).
- slime: arrays are response-only; `position = len(tokens) - response_length + i`, the step is
  `rollout_id`, `sample_id` the index in `samples`. Loaded with
  `torch.load(weights_only=True, mmap=True)`: nothing but tensors, lists, dicts and numbers is
  ever unpickled, and tensors are paged in on use. torch is imported only here, on demand.

Throughput, reading 1M tokens on 2 cores: prime-rl 0.4M tokens/s (~150 bytes of JSON a
token), NeMo-RL 0.55M tokens/s, plain JSONL token rows 0.2M tokens/s, slime 0.16M tokens/s
(torch's safe unpickler, ~0.3 ms a tensor, dominates when samples are short).
"""

from __future__ import annotations

import io as _bytesio
import json
import math
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from .errors import DataError

FORMATS = ("parquet", "jsonl", "prime-rl", "nemo-rl", "slime")
FRAMEWORKS = ("prime-rl", "nemo-rl", "slime")
JSON_FORMATS = ("jsonl", "prime-rl", "nemo-rl")
SUFFIXES = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".pt": "slime",
}
RECORDS = "records: "  # ReadReport.dropped column prefix for skipped records
PRIME_SEQ_STRIDE = 1_000_000  # prime-rl sample_id = rank * stride + export_sequence_idx

_PRIME_FILE = re.compile(r"rank_(\d+)\.jsonl")
_PRIME_DIR = re.compile(r"step_(\d+)")
_NEMO_FILE = re.compile(r"train_data_step(\d+)\.jsonl")
_ANY_STEP = re.compile(r"step[_=-]?(\d+)")
_HIVE_STEP = re.compile(r"step=(-?\d+)")

F64, I64, BOOL, STR = pl.Float64, pl.Int64, pl.Boolean, pl.String

_FIX_RECORD = (
    "Fix or remove the record, or pass --drop-invalid to skip such records (they are counted "
    "on stderr)."
)


# ----------------------------------------------------------------------------- detection


def detect(path: Path) -> str | None:
    """The format a file's path says it holds (None: not a token log we know)."""
    if _PRIME_FILE.fullmatch(path.name) and _PRIME_DIR.fullmatch(path.parent.name):
        return "prime-rl"
    if _NEMO_FILE.fullmatch(path.name):
        return "nemo-rl"
    return SUFFIXES.get(path.suffix.lower())


def sniff(path: Path) -> str:
    """The format of a file with an unknown suffix, from its first bytes (default parquet)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return "parquet"  # the Parquet reader reports the problem
    if head.startswith(b"PK"):  # torch.save's zip container
        return "slime"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    return "parquet"


def prime_step_dir(path: Path) -> Path | None:
    """The `step_<n>` directory of a prime-rl rank file (None when not in one)."""
    return path.parent if _PRIME_DIR.fullmatch(path.parent.name) else None


def path_step(path: Path, fmt: str) -> int | None:
    """The step a file's path implies: hive `step=N`, prime-rl `step_N`, nemo `..._stepN`."""
    if fmt == "parquet":
        for part in reversed(path.parent.parts):
            m = _HIVE_STEP.fullmatch(part)
            if m:
                return int(m.group(1))
        return None
    if fmt == "prime-rl":
        m = _PRIME_DIR.fullmatch(path.parent.name)
        return int(m.group(1)) if m else None
    if fmt == "nemo-rl":
        m = _NEMO_FILE.fullmatch(path.name) or _ANY_STEP.search(path.stem)
        return int(m.group(1)) if m else None
    return None


def natural_key(path: Path) -> tuple:
    """Sort key with digit runs compared as numbers (step_2 before step_10)."""
    return tuple(
        (0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(path)) if t
    )


# ----------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class _Spec:
    """A JSON-lines framework format: which keys feed which canonical column."""

    name: str
    arrays: dict[str, str]  # per-token array key -> canonical column
    required: tuple[str, ...]  # keys a record must have
    scalars: dict[str, pl.DataType]  # per-record keys read (dtype)
    hint: str  # how to turn the export on, for error messages


PRIME = _Spec(
    name="prime-rl",
    arrays={
        "trainer_logprobs": "trainer_logprob",
        "inference_logprobs": "inference_logprob",
        "loss_mask": "loss_mask",
        "advantages": "advantage",
        "entropy": "entropy",
        "token_ids": "token_id",
        "position_ids": "position",
    },
    required=("trainer_logprobs", "inference_logprobs", "loss_mask"),
    scalars={"step": I64, "rank": I64, "export_sequence_idx": I64, "env_name": STR},
    hint="prime-rl writes these with trainer.enable_token_export",
)
NEMO = _Spec(
    name="nemo-rl",
    arrays={
        "prev_logprobs": "trainer_logprob",
        "generation_logprobs": "inference_logprob",
        "token_loss_mask": "loss_mask",
        "advantages": "advantage",
        "token_ids": "token_id",
    },
    required=("prev_logprobs", "generation_logprobs"),
    scalars={"input_lengths": I64, "sample_loss_mask": F64},
    hint="NeMo-RL's GRPO loop writes train_data_step<N>.jsonl into its log directory",
)
SPECS = {"prime-rl": PRIME, "nemo-rl": NEMO}

# Canonical columns each framework format delivers (beyond what a record's keys add).
_FRAMEWORK_BASE = ("step", "sample_id", "position", "trainer_logprob", "inference_logprob")
_CANON_TYPES: dict[str, pl.DataType] = {
    "step": I64,
    "sample_id": I64,
    "position": I64,
    "trainer_logprob": F64,
    "inference_logprob": F64,
    "old_logprob": F64,
    "advantage": F64,
    "entropy": F64,
    "loss_mask": BOOL,
    "env": STR,
    "token_id": I64,
}


@dataclass
class Probe:
    """What the first record of a file says: the columns a read will deliver."""

    columns: dict[str, bool]  # delivered column (source name) -> is a list column
    schema: dict[str, pl.DataType]  # JSON key -> dtype the reader parses it as
    rows: int  # estimated rows (tokens) in the file, for progress
    warnings: list[str] = field(default_factory=list)


class _Drops:
    """Record-level problems: raise (naming file and line) or skip and count."""

    def __init__(self, path: Path, drop: bool, report) -> None:
        self.path, self.drop, self.report = path, drop, report

    def bad(self, where: str, why: str, detail: str) -> None:
        if not self.drop:
            raise DataError(f"{self.path}, {where}: {detail}. {_FIX_RECORD}")
        if self.report is not None:
            key = (str(self.path), RECORDS + why)
            self.report.dropped[key] = self.report.dropped.get(key, 0) + 1


# ----------------------------------------------------------------------------- JSON lines


def _open(path: Path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing or rotating its logs? Wait for the step to "
            "finish, or leave the file out."
        ) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot open it ({exc}). Check permissions.") from exc


def _blocks(path: Path, block_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(block of whole lines, number of its first line); the last line may lack a newline."""
    with _open(path) as f:
        line = 1
        tail = b""
        while True:
            try:
                data = f.read(block_bytes)
            except OSError as exc:
                raise DataError(
                    f"{path}: reading failed part-way ({exc}). The file may have been removed "
                    "or truncated while being read; re-run when the trainer is done with it."
                ) from exc
            if not data:
                if tail.strip():
                    yield tail, line
                return
            data = tail + data
            cut = data.rfind(b"\n")
            if cut < 0:
                tail = data
                continue
            block, tail = data[: cut + 1], data[cut + 1 :]
            yield block, line
            line += block.count(b"\n")


def _first_record(path: Path, drop: bool) -> tuple[dict, int, int] | None:
    """(first parseable JSON object, its line number, its size in bytes); None: no record."""
    drops = _Drops(path, drop, report=None)  # the read counts drops; the probe only peeks
    with _open(path) as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                drops.bad(f"line {n}", "not valid JSON", f"not valid JSON ({exc})")
                continue
            if not isinstance(obj, dict):
                drops.bad(f"line {n}", "not a JSON object", "not a JSON object")
                continue
            return obj, n, len(raw)
    return None


def _kind(v) -> pl.DataType | None:
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


def _list_kind(values: list) -> pl.DataType:
    kinds = {_kind(x) for x in values} - {None}
    if kinds <= {BOOL}:
        return BOOL
    if kinds <= {I64}:
        return I64
    if kinds <= {I64, F64}:
        return F64
    return STR


def _mask_dtype(v) -> pl.DataType:
    """Masks are bools in some exports and 0/1 numbers in others."""
    inner = _list_kind(v) if isinstance(v, list) else (_kind(v) or BOOL)
    return BOOL if inner == BOOL else F64


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _estimate(path: Path, tokens: int, nbytes: int) -> int:
    return int(tokens * _file_size(path) / max(nbytes, 1))


def _keys_error(path: Path, where: str, spec: _Spec, found) -> DataError:
    optional = [k for k in [*spec.arrays, *spec.scalars] if k not in spec.required]
    return DataError(
        f"{path}, {where}: not a {spec.name} record: required key(s) "
        f"{', '.join(k for k in spec.required if k not in found)} missing. Keys found: "
        f"{', '.join(sorted(found)) or 'none'}. Keys expected: {', '.join(spec.required)} "
        f"(optional: {', '.join(optional)}). {spec.hint}; pass --format to read the file as "
        "another format."
    )


def probe_framework(fmt: str, path: Path, drop: bool) -> Probe | None:
    """Columns a prime-rl / nemo-rl file delivers, from its first record (None: empty)."""
    spec = SPECS[fmt]
    first = _first_record(path, drop)
    if first is None:
        return None
    rec, line, nbytes = first
    missing = [k for k in spec.required if k not in rec]
    if missing:
        raise _keys_error(path, f"line {line}", spec, rec)
    schema: dict[str, pl.DataType] = {}
    columns = dict.fromkeys(_FRAMEWORK_BASE, False)
    for key, canon in spec.arrays.items():
        if key not in rec:
            continue
        v = rec[key]
        if canon == "loss_mask":
            schema[key] = pl.List(_mask_dtype(v))
        elif canon == "advantage" and isinstance(v, int | float) and not isinstance(v, bool):
            schema[key] = _CANON_TYPES[canon]  # per-sample advantage (some versions): broadcast
        else:
            schema[key] = pl.List(_CANON_TYPES[canon])
        columns[canon] = False
    for key, dtype in spec.scalars.items():
        if key in rec:
            schema[key] = dtype
    warnings = []
    if fmt == "prime-rl":
        columns["loss_mask"] = False
        if "env_name" in rec:
            columns["env"] = False
    if fmt == "nemo-rl":
        columns["loss_mask"] = False
        if "token_loss_mask" not in rec:
            warnings.append(
                f"{path}: no token_loss_mask in the records, so every token up to "
                "input_lengths counts, prompt tokens included. Log token_loss_mask (recent "
                "NeMo-RL versions do), or expect prompt tokens in the counts."
            )
        if "input_lengths" not in rec:
            warnings.append(
                f"{path}: no input_lengths in the records, so padding cannot be cut off; "
                "only token_loss_mask keeps it out of the counts."
            )
    ref = rec[spec.required[0]]
    tokens = len(ref) if isinstance(ref, list) else 1
    return Probe(
        columns=columns, schema=schema, rows=_estimate(path, tokens, nbytes), warnings=warnings
    )


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
    first = _first_record(path, drop)
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
            inner = _mask_dtype(v)
        elif role in _ROLE_TYPES:
            inner = _ROLE_TYPES[role]
        elif is_list:
            inner = _list_kind(v)
        elif isinstance(v, dict):
            continue  # nested objects are never a token column
        else:
            inner = _kind(v) or STR
        if role == "sample_id" and inner == F64:
            inner = I64
        schema[key] = pl.List(inner) if is_list else inner
        columns[key] = is_list
        if is_list:
            tokens = max(tokens, len(v))
    return Probe(columns=columns, schema=schema, rows=_estimate(path, tokens, nbytes))


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
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _record_lines(block: bytes, first_line: int) -> list[int]:
    return [first_line + i for i, raw in enumerate(block.split(b"\n")) if raw.strip()]


def _parse_block(
    block: bytes, first_line: int, schema: dict[str, pl.DataType], drops: _Drops
) -> tuple[pl.DataFrame, list[int], list[int], int]:
    """Parse a block: (one row per good record, their lines, their ordinals among the block's
    records, number of records incl. skipped ones).

    Fast path: polars' NDJSON reader. A block it rejects is re-read line by line.
    """
    lines = _record_lines(block, first_line)
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
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
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
    drops = _Drops(path, drop, report)
    for block, first_line in _blocks(path, block_bytes):
        df, _lines, _ords, _n = _parse_block(block, first_line, schema, drops)
        if df.height:
            yield df


def read_framework(
    fmt: str,
    path: Path,
    file_step: int | None,
    schema: dict[str, pl.DataType],
    wanted: set[str] | None,
    drop: bool,
    report,
    block_bytes: int,
) -> Iterator[pl.DataFrame]:
    """prime-rl / nemo-rl JSON lines -> canonical token frames, one per block."""
    spec = SPECS[fmt]
    drops = _Drops(path, drop, report)
    rec_base = 0
    for block, first_line in _blocks(path, block_bytes):
        df, lines, ordinals, n = _parse_block(block, first_line, schema, drops)
        if df.height:
            rec = df.with_columns(
                _line=pl.Series(lines, dtype=I64),
                _rec=pl.Series(ordinals, dtype=I64) + rec_base,
            )
            out = _explode(spec, rec, file_step, drops)
            if out.height:
                if wanted is not None:
                    out = out.select([c for c in out.columns if c in wanted or c == "step"])
                yield out
        rec_base += n


def _explode(spec: _Spec, rec: pl.DataFrame, file_step: int | None, drops: _Drops) -> pl.DataFrame:
    """Records (one row each, list columns) -> token rows with canonical names."""
    arrays = [k for k in spec.arrays if k in rec.columns and isinstance(rec.schema[k], pl.List)]
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
    if spec is NEMO and "input_lengths" in rec.columns:
        over = rec.filter(pl.col("input_lengths") > pl.col(ref).list.len())
        for row in over.select("_line", "input_lengths", n=pl.col(ref).list.len()).iter_rows():
            drops.bad(
                f"line {row[0]}",
                "input_lengths beyond the arrays",
                f"input_lengths {row[1]} is longer than the arrays ({row[2]} tokens)",
            )
        if over.height:
            rec = rec.filter(~(pl.col("input_lengths") > pl.col(ref).list.len()))
        n = pl.col("input_lengths").fill_null(pl.col(ref).list.len())
        rec = rec.with_columns([pl.col(k).list.head(n) for k in arrays])
    rec = rec.filter(pl.col(ref).list.len() > 0)
    if rec.height == 0:
        return pl.DataFrame(schema={c: _CANON_TYPES[c] for c in _FRAMEWORK_BASE})
    rec = rec.with_columns(_idx=pl.int_ranges(0, pl.col(ref).list.len(), dtype=I64))
    tok = rec.explode([*arrays, "_idx"])
    return _finish(spec, tok, file_step)


def _finish(spec: _Spec, tok: pl.DataFrame, file_step: int | None) -> pl.DataFrame:
    cols = tok.columns
    exprs: list[pl.Expr] = []
    for key, canon in spec.arrays.items():
        if key not in cols or canon == "loss_mask":
            continue
        exprs.append(pl.col(key).cast(_CANON_TYPES[canon]).alias(canon))
    lit_step = pl.lit(file_step if file_step is not None else 0, dtype=I64)
    if spec is PRIME:
        step = pl.col("step").fill_null(lit_step) if "step" in cols else lit_step
        rank = pl.col("rank").fill_null(0) if "rank" in cols else pl.lit(0, dtype=I64)
        seq = (
            pl.col("export_sequence_idx").fill_null(pl.col("_rec"))
            if "export_sequence_idx" in cols
            else pl.col("_rec")
        )
        mask = _as_bool("loss_mask") & (pl.col("_idx") != 0)  # index 0: the pad
        exprs += [
            step.alias("step"),
            (rank * PRIME_SEQ_STRIDE + seq).cast(I64).alias("sample_id"),
            mask.alias("loss_mask"),
        ]
        if "position_ids" not in cols:
            exprs.append(pl.col("_idx").alias("position"))
        if "env_name" in cols:
            exprs.append(pl.col("env_name").cast(STR).alias("env"))
    else:  # nemo-rl
        mask = _as_bool("token_loss_mask") if "token_loss_mask" in cols else pl.lit(True)
        if "sample_loss_mask" in cols:
            mask = mask & (pl.col("sample_loss_mask").fill_null(1.0) != 0)
        exprs += [
            lit_step.alias("step"),
            pl.col("_rec").alias("sample_id"),
            pl.col("_idx").alias("position"),
            mask.alias("loss_mask"),
        ]
    out = tok.select(exprs)
    order = [c for c in _CANON_TYPES if c in out.columns]
    return out.select(order)


def _as_bool(key: str) -> pl.Expr:
    return pl.col(key).cast(F64) != 0


# ----------------------------------------------------------------------------- slime


SLIME_TOP = ("format_version", "rollout_id", "samples")
SLIME_REQUIRED = ("log_probs", "rollout_log_probs")
SLIME_OPTIONAL = ("loss_masks", "advantages", "response_lengths", "tokens", "entropy")
_SLIME_HINT = (
    "slime writes train dumps with --save-debug-train-data PATH/{rollout_id}.pt (format_version 2)"
)


def _torch():
    try:
        import torch
    except ImportError:
        raise DataError(
            "reading slime .pt dumps needs torch, which is not installed: pip install "
            "torch==2.13.0 (the CPU build) or pip install 'mismatch-replay[torch]'. Or convert "
            "the dumps to Parquet where torch is installed (mismatch-replay convert)."
        ) from None
    return torch


def load_slime(path: Path) -> dict:
    """Load a slime dump safely (weights_only: tensors, lists, dicts, numbers; no code)."""
    torch = _torch()
    if not path.exists():
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing? Wait for it, or leave the file out."
        )
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"{path}: the file disappeared while being read.") from None
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling refused"
        raise DataError(
            f"{path}: the dump holds objects other than tensors, lists, dicts and numbers "
            f"({first[:200]}). mismatch-replay loads .pt files with weights_only=True and "
            "never unpickles arbitrary objects: re-save the samples as plain tensors/lists."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise DataError(
            f"{path}: cannot read it as a torch.save file ({str(exc)[:200]}). Is it complete? "
            f"{_SLIME_HINT}."
        ) from None
    if not isinstance(obj, dict) or "samples" not in obj or "rollout_id" not in obj:
        found = ", ".join(sorted(map(str, obj))) if isinstance(obj, dict) else type(obj).__name__
        old = (
            " (an older slime dump: rollout_data is format 1, not read)"
            if (isinstance(obj, dict) and "rollout_data" in obj)
            else ""
        )
        raise DataError(
            f"{path}: not a slime train dump{old}. Top-level keys found: {found}. Keys "
            f"expected: {', '.join(SLIME_TOP)} (samples: a list of dicts with "
            f"{', '.join(SLIME_REQUIRED)}, optional {', '.join(SLIME_OPTIONAL)}). "
            f"{_SLIME_HINT}; pass --format to read the file as another format."
        )
    version = obj.get("format_version", 2)
    if version != 2:
        raise DataError(
            f"{path}: slime dump format_version {version}; this reader knows format_version 2 "
            f"(keys {', '.join(SLIME_TOP)}). {_SLIME_HINT}."
        )
    if not isinstance(obj["samples"], list | tuple):
        raise DataError(
            f"{path}: 'samples' is a {type(obj['samples']).__name__}, expected a list of dicts "
            f"with {', '.join(SLIME_REQUIRED)}."
        )
    return obj


def _slime_rollout(path: Path, obj: dict) -> int:
    rid = obj["rollout_id"]
    try:
        return int(rid.item() if hasattr(rid, "item") else rid)
    except (TypeError, ValueError):
        raise DataError(
            f"{path}: rollout_id is {rid!r}, expected an integer (it becomes the step)."
        ) from None


def probe_slime(path: Path) -> Probe:
    obj = load_slime(path)
    columns = dict.fromkeys([*_FRAMEWORK_BASE, "loss_mask"], False)
    samples = obj["samples"]
    tokens = 0
    first = samples[0] if samples else {}
    if samples and not isinstance(first, dict):
        raise DataError(
            f"{path}: samples[0] is a {type(first).__name__}, expected a dict with "
            f"{', '.join(SLIME_REQUIRED)}."
        )
    missing = [k for k in SLIME_REQUIRED if k not in first]
    if samples and missing:
        raise DataError(
            f"{path}: samples[0] is not a slime train sample: key(s) {', '.join(missing)} "
            f"missing. Keys found: {', '.join(sorted(map(str, first)))}. Keys expected: "
            f"{', '.join(SLIME_REQUIRED)} (optional: {', '.join(SLIME_OPTIONAL)}). "
            f"{_SLIME_HINT}."
        )
    if "advantages" in first:
        columns["advantage"] = False
    if "entropy" in first:
        columns["entropy"] = False
    if "tokens" in first:
        columns["token_id"] = False
    for s in samples:
        if isinstance(s, dict) and "log_probs" in s:
            tokens += _length(s["log_probs"])
    return Probe(columns=columns, schema={}, rows=tokens)


def _length(v) -> int:
    try:
        return len(v)
    except TypeError:
        return 1


def _floats(v, n: int | None = None) -> np.ndarray:
    """A tensor, list or number -> float64 array (a number is broadcast to n)."""
    if hasattr(v, "detach"):
        import torch

        return v.detach().to(device="cpu", dtype=torch.float64).reshape(-1).numpy()
    if isinstance(v, list | tuple):  # a null in a list reads as NaN (tensors have no null)
        s = pl.Series(values=list(v), dtype=F64, strict=True)
        return s.fill_null(math.nan).to_numpy()
    if isinstance(v, int | float) and not isinstance(v, bool) and n is not None:
        return np.full(n, float(v))
    raise TypeError(f"expected a tensor or a list of numbers, found {type(v).__name__}")


def _ints(v) -> np.ndarray:
    if hasattr(v, "detach"):
        return v.detach().cpu().reshape(-1).long().numpy()
    return np.asarray(v, dtype=np.int64).reshape(-1)


def _scalar_int(v) -> int:
    return int(v.item() if hasattr(v, "item") else v)


def _slime_sample(
    i: int, s, step: int, want_tokens: bool, optional: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """One sample -> per-token arrays; raises ValueError naming what is wrong. `optional`:
    the optional keys samples[0] has, which every sample must have too."""
    if not isinstance(s, dict):
        raise ValueError(f"a {type(s).__name__}, expected a dict")
    missing = [k for k in (*SLIME_REQUIRED, *optional) if k not in s]
    if missing:
        raise ValueError(
            f"key(s) {', '.join(missing)} missing (keys found: "
            f"{', '.join(sorted(map(str, s)))}; expected: {', '.join(SLIME_REQUIRED)}, and "
            "the optional keys samples[0] has)"
        )
    lp = _floats(s["log_probs"])
    n = len(lp)
    rlen = s.get("response_lengths", s.get("response_length"))
    if rlen is not None:
        rlen = _scalar_int(rlen)
    cols = {"trainer_logprob": lp, "inference_logprob": _floats(s["rollout_log_probs"])}
    if "loss_masks" in s:
        cols["loss_mask"] = _floats(s["loss_masks"])
    if "advantages" in s:
        cols["advantage"] = _floats(s["advantages"], n)
    if "entropy" in s:
        cols["entropy"] = _floats(s["entropy"], n)
    sizes = {k: len(v) for k, v in cols.items()}
    expect = rlen if rlen is not None else n
    if any(v != expect for v in sizes.values()):
        names = {
            "trainer_logprob": "log_probs",
            "inference_logprob": "rollout_log_probs",
            "loss_mask": "loss_masks",
            "advantage": "advantages",
            "entropy": "entropy",
        }
        detail = ", ".join(f"{names[k]} {v}" for k, v in sizes.items())
        extra = f" (response_lengths {rlen})" if rlen is not None else ""
        raise _Unequal(f"response arrays of unequal length: {detail}{extra}")
    prompt = 0
    if "tokens" in s:
        toks = _ints(s["tokens"])
        prompt = len(toks) - n
        if prompt < 0:
            raise _Unequal(f"tokens ({len(toks)}) shorter than the response ({n})")
        if want_tokens:
            cols["token_id"] = toks[prompt:].astype(np.int64)
    mask = cols.get("loss_mask")
    cols["loss_mask"] = np.ones(n, bool) if mask is None else (mask != 0)
    cols["position"] = np.arange(prompt, prompt + n, dtype=np.int64)
    cols["sample_id"] = np.full(n, i, np.int64)
    cols["step"] = np.full(n, step, np.int64)
    return cols


class _Unequal(ValueError):
    pass


def read_slime(
    path: Path, wanted: set[str] | None, drop: bool, report, batch_rows: int
) -> Iterator[pl.DataFrame]:
    """One slime dump -> canonical token frames of about batch_rows rows."""
    obj = load_slime(path)
    step = _slime_rollout(path, obj)
    drops = _Drops(path, drop, report)
    want_tokens = wanted is None or "token_id" in wanted
    samples = obj["samples"]
    first = samples[0] if samples and isinstance(samples[0], dict) else {}
    optional = tuple(k for k in ("loss_masks", "advantages", "entropy", "tokens") if k in first)
    buf: dict[str, list[np.ndarray]] = {}
    nbuf = 0
    for i, s in enumerate(samples):
        try:
            cols = _slime_sample(i, s, step, want_tokens, optional)
        except _Unequal as exc:
            drops.bad(f"samples[{i}]", "arrays of unequal length", str(exc))
            continue
        except (ValueError, TypeError, RuntimeError) as exc:
            drops.bad(f"samples[{i}]", "not a slime train sample", str(exc))
            continue
        for k, v in cols.items():
            buf.setdefault(k, []).append(v)
        nbuf += len(cols["trainer_logprob"])
        if nbuf >= batch_rows:
            yield _slime_frame(buf, wanted)
            buf, nbuf = {}, 0
    if nbuf:
        yield _slime_frame(buf, wanted)


def _slime_frame(buf: dict[str, list[np.ndarray]], wanted: set[str] | None) -> pl.DataFrame:
    cols = {}
    for c, dtype in _CANON_TYPES.items():
        if c in buf and (wanted is None or c in wanted or c in ("step", "loss_mask")):
            cols[c] = pl.Series(c, np.concatenate(buf[c]), dtype=dtype)
    return pl.DataFrame(cols)
