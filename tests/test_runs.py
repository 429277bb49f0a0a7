"""drift --run: several runs side by side (analysis/runs.py, cli/render_runs.py, viz/runs.py),
the canonical `reward` column, and the rule mask the simulator's --loss trains with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import brute
import numpy as np
import polars as pl
import pytest
from conftest import logs
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mismatch_replay import analysis, ingest
from mismatch_replay.analysis.runs import COLLAPSE, Run, drift_runs, parse_runs, runs_findings
from mismatch_replay.cli import app
from mismatch_replay.errors import UsageError
from mismatch_replay.rules import parse_rule
from mismatch_replay.rules.mask import token_mask

runner = CliRunner()
DATA = Path(__file__).resolve().parents[1] / "data"
IPO, ICEPOP = "ipo:eps=0.3", "icepop:low=0.2,high=5"


def with_rewards(df: pl.DataFrame, seed: int) -> pl.DataFrame:
    """One reward per (step, sample_id), on each of its tokens."""
    keys = df.select("step", "sample_id").unique(maintain_order=True)
    rng = np.random.default_rng(seed)
    keys = keys.with_columns(reward=pl.Series(rng.integers(0, 5, keys.height) / 4.0))
    return df.join(keys, on=["step", "sample_id"], how="left", maintain_order="left")


def brute_steps(df: pl.DataFrame, specs: list[str]) -> dict[int, dict]:
    """Per step, by numpy and brute.py alone: loss tokens, k3 token mean (unclamped, fsum),
    masked fraction of each setting, mean reward over sequences."""
    df = df.filter(pl.col("loss_mask"))
    out = {}
    for (step,), g in df.group_by("step"):
        lp = g["trainer_logprob"].to_numpy()
        lq = g["inference_logprob"].to_numpy()
        l = lp - lq  # noqa: E741
        with np.errstate(over="ignore"):
            k3 = math.fsum((np.expm1(l) - l).tolist()) / len(l)
        row = {"tokens": g.height, "k3": k3}
        for spec in specs:
            name, params = brute.parse_spec(spec)
            got = brute.evaluate(g, name, params)[None]
            row[spec] = got["masked_tokens"] / got["tokens"]
        if "reward" in g.columns:
            per_seq = g.unique(["sample_id"], keep="first")["reward"].to_numpy()
            row["reward"] = float(per_seq.mean())
        out[int(step)] = row
    return out


def write(path: Path, df: pl.DataFrame) -> Path:
    df.write_parquet(path)
    return path


LOGS = {"a": logs(max_steps=4, max_seqs=3, max_len=6), "b": logs(max_steps=4)}


@settings(max_examples=8, deadline=None)
@given(**LOGS, seed=st.integers(0, 9))
def test_two_runs_equal_each_runs_own_drift_and_brute_force(tmp_path_factory, a, b, seed):
    """drift_runs over two runs gives each run's own drift (the same rows as drift on that log
    alone), and its per-step k3, masked fractions and rewards are the brute force's."""
    two_runs_property(tmp_path_factory, a, b, seed)


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(**LOGS, seed=st.integers(0, 9))
def test_two_runs_property_at_length(tmp_path_factory, a, b, seed):
    """The same property over ten times as many logs (slow)."""
    two_runs_property(tmp_path_factory, a, b, seed)


