"""The report's figures: `viz.render_all` (what `report` and `plot` draw), best of N.

Usage:
    python benchmarks/render_bench.py                        # the bundled sample and 20M tokens
    python benchmarks/render_bench.py --log sample --rounds 5 --profile
    python benchmarks/render_bench.py --log path/to/log.parquet --fmt svg --out /tmp/figs
    python benchmarks/render_bench.py --trees /tmp/before . --rounds 3   # before/after
    python benchmarks/render_bench.py --log 20m --pool      # alone vs with viz.pool's helper

Drawing a figure costs the same for 20k tokens as for 20M: every figure is drawn from the
aggregated `FigureData` (analysis.figure_data), never from tokens. Building that data takes
seconds per log (a full replay), so it is built once per log and pickled to `--cache`
(default: the system's temporary folder, `render_bench_<name>.pkl`; built again when the log
is newer, when the pickle does not load, or with `--rebuild`, after FigureData changed); the
timed calls then only draw. `--log`: `sample` (the bundled
`mismatch_replay/data/sample_drift.parquet`), `20m`
(`benchmarks/_data/log_20000000.parquet`, made by sweep_bench.py) or a parquet path;
repeatable, default both.

Each call writes every figure into `--out` (default: a temporary folder) with `force=True`,
as `report --force` does, so a call's time includes the PNG encoding and the file writes.
The first call of a log is timed on its own ("first": for the first log, in a process whose
caches are cold, as `report` runs it once per process), then `--rounds` more: printed are
their best and median wall seconds and the best CPU seconds (the machines are shared: CPU
time moves less when another job has a core). `--json` writes them.

`--trees A B ...`: the same measurement for each source tree (e.g. a `git worktree` of the
commit before), each in its own process with PYTHONPATH set to the tree, the trees
alternating for `--repeat` rounds (default 3), every round's calls of a tree taken together
(`--rebuild` builds the data once, with this process's mismatch_replay, for all trees): only
timings taken side by side mean anything here. `--profile` runs one more call under cProfile
and prints the 25 costliest calls (cumulative). `--pool`: the same figures alone and with
`viz.pool.FigurePool`'s helper process, alternating, and the ratio of their best times.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pickle
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOGS = {
    "sample": ROOT / "mismatch_replay" / "data" / "sample_drift.parquet",
    "20m": HERE / "_data" / "log_20000000.parquet",
}


def figure_data(log: str, cache: Path, rebuild: bool = False):
    """(name, FigureData) of `log` (a name of LOGS or a path), from its pickle when fresh."""
    path = LOGS.get(log, Path(log))
    if not path.exists():
        hint = " (python benchmarks/sweep_bench.py makes it)" if log == "20m" else ""
        raise SystemExit(f"{path}: no such log{hint}")
    name = log if log in LOGS else path.stem
    pkl = cache / f"render_bench_{name}.pkl"
    if not rebuild and pkl.exists() and pkl.stat().st_mtime >= path.stat().st_mtime:
        try:
            with pkl.open("rb") as f:
                return name, pickle.load(f)
        except Exception:  # an older FigureData, a partial file: build it again
            pass
    from mismatch_replay import analysis

    t0 = time.perf_counter()
    data = analysis.figure_data([str(path)])
    print(f"{name}: FigureData built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    tmp = pkl.with_name(f"{pkl.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        pickle.dump(data, f)
    tmp.replace(pkl)
    return name, data


def measure(data, out: Path, fmt: str, rounds: int, dpi: int) -> dict:
    """The first call's wall seconds, then `rounds` calls' wall and CPU seconds."""
    from mismatch_replay.viz import render_all

    t0 = time.perf_counter()
    render_all(data, out, fmt, force=True, dpi=dpi)
    first = time.perf_counter() - t0
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        render_all(data, out, fmt, force=True, dpi=dpi)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "first": first,
        "wall": wall,
        "cpu": cpu,
        "best": min(wall),
        "median": statistics.median(wall),
        "best_cpu": min(cpu),
    }


def measure_pool(data, out: Path, fmt: str, rounds: int, dpi: int) -> dict:
    """render_all alone and with a `pool.FigurePool` (its helper draws `pool.OFFLOAD`,
    masked_fraction), alternating for `rounds` rounds after one warm-up call of each (the
    helper's imports, as a report pays them during its read): best wall seconds of each and
    their ratio. `report` sends masked_fraction earlier still (while choose runs): not here."""
    from mismatch_replay.viz import pool, render_all

    plain, pooled = [], []
    with pool.FigurePool() as helper:
        render_all(data, out, fmt, force=True, dpi=dpi)
        render_all(data, out, fmt, force=True, dpi=dpi, pool=helper)
        for _ in range(rounds):
            t0 = time.perf_counter()
            render_all(data, out, fmt, force=True, dpi=dpi)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            render_all(data, out, fmt, force=True, dpi=dpi, pool=helper)
            pooled.append(time.perf_counter() - t0)
    return {"plain": plain, "pool": pooled, "ratio": min(pooled) / min(plain)}


def line(name: str, r: dict, fmt: str, dpi: int) -> str:
    rounds = " ".join(f"{t:.3f}" for t in r["wall"])
    return (
        f"{name}: render_all {fmt} dpi {dpi}: best {r['best']:.3f} s (CPU {r['best_cpu']:.3f} s),"
        f" median {r['median']:.3f} s ({rounds}); first call {r['first']:.3f} s"
    )


def run_trees(args) -> dict:
    """Each tree's measurement in its own process, trees alternating; per tree and log, the
    calls of every round together (best and median of all, best first call)."""
    runs: dict[str, dict[str, list[dict]]] = {}
    if args.rebuild:  # once, by this process's mismatch_replay, for every tree
        for log in args.log or ["sample", "20m"]:
            figure_data(log, args.cache, rebuild=True)
    for k in range(args.repeat):
        trees = args.trees if k % 2 == 0 else args.trees[::-1]
        for tree in trees:
            tree = tree.resolve()
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                cmd = [sys.executable, __file__, "--rounds", str(args.rounds), "--json", tmp.name]
                cmd += ["--fmt", args.fmt, "--dpi", str(args.dpi), "--cache", str(args.cache)]
                for log in args.log or ["sample", "20m"]:
                    cmd += ["--log", log]
                env = {**os.environ, "PYTHONPATH": str(tree)}
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
                res = json.loads(Path(tmp.name).read_text())
            for name, r in res.items():
                runs.setdefault(str(tree), {}).setdefault(name, []).append(r)
    out: dict[str, dict[str, dict]] = {}
    for tree, logs in runs.items():
        print(tree)
        for name, rs in logs.items():
            wall = [t for r in rs for t in r["wall"]]
            cpu = [t for r in rs for t in r["cpu"]]
            r = {
                "first": min(r["first"] for r in rs),
                "wall": wall,
                "cpu": cpu,
                "best": min(wall),
                "median": statistics.median(wall),
                "best_cpu": min(cpu),
            }
            out.setdefault(tree, {})[name] = r
            print("  " + line(name, r, args.fmt, args.dpi))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", action="append", help="sample, 20m or a parquet path (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="timed calls after the first")
    ap.add_argument("--fmt", default="png", choices=("png", "svg", "pdf"))
    ap.add_argument("--dpi", type=int, default=150, help="as write_report's default")
    ap.add_argument("--out", type=Path, help="where the figures go (default: a temporary folder)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--rebuild", action="store_true", help="build the FigureData again")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--pool", action="store_true", help="also with the helper process (pool.py)")
    ap.add_argument("--json", type=Path, help="write the timings here")
    ap.add_argument("--trees", nargs="+", type=Path, help="source trees to compare")
    ap.add_argument("--repeat", type=int, default=3, help="--trees: rounds over the trees")
    args = ap.parse_args()
    if args.trees:
        results = run_trees(args)
    else:
        import mismatch_replay

        print(f"mismatch_replay from {Path(mismatch_replay.__file__).parent}")
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for log in args.log or ["sample", "20m"]:
                name, data = figure_data(log, args.cache, args.rebuild)
                out = (args.out / name) if args.out else Path(tmp) / name
                results[name] = r = measure(data, out, args.fmt, args.rounds, args.dpi)
                print(line(name, r, args.fmt, args.dpi))
                if args.pool:
                    r["pool"] = got = measure_pool(data, out, args.fmt, args.rounds, args.dpi)
                    print(
                        f"{name}: with the helper process {min(got['pool']):.3f} s against "
                        f"{min(got['plain']):.3f} s alone (best of {args.rounds}): "
                        f"{got['ratio']:.2f}x"
                    )
                if args.profile:
                    from mismatch_replay.viz import render_all

                    prof = cProfile.Profile()
                    prof.runcall(render_all, data, out, args.fmt, force=True, dpi=args.dpi)
                    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
