"""Framework adapters: prime-rl, NeMo-RL, slime, list-column Parquet and JSONL, and hardening.

The fixtures are written here from the golden canonical log (8 steps, 96 sequences), in each
framework's on-disk layout (RULES.md, "On-disk token logs in the wild"), and every format must
replay to the very same counts as the golden Parquet log. `write_format` is shared with
test_convert.py.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import GOLDEN_LOG, assert_tables_equal
from typer.testing import CliRunner

from mismatch_replay import adapters, engine, io
from mismatch_replay.cli import app
from mismatch_replay.errors import DataError, UsageError

torch = pytest.importorskip("torch")

FORMATS = ("parquet", "lists", "jsonl", "jsonl-lists", "prime-rl", "nemo-rl", "slime")
SPECS = [
    "ipo:eps=0.05",
    "icepop@prime-rl",
    "kpop@prime-rl",
    "dppo-tv",
    "seq-mis@verl",
    "m2po:tau=0.001",
]
COLS = ["step", "position", "trainer_logprob", "inference_logprob", "advantage"]
runner = CliRunner()


# ----------------------------------------------------------------------------- fixture writers


def _sequences(df: pl.DataFrame):
    """(step, [sequence frames sorted by position]) per step, sequences in sample_id order."""
    df = df.sort("step", "sample_id", "position")
    for (step,), part in df.group_by("step", maintain_order=True):
        yield int(step), [g for _, g in part.group_by("sample_id", maintain_order=True)]


def write_prime(df: pl.DataFrame, root: Path, ranks: int = 2, stable: bool = True) -> Path:
    """prime-rl token export: token_exports/step_<n>/rank_<r>.jsonl, one object per sequence.

    Index 0 of every array is the pad (null log-probs, loss_mask false), so the golden tokens
    sit at positions 1..n."""
    out = root / "token_exports"
    for step, seqs in _sequences(df):
        d = out / f"step_{step}"
        d.mkdir(parents=True)
        per = -(-len(seqs) // ranks)
        for r in range(ranks):
            with open(d / f"rank_{r}.jsonl", "w") as f:
                for k, g in enumerate(seqs[r * per : (r + 1) * per]):
                    n = g.height
                    lp, lq = g["trainer_logprob"].to_list(), g["inference_logprob"].to_list()
                    rec = {
                        "schema_version": 1,
                        "step": step,
                        "rank": r,
                        "micro_step": 0,
                        "micro_sequence_idx": k,
                        "export_sequence_idx": k,
                        "env_name": g["env"][0],
                        "token_ids": list(range(100, 101 + n)),
                        "position_ids": list(range(n + 1)),
                        "loss_mask": [False, *g["loss_mask"].to_list()],
                        "advantages": [0.0, *g["advantage"].to_list()],
                        "inference_logprobs": [None, *lq],
                        "trainer_logprobs": [None, *lp],
                        "entropy": [None, *(abs(x) for x in lq)],
                        "mismatch_kl": [None] * (n + 1),
                        "log_importance_ratio": [
                            None,
                            *(a - b for a, b in zip(lp, lq, strict=True)),
                        ],
                        "is_masked": [False] * (n + 1),
                    }
                    f.write(json.dumps(rec) + "\n")
        if stable:
            (d / "STABLE").write_text("")
    return out


def write_nemo(df: pl.DataFrame, root: Path) -> Path:
    """NeMo-RL train_data_step<N>.jsonl: one object per sample, arrays padded to the step's
    longest sample (cut back by input_lengths), 0/1 integer masks."""
    root.mkdir(parents=True, exist_ok=True)
    for step, seqs in _sequences(df):
        width = max(g.height for g in seqs)
        with open(root / f"train_data_step{step}.jsonl", "w") as f:
            for g in seqs:
                n = g.height
                pad = [0.0] * (width - n)
                rec = {
                    "content": [{"role": "user", "content": "2+2?"}],
                    "rewards": 1.0,
                    "input_lengths": n,
                    "token_ids": list(range(n)) + [0] * (width - n),
                    "token_loss_mask": [int(x) for x in g["loss_mask"]] + [0] * (width - n),
                    "sample_loss_mask": 1,
                    "advantages": g["advantage"].to_list() + pad,
                    "generation_logprobs": g["inference_logprob"].to_list() + pad,
                    "prev_logprobs": g["trainer_logprob"].to_list() + pad,
                }
                f.write(json.dumps(rec) + "\n")
    return root


def slime_dump(seqs: list[pl.DataFrame], step: int) -> dict:
    """A slime train dump (format_version 2): response-only arrays, prompt = the tokens before
    the first loss token."""
    samples = []
    for i, g in enumerate(seqs):
        start = int(np.argmax(g["loss_mask"].to_numpy()))
        r = g.slice(start)
        samples.append(
            {
                "sample_index": i,
                "data_parallel_rank": i % 2,
                "tokens": torch.arange(g.height),
                "response_lengths": r.height,
                "loss_masks": torch.tensor(r["loss_mask"].to_numpy().astype(np.int64)),
                "rollout_log_probs": torch.tensor(r["inference_logprob"].to_numpy()),
                "log_probs": torch.tensor(r["trainer_logprob"].to_numpy()),
                "advantages": torch.tensor(r["advantage"].to_numpy()),
            }
        )
    return {
        "format_version": 2,
        "rollout_id": step,
        "samples": samples,
        "dp_shards": [{"rank": 0, "sample_indices": list(range(len(seqs)))}],
        "raw_reward": [1.0] * len(seqs),
    }


def write_slime(df: pl.DataFrame, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for step, seqs in _sequences(df):
        torch.save(slime_dump(seqs, step), root / f"train_{step}.pt")
    return root


def as_lists(df: pl.DataFrame) -> pl.DataFrame:
    """One row per sequence with list columns, under trainer-style names."""
    return (
        df.sort("step", "sample_id", "position")
        .group_by("step", "sample_id", maintain_order=True)
        .agg(
            pl.col("position").alias("position_ids"),
            pl.col("trainer_logprob").alias("trainer_logprobs"),
            pl.col("inference_logprob").alias("inference_logprobs"),
            pl.col("loss_mask").alias("loss_masks"),
            pl.col("advantage").alias("advantages"),
            pl.col("env").first().alias("env_name"),
        )
    )


def write_format(fmt: str, df: pl.DataFrame, root: Path) -> Path:
    """The golden log in format `fmt` under root; returns the SOURCE to pass."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        df.write_parquet(root / "log.parquet")
        return root / "log.parquet"
    if fmt == "lists":
        as_lists(df).write_parquet(root / "lists.parquet")
        return root / "lists.parquet"
    if fmt == "jsonl":
        with open(root / "log.jsonl", "w") as f:
            for row in df.iter_rows(named=True):
                f.write(json.dumps(row) + "\n")
        return root / "log.jsonl"
    if fmt == "jsonl-lists":
        with open(root / "lists.jsonl", "w") as f:
            for row in as_lists(df).iter_rows(named=True):
                f.write(json.dumps(row) + "\n")
        return root / "lists.jsonl"
    if fmt == "prime-rl":
        return write_prime(df, root)
    if fmt == "nemo-rl":
        return write_nemo(df, root / "logs")
    if fmt == "slime":
        return write_slime(df, root / "dumps")
    raise ValueError(fmt)


