"""capture: several TokenWriter ranks, as data-parallel ranks run them, and the runs that share
a directory.

The lockstep tests run each rank in its own process (multiprocessing, spawn): it writes its
share of every step and calls flush(), then waits at a barrier, as ranks meet at a collective;
the ranks then commit together, which made two ranks publish `_SUCCESS` through one temporary
name (issue 37: "No such file or directory: step=9/._SUCCESS.tmp"). The reader's token count
must be what the ranks wrote, with no warning on any rank. The same for ranks committing in
every order, for a rank killed mid-step, for two writers of one rank (refused), and for a rerun
in the same directory with another world size or a resumed step (only one run's files are
read)."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import multiprocessing as mp
import os
import signal
import threading
import warnings

import numpy as np
import pytest

from mismatch_replay import ingest
from mismatch_replay.capture import (
    CaptureWarning,
    RankInUseError,
    TokenWriter,
    lock_file,
    rank_file,
    rank_marker,
    step_dir,
)
from mismatch_replay.capture import commit as commit_mod
from mismatch_replay.capture import writer as writer_mod
from mismatch_replay.errors import DataError

CTX = mp.get_context("spawn")


def _batch(rank: int, step: int, salt: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small batch whose loss-token count depends on the rank, the step and `salt`."""
    rows = 1 + (rank + step + salt) % 3
    lp = np.full((rows, 4), -0.25 - 0.01 * salt)
    mask = np.zeros((rows, 4), dtype=bool)
    mask[:, : 1 + (step + rank + salt) % 4] = True
    return lp, mask


def _expected(ranks, steps, salt=0) -> int:
    return sum(int(_batch(r, s, salt)[1].sum()) for r in ranks for s in steps)


def _write(w: TokenWriter, step: int, salt: int = 0) -> int:
    lp, mask = _batch(w.rank, step, salt)
    return w.write(step, lp, lp - 0.01, mask=mask)


def _read(root, **kw):
    return ingest.read_table([root], ingest.ReadOptions(**kw))


def _read_quietly(root):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ingest.IngestWarning)
        return _read(root)


def _notes(root) -> list[str]:
    report = ingest.ReadReport()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ingest.IngestWarning)
        ingest.read_table([root], report=report)
    return report.warnings


# ----------------------------------------------------------------------------- lockstep


def _lockstep(root, rank, world, steps, barrier, out, run_id, fsync):
    """One rank: write() + flush() per step, then the barrier (in a child process)."""
    os.environ["MISMATCH_REPLAY_RUN_ID"] = run_id  # the old writer ignores it
    written, error = 0, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            w = TokenWriter(root, rank=rank, world_size=world, fsync=fsync)
            for step in range(steps):
                written += _write(w, step)
                w.flush()
                barrier.wait(60)
            w.close()
        except BaseException as exc:  # reported to the test, which fails on it
            error = f"{type(exc).__name__}: {exc}"
            barrier.abort()
    out.put((rank, written, error, [str(x.message) for x in caught]))


def _run_ranks(target, world, args, timeout=120) -> list[tuple]:
    out = CTX.Queue()
    procs = [CTX.Process(target=target, args=(*args(r, out),)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout)
    return results


def _check_lockstep(root, world, steps, fsync):
    barrier = CTX.Barrier(world)
    results = _run_ranks(
        _lockstep, world, lambda r, out: (root, r, world, steps, barrier, out, "ls", fsync)
    )
    errors = [(r, e) for r, _, e, _ in results if e]
    assert not errors, errors
    assert not [(r, w) for r, _, _, w in results if w]  # no rank skipped a step
    written = sum(n for _, n, _, _ in results)
    assert written == _expected(range(world), range(steps))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ingest.IngestWarning)  # no step may be left out
        assert _read(root).height == written
    assert all((step_dir(root, s) / "_SUCCESS").exists() for s in range(steps))
    assert not [p for p in root.rglob(".*.tmp")]  # every temporary is gone


@pytest.mark.slow  # two rank processes
def test_two_ranks_in_lockstep_publish_every_step(tmp_path):
    _check_lockstep(tmp_path, 2, 40, fsync=False)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "steps"), [(2, 300), (4, 200), (8, 100)])
