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

**Atomic commit, per step and rank; the run id.** Rows of step N go to a dot-named
temporary (`step=N/.rank=R.parquet.tmp`, which every reader skips); when the loop moves on
to another step (or on `commit()`, `flush()`, `close()`) it is fsync'ed and renamed to
`step=N/rank=R.parquet`, the rank's marker `step=N/_SUCCESS.rank=R` is written, and the rank
that then finds every rank's marker of this run publishes `step=N/_SUCCESS`, which the
readers wait for. All ranks of one run record the same run id (`run_id=`, else
MISMATCH_REPLAY_RUN_ID, else torchrun's). The protocol on disk (paths, markers, the
idempotent publish, the run id, the lock file's contents) is in commit.py, with its design.
Several write() calls for one step (micro-batches, TRL's generation batches) append to
the same file; a step already committed by this writer cannot be written again (ValueError).

**One writer per rank.** `root/.rank=R.lock` is held with `flock` for the writer's life (the
kernel drops it when the process dies, however it dies) and holds the writer's pid and host.
A second live writer of the same rank in the same directory, in this process or another,
is refused at construction (CaptureError naming the directory, rank and pid: a forgotten
`rank=`). A lock file left by a writer that did not close (killed) is taken over, with a
note on stderr. Where flock is not supported the pid is checked instead (alive on this host:
refused). A lock file that cannot be created (a read-only directory) is a CaptureWarning and
no lock (strict=True: CaptureError).

**A crash does not publish the step in flight.** An exception out of `with TokenWriter(...)`,
`close()` while an exception is propagating (`finally:`), and an exit on an uncaught
exception without close() (atexit) drop the step being written: its temporary is deleted,
no marker is written. Steps handed over before (the loop moved on, `commit()`, `flush()`)
are committed. `close(commit=True)` commits anyway, `abort()` drops it on purpose.

**Memory bound (back-pressure).** The queue holds at most `max_pending` batches (default 4);
a write() that finds it full waits for the thread. A pending batch holds the selected values
in their own dtype (2 bytes a token for bf16, 4 for fp32, per column) plus 1 byte per padded
[B, T] position (the copied mask) or 4 per token (indices from a device): ~13 MB for a
1M-token batch of 1.5M positions. The thread holds one batch being encoded and the rows
gathered for the next row group (small batches are gathered into row groups of up to 1M
rows): ~36 bytes a token as Arrow columns (52 with float64 values), at most ~2M rows. For
1M-token steps that is ~(4 + 1) x 13 MB + 2 x 40 MB ~ 150 MB of host memory at most,
whatever the length of the run.

**A failure on the thread skips a step, never the training loop.** An exception there (disk
full, permissions, a lost mount ...) drops the step it happened in (its temporary deleted, no
marker: the step stays unpublished on every rank, and the readers leave it out with a note),
and the next `write()`, `commit()`, `flush()` or `close()` on the loop's thread warns
(`CaptureWarning`, naming the step and the cause); the thread goes on with the next step.
`failed_steps` lists them. With `strict=True` the first failure is kept and raised instead, as
`CaptureError` from the next call, and the thread discards what it is given afterwards (the
loop never blocks on a dead writer).

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
import errno
import json
import logging
import os
import queue
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..ingest import COMMIT_MARKER
from . import inputs
from .commit import HOST as _HOST
from .commit import (
    RUN_ID_ENV,
    RUN_ID_PATTERN,
    default_run_id,
    fsync_dir,
    fsync_file,
    lock_file,
    lock_holder,
    pid_alive,
    publish,
    rank_file,
    rank_marker,
    read_json,
    step_dir,
    write_marker,
)
from .inputs import SAMPLE_ID_STRIDE, Prepared

try:
    import fcntl
except ImportError:  # not on POSIX: the pid check alone
    fcntl = None

log = logging.getLogger(__name__)

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
WARN_EACH = 5  # failed steps warned one by one; the rest are counted (close() says how many)


class CaptureError(RuntimeError):
    """The background writer failed (strict=True; the cause is chained, `__cause__`), or a
    writer cannot start (another live writer holds the rank)."""


class RankInUseError(CaptureError):
    """Another live TokenWriter writes the same rank into the same directory."""


class CaptureWarning(RuntimeWarning):
    """A step could not be written (it is skipped; the training loop goes on), or the
    writer's setup is fragile (no run id with several ranks)."""


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


def _last_uncaught() -> BaseException | None:
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _clean_exit(exc: BaseException | None) -> bool:
    """No exception, or sys.exit(0): the step in flight is committed."""
    return exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None))


