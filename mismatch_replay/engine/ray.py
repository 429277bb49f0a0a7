"""The Ray engine: the local engine's Tally, computed per shard on a Ray cluster and added up.

Design
------
A Tally is a sum (counts, masses, metric sums, histograms), a max or a min per bin, group and
sequence, so the Tally of a log is the sum of its shards' Tallies, whatever the split
(`Tally.absorb`). The driver plans the read once (schemas only), sends one task per
shard -- the plan narrowed to one file, or for Parquet to a run of a file's row groups (about
two tasks per CPU of the cluster, so one large file spreads too), the jobs, the columns --
and each task streams its shard through the same `stream.shard_tally` the local engine runs,
fused kernel included (one thread per task: Ray gives each task one CPU). Object-store URIs
(s3://, gs://, ...) travel in the plan and each task opens its files through pyarrow.fs.
Shard Tallies come back through the object store and are added in input order, which is
also what makes them identical to the local engine's: sequence ids and groups are numbered
in order of appearance, a sequence's group is its first token's, and m2po breaks ties by
input order.

Sizes: a shard Tally is ~(groups x sum of grid sizes x 48 bytes) + ~100 bytes per sequence,
plus, when m2po is swept, 24-28 bytes per token (m2po ranks each step's tokens: they travel
to the driver, which spills them to disk past MISMATCH_REPLAY_M2PO_MEMORY and resolves one
step at a time). Leave m2po out (`--rule`) to keep the driver's traffic independent of the
log's size.

`ray.init()` attaches to the cluster named by `address` (or RAY_ADDRESS), else starts a local
one with a worker per core. The package must be importable on the workers (installed there,
or shipped with a runtime_env). Ray is optional (`pip install mismatch-replay[ray]`): it is
imported when a replay asks for engine="ray", not before.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence

from .. import ingest
from ..errors import UsageError
from .jobs import Job
from .stream import check_loss_tokens, columns_needed, shard_tally
from .tally import Tally

# sample ids numbered by row get a per-file base when ingest's row counts are estimates
_ID_BASE = 1 << 40


def _ray():
    try:
        import ray
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise UsageError(
            "--engine ray needs Ray: pip install 'mismatch-replay[ray]' (or use --engine local)."
        ) from None
    return ray


def init(address: str | None = None, **kwargs) -> None:
    """Attach to (or start) a Ray cluster once per process."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(
            address=address,
            ignore_reinit_error=True,
            include_dashboard=False,
            log_to_driver=False,
            **kwargs,
        )


def shards(plan: ingest.Plan, per_file: int = 1) -> list[tuple[ingest.Plan, int | None]]:
    """(plan, sample-id offset) per shard: each file, or for Parquet up to `per_file`
    contiguous runs of row groups of each file (a single large file still spreads over the
    cluster). Shards are in input order, which the merge keeps."""
    synthesised = bool(plan.list_columns) and "sample_id" not in plan.source
    out = []
    offset = 0
    for i, path in enumerate(plan.files):
        step = (plan.file_steps[i],) if i < len(plan.file_steps) else ()
        pieces: list[tuple[tuple[int, int] | None, int]] = [(None, plan.rows[i])]
        if plan.format == "parquet" and per_file > 1:
            sizes = ingest.row_group_rows(path)
            k = min(per_file, len(sizes))
            if k > 1:
                cuts = [j * len(sizes) // k for j in range(k + 1)]
                pieces = [((a, b), sum(sizes[a:b])) for a, b in itertools.pairwise(cuts)]
        for groups, rows in pieces:
            part = dataclasses.replace(
                plan,
                files=(path,),
                rows=(rows,),
                file_steps=step,
                row_groups=(groups,),
            )
            if not synthesised:
                base = None
            elif plan.format == "parquet":  # exact row counts: the local engine's numbering
                base = offset
            else:
                base = i * _ID_BASE
            out.append((part, base))
            offset += rows
    return out


def _task(plan, jobs, by, cols, has_seq, has_adv, offset):
    os.environ.setdefault("MISMATCH_REPLAY_THREADS", "1")
    return shard_tally(plan, jobs, by, cols, has_seq, has_adv, offset)


def replay(
    plan: ingest.Plan,
    jobs: Sequence[Job],
    by: str | None = None,
    address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Tally:
    """The Tally of `plan` for `jobs`, one Ray task per shard, merged in input order."""
    ray = _ray()
    init(address)
    cols = columns_needed(jobs, by, plan.columns)
    has_seq, has_adv = "sample_id" in cols, "advantage" in cols
    remote = ray.remote(num_cpus=1)(_task)
    jobs_ref = ray.put(list(jobs))
    # two tasks per CPU (so that uneven shards balance); large files split by row groups
    cpus = int(ray.cluster_resources().get("CPU", 1))
    per_file = max(1, -(-2 * cpus // max(1, len(plan.files))))
    refs = [
        remote.remote(part, jobs_ref, by, cols, has_seq, has_adv, offset)
        for part, offset in shards(plan, per_file)
    ]
    total = sum(plan.rows)
    tally = Tally(list(jobs), by, has_seq=has_seq, has_adv=has_adv)
    done_rows = 0
    for ref in refs:  # in file order: merging order fixes sequence and group numbering
        part = ray.get(ref)
        tally.absorb(part)
        done_rows += part.report.rows
        if progress is not None:
            progress(done_rows, total)
    check_loss_tokens(plan, tally)
    return tally
