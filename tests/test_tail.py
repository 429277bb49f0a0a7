"""The replay's tail (engine/tail.py) and the counts taken from it (analysis/tail_counts.py):
against brute force where it says it covers, against the streaming bootstrap pass it
replaces, and choose with and without it."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from brute import PARAMS, TOKEN_RULES, evaluate
from conftest import random_log
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import analysis, engine, fast, ingest
from mismatch_replay.analysis import search
from mismatch_replay.analysis.tail_counts import TailCounts
from mismatch_replay.engine import readout
from mismatch_replay.engine.readout import COST_COLUMNS
from mismatch_replay.rules import parse_rule as _parse_rule

TOKEN_SPECS = (*TOKEN_RULES, "icepop@prime-rl", "kpop@prime-rl")
FUSED = fast.backend() == "numba"


def parse_rule(spec: str):
    """The tail is the fused path's (float64): presets in exact arithmetic here (a float32
    preset runs on the simple path, which keeps no tail)."""
    return _parse_rule(spec).replace(precision="float64")


@pytest.fixture(autouse=True)
def _exact():
    with engine.use_precision("float64"):
        yield


def _log(tmp_path, seed: int, **kw) -> tuple[pl.DataFrame, object]:
    df = random_log(np.random.default_rng(seed), **kw)
    path = tmp_path / f"log_{seed}.parquet"
    df.write_parquet(path)
    return df, path


def _params(rule, param: str, value: float) -> dict:
    out = {p: getattr(rule, p) for p in PARAMS[rule.name]}
    out[param] = value
    return out


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**31),
    spec=st.sampled_from(TOKEN_SPECS),
    fraction=st.sampled_from([0.001, 0.02, 0.1, 0.3]),
    picks=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=6),
)
def test_tail_counts_equal_brute_force_where_covered(tmp_path_factory, seed, spec, fraction, picks):
    """Wherever TailCounts says a value is covered, its count is brute force's; the
    strictest values (few tokens masked) are covered once the tail keeps 10% a side."""
    df, path = _log(tmp_path_factory.mktemp("t"), seed, seqs=10)
    rule = parse_rule(spec)
    jobs = search.choice_jobs([rule], True)
    tail = engine.Tail(fraction)
    main = engine.replay([path], jobs=jobs, tail=tail, final=True)
    tc = TailCounts.of(main)
    if not FUSED:  # the simple path keeps no tail: every consumer makes its pass
        assert tc is None and tail.off is not None and "simple path" in tail.off
        return
    assert tc is not None and tail.tokens == main.report.loss_rows
    checked = 0
    for ji, job in enumerate(jobs):
        values = readout.job_counts(main, ji)[0]
        # values on the grid and between grid points
        lo, hi = float(values.min()), float(values.max())
        extra = [lo + u * (hi - lo) for u in picks]
        for v in [*values[:: max(1, len(values) // 7)].tolist(), *extra]:
            one = engine.Job(job.rule, job.param, np.array([v]))
            if not tc.covers(one):
                continue
            checked += 1
            want = evaluate(df, rule.name, _params(rule, job.param, v))[None]["masked_tokens"]
            assert int(tc.hits(one)[0]) == want, (spec, job.param, v)
        if fraction >= 0.1:
            assert np.isfinite(tc.cover(job)), (spec, job.param)
    if fraction >= 0.1:
        assert checked > 0


@pytest.mark.parametrize("unit", ["sequence", "step"])
def test_tail_replicates_equal_the_engines_bootstrap(tmp_path, unit):
    """The tail's replicates (integer weights times integer counts) are the streaming
    bootstrap's bit for bit, and the token jobs come from the tail with no pass."""
    from test_analysis import random_log as analysis_log

    f = analysis_log(tmp_path / "log.parquet", 3)
    plan = ingest.plan_sources([f])
    specs = ["ipo", "icepop@prime-rl", "kpop@prime-rl", "dppo-tv", "seq-mis"]
    jobs = search.choice_jobs([parse_rule(r) for r in specs], True)
    ref = engine.replay(plan, jobs=jobs, bootstrap=(30, unit, 3), final=True)
    tail = engine.Tail(0.45, count_steps=unit == "step")
    main = engine.replay(plan, jobs=jobs, final=True, tail=tail)
    tc = TailCounts.of(main)
    # the columns a search would resample: the strict half of each grid
    boot = []
    for j in jobs:
        thr = j.thresholds
        keep = thr >= np.quantile(thr, 0.5)
        boot.append(engine.Job(j.rule, j.param, j.values[keep]))
    res = search.one_pass(plan, [], boot, 30, unit, 3, main, None)
    if FUSED:
        assert tc is not None and tc.can_resample(unit)
        assert all(tc.covers(b) for b in boot if b.rule.level == "token")
        assert not res.read  # every token job from the tail, sequence rules from the sums
    for ji, b in enumerate(boot):
        counts, tokens = readout.boot_counts(ref, ji)
        keep = jobs[ji].thresholds >= np.quantile(jobs[ji].thresholds, 0.5)
        order = np.argsort(jobs[ji].values)  # boot_counts: values ascending
        want = counts[:, np.flatnonzero(keep[order])]
        assert np.array_equal(res.reps[ji], want), b.label
        np.testing.assert_allclose(res.tokens[ji], tokens, rtol=1e-12)


