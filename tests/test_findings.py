"""analysis.findings: "What this log says", each sentence checked against its result objects.

Every number a sentence quotes is read again here from the result object it comes from
(drift's steps, the per-step settings table, compare's counts, choose's rows) and compared
with the Finding's value; the text the sentence shows must be that value rounded. The
property tests build drift results by hand (hypothesis) and check the trend and the verdict
words against an independent reading of the same numbers.
"""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_replay import analysis
from mismatch_replay.analysis.drift import Baseline, DriftResult, RuleVerdict, StepRow
from mismatch_replay.viz import report

fmod = importlib.import_module("mismatch_replay.analysis.findings")  # the module, not the function
GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"
OWN = ("icepop@verl", "token-mis@verl")  # what a verl config's specs look like


@pytest.fixture(scope="module")
def golden():
    got: dict = {}
    data, dec = analysis.report_data(
        [str(GOLDEN)], ["ipo@prime-rl", *OWN], 0.01, bootstrap=20, summary=got
    )
    return data, dec, got["summary"]


def shown(n: fmod.Number) -> float:
    """The value a number's text shows (a percentage as a fraction)."""
    t = n.text.replace(",", "")
    return float(t[:-1]) / 100 if t.endswith("%") else float(t)


def check_numbers(f: fmod.Finding) -> None:
    """Each number is shown in the sentence, rounded to 3 significant digits (counts and
    step numbers exactly)."""
    assert f.numbers, f.sentence
    for n in f.numbers:
        assert n.text in f.sentence
        if isinstance(n.value, int):
            assert shown(n) == n.value, (n, f.sentence)
        else:
            assert math.isclose(shown(n), n.value, rel_tol=5e-3, abs_tol=1e-300), n


def brute_headline() -> tuple[int, int]:
    """IPO |p - q| > 0.3 and IcePop r outside [0.2, 5] on the golden log's loss tokens,
    counted directly from the file."""
    t = pl.read_parquet(GOLDEN).filter(pl.col("loss_mask"))
    lp, lq = t["trainer_logprob"].to_numpy(), t["inference_logprob"].to_numpy()
    ipo = int((abs(np.exp(lp) - np.exp(lq)) > 0.3).sum())
    icepop = int(((lp - lq < math.log(0.2)) | (lp - lq > math.log(5))).sum())
    return ipo, icepop


def masked_tokens(data, spec: str) -> int:
    return int(data.steps.filter(pl.col("spec") == spec)["masked_tokens"].sum())


def test_findings_on_a_log_quote_its_results(golden):
    data, dec, summary = golden
    found = analysis.findings(
        data, dec, log_format=summary.format, config_framework="verl", own_specs=OWN
    )
    assert 3 <= len(found) <= 6
    keys = ["mismatch", "headline", "framework", "choose", "drift", "mask_cost"]
    assert [f.key for f in found] == keys
    for f in found:
        check_numbers(f)
    c = found.get("mask_cost")  # what IPO's mask costs: its row of the mask-cost table
    row = data.mask_cost.filter(pl.col("spec") == "ipo@prime-rl:eps=0.3").row(0, named=True)
    assert c.value("ipo.adv_mass_fraction") == row["masked_adv_mass_fraction"]
    m = found.get("mismatch")
    assert m.value("kl_k3") == data.metrics["kl_k3"]
    assert m.value("tokens") == data.tokens == 19_598
    steps = sorted(data.step_metrics["step"].to_list())
    assert m.value("step_first") == steps[0] and m.value("step_last") == steps[-1]
    by_step = dict(zip(*data.step_metrics.select("step", "kl_k3"), strict=True))
    assert m.value("kl_k3_first") == pytest.approx(by_step[steps[0]], rel=1e-12)
    assert m.value("kl_k3_last") == pytest.approx(by_step[steps[-1]], rel=1e-12)
    word = "rose" if by_step[steps[-1]] >= 2 * by_step[steps[0]] else None
    word = word or ("fell" if by_step[steps[-1]] <= 0.5 * by_step[steps[0]] else "level")
    assert word in m.sentence
    h = found.get("headline")
    ipo = masked_tokens(data, "ipo@prime-rl:eps=0.3")
    brute_ipo, brute_icepop = brute_headline()
    assert h.value("ipo.tokens") == ipo == brute_ipo  # the settings table and a brute force
    assert h.value("ipo.fraction") == ipo / data.tokens
    assert h.value("icepop.tokens") == brute_icepop
    assert (h.value("ipo.eps"), h.value("icepop.low"), h.value("icepop.high")) == (0.3, 0.2, 5)
    own = found.get("framework")
    assert "verl config" in own.sentence
    assert own.value("own0.tokens") == masked_tokens(data, "icepop@verl:low=0.5,high=5")
    c = found.get("choose")
    first = dec.choose[0]
    assert c.value("choose0.value") == first.value
    assert (c.value("choose0.ci_low"), c.value("choose0.ci_high")) == (first.ci_low, first.ci_high)
    assert c.value("target_fraction") == 0.01
    d = found.get("drift")
    assert dec.drift is not None and not dec.drift.flagged_steps
    assert d.sentence.startswith("No drift")
    assert d.value("baseline_k3_trimmed") == dec.drift.baseline.kl_k3_trimmed
    assert d.value("min_run") == dec.drift.min_run


