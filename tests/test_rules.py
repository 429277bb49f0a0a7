"""The rule catalogue against RULES.md: parsing, worked cases, and every rule x every threshold
parameter against the independent brute force (tests/brute.py) on random logs.

The property test drives the public path (`engine.sweep` on a Parquet file) because a rule's
observable behaviour is its sweep-table row; tests/test_engine.py covers what the engine adds
(streaming, splitting, merging, grouping).
"""

from __future__ import annotations

import dataclasses
import math

import brute
import numpy as np
import polars as pl
import pytest
from conftest import DYADIC_L, NICE_RATIOS, canonical_log, close, log_file, logs, ratio_pair
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import engine, ingest
from mismatch_replay.errors import UsageError
from mismatch_replay.rules import (
    REGISTRY,
    SEQ_STATS,
    SeqStats,
    TokenBatch,
    binary_kl,
    parse_grid,
    parse_rule,
)

# ----------------------------------------------------------------------------- catalogue


def test_registry_is_the_rules_md_catalogue():
    assert len(REGISTRY) == 23
    assert set(REGISTRY) == set(brute.ALL_RULES)
    for name, cls in REGISTRY.items():
        assert cls.param_names() == brute.PARAMS[name], name
        thresholds = tuple(p.name for p in cls.params if p.threshold)
        assert thresholds == brute.threshold_params(name), name
        assert ("advantage" in cls.needs) == (name in brute.NEEDS_ADVANTAGE), name
        assert (cls.kind == "weight") == (name in brute.WEIGHT_RULES), name


def test_rule_levels_match_rules_md():
    levels = {name: cls.level for name, cls in REGISTRY.items()}
    assert {n for n, v in levels.items() if v == "sequence"} == {
        "seq-tis",
        *brute.SEQUENCE_RULES,
    }
    assert levels["m2po"] == "step"
    for name in (*brute.TOKEN_RULES, *brute.WEIGHT_TOKEN_RULES):
        assert levels[name] == "token", name


def test_seq_stats_fields_follow_the_sequence_statistics_table():
    fields = {f.name: f for f in dataclasses.fields(SeqStats)}
    assert [n for n in fields if n != "has_adv"] == [s.name for s in SEQ_STATS]
    tb = TokenBatch(np.array([-0.1, -2.0]), np.array([-0.3, -1.0]), np.array([1.0, -1.0]))
    for s in SEQ_STATS:
        assert (fields[s.name].default is None) == s.optional, s.name
        assert s.fill == {"sum": 0.0, "max": -math.inf, "min": math.inf}[s.combine], s.name
        v = s.per_token(tb)
        assert (v is None) == (s.name == "n")
        assert v is None or v.shape == (2,), s.name


def test_the_table_aggregates_each_statistic_over_its_sequence():
    """Each statistic of SEQ_STATS, accumulated over two partial batches and combined as
    the table says, is the statistic of the whole sequence (checked against a plain loop)."""
    rng = np.random.default_rng(7)
    n, S = 400, 9
    lp = -rng.exponential(1.0, n)
    lq = np.minimum(lp + rng.normal(0, 0.7, n), 0.0)
    adv = rng.normal(size=n)
    seq = rng.integers(0, S, n)
    combine = {"sum": np.add, "max": np.maximum, "min": np.minimum}
    acc = {s.name: np.full(S, s.fill) for s in SEQ_STATS}
    for part in (slice(0, 150), slice(150, n)):
        tb = TokenBatch(lp[part], lq[part], adv[part])
        for s in SEQ_STATS:
            v = s.per_token(tb)
            w = np.ones(len(tb)) if v is None else v
            got = np.full(S, s.fill)
            combine[s.combine].at(got, seq[part], w)
            acc[s.name] = combine[s.combine](acc[s.name], got)
    stats = SeqStats(**acc)

    def near(a, b):  # float sums in another order
        return close(a, b, abs_=1e-12)

    tb = TokenBatch(lp, lq, adv)
    for i in range(S):
        m = seq == i
        assert stats.n[i] == m.sum()
        assert near(stats.sum_l[i], tb.l[m].sum())
        assert near(stats.sum_k3[i], tb.k3[m].sum())
        assert stats.max_k2[i] == tb.k2[m].max()
        assert stats.min_l[i] == tb.l[m].min()
        assert near(stats.sum_exp_abs_l[i], np.exp(np.abs(tb.l[m])).sum())
        assert near(stats.sum_adv[i], adv[m].sum())
        assert near(stats.sum_lc[i], np.clip(tb.l[m], -20, 20).sum())
        assert near(stats.sum_k3c[i], tb.k3_verl[m].sum())


