"""Figures drawn in a second process while this one draws the others.

Design
------
Drawing the five figures costs matplotlib ~1.7 s of one core whatever the log's size
(layout and text, not data), and matplotlib holds the GIL while it draws: threads cannot
share the work, a second process can. `FigurePool` starts one helper process
(`python -m mismatch_replay.viz.pool`) when a job begins, so that its imports (~0.5 s of
matplotlib and the figure modules) run while this process replays the log. The helper's
figures (`OFFLOAD`) go to it with only the FigureData fields they read (`READS`). The
costliest, masked_fraction (about half the drawing), is sent by `report` as soon as the
replay has made the sweep table (`report_data(on_sweep=)`), so it is drawn while choose,
compare and the other tables are counted, and this process draws the other four;
`render_all` picks it up (`ask` knows a figure was sent already from the same objects with
the same settings, else sends it, as `plot` does).

The helper only draws: it returns the encoded file (`render.encode`, the bytes `render.save`
writes), and this process writes it (`render.write`), so the output folder, `force` and a
job that fails before its figures are handled in one place, and the files are
byte-identical to those drawn here (tests/test_pool.py). It gets the rcParams this process
changed since matplotlib's import (a notebook's style) and hands back the warnings its
drawing raised, which are raised again here. Anything that goes wrong on its side (it could
not start, it died, a figure raised) makes this process draw that figure itself, so errors
surface as they would without the pool and no figure is lost.

Messages are pickles over the helper's stdin and stdout, each reply carrying its request's
id; its own prints go to stderr, which is discarded unless MISMATCH_REPLAY_POOL_DEBUG is
set. The pool is used only where the machine has two cores or more and
MISMATCH_REPLAY_FIGURE_WORKERS is not "0" (`wanted`). The helper lives as long as the
`with` block that made it.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import subprocess
import sys
import threading
import traceback
import types
import warnings
from typing import IO, Any

# the figures the helper draws (the rest: this process), and the FigureData fields each
# reads. masked_fraction is about half the drawing: with the report's decisions and the
# other four figures here the two processes finish about together (masked_by_length sent
# too left the helper last, ~0.1-0.3 s after this process at 20M tokens)
OFFLOAD = ("masked_fraction",)
READS = {"masked_fraction": ("sweep", "curves"), "masked_by_length": ("by_length",)}
ENV_WORKERS = "MISMATCH_REPLAY_FIGURE_WORKERS"
ENV_DEBUG = "MISMATCH_REPLAY_POOL_DEBUG"
_RC_SKIP = ("backend", "backend_fallback", "interactive")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def wanted() -> bool:
    """Whether a job should draw in a second process: two cores or more, not switched off
    with MISMATCH_REPLAY_FIGURE_WORKERS=0, and a Python interpreter to start (not a frozen
    application)."""
    if getattr(sys, "frozen", False) or not sys.executable:  # no Python to start it with
        return False
    return os.environ.get(ENV_WORKERS, "").strip() != "0" and _cores() >= 2


def _rc_changes() -> dict:
    """The rcParams this process changed since matplotlib was imported (none if it was not)."""
    mpl = sys.modules.get("matplotlib")
    if mpl is None:
        return {}
    out = {}
    for k, v in mpl.rcParams.items():
        if k in _RC_SKIP:
            continue
        try:
            same = mpl.rcParamsOrig[k] == v
        except Exception:  # a value that does not compare: send it
            same = False
        if not same:
            out[k] = v
    return out


class Part(types.SimpleNamespace):
    """The fields of a FigureData that one figure reads (`READS`): what the helper is sent."""


class FigurePool:
    """One helper process that draws figures into bytes: `ask` (or `send` early), then
    `result`. This process writes the files (`render.write`), so the output folder, `force`
    and a failed job are handled here alone.

    `FigurePool()` starts the helper at once and never raises: where it cannot start,
    `alive` is False and `render_all` draws everything here."""

    offload = OFFLOAD

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.asked: dict[str, tuple[int, tuple, Part]] = {}  # name -> (id, request, part)
        self.replies: dict[int, dict] = {}
        self.next_id = 0
        self.heard = threading.Condition()
        self.stale: set[int] = set()  # requests asked again since: their replies are dropped
        self.reader: threading.Thread | None = None
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mismatch_replay.viz.pool"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None if os.environ.get(ENV_DEBUG) else subprocess.DEVNULL,
            )
        except (OSError, ValueError):
            self.proc = None
            return
        # one thread writes the requests and one reads the replies as they come: neither
        # side ever waits on a full pipe (the helper still importing, or writing a reply
        # while this process writes the next request: two full pipes would deadlock)
        self.reader = threading.Thread(target=self._listen, args=(self.proc.stdout,), daemon=True)
        self.reader.start()
        threading.Thread(target=self._post, args=(self.proc.stdin,), daemon=True).start()

    def _post(self, stream: IO[bytes]) -> None:
        while (msg := self.outbox.get()) is not None:
            try:
                stream.write(msg)
                stream.flush()
            except (OSError, ValueError):  # the helper is gone: the reader sees its EOF
                break
        with contextlib.suppress(OSError, ValueError):
            stream.close()

    def _listen(self, stream: IO[bytes]) -> None:
        while True:
            try:
                reply = pickle.load(stream)
            except Exception:  # EOF: the helper ended (or died); anything else: the same
                reply = None
            with self.heard:
                if reply is None:
                    self.reader = None
                elif reply["id"] not in self.stale:
                    self.replies[reply["id"]] = reply
                self.heard.notify_all()
            if reply is None:
                return

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, name: str, data: Any, fmt: str, dpi: int, kw: dict) -> bool:
        """Ask the helper to draw figure `name` (of `pool.READS`) from `data` (a FigureData,
        or any object with the fields the figure reads); False if it cannot be asked."""
        if not self.alive:
            return False
        part = Part(**{f: getattr(data, f, None) for f in READS[name]})
        rid, self.next_id = self.next_id, self.next_id + 1
        msg = {"id": rid, "name": name, "data": part, "fmt": fmt, "dpi": dpi, "kw": kw}
        msg["rc"] = _rc_changes()
        try:
            self.outbox.put(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except (pickle.PicklingError, TypeError, AttributeError):
            return False  # drawn here then
        with self.heard:
            if name in self.asked:
                old = self.asked[name][0]
                self.stale.add(old)
                self.replies.pop(old, None)
            self.asked[name] = (rid, (fmt, dpi, dict(kw)), part)
        return True

    def ask(self, name: str, data: Any, fmt: str, dpi: int, kw: dict) -> bool:
        """As `send`, unless the figure was sent already from the same objects with the same
        settings (a job sends masked_fraction as soon as its sweep table exists)."""
        got = self.asked.get(name)
        same = got is not None and got[1] == (fmt, dpi, dict(kw))
        if same and all(getattr(got[2], f) is getattr(data, f, None) for f in READS[name]):
            return True
        return self.send(name, data, fmt, dpi, kw)

    def result(self, name: str) -> bytes | None:
        """The encoded figure the helper drew for the last request of `name`, or None where
        it could not (it died, it raised): the caller then draws it. Warnings its drawing
        raised are raised again here."""
        with self.heard:
            got = self.asked.pop(name, None)
            if got is None:
                return None
            rid = got[0]
            self.heard.wait_for(lambda: rid in self.replies or self.reader is None)
            reply = self.replies.pop(rid, None)
        if reply is None or not reply.get("ok"):
            return None
        for w in reply.get("warnings", ()):
            warnings.warn(w["message"], w["category"], stacklevel=2)
        return reply["image"]

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self.outbox.put(None)  # the writer closes the helper's stdin: it ends at EOF
        try:
            proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        reader = self.reader
        if reader is not None:
            reader.join(timeout=2)  # it ends at the helper's EOF
        if proc.stdout is not None and self.reader is None:
            proc.stdout.close()

    def __enter__(self) -> FigurePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _send(stream: IO[bytes], obj: Any) -> None:  # the helper's replies
    pickle.dump(obj, stream, protocol=pickle.HIGHEST_PROTOCOL)
    stream.flush()


# ----------------------------------------------------------------------------- the helper


def _draw(msg: dict) -> dict:
    """One request: the figure's bytes and the warnings its drawing raised, or the error."""
    import matplotlib as mpl

    from . import render

    reply: dict = {"id": msg["id"], "ok": False}
    try:
        with mpl.rc_context(msg["rc"]), warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            build = render.figures(msg["data"], **msg["kw"])[msg["name"]]
            reply["image"] = render.encode(build(), msg["fmt"], msg["dpi"])
        reply["warnings"] = [_warning(w) for w in ws]
        reply["ok"] = True
    except Exception:
        reply["error"] = traceback.format_exc()
    return reply


def _warning(w: warnings.WarningMessage) -> dict:
    try:
        pickle.dumps(w.category)
        category = w.category
    except Exception:  # a class defined where the caller cannot load it
        category = UserWarning
    return {"message": str(w.message), "category": category}


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    """The helper's loop: one message in, one reply out, until its stdin closes."""
    from . import render  # noqa: F401  (the imports, while the parent replays the log)

    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        _send(out, _draw(msg))


if __name__ == "__main__":
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the channel
    serve(channel_in, channel_out)
    # every reply is flushed and the helper holds nothing else: skip the interpreter's
    # teardown (freeing matplotlib's and numpy's modules, ~0.1-0.2 s that `close` would wait)
    sys.stderr.flush()
    os._exit(0)