def test_format_framework_and_none(golden):
    data, dec, _ = golden
    assert fmod.framework_of("prime-rl-traces") == ("prime-rl", "format")
    assert fmod.framework_of("parquet") == (None, None)
    assert fmod.framework_of("skyrl", "verl") == ("verl", "config")
    keys = [f.key for f in analysis.findings(data, dec, log_format="parquet")]
    assert "framework" not in keys  # nothing tells the framework: no sentence for it
    prime = analysis.findings(data, dec, log_format="prime-rl")
    assert "framework" not in [f.key for f in prime]  # prime-rl's presets are the headline
    assert "(this log's framework)" in prime.get("headline").sentence
    # a format's presets, where a result counts them exactly: icepop@verl is a setting here
    verl = analysis.findings(data, dec, config_framework="verl")
    fw = verl.get("framework")
    assert "verl's presets" in fw.sentence or "verl" in fw.sentence
    assert masked_tokens(data, "icepop@verl:low=0.5,high=5") in [
        n.value for n in fw.numbers if n.name.endswith(".tokens")
    ]


def test_a_finding_needs_its_numbers():
    with pytest.raises(ValueError, match="no number"):
        fmod.Finding("x", "The run looks fine.", ())
    with pytest.raises(ValueError, match="does not show"):
        fmod.Finding("x", "k3 is 0.01.", (fmod.Number("k3", 0.0123, "0.0123"),))
    f = fmod.Finding("x", "k3 is 0.0123.", (fmod.Number("k3", 0.0123, "0.0123"),))
    assert f.to_dict() == {"key": "x", "sentence": "k3 is 0.0123.", "numbers": {"k3": 0.0123}}


# ----------------------------------------------------------------------------- properties

k3s = st.floats(1e-7, 10.0, allow_nan=False)


def _drift(k3: list[float], flagged: list[int], verdicts: list[RuleVerdict]) -> DriftResult:
    rows = [StepRow(i, 100, v, v, v, v, 0.0) for i, v in enumerate(k3)]
    return DriftResult(3.0, 3, [0, 1], Baseline(k3[0], k3[0]), "x", flagged, [], verdicts, rows)


def _ctx(drift: DriftResult | None, k3: float = 0.01, tokens: int = 1000, steps: int = 2):
    data = SimpleNamespace(
        metrics={"kl_k3": k3},
        tokens=tokens,
        step_metrics=pl.DataFrame({"step": list(range(steps))}),
    )
    return fmod.Context(data, SimpleNamespace(drift=drift))


@settings(max_examples=60, deadline=None)
@given(st.lists(k3s, min_size=2, max_size=12), k3s, st.integers(1, 10**9))
def test_mismatch_trend_follows_first_and_last_step(k3, mean, tokens):
    f = fmod.mismatch_level(_ctx(_drift(k3, [], []), mean, tokens))
    check_numbers(f)
    assert f.value("kl_k3") == mean and f.value("tokens") == tokens
    assert f.value("kl_k3_first") == k3[0] and f.value("kl_k3_last") == k3[-1]
    assert f.value("step_last") == len(k3) - 1
    ratio = k3[-1] / k3[0]
    expect = "rose" if ratio >= 2 else "fell" if ratio <= 0.5 else "about level"
    assert expect in f.sentence
    assert ("×" in f.sentence) == (ratio >= 2)


fractions = st.floats(0.0, 1.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(k3s, min_size=4, max_size=12),
    st.integers(0, 3),
    fractions,
    fractions,
    st.sampled_from(
        ["rose with the mismatch", "flat", "flat while the mismatch rose (the collapse signature)"]
    ),
)
def test_drift_sentence_quotes_the_verdicts(k3, start, base, up, verdict):
    flagged = list(range(start, len(k3)))
    v = RuleVerdict("ipo@prime-rl:eps=0.3", base, up, None, verdict)
    f = fmod.drift_verdict(_ctx(_drift(k3, flagged, [v])))
    check_numbers(f)
    assert f.sentence.startswith("The run drifted")
    assert f.value("drift_steps") == len(flagged)
    assert (f.value("drift_first"), f.value("drift_last")) == (flagged[0], flagged[-1])
    assert f.value("drift0.baseline_fraction") == base
    assert f.value("drift0.drift_fraction") == up
    assert f.value("drift0.eps") == 0.3
    assert ("rose with it" in f.sentence) == verdict.startswith("rose")
    assert ("collapse signature" in f.sentence) == ("while" in verdict)