# ----------------------------------------------------------------------------- parsing


def test_parse_rule_name_only_gives_defaults():
    r = parse_rule("icepop")
    assert r.name == "icepop"
    assert (r.low, r.high) == (0.5, 5.0)
    assert parse_rule("ipo").eps == 0.3
    assert parse_rule("  kpop  ").clamp == 1e-6


def test_parse_rule_key_values():
    r = parse_rule("icepop:low=0.2,high=5")
    assert (r.low, r.high) == (0.2, 5.0)
    assert parse_rule("ipo:eps=0.05").eps == 0.05
    r = parse_rule("dual-clip:eps_low=0.1,eps_high=0.28,c=2.5")
    assert (r.eps_low, r.eps_high, r.c) == (0.1, 0.28, 2.5)
    assert parse_rule("token-k2:hi=1e-3").hi == 1e-3
    assert parse_rule("cispo:low=off").low == 0.0


def test_parse_rule_presets():
    r = parse_rule("icepop@prime-rl")
    assert (r.low, r.high) == (0.2, 5.0)
    r = parse_rule("icepop@verl")
    assert (r.low, r.high) == (0.5, 5.0)
    assert parse_rule("ipo@prime-rl").eps == 0.3
    assert parse_rule("ipo@prime-rl-legacy").eps == 0.1
    r = parse_rule("token-mis@trl")
    assert (r.low, r.high) == (0.5, 2.0)
    r = parse_rule("kpop@areal")
    assert (r.phi, r.clamp) == (2.0, 1e-8)
    r = parse_rule("ppo-clip@dapo")
    assert (r.eps_low, r.eps_high) == (0.2, 0.28)


def test_parse_rule_preset_then_override():
    r = parse_rule("icepop@verl:high=3")
    assert (r.low, r.high) == (0.5, 3.0)
    r = parse_rule("kpop@areal:clamp=1e-6")
    assert (r.phi, r.clamp) == (2.0, 1e-6)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("nosuchrule", ["nosuchrule"]),
        ("nosuchrule:eps=1", ["nosuchrule"]),
        ("ipo:nosuch=1", ["nosuch", "eps"]),
        ("icepop:eps=0.2", ["eps"]),
        ("icepop@nosuchpreset", ["nosuchpreset"]),
        ("token-k2@trl", ["trl", "verl"]),
        ("ipo:eps=abc", ["abc"]),
        ("ipo:eps", ["eps"]),
        ("ipo:eps=inf", ["finite"]),
        ("IPO!", []),
    ],
)
def test_parse_rule_rejects(spec, words):
    with pytest.raises(UsageError) as e:
        parse_rule(spec)
    for w in words:
        assert w in str(e.value)


def test_parse_grid_list_is_sorted_unique_float64():
    g = parse_grid("0.3, 0.1,0.2,0.1")
    assert g.dtype == np.float64
    assert g.tolist() == [0.1, 0.2, 0.3]
    assert parse_grid("5").tolist() == [5.0]


def test_parse_grid_ranges():
    assert np.array_equal(parse_grid("0:1:5"), np.linspace(0, 1, 5))
    assert np.array_equal(parse_grid("0:1:5:lin"), np.linspace(0, 1, 5))
    g = parse_grid("1e-3:1:4:log")
    assert np.allclose(g, [1e-3, 1e-2, 1e-1, 1.0], rtol=1e-12)
    assert g[0] == 1e-3 and g[-1] == 1.0
    assert parse_grid("0.001:1:121:log").shape == (121,)
    assert parse_grid("2:2:3").tolist() == [2.0]  # unique


@pytest.mark.parametrize(
    "text", ["1:2", "1:2:3:4:5", "0:1:3:log", "-1:1:3:log", "a,b", "1:2:x", "1:2:0", ",", ""]
)
def test_parse_grid_rejects(text):
    with pytest.raises(UsageError):
        parse_grid(text)


# ----------------------------------------------------------------------------- worked cases


def _sweep_df(df: pl.DataFrame, rules, sweeps=None, by=None) -> pl.DataFrame:
    with log_file(df) as path:
        return engine.sweep([path], rules=rules, sweeps=sweeps, by=by).table


def _ratio_log(ratios, advantage=None) -> pl.DataFrame:
    pairs = [ratio_pair(c) for c in ratios]
    return canonical_log(
        [p for p, _ in pairs],
        [q for _, q in pairs],
        step=0,
        sample_id=list(range(len(ratios))),
        advantage=advantage,
    )


