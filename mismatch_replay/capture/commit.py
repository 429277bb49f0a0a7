"""The capture log's protocol on disk: paths, commit markers, the run id, the rank's lock file.

Design
------
TokenWriter (writer.py) encodes the rows; this module decides what a reader may take for a
whole step, and how several ranks agree on it without talking to each other. Everything
here is a plain function of paths and JSON payloads, so that the protocol reads in one
place and the ranks' races can be tested on it (tests/test_capture_ranks.py).

**Atomic commit, per step and rank.** Rows of step N go to `step=N/.rank=R.parquet.tmp` (a
dot name, which every reader skips); when the loop moves on to another step (or on `commit()`,
`flush()`, `close()`), the file is closed, fsync'ed and renamed to `step=N/rank=R.parquet`, and
the rank's marker `step=N/_SUCCESS.rank=R` is written (JSON: run id, world size, step, counts).
The rank that then finds every rank's marker of *this run* (`world_size` of them, each with
this run's id and world size) publishes `step=N/_SUCCESS` (run id, world size, step). Several
ranks may find them at once (ranks in lockstep commit together): each writes its own
temporary (`._SUCCESS.<host>-<pid>-<rank>.tmp`) and hard-links it to `_SUCCESS`; "already
there, same run" counts as done, so publishing is idempotent and never fails a rank (a
filesystem without hard links gets an atomic rename of the rank's own temporary). A rename
is atomic, so a reader sees either no file or a whole one; the readers (`ingest.sources`)
read a step directory only once it holds `_SUCCESS`, and then only the rank files that
`_SUCCESS`'s run committed (ranks below its world size whose markers carry its run id): the
files of an earlier run in the same directory (a larger world size, a resume) are left out
with a note. A step rewritten by a later run (a resume) first loses its `_SUCCESS` and this
rank's marker, then is committed again once every rank of the new run has committed it: an
old marker of another rank never completes it.

**Run id.** All ranks of one run must record the same id, and a rerun a new one, without
talking to each other: `run_id=` (pass one value on every rank, e.g. the job id and its
restart count), else the environment variable MISMATCH_REPLAY_RUN_ID, else torchrun's
`TORCHELASTIC_RUN_ID` with `TORCHELASTIC_RESTART_COUNT` (a fresh uuid per single-node launch,
the `--rdzv-id` of a multi-node one; its default "none" is not taken), else for one rank a
fresh uuid. Several ranks with none of these get no run id, and a warning: the world size
still tells runs apart, a rerun with the same one does not. (A rendezvous through the
directory, rank 0 writing the id for the others to read, cannot tell a fresh file from the
last run's without an id shared beforehand, so it is not attempted.)


**Markers are written through a temporary** (`temp_twin`: a dot name with the host, pid and a
tag, so that no two ranks or processes share one): a rank's own marker is replaced
atomically (`write_marker`), the step's `_SUCCESS` hard-linked (`publish`, above). With
`fsync` each temporary is fsync'ed before the rename, and the writer fsyncs the step's
directory after it (`fsync_dir`; a filesystem that cannot open a directory skips it).

**The rank's lock file** `root/.rank=R.lock` (`lock_file`) holds its writer's pid, host,
rank, world size, run id and start time as JSON (`lock_holder` reads it; empty once a
writer closed cleanly); the writer takes and releases the flock (writer.py, "One writer
per rank"), and where flock is unsupported decides on `pid_alive` for a holder on this
`HOST`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import uuid
from pathlib import Path

from ..ingest import COMMIT_MARKER
from ..output import pid_alive  # noqa: F401  (the writer's lock reads it from here)

RUN_ID_ENV = "MISMATCH_REPLAY_RUN_ID"
RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}")
HOST = socket.gethostname()


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step={step}"


def rank_file(root: str | Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"rank={rank}.parquet"


def rank_marker(root: str | Path, step: int, rank: int) -> Path:
    return step_dir(root, step) / f"{COMMIT_MARKER}.rank={rank}"


def lock_file(root: str | Path, rank: int) -> Path:
    return Path(root) / f".rank={rank}.lock"


def read_json(path: Path) -> dict | None:
    """A marker's JSON, None when it is missing or not a JSON object (an empty `_SUCCESS`)."""
    try:
        with open(path, "rb") as f:
            out = json.loads(f.read() or b"null")
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def fsync_dir(d: Path) -> None:
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


def fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_twin(path: Path, tag: str) -> Path:
    """A temporary beside `path` that no other rank or process uses: a dot name (readers skip
    it), with the host, pid and `tag`."""
    return path.with_name(f".{path.name}.{HOST}-{os.getpid()}-{tag}.tmp")


def write_temp(tmp: Path, payload: dict, fsync: bool) -> None:
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def write_marker(path: Path, payload: dict, fsync: bool, tag: str) -> None:
    """A marker that one writer owns (its rank's), replaced atomically."""
    tmp = temp_twin(path, tag)
    try:
        write_temp(tmp, payload, fsync)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


NO_LINK = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV, errno.EMLINK}


def publish(path: Path, payload: dict, fsync: bool, tag: str) -> None:
    """A marker that several ranks may publish at once (the step's `_SUCCESS`): each links its
    own temporary to it; one already there for the same run counts as published."""
    tmp = temp_twin(path, tag)
    write_temp(tmp, payload, fsync)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            have = read_json(path) or {}
            if any(have.get(k) != payload[k] for k in ("run_id", "world_size", "step")):
                os.replace(tmp, path)  # an earlier run's marker that survived: this run's wins
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise
            os.replace(tmp, path)  # no hard links here: the rank's own temporary, renamed
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def default_run_id(world_size: int) -> str | None:
    """The run id when none is given (see "Run id" in the module docstring)."""
    env = os.environ
    if env.get(RUN_ID_ENV):
        return env[RUN_ID_ENV]
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic.lower() != "none":
        return f"torchelastic-{elastic}-r{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if world_size == 1:
        return uuid.uuid4().hex
    return None


def lock_holder(fd: int) -> dict:
    """What a lock file says of its writer ({} when empty: released cleanly)."""
    try:
        raw = os.pread(fd, 4096, 0)
        out = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}
