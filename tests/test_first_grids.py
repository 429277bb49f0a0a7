"""A search's first grids (search.first_jobs), the sample they are placed on, and the fast
paths this session's speed work added under the engine: group codes by runs, the duplicate
check by runs, the tail without extra columns. Each against an independent computation."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import log_file, random_log
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, ingest
from mismatch_replay.analysis import search
from mismatch_replay.engine import readout
from mismatch_replay.ingest.canonical import DuplicateCheck
from mismatch_replay.rules import parse_rule

SPECS = ["ipo", "icepop", "kpop", "dppo-tv", "token-k3", "m2po"]


def _first_sample(plan):
    """The sample a replay shapes its jobs on: engine.sample_of the first non-empty batch,
    read here on its own (the read ahead replay(shape=) makes unnecessary)."""
    from mismatch_replay.rules import TokenBatch

    for _, df in ingest.iter_batches(plan, ["trainer_logprob", "inference_logprob", "advantage"]):
        if df.height:
            cols = [df[c].to_numpy() for c in ("trainer_logprob", "inference_logprob", "advantage")]
            return engine.sample_of(TokenBatch(*cols))
    return None


def _jobs(specs):
    return search.choice_jobs([parse_rule(s) for s in specs], True)


def _brute_fraction(job, tb) -> np.ndarray:
    """Masked fraction at each value, straight from the rule's definition: a token is masked
    where its score passes the value's threshold (>= when inclusive); m2po ranks the tokens
    as one step (a rank is masked when the mean of its l^2 and all smaller ones reaches tau)."""
    score = np.asarray(job.rule.score(tb, job.param), dtype=float)
    out = []
    for thr in job.thresholds:
        if job.rule.level == "step":
            xs = sorted(score.tolist(), reverse=True)
            masked = sum(1 for m in range(len(xs)) if sum(xs[m:]) / (len(xs) - m) >= thr)
        else:
            masked = int(np.sum(score >= thr if job.rule.inclusive else score > thr))
        out.append(masked / len(tb))
    return np.array(out)


@pytest.mark.slow  # hypothesis examples, each a brute force over every grid
@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    target=st.sampled_from([0.001, 0.0025, 0.01, 0.05]),
)
def test_first_grids_keep_the_defaults_and_add_points_only_near_the_target(seed, target):
    df = random_log(np.random.default_rng(seed), steps=1, seqs=40, max_len=60)
    with log_file(df) as f:
        plan = ingest.plan_sources([f])
        sample = _first_sample(plan)
        jobs = _jobs(SPECS)
        first = search.first_jobs(jobs, target, sample)
    for job, fj in zip(jobs, first, strict=True):
        assert set(job.values.tolist()) <= set(fj.values.tolist())  # the defaults stay
        f = _brute_fraction(job, sample)
        lo, hi = np.minimum(f[:-1], f[1:]), np.maximum(f[:-1], f[1:])
        near = (hi >= target / search.NEAR) & (lo <= target * search.NEAR)
        allowed = near.copy()
        allowed[1:] |= near[:-1]
        allowed[:-1] |= near[1:]
        added = np.setdiff1d(fj.values, job.values)
        where = np.searchsorted(job.values, added) - 1  # the default interval of each
        assert np.all(allowed[where]), (job.label, target)
        m = search.FIRST_DENSE[job.rule.level]
        assert len(added) == m * int(allowed.sum())  # every allowed interval gets m points


@pytest.mark.parametrize("spec", SPECS)
def test_the_samples_fraction_is_the_replays_on_a_one_batch_log(tmp_path, spec):
    """On a log of one step and fewer tokens than a sample holds, the sample is the log:
    first_jobs's fractions are the replay's exact counts (m2po ranked as the one step)."""
    df = random_log(np.random.default_rng(7), steps=1, seqs=30, max_len=40)
    f = tmp_path / "log.parquet"
    df.write_parquet(f)
    plan = ingest.plan_sources([f])
    sample = _first_sample(plan)
    (job,) = _jobs([spec])[:1]
    tally = engine.replay(plan, jobs=[job], final=True)
    _, hits, tokens = readout.job_counts(tally, 0)
    assert len(sample) == tokens
    got = search._sample_fractions(job, sample)
    np.testing.assert_array_equal(got, hits / tokens)
    np.testing.assert_allclose(got, _brute_fraction(job, sample), rtol=0, atol=1e-15)


def test_a_replay_shapes_its_jobs_on_the_first_batch_as_a_read_ahead_would(tmp_path):
    """replay(shape=): the jobs counted are first_jobs on the first batch's sample, the one
    a read ahead gives; their counts are those of a replay of those jobs."""
    df = random_log(np.random.default_rng(5), steps=3, seqs=40, max_len=60)
    f = tmp_path / "log.parquet"
    df.write_parquet(f)
    plan = ingest.plan_sources([f])
    jobs = _jobs(SPECS)
    shaped = engine.replay(
        plan, jobs=jobs, final=True, shape=lambda s: search.first_jobs(jobs, 0.01, s)
    )
    ahead = search.first_jobs(jobs, 0.01, _first_sample(plan))
    plain = engine.replay(plan, jobs=ahead, final=True)
    for ji, (a, b) in enumerate(zip(shaped.jobs, ahead, strict=True)):
        assert np.array_equal(a.values, b.values), a.label
        assert len(a.values) > len(jobs[ji].values) or a.rule.level == "sequence"
        got, want = readout.job_counts(shaped, ji), readout.job_counts(plain, ji)
        assert np.array_equal(got[1], want[1]) and got[2] == want[2], a.label
    with pytest.raises(ValueError, match="same rules"):  # a shape must keep the rules
        engine.replay(plan, jobs=jobs, final=True, shape=lambda s: jobs[:1])


def test_without_a_sample_the_first_grid_is_dense_everywhere():
    jobs = _jobs(["ipo", "m2po"])
    for job, fj in zip(jobs, search.first_jobs(jobs, 0.01, None), strict=True):
        m = search.FIRST_DENSE[job.rule.level]
        assert len(fj.values) == len(job.values) + m * (len(job.values) - 1)


def test_choose_finds_its_jobs_in_a_replay_of_the_first_grids(tmp_path):
    """find_job: a replay holding the first job (a superset of the default grid) is found
    for the default job; one holding neither is refused."""
    jobs = _jobs(["ipo"])
    first = search.first_jobs(jobs, 0.01, None)
    assert search.find_job(first + jobs, jobs[0]) == 0  # the one with the most values
    assert search.find_job(_jobs(["icepop"]), jobs[0]) is None


# ----------------------------------------------------------------------------- group codes


@settings(max_examples=60, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(-3, 5), st.integers(1, 40)), min_size=0, max_size=30),
    batches=st.integers(1, 3),
)
def test_step_codes_by_runs_equal_the_general_path(runs, batches):
    """An integer --by column's group codes (by runs, or the polars join where runs are
    short) are the general path's: the same groups, registered in the same order."""
    x = np.array([v for v, n in runs for _ in range(n)], dtype=np.int64)
    parts = np.array_split(x, batches)
    fast_t = engine.Tally([], "step")
    slow_t = engine.Tally([], "step")
    for part in parts:
        df = pl.DataFrame({"step": part})
        got = fast_t._group_codes(df)
        # the general path: every batch through polars, whatever the dtype
        slow = slow_t._group_codes(df.with_columns(pl.col("step").cast(pl.Utf8)))
        np.testing.assert_array_equal(got, slow)
    assert fast_t.groups == [int(g) for g in slow_t.groups]