def test_prime_rl_icepop_band_masks_exactly_the_outside_ratios():
    ratios = [0.1, 0.2, 1.0, 5.0, 10.0]
    df = _ratio_log(ratios)
    # with lq = 0 (or lp = 0) the log ratio is exactly log(c): the boundaries are exact ties
    assert (df["trainer_logprob"] - df["inference_logprob"]).to_list() == [
        math.log(c) for c in ratios
    ]
    # in prime-rl's float32 (the default) its IcePopLoss compares l with log(tensor(0.2)),
    # the same float32 value: kept; its legacy ratio-space test finds exp(f32(log 0.2)) =
    # 0.19999999 < f32(0.2) and masks that token too, as torch.float32 does
    assert _sweep_df(df, ["icepop@prime-rl"])["masked_tokens"].item() == 2
    assert _sweep_df(df, ["icepop@prime-rl-legacy"])["masked_tokens"].item() == 3
    t = _sweep_df(df, [parse_rule("icepop@prime-rl").replace(precision="float64")])
    assert t.height == 1
    row = t.row(0, named=True)
    assert (row["tokens"], row["masked_tokens"], row["masked_sequences"]) == (5, 2, 2)
    # which two: the masked mass is that of the 0.1 and 10 tokens
    tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy())
    assert row["masked_mass"] == pytest.approx(tb.abs_dp[0] + tb.abs_dp[4], rel=1e-12)
    b = brute.evaluate(df, "icepop", {"low": 0.2, "high": 5.0})[None]
    assert (b["masked_tokens"], b["masked_mass"]) == (2, pytest.approx(row["masked_mass"]))
    # one token at a time: only the outside ones are masked
    for i, c in enumerate(ratios):
        t1 = _sweep_df(df[i : i + 1], ["icepop:low=0.2,high=5"])
        assert t1["masked_tokens"].item() == (1 if c in (0.1, 10.0) else 0), c


def test_prime_rl_ppo_clip_example_clips_one_of_six():
    df = _ratio_log([0.5, 0.9, 1.0, 1.1, 2.0, 2.0], advantage=[1, 1, 1, 1, 1, -1])
    t = _sweep_df(df, ["ppo-clip:eps_low=0.2,eps_high=0.2"])
    row = t.row(0, named=True)
    assert (row["tokens"], row["masked_tokens"], row["masked_sequences"]) == (6, 1, 1)
    assert row["masked_fraction"] == pytest.approx(1 / 6)
    b = brute.evaluate(df, "ppo-clip", {"eps_low": 0.2, "eps_high": 0.2})[None]
    assert b["masked_tokens"] == 1
    # the clipped one is the r = 2, A = +1 token (index 4); A = -1 at r = 2 is not clipped
    tb = TokenBatch(df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy())
    assert row["masked_mass"] == pytest.approx(tb.abs_dp[4], rel=1e-12)


def _one_token(p: float, q: float) -> pl.DataFrame:
    return canonical_log([math.log(p)], [math.log(q)], step=0, sample_id=[0])


@pytest.mark.parametrize(
    "p, q, icepop_masks, ipo_masks",
    [
        (0.06, 0.01, True, False),  # rare token up 6x: IcePop masks, IPO (|dp| = 0.05) keeps
        (0.20, 0.90, False, True),  # likely token down (r = 0.22 >= 0.2): IPO masks it
    ],
)
def test_ipo_motivating_examples(p, q, icepop_masks, ipo_masks):
    df = _one_token(p, q)
    t = _sweep_df(df, ["icepop@prime-rl", "ipo@prime-rl"])
    got = dict(zip(t["rule"].to_list(), t["masked_tokens"].to_list(), strict=True))
    assert got == {"icepop": int(icepop_masks), "ipo": int(ipo_masks)}
    assert brute.evaluate(df, "icepop", {"low": 0.2, "high": 5.0})[None]["masked_tokens"] == int(
        icepop_masks
    )
    assert brute.evaluate(df, "ipo", {"eps": 0.3})[None]["masked_tokens"] == int(ipo_masks)


def _lp_with_abs_dp(target: float) -> float:
    """lp (with lq = 0) whose |dp| by RULES.md's formula is exactly `target`."""
    lp = math.log1p(-target)
    for direction in (-1.0, 1.0):
        x = lp
        for _ in range(8):
            if -np.expm1(np.array([x]))[0] == target:
                return x
            x = float(np.nextafter(x, direction * np.inf))
    raise AssertionError(f"no lp found with |dp| == {target}")


