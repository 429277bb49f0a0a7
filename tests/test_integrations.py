"""mismatch_replay.integrations: trainer configs in and out, W&B and TensorBoard logging.

- Config in: each framework's fixture (tests/configs/) reads to the rules its code selects;
  unknown keys are named with the file; settings no catalogue rule replays are refused.
- The round trip, per framework: config in -> choose on tests/data/golden_log.parquet ->
  emit -> read back (alone, and merged over the base config) -> the same rule, the chosen
  threshold exactly.
- W&B (WANDB_MODE=offline, no server): a report logged into a resumed run id, the run
  directory read back (read_offline_run; and wandb's own `wandb leet inspect` when present).
- TensorBoard: event files written by tensorboardX and read back (read_events; and
  TensorBoard's EventAccumulator when installed).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest

from mismatch_replay import analysis
from mismatch_replay.errors import DataError, UsageError
from mismatch_replay.integrations import config_in, config_out, outputs
from mismatch_replay.integrations.frameworks import FRAMEWORKS, get_framework
from mismatch_replay.rules import parse_rule

HERE = Path(__file__).parent
CONFIGS = HERE / "configs"
GOLDEN = HERE / "data" / "golden_log.parquet"
DOCS = HERE.parent / "docs" / "integrations.md"

EXPECTED = {
    "prime-rl.toml": ("prime-rl", ["ipo@prime-rl:eps=0.2"]),
    "verl.yaml": (
        "verl",
        [
            "tis@verl:cap=2",
            "token-mis@verl-k1:low=0.625,high=1.6666666666666667",
            "seq-max-k2@verl:hi=2.5",
        ],
    ),
    "verl_run.sh": (
        "verl",
        ["seq-tis@verl:cap=2", "geo-mis@verl:low=0.9990009990009991,high=1.001001001001001"],
    ),
    "areal.yaml": ("areal", ["icepop@areal:low=0.5,high=5", "m2po@areal:tau=0.04"]),
    "trl.yaml": ("trl", ["token-mis@trl:low=0.5,high=2", "opsm:delta=0.5"]),
    "nemo-rl.yaml": ("nemo-rl", ["icepop:low=0.5,high=5", "prob-error:tau=1.5"]),
    # slime's icepop_function and SkyRL's token TIS have presets (issue 30): their arithmetic
    "slime.sh": ("slime", ["icepop@slime:low=0.5,high=2", "opsm:delta=0.0001"]),
    "skyrl.sh": ("skyrl", ["tis@skyrl:cap=2", "geo-mis@skyrl:low=0.99,high=1.01"]),
    "openrlhf.sh": ("openrlhf", ["icepop:low=0.5,high=5"]),
}


# ----------------------------------------------------------------------------- config in


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_reads_to_the_rules_the_framework_runs(name):
    fw, specs = EXPECTED[name]
    cfg = config_in.read_config(CONFIGS / name)
    assert cfg.framework == fw  # detected from the keys
    assert cfg.specs() == specs
    assert cfg.files == [str(CONFIGS / name)]
    # the same with the framework named
    assert config_in.read_config(CONFIGS / name, framework=fw).specs() == specs


def test_every_framework_has_a_fixture():
    assert {fw for fw, _ in EXPECTED.values()} == set(FRAMEWORKS)


def test_defaults_follow_the_framework_code():
    # TRL: correction on, mode sequence_mask, clip_max 3 -> the catalogue's seq-mis@trl
    cfg = config_in.read_text(
        "use_vllm: true\nvllm_importance_sampling_correction: true\n", "trl", "yaml"
    )
    assert cfg.specs() == ["seq-mis@trl:low=0,high=3"]
    assert parse_rule("seq-mis@trl").values() == cfg.rules[0].rule.values()
    # SkyRL: geometric mask bounds 0.99 / 1.01 -> geo-mis@skyrl
    cfg = config_in.read_text(
        "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric", "skyrl", "hydra"
    )
    assert cfg.rules[0].rule.values() == parse_rule("geo-mis@skyrl").values()
    # prime-rl: no [trainer.loss] type -> the default loss, DPPO 0.2 / 0.2
    cfg = config_in.read_text("[trainer.loss]\nkl_tau = 0.001\n", "prime-rl", "toml")
    assert cfg.specs() == ["dppo-tv@prime-rl:low=0.2,high=0.2"]
    # AReaL: rejection_sampling: {} -> token / mask / ratio, upper 5, no lower bound
    cfg = config_in.read_text("actor:\n  rejection_sampling: {}\n", "areal", "yaml")
    assert cfg.specs() == ["icepop@areal:low=0,high=5"]
    assert any("use_decoupled_loss" in n for n in cfg.notes)  # off by default in AReaL
    # AReaL: rejection_sampling: null -> no rule
    assert config_in.read_text("actor:\n  rejection_sampling: null\n", "areal", "yaml").rules == []


def test_verl_k1_threshold_follows_the_code():
    cfg = config_in.read_config(CONFIGS / "verl.yaml")
    k1 = cfg.rules[1]
    # '0.6_1.6' keeps 1/1.6 <= r <= 1/0.6 in verl's code, not [0.6, 1.6]
    assert k1.rule.low == pytest.approx(1 / 1.6) and k1.rule.high == pytest.approx(1 / 0.6)
    assert k1.rule.preset == "verl-k1"
    assert any("1/1.6 <= r <= 1/0.6" in n for n in k1.notes)
    # one float X: verl infers lower = 1/X, a symmetric band
    cfg = config_in.read_text(
        "algorithm.rollout_correction.rollout_rs=token_k1 "
        "algorithm.rollout_correction.rollout_rs_threshold=2.0",
        "verl",
        "hydra",
    )
    assert cfg.rules[0].rule.values() == {"low": 0.5, "high": 2.0}


def test_shell_variables_overrides_and_deletion():
    text = (
        'CAP=3.5\nRS="token_k2"\n'
        "python -m verl.trainer.main_ppo algorithm.rollout_correction.rollout_is=token "
        "algorithm.rollout_correction.rollout_is_threshold=${CAP} \\\n"
        "  algorithm.rollout_correction.rollout_rs=$RS "
        "algorithm.rollout_correction.rollout_rs_threshold=${UNSET:-0.5} "
        "~algorithm.rollout_correction.rollout_is\n"
    )
    cfg = config_in.read_text(text, "verl", "hydra")
    assert cfg.specs() == ["token-k2@verl:hi=0.5"]  # rollout_is deleted by ~key
    with pytest.raises(UsageError, match=r"refers to a variable"):
        config_in.read_text(
            "algorithm.rollout_correction.rollout_is=token "
            "algorithm.rollout_correction.rollout_is_threshold=$NOPE",
            "verl",
            "hydra",
        )


def test_later_files_win(tmp_path):
    over = tmp_path / "over.txt"
    over.write_text(
        "algorithm.rollout_correction.rollout_is_threshold=4.0\n"
        "algorithm.rollout_correction.rollout_rs=null\n"
    )
    cfg = config_in.read_config([CONFIGS / "verl.yaml", over])
    assert cfg.specs() == ["tis@verl:cap=4"]
    assert cfg.files == [str(CONFIGS / "verl.yaml"), str(over)]


TYPOS = {
    "prime-rl": (
        "toml",
        "[trainer.loss]\ntype = 'ipo'\nipo_treshold = 0.2\n",
        "trainer.loss.ipo_treshold",
        "ipo_threshold",
    ),
    "verl": (
        "yaml",
        "algorithm:\n  rollout_correction:\n    rollout_rs_treshold: '2.0'\n",
        "algorithm.rollout_correction.rollout_rs_treshold",
        "rollout_rs_threshold",
    ),
    "areal": (
        "yaml",
        "actor:\n  rejection_sampling:\n    uper: 3.0\n",
        "actor.rejection_sampling.uper",
        "upper",
    ),
    "trl": (
        "cli",
        "--vllm_importance_sampling_clipmax 2.0",
        "vllm_importance_sampling_clipmax",
        "vllm_importance_sampling_clip_max",
    ),
    "nemo-rl": (
        "hydra",
        "loss_fn.truncated_importance_sampling_ration=2.0",
        "loss_fn.truncated_importance_sampling_ration",
        "ratio",
    ),
    "slime": ("cli", "--use-tis --tis-clip-lo 0.5", "tis_clip_lo", "tis_clip_low"),
    "skyrl": (
        "hydra",
        "trainer.algorithm.off_policy_correction.geo_mask_hi=1.02",
        "trainer.algorithm.off_policy_correction.geo_mask_hi",
        "geo_mask_high",
    ),
    "openrlhf": (
        "cli",
        "--algo.advantage.is_correction_thresh 0.5 5",
        "algo.advantage.is_correction_thresh",
        "is_correction_threshold",
    ),
}


@pytest.mark.parametrize("fw", sorted(TYPOS))
def test_unknown_keys_are_named_with_the_file(fw, tmp_path):
    syntax, text, key, hint = TYPOS[fw]
    path = tmp_path / f"cfg.{ {'toml': 'toml', 'yaml': 'yaml'}.get(syntax, 'sh') }"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        config_in.read_config(path)  # detected from the (misspelt) key's section
    msg = str(e.value)
    assert str(path) in msg and f"'{key}'" in msg and hint in msg
    assert get_framework(fw).checked[0].commit[:7] in msg


@pytest.mark.parametrize(
    ("fw", "syntax", "text", "match"),
    [
        (
            "areal",
            "yaml",
            "actor:\n  rejection_sampling:\n    metric: kl_k3\n    upper: 1.0\n",
            r"q/p - 1 - log\(q/p\)",
        ),
        (
            "verl",
            "hydra",
            "algorithm.rollout_correction.rollout_rs=seq_sum_k2 "
            "algorithm.rollout_correction.rollout_rs_threshold=1.0",
            r"seq_sum_k2.*no rule",
        ),
        ("verl", "hydra", "algorithm.rollout_correction.rollout_rs=token_k1", r"requires one"),
        (
            "skyrl",
            "hydra",
            "trainer.algorithm.off_policy_correction.outlier_token_is_threshold_high=100",
            r"no rule",
        ),
        ("slime", "cli", "--use-tis --custom-tis-function-path my.mod:fn", r"your own code"),
        ("prime-rl", "toml", "[trainer.loss]\ntype='custom'\nimport_path='m.f'\n", r"--rule"),
        (
            "nemo-rl",
            "yaml",
            "loss_fn:\n  truncated_importance_sampling_type: tis\n"
            "  truncated_importance_sampling_ratio: 2.0\n",
            r"use_importance_sampling_correction",
        ),
        ("trl", "yaml", "vllm_importance_sampling_mode: token_mix\n", r"token_mask"),
    ],
)
def test_settings_no_rule_replays_are_refused(fw, syntax, text, match):
    with pytest.raises(UsageError, match=match):
        config_in.read_text(text, fw, syntax)


def test_detection_needs_known_keys(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("learning_rate: 1.0e-6\n")
    with pytest.raises(UsageError, match=r"--framework"):
        config_in.read_config(p)
    with pytest.raises(UsageError, match=r"unknown framework"):
        config_in.read_config(p, framework="megatron")
    with pytest.raises(UsageError, match=r"no such file"):
        config_in.read_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer.loss\n")
    with pytest.raises(UsageError, match=r"bad.toml: not valid TOML"):
        config_in.read_config(bad)


# ----------------------------------------------------------------------------- round trip


def _same(a, b) -> bool:
    return (
        a.name == b.name
        and a.preset == b.preset
        and all(
            (x is None and y is None) or math.isclose(x, y, rel_tol=1e-15, abs_tol=0.0)
            for x, y in zip(a.values().values(), b.values().values(), strict=True)
        )
    )


@pytest.fixture(scope="module")
def chosen():
    """choose on the golden log for every fixture's rules (one pass set per fixture)."""
    out = {}
    for name in EXPECTED:
        cfg = config_in.read_config(CONFIGS / name)
        rows = analysis.choose([GOLDEN], 0.02, cfg.specs(), bootstrap=0)
        out[name] = (cfg, rows)
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_round_trip_config_replay_choose_emit(name, chosen, tmp_path):
    cfg, rows = chosen[name]
    fw = get_framework(cfg.framework)
    usable = [r for r in rows if r.status != "out of range"]
    assert usable, rows
    for syntax in fw.syntaxes:
        for row in usable:
            want = parse_rule(row.spec)
            text = config_out.emit(cfg.framework, [row], base=cfg, syntax=syntax)
            assert text.startswith("# mismatch-replay choose: ")
            # read back alone: the emitted block is self-contained
            back = config_in.read_text(text, cfg.framework, syntax)
            got = [r.rule for r in back.rules if r.rule.name == want.name]
            assert len(got) == 1 and _same(got[0], want), (syntax, text, back.specs())
            # only what was chosen: no rule the base holds beyond its slot's comes back
            assert len(back.rules) <= len(cfg.rules)
            # merged over the base config, as the trainer would read base + override
            ext = {"toml": ".toml", "yaml": ".yaml"}.get(syntax, ".txt")
            over = tmp_path / f"override{ext}"
            over.write_text(text)
            merged = config_in.read_config([CONFIGS / name, over], framework=cfg.framework)
            got = [r.rule for r in merged.rules if r.rule.name == want.name]
            assert len(got) == 1 and _same(got[0], want), (syntax, text, merged.specs())
            # ... the base's other rules kept as they were
            assert len(merged.rules) == len(cfg.rules)
            others = {r.rule.spec() for r in cfg.rules if r.rule.name != want.name}
            assert others <= {r.rule.spec() for r in merged.rules}, (syntax, text)


