"""diagnose's cost against a default sweep, on the same log, in one run.

Usage:
    python benchmarks/diagnose_bench.py                  # 20M tokens (the sweep bench's log)
    python benchmarks/diagnose_bench.py --tokens 2e6     # quick
    python benchmarks/diagnose_bench.py --repeat 3

Each workload runs in a fresh subprocess (numba's start and every import paid as a user's
command pays them), alternating, best of --repeat:
  sweep      `engine.sweep(file)`: every rule the log supports over its default grid, the
             metrics, the scatter (what `mismatch-replay sweep LOG` computes).
  diagnose   `analysis.diagnose.diagnose(file)`: the seven findings from one streamed read.
The log is sweep_bench's synthetic one (`_data/log_<N>.parquet`, generated once: step,
sample_id, position, both log-probs, advantage; 512-token sequences). Reported: wall and CPU
seconds, peak RSS, and diagnose / sweep (the issue's bar: at most 1.5x).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _child(name: str, path: str) -> None:
    t = time.perf_counter()
    c = time.process_time()
    if name == "sweep":
        from mismatch_replay import engine

        res = engine.sweep([path])
        extra = {"rows": res.table.height}
    else:
        from mismatch_replay.analysis.diagnose import diagnose

        res = diagnose([path])
        extra = {"found": [d.key for d in res.found], "tokens": res.tokens}
    out = {
        "seconds": time.perf_counter() - t,
        "cpu_seconds": time.process_time() - c,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        **extra,
    }
    print(json.dumps(out))


def _spawn(name: str, path: Path) -> dict:
    cmd = [sys.executable, __file__, "--run", name, str(path)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ))
    if res.returncode:
        raise SystemExit(f"{name} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=float, default=20e6)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--run", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        _child(*a.run)
        return
    from sweep_bench import DATA, make_log

    n = int(a.tokens)
    path = DATA / f"log_{n}.parquet"
    if not path.exists():
        DATA.mkdir(exist_ok=True)
        print(f"generating {path} ...", file=sys.stderr)
        make_log(path, n)
    runs: dict[str, list[dict]] = {"sweep": [], "diagnose": []}
    for _ in range(a.repeat):  # alternate, so that the machine's load hits both alike
        for name in runs:
            runs[name].append(_spawn(name, path))
            print(f"{name}: {runs[name][-1]['seconds']:.2f} s", file=sys.stderr)
    best = {k: min(v, key=lambda d: d["seconds"]) for k, v in runs.items()}
    ratio = best["diagnose"]["seconds"] / best["sweep"]["seconds"]
    print(f"{n:,} tokens, {os.cpu_count()} cores, best of {a.repeat}")
    print(f"{'workload':10s} {'wall s':>8s} {'CPU s':>8s} {'peak RSS':>10s}")
    for k, d in best.items():
        print(f"{k:10s} {d['seconds']:8.2f} {d['cpu_seconds']:8.2f} {d['peak_rss_gib']:8.2f} GiB")
    print(f"diagnose / sweep: {ratio:.2f}x (found: {best['diagnose']['found'] or 'nothing'})")
    if a.json:
        a.json.write_text(json.dumps({"tokens": n, "runs": runs, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