def test_single_step_log_says_why():
    f = fmod.drift_verdict(_ctx(None, steps=1))
    assert f.sentence == "Drift not computed: the log has 1 step(s)."
    m = fmod.mismatch_level(_ctx(None, 0.5, 12, steps=1))
    check_numbers(m)
    assert m.sentence.endswith("in 1 step(s).")


# ----------------------------------------------------------------------------- the page


def test_report_opens_with_the_findings(golden):
    data, dec, summary = golden
    found = analysis.findings(data, dec, log_format=summary.format)
    sentences = [*found.sentences, "a <b>tag</b> & more 1"]
    page = report.render_html(
        data,
        {"scatter": b"s", "masked_fraction": b"m", "steps": b"t"},
        command="c",
        date="d",
        findings=sentences,
        sections=[("Decision", "<p>decide</p>")],
        choices=dec.choose,
    )
    top = page.index('<section class="findings"><h2>What this log says</h2>')
    assert top < page.index("<h2>") + len("<h2>") + 30  # the first section of the page
    order = [
        "What this log says",
        "<h2>Trainer vs inference probability</h2>",
        "<h2>Masked fraction vs threshold</h2>",
        "<h2>Decision</h2>",
        "<h2>Chosen settings</h2>",
        "<h2>Per step</h2>",
        "<h2>Reference tables</h2>",
        "<details><summary>Summary</summary>",
        "<details><summary>Every rule at its presets</summary>",
        "<details><summary>Rule catalogue: defaults and presets</summary>",
        "<h2>Reproduce</h2>",
    ]
    at = [page.index(x) for x in order]
    assert at == sorted(at)
    for s in found.sentences:
        assert re.sub("'", "&#x27;", s.replace("&", "&amp;")) in page
    assert "a &lt;b&gt;tag&lt;/b&gt; &amp; more 1" in page  # escaped
    assert "What this log says" not in report.render_html(data, {}, command="c", date="d")


def test_masked_reads_the_first_exact_result():
    """masked(): the per-step settings table, else compare, else the by-length table, else
    the report's exact preset rows (stable form), else an exact grid point of the sweep."""
    from mismatch_replay.rules import parse_rule

    empty = pl.DataFrame({"spec": [], "kind": [], "tokens": [], "masked_tokens": []})
    sweep = pl.DataFrame(
        {
            "rule": ["icepop", "icepop"],
            "setting": ["high=5", "high=5"],
            "param": ["low", "low"],
            "value": [0.2, 0.5],
            "tokens": [1000, 1000],
            "masked_tokens": [3, 9],
            "truncated_tokens": [0, 0],
            "kind": ["mask", "mask"],
        }
    )
    data = SimpleNamespace(
        steps=empty, by_length=None, sweep=sweep, tokens=1000, presets={"ipo:eps=0.3": 0.007}
    )
    ctx = fmod.Context(data, SimpleNamespace(compare=None))
    assert fmod.masked(ctx, parse_rule("ipo@prime-rl")) == fmod.Masked(1000, 7, "mask")
    assert fmod.masked(ctx, parse_rule("icepop@verl")) == fmod.Masked(1000, 9, "mask")
    assert fmod.masked(ctx, parse_rule("icepop:low=0.3,high=5")) is None  # not on the grid
    data.steps = pl.DataFrame(
        {"spec": ["ipo@prime-rl:eps=0.3"] * 2, "kind": ["mask"] * 2, "tokens": [400, 600]}
    ).with_columns(masked_tokens=pl.Series([2, 4]))
    assert fmod.masked(ctx, parse_rule("ipo@prime-rl")) == fmod.Masked(1000, 6, "mask")


def test_a_first_step_with_no_mismatch_is_a_rise():
    f = fmod.mismatch_level(_ctx(_drift([0.0, 0.0, 0.02], [], [])))
    check_numbers(f)
    assert "it rose from 0 at step 0 to 0.02 at step 2." in f.sentence
    flat = fmod.mismatch_level(_ctx(_drift([0.0, 0.0], [], [])))
    assert "about level" in flat.sentence