def two_runs_property(tmp_path_factory, a, b, seed):
    for df in (a, b):
        assume(df.filter(pl.col("loss_mask"))["step"].n_unique() >= 2)
    d = tmp_path_factory.mktemp("runs")
    a = with_rewards(a.with_columns(pl.col("sample_id").cast(pl.String)), seed)
    pa, pb = write(d / "a.parquet", a), write(d / "b.parquet", b)
    small = ingest.ReadOptions(batch_rows=5)  # sequences split across batches
    res = drift_runs([Run("a", (pa,), small, (IPO,)), Run("b", (pb,), rules=(ICEPOP,))], [ICEPOP])
    assert res.names == ["a", "b"] and res.rules == [ICEPOP]
    for name, path, df, own, opts in (("a", pa, a, IPO, small), ("b", pb, b, ICEPOP, None)):
        specs = list(dict.fromkeys([own, ICEPOP]))
        alone = analysis.drift([path], rules=specs, options=opts)  # the same batches
        rr = res[name]
        assert [s.to_dict() for s in rr.drift.steps] == [s.to_dict() for s in alone.steps]
        assert [v.to_dict() for v in rr.drift.rules] == [v.to_dict() for v in alone.rules]
        want = brute_steps(df, [own, ICEPOP])
        table = res.table.filter(pl.col("run") == name)
        assert table["step"].to_list() == sorted(want)
        for row in table.iter_rows(named=True):
            w = want[row["step"]]
            assert row["tokens"] == w["tokens"]
            assert row["kl_k3"] == pytest.approx(w["k3"], rel=1e-9, abs=1e-15)
            assert row["masked_own"] == w[own]
            assert row[f"masked:{ICEPOP}"] == w[ICEPOP]
            assert row["own_rule"] == own
            if "reward" in w:
                assert row["reward_mean"] == pytest.approx(w["reward"], rel=1e-12)
            else:
                assert row["reward_mean"] is None
    assert res["a"].reward_over == "sequences" and res["b"].reward_over is None


def drift_log(path: Path, drift_from: int | None, steps: int = 20, seed: int = 7) -> Path:
    """k3 flat, then (from `drift_from`) climbing x9 a step; ratios stay inside [1e-4, 1e4]."""
    rng = np.random.default_rng(seed)
    frames = []
    for step in range(steps):
        n = 4000
        lq = -rng.exponential(0.3, n)
        sd = 0.02
        if drift_from is not None and step >= drift_from:
            sd *= 3 ** (step - drift_from + 1)
        lp = np.minimum(lq + rng.normal(0, min(sd, 2.0), n), 0.0)
        frames.append(
            pl.DataFrame(
                {
                    "step": np.full(n, step),
                    "sample_id": np.repeat(np.arange(40), 100),
                    "trainer_logprob": lp,
                    "inference_logprob": lq,
                    "entropy": np.full(n, 1.0 - step / 40),
                }
            )
        )
    pl.concat(frames).write_parquet(path)
    return path


def test_verdicts_on_constructed_runs(tmp_path):
    """One run departs at step 12 (its own rule follows), one departs at 15 under a band its
    drift never leaves (the collapse signature), one never departs (and names no rule)."""
    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    late = drift_log(tmp_path / "late.parquet", drift_from=15, seed=8)
    quiet = drift_log(tmp_path / "quiet.parquet", drift_from=None, seed=9)
    wide = "icepop:low=0.0001,high=10000"
    res = drift_runs(
        [
            Run("up", (up,), rules=("ipo:eps=0.05",)),
            Run("late", (late,), rules=(wide,)),
            Run("quiet", (quiet,)),
        ]
    )
    v = {r.run.name: r.verdict for r in res.runs}
    assert v["up"].departs_at == 12 and v["up"].drift_steps == list(range(12, 20))
    assert v["up"].collapse is False
    assert v["up"].rule_verdicts["ipo:eps=0.05"] == "rose with the mismatch"
    assert v["late"].departs_at == 15 and v["late"].collapse is True
    assert v["late"].rule_verdicts[wide] == COLLAPSE
    assert v["quiet"].departs_at is None and not v["quiet"].drifted
    assert v["quiet"].collapse is None and v["quiet"].own_rules == []
    # a run with no rule of its own: every run also gets drift's default settings
    assert res.rules and all(s in v["quiet"].rule_verdicts for s in res.rules)
    # late / early k3: token means over the last and the first baseline-many steps (numpy)
    df = pl.read_parquet(up)
    k3 = (
        df.with_columns(l=pl.col("trainer_logprob") - pl.col("inference_logprob"))
        .with_columns(k3=pl.col("l").exp() - 1 - pl.col("l"))
        .group_by("step")
        .agg(pl.col("k3").mean())
        .sort("step")["k3"]
        .to_numpy()
    )
    n = len(res["up"].drift.baseline_steps)
    assert n == 4  # 20% of 20 steps
    assert v["up"].late_early_k3 == pytest.approx(k3[-n:].mean() / k3[:n].mean(), rel=1e-9)
    assert v["quiet"].late_early_k3 == pytest.approx(1.0, abs=0.15)
    # entropy per step: the logged value
    assert res["up"].entropy[10] == pytest.approx(0.75)
    # the sentences quote the numbers
    found = runs_findings(res)
    up_s = found.get("run:up")
    assert up_s.value("run0.departs_at") == 12 and "step 12" in up_s.sentence
    assert "collapse signature" in found.get("run:late").sentence
    assert "no drift" in found.get("run:quiet").sentence
    top = found.get("runs")
    assert top.sentence.startswith("Of the 3 runs, k3 rose most in up")


