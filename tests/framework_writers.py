"""Test fixtures: a canonical token table written the way each framework's writer lays it out.

Every writer below was built from the framework's own writer code, read at the commit named
in its docstring (the layouts are restated here in our words; no framework code is copied).
Each takes a canonical table (`step, sample_id, position, trainer_logprob,
inference_logprob, advantage, loss_mask, env`, one row per token, positions from 0) and
writes the same tokens in the framework's layout, so a reader that gets the layout right
replays them to the very counts of the canonical Parquet.

Values: the writers store float32 (`tensor.to(float32).tolist()`, float32 tensors). By
default the fixtures keep the table's float64 values in the same slots, so that they equal
the golden log exactly; `dtype="float32"` (and, for traces, `decimals`) writes what the
frameworks would, and the tests compare that with a Parquet of the same rounded table
(`as_written`).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import types
import uuid
from pathlib import Path

import numpy as np
import polars as pl

VOCAB = 151_936  # prime-rl pads position 0 with log(1/vocab) after the right shift


def sequences(df: pl.DataFrame):
    """(step, [sequence frames sorted by position]) per step, sequences in sample_id order."""
    df = df.sort("step", "sample_id", "position")
    for (step,), part in df.group_by("step", maintain_order=True):
        yield int(step), [g for _, g in part.group_by("sample_id", maintain_order=True)]


def as_written(df: pl.DataFrame, dtype: str = "float32", decimals: int | None = None):
    """The table with its float columns rounded as a writer stores them (float32, then
    `round(x, decimals)` for prime-rl's trace monitor)."""

    def r(c: str) -> pl.Expr:
        x = pl.col(c).cast(pl.Float32).cast(pl.Float64) if dtype == "float32" else pl.col(c)
        return x.round(decimals) if decimals is not None else x

    return df.with_columns(r("trainer_logprob"), r("inference_logprob"), r("advantage"))


def _f(x: float, dtype: str, decimals: int | None = None) -> float | None:
    """One value as the writer's `_tensor_to_floats` gives it (None when not finite)."""
    v = float(np.float32(x)) if dtype == "float32" else float(x)
    if not math.isfinite(v):
        return None
    return round(v, decimals) if decimals is not None else v


# ----------------------------------------------------------------------------- prime-rl


def prime_record_fields(
    g: pl.DataFrame, dtype: str = "float64", high=0.2, low=0.2, shifted_in: float | None = None
) -> dict:
    """The per-token arrays of one prime-rl token-export record for one golden sequence.

    PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/token_export.py (`_export_columns`,
    `_compute_export_tensors`) and train.py at 559b447: a record covers one packed sample,
    index 0 its first token, whose trainer log-prob is what the right shift of the packed
    micro batch moved in (`shifted_in`: the previous sample's last value; the pad log 1/vocab
    for the micro batch's first sample); the sampler's log-probs are 0.0 off the sampled
    tokens (the branch's
    spread); `log_importance_ratio = lp - lq`, `importance_ratio = exp(.)`, `mismatch_kl =
    ratio - log_ratio - 1`, `prob_delta = exp(lp) - exp(lq)` over every position (non-finite
    -> null); under DefaultLossConfig `is_masked = loss_mask & where(A > 0, delta > high,
    delta < -low)`, `is_masked_high`/`_low` the sided parts; weight streams null (defaults).
    The golden tokens sit at indexes 1..n (a BOS before them), so index 0 is never a loss
    token, as in every real sample.
    """
    n = g.height
    loss = [False, *g["loss_mask"].to_list()]
    first = math.log(1.0 / VOCAB) if shifted_in is None else shifted_in
    lp = np.array([first, *g["trainer_logprob"].to_list()])
    lq_raw = [0.0, *g["inference_logprob"].to_list()]
    lq = np.array([x if m else 0.0 for x, m in zip(lq_raw, loss, strict=True)])
    adv = np.array([g["advantage"][0], *g["advantage"].to_list()])
    if dtype == "float32":  # the writer's own arithmetic: float32 tensors
        import torch

        tlp, tlq = torch.tensor(lp, dtype=torch.float32), torch.tensor(lq, dtype=torch.float32)
        log_ratio = tlp - tlq
        ratio = torch.exp(log_ratio)
        kl = (ratio - log_ratio - 1).double().numpy()
        delta = (torch.exp(tlp) - torch.exp(tlq)).double().numpy()
        log_ratio, ratio = log_ratio.double().numpy(), ratio.double().numpy()
    else:
        log_ratio = lp - lq
        ratio = np.exp(log_ratio)
        kl = ratio - log_ratio - 1
        delta = np.exp(lp) - np.exp(lq)
    mask = np.array(loss)
    pos, neg = adv > 0, adv < 0
    inv_high, inv_low = delta > high, delta < -low
    return {
        "token_ids": [1, *range(100, 100 + n)],
        "position_ids": list(range(n + 1)),
        "loss_mask": loss,
        "advantages": [_f(x, dtype) for x in adv],
        "inference_logprobs": [_f(x, dtype) for x in lq],
        "trainer_logprobs": [_f(x, dtype) for x in lp],
        "entropy": [_f(math.log(VOCAB), dtype), *(_f(0.1 + abs(x), dtype) for x in lq[1:])],
        "mismatch_kl": [_f(x, dtype) for x in kl],
        "log_importance_ratio": [_f(x, dtype) for x in log_ratio],
        "importance_ratio": [_f(x, dtype) for x in ratio],
        "prob_delta": [_f(x, dtype) for x in delta],
        "is_masked": [bool(x) for x in mask & np.where(pos, inv_high, inv_low)],
        "is_masked_high": [bool(x) for x in mask & pos & inv_high],
        "is_masked_low": [bool(x) for x in mask & neg & inv_low],
        "rl_weights": [None] * (n + 1),
        "ce_weights": [None] * (n + 1),
        "ref_kl_weights": [None] * (n + 1),
    }


def write_prime(
    df: pl.DataFrame,
    root: Path,
    ranks: int = 2,
    stable: bool = True,
    dtype: str = "float64",
    per_micro_batch: int = 3,
    edit=None,
) -> Path:
    """prime-rl token export: `<output_dir>/token_exports/step_<n>/rank_<r>.jsonl`.

    PrimeIntellect-ai/prime-rl, src/prime_rl/trainer/rl/token_export.py (`TokenExporter`) at
    559b447: one JSON object per packed sample that has a loss token, written with
    `json.dumps(record, separators=(",", ":"), allow_nan=False)` and keys `schema_version` (1),
    `step`, `rank`, `micro_step`, `micro_sequence_idx` (the sample's place in its micro
    batch), `export_sequence_idx` (a counter per step file), `env_name`, then the per-token
    arrays of `prime_record_fields`; a `STABLE` file marks the step once every rank flushed.
    `edit(step, k, record)` may change a record before it is written.
    """
    out = root / "token_exports"
    for step, seqs in sequences(df):
        d = out / f"step_{step}"
        d.mkdir(parents=True)
        per = -(-len(seqs) // ranks)
        for r in range(ranks):
            exported = 0
            with open(d / f"rank_{r}.jsonl", "w") as f:
                mine = seqs[r * per : (r + 1) * per]
                for k, g in enumerate(mine):
                    if not g["loss_mask"].any():
                        continue  # the exporter skips samples without a loss token
                    prev = mine[k - 1] if k % per_micro_batch else None
                    shifted_in = None if prev is None else prev["trainer_logprob"][-1]
                    rec = {
                        "schema_version": 1,
                        "step": step,
                        "rank": r,
                        "micro_step": k // per_micro_batch,
                        "micro_sequence_idx": k % per_micro_batch,
                        "export_sequence_idx": exported,
                        "env_name": g["env"][0],
                        **prime_record_fields(g, dtype, shifted_in=shifted_in),
                    }
                    if edit is not None:
                        edit(step, k, rec)
                    f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n")
                    exported += 1
        if stable:
            (d / "STABLE").write_text("")
    return out


# ----------------------------------------------------------------------------- prime-rl traces


def _nodes_for(g: pl.DataFrame, parent: int, base: int, lq_of, tok0: int) -> list[dict]:
    """The message nodes one golden sequence adds below `parent`: its leading unsampled run
    as a user node (less the last two tokens), then an assistant node holding those two as
    the generation-prompt scaffold followed by the sampled completion (verifiers'
    attribution). `base` is the index the first new node gets."""
    mask = g["loss_mask"].to_list()
    first = mask.index(True) if True in mask else len(mask)
    scaffold = min(2, first)
    nodes = []
    if first - scaffold:
        nodes.append(
            {
                "parent": parent,
                "message": {"role": "user", "content": "Solve it."},
                "sampled": False,
                "timestamp": 1.0e9,
                "token_ids": list(range(tok0, tok0 + first - scaffold)),
                "mask": [False] * (first - scaffold),
                "is_content": [True] * (first - scaffold),
                "logprobs": [],
            }
        )
        parent = base
    done = first - scaffold
    comp = mask[first:]
    nodes.append(
        {
            "parent": parent,
            "message": {"role": "assistant", "content": "The answer is 4."},
            "sampled": True,
            "timestamp": 1.0e9 + 1,
            "token_ids": list(range(tok0 + done, tok0 + len(mask))),
            "mask": [False] * scaffold + comp,
            "is_content": [False] * scaffold + [True] * len(comp),
            "logprobs": [lq_of(i) for i in range(first, len(mask)) if mask[i]],
        }
    )
    return nodes


def write_traces(
    df: pl.DataFrame,
    root: Path,
    dtype: str = "float64",
    decimals: int | None = None,
    is_masked: str | None = "dppo-tv",
    node_advantages: bool = False,
) -> Path:
    """prime-rl trace stream + trainer annotations (the format that replaced the token export,
    PR #3444, merged 2026-08-31): `<run>/monitors/file/traces/stream.jsonl` and
    `.../traces/annotations/<producer>.jsonl`.

    Records, from PrimeIntellect-ai/verifiers at a60a606: `verifiers/v1/episode.py`
    (`Episode.to_record`: model_dump(mode="json", exclude_none=True) of `{"id", "env": {"id",
    "name"}, "task", "group", "run": {"type": "train", "id", "work": {"type": "train", "step",
    "policy"}}, "ok", "errors", "traces"}`), `verifiers/v1/trace.py` (`Trace`: `version`,
    `id`, `task`, `agent`, `nodes`, `calls`, `rewards`, ...; a branch per graph leaf, leaves
    in node order) and `verifiers/v1/graph.py` (`MessageNode`: `parent`, `message`,
    `sampled`, `token_ids` added to the sequence, per-token `mask`, `is_content`, and
    `logprobs` over the sampled tokens only). Two golden sequences of a step form one trace
    with two branches sharing a two-token root node, so golden position p sits at branch
    position p + 2; each step also streams one eval episode, never trained on.

    Annotations, from PrimeIntellect-ai/prime-rl at 65a1858 (a PR #3444-era commit of the
    code index): `src/prime_rl/trainer/rl/annotations.py` (`AnnotationWriter.export`: per
    trained sample an update `make_update(trace_id, branches={index: streams})` with streams
    `trainer_logprobs`, `entropies` and, when the loss reports it, `is_masked`, each over the
    sample's whole token prefix, null off the loss mask and at position 0, floats
    `round(x, float_decimals)`) and `src/prime_rl/monitors/file/traces/update.py`
    (`make_update`: `{"version": 1, "trace_id", "info": {}, "branches": [{"index", ...}]}`;
    `STREAM_FIELDS` adds `advantages`), appended by `FileMonitor.log_annotations` to
    `annotations/<producer>.jsonl`. The advantages are written here as an `orchestrator`
    producer's `advantages` stream (the producer's code is not in the commits read), or with
    `node_advantages=True` on the assistant nodes (verifiers' `MessageNode.advantages`).
    `is_masked`: the decision of "dppo-tv" (DPPO at 0.2) or "ipo" (|dp| > 0.3), or None.
    """
    tdir = root / "monitors" / "file" / "traces"
    (tdir / "annotations").mkdir(parents=True)
    stream = open(tdir / "stream.jsonl", "w")  # noqa: SIM115
    trainer = open(tdir / "annotations" / "trainer.jsonl", "w")  # noqa: SIM115
    orch = open(tdir / "annotations" / "orchestrator.jsonl", "w")  # noqa: SIM115
    ids = iter(uuid.UUID(int=k).hex for k in range(1, 1_000_000))
    try:
        for step, seqs in sequences(df):
            for pair in range(0, len(seqs), 2):
                group = seqs[pair : pair + 2]
                root_node = {
                    "message": {"role": "system", "content": "You are helpful."},
                    "sampled": False,
                    "timestamp": 1.0e9,
                    "token_ids": [1, 2],
                    "mask": [False, False],
                    "is_content": [False, False],
                    "logprobs": [],
                }  # parent None: dropped by exclude_none
                nodes, leaves = [root_node], []
                for k, g in enumerate(group):
                    lq = g["inference_logprob"].to_list()
                    new = _nodes_for(
                        g,
                        0,
                        len(nodes),
                        lambda i, lq=lq: _f(lq[i], dtype, decimals),
                        1000 * (k + 1),
                    )
                    if node_advantages:
                        a = g["advantage"].to_list()
                        for node in new:
                            if node["sampled"]:
                                node["advantages"] = [_f(a[0], dtype, decimals)] * sum(node["mask"])
                    nodes += new
                    leaves.append(g)
                tid = next(ids)
                trace = {
                    "version": 1,
                    "id": tid,
                    "verifiers": {"version": "0.1.99"},
                    "task": {"type": "MathTask", "data": {"question": "2+2?", "answer": "4"}},
                    "agent": {"config": {"id": "single-turn"}, "name": "agent", "trainable": True},
                    "tools": [],
                    "nodes": nodes,
                    "calls": [],
                    "request_rewrites": [],
                    "response_rewrites": [],
                    "rewards": {"correct": {"score": 1.0, "weight": 1.0}},
                    "metrics": {},
                    "info": {},
                    "extra_usage": [],
                    "is_completed": True,
                    "ok": True,
                    "stop_condition": "final_answer",
                    "errors": [],
                    "timing": {"start": 1.0e9},
                }
                episode = {
                    "id": next(ids),
                    "env": {"id": f"{group[0]['env'][0]}-env", "name": group[0]["env"][0]},
                    "task": trace["task"],
                    "group": {"id": f"g{step}-{pair}"},
                    "run": {
                        "type": "train",
                        "id": "run-1",
                        "work": {
                            "type": "train",
                            "step": step,
                            "policy": {"start": step, "end": step},
                        },
                    },
                    "ok": True,
                    "errors": [],
                    "traces": [trace],
                }
                stream.write(json.dumps(episode) + "\n")
                for b, g in enumerate(leaves):
                    streams = _trace_streams(g, dtype, decimals, is_masked)
                    if streams is None:
                        continue  # no loss token: never trained on, never annotated
                    adv = streams.pop("advantages")
                    upd = {
                        "version": 1,
                        "trace_id": tid,
                        "info": {},
                        "branches": [{"index": b, **streams}],
                    }
                    trainer.write(json.dumps(upd, separators=(",", ":")) + "\n")
                    if not node_advantages:
                        o = {
                            "version": 1,
                            "trace_id": tid,
                            "info": {},
                            "branches": [{"index": b, "advantages": adv}],
                        }
                        orch.write(json.dumps(o, separators=(",", ":")) + "\n")
            evaluation = {
                "id": next(ids),
                "env": {"id": "eval-env", "name": "eval"},
                "task": {"type": "MathTask", "data": {}},
                "run": {"type": "train", "id": "run-1", "work": {"type": "eval", "step": step}},
                "ok": True,
                "errors": [],
                "traces": [
                    {
                        "version": 1,
                        "id": next(ids),
                        "task": {"type": "MathTask", "data": {}},
                        "nodes": [root_node],
                    }
                ],
            }
            stream.write(json.dumps(evaluation) + "\n")
    finally:
        stream.close()
        trainer.close()
        orch.close()
    return root


def _trace_streams(g: pl.DataFrame, dtype, decimals, is_masked) -> dict | None:
    """One branch's annotation streams over its token prefix (root + sequence)."""
    loss = [False, False, *g["loss_mask"].to_list()]
    if not any(loss):
        return None
    lp = [0.0, 0.0, *g["trainer_logprob"].to_list()]
    lq = [0.0, 0.0, *g["inference_logprob"].to_list()]
    a = g["advantage"][0]
    out = {
        "trainer_logprobs": [
            _f(x, dtype, decimals) if m else None for x, m in zip(lp, loss, strict=True)
        ],
        "entropies": [_f(0.5, dtype, decimals) if m else None for m in loss],
        "advantages": [_f(a, dtype, decimals) if m else None for m in loss],
    }
    out["trainer_logprobs"][0] = out["entropies"][0] = None
    if is_masked is not None:
        flags = []
        for x, y, m in zip(lp, lq, loss, strict=True):
            d = math.exp(x) - math.exp(y)
            hit = (d > 0.2 if a > 0 else d < -0.2) if is_masked == "dppo-tv" else abs(d) > 0.3
            flags.append(bool(hit) if m else None)
        flags[0] = None
        out["is_masked"] = flags
    return out


# ----------------------------------------------------------------------------- NeMo-RL


def nemo_batch(seqs: list[pl.DataFrame], zero_prev: bool = False, divisible_by: int = 8) -> dict:
    """The per-step lists NeMo-RL's GRPO loop hands to the logger.

    NVIDIA-NeMo/RL, nemo_rl/algorithms/grpo.py (the "Logging" block of the sync loop) at
    7ea279a, in its key order: `content` (per sample, the messages' texts), `rewards`,
    `input_lengths`, `token_ids` (`train_data["input_ids"]`), `token_loss_mask`,
    `sample_loss_mask`, `advantages`, `generation_logprobs`, `prev_logprobs`, each
    `.tolist()` of a (batch, width) tensor right-padded to the longest sample (rounded up to
    `make_sequence_length_divisible_by`; nemo_rl/data/llm_message_utils.py
    `batched_message_log_to_flat_message`), pad value 0 (token_ids: the pad token).
    `token_loss_mask` is int (ones on generated assistant tokens), `sample_loss_mask` float,
    `generation_logprobs` 0.0 off the generated tokens, `advantages` per token (GRPO expands
    the sample's advantage to the mask's shape). With `force_on_policy_ratio=True` grpo.py
    logs `torch.zeros_like(generation_logprobs)` as `prev_logprobs` (`zero_prev`).
    """
    width = max(g.height for g in seqs)
    width = -(-width // divisible_by) * divisible_by
    pad = lambda xs, v: list(xs) + [v] * (width - len(xs))  # noqa: E731
    out: dict[str, list] = {k: [] for k in ("content", "rewards", "input_lengths", "token_ids")}
    for k in ("token_loss_mask", "sample_loss_mask", "advantages"):
        out[k] = []
    out["generation_logprobs"], out["prev_logprobs"] = [], []
    for g in seqs:
        loss = g["loss_mask"].to_list()
        lq = [x if m else 0.0 for x, m in zip(g["inference_logprob"].to_list(), loss, strict=True)]
        out["content"].append(["What is 2+2?", "4"])
        out["rewards"].append(1.0)
        out["input_lengths"].append(g.height)
        out["token_ids"].append(pad(range(10, 10 + g.height), 151_643))
        out["token_loss_mask"].append(pad([int(m) for m in loss], 0))
        out["sample_loss_mask"].append(1.0)
        out["advantages"].append(pad(g["advantage"].to_list(), 0.0))
        out["generation_logprobs"].append(pad(lq, 0.0))
        lp = [0.0] * g.height if zero_prev else g["trainer_logprob"].to_list()
        out["prev_logprobs"].append(pad(lp, 0.0))
    return out


def write_nemo(
    df: pl.DataFrame, root: Path, layout: str = "nemo-rl", zero_prev: bool = False
) -> Path:
    """NeMo-RL `<log_dir>/exp_<NNN>/train_data_step<N>.jsonl` (on by default).

    NVIDIA-NeMo/RL, nemo_rl/utils/logger.py (`Logger.log_batched_dict_as_jsonl`) at 7ea279a:
    the dict becomes a `BatchedDataDict` and is iterated with `make_microbatch_iterator(1)`
    (nemo_rl/distributed/batched_data_dict.py: `slice(i, i + 1)` of every value), so each
    line is `json.dumps({**sample, "idx": i}, default=str)` with every field a one-element
    list: `"prev_logprobs": [[...]]`, `"input_lengths": [n]`, `"sample_loss_mask": [1.0]`.
    The step of file `train_data_step{total_steps + 1}` is N; golden step s is written as
    file s (our step = the file's N). `layout="flat"`: the same records unwrapped, as other
    writers lay them out.
    """
    d = root / "exp_001"
    d.mkdir(parents=True, exist_ok=True)
    for step, seqs in sequences(df):
        batch = nemo_batch(seqs, zero_prev)
        with open(d / f"train_data_step{step}.jsonl", "w") as f:
            for i in range(len(seqs)):
                if layout == "flat":
                    sample = {k: v[i] for k, v in batch.items()}
                else:
                    sample = {k: v[i : i + 1] for k, v in batch.items()}
                f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
    return d


# ----------------------------------------------------------------------------- slime


def slime_dump(seqs: list[pl.DataFrame], step: int, dtype: str = "float64") -> dict:
    """A slime train dump, `format_version` 2.

    THUDM/slime, slime/observability/train_data_utils.py (`_build_dump_payload`,
    `save_debug_train_data`) at 624b824: `{"format_version": 2, "rollout_id", "rank",
    "samples", "dp_shards", "raw_reward"}`; one dict per training sample, sorted by
    `rollout_position`, holding `data_parallel_rank`, `sample_index`, `rollout_position` and
    every per-sample column of the rank's rollout_data (slime/ray/rollout.py
    `_convert_samples_to_train_data`, slime/utils/data.py): `tokens` (prompt + response, a
    long tensor), `response_lengths`, `rewards`, `truncated`, `rollout_ids`, `loss_masks`
    (int tensor over the response), `rollout_mask_sums` (an element of a float32 tensor),
    `rollout_log_probs`, `total_lengths`, `log_probs`, `advantages`, `returns` (float32
    tensors over the response, CP-restored), `local_raw_reward`; `dp_shards` keeps the
    layout (`sample_indices`, `partition`, `micro_batch_indices`, `num_microbatches`,
    `global_batch_sizes`). The response starts at the first loss token.
    """
    import torch

    fdt = torch.float32 if dtype == "float32" else torch.float64
    samples, shards = [], {0: [], 1: []}
    mask_sums = torch.tensor(
        [float(g["loss_mask"].sum()) for g in seqs], dtype=torch.float32
    )  # one rollout per sample
    for i, g in enumerate(seqs):
        start = int(np.argmax(g["loss_mask"].to_numpy())) if g["loss_mask"].any() else g.height
        r = g.slice(start)
        dp = i % 2
        shards[dp].append(i)
        samples.append(
            {
                "data_parallel_rank": dp,
                "sample_index": 1000 + i,
                "rollout_position": i,
                "tokens": torch.arange(10, 10 + g.height, dtype=torch.long),
                "response_lengths": r.height,
                "rewards": 1.0,
                "truncated": 0,
                "rollout_ids": 1000 + i,
                "loss_masks": torch.tensor(r["loss_mask"].to_numpy().astype(np.int32)),
                "rollout_mask_sums": mask_sums[i],
                "rollout_log_probs": torch.tensor(r["inference_logprob"].to_numpy(), dtype=fdt),
                "total_lengths": g.height,
                "log_probs": torch.tensor(r["trainer_logprob"].to_numpy(), dtype=fdt),
                "advantages": torch.tensor(r["advantage"].to_numpy(), dtype=fdt),
                "returns": torch.tensor(r["advantage"].to_numpy(), dtype=fdt),
                "local_raw_reward": 1.0,
            }
        )
    return {
        "format_version": 2,
        "rollout_id": step,
        "rank": 0,
        "samples": samples,
        "dp_shards": [
            {
                "rank": dp,
                "data_parallel_rank": dp,
                "sample_indices": [1000 + i for i in idx],
                "partition": idx,
                "micro_batch_indices": [[list(range(len(idx)))]],
                "num_microbatches": [1],
                "global_batch_sizes": [len(seqs)],
            }
            for dp, idx in shards.items()
        ],
        "raw_reward": [1.0] * len(seqs),
    }


def slime_rollout_dump(seqs: list[pl.DataFrame], step: int) -> dict:
    """A slime rollout debug dump, which `--dump-details DIR` writes to
    `DIR/rollout_data/{rollout_id}.pt` beside the train dumps.

    THUDM/slime, slime/observability/rollout_data_utils.py (`save_debug_rollout_data`) and
    slime/utils/types.py (`Sample.to_dict`) at 624b824: `{"rollout_id", "samples"}` with each
    sample the `Sample` dataclass as a dict (`status` as its string value, `spec_info` and
    `prefix_cache_info` as dicts): tokens, response_length, loss_mask, rollout_log_probs,
    reward, ... and no trainer log-probs.
    """
    samples = []
    for i, g in enumerate(seqs):
        start = int(np.argmax(g["loss_mask"].to_numpy())) if g["loss_mask"].any() else g.height
        r = g.slice(start)
        samples.append(
            {
                "group_index": i // 4,
                "index": 1000 + i,
                "rollout_id": None,
                "prompt": "What is 2+2?",
                "tokens": list(range(10, 10 + g.height)),
                "multimodal_inputs": None,
                "multimodal_train_inputs": None,
                "multimodal_train_input_id": None,
                "apply_chat_template_kwargs": {},
                "response": "4",
                "response_length": r.height,
                "label": "4",
                "reward": 1.0,
                "loss_mask": [int(x) for x in r["loss_mask"]],
                "weight_versions": ["1"],
                "rollout_log_probs": r["inference_logprob"].to_list(),
                "rollout_top_p_token_ids": None,
                "rollout_top_p_token_offsets": None,
                "rollout_routed_experts": None,
                "remove_sample": False,
                "teacher_log_probs": None,
                "status": "completed",
                "metadata": {},
                "generate_function_path": None,
                "custom_rm_path": None,
                "train_metadata": None,
                "session_id": None,
                "non_generation_time": 0.0,
                "spec_info": {
                    "spec_accept_token_num": 0,
                    "spec_draft_token_num": 0,
                    "spec_verify_ct": 0,
                    "completion_token_num": 0,
                },
                "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0},
            }
        )
    return {"rollout_id": step, "samples": samples}


def write_slime(
    df: pl.DataFrame, root: Path, dump_details: bool = False, dtype: str = "float64"
) -> Path:
    """slime dumps: `--save-debug-train-data PATH/train_{rollout_id}.pt` files, or with
    `dump_details` the `--dump-details DIR` tree (slime/utils/arguments.py at 624b824:
    `DIR/rollout_data/{rollout_id}.pt` and `DIR/train_data/{rollout_id}.pt`)."""
    import torch

    root.mkdir(parents=True, exist_ok=True)
    for step, seqs in sequences(df):
        if dump_details:
            (root / "rollout_data").mkdir(exist_ok=True)
            (root / "train_data").mkdir(exist_ok=True)
            torch.save(slime_rollout_dump(seqs, step), root / "rollout_data" / f"{step}.pt")
            torch.save(slime_dump(seqs, step, dtype), root / "train_data" / f"{step}.pt")
        else:
            torch.save(slime_dump(seqs, step, dtype), root / f"train_{step}.pt")
    return root


# ----------------------------------------------------------------------------- SkyRL


SKYRL_MODULE = "skyrl.backends.skyrl_train.training_batch"


@contextlib.contextmanager
def skyrl_classes():
    """Stand-ins for SkyRL's `TrainingInputBatch` and `_rebuild_tensor_batch`, registered under
    SkyRL's module name while a fixture is pickled, so that the pickle names exactly the
    globals a real dump names (the stand-ins are ours; SkyRL is not installed)."""
    names = ["skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", SKYRL_MODULE]
    saved = {n: sys.modules.get(n) for n in names}
    mods = {n: types.ModuleType(n) for n in names}
    tb = mods[SKYRL_MODULE]

    def _rebuild_tensor_batch(cls, state):  # pragma: no cover - only named in the pickle
        raise AssertionError("the reader must never call this")

    class TrainingInputBatch(dict):
        def __reduce__(self):
            return (tb._rebuild_tensor_batch, (type(self), self["__state__"]))

    for obj, name in (
        (_rebuild_tensor_batch, "_rebuild_tensor_batch"),
        (TrainingInputBatch, "TrainingInputBatch"),
    ):
        obj.__module__ = SKYRL_MODULE
        obj.__qualname__ = name
        setattr(tb, name, obj)
    sys.modules.update(mods)
    try:
        yield tb
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _skyrl_serialize(arr: np.ndarray | None):
    """A tensor as TensorBatch.__getstate__ stores it (`_serialize_tensor`, numpy path)."""
    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    return {"format": "numpy", "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}


def skyrl_state(seqs: list[pl.DataFrame], dtype: str = "float64", dp_size: int = 5) -> dict:
    """The pickled state of one SkyRL `TrainingInputBatch` as `dump_data` writes it.

    NovaSky-AI/SkyRL at a956457: skyrl/train/trainer.py (`convert_to_training_input`,
    `fwd_logprobs_values_reward`, then `compute_advantages_and_returns`; `rewards` popped and
    metadata `uids` / `is_last_step` removed before `dump_data`), the tensors as
    skyrl/train/dataset/preprocess.py (`convert_prompts_responses_to_batch_tensors`) lays
    them out: `sequences` / `attention_mask` (batch, max prompt+response) left-padded;
    `response_mask`, `loss_mask` (float32), `rollout_logprobs`, `action_log_probs`,
    `advantages`, `returns` (batch, max response) right-aligned with leading zeros;
    skyrl/backends/skyrl_train/training_batch.py (`pad_training_input_batch`: DP padding rows
    copy row 0 with a zero loss mask, `metadata["pad_size"]`; `__getstate__`: `{"batch_dict",
    "batch_size", "device", "metadata"}`, each tensor `_serialize_tensor`'d). The response
    starts at the first loss token.
    """
    import torch

    fdt = np.float32 if dtype == "float32" else np.float64
    prompts, resp = [], []
    for g in seqs:
        start = int(np.argmax(g["loss_mask"].to_numpy())) if g["loss_mask"].any() else g.height
        prompts.append(g.slice(0, start))
        resp.append(g.slice(start))
    b = len(seqs)
    pad = -(-b // dp_size) * dp_size - b
    width = max(r.height for r in resp)
    total = max(p.height + r.height for p, r in zip(prompts, resp, strict=True))
    seq = np.full((b, total), 151_643, np.int64)
    att = np.zeros((b, total), np.int64)
    rmask = np.zeros((b, width), np.int64)
    lmask = np.zeros((b, width), np.float32)
    lq, lp, adv = (np.zeros((b, width), fdt) for _ in range(3))
    for i, (p, r) in enumerate(zip(prompts, resp, strict=True)):
        n = p.height + r.height
        seq[i, total - n :] = np.arange(10, 10 + n)
        att[i, total - n :] = 1
        rmask[i, width - r.height :] = 1
        lmask[i, width - r.height :] = r["loss_mask"].to_numpy()
        lq[i, width - r.height :] = r["inference_logprob"].to_numpy()
        lp[i, width - r.height :] = r["trainer_logprob"].to_numpy()
        adv[i, width - r.height :] = r["advantage"].to_numpy()

    def padded(a, zero=False):
        extra = np.zeros_like(a[:1].repeat(pad, 0)) if zero else a[[0] * pad]
        return np.concatenate([a, extra]) if pad else a

    batch = {
        "sequences": padded(seq),
        "attention_mask": padded(att),
        "response_mask": padded(rmask),
        "loss_mask": padded(lmask, zero=True),
        "rollout_logprobs": padded(lq),
        "rollout_expert_indices": None,
        "router_padding_mask": None,
        "pixel_values": None,
        "image_grid_thw": None,
        "base_action_log_probs": None,
        "action_log_probs": padded(lp),
        "values": None,
        "advantages": padded(adv),
        "returns": padded(adv),
    }
    metadata = {
        "policy_mini_batch_boundaries": [(0, b)],
        "policy_prompt_boundaries": [(i, i + 1) for i in range(b)],
        "response_length": width,
        "avg_response_length": float(np.mean([r.height for r in resp])),
        "pad_size": pad,
        "metrics": {"avg_final_rewards": 1.0},
    }
    return {
        "batch_dict": {k: _skyrl_serialize(v) for k, v in batch.items()},
        "batch_size": b + pad,
        "device": torch.device("cpu"),
        "metadata": metadata,
    }


def write_skyrl(df: pl.DataFrame, root: Path, dtype: str = "float64", edit=None) -> Path:
    """SkyRL `trainer.dump_data_batch`: `{export_path}/dumped_data/
    global_step_{N}_training_input.pkl`, `pickle.dump(TrainingInputBatch)` (trainer.py
    `dump_data`, training_batch.py `TensorBatch.save` at a956457); `TensorBatch.__reduce__`
    pickles it as `_rebuild_tensor_batch(type(self), self.__getstate__())`. `edit(state)` may
    change a state before it is pickled."""
    import pickle

    d = root / "dumped_data"
    d.mkdir(parents=True, exist_ok=True)
    with skyrl_classes() as tb:
        for step, seqs in sequences(df):
            state = skyrl_state(seqs, dtype)
            if edit is not None:
                edit(state)
            with open(d / f"global_step_{step}_training_input.pkl", "wb") as f:
                pickle.dump(tb.TrainingInputBatch(__state__=state), f)
    return d
