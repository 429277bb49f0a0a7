"""Framework adapters: every framework's own on-disk layout, read back to the canonical counts.

The fixtures are written from the golden canonical log (8 steps, 96 sequences) by
tests/framework_writers.py, each exactly as that framework's writer lays it out (the
repository, file and commit read are named in each writer's docstring):

- prime-rl token export: PrimeIntellect-ai/prime-rl token_export.py at 559b447;
- prime-rl traces + trainer annotations (PR #3444): prime-rl annotations.py / update.py at
  65a1858, verifiers graph.py / trace.py / episode.py at a60a606;
- NeMo-RL train_data_step<N>.jsonl: NVIDIA-NeMo/RL logger.py / grpo.py at 7ea279a;
- slime train dumps and --dump-details trees: THUDM/slime train_data_utils.py at 624b824;
- SkyRL dump_data_batch pickles: NovaSky-AI/SkyRL training_batch.py / trainer.py at a956457.

Every format must replay to the very same counts as the golden Parquet log; with the values
rounded as the writers round them (float32, the trace monitor's decimals), to the counts of a
Parquet of the same rounded table. `write_format` and `FORMATS` are shared with
test_convert.py.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from conftest import GOLDEN_LOG, assert_tables_equal
from framework_writers import (
    as_written,
    nemo_batch,
    sequences,
    slime_dump,
    slime_rollout_dump,
    write_nemo,
    write_prime,
    write_skyrl,
    write_slime,
    write_traces,
)
from typer.testing import CliRunner

from mismatch_replay import engine, ingest
from mismatch_replay.analysis.inspect import prime_check
from mismatch_replay.cli import app
from mismatch_replay.errors import DataError, UsageError
from mismatch_replay.ingest import formats
from mismatch_replay.ingest.formats import jsonl, prime_rl, skyrl

torch = pytest.importorskip("torch")

FRAMEWORK_FORMATS = ("prime-rl", "prime-rl-traces", "nemo-rl", "slime", "skyrl")
FORMATS = ("parquet", "lists", "jsonl", "jsonl-lists", *FRAMEWORK_FORMATS)
SPECS = [
    "ipo:eps=0.05",
    "icepop@prime-rl",
    "kpop@prime-rl",
    "dppo-tv",
    "seq-mis@verl",
    "m2po:tau=0.001",
]
COLS = ["step", "position", "trainer_logprob", "inference_logprob", "advantage"]
SHIFT = {"prime-rl": 1, "prime-rl-traces": 2}  # tokens before golden position 0
runner = CliRunner()
_sequences = sequences


# ----------------------------------------------------------------------------- fixture writers


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


def write_format(fmt: str, df: pl.DataFrame, root: Path, dtype: str = "float64") -> Path:
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
        return write_prime(df, root, dtype=dtype)
    if fmt == "prime-rl-traces":
        return write_traces(df, root / "run", dtype=dtype) / "monitors" / "file" / "traces"
    if fmt == "nemo-rl":
        return write_nemo(df, root / "logs")
    if fmt == "slime":
        return write_slime(df, root / "dumps", dtype=dtype)
    if fmt == "skyrl":
        return write_skyrl(df, root / "export", dtype=dtype)
    raise ValueError(fmt)


@pytest.fixture(scope="module")
def golden() -> pl.DataFrame:
    return pl.read_parquet(GOLDEN_LOG)


@pytest.fixture(scope="module")
def sources(golden, tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("formats")
    return {fmt: write_format(fmt, golden, base / fmt) for fmt in FORMATS}


ENTROPY_COLUMNS = ("entropy_mean", "masked_entropy_mean")


def expected_sweep(table: pl.DataFrame, src: Path, fmt: str, tmp: Path) -> pl.DataFrame:
    """The sweep a format's log must replay to: that of the canonical Parquet `table`, plus
    the entropy column the format's layout carries where it carries one (prime-rl's token
    export and traces write the trainer's entropies; the golden log has none, so its
    entropy_mean / masked_entropy_mean are null), joined on step, the sequence's rank in
    its step (the traces number sequences across steps) and golden position, the joined
    log-probs checked equal. Every other column is checked to be the plain Parquet's own."""
    tmp.mkdir(parents=True, exist_ok=True)
    table.write_parquet(tmp / "plain.parquet")
    plain = engine.sweep([tmp / "plain.parquet"], rules=SPECS).table
    read = ingest.read_table([src])
    if "entropy" not in read.columns:
        return plain
    seq = pl.col("sample_id").rank("dense").over("step").alias("seq")
    keys = ["step", "seq", "position"]
    ent = read.select(
        "step", seq, pl.col("position") - SHIFT.get(fmt, 0), "entropy", "trainer_logprob"
    )
    joined = table.with_columns(seq).join(ent, on=keys, how="left", validate="1:1", suffix="_read")
    loss = joined.filter("loss_mask")
    assert loss["entropy"].null_count() == 0  # every loss token has its entropy
    assert (loss["trainer_logprob"] == loss["trainer_logprob_read"]).all()  # the same token
    joined = joined.drop("seq", "trainer_logprob_read")
    joined.write_parquet(tmp / "with_entropy.parquet")
    want = engine.sweep([tmp / "with_entropy.parquet"], rules=SPECS).table
    assert_tables_equal(want, plain, rel=1e-12, skip=ENTROPY_COLUMNS)
    assert want["entropy_mean"].null_count() < want.height  # the entropies are counted
    return want


def canon(t: pl.DataFrame, fmt: str) -> pl.DataFrame:
    """The golden columns of a table read back, in golden order (positions shifted back by
    the tokens a format's layout puts before golden position 0)."""
    if fmt in SHIFT:
        t = t.with_columns(pl.col("position") - SHIFT[fmt])
    return t.sort("step", "position", "trainer_logprob").select(COLS)