_CLOSE = object()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # writers whose lock a forked child must not keep


def _after_fork_in_child() -> None:
    for w in list(_LIVE):
        w._forget_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class TokenWriter:
    """Write the canonical token table from a training loop (see the module docstring).

    ```python
    writer = TokenWriter("runs/exp1/tokens", rank=rank, world_size=world, run_id=job_id,
                         meta={"trainer_logprob": "old", "framework": "verl"})
    writer.write(step=step, trainer_logprobs=old_lp, inference_logprobs=rollout_lp,
                 mask=response_mask, advantages=adv)
    writer.close()   # or: with TokenWriter(...) as writer:
    ```

    root: the directory of the log (`step=N/rank=R.parquet` under it).
    rank, world_size: this process's rank among the processes writing the same log; a step
      is complete (`_SUCCESS`) once `world_size` ranks of this run have committed it. One
      live writer per rank and directory (`.rank=R.lock`).
    run_id: one string shared by every rank of this run and new for each run (a job id and
      its restart count); default: MISMATCH_REPLAY_RUN_ID, torchrun's run id and restart
      count, or (one rank) a fresh uuid. Recorded in the markers and the files; the readers
      read a step only from the files of the run that committed it.
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
    strict: a failure on the writer's thread raises CaptureError from the next call (default
      False: the step is skipped with a CaptureWarning and the training loop goes on).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        rank: int = 0,
        world_size: int = 1,
        meta: Mapping | None = None,
        run_id: str | None = None,
        every: int = 1,
        max_tokens_per_step: int | None = None,
        seed: int = 0,
        max_pending: int = 4,
        compression: str = "zstd",
        fsync: bool = True,
        strict: bool = False,
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
        if run_id is None:
            run_id = default_run_id(world_size)
            if run_id is None:
                warnings.warn(
                    f"TokenWriter({root}, rank={rank}, world_size={world_size}): no run id. "
                    "Pass run_id= (one value on every rank, new for each run: e.g. the job id "
                    f"and restart count) or set {RUN_ID_ENV}; without it a rerun in this "
                    "directory with the same world size can complete a step with this run's "
                    "files and its own.",
                    CaptureWarning,
                    stacklevel=2,
                )
        elif not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
            raise ValueError(
                f"run_id={run_id!r}: 1-128 characters of letters, digits and ._:@+=- "
                "(starting with a letter or digit); pass the same string on every rank"
            )
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
        self.run_id = run_id
        self.every = every
        self.max_tokens_per_step = None if max_tokens_per_step is None else int(max_tokens_per_step)
        self.seed = int(seed)
        self.compression = compression
        self.fsync = fsync
        self.strict = bool(strict)
        self.meta = {
            "trainer_logprob": None,
            "temperature": None,
            "top_p": None,
            "framework": None,
            "framework_version": None,
            **meta,
            "rank": rank,
            "world_size": world_size,
            "run_id": run_id,
            "every": every,
            "max_tokens_per_step": self.max_tokens_per_step,
            "seed": self.seed,
            "writer": f"mismatch_replay.capture.TokenWriter {__version__}",
        }
        json.dumps(self.meta)  # fail here, not on the thread, if meta is not serialisable
        self.root.mkdir(parents=True, exist_ok=True)
        self._pid = os.getpid()  # a forked child inherits the object, not the thread
        self._lock_fd: int | None = None
        self._take_lock()
        # caller side
        self._step: int | None = None  # the step write() is filling
        self._done: set[int] = set()  # steps handed over for commit
        self._step_rows = 0  # rows seen in the current step (default sample ids)
        self._step_calls = 0
        self._budget: int | None = None
        self._signature: tuple | None = None  # columns, fixed by the first batch
        self._widths: dict[str, np.dtype] = {}  # float width per column in the current step
        self._closed = False
        self._close_sent = False  # _CLOSE is queued (a close() interrupted in its join)
        self._reported = False
        self._summarised = False  # close() said how many steps failed
        self._last_exc = _last_uncaught()  # an uncaught one before this writer (a notebook)
        self.failed_steps: list[tuple[int, str]] = []  # (step, cause), strict=False
        # the thread's side
        self._error: BaseException | None = None
        self._failures: list[tuple[int, BaseException]] = []  # appended by the thread
        self._skip: int | None = None  # a failed step whose later batches are dropped
        self._at: int | None = None  # the step the thread is working on
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

    # ------------------------------------------------------------------ the rank's lock

    def _take_lock(self) -> None:
        path = lock_file(self.root, self.rank)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:  # a read-only or foreign directory: the thread will say more
            if self.strict:
                raise CaptureError(f"{path}: cannot create the rank's lock file: {exc}") from exc
            warnings.warn(
                f"{path}: cannot create the rank's lock file ({exc}); writing without it, so a "
                "second writer of this rank would not be detected",
                CaptureWarning,
                stacklevel=3,
            )
            return
        try:
            held = self._flock(fd)
            prev = lock_holder(fd)
            if held is None:  # flock is not supported here: the pid in the file decides
                pid, host = prev.get("pid"), prev.get("host")
                if pid is None:
                    held = True  # released cleanly, or new
                elif host != _HOST:
                    held = True  # cannot check another host's pid: taken over, with a note
                else:
                    held = pid != self._pid and not pid_alive(int(pid))
            if not held:
                raise RankInUseError(self._in_use(path, prev))
            if prev.get("pid") is not None:
                log.warning(
                    "%s: took over the lock of rank %d left by pid %s on %s (started %s), "
                    "which did not close its writer (killed or crashed)",
                    path,
                    self.rank,
                    prev.get("pid"),
                    prev.get("host"),
                    prev.get("started"),
                )
            mine = {
                "pid": self._pid,
                "host": _HOST,
                "rank": self.rank,
                "world_size": self.world_size,
                "run_id": self.run_id,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(mine).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        _LIVE.add(self)

    @staticmethod
    def _flock(fd: int) -> bool | None:
        """True: locked; False: another open file holds it; None: flock unsupported."""
        if fcntl is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            return None
        return True

    def _in_use(self, path: Path, holder: dict) -> str:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
        if holder.get("pid") == self._pid and holder.get("host") == _HOST:
            who += " (this process: an earlier TokenWriter not closed)"
        return (
            f"{self.root}: rank {self.rank} is already being written by another TokenWriter "
            f"({who}, run {holder.get('run_id')}, since {holder.get('started', '?')}); two "
            "writers of one rank overwrite each other's files. Give each process its own "
            "rank= (its data-parallel rank) and world_size=, or close() the other writer "
            f"first. If no such process runs, delete {path}."
        )

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        _LIVE.discard(self)
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # an empty lock file: released cleanly, nothing to report
        with contextlib.suppress(OSError):
            os.close(fd)  # drops the flock

    def _forget_lock(self) -> None:
        """In a forked child: close the inherited descriptor without touching the lock (the
        parent still holds it through its own)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

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
        rewards=None,
    ) -> int:
        """Queue one batch of step `step`; returns the loss tokens queued (0 for a step that
        `every` skips).

        Per-token inputs are [B, T] (torch tensors on any device and in any float dtype, or
        numpy arrays) or ragged (a list of B per-sequence lists, arrays or 1-D tensors).
        mask: true (non-zero) at the loss tokens; None: every token. advantages: [B] or
        [B, T] (ragged: B values or B sequences). sample_ids: B ints or strings; default: the
        row's index (`rank * 1e9 + row`, rows of earlier calls of the step counted). env: one
        string or B strings. old_logprobs, entropy: optional per-token columns. rewards: B
        numbers, each sequence's reward (the `reward` column, on each of its tokens).
        Returns once the loss tokens are copied: the inputs may be reused at once."""
        self._check("write")
        step = inputs.check_step(step)
        if inputs.same_values(trainer_logprobs, inference_logprobs):
            raise ValueError(
                f"step {step}: trainer_logprobs and inference_logprobs are the same "
                f"{type(trainer_logprobs).__name__} (one object, or one storage): every ratio "
                "would be 1, nothing to compare. Pass the trainer's log-probs and the "
                "sampler's; to log equal values on purpose, pass a copy (x.clone())."
            )
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
        if rewards is not None:
            prep = inputs.add_rewards(prep, rewards)
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

    def close(self, commit: bool | None = None) -> None:
        """Commit the last step, stop the thread, release the rank's lock. commit=None (the
        default): commit unless an exception is propagating (close() in a `finally:` or an
        `except:` of a failed step), which drops the step in flight instead; True / False
        decide. Raises CaptureError if the thread failed with strict=True (unless a call
        already raised it); warns of the steps it skipped otherwise. Calling it again
        waits for the thread again if the first call was interrupted (Ctrl-C in its
        join); once it is done, it does nothing."""
        if os.getpid() != self._pid:
            self._closed = True
            return  # the parent's writer: its thread and files are the parent's
        if commit is None:
            commit = _clean_exit(sys.exc_info()[1])
        self._closed = True
        if not self._close_sent:
            atexit.unregister(self._close_at_exit)
            if self._step is not None:
                if commit:
                    self._done.add(self._step)
                self._put(("commit" if commit else "drop", self._step))
                self._step = None
            self._put(_CLOSE)
            self._close_sent = True
        self._thread.join()
        self._release_lock()
        self._report_failures(stacklevel=3)
        if len(self.failed_steps) > WARN_EACH and not self._summarised:
            self._summarised = True
            last = self.failed_steps[-1]
            warnings.warn(
                f"{self.root}: rank {self.rank} skipped {len(self.failed_steps)} step(s) in "
                f"all; the last, step {last[0]}: {last[1]}",
                CaptureWarning,
                stacklevel=2,
            )
        if self._error is not None and not self._reported:
            self._reported = True
            raise CaptureError(
                f"{self.root}: the background writer failed: {self._error}"
            ) from self._error

    def abort(self) -> None:
        """Stop without committing the step being written (steps handed over before are
        committed); what `with` does on an exception."""
        self.close(commit=False)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(commit=_clean_exit(exc))

    def _close_at_exit(self) -> None:
        last = _last_uncaught()  # set when the process ends on an uncaught exception
        crashed = last is not None and last is not self._last_exc
        try:
            self.close(commit=not crashed or _clean_exit(last))
        except CaptureError as e:  # at exit there is no caller left to raise to
            warnings.warn(str(e), CaptureWarning, stacklevel=1)

    def _check(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"TokenWriter({self.root}): {what}() after close()")
        if self._failures:
            self._report_failures(stacklevel=4)
        if self._error is not None:
            first = not self._reported
            self._reported = True
            msg = "the background writer failed" if first else "the writer failed earlier"
            raise CaptureError(f"{self.root}: {msg}: {self._error}") from self._error

    def _report_failures(self, stacklevel: int) -> None:
        """Warn (on the caller's thread) of the steps the thread skipped since last time."""
        while self._failures:
            step, exc = self._failures.pop(0)
            cause = f"{type(exc).__name__}: {exc}"
            self.failed_steps.append((step, cause))
            if len(self.failed_steps) > WARN_EACH:
                continue  # counted; close() says how many
            more = ""
            if len(self.failed_steps) == WARN_EACH:
                more = " Later failed steps are counted, not warned (failed_steps lists them)."
            warnings.warn(
                f"{self.root}: rank {self.rank} could not write step {step} ({cause}); the "
                "step is skipped (not published: readers leave it out) and the training loop "
                "goes on. Pass strict=True to raise CaptureError instead." + more,
                CaptureWarning,
                stacklevel=stacklevel,
            )

    def _end_step(self) -> None:
        if self._step is not None:
            self._done.add(self._step)
            self._put(("commit", self._step))
            self._step = None

    def _put(self, item) -> None:
        """Blocks while max_pending batches wait (the memory bound); never on a stopped
        thread."""
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    return

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
            self._at = None  # the step the item concerns, for a failure's warning
            try:
                self._handle(item)
            except BaseException as exc:  # kept for the caller, never lost
                self._fail(self._at, exc)
            finally:
                self._queue.task_done()
            if item is _CLOSE:
                return

    def _handle(self, item) -> None:
        if item is _CLOSE:
            if self._error is None:
                self._at = self._file_step
                self._commit()
            return
        if self._error is not None:
            return  # a failed strict writer discards what it is given
        if isinstance(item, tuple):  # ("commit" | "drop", step)
            kind, self._at = item
            if self._file_step == self._at:
                if kind == "commit":
                    self._commit()
                else:
                    self._abort()
            if self._skip == self._at:
                self._skip = None  # the failed step is over
            return
        self._at = item.step
        if self._skip == item.step:
            return  # the rest of a failed step
        self._skip = None
        if self._file_step is not None and self._file_step != item.step:
            prev = self._file_step  # not handed over (write() always does): committed first
            try:
                self._commit()
            except BaseException as exc:
                self._fail(prev, exc)
                if self._error is not None:
                    return
            self._skip = None
        self._append(item)

    def _fail(self, step: int | None, exc: BaseException) -> None:
        """Drop the open step; strict: keep the error (raised by the next call), else: keep
        the failure (warned by the next call) and skip the rest of the step."""
        self._abort()
        if self.strict:
            self._error = exc
        else:
            self._failures.append((step, exc))
            self._skip = step

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
        if "reward" in p.per_row:
            cols["reward"] = pa.array(p.per_row["reward"][rows])
        return pa.table(cols)

    def _write_held(self) -> None:
        if self._held:
            table = self._held[0] if len(self._held) == 1 else pa.concat_tables(self._held)
            self._file.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._held, self._held_rows = [], 0

    def _open(self, step: int, schema: pa.Schema) -> None:
        d = step_dir(self.root, step)
        d.mkdir(parents=True, exist_ok=True)
        # a step rewritten after a resume is not complete: its _SUCCESS goes first, then this
        # rank's marker, before this rank's file is replaced
        for stale in (d / COMMIT_MARKER, rank_marker(self.root, step, self.rank)):
            stale.unlink(missing_ok=True)
        meta = {**self.meta, "step": step}
        self._schema = schema.with_metadata({META_KEY: json.dumps(meta)})
        self._tmp = d / f".rank={self.rank}.parquet.tmp"
        self._file_step = step  # before the file exists: a failure here names the step
        self._file = pq.ParquetWriter(
            self._tmp,
            self._schema,
            compression=self.compression,
            use_dictionary=[c for c in ("step", "sample_id", "env") if c in schema.names],
        )
        self._counts = dict.fromkeys(
            ("calls", "sequences_seen", "sequences_written", "tokens_seen", "tokens_written"), 0
        )

    def _commit(self) -> None:
        """Close, fsync and rename the open step's file; write the rank's marker, and publish
        the step's marker when every rank of this run has committed the step."""
        if self._file is None:
            return
        step, d = self._file_step, step_dir(self.root, self._file_step)
        self._write_held()
        self._file.add_key_value_metadata({STEP_META_KEY: json.dumps(self._counts)})
        self._file.close()
        self._file = None
        final = rank_file(self.root, step, self.rank)
        if self.fsync:
            fsync_file(self._tmp)
        os.replace(self._tmp, final)
        self._file_step = None
        if self.fsync:
            fsync_dir(d)
        mine = {"run_id": self.run_id, "world_size": self.world_size, "step": step}
        tag = f"rank{self.rank}"
        write_marker(
            rank_marker(self.root, step, self.rank),
            {**mine, "rank": self.rank, **self._counts},
            self.fsync,
            tag,
        )
        if self._all_committed(step, mine):
            publish(d / COMMIT_MARKER, mine, self.fsync, tag)
        if self.fsync:
            fsync_dir(d)

    def _all_committed(self, step: int, mine: dict) -> bool:
        """Every rank's marker of this step is there, from this run (run id, world size)."""
        for r in range(self.world_size):
            if r == self.rank:
                continue
            m = read_json(rank_marker(self.root, step, r))
            if m is None or any(m.get(k) != v for k, v in mine.items()):
                return False
        return True

    def _abort(self) -> None:
        """After an error, or a step dropped: delete the open step's temporary (its temp name
        is never read); no marker is written."""
        f, self._file = self._file, None
        step, self._file_step = self._file_step, None
        self._held, self._held_rows = [], 0
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()
        if step is not None:
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
