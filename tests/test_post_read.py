"""The post-read paths of choose and report against the computations they replace, exactly:
TailCounts' narrowed views (`_view`) and sorted counts (`sorted_counts`) against bins of a
coordinate's every kept token, the replicates' merged runs against one entry per token, the
per-row values of the grouped tables and compare's table (`TailCounts.batch`) against the
same values read from every kept token, and the sweep table's specs (`readout.value_specs`)
against a rule rebuilt per value (the code they replace, kept here as the reference)."""

from __future__ import annotations

import importlib
import re
from unittest import mock

import numpy as np
import pytest
from conftest import random_log
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, fast, ingest
from mismatch_replay.analysis import search, tail_counts
from mismatch_replay.analysis.tail_counts import TailCounts, sorted_counts, suffix_values
from mismatch_replay.engine import readout
from mismatch_replay.fast.program import reference_bins
from mismatch_replay.rules import REGISTRY
from mismatch_replay.rules import parse_rule as _parse_rule

FUSED = fast.backend() == "numba"
needs_tail = pytest.mark.skipif(not FUSED, reason="the simple path keeps no tail")
cmp = importlib.import_module("mismatch_replay.analysis.compare")

SPECS = ("ipo", "icepop@prime-rl", "kpop@prime-rl", "dppo-tv", "ppo-clip", "token-k3")


def parse_rule(spec: str):
    """The tail is the fused path's (float64): presets in exact arithmetic here (a float32
    preset, their default since issue 30, runs on the simple path, which keeps no tail)."""
    return _parse_rule(spec).replace(precision="float64")


@pytest.fixture(autouse=True)
def _exact():  # compare_setup's rules too
    with engine.use_precision("float64"):
        yield


def _log(tmp_path, seed: int, **kw):
    df = random_log(np.random.default_rng(seed), **kw)
    path = tmp_path / f"log_{seed}.parquet"
    df.write_parquet(path)
    return df, path


# ------------------------------------------------------------------ sorted counts


finite = st.floats(-5, 5, allow_nan=False, allow_infinity=False)
special = st.sampled_from([-np.inf, np.inf, 0.0, 1.0, -1.0])


@settings(max_examples=300, deadline=None)
@given(
    scores=st.lists(st.one_of(finite, special), max_size=60),
    thr=st.lists(st.one_of(finite, special), min_size=1, max_size=12),
    inclusive=st.booleans(),
)
def test_sorted_counts_are_the_bins_counts(scores, thr, inclusive):
    """Counting on sorted scores gives, at every threshold, what binning and the suffix sums
    give (ties, +-inf scores and thresholds, duplicate thresholds)."""
    s = np.asarray(scores, dtype=np.float64)
    t = np.asarray(thr, dtype=np.float64)
    job = engine.Job(parse_rule("ipo"), "eps", np.arange(t.size, dtype=float))
    order = np.argsort(t, kind="stable")
    b = reference_bins(s, t[order], inclusive)
    want = suffix_values(job, np.bincount(b, minlength=t.size + 2), order)
    got = sorted_counts(np.sort(s), t, inclusive)
    assert got.dtype == want.dtype and np.array_equal(got, want)
    lo = t.min()  # and on the scores at or above the loosest threshold only
    got = sorted_counts(np.sort(s[np.flatnonzero(s >= lo)]), t, inclusive)
    assert np.array_equal(got, want)


def test_sorted_counts_refuse_nan_scores():
    with pytest.raises(AssertionError, match="NaN"):
        sorted_counts(np.sort(np.array([0.0, np.nan])), np.array([0.5]), False)


# ------------------------------------------------------------------ views


def _reference(tc: TailCounts, job: engine.Job):
    """(rows, bins) of the job on its coordinate's every kept token, numpy's bins."""
    idx = tc._index(tc._coordinate(job))
    s = tc.score(job)
    rows = np.arange(s.shape[0]) if idx is None else idx
    return rows, reference_bins(s, job.sorted_thresholds, job.rule.inclusive)


def _reference_replicates(tc, job, B, unit, seed):
    _, wt, tokens, where = tc._unit_weights(B, unit, seed)
    rows, b = _reference(tc, job)
    hit = b > 0
    out = np.zeros((len(job.values) + 2, B))
    np.add.at(out, b[hit], wt[where[rows[hit]]].astype(np.float64))  # one entry a token
    return suffix_values(job, out.T), tokens


