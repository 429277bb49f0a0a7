"""A follower Tally's metrics from the leader's kernel pass are its own pass's, bit for bit.

The report reads a log once into the full sweep's Tally and a per-step one with no job
(analysis/decisions.py); the per-step Tally's metric sums and maxima, sequence sums and
first groups come from the full sweep's `coord_pass` (runner.Fused.run's `follow`,
Tally.lead_metrics) instead of a pass of its own. Every comparison here is of the bits
(tobytes / array_equal, rel=0): against the follower's own pass (the same kernel, its own
call), a replay of its own, the leader's metrics without a follower, and on the numpy
backend the simple path's. One test shows the comparison is sharp: another chunking of
the same tokens changes the sums' last bits.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import polars as pl
import pytest
from conftest import log_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, fast, ingest
from mismatch_replay.engine.tally import Tally
from mismatch_replay.fast import runner
from mismatch_replay.rules import parse_rule

needs_numba = pytest.mark.skipif(fast.backend() != "numba", reason="the fused kernel")
BY_STEP = {"by": "step", "robust": True, "scatter": False}


@contextlib.contextmanager
def patched(**kw):
    """MISMATCH_REPLAY_THREADS, Fused.MIN_CHUNK, runner.ORDERED_BUDGET and FOLLOW_ROWS for a block
    (hypothesis examples cannot use monkeypatch)."""
    old_env = os.environ.get("MISMATCH_REPLAY_THREADS")
    old_chunk, old_budget, old_rows = (
        runner.Fused.MIN_CHUNK,
        runner.ORDERED_BUDGET,
        runner.FOLLOW_ROWS,
    )
    try:
        if "threads" in kw:
            os.environ["MISMATCH_REPLAY_THREADS"] = str(kw["threads"])
        runner.Fused.MIN_CHUNK = kw.get("min_chunk", old_chunk)
        runner.ORDERED_BUDGET = kw.get("budget", old_budget)
        runner.FOLLOW_ROWS = kw.get("follow_rows", old_rows)
        yield
    finally:
        if old_env is None:
            os.environ.pop("MISMATCH_REPLAY_THREADS", None)
        else:
            os.environ["MISMATCH_REPLAY_THREADS"] = old_env
        runner.Fused.MIN_CHUNK, runner.ORDERED_BUDGET = old_chunk, old_budget
        runner.FOLLOW_ROWS = old_rows


def _steps(rng, n: int, layout: str, n_steps: int) -> np.ndarray:
    """Per-token step codes: runs in order, runs out of order, or every token at random."""
    if layout == "random":
        return rng.integers(0, n_steps, n)
    cuts = np.sort(rng.choice(np.arange(1, max(n, 2)), min(n_steps - 1, max(n - 1, 0)), False))
    run = np.zeros(n, np.int64)
    run[cuts[cuts < n]] = 1
    run = np.cumsum(run)
    if layout == "shuffled":  # runs of steps, the steps out of order (and some repeated)
        return rng.permutation(n_steps)[run % n_steps] if n_steps > 1 else run * 0
    return run


def _tokens(rng, n: int):
    lq = -rng.exponential(0.7, n)
    rare = rng.random(n) < 0.05
    lq[rare] -= rng.uniform(3.0, 30.0, int(rare.sum()))  # beyond the clamp too
    lp = np.minimum(lq + rng.normal(0.0, 0.1, n), 0.0)
    return lp, lq


# ----------------------------------------------------------------------------- the kernel


@needs_numba
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 6000),
    n_steps=st.integers(1, 40),
    layout=st.sampled_from(["runs", "shuffled", "random"]),
    lead_groups=st.sampled_from([1, 3]),
    threads=st.integers(1, 3),
    min_chunk=st.sampled_from([1, 97, 1 << 15]),
    ent=st.sampled_from(["none", "leader", "both"]),
    seqs=st.booleans(),
    per_thread=st.booleans(),
    windows=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_follow_gives_the_followers_own_run_bit_for_bit(
    n, n_steps, layout, lead_groups, threads, min_chunk, ent, seqs, per_thread, windows, seed
):
    """Fused.run(follow=(g2, G2, entropy)) on one batch: the follower's metric sums and
    maxima and its sequences' first groups are those of the follower's own run() of the
    same tokens with its codes (a Fused of no job, the same threads), and the leader's
    own outputs are those of a run without a follower. Several steps per chunk, steps out
    of order, every token its own run, a leader grouped itself, one thread or several,
    chunks of any size, the per-thread mode (ORDERED_BUDGET 0), the follower's rows per
    chunk whole or each chunk's window (FOLLOW_ROWS 0), entropy with NaN and inf."""
    rng = np.random.default_rng(seed)
    lp, lq = _tokens(rng, n)
    adv = rng.normal(size=n)
    g2 = _steps(rng, n, layout, n_steps)
    G2 = int(g2.max()) + 1
    g = _steps(rng, n, "runs", lead_groups) if lead_groups > 1 else np.zeros(n, np.int64)
    G = int(g.max()) + 1
    e = None
    if ent != "none":
        e = rng.normal(1.0, 0.5, n)
        e[rng.random(n) < 0.05] = np.nan
        e[rng.random(n) < 0.02] = np.inf
    sl, m = None, 0
    if seqs:
        # a sequence in at most two chunks (of >= n // 12 tokens): a per-thread sequence
        # sum over three would depend on which thread took which chunk, in any pass
        starts = (rng.random(n) < 0.02) | (np.arange(n) % max(1, n // 12) == 0)
        sl = np.cumsum(starts) - 1
        m = int(sl[-1]) + 1
    jobs = [engine.single_job(parse_rule(r)) for r in ("ipo", "icepop@prime-rl")]

    def fused(js):
        return fast.Fused(fast.Program(js), seqfrac=False, nthreads=threads)

    kw = dict(scatter=False)
    budget = 0 if per_thread else runner.ORDERED_BUDGET
    with patched(min_chunk=min_chunk, budget=budget, follow_rows=0 if windows else 1 << 13):
        led = fused(jobs).run(
            lp, lq, adv, g, G, sl, m, None, e, follow=(g2, G2, ent == "both"), **kw
        )
        alone = fused(jobs).run(lp, lq, adv, g, G, sl, m, None, e, **kw)
        own = fused([]).run(lp, lq, adv, g2, G2, sl, m, None, e if ent == "both" else None, **kw)
    msum, mmax, first = led.follow
    assert msum.tobytes() == own.msum.tobytes()
    assert mmax.tobytes() == own.mmax.tobytes()
    assert alone.follow is None
    assert led.msum.tobytes() == alone.msum.tobytes()
    assert led.mmax.tobytes() == alone.mmax.tobytes()
    if seqs:
        assert np.array_equal(first, own.seq_first)
        assert np.array_equal(led.seq_first, alone.seq_first)
        for name, v in own.seq.items():
            assert led.seq[name].tobytes() == v.tobytes(), name
    np.testing.assert_array_equal(msum[:, 0], np.bincount(g2, minlength=G2))  # counts


# ----------------------------------------------------------------------------- replays


def _log(rng, n: int, n_steps: int, layout: str, entropy: bool, sample_id: bool, short=False):
    lp, lq = _tokens(rng, n)
    step = _steps(rng, n, layout, n_steps)
    cols = {"trainer_logprob": lp, "inference_logprob": lq, "step": step}
    if sample_id:  # sequences: runs of tokens within a step, of at most 10 (short=True)
        new = np.r_[True, (step[1:] != step[:-1]) | (rng.random(n - 1) < 0.01)]
        if short:  # in at most two chunks of a batch split (>= 10 tokens each), see above
            new |= np.arange(n) % 10 == 0
        cols["sample_id"] = np.cumsum(new)
        cols["position"] = np.arange(n) - np.maximum.accumulate(np.where(new, np.arange(n), 0))
    cols["advantage"] = rng.normal(size=n)
    if entropy:
        e = rng.normal(1.0, 0.5, n)
        e[rng.random(n) < 0.05] = np.nan
        cols["entropy"] = e
    return pl.DataFrame(cols)


def _same_tally(a: Tally, b: Tally) -> None:
    """The bits of everything a per-step Tally holds (metrics, sequences, robust)."""
    assert a.groups == b.groups
    assert a.metrics.s.keys() == b.metrics.s.keys() and a.metrics.m.keys() == b.metrics.m.keys()
    for k in a.metrics.s:
        assert a.metrics.s[k].tobytes() == b.metrics.s[k].tobytes(), k
    for k in a.metrics.m:
        assert a.metrics.m[k].tobytes() == b.metrics.m[k].tobytes(), k
    assert a.seq_keys == b.seq_keys
    for k in a.sequences.sums:
        assert a.sequences.column(k).tobytes() == b.sequences.column(k).tobytes(), k
    if a.robust:
        assert a.k3_hist.tobytes() == b.k3_hist.tobytes()
        assert a.k3_hist_sum.tobytes() == b.k3_hist_sum.tobytes()
        assert list(a.top) == list(b.top)
        for gi, top in a.top.items():
            for c, v in top.items():
                assert np.array_equal(v, b.top[gi][c], equal_nan=v.dtype.kind == "f"), c
    assert a.result().metrics.equals(b.result().metrics)


def _together(path, lead_part, batch_rows):
    plan = ingest.plan_sources([path], ingest.ReadOptions(batch_rows=batch_rows))
    full, step = engine.replay_together(plan, [lead_part, BY_STEP | {"jobs": []}], final=True)
    return plan, full, step


@pytest.mark.slow  # hypothesis examples through the numba kernel, over threads
@needs_numba
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(200, 40_000),
    n_steps=st.integers(1, 30),
    layout=st.sampled_from(["runs", "shuffled", "random"]),
    batch_rows=st.sampled_from([1000, 7777, 1_000_000]),
    threads=st.integers(1, 3),
    min_chunk=st.sampled_from([64, 1 << 15]),
    per_thread=st.booleans(),
    entropy=st.booleans(),
    sample_id=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_per_step_tally_of_a_shared_read_is_its_own_replays(
    n, n_steps, layout, batch_rows, threads, min_chunk, per_thread, entropy, sample_id, seed
):
    """replay_together([sweep, per-step]) as the report runs it: the per-step Tally takes
    every batch's metrics from the sweep's pass (led_batches), and it is, bit for bit, a
    replay of its own (metrics, sequence sums, k3 histograms and top tokens); the sweep's
    own metrics are a replay of its own's. Many batches or a single one, several steps per
    chunk, steps out of order, the per-thread mode, with and without entropy and sample ids."""
    rng = np.random.default_rng(seed)
    df = _log(rng, n, n_steps, layout, entropy, sample_id, short=True)
    with (
        log_file(df) as path,
        patched(threads=threads, min_chunk=min_chunk, budget=0 if per_thread else 16 << 20),
    ):
        jobs, _ = engine.plan_jobs(None, None, df.columns)
        plan, full, step = _together(path, {"jobs": jobs}, batch_rows)
        solo = engine.replay(plan, jobs=[], final=True, **BY_STEP)
        solo_full = engine.replay(plan, jobs=jobs, final=True)
    batches = -(-n // batch_rows)
    assert step.led_batches == batches and solo.led_batches == 0
    _same_tally(step, solo)
    for k in full.metrics.s:
        assert full.metrics.s[k].tobytes() == solo_full.metrics.s[k].tobytes(), k
    for k in full.metrics.m:
        assert full.metrics.m[k].tobytes() == solo_full.metrics.m[k].tobytes(), k
    if not per_thread:  # per-thread bins' float sums depend on the threads' timing
        assert full.result().table.equals(solo_full.result().table)


@needs_numba
def test_the_reports_shared_read_leads_the_per_step_tally(tmp_path):
    """The report's parts (the sweep with its tail, choose's grids placed on the first
    batch, and the per-step Tally): the per-step Tally is led on every batch and equals a
    replay of its own; the sweep's table and metrics equal those of a read without it."""
    from mismatch_replay.analysis.search import choice_jobs, first_jobs, tail_fraction

    rng = np.random.default_rng(7)
    df = _log(rng, 90_000, 12, "runs", True, True)
    path = tmp_path / "log.parquet"
    df.write_parquet(path)
    plan = ingest.plan_sources([path], ingest.ReadOptions(batch_rows=20_000))
    jobs, _ = engine.plan_jobs(None, None, plan.columns)
    cjobs = choice_jobs([parse_rule(r) for r in ("ipo", "icepop@prime-rl")], True)

    def lead():
        return {
            "jobs": [*jobs, *cjobs],
            "tail": engine.Tail(tail_fraction(0.01), count_steps=False),
            "shape": lambda sample: [*jobs, *first_jobs(cjobs, 0.01, sample)],
        }

    full, step = engine.replay_together(plan, [lead(), BY_STEP | {"jobs": []}], final=True)
    (alone,) = engine.replay_together(plan, [lead()], final=True)
    solo = engine.replay(plan, jobs=[], final=True, **BY_STEP)
    assert step.led_batches == 5
    _same_tally(step, solo)
    assert full.result().table.equals(alone.result().table)
    assert full.result().metrics.equals(alone.result().metrics)


@needs_numba
def test_a_follower_on_other_chunks_runs_its_own_pass(tmp_path):
    """Where the leader's chunks are not the follower's (another thread count), the
    follower runs its own pass (led_batches 0), with the same results; and that thread
    count's sums differ from the two-thread ones in their last bits: the bitwise checks
    here see a different chunking."""
    rng = np.random.default_rng(11)
    df = _log(rng, 120_000, 3, "runs", True, True)
    path = tmp_path / "log.parquet"
    df.write_parquet(path)
    plan = ingest.plan_sources([path])

    def feed(threads_follower):
        lead = Tally([], None, has_seq=True)
        follow = Tally([], "step", has_seq=True)
        follow.robust, follow.scatter = True, False
        with patched(threads=2, min_chunk=1 << 12):
            lead._fused_state()
            with patched(threads=threads_follower):
                follow._fused_state()
            lead.sequences.lead([follow.sequences])
            cols = sorted(df.columns)  # as the replays read (the advantage: what a mask costs)
            assert lead.lead_metrics(follow, cols, cols)
            for _, batch in ingest.iter_batches(plan, cols, lead.report):
                lead.add_batch(batch)
                follow.add_batch(batch)
        lead.lead_metrics(None)
        return follow

    same, other = feed(2), feed(1)
    assert same.led_batches == 1 and other.led_batches == 0
    with patched(threads=2, min_chunk=1 << 12):
        solo2 = engine.replay(plan, jobs=[], final=True, **BY_STEP)
    with patched(threads=1, min_chunk=1 << 12):
        solo1 = engine.replay(plan, jobs=[], final=True, **BY_STEP)
    _same_tally(same, solo2)
    _same_tally(other, solo1)
    assert any(
        solo1.metrics.s[k].tobytes() != solo2.metrics.s[k].tobytes() for k in solo1.metrics.s
    )


def test_the_numpy_backend_keeps_the_per_step_tallys_own_computation(tmp_path):
    """MISMATCH_REPLAY_KERNEL=numpy: no kernel pass to share, so the per-step Tally
    computes its metrics itself (the simple path), the same as a replay of its own."""
    rng = np.random.default_rng(5)
    df = _log(rng, 5000, 4, "shuffled", True, True)
    path = tmp_path / "log.parquet"
    df.write_parquet(path)
    with fast.use_backend("numpy"):
        jobs, _ = engine.plan_jobs(["ipo"], None, df.columns)
        plan, _, step = _together(path, {"jobs": jobs}, 1000)
        solo = engine.replay(plan, jobs=[], final=True, **BY_STEP)
    assert step.led_batches == 0
    _same_tally(step, solo)