def test_ipo_is_strict_at_eps():
    lp = _lp_with_abs_dp(0.25)
    df = canonical_log([lp, lp], [0.0, 0.0], step=0, sample_id=[0, 1])
    below = float(np.nextafter(0.25, 0.0))
    t = _sweep_df(df, ["ipo"], sweeps={"ipo.eps": np.array([below, 0.25, 0.3])})
    got = dict(zip(t["value"].to_list(), t["masked_tokens"].to_list(), strict=True))
    assert got == {below: 2, 0.25: 0, 0.3: 0}  # |dp| == eps is kept
    assert brute.evaluate(df, "ipo", {"eps": 0.25})[None]["masked_tokens"] == 0
    assert brute.evaluate(df, "ipo", {"eps": below})[None]["masked_tokens"] == 2


def test_ipo_strict_at_any_data_derived_eps():
    rng = np.random.default_rng(7)
    lq = -rng.exponential(1.0, 50)
    lp = np.minimum(lq + rng.normal(0, 0.5, 50), 0.0)
    df = canonical_log(lp, lq, step=0, sample_id=range(50))
    tb = TokenBatch(lp, lq)
    eps = float(np.sort(tb.abs_dp)[25])
    vals = np.array([float(np.nextafter(eps, 0.0)), eps])
    t = _sweep_df(df, ["ipo"], sweeps={"eps": vals})
    strictly_above = int((tb.abs_dp > eps).sum())
    assert t["masked_tokens"].to_list() == [strictly_above + 1, strictly_above]


def test_icepop_band_inclusive_on_both_sides():
    df = _ratio_log([0.5, 2.0])
    t = _sweep_df(df, ["icepop:low=0.5,high=2"])
    assert t["masked_tokens"].item() == 0
    t = _sweep_df(df, ["icepop:low=0.5,high=2"], sweeps={"icepop.low": np.array([0.5, 0.51])})
    assert t.sort("value")["masked_tokens"].to_list() == [0, 1]


def test_dppo_tv_zero_advantage_goes_to_the_low_side():
    # p - q = -0.5 with A = 0 -> masked at low 0.2; p - q = +0.5 with A = 0 -> kept
    lp_down, lq_down = math.log(0.25), math.log(0.75)
    lp_up, lq_up = math.log(0.75), math.log(0.25)
    df = canonical_log(
        [lp_down, lp_up], [lq_down, lq_up], step=0, sample_id=[0, 1], advantage=[0.0, 0.0]
    )
    t = _sweep_df(df, ["dppo-tv@prime-rl"])
    assert t["masked_tokens"].item() == 1
    assert brute.evaluate(df, "dppo-tv", {"low": 0.2, "high": 0.2})[None]["masked_tokens"] == 1


def test_weight_rules_truncate_and_never_mask():
    df = _ratio_log([0.1, 1.0, 3.0, 10.0])
    t = _sweep_df(df, ["tis:cap=2"])
    row = t.row(0, named=True)
    assert (row["masked_tokens"], row["truncated_tokens"]) == (0, 2)
    w = [0.1, 1.0, 2.0, 2.0]
    assert row["weight_mean"] == pytest.approx(np.mean(w), rel=1e-12)
    assert row["weight_max"] == pytest.approx(2.0)
    assert row["weight_ess"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)))
    t = _sweep_df(df, ["cispo:low=0.2,high=5"])
    row = t.row(0, named=True)
    assert (row["masked_tokens"], row["truncated_tokens"]) == (0, 2)
    assert row["weight_mean"] == pytest.approx(np.mean([0.2, 1.0, 3.0, 5.0]), rel=1e-12)


def test_binary_kl_matches_brute_force_and_definition():
    c = 1e-6
    for p, q in [(0.5, 0.5), (0.06, 0.01), (0.2, 0.9), (1 - 1e-9, 0.5), (1e-9, 0.3)]:
        la, lb = np.array([math.log(p)]), np.array([math.log(q)])
        got = float(binary_kl(la, lb, c)[0])
        a = min(max(p, c), 1 - c)
        b = min(max(q, c), 1 - c)
        direct = a * math.log(a / b) + (1 - a) * math.log((1 - a) / (1 - b))
        assert got == pytest.approx(direct, rel=1e-7, abs=1e-15), (p, q)
        assert got == pytest.approx(brute.bkl(la[0], lb[0], c), rel=1e-9, abs=1e-15)
    assert float(binary_kl(np.array([-0.3]), np.array([-0.3]), c)[0]) == 0.0


def test_abs_dp_has_no_cancellation_for_confident_tokens():
    lp, lq = np.array([-1e-12, -3e-12]), np.array([-2e-12, -1e-12])
    tb = TokenBatch(lp, lq)
    assert tb.abs_dp == pytest.approx([1e-12, 2e-12], rel=1e-9)
    assert np.array_equal(tb.dp > 0, [True, False])


# ----------------------------------------------------------------------------- m2po