def _reference_spread(tc, job, unit):
    _, n, where = tc._units(unit)
    rows, b = _reference(tc, job)
    c = np.bincount(where[rows[b > 0]], minlength=n.shape[0]).astype(float)
    total = c.sum()
    if total == 0:
        return None
    f = total / n.sum()
    var = (c * c).sum() - 2.0 * f * (c * n).sum() + f * f * (n * n).sum()
    return float(np.sqrt(max(var, 0.0)) / total)


@needs_tail
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    spec=st.sampled_from(SPECS),
    fraction=st.sampled_from([0.02, 0.1, 0.3]),
    sort_min=st.sampled_from([0, 1 << 16]),
    shrink=st.sampled_from([0.75, 1.0]),
    asks=st.lists(
        st.tuples(
            st.sampled_from(["hits", "replicates", "spread", "masked"]),
            st.floats(0.0, 1.0),
            st.floats(0.0, 1.0),
            st.integers(1, 40),
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_views_give_the_whole_coordinates_counts(
    tmp_path_factory, seed, spec, fraction, sort_min, shrink, asks
):
    """Whatever the jobs asked and in whatever order (so that views of every bound are cut
    and reused), hits, replicates, spread and masked tokens are those of the coordinate's
    every kept token binned by numpy: counts and replicates exactly, spread to the bit
    (`sort_min` 0: every count on sorted scores; `shrink` 1: every view cut is kept)."""
    with (
        mock.patch.object(tail_counts, "SORT_MIN", sort_min),
        mock.patch.object(tail_counts, "VIEW_SHRINK", shrink),
    ):
        _check_views(tmp_path_factory, seed, spec, fraction, asks)


def _check_views(tmp_path_factory, seed, spec, fraction, asks):
    _, path = _log(tmp_path_factory.mktemp("v"), seed, seqs=12)
    rule = parse_rule(spec)
    jobs = search.choice_jobs([rule], True)
    main = engine.replay([path], jobs=jobs, tail=engine.Tail(fraction), final=True)
    tc = TailCounts.of(main)
    assert tc is not None
    tc.prepare(jobs, (20, "sequence", 3))
    for what, a, b, k in asks:
        job0 = jobs[int(a * 7) % len(jobs)]
        grid = job0.values
        lo = grid[int(a * (grid.size - 1))]
        hi = grid[int(b * (grid.size - 1))]
        n = 1 if what in ("spread", "masked") else k
        job = engine.Job(job0.rule, job0.param, search.grid_between(lo, hi, n))
        if what == "hits":
            rows, bins = _reference(tc, job)
            want = suffix_values(job, np.bincount(bins, minlength=len(job.values) + 2))
            assert np.array_equal(tc.hits(job), want)
        elif what == "replicates":
            got, tok = tc.replicates(job, 20, "sequence", 3)
            want, wtok = _reference_replicates(tc, job, 20, "sequence", 3)
            assert np.array_equal(got, want) and np.array_equal(tok, wtok)
        elif what == "spread":
            assert tc.spread(job, "sequence") == _reference_spread(tc, job, "sequence")
        else:
            rows, bins = _reference(tc, job)
            want = np.zeros(tc.tail.kept, dtype=bool)
            want[rows[bins > 0]] = True
            assert np.array_equal(tc.masked(job), want)
            assert np.array_equal(tc.masked_rows(job), np.flatnonzero(want))


@needs_tail
def test_views_are_cut_and_reused(tmp_path):
    """A job near a search's answer bins a cached view narrower than the coordinate, and a
    stricter one cuts its own from it (the paths the test above compares)."""
    _, path = _log(tmp_path, 3, seqs=60)
    jobs = search.choice_jobs([parse_rule("ipo")], True)
    main = engine.replay([path], jobs=jobs, tail=engine.Tail(0.1), final=True)
    tc = TailCounts.of(main)
    job = jobs[0]
    assert np.isfinite(tc.cover(job))
    s = tc.score(job)
    strict = np.sort(s)[[-40, -10]]  # two scores near the top
    key = tail_counts._key(job)
    for t in strict:
        tc._view(job, key, float(t))
    rows = tc._index(tc._coordinate(job))
    for t in strict:  # every token scoring at least the bound (ties included), in order
        got_rows, got_s, whole = tc._view(job, key, float(t))
        assert not whole and np.array_equal(got_rows, rows[s >= t])
        assert _same_bits(got_s, s[s >= t])
    bounds = [b[0] for b in tc._live[key]]
    assert bounds == sorted(float(t) for t in strict)
    assert tc._live[key][1][2].shape[0] < tc._live[key][0][2].shape[0] < s.shape[0]


@needs_tail
def test_cover_is_the_bins_cover(tmp_path):
    """`cover` on sorted scores is the threshold the bins give (the strict end's agreement
    with the replay's exact counts)."""
    _, path = _log(tmp_path, 11, seqs=40)
    rules = [parse_rule(s) for s in SPECS]
    jobs = search.choice_jobs(rules, True)
    main = engine.replay([path], jobs=jobs, tail=engine.Tail(0.05), final=True)
    tc = TailCounts.of(main)
    for job in jobs:
        k = (job.rule.name, job.rule.arith, job.rule.precision, job.rule.setting(job.param))
        found = tc._evaluated((*k, job.param))
        values = np.concatenate([c[0] for _, c in found])
        exact = np.concatenate([c[1] for _, c in found])
        union = engine.Job(job.rule, job.param, values)
        _, bins = _reference(tc, union)
        mine = suffix_values(union, np.bincount(bins, minlength=len(values) + 2))
        want, thr = np.inf, union.thresholds
        for i in np.argsort(thr, kind="stable")[::-1]:
            if mine[i] != exact[i]:
                break
            want = min(want, float(thr[i]))
        assert tc.cover(job) == want


@needs_tail
def test_subsets_are_the_coordinates_bits(tmp_path):
    _, path = _log(tmp_path, 5, seqs=30)
    jobs = search.choice_jobs([parse_rule(s) for s in SPECS], True)
    main = engine.replay([path], jobs=jobs, tail=engine.Tail(0.05), final=True)
    tc = TailCounts.of(main)
    bits = tc.tail.arrays()["bits"]
    for c in range(len(main.program.coords)):
        idx, tb = tc._subset(c)
        assert np.array_equal(idx, np.flatnonzero(bits & np.uint32(1 << c)))
        assert np.array_equal(tb.lp, tc.tail.arrays()["lp"][idx])


@needs_tail
@pytest.mark.parametrize("unit", ["sequence", "step"])
def test_a_tail_that_kept_no_token_counts_nothing_masked(tmp_path, unit):
    """A setting that masks nothing, with no cutoff (fraction 0): the tail keeps no token (no
    sequence or step column either), is still exact, and its spread is None and its
    replicates zero, with each replicate's tokens those of a tail that kept some."""
    _, path = _log(tmp_path, 3, seqs=12)
    job = engine.single_job(parse_rule("ipo:eps=1e6"))
    kw = {"jobs": [job], "final": True}
    main = engine.replay([path], tail=engine.Tail(0.0, count_steps=True), **kw)
    assert main.tail.kept == 0
    tc = TailCounts.of(main)
    assert tc.covers(job) and tc.hits(job).tolist() == [0]
    assert tc.spread(job, unit) is None
    reps, tokens = tc.replicates(job, 7, unit, 5)
    assert reps.shape == (7, 1) and not reps.any()
    some = TailCounts.of(engine.replay([path], tail=engine.Tail(0.1, count_steps=True), **kw))
    assert some.tail.kept > 0
    _, want = some.replicates(job, 7, unit, 5)
    assert np.array_equal(tokens, want) and tokens.sum() > 0


# ------------------------------------------------------------------ grouped tables


def _reference_grouped(tc, job, group, n, mass):
    """The code `_grouped` replaces: groups and |dp| read from every kept token's."""
    rows, b = _reference(tc, job)
    hit = b > 0
    rows, bh = rows[hit], b[hit]
    G, width = n.shape[0], len(job.values) + 2
    count, msum = np.zeros((G, width), dtype=np.int64), np.zeros((G, width))
    g = group[rows]
    np.add.at(count, (g, bh), 1)
    np.add.at(msum, (g, bh), tc.kept_batch().abs_dp[rows])
    count[:, 0] = np.asarray(n, dtype=np.int64) - count[:, 1:].sum(axis=1)
    msum[:, 0] = mass - msum[:, 1:].sum(axis=1)
    return count, msum


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@needs_tail
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_grouped_tables_read_the_masked_rows_only(tmp_path, seed):
    """by_q_bucket's and by_length's bins from the masked rows' own q and |dp| are those
    from every kept token's, every float bit included."""
    _, path = _log(tmp_path, seed, steps=4, seqs=25)
    rules = [parse_rule(s) for s in ("ipo@prime-rl", "icepop@prime-rl", "dppo-tv", "kpop")]
    jobs = [engine.single_job(r) for r in rules]
    main = engine.replay([path], jobs=jobs, tail=engine.Tail(0.0), final=True)
    tc = TailCounts.of(main)
    t = tc.tail
    tally = tc.by_q_bucket(rules)
    assert tally is not None
    edges = np.asarray(engine.Q_BUCKET_EDGES)
    present = np.flatnonzero(t.q_counts > 0)
    row = np.full(edges.size, -1, dtype=np.int64)
    row[present] = np.arange(present.size)
    group = row[np.searchsorted(edges, tc.kept_batch().q, side="right") - 1]
    for j, bins in zip(tally.jobs, tally.bins, strict=True):
        count, msum = _reference_grouped(tc, j, group, t.q_counts[present], t.q_mass[present])
        assert _same_bits(bins.count, count) and _same_bits(bins.mass, msum)
    by_len = tc.by_length(rules)
    assert by_len is not None
    st_ = main.seq_stats()
    b = engine.length_bucket(st_.n.astype(np.int64))
    present = np.unique(b)
    seq_group = np.searchsorted(present, b)
    mass = main.sequences.column("mass")
    n_g = np.bincount(seq_group, weights=st_.n, minlength=present.size)
    mass_g = np.bincount(seq_group, weights=mass, minlength=present.size)
    group = seq_group[t.arrays()["seq"]]
    for j, bins in zip(by_len.jobs, by_len.bins, strict=True):
        count, msum = _reference_grouped(tc, j, group, n_g, mass_g)
        assert _same_bits(bins.count, count) and _same_bits(bins.mass, msum)


def _reference_from_tail(plan, pr, tc, examples):
    """compare._from_tail as it read every kept token's values (the reference)."""
    ja, jb = cmp._covered_job(pr.a, tc), cmp._covered_job(pr.b, tc)
    ma, mb = tc.masked(ja), tc.masked(jb)
    tb = tc.kept_batch()
    cell = np.where(ma & mb, 0, np.where(ma, 1, np.where(mb, 2, 3)))
    edges = np.asarray(engine.Q_BUCKET_EDGES)
    nb = edges.size
    qb = np.searchsorted(edges, tb.q, side="right") - 1
    hit = cell < 3
    c, w = cell[hit], {"q": tb.q[hit], "p": tb.p[hit], "mass": tb.abs_dp[hit]}
    acc = {"count": np.bincount(c, minlength=4).astype(np.float64)}
    acc |= {k: np.bincount(c, weights=v, minlength=4) for k, v in w.items()}
    a = tc.tail.arrays()
    # what a mask costs (issue 32, 3264e37): each cell's corrective and divergent tokens and
    # |A| from every kept token's direction class; "neither" the replay's totals minus the rest
    adv = a["advantage"] if "advantage" in a and tc.main.has_adv else None
    totals = cmp._cost_totals(tc.main) if adv is not None else None
    direction = None
    if totals is not None:
        d = engine.direction_class(tb.lp, tb.lq, adv)
        direction = cmp._DIRECTION[d]
        for k, v in (("corr", d == 1), ("div", d == 2), ("amass", np.abs(adv))):
            acc[k] = np.bincount(c, weights=v[hit], minlength=4)
            acc[k][3] = totals[k] - acc[k][:3].sum()
    tot = tc.main.metrics.total().s
    for k, total in (
        ("count", float(tc.tail.tokens)),
        ("q", tot["q"][0]),
        ("p", tot["p"][0]),
        ("mass", tot["abs_dp"][0]),
    ):
        acc[k][3] = total - acc[k][:3].sum()
    bucket = np.bincount(c * nb + qb[hit], minlength=4 * nb).reshape(4, nb).astype(np.float64)
    bucket[3] = tc.tail.q_counts - bucket[:3].sum(axis=0)
    top = {}
    for side, code in (("a", 1), ("b", 2)):
        dis = np.flatnonzero(cell == code)
        if dis.size:
            keep = dis[np.argsort(-np.abs(tb.l[dis]), kind="stable")[:examples]]
            top[side] = {
                "masked_by": np.full(keep.size, side),
                "q": tb.q[keep],
                "p": tb.p[keep],
                "abs_dp": tb.abs_dp[keep],
                "log_ratio": tb.l[keep],
                "direction": direction[keep] if direction is not None else np.full(keep.size, None),
            } | {col: a[col][keep] for col in ("step", "sample_id", "position") if col in a}
    return cmp._compare_result(plan, pr, cmp._Acc(acc, bucket, top), edges)


@needs_tail
@pytest.mark.parametrize("fraction", [0.0, 0.05])  # 0.05: kept tokens neither rule masks
@pytest.mark.parametrize(
    ("a", "b"),
    [("ipo@prime-rl", "icepop@prime-rl"), ("kpop@prime-rl", "dppo-tv"), ("ipo", "ipo")],
)
def test_compare_from_the_tail_reads_the_masked_rows_only(tmp_path, a, b, fraction):
    """compare's table from the union of the two masked sets' own values is the one from
    every kept token's: the same dict, every float equal, the examples' columns too."""
    _, path = _log(tmp_path, 8, steps=5, seqs=30)
    plan = ingest.plan_sources([path])
    pair = cmp.compare_setup(plan, a, b, None, None, None, None)
    jobs = [engine.single_job(pair.a), engine.single_job(pair.b)]
    tally = engine.replay(plan, jobs=jobs, final=True, tail=engine.Tail(fraction))
    tc = TailCounts.of(tally)
    got = cmp._from_tail(plan, pair, tc, 4)
    assert got is not None
    assert got.to_dict() == _reference_from_tail(plan, pair, tc, 4).to_dict()


@needs_tail
def test_float32_presets_are_left_to_a_pass(tmp_path):
    """A preset in its framework's float32 (its default, issue 30): the tail (the fused
    path's, float64) covers none of its jobs, so the grouped tables and compare's table say
    None (their pass counts it in float32), while the same rules in float64 are counted
    from the tail."""
    _, path = _log(tmp_path, 8, steps=5, seqs=30)
    plan = ingest.plan_sources([path])
    specs = ("ipo@prime-rl", "icepop@prime-rl")
    for precision in ("float32", "float64"):
        rules = [_parse_rule(s).replace(precision=precision) for s in specs]
        jobs = [engine.single_job(r) for r in rules]
        tc = TailCounts.of(engine.replay(plan, jobs=jobs, final=True, tail=engine.Tail(0.05)))
        exact = precision == "float64"
        assert all(tc.covers(j) == exact for j in jobs)
        assert (tc.by_q_bucket(rules) is not None) == exact
        assert (tc.by_length(rules) is not None) == exact
        with engine.use_precision(precision):
            pair = cmp.compare_setup(plan, *specs, None, None, None, None)
        assert pair.a.precision == pair.b.precision == precision
        assert (cmp._from_tail(plan, pair, tc, 4) is not None) == exact


# ------------------------------------------------------------------ readout


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(REGISTRY)),
    which=st.integers(0, 10),
    values=st.lists(
        st.one_of(
            st.floats(-2.0, 50.0, allow_nan=False),
            st.sampled_from([0.0, -0.0, 1.0, 0.2, 1 / 0.999, 1e-300, 1e300, np.inf]),
        ),
        min_size=1,
        max_size=8,
    ),
    preset=st.booleans(),
)
def test_value_specs_are_the_rebuilt_rules_specs(name, which, values, preset):
    """The sweep table's specs without a rule per value are `replace(...).spec()`'s, and a
    value outside the parameter's domain fails with the same error."""
    cls = REGISTRY[name]
    rule = cls()
    if preset and getattr(cls, "presets", None):
        rule = parse_rule(f"{name}@{sorted(cls.presets)[0]}")
    param = cls.params[which % len(cls.params)].name
    for v in values:
        try:
            want = rule.replace(**{param: v}).spec()
        except Exception as e:  # the same error, whatever it is
            with pytest.raises(type(e), match=re.escape(str(e))):
                readout.value_specs(rule, param, [v])
            continue
        assert readout.value_specs(rule, param, [v]) == {v: want}


@needs_tail
def test_scores_after_prepare_let_the_batch_go_are_the_same(tmp_path):
    """`prepare` lets a coordinate's batch (its gathered log-probs and derived values) go
    once its jobs are scored: a rule scored on that subset afterwards gets the scores a
    fresh TailCounts gives, bit for bit."""
    _, path = _log(tmp_path, 9, seqs=40)
    rules = [parse_rule(s) for s in ("icepop@prime-rl", "ppo-clip", "token-k3", "dppo-tv")]
    jobs = search.choice_jobs(rules, True)
    main = engine.replay([path], jobs=jobs, tail=engine.Tail(0.05), final=True)
    tc = TailCounts.of(main)
    first, later = jobs[:2], jobs[2:]
    tc.prepare(first)
    assert tc._coordinate(first[0]) not in tc._sub
    fresh = TailCounts(main)
    for j in later:
        assert _same_bits(tc.score(j), fresh.score(j))
        assert np.array_equal(tc.hits(j), fresh.hits(j))
