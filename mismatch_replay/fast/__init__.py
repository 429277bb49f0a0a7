"""The fused path: every token rule, the metrics, the scatter and the sequence sums in one loop.

The engine's simple path (engine/, numpy, rule by rule) runs each rule's `score()` and bins
it; it is the reference. This package is the fast path, in seven modules:

* `coordinates`: the four per-token values the kernel bins (dp, l, and the binary KLs at
  each clamp), and for each quantity a rule can declare a threshold on (`Rule.quantities`)
  its coordinate, the preimage of a threshold value and its rounding window;
* `program`: a Tally's token jobs compiled into the kernel's tables, each interval's bin
  derived from the rule's own score() (`Program`, `Program.reasons`: why a job is not
  fused), and the direct binning tables;
* `runner`: the backend switch (`backend`, `use_backend`, MISMATCH_REPLAY_KERNEL), the
  threads and the per-batch call (`Fused.run` -> `BatchOut`);
* `m2po_bins`: m2po's per-step bins (`m2po_step_bins`: the kernel, or the numpy reference);
* `jit`: the numba kernels (one fused loop over a batch's tokens, m2po's step);
* `jit_rows`: the small row-by-row kernels beside them (sequence runs, column checks, the
  bootstrap's weights and replicate sums, q-bucket codes), re-exported by `jit`;
* `vmath`: the call-free exp/expm1/log they use, bit-identical to `pmath`'s.

Only `runner.compiled()` imports numba (on first use; `jit`, `jit_rows` and `vmath` need
it). Counts are exactly the simple path's: tokens the kernel cannot settle take the simple
path.
"""

from __future__ import annotations

from .coordinates import COORDINATES, QUANTITIES, Coordinate, Quantity, SampleBatch
from .m2po_bins import m2po_step_bins
from .program import (
    MAX_LUT,
    Binner,
    Coord,
    Plan,
    Program,
    TooManyCoordinates,
    flag_lut,
    flagged_bins,
    float_keys,
    lut_bins,
    make_binner,
    make_coord_binner,
    plan_job,
    reference_bins,
    sample_bins,
)
from .runner import (
    BatchOut,
    Fused,
    KernelWarning,
    backend,
    bin_scores,
    compiled,
    executor,
    replicate_bins,
    threads,
    use_backend,
)

__all__ = [
    "COORDINATES",
    "MAX_LUT",
    "QUANTITIES",
    "BatchOut",
    "Binner",
    "Coord",
    "Coordinate",
    "Fused",
    "KernelWarning",
    "Plan",
    "Program",
    "Quantity",
    "SampleBatch",
    "TooManyCoordinates",
    "backend",
    "bin_scores",
    "compiled",
    "executor",
    "flag_lut",
    "flagged_bins",
    "float_keys",
    "lut_bins",
    "m2po_step_bins",
    "make_binner",
    "make_coord_binner",
    "plan_job",
    "reference_bins",
    "replicate_bins",
    "sample_bins",
    "threads",
    "use_backend",
]
