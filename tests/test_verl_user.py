"""Issue 36, a verl user's first hour: every preset alone and in pairs through choose,
compare and the report's data; verl's column names; --emit for a rejection-only question;
check --per-step's violating steps; compare --budget's side; the tables' preset names.

The golden log (tests/data) holds 19,598 loss tokens in 8 steps, with sequences and
advantages, so every rule of the catalogue applies.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_replay import analysis
from mismatch_replay.cli import app
from mismatch_replay.cli.render import budget_side, given_label
from mismatch_replay.errors import UsageError
from mismatch_replay.integrations import config_in, config_out
from mismatch_replay.rules import REGISTRY, parse_rule

DATA = Path(__file__).parent / "data"
GOLDEN = str(DATA / "golden_log.parquet")
CONFIGS = Path(__file__).parent / "configs"
PRESETS = [f"{n}@{p}" for n, cls in REGISTRY.items() for p in cls.presets]
MASKS = [s for s in PRESETS if parse_rule(s).kind == "mask" and parse_rule(s).level != "step"]


def _golden_l() -> np.ndarray:
    d = pl.read_parquet(GOLDEN).filter(pl.col("loss_mask"))
    return (d["trainer_logprob"] - d["inference_logprob"]).to_numpy()


def _needs_two(spec: str) -> bool:
    """A preset that leaves two or more parameters unset (SkyRL's token-mis: the user sets
    both bounds): choose cannot sweep one side with the other unknown."""
    return sum(v is None for v in parse_rule(spec).values().values()) >= 2


def _filled(spec: str) -> str:
    """A preset SPEC with each parameter it leaves unset (token-k3@verl's hi) at the middle
    of that parameter's default grid: a setting compare and the report can replay."""
    from mismatch_replay.rules.spec import parse_grid

    rule = parse_rule(spec)
    unset = [k for k, v in rule.values().items() if v is None]
    if not unset:
        return spec
    vals = {k: float(np.median(parse_grid(rule.param(k).grid))) for k in unset}
    return rule.replace(**vals).spec()


def test_every_preset_has_a_spec():
    assert len(PRESETS) >= 40 and "token-k3@verl" in PRESETS and "token-mis@verl-k1" in PRESETS


@pytest.mark.parametrize("spec", PRESETS)
def test_choose_each_preset_alone(spec):
    """The crash of issue 36 (KeyError 'bits': a tail that kept no token) for
    token-k3@verl, token-k2@verl, token-mis@verl-k1 alone; every preset alone answers."""
    if _needs_two(spec):  # a preset that leaves both bounds to the user: a clear refusal
        with pytest.raises(UsageError, match="has no default for"):
            analysis.choose([GOLDEN], 0.005, [spec], bootstrap=20)
        return
    rows = analysis.choose([GOLDEN], 0.005, [spec], bootstrap=20)
    assert len(rows) >= 1
    for r in rows:
        assert r.status in ("ok", "ties", "out of range", "not converged"), r
        if r.status == "ok":
            assert math.isclose(r.masked_fraction, 0.005, rel_tol=0.02), r


def test_choose_token_k3_alone_is_exact():
    """token-k3@verl alone, against numpy: k3 = r - 1 - l with l clamped to +-20."""
    (row,) = analysis.choose([GOLDEN], 0.005, ["token-k3@verl"], bootstrap=20)
    lr = np.clip(_golden_l(), -20, 20)
    k3 = np.exp(lr) - 1 - lr
    assert int((k3 > row.value).sum()) == row.masked_tokens
    assert row.ci_low is not None and row.ci_low <= row.value <= row.ci_high


def test_choose_preset_pairs():
    """Consecutive pairs covering every preset: each rule answers as it does alone (the
    same threshold: the answer does not depend on the other rule)."""
    alone = {}
    ok = [s for s in PRESETS if not _needs_two(s)]
    for a, b in zip(ok[::2], ok[1::2] + ok[:1], strict=False):
        rows = analysis.choose([GOLDEN], 0.005, [a, b], bootstrap=0)
        for r in rows:
            alone.setdefault(r.spec.partition(":")[0] + r.param, set()).add(round(r.value, 12))
    assert alone and all(len(v) == 1 for v in alone.values()), alone


def test_compare_preset_pairs():
    """Consecutive pairs of the mask presets through compare: the four cells add up."""
    specs = [_filled(s) for s in MASKS]
    for a, b in zip(specs, specs[1:] + specs[:1], strict=True):
        res = analysis.compare([GOLDEN], a, b)
        assert res.both + res.only_a + res.only_b + res.neither == res.tokens == 19598


def test_compare_refuses_weight_presets_with_a_sentence():
    with pytest.raises(UsageError, match="truncates weights"):
        analysis.compare([GOLDEN], "tis@verl", "token-mis@verl")


@pytest.mark.slow
@pytest.mark.parametrize("spec", PRESETS)
def test_report_data_each_preset_alone(spec):
    if _needs_two(spec):
        with pytest.raises(UsageError, match="has no default for"):
            analysis.report_data([GOLDEN], [spec], 0.005, bootstrap=0)
        return
    data, dec = analysis.report_data([GOLDEN], [spec], 0.005, bootstrap=0)
    want = parse_rule(spec).spec()
    assert dec.given and len(data.settings) == 1
    got = data.settings[0].spec()
    # a preset with no default threshold (token-k3@verl) is shown at choose's value
    assert got == want or (
        got.startswith(want + ":") and any(f"{want} has no default" in n for n in data.notes)
    )
    assert {c.spec.partition(":")[0] for c in dec.choose} <= {
        parse_rule(spec).spec().partition(":")[0]
    }
    assert dec.compare is None and "two rules" in dec.compare_note


@pytest.mark.slow
def test_report_data_preset_pairs():
    ok = [s for s in MASKS if not _needs_two(s)]
    for a, b in zip(ok[::3], ok[1::3], strict=False):
        _, dec = analysis.report_data([GOLDEN], [a, b], 0.005, bootstrap=0)
        heads = tuple(parse_rule(x).spec().partition(":")[0] for x in (a, b))
        assert tuple(x.partition(":")[0] for x in dec.pair) == heads
        assert dec.compare.rule_a.partition(":")[0] == heads[0]
        assert dec.compare_budget is not None and set(dec.compare_budget.settings) == {"a", "b"}


# ----------------------------------------------------------------------------- verl names


@pytest.fixture(scope="module")
def verl_log(tmp_path_factory) -> str:
    """The golden log with verl's column names, one Parquet file a step."""
    out = tmp_path_factory.mktemp("verl")
    d = pl.read_parquet(GOLDEN).rename(
        {
            "trainer_logprob": "old_log_probs",
            "inference_logprob": "rollout_log_probs",
            "loss_mask": "response_mask",
            "advantage": "advantages",
            "step": "global_step",
        }
    )
    for (s,), g in d.group_by(["global_step"], maintain_order=True):
        g.write_parquet(out / f"step_{s}.parquet")
    return str(out / "*.parquet")


def test_verl_old_log_probs_is_the_trainer_logprob(verl_log):
    from mismatch_replay.analysis.inspect import inspect_log

    s = inspect_log([verl_log])
    assert s.source["trainer_logprob"] == "old_log_probs"
    assert "old_logprob" not in s.source
    assert s.loss_tokens == 19598
    res = CliRunner().invoke(app, ["inspect", verl_log], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "trainer_logprob <- old_log_probs" in res.output
    assert "the one trainer-side column" in " ".join(res.output.split())


def test_two_trainer_side_candidates_are_refused(tmp_path):
    d = pl.read_parquet(GOLDEN).rename(
        {"trainer_logprob": "old_log_probs", "inference_logprob": "rollout_log_probs"}
    )
    d = d.with_columns(old_logprobs=pl.col("old_log_probs"))
    d.write_parquet(tmp_path / "two.parquet")
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "two.parquet")])
    assert res.exit_code == 1 and "trainer_logprob" in res.output


