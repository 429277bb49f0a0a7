"""Reliability (issue 15): every malformed log and every fault gets one clear sentence or the
right answer, outputs are published exclusively, interrupted runs leave nothing, remote
sources time out and stop on Ctrl-C, m2po's memory stays within its budget.

Each case writes the malformed input (or causes the fault) and asserts the error's text, or
the right answer against a numpy computation. Large-memory shapes are in
benchmarks/memory_bench.py, not here.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import GOLDEN_LOG, assert_tables_equal

from mismatch_replay import engine, ingest, output, rules
from mismatch_replay.analysis.inspect import inspect_log
from mismatch_replay.engine import m2po as m2po_store
from mismatch_replay.errors import DataError, OutputError, ReplayError, UsageError
from mismatch_replay.ingest import canonical
from mismatch_replay.ingest import convert as conv

GOLDEN = str(GOLDEN_LOG)
ROOT = Path(__file__).resolve().parents[1]


def _lp(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lq = -rng.exponential(0.5, n)
    return np.minimum(lq + rng.normal(0, 0.05, n), 0.0), lq


def _write(tmp_path: Path, name: str, **cols) -> Path:
    p = tmp_path / name
    pl.DataFrame(cols).write_parquet(p)
    return p


def _leftovers(d: Path) -> list[str]:
    """Temporary files and directories of mismatch-replay under d."""
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if output.is_temp(p.name))


def _child(code: str, tmp_path: Path, env: dict | None = None) -> subprocess.Popen:
    """A Python child running `code` (SIGTERM behaves as SIGINT there, as in the CLI)."""
    script = tmp_path / f"child_{time.monotonic_ns()}.py"
    script.write_text(
        "from mismatch_replay import output\noutput.terminate_as_interrupt()\n"
        + textwrap.dedent(code)
    )
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _wait_for(pred, timeout: float = 30.0) -> None:
    t = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > t:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


# ----------------------------------------------------------------------------- data


def test_fractional_steps_are_refused_not_truncated(tmp_path):
    lp, lq = _lp(20)
    p = _write(
        tmp_path, "frac.parquet", trainer_logprob=lp, inference_logprob=lq,
        step=[0.0, 0.25, 0.5, 0.75] * 5,
    )  # fmt: skip
    with pytest.raises(DataError) as e:
        ingest.read_table([p])
    msg = str(e.value)
    assert "frac.parquet: column 'step': 15 of 20 rows are not whole numbers (e.g. 0.25)" in msg
    assert "Write integer steps" in msg
    whole = _write(
        tmp_path, "whole.parquet", trainer_logprob=lp, inference_logprob=lq, step=[1.0, 2.0] * 10
    )
    assert ingest.read_table([whole])["step"].to_list() == [1, 2] * 10


def test_null_loss_mask_rows_are_an_error_and_dropped_with_a_count(tmp_path):
    lp, lq = _lp(1000)
    mask = [True, None, False, True] * 250
    p = _write(tmp_path, "m.parquet", trainer_logprob=lp, inference_logprob=lq, loss_mask=mask)
    with pytest.raises(DataError) as e:
        ingest.read_table([p])
    assert "column 'loss_mask': 250 of 750 loss rows are null" in str(e.value)
    assert "--drop-invalid" in str(e.value)
    rep = ingest.ReadReport()
    got = ingest.read_table([p], ingest.ReadOptions(drop_invalid=True), report=rep)
    keep = np.array([m is True for m in mask])
    assert got.height == keep.sum() == 500
    np.testing.assert_array_equal(got["trainer_logprob"].to_numpy(), lp[keep])
    assert rep.dropped == {(str(p), "loss_mask"): 250, (str(p), "*"): 250}


def test_null_logprobs_are_reported_once_and_counted_once(tmp_path):
    lp, lq = _lp(20)
    t = [None if i < 5 else float(v) for i, v in enumerate(lp)]
    p = _write(tmp_path, "n.parquet", trainer_logprob=t, inference_logprob=lq)
    with pytest.raises(DataError) as e:
        ingest.read_table([p])
    msg = str(e.value)
    assert msg.count("column 'trainer_logprob'") == 1
    assert "5 of 20 loss rows are null." in msg
    assert "NaN" not in msg and "inf" not in msg and "above 0" not in msg
    rep = ingest.ReadReport()
    ingest.read_table([p], ingest.ReadOptions(drop_invalid=True), report=rep)
    assert rep.dropped == {(str(p), "trainer_logprob"): 5, (str(p), "*"): 5}
    # inspect: 3 nulls and 2 NaN in one column, 1 null in the other: counted per column
    t2 = [None, None, None, float("nan"), float("nan"), *lp[5:]]
    q2 = [None, *lq[1:]]
    p2 = _write(tmp_path, "n2.parquet", trainer_logprob=t2, inference_logprob=q2)
    s = inspect_log([p2])
    assert s.invalid == {f"{p2}: trainer_logprob": 5, f"{p2}: inference_logprob": 1}
    assert s.invalid_rows == 5 and s.loss_tokens == 15


def test_null_step_or_sample_id_is_an_invalid_row(tmp_path):
    lp, lq = _lp(4)
    p = _write(
        tmp_path, "k.parquet", trainer_logprob=lp, inference_logprob=lq,
        step=[None, 1, 1, 1], sample_id=[3, None, 3, 3],
    )  # fmt: skip
    with pytest.raises(DataError, match="column 'step': 1 of 4 loss rows are null; column "):
        ingest.read_table([p])
    assert ingest.read_table([p], ingest.ReadOptions(drop_invalid=True)).height == 2


@pytest.mark.parametrize(
    ("col", "value", "text"),
    [
        ("trainer_logprob", "abc", "column 'trainer_logprob' holds text (strings)"),
        ("step", "x", "column 'step' holds text (strings)"),
        ("loss_mask", "yes", "column 'loss_mask' holds text (strings)"),
    ],
)
def test_text_columns_are_one_sentence_not_a_traceback(tmp_path, col, value, text):
    lp, lq = _lp(20)
    cols = {"trainer_logprob": lp, "inference_logprob": lq, col: [value] * 20}
    p = _write(tmp_path, "t.parquet", **cols)
    with pytest.raises(DataError) as e:
        ingest.plan_sources([p])
    assert text in str(e.value) and "in all 20 rows" in str(e.value)
    assert "--map" in str(e.value)


def test_nested_columns_are_refused_or_left_out_with_a_warning(tmp_path):
    lp, lq = _lp(6)
    lol = _write(
        tmp_path, "lol.parquet", trainer_logprob=[[[-0.1]]] * 6, inference_logprob=[[[-0.1]]] * 6
    )
    with pytest.raises(DataError, match="column 'trainer_logprob' holds lists of lists"):
        ingest.plan_sources([lol])
    st = _write(
        tmp_path, "st.parquet", trainer_logprob=lp, inference_logprob=lq,
        advantage=[{"a": 1.0}] * 6,
    )  # fmt: skip
    with pytest.warns(ingest.IngestWarning, match="column 'advantage' holds nested structs"):
        plan = ingest.plan_sources([st])
    assert "advantage" not in plan.source
    assert ingest.read_table(plan).height == 6
    with pytest.raises(DataError, match="needs the column"):
        engine.sweep(plan, rules=["dppo-tv"])
    # --map'ed explicitly: an error, not left out
    with pytest.raises(DataError, match="holds nested structs"):
        ingest.plan_sources([st], ingest.ReadOptions(mapping={"advantage": "advantage"}))


def test_a_value_that_cannot_be_cast_names_the_column_and_an_example(tmp_path):
    lp, lq = _lp(4)
    good = _write(tmp_path, "g.parquet", trainer_logprob=lp, inference_logprob=lq)
    plan = ingest.plan_sources([good])
    bad = pl.DataFrame({"trainer_logprob": ["-0.1", "x", "-0.2", "y"], "inference_logprob": lq})
    with pytest.raises(DataError) as e:
        canonical.canonicalise(bad, plan, 0, 0)
    assert "g.parquet: column 'trainer_logprob': 2 of 4 rows cannot be read as numbers" in str(
        e.value
    )
    assert "(e.g. 'x')" in str(e.value)


# ----------------------------------------------------------------------------- outputs


def test_convert_refuses_a_target_that_appears_while_it_runs(tmp_path):
    out = tmp_path / "out.parquet"

    def appear(done, total):
        if not out.exists():
            out.write_text("someone else's")

    with pytest.raises(UsageError, match="appeared while this command ran"):
        conv.convert([GOLDEN], out, options=ingest.ReadOptions(batch_rows=5000), progress=appear)
    assert out.read_text() == "someone else's"
    assert _leftovers(tmp_path) == []
    # with force it is replaced
    s = conv.convert([GOLDEN], out, progress=appear, force=True)
    assert s["tokens"] == 19598 and pl.read_parquet(out).height == 19598


def test_partitioned_convert_refuses_a_directory_that_appears(tmp_path):
    out = tmp_path / "hive"

    def appear(done, total):
        (out / "step=0").mkdir(parents=True, exist_ok=True)
        (out / "step=0" / "x.parquet").write_text("x")

    with pytest.raises(UsageError, match="appeared while this command ran"):
        conv.convert([GOLDEN], out, partition_by="step", progress=appear)
    assert (out / "step=0" / "x.parquet").read_text() == "x"
    assert _leftovers(tmp_path) == []


@pytest.mark.slow  # two CLI processes
def test_two_concurrent_converts_to_one_path_one_wins(tmp_path):
    out = tmp_path / "out.parquet"
    cmd = [sys.executable, "-m", "mismatch_replay", "convert", GOLDEN, "-o", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    codes = sorted(p.wait(60) for p in procs)
    errs = " ".join(p.stderr.read() for p in procs)
    assert codes == [0, 2], errs
    assert "appeared while this command ran" in errs or "the file exists" in errs
    assert pl.read_parquet(out).height == 19598
    assert _leftovers(tmp_path) == []


def test_atomic_write_publishes_exclusively_and_force_replaces(tmp_path):
    p = tmp_path / "t.csv"
    output.atomic_write(p, lambda t: t.write_text("a"))
    with pytest.raises(UsageError, match="appeared while this command ran"):
        output.atomic_write(p, lambda t: t.write_text("b"))
    assert p.read_text() == "a"
    output.atomic_write(p, lambda t: t.write_text("c"), force=True)
    assert p.read_text() == "c"
    df = pl.DataFrame({"a": [1]})
    with pytest.raises(UsageError, match="the file exists"):
        output.write_table(df, p)
    assert _leftovers(tmp_path) == []
    assert oct(p.stat().st_mode & 0o777) == oct(0o666 & ~output._umask())


def test_publish_without_hard_links_still_refuses(tmp_path, monkeypatch):
    def no_link(a, b):
        raise OSError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(os, "link", no_link)
    p = tmp_path / "t.json"
    output.atomic_write(p, lambda t: t.write_text("1"))
    with pytest.raises(UsageError, match="appeared"):
        output.atomic_write(p, lambda t: t.write_text("2"))
    monkeypatch.setattr(output, "_renameat2", lambda a, b: False)  # nor renameat2: O_EXCL
    with pytest.raises(UsageError, match="appeared"):
        output.atomic_write(p, lambda t: t.write_text("3"))
    q = tmp_path / "u.json"
    output.atomic_write(q, lambda t: t.write_text("4"))
    assert p.read_text() == "1" and q.read_text() == "4"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    ("err", "cls", "text"),
    [
        (errno.ENOSPC, OutputError, "the disk holding"),
        (errno.EDQUOT, OutputError, "the disk quota holding"),
        (errno.EACCES, UsageError, "no permission to write in"),
        (errno.EROFS, UsageError, "is on a read-only file system"),
        (errno.EIO, OutputError, "writing failed"),
    ],
)
def test_write_failures_are_one_sentence_and_leave_nothing(tmp_path, err, cls, text):
    def fail(t):
        t.write_text("partial")
        raise OSError(err, os.strerror(err))

    with pytest.raises(cls, match=text) as e:
        output.atomic_write(tmp_path / "x.csv", fail)
    assert str(e.value).startswith(f"-o {tmp_path / 'x.csv'}: ")
    assert list(tmp_path.iterdir()) == []


def test_polars_and_pyarrow_wrapped_io_errors_are_recognised(tmp_path):
    def polars_style(t):
        raise pl.exceptions.ComputeError("parquet: underlying IO error: No space (os error 28)")

    with pytest.raises(OutputError, match="is full"):
        output.atomic_write(tmp_path / "x.parquet", polars_style)
    assert list(tmp_path.iterdir()) == []


def test_bad_output_paths_are_one_sentence(tmp_path):
    (tmp_path / "afile").write_text("x")
    long = "a" * 300
    cases = [
        (tmp_path / "afile" / "sub" / "o.csv", "afile is a file, not a directory"),
        (tmp_path / f"{long}.csv", r"the name is too long for the file system \(30\d bytes"),
    ]
    df = pl.DataFrame({"a": [1]})
    for path, text in cases:
        with pytest.raises(UsageError, match=text):
            output.write_table(df, path)
        with pytest.raises(UsageError, match=text):
            conv.convert([GOLDEN], path.with_suffix(".parquet"))
    with pytest.raises(UsageError, match="afile is a file"):
        output.ensure_dir(tmp_path / "afile" / "figs")
    # a name just short enough: its temporary name is cut to fit
    ok = tmp_path / ("b" * 250 + ".csv")
    output.write_table(df, ok)
    assert ok.exists()


def test_read_only_directory_is_one_sentence(tmp_path, monkeypatch):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
    else:  # root writes anywhere: fail the way a read-only directory fails
        real = os.open

        def ro(path, flags, *a, **k):
            if str(path).startswith(str(d)) and flags & os.O_CREAT:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", ro)
    try:
        with pytest.raises(UsageError, match=f"no permission to write in {d}"):
            output.write_table(pl.DataFrame({"a": [1]}), d / "o.csv")
        with pytest.raises(UsageError, match=f"no permission to write in {d}"):
            conv.convert([GOLDEN], d / "o.parquet")
    finally:
        d.chmod(0o755)
    assert list(d.iterdir()) == []


def test_figures_and_the_report_page_publish_through_the_helper(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mismatch_replay.viz import render, report

    fig = plt.figure()
    p = tmp_path / "f.png"
    render.save(fig, p, "png", force=False)
    with pytest.raises(UsageError, match="appeared"):
        render.save(fig, p, "png", force=False)
    plt.close(fig)
    report._atomic_text(tmp_path / "index.html", "<html></html>", force=False)
    with pytest.raises(UsageError, match="appeared"):
        report._atomic_text(tmp_path / "index.html", "<p>", force=False)
    assert (tmp_path / "index.html").read_text() == "<html></html>"
    assert _leftovers(tmp_path) == []


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs filled to the last byte (root only; skipped elsewhere)."""
    d = tmp_path / "full"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=False)
    if r.returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(d / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_disk_fails_every_writer_with_one_sentence(full_disk):
    df = pl.DataFrame({"a": np.arange(1000)})
    for suffix in (".csv", ".parquet", ".json"):
        with pytest.raises(OutputError, match="is full"):
            output.write_table(df, full_disk / f"o{suffix}")
    with pytest.raises(OutputError, match="is full"):
        conv.convert([GOLDEN], full_disk / "o.parquet")
    with pytest.raises(OutputError, match="is full"):
        conv.convert([GOLDEN], full_disk / "hive", partition_by="step")
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_m2po_spill_to_a_full_or_missing_tmpdir_is_one_sentence(tmp_path, monkeypatch):
    store = engine.M2POStore(limit_bytes=1)
    real_open = open

    def full(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "a" in mode:
            f.close()
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return f

    monkeypatch.setattr(m2po_store, "open", full, raising=False)
    with pytest.raises(OutputError) as e:
        store.add(np.zeros(10, np.int64), np.ones(10), np.ones(10))
    msg = str(e.value)
    assert "m2po's store could not write to" in msg and "No space left on device" in msg
    assert "TMPDIR" in msg and engine.M2PO_MEMORY_ENV in msg
    monkeypatch.undo()
    (tmp_path / "notadir").write_text("x")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "notadir"))
    with pytest.raises(ReplayError, match="m2po's store could not write to"):
        engine.M2POStore(limit_bytes=1).add(np.zeros(10, np.int64), np.ones(10), np.ones(10))