def test_ranks_in_lockstep_with_fsync_publish_every_step(tmp_path, world, steps):
    """The issue's repro (fsync on, as by default: the marker's fsync widens the window in
    which both ranks held `._SUCCESS.tmp`): it failed within 1-20 steps at 2, 4 and 8 ranks."""
    _check_lockstep(tmp_path, world, steps, fsync=True)


def test_two_ranks_that_publish_at_the_same_moment_both_succeed(tmp_path, monkeypatch):
    """Both ranks find every marker, and both write their `_SUCCESS` temporaries before either
    links it: one links, the other finds it there (same run) and is done."""
    both_see = threading.Barrier(2, timeout=10)
    both_wrote = threading.Barrier(2, timeout=10)
    all_committed, write_temp = TokenWriter._all_committed, commit_mod.write_temp

    def see(self, step, mine):
        both_see.wait()  # both markers are written
        return all_committed(self, step, mine)

    def wrote(tmp, payload, fsync):
        write_temp(tmp, payload, fsync)
        if tmp.name.startswith("._SUCCESS.") and ".rank=" not in tmp.name:
            both_wrote.wait()

    monkeypatch.setattr(TokenWriter, "_all_committed", see)
    monkeypatch.setattr(commit_mod, "write_temp", wrote)
    ws = [TokenWriter(tmp_path, rank=r, world_size=2, run_id="x", fsync=False) for r in (0, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for w in ws:
            _write(w, 0)
            w.commit()
        for w in ws:
            w.close()
    assert json.loads((step_dir(tmp_path, 0) / "_SUCCESS").read_text()) == {
        "run_id": "x",
        "world_size": 2,
        "step": 0,
    }
    assert _read(tmp_path).height == _expected([0, 1], [0])
    assert sorted(p.name for p in step_dir(tmp_path, 0).iterdir()) == [
        "_SUCCESS",
        "_SUCCESS.rank=0",
        "_SUCCESS.rank=1",
        "rank=0.parquet",
        "rank=1.parquet",
    ]


def test_without_hard_links_the_step_is_published_by_a_rename(tmp_path, monkeypatch):
    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(writer_mod.os, "link", no_link)
    ws = [TokenWriter(tmp_path, rank=r, world_size=2, run_id="x", fsync=False) for r in (0, 1)]
    for w in ws:
        _write(w, 0)
        w.close()
    assert (step_dir(tmp_path, 0) / "_SUCCESS").exists()
    assert _read(tmp_path).height == _expected([0, 1], [0])


# ----------------------------------------------------------------------------- every order


def test_three_ranks_committing_in_every_order(tmp_path):
    """Only the last rank to commit a step publishes it, whichever it is (one process)."""
    ws = [TokenWriter(tmp_path, rank=r, world_size=3, run_id="o", fsync=False) for r in range(3)]
    orders = list(itertools.permutations(range(3)))
    for step, order in enumerate(orders):
        for k, r in enumerate(order):
            _write(ws[r], step)
            ws[r].flush()
            assert (step_dir(tmp_path, step) / "_SUCCESS").exists() == (k == 2), (order, k)
    for w in ws:
        w.close()
    assert _read(tmp_path).height == _expected(range(3), range(len(orders)))


def _in_turn(root, rank, world, steps, turn, cond, out):
    """One rank of three: at step s the ranks commit in the order permutations[s % 6]."""
    orders = list(itertools.permutations(range(world)))
    error, written = None, 0
    try:
        w = TokenWriter(root, rank=rank, world_size=world, run_id="turns", fsync=False)
        for step in range(steps):
            k = orders[step % len(orders)].index(rank)
            with cond:
                mine = step * world + k
                if not cond.wait_for(lambda mine=mine: turn.value == mine, 60):
                    raise TimeoutError(f"rank {rank} waited for its turn at step {step}")
            written += _write(w, step)
            w.flush()
            published = (step_dir(root, step) / "_SUCCESS").exists()
            if published != (k == world - 1):
                raise AssertionError(f"step {step}, {k + 1}th to commit: _SUCCESS {published}")
            with cond:
                turn.value += 1
                cond.notify_all()
        w.close()
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.put((rank, written, error))


@pytest.mark.slow
def test_three_rank_processes_arriving_in_every_order(tmp_path):
    turn, cond = CTX.Value("i", 0), CTX.Condition()
    steps = 30  # every permutation of 3 ranks, 5 times
    results = _run_ranks(_in_turn, 3, lambda r, out: (tmp_path, r, 3, steps, turn, cond, out))
    assert not [e for _, _, e in results if e], results
    assert sum(n for _, n, _ in results) == _expected(range(3), range(steps))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ingest.IngestWarning)
        assert _read(tmp_path).height == _expected(range(3), range(steps))


# ----------------------------------------------------------------------------- a rank killed


def _killed_mid_step(root, steps, ready):
    """Rank 1 of 2: commits steps 0..steps-1, writes half of the next one, then waits to be
    killed (SIGKILL: no atexit, no finally)."""
    w = TokenWriter(root, rank=1, world_size=2, run_id="first", fsync=False)
    for step in range(steps):
        _write(w, step)
        w.flush()
    _write(w, steps)
    w._queue.join()  # step `steps` is in its temporary, not committed
    ready.set()
    threading.Event().wait(60)


@pytest.mark.slow
def test_a_rank_killed_mid_step_leaves_it_unpublished_and_a_new_run_works(tmp_path, caplog):
    k = 3
    ready = CTX.Event()
    child = CTX.Process(target=_killed_mid_step, args=(tmp_path, k, ready))
    child.start()
    w0 = TokenWriter(tmp_path, rank=0, world_size=2, run_id="first", fsync=False)
    for step in range(k + 1):
        _write(w0, step)
        w0.flush()
    w0.close()
    assert ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
    assert not (step_dir(tmp_path, k) / "_SUCCESS").exists()
    assert (step_dir(tmp_path, k) / ".rank=1.parquet.tmp").exists()  # hidden from readers
    assert json.loads(lock_file(tmp_path, 1).read_text())["pid"] == child.pid
    notes = _notes(tmp_path)
    assert any("skipped 1 captured step" in n and f"step={k}" in n for n in notes), notes
    assert _read_quietly(tmp_path).height == _expected([0, 1], range(k))
    # a new run in the same directory: rank 1's lock is taken over, with a note
    with caplog.at_level(logging.WARNING, logger=writer_mod.__name__):
        ws = [
            TokenWriter(tmp_path, rank=r, world_size=2, run_id="second", fsync=False)
            for r in (0, 1)
        ]
    assert any(f"left by pid {child.pid}" in r.getMessage() for r in caplog.records)
    for step in range(k + 2):
        for w in ws:
            _write(w, step, salt=1)
            w.flush()
    for w in ws:
        w.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ingest.IngestWarning)
        assert _read(tmp_path).height == _expected([0, 1], range(k + 2), salt=1)


