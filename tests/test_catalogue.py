"""The catalogue as users see it: docs/rules.md agreement, presets, quirk warnings, prime-rl
matching."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from mismatch_replay import engine
from mismatch_replay.rules import (
    REGISTRY,
    catalogue_markdown,
    catalogue_records,
    parse_rule,
    presets_markdown,
)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden_log.parquet"
RULES_MD_NAMES = [
    "ipo",
    "ipo-v1",
    "icepop",
    "kpop",
    "token-mis",
    "token-k2",
    "token-k3",
    "m2po",
    "dppo-tv",
    "dppo-kl",
    "ppo-clip",
    "dual-clip",
    "tis",
    "cispo",
    "seq-tis",
    "seq-mis",
    "geo-mis",
    "seq-mean-k3",
    "seq-max-k2",
    "veto",
    "opsm",
    "gspo",
    "prob-error",
]


def test_catalogue_has_every_rule_of_rules_md():
    assert sorted(REGISTRY) == sorted(RULES_MD_NAMES)


def test_docs_catalogue_table_matches_the_code():
    text = (ROOT / "docs" / "rules.md").read_text()
    start = text.index("<!-- catalogue:start -->") + len("<!-- catalogue:start -->")
    end = text.index("<!-- catalogue:end -->")
    assert text[start:end].strip() == catalogue_markdown().strip()


def test_docs_preset_table_matches_the_code():
    text = (ROOT / "docs" / "rules.md").read_text()
    start = text.index("<!-- presets:start -->") + len("<!-- presets:start -->")
    end = text.index("<!-- presets:end -->")
    assert text[start:end].strip() == presets_markdown().strip()


def test_every_arithmetic_preset_names_its_source_and_round_trips():
    for rec in catalogue_records():
        for preset, arith in rec["preset_arith"].items():
            assert "@" in rec["preset_sources"][preset], (rec["name"], preset)
            rule = parse_rule(f"{rec['name']}@{preset}")
            assert rule.arith == arith and rule.preset == preset
            assert parse_rule(rule.spec()) == rule  # SPECs carry the preset and exact values


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("ipo@prime-rl", {"eps": 0.3}),
        ("ipo@prime-rl-legacy", {"eps": 0.1}),
        ("icepop@prime-rl", {"low": 0.2, "high": 5.0}),
        ("icepop@verl", {"low": 0.5, "high": 5.0}),
        ("icepop@areal", {"low": 0.5, "high": 5.0}),
        ("token-mis@trl", {"low": 0.5, "high": 2.0}),
        ("kpop@areal", {"phi": 2.0, "clamp": 1e-8}),
        ("kpop@prime-rl", {"phi": 0.1, "clamp": 1e-6}),
        ("dppo-tv@verl", {"low": 0.15, "high": 0.15}),
        ("ppo-clip@dapo", {"eps_low": 0.2, "eps_high": 0.28}),
        ("tis@trl", {"cap": 3.0}),
        ("seq-tis@skyrl", {"cap": 5.0}),
        ("seq-mis@trl", {"low": 0.0, "high": 3.0}),
        ("geo-mis@skyrl", {"low": 0.99, "high": 1.01}),
        ("geo-mis@prime-rl-legacy", {"low": 0.1, "high": 10.0}),
        ("prob-error@nemo-rl", {"tau": 1.5}),
        ("opsm@trl", {"delta": 0.5}),
        ("cispo@prime-rl", {"low": 0.0, "high": 5.0}),
    ],
)
def test_presets_carry_rules_md_values(spec, expected):
    assert parse_rule(spec).values() | expected == parse_rule(spec).values()


def test_every_record_lists_params_defaults_presets_and_source():
    for rec in catalogue_records():
        assert rec["params"] and rec["source"] and rec["definition"]
        for preset in rec["presets"].values():
            assert set(preset) <= {p["name"] for p in rec["params"]}


def test_quirk_preset_warns_and_follows_the_code():
    res = engine.sweep([GOLDEN], rules=["token-mis@verl-k1", "token-mis@verl"])
    assert len(res.warnings) == 1 and "1/hi <= r <= 1/lo" in res.warnings[0]
    rule = parse_rule("token-mis@verl-k1")
    assert rule.low == pytest.approx(0.625) and rule.high == pytest.approx(1 / 0.6)


def test_ipo_motivating_examples():
    """A rare token 0.01 -> 0.06 is masked by IcePop, kept by IPO; 0.9 -> 0.2 the reverse."""
    from mismatch_replay.rules import TokenBatch

    def masked(spec, q, p):
        r = parse_rule(spec)
        b = TokenBatch(np.log([p]), np.log([q]))
        scores = [
            r.score(b, name)[0] > r.threshold(name, getattr(r, name))
            for name in (x.name for x in r.params if x.threshold)
        ]
        return any(scores)

    assert masked("icepop@prime-rl", 0.01, 0.06) and not masked("ipo@prime-rl", 0.01, 0.06)
    assert not masked("icepop@prime-rl", 0.90, 0.20) and masked("ipo@prime-rl", 0.90, 0.20)


def test_match_prime_rl_against_brute_force():
    specs = ["ipo@prime-rl", "icepop@prime-rl", "seq-mis@verl"]
    res = engine.sweep([GOLDEN], rules=specs, match="prime-rl")
    df = pl.read_parquet(GOLDEN).filter("loss_mask").filter(pl.col("advantage") != 0)
    lp, lq = df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy()
    p, q = np.exp(lp), np.exp(lq)
    seq_l = df.with_columns(l=pl.lit(lp - lq)).group_by("step", "sample_id").agg(pl.col("l").sum())
    masks = {
        "ipo": np.abs(p - q) > 0.3,
        "icepop": (lp - lq < np.log(0.2)) | (lp - lq > np.log(5.0)),
    }
    for row in res.table.iter_rows(named=True):
        assert row["tokens"] == df.height
        if row["rule"] in masks:
            m = df.with_columns(m=pl.Series(masks[row["rule"]]))
            per_seq = m.group_by("step", "sample_id").agg(pl.col("m").mean())
            assert row["masked_tokens"] == int(masks[row["rule"]].sum())
            assert row["is_masked_mean"] == pytest.approx(per_seq["m"].mean(), rel=1e-12)
        else:  # a sequence rule masks whole sequences: the mean equals the sequence fraction
            s = np.exp(seq_l["l"].to_numpy())
            frac = float(np.mean((s < 0.5) | (s > 2.0)))
            assert row["is_masked_mean"] == pytest.approx(frac, rel=1e-12)
    assert "zero-advantage" in res.notes[-1]


def test_match_needs_advantage(tmp_path):
    pl.DataFrame(
        {"trainer_logprob": [-0.1], "inference_logprob": [-0.2], "sample_id": [0]}
    ).write_parquet(tmp_path / "x.parquet")
    from mismatch_replay.errors import DataError

    with pytest.raises(DataError, match="advantage"):
        engine.sweep([tmp_path / "x.parquet"], rules=["ipo"], match="prime-rl")