def test_parse_runs_and_their_errors(tmp_path):
    cfg = tmp_path / "icepop.toml"
    cfg.write_text('[trainer.loss]\ntype = "default"\nicepop_ratio_low = 0.2\n')
    runs = parse_runs(
        ["ipo=a.parquet", "icepop=b.parquet", "ipo=c.parquet"],
        [f"icepop={cfg}"],
        ["ipo=ipo@prime-rl"],
    )
    assert [r.name for r in runs] == ["ipo", "icepop"]
    assert runs[0].sources == ("a.parquet", "c.parquet") and runs[0].rules == ("ipo@prime-rl",)
    assert runs[1].rules == ("icepop@prime-rl:low=0.2,high=5",)
    bad = [
        ((["ipo"],), "--run 'ipo': give NAME=SOURCES, e.g. --run icepop=logs/icepop."),
        ((["=x"],), "--run '=x': give NAME=SOURCES"),
        ((["a/b=x"],), "the run name 'a/b' may not hold"),
        ((["a=x"], ["b=f.toml"]), "--run-config b=...: no --run names 'b' (runs: a)"),
        ((["a=x"], [], ["a"]), "--run-rule 'a': give NAME=SPEC, e.g. --run-rule icepop="),
        ((["a=x"], [], ["a=nosuchrule"]), "nosuchrule"),
        (([],), "give at least one --run NAME=SOURCES."),
    ]
    for args, text in bad:
        with pytest.raises(UsageError) as e:
            parse_runs(*args)
        assert text in str(e.value)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--run", "ipo"], "--run 'ipo': give NAME=SOURCES"),
        (["x.parquet", "--run", "a=y.parquet"], "give SOURCES or --run NAME=SOURCES, not both"),
        (["--run-rule", "a=ipo"], "--run-rule names a run's own rule; give the runs with --run"),
        ([], "drift needs SOURCES, or the runs of an ablation as --run NAME=SOURCES."),
        (["--run", "a=x", "--run-config", "b=y.toml"], "no --run names 'b'"),
    ],
)
def test_cli_run_errors(args, text):
    r = runner.invoke(app, ["drift", *args])
    assert r.exit_code == 2, r.output
    assert text in " ".join(r.stderr.split())