def test_m2po_exact_on_dyadic_ties():
    # one step, l^2 = 1, 1/4, 1/16, 1/64: suffix means 0.33203125, 0.109375, 0.0390625, 0.015625
    ls = [1.0, 0.5, 0.25, 0.125]
    pairs = [(-x, 0.0) for x in ls]
    df = canonical_log(
        [p for p, _ in pairs] * 2,
        [q for _, q in pairs] * 2,
        step=[0, 0, 0, 0, 1, 1, 1, 1],
        sample_id=[0, 1, 0, 1, 0, 0, 1, 1],
    )
    grid = {
        0.4: 0,
        0.33203125: 1,  # the step mean == tau: not < tau, so the largest goes
        float(np.nextafter(0.33203125, 1.0)): 0,
        0.109375: 2,
        0.0390625: 3,
        float(np.nextafter(0.0390625, 1.0)): 2,
        0.015625: 4,  # every suffix mean >= tau: all masked
        0.01: 4,
    }
    t = _sweep_df(df, ["m2po"], sweeps={"m2po.tau": np.array(list(grid))}, by="step")
    for row in t.iter_rows(named=True):
        assert row["masked_tokens"] == grid[row["value"]], row
        b = brute.evaluate(df, "m2po", {"tau": row["value"]}, by="step")[row["step"]]
        assert row["masked_tokens"] == b["masked_tokens"]
        assert row["masked_sequences"] == b["masked_sequences"]
        assert close(row["masked_mass"], b["masked_mass"])


def test_m2po_is_per_step():
    # step 0 has a huge mismatch; step 1 is clean: the budget of one does not spill over
    df = canonical_log(
        [-3.0, -0.01, -0.01, -0.01],
        [0.0, 0.0, 0.0, 0.0],
        step=[0, 0, 1, 1],
        sample_id=[0, 0, 0, 0],
    )
    t = _sweep_df(df, ["m2po:tau=0.04"], by="step").sort("step")
    assert t["masked_tokens"].to_list() == [1, 0]
    b = brute.evaluate(df, "m2po", {"tau": 0.04}, by="step")
    assert [b[0]["masked_tokens"], b[1]["masked_tokens"]] == [1, 0]


def test_m2po_step_counts_do_not_depend_on_other_steps():
    # step 1: two tokens with l = -1e-4 (l^2 = 1e-8). The mean of the rest is 1e-8 at both
    # ranks, so at tau = 0.999e-8 both are masked (1e-8 >= tau), whatever step 0 holds.
    tau = 0.999e-8
    step1 = canonical_log([-1e-4, -1e-4], [0.0, 0.0], step=1, sample_id=[0, 0])
    alone = _sweep_df(step1, [f"m2po:tau={tau!r}"])
    assert alone["masked_tokens"].item() == 2
    assert brute.evaluate(step1, "m2po", {"tau": tau})[None]["masked_tokens"] == 2
    step0 = canonical_log([-700.0], [0.0], step=0, sample_id=[0])  # l^2 = 490000
    both = pl.concat([step0, step1])
    b = brute.evaluate(both, "m2po", {"tau": tau}, by="step")
    assert (b[0]["masked_tokens"], b[1]["masked_tokens"]) == (1, 2)
    t = _sweep_df(both, [f"m2po:tau={tau!r}"], by="step").sort("step")
    assert t["masked_tokens"].to_list() == [1, 2]


def test_m2po_suffix_means_have_no_cancellation():
    # one step: l = -300 (l^2 = 9e4) and two tokens with l = -1e-4 (l^2 = 1e-8). Suffix means:
    # 3e4, 1e-8, 1e-8, all >= tau = 0.9999e-8 (not a tie: 1e-4 relative below), so all three
    # are masked. The engine's second suffix mean is (9e4 + 2e-8 - 9e4) / 2, wrong by ~1e-4.
    tau = 0.9999e-8
    df = canonical_log([-300.0, -1e-4, -1e-4], [0.0, 0.0, 0.0], step=0, sample_id=[0, 0, 1])
    assert brute.evaluate(df, "m2po", {"tau": tau})[None]["masked_tokens"] == 3
    t = _sweep_df(df, [f"m2po:tau={tau!r}"])
    assert t["masked_tokens"].item() == 3  # engine: 1


# ----------------------------------------------------------------------------- weight clamp