class _NoTail(engine.Tail):
    """A tail that keeps nothing (as on the simple path): consumers make their passes."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.off = "switched off by the test"


@pytest.mark.parametrize("target", [0.005, 0.05])
def test_choose_with_and_without_the_tail(tmp_path, monkeypatch, reads, target):
    """choose's answers are the same exact counts with the tail (one read of the log) and
    without it (a second pass); the bootstrap intervals agree to a fraction of their width
    (their columns are placed differently: around the answer, or over the coarse bracket)."""

    from test_analysis import random_log as analysis_log

    f = analysis_log(tmp_path / "log.parquet", 1, steps=8, seqs=40)
    specs = ["ipo", "icepop@prime-rl", "kpop@prime-rl", "dppo-tv", "seq-mis"]
    with_tail = analysis.choose([f], target, specs, bootstrap=60)
    n_with = len(reads)
    monkeypatch.setattr(engine, "Tail", _NoTail)
    without = analysis.choose([f], target, specs, bootstrap=60)
    if FUSED:
        assert n_with == 1 and all(r.passes == 1 for r in with_tail)
    assert len(reads) - n_with >= 2  # without a tail: the grids, then its passes
    for a, b in zip(with_tail, without, strict=True):
        assert (a.rule, a.param, a.status) == (b.rule, b.param, b.status)
        assert a.value == b.value and a.masked_tokens == b.masked_tokens
        if a.ci_low is not None and b.ci_low is not None:
            width = max(a.ci_high - a.ci_low, b.ci_high - b.ci_low)
            assert abs(a.ci_low - b.ci_low) <= 0.35 * width + 1e-12, a.rule
            assert abs(a.ci_high - b.ci_high) <= 0.35 * width + 1e-12, a.rule
            assert a.ci_low <= a.value <= a.ci_high


def test_tail_past_its_limit_keeps_nothing_and_choose_still_answers(tmp_path, monkeypatch):
    """A tail that outgrows its limit says so and keeps nothing; choose then makes its pass
    and gives the answers it gives with a tail."""
    from test_analysis import random_log as analysis_log

    f = analysis_log(tmp_path / "log.parquet", 2)
    tail = engine.Tail(0.3, limit=10)
    jobs = search.choice_jobs([parse_rule("ipo")], True)
    main = engine.replay([f], jobs=jobs, tail=tail, final=True)
    assert TailCounts.of(main) is None
    if FUSED:
        assert "outgrew 10 tokens" in tail.off and not tail.parts
    full = analysis.choose([f], 0.02, ["ipo"], bootstrap=0)
    small = engine.Tail

    def tiny(*a, **k):
        return small(*a, **{**k, "limit": 10})

    monkeypatch.setattr(engine, "Tail", tiny)
    capped = analysis.choose([f], 0.02, ["ipo"], bootstrap=0)
    assert [(r.value, r.masked_tokens, r.status) for r in capped] == [
        (r.value, r.masked_tokens, r.status) for r in full
    ]


@pytest.mark.skipif(not FUSED, reason="the kernel's tail bits exist on the fused path only")
def test_kernel_keeps_every_token_beyond_the_cutoffs(tmp_path):
    """Every token whose coordinate (numpy, the rules' arithmetic) lies clearly beyond a
    cutoff is kept, and what is kept lies beyond a cutoff, in a window, or on a fixed side."""
    df, path = _log(tmp_path, 11, steps=4, seqs=20)
    jobs = search.choice_jobs([parse_rule("ipo"), parse_rule("icepop@prime-rl")], True)
    tail = engine.Tail(0.05)
    engine.replay([path], jobs=jobs, tail=tail, final=True)
    kept = set(tail.arrays()["row"].tolist())
    loss = df.filter(pl.col("loss_mask"))
    from mismatch_replay.engine.tail import coordinate_values
    from mismatch_replay.rules import TokenBatch

    tb = TokenBatch(loss["trainer_logprob"].to_numpy(), loss["inference_logprob"].to_numpy())
    for c, (kind, clamp) in enumerate(tail.coords):
        x = coordinate_values(kind, clamp, tb)
        lo, hi = tail.cut[c]
        margin = 1e-12 * np.maximum(1.0, np.abs(x))
        beyond = np.flatnonzero((x <= lo - margin) | (x >= hi + margin))
        assert set(beyond.tolist()) <= kept, kind
    assert 0 < len(kept) < loss.height


@pytest.mark.parametrize(
    ("a", "b", "budget", "from_tail"),
    [
        ("ipo@prime-rl", "icepop@prime-rl", None, True),
        ("ipo", "icepop@prime-rl", 0.01, True),
        ("kpop@prime-rl", "dppo-tv", None, True),
        # dppo-kl's high bound masks one advantage class only: at 5% of all tokens it sits
        # deeper in the coordinate than the tail's cutoff, so compare makes its pass
        ("dppo-kl", "ppo-clip", 0.05, False),
    ],
)
def test_compare_from_the_tail_is_the_numpy_pass(tmp_path, a, b, budget, from_tail):
    """compare's table from the kept tokens (no pass) equals the numpy pass's: every count
    exactly, the cells' means and masses to rounding, the disputed tokens one for one; and
    where the tail does not hold every masked token, compare says so by making its pass."""
    import importlib

    cmp = importlib.import_module("mismatch_replay.analysis.compare")

    _, path = _log(tmp_path, 4, steps=5, seqs=30)
    plan = ingest.plan_sources([path])
    got = analysis.compare([path], a, b, budget=budget, examples=4)
    pair = cmp.compare_setup(plan, a, b, budget, None, None, None)
    if budget is not None:
        assert pair.tally is not None
        got_pair = cmp.compare_pass(plan, [pair], 4, None, pair.tally)[0]
        assert got_pair.to_dict() == got.to_dict()
    ref = cmp._compare_pass(plan, [pair], 4, None)[0]
    if FUSED:  # was the tail used (no numpy pass), or not
        tally = pair.tally
        if tally is None:
            jobs = [engine.single_job(pair.a), engine.single_job(pair.b)]
            tally = engine.replay(plan, jobs=jobs, final=True, tail=engine.Tail(0.0))
        tc = TailCounts.of(tally)
        assert (tc is not None and cmp._from_tail(plan, pair, tc, 4) is not None) == from_tail
    d, r = got.to_dict(), ref.to_dict()
    for k in ("both", "only_a", "only_b", "neither", "masked_a", "masked_b", "jaccard", "where"):
        assert d[k] == r[k], k
    for c in analysis.CELLS:
        for f in ("tokens", "fraction"):
            assert d["cells"][c][f] == r["cells"][c][f]
        for f in ("mean_q", "mean_p", "mass"):
            x, y = d["cells"][c][f], r["cells"][c][f]
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-9 * max(1, abs(y)))
    assert [(e["masked_by"], e["log_ratio"], e["step"], e["position"]) for e in d["examples"]] == [
        (e["masked_by"], e["log_ratio"], e["step"], e["position"]) for e in r["examples"]
    ]


def _same_table(a: pl.DataFrame, b: pl.DataFrame, key) -> None:
    assert a.columns == b.columns and a.height == b.height
    a, b = a.sort(key), b.sort(key)
    for c in a.columns:
        if c in COST_COLUMNS:  # what a mask costs: tail_counts' tables leave it null
            continue
        if a[c].dtype == pl.Float64:
            np.testing.assert_allclose(
                a[c].fill_null(np.nan).to_numpy(), b[c].fill_null(np.nan).to_numpy(), rtol=1e-12
            )
        else:
            assert a[c].equals(b[c]), c


def test_the_reports_grouped_tables_come_from_the_tail(tmp_path, monkeypatch):
    """report_data's tables of the chosen settings by q bucket and by step, and of the
    length settings by sequence length, are those of their own replays (counts exactly,
    sequences and prompt groups included, mass sums to the last bits; drift's verdicts the
    same), counted from the shared read's sequences and tail with no Tally holding these
    settings but the full one (and no second read); where the tail cannot say, replays of
    their own give the same tables."""
    from mismatch_replay.analysis.drift import drift
    from mismatch_replay.analysis.figure_data import default_settings, length_table

    f = tmp_path / "log.parquet"
    df = random_log(np.random.default_rng(11), steps=5, seqs=30, max_len=50)
    df.with_columns(group_id=pl.col("sample_id") // 4).write_parquet(f)  # prompt groups
    plan = ingest.plan_sources([f])
    chosen = default_settings(plan.columns)
    want_b = (
        engine.replay(plan, rules=chosen, by="q_bucket", final=True, scatter=False).result().table
    )
    want_s = (
        engine.replay(plan, rules=chosen, by="step", robust=True, final=True, scatter=False)
        .result()
        .table
    )
    assert want_s["fully_masked_groups"].null_count() == 0  # the prompt-group counts
    want_d = drift([f]).to_dict()
    want_l = length_table(plan)
    grouped = []  # per replay (alone or in a shared read): its grouping, if it holds jobs

    def note(k):
        if k.get("jobs") != [] and k.get("by") in ("q_bucket", "step", "length"):
            grouped.append(k["by"])

    real_replay, real_together = engine.replay, engine.replay_together

    def replay(*a, **k):
        note(k)
        return real_replay(*a, **k)

    def together(plan, parts, *a, **k):
        for p in parts:
            note(p)
        return real_together(plan, parts, *a, **k)

    monkeypatch.setattr(engine, "replay", replay)
    monkeypatch.setattr(engine, "replay_together", together)
    for fallback in (False, True):
        if fallback:
            monkeypatch.setattr(TailCounts, "by_q_bucket", lambda self, rules: None)
            monkeypatch.setattr(TailCounts, "attach_by_step", lambda self, rules, t: False)
            monkeypatch.setattr(TailCounts, "by_length", lambda self, rules: None)
        grouped.clear()
        data, dec = analysis.report_data([f], bootstrap=20)
        _same_table(data.buckets, want_b, ["spec", "q_bucket"])
        _same_table(data.steps, want_s, ["spec", "step"])
        _same_table(data.by_length, want_l, ["spec", "length"])
        assert dec.drift.to_dict() == want_d  # counts over tokens, the same metric sums
        assert sorted(grouped) == (["length", "q_bucket", "step"] if fallback or not FUSED else [])
