"""Sweep benchmark: the scan floor, the full default sweep, and a naive loop, in one run.

Usage:
    python benchmarks/sweep_bench.py                 # 20M tokens (generated once, ~0.4 GB)
    python benchmarks/sweep_bench.py --tokens 2e6    # quick
    python benchmarks/sweep_bench.py --naive-passes 8 --json out.json

What is measured, each in a fresh subprocess (so that peak RSS is its own):
  floor  polars reading the two log-prob columns of the same file and summing them: no engine
         can replay a log faster than it can read it.
  ours   `engine.sweep(file)`: every rule the log supports over its default grid (>= 100
         values each), sequence rules and metrics included; and the token rules alone.
  naive  one full pass per threshold (read, compute the rule's mask at one value, count):
         timed over --naive-passes passes of IPO and extrapolated to the number of grid points
         of the full sweep, which is stated next to it.
Reported as ratios to the floor (the machines are shared and noisy: compare within one run).
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


def make_log(path: Path, tokens: int, seed: int = 0) -> None:
    """A synthetic canonical log: peaked tokens, a rare tail, bf16-scale mismatch, outliers."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    chunk = 2_000_000
    seq_len = 512
    tmp = path.with_suffix(".tmp")
    writer = None
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        idx = np.arange(done, done + n)
        seq = idx // seq_len
        step = seq // 256
        sample = seq % 256
        # inference log-prob: most tokens confident, a long tail of rare ones
        lq = -rng.exponential(0.05, n)
        tail = rng.random(n) < 0.15
        lq[tail] = -rng.exponential(3.0, tail.sum())
        noise = rng.normal(0.0, 0.01, n) * (1 + 3 * tail)
        out = rng.random(n) < 2e-4
        noise[out] += rng.normal(0.0, 1.5, out.sum())
        lp = np.minimum(lq + noise, 0.0)
        adv = np.repeat(rng.normal(size=n // seq_len + 2), seq_len)[:n]
        table = pa.table(
            {
                "step": step.astype(np.int64),
                "sample_id": sample.astype(np.int64),
                "position": (idx % seq_len).astype(np.int64),
                "trainer_logprob": lp,
                "inference_logprob": lq,
                "advantage": adv,
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
        writer.write_table(table, row_group_size=1_000_000)
        done += n
    writer.close()
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- workloads
# Each runs in its own subprocess: `python sweep_bench.py --run NAME FILE [passes]`.


def _floor(path: str) -> dict:
    import polars as pl

    t = time.perf_counter()
    s = (
        pl.scan_parquet(path)
        .select(pl.col("trainer_logprob").sum(), pl.col("inference_logprob").sum())
        .collect()
    )
    return {"seconds": time.perf_counter() - t, "check": float(s.row(0)[0])}


def _ours(path: str, token_only: bool = False) -> dict:
    from mismatch_replay import engine
    from mismatch_replay.rules import REGISTRY

    rules = None
    if token_only:
        rules = [
            c()
            for c in REGISTRY.values()
            if c.level == "token" and c.name not in ("token-k2", "token-k3")
        ]
        sweeps = {}
        for r in rules:
            for p in r.params:
                if p.threshold:
                    sweeps[f"{r.name}.{p.name}"] = p.grid
        t = time.perf_counter()
        res = engine.sweep([path], rules=rules, sweeps=sweeps)
    else:
        t = time.perf_counter()
        res = engine.sweep([path])
    sec = time.perf_counter() - t
    return {
        "seconds": sec,
        "rows": res.table.height,
        "grid_points": res.table.height,
        "tokens": int(res.table["tokens"].max()),
    }


def _naive(path: str, passes: int) -> dict:
    """One full pass per threshold: read, |p - q| > eps, count."""
    import numpy as np
    import polars as pl

    eps = np.geomspace(1e-3, 1, passes)
    t = time.perf_counter()
    counts = []
    for e in eps:
        df = pl.read_parquet(path, columns=["trainer_logprob", "inference_logprob"])
        p = np.exp(df["trainer_logprob"].to_numpy())
        q = np.exp(df["inference_logprob"].to_numpy())
        counts.append(int(np.count_nonzero(np.abs(p - q) > e)))
        del df, p, q
    return {"seconds_per_pass": (time.perf_counter() - t) / passes, "counts": counts}


def _child(name: str, path: str, arg: str | None) -> None:
    import resource

    if name == "floor":
        out = _floor(path)
    elif name == "ours":
        out = _ours(path)
    elif name == "ours_token":
        out = _ours(path, token_only=True)
    else:
        out = _naive(path, int(arg))
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))


def _spawn(name: str, path: Path, arg: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--run", name, str(path)] + ([arg] if arg else [])
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=20e6)
    ap.add_argument("--naive-passes", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=2, help="floor and ours: best of N")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--run", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        _child(a.run[0], a.run[1], a.run[2] if len(a.run) > 2 else None)
        return
    n = int(a.tokens)
    DATA.mkdir(exist_ok=True)
    path = DATA / f"log_{n}.parquet"
    if not path.exists():
        t = time.perf_counter()
        make_log(path, n)
        print(
            f"generated {path} ({path.stat().st_size / 2**20:.0f} MiB) in "
            f"{time.perf_counter() - t:.0f} s",
            file=sys.stderr,
        )
    _spawn("floor", path)  # warm the file cache once so every workload sees the same cache
    floor = min((_spawn("floor", path) for _ in range(a.repeat)), key=lambda d: d["seconds"])
    ours = min((_spawn("ours", path) for _ in range(a.repeat)), key=lambda d: d["seconds"])
    tok = _spawn("ours_token", path)
    naive = _spawn("naive", path, str(a.naive_passes))
    naive_total = naive["seconds_per_pass"] * ours["grid_points"]
    res = {
        "tokens": n,
        "cpu_count": os.cpu_count(),
        "floor_s": floor["seconds"],
        "ours_s": ours["seconds"],
        "ours_token_rules_s": tok["seconds"],
        "grid_points": ours["grid_points"],
        "naive_s_per_pass": naive["seconds_per_pass"],
        "naive_extrapolated_s": naive_total,
        "ours_over_floor": ours["seconds"] / floor["seconds"],
        "token_rules_over_floor": tok["seconds"] / floor["seconds"],
        "naive_over_ours": naive_total / ours["seconds"],
        "peak_rss_gib": {
            "floor": floor["peak_rss_gib"],
            "ours": ours["peak_rss_gib"],
            "naive": naive["peak_rss_gib"],
        },
    }
    print(f"tokens                {n:,}  ({os.cpu_count()} cores)")
    print(f"scan floor            {floor['seconds']:8.2f} s   peak {floor['peak_rss_gib']:.2f} GiB")
    print(
        f"full default sweep    {ours['seconds']:8.2f} s   peak {ours['peak_rss_gib']:.2f} GiB"
        f"   ({ours['grid_points']:,} rule x value rows)  = {res['ours_over_floor']:.1f}x floor"
    )
    print(
        f"token rules only      {tok['seconds']:8.2f} s   = {res['token_rules_over_floor']:.1f}x "
        "floor"
    )
    print(
        f"naive, per threshold  {naive['seconds_per_pass']:8.2f} s   x {ours['grid_points']:,} "
        f"= {naive_total:,.0f} s (extrapolated from {a.naive_passes} passes)"
        f"  = {res['naive_over_ours']:.0f}x ours"
    )
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