def test_tis_weight_uses_the_clamped_ratio_above_exp20():
    # l = 25: the clamped ratio is e^20 (4.85e8); at cap 1e10 the weight is e^20, not 1e10
    df = canonical_log([0.0, -0.5], [-25.0, -0.5], step=0, sample_id=[0, 1])
    b = brute.evaluate(df, "tis", {"cap": 1e10})[None]
    assert b["weight_max"] == pytest.approx(math.exp(20.0))
    t = _sweep_df(df, ["tis:cap=1e10"])
    assert t["weight_max"].item() == pytest.approx(math.exp(20.0), rel=1e-12)


# ----------------------------------------------------------------------------- property


def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_subnormal=False)


OFF = st.just(0.0)
RANGES: dict[tuple[str, str], st.SearchStrategy[float]] = {
    ("ipo", "eps"): _floats(0.0, 1.0),
    ("ipo-v1", "low"): _floats(0.0, 1.0),
    ("ipo-v1", "high"): _floats(0.0, 1.0),
    ("icepop", "low"): OFF | _floats(0.01, 1.0),
    ("icepop", "high"): _floats(1.0, 20.0),
    ("kpop", "phi"): _floats(1e-6, 10.0),
    ("kpop", "clamp"): st.sampled_from([1e-8, 1e-6, 1e-4]),
    ("token-k2", "hi"): _floats(0.0, 10.0),
    ("token-k3", "hi"): _floats(0.0, 10.0),
    ("m2po", "tau"): _floats(1e-9, 2.0),
    ("dppo-tv", "low"): _floats(0.0, 1.0),
    ("dppo-tv", "high"): _floats(0.0, 1.0),
    ("dppo-kl", "low"): _floats(1e-6, 5.0),
    ("dppo-kl", "high"): _floats(1e-6, 5.0),
    ("dppo-kl", "clamp"): st.sampled_from([1e-8, 1e-6, 1e-4]),
    ("ppo-clip", "eps_low"): _floats(0.0, 1.0),
    ("ppo-clip", "eps_high"): _floats(0.0, 10.0),
    ("dual-clip", "c"): _floats(1.0, 20.0),
    ("tis", "cap"): _floats(0.1, 50.0),
    ("cispo", "low"): OFF | _floats(1e-3, 1.0),
    ("cispo", "high"): _floats(1.0, 50.0),
    ("seq-tis", "cap"): _floats(0.1, 100.0),
    ("seq-mis", "low"): OFF | _floats(1e-3, 1.0),
    ("seq-mis", "high"): _floats(1.0, 100.0),
    ("geo-mis", "low"): _floats(0.5, 1.0),
    ("geo-mis", "high"): _floats(1.0, 2.0),
    ("seq-mean-k3", "hi"): _floats(0.0, 1.0),
    ("seq-max-k2", "hi"): _floats(0.0, 10.0),
    ("veto", "v"): _floats(1e-9, 1.0),
    ("opsm", "delta"): _floats(-1.0, 3.0),
    ("gspo", "eps_low"): _floats(0.0, 0.5),
    ("gspo", "eps_high"): _floats(0.0, 2.0),
    ("prob-error", "tau"): _floats(1.0, 10.0),
}
RANGES[("token-mis", "low")] = RANGES[("icepop", "low")]
RANGES[("token-mis", "high")] = RANGES[("icepop", "high")]
RANGES[("dual-clip", "eps_low")] = RANGES[("ppo-clip", "eps_low")]
RANGES[("dual-clip", "eps_high")] = RANGES[("ppo-clip", "eps_high")]


def _finite(xs) -> list[float]:
    return sorted({float(x) for x in xs if math.isfinite(x)})


def derived(rule: str, param: str, L: brute.Log) -> list[float]:
    """Threshold values that sit exactly on a data value (ties: strict vs inclusive)."""
    lo_ratios = [c for c in NICE_RATIOS if c < 1]
    hi_ratios = [c for c in NICE_RATIOS if c > 1]
    if rule == "ipo":
        return _finite(L.abs_dp)
    if rule in ("ipo-v1", "dppo-tv"):
        return _finite(L.dp[L.dp > 0]) if param == "high" else _finite(-L.dp[L.dp < 0])
    if rule in ("icepop", "token-mis", "cispo", "seq-mis", "geo-mis"):
        return lo_ratios if param == "low" else hi_ratios
    if rule in ("tis", "seq-tis"):
        return list(NICE_RATIOS)
    if rule == "veto":
        return lo_ratios
    if rule in ("token-k2", "seq-max-k2"):
        return _finite(L.k2)
    if rule in ("token-k3", "seq-mean-k3"):
        return _finite(L.k3)
    if rule == "m2po":
        return [x * x for x in DYADIC_L]
    if rule in ("ppo-clip", "dual-clip"):
        r = L.r[np.isfinite(L.r)]
        if param == "eps_high":
            return _finite(r[r > 1] - 1.0)
        if param == "eps_low":
            return _finite(1.0 - r[r < 1])
        return _finite(r[r > 1])
    if rule == "opsm":
        return _finite(-L.l)
    if rule == "prob-error":
        return _finite(L.exp_abs_l)
    return []


