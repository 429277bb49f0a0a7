"""What every format reader shares: the canonical dtypes it delivers, the probe it answers,
how it skips or refuses a bad record, and the small converters.

Design
------
A format reader turns one file into polars frames whose columns are canonical names
(`CANON_TYPES`; a framework format always delivers `FRAMEWORK_BASE`), every token of the
records it covers, prompt tokens included: `read.iter_batches` applies `loss_mask` and the
value checks to them exactly as to Parquet. Before any read, `probe` answers with a `Probe`
(the columns a read will deliver, the JSON schema to parse with, a row estimate for
progress, warnings). A record that cannot be read goes through `Drops`: an error naming the
file and the line (or sample), or with `--drop-invalid` a skip counted in
`ReadReport.dropped` under `RECORDS + why`. `LOGGED` are the run's own decisions (prime-rl's
`is_masked`, `mismatch_kl`), delivered only for `inspect.prime_check` and dropped by
canonicalisation. torch is imported on demand (`import_torch`), by the slime reader and by
SkyRL's bfloat16 tensors only.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from ...errors import DataError
from .. import safe_read
from ..canonical import RECORDS

F64, I64, BOOL, STR = pl.Float64, pl.Int64, pl.Boolean, pl.String

FIX_RECORD = (
    "Fix or remove the record, or pass --drop-invalid to skip such records (they are counted "
    "on stderr)."
)
CAPTURE_HINT = (
    "or log the tokens from the training loop with mismatch_replay.capture.TokenWriter, "
    "which writes the canonical table"
)

# Canonical columns every framework format delivers (beyond what a record's keys add), and
# the dtype of each canonical column a reader delivers.
FRAMEWORK_BASE = ("step", "sample_id", "position", "trainer_logprob", "inference_logprob")
CANON_TYPES: dict[str, pl.DataType] = {
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
    "reward": F64,
}

LOGGED = ("logged_is_masked", "logged_mismatch_kl")  # the run's own decisions (prime-rl)


@dataclass
class Probe:
    """What the first record of a file says: the columns a read will deliver."""

    columns: dict[str, bool]  # delivered column (source name) -> is a list column
    schema: dict[str, pl.DataType]  # JSON key -> dtype the reader parses it as
    rows: int  # estimated rows (tokens) in the file, for progress
    warnings: list[str] = field(default_factory=list)


class Drops:
    """Record-level problems: raise (naming file and line) or skip and count."""

    def __init__(self, path: Path, drop: bool, report) -> None:
        self.path, self.drop, self.report = path, drop, report

    def bad(self, where: str, why: str, detail: str) -> None:
        if not self.drop:
            raise DataError(f"{self.path}, {where}: {detail}. {FIX_RECORD}")
        if self.report is not None:
            key = (str(self.path), RECORDS + why)
            self.report.dropped[key] = self.report.dropped.get(key, 0) + 1


def open_local(path: Path):
    """A local regular file opened for reading bytes; a DataError that says why it cannot be
    (a FIFO or a device is refused from os.stat, before any open: safe_read)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing or rotating its logs? Wait for the step to "
            "finish, or leave the file out."
        ) from None
    except OSError:
        pass  # open_checked says what it is
    return safe_read.open_checked(path, None, "token log", "", DataError)


def file_size(path: Path) -> int:
    """The file's size in bytes (0 when it cannot be read: the reader then says why)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def estimate_rows(path: Path, tokens: int, nbytes: int) -> int:
    """Rows in a file whose first `nbytes` bytes hold `tokens` rows (for progress only)."""
    return int(tokens * file_size(path) / max(nbytes, 1))


def import_torch():
    """torch, imported on demand; a DataError with the way to install it when missing."""
    try:
        import torch
    except ImportError:
        raise DataError(
            "reading slime .pt dumps needs torch, which is not installed: pip install "
            "torch==2.13.0 (the CPU build) or pip install 'mismatch-replay[torch]'. Or convert "
            "the dumps to Parquet where torch is installed (mismatch-replay convert)."
        ) from None
    return torch


def floats(v, n: int | None = None) -> np.ndarray:
    """A tensor, list or number -> float64 array (a number is broadcast to n)."""
    if hasattr(v, "detach"):
        import torch

        return v.detach().to(device="cpu", dtype=torch.float64).reshape(-1).numpy()
    if isinstance(v, list | tuple):  # a null in a list reads as NaN (tensors have no null)
        nested = set(map(type, v)) & {list, tuple, dict}
        if nested:  # polars takes seconds to refuse a deeply nested list (18 s at depth 471)
            raise TypeError(f"expected numbers, found a {nested.pop().__name__} in the list")
        s = pl.Series(values=list(v), dtype=F64, strict=True)
        return s.fill_null(math.nan).to_numpy()
    if isinstance(v, int | float) and not isinstance(v, bool) and n is not None:
        return np.full(n, float(v))
    raise TypeError(f"expected a tensor or a list of numbers, found {type(v).__name__}")


def frame(cols: dict[str, np.ndarray], wanted: set[str] | None) -> pl.DataFrame:
    """Canonical columns (plus the logged decisions) as a frame, projected to `wanted`."""
    keep = {"step", "loss_mask", *LOGGED}
    out = {}
    for c, dtype in CANON_TYPES.items():
        if c in cols and (wanted is None or c in wanted or c in keep):
            out[c] = pl.Series(c, cols[c], dtype=dtype, strict=False)
    df = pl.DataFrame(out)
    if "logged_is_masked" in cols:  # int8: 1 masked, 0 kept, -1 not annotated
        flag = pl.Series(cols["logged_is_masked"], dtype=pl.Int8)
        df = df.with_columns(
            logged_is_masked=pl.when(pl.lit(flag) == -1).then(None).otherwise(pl.lit(flag) == 1)
        )
    if "logged_mismatch_kl" in cols:
        df = df.with_columns(logged_mismatch_kl=pl.Series(cols["logged_mismatch_kl"]))
    return df