# ----------------------------------------------------------------------------- every format


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_replays_to_the_golden_counts(sources, golden, tmp_path, fmt):
    expected = expected_sweep(golden, sources[fmt], fmt, tmp_path)
    got = engine.sweep([sources[fmt]], rules=SPECS).table
    assert got["tokens"][0] == 19598
    assert got["masked_tokens"].to_list() == expected["masked_tokens"].to_list()
    assert got["masked_sequences"].to_list() == expected["masked_sequences"].to_list()
    assert_tables_equal(got, expected, rel=1e-12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_reads_the_golden_values_exactly(sources, golden, fmt):
    got = ingest.read_table([sources[fmt]])
    want = golden.filter("loss_mask").sort("step", "position", "trainer_logprob").select(COLS)
    assert canon(got, fmt).equals(want)
    seqs = got.select("step", "sample_id").unique().height
    assert seqs == 96


@pytest.mark.parametrize("fmt", FRAMEWORK_FORMATS)
def test_values_rounded_as_the_writers_store_them_replay_like_the_same_parquet(
    golden, tmp_path, fmt
):
    """The frameworks write float32 (and the trace monitor rounds to its float_decimals): the
    same rounded tokens as a canonical Parquet give the same sweep, count for count."""
    decimals = 4 if fmt == "prime-rl-traces" else None
    rounded = as_written(golden, "float32", decimals)
    if fmt == "prime-rl-traces":
        src = write_traces(rounded, tmp_path / "run", dtype="float32", decimals=decimals)
        src = src / "monitors" / "file" / "traces"
    else:
        src = write_format(fmt, rounded, tmp_path / fmt, dtype="float32")
    want = expected_sweep(rounded, src, fmt, tmp_path / "rounded")
    got = engine.sweep([src], rules=SPECS).table
    assert got["tokens"][0] == 19598
    assert got["masked_tokens"].to_list() == want["masked_tokens"].to_list()
    assert_tables_equal(got, want, rel=1e-12)
    assert rounded["trainer_logprob"].to_list() != golden["trainer_logprob"].to_list()


@pytest.mark.parametrize(
    "fmt", ["prime-rl", "nemo-rl", "jsonl", "slime", "skyrl", "prime-rl-traces"]
)
def test_batch_size_does_not_change_the_table(sources, fmt):
    """Small batches: JSON is parsed in 64 KiB blocks, dumps and traces in 777-row frames."""
    plan = ingest.plan_sources([sources[fmt]], ingest.ReadOptions(batch_rows=777))
    frames = [df for _, df in ingest.iter_batches(plan)]
    assert len(frames) > 8
    a = pl.concat(frames).sort("step", "sample_id", "position")
    b = ingest.read_table([sources[fmt]]).sort("step", "sample_id", "position")
    assert a.equals(b)


def test_json_fast_and_slow_parsers_agree(sources, monkeypatch):
    """Blocks polars rejects are re-parsed line by line; both give the same table."""
    want = {f: ingest.read_table([sources[f]]) for f in ("prime-rl", "nemo-rl", "jsonl-lists")}

    def refuse(*a, **k):
        raise pl.exceptions.ComputeError("forced slow path")

    monkeypatch.setattr(jsonl.pl, "read_ndjson", refuse)
    for f, t in want.items():
        assert ingest.read_table([sources[f]]).equals(t), f


def test_a_prime_rl_tree_streams_in_bounded_batches(golden, tmp_path):
    """40 steps x 4 ranks; with 1,000-row batches no frame holds more than a block's worth."""
    big = pl.concat([golden.with_columns(step=pl.col("step") + 8 * k) for k in range(5)])
    src = write_prime(big, tmp_path, ranks=4)
    plan = ingest.plan_sources([src], ingest.ReadOptions(batch_rows=1000))
    assert len(plan.files) == 160 and plan.format == "prime-rl"
    heights = [df.height for _, df in ingest.iter_batches(plan, ["step", "sample_id"])]
    assert sum(heights) == 5 * 19598
    assert max(heights) < 1500  # 64 KiB of JSON at a time, never a whole file or step
    steps = [int(p.parent.name.split("_")[1]) for p in plan.files]
    assert steps == sorted(steps)  # step_10 after step_9: numeric order


# ----------------------------------------------------------------------------- detection


def test_detection_rules(tmp_path):
    d = formats.detect
    assert d(Path("run/token_exports/step_12/rank_3.jsonl")) == "prime-rl"
    assert d(Path("run/rank_3.jsonl")) == "jsonl"  # not in a step_<n> directory
    assert d(Path("logs/exp_001/train_data_step7.jsonl")) == "nemo-rl"
    assert d(Path("logs/val_data_step7.jsonl")) == "jsonl"
    assert d(Path("dumps/train_3.pt")) == "slime"
    assert d(Path("export/dumped_data/global_step_4_training_input.pkl")) == "skyrl"
    assert d(Path("run/monitors/file/traces/stream.jsonl")) == "prime-rl-traces"
    assert d(Path("x.parquet")) == d(Path("x.PQ")) == "parquet"
    assert d(Path("STABLE")) is None
    # the annotations and indexes of a trace stream are read with it, never on their own
    t = tmp_path / "traces"
    (t / "annotations").mkdir(parents=True)
    (t / "stream.jsonl").write_text("")
    assert d(t / "annotations" / "trainer.jsonl") is None
    assert d(t / "stream.index.jsonl") is None
    assert formats.path_step(Path("t/step=4/part-0.parquet"), "parquet") == 4
    assert formats.path_step(Path("logs/train_data_step7.jsonl"), "nemo-rl") == 7
    assert formats.path_step(Path("t/step_12/rank_0.jsonl"), "prime-rl") == 12
    assert formats.path_step(Path("d/global_step_9_training_input.pkl"), "skyrl") == 9


def test_plan_names_the_format_and_format_option_overrides(sources, golden, tmp_path):
    for fmt in FRAMEWORK_FORMATS:
        assert ingest.plan_sources([sources[fmt]]).format == fmt
    assert ingest.plan_sources([sources["jsonl"]]).format == "jsonl"
    # a NeMo-RL file under another name: --format nemo-rl, step from the digits in the name
    src = tmp_path / "step5.jsonl"
    src.write_bytes((sources["nemo-rl"] / "train_data_step5.jsonl").read_bytes())
    plan = ingest.plan_sources([src], ingest.ReadOptions(format="nemo-rl"))
    t = ingest.read_table(plan)
    want = golden.filter(pl.col("step") == 5, "loss_mask").height
    assert plan.format == "nemo-rl" and set(t["step"]) == {5} and t.height == want
    with pytest.raises(UsageError, match="--format csv: known formats"):
        ingest.plan_sources([src], ingest.ReadOptions(format="csv"))


def test_directory_with_one_framework_ignores_other_files_and_says_so(sources, tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    for p in sources["nemo-rl"].iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    (d / "val_data_step1.jsonl").write_text('{"content": "x"}\n')
    (d / "notes.txt").write_text("hi")
    with pytest.warns(ingest.IngestWarning, match="ignored 1 jsonl file"):
        plan = ingest.plan_sources([d])
    assert plan.format == "nemo-rl" and len(plan.files) == 8
    assert any("ignored" in w for w in plan.warnings)


def test_hive_partitioned_parquet_takes_the_step_from_the_directory(golden, tmp_path):
    for (step,), part in golden.group_by("step"):
        (tmp_path / f"step={step}").mkdir()
        part.drop("step").write_parquet(tmp_path / f"step={step}" / "part-0.parquet")
    got = engine.sweep([tmp_path], rules=SPECS, by="step").table
    want = engine.sweep([GOLDEN_LOG], rules=SPECS, by="step").table
    assert_tables_equal(got, want, keys=("rule", "setting", "param", "value", "step"))


# ----------------------------------------------------------------------------- NeMo-RL


def test_nemo_rl_lines_are_the_loggers_one_element_lists(sources):
    """What the fixture holds is what log_batched_dict_as_jsonl writes: every field wrapped."""
    line = (sources["nemo-rl"] / "train_data_step0.jsonl").read_text().splitlines()[0]
    rec = json.loads(line)
    assert list(rec)[:4] == ["content", "rewards", "input_lengths", "token_ids"]
    assert rec["idx"] == 0 and isinstance(rec["input_lengths"], list)
    assert len(rec["prev_logprobs"]) == 1 and isinstance(rec["prev_logprobs"][0], list)
    assert rec["sample_loss_mask"] == [1.0] and len(rec["input_lengths"]) == 1
    assert len(rec["prev_logprobs"][0]) % 8 == 0  # padded to the batch's longest, divisible


def test_nemo_rl_flat_layout_reads_the_same_table(golden, sources, tmp_path):
    flat = write_nemo(golden, tmp_path / "flat", layout="flat")
    assert ingest.read_table([flat]).equals(ingest.read_table([sources["nemo-rl"]]))


def test_nemo_rl_all_zero_prev_logprobs_are_refused(golden, tmp_path):
    """force_on_policy_ratio=True: prev_logprobs are zeros_like placeholders, p_train = 1."""
    src = write_nemo(golden, tmp_path / "logs", zero_prev=True)
    with pytest.raises(DataError) as e:
        engine.sweep([src], rules=["ipo"])
    msg = str(e.value)
    assert "train_data_step0.jsonl: key 'prev_logprobs'" in msg
    n = golden.filter(pl.col("step") == 0, "loss_mask").height
    assert f"is exactly 0 on all {n:,} loss tokens, so p_train = 1 everywhere" in msg
    assert "loss_fn.force_on_policy_ratio=True" in msg and "force_on_policy_ratio=false" in msg
    assert "mismatch_replay.capture.TokenWriter" in msg
    with pytest.raises(DataError, match="prev_logprobs"):  # not a row problem: no dropping it
        ingest.read_table([src], ingest.ReadOptions(drop_invalid=True))
    # a real file where some tokens happen to be 0.0 (p = 1 in float32) is read
    seqs = next(sequences(golden))[1]
    batch = nemo_batch(seqs)
    batch["prev_logprobs"][0][3] = 0.0
    path = tmp_path / "ok" / "train_data_step0.jsonl"
    path.parent.mkdir()
    path.write_text(
        "".join(
            json.dumps({**{k: v[i : i + 1] for k, v in batch.items()}, "idx": i}) + "\n"
            for i in range(len(seqs))
        )
    )
    assert (
        ingest.read_table([path]).height == golden.filter(pl.col("step") == 0, "loss_mask").height
    )


def test_nemo_rl_a_line_holding_several_samples_is_reported(golden, tmp_path):
    seqs = next(sequences(golden))[1]
    batch = nemo_batch(seqs)
    lines = [
        json.dumps({**{k: v[i : i + 1] for k, v in batch.items()}, "idx": i}) for i in range(3)
    ]
    lines.append(json.dumps({**{k: v[3:5] for k, v in batch.items()}, "idx": 3}))
    path = tmp_path / "train_data_step0.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        ingest.read_table([path])
    assert "train_data_step0.jsonl, line 4: NeMo-RL writes one sample per line" in str(e.value)
    assert "prev_logprobs 2" in str(e.value)
    report = ingest.ReadReport()
    t = ingest.read_table([path], ingest.ReadOptions(drop_invalid=True), report=report)
    assert report.dropped_records == 1 and sorted(set(t["sample_id"])) == [0, 1, 2]


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
    t = ingest.read_table([src])
    assert t["sample_id"].to_list() == [0, 0, 2, 2]  # index in the file, blank lines skipped
    assert t["position"].to_list() == [1, 2, 1, 2] and set(t["step"]) == {4}
    bare = {k: v for k, v in base.items() if k != "token_loss_mask"}
    src = _write_lines(tmp_path / "b" / "train_data_step1.jsonl", [bare])
    with pytest.warns(ingest.IngestWarning, match="no token_loss_mask"):
        assert ingest.read_table([src]).height == 3  # the prompt token counts too
    # the same records in NeMo-RL's wrapped layout, idx as written
    wrapped = [
        {**{k: [v] for k, v in r.items()}, "idx": i} for i, r in enumerate([base, off, base])
    ]
    src = _write_lines(tmp_path / "w" / "train_data_step4.jsonl", wrapped)
    t = ingest.read_table([src])
    assert t["sample_id"].to_list() == [0, 0, 2, 2] and t["position"].to_list() == [1, 2, 1, 2]


# ----------------------------------------------------------------------------- slime


def test_slime_dump_details_tree_reads_train_data_and_skips_rollout_data(golden, tmp_path):
    d = write_slime(golden, tmp_path / "details", dump_details=True)
    with pytest.warns(ingest.IngestWarning) as w:
        plan = ingest.plan_sources([d])
    assert [p.parent.name for p in plan.files] == ["train_data"] * 8
    note = next(str(x.message) for x in w if "rollout" in str(x.message))
    assert note.startswith(f"skipped 8 slime rollout dump(s) under {d / 'rollout_data'}")
    assert "without trainer log-probs; the train dumps beside them (train_data/) are read" in note
    assert note in plan.warnings
    with pytest.warns(ingest.IngestWarning, match="skipped 8 slime rollout dump"):
        got = engine.sweep([d], rules=SPECS).table
    want = engine.sweep([GOLDEN_LOG], rules=SPECS).table
    assert_tables_equal(got, want, rel=1e-12)
    # a glob over the whole tree does the same
    with pytest.warns(ingest.IngestWarning, match="skipped 8 slime rollout dump"):
        assert len(ingest.plan_sources([str(d / "**" / "*.pt")]).files) == 8


def test_a_slime_rollout_dump_on_its_own_says_where_the_train_dumps_are(golden, tmp_path):
    d = write_slime(golden, tmp_path / "details", dump_details=True)
    for src in (d / "rollout_data" / "3.pt", d / "rollout_data"):
        with pytest.raises(DataError) as e:
            ingest.plan_sources([src])
        msg = str(e.value)
        assert "0.pt" in msg or "3.pt" in msg
        assert "a slime rollout dump (12 samples" in msg and "not a train dump" in msg
        assert "no trainer log-probs (log_probs)" in msg
        assert f"read {d / 'train_data'} instead" in msg
    torch.save(slime_rollout_dump(next(sequences(golden))[1], 0), tmp_path / "alone.pt")
    with pytest.raises(DataError, match="--save-debug-train-data PATH writes PATH\\."):
        ingest.plan_sources([tmp_path / "alone.pt"])


def test_slime_positions_steps_and_safe_loading(golden, tmp_path):
    seqs = next(_sequences(golden))[1][:2]
    dump = slime_dump(seqs, step=42)
    dump["samples"][1]["log_probs"] = dump["samples"][1]["log_probs"].float()  # real dumps
    torch.save(dump, tmp_path / "r42.pt")
    t = ingest.read_table([tmp_path / "r42.pt"])
    assert set(t["step"]) == {42} and sorted(set(t["sample_id"])) == [0, 1]
    g = golden.filter(pl.col("step") == 0, pl.col("sample_id") == 0, "loss_mask")
    assert t.filter(pl.col("sample_id") == 0)["position"].to_list() == g["position"].to_list()
    # arbitrary objects are never unpickled
    torch.save(
        {"format_version": 2, "rollout_id": 1, "samples": [NotPlainData()]}, tmp_path / "x.pt"
    )
    with pytest.raises(DataError, match="never unpickles arbitrary objects"):
        ingest.plan_sources([tmp_path / "x.pt"])


class NotPlainData:
    def __init__(self):
        self.x = 1


def test_slime_dump_with_unexpected_keys_lists_found_and_expected(tmp_path):
    torch.save({"rollout_id": 1, "rank": 0, "rollout_data": {}}, tmp_path / "old.pt")
    with pytest.raises(DataError) as e:
        ingest.plan_sources([tmp_path / "old.pt"])
    msg = str(e.value)
    assert "old.pt" in msg and "keys found: rank, rollout_data, rollout_id" in msg
    assert "expected: format_version, rollout_id, samples" in msg
    sample = {"log_prob": torch.zeros(3), "rollout_log_probs": torch.zeros(3)}
    torch.save({"format_version": 2, "rollout_id": 1, "samples": [sample]}, tmp_path / "s.pt")
    with pytest.raises(DataError, match=r"samples\[0\].*log_probs missing.*found: log_prob, "):
        ingest.plan_sources([tmp_path / "s.pt"])
    torch.save({"format_version": 3, "rollout_id": 1, "samples": []}, tmp_path / "v3.pt")
    with pytest.raises(DataError, match="format_version 3"):
        ingest.plan_sources([tmp_path / "v3.pt"])


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
        ingest.plan_sources([tmp_path / "d.pt"])


# ----------------------------------------------------------------------------- SkyRL


def test_skyrl_pickle_reads_with_pad_rows_left_out(sources, golden):
    plan = ingest.plan_sources([sources["skyrl"]])
    assert [p.name for p in plan.files][:2] == [
        "global_step_0_training_input.pkl",
        "global_step_1_training_input.pkl",
    ]
    state = skyrl.load_skyrl(plan.files[0])
    assert state["batch_size"] == 15 and state["metadata"]["pad_size"] == 3  # 12 + DP padding
    t = ingest.read_table([plan.files[0]])
    assert sorted(set(t["sample_id"])) == list(range(12))  # rows 12..14 are padding
    want = golden.filter(pl.col("step") == 0, "loss_mask")
    assert t.height == want.height and set(t["step"]) == {0}


class _Boom:
    """An object whose unpickling would run code: create a directory."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.makedirs, (str(self.target),))


def test_skyrl_pickle_with_any_other_object_is_refused_and_never_runs(golden, tmp_path):
    marker = tmp_path / "pwned"

    def sneak(state):
        state["metadata"]["metrics"] = _Boom(marker)

    src = write_skyrl(golden.filter(pl.col("step") == 0), tmp_path / "x", edit=sneak)
    with pytest.raises(DataError) as e:
        ingest.plan_sources([src])
    msg = str(e.value)
    assert "global_step_0_training_input.pkl: the pickle names posix.makedirs" in msg or (
        "the pickle names os.makedirs" in msg
    )
    assert "not part of a SkyRL TrainingInputBatch dump" in msg
    assert "never unpickles arbitrary objects" in msg and "TokenWriter" in msg
    assert not marker.exists()
    # a pickle of something else altogether
    (tmp_path / "other.pkl").write_bytes(pickle.dumps({"a": [1, 2]}))
    with pytest.raises(DataError, match=r"other.pkl: the pickle holds a dict, not a SkyRL"):
        ingest.plan_sources([tmp_path / "other.pkl"])


def test_skyrl_batch_without_trainer_logprobs_says_why(golden, tmp_path):
    def skip_forward(state):  # _skip_policy_forward: the policy's forward never ran
        state["batch_dict"]["action_log_probs"] = None

    src = write_skyrl(golden.filter(pl.col("step") == 0), tmp_path / "x", edit=skip_forward)
    with pytest.raises(DataError) as e:
        ingest.plan_sources([src])
    msg = str(e.value)
    assert "global_step_0_training_input.pkl: the batch holds no action_log_probs" in msg
    assert "_skip_policy_forward" in msg and "off_policy_correction" in msg

    def no_sampler(state):
        state["batch_dict"]["rollout_logprobs"] = None

    src = write_skyrl(golden.filter(pl.col("step") == 0), tmp_path / "y", edit=no_sampler)
    with pytest.raises(DataError, match=r"no rollout_logprobs.*generator.sampling_params.logprobs"):
        ingest.plan_sources([src])


def test_skyrl_bfloat16_tensors_take_the_torch_path(golden, tmp_path):
    """SkyRL stores dtypes numpy lacks (bf16) as a torch.save blob, loaded weights_only."""

    def to_bf16(state):
        b = state["batch_dict"]["action_log_probs"]
        arr = np.frombuffer(b["data"], dtype=b["dtype"]).reshape(b["shape"])
        buf = __import__("io").BytesIO()
        torch.save(torch.tensor(arr).to(torch.bfloat16), buf)
        state["batch_dict"]["action_log_probs"] = {"format": "torch", "data": buf.getvalue()}

    src = write_skyrl(golden.filter(pl.col("step") == 0), tmp_path / "x", edit=to_bf16)
    t = ingest.read_table([src])
    want = golden.filter(pl.col("step") == 0, "loss_mask").sort("sample_id", "position")
    got = t.sort("sample_id", "position")["trainer_logprob"].to_numpy()
    bf16 = torch.tensor(want["trainer_logprob"].to_numpy()).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(got, bf16)


# ----------------------------------------------------------------------------- prime-rl traces


def test_trace_fixture_is_episodes_of_message_graphs(sources):
    tdir = sources["prime-rl-traces"]
    first = json.loads((tdir / "stream.jsonl").read_text().splitlines()[0])
    assert set(first) >= {"id", "env", "run", "traces"} and len(first["traces"]) == 1
    nodes = first["traces"][0]["nodes"]
    assert "parent" not in nodes[0]  # exclude_none drops the root's parent
    paths = prime_rl._leaf_paths(nodes)  # two branches below a shared root, leaves in order
    assert len(paths) == 2 and paths[0][0] == paths[1][0] == 0 and paths[0][-1] < paths[1][-1]
    assert [nodes[p[-1]]["sampled"] for p in paths] == [True, True]
    upd = json.loads((tdir / "annotations" / "trainer.jsonl").read_text().splitlines()[0])
    assert set(upd) == {"version", "trace_id", "info", "branches"}
    br = upd["branches"][0]
    assert br["index"] == 0 and br["trainer_logprobs"][0] is None
    assert set(br) == {"index", "trainer_logprobs", "entropies", "is_masked"}


def test_traces_without_annotations_are_refused_with_the_reason(golden, tmp_path):
    run = write_traces(golden.filter(pl.col("step") == 0), tmp_path / "run")
    tdir = run / "monitors" / "file" / "traces"
    for p in (tdir / "annotations").iterdir():
        p.unlink()
    with pytest.raises(DataError) as e:
        ingest.plan_sources([tdir])
    msg = str(e.value)
    assert "stream.jsonl: no trainer annotations beside the trace stream" in msg
    assert "the traces hold only the sampler's" in msg and "annotations/trainer.jsonl" in msg


def test_traces_with_node_advantages_and_an_annotation_for_a_missing_trace(golden, tmp_path):
    part = golden.filter(pl.col("step") < 2)
    run = write_traces(part, tmp_path / "run", node_advantages=True)
    tdir = run / "monitors" / "file" / "traces"
    assert not (tdir / "annotations" / "orchestrator.jsonl").read_text()
    with open(tdir / "annotations" / "trainer.jsonl", "a") as f:
        f.write(json.dumps({"version": 1, "trace_id": "f" * 32, "info": {}, "branches": []}) + "\n")
        f.write(
            json.dumps(
                {
                    "version": 1,
                    "trace_id": "e" * 32,
                    "info": {},
                    "branches": [{"index": 0, "trainer_logprobs": [None, -1.0]}],
                }
            )
            + "\n"
        )
    report = ingest.ReadReport()
    t = ingest.read_table([tdir], report=report)
    want = part.filter("loss_mask").sort("step", "position", "trainer_logprob").select(COLS)
    assert canon(t, "prime-rl-traces").equals(want)
    assert any(
        "1 trace(s) named by the trainer annotations are not in the stream" in w
        for w in report.warnings
    )


def test_a_torn_annotation_line_names_file_and_line_or_is_skipped(golden, tmp_path):
    part = golden.filter(pl.col("step") == 0)
    run = write_traces(part, tmp_path / "run")
    tdir = run / "monitors" / "file" / "traces"
    ann = tdir / "annotations" / "trainer.jsonl"
    lines = ann.read_text().splitlines()
    ann.write_text("\n".join([*lines, lines[0][:50]]) + "\n")  # the trainer died mid-append
    with pytest.raises(DataError, match=rf"trainer.jsonl, line {len(lines) + 1}: not valid JSON"):
        ingest.plan_sources([tdir])
    report = ingest.ReadReport()
    t = ingest.read_table([tdir], ingest.ReadOptions(drop_invalid=True), report=report)
    assert t.height == part.filter("loss_mask").height and report.dropped_records == 1


def test_trace_ce_tokens_leave_the_mask(golden, tmp_path):
    """A branch whose is_masked stream is null on some loss tokens (prime-rl annotates only its
    RL component) or whose nodes carry rl loss weights 0: those tokens are not replayed."""
    part = golden.filter(pl.col("step") == 0)
    run = write_traces(part, tmp_path / "run")
    tdir = run / "monitors" / "file" / "traces"
    lines = (tdir / "annotations" / "trainer.jsonl").read_text().splitlines()
    upd = json.loads(lines[0])
    im = upd["branches"][0]["is_masked"]
    loss_at = [k for k, v in enumerate(upd["branches"][0]["trainer_logprobs"]) if v is not None]
    for k in loss_at[:5]:
        im[k] = None
    lines[0] = json.dumps(upd)
    (tdir / "annotations" / "trainer.jsonl").write_text("\n".join(lines) + "\n")
    t = ingest.read_table([tdir])
    assert t.height == part.filter("loss_mask").height - 5


# ----------------------------------------------------------------------------- prime-rl


def test_prime_rl_records_are_the_exporters(sources):
    line = (sources["prime-rl"] / "step_0" / "rank_0.jsonl").read_text().splitlines()[0]
    rec = json.loads(line)
    assert list(rec)[:7] == [
        "schema_version",
        "step",
        "rank",
        "micro_step",
        "micro_sequence_idx",
        "export_sequence_idx",
        "env_name",
    ]
    assert ", " not in line and '": ' not in line  # separators=(",", ":")
    assert rec["trainer_logprobs"][0] == math.log(1 / 151_936) and rec["loss_mask"][0] is False
    second = json.loads(
        (sources["prime-rl"] / "step_0" / "rank_0.jsonl").read_text().splitlines()[1]
    )
    assert second["micro_sequence_idx"] == 1  # the right shift moved rec's last value in
    assert second["trainer_logprobs"][0] == rec["trainer_logprobs"][-1]
    assert rec["rl_weights"] == [None] * len(rec["loss_mask"])


def test_prime_rl_ce_tokens_carry_no_mismatch(golden, tmp_path):
    """Tokens with rl_weights == 0 and ref_kl_weights == 0 (CE / SFT / distillation) leave the
    mask; ref_kl tokens (on-policy distillation) stay, as in prime-rl's mismatch metric."""
    part = golden.filter(pl.col("step") == 0)

    def route(step, k, rec):
        n = len(rec["loss_mask"])
        if k == 0:  # an SFT sample: its action tokens routed to the ce component
            rec["rl_weights"] = [0.0] * n
            rec["ce_weights"] = [1.0 if m else 0.0 for m in rec["loss_mask"]]
        if k == 1:  # a distillation sample: ref_kl component
            rec["rl_weights"] = [0.0] * n
            rec["ref_kl_weights"] = [1.0 if m else 0.0 for m in rec["loss_mask"]]

    src = write_prime(part, tmp_path, edit=route)
    with pytest.warns(ingest.IngestWarning, match=r"rl_weights == 0 and ref_kl_weights == 0 \(CE"):
        t = ingest.read_table([src])
    ce = sum(
        g["loss_mask"].sum() for k, g in enumerate(next(sequences(part))[1]) if k in (0, 6)
    )  # k == 0 on each of the two ranks
    assert t.height == part.filter("loss_mask").height - ce


def test_prime_check_agrees_with_the_exported_is_masked(sources):
    check = prime_check([sources["prime-rl"]])
    n = 19598
    masked = check.logged_masked
    assert check.rule == "dppo-tv@prime-rl" and check.tokens == n and check.agree == n
    assert check.line() == (
        f"{n:,} of {n:,} tokens agree with prime-rl's is_masked (replayed as dppo-tv@prime-rl; "
        f"{masked:,} masked in the run, {masked:,} in the replay); mismatch_kl equals the "
        f"replayed k3 on {n:,} of {n:,} tokens"
    )
    assert masked > 10
    assert prime_check([sources["nemo-rl"]]) is None  # nothing logged to check


def test_prime_check_names_disagreements(golden, tmp_path):
    """The export written in float32 arithmetic by torch, and one decision flipped."""
    part = as_written(golden.filter(pl.col("step") < 3))

    def flip(step, k, rec):
        if step == 1 and k == 2 and rec["rank"] == 0:  # the third sample; its first loss token
            at = rec["loss_mask"].index(True)
            rec["is_masked"][at] = not rec["is_masked"][at]
            flipped.append(at)

    flipped = []

    src = write_prime(part, tmp_path, dtype="float32", edit=flip)
    check = prime_check([src])
    assert check.tokens == part.filter("loss_mask").height
    assert check.agree == check.tokens - 1
    assert f"first disagreements: step 1 sample 2 position {flipped[0]} (run " in check.line()


def test_prime_check_on_traces_names_the_rule_that_fits(golden, tmp_path):
    part = golden.filter(pl.col("step") < 2)
    n = part.filter("loss_mask").height
    for kind, rule in (("dppo-tv", "dppo-tv@prime-rl"), ("ipo", "ipo@prime-rl")):
        run = write_traces(part, tmp_path / kind, is_masked=kind)
        check = prime_check([run / "monitors" / "file" / "traces"])
        assert check.rule == rule and check.agree == check.tokens == n
        assert "the best of dppo-tv@prime-rl, ipo@prime-rl, ipo@prime-rl-legacy" in check.line()
    run = write_traces(part, tmp_path / "none", is_masked=None)
    assert prime_check([run / "monitors" / "file" / "traces"]) is None


# ----------------------------------------------------------------------------- prime-rl records


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
    t = ingest.read_table([src])
    assert t["position"].to_list() == [2, 3]
    assert t["sample_id"].to_list() == [2_000_017] * 2  # rank 2, sequence 17
    assert t["step"].to_list() == [9, 9]
    assert t["env"].to_list() == ["math"] * 2
    assert t["entropy"].to_list() == [0.2, 0.3]


def test_prime_rl_unstable_steps_are_skipped_with_a_warning(tmp_path):
    src = _prime_step(tmp_path, 1, {0: [_prime_record(step=1)]})
    _prime_step(tmp_path, 2, {0: [_prime_record(step=2), '{"step": 2, "trainer_lo']}, False)
    with pytest.warns(ingest.IngestWarning, match=r"skipped 1 prime-rl step\(s\) without a STABLE"):
        plan = ingest.plan_sources([src])
    assert [p.parent.name for p in plan.files] == ["step_1"]
    report = ingest.ReadReport()
    assert ingest.read_table(plan, report=report)["step"].to_list() == [1, 1]
    assert "--include-unstable" in report.warnings[0]
    # taking them: the half-written last line is an error naming file and line ...
    opts = ingest.ReadOptions(include_unstable=True)
    with (
        pytest.warns(ingest.IngestWarning),
        pytest.raises(DataError, match=r"rank_0.jsonl, line 2"),
    ):
        ingest.read_table([src], opts)
    # ... or skipped and counted
    opts = ingest.ReadOptions(include_unstable=True, drop_invalid=True)
    report = ingest.ReadReport()
    with pytest.warns(ingest.IngestWarning):
        t = ingest.read_table([src], opts, report=report)
    assert sorted(set(t["step"])) == [1, 2] and report.dropped_records == 1
    # every step unstable: nothing to read, and the error says how to read them anyway
    (src / "step_1" / "STABLE").unlink()
    with pytest.raises(DataError, match=r"still being written.*--include-unstable"):
        ingest.plan_sources([src])


# ----------------------------------------------------------------------------- hardening


def test_truncated_and_malformed_lines_name_file_and_line(tmp_path):
    good = _prime_record()
    src = _prime_step(tmp_path, 3, {0: [good, "{not json}", good, json.dumps(good)[:-20]]})
    with pytest.raises(DataError) as e:
        ingest.read_table([src])
    msg = str(e.value)
    assert "rank_0.jsonl, line 2: not valid JSON" in msg and "--drop-invalid" in msg
    report = ingest.ReadReport()
    t = ingest.read_table([src], ingest.ReadOptions(drop_invalid=True), report=report)
    assert t.height == 4 and report.dropped_records == 2  # 2 good records x 2 loss tokens
    key = (str(src / "step_3" / "rank_0.jsonl"), "records: not valid JSON")
    assert report.dropped[key] == 2


def test_arrays_of_unequal_length_within_a_record(tmp_path):
    bad = _prime_record(trainer_logprobs=[None, -0.5, -0.5])
    src = _prime_step(tmp_path, 3, {0: [_prime_record(), bad]})
    with pytest.raises(DataError, match=r"line 2: per-token arrays of unequal length") as e:
        ingest.read_table([src])
    assert "trainer_logprobs 3" in str(e.value) and "inference_logprobs 4" in str(e.value)
    report = ingest.ReadReport()
    assert (
        ingest.read_table([src], ingest.ReadOptions(drop_invalid=True), report=report).height == 2
    )
    assert report.dropped_records == 1
    # slime: a sample whose response arrays disagree
    s = slime_dump([pl.read_parquet(GOLDEN_LOG).head(40)], step=0)
    s["samples"][0]["rollout_log_probs"] = s["samples"][0]["rollout_log_probs"][:-1]
    torch.save(s, tmp_path / "u.pt")
    with pytest.raises(DataError, match=r"u.pt, samples\[0\]: response arrays of unequal"):
        ingest.read_table([tmp_path / "u.pt"])


def test_a_record_without_the_expected_keys(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [{"step": 3, "tokens": [{"id": 1}]}]})
    with pytest.raises(DataError) as e:
        ingest.plan_sources([src])
    msg = str(e.value)
    assert "line 1: not a prime-rl record" in msg and "Keys found: step, tokens" in msg
    assert "Keys expected: trainer_logprobs, inference_logprobs, loss_mask" in msg
    # a later record lacking one: named by line, or skipped
    rec = _prime_record()
    del rec["inference_logprobs"]
    src = _prime_step(tmp_path / "b", 3, {0: [_prime_record(), rec]})
    with pytest.raises(DataError, match=r"line 2: prime-rl record without inference_logprobs"):
        ingest.read_table([src])


def test_an_empty_rank_file_is_skipped_and_all_empty_is_an_error(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [_prime_record()], 1: []})
    with pytest.warns(ingest.IngestWarning, match="1 empty file"):
        assert ingest.read_table([src]).height == 2
    src = _prime_step(tmp_path / "e", 3, {0: [], 1: []})
    with pytest.raises(DataError, match="no record to read"):
        ingest.plan_sources([src])