def value_strategy(
    rule: str, param: str, L: brute.Log, ties: bool = True
) -> st.SearchStrategy[float]:
    base = RANGES[(rule, param)]
    d = derived(rule, param, L) if ties else []
    return st.one_of(base, st.sampled_from(d)) if d else base


def _check_row(row: dict, exp: dict, what: str) -> None:
    for k in ("tokens", "masked_tokens", "truncated_tokens", "sequences", "masked_sequences"):
        assert row[k] == exp[k], f"{what}: {k} engine {row[k]} != brute {exp[k]}"
    for k in ("masked_mass", "masked_mass_fraction"):
        assert close(row[k], exp[k]), f"{what}: {k} engine {row[k]} != brute {exp[k]}"
    for k in ("weight_mean", "weight_max", "weight_ess"):
        assert close(row[k], exp[k], rel=1e-9), f"{what}: {k} engine {row[k]} != brute {exp[k]}"
    assert close(row["masked_fraction"], row["masked_tokens"] / row["tokens"], rel=1e-12)
    assert close(row["truncated_fraction"], row["truncated_tokens"] / row["tokens"], rel=1e-12)
    weight = row["rule"] in brute.WEIGHT_RULES
    assert row["kind"] == ("weight" if weight else "mask")
    if weight:
        assert row["masked_tokens"] == 0 and row["masked_sequences"] == 0
    else:
        assert row["truncated_tokens"] == 0 and row["weight_mean"] is None


FAMILIES = {
    "token": ("ipo", "ipo-v1", "icepop", "token-mis", "kpop", "token-k2", "token-k3"),
    "advantage": ("dppo-tv", "dppo-kl", "ppo-clip", "dual-clip"),
    "m2po": ("m2po",),
    "weight": ("tis", "cispo", "seq-tis"),
    "sequence": brute.SEQUENCE_RULES,
}
assert sorted(r for f in FAMILIES.values() for r in f) == sorted(brute.ALL_RULES)


def _run_family(data, df: pl.DataFrame, names, ties: bool) -> None:
    """Draw a fixed setting and a grid per parameter for every rule, sweep once, compare."""
    L = brute.Log(df)
    rules, fixed_of, sweeps = [], {}, {}
    for rule in names:
        fixed = {
            p: data.draw(value_strategy(rule, p, L, ties), label=f"{rule} fixed {p}")
            for p in brute.PARAMS[rule]
        }
        fixed_of[rule] = fixed
        rules.append(REGISTRY[rule](**fixed))
        for p in brute.PARAMS[rule]:
            grid = data.draw(
                st.lists(value_strategy(rule, p, L, ties), min_size=1, max_size=4),
                label=f"{rule} grid {p}",
            )
            sweeps[f"{rule}.{p}"] = np.array(grid, dtype=float)
    batch_rows = data.draw(st.sampled_from([2, 7, 1_000_000]), label="batch_rows")
    with log_file(df) as path:
        res = engine.sweep(
            [path], rules=rules, sweeps=sweeps, options=ingest.ReadOptions(batch_rows=batch_rows)
        )
    t = res.table
    assert t.height == sum(np.unique(g).shape[0] for g in sweeps.values())
    seen = set()
    for row in t.iter_rows(named=True):
        rule = row["rule"]
        params = {**fixed_of[rule], row["param"]: row["value"]}
        exp = brute.evaluate(L, rule, params)[None]
        _check_row(row, exp, f"{rule} {params}")
        seen.add((rule, row["param"]))
    assert seen == {(r, p) for r in names for p in brute.PARAMS[r]}


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=25)
@given(data=st.data())
def test_every_rule_every_threshold_matches_brute_force(family, kernel_backend, data):
    """Random logs x random grids (with exact data ties, except for m2po: see the xfail
    above and test_m2po_exact_ties_match_brute_force) for every parameter of every rule."""
    df = data.draw(logs(), label="log")
    _run_family(data, df, FAMILIES[family], ties=family != "m2po")


@st.composite
def exact_logs(draw) -> pl.DataFrame:
    """Logs whose l are 0 or +-1/8, 1/4, 1/2, 1: every l^2 and every sum of them is exact."""
    n = draw(st.integers(1, 14))
    ls = draw(st.lists(st.sampled_from((0.0, *DYADIC_L)), min_size=n, max_size=n))
    signs = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    base = draw(st.lists(st.sampled_from((0.0, -0.5, -2.0)), min_size=n, max_size=n))
    lp = [b - x if s else b for b, x, s in zip(base, ls, signs, strict=True)]
    lq = [b if s else b - x for b, x, s in zip(base, ls, signs, strict=True)]
    step = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    sid = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    return canonical_log(lp, lq, step=step, sample_id=sid)