# ----------------------------------------------------------------------------- one writer a rank


def test_a_second_live_writer_of_the_same_rank_is_refused(tmp_path):
    first = TokenWriter(tmp_path, rank=0, world_size=2, run_id="a", fsync=False)
    with pytest.raises(RankInUseError) as e:
        TokenWriter(tmp_path, rank=0, world_size=2, run_id="a", fsync=False)
    msg = str(e.value)
    assert str(tmp_path) in msg and "rank 0" in msg and f"pid {os.getpid()}" in msg
    assert "rank=" in msg and "this process" in msg
    TokenWriter(tmp_path, rank=1, world_size=2, run_id="a", fsync=False).close()  # other rank
    first.close()
    TokenWriter(tmp_path, rank=0, world_size=2, run_id="a", fsync=False).close()  # released
    assert lock_file(tmp_path, 0).read_text() == ""  # closed cleanly: nothing to take over


def _hold_rank(root, ready, release):
    w = TokenWriter(root, rank=0, run_id="holder", fsync=False)
    ready.set()
    release.wait(60)
    w.close()


@pytest.mark.slow
def test_a_writer_in_another_process_holding_the_rank_is_named(tmp_path):
    ready, release = CTX.Event(), CTX.Event()
    child = CTX.Process(target=_hold_rank, args=(tmp_path, ready, release))
    child.start()
    try:
        assert ready.wait(60)
        with pytest.raises(RankInUseError, match=rf"rank 0 .*pid {child.pid} .*rank="):
            TokenWriter(tmp_path, rank=0, run_id="other", fsync=False)
    finally:
        release.set()
        child.join(30)
    TokenWriter(tmp_path, rank=0, run_id="other", fsync=False).close()


