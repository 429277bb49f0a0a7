"""The sweep engine: one streaming pass over token batches -> an additive Tally -> tables.

Design
------
A *job* (jobs.py) is one rule swept over one parameter's grid of K values. For a token
rule the Tally (tally.py) bins the rule's per-token score against the K sorted thresholds
and adds per-bin sums into arrays of shape (groups, K + 2) (bins.py): bin j holds the
tokens that exceed exactly j thresholds, the last bin the tokens a fixed side of the rule
masks, so the masked count at every grid point is a suffix sum, exact whatever K. The fused
path (fast/) fills those bins for every token job in one loop; the simple path (numpy, rule
by rule) is its reference. Sequence rules are scored at the end from per-sequence sums
(sequences.py, one row per statistic of rules.SEQ_STATS); m2po ranks each step's tokens
from a per-step store that spills to disk (m2po.py). The readout (readout.py) turns bins
into the long sweep table. `replay` / `sweep` (replay.py) stream a log through it, reading
ahead in a thread (stream.py), and `replay_together` feeds several Tallies from one read;
the Ray engine (ray.py) computes the same Tally per shard and adds them up: every piece of
a Tally is a sum, a max or a min.

A replay may also keep the tokens beyond per-coordinate cutoffs (tail.py), so that counts
at thresholds chosen after the pass (choose, compare) need no second pass.

Modules, each importing only those before it: bins, jobs, sequences, m2po, readout, tail,
tally, stream, ray, replay. The names below are what the rest of the package uses.
"""

from __future__ import annotations

from .bins import (
    K3_BINS,
    K3_LOG10_MAX,
    K3_LOG10_MIN,
    Q_BUCKET_EDGES,
    SCATTER_BINS,
    SCATTER_LOG10_MIN,
    TOP_TOKENS,
    JobBins,
    direction_class,
    length_bucket,
    poisson_weights,
    scatter_edges,
)
from .groups import GROUP_KEYS
from .jobs import (
    Job,
    check_precision,
    current_precision,
    parse_sweeps,
    plan_jobs,
    single_job,
    use_precision,
    with_precision,
)
from .m2po import M2PO_MEMORY_ENV, M2PO_MEMORY_MIB, M2PO_SPILL_PREFIX, M2POStore, reclaim_spills
from .precision_note import PrecisionNote
from .replay import (
    ENGINES,
    MATCH,
    precision_notes,
    precision_notes_for,
    replay,
    replay_together,
    sweep,
)
from .stream import (
    check_loss_tokens,
    clear_alignment_warnings,
    columns_needed,
    prefetch,
    shard_tally,
)
from .tail import Tail, sample_of
from .tally import SweepResult, Tally

__all__ = [
    "ENGINES",
    "GROUP_KEYS",
    "K3_BINS",
    "K3_LOG10_MAX",
    "K3_LOG10_MIN",
    "M2PO_MEMORY_ENV",
    "M2PO_MEMORY_MIB",
    "M2PO_SPILL_PREFIX",
    "MATCH",
    "Q_BUCKET_EDGES",
    "SCATTER_BINS",
    "SCATTER_LOG10_MIN",
    "TOP_TOKENS",
    "Job",
    "JobBins",
    "M2POStore",
    "PrecisionNote",
    "SweepResult",
    "Tail",
    "Tally",
    "check_loss_tokens",
    "check_precision",
    "clear_alignment_warnings",
    "columns_needed",
    "current_precision",
    "direction_class",
    "length_bucket",
    "parse_sweeps",
    "plan_jobs",
    "poisson_weights",
    "precision_notes",
    "precision_notes_for",
    "prefetch",
    "reclaim_spills",
    "replay",
    "replay_together",
    "sample_of",
    "scatter_edges",
    "shard_tally",
    "single_job",
    "sweep",
    "use_precision",
    "with_precision",
]
