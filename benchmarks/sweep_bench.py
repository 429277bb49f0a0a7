"""Sweep benchmark: the scan floor, the full default sweep, a naive loop and Ray, in one run.

Usage:
    python benchmarks/sweep_bench.py                      # 20M tokens (generated once, 0.3 GB)
    python benchmarks/sweep_bench.py --tokens 2e6         # quick
    python benchmarks/sweep_bench.py --tokens 200e6 --memory-only   # peak memory at 200M
    python benchmarks/sweep_bench.py --ray --simple --json out.json

What is measured, each in a fresh subprocess (so that its peak RSS is its own), best of
--repeat for the short ones:
  floor        polars reading the two log-prob columns of the same file and summing them: no
               engine can replay a log faster than it can read it (the issue's scan floor).
  floor5       the same for the five columns the full sweep reads (log-probs, step,
               sample_id, advantage): the floor of this particular sweep.
  read5        the engine's own reader (plan, read-ahead thread, validation) over those five
               columns, nothing computed: what `ours` pays before its first exp.
  bound        `read5` plus the per-token arithmetic every output is made of (p, q, |dp|,
               the clamped ratio, k3, a binary-KL pair) with the kernel's vectorised
               exp/log, on both cores, after numba's start: a lower bound for `ours-warm`
               (_bound.py).
  ours         `engine.sweep(file)`: every rule the log supports over its default grid (>= 100
               values each: 22 token jobs, m2po, 10 sequence jobs), the metrics, the scatter.
  ours-warm    `ours` in a process that has run a small sweep first: numba imported and
               its kernels loaded (~0.8 s once per process), as in a notebook or a Ray worker.
  ours-1t      the same on one thread (MISMATCH_REPLAY_THREADS=1): scaling with cores.
  tokens-only  token rules and m2po, no sequence ids read (sequence rules add the difference).
  tokens-by-step  tokens-only with --by step: every count and metric per step too.
  simple       (--simple) `ours` on the numpy path (MISMATCH_REPLAY_KERNEL=numpy).
  ray          (--ray) `ours` with engine="ray" on the log split into --ray-files files, on a
               local Ray instance with one worker per core; its table is compared with the local
               engine's on the same files (counts exact, floats to 1e-9).
  naive        one full pass per threshold (read, |p - q| > eps, count): timed over
               --naive-passes passes and extrapolated to the full sweep's rule x value rows.
Reported as ratios to the floor: the machines are shared and noisy, so only ratios measured in
the same run are meaningful. CPU seconds are reported next to wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "_data"
FIVE = ["trainer_logprob", "inference_logprob", "step", "sample_id", "advantage"]


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


def split_log(path: Path, parts: int) -> Path:
    """The same log as `parts` files of whole row groups (for the Ray engine)."""
    import pyarrow.parquet as pq

    d = path.parent / f"{path.stem}_x{parts}"
    if d.exists() and len(list(d.glob("*.parquet"))) == parts:
        return d
    d.mkdir(exist_ok=True)
    pf = pq.ParquetFile(path)
    groups = list(range(pf.num_row_groups))
    per = -(-len(groups) // parts)
    for i in range(parts):
        sel = groups[i * per : (i + 1) * per]
        if sel:
            pq.write_table(pf.read_row_groups(sel), d / f"part{i:02d}.parquet", compression="zstd")
    return d


# ----------------------------------------------------------------------------- workloads
# Each runs in its own subprocess: `python sweep_bench.py --run NAME FILE [ARG]`.


def _floor(path: str, cols: list[str]) -> dict:
    import polars as pl

    t = time.perf_counter()
    s = pl.scan_parquet(path).select([pl.col(c).sum() for c in cols]).collect()
    return {"seconds": time.perf_counter() - t, "check": float(s.row(0)[0])}


def _ours(path: str, mode: str = "full") -> dict:
    from mismatch_replay import engine
    from mismatch_replay.rules import REGISTRY

    kw: dict = {}
    if mode == "tokens-step":  # the same, every count and metric per step as well
        kw["by"] = "step"
    if mode in ("tokens", "tokens-step"):  # token rules and m2po; no sequence ids read
        kw["rules"] = [c() for c in REGISTRY.values() if c.level != "sequence"]
        kw["sweeps"] = {
            f"{c.name}.{p.name}": p.grid
            for c in REGISTRY.values()
            if c.level != "sequence"
            for p in c.params
            if p.threshold
        }
        from mismatch_replay.engine import stream

        needed = stream.columns_needed  # what replay() reads

        def no_sequences(jobs, by, available):
            return [c for c in needed(jobs, by, available) if c != "sample_id"]

        stream.columns_needed = no_sequences
    if mode == "warm":  # numba loaded and the kernel's caches read first, as in a notebook
        small = DATA / "log_2000000.parquet"
        engine.sweep([str(small) if small.exists() else path])
    if mode == "ray":
        from mismatch_replay.engine import ray as distributed

        distributed.init(num_cpus=os.cpu_count())
        kw["engine"] = "ray"
    t = time.perf_counter()
    c = time.process_time()
    res = engine.sweep([path], **kw)
    out = {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": time.process_time() - c,
        "rows": res.table.height,
        "tokens": int(res.table["tokens"].max()),
        "m2po_spilled_tokens": res.tally.m2po.spilled_tokens,
    }
    if mode in ("ray", "local-split"):
        res.table.write_parquet(f"{path.rstrip('/')}.{mode}.parquet")
    return out


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


def _no_pre_buffer() -> None:
    """--no-pre-buffer: every `pq.ParquetFile` opened without pre-buffering, as io.py does
    since aa08cdc (pyarrow's default keeps every row group it has read: ~16 bytes a token of
    the projected columns, 4.4 GiB peak at 200M tokens); for measuring older trees."""
    import functools

    import pyarrow.parquet as pq

    pq.ParquetFile = functools.partial(pq.ParquetFile, pre_buffer=False)


def _child(name: str, path: str, arg: str | None) -> None:
    import resource

    if os.environ.get("MR_BENCH_NO_PRE_BUFFER") == "1":
        _no_pre_buffer()

    if name == "floor":
        out = _floor(path, FIVE[:2])
    elif name == "floor5":
        out = _floor(path, FIVE)
    elif name in ("read5", "bound"):
        from _bound import run

        out = run(path, compute=name == "bound")
    elif name in ("ours", "ours-1t", "simple"):
        out = _ours(path)
    elif name == "ours-warm":
        out = _ours(path, "warm")
    elif name == "tokens-only":
        out = _ours(path, "tokens")
    elif name == "tokens-by-step":
        out = _ours(path, "tokens-step")
    elif name in ("ray", "local-split"):
        out = _ours(path, name)
    else:
        out = _naive(path, int(arg))
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if name == "ray":  # the workers' memory is theirs: report the driver's
        out["note"] = "driver process only"
    print(json.dumps(out))


ENV = {
    "ours-1t": {"MISMATCH_REPLAY_THREADS": "1"},
    "simple": {"MISMATCH_REPLAY_KERNEL": "numpy"},
}


def _spawn(name: str, path: Path, arg: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--run", name, str(path)] + ([arg] if arg else [])
    env = {**os.environ, **ENV.get(name, {})}
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _best(name: str, path: Path, repeat: int) -> dict:
    return min((_spawn(name, path) for _ in range(repeat)), key=lambda d: d["seconds"])


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return f"{os.cpu_count()} cores ({cpu}), load average {load:.1f} at start"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=20e6)
    ap.add_argument("--naive-passes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2, help="floor and ours: best of N")
    ap.add_argument("--ray", action="store_true", help="also the Ray engine on split files")
    ap.add_argument("--ray-files", type=int, default=4)
    ap.add_argument("--simple", action="store_true", help="also the numpy path (slow)")
    ap.add_argument("--memory-only", action="store_true", help="floor and ours only, once")
    ap.add_argument(
        "--no-pre-buffer",
        action="store_true",
        help="read Parquet without pyarrow's pre-buffering (see _no_pre_buffer)",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--run", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        _child(a.run[0], a.run[1], a.run[2] if len(a.run) > 2 else None)
        return
    n = int(a.tokens)
    if a.no_pre_buffer:
        os.environ["MR_BENCH_NO_PRE_BUFFER"] = "1"
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
    machine = _machine()
    _spawn("floor", path)  # warm the file cache once so every workload sees the same cache
    small = DATA / "log_2000000.parquet"
    _spawn("ours", small if small.exists() else path)  # compile or load the kernel cache once
    rows: dict[str, dict] = {}
    repeat = 1 if a.memory_only else a.repeat
    rows["floor"] = _best("floor", path, repeat)
    if not a.memory_only:
        rows["floor5"] = _best("floor5", path, repeat)
        rows["read5"] = _best("read5", path, repeat)
        rows["bound"] = _best("bound", path, repeat)
    rows["ours"] = _best("ours", path, repeat)
    if not a.memory_only:
        rows["ours-warm"] = _best("ours-warm", path, repeat)
        rows["ours-1t"] = _spawn("ours-1t", path)
        rows["tokens-only"] = _best("tokens-only", path, repeat)
        rows["tokens-by-step"] = _spawn("tokens-by-step", path)
        if a.simple:
            rows["simple"] = _spawn("simple", path)
        naive = _spawn("naive", path, str(a.naive_passes))
        rows["naive"] = {
            "seconds": naive["seconds_per_pass"] * rows["ours"]["rows"],
            "seconds_per_pass": naive["seconds_per_pass"],
            "peak_rss_gib": naive["peak_rss_gib"],
        }
    ray_match = None
    if a.ray:
        d = split_log(path, a.ray_files)
        rows["local-split"] = _spawn("local-split", d)
        rows["ray"] = _spawn("ray", d)
        ray_match = _compare(d)
    floor = rows["floor"]["seconds"]
    pre = "; Parquet read without pre-buffering" if a.no_pre_buffer else ""
    print(f"tokens {n:,}; {machine}{pre}")
    print(f"{'workload':14s} {'wall s':>9s} {'cpu s':>8s} {'x floor':>8s} {'peak RSS':>9s}")
    for name, r in rows.items():
        cpu = r.get("cpu_seconds")
        cpu_s = f"{cpu:8.2f}" if cpu is not None else f"{'':8s}"
        print(
            f"{name:14s} {r['seconds']:9.2f} {cpu_s} {r['seconds'] / floor:8.1f} "
            f"{r['peak_rss_gib']:7.2f} G"
        )
    if "naive" in rows:
        print(
            f"naive = {rows['naive']['seconds_per_pass']:.2f} s/pass x {rows['ours']['rows']:,} "
            f"rule x value rows (extrapolated from {a.naive_passes} passes): "
            f"{rows['naive']['seconds'] / rows['ours']['seconds']:.0f}x ours"
        )
    if "tokens-only" in rows:
        extra = rows["ours"]["seconds"] - rows["tokens-only"]["seconds"]
        print(f"sequence rules add {extra:.2f} s = {extra / floor:.1f}x floor")
    if "bound" in rows:
        b = rows["bound"]["seconds"]
        print(
            f"bound (reading + unavoidable arithmetic, warm) = {b / floor:.1f}x floor; "
            f"ours-warm = {rows['ours-warm']['seconds'] / b:.1f}x bound"
        )
    if "ours-1t" in rows:
        print(f"2 threads vs 1: {rows['ours-1t']['seconds'] / rows['ours']['seconds']:.2f}x")
    if ray_match is not None:
        print(f"ray vs local engine on {a.ray_files} files: {ray_match}")
    if a.json:
        res = {
            "tokens": n,
            "machine": machine,
            "no_pre_buffer": a.no_pre_buffer,
            "rows": rows,
            "ray_match": ray_match,
            "ratios": {k: v["seconds"] / floor for k, v in rows.items()},
        }
        a.json.write_text(json.dumps(res, indent=2))


def _compare(d: Path) -> str:
    import numpy as np
    import polars as pl

    a = pl.read_parquet(f"{d}.local-split.parquet")
    b = pl.read_parquet(f"{d}.ray.parquet")
    keys = ["rule", "setting", "param", "value"]
    a, b = a.sort(keys), b.sort(keys)
    if a.columns != b.columns or a.height != b.height:
        return "MISMATCH (shape)"
    worst = 0.0
    for c in a.columns:
        x, y = a[c], b[c]
        if x.dtype == pl.Float64:
            xv, yv = x.fill_null(0).to_numpy(), y.fill_null(0).to_numpy()
            rel = np.abs(xv - yv) / np.maximum(np.abs(xv), 1e-300)
            worst = max(worst, float(np.nanmax(np.where(xv == yv, 0, rel))))
        elif not (x == y).fill_null(True).all():
            return f"MISMATCH ({c})"
    return f"identical counts on {a.height:,} rows; floats within {worst:.1e} relative"


if __name__ == "__main__":
    main()
