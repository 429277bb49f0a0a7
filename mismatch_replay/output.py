"""Writing results: CSV, Parquet or JSON by suffix, atomically, never over an existing file.

Design
------
Every output goes to a temporary file in the target's directory and is renamed into place
(`os.replace`, atomic on POSIX), so an interrupted run never leaves a half-written file. An
existing target is an error unless `force`. JSON carries `schema_version` and writes null for
every undefined number: NaN and infinities never reach a JSON file.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import polars as pl

from .errors import UsageError

SCHEMA_VERSION = 1
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".json": "json"}


def check_target(path: str | Path, force: bool) -> Path:
    """Refuse an existing file (unless force) or an unknown suffix, before any work is done."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise UsageError(
            f"-o {p}: unknown output format '{p.suffix}'. Use .csv, .parquet or .json."
        )
    if p.exists() and not force:
        raise UsageError(f"-o {p}: the file exists. Pass --force to overwrite it.")
    if p.exists() and p.is_dir():
        raise UsageError(f"-o {p}: that is a directory; give a file name.")
    return p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def normal_mode(path: str | Path) -> None:
    """Give a temporary file (mkstemp: 0600) or directory (mkdtemp: 0700) the permissions a
    plainly created one would have (0666 / 0777 minus the umask) before it is renamed."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) and rename tmp to path; remove tmp on any failure."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        normal_mode(tmp)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def clean(obj):
    """Recursively replace non-finite floats by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    return obj


def to_json(payload: dict) -> str:
    return json.dumps(clean({"schema_version": SCHEMA_VERSION, **payload}), indent=2)


def write_table(
    df: pl.DataFrame, path: str | Path, force: bool = False, meta: dict | None = None
) -> Path:
    """Write a table by suffix (.csv, .parquet, .json), atomically."""
    p = check_target(path, force)
    fmt = FORMATS[p.suffix.lower()]
    if fmt == "csv":
        return atomic_write(p, lambda t: df.write_csv(t))
    if fmt == "parquet":
        return atomic_write(p, lambda t: df.write_parquet(t, compression="zstd"))
    text = to_json({**(meta or {}), "rows": df.to_dicts()})
    return atomic_write(p, lambda t: t.write_text(text + "\n"))
