"""`inspect`: what is in a log, without failing on what is wrong with it.

Design
------
Inspecting is diagnosis, so invalid rows are counted (per file and column) instead of raising:
the same ingest path runs with `drop_invalid=True` and its `ReadReport` is the invalid-row
report. Everything else comes from one metrics-only pass of the engine (no rules): loss
tokens, steps, sequences and the mismatch metrics, overall and per step. It also counts rows
that repeat a (step, sample_id, position) (`io.DuplicateCheck`, memory ~40 bytes a sequence)
and warns about them, and checks that the two log-prob columns are about the same tokens
(`alignment.AlignmentCheck`: lag 0 against lags +-1 within sequences, and degenerate columns).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from . import io
from .alignment import AlignmentCheck
from .engine import Tally, columns_needed


@dataclass
class Summary:
    files: list[str]
    format: str  # parquet, prime-rl, nemo-rl, slime, jsonl
    source: dict[str, str]  # canonical -> source column
    layout: str  # "token rows" | "sequence rows (list columns)"
    probs: list[str]  # canonical columns read as probabilities
    rows: int
    loss_tokens: int
    steps: int
    sequences: int | None
    invalid: dict[str, int]  # "file: column" -> rows
    invalid_rows: int
    metrics: dict[str, float | None]
    per_step: pl.DataFrame
    warnings: list[str] = dataclasses.field(default_factory=list)
    alignment: str = ""  # the lag check's verdict and evidence (one line)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["per_step"] = self.per_step.to_dicts()
        return d


def inspect_log(
    sources: Sequence[str | Path],
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Summary:
    """Summarise a log: schema found, counts, invalid rows and mismatch metrics."""
    options = dataclasses.replace(options or io.ReadOptions(), drop_invalid=True)
    plan = io.plan_sources(sources, options)
    cols = columns_needed([], "step", plan.columns)
    dups = io.DuplicateCheck() if io.DuplicateCheck.possible(plan.columns) else None
    if dups is not None:
        cols = sorted({*cols, "sample_id", "position"})
    aligned = AlignmentCheck() if AlignmentCheck.possible(plan.columns) else None
    if aligned is not None:
        cols = sorted({*cols, *(c for c in ("sample_id", "position") if c in plan.columns)})
    tally = Tally([], "step", has_seq="sample_id" in plan.columns)
    total = sum(plan.rows)
    for _, df in io.iter_batches(plan, cols, tally.report):
        if df.height:
            tally.add_batch(df)
            if dups is not None:
                dups.add(df)
            if aligned is not None:
                aligned.add(df)
        if progress is not None:
            progress(tally.report.rows, total)
    note = dups.warning(plan.files) if dups is not None else None
    if note is not None:
        tally.report.warnings.append(note)
        warnings.warn(note, io.IngestWarning, stacklevel=2)
    for note in aligned.warnings() if aligned is not None else ():
        tally.report.warnings.append(note)
        warnings.warn(note, io.IngestWarning, stacklevel=2)
    overall = tally.metrics.total().table(None, [None]).to_dicts()[0]
    invalid = {
        f"{f}: {c}": n for (f, c), n in tally.report.dropped.items() if not c.startswith("*")
    }
    lists = sum(n for (f, c), n in tally.report.dropped.items() if c == "*lists")
    if lists:
        invalid["sequence rows with unequal list lengths"] = lists
    return Summary(
        files=[str(p) for p in plan.files],
        format=plan.format,
        source=dict(plan.source),
        layout="sequence rows (list columns)" if plan.per_sequence else "token rows",
        probs=sorted(plan.probs),
        rows=tally.report.rows,
        loss_tokens=tally.report.loss_rows,
        steps=sum(1 for g in tally.groups),
        sequences=len(tally.seq_keys) if tally.has_seq else None,
        invalid=invalid,
        invalid_rows=tally.report.dropped_rows,
        metrics=overall,
        per_step=tally.metrics.table("step", tally.groups),
        warnings=list(dict.fromkeys([*plan.warnings, *tally.report.warnings])),
        alignment=aligned.line() if aligned is not None else "not checked (no sample_id column)",
    )