def test_emit_formats():
    verl = config_in.read_config(CONFIGS / "verl.yaml")
    text = config_out.emit("verl", ["token-mis@verl-k1:low=0.4,high=3"], base=verl)
    # shell-ready Hydra overrides; the k1 pair is (1/high, 1/low), shortest exact decimals
    assert (
        "\"algorithm.rollout_correction.rollout_rs_threshold='0.3333333333333333_2.5,2.5'\"" in text
    )
    assert text.rstrip().splitlines()[-2].endswith(" \\")
    prime = config_out.emit("prime-rl", ["ipo:eps=0.25"])
    assert '[trainer.loss]\ntype = "ipo"\nipo_threshold = 0.25' in prime
    cli = config_out.emit("prime-rl:cli", ["ipo:eps=0.25"])
    assert "--trainer.loss.type ipo \\\n--trainer.loss.ipo-threshold 0.25" in cli
    assert config_in.read_text(cli, "prime-rl", "cli").specs() == ["ipo@prime-rl:eps=0.25"]
    slime = config_out.emit("slime", ["tis:cap=2.5"])
    assert "--use-tis \\\n--tis-clip 2.5 \\\n--tis-clip-low 0.0" in slime
    assert config_out.assignments("skyrl", ["geo-mis:low=0.98,high=1.02"]) == [
        ("trainer.algorithm.off_policy_correction.sequence_mask_metric", "geometric"),
        ("trainer.algorithm.off_policy_correction.geo_mask_low", 0.98),
        ("trainer.algorithm.off_policy_correction.geo_mask_high", 1.02),
    ]


