"""Ingest: any supported token log -> batches of the canonical token table (DESIGN.md).

Design
------
Five layers, each importing only those above it in this list:

- `canonical`: the table's columns and accepted names, `ReadOptions`, `ReadReport`, `Plan`;
  mapping a log's columns onto it, exploding list columns, validation with counts.
- `formats/`: one module per framework format (prime_rl, nemo_rl, slime, skyrl; jsonl for
  plain JSON lines; records for what the JSON-lines frameworks share), and a registry that
  detects a file's format from its path and dispatches its probe and read.
- `sources`: SOURCES (files, directories, globs, URIs) -> the files and their one format;
  step markers; object stores and their timeouts.
- `read`: `plan_sources` (the Plan, from the schemas alone) and `iter_batches` / `read_table`
  (the files streamed a batch at a time: Parquet read here, the other formats by their
  readers, every batch through canonical's checks).
- `convert` (the canonical table written once as zstd Parquet), `alignment` (are the two
  log-prob columns about the same tokens). `inspect` (what is in a log, and prime_check: the
  run's logged decisions replayed) runs the engine, so it lives in `analysis.inspect`.

This package re-exports what the rest of the library uses. `convert` is not imported here,
so that the name stays the module's (`ingest.convert.convert`).
"""

from __future__ import annotations

from .alignment import AlignmentCheck, first_batch_warnings
from .canonical import (
    ALIASES,
    CANONICAL,
    IO_TIMEOUT_S,
    LOGPROB_COLUMNS,
    OPTIONAL,
    POSITIVE_TOLERANCE,
    PROB_ALIASES,
    RECORDS,
    REQUIRED,
    DuplicateCheck,
    IngestWarning,
    Plan,
    ReadOptions,
    ReadReport,
    parse_mapping,
)
from .formats import FORMATS, FRAMEWORKS, detect, path_step
from .read import iter_batches, plan_sources, read_table, row_group_rows, step_bounds
from .sources import (
    COMMIT_MARKER,
    RemotePath,
    filesystem_from_uri,
    is_uri,
    natural_key,
    remote_call,
    resolve_sources,
    stuck_requests,
)

__all__ = [
    "ALIASES",
    "CANONICAL",
    "COMMIT_MARKER",
    "FORMATS",
    "FRAMEWORKS",
    "IO_TIMEOUT_S",
    "LOGPROB_COLUMNS",
    "OPTIONAL",
    "POSITIVE_TOLERANCE",
    "PROB_ALIASES",
    "RECORDS",
    "REQUIRED",
    "AlignmentCheck",
    "DuplicateCheck",
    "IngestWarning",
    "Plan",
    "ReadOptions",
    "ReadReport",
    "RemotePath",
    "detect",
    "filesystem_from_uri",
    "first_batch_warnings",
    "is_uri",
    "iter_batches",
    "natural_key",
    "parse_mapping",
    "path_step",
    "plan_sources",
    "read_table",
    "remote_call",
    "resolve_sources",
    "row_group_rows",
    "step_bounds",
    "stuck_requests",
]
