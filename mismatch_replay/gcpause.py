"""The cyclic garbage collector kept off what a job did not make.

Design
------
A full pass of CPython's collector walks every tracked object of the process, and once
numba, polars and matplotlib are imported that is a few hundred thousand objects: 0.05-0.15 s
a pass, two or three of them in a report. Two tools (tests/test_gcpause.py):

* `frozen()`, around a whole job (`engine.sweep`, `analysis.choose` and `compare`,
  `viz.jobs.report` and `plot`, and so the commands that run them): the objects that exist
  when the job starts go to the collector's permanent generation (`gc.freeze`) and come
  back when it ends (`gc.unfreeze`), so the passes in between walk only what the job made,
  and still free its cyclic garbage as they go. Only the outermost job of the process freezes (a
  depth count, under a lock, for jobs in threads), and none where something else froze
  objects already (`gc.get_freeze_count()`): their freeze is theirs to undo.
* `paused()` (a context and a decorator), around building or drawing one figure: the
  collector off altogether, back as it was afterwards; a figure allocates tens of thousands
  of containers, enough for a full pass every figure or two, and its garbage simply waits
  for the next pass after it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # jobs inside `frozen()` now
_froze = False  # whether the outermost one froze (nobody else had)


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Run a job with the objects that exist now out of the collector's passes."""
    global _depth, _froze
    with _lock:
        if _depth == 0:
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _froze:
                gc.unfreeze()
                _froze = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off while a figure is built or drawn, back as it was afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = ["frozen", "paused"]