def test_cli_drift_runs_json_and_table(tmp_path):
    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    quiet = drift_log(tmp_path / "quiet.parquet", drift_from=None, seed=9)
    args = ["drift", "--run", f"up={up}", "--run", f"quiet={quiet}", "--run-rule", "up=ipo"]
    r = runner.invoke(app, [*args, "-r", ICEPOP, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert [x["run"] for x in d["runs"]] == ["up", "quiet"]
    assert d["runs"][0]["verdict"]["departs_at"] == 12 and d["rules"] == [ICEPOP]
    assert d["runs"][0]["own_rules"] == ["ipo"]
    assert d["findings"][0]["numbers"]["run0.departs_at"] == 12
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.stderr
    assert "verdict per run" in r.stdout and "What these runs say" in r.stderr


def test_reward_column_from_parquet_and_nemo_rl(tmp_path):
    p = tmp_path / "r.parquet"
    pl.DataFrame(
        {
            "trainer_logprob": [-0.1, -0.2, -0.3],
            "inference_logprob": [-0.1, -0.25, -0.3],
            "sample_id": [0, 0, 1],
            "rewards": [1, 1, 0],  # the NeMo-RL name, integers
        }
    ).write_parquet(p)
    t = ingest.read_table([p])
    assert t["reward"].dtype == pl.Float64 and t["reward"].to_list() == [1.0, 1.0, 0.0]
    f = tmp_path / "train_data_step3.jsonl"
    with f.open("w") as fh:
        for i in range(3):  # NeMo-RL's layout: every field a one-element list
            rec = {
                "token_ids": [[1, 2, 3]],
                "token_loss_mask": [[0, 1, 1]],
                "generation_logprobs": [[-0.1, -0.2, -0.3]],
                "prev_logprobs": [[-0.1, -0.21, -0.3]],
                "rewards": [0.5 * i],
                "input_lengths": [3],
                "idx": i,
            }
            fh.write(json.dumps(rec) + "\n")
    t = ingest.read_table([f])
    assert t["reward"].to_list() == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert t["sample_id"].to_list() == [0, 0, 1, 1, 2, 2]


@settings(max_examples=40, deadline=None)
@given(df=logs(max_steps=2, max_seqs=3, max_len=8), which=st.sampled_from(range(6)))
def test_token_mask_is_the_brute_forces_mask(df, which):
    """The simulator's loss mask (rules.mask.token_mask) masks what brute.py masks."""
    spec = [IPO, "ipo:eps=0.01", ICEPOP, "kpop:phi=0.1,clamp=1e-6", "dppo-tv:low=0.2,high=0.2",
            "token-k3:hi=0.01"][which]  # fmt: skip
    df = df.filter(pl.col("loss_mask"))
    got = token_mask(
        parse_rule(spec),
        df["trainer_logprob"].to_numpy(),
        df["inference_logprob"].to_numpy(),
        df["advantage"].to_numpy(),
    )
    name, params = brute.parse_spec(spec)
    L = brute.Log(df)
    want = [brute._token_masked(name, params, L, i) for i in range(L.n)]
    assert got.tolist() == want


def test_token_mask_refuses_what_is_no_token_mask():
    for spec in ("tis", "seq-mis", "m2po"):
        with pytest.raises(UsageError, match="a loss mask needs a token masking rule"):
            token_mask(parse_rule(spec), np.zeros(2), np.zeros(2))


@pytest.mark.slow
def test_runs_png(tmp_path):
    """runs.png: the panels stacked (k3 log, own rule's masked %, entropy, reward where
    logged), one line a run in each, the departure steps marked."""
    from mismatch_replay.viz.runs import RUN_COLORS, runs_figure, write_runs

    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    quiet = drift_log(tmp_path / "quiet.parquet", drift_from=None, seed=9)
    res = drift_runs([Run("up", (up,), rules=("ipo",)), Run("quiet", (quiet,))], [ICEPOP])
    fig = runs_figure(res.table, departs={"up": 12, "quiet": None})
    axes = fig.axes
    assert len(axes) == 3  # no reward logged: k3, masked, entropy
    assert axes[0].get_yscale() == "log"
    for a, panel in zip(axes, ("k3", "masked_own", "entropy_mean"), strict=True):
        lines = {ln.get_gid(): ln for ln in a.get_lines()}
        assert {f"{panel}:up", f"{panel}:quiet"} <= set(lines)
        assert lines[f"{panel}:up"].get_color() == RUN_COLORS[0]
        assert lines["departs:up"].get_xdata()[0] == 12
    own = {ln.get_gid(): ln for ln in axes[1].get_lines()}
    want = 100 * res.table.filter(pl.col("run") == "up")["masked_own"].to_numpy()
    assert np.allclose(own["masked_own:up"].get_ydata(), want)
    assert len(own["masked_own:quiet"].get_xdata()) == 0  # no rule of its own: no line
    path = write_runs(res, tmp_path)
    assert path.name == "runs.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UsageError, match="exists"):
        write_runs(res, tmp_path)


def test_bundled_arms(tmp_path):
    """data/arms/ipo.parquet and data/arms/icepop.parquet: the IPO arm's rule follows its
    mismatch, the IcePop arm's stays flat (the collapse signature)."""
    a, b = DATA / "arms" / "ipo.parquet", DATA / "arms" / "icepop.parquet"
    assert a.stat().st_size < 2 << 20 and b.stat().st_size < 2 << 20
    runs = parse_runs(
        [f"ipo={a}", f"icepop={b}"],
        [f"ipo={DATA / 'arms' / 'ipo.toml'}", f"icepop={DATA / 'arms' / 'icepop.toml'}"],
    )
    res = drift_runs(runs)
    assert res["ipo"].verdict.collapse is False and res["icepop"].verdict.collapse is True
    assert res["ipo"].reward_over == "sequences"
    # the arms start from one seed: identical until the first token either rule masks
    t = res.table
    ia = t.filter(pl.col("run") == "ipo")
    ib = t.filter(pl.col("run") == "icepop")
    assert ia["kl_k3"][0] == ib["kl_k3"][0]
    assert ia["kl_k3"].to_list() != ib["kl_k3"].to_list()


@pytest.mark.slow
def test_simulate_loss_masks_the_update(tmp_path):
    """--loss SPEC: the rule's mask in the loss changes the run (from the first step with a
    masked token on), and the log gains the sample's reward on each of its tokens."""
    from mismatch_replay.simulate import SimConfig, simulate

    base = SimConfig(scenario="drift", steps=5, batch=32, seq_len=8, pretrain_steps=20)
    s0 = simulate(base, tmp_path / "none.parquet")
    s1 = simulate(SimConfig(**{**base.__dict__, "loss": "ipo:eps=0.01"}), tmp_path / "m.parquet")
    assert len(s1["loss_masked_per_step"]) == 5 and max(s1["loss_masked_per_step"]) > 0
    assert s0["loss_masked_per_step"] == []
    a, b = pl.read_parquet(tmp_path / "none.parquet"), pl.read_parquet(tmp_path / "m.parquet")
    assert not a["trainer_logprob"].equals(b["trainer_logprob"])
    per_seq = b.group_by("step", "sample_id").agg(pl.col("reward").n_unique())
    assert per_seq["reward"].max() == 1
    with pytest.raises(ValueError, match="a loss mask needs a token masking rule"):
        SimConfig(loss="tis").validate()


@pytest.mark.slow
def test_cli_plot_and_report_runs(tmp_path):
    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    quiet = drift_log(tmp_path / "quiet.parquet", drift_from=None, seed=9)
    runs = ["--run", f"up={up}", "--run", f"quiet={quiet}", "--run-rule", "up=ipo"]
    r = runner.invoke(app, ["plot", *runs, "-o", str(tmp_path / "p")])
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "p" / "runs.png").read_bytes()[:4] == b"\x89PNG"
    r = runner.invoke(app, ["report", *runs, "-o", str(tmp_path / "r")])
    assert r.exit_code == 0, r.stderr
    page = (tmp_path / "r" / "index.html").read_text()
    assert "What these runs say" in page and "departs from its own baseline at step 12" in page
    assert page.count("data:image/png;base64,") == 1
    t = pl.read_csv(tmp_path / "r" / "runs.csv")
    assert t["run"].unique(maintain_order=True).to_list() == ["up", "quiet"]
    r = runner.invoke(app, ["report", *runs, "-o", str(tmp_path / "r")])
    assert r.exit_code != 0 and "exists; pass --force" in " ".join(r.stderr.split())
    r = runner.invoke(app, ["report", *runs, "--from-config", "x.toml"])
    assert r.exit_code == 2 and "--run-config NAME=FILE" in " ".join(r.stderr.split())


@pytest.mark.slow
@pytest.mark.parametrize("cols", (80, 120))
def test_drift_runs_in_a_pty(cols, tmp_path):
    """drift --run on the bundled arms in a real terminal: every table fits the width (no
    cut, no wrapped line), the verdicts and the findings are there with their numbers."""
    from test_pty import check, run_pty, words

    arms = DATA / "arms"
    args = [
        "drift",
        "--run",
        f"ipo={arms / 'ipo.parquet'}",
        "--run",
        f"icepop={arms / 'icepop.parquet'}",
    ]
    args += [
        "--run-config",
        f"ipo={arms / 'ipo.toml'}",
        "--run-config",
        f"icepop={arms / 'icepop.toml'}",
    ]
    out = check(*run_pty(args, cols, tmp_path, rows=200), cols, "drift")
    w = words(out)
    assert {"verdict", "x11.2", "x10.3", "rose", "collapse", "signature"} <= w
    assert "What these runs say" in out and "departs from its own baseline at step 11" in " ".join(
        out.split()
    )
    assert ("entropy" in w) and ("reward" in w)


def test_token_writer_rewards_and_the_verl_hook(tmp_path):
    """TokenWriter.write(rewards=[B]) writes each sequence's reward on its tokens (sampled
    rows too); verl_batch takes it from token_level_scores summed over the response."""
    import torch
    from test_capture import _batch, _DataProto, _read, _writer

    from mismatch_replay.capture import hooks

    lp, lq, mask, adv = _batch(0)
    rewards = np.array([1.0, 0.0, 0.5, 2.0])
    with _writer(tmp_path / "w") as w:
        w.write(step=0, trainer_logprobs=lp, inference_logprobs=lq, mask=mask, rewards=rewards)
    got = _read(tmp_path / "w")
    assert got["reward"].to_list() == [rewards[s] for s in got["sample_id"].to_list()]
    with _writer(tmp_path / "s", max_tokens_per_step=int(mask.sum(1)[0]) + 1, seed=1) as w:
        w.write(step=0, trainer_logprobs=lp, inference_logprobs=lq, mask=mask, rewards=rewards)
    got = _read(tmp_path / "s")  # rows sampled: each kept row keeps its own reward
    assert got.height and got["reward"].to_list() == [rewards[s] for s in got["sample_id"]]
    with _writer(tmp_path / "bad") as w:
        with pytest.raises(ValueError, match=r"rewards: expected one value per sequence \(4\)"):
            w.write(step=0, trainer_logprobs=lp, inference_logprobs=lq, rewards=[1.0])
        with pytest.raises(ValueError, match="rewards: 1 of 4 are NaN or infinite"):
            w.write(step=0, trainer_logprobs=lp, inference_logprobs=lq, rewards=[1, 2, np.nan, 0])
    scores = torch.zeros_like(lp)
    scores[torch.arange(4), mask.sum(1) - 1] = torch.tensor([1.0, 0.0, 1.0, 0.0])  # last token
    batch = _DataProto(
        {"old_log_probs": lp, "rollout_log_probs": lq, "response_mask": mask,
         "advantages": adv[:, None] * mask, "token_level_scores": scores},
        {},
    )  # fmt: skip
    with _writer(tmp_path / "verl") as w:
        hooks.verl_batch(w, batch, step=2)
    got = _read(tmp_path / "verl")
    assert got["reward"].to_list() == [[1.0, 0.0, 1.0, 0.0][s] for s in got["sample_id"]]


def renamed(path: Path, out: Path) -> Path:
    """The log with its own column names (as another trainer writes them)."""
    names = {"trainer_logprob": "actor_lp", "inference_logprob": "rollout_lp", "sample_id": "uid"}
    pl.read_parquet(path).rename(names).write_parquet(out)
    return out


RUN_MAP = ["trainer_logprob=actor_lp", "inference_logprob=rollout_lp", "sample_id=uid"]


def test_run_map_gives_each_run_the_drift_of_its_log_with_that_map(tmp_path):
    """--run-map NAME:CANONICAL=THEIRS is that run's --map: a run whose log uses other names
    gets the drift `drift LOG --map ...` gives that log, the canonical run the drift of its
    own; without the map the renamed run cannot be read."""
    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    theirs = renamed(
        drift_log(tmp_path / "late.parquet", drift_from=15, seed=8), tmp_path / "t.parquet"
    )
    runs = ["--run", f"up={up}", "--run", f"late={theirs}", "--run-rule", "up=ipo"]
    maps = [x for m in RUN_MAP for x in ("--run-map", f"late:{m}")]
    r = runner.invoke(app, ["drift", *runs, *maps, "-r", ICEPOP, "--json"])
    assert r.exit_code == 0, r.stderr
    got = {x["run"]: x["drift"] for x in json.loads(r.stdout)["runs"]}
    for name, args in (
        ("up", [str(up), "-r", "ipo", "-r", ICEPOP]),
        ("late", [str(theirs), *[x for m in RUN_MAP for x in ("--map", m)], "-r", ICEPOP]),
    ):
        alone = runner.invoke(app, ["drift", *args, "--json"])
        assert alone.exit_code == 0, alone.stderr
        want = json.loads(alone.stdout)
        for key in ("precision_notes", "schema_version"):  # the whole output's, not drift's
            want.pop(key, None)
        assert got[name] == want, name
    assert got["late"] != got["up"]
    r = runner.invoke(app, ["drift", *runs, "-r", ICEPOP, "--json"])  # no map: not readable
    assert r.exit_code != 0 and "trainer_logprob" in r.stderr


def test_with_read_options_merges_the_shared_ones(tmp_path):
    """The shared read options apply to every run; a run's own --run-map adds to (and wins
    over) the shared mapping, --run-format replaces the shared format, --run-probs sets probs."""
    from mismatch_replay.cli.runs import with_read_options

    runs = parse_runs(["a=x.parquet", "b=y.jsonl"])
    shared = ingest.ReadOptions(mapping={"advantage": "adv", "entropy": "ent"}, batch_rows=7)
    a, b = with_read_options(
        runs,
        shared,
        ["b:entropy=H", "b:reward=score", "b:entropy=H2"],
        ["b=jsonl"],
        ["b"],
    )
    assert a.options == shared
    assert b.options.mapping == {"advantage": "adv", "entropy": "H2", "reward": "score"}
    assert b.options.format == "jsonl" and b.options.probs and b.options.batch_rows == 7
    (c,) = with_read_options(
        parse_runs(["c=z"]), ingest.ReadOptions(format="jsonl"), (), ["c=auto"]
    )
    assert c.options.format is None  # auto: detected from the paths


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["--run-map", "zz:entropy=H"], "--run-map 'zz:entropy=H': no --run names 'zz' (runs: a)"),
        (["--run-map", "a=entropy"], "--run-map 'a=entropy': give NAME:CANONICAL=THEIRS"),
        (["--run-map", "a:entropy"], "--run-map 'a:entropy': give NAME:CANONICAL=THEIRS"),
        (["--run-format", "a"], "--run-format 'a': give NAME=FORMAT"),
        (["--run-format", "a=csv"], "run 'a': unknown format 'csv'; known formats: auto,"),
        (["--run-format", "zz=jsonl"], "--run-format 'zz=jsonl': no --run names 'zz'"),
        (["--run-format", "a=jsonl", "--run-format", "a=parquet"], "run 'a' is given two formats"),
        (["--run-probs", "zz"], "--run-probs 'zz': no --run names 'zz'"),
    ],
)
def test_cli_run_read_option_errors(args, text):
    r = runner.invoke(app, ["drift", "--run", "a=x.parquet", *args])
    assert r.exit_code == 2, r.output
    assert text in " ".join(r.stderr.split())


