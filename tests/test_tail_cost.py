"""What a mask costs in the grouped tables counted from a replay's tail (issue 32): the
report's tables by q bucket, by sequence length and by step, from `TailCounts`, against a
plain replay grouped the same way (`engine.sweep(..., by=...)`): the direction counts
exactly, the |A| and entropy sums and their fractions and means to 1e-12 relative."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
from conftest import log_file, random_log
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, fast
from mismatch_replay.analysis.tail_counts import TailCounts
from mismatch_replay.engine import readout
from mismatch_replay.rules import parse_rule as _parse_rule

needs_tail = pytest.mark.skipif(fast.backend() != "numba", reason="the simple path keeps no tail")
TOKEN = ("ipo@prime-rl", "icepop@prime-rl", "dppo-tv", "kpop", "ppo-clip")
SEQUENCE = ("geo-mis", "seq-mean-k3")
INTS = ("masked_tokens", "masked_corrective", "masked_divergent", "masked_neutral")
KEY = {"q_bucket": "q_bucket", "length": "length", "step": "step"}


def parse_rule(spec: str):
    """Exact arithmetic: the tail is the fused path's, float64 (test_post_read.py)."""
    return _parse_rule(spec).replace(precision="float64")


def _log(seed: int, steps: int, seqs: int, entropy: bool) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    df = random_log(rng, steps=steps, seqs=seqs, mismatch=float(rng.choice([0.02, 0.1])))
    if entropy:  # a NaN now and then: left out of both means
        e = rng.gamma(1.0, 1.0, df.height)
        e[rng.random(df.height) < 0.1] = np.nan
        df = df.with_columns(pl.Series("entropy", e))
    return df


def _same(got: pl.DataFrame, want: pl.DataFrame, by: str) -> None:
    """Every row's count and cost columns, matched on (spec, group)."""
    cols = [*INTS, *readout.COST_COLUMNS]
    g = got.sort(["spec", by])
    w = want.sort(["spec", by])
    assert g.select("spec", by).equals(w.select("spec", by)), by
    for c in cols:
        for a, b in zip(g[c].to_list(), w[c].to_list(), strict=True):
            if c in INTS or a is None or b is None:
                assert a == b, (by, c, a, b)
            else:
                assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300), (by, c, a, b)


def _check(df: pl.DataFrame, fraction: float) -> None:
    tok = [parse_rule(s) for s in TOKEN]
    seqr = [parse_rule(s) for s in SEQUENCE]
    with log_file(df) as path:
        jobs = [engine.single_job(r) for r in tok + seqr]
        main = engine.replay([path], jobs=jobs, tail=engine.Tail(fraction), final=True)
        tc = TailCounts.of(main)
        by_step = engine.replay([path], jobs=[], by="step", robust=True, scatter=False, final=True)
        assert tc is not None
        got = {
            "q_bucket": (tc.by_q_bucket(tok), tok),
            "length": (tc.by_length(tok + seqr), tok + seqr),
            "step": (by_step if tc.attach_by_step(tok, by_step) else None, tok),
        }
        for by, (tally, rules) in got.items():
            # a tail that kept no token has no sequence or step column: by length and by
            # step are then left to a replay of their own (decisions.py), as before
            assert tally is not None or (by != "q_bucket" and tc.tail.kept == 0), by
            if tally is None:
                continue
            want = engine.sweep([path], rules=rules, by=by).table
            _same(readout.sweep_table(tally), want, by)


@needs_tail
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    steps=st.integers(1, 4),
    seqs=st.integers(1, 12),
    entropy=st.booleans(),
    fraction=st.sampled_from([0.0, 0.05]),
)
def test_tail_grouped_cost_columns_are_the_grouped_replays(seed, steps, seqs, entropy, fraction):
    """The grouped tables from the tail carry what a mask costs, equal to a plain replay's
    `--by q_bucket/length/step` columns (counts exactly, sums to 1e-12 relative)."""
    _check(_log(seed, steps, seqs, entropy), fraction)


@needs_tail
def test_no_per_group_adv_sums_leave_the_direction_columns_null_with_a_note(tmp_path):
    """A replay with no sequence rule keeps no per-sequence |A| sums: the step table from
    its tail leaves the |A| and direction columns null and says why; the entropy columns,
    from the step Tally's metrics and the kept tokens' entropies, are still there."""
    df = _log(3, 3, 10, entropy=True)
    path = tmp_path / "log.parquet"
    df.write_parquet(path)
    tok = [parse_rule(s) for s in TOKEN]
    main = engine.replay([path], jobs=[engine.single_job(r) for r in tok], tail=engine.Tail(0.0))
    by_step = engine.replay([path], jobs=[], by="step", robust=True, scatter=False, final=True)
    tc = TailCounts.of(main)
    assert tc.attach_by_step(tok, by_step)
    t = readout.sweep_table(by_step)
    assert t["masked_adv_mass"].null_count() == t.height
    assert t["masked_corrective"].null_count() == t.height
    assert any("per-group |A| sums" in n for n in by_step.notes)
    want = engine.sweep([path], rules=tok, by="step").table.sort(["spec", "step"])
    t = t.sort(["spec", "step"])
    for c in ("entropy_mean", "masked_entropy_mean"):
        for a, b in zip(t[c].to_list(), want[c].to_list(), strict=True):
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-12), (c, a, b)
