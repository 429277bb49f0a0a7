"""The streaming pass: which columns a replay reads, batches read ahead, one shard's Tally.

Design
------
A replay reads only the columns its jobs need (`columns_needed`: the two log-probs and the
step always, sample_id / entropy / group_id where the log has them, advantage where a rule
reads it, the --by column), through ingest's batches. `prefetch` reads them in a background
thread two batches ahead, so Parquet decoding and canonicalisation (pyarrow and polars
release the GIL) overlap the kernel. `shard_tally` is one shard's whole pass, the body of a
Ray task (ray.py) as of the local engine's replay (replay.py); `count_sequences` is the
pre-pass that numbers the sequences and counts their loss tokens when a replay needs each
sequence's length up front (match="prime-rl", --by length).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
import polars as pl

from ..errors import DataError, UsageError
from ..ingest import IngestWarning, Plan, first_batch_warnings, iter_batches
from .bins import Grow
from .groups import GROUP_KEYS
from .jobs import Job
from .tally import Tally


def columns_needed(jobs: Sequence[Job], by: str | None, available: Sequence[str]) -> list[str]:
    """The canonical columns a replay of `jobs` grouped `by` reads from a log that has the
    columns `available` (a usage or data error where `by` cannot be read)."""
    cols = {"trainer_logprob", "inference_logprob", "step"}
    for j in jobs:
        cols |= set(j.rule.needs)
    if "sample_id" in available:
        cols.add("sample_id")
    if "entropy" in available:
        cols.add("entropy")
    if "advantage" in available:  # every rule's row says what its mask costs (readout)
        cols.add("advantage")
    if "group_id" in available and "sample_id" in available:
        cols.add("group_id")  # prompt groups: fully masked groups per rule (readout.py)
    if by is not None:
        if by not in GROUP_KEYS:
            raise UsageError(f"--by {by}: group by one of {', '.join(GROUP_KEYS)}.")
        if by == "q_bucket":
            return sorted(cols)
        if by in ("lag", "position"):  # a token's step - version, its position's bucket
            need = "version" if by == "lag" else "position"
            if need not in available:
                raise DataError(
                    f"--by {by} needs a {need} column (found: {', '.join(available)}). Map "
                    f"one with --map {need}=COLUMN."
                )
            return sorted(cols | {need})
        if by == "length":
            if "sample_id" not in available:
                raise DataError(
                    "--by length buckets sequences by their loss tokens, so it needs a "
                    f"sample_id column (found: {', '.join(available)}). Map one with --map "
                    "sample_id=COLUMN."
                )
            return sorted(cols)
        if by not in available and by != "step":
            raise UsageError(
                f"--by {by}: the log has no '{by}' column (found: {', '.join(available)})."
            )
        cols.add(by)
    return sorted(cols)


def prefetch(batches: Iterator, depth: int = 2) -> Iterator:
    """Iterate `batches` in a background thread, `depth` batches ahead: Parquet decoding and
    canonicalisation (pyarrow and polars release the GIL) overlap the kernel. Errors are
    raised here, in order; stopping early stops the reader."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        q.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((True, done))
        except BaseException as exc:  # handed to the consumer
            q.put((False, exc))

    t = threading.Thread(target=produce, name="mismatch-replay-reader", daemon=True)
    t.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while t.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(timeout=0.05)


def shard_tally(
    plan: Plan,
    jobs: Sequence[Job],
    by: str | None,
    cols: Sequence[str],
    has_seq: bool,
    has_adv: bool,
    sample_id_offset: int | None = None,
) -> Tally:
    """The Tally of one shard's plan (the Ray engine's task body), flushed for shipping.
    `sample_id_offset` is added to sample ids that ingest numbers by row (one row per
    sequence without a sample_id column), so that they stay unique across shards."""
    tally = Tally(list(jobs), by, has_seq=has_seq, has_adv=has_adv)
    tally.has_pgroup = has_seq and "group_id" in cols
    for _, df in prefetch(iter_batches(plan, cols, tally.report)):
        if sample_id_offset:
            df = df.with_columns(pl.col("sample_id") + sample_id_offset)
        if df.height:
            tally.add_batch(df)
    tally.flush()
    return tally


def count_sequences(plan: Plan, cols: Sequence[str], keep=None) -> tuple[dict, np.ndarray]:
    """The pre-pass of `match="prime-rl"` and `by="length"`: every sequence's id (the
    replay numbers them in the same order) and its loss tokens (float64), from one read of
    the replay's own columns `cols` (so that --drop-invalid drops the same rows; `keep`:
    prime-rl's filter)."""
    pre = Tally([], None, has_seq=True)
    n = Grow(0.0)
    for _, df in iter_batches(plan, cols, pre.report):
        if keep is not None:
            df = keep(df)
        if df.height:
            _, (uniq, local) = pre.seq_codes(df)
            n.ensure(len(pre.seq_keys))
            n.a[uniq] += np.bincount(local, minlength=uniq.shape[0])
    return pre.seq_keys, n.a[: len(pre.seq_keys)].copy()


def check_loss_tokens(plan: Plan, tally: Tally) -> None:
    """A data error where the replay found no loss token to replay."""
    if tally.report.loss_rows == 0:
        raise DataError(
            f"{plan.files[0]}{' and others' if len(plan.files) > 1 else ''}: no loss tokens "
            f"to replay ({tally.report.rows:,} row(s) read, none with loss_mask true and valid). "
            "Check the loss_mask column and the --map options."
        )


_ALIGNMENT_WARNED: set[tuple] = set()


def warn_alignment(plan: Plan, df: pl.DataFrame) -> None:
    """The lag check on the first batch (ingest.alignment), warned once per log and
    process."""
    for note in first_batch_warnings(df):
        key = (tuple(map(str, plan.files)), note)
        if key not in _ALIGNMENT_WARNED:
            _ALIGNMENT_WARNED.add(key)
            warnings.warn(f"{plan.files[0]}: {note}", IngestWarning, stacklevel=3)


def clear_alignment_warnings() -> None:
    """Warn again about the logs this process has warned about (`warn_alignment`)."""
    _ALIGNMENT_WARNED.clear()
