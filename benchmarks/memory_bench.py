"""Memory benchmark: peak RSS of each command on the log shapes that once broke the bound.

Usage:
    python benchmarks/memory_bench.py                       # every shape, default sizes
    python benchmarks/memory_bench.py --shapes one-step grid --tokens 25e6 50e6
    python benchmarks/memory_bench.py --json out.json
    PYTHONPATH=/tmp/before python benchmarks/memory_bench.py   # another checkout's code

DESIGN.md promises memory bounded by the batch (and m2po's budget), not by the log. Each
workload runs in a fresh subprocess and its peak RSS is that child's own (os.wait4's
ru_maxrss), so nothing a previous workload allocated is counted. The shapes:

  sorted       the benchmark log of sweep_bench.make_log (512-token sequences, 256 a step,
               sorted by step, 1M-row row groups): default sweep.
  one-step     the same tokens without a step column (one step of N tokens): m2po must rank
               the whole step, so its store spills and the step is resolved streamed.
  one-group    the log written as a single row group of N rows: inspect, convert, sweep.
  grid         a grid of G values for one rule on the golden 19,598-token log; past the
               limit (rules.MAX_GRID, where the lead has applied it) it is refused at once.
  choose       `choose --target-fraction 0.01` on the sorted log.

Sizes are scaled to the machine this was written on (2 cores, 23 GiB): the issue measured
25M / 50M / 100M one-step logs, a 300M-row group and a 1e7-value grid; the defaults here are
25M / 50M (one-step), 50M rows (one-group), 1e5 and 1e7 values (grid), 10M / 50M (choose).
Logs are generated once into benchmarks/_data (gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
sys.path.insert(0, str(HERE))
GOLDEN = HERE.parent / "tests" / "data" / "golden_log.parquet"


def _log(tokens: int, shape: str) -> Path:
    """The benchmark log of `tokens` tokens in one of the shapes, made once, in a child
    process: the parent stays small, because a child's ru_maxrss starts from the size of
    the process it was forked from (Linux keeps the forked copy's high-water mark at exec)."""
    path = DATA / (
        f"log_{tokens}.parquet" if shape == "sorted" else f"log_{tokens}_{shape}.parquet"
    )
    if not path.exists():
        subprocess.run([sys.executable, __file__, "--make", str(tokens), shape], check=True)
    return path


def _make(tokens: int, shape: str) -> Path:
    import pyarrow.parquet as pq
    from sweep_bench import make_log

    DATA.mkdir(exist_ok=True)
    base = DATA / f"log_{tokens}.parquet"
    if not base.exists():
        make_log(base, tokens)
    if shape == "sorted":
        return base
    path = DATA / f"log_{tokens}_{shape}.parquet"
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    pf = pq.ParquetFile(base)
    if shape == "one-step":  # drop the step column: the whole log is step 0
        cols = [c for c in pf.schema_arrow.names if c != "step"]
        writer = None
        for i in range(pf.num_row_groups):
            t = pf.read_row_group(i, columns=cols)
            if writer is None:
                writer = pq.ParquetWriter(tmp, t.schema, compression="zstd")
            writer.write_table(t, row_group_size=1_000_000)
        writer.close()
    elif shape == "one-group":  # one row group of every row (written a few columns at a time)
        cols = ["step", "trainer_logprob", "inference_logprob"]
        t = pq.read_table(base, columns=cols)
        pq.write_table(t, tmp, row_group_size=t.num_rows, compression="zstd")
        del t
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- children


def _child(name: str, path: str, arg: str) -> dict:
    t0 = time.perf_counter()
    out: dict = {}
    if name == "sweep":
        from mismatch_replay import engine

        res = engine.sweep([path])
        out["rows"] = res.table.height
    elif name == "inspect":
        from mismatch_replay.analysis.inspect import inspect_log

        out["tokens"] = inspect_log([path]).loss_tokens
    elif name == "convert":
        import tempfile

        from mismatch_replay.ingest.convert import convert

        with tempfile.TemporaryDirectory(dir=DATA) as d:
            out["tokens"] = convert([path], Path(d) / "out.parquet")["tokens"]
    elif name == "grid":
        from mismatch_replay import engine
        from mismatch_replay.errors import ReplayError

        try:
            res = engine.sweep([path], rules=["ipo"], sweeps={"eps": f"1e-4:1:{arg}:log"})
            out["rows"] = res.table.height
        except ReplayError as exc:
            out["refused"] = str(exc)
    elif name == "choose":
        from mismatch_replay.analysis import choose

        out["rows"] = len(choose([path], target_fraction=0.01))
    else:
        raise SystemExit(f"unknown workload {name}")
    out["seconds"] = time.perf_counter() - t0
    return out


def _spawn(name: str, path: Path, arg: str = "") -> dict:
    """Run a workload in a fresh process; its own peak RSS from os.wait4."""
    cmd = [sys.executable, __file__, "--run", name, str(path), arg]
    with open(os.devnull, "w") as null:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=null, text=True)
        text = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        return {"error": f"exit {proc.returncode}", "peak_rss_gib": usage.ru_maxrss / 2**20}
    out = json.loads(text.strip().splitlines()[-1])
    out["peak_rss_gib"] = usage.ru_maxrss / 2**20  # KiB on Linux
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--shapes", nargs="+", default=["sorted", "one-step", "one-group", "grid", "choose"]
    )
    ap.add_argument("--tokens", nargs="+", type=float, default=None, help="one-step sizes")
    ap.add_argument("--group-rows", type=float, default=50e6, help="one-group: rows")
    ap.add_argument("--grid", nargs="+", type=float, default=[1e5, 1e7], help="grid sizes")
    ap.add_argument("--choose-tokens", nargs="+", type=float, default=[10e6, 50e6])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--make", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        print(json.dumps(_child(*a.run)))
        return
    if a.make:
        _make(int(a.make[0]), a.make[1])
        return
    code = subprocess.run(
        [sys.executable, "-c", "import mismatch_replay as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"code: {Path(code).parent}", flush=True)
    rows = []

    def measure(shape, workload, size, path, arg=""):
        r = _spawn(workload, path, arg)
        row = {"shape": shape, "workload": workload, "size": size, **r}
        rows.append(row)
        extra = r.get("error") or ("refused" if "refused" in r else f"{r['seconds']:.1f} s")
        print(
            f"{shape:10} {workload:8} {size:>12} {r['peak_rss_gib']:6.2f} GiB  {extra}", flush=True
        )

    if "sorted" in a.shapes:
        n = 20_000_000
        measure("sorted", "sweep", f"{n:,}", _log(n, "sorted"))
    if "one-step" in a.shapes:
        for t in a.tokens or [25e6, 50e6]:
            n = int(t)
            measure("one-step", "sweep", f"{n:,}", _log(n, "one-step"))
    if "one-group" in a.shapes:
        n = int(a.group_rows)
        path = _log(n, "one-group")
        for w in ("inspect", "convert", "sweep"):
            measure("one-group", w, f"{n:,}", path)
    if "grid" in a.shapes:
        for g in a.grid:
            measure("grid", "grid", f"{int(g):,}", GOLDEN, str(int(g)))
    if "choose" in a.shapes:
        for t in a.choose_tokens:
            n = int(t)
            measure("choose", "choose", f"{n:,}", _log(n, "sorted"))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