def test_mixed_formats_are_refused(sources):
    with pytest.raises(DataError) as e:
        ingest.plan_sources([sources["nemo-rl"], sources["parquet"]])
    msg = str(e.value)
    assert "mix formats" in msg and "is nemo-rl" in msg and "is parquet" in msg


def test_mixed_directory_is_refused_with_what_it_holds(sources, tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.parquet").write_bytes(sources["parquet"].read_bytes())
    (d / "b.jsonl").write_bytes(sources["jsonl"].read_bytes())
    with pytest.raises(DataError, match=r"mixes formats: 1 parquet file.*1 jsonl file.*--format"):
        ingest.plan_sources([d])
    assert ingest.plan_sources([d], ingest.ReadOptions(format="jsonl")).format == "jsonl"


def test_a_directory_with_nothing_readable(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    (tmp_path / "d" / "STABLE").write_text("")
    with pytest.raises(DataError, match=r"no \.parquet file and no other token log.*2 other"):
        ingest.plan_sources([tmp_path / "d"])


@pytest.mark.parametrize("fmt", [*FRAMEWORK_FORMATS, "parquet", "jsonl"])
def test_a_file_that_disappears_while_being_read(sources, tmp_path, fmt):
    import shutil

    src = sources[fmt]
    copy = tmp_path / "copy"
    (shutil.copytree if src.is_dir() else shutil.copy)(src, copy)
    plan = ingest.plan_sources([copy])
    victim = plan.files[-1]
    batches = ingest.iter_batches(plan)
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
        ingest.read_table([src])
    msg = str(e.value)
    assert "rank_0.jsonl" in msg and "trainer_logprob" in msg
    assert f"1 of 4 loss rows are {what}" in msg
    report = ingest.ReadReport()
    t = ingest.read_table([src], ingest.ReadOptions(drop_invalid=True), report=report)
    assert t.height == 3 and report.dropped_rows == 1 and report.dropped_records == 0


def test_a_value_of_the_wrong_type_names_line_and_key(tmp_path):
    src = _prime_step(tmp_path, 3, {0: [_prime_record(), _prime_record(loss_mask="yes")]})
    with pytest.raises(DataError, match=r"line 2: key 'loss_mask': expected an array"):
        ingest.read_table([src])


def test_jsonl_token_rows_aliases_map_and_probabilities(tmp_path):
    rows = [
        {"lp": 0.5, "inference_probs": 0.25, "step": 1, "extra": {"nested": [1]}},
        {"lp": 1, "inference_probs": 1, "step": 1},
    ]
    src = _write_lines(tmp_path / "p.jsonl", rows)
    opts = ingest.ReadOptions(mapping={"trainer_logprob": "lp"}, probs=True)
    t = ingest.read_table([src], opts)
    np.testing.assert_allclose(t["trainer_logprob"], [math.log(0.5), 0.0])
    np.testing.assert_allclose(t["inference_logprob"], [math.log(0.25), 0.0])


# ----------------------------------------------------------------------------- command line


def test_cli_reads_each_format_and_prints_warnings(sources, tmp_path):
    for fmt in FRAMEWORK_FORMATS:
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
        ingest.plan_sources([tmp_path / "half.pt"])
    assert os.path.getsize(tmp_path / "full.pt") == len(data)


def test_inspect_prints_the_prime_rl_agreement(sources):
    import json

    from typer.testing import CliRunner

    from mismatch_replay.cli import app

    res = CliRunner().invoke(app, ["inspect", str(sources["prime-rl"])])
    assert res.exit_code == 0, res.output
    assert "prime-rl check" in res.stdout
    assert "agree with prime-rl's is_masked" in " ".join(res.stdout.split())
    res = CliRunner().invoke(app, ["inspect", str(sources["prime-rl"]), "--json"])
    d = json.loads(res.stdout)["prime_rl_check"]
    assert d == json.loads(json.dumps(prime_check([sources["prime-rl"]]).to_dict()))
    res = CliRunner().invoke(app, ["inspect", str(sources["nemo-rl"]), "--json"])
    assert "prime_rl_check" not in json.loads(res.stdout)


def test_nemo_rl_negative_input_lengths_are_a_bad_record(golden, tmp_path):
    """A NeMo-RL line (written as write_nemo lays it out) whose input_lengths is -5."""
    src = write_nemo(golden, tmp_path / "logs")
    f = src / "train_data_step0.jsonl"
    lines = f.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["input_lengths"] = [-5]
    lines[1] = json.dumps(rec)
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"train_data_step0.jsonl, line 2: input_lengths -5 is neg"):
        ingest.read_table([src])
    report = ingest.ReadReport()
    t = ingest.read_table([src], ingest.ReadOptions(drop_invalid=True), report=report)
    dropped = {c: n for (_, c), n in report.dropped.items()}
    assert dropped == {"records: negative input_lengths": 1}
    want = golden.filter(pl.col("loss_mask")).height
    gone = golden.filter((pl.col("step") == 0) & pl.col("loss_mask")).group_by("sample_id")
    assert t.height < want and t.height >= want - max(g.height for _, g in gone)
