"""A Tally grouped by an integer column with long runs (--by step) codes a batch's groups run
by run into one reused array (Tally._run_codes): the codes must be the general path's
(groups registered by first appearance), batch after batch, whatever the runs."""

from __future__ import annotations

import numpy as np
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay.engine.tally import Tally


def _reference(batches):
    """Brute force: each value's group is its rank of first appearance over all batches."""
    seen: dict[int, int] = {}
    out = []
    for x in batches:
        out.append(np.array([seen.setdefault(int(v), len(seen)) for v in x], dtype=np.int64))
    return out


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.tuples(st.integers(-3, 6), st.integers(1, 400)), min_size=0, max_size=6),
        min_size=1,
        max_size=6,
    )
)
def test_run_codes_are_first_appearance_codes_batch_after_batch(batches):
    xs = [
        np.concatenate([np.full(n, v, np.int64) for v, n in runs] or [np.zeros(0, np.int64)])
        for runs in batches
    ]
    tally = Tally([], "step")
    want = _reference(xs)
    for x, w in zip(xs, want, strict=True):
        got = tally._group_codes(pl.DataFrame({"step": x}))
        # checked before the next batch: the array is the Tally's scratch until then
        np.testing.assert_array_equal(got, w)
    assert tally.groups == list(dict.fromkeys(int(v) for x in xs for v in x))