@pytest.mark.slow
def test_report_data_from_verl_config_follows_its_rules(verl_log):
    cfg = config_in.read_config(CONFIGS / "verl.yaml")
    data, dec = analysis.report_data([verl_log], cfg.specs(), 0.005, bootstrap=0)
    names = {c.spec.partition(":")[0] for c in dec.choose}
    assert names == {"tis@verl", "token-mis@verl-k1", "seq-max-k2@verl"}
    assert dec.pair == (
        "token-mis@verl-k1:low=0.625,high=1.6666666666666667",
        "seq-max-k2@verl:hi=2.5",
    )
    assert not any("ipo" in c.spec or "kpop" in c.spec for c in dec.choose)
    from mismatch_replay.viz.render import panel_rules, scatter_kwargs

    kw = scatter_kwargs(data)
    assert kw["ipo_eps"] == () and kw["icepop"] == ()
    assert [r.spec() for r in kw["extra"]] == [cfg.specs()[1]]  # token-MIS's cone alone
    assert set(data.by_length["rule"].unique()) == {"token-mis", "seq-max-k2"}
    assert panel_rules(data.settings, data.given) == ["seq-max-k2", "tis", "token-mis"]
    from mismatch_replay.viz import report as page

    assert "rules given" in page._caption("scatter", data)  # not "the IPO band"
    assert "IPO" not in page._caption("scatter", data)
    html = page.decision_html(dec)
    assert "IPO and IcePop" not in html and "token-mis@verl-k1 and seq-max-k2@verl" in html
    assert "its upper bound" in html and "<td>seq-max-k2@verl</td>" in html
    # the presets table: exact counts (seq-MIS verl from the replay equals a sweep's)
    got = data.presets["seq-mis:low=0.5,high=2"]
    want = analysis.choose([verl_log], None, ["seq-mis:low=0.5,high=2"], bootstrap=0)[0]
    assert got == want.masked_fraction