def test_emit_refuses_what_the_framework_cannot_express():
    with pytest.raises(UsageError, match=r"no setting that replays rule 'kpop'.*can express"):
        config_out.emit("verl", ["kpop:phi=0.1"])
    with pytest.raises(UsageError, match=r"written as cli"):
        config_out.emit("slime:yaml", ["tis:cap=2"])
    with pytest.raises(UsageError, match=r"clamps probabilities at 1e-06"):
        config_out.emit("prime-rl", ["kpop:phi=0.1,clamp=1e-8"])
    with pytest.raises(UsageError, match=r"upper > 1"):
        config_out.emit("areal", ["icepop:low=0.5,high=1"])
    verl = config_in.read_config(CONFIGS / "verl.yaml")
    with pytest.raises(UsageError, match=r"is a verl config"):
        config_out.emit("trl", ["tis:cap=2"], base=verl)


def test_emit_skips_rows_without_a_threshold():
    row = {
        "rule": "ipo",
        "param": "eps",
        "value": 1.0,
        "spec": "ipo:eps=1",
        "status": "out of range",
        "note": "at most 0.01 masked",
    }
    text = config_out.emit("prime-rl", [row])
    assert "nothing to write" in text and "[trainer.loss]" not in text


# ----------------------------------------------------------------------------- loggers


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A real report of the golden log, and its ReportOutputs (figures, sweep, series)."""
    from mismatch_replay.viz import jobs

    d = tmp_path_factory.mktemp("report")
    jobs.report([GOLDEN], d, command="mismatch-replay report golden", bootstrap=0)
    data = analysis.figure_data([GOLDEN])
    out = outputs.collect(d, data, command="mismatch-replay report golden")
    out.choose = [c.to_dict() for c in analysis.choose([GOLDEN], 0.0025, ["ipo"], bootstrap=0)]
    return d, data, out


@pytest.mark.slow  # the module's whole report (its fixture)
def test_collect_and_step_series(report):
    d, data, out = report
    assert out.html == d / "index.html"
    assert set(out.figures) == set(outputs.FIGURE_NAMES)
    s = out.steps
    assert s["step"].to_list() == sorted(data.step_metrics["step"].to_list())
    assert "kl_k3" in s.columns and "masked_fraction/ipo@prime-rl:eps=0.3" in s.columns
    frac = data.steps.filter(pl.col("spec") == "ipo@prime-rl:eps=0.3").sort("step")
    assert s["masked_fraction/ipo@prime-rl:eps=0.3"].to_list() == frac["masked_fraction"].to_list()
    only_dir = outputs.collect(d)
    assert only_dir.steps is None and only_dir.html == d / "index.html"


@pytest.mark.slow  # a wandb offline run: its core process
def test_wandb_offline_run_read_back(report, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from mismatch_replay.integrations import wandb_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    _, data, out = report
    info = wandb_log.log_to_wandb("my-team/grpo-math/train0042", out, artifact=GOLDEN, dir=tmp_path)
    assert info["mode"] == "offline" and info["id"] == "train0042" and info["resumed"]
    assert info["complete"]  # the transaction log holds its exit record
    run_dir = Path(info["dir"])
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    back = wandb_log.read_offline_run(run_dir)
    assert back["complete"] and back["run"]["id"] == "train0042"
    assert (back["run"]["entity"], back["run"]["project"]) == ("my-team", "grpo-math")
    # the per-step series against their own step metric
    assert {"name": "mismatch_replay/step", "options": {"defined": True}} in back["metrics"]
    glob = [m for m in back["metrics"] if m.get("glob_name") == "mismatch_replay/*"]
    assert glob and glob[0]["step_metric"] == "mismatch_replay/step"
    steps = [h for h in back["history"] if "mismatch_replay/kl_k3" in h]
    sm = data.step_metrics.sort("step")
    assert [h["mismatch_replay/step"] for h in steps] == sm["step"].to_list()
    for h, want in zip(steps, sm["kl_k3"].to_list(), strict=True):
        assert h["mismatch_replay/kl_k3"] == pytest.approx(want, rel=1e-12)
    spec = "mismatch_replay/masked_fraction/icepop@prime-rl:low=0.2,high=5"
    assert all(spec in h for h in steps)
    # the figures, the sweep and choose tables, the page: one row at the last step
    media = [h for h in back["history"] if "mismatch_replay/report/page" in h]
    assert len(media) == 1
    m = media[0]
    assert m["mismatch_replay/step"] == sm["step"].max()
    files = run_dir / "files"
    for name in outputs.FIGURE_NAMES:
        img = m[f"mismatch_replay/report/figures/{name}"]
        assert img["_type"] == "image-file" and img["format"] == "png"
        assert (files / img["path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = m["mismatch_replay/report/sweep"]
    assert sweep["_type"] == "table-file" and sweep["nrows"] == data.sweep.height
    table = json.loads((files / sweep["path"]).read_text())
    assert table["columns"] == data.sweep.columns and len(table["data"]) == data.sweep.height
    choose = json.loads((files / m["mismatch_replay/report/choose"]["path"]).read_text())
    assert choose["data"][0][choose["columns"].index("rule")] == "ipo"
    page = m["mismatch_replay/report/page"]
    assert page["_type"] == "html-file"
    assert "mismatch-replay report" in (files / page["path"]).read_text()
    # summary and config
    assert back["summary"]["mismatch_replay/summary/kl_k3"] == pytest.approx(data.metrics["kl_k3"])
    assert back["config"]["mismatch_replay"]["command"] == out.command
    # the Parquet artifact
    arts = [a for a in back["artifacts"] if a.get("type") == "dataset"]
    assert [a["name"] for a in arts] == ["mismatch-replay-tokens-train0042"]
    assert "golden_log.parquet" in json.dumps(arts[0])
    # wandb's own reader of the transaction log agrees, where this wandb has one
    exe = shutil.which("wandb")
    if exe:
        res = subprocess.run(
            [exe, "leet", "inspect", "--json", str(back["path"])],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "WANDB_MODE": "offline"},
        )
        if res.returncode == 0 and res.stdout.strip():
            recs = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
            hist = [r["history"]["item"] for r in recs if r.get("type") == "history"]
            assert len(hist) == len(back["history"])
            kl = [h["mismatch_replay/kl_k3"] for h in hist if "mismatch_replay/kl_k3" in h]
            assert kl == pytest.approx(sm["kl_k3"].to_list(), rel=1e-12)


def test_wandb_init_kwargs_leave_the_users_settings_alone(tmp_path):
    from mismatch_replay.integrations.wandb_log import init_kwargs

    rep, mine, given = tmp_path / "rep", tmp_path / "mine", tmp_path / "given"

    def kw(run_id=None, env=None, **opts):
        return init_kwargs("team", "proj", run_id, name="ours", environ=env or {}, **opts)

    # nothing set: the report folder, our name and job type; no mode, no tags
    assert kw(default_dir=rep) == {
        "entity": "team",
        "project": "proj",
        "job_type": "mismatch-replay",
        "name": "ours",
        "dir": str(rep),
    }
    assert rep.is_dir()
    # WANDB_DIR set: it, not the report folder (passed on: wandb reads its environment once)
    assert kw(env={"WANDB_DIR": str(mine)}, default_dir=rep)["dir"] == str(mine)
    assert mine.is_dir()
    # an empty WANDB_DIR is unset
    assert kw(env={"WANDB_DIR": ""}, default_dir=rep)["dir"] == str(rep)
    # the caller's dir= wins over both
    assert kw(env={"WANDB_DIR": str(mine)}, dir=given, default_dir=rep)["dir"] == str(given)
    # WANDB_NAME / WANDB_JOB_TYPE win over ours; WANDB_MODE is left to wandb
    env = {"WANDB_NAME": "theirs", "WANDB_JOB_TYPE": "eval", "WANDB_MODE": "offline"}
    got = kw(env=env, default_dir=rep)
    assert (got["name"], got["job_type"]) == ("theirs", "eval") and "mode" not in got
    # a run id resumes; mode and tags only when the caller gives them
    got = kw("abc", mode="offline", tags=["x"])
    assert got == {
        "entity": "team",
        "project": "proj",
        "id": "abc",
        "resume": "allow",
        "mode": "offline",
        "tags": ["x"],
    }


@pytest.mark.slow  # a wandb offline run: its core process, ~3-6 s
def test_wandb_offline_run_goes_to_wandb_dir(report, tmp_path, monkeypatch):
    """The defect of issue 29: WANDB_DIR set, the run went into the report folder anyway."""
    pytest.importorskip("wandb")
    from mismatch_replay.integrations import wandb_log

    mine, rep = tmp_path / "mine", tmp_path / "rep"
    for k, v in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(mine),
        "WANDB_NAME": "users-name",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
    }.items():
        monkeypatch.setenv(k, v)
    _, _, out = report
    info = wandb_log.log_to_wandb("my-team/grpo-math", out, default_dir=rep)
    run_dir = Path(info["dir"])
    assert run_dir.parent == mine / "wandb" and run_dir.name.startswith("offline-run-")
    assert not (rep / "wandb").exists()
    back = wandb_log.read_offline_run(run_dir)
    assert back["complete"] and back["run"]["display_name"] == "users-name"
    assert not back["run"]["resumed"] and back["run"]["id"] == info["id"]


def test_wandb_targets():
    from mismatch_replay.integrations.wandb_log import parse_target

    assert parse_target("team/proj") == ("team", "proj", None)
    assert parse_target("team/proj/abc123") == ("team", "proj", "abc123")
    assert parse_target("https://wandb.ai/team/proj/runs/abc123?x=1") == ("team", "proj", "abc123")
    with pytest.raises(UsageError, match=r"ENTITY/PROJECT"):
        parse_target("proj")


@pytest.mark.slow  # the module's whole report (its fixture)
def test_tensorboard_event_files_read_back(report, tmp_path):
    pytest.importorskip("tensorboardX")
    from mismatch_replay.integrations import tensorboard_log

    _, data, out = report
    info = tensorboard_log.log_to_tensorboard(tmp_path / "tb", out)
    assert Path(info["event_file"]).name.startswith("events.out.tfevents.")
    ev = tensorboard_log.read_events(tmp_path / "tb")
    sm = data.step_metrics.sort("step")
    kl = ev["scalars"]["mismatch_replay/kl_k3"]
    assert [s for s, _ in kl] == sm["step"].to_list()  # at their trainer steps
    assert [v for _, v in kl] == pytest.approx(sm["kl_k3"].to_list(), rel=1e-6)  # float32
    tag = "mismatch_replay/masked_fraction/ipo_prime-rl_eps_0.3"
    frac = data.steps.filter(pl.col("spec") == "ipo@prime-rl:eps=0.3").sort("step")
    assert [v for _, v in ev["scalars"][tag]] == pytest.approx(
        frac["masked_fraction"].to_list(), rel=1e-6
    )
    for name, path in out.figures.items():
        (img,) = ev["images"][f"mismatch_replay/report/figures/{name}"]
        assert img["png"] == path.read_bytes() and img["step"] == sm["step"].max()
        assert img["width"] > 0 and img["height"] > 0
    choose = [t for tag_, ts in ev["texts"].items() if "choose" in tag_ for _, t in ts]
    assert choose and "| ipo |" in choose[0]
    # TensorBoard's own reader, where it is installed
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        return
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("mismatch_replay/kl_k3")] == sm["step"].to_list()


def test_tensorboard_reader_checks_the_framing(tmp_path):
    pytest.importorskip("tensorboardX")
    from mismatch_replay.integrations import tensorboard_log

    out = outputs.ReportOutputs(
        steps=pl.DataFrame({"step": [3, 5], "kl_k3": [0.1, 0.2]}),
    )
    info = tensorboard_log.log_to_tensorboard(tmp_path, out)
    assert tensorboard_log.read_events(tmp_path)["scalars"]["mismatch_replay/kl_k3"] == [
        (3, pytest.approx(0.1)),
        (5, pytest.approx(0.2)),
    ]
    raw = bytearray(Path(info["event_file"]).read_bytes())
    raw[-6] ^= 0xFF
    Path(info["event_file"]).write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"checksum"):
        tensorboard_log.read_events(tmp_path)


# ----------------------------------------------------------------------------- docs


def test_docs_table_names_every_checked_commit():
    text = DOCS.read_text()
    for fw in FRAMEWORKS.values():
        for c in fw.checked:
            assert c.repo in text and c.commit[:7] in text, (fw.name, c.commit)


# ----------------------------------------------------------------------------- the CLI
# The flags of docs/integrations.md, driven through the command line.


def _cli(*args):
    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _has_flag(command: str, flag: str) -> bool:
    return flag in _cli(command, "--help").stdout


def test_cli_choose_from_config_emit_round_trip(tmp_path):
    assert _has_flag("choose", "--emit")
    res = _cli(
        "choose",
        GOLDEN,
        "-t",
        "0.02",
        "--bootstrap",
        "0",
        "--from-config",
        CONFIGS / "prime-rl.toml",
        "--emit",
        "prime-rl",
    )
    assert res.exit_code == 0, res.stderr
    assert res.stdout.startswith("# mismatch-replay choose: ipo@prime-rl eps=")  # the override
    assert "threshold masking 2% of tokens" in res.stderr  # the table went to stderr
    over = tmp_path / "chosen.toml"
    over.write_text(res.stdout)
    back = config_in.read_config(over)
    (row,) = analysis.choose([GOLDEN], 0.02, ["ipo@prime-rl:eps=0.2"], bootstrap=0)
    assert back.specs() == [row.spec]
    bad = _cli("choose", GOLDEN, "-t", "0.02", "--emit", "slime:yaml")
    assert bad.exit_code == 2 and "written as cli" in bad.stderr


@pytest.mark.slow  # a wandb offline run: its core process, and a whole report
def test_cli_report_wandb_and_tensorboard(tmp_path, monkeypatch):
    assert _has_flag("report", "--wandb") and _has_flag("report", "--tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboardX")
    from mismatch_replay.integrations import tensorboard_log, wandb_log

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(k, str(tmp_path / k.lower()))
    out = tmp_path / "rep"
    res = _cli(
        "report",
        GOLDEN,
        "-o",
        out,
        "--bootstrap",
        "0",
        "--from-config",
        CONFIGS / "areal.yaml",
        "--wandb",
        "team/proj/run7",
        "--wandb-artifact",
        "--tensorboard",
        tmp_path / "tb",
    )
    assert res.exit_code == 0, res.stderr
    back = wandb_log.read_offline_run(out / "wandb")
    assert back["run"]["id"] == "run7"
    assert any(
        "mismatch_replay/masked_fraction/icepop@areal:low=0.5,high=5" in h for h in back["history"]
    )
    assert [a["name"] for a in back["artifacts"] if a.get("type") == "dataset"] == [
        "mismatch-replay-tokens-run7"
    ]
    ev = tensorboard_log.read_events(tmp_path / "tb")
    assert "mismatch_replay/masked_fraction/m2po_areal_tau_0.04" in ev["scalars"]


def test_out_of_domain_settings_are_refused_before_emit():
    with pytest.raises(UsageError, match=r"icepop's high must be >= 1, got 0.9"):
        config_out.emit("areal", ["icepop:low=0.5,high=0.9"])


def test_sweep_from_config_replays_the_configs_rules():
    from typer.testing import CliRunner

    from mismatch_replay import engine
    from mismatch_replay.cli import app

    golden = GOLDEN
    res = CliRunner().invoke(
        app, ["sweep", str(golden), "--from-config", str(CONFIGS / "verl.yaml"), "--json"]
    )
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    specs = config_in.read_config(CONFIGS / "verl.yaml").specs()
    assert [r["spec"] for r in rows] == specs
    want = engine.sweep([golden], rules=specs).table
    assert [r["masked_tokens"] for r in rows] == want["masked_tokens"].to_list()
    assert "verl config:" in res.stderr