@settings(max_examples=60)
@given(df=exact_logs(), data=st.data())
def test_m2po_exact_ties_match_brute_force(df, data):
    """m2po's per-step rule at taus equal to suffix means (exact here): inclusive ties,
    per-step budgets, which tokens (mass) and which sequences are masked."""
    L = brute.Log(df)
    candidates = set()
    for s in set(L.step):
        x = sorted((float(L.l[i] ** 2) for i in range(L.n) if L.step[i] == s), reverse=True)
        for m in range(len(x)):
            candidates.add(math.fsum(x[m:]) / (len(x) - m))
    cand = sorted(candidates)
    taus = data.draw(
        st.lists(st.sampled_from(cand) | _floats(1e-3, 2.0), min_size=1, max_size=6), label="tau"
    )
    by = data.draw(st.sampled_from([None, "step"]), label="by")
    with log_file(df) as path:
        t = engine.sweep([path], rules=["m2po"], sweeps={"tau": np.array(taus)}, by=by).table
    for row in t.iter_rows(named=True):
        key = row["step"] if by else None
        exp = brute.evaluate(L, "m2po", {"tau": row["value"]}, by=by)[key]
        _check_row(row, exp, f"m2po tau={row['value']} group={key}")


# ----------------------------------------------------------------------------- domains


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("ipo:eps=-0.1", "ipo's eps must be >= 0, got -0.1"),
        ("icepop:low=5,high=0.5", "icepop's low must be in [0, 1] (0 = off), got 5"),
        ("icepop:high=0.5", "icepop's high must be >= 1, got 0.5"),
        ("kpop:phi=-1", "kpop's phi must be >= 0, got -1"),
        ("tis:cap=-1", "tis's cap must be > 0, got -1"),
        ("geo-mis:low=2,high=1", "geo-mis's low must be in [0, 1] (0 = off), got 2"),
        ("kpop:clamp=0", "kpop's clamp must be in (0, 0.5), got 0"),
        ("kpop:clamp=2", "kpop's clamp must be in (0, 0.5), got 2"),
        ("dppo-kl:clamp=0.5", "dppo-kl's clamp must be in [0, 0.5), got 0.5"),
        ("ppo-clip:eps_low=1.5", "ppo-clip's eps_low must be in [0, 1], got 1.5"),
        ("dual-clip:c=0.5", "dual-clip's c must be >= 1, got 0.5"),
        ("prob-error:tau=0.9", "prob-error's tau must be >= 1, got 0.9"),
        ("veto:v=2", "veto's v must be in [0, 1], got 2"),
        ("ipo:eps=0.1,eps=0.2", "eps is given twice"),
        ("icepop@verl:high=3,high=4", "high is given twice"),
    ],
)
def test_a_setting_outside_its_domain_is_a_usage_error(spec, needle):
    with pytest.raises(UsageError) as exc:
        parse_rule(spec)
    assert needle in str(exc.value) and spec in str(exc.value)


def test_every_default_preset_and_grid_lies_in_its_domain():
    for name, cls in REGISTRY.items():
        cls()  # the defaults
        for preset in cls.presets:
            parse_rule(f"{name}@{preset}")
        for p in cls.params:
            assert all(float(v) in p.domain for v in parse_grid(p.grid)), (name, p.name)
    assert parse_rule("cispo:low=0,high=5").low == 0.0  # 0 = off where the domain says so
    assert parse_rule("opsm:delta=-0.5").delta == -0.5  # a signed threshold


def test_a_grid_point_outside_the_domain_is_refused_before_the_replay():
    with pytest.raises(UsageError, match=r"--sweep icepop.low: icepop's low must be in \[0, 1\]"):
        engine.plan_jobs(["icepop"], {"icepop.low": "0.5:1.5:5"})
    with pytest.raises(UsageError, match=r"kpop's clamp must be in \(0, 0.5\), got 0"):
        engine.plan_jobs(["kpop"], {"kpop.clamp": "0,1e-6"})


def test_the_cli_exits_2_naming_the_parameter(golden_log):
    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    res = CliRunner().invoke(app, ["sweep", str(golden_log), "-r", "kpop:clamp=2"])
    assert res.exit_code == 2
    assert "kpop's clamp must be in (0, 0.5), got 2" in res.stderr
    assert "Traceback" not in res.output
