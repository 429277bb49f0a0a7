"""gcpause: a job's collector passes skip the objects it found (`frozen`), a figure's skip
the collector altogether (`paused`); both give the process back as it was."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest

from mismatch_replay import gcpause


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def test_frozen_moves_what_exists_out_of_the_passes_and_back():
    assert gc.get_freeze_count() == 0
    before = len(gc.get_objects(generation=2))
    with gcpause.frozen():
        assert gc.get_freeze_count() >= before > 1000
        assert len(gc.get_objects(generation=2)) < before / 10
    assert gc.get_freeze_count() == 0
    assert len(gc.get_objects(generation=2)) >= before * 0.9


def test_a_frozen_jobs_own_cyclic_garbage_is_still_collected():
    with gcpause.frozen():
        node = _Node()
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None


def test_nested_and_threaded_jobs_unfreeze_once_at_the_end(monkeypatch):
    """Only the outermost job freezes and unfreezes: a nested job and one in a thread call
    neither. (The calls are counted, not `gc.get_freeze_count()` compared: a frozen object
    can die by its reference count while frozen: starting a thread frees the released locks
    of non-daemon threads that ended unjoined in earlier tests, so the count may drop.)"""
    calls = []
    real_freeze, real_unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gcpause.gc, "freeze", lambda: (calls.append("freeze"), real_freeze()))
    monkeypatch.setattr(gcpause.gc, "unfreeze", lambda: (calls.append("unfreeze"), real_unfreeze()))
    started, go = threading.Event(), threading.Event()

    def job():
        with gcpause.frozen():
            started.set()
            go.wait(5)

    t = threading.Thread(target=job)
    try:
        with gcpause.frozen():
            assert calls == ["freeze"]
            assert gc.get_freeze_count() > 1000
            t.start()
            assert started.wait(5)
            with gcpause.frozen():
                assert calls == ["freeze"]  # the nested job froze nothing again
            assert calls == ["freeze"]  # the inner job ended, the outer one still runs
            assert gc.get_freeze_count() > 1000
            go.set()
            t.join(5)
            assert not t.is_alive()
            assert calls == ["freeze"]  # so did the thread's: still frozen
            assert gc.get_freeze_count() > 1000
        assert calls == ["freeze", "unfreeze"]
        assert gc.get_freeze_count() == 0
    finally:  # a failure above must not leave the thread inside frozen() for the next tests
        go.set()
        if t.ident is not None:
            t.join(5)


def test_someone_elses_freeze_is_left_alone():
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        with gcpause.frozen():
            pass
        assert gc.get_freeze_count() >= theirs  # not unfrozen by us
    finally:
        gc.unfreeze()


def test_frozen_unfreezes_on_an_exception():
    with pytest.raises(RuntimeError), gcpause.frozen():
        raise RuntimeError
    assert gc.get_freeze_count() == 0


def test_paused_restores_the_collector_as_it_was():
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), gcpause.paused():
        raise RuntimeError
    assert gc.isenabled()


def test_the_jobs_run_frozen(tmp_path, monkeypatch):
    """`viz.jobs.report` runs inside `frozen()` (what the report's figures and tables
    allocate is walked; the imported modules are not)."""
    from mismatch_replay.viz import jobs

    seen = []

    def spy(*a, **k):
        seen.append(gc.get_freeze_count())
        raise RuntimeError("stop here")

    monkeypatch.setattr(jobs.analysis, "report_data", spy)
    with pytest.raises(RuntimeError, match="stop here"):
        jobs.report([tmp_path / "x.parquet"], tmp_path / "out", command="t", figure_process=False)
    assert seen and seen[0] > 1000
    assert gc.get_freeze_count() == 0


GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"


@pytest.mark.parametrize(
    "job",
    ["sweep", "choose", "compare", pytest.param("plot", marks=pytest.mark.slow)],  # every figure
)
def test_the_library_jobs_run_frozen(job, monkeypatch, tmp_path):
    """engine.sweep, analysis.choose and compare, viz.jobs.plot freeze what they find once
    (the outermost job: the calls inside them do not freeze again) and give it back."""
    from mismatch_replay import analysis, engine
    from mismatch_replay.viz import jobs

    calls = []
    real_freeze, real_unfreeze = gc.freeze, gc.unfreeze
    monkeypatch.setattr(gcpause.gc, "freeze", lambda: (calls.append("freeze"), real_freeze()))
    monkeypatch.setattr(gcpause.gc, "unfreeze", lambda: (calls.append("unfreeze"), real_unfreeze()))
    {
        "sweep": lambda: engine.sweep([GOLDEN]),
        "choose": lambda: analysis.choose([GOLDEN], 0.01, ["ipo"], bootstrap=20),
        "compare": lambda: analysis.compare([GOLDEN], "ipo", "icepop", budget=0.01),
        "plot": lambda: jobs.plot([GOLDEN], tmp_path / "p", figure_process=False),
    }[job]()
    assert calls == ["freeze", "unfreeze"]
    assert gc.get_freeze_count() == 0
