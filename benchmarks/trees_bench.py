"""Two source trees, one log, interleaved: the full default sweep's time as a ratio to the
scan floor, for a refactor's before/after.

Usage:
    git worktree add /tmp/before <commit>
    python benchmarks/trees_bench.py /tmp/before . --tokens 20e6 --rounds 5

Each round runs, in fresh subprocesses, the floor (polars summing the two log-prob columns),
then the workload (default `ours-warm`: sweep_bench.py's full sweep in a process that ran
one first, numba loaded; `ours`: in a fresh process) of every tree, in the given order in
even rounds and reversed in odd ones, each tree's own benchmarks/sweep_bench.py with
PYTHONPATH set to that tree. One warm-up round per tree (numba compiles into the tree's
__pycache__) is not counted. Reported: per tree the median over rounds of (sweep seconds /
that round's floor seconds), and the ratio of the medians: the machines are shared and
noisy, so only ratios measured side by side mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run(tree: Path, name: str, log: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / "sweep_bench.py"), "--run", name, str(log)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, check=False)
    if res.returncode:
        raise SystemExit(f"{tree}: {name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path, help="source trees (first = baseline)")
    ap.add_argument("--tokens", type=float, default=20e6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workload", default="ours-warm", help="sweep_bench.py workload")
    ap.add_argument("--json", type=Path, help="write the measurements here")
    args = ap.parse_args()
    trees = [t.resolve() for t in args.trees]
    sys.path.insert(0, str(HERE))
    from sweep_bench import DATA, make_log

    n = int(args.tokens)
    log = DATA / f"log_{n}.parquet"
    if not log.exists():
        DATA.mkdir(parents=True, exist_ok=True)
        make_log(log, n)
    for t in trees:  # warm-up: numba compiles into each tree's cache
        _run(t, args.workload, log)
    ratios: dict[str, list[float]] = {str(t): [] for t in trees}
    rows = []
    for r in range(args.rounds):
        floor = _run(trees[0], "floor", log)["seconds"]
        for t in trees if r % 2 == 0 else trees[::-1]:  # alternate: no tree always first
            s = _run(t, args.workload, log)["seconds"]
            ratios[str(t)].append(s / floor)
            rows.append({"round": r, "tree": str(t), "seconds": s, "floor": floor})
            print(
                f"round {r}: {t.name:>12}  {s:6.2f} s  floor {floor:5.2f} s  "
                f"ratio {s / floor:6.2f}",
                flush=True,
            )
    med = {t: statistics.median(v) for t, v in ratios.items()}
    base = med[str(trees[0])]
    print(f"\n{args.workload}, {n:,} tokens, {args.rounds} rounds (median ratio to the floor):")
    for t in trees:
        m = med[str(t)]
        print(f"  {t!s:<40} {m:6.2f}x floor   {m / base:5.3f} of the first tree")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "median_ratio": med}, indent=1))


if __name__ == "__main__":
    main()
