"""TokenWriter: the canonical token table, written from inside a training loop.

Design
------
A training step must not wait for Parquet encoding, and the log must never hold a half-written
step that a reader would take for a whole one. So the writer splits the work in two:

* **`write()` (the training loop's thread)** keeps only the loss tokens (`inputs.prepare`:
  selected on the device, only those copied to host memory) and hands the compact batch to a
  queue. For 1M tokens of CPU tensors it returns in ~2 ms (median; 6-10 ms at worst on two
  busy cores); the figures are in docs/capture.md (benchmarks/capture_bench.py).
* **One background thread** turns batches into Arrow tables and appends them as row groups to
  the step's file. numpy and pyarrow release the GIL while they work, so on 2 cores the
  training loop keeps its core while the thread encodes (zstd; ~40 ms per 1M tokens).

**Atomic commit, per step and rank.** Rows of step N go to `step=N/.rank=R.parquet.tmp` (a
dot name, which every reader skips); when the loop moves on to another step (or on `commit()`,
`flush()`, `close()`), the file is closed, fsync'ed and renamed to `step=N/rank=R.parquet`, and
the rank's marker `step=N/_SUCCESS.rank=R` is written. The rank that finds every rank's marker
present (`world_size` of them) writes `step=N/_SUCCESS`. A rename is atomic, so a reader sees
either no file or a whole one; the readers (`io`) read a step directory only once it holds
`_SUCCESS`, and skip the others with a note. Several write() calls for one step (micro-batches,
TRL's generation batches) append to the same file; a step already committed by this writer
cannot be written again (ValueError). A step rewritten by a later run (a resume) first loses
its `_SUCCESS` and this rank's marker, then is committed again.

**Memory bound (back-pressure).** The queue holds at most `max_pending` batches (default 4);
a write() that finds it full waits for the thread. A pending batch holds the selected values
in their own dtype (2 bytes a token for bf16, 4 for fp32, per column) plus 1 byte per padded
[B, T] position (the copied mask) or 4 per token (indices from a device): ~13 MB for a
1M-token batch of 1.5M positions. The thread holds one batch being encoded and the rows
gathered for the next row group (small batches are gathered into row groups of up to 1M
rows): ~36 bytes a token as Arrow columns (52 with float64 values), at most ~2M rows. For
1M-token steps that is ~(4 + 1) x 13 MB + 2 x 40 MB ~ 150 MB of host memory at most,
whatever the length of the run.

**Errors on the thread are not lost.** The first exception there (disk full, permissions ...)
is kept; the next `write()`, `commit()`, `flush()` or `close()` raises `CaptureError` from
it. The thread
then discards what it is given, so the loop never blocks on a dead writer.

**Sampling.** `every=k` writes the steps divisible by k; `max_tokens_per_step` caps the loss
tokens a rank writes per step, keeping whole sequences (sequence rules need all of a
sequence's tokens; see `inputs.choose_rows`). What was seen and what was written is recorded
in each file's metadata (`read_meta`), so that counts can be scaled back.

**File metadata** (Parquet key-value metadata, JSON under `mismatch_replay.capture`): which
trainer log-prob the `trainer_logprob` column holds (`current`, `old` or `proximal`), the
sampler's `temperature` and `top_p`, the `framework` and its version (looked up when not
given), rank, world size, step, the sampling settings and any other keys given in `meta`; the
per-step counts under `mismatch_replay.capture.step`.

torch is never imported by this package: a tensor is recognised through `sys.modules`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..ingest import COMMIT_MARKER
from . import inputs
from .inputs import SAMPLE_ID_STRIDE, Prepared

META_KEY = "mismatch_replay.capture"
STEP_META_KEY = "mismatch_replay.capture.step"
TRAINER_LOGPROB_KINDS = ("current", "old", "proximal")
# framework name in meta -> its distribution name, for the version lookup
FRAMEWORK_PACKAGES = {
    "verl": "verl",
    "trl": "trl",
    "skyrl": "skyrl",
    "areal": "areal",
    "openrlhf": "openrlhf",
    "slime": "slime",
}
ROW_GROUP_ROWS = 1 << 20


class CaptureError(RuntimeError):
    """The background writer failed; the cause is chained (`__cause__`)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step={step}"