# ----------------------------------------------------------------------------- --emit


def test_emit_a_rejection_question_leaves_the_is_threshold_alone():
    cfg = config_in.read_config(CONFIGS / "verl.yaml")
    rows = analysis.choose([GOLDEN], 0.005, ["token-mis@verl-k1"], bootstrap=50)
    text = config_out.emit("verl", rows, base=cfg)
    assert "rollout_is" not in text  # neither rollout_is nor rollout_is_threshold
    assert text.count("rollout_rs_threshold=") == len(rows) == 2
    for r in rows:  # the written threshold lies in its interval, and is short
        assert r.ci_low <= r.value <= r.ci_high
    back = config_in.read_text(text.split("\n\n")[0], "verl", "hydra")
    (tm,) = [c.rule for c in back.rules if c.rule.name == "token-mis"]
    assert rows[0].ci_low <= tm.low <= rows[0].ci_high
    assert len(f"{1 / tm.low:.17g}".rstrip("0")) > len("1.057") and "'0.6_1.05" in text
    # the TIS block of a config's own question carries no k1 note
    trows = analysis.choose([GOLDEN], 0.005, ["tis@verl"], bootstrap=50)
    ttext = config_out.emit("verl", trows, base=cfg)
    assert "k1" not in ttext and "rollout_rs" not in ttext
    assert "rollout_is_threshold=1.05\n" in ttext + "\n"


def test_rounded_value_is_the_shortest_inside_the_interval():
    row = {
        "spec": "tis:cap=1.0495847307869384",
        "param": "cap",
        "value": 1.0495847307869384,
        "ci_low": 1.048,
        "ci_high": 1.051,
        "target_fraction": 0.005,
        "kind": "weight",
    }
    text = config_out.emit("verl", [row])
    assert "rollout_is_threshold=1.05" in text and "1.0495" not in text.split("#   rule")[1]


def test_emit_names_what_it_cannot_and_writes_the_rest():
    text = config_out.emit("verl", ["ipo:eps=0.2", "token-k3@verl:hi=0.002"])
    assert "not written: verl has no setting that replays rule 'ipo'" in text
    assert "rollout_rs=token_k3" in text
    with pytest.raises(UsageError, match="no setting that replays rule 'kpop'"):
        config_out.emit("verl", ["kpop:phi=0.1"])


def test_cli_choose_rejection_only_config(tmp_path):
    """A verl config that sets only rollout_rs: choose alone, then --emit."""
    cfg = tmp_path / "rs.yaml"
    cfg.write_text(
        "algorithm:\n  rollout_correction:\n    rollout_rs: token_k3\n"
        "    rollout_rs_threshold: 0.01\n"
    )
    res = CliRunner().invoke(
        app, ["choose", GOLDEN, "--from-config", str(cfg), "-t", "0.005", "--emit", "verl"]
    )
    assert res.exit_code == 0, res.output
    assert "rollout_rs=token_k3" in res.stdout and "rollout_is" not in res.stdout


# ----------------------------------------------------------------------------- tables


def test_given_label():
    assert given_label("token-mis@verl:low=0.5,high=5", "low") == "token-mis@verl"
    assert given_label("icepop@verl:low=0.3,high=5") == "icepop@verl [low=0.3]"
    assert given_label("icepop:low=0.2,high=5", "low") == "icepop [high=5]"
    k1 = "token-mis@verl-k1:low=0.625,high=1.6666666666666667"
    assert given_label(k1, "low") == "token-mis@verl-k1"
    assert budget_side("high") == "its upper bound" and budget_side("low") == "its lower bound"


