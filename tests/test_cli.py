"""The command line, driven as a user drives it: exit codes, stdout/stderr, files written."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from mismatch_replay.cli import app
from mismatch_replay.rules import REGISTRY

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def strict_json(text: str):
    """json.loads that fails on NaN / Infinity (JSON output must carry null instead)."""

    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=bad)


def write(path: Path, **cols) -> str:
    pl.DataFrame(cols).write_parquet(path)
    return str(path)


def assert_clean_error(res, code: int, *needles: str) -> None:
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    assert res.stderr.startswith("error: ")
    for n in needles:
        assert n in res.stderr, (n, res.stderr)


# ----------------------------------------------------------------------------- rules


def test_rules_lists_the_whole_catalogue():
    res = run("rules")
    assert res.exit_code == 0
    for name in REGISTRY:
        assert name in res.stdout
    recs = strict_json(run("rules", "--json").stdout)["rules"]
    assert [r["name"] for r in recs] == list(REGISTRY)
    assert len(recs) == 23
    ipo = next(r for r in recs if r["name"] == "ipo")
    assert ipo["params"][0]["default"] == 0.3
    assert ipo["presets"]["prime-rl-legacy"] == {"eps": 0.1}


# ----------------------------------------------------------------------------- inspect


def test_inspect_summarises_the_golden_log():
    res = run("inspect", GOLDEN)
    assert res.exit_code == 0, res.stderr
    assert "19,598" in res.stdout and "mismatch_kl/all/mean" in res.stdout
    d = strict_json(run("inspect", GOLDEN, "--json").stdout)
    assert d["schema_version"] == 1
    assert (d["rows"], d["loss_tokens"], d["steps"], d["sequences"]) == (20969, 19598, 8, 96)
    assert d["invalid_rows"] == 0
    assert len(d["per_step"]) == 8
    assert sum(r["tokens"] for r in d["per_step"]) == 19598
    lp = pl.read_parquet(GOLDEN).filter("loss_mask")
    ell = (lp["trainer_logprob"] - lp["inference_logprob"]).to_numpy()
    assert d["metrics"]["kl_k3"] == pytest.approx(np.mean(np.expm1(ell) - ell), rel=1e-12)


def test_inspect_counts_invalid_rows_instead_of_failing(tmp_path):
    f = write(
        tmp_path / "x.parquet",
        trainer_logprob=[-0.1, math.nan, 0.5, -0.2],
        inference_logprob=[-0.1, -0.2, -0.3, -0.4],
    )
    d = strict_json(run("inspect", f, "--json").stdout)
    assert d["invalid_rows"] == 2 and d["loss_tokens"] == 2
    assert any("trainer_logprob" in k for k in d["invalid"])


# ----------------------------------------------------------------------------- sweep


def test_sweep_single_setting_json_matches_golden():
    res = run("sweep", GOLDEN, "-r", "ipo:eps=0.3", "-r", "tis:cap=2", "--json")
    assert res.exit_code == 0, res.stderr
    d = strict_json(res.stdout)
    assert d["schema_version"] == 1 and "mismatch-replay" in d["command"]
    ipo, tis = d["rows"]
    assert (ipo["rule"], ipo["param"], ipo["value"], ipo["masked_tokens"]) == (
        "ipo",
        "eps",
        0.3,
        29,
    )
    assert ipo["tokens"] == 19598 and ipo["truncated_tokens"] == 0
    assert tis["masked_tokens"] == 0 and tis["truncated_tokens"] == 4
    for col in ("masked_fraction", "sequences", "masked_sequences", "masked_mass_fraction"):
        assert col in ipo


def test_sweep_reports_each_jobs_path():
    """--json carries each job's path (fused or simple, and why); --verbose prints it on
    stderr as a table and leaves stdout as it was."""
    args = ["sweep", GOLDEN, "-r", "ipo:eps=0.3", "-r", "seq-tis:cap=2", "--sweep", "eps=0.1,0.3"]
    d = strict_json(run(*args, "--json").stdout)
    assert d["paths"] == [
        {"rule": "ipo", "param": "eps", "path": "fused", "reason": None},
        {"rule": "seq-tis:cap=2", "param": None, "path": "simple", "reason": "sequence rule"},
    ]
    f32 = strict_json(run(*args, "--json", "--precision", "float32").stdout)["paths"]
    # each job's own reason since df222d1 (precision per rule, no Tally-wide 'float32
    # replay'): a sequence rule runs the simple path in any precision, so it says so
    assert [(p["path"], p["reason"]) for p in f32] == [
        ("simple", "float32 replay"),
        ("simple", "sequence rule"),
    ]
    plain_run, verbose = run(*args), run(*args, "--verbose")
    assert verbose.exit_code == 0, verbose.stderr
    assert verbose.stdout == plain_run.stdout
    assert "path of each job" in verbose.stderr and "path of each job" not in plain_run.stderr
    lines = verbose.stderr.splitlines()
    assert any(line.split()[:1] == ["ipo"] and "fused" in line for line in lines)
    assert any("seq-tis:cap=2" in line and "sequence rule" in line for line in lines)


def test_sweep_default_runs_every_rule_over_a_100_point_grid(tmp_path):
    out = tmp_path / "all.parquet"
    res = run("sweep", GOLDEN, "-o", out)
    assert res.exit_code == 0, res.stderr
    df = pl.read_parquet(out)
    assert set(df["rule"]) == set(REGISTRY)
    per = df.group_by("rule", "param", "setting").len()
    assert per["len"].min() >= 100
    # the human table is a preview of the same numbers
    res = run("sweep", GOLDEN)
    assert res.exit_code == 0 and "showing" in res.stderr


def test_sweep_grid_forms_and_rule_qualified_sweeps():
    d = strict_json(
        run(
            "sweep",
            GOLDEN,
            "-r",
            "ipo",
            "-r",
            "icepop@prime-rl",
            "--sweep",
            "eps=0.05,0.3",
            "--sweep",
            "icepop.high=2:8:3",
            "--json",
        ).stdout
    )
    got = [(r["rule"], r["param"], r["value"]) for r in d["rows"]]
    assert got == [
        ("ipo", "eps", 0.05),
        ("ipo", "eps", 0.3),
        ("icepop", "high", 2.0),
        ("icepop", "high", 5.0),
        ("icepop", "high", 8.0),
    ]
    assert [r["masked_tokens"] for r in d["rows"]][:2] == [102, 29]
    assert d["rows"][3]["masked_tokens"] == 15  # icepop [0.2, 5]: golden


def test_sweep_by_step_sums_to_the_total():
    args = ("sweep", GOLDEN, "-r", "kpop@prime-rl", "--by", "step", "--json")
    d = strict_json(run(*args, "--precision", "float64").stdout)
    rows = d["rows"]
    assert sorted(r["step"] for r in rows) == list(range(8))
    assert sum(r["masked_tokens"] for r in rows) == 702
    # by default in prime-rl's float32 (tests/test_presets.py: torch.float32 agrees): 701
    rows32 = strict_json(run(*args).stdout)["rows"]
    assert sum(r["masked_tokens"] for r in rows32) == 701
    assert sum(r["tokens"] for r in rows) == 19598


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json"])
def test_output_is_refused_when_present_unless_force(tmp_path, suffix):
    out = tmp_path / f"t{suffix}"
    assert run("sweep", GOLDEN, "-r", "ipo", "-o", out).exit_code == 0
    first = out.read_bytes()
    res = run("sweep", GOLDEN, "-r", "ipo:eps=0.05", "-o", out)
    assert_clean_error(res, 2, str(out), "--force")
    assert out.read_bytes() == first
    assert run("sweep", GOLDEN, "-r", "ipo:eps=0.05", "-o", out, "--force").exit_code == 0
    assert out.read_bytes() != first
    assert not list(tmp_path.glob(".*tmp"))  # no temporary left behind
    if suffix == ".json":
        assert strict_json(out.read_text())["rows"][0]["masked_tokens"] == 102
    elif suffix == ".csv":
        assert pl.read_csv(out)["masked_tokens"].to_list() == [102]


def test_unknown_output_suffix_is_a_usage_error(tmp_path):
    assert_clean_error(run("sweep", GOLDEN, "-o", tmp_path / "x.xlsx"), 2, ".xlsx")


def test_json_has_null_not_nan_for_undefined_values(tmp_path):
    f = write(
        tmp_path / "nos.parquet", trainer_logprob=[-0.1, -0.2], inference_logprob=[-0.2, -0.2]
    )
    res = run("sweep", f, "-r", "ipo", "--json")
    row = strict_json(res.stdout)["rows"][0]
    assert row["sequences"] is None and row["weight_mean"] is None


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def bad(tmp_path):
    return tmp_path


def test_missing_file(bad):
    assert_clean_error(run("sweep", bad / "nope.parquet"), 1, "nope.parquet", "no such file")


def test_empty_directory(bad):
    (bad / "d").mkdir()
    assert_clean_error(run("sweep", bad / "d"), 1, "no .parquet file")


def test_corrupt_file(bad):
    (bad / "c.parquet").write_bytes(b"PAR1 not really")
    assert_clean_error(run("sweep", bad / "c.parquet"), 1, "c.parquet", "cannot read")


def test_missing_required_column_suggests_map(bad):
    f = write(bad / "m.parquet", lp=[-0.1], lq=[-0.2])
    assert_clean_error(run("sweep", f), 1, "m.parquet", "trainer_logprob", "--map", "lp, lq")
    res = run("sweep", f, "--map", "trainer_logprob=lp", "--map", "inference_logprob=lq", "--json")
    assert res.exit_code == 0 and strict_json(res.stdout)["rows"][0]["tokens"] == 1


@pytest.mark.parametrize(
    "values,what",
    [
        ([-0.1, math.nan, -0.3], "1 of 3 loss rows are NaN"),
        ([-0.1, math.inf, -0.3], "1 of 3 loss rows are +inf or -inf"),
        ([-0.1, -math.inf, -0.3], "1 of 3 loss rows are +inf or -inf"),
        ([-0.1, 0.5, 2e-6], "2 of 3 loss rows are above 0"),
        ([-0.1, None, -0.3], "1 of 3 loss rows are null"),
    ],
)
def test_invalid_values_name_file_column_count_and_fix(bad, values, what):
    f = write(bad / "v.parquet", trainer_logprob=values, inference_logprob=[-0.1, -0.2, -0.3])
    assert_clean_error(
        run("sweep", f, "-r", "ipo"), 1, "v.parquet", "trainer_logprob", what, "--drop-invalid"
    )


def test_drop_invalid_drops_and_reports(bad):
    f = write(
        bad / "v.parquet",
        trainer_logprob=[-0.1, math.nan, 0.5, -0.2],
        inference_logprob=[-0.1, -0.2, -0.3, -0.4],
    )
    res = run("sweep", f, "-r", "ipo:eps=0.001", "--drop-invalid", "--json")
    assert res.exit_code == 0
    assert "dropped 2 invalid loss rows" in res.stderr
    row = strict_json(res.stdout)["rows"][0]
    assert row["tokens"] == 2


def test_tiny_positive_logprobs_are_rounding_noise(bad):
    f = write(bad / "t.parquet", trainer_logprob=[5e-7, -0.1], inference_logprob=[-0.0, -0.1])
    res = run("sweep", f, "-r", "ipo:eps=0.001", "--json")
    assert res.exit_code == 0
    assert strict_json(res.stdout)["rows"][0]["masked_tokens"] == 0


def test_probabilities_out_of_range(bad):
    f = write(bad / "p.parquet", trainer_prob=[0.9, 1.2, 0.5], inference_prob=[0.8, 0.5, 0.5])
    assert_clean_error(run("sweep", f), 1, "p.parquet", "trainer_prob", "probability above 1")
    f = write(bad / "ok.parquet", trainer_prob=[0.9, 0.2], inference_prob=[0.8, 0.5])
    d = strict_json(run("sweep", f, "-r", "ipo:eps=0.25", "--json").stdout)
    assert d["rows"][0]["masked_tokens"] == 1  # |0.2 - 0.5| > 0.25


def test_probs_flag_reads_mapped_columns_as_probabilities(bad):
    f = write(bad / "p.parquet", a=[0.9, 0.2], b=[0.8, 0.5])
    res = run(
        "sweep",
        f,
        "--map",
        "trainer_logprob=a",
        "--map",
        "inference_logprob=b",
        "--probs",
        "-r",
        "ipo:eps=0.25",
        "--json",
    )
    assert res.exit_code == 0, res.stderr
    assert strict_json(res.stdout)["rows"][0]["masked_tokens"] == 1


def test_unequal_list_lengths(bad):
    f = write(
        bad / "l.parquet",
        trainer_logprobs=[[-0.1, -0.2], [-0.3]],
        inference_logprobs=[[-0.1, -0.2], [-0.3, -0.1]],
    )
    assert_clean_error(run("sweep", f), 1, "l.parquet", "1 of 2 sequence rows", "unequal")
    res = run("sweep", f, "--drop-invalid", "-r", "ipo", "--json")
    assert res.exit_code == 0 and strict_json(res.stdout)["rows"][0]["tokens"] == 2


def test_schemas_that_differ_between_files(bad):
    a = write(bad / "a.parquet", trainer_logprob=[-0.1], inference_logprob=[-0.2], advantage=[1.0])
    b = write(bad / "b.parquet", trainer_logprob=[-0.1], inference_logprob=[-0.2])
    assert_clean_error(run("sweep", a, b), 1, "schemas differ", "a.parquet", "b.parquet")


def test_empty_selection(bad):
    f = write(
        bad / "e.parquet", trainer_logprob=[-0.1], inference_logprob=[-0.2], loss_mask=[False]
    )
    assert_clean_error(run("sweep", f), 1, "e.parquet", "no loss tokens")


def test_advantage_rule_without_advantage_column(bad):
    f = write(bad / "n.parquet", trainer_logprob=[-0.1], inference_logprob=[-0.2])
    assert_clean_error(run("sweep", f, "-r", "dppo-tv"), 1, "advantage", "--map advantage=")
    res = run("sweep", f)
    assert res.exit_code == 0 and "dppo-tv: skipped" in res.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-r", "nosuch"], "unknown rule 'nosuch'"),
        (["-r", "ipo:foo=1"], "no parameter 'foo'"),
        (["-r", "icepop@nowhere"], "no preset 'nowhere'"),
        (["-r", "ipo:eps=abc"], "not a number"),
        # a preset that leaves hi unset (a bare token-k2 is swept over hi's grid: sweep -r NAME)
        (["-r", "token-k2@verl"], "no default for 'hi'"),
        (["--sweep", "eps=1:2"], "bad GRID"),
        (["--sweep", "nosuch=1,2"], "no selected rule has that parameter"),
        (["--by", "colour"], "--by colour"),
        (["--map", "nonsense"], "canonical=theirs"),
    ],
)
def test_usage_errors_exit_2(args, needle):
    assert_clean_error(run("sweep", GOLDEN, *args), 2, needle)


def test_directory_and_glob_sources(tmp_path):
    df = pl.read_parquet(GOLDEN)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    df.filter(pl.col("step") < 4).write_parquet(tmp_path / "d" / "a.parquet")
    df.filter(pl.col("step") >= 4).write_parquet(tmp_path / "d" / "sub" / "b.parquet")
    for src in (tmp_path / "d", str(tmp_path / "d" / "**" / "*.parquet")):
        d = strict_json(run("sweep", src, "-r", "kpop@prime-rl", "--json").stdout)
        assert d["rows"][0]["masked_tokens"] == 701  # prime-rl's float32 (702 exact)


def test_module_entry_point_and_version():
    res = subprocess.run(
        [sys.executable, "-m", "mismatch_replay", "--version"], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stdout.startswith("mismatch-replay ")
    res = subprocess.run(
        [sys.executable, "-m", "mismatch_replay", "sweep", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "--sweep" in res.stdout and "--rule" in res.stdout


def test_precision_float32_replays_the_frameworks_float32(golden_log):
    """AReaL's binary KL in float32 turns p = 1 into NaN, which its comparison masks."""
    counts = {}
    for p in ("float64", "float32"):
        res = run(
            "sweep", str(golden_log), "-r", "kpop@areal", "-r", "ipo", "--precision", p, "--json"
        )
        assert res.exit_code == 0, res.output
        counts[p] = {r["rule"]: r["masked_tokens"] for r in json.loads(res.stdout)["rows"]}
    assert counts["float32"]["kpop"] > 10 * counts["float64"]["kpop"]
    assert counts["float32"]["ipo"] == counts["float64"]["ipo"]
    for cmd in (
        ["choose", "-t", "0.01", "-r", "ipo"],
        ["compare", "-r", "ipo", "-r", "kpop@areal"],
    ):
        res = run(cmd[0], str(golden_log), *cmd[1:], "--precision", "float32")
        assert res.exit_code == 0, res.output
    bad = run("sweep", str(golden_log), "-r", "ipo", "--precision", "float16")
    assert bad.exit_code == 2 and "float16" in bad.stderr