def rank_file(root: str | Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank={rank}.parquet"


def read_meta(path: str | Path) -> dict:
    """The capture metadata of a file written by TokenWriter (with the step's counts under
    "step_counts"); {} for other Parquet files."""
    kv = pq.read_metadata(path).metadata or {}
    out = json.loads(kv[META_KEY.encode()]) if META_KEY.encode() in kv else {}
    if STEP_META_KEY.encode() in kv:
        out["step_counts"] = json.loads(kv[STEP_META_KEY.encode()])
    return out


def _framework_version(name: str | None) -> str | None:
    if not name:
        return None
    from importlib import metadata

    try:
        return metadata.version(FRAMEWORK_PACKAGES.get(name.lower(), name))
    except metadata.PackageNotFoundError:
        return None


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # some filesystems cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(path: Path, payload: dict, fsync: bool) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


_CLOSE = object()


class TokenWriter:
    """Write the canonical token table from a training loop (see the module docstring).

    ```python
    writer = TokenWriter("runs/exp1/tokens", rank=rank, world_size=world,
                         meta={"trainer_logprob": "old", "framework": "verl"})
    writer.write(step=step, trainer_logprobs=old_lp, inference_logprobs=rollout_lp,
                 mask=response_mask, advantages=adv)
    writer.close()   # or: with TokenWriter(...) as writer:
    ```

    root: the directory of the log (`step=N/rank=R.parquet` under it).
    rank, world_size: this process's rank among the processes writing the same log; a step
      is complete (`_SUCCESS`) once `world_size` ranks have committed it.
    meta: recorded in every file: `trainer_logprob` ("current", "old" or "proximal"),
      `temperature`, `top_p`, `framework`, `framework_version` (looked up from the installed
      package when not given), and any other JSON-serialisable keys.
    every: write only the steps divisible by `every`.
    max_tokens_per_step: at most this many loss tokens per step on this rank, whole sequences
      chosen at random (seeded by `seed`, the step and the rank).
    max_pending: batches queued before write() waits (the memory bound).
    compression: the Parquet codec (zstd: ~5.5 bytes a token on disk, lz4/snappy faster,
      larger).
    fsync: fsync each file and marker before it counts as written (off only for scratch).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        meta: Mapping | None = None,
        every: int = 1,
        max_tokens_per_step: int | None = None,
        seed: int = 0,
        max_pending: int = 4,
        compression: str = "zstd",
        fsync: bool = True,
    ):
        rank, world_size, every = int(rank), int(world_size), int(every)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} with world_size {world_size}: need 0 <= rank < world_size "
                "(pass world_size= when several processes write the same log)"
            )
        if every < 1:
            raise ValueError(f"every={every}: must be >= 1")
        if max_tokens_per_step is not None and int(max_tokens_per_step) < 1:
            raise ValueError(f"max_tokens_per_step={max_tokens_per_step}: must be >= 1")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}: must be >= 1")
        meta = dict(meta or {})
        kind = meta.get("trainer_logprob")
        if kind is not None and kind not in TRAINER_LOGPROB_KINDS:
            raise ValueError(
                f"meta trainer_logprob={kind!r}: one of {', '.join(TRAINER_LOGPROB_KINDS)} "
                "(the log-prob the trainer_logprob column holds: the policy being trained, "
                "the old policy the rollout's advantages belong to, or a proximal policy)"
            )
        for key in ("temperature", "top_p"):
            if meta.get(key) is not None:
                meta[key] = float(meta[key])
        if meta.get("framework") and not meta.get("framework_version"):
            meta["framework_version"] = _framework_version(meta["framework"])
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self.max_tokens_per_step = None if max_tokens_per_step is None else int(max_tokens_per_step)
        self.seed = int(seed)
        self.compression = compression
        self.fsync = fsync
        self.meta = {
            "trainer_logprob": None,
            "temperature": None,
            "top_p": None,
            "framework": None,
            "framework_version": None,
            **meta,
            "rank": rank,
            "world_size": world_size,
            "every": every,
            "max_tokens_per_step": self.max_tokens_per_step,
            "seed": self.seed,
            "writer": f"mismatch_replay.capture.TokenWriter {__version__}",
        }
        json.dumps(self.meta)  # fail here, not on the thread, if meta is not serialisable
        self.root.mkdir(parents=True, exist_ok=True)
        # caller side
        self._step: int | None = None  # the step write() is filling
        self._done: set[int] = set()  # steps handed over for commit
        self._step_rows = 0  # rows seen in the current step (default sample ids)
        self._step_calls = 0
        self._budget: int | None = None
        self._signature: tuple | None = None  # columns, fixed by the first batch
        self._widths: dict[str, np.dtype] = {}  # float width per column in the current step
        self._closed = False
        self._reported = False
        self._pid = os.getpid()  # a forked child inherits the object, not the thread
        # the thread's side
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._file: pq.ParquetWriter | None = None
        self._file_step: int | None = None
        self._schema: pa.Schema | None = None
        self._counts: dict[str, int] = {}
        self._held: list[pa.Table] = []  # tables not yet written as a row group
        self._held_rows = 0
        self._thread = threading.Thread(
            target=self._run, name=f"TokenWriter({self.root}, rank {rank})", daemon=True
        )
        self._thread.start()
        atexit.register(self._close_at_exit)

    # ------------------------------------------------------------------ the caller's side

    def write(
        self,
        step: int,
        trainer_logprobs,
        inference_logprobs,
        mask=None,
        advantages=None,
        sample_ids=None,
        env=None,
        old_logprobs=None,
        entropy=None,
    ) -> int:
        """Queue one batch of step `step`; returns the loss tokens queued (0 for a step that
        `every` skips).

        Per-token inputs are [B, T] (torch tensors on any device and in any float dtype, or
        numpy arrays) or ragged (a list of B per-sequence lists, arrays or 1-D tensors).
        mask: true (non-zero) at the loss tokens; None: every token. advantages: [B] or
        [B, T] (ragged: B values or B sequences). sample_ids: B ints or strings; default: the
        row's index (`rank * 1e9 + row`, rows of earlier calls of the step counted). env: one
        string or B strings. old_logprobs, entropy: optional per-token columns.
        Returns once the loss tokens are copied: the inputs may be reused at once."""
        self._check("write")
        step = int(step)
        if step < 0:
            raise ValueError(f"step={step}: must be >= 0")
        if step != self._step:
            if step in self._done:
                raise ValueError(
                    f"step {step} was already committed by this writer; write each step's "
                    "batches before moving on to the next step"
                )
            self._end_step()
            if step % self.every:
                return 0
            self._step = step
            self._step_rows = 0
            self._step_calls = 0
            self._budget = self.max_tokens_per_step
            self._widths = {}
        values = {"trainer_logprob": trainer_logprobs, "inference_logprob": inference_logprobs}
        for name, x in (("advantage", advantages), ("old_logprob", old_logprobs)):
            if x is not None:
                values[name] = x
        if entropy is not None:
            values["entropy"] = entropy
        base = self.rank * SAMPLE_ID_STRIDE + self._step_rows
        prep = inputs.prepare(
            step,
            values,
            mask,
            sample_ids,
            env,
            sample_base=base,
            budget=self._budget,
            rng_seed=(self.seed, step, self.rank, self._step_calls),
        )
        self._check_signature(prep, sample_ids)
        n = _tokens(prep)
        self._step_rows += prep.seen_rows
        self._step_calls += 1
        if self._budget is not None:
            self._budget -= n
        self._put(prep)
        return n

    def commit(self) -> None:
        """Hand the step being written over for commit now, without waiting (the step is
        otherwise committed when write() moves to another step, or on close()). For loops
        that give a step in one call: the step is on disk ~50 ms per 1M tokens later, even
        if the process is then killed (a Ray actor at the end of a job runs no atexit)."""
        self._check("commit")
        self._end_step()

    def flush(self) -> None:
        """Commit the step being written now, and wait until everything queued is on disk."""
        self._check("flush")
        self._end_step()
        self._queue.join()
        self._check("flush")

    def close(self) -> None:
        """Commit the last step, stop the thread; raises CaptureError if the thread failed
        (unless a write() already raised it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if os.getpid() != self._pid:
            return  # the parent's writer: its thread and files are the parent's
        if self._step is not None:
            self._done.add(self._step)
            self._queue.put(("commit", self._step))
            self._step = None
        self._queue.put(_CLOSE)
        self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise CaptureError(
                f"{self.root}: the background writer failed: {self._error}"
            ) from self._error

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except CaptureError as e:  # at exit there is no caller left to raise to
            import warnings

            warnings.warn(str(e), RuntimeWarning, stacklevel=1)

    def _check(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"TokenWriter({self.root}): {what}() after close()")
        if self._error is not None:
            first = not self._reported
            self._reported = True
            msg = "the background writer failed" if first else "the writer failed earlier"
            raise CaptureError(f"{self.root}: {msg}: {self._error}") from self._error

    def _end_step(self) -> None:
        if self._step is not None:
            self._done.add(self._step)
            self._put(("commit", self._step))
            self._step = None

    def _put(self, item) -> None:
        self._queue.put(item)  # blocks while max_pending batches wait: the memory bound

    def _check_signature(self, prep: Prepared, sample_ids) -> None:
        """Every file of a log has the same columns (the readers refuse a mix), and within a
        step's file each float column keeps one width."""
        sid = "int" if sample_ids is None else prep.per_row["sample_id"].dtype.kind
        sig = (prep.columns, "str" if sid in "US" else "int")
        if self._signature is None:
            self._signature = sig
        elif sig != self._signature:
            raise ValueError(
                f"step {prep.step}: this batch has columns {_describe(sig)}, earlier batches "
                f"had {_describe(self._signature)}; every batch of a log needs the same ones "
                "(the readers refuse files whose columns differ)"
            )
        for name, a in prep.tokens.items():
            w = inputs.disk_dtype(a)
            have = self._widths.setdefault(name, w)
            if w.itemsize > have.itemsize:
                raise ValueError(
                    f"step {prep.step}: {name} is {w} in this batch but {have} in an earlier "
                    "batch of the same step; pass one dtype per step"
                )
        if "advantage" in prep.per_row:
            w = prep.per_row["advantage"].dtype
            have = self._widths.setdefault("advantage", w)
            if w.itemsize > have.itemsize:
                raise ValueError(
                    f"step {prep.step}: advantage is {w} in this batch but {have} earlier "
                    "in the same step; pass one dtype per step"
                )

    # ------------------------------------------------------------------ the thread's side

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _CLOSE:
                    if self._error is None:
                        self._commit()
                    return
                if self._error is not None:
                    continue  # a failed writer discards what it is given
                if isinstance(item, tuple):  # ("commit", step)
                    if self._file_step == item[1]:
                        self._commit()
                    continue
                self._append(item)
            except BaseException as exc:  # kept for the caller, never lost
                self._error = exc
                self._abort()
            finally:
                self._queue.task_done()

    def _append(self, p: Prepared) -> None:
        table = self._table(p)
        if self._file_step != p.step:
            self._commit()
            self._open(p.step, table.schema)
        if not table.schema.equals(self._schema, check_metadata=False):
            table = table.cast(self._schema)  # a narrower float column of the same step
        # small batches (micro-batches, one per trajectory ...) are gathered into row groups
        # of up to ROW_GROUP_ROWS rows: many tiny row groups would slow every reader down
        self._held.append(table)
        self._held_rows += table.num_rows
        if self._held_rows >= ROW_GROUP_ROWS:
            self._write_held()
        c = self._counts
        c["calls"] += 1
        c["sequences_seen"] += p.seen_rows
        c["sequences_written"] += p.rows
        c["tokens_written"] += table.num_rows
        c["tokens_seen"] += table.num_rows if p.seen_tokens is None else p.seen_tokens

    def _table(self, p: Prepared) -> pa.Table:
        rows, pos = inputs.token_rows(p)
        n = pos.shape[0]
        cols: dict[str, pa.Array] = {
            "trainer_logprob": pa.array(inputs.to_disk(p.tokens["trainer_logprob"])),
            "inference_logprob": pa.array(inputs.to_disk(p.tokens["inference_logprob"])),
            "step": pa.array(np.full(n, p.step, dtype=np.int64)),
        }
        if "sample_id" in p.per_row:
            cols["sample_id"] = _per_token(p.per_row["sample_id"], rows)
        else:
            orig = rows if p.row_ids is None else p.row_ids[rows]
            cols["sample_id"] = pa.array(orig.astype(np.int64) + p.sample_base)
        cols["position"] = pa.array(pos)
        if "advantage" in p.tokens:
            cols["advantage"] = pa.array(inputs.to_disk(p.tokens["advantage"]))
        elif "advantage" in p.per_row:
            cols["advantage"] = pa.array(p.per_row["advantage"][rows])
        if p.env is not None:
            cols["env"] = pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(n, dtype=np.int32)), pa.array([p.env])
            ).cast(pa.string())
        elif "env" in p.per_row:
            cols["env"] = _per_token(p.per_row["env"], rows)
        for name in ("old_logprob", "entropy"):
            if name in p.tokens:
                cols[name] = pa.array(inputs.to_disk(p.tokens[name]))
        return pa.table(cols)

    def _write_held(self) -> None:
        if self._held:
            table = self._held[0] if len(self._held) == 1 else pa.concat_tables(self._held)
            self._file.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._held, self._held_rows = [], 0

    def _open(self, step: int, schema: pa.Schema) -> None:
        d = step_dir(self.root, step)
        d.mkdir(parents=True, exist_ok=True)
        for stale in (d / COMMIT_MARKER, d / f"{COMMIT_MARKER}.rank={self.rank}"):
            stale.unlink(missing_ok=True)  # a step rewritten after a resume is not complete
        meta = {**self.meta, "step": step}
        self._schema = schema.with_metadata({META_KEY: json.dumps(meta)})
        self._tmp = d / f".rank={self.rank}.parquet.tmp"
        self._file = pq.ParquetWriter(
            self._tmp,
            self._schema,
            compression=self.compression,
            use_dictionary=[c for c in ("step", "sample_id", "env") if c in schema.names],
        )
        self._file_step = step
        self._counts = dict.fromkeys(
            ("calls", "sequences_seen", "sequences_written", "tokens_seen", "tokens_written"), 0
        )

    def _commit(self) -> None:
        """Close, fsync and rename the open step's file; write the rank's marker, and the
        step's marker when every rank's is there."""
        if self._file is None:
            return
        step, d = self._file_step, step_dir(self.root, self._file_step)
        self._write_held()
        self._file.add_key_value_metadata({STEP_META_KEY: json.dumps(self._counts)})
        self._file.close()
        self._file = None
        self._file_step = None
        final = rank_file(self.root, step, self.rank)
        if self.fsync:
            _fsync_file(self._tmp)
        os.replace(self._tmp, final)
        if self.fsync:
            _fsync_dir(d)
        _write_marker(d / f"{COMMIT_MARKER}.rank={self.rank}", self._counts, self.fsync)
        ranks = [d / f"{COMMIT_MARKER}.rank={r}" for r in range(self.world_size)]
        if all(m.exists() for m in ranks):
            _write_marker(
                d / COMMIT_MARKER, {"step": step, "world_size": self.world_size}, self.fsync
            )
        if self.fsync:
            _fsync_dir(d)

    def _abort(self) -> None:
        """After an error: drop the open step's file (its temp name is never read)."""
        f, self._file = self._file, None
        self._file_step = None
        self._held, self._held_rows = [], 0
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()
            with contextlib.suppress(OSError):
                self._tmp.unlink(missing_ok=True)


def _tokens(p: Prepared) -> int:
    return int(p.tokens["trainer_logprob"].shape[0])


def _per_token(values: np.ndarray, rows: np.ndarray) -> pa.Array:
    """A per-row column [B] (int or str) spread over the tokens; strings through a
    dictionary, so that 1M tokens do not become 1M Python strings."""
    if values.dtype.kind in "iu":
        return pa.array(values[rows].astype(np.int64, copy=False))
    names, codes = np.unique(values, return_inverse=True)
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.reshape(-1)[rows].astype(np.int32)), pa.array(names.tolist())
    ).cast(pa.string())


def _describe(sig: tuple) -> str:
    cols, sid = sig
    extra = ", ".join(cols) if cols else "no optional column"
    return f"[{extra}; {sid} sample ids]"
