"""choose / compare / drift against brute force, and their command lines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_replay import analysis
from mismatch_replay.analysis import search
from mismatch_replay.cli import app

GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"


def random_log(path: Path, seed: int, steps: int = 6, seqs: int = 20, length: int = 60) -> Path:
    rng = np.random.default_rng(seed)
    n = steps * seqs * length
    lq = -rng.exponential(rng.uniform(0.1, 1.0), n)
    lp = np.minimum(lq + rng.standard_t(3, n) * rng.uniform(0.01, 0.2), 0.0)
    pl.DataFrame(
        {
            "step": np.repeat(np.arange(steps), seqs * length),
            "sample_id": np.tile(np.repeat(np.arange(seqs), length), steps),
            "trainer_logprob": lp,
            "inference_logprob": lq,
            "advantage": np.repeat(rng.normal(size=steps * seqs), length),
        }
    ).write_parquet(path)
    return path


def brute_masks(df: pl.DataFrame) -> dict[str, object]:
    lp, lq = df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy()
    p, q = np.exp(lp), np.exp(lq)
    return {
        "ipo": lambda eps: np.abs(p - q) > eps,
        "icepop-high": lambda high, low=0.2: (lp - lq < np.log(low)) | (lp - lq > np.log(high)),
        "kpop": None,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("target", [0.003, 0.02, 0.2])
def test_choose_lands_within_tolerance(tmp_path, seed, target):
    f = random_log(tmp_path / "log.parquet", seed)
    rows = analysis.choose([f], target, ["ipo", "icepop@prime-rl"], bootstrap=0)
    df = pl.read_parquet(f)
    m = brute_masks(df)
    for r in rows:
        if r.rule == "ipo":
            brute = m["ipo"](r.value).mean()
        elif r.param == "high":
            brute = m["icepop-high"](r.value).mean()
        else:
            lp = df["trainer_logprob"].to_numpy() - df["inference_logprob"].to_numpy()
            brute = ((lp < np.log(r.value)) | (lp > np.log(5.0))).mean()
        assert r.masked_fraction == pytest.approx(brute, rel=1e-12, abs=1e-15)
        if r.status == "ok":
            assert abs(r.masked_fraction - target) <= 0.01 * target
        else:
            assert r.status in ("ties", "out of range"), r


def test_choose_reports_ties(tmp_path):
    n = 1000
    lq = np.full(n, np.log(0.9))
    lp = np.where(np.arange(n) < 500, np.log(0.5), np.log(0.9))  # half move by exactly 0.4
    pl.DataFrame({"trainer_logprob": lp, "inference_logprob": lq}).write_parquet(tmp_path / "t.pq")
    (row,) = analysis.choose([tmp_path / "t.pq"], 0.25, ["ipo"], bootstrap=0)
    assert row.status == "ties" and "jumps from 0.5 to 0" in row.note


def test_choose_bootstrap_interval(tmp_path):
    f = random_log(tmp_path / "log.parquet", 3)
    a = analysis.choose([f], 0.02, ["ipo"], bootstrap=100, seed=1)[0]
    b = analysis.choose([f], 0.02, ["ipo"], bootstrap=100, seed=1)[0]
    c = analysis.choose([f], 0.02, ["ipo"], bootstrap=100, seed=2)[0]
    assert a == b
    assert (a.ci_low, a.ci_high) != (c.ci_low, c.ci_high)
    assert a.ci_low <= a.value <= a.ci_high
    assert a.ci_low < a.ci_high
    steps = analysis.choose([f], 0.02, ["ipo"], bootstrap=100, unit="step")[0]
    assert steps.ci_low <= steps.value <= steps.ci_high


def test_choose_inverse_gives_the_fraction_at_a_setting():
    rows = analysis.choose([GOLDEN], None, ["ipo:eps=0.3", "seq-mis@verl"], bootstrap=50)
    assert rows[0].masked_tokens == 29 and rows[0].tokens == 19598
    assert rows[1].masked_tokens == 7981  # golden
    for r in rows:
        assert r.ci_low <= r.masked_fraction <= r.ci_high


def test_compare_counts_equal_brute_force_sets():
    res = analysis.compare([GOLDEN], "ipo@prime-rl", "icepop@prime-rl", examples=3)
    df = pl.read_parquet(GOLDEN).filter("loss_mask")
    lp, lq = df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy()
    a = np.abs(np.exp(lp) - np.exp(lq)) > 0.3
    b = (lp - lq < np.log(0.2)) | (lp - lq > np.log(5.0))
    assert res.both == (a & b).sum() and res.only_a == (a & ~b).sum()
    assert res.only_b == (~a & b).sum() and res.neither == (~a & ~b).sum()
    assert res.jaccard == pytest.approx((a & b).sum() / (a | b).sum())
    mass = np.abs(np.exp(lp) - np.exp(lq))
    assert res.cells["only_a"].mass == pytest.approx(mass[a & ~b].sum())
    assert res.cells["only_b"].mean_q == pytest.approx(np.exp(lq)[~a & b].mean())
    assert sum(w.tokens for w in res.where) == df.height
    ex = res.examples
    assert [e["masked_by"] for e in ex] == ["a"] * 3 + ["b"] * 3
    only_b_ratios = np.abs(lp - lq)[~a & b]
    assert abs(ex[3]["log_ratio"]) == pytest.approx(only_b_ratios.max())


def test_compare_with_a_sequence_rule():
    res = analysis.compare([GOLDEN], "seq-mis@verl", "ipo:eps=0.05")
    assert res.masked_a == 7981 and res.masked_b == 102  # golden counts


def test_compare_iso_budget():
    res = analysis.compare([GOLDEN], "ipo", "icepop@prime-rl", budget=0.01)
    for side in ("a", "b"):
        assert res.settings[side].masked_fraction == pytest.approx(0.01, rel=0.011)
    assert res.masked_a / res.tokens == pytest.approx(0.01, rel=0.011)
    assert res.masked_b / res.tokens == pytest.approx(0.01, rel=0.011)


def drift_log(path: Path, drift_from: int | None, spike_at: int | None, steps: int = 20):
    rng = np.random.default_rng(7)
    frames = []
    for step in range(steps):
        n = 4000
        lq = -rng.exponential(0.3, n)
        sd = 0.02
        if drift_from is not None and step >= drift_from:
            sd *= 3 ** (step - drift_from + 1)
        lp = np.minimum(lq + rng.normal(0, sd, n), 0.0)
        if spike_at == step:
            lp[:4] = lq[:4] - 9.0  # four catastrophic tokens lift the step's mean k3 ~10x
        frames.append(
            pl.DataFrame(
                {
                    "step": np.full(n, step),
                    "sample_id": np.repeat(np.arange(40), 100),
                    "position": np.tile(np.arange(100), 40),
                    "trainer_logprob": lp,
                    "inference_logprob": lq,
                }
            )
        )
    pl.concat(frames).write_parquet(path)
    return path


def test_drift_flags_the_drifting_steps(tmp_path):
    res = analysis.drift([drift_log(tmp_path / "d.pq", drift_from=15, spike_at=None)])
    assert res.flagged_steps == [15, 16, 17, 18, 19]
    assert res.spike_steps == []
    assert any("rose" in v.verdict for v in res.rules)


def test_drift_quiet_log_flags_nothing(tmp_path):
    res = analysis.drift([drift_log(tmp_path / "q.pq", drift_from=None, spike_at=None)])
    assert res.flagged_steps == [] and res.spike_steps == []
    assert all(v.verdict == "no drift" for v in res.rules)


def test_drift_lone_heavy_tail_step_is_a_spike(tmp_path):
    res = analysis.drift([drift_log(tmp_path / "s.pq", drift_from=None, spike_at=8)])
    assert res.flagged_steps == [] and res.spike_steps == [8]
    row = next(r for r in res.steps if r.step == 8)
    assert row.kl_k3 > 5 * res.baseline.kl_k3  # the mean is lifted ...
    assert row.kl_k3_trimmed < 1.5 * res.baseline.kl_k3_trimmed  # ... the trim is not
    toks = res.spikes[0].tokens
    assert {t["position"] for t in toks[:4]} == {0, 1, 2, 3}
    assert all(t["step"] == 8 and t["sample_id"] == 0 for t in toks[:4])


def test_drift_collapse_signature(tmp_path):
    """A ratio rule whose band the drift never reaches stays flat while k3 climbs."""
    res = analysis.drift(
        [drift_log(tmp_path / "c.pq", drift_from=16, spike_at=None)],
        rules=["icepop:low=0.0001,high=10000", "ipo:eps=0.05"],
    )
    verdicts = {v.rule: v.verdict for v in res.rules}
    assert "collapse signature" in verdicts["icepop:low=0.0001,high=10000"]
    assert verdicts["ipo:eps=0.05"].startswith("rose")


def rise_log(path: Path, masked_per_step: int, steps: int = 20, drift_from: int = 15):
    """k3 climbs ~25x from step `drift_from` on with every ratio inside IcePop's [0.2, 5],
    except `masked_per_step` tokens per drift step at ratio 0.05: IcePop [0.2, 5] masks 0
    tokens in the baseline and masked_per_step / 10,000 of each drift step."""
    rng = np.random.default_rng(3)
    n = 10_000
    frames = []
    for step in range(steps):
        lq = -rng.exponential(0.3, n)
        lp = np.minimum(lq + rng.normal(0, 0.1 if step >= drift_from else 0.02, n), 0.0)
        if step >= drift_from:
            lp[:masked_per_step] = lq[:masked_per_step] - 3.0
        frames.append(
            pl.DataFrame(
                {
                    "step": np.full(n, step),
                    "sample_id": np.repeat(np.arange(100), 100),
                    "position": np.tile(np.arange(100), 100),
                    "trainer_logprob": lp,
                    "inference_logprob": lq,
                }
            )
        )
    pl.concat(frames).write_parquet(path)
    return path


ICEPOP = "icepop:low=0.2,high=5"


@pytest.mark.parametrize(
    ("per_step", "min_rise", "rose"),
    [
        (1, None, False),  # 0 -> 1e-4: x8 but 0.01 percentage points: flat
        (10, None, True),  # 0 -> 1e-3: rises by 0.1 pp, over the 0.05 pp default floor
        (1, 5e-5, True),  # the floor is configurable: 1e-4 clears 5e-5 ...
        (10, 2e-3, False),  # ... and 1e-3 does not clear 2e-3
        (1, 0.0, True),  # no floor: the ratio alone decides
    ],
)
def test_drift_min_rise_floor(tmp_path, per_step, min_rise, rose):
    """A rise from a zero baseline to a fraction no one would act on is no rise."""
    kw = {} if min_rise is None else {"min_rise": min_rise}
    res = analysis.drift([rise_log(tmp_path / "r.pq", per_step)], rules=[ICEPOP], **kw)
    assert res.flagged_steps == [15, 16, 17, 18, 19]
    assert res.min_rise == (5e-4 if min_rise is None else min_rise)
    (v,) = res.rules
    assert v.baseline_fraction == 0
    assert v.drift_fraction == pytest.approx(per_step / 10_000)
    assert v.rise == pytest.approx(per_step / 10_000)
    assert v.ratio >= 2  # the ratio alone would call every one of them a rise
    if rose:
        assert v.verdict == "rose with the mismatch"
    else:
        assert v.verdict == "flat while the mismatch rose (the collapse signature)"


def test_cli_drift_min_rise(tmp_path):
    f = rise_log(tmp_path / "r.pq", 1)
    r = runner.invoke(app, ["drift", str(f), "-r", ICEPOP, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["min_rise"] == 5e-4
    assert d["rules"][0]["verdict"].startswith("flat") and d["rules"][0]["rise"] > 0
    r = runner.invoke(app, ["drift", str(f), "-r", ICEPOP])
    assert r.exit_code == 0 and "under --min-rise 0.05%" in " ".join(r.stdout.split())
    r = runner.invoke(app, ["drift", str(f), "-r", ICEPOP, "--min-rise", "0", "--json"])
    assert json.loads(r.stdout)["rules"][0]["verdict"] == "rose with the mismatch"
    r = runner.invoke(app, ["drift", str(f), "--min-rise", "2"])
    assert r.exit_code == 2


runner = CliRunner()


def test_cli_decision_commands_json(tmp_path):
    r = runner.invoke(
        app, ["choose", str(GOLDEN), "-t", "0.01", "-r", "ipo", "--json", "--bootstrap", "20"]
    )
    assert r.exit_code == 0, r.stderr
    row = json.loads(r.stdout)["rows"][0]
    assert {"rule", "param", "value", "masked_fraction", "ci_low", "ci_high"} <= set(row)
    r = runner.invoke(app, ["compare", str(GOLDEN), "-r", "ipo", "-r", "icepop", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"both", "only_a", "only_b", "neither", "rule_a", "rule_b"} <= set(d)
    f = drift_log(tmp_path / "d.pq", drift_from=15, spike_at=5)
    r = runner.invoke(app, ["drift", str(f), "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["flagged_steps"] == [15, 16, 17, 18, 19] and d["spike_steps"] == [5]
    assert len(d["steps"]) == 20
    r = runner.invoke(app, ["drift", str(f)])
    assert r.exit_code == 0 and "DRIFT" in r.stdout and "spike at step 5" in r.stdout
    r = runner.invoke(app, ["compare", str(GOLDEN), "-r", "ipo"])
    assert r.exit_code == 2 and "exactly two" in r.stderr
    r = runner.invoke(app, ["choose", str(GOLDEN), "-t", "1.5"])
    assert r.exit_code == 2 and "(0, 1)" in r.stderr


@pytest.mark.parametrize("unit", ["sequence", "step"])
def test_one_pass_bootstrap_equals_the_engines_replicates(tmp_path, unit):
    """choose's bootstrap on the fused path (a Tally grouped by unit, sub-batch by
    sub-batch) gives exactly the replicates of engine.replay(bootstrap=...) on the simple
    path, sequences spanning sub-batches included; sequence rules from the sequence sums."""
    from mismatch_replay import engine, ingest
    from mismatch_replay.engine import readout as tables
    from mismatch_replay.rules import parse_rule

    f = random_log(tmp_path / "log.parquet", 3)
    plan = ingest.plan_sources([f])
    specs = ["ipo", "icepop@prime-rl", "kpop@prime-rl", "seq-mis"]
    jobs = search.choice_jobs([parse_rule(r) for r in specs], True)
    ref = engine.replay(plan, jobs=jobs, bootstrap=(30, unit, 3), final=True)
    main = engine.replay(plan, jobs=jobs, final=True)
    old = search.SUB_BATCH
    search.SUB_BATCH = 1000  # many sub-batches: 60-token sequences cut across them
    try:
        res = search.one_pass(plan, jobs, jobs, 30, unit, 3, main, None)
    finally:
        search.SUB_BATCH = old
    for ji in range(len(jobs)):
        counts, tokens = tables.boot_counts(ref, ji)
        assert np.array_equal(res.hits[ji], tables.job_counts(ref, ji)[1])
        assert np.array_equal(res.reps[ji], counts)
        np.testing.assert_allclose(res.tokens[ji], tokens, rtol=1e-12)


def test_choose_reads_the_log_once(tmp_path, reads):
    """One replay of the default grids that keeps its tail: refinement and bootstrap come
    from the kept tokens (tail_counts.py), so no second read (on the fused path; the simple
    path keeps no tail: the grids, then one pass for refinement and bootstrap). The grids'
    extra points are placed on the first batch as it comes (engine.replay(shape=)): no
    read ahead."""

    f = random_log(tmp_path / "log.parquet", 1)
    # exact arithmetic: a preset's float32 (its default) runs on the simple path, no tail
    specs = ["ipo", "icepop@prime-rl", "seq-mis"]
    rows = analysis.choose([f], 0.02, specs, bootstrap=50, precision="float64")
    from mismatch_replay import fast

    n = 1 if fast.backend() == "numba" else 2
    assert len(reads) == n and reads.partial == 0
    assert all(r.passes == n for r in rows)
    assert all(r.ci_low is not None for r in rows if r.status == "ok")


def test_choose_curve_is_exact_around_the_choice(tmp_path):
    f = random_log(tmp_path / "log.parquet", 2)
    (row,) = analysis.choose([f], 0.02, ["ipo"], bootstrap=0, curve=True)
    df = pl.read_parquet(f)
    p, q = np.exp(df["trainer_logprob"].to_numpy()), np.exp(df["inference_logprob"].to_numpy())
    pts = row.curve
    assert 5 <= len(pts) <= analysis.CURVE_POINTS
    assert [pt.chosen for pt in pts].count(True) == 1
    assert [pt.value for pt in pts] == sorted(pt.value for pt in pts)  # eps: masking order
    for pt in pts:
        assert pt.masked_tokens == int((np.abs(p - q) > pt.value).sum())
