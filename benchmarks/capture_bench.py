"""Capture benchmark: how long TokenWriter.write() holds a training loop, and how many tokens a
second the writer sustains, with the Parquet encoding floor beside them, in one run.

Usage:
    python benchmarks/capture_bench.py                 # 1M-token steps, bf16 and fp32
    python benchmarks/capture_bench.py --steps 40 --json out.json
    python benchmarks/capture_bench.py --no-fsync --compression lz4

The batch is what a trainer holds after the rollout, as CPU tensors: 1024 sequences padded to
1536 positions, lengths uniform in 512..1536 (~1.05M loss tokens of 1.57M positions), the
trainer's log-probs in bf16 or fp32, the sampler's in fp32, a bool mask, one fp32 advantage
per sequence. Measured:
  write       write() latency with an idle writer: the loop waits for the writer to drain
              between calls, as a training step (seconds) would; median and max of --steps
              calls. Target: <= 10 ms for 1M tokens of CPU tensors.
  sustained   back-to-back write() of --steps steps, then close(): total loss tokens / wall
              seconds, close() included (every step encoded, fsync'ed, renamed, committed).
              Target: >= 5M tokens/s on 2 cores.
  floor       pyarrow writing one step's final table (already built) with the same
              codec and encodings, as one file: the encoding cost no writer avoids. Sustained
              seconds a step / floor says what the rest (selection, queue, commit) costs.
Ratios are what to compare: the machines are shared, absolute figures move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from mismatch_replay.capture import TokenWriter, rank_file

HERE = Path(__file__).resolve().parent
WRITE_BUDGET_S = 0.010  # the bound for write() on 1M tokens of CPU tensors
THROUGHPUT_TARGET = 5e6  # tokens/s on 2 cores


def make_batch(dtype: torch.dtype, rows: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 3, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    lq = -torch.empty(rows, width).exponential_(2.0, generator=g)
    lp = (lq + 0.02 * torch.randn(rows, width, generator=g)).clamp(max=0.0)
    adv = torch.randn(rows, generator=g)
    return lp.to(dtype), lq.float(), mask, adv.float()


def measure(dtype: torch.dtype, args, root: Path) -> dict:
    lp, lq, mask, adv = make_batch(dtype, args.rows, args.width)
    tokens = int(mask.sum())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    kw = dict(
        fsync=not args.no_fsync, compression=args.compression, meta={"trainer_logprob": "old"}
    )

    # write(): latency with an idle writer (the loop's step takes longer than the encoding)
    lat = []
    with TokenWriter(root / "latency", **kw) as w:
        w.write(0, lp, lq, mask=mask, advantages=adv)  # warm-up: imports, first file
        w._queue.join()
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            w.write(step, lp, lq, mask=mask, advantages=adv)
            lat.append(time.perf_counter() - t0)
            w._queue.join()

    # sustained: back to back, close() included
    c0 = time.process_time()
    t0 = time.perf_counter()
    with TokenWriter(root / "sustained", **kw) as w:
        for step in range(args.steps):
            w.write(step, lp, lq, mask=mask, advantages=adv)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    last = rank_file(root / "sustained", args.steps - 1, 0)
    disk = os.path.getsize(last) / tokens

    # floor: the final table of one step, written once by pyarrow with the same settings
    table = pq.read_table(last)
    floors = []
    for _ in range(3):
        t = time.perf_counter()
        pq.write_table(
            table,
            root / "floor.parquet",
            compression=args.compression,
            use_dictionary=["step", "sample_id"],
            row_group_size=1 << 20,
        )
        floors.append(time.perf_counter() - t)
    floor = min(floors)
    per_step = wall / args.steps
    rate = tokens * args.steps / wall
    return {
        "trainer_dtype": str(dtype).replace("torch.", ""),
        "loss_tokens_per_step": tokens,
        "padded_positions_per_step": int(mask.numel()),
        "write_median_ms": 1e3 * statistics.median(lat),
        "write_max_ms": 1e3 * max(lat),
        "write_median_x_budget": statistics.median(lat) / WRITE_BUDGET_S,
        "write_max_x_budget": max(lat) / WRITE_BUDGET_S,
        "sustained_tokens_per_s": rate,
        "sustained_x_target": rate / THROUGHPUT_TARGET,
        "sustained_wall_s": wall,
        "sustained_cpu_s": cpu,
        "step_s": per_step,
        "floor_s": floor,
        "step_x_floor": per_step / floor,
        "disk_bytes_per_token": disk,
        "peak_rss_growth_mib": rss1 - rss0,  # the writers' own memory (0 once a peak is set)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--compression", default="zstd")
    ap.add_argument("--no-fsync", action="store_true")
    ap.add_argument("--dir", type=Path, default=HERE / "_data", help="where the logs go")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="capture_", dir=args.dir))
    try:
        results = [measure(dt, args, root / str(dt)) for dt in (torch.bfloat16, torch.float32)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    info = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": args.steps,
        "compression": args.compression,
        "fsync": not args.no_fsync,
    }
    print(
        f"{args.steps} steps, {args.compression}, fsync {'on' if info['fsync'] else 'off'}, "
        f"{info['cpus']} CPUs, load {info['load_average'][0]:.2f}, "
        f"peak RSS {info['peak_rss_mib']:.0f} MiB"
    )
    head = (
        f"{'trainer':<9}{'tokens':>10}{'write med':>11}{'max':>8}{'x10ms':>7}"
        f"{'sustained':>13}{'x5M/s':>7}{'step s':>8}{'floor s':>9}{'x floor':>8}"
        f"{'B/token':>9}{'CPU/wall':>9}{'RSS+ MiB':>10}"
    )
    print(head)
    for r in results:
        print(
            f"{r['trainer_dtype']:<9}{r['loss_tokens_per_step']:>10,}"
            f"{r['write_median_ms']:>9.2f}ms{r['write_max_ms']:>6.1f}ms"
            f"{r['write_max_x_budget']:>7.2f}{r['sustained_tokens_per_s'] / 1e6:>10.1f}M/s"
            f"{r['sustained_x_target']:>7.1f}{r['step_s']:>8.3f}{r['floor_s']:>9.3f}"
            f"{r['step_x_floor']:>8.2f}{r['disk_bytes_per_token']:>9.2f}"
            f"{r['sustained_cpu_s'] / r['sustained_wall_s']:>9.2f}"
            f"{r['peak_rss_growth_mib']:>10.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"info": info, "results": results}, indent=2))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
