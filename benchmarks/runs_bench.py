"""drift --run benchmark: reading two runs costs the sum of reading each, not more.

Usage:
    python benchmarks/runs_bench.py                    # two 2M-token logs in _data/
    python benchmarks/runs_bench.py --tokens 5e6 --repeat 3

Three workloads, each in a fresh process, interleaved (a burst of load on this shared
machine hits all alike), best of --repeat:
  a      `analysis.drift` on run A's log alone (IPO 0.3 and IcePop [0.2, 5]);
  b      the same on run B's log;
  runs   `analysis.runs.drift_runs` on both, each with one of the rules as its own and the
         other as the shared -r rule (the same two jobs a run), rewards and entropy read.
Each process first runs its workload on a tiny log (numba's kernels loaded, polars warmed),
untimed, so that every workload pays its start once and the times compare the reads. The
answer is the ratio runs / (a + b): 1.0 is "their sum"; CPU seconds beside wall seconds
(wall > CPU / cores: something else had the cores). Only the ratio means anything
(benchmarks/README.md).

The logs (`_data/runs_<N>_{a,b}.parquet`, gitignored, made once) are synthetic: 40 steps,
256-token sequences, bf16-scale mismatch with a 10% tail, the B run drifting from step 20,
an entropy per token and a reward per sequence.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl

DATA = Path(__file__).resolve().parent / "_data"
RULES = ("ipo:eps=0.3", "icepop:low=0.2,high=5")

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import numpy as np, polars as pl
from mismatch_replay import analysis
from mismatch_replay.analysis.runs import Run, drift_runs
kind, a, b, tiny = sys.argv[1:5]
def work(a, b):
    if kind == "runs":
        drift_runs([Run("a", (a,), rules=(RULES[0],)), Run("b", (b,), rules=(RULES[0],))],
                   [RULES[1]])
    else:
        analysis.drift([a if kind == "a" else b], rules=list(RULES))
work(tiny, tiny)  # warm-up of the workload's own code path: not timed
t0, c0 = time.perf_counter(), time.process_time()
work(a, b)
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0}))
"""


def make_log(path: Path, tokens: int, drift_from: int | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    steps, seq = 40, 256
    per = tokens // steps // seq * seq
    frames = []
    for step in range(steps):
        lq = np.where(rng.random(per) < 0.9, -rng.exponential(0.05, per), -rng.exponential(4, per))
        sd = 2e-3 * (
            1 + (step - drift_from) if drift_from is not None and step >= drift_from else 1
        )
        lp = np.minimum(lq + rng.normal(0, sd, per) * (1 + np.abs(lq)), 0.0)
        n = per // seq
        frames.append(
            pl.DataFrame(
                {
                    "step": np.full(per, step, dtype=np.int64),
                    "sample_id": np.repeat(np.arange(n, dtype=np.int64), seq),
                    "position": np.tile(np.arange(seq, dtype=np.int64), n),
                    "trainer_logprob": lp,
                    "inference_logprob": lq,
                    "entropy": rng.exponential(0.6, per),
                    "reward": np.repeat(rng.integers(0, 2, n).astype(float), seq),
                }
            )
        )
    pl.concat(frames).write_parquet(path, compression="zstd", row_group_size=1 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=2e6)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    n = int(args.tokens)
    DATA.mkdir(exist_ok=True)
    a, b, tiny = (DATA / f"runs_{n}_{x}.parquet" for x in ("a", "b", "tiny"))
    for path, drift, seed, size in ((a, None, 1, n), (b, 20, 2, n), (tiny, None, 3, 40 * 256)):
        if not path.exists():
            make_log(path, size, drift, seed)
    child = f"RULES = {RULES!r}\n" + CHILD
    best: dict[str, dict] = {}
    for _ in range(args.repeat):
        for kind in ("a", "b", "runs"):
            out = subprocess.run(
                [sys.executable, "-c", child, kind, str(a), str(b), str(tiny)],
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(out.stdout.strip().splitlines()[-1])
            if kind not in best or got["wall"] < best[kind]["wall"]:
                best[kind] = got
    print(f"two logs of {n:,} tokens each; best of {args.repeat}, each in a fresh process")
    for kind in ("a", "b", "runs"):
        print(f"  {kind:5s} wall {best[kind]['wall']:7.3f} s   CPU {best[kind]['cpu']:7.3f} s")
    total = best["a"]["wall"] + best["b"]["wall"]
    print(f"  runs / (a + b) = {best['runs']['wall'] / total:.3f} (wall), "
          f"{best['runs']['cpu'] / (best['a']['cpu'] + best['b']['cpu']):.3f} (CPU)")  # fmt: skip


if __name__ == "__main__":
    main()