def test_cli_run_read_options_need_runs():
    r = runner.invoke(app, ["drift", "x.parquet", "--run-map", "a:entropy=H"])
    assert r.exit_code == 2
    assert "--run-map gives a run's own read options; give the runs with --run too" in " ".join(
        r.stderr.split()
    )


TWO_OWN = ("ipo:eps=0.05", "icepop:low=0.0001,high=10000")


def test_every_own_rule_in_the_table_and_the_verdicts(tmp_path):
    """A run with two own rules: the long table holds both (own_rule / masked_own, then
    own_rule_2 / masked_own_2), each equal to drift's masked fraction of that rule; the
    CLI's step table has a column, and the verdict table a row, for each."""
    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    quiet = drift_log(tmp_path / "quiet.parquet", drift_from=None, seed=9)
    res = drift_runs([Run("up", (up,), rules=TWO_OWN), Run("quiet", (quiet,), rules=("ipo",))])
    t = res.table
    assert {"own_rule_2", "masked_own_2"} <= set(t.columns) and "own_rule_3" not in t.columns
    alone = analysis.drift([up], rules=list(TWO_OWN))
    want = {s.step: s.masked for s in alone.steps}
    for row in t.filter(pl.col("run") == "up").iter_rows(named=True):
        assert row["own_rule"] == TWO_OWN[0] and row["own_rule_2"] == TWO_OWN[1]
        assert row["masked_own"] == want[row["step"]][TWO_OWN[0]]
        assert row["masked_own_2"] == want[row["step"]][TWO_OWN[1]]
    q = t.filter(pl.col("run") == "quiet")
    assert q["own_rule_2"].null_count() == q.height == q["masked_own_2"].null_count()
    v = res["up"].verdict
    assert v.rule_verdicts[TWO_OWN[0]] == "rose with the mismatch"
    assert v.rule_verdicts[TWO_OWN[1]] == COLLAPSE and v.collapse is True
    args = ["drift", "--run", f"up={up}", "--run", f"quiet={quiet}", "--run-rule", "quiet=ipo"]
    args += [x for s in TWO_OWN for x in ("--run-rule", f"up={s}")]
    r = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    verdicts = r.stdout[r.stdout.index("verdict per run") :]
    rows = [ln.split("│") for ln in verdicts.splitlines() if "│" in ln]
    cells = [[c.strip() for c in row] for row in rows]
    assert [c[0] for c in cells] == ["up", "", "quiet"]
    assert [c[-1] for c in cells] == ["rose", "flat: collapse signature", "no drift"]
    assert cells[1][4].startswith("icepop:low=0.0001")
    steps = r.stdout[: r.stdout.index("verdict per run")]
    assert "eps=0.05" in steps and "low=0.0001" in steps and "eps=0.3" in steps
    row12 = next(ln for ln in steps.splitlines() if ln.strip().startswith("12 "))
    # step; up: k3, its two rules, entropy; quiet: k3, its rule, entropy
    cells12 = [c.strip() for c in row12.split("│")]
    assert len(cells12) == 8
    assert cells12[2] == f"{100 * want[12][TWO_OWN[0]]:.3g}%"