# ----------------------------------------------------------------------------- interrupted runs

_SLOW_CONVERT = """
    import sys, time
    from pathlib import Path
    from mismatch_replay import ingest
    from mismatch_replay.ingest import convert
    out = Path(sys.argv[0]).parent / {out!r}
    def slow(done, total):
        print("tick", flush=True)
        time.sleep(0.3)
    convert.convert([{src!r}], out, options=ingest.ReadOptions(batch_rows=1000), progress=slow,
                    partition_by={part!r})
"""


@pytest.mark.slow  # a child process signalled mid-run
@pytest.mark.parametrize("part", [None, "step"])
def test_sigterm_during_convert_leaves_nothing(tmp_path, part):
    out = "o.parquet" if part is None else "hive"
    proc = _child(_SLOW_CONVERT.format(out=out, src=GOLDEN, part=part), tmp_path)
    assert proc.stdout.readline().strip() == "tick"
    _wait_for(lambda: _leftovers(tmp_path))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) != 0
    assert "Terminated" in proc.stderr.read()
    assert _leftovers(tmp_path) == [] and not (tmp_path / out).exists()


@pytest.mark.slow  # a child process signalled mid-run
@pytest.mark.parametrize("part", [None, "step"])
def test_sigkill_during_convert_readers_skip_and_the_next_write_reclaims(tmp_path, part):
    out = "o.parquet" if part is None else "hive"
    proc = _child(_SLOW_CONVERT.format(out=out, src=GOLDEN, part=part), tmp_path)
    assert proc.stdout.readline().strip() == "tick"
    for _ in range(3):  # a few batches in: the temporary holds part of the table
        proc.stdout.readline()
    proc.kill()
    proc.wait(20)
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".{out}.")
    (tmp_path / "real.parquet").write_bytes(Path(GOLDEN).read_bytes())
    # readers skip it: the directory holds one log
    assert inspect_log([tmp_path]).files == [str(tmp_path / "real.parquet")]
    # the next write into the directory removes it (its process is gone)
    output.write_table(pl.DataFrame({"a": [1]}), tmp_path / "t.csv")
    assert _leftovers(tmp_path) == []