# ----------------------------------------------------------------------------- duplicates


@settings(max_examples=60, deadline=None)
@given(
    seqs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 30), st.integers(1, 12)),
        min_size=1,
        max_size=25,
    ),
    split=st.integers(1, 4),
)
def test_duplicate_check_by_runs_counts_what_group_by_counts(seqs, split):
    """Rows repeating a (step, sample_id, position): the run-based count equals the
    group_by one, however the rows fall into batches (runs of one sequence interleave)."""
    rows = [(s, i, p0 + k) for s, i, p0, n in seqs for k in range(n)]
    df = pl.DataFrame(rows, schema=["step", "sample_id", "position"], orient="row")
    fast_c, slow_c = DuplicateCheck(), DuplicateCheck()
    for part in np.array_split(np.arange(df.height), split):
        batch = df[part.tolist()] if part.size else df.head(0)
        fast_c.add(batch)
        # the group_by path: sample_id as text (not an integer column)
        slow_c.add(batch.with_columns(pl.col("sample_id").cast(pl.Utf8)))
    assert fast_c.counts() == slow_c.counts()
    # and against the definition: rows of a sequence beyond its position span
    brute = 0
    for _, g in df.group_by("step", "sample_id"):
        brute += max(0, g.height - (g["position"].max() - g["position"].min() + 1))
    assert fast_c.counts()[0] == brute


# ----------------------------------------------------------------------------- the tail


def test_choose_keeps_no_position_and_counts_no_q_buckets(tmp_path, monkeypatch):
    """choose's tail holds what its bootstrap needs and no more; compare's keeps the
    columns its examples name and the q-bucket counts its table needs."""
    from mismatch_replay import analysis, fast

    if fast.backend() != "numba":
        pytest.skip("the tail is kept on the fused path")
    f = tmp_path / "log.parquet"
    random_log(np.random.default_rng(3), steps=4, seqs=40, max_len=60).write_parquet(f)
    made = []
    real = engine.Tail

    def spy(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(engine, "Tail", spy)
    analysis.choose([f], 0.02, ["ipo"], bootstrap=20)
    tail = made[-1]
    assert tail.kept and "position" not in tail.arrays() and tail.q_counts is None
    analysis.compare([f], "ipo", "icepop@prime-rl", budget=0.02)
    tail = made[-1]
    assert "position" in tail.arrays() and tail.q_counts is not None
