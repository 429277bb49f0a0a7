"""viz.pool: figures drawn in a second process are the files drawn here, and nothing is
lost when the helper fails.

The helper process runs the same figure functions and `render.save`; these tests compare
bytes, check that the helper (not this process) drew what it was sent, and make it fail in
the ways it can (never started, died, a figure that raises) to see this process draw the
figure itself or raise what it would have raised without the pool.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import threading
import warnings
from pathlib import Path

import matplotlib as mpl
import pytest

from mismatch_replay import analysis, viz
from mismatch_replay.viz import jobs, pool, render

pytestmark = pytest.mark.slow  # figure-pool helper processes started and killed

GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"
DPI = 40


@pytest.fixture(scope="module")
def data():
    return analysis.figure_data([str(GOLDEN)])


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _drawn_here(monkeypatch) -> list[str]:
    """The files this process saves (the helper's are not seen: another process)."""
    seen: list[str] = []
    real = render.save

    def spy(fig, path, fmt, dpi=150, force=True):
        seen.append(Path(path).stem)
        return real(fig, path, fmt, dpi, force=force)

    monkeypatch.setattr(render, "save", spy)
    return seen


def test_the_helper_draws_the_same_bytes(data, tmp_path, monkeypatch):
    render.render_all(data, tmp_path / "here", dpi=DPI, target_fraction=0.0025)
    seen = _drawn_here(monkeypatch)
    with pool.FigurePool() as helper:
        assert helper.alive
        render.render_all(data, tmp_path / "pool", dpi=DPI, target_fraction=0.0025, pool=helper)
    assert _files(tmp_path / "pool") == _files(tmp_path / "here")
    assert sorted(seen) == sorted(set(viz.FIGURES) - set(pool.OFFLOAD))  # the rest: helper


def test_the_helper_gets_the_callers_rcparams(data, tmp_path):
    with mpl.rc_context({"axes.facecolor": "#dddddd", "font.size": 7}):
        render.render_all(data, tmp_path / "here", dpi=DPI)
        with pool.FigurePool() as helper:
            render.render_all(data, tmp_path / "pool", dpi=DPI, pool=helper)
    plain = tmp_path / "plain"
    render.render_all(data, plain, dpi=DPI)
    assert _files(tmp_path / "pool") == _files(tmp_path / "here")
    assert _files(plain)["masked_fraction.png"] != _files(tmp_path / "here")["masked_fraction.png"]


def test_rc_changes_lists_what_was_changed():
    assert pool._rc_changes() == {}
    with mpl.rc_context({"axes.facecolor": "#dddddd"}):
        assert pool._rc_changes() == {"axes.facecolor": "#dddddd"}


def test_a_dead_helper_leaves_the_drawing_here(data, tmp_path, monkeypatch):
    render.render_all(data, tmp_path / "here", dpi=DPI)
    seen = _drawn_here(monkeypatch)
    with pool.FigurePool() as helper:
        helper.proc.kill()
        helper.proc.wait()
        render.render_all(data, tmp_path / "pool", dpi=DPI, pool=helper)
    assert sorted(seen) == sorted(viz.FIGURES)
    assert _files(tmp_path / "pool") == _files(tmp_path / "here")


def test_a_helper_dying_mid_figure_leaves_it_here(data, tmp_path, monkeypatch):
    """The helper dies as soon as it was sent the figure: this process draws it."""
    seen = _drawn_here(monkeypatch)
    with pool.FigurePool() as helper:
        real_send = helper.send

        def send_then_die(*a, **k):
            sent = real_send(*a, **k)
            helper.proc.kill()
            helper.proc.wait()
            return sent

        monkeypatch.setattr(helper, "send", send_then_die)
        render.render_all(data, tmp_path, dpi=DPI, pool=helper)
    assert "masked_fraction" in seen
    assert {p.stem for p in tmp_path.iterdir()} == set(viz.FIGURES)


def test_a_pool_that_cannot_start_is_not_alive(monkeypatch, data, tmp_path):
    def refuse(*a, **k):
        raise OSError("no processes here")

    monkeypatch.setattr(pool.subprocess, "Popen", refuse)
    helper = pool.FigurePool()
    assert not helper.alive
    assert not helper.send("masked_fraction", data, "png", DPI, {})
    assert helper.result("masked_fraction") is None
    render.render_all(data, tmp_path, dpi=DPI, pool=helper)
    assert {p.stem for p in tmp_path.iterdir()} == set(viz.FIGURES)


def test_a_figure_that_fails_there_raises_here_as_without_the_pool(data, tmp_path):
    broken = dataclasses.replace(data, sweep=data.sweep.drop("value"))
    with pytest.raises(Exception) as plain:
        render.masked_fraction(broken.sweep)
    with pool.FigurePool() as helper:
        with pytest.raises(type(plain.value)):
            render.render_all(broken, tmp_path, dpi=DPI, pool=helper)
        assert helper.alive  # a figure's error is an answer, not a crash


def _msg(name, data, rid=0):
    part = pool.Part(**{f: getattr(data, f) for f in pool.READS.get(name, ("sweep",))})
    if name != "masked_fraction":
        part = data
    return {"id": rid, "name": name, "data": part, "fmt": "png", "dpi": DPI, "kw": {}, "rc": {}}


def test_the_helper_reports_errors_and_warnings(monkeypatch, data):
    """`_draw` (the helper's side, run here): an error comes back as text, warnings as
    message and category, which `result` raises again in the caller."""

    def warns():
        warnings.warn("a note from the drawing", RuntimeWarning, stacklevel=1)
        return viz.masked_fraction(data.sweep)

    real = render.figures
    monkeypatch.setattr(render, "figures", lambda d, **kw: {"masked_fraction": warns})
    reply = pool._draw(_msg("masked_fraction", data, rid=7))
    assert reply["ok"] and reply["id"] == 7
    assert reply["warnings"] == [{"message": "a note from the drawing", "category": RuntimeWarning}]
    monkeypatch.setattr(render, "figures", real)
    plain = render.encode(viz.masked_fraction(data.sweep), "png", DPI)
    assert reply["image"] == plain  # the bytes render.save writes
    broken = _msg("masked_fraction", dataclasses.replace(data, sweep=data.sweep.drop("value")))
    failed = pool._draw(broken)
    assert not failed["ok"] and "Traceback" in failed["error"]

    fake = pool.FigurePool.__new__(pool.FigurePool)  # a helper that answered, then ended
    fake.proc, fake.replies, fake.next_id = None, {}, 8
    fake.heard, fake.reader = threading.Condition(), threading.current_thread()
    fake.stale = {3}  # a request asked again since
    stale = {"id": 3, "ok": True, "image": b"old"}
    fake._listen(io.BytesIO(pickle.dumps(stale) + pickle.dumps(reply)))  # to its EOF
    assert fake.reader is None and sorted(fake.replies) == [7]
    fake.asked = {"masked_fraction": (7, ("png", DPI, {}), None)}
    with pytest.warns(RuntimeWarning, match="a note from the drawing"):
        assert fake.result("masked_fraction") == plain
    assert fake.replies == {}
    assert fake.result("masked_fraction") is None  # nothing asked any more


def test_serve_answers_each_message_until_its_input_ends(data):
    msgs = [_msg(n, data, rid=i) for i, n in enumerate(("steps", "where_masked"))]
    inp = io.BytesIO(b"".join(pickle.dumps(m) for m in msgs))
    out = io.BytesIO()
    pool.serve(inp, out)
    out.seek(0)
    replies = [pickle.load(out), pickle.load(out)]
    assert [(r["id"], r["ok"]) for r in replies] == [(0, True), (1, True)]
    assert replies[0]["image"] == render.encode(viz.steps(data), "png", DPI)


def test_ask_reuses_a_figure_sent_early_from_the_same_objects(data):
    with pool.FigurePool() as helper:
        assert helper.send("masked_fraction", pool.Part(sweep=data.sweep), "png", DPI, {})
        first = helper.asked["masked_fraction"][0]
        assert helper.ask("masked_fraction", data, "png", DPI, {})  # same table: kept
        assert helper.asked["masked_fraction"][0] == first
        other = dataclasses.replace(data, sweep=data.sweep.clone())
        assert helper.ask("masked_fraction", other, "png", DPI, {})  # another table: again
        assert helper.asked["masked_fraction"][0] != first
        assert helper.ask("masked_fraction", other, "png", DPI + 1, {})  # another resolution
        image = helper.result("masked_fraction")  # the last request's, past the stale two
    assert image == render.encode(viz.masked_fraction(other.sweep), "png", DPI + 1)


def test_wanted_follows_the_cores_and_the_switch(monkeypatch):
    monkeypatch.setattr(pool, "_cores", lambda: 2)
    monkeypatch.delenv(pool.ENV_WORKERS, raising=False)
    assert pool.wanted()
    monkeypatch.setenv(pool.ENV_WORKERS, "0")
    assert not pool.wanted()
    monkeypatch.delenv(pool.ENV_WORKERS)
    monkeypatch.setattr(pool, "_cores", lambda: 1)
    assert not pool.wanted()


def test_report_with_and_without_the_helper_writes_the_same_page(tmp_path):
    a = jobs.report([str(GOLDEN)], tmp_path / "a", command="x", figure_process=True)
    b = jobs.report([str(GOLDEN)], tmp_path / "b", command="x", figure_process=False)
    fa, fb = _files(a.parent), _files(b.parent)
    assert fa.keys() == fb.keys()
    for name in fa:
        if name.endswith(".png"):
            assert fa[name] == fb[name], name
    # the page embeds the same figures (its generation time may differ)
    strip = lambda s: [ln for ln in s.decode().splitlines() if " UTC<" not in ln]  # noqa: E731
    assert strip(fa["index.html"]) == strip(fb["index.html"])


def test_report_sends_masked_fraction_once_as_soon_as_the_sweep_exists(tmp_path, monkeypatch):
    """The report's helper is sent masked_fraction from report_data's sweep table (before
    choose and compare run) and render_all picks that request up instead of sending again."""
    events: list[str] = []
    decisions = importlib.import_module("mismatch_replay.analysis.decisions")
    real_send, real_choose = pool.FigurePool.send, decisions.choose

    def send(self, name, *a, **k):
        events.append(f"send {name}")
        return real_send(self, name, *a, **k)

    def choose(*a, **k):
        events.append("choose")
        return real_choose(*a, **k)

    monkeypatch.setattr(pool.FigurePool, "send", send)
    monkeypatch.setattr(decisions, "choose", choose)
    seen = _drawn_here(monkeypatch)
    jobs.report([str(GOLDEN)], tmp_path, command="x", figure_process=True)
    assert events[:2] == ["send masked_fraction", "choose"]
    assert events.count("send masked_fraction") == 1 and len(events) == 2  # sent once, early
    assert "masked_fraction" not in seen and (tmp_path / "masked_fraction.png").exists()


def test_the_helper_imports_the_figures_but_no_engine():
    """The helper's imports run while the caller replays the log, on the core the replay
    would use: it loads matplotlib and the figure modules, not the engine, ingest or numba
    (~0.1 s of that core at 20M tokens; groups.py takes the q buckets from metrics)."""
    import subprocess
    import sys

    code = (
        "import sys; import mismatch_replay.viz.render; "
        "print(sorted(m for m in ('mismatch_replay.engine', 'mismatch_replay.ingest', "
        "'mismatch_replay.analysis', 'numba') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
