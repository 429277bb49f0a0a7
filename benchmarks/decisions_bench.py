"""Decisions benchmark: what `choose`, `compare --budget` and `report` cost against one sweep.

Usage:
    python benchmarks/decisions_bench.py --tokens 2e6            # quick
    python benchmarks/decisions_bench.py                         # 20M tokens (0.3 GB, made once)
    python benchmarks/decisions_bench.py --tokens 50e6 --repeat 1 --json out.json
    python benchmarks/decisions_bench.py --trees /tmp/before . --repeat 4   # before/after

Every workload runs in a fresh process (`python decisions_bench.py --run NAME FILE`), as the
command line would, and the repeats are interleaved (floor, sweep, choose, ..., then again), so
that a burst of load on this shared machine hits every workload alike; the best of --repeat is
kept. Only the ratios measured in one run mean anything (benchmarks/README.md):

  floor     polars reading the two log-prob columns and summing them (the scan floor)
  sweep     `engine.sweep(file)`: every rule over its default grid, metrics, scatter
  choose    `analysis.choose(file, 0.0025)`: every mask rule the log supports, each threshold
            parameter refined to the target, with the 200-replicate bootstrap interval
            (the CLI's `choose -t 0.0025`)
  compare   `analysis.compare(file, "ipo", "icepop@prime-rl", budget=0.0025)` (`compare
            --budget`)
  data      `analysis.report_data(file, ...)`: the report without its drawing: its one read
            (sweep, choose's tail, drift's per-step Tally, inspect's checks), its decisions
            and every figure's data
  report    `viz.jobs.report(file, DIR)`: inspect, sweep, figures, choose, compare, drift, the
            page (the CLI's `report`)

"cpu s" is this process's CPU; "+helper" adds its children's (the report's figure process),
what the machine's cores had to give the job: on 2 cores, (cpu + helper) / 2 is the least
wall time the job could take however well its work overlapped. Below the table, the
report's drawing: the wall seconds from the end of its read and decisions (`report_data`
returning) to the end (figures and page, in both processes).

`--trees A B ...`: every workload once per tree in each round (PYTHONPATH set to the tree,
e.g. a `git worktree` of an earlier commit; the trees alternate within a workload), one
table per tree and its ratios to its own sweep: only timings taken side by side compare
code on this shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
WORKLOADS = ("floor", "sweep", "choose", "compare", "data", "report")


def _child(name: str, path: str) -> None:
    import resource

    t = time.perf_counter()
    c = time.process_time()
    phase: dict[str, float] = {}
    if name == "floor":
        import polars as pl

        pl.scan_parquet(path).select(
            pl.col("trainer_logprob").sum(), pl.col("inference_logprob").sum()
        ).collect()
    elif name == "sweep":
        from mismatch_replay import engine

        engine.sweep([path])
    elif name == "choose":
        from mismatch_replay import analysis

        analysis.choose([path], 0.0025)
    elif name == "compare":
        from mismatch_replay import analysis

        analysis.compare([path], "ipo", "icepop@prime-rl", budget=0.0025)
    elif name == "data":
        from mismatch_replay import analysis

        analysis.report_data([path], None, 0.0025, bootstrap=200, summary={})
    elif name == "report":
        from mismatch_replay import analysis
        from mismatch_replay.viz import jobs

        real = analysis.report_data

        def timed(*args, **kw):  # where the report's read and decisions end, its drawing begins
            got = real(*args, **kw)
            phase["draw_from"] = time.perf_counter()
            return got

        analysis.report_data = timed
        with tempfile.TemporaryDirectory() as d:
            jobs.report([path], Path(d) / "r", command="bench")
    else:
        raise SystemExit(f"unknown workload {name}")
    out = {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": time.process_time() - c,
        "child_cpu_seconds": sum(
            getattr(resource.getrusage(resource.RUSAGE_CHILDREN), f)
            for f in ("ru_utime", "ru_stime")
        ),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if "draw_from" in phase:  # the figures and the page, after the read and the decisions
        out["draw_seconds"] = time.perf_counter() - phase["draw_from"]
    print(json.dumps(out))


def _spawn(name: str, path: Path, tree: Path | None = None) -> dict:
    cmd = [sys.executable, __file__, "--run", name, str(path)]
    env = dict(os.environ)
    if tree is not None:  # that tree's mismatch_replay first on the path
        rest = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(tree) if not rest else os.pathsep.join([str(tree), rest])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=20e6)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds; best is kept")
    ap.add_argument("--only", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--trees", nargs="+", type=Path, default=None, help="source trees to compare")
    ap.add_argument("--run", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        _child(*a.run)
        return
    n = int(a.tokens)
    path = DATA / f"log_{n}.parquet"
    if not path.exists():
        sys.path.insert(0, str(HERE))
        from sweep_bench import make_log

        DATA.mkdir(exist_ok=True)
        make_log(path, n)
    _spawn("floor", path)  # the file cache warm for everyone
    small = DATA / "log_2000000.parquet"
    _spawn("sweep", small if small.exists() else path)  # numba's cache loaded once
    names = [w for w in WORKLOADS if w in a.only]
    trees = [t.resolve() for t in a.trees] if a.trees else [None]
    if a.trees:
        for t in trees:  # numba compiles a tree's kernels on its first run: not timed
            _spawn("sweep", small if small.exists() else path, t)
    runs = {t: {w: [] for w in names} for t in trees}
    load = os.getloadavg()[0]
    for _ in range(a.repeat):
        for w in names:
            for t in trees:
                runs[t][w].append(_spawn(w, path, t))
    print(f"tokens {n:,}; {os.cpu_count()} cores, load average {load:.1f} at start")
    out = {"tokens": n, "load": load, "trees": {}}
    for t in trees:
        best = {w: min(r, key=lambda d: d["seconds"]) for w, r in runs[t].items()}
        if t is not None:
            print(f"\n{t}")
        _table(best, {w: [d["seconds"] for d in r] for w, r in runs[t].items()})
        draws = sorted(d["draw_seconds"] for d in runs[t].get("report", []) if "draw_seconds" in d)
        if draws:
            print(
                f"report's drawing (after its read and decisions): best {draws[0]:.2f} s, "
                f"median {draws[len(draws) // 2]:.2f} s"
            )
        out["trees"][str(t or ".")] = {"runs": runs[t], "best": best}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


def _table(best: dict, walls: dict) -> None:
    floor = best.get("floor", {}).get("seconds")
    sweep = best.get("sweep", {}).get("seconds")
    head = f"{'workload':10s} {'wall s':>8s} {'median':>8s} {'cpu s':>8s} {'+helper':>8s}"
    print(f"{head} {'x sweep':>8s} {'x floor':>8s} RSS")
    for w, r in best.items():
        xs = f"{r['seconds'] / sweep:8.2f}" if sweep else f"{'':8s}"
        xf = f"{r['seconds'] / floor:8.1f}" if floor else f"{'':8s}"
        med = sorted(walls[w])[len(walls[w]) // 2]
        print(
            f"{w:10s} {r['seconds']:8.2f} {med:8.2f} {r['cpu_seconds']:8.2f} "
            f"{r['cpu_seconds'] + r.get('child_cpu_seconds', 0.0):8.2f} {xs} {xf} "
            f"{r['peak_rss_gib']:.2f} G"
        )


if __name__ == "__main__":
    main()