_SPILLING_SWEEP = """
    import os, time
    from mismatch_replay import engine, ingest
    def slow(done, total):
        print("tick", flush=True)
        time.sleep(0.3)
    engine.sweep([{src!r}], rules=["m2po"], options=ingest.ReadOptions(batch_rows=1000),
                 progress=slow)
"""


def _spills(d: Path) -> list[Path]:
    return sorted(d.glob(engine.M2PO_SPILL_PREFIX + "*"))


@pytest.mark.slow  # a child process signalled mid-run
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_during_an_m2po_spill_removes_it(tmp_path, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), engine.M2PO_MEMORY_ENV: "0.01"}
    proc = _child(_SPILLING_SWEEP.format(src=GOLDEN), tmp_path, env)
    assert proc.stdout.readline().strip() == "tick"
    _wait_for(lambda: any(p.is_dir() and any(p.iterdir()) for p in _spills(tmp)))
    proc.send_signal(sig)
    assert proc.wait(20) != 0
    assert _spills(tmp) == []


@pytest.mark.slow  # a child process signalled mid-run
def test_sigkill_during_an_m2po_spill_is_reclaimed_by_the_next_run(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), engine.M2PO_MEMORY_ENV: "0.01"}
    proc = _child(_SPILLING_SWEEP.format(src=GOLDEN), tmp_path, env)
    assert proc.stdout.readline().strip() == "tick"
    _wait_for(lambda: any(p.is_dir() and any(p.iterdir()) for p in _spills(tmp)))
    proc.kill()
    proc.wait(20)
    (left,) = _spills(tmp)
    assert str(proc.pid) in left.name
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    store = engine.M2POStore(limit_bytes=1)
    store.add(np.zeros(10, np.int64), np.ones(10), np.ones(10))  # spills: reclaims first
    assert _spills(tmp) == [Path(store._dir.name)]
    store._dir.cleanup()
    assert _spills(tmp) == []