def test_a_lock_left_by_a_dead_writer_is_taken_over_with_a_note(tmp_path, caplog):
    holder = {"pid": 999_999_999, "host": "gone", "run_id": "old", "started": "yesterday"}
    lock_file(tmp_path, 0).write_text(json.dumps(holder))  # not flock'ed: its process died
    with caplog.at_level(logging.WARNING, logger=writer_mod.__name__):
        TokenWriter(tmp_path, run_id="new", fsync=False).close()
    assert any("left by pid 999999999 on gone" in r.getMessage() for r in caplog.records)


def test_without_flock_a_live_pid_on_this_host_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(TokenWriter, "_flock", staticmethod(lambda fd: None))
    live = {"pid": os.getppid(), "host": writer_mod._HOST}
    lock_file(tmp_path, 0).write_text(json.dumps(live))
    with pytest.raises(RankInUseError, match=f"pid {os.getppid()}"):
        TokenWriter(tmp_path, run_id="x", fsync=False)
    dead = {"pid": 999_999_999, "host": writer_mod._HOST}
    lock_file(tmp_path, 0).write_text(json.dumps(dead))
    TokenWriter(tmp_path, run_id="x", fsync=False).close()


# ----------------------------------------------------------------------------- runs


def test_a_rerun_with_a_smaller_world_reads_only_the_new_runs_files(tmp_path):
    """world_size 4 -> 2 in one directory: the old ranks 2 and 3 stay on disk, unread."""
    steps = range(5)
    old = [TokenWriter(tmp_path, rank=r, world_size=4, run_id="a", fsync=False) for r in range(4)]
    for step in steps:
        for w in old:
            _write(w, step)
    for w in old:
        w.close()
    assert _read(tmp_path).height == _expected(range(4), steps)
    new = [TokenWriter(tmp_path, rank=r, world_size=2, run_id="b", fsync=False) for r in (0, 1)]
    for step in steps:
        for w in new:
            _write(w, step, salt=1)
    for w in new:
        w.close()
    assert rank_file(tmp_path, 0, 3).exists()  # the earlier run's file is still there
    with pytest.warns(ingest.IngestWarning, match=r"left out 10 file\(s\) of an earlier run"):
        got = _read(tmp_path)
    assert got.height == _expected([0, 1], steps, salt=1)
    assert (got["trainer_logprob"] == -0.26).all()  # salt 1: only the new run's values


def test_a_resumed_step_committed_by_rank_0_first_does_not_revive_rank_1s_old_file(tmp_path):
    run_a = [TokenWriter(tmp_path, rank=r, world_size=2, run_id="a", fsync=False) for r in (0, 1)]
    for step in range(3):
        for w in run_a:
            _write(w, step)
    for w in run_a:
        w.close()
    run_b = [TokenWriter(tmp_path, rank=r, world_size=2, run_id="b", fsync=False) for r in (0, 1)]
    _write(run_b[0], 2, salt=1)  # the resumed run rewrites step 2, rank 0 first
    run_b[0].flush()
    assert not (step_dir(tmp_path, 2) / "_SUCCESS").exists()  # rank 1's marker is run a's
    with pytest.warns(ingest.IngestWarning, match=r"skipped 1 captured step.*step=2"):
        assert _read(tmp_path).height == _expected([0, 1], [0, 1])
    _write(run_b[1], 2, salt=1)
    for w in run_b:
        w.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ingest.IngestWarning)
        got = _read(tmp_path)
    assert got.height == _expected([0, 1], [0, 1]) + _expected([0, 1], [2], salt=1)
    assert (got.filter(got["step"] == 2)["trainer_logprob"] == -0.26).all()