@pytest.fixture(scope="module")
def golden() -> pl.DataFrame:
    return pl.read_parquet(GOLDEN_LOG)


@pytest.fixture(scope="module")
def sources(golden, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("formats")
    return {fmt: write_format(fmt, golden, base / fmt) for fmt in FORMATS}


def canon(t: pl.DataFrame, fmt: str) -> pl.DataFrame:
    """The golden columns of a table read back, in golden order (prime-rl: pad shifts +1)."""
    if fmt == "prime-rl":
        t = t.with_columns(pl.col("position") - 1)
    return t.sort("step", "position", "trainer_logprob").select(COLS)


# ----------------------------------------------------------------------------- every format


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_replays_to_the_golden_counts(sources, fmt):
    expected = engine.sweep([GOLDEN_LOG], rules=SPECS).table
    got = engine.sweep([sources[fmt]], rules=SPECS).table
    assert got["tokens"][0] == 19598
    assert got["masked_tokens"].to_list() == expected["masked_tokens"].to_list()
    assert got["masked_sequences"].to_list() == expected["masked_sequences"].to_list()
    assert_tables_equal(got, expected, rel=1e-12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_the_golden_values_exactly(sources, golden, fmt):
    got = io.read_table([sources[fmt]])
    want = golden.filter("loss_mask").sort("step", "position", "trainer_logprob").select(COLS)
    assert canon(got, fmt).equals(want)
    seqs = got.select("step", "sample_id").unique().height
    assert seqs == 96


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl", "jsonl", "slime"])
def test_batch_size_does_not_change_the_table(sources, fmt):
    """Small batches: JSON is parsed in 64 KiB blocks, slime samples in 777-row frames."""
    plan = io.plan_sources([sources[fmt]], io.ReadOptions(batch_rows=777))
    frames = [df for _, df in io.iter_batches(plan)]
    assert len(frames) > 8
    a = pl.concat(frames).sort("step", "sample_id", "position")
    b = io.read_table([sources[fmt]]).sort("step", "sample_id", "position")
    assert a.equals(b)


def test_json_fast_and_slow_parsers_agree(sources, monkeypatch):
    """Blocks polars rejects are re-parsed line by line; both give the same table."""
    want = {f: io.read_table([sources[f]]) for f in ("prime-rl", "nemo-rl", "jsonl-lists")}

    def refuse(*a, **k):
        raise pl.exceptions.ComputeError("forced slow path")

    monkeypatch.setattr(adapters.pl, "read_ndjson", refuse)
    for f, t in want.items():
        assert io.read_table([sources[f]]).equals(t), f


def test_a_prime_rl_tree_streams_in_bounded_batches(golden, tmp_path):
    """40 steps x 4 ranks; with 1,000-row batches no frame holds more than a block's worth."""
    big = pl.concat([golden.with_columns(step=pl.col("step") + 8 * k) for k in range(5)])
    src = write_prime(big, tmp_path, ranks=4)
    plan = io.plan_sources([src], io.ReadOptions(batch_rows=1000))
    assert len(plan.files) == 160 and plan.format == "prime-rl"
    heights = [df.height for _, df in io.iter_batches(plan, ["step", "sample_id"])]
    assert sum(heights) == 5 * 19598
    assert max(heights) < 1500  # 64 KiB of JSON at a time, never a whole file or step
    steps = [int(p.parent.name.split("_")[1]) for p in plan.files]
    assert steps == sorted(steps)  # step_10 after step_9: numeric order


# ----------------------------------------------------------------------------- detection


def test_detection_rules(tmp_path):
    d = adapters.detect
    assert d(Path("run/token_exports/step_12/rank_3.jsonl")) == "prime-rl"
    assert d(Path("run/rank_3.jsonl")) == "jsonl"  # not in a step_<n> directory
    assert d(Path("logs/exp_001/train_data_step7.jsonl")) == "nemo-rl"
    assert d(Path("logs/val_data_step7.jsonl")) == "jsonl"
    assert d(Path("dumps/train_3.pt")) == "slime"
    assert d(Path("x.parquet")) == d(Path("x.PQ")) == "parquet"
    assert d(Path("STABLE")) is None
    assert adapters.path_step(Path("t/step=4/part-0.parquet"), "parquet") == 4
    assert adapters.path_step(Path("logs/train_data_step7.jsonl"), "nemo-rl") == 7
    assert adapters.path_step(Path("t/step_12/rank_0.jsonl"), "prime-rl") == 12


def test_plan_names_the_format_and_format_option_overrides(sources, golden, tmp_path):
    for fmt, kind in [("prime-rl", "prime-rl"), ("nemo-rl", "nemo-rl"), ("slime", "slime")]:
        assert io.plan_sources([sources[fmt]]).format == kind
    assert io.plan_sources([sources["jsonl"]]).format == "jsonl"
    # a NeMo-RL file under another name: --format nemo-rl, step from the digits in the name
    src = tmp_path / "step5.jsonl"
    src.write_bytes((sources["nemo-rl"] / "train_data_step5.jsonl").read_bytes())
    plan = io.plan_sources([src], io.ReadOptions(format="nemo-rl"))
    t = io.read_table(plan)
    want = golden.filter(pl.col("step") == 5, "loss_mask").height
    assert plan.format == "nemo-rl" and set(t["step"]) == {5} and t.height == want
    with pytest.raises(UsageError, match="--format csv: known formats"):
        io.plan_sources([src], io.ReadOptions(format="csv"))


def test_directory_with_one_framework_ignores_other_files_and_says_so(sources, tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    for p in sources["nemo-rl"].iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    (d / "val_data_step1.jsonl").write_text('{"content": "x"}\n')
    (d / "notes.txt").write_text("hi")
    with pytest.warns(io.IngestWarning, match="ignored 1 jsonl file"):
        plan = io.plan_sources([d])
    assert plan.format == "nemo-rl" and len(plan.files) == 8
    assert any("ignored" in w for w in plan.warnings)


def test_hive_partitioned_parquet_takes_the_step_from_the_directory(golden, tmp_path):
    for (step,), part in golden.group_by("step"):
        (tmp_path / f"step={step}").mkdir()
        part.drop("step").write_parquet(tmp_path / f"step={step}" / "part-0.parquet")
    got = engine.sweep([tmp_path], rules=SPECS, by="step").table
    want = engine.sweep([GOLDEN_LOG], rules=SPECS, by="step").table
    assert_tables_equal(got, want, keys=("rule", "setting", "param", "value", "step"))


# ----------------------------------------------------------------------------- prime-rl


def _prime_record(step=3, rank=0, idx=0, **over) -> dict:
    rec = {
        "schema_version": 1,
        "step": step,
        "rank": rank,
        "micro_step": 0,
        "micro_sequence_idx": idx,
        "export_sequence_idx": idx,
        "env_name": "math",
        "token_ids": [1, 2, 3, 4],
        "position_ids": [0, 1, 2, 3],
        "loss_mask": [True, False, True, True],  # index 0 is the pad: never a loss token
        "advantages": [0.5] * 4,
        "inference_logprobs": [None, -0.5, -0.25, -1.0],
        "trainer_logprobs": [None, -0.5, -0.5, -1.0],
        "entropy": [None, 0.1, 0.2, 0.3],
    }
    rec.update(over)
    return rec


def _write_lines(path: Path, lines: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _prime_step(root: Path, step: int, ranks: dict[int, list], stable: bool = True) -> Path:
    d = root / "token_exports" / f"step_{step}"
    for r, lines in ranks.items():
        _write_lines(d / f"rank_{r}.jsonl", lines)
    if stable:
        (d / "STABLE").write_text("")
    return root / "token_exports"


def test_prime_rl_pad_ids_and_step(tmp_path):
    rec = _prime_record(rank=2, idx=17)
    del rec["step"]  # the step then comes from the directory
    src = _prime_step(tmp_path, 9, {2: [rec]})
    t = io.read_table([src])
    assert t["position"].to_list() == [2, 3]
    assert t["sample_id"].to_list() == [2_000_017] * 2  # rank 2, sequence 17
    assert t["step"].to_list() == [9, 9]
    assert t["env"].to_list() == ["math"] * 2
    assert t["entropy"].to_list() == [0.2, 0.3]


def test_prime_rl_unstable_steps_are_skipped_with_a_warning(tmp_path):
    src = _prime_step(tmp_path, 1, {0: [_prime_record(step=1)]})
    _prime_step(tmp_path, 2, {0: [_prime_record(step=2), '{"step": 2, "trainer_lo']}, False)
    with pytest.warns(io.IngestWarning, match=r"skipped 1 prime-rl step\(s\) without a STABLE"):
        plan = io.plan_sources([src])
    assert [p.parent.name for p in plan.files] == ["step_1"]
    report = io.ReadReport()
    assert io.read_table(plan, report=report)["step"].to_list() == [1, 1]
    assert "--include-unstable" in report.warnings[0]
    # taking them: the half-written last line is an error naming file and line ...
    opts = io.ReadOptions(include_unstable=True)
    with pytest.warns(io.IngestWarning), pytest.raises(DataError, match=r"rank_0.jsonl, line 2"):
        io.read_table([src], opts)
    # ... or skipped and counted
    opts = io.ReadOptions(include_unstable=True, drop_invalid=True)
    report = io.ReadReport()
    with pytest.warns(io.IngestWarning):
        t = io.read_table([src], opts, report=report)
    assert sorted(set(t["step"])) == [1, 2] and report.dropped_records == 1
    # every step unstable: nothing to read, and the error says how to read them anyway
    (src / "step_1" / "STABLE").unlink()
    with pytest.raises(DataError, match=r"still being written.*--include-unstable"):
        io.plan_sources([src])


# ----------------------------------------------------------------------------- nemo-rl


def test_nemo_rl_padding_sample_mask_and_missing_token_mask(tmp_path):
    base = {
        "prev_logprobs": [0.0, -0.5, -0.25, 0.0],
        "generation_logprobs": [0.0, -0.5, -0.5, 0.0],
        "token_loss_mask": [0, 1, 1, 0],
        "advantages": [1.0] * 4,
        "input_lengths": 3,  # the 4th entry is padding, cut off
        "sample_loss_mask": 1,
    }
    off = dict(base, sample_loss_mask=0)  # a whole sample kept out of the loss
    src = _write_lines(tmp_path / "train_data_step4.jsonl", [base, "", off, base])
    t = io.read_table([src])
    assert t["sample_id"].to_list() == [0, 0, 2, 2]  # index in the file, blank lines skipped
    assert t["position"].to_list() == [1, 2, 1, 2] and set(t["step"]) == {4}
    bare = {k: v for k, v in base.items() if k != "token_loss_mask"}
    src = _write_lines(tmp_path / "b" / "train_data_step1.jsonl", [bare])
    with pytest.warns(io.IngestWarning, match="no token_loss_mask"):
        assert io.read_table([src]).height == 3  # the prompt token counts too


# ----------------------------------------------------------------------------- slime


class NotPlainData:
    def __init__(self):
        self.x = 1


def test_slime_positions_steps_and_safe_loading(golden, tmp_path):
    seqs = next(_sequences(golden))[1][:2]
    dump = slime_dump(seqs, step=42)
    dump["samples"][1]["log_probs"] = dump["samples"][1]["log_probs"].float()  # real dumps
    torch.save(dump, tmp_path / "r42.pt")
    t = io.read_table([tmp_path / "r42.pt"])
    assert set(t["step"]) == {42} and sorted(set(t["sample_id"])) == [0, 1]
    g = golden.filter(pl.col("step") == 0, pl.col("sample_id") == 0, "loss_mask")
    assert t.filter(pl.col("sample_id") == 0)["position"].to_list() == g["position"].to_list()
    # arbitrary objects are never unpickled
    torch.save(
        {"format_version": 2, "rollout_id": 1, "samples": [NotPlainData()]}, tmp_path / "x.pt"
    )
    with pytest.raises(DataError, match="never unpickles arbitrary objects"):
        io.plan_sources([tmp_path / "x.pt"])


def test_slime_dump_with_unexpected_keys_lists_found_and_expected(tmp_path):
    torch.save({"rollout_id": 1, "rank": 0, "rollout_data": {}}, tmp_path / "old.pt")
    with pytest.raises(DataError) as e:
        io.plan_sources([tmp_path / "old.pt"])
    msg = str(e.value)
    assert "old.pt" in msg and "keys found: rank, rollout_data, rollout_id" in msg
    assert "expected: format_version, rollout_id, samples" in msg
    sample = {"log_prob": torch.zeros(3), "rollout_log_probs": torch.zeros(3)}
    torch.save({"format_version": 2, "rollout_id": 1, "samples": [sample]}, tmp_path / "s.pt")
    with pytest.raises(DataError, match=r"samples\[0\].*log_probs missing.*found: log_prob, "):
        io.plan_sources([tmp_path / "s.pt"])
    torch.save({"format_version": 3, "rollout_id": 1, "samples": []}, tmp_path / "v3.pt")
    with pytest.raises(DataError, match="format_version 3"):
        io.plan_sources([tmp_path / "v3.pt"])


def test_slime_without_torch_says_how_to_install_it(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch":
            raise ImportError("no torch here")
        return real(name, *a, **k)

    (tmp_path / "d.pt").write_bytes(b"PK")
    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(DataError, match=r"needs torch.*pip install torch==2.13.0"):
        io.plan_sources([tmp_path / "d.pt"])


# ----------------------------------------------------------------------------- hardening


def test_truncated_and_malformed_lines_name_file_and_line(tmp_path):
    good = _prime_record()
    src = _prime_step(tmp_path, 3, {0: [good, "{not json}", good, json.dumps(good)[:-20]]})
    with pytest.raises(DataError) as e:
        io.read_table([src])
    msg = str(e.value)
    assert "rank_0.jsonl, line 2: not valid JSON" in msg and "--drop-invalid" in msg
    report = io.ReadReport()
    t = io.read_table([src], io.ReadOptions(drop_invalid=True), report=report)
    assert t.height == 4 and report.dropped_records == 2  # 2 good records x 2 loss tokens
    key = (str(src / "step_3" / "rank_0.jsonl"), "records: not valid JSON")
    assert report.dropped[key] == 2


def test_arrays_of_unequal_length_within_a_record(tmp_path):
    bad = _prime_record(trainer_logprobs=[None, -0.5, -0.5])
    src = _prime_step(tmp_path, 3, {0: [_prime_record(), bad]})
    with pytest.raises(DataError, match=r"line 2: per-token arrays of unequal length") as e:
        io.read_table([src])
    assert "trainer_logprobs 3" in str(e.value) and "inference_logprobs 4" in str(e.value)
    report = io.ReadReport()
    assert io.read_table([src], io.ReadOptions(drop_invalid=True), report=report).height == 2
    assert report.dropped_records == 1
    # slime: a sample whose response arrays disagree
    s = slime_dump([pl.read_parquet(GOLDEN_LOG).head(40)], step=0)
    s["samples"][0]["rollout_log_probs"] = s["samples"][0]["rollout_log_probs"][:-1]
    torch.save(s, tmp_path / "u.pt")
    with pytest.raises(DataError, match=r"u.pt, samples\[0\]: response arrays of unequal"):
        io.read_table([tmp_path / "u.pt"])


def test_a_record_without_the_expected_keys(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [{"step": 3, "tokens": [{"id": 1}]}]})
    with pytest.raises(DataError) as e:
        io.plan_sources([src])
    msg = str(e.value)
    assert "line 1: not a prime-rl record" in msg and "Keys found: step, tokens" in msg
    assert "Keys expected: trainer_logprobs, inference_logprobs, loss_mask" in msg
    # a later record lacking one: named by line, or skipped
    rec = _prime_record()
    del rec["inference_logprobs"]
    src = _prime_step(tmp_path / "b", 3, {0: [_prime_record(), rec]})
    with pytest.raises(DataError, match=r"line 2: prime-rl record without inference_logprobs"):
        io.read_table([src])


def test_an_empty_rank_file_is_skipped_and_all_empty_is_an_error(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [_prime_record()], 1: []})
    with pytest.warns(io.IngestWarning, match="1 empty file"):
        assert io.read_table([src]).height == 2
    src = _prime_step(tmp_path / "e", 3, {0: [], 1: []})
    with pytest.raises(DataError, match="no record to read"):
        io.plan_sources([src])


def test_mixed_formats_are_refused(sources):
    with pytest.raises(DataError) as e:
        io.plan_sources([sources["nemo-rl"], sources["parquet"]])
    msg = str(e.value)
    assert "mix formats" in msg and "is nemo-rl" in msg and "is parquet" in msg


def test_mixed_directory_is_refused_with_what_it_holds(sources, tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.parquet").write_bytes(sources["parquet"].read_bytes())
    (d / "b.jsonl").write_bytes(sources["jsonl"].read_bytes())
    with pytest.raises(DataError, match=r"mixes formats: 1 parquet file.*1 jsonl file.*--format"):
        io.plan_sources([d])
    assert io.plan_sources([d], io.ReadOptions(format="jsonl")).format == "jsonl"


def test_a_directory_with_nothing_readable(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    (tmp_path / "d" / "STABLE").write_text("")
    with pytest.raises(DataError, match=r"no \.parquet file and no other token log.*2 other"):
        io.plan_sources([tmp_path / "d"])


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl", "slime", "parquet", "jsonl"])
def test_a_file_that_disappears_while_being_read(sources, tmp_path, fmt):
    import shutil

    src = sources[fmt]
    copy = tmp_path / "copy"
    (shutil.copytree if src.is_dir() else shutil.copy)(src, copy)
    plan = io.plan_sources([copy])
    victim = plan.files[-1]
    batches = io.iter_batches(plan)
    if len(plan.files) > 1:
        next(batches)  # reading has started (a file already open stays readable on POSIX)
    victim.unlink()
    with pytest.raises(DataError, match="disappeared") as e:
        list(batches)
    assert str(victim) in str(e.value)


@pytest.mark.parametrize(
    "value,what",
    [
        ("1e400", "+inf or -inf"),
        ("-1e400", "+inf or -inf"),
        ("NaN", "NaN"),
        ("null", "null"),
        ("1e300", "above 0"),
    ],
)
def test_huge_values_and_null_in_a_logprob(tmp_path, value, what):
    text = json.dumps(_prime_record(trainer_logprobs=[None, -0.5, "X", -1.0]))
    src = _prime_step(tmp_path, 3, {0: [text.replace('"X"', value), _prime_record()]})
    with pytest.raises(DataError) as e:
        io.read_table([src])
    msg = str(e.value)
    assert "rank_0.jsonl" in msg and "trainer_logprob" in msg
    assert f"1 of 4 loss rows are {what}" in msg
    report = io.ReadReport()
    t = io.read_table([src], io.ReadOptions(drop_invalid=True), report=report)
    assert t.height == 3 and report.dropped_rows == 1 and report.dropped_records == 0


def test_a_value_of_the_wrong_type_names_line_and_key(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [_prime_record(), _prime_record(loss_mask="yes")]})
    with pytest.raises(DataError, match=r"line 2: key 'loss_mask': expected an array"):
        io.read_table([src])


def test_jsonl_token_rows_aliases_map_and_probabilities(tmp_path):
    rows = [
        {"lp": 0.5, "inference_probs": 0.25, "step": 1, "extra": {"nested": [1]}},
        {"lp": 1, "inference_probs": 1, "step": 1},
    ]
    src = _write_lines(tmp_path / "p.jsonl", rows)
    opts = io.ReadOptions(mapping={"trainer_logprob": "lp"}, probs=True)
    t = io.read_table([src], opts)
    np.testing.assert_allclose(t["trainer_logprob"], [math.log(0.5), 0.0])
    np.testing.assert_allclose(t["inference_logprob"], [math.log(0.25), 0.0])


# ----------------------------------------------------------------------------- command line


def test_cli_reads_each_format_and_prints_warnings(sources, tmp_path):
    for fmt in ("prime-rl", "nemo-rl", "slime"):
        res = runner.invoke(app, ["sweep", str(sources[fmt]), "-r", "ipo:eps=0.05", "--json"])
        assert res.exit_code == 0, res.stderr
        assert json.loads(res.stdout)["rows"][0]["masked_tokens"] == 102
    src = _prime_step(tmp_path, 1, {0: [_prime_record(step=1)]})
    _prime_step(tmp_path, 2, {0: [_prime_record(step=2)]}, stable=False)
    res = runner.invoke(app, ["inspect", str(src), "--json"])
    assert res.exit_code == 0 and "warning: skipped 1 prime-rl step" in res.stderr
    assert json.loads(res.stdout)["steps"] == 1
    res = runner.invoke(app, ["inspect", str(src), "--json", "--include-unstable"])
    assert json.loads(res.stdout)["steps"] == 2
    res = runner.invoke(app, ["sweep", str(src), "--format", "slime"])
    assert res.exit_code == 1 and "no slime file" in res.stderr


def test_cli_drop_invalid_reports_skipped_records(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [_prime_record(), "{truncated"]})
    res = runner.invoke(app, ["sweep", str(src), "-r", "ipo", "--json"])
    assert res.exit_code == 1 and "line 2: not valid JSON" in res.stderr
    res = runner.invoke(app, ["sweep", str(src), "-r", "ipo", "--json", "--drop-invalid"])
    assert res.exit_code == 0
    assert "skipped 1 unreadable records" in res.stderr and "records: not valid JSON" in res.stderr


def test_never_reads_a_half_written_dump(tmp_path):
    """A truncated .pt (a dump being written) is an error naming the file, not a crash."""
    s = slime_dump([pl.read_parquet(GOLDEN_LOG).head(40)], step=0)
    torch.save(s, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "half.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"half.pt: cannot read it as a torch.save file"):
        io.plan_sources([tmp_path / "half.pt"])
    assert os.path.getsize(tmp_path / "full.pt") == len(data)