def test_readers_skip_temporaries_of_files_and_directories(tmp_path):
    (tmp_path / "real.parquet").write_bytes(Path(GOLDEN).read_bytes())
    fake = output.temp_name(tmp_path / "o.parquet")
    fake.write_bytes(b"PAR1 truncated")
    hive = output.temp_name(tmp_path / "hive") / "step=3"
    hive.mkdir(parents=True)
    (hive / "part-0.parquet").write_bytes(b"PAR1 truncated")
    plan = ingest.plan_sources([tmp_path])
    assert [str(f) for f in plan.files] == [str(tmp_path / "real.parquet")]
    plan = ingest.plan_sources([str(tmp_path / "**" / "*.parquet")])
    assert [str(f) for f in plan.files] == [str(tmp_path / "real.parquet")]


# ----------------------------------------------------------------------------- hangs


@pytest.fixture
def blackhole():
    """A TCP port on 127.0.0.1 that accepts connections and never answers."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns: list = []
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(2)
    for c in conns:
        c.close()
    srv.close()


def _uri(scheme: str, port: int) -> str:
    return f"{scheme}://bucket/log.parquet?endpoint_override=127.0.0.1:{port}&scheme=http"


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_unanswering_object_store_times_out_with_one_sentence(blackhole, scheme):
    pafs = pytest.importorskip("pyarrow.fs")
    if not hasattr(pafs, "S3FileSystem" if scheme == "s3" else "GcsFileSystem"):
        pytest.skip(f"pyarrow without {scheme}")
    t0 = time.monotonic()
    with pytest.raises(DataError) as e:
        ingest.plan_sources([_uri(scheme, blackhole)], ingest.ReadOptions(io_timeout=1.0))
    assert time.monotonic() - t0 < 4
    assert "no answer within 1 s (--io-timeout 1)" in str(e.value)
    assert str(e.value).startswith(f"{scheme}://bucket/log.parquet")


@pytest.mark.slow  # a child process signalled mid-run
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_ctrl_c_stops_a_hung_remote_read_within_two_seconds(tmp_path, blackhole, scheme):
    pafs = pytest.importorskip("pyarrow.fs")
    if not hasattr(pafs, "S3FileSystem" if scheme == "s3" else "GcsFileSystem"):
        pytest.skip(f"pyarrow without {scheme}")
    code = f"""
        from mismatch_replay import ingest, output
        print("go", flush=True)
        try:
            ingest.plan_sources([{_uri(scheme, blackhole)!r}], ingest.ReadOptions(io_timeout=None))
        except KeyboardInterrupt:
            output.exit_process(130)
    """
    proc = _child(code, tmp_path)
    assert proc.stdout.readline().strip() == "go"
    time.sleep(1.0)  # inside the request now
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 130
    assert time.monotonic() - t0 < 2.0


def test_io_timeout_reaches_the_clients_and_the_paths():
    pafs = pytest.importorskip("pyarrow.fs")
    if not hasattr(pafs, "S3FileSystem"):
        pytest.skip("pyarrow without S3")
    fs, key = ingest.filesystem_from_uri(
        "s3://b/k/x.parquet?endpoint_override=127.0.0.1:1&scheme=http", timeout=7
    )
    assert key == "b/k/x.parquet" and isinstance(fs, pafs.S3FileSystem)
    p = ingest.RemotePath.make("s3", key, fs, 7)
    import pickle

    assert pickle.loads(pickle.dumps(p)).timeout == 7
    assert ingest.ReadOptions().io_timeout == ingest.IO_TIMEOUT_S == 30.0


# ----------------------------------------------------------------------------- memory


def _m2po_log(tmp_path: Path, n: int, steps: int, sorted_steps: bool) -> Path:
    rng = np.random.default_rng(7)
    lq = -rng.exponential(0.5, n)
    dy = rng.choice([0.0, 0.125, 0.25, 0.5, 1.0], n) * rng.choice([-1, 1], n)  # exact ties
    ratio = np.where(rng.random(n) < 0.5, dy, rng.normal(0, 0.3, n))
    step = np.sort(rng.integers(0, steps, n)) if sorted_steps else rng.integers(0, steps, n)
    df = pl.DataFrame(
        {
            "trainer_logprob": np.minimum(lq + ratio, 0.0),
            "inference_logprob": lq,
            "step": step,
            "sample_id": rng.integers(0, 50, n),
            "env": rng.choice(["a", "b"], n),
        }
    )
    p = tmp_path / f"m2po_{steps}_{sorted_steps}.parquet"
    df.write_parquet(p, row_group_size=2000)
    return p


@pytest.mark.parametrize(("steps", "sorted_steps", "by"), [(1, True, None), (3, False, "env"),
                                                          (3, True, "step")])  # fmt: skip
def test_m2po_on_steps_larger_than_its_budget_gives_the_same_table(
    tmp_path, monkeypatch, steps, sorted_steps, by
):
    """A step over the store's chunk is resolved streamed (sorted runs on disk, merged):
    exactly the in-memory bins (counts, sequences; floats to 1e-12)."""
    path = _m2po_log(tmp_path, 12000, steps, sorted_steps)
    kw = {"rules": ["m2po"], "sweeps": {"tau": "0.001:1:200:log"}, "by": by}
    ref = engine.sweep([path], **kw).table
    monkeypatch.setenv(engine.M2PO_MEMORY_ENV, str(1024 * 300 / 2**20))  # chunk: 1024 tokens
    calls = []
    real = m2po_store.resolve_big
    monkeypatch.setattr(m2po_store, "resolve_big", lambda *a: (calls.append(a[0].n), real(*a))[1])
    got = engine.sweep([path], **kw).table
    assert calls and min(calls) > 1024
    assert_tables_equal(ref, got, keys=[c for c in ("rule", "value", by) if c], rel=1e-12)


def test_a_large_row_group_is_streamed_in_batches(tmp_path):
    lp, lq = _lp(50_000)
    p = tmp_path / "one.parquet"
    pl.DataFrame({"trainer_logprob": lp, "inference_logprob": lq}).write_parquet(
        p, row_group_size=50_000
    )
    plan = ingest.plan_sources([p], ingest.ReadOptions(batch_rows=4096))
    sizes = [df.height for _, df in ingest.iter_batches(plan)]
    assert max(sizes) <= 4096 and sum(sizes) == 50_000
    got = ingest.read_table(plan)
    np.testing.assert_array_equal(got["trainer_logprob"].to_numpy(), lp)


def test_a_grid_past_the_limit_is_refused_with_the_limit_and_the_fix():
    with pytest.raises(UsageError) as e:
        rules.parse_grid(f"1e-4:1:{rules.MAX_GRID + 1}:log")
    assert f"{rules.MAX_GRID:,}" in str(e.value) and "narrow start:stop" in str(e.value)
    with pytest.raises(UsageError, match="at most"):
        rules.parse_grid(",".join(["0.1"] * (rules.MAX_GRID + 1)))
    from mismatch_replay import engine

    with pytest.raises(UsageError, match="at most"):
        engine.plan_jobs(["ipo"], {"ipo.eps": np.linspace(0, 1, rules.MAX_GRID + 1)})
    assert rules.parse_grid(f"1e-4:1:{rules.MAX_GRID}:log").size == rules.MAX_GRID


# ----------------------------------------------------------------------------- warnings


def test_duplicate_token_rows_are_counted_and_warned_about(tmp_path):
    raw = pl.read_parquet(GOLDEN)
    dup = pl.concat([raw, raw.head(700)])
    p = tmp_path / "dup.parquet"
    dup.write_parquet(p)
    keys = dup.filter("loss_mask").select("step", "sample_id", "position")
    want = keys.height - keys.unique().height  # numpy-free truth: rows repeating a key
    assert want > 0
    with pytest.warns(ingest.IngestWarning, match=f"at least {want:,} rows repeat a"):
        s = inspect_log([p])
    assert any("rows repeat a (step, sample_id, position)" in w for w in s.warnings)
    with pytest.warns(ingest.IngestWarning, match=f"at least {want:,} rows repeat"):
        conv.convert([p], tmp_path / "o.parquet")
    clean = inspect_log([GOLDEN])
    assert not any("repeat" in w for w in clean.warnings)


def test_a_column_under_two_accepted_names_says_which_was_read(tmp_path):
    lp, lq = _lp(5)
    p = _write(tmp_path, "two.parquet", trainer_logprob=lp, trainer_logprobs=lp * 2,
               inference_logprob=lq)  # fmt: skip
    with pytest.warns(ingest.IngestWarning) as w:
        plan = ingest.plan_sources([p])
    msg = " ".join(str(x.message) for x in w)
    assert "trainer_logprob under 2 accepted names ('trainer_logprob', 'trainer_logprobs')" in msg
    assert "read 'trainer_logprob'" in msg and "--map trainer_logprob=trainer_logprobs" in msg
    assert plan.source["trainer_logprob"] == "trainer_logprob"


def test_both_logprob_columns_mapped_to_one_source_is_warned_about(tmp_path):
    lp, lq = _lp(5)
    p = _write(tmp_path, "m.parquet", a=lp, b=lq)
    opts = ingest.ReadOptions(mapping={"trainer_logprob": "a", "inference_logprob": "a"})
    with pytest.warns(ingest.IngestWarning, match="both read column 'a'"):
        ingest.plan_sources([p], opts)


def test_a_hive_directory_that_disagrees_with_the_step_column_is_warned_about(tmp_path):
    lp, lq = _lp(20)
    d = tmp_path / "step=3"
    d.mkdir()
    _write(d, "part.parquet", trainer_logprob=lp, inference_logprob=lq, step=[3] * 15 + [5] * 5)
    with pytest.warns(ingest.IngestWarning) as w:
        got = ingest.read_table([tmp_path])
    (msg,) = [str(x.message) for x in w if "disagrees" in str(x.message)]
    assert "the directory step=3 disagrees with the file's step column 'step' on 5 of 20" in msg
    assert "(e.g. step 5); used the column" in msg
    assert got["step"].to_list() == [3] * 15 + [5] * 5


def test_a_fifo_is_not_reported_as_missing(tmp_path):
    f = tmp_path / "log.parquet"
    os.mkfifo(f)
    with pytest.raises(DataError, match="that is a named pipe \\(FIFO\\), not a regular file"):
        ingest.plan_sources([f])
    with pytest.raises(DataError, match="no such file or directory"):
        ingest.plan_sources([tmp_path / "missing.parquet"])
    with pytest.raises(DataError, match="name is too long"):
        ingest.plan_sources([tmp_path / ("a" * 300 + ".parquet")])


@pytest.mark.slow  # CLI subprocesses
def test_extreme_logprobs_print_no_numpy_warning(tmp_path):
    """|l| > 1e154 squares to inf (k2, m2po's l^2) and log10 p = -4e307 overflows the
    scatter's bin index: numpy must not print RuntimeWarnings about it (the numpy path and
    --precision float32 compute them)."""
    lp, lq = _lp(400)
    lp[:5], lq[5:10], lp[10:15] = -1e308, -1e200, -1e160
    p = _write(tmp_path, "x.parquet", trainer_logprob=lp, inference_logprob=lq)
    env = {**os.environ, "MISMATCH_REPLAY_KERNEL": "numpy"}
    for args in (["sweep"], ["choose", "-t", "0.01"]):
        r = subprocess.run(
            [sys.executable, "-W", "default", "-m", "mismatch_replay", *args, str(p)],
            capture_output=True,
            text=True,
            check=False,
            env=env,
        )
        assert r.returncode == 0, r.stderr
        assert "RuntimeWarning" not in r.stderr, r.stderr
