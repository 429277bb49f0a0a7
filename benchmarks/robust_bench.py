"""--robust benchmark: the reference accumulation (Tally._add_robust's numpy code) against
`engine.robust.add_robust` (numba) on the worker threads and on one, on one log, in one run.

Usage:
    python benchmarks/robust_bench.py                      # _data/log_20000000.parquet
    python benchmarks/robust_bench.py --file LOG.parquet --batch 1e6 --repeat 3

The log is read once (step, sample_id, position and the two log-probs); each 1M-row batch
then goes through both functions, each with a fresh TokenBatch (as the fused path builds
one for --robust: the reference pays for the whole batch's p and q), group codes = the step
column mapped to 0 .. G-1 in order of appearance, G growing as new steps appear (as the
Tally's `--by step` does). Reading is not timed. The paths alternate batch by batch (a
burst of load on this shared machine hits all alike), the best of --repeat passes is kept,
and the final states are compared bit for bit. "fast" runs on `fast.threads()` threads
(MISMATCH_REPLAY_THREADS), "one thread" with every batch in one chunk. Only the ratios mean
anything (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl

from mismatch_replay import fast
from mismatch_replay.engine import robust
from mismatch_replay.rules import TokenBatch

DATA = Path(__file__).resolve().parent / "_data"
COLUMNS = ["step", "sample_id", "position", "trainer_logprob", "inference_logprob"]


def _state() -> SimpleNamespace:
    return SimpleNamespace(k3_hist=None, k3_hist_sum=None, top={})


def _same(a, b) -> bool:
    if not (np.array_equal(a.k3_hist, b.k3_hist) and list(a.top) == list(b.top)):
        return False
    if not np.array_equal(a.k3_hist_sum.view(np.uint64), b.k3_hist_sum.view(np.uint64)):
        return False
    for gi, ta in a.top.items():
        tb = b.top[gi]
        if list(ta) != list(tb):
            return False
        for c in ta:
            if ta[c].dtype != tb[c].dtype or ta[c].tobytes() != tb[c].tobytes():
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=str(DATA / "log_20000000.parquet"))
    ap.add_argument("--batch", type=float, default=1e6)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    df = pl.read_parquet(args.file, columns=COLUMNS)
    step = df["step"].to_numpy()
    steps, first = np.unique(step, return_index=True)
    order = np.argsort(first)  # codes in order of appearance
    code = np.empty(steps.shape[0], dtype=np.int64)
    code[order] = np.arange(steps.shape[0])
    g_all = code[np.searchsorted(steps, step)]
    size = int(args.batch)
    parts = []
    for lo in range(0, df.height, size):
        d = df.slice(lo, size)
        g = g_all[lo : lo + size]
        lp = d["trainer_logprob"].to_numpy()
        lq = d["inference_logprob"].to_numpy()
        parts.append((d, lp, lq, g))
    Gs = np.maximum.accumulate([int(g.max()) + 1 for *_, g in parts])

    t = time.perf_counter()
    robust.kernels()  # numba's start and the kernels (compiled or loaded from the cache)
    d, lp, lq, g = parts[0]
    robust.add_robust(_state(), d[:1000], TokenBatch(lp[:1000], lq[:1000]), g[:1000], int(Gs[0]))
    start = time.perf_counter() - t

    def one_thread(*a):
        keep, robust.MIN_CHUNK = robust.MIN_CHUNK, 1 << 62
        try:
            robust.add_robust(*a)
        finally:
            robust.MIN_CHUNK = keep

    paths = {"reference": robust.add_robust_numpy, "fast": robust.add_robust}
    paths["one thread"] = one_thread
    best = dict.fromkeys(paths, np.inf)
    for _ in range(args.repeat):
        states = {k: _state() for k in paths}
        spent = dict.fromkeys(best, 0.0)
        for (d, lp, lq, g), G in zip(parts, Gs, strict=True):
            for name, fn in paths.items():
                tb = TokenBatch(lp, lq)
                t = time.perf_counter()
                fn(states[name], d, tb, g, int(G))
                spent[name] += time.perf_counter() - t
        best = {k: min(best[k], spent[k]) for k in best}
    same = all(_same(states["reference"], states[k]) for k in paths)
    n = df.height
    print(f"{args.file}: {n:,} tokens, {len(parts)} batches, {int(Gs[-1])} groups")
    print(f"numba start + kernels: {start:.2f} s (once per process)")
    print(f"threads: {fast.threads()}; batches by path: {dict(robust.paths)}")
    for k, v in best.items():
        print(f"{k:>10}: {v:7.3f} s  ({1e9 * v / n:6.1f} ns/token)  best of {args.repeat}")
    for k in ("fast", "one thread"):
        print(f"ratio reference / {k}: {best['reference'] / best[k]:.1f}x")
    print(f"identical (counts, sums bit for bit, top tokens): {same}")


if __name__ == "__main__":
    main()
