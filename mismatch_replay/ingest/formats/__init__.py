"""The token logs trainers write on disk -> canonical frames, streamed: one module per format,
and this registry, which detects a file's format and dispatches to its reader.

Design
------
| format | what is read | detected by |
|---|---|---|
| `prime-rl` | one object per packed sequence, per-token arrays | `step_<n>/rank_<r>.jsonl` |
| `prime-rl-traces` | episode records + the trainer's annotations | `traces/stream.jsonl` |
| `nemo-rl` | one object per sample, every field a one-element list | `train_data_step<N>.jsonl` |
| `slime` | `torch.save` train dumps, `format_version` 2 | the `.pt` suffix |
| `skyrl` | a pickled `TrainingInputBatch`, unpickled restrictively | the `.pkl` suffix |
| `jsonl` | canonical rows (token rows, or sequence rows of lists) | other `.jsonl` / `.ndjson` |
| `parquet` | the canonical table, read by ingest.read | `.parquet` / `.pq` |

The two prime-rl formats are read by prime_rl.py, the others by the module of their name.
Every layout was read from the framework's own writer code, at the commit its module names
(the test fixtures are built the same way, tests/framework_writers.py). `detect` tells a
format from a path (a file with an unknown suffix: `sniff`, from its first bytes; the
prime-rl trace annotations and indexes are sidecars read with their stream, never on their
own); `path_step` the step a path implies. Each reader answers a probe (base.Probe: the
columns it will deliver, from the first record or dump) and streams frames of canonical
columns (the framework formats; plain JSONL keeps the file's own names, which then go
through the same alias / `--map` / list-explode path as Parquet). `probe` and `read` here
dispatch by format name; `read` projects the JSON schema to the columns wanted.

The modules depend one way: base <- jsonl <- records <- nemo_rl, prime_rl; base <- slime,
skyrl; this registry on all of them; and the formats on ingest.canonical (for the
`ReadReport` key of skipped records and the required columns) and ingest.safe_read (regular
files only; caps on a file read whole and on one JSON line) only, never on the resolution of
sources or the batches that use them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import polars as pl

from ..canonical import REQUIRED
from . import jsonl, prime_rl, records, skyrl, slime
from .base import Probe, file_size
from .nemo_rl import NEMO, TRAIN_DATA_FILE
from .prime_rl import EXPORT_FILE, PRIME, STEP_DIR, TRACE_STREAM, traces_dir
from .skyrl import DUMP_FILE
from .slime import is_slime_rollout_dump

FORMATS = ("parquet", "jsonl", "prime-rl", "prime-rl-traces", "nemo-rl", "slime", "skyrl")
FRAMEWORKS = ("prime-rl", "prime-rl-traces", "nemo-rl", "slime", "skyrl")
JSON_FORMATS = ("jsonl", "prime-rl", "nemo-rl")
FILE_FORMATS = ("slime", "skyrl", "prime-rl-traces")  # read whole by one reader call
SPECS = {"prime-rl": PRIME, "nemo-rl": NEMO}  # the framework JSON-lines formats
SUFFIXES = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".pt": "slime",
    ".pkl": "skyrl",
}
_ANY_STEP = re.compile(r"step[_=-]?(\d+)")
_HIVE_STEP = re.compile(r"step=(-?\d+)")

__all__ = [
    "FILE_FORMATS",
    "FORMATS",
    "FRAMEWORKS",
    "JSON_FORMATS",
    "SPECS",
    "SUFFIXES",
    "Probe",
    "detect",
    "file_size",
    "is_slime_rollout_dump",
    "path_step",
    "prime_step_dir",
    "probe",
    "read",
    "sniff",
]


def detect(path: Path) -> str | None:
    """The format a file's path says it holds (None: not a token log we know, or a sidecar
    read along with one: prime-rl's trace annotations and indexes)."""
    if EXPORT_FILE.fullmatch(path.name) and STEP_DIR.fullmatch(path.parent.name):
        return "prime-rl"
    if TRAIN_DATA_FILE.fullmatch(path.name):
        return "nemo-rl"
    if path.name == TRACE_STREAM and (
        path.parent.name == "traces" or (path.parent / "annotations").is_dir()
    ):
        return "prime-rl-traces"
    if path.suffix.lower() == ".jsonl" and (
        traces_dir(path) is not None
        or (path.parent.name == "annotations" and (path.parent.parent / TRACE_STREAM).is_file())
        or (path.name.endswith(".index.jsonl") and (path.parent / TRACE_STREAM).is_file())
    ):
        return None  # annotations/<producer>.jsonl, *.index.jsonl, live/: read with the stream
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
    if head[:1] == b"\x80":  # a pickle (protocol 2+): SkyRL's dump_data_batch
        return "skyrl"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    return "parquet"


prime_step_dir = prime_rl.step_dir


def path_step(path: Path, fmt: str) -> int | None:
    """The step a file's path implies: hive `step=N`, prime-rl `step_N`, nemo `..._stepN`,
    SkyRL `global_step_N_...`."""
    if fmt == "parquet":
        for part in reversed(path.parent.parts):
            m = _HIVE_STEP.fullmatch(part)
            if m:
                return int(m.group(1))
        return None
    if fmt == "prime-rl":
        m = STEP_DIR.fullmatch(path.parent.name)
        return int(m.group(1)) if m else None
    if fmt in ("nemo-rl", "skyrl"):
        m = TRAIN_DATA_FILE.fullmatch(path.name) or DUMP_FILE.fullmatch(path.name)
        m = m or _ANY_STEP.search(path.stem)
        return int(m.group(1)) if m else None
    return None


def probe(fmt: str, path: Path, drop: bool, roles: dict[str, str]) -> Probe | None:
    """What a read of one file of format `fmt` will deliver (None: the file holds no record).
    `roles`: plain JSONL key -> the canonical column it would feed (fixes float dtypes)."""
    if fmt == "slime":
        return slime.probe_slime(path)
    if fmt == "skyrl":
        return skyrl.probe_skyrl(path)
    if fmt == "prime-rl-traces":
        return prime_rl.probe_traces(path, drop)
    if fmt == "jsonl":
        return jsonl.probe_jsonl(path, drop, roles)
    return records.probe_records(SPECS[fmt], path, drop)


def read(
    fmt: str,
    path: Path,
    file_step: int | None,
    schema: dict[str, pl.DataType],
    wanted: set[str],
    drop: bool,
    report,
    batch_rows: int,
    block_bytes: int,
) -> Iterator[pl.DataFrame]:
    """Frames of one file of format `fmt`: canonical columns (plain JSONL: the file's own),
    every row, the `wanted` columns and those the loss mask needs. `schema`: the probe's JSON
    schema; skipped records (--drop-invalid) are counted in `report`."""
    if fmt == "slime":
        yield from slime.read_slime(path, wanted, drop, report, batch_rows)
    elif fmt == "skyrl":
        yield from skyrl.read_skyrl(path, file_step, wanted, batch_rows)
    elif fmt == "prime-rl-traces":
        yield from prime_rl.read_traces(path, wanted, drop, report, batch_rows)
    elif fmt == "jsonl":
        schema = {k: t for k, t in schema.items() if k in wanted}
        yield from jsonl.read_jsonl(path, schema, drop, report, block_bytes)
    else:
        spec = SPECS[fmt]
        arrays = spec.arrays
        schema = {
            k: t
            for k, t in schema.items()
            if k not in arrays or arrays[k] in wanted or arrays[k] in REQUIRED
        }
        yield from records.read_records(
            spec, path, file_step, schema, wanted, drop, report, block_bytes
        )