def test_the_markers_record_the_run_id_and_world_size(tmp_path):
    with TokenWriter(tmp_path, rank=0, world_size=1, run_id="job-7.r0", fsync=False) as w:
        _write(w, 0)
    assert json.loads((step_dir(tmp_path, 0) / "_SUCCESS").read_text()) == {
        "run_id": "job-7.r0",
        "world_size": 1,
        "step": 0,
    }
    mine = json.loads(rank_marker(tmp_path, 0, 0).read_text())
    assert mine["run_id"] == "job-7.r0" and mine["world_size"] == 1 and mine["rank"] == 0
    assert writer_mod.read_meta(rank_file(tmp_path, 0, 0))["run_id"] == "job-7.r0"


def test_the_default_run_id(tmp_path, monkeypatch):
    for var in ("MISMATCH_REPLAY_RUN_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    one, two = writer_mod.default_run_id(1), writer_mod.default_run_id(1)
    assert one != two and len(one) == 32  # one rank: a fresh uuid each time
    assert writer_mod.default_run_id(4) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default --rdzv-id
    assert writer_mod.default_run_id(4) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert writer_mod.default_run_id(4) == "torchelastic-3f2a-r2"
    monkeypatch.setenv("MISMATCH_REPLAY_RUN_ID", "mine")
    assert writer_mod.default_run_id(4) == "mine"
    monkeypatch.delenv("MISMATCH_REPLAY_RUN_ID")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with pytest.warns(CaptureWarning, match="no run id. Pass run_id="):
        TokenWriter(tmp_path, rank=1, world_size=2, fsync=False).close()
    with pytest.raises(ValueError, match="run_id="):
        TokenWriter(tmp_path, run_id="a/b", fsync=False)


def test_markers_of_older_writers_and_empty_ones_are_read(tmp_path):
    """A `_SUCCESS` without a run id (older writers: step and world size) still limits the
    ranks to its world size; an empty one (`touch _SUCCESS`) reads every rank file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)  # no run id
        for r in range(3):
            with TokenWriter(tmp_path, rank=r, world_size=3, fsync=False) as w:
                _write(w, 0)
    marker = step_dir(tmp_path, 0) / "_SUCCESS"
    marker.write_text(json.dumps({"step": 0, "world_size": 2}))
    with pytest.warns(ingest.IngestWarning, match=r"rank\(s\) 2 at or beyond the world size 2"):
        assert _read(tmp_path).height == _expected([0, 1], [0])
    marker.write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ingest.IngestWarning)
        assert _read(tmp_path).height == _expected(range(3), [0])


def test_a_marker_of_another_run_than_a_ranks_file_skips_the_step(tmp_path):
    ws = [TokenWriter(tmp_path, rank=r, world_size=2, run_id="a", fsync=False) for r in (0, 1)]
    for step in range(2):
        for w in ws:
            _write(w, step)
    for w in ws:
        w.close()
    m = rank_marker(tmp_path, 1, 1)
    m.write_text(json.dumps({**json.loads(m.read_text()), "run_id": "b"}))
    with pytest.warns(ingest.IngestWarning, match=r"skipped 1 captured step.*another run"):
        assert _read(tmp_path).height == _expected([0, 1], [0])
    for step in range(2):
        m = rank_marker(tmp_path, step, 1)
        m.write_text(json.dumps({**json.loads(m.read_text()), "run_id": "b"}))
    with pytest.raises(DataError, match="another run"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ingest.IngestWarning)
        _read(tmp_path)


def test_a_lock_file_that_cannot_be_opened_warns_and_strict_refuses(tmp_path):
    lock_file(tmp_path, 0).mkdir()  # a directory where the lock file goes: open() fails
    with pytest.warns(CaptureWarning, match="cannot create the rank's lock file"):
        w = TokenWriter(tmp_path, run_id="x", fsync=False)
    _write(w, 0)
    w.close()
    assert _read(tmp_path).height == _expected([0], [0])  # the log is still written
    with pytest.raises(writer_mod.CaptureError, match="cannot create the rank's lock file"):
        TokenWriter(tmp_path, run_id="x", fsync=False, strict=True)
