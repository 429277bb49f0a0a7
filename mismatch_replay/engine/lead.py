"""One read, two Tallies: a follower's metrics from its leader's kernel pass.

Design
------
`engine.replay_together` streams one read into several Tallies. One that needs no kernel
pass of its own -- no token or m2po job, no scatter, tail or bootstrap: the report's
per-step Tally -- can take its metrics and sequence sums from the first Tally's pass
(`Leading.lead_metrics`, a mixin of `Tally`): before the leader's pass over a batch the
follower computes its group codes of the batch (`_stage`), the leader's kernel sums the
metrics under both groupings (fast/runner.py, `Fused.run(follow=)`), and the follower's
add_batch builds its batch output from the leader's (`_shared_out`), bit for bit what its
own pass would give (the same chunks: the same thread count, checked per batch). Where the
leader cannot serve a batch (the simple path, another thread count, other sequence codes)
the follower runs its own pass. Its robust part always runs on its own.
tests/test_shared_metrics.py compares both ways byte for byte.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from .. import fast

_NONE = np.zeros(0, np.int64)


class Leading:
    """The leader/follower half of `Tally` (this module's docstring)."""

    def _init_leading(self) -> None:
        self._follower: Leading | None = None
        self._leader: Leading | None = None
        self._follow_ent = False  # the follower's batches have an entropy column
        self._batches = 0  # add_batch calls
        self._staged: tuple | None = None  # the leader's work on the follower's next batch
        self.led_batches = 0  # batches whose metrics came from the leader's pass

    def lead_metrics(self, follower: Leading | None, cols=(), follower_cols=()) -> bool:
        """Make `follower` (another Tally of one read, fed the same rows in the same order,
        each batch after this one: engine.replay's _stream) take its metrics and sequence
        sums from this one's kernel pass instead of running its own, where it can: a
        Tally with no token or m2po job, no scatter, tail or bootstrap (the report's
        per-step Tally), grouped by a column this one reads (`cols`: this one's columns,
        `follower_cols` its), and whose sequences, advantage, entropy and clamped sums this
        one's pass has too. Both then run the kernel with the same chunks, so the follower's
        sums are the ones its own pass would give, bit for bit (fast/runner.py). Returns
        whether it is linked (their Sequences must be linked too: `Sequences.lead`); None
        ends it. A batch the leader could not serve (another thread count, a backend off,
        other sequence codes) the follower runs on its own."""
        for f in [self._follower] if self._follower is not None else []:
            f._leader, f._staged = None, None
        self._follower = None
        if follower is None or not self._can_lead(follower, set(cols), set(follower_cols)):
            return False
        self._follower, follower._leader = follower, self
        follower._follow_ent = "entropy" in follower_cols
        follower._batches = 0
        self._batches = 0
        return True

    def _can_lead(self, f: Leading, cols: set, fcols: set) -> bool:
        if f is self or self._leader is not None or f._follower is not None:
            return False
        if any(j.rule.level != "sequence" for j in f.jobs) or f.shape is not None:
            return False
        if f.scatter or f.tail is not None or f.boot_replicates or f.inv_n is not None:
            return False
        if f.by == "length" or f.precision != "float64" or self.precision != "float64":
            return False
        if f.by not in (None, "q_bucket") and f.by not in cols:
            return False
        need = {c for c in ("sample_id", "advantage", "entropy") if c in fcols}
        if not need <= cols or (f.has_seq and not self.has_seq):
            return False
        return (
            (self.has_adv or not f.has_adv)
            and (self.clamped_seq or not f.clamped_seq)
            and "f32" not in f.seq_extras  # float32 twins: its own pass
        )

    def _stage(self, df: pl.DataFrame, lead: fast.Fused) -> tuple | None:
        """(Follower.) Before the leader's pass over this batch: this Tally's group codes of
        it (kept for its own add_batch) and what the leader's kernel needs for its metrics
        (Fused.run's `follow`), or None where the leader cannot give what this Tally's own
        pass would (another thread count: other chunks)."""
        self._staged = None
        own = self._fused_state()
        if own is None or not df.height:
            return None
        g = self._group_codes(df)
        G = len(self.groups)
        own._grow(G)  # as its own run() would: the threads it would use
        self._staged = (self._batches + 1, df.height, g, None)
        if own.t != lead.t:
            return None
        return g, G, self._follow_ent

    def _shared_out(self, seq) -> fast.BatchOut | None:
        """(Follower.) The leader's pass's output for this batch, as this Tally's own run()
        would return it (None: run its own)."""
        got = self._staged[3] if self._staged is not None else None
        if got is None or got[0] is None:
            return None
        (msum, mmax, first), sums, lead_seq = got
        if self.has_seq and (lead_seq is None or first is None):
            return None
        if self.has_seq and not all(map(_same, seq[1], lead_seq[1])):
            return None
        j = fast.compiled()
        names = j.SEQ_SUMS if self.clamped_seq else j.SEQ_SUMS[: -j.N_CLAMPED_SUMS]
        return fast.BatchOut(
            smax=np.full((1, 1), -1, np.int64),
            flagged=[],
            msum=msum,
            mmax=mmax,
            hist_lin=_NONE,
            hist_log=_NONE,
            seq={k: sums[k] for k in (*names, j.SEQ_MAX, j.SEQ_MIN)} if self.has_seq else {},
            seq_first=first if self.has_seq else _NONE,
            m2po_x=None,
            m2po_mass=None,
        )


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays hold the same values (views of one buffer: at once)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    at = a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    if at and a.strides == b.strides:  # a follower's read-only view of its leader's array
        return True
    return bool(np.array_equal(a, b))