@pytest.mark.slow
def test_runs_png_draws_every_own_rule(tmp_path):
    """runs.png's masked panel: a line for each own rule of a run, in the run's colour, one
    line style a rule; a rule at 0 at every step says so in the legend."""
    from mismatch_replay.viz.runs import RUN_COLORS, runs_figure

    up = drift_log(tmp_path / "up.parquet", drift_from=12)
    quiet = drift_log(tmp_path / "quiet.parquet", drift_from=None, seed=9)
    res = drift_runs([Run("up", (up,), rules=TWO_OWN), Run("quiet", (quiet,), rules=("ipo",))])
    fig = runs_figure(res.table)
    lines = {ln.get_gid(): ln for ln in fig.axes[1].get_lines()}
    assert set(lines) == {"masked_own:up", "masked_own_2:up", "masked_own:quiet"}
    a, b = lines["masked_own:up"], lines["masked_own_2:up"]
    assert a.get_color() == b.get_color() == RUN_COLORS[0]
    assert a.get_linestyle() != b.get_linestyle()
    t = res.table.filter(pl.col("run") == "up")
    assert np.allclose(b.get_ydata(), 100 * t["masked_own_2"].to_numpy())
    labels = fig.axes[1].get_legend_handles_labels()[1]
    assert labels[1] == "up: IcePop low=0.0001, high=10000: 0 at every step"
    assert fig.axes[1].get_ylabel().startswith("masked, own rules")