def test_tables_print_the_spec_given():
    r = CliRunner()
    env = {"COLUMNS": "160"}
    out = r.invoke(app, ["sweep", GOLDEN, "-r", "token-mis@verl", "-r", "icepop@verl"], env=env)
    assert "token-mis@verl " in out.stdout and "icepop@verl " in out.stdout
    out = r.invoke(
        app, ["choose", GOLDEN, "-r", "token-mis@verl", "-t", "0.005", "--bootstrap", "0"], env=env
    )
    assert out.stdout.count("token-mis@verl ") == 2
    out = r.invoke(
        app, ["compare", GOLDEN, "-r", "ipo", "-r", "icepop@prime-rl", "--budget", "0.005"], env=env
    )
    flat = " ".join(out.stdout.split())
    assert "B = icepop@prime-rl with its upper bound high moved to 1.051 (low=0.2 kept)" in flat
    out = r.invoke(
        app, ["drift", GOLDEN, "-r", "token-mis@verl", "-r", "icepop@verl:low=0.3"], env=env
    )
    flat = " ".join((out.stdout + out.stderr).split())
    assert "token-mis@verl: no drift" in flat and "icepop@verl [low=0.3]: no drift" in flat


def test_check_per_step_json_lists_every_violating_step():
    res = CliRunner().invoke(
        app,
        [
            "check",
            GOLDEN,
            "--max",
            "kl_k3=0.001",
            "-r",
            "ipo:eps=0.05",
            "--max-masked",
            "0.004",
            "--per-step",
            "--json",
        ],
    )
    assert res.exit_code == 3
    doc = json.loads(res.stdout)
    d = pl.read_parquet(GOLDEN).filter(pl.col("loss_mask"))
    lr = (d["trainer_logprob"] - d["inference_logprob"]).to_numpy()
    k3 = pl.Series(np.exp(lr) - 1 - lr)
    per = d.with_columns(k3=k3).group_by("step").agg(pl.col("k3").mean()).sort("step")
    want = [(int(s), v) for s, v in zip(per["step"], per["k3"], strict=True) if v > 0.001]
    got = doc["verdicts"][0]["violating_steps"]
    assert [g["step"] for g in got] == [s for s, _ in want]
    assert all(
        math.isclose(g["value"], v, rel_tol=1e-9) for g, (_, v) in zip(got, want, strict=True)
    )
    assert doc["verdicts"][1]["violating_steps"]  # the rule's too


# ----------------------------------------------------------------------------- figures


@pytest.fixture(scope="module")
def golden_sweep() -> pl.DataFrame:
    import mismatch_replay as mr

    return mr.sweep([GOLDEN]).table


def test_masked_fraction_draws_only_the_rules_given(golden_sweep):
    from mismatch_replay.viz.curves import masked_fraction

    fig = masked_fraction(golden_sweep, rules=["tis", "token-mis", "seq-max-k2"])
    shown = [a for a in fig.axes if a.axison and a.get_title()]
    assert len(shown) == 2  # token ratio bounds (token-MIS, TIS) and sequence divergence
    drawn = {
        ln.get_gid().split("|")[1]
        for a in shown
        for ln in a.lines
        if (ln.get_gid() or "").startswith("sweep|")
    }
    assert drawn == {"tis", "token-mis", "seq-max-k2"}
    note = fig.get_supxlabel()
    width = max(60, int(fig.get_figwidth() * 14))
    assert note and all(len(line) <= width for line in note.splitlines())  # not cut


@pytest.mark.slow
def test_preset_labels_are_whole(golden_sweep):
    from mismatch_replay.viz.curves import masked_fraction

    fig = masked_fraction(golden_sweep)
    texts = [t.get_text() for a in fig.axes for t in a.texts]
    assert not any("…" in t for t in texts)
    assert any("verl, areal, paper" in t for t in texts)  # IcePop's three presets named


def test_interval_does_not_depend_on_the_other_rules():
    """token-mis@verl-k1's interval alone (a pass: its tail keeps nothing) and beside IcePop
    (counted from IcePop's kept tokens, on columns over a range where the fraction is flat
    far from the answer) agree to a fraction of the interval's width: at 25 columns the
    tail's 2.5% end was 0.9386 for the pass's 0.9441."""
    got = {}
    for rules in (["token-mis@verl-k1"], ["token-mis@verl-k1", "icepop"]):
        rows = analysis.choose([GOLDEN], 0.005, rules, bootstrap=200, precision="float64")
        (r,) = [x for x in rows if x.rule == "token-mis" and x.param == "low"]
        got[len(rules)] = (r.ci_low, r.ci_high)
    (a_lo, a_hi), (b_lo, b_hi) = got[1], got[2]
    width = a_hi - a_lo
    assert width > 0
    assert abs(a_lo - b_lo) < 0.25 * width and abs(a_hi - b_hi) < 0.25 * width, got
