"""check: the CI gate's verdicts against numpy on the golden log, per step and whole."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import GOLDEN_LOG

from mismatch_replay.analysis import check as chk
from mismatch_replay.errors import UsageError


@pytest.fixture(scope="module")
def tokens():
    df = pl.read_parquet(GOLDEN_LOG)
    if "loss_mask" in df.columns:
        df = df.filter(pl.col("loss_mask"))
    lp, lq = df["trainer_logprob"].to_numpy(), df["inference_logprob"].to_numpy()
    l = np.clip(lp - lq, -20, 20)  # noqa: E741
    return {
        "step": df["step"].to_numpy(),
        "k3": np.expm1(l) - l,
        "ipo": np.abs(np.exp(lp) - np.exp(lq)) > 0.3,
        "path": str(GOLDEN_LOG),
    }


def _per_step(tokens, values):
    steps = np.unique(tokens["step"])
    per = np.array([values[tokens["step"] == s].mean() for s in steps])
    return steps, per


def test_whole_log_values_and_verdicts(tokens):
    k3 = tokens["k3"].mean()
    ipo = tokens["ipo"].mean()
    limits = [
        chk.metric_limit(f"kl_k3={k3 * 1.01}"),  # holds
        chk.metric_limit(f"rollout_corr/k3_kl={k3 * 0.99}"),  # exceeded (a dashboard name)
        chk.masked_limit("ipo:eps=0.3", ipo),  # holds at equality
        chk.masked_limit("ipo:eps=0.3", ipo * 0.99),  # exceeded
    ]
    res = chk.check([tokens["path"]], limits)
    got = [(v.value, v.ok) for v in res.verdicts]
    assert got[0][0] == pytest.approx(k3, rel=1e-9) and got[0][1]
    assert got[1][0] == pytest.approx(k3, rel=1e-9) and not got[1][1]
    assert got[2][0] == pytest.approx(ipo, rel=1e-12) and got[2][1]
    assert not got[3][1]
    assert not res.passed and [v.limit for v in res.violations] == [limits[1], limits[3]]
    assert res.verdicts[1].limit.label == "rollout_corr/k3_kl"
    assert res.tokens == tokens["k3"].shape[0]


def test_per_step_the_worst_step_decides(tokens):
    steps, per = _per_step(tokens, tokens["k3"])
    worst = int(np.argmax(per))
    between = (per.mean() + per.max()) / 2  # above the log's mean, below the worst step
    assert tokens["k3"].mean() < between < per.max()
    whole = chk.check([tokens["path"]], [chk.metric_limit(f"kl_k3={between}")])
    stepwise = chk.check([tokens["path"]], [chk.metric_limit(f"kl_k3={between}")], per_step=True)
    assert whole.passed and not stepwise.passed
    v = stepwise.verdicts[0]
    assert v.worst_step == int(steps[worst])
    assert v.worst_value == pytest.approx(per[worst], rel=1e-9)
    assert v.value == pytest.approx(tokens["k3"].mean(), rel=1e-9)  # whole log, same replay
    assert stepwise.steps == steps.shape[0]

    steps, per = _per_step(tokens, tokens["ipo"].astype(float))
    res = chk.check([tokens["path"]], [chk.masked_limit("ipo:eps=0.3", 1.0)], per_step=True)
    assert res.passed
    assert res.verdicts[0].worst_value == pytest.approx(per.max(), rel=1e-12)
    assert res.verdicts[0].worst_step == int(steps[np.argmax(per)])


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("kl_k3", "METRIC=VALUE"),
        ("kl_k9=0.1", "unknown metric 'kl_k9'"),
        ("kl_k3=abc", "not a number"),
        ("kl_k3=nan", "not NaN"),
    ],
)
def test_bad_limits_are_usage_errors(text, needle):
    with pytest.raises(UsageError, match=needle):
        chk.metric_limit(text)


def test_masked_limits_are_checked_before_the_replay():
    with pytest.raises(UsageError, match="between 0 and 1"):
        chk.masked_limit("ipo:eps=0.3", 1.5)
    with pytest.raises(UsageError):
        chk.masked_limit("no-such-rule", 0.1)
    with pytest.raises(UsageError, match="at least one limit"):
        chk.check(["x.parquet"], [])


def _cli(*args):
    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    return CliRunner().invoke(app, ["check", str(GOLDEN_LOG), *args])


def test_cli_exit_codes_and_json(tokens):
    import json

    k3 = tokens["k3"].mean()
    ok = _cli("--max", f"kl_k3={k3 * 1.01}", "-r", "ipo:eps=0.3", "--max-masked", "0.01")
    assert ok.exit_code == 0, ok.output
    assert "kl_k3" in ok.stdout and "ok" in ok.stdout and "EXCEEDED" not in ok.stdout
    bad = _cli("--max", f"mismatch_kl={k3 * 0.99}", "--per-step", "--json")
    assert bad.exit_code == 3, bad.output
    d = json.loads(bad.stdout)
    assert d["passed"] is False and d["per_step"] is True
    assert [v["limit"] for v in d["violations"]] == ["mismatch_kl"]
    assert d["violations"][0]["value"] == pytest.approx(k3, rel=1e-9)
    assert d["violations"][0]["worst_step"] in set(tokens["step"].tolist())
    assert "1 of 1 limit(s) exceeded" in bad.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "at least one limit"),
        (("-r", "ipo"), "--max-masked"),
        (("--max-masked", "0.1"), "add -r SPEC"),
        (
            (
                "-r",
                "ipo",
                "-r",
                "kpop",
                "--max-masked",
                "0.1",
                "--max-masked",
                "0.2",
                "--max-masked",
                "0.3",
            ),
            "one for each",
        ),
        (("--max", "kl=1"), "unknown metric"),
    ],
)
def test_cli_usage_errors_exit_2(args, needle):
    res = _cli(*args)
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and "Traceback" not in res.output


def test_cli_bad_data_exits_1(tmp_path):
    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    bad = tmp_path / "bad.parquet"
    pl.DataFrame({"x": [1.0]}).write_parquet(bad)
    res = CliRunner().invoke(app, ["check", str(bad), "--max", "kl_k3=0.1"])
    assert res.exit_code == 1, res.output
    assert "trainer_logprob" in res.stderr


def test_slimes_sample_mean_abs_diff(tokens, tmp_path):
    """slime: mean over samples of each sample's mean |lp - lq| (cp_utils.sum_of_sample_mean)."""
    df = pl.read_parquet(GOLDEN_LOG).filter(pl.col("loss_mask"))
    per_sample: dict[tuple, list[float]] = {}
    for step, sid, lp, lq in df.select(
        "step", "sample_id", "trainer_logprob", "inference_logprob"
    ).iter_rows():
        per_sample.setdefault((step, sid), []).append(abs(lp - lq))
    means = {k: sum(v) / len(v) for k, v in per_sample.items()}
    whole = sum(means.values()) / len(means)
    by_step: dict[int, list[float]] = {}
    for (step, _), m in means.items():
        by_step.setdefault(step, []).append(m)
    worst = max(by_step, key=lambda s: sum(by_step[s]) / len(by_step[s]))
    lim = chk.metric_limit(f"train_rollout_logprob_abs_diff={whole * 1.5}")
    res = chk.check([tokens["path"]], [lim], per_step=True)
    v = res.verdicts[0]
    assert v.value == pytest.approx(whole, rel=1e-12)
    assert v.worst_step == worst
    assert v.worst_value == pytest.approx(sum(by_step[worst]) / len(by_step[worst]), rel=1e-12)
    no_ids = tmp_path / "no_ids.parquet"
    df.drop("sample_id").write_parquet(no_ids)
    with pytest.raises(UsageError, match="no sample_id column"):
        chk.check([str(no_ids)], [lim])
