"""diagnose: each finding on a constructed log with a known cause (the number recovered),
no false alarm on the bundled sample and the golden log, the streamed statistics against a
brute-force numpy computation on the whole table (hypothesis), and the CLI's table and JSON.
The simulator's cases (torch) are in the slow tests at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay.analysis import diagnose as D
from mismatch_replay.ingest import ReadOptions

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "mismatch_replay" / "data" / "sample_drift.parquet"
GOLDEN = ROOT / "tests" / "data" / "golden_log.parquet"


def _write(tmp_path: Path, df: pl.DataFrame, name: str = "log.parquet") -> Path:
    p = tmp_path / name
    df.write_parquet(p)
    return p


def _contexts(rng, n_ctx: int, vocab: int, scale: float) -> np.ndarray:
    """[n_ctx, vocab] logits of peaked, LLM-like next-token distributions."""
    z = rng.normal(0, scale, (n_ctx, vocab))
    z[:, 0] += rng.uniform(0, 6, n_ctx)  # a dominant token in most contexts
    return z


def _logsoftmax(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


def _log(lp, lq, seqs: int, extra: dict | None = None) -> pl.DataFrame:
    n = lp.size
    length = n // seqs
    return pl.DataFrame(
        {
            "step": np.repeat(np.arange(seqs) // max(1, seqs // 4), length),
            "sample_id": np.repeat(np.arange(seqs), length),
            "position": np.tile(np.arange(length), seqs),
            "trainer_logprob": lp,
            "inference_logprob": lq,
            **(extra or {}),
        }
    )


def _sample(rng, logp_rows: np.ndarray) -> np.ndarray:
    """One token per row from the distributions exp(logp_rows)."""
    p = np.exp(logp_rows)
    c = p.cumsum(axis=1)
    u = rng.random(p.shape[0])[:, None] * c[:, -1:]
    return np.minimum((c < u).sum(axis=1), p.shape[1] - 1)


def _top_p_log(rng, top_p: float, seqs=400, length=50, vocab=64):
    """The engine samples from q's top-p set renormalised and logs that log-prob; the
    trainer logs p (q with bf16-scale noise on the logits). Returns the log and the true
    kept mass per token."""
    n = seqs * length
    z = _contexts(rng, n, vocab, 1.5)
    lqf = _logsoftmax(z)
    lpf = _logsoftmax(z + rng.normal(0, 0.02, z.shape))
    order = np.argsort(-lqf, axis=1)
    sorted_p = np.exp(np.take_along_axis(lqf, order, axis=1))
    before = np.cumsum(sorted_p, axis=1) - sorted_p
    keep_sorted = before < top_p  # the smallest set whose mass reaches top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=1)
    kept = np.where(keep, np.exp(lqf), 0).sum(axis=1)
    lq_trunc = np.where(keep, lqf - np.log(kept)[:, None], -np.inf)
    tok = _sample(rng, lq_trunc)
    rows = np.arange(n)
    lp, lq = lpf[rows, tok], lq_trunc[rows, tok]
    return _log(lp, lq, seqs, {"kept_mass": kept}), kept


# ----------------------------------------------------------------------------- truncation


def test_truncation_found_and_kept_mass_recovered(tmp_path):
    rng = np.random.default_rng(1)
    df, kept = _top_p_log(rng, 0.8)
    res = D.diagnose(_write(tmp_path, df))
    t = res.get("truncation")
    assert t.verdict == "found"
    assert abs(t.numbers["kept_mass"] - kept.mean()) < 0.01
    assert t.numbers["ci_high"] < 0.99
    assert t.rows.height == 4  # per step
    # the renormalisation moves the slope of l on lq too: never a temperature finding
    assert res.get("temperature").verdict != "found"
    # with the kept mass mapped, every command replays lq + log(kept_mass): it clears
    opts = ReadOptions(mapping={"kept_mass": "kept_mass"})
    fixed = D.diagnose(_write(tmp_path, df), options=opts).get("truncation")
    assert fixed.verdict == "clear"
    assert fixed.numbers["ci_low"] <= 1.0 <= fixed.numbers["ci_high"]
    assert "kept_mass applied" in fixed.evidence


def test_truncation_clear_at_top_p_1(tmp_path):
    rng = np.random.default_rng(2)
    df, kept = _top_p_log(rng, 1.01)
    assert kept.min() == pytest.approx(1.0)
    t = D.diagnose(_write(tmp_path, df)).get("truncation")
    assert t.verdict == "clear"
    assert t.numbers["ci_low"] <= 1.0 <= t.numbers["ci_high"]


def test_kept_mass_is_not_read_unless_mapped(tmp_path):
    rng = np.random.default_rng(3)
    df, _ = _top_p_log(rng, 0.8, seqs=100)
    p = _write(tmp_path, df)
    import mismatch_replay as mr

    plain = mr.inspect(p).metrics["kl_k1"]
    mapped = mr.inspect(p, options=ReadOptions(mapping={"kept_mass": "kept_mass"}))
    lp, lq, s = (df[c].to_numpy() for c in ("trainer_logprob", "inference_logprob", "kept_mass"))
    assert plain == pytest.approx(np.mean(lq - lp), rel=1e-9)
    assert mapped.metrics["kl_k1"] == pytest.approx(np.mean(lq + np.log(s) - lp), rel=1e-9)


def test_kept_mass_out_of_range_is_an_error(tmp_path):
    df = _log(np.full(8, -0.1), np.full(8, -0.1), 2, {"km": np.r_[np.full(7, 0.9), 1.5]})
    import mismatch_replay as mr
    from mismatch_replay.errors import DataError

    with pytest.raises(DataError, match="kept_mass"):
        mr.sweep(_write(tmp_path, df), options=ReadOptions(mapping={"kept_mass": "km"}))
    # diagnose counts invalid rows instead of refusing them
    st = D.collect(_write(tmp_path, df), ReadOptions(mapping={"kept_mass": "km"}))
    assert sum(v for (f, c), v in st.report.dropped.items() if c == "kept_mass") == 1


# ----------------------------------------------------------------------------- temperature


@pytest.mark.parametrize("T", [0.7, 1.3])
def test_temperature_recovered(tmp_path, T):
    rng = np.random.default_rng(4)
    n, vocab = 20000, 64
    z = _contexts(rng, n, vocab, 1.5)
    lq_full = _logsoftmax(z / T)  # the sampler's tempered distribution, sampled and logged
    lp_full = _logsoftmax(z)  # the trainer's plain one
    tok = _sample(rng, lq_full)
    rows = np.arange(n)
    entropy = -(np.exp(lp_full) * lp_full).sum(axis=1)  # the trainer's, as trainers log it
    df = _log(lp_full[rows, tok], lq_full[rows, tok], 400, {"entropy": entropy})
    t = D.diagnose(_write(tmp_path, df)).get("temperature")
    assert t.verdict == "found"
    assert abs(t.numbers["temperature_ratio"] - T) < 0.05
    assert t.numbers["ci_low"] <= t.numbers["slope"] <= t.numbers["ci_high"]
    # without the entropy the plain slope still flags it, pulled toward 1
    plain = D.diagnose(_write(tmp_path, df.drop("entropy"), "plain.parquet")).get("temperature")
    assert plain.verdict == "found"
    assert abs(plain.numbers["temperature_ratio"] - 1) < abs(T - 1)


# ----------------------------------------------------------------------------- staleness


def test_staleness_split(tmp_path):
    rng = np.random.default_rng(5)
    n = 40000
    lo = -rng.exponential(0.5, n)
    lq = lo + rng.normal(0, 0.01, n)  # the engine: small
    lp = lo + rng.normal(0, 0.2, n)  # the lag: large
    df = _log(np.minimum(lp, 0), np.minimum(lq, 0), 400, {"old_logprob": np.minimum(lo, 0)})
    s = D.diagnose(_write(tmp_path, df)).get("staleness")
    assert s.verdict == "clear"
    assert s.numbers["dominant"] == "staleness dominates"
    assert s.numbers["k3_lag"] > 10 * s.numbers["k3_engine"]


def test_staleness_cant_tell_without_old_logprob(tmp_path):
    df = _log(np.full(400, -0.1), np.full(400, -0.12), 10)
    s = D.diagnose(_write(tmp_path, df)).get("staleness")
    assert s.verdict == "can't tell"
    assert "old_logprob" in s.evidence


# ----------------------------------------------------------------------------- position


@pytest.mark.parametrize("p0", [96, 300])
def test_changepoint_within_2(tmp_path, p0):
    rng = np.random.default_rng(6)
    seqs, length = 200, 600
    n = seqs * length
    pos = np.tile(np.arange(length), seqs)
    lq = -rng.exponential(0.3, n)
    noise = np.where(pos >= p0, 0.05, 0.01)
    lp = np.minimum(lq + rng.normal(0, 1, n) * noise, 0)
    res = D.diagnose(_write(tmp_path, _log(lp, lq, seqs)))
    p = res.get("position")
    assert p.verdict == "found"
    assert abs(p.numbers["changepoint_position"] - p0) <= 2
    assert p.numbers["changepoint_ci_low"] > 1


def test_first_token(tmp_path):
    rng = np.random.default_rng(7)
    seqs, length = 300, 40
    n = seqs * length
    pos = np.tile(np.arange(length), seqs)
    lq = -rng.exponential(0.3, n)
    lp = np.minimum(lq + rng.normal(0, 1, n) * np.where(pos == 0, 0.2, 0.01), 0)
    df = _log(lp, lq, seqs).drop("position")  # the index among the sequence's tokens
    p = D.diagnose(_write(tmp_path, df)).get("position")
    assert p.verdict == "found"
    assert p.numbers["first_token_ratio"] > 10
    assert p.numbers["first_tokens"] == seqs


# ----------------------------------------------------------------------------- placeholders


def test_placeholder_zero_on_last_token(tmp_path):
    rng = np.random.default_rng(8)
    seqs, length = 500, 30
    n = seqs * length
    lq = -rng.exponential(0.3, n)
    lp = np.minimum(lq + rng.normal(0, 0.01, n), 0.0)
    last = np.arange(length - 1, n, length)
    hit = last[rng.random(seqs) < 0.6]  # an appended EOS, engine log-prob filled with 0.0
    lp[hit] = -3.0
    lq[hit] = 0.0
    res = D.diagnose(_write(tmp_path, _log(lp, lq, seqs)))
    p = res.get("placeholders")
    assert p.verdict == "found"
    assert p.numbers["zero_inference"] == hit.size
    assert p.numbers["zero_inference_last"] == hit.size
    assert f"on the last token of {hit.size:,} sequences" in p.evidence
    assert "appended stop token" in p.evidence


def test_placeholder_sentinels_and_frequent_value(tmp_path):
    rng = np.random.default_rng(9)
    seqs, length = 200, 50
    n = seqs * length
    lq = -rng.exponential(0.3, n)
    lp = np.minimum(lq + rng.normal(0, 0.01, n), 0.0)
    sent = rng.choice(n, 17, replace=False)
    lq[sent] = -1e9
    freq = rng.choice(np.setdiff1d(np.arange(n), sent), 300, replace=False)  # 3%
    lp[freq] = -9.999
    p = D.diagnose(_write(tmp_path, _log(lp, lq, seqs))).get("placeholders")
    assert p.verdict == "found"
    assert p.numbers["sentinel_inference"] == 17
    assert p.numbers["value_trainer"] == -9.999
    assert p.numbers["value_trainer_tokens"] == 300


def test_placeholder_infinite_rows_counted_not_refused(tmp_path):
    lq = np.full(1000, -0.2)
    lq[[5, 50]] = -np.inf
    df = _log(np.full(1000, -0.21), lq, 10)
    p = D.diagnose(_write(tmp_path, df)).get("placeholders")
    assert p.verdict == "found"
    assert p.numbers["invalid_inference"] == 2


# ----------------------------------------------------------------------------- noise floor


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to the nearest bf16 (ties to even) as float64."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def test_noise_floor_bf16_grid_and_settings_below(tmp_path):
    rng = np.random.default_rng(10)
    n = 40000
    x = -rng.exponential(0.2, n)
    lq, lp = _bf16(x), _bf16(x + rng.normal(0, 0.003, n))
    lp = np.minimum(lp, 0.0)
    df = _log(lp, lq, 400)
    res = D.diagnose(_write(tmp_path, df), settings=["ipo:eps=0.0001", "ipo:eps=0.3"])
    f = res.get("noise_floor")
    assert f.numbers["inference_bf16"] == 1.0 and f.numbers["trainer_bf16"] == 1.0
    assert "bf16 grid" in f.evidence
    conf = (lp > math.log(0.9)) & (lq > math.log(0.9))
    p90 = np.quantile(np.abs(lp - lq)[conf], 0.9)
    assert f.numbers["p90"] == pytest.approx(p90, rel=0.02)
    assert f.verdict == "found"
    assert f.numbers["below_floor"] == 1
    assert "ipo:eps=0.0001" in f.evidence and "masks rounding noise" in f.evidence
    only_high = D.diagnose(_write(tmp_path, df), settings=["ipo:eps=0.3"]).get("noise_floor")
    assert only_high.verdict == "clear"


def test_rule_threshold_l_ipo():
    # IPO masks |p - q| > eps: at q = 0.95 that is |l| ~ eps / q for small eps
    from mismatch_replay.rules import parse_rule

    t = D.rule_threshold_l(parse_rule("ipo:eps=0.01"), 0.95)
    assert t == pytest.approx(math.log(0.96 / 0.95), rel=0.01)


# ----------------------------------------------------------------------------- alignment


def test_alignment_shift_found(tmp_path):
    rng = np.random.default_rng(11)
    seqs, length = 200, 50
    n = seqs * length
    lq = -rng.exponential(1.0, n)
    lp = np.minimum(lq + rng.normal(0, 0.01, n), 0)
    lp_shift = np.roll(lp.reshape(seqs, length), 1, axis=1).ravel()  # trainer one behind
    a = D.diagnose(_write(tmp_path, _log(lp_shift, lq, seqs))).get("alignment")
    assert a.verdict == "found"
    assert a.numbers["shift"] != 0
    ok = D.diagnose(_write(tmp_path, _log(lp, lq, seqs), "ok.parquet")).get("alignment")
    assert ok.verdict == "clear"


# ----------------------------------------------------------------------------- no false alarms


@pytest.mark.parametrize("path", [SAMPLE, GOLDEN], ids=["sample", "golden"])
def test_no_false_alarm(path):
    res = D.diagnose(path, settings=["ipo:eps=0.3", "icepop@prime-rl"])
    assert [d.key for d in res.findings] == list(D.FINDINGS)
    assert res.found == [], [(d.key, d.evidence) for d in res.found]


# ----------------------------------------------------------------------------- streamed stats


@st.composite
def _tables(draw):
    seqs = draw(st.integers(1, 12))
    lens = draw(st.lists(st.integers(1, 40), min_size=seqs, max_size=seqs))
    n = sum(lens)
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    big = draw(st.booleans())
    start = rng.integers(0, 9000 if big else 50, seqs)
    pos = np.concatenate([s + np.arange(k) for s, k in zip(start, lens, strict=True)])
    lq = -rng.exponential(1.0, n)
    lp = np.minimum(lq + rng.normal(0, draw(st.sampled_from([0.01, 0.5])), n), 0)
    sid = np.repeat(np.arange(seqs), lens)
    df = pl.DataFrame(
        {
            "step": sid % 3,
            "sample_id": sid,
            "position": pos,
            "trainer_logprob": lp,
            "inference_logprob": lq,
        }
    )
    cut = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return df, cut


@settings(max_examples=40, deadline=None)
@given(_tables())
def test_streamed_stats_equal_brute_force(kernel_backend, case):
    df, cut = case
    stats = D.DiagnoseStats(tuple(df.columns))
    for a, b in zip([0, *cut], [*cut, df.height], strict=True):
        stats.add(df[a:b])
    lp, lq = df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy()
    el = lp - lq
    # by position bin: counts, mean |l|, k3
    pos = df["position"].to_numpy()
    b = np.where(pos < D.EXACT_POS, pos, D.EXACT_POS + np.floor(np.log2(np.maximum(pos, 1))) - 12)
    t = D.position_table(stats)
    for row in t.iter_rows(named=True):
        start = row["position"]
        sel = (b == start) if start < D.EXACT_POS else (b == D.EXACT_POS + math.log2(start) - 12)
        assert row["tokens"] == int(sel.sum())
        assert row["mean_abs_l"] == pytest.approx(np.abs(el[sel]).mean(), rel=1e-9, abs=1e-15)
        assert row["kl_k3"] == pytest.approx(
            (np.expm1(el[sel]) - el[sel]).mean(), rel=1e-9, abs=1e-15
        )
    assert t["tokens"].sum() == df.height
    # truncation's mean ratio and temperature's slope over the whole table
    assert stats.mom[1] / stats.mom[0] == pytest.approx(np.exp(np.clip(el, -20, 20)).mean())
    if df.height > 2 and np.ptp(lq) > 1e-6:
        x = lq - lq.mean()
        slope = (x * (el - el.mean())).sum() / (x * x).sum()
        got = D.temperature(stats).numbers["slope"]
        assert got == pytest.approx(slope, rel=1e-6, abs=1e-9)
    # first token of each sequence (index 0 among its loss tokens)
    first = np.r_[True, df["sample_id"].to_numpy()[1:] != df["sample_id"].to_numpy()[:-1]]
    assert stats.first[0] == first.sum()
    assert stats.first[1] == pytest.approx(np.abs(el[first]).sum(), rel=1e-9, abs=1e-15)
    # the bootstrap: replicate b weighs sequence g by poisson_weights(key_g)[b]
    keys = stats.runs(df, df["step"].to_numpy())[1]
    starts = stats.runs(df, df["step"].to_numpy())[0]
    w = D.poisson_weights(keys)
    per = np.add.reduceat(np.exp(np.clip(el, -20, 20)), starts)
    assert np.allclose(stats.boot[:, 1], w.T @ per, rtol=1e-9)


def test_poisson_weights_mean_and_variance():
    w = D.poisson_weights(np.arange(20000, dtype=np.uint64), 50)
    assert w.mean() == pytest.approx(1.0, abs=0.01)
    assert w.var() == pytest.approx(1.0, abs=0.02)
    assert np.array_equal(w, D.poisson_weights(np.arange(20000, dtype=np.uint64), 50))


# ----------------------------------------------------------------------------- result, CLI


def test_result_table_json_and_text(tmp_path):
    res = D.diagnose(GOLDEN)
    assert res.table.columns == ["finding", "verdict", "evidence", "what_to_do"]
    assert res.table.height == 7
    d = res.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["schema_version"] == 1
    assert {f["verdict"] for f in d["findings"]} <= set(D.VERDICTS)
    assert "diagnose:" in str(res)


def test_cli_json_exit_0(tmp_path, capsys):
    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    rng = np.random.default_rng(12)
    df, _ = _top_p_log(rng, 0.8, seqs=200)
    p = _write(tmp_path, df)
    r = CliRunner().invoke(app, ["diagnose", str(p), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert next(f for f in doc["findings"] if f["finding"] == "truncation")["verdict"] == "found"
    r = CliRunner().invoke(app, ["diagnose", str(p), "--map", "kept_mass=kept_mass", "--json"])
    doc = json.loads(r.stdout)
    assert next(f for f in doc["findings"] if f["finding"] == "truncation")["verdict"] == "clear"


# ----------------------------------------------------------------------------- simulator


def _simulate(tmp_path: Path, name: str, **kw) -> Path:
    pytest.importorskip("torch")
    from mismatch_replay.simulate import SimConfig, simulate

    cfg = {"scenario": "healthy", "steps": 4, "batch": 32, "seq_len": 40, **kw}
    path = tmp_path / f"{name}.parquet"
    simulate(SimConfig(**cfg), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("how", [{"top_p": 0.8}, {"top_k": 4}], ids=["top_p", "top_k"])
def test_simulated_truncation(tmp_path, how):
    # lag 0: with a lag the corrected mean is sum_kept p / sum_kept q < 1 (the kept set is
    # q's likeliest tokens), 0.995-0.998 at lag 4 (measured)
    path = _simulate(tmp_path, "trunc", staleness=0, **how)
    kept = pl.read_parquet(path).filter(pl.col("loss_mask"))["kept_mass"].mean()
    res = D.diagnose(path)
    t = res.get("truncation")
    assert t.verdict == "found"
    assert abs(t.numbers["kept_mass"] - kept) < 0.01
    assert [d.key for d in res.found] == ["truncation"]
    fixed = D.diagnose(path, options=ReadOptions(mapping={"kept_mass": "kept_mass"}))
    f = fixed.get("truncation")
    assert f.verdict == "clear"
    # E_q'[p/q] = sum_kept p / sum_kept q: 1 to the kept mass's own mismatch (1e-4 here)
    assert f.numbers["ci_low"] - 1e-3 <= 1.0 <= f.numbers["ci_high"] + 1e-3
    assert fixed.found == [], [(d.key, d.evidence) for d in fixed.found]


@pytest.mark.slow
def test_simulated_temperature(tmp_path):
    path = _simulate(tmp_path, "temp", temperature=0.7)
    t = D.diagnose(path).get("temperature")
    assert t.verdict == "found"
    assert abs(t.numbers["temperature_ratio"] - 0.7) < 0.05


@pytest.mark.slow
def test_simulated_kv_fp8_changepoint(tmp_path):
    # engine noise alone (lag 0), from position 96 on, over 150 response tokens
    path = _simulate(tmp_path, "kv", staleness=0, steps=3, batch=8, seq_len=130, kv_fp8_from=96)
    p = D.diagnose(path).get("position")
    assert p.verdict == "found"
    assert abs(p.numbers["changepoint_position"] - 96) <= 2


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["healthy", "stale", "drift"])
def test_simulated_scenarios_no_false_alarm(tmp_path, scenario):
    path = _simulate(tmp_path, scenario, scenario=scenario, steps=6, batch=48)
    res = D.diagnose(path, settings=["ipo:eps=0.3", "icepop@prime-rl"])
    assert res.found == [], [(d.key, d.evidence) for d in res.found]


def test_findings_sentence_from_diagnosis(tmp_path):
    """The report's and demo's "What this log says" quotes diagnose's causes with their
    numbers (analysis.findings.diagnosed)."""
    from mismatch_replay.analysis.findings import Context, diagnosed

    rng = np.random.default_rng(13)
    df, _ = _top_p_log(rng, 0.8, seqs=200)
    res = D.diagnose(_write(tmp_path, df), settings=["ipo:eps=0.00001"])
    assert {d.key for d in res.found} >= {"truncation", "noise_floor"}
    f = diagnosed(Context(None, None, diagnosis=res))
    t = res.get("truncation").numbers["mean_ratio"]
    assert f.value("truncation.mean_ratio") == t
    assert f"mean p/q {t:.4g}" in f.sentence
    assert f.value("diagnose.found") == len(res.found)
    assert f.sentence.startswith(f"Diagnose found {len(res.found)} of 7 causes")
    clear = diagnosed(Context(None, None, diagnosis=D.diagnose(GOLDEN)))
    want = "Diagnose found none of its 7 causes (staleness vs engine: can't tell)."
    assert clear.sentence == want


# ----------------------------------------------------------------------------- sweep --by


@pytest.mark.parametrize("by", ["lag", "position"])
def test_sweep_by_lag_and_position(tmp_path, by):
    import mismatch_replay as mr

    rng = np.random.default_rng(14)
    seqs, length = 60, 70
    n = seqs * length
    lq = -rng.exponential(0.5, n)
    lp = np.minimum(lq + rng.normal(0, 0.2, n), 0)
    df = _log(lp, lq, seqs, {"versions": np.repeat(np.arange(seqs) % 4, length)})
    df = df.with_columns(pl.col("step") * 4)  # steps 0, 4, 8, 12: lags step - version
    res = mr.sweep(_write(tmp_path, df), rules=["ipo:eps=0.3"], by=by)
    t = res.table.filter(pl.col("rule") == "ipo")
    masked = np.abs(np.exp(lp) - np.exp(lq)) > 0.3
    if by == "lag":
        key = df["step"].to_numpy() - df["versions"].to_numpy()
    else:
        pos = df["position"].to_numpy()
        key = np.where(pos > 0, 2 ** np.floor(np.log2(np.maximum(pos, 1))).astype(int), 0)
    want = {int(k): (int((key == k).sum()), int(masked[key == k].sum())) for k in np.unique(key)}
    got = {r[by]: (r["tokens"], r["masked_tokens"]) for r in t.iter_rows(named=True)}
    assert got == want
    assert t["sequences"].null_count() == t.height  # a sequence spans groups


def test_sweep_by_lag_needs_a_version_column(tmp_path):
    import mismatch_replay as mr
    from mismatch_replay.errors import DataError

    df = _log(np.full(40, -0.1), np.full(40, -0.12), 4)
    with pytest.raises(DataError, match="--by lag needs a version column"):
        mr.sweep(_write(tmp_path, df), rules=["ipo:eps=0.3"], by="lag")
