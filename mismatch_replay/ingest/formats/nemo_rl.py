"""NeMo-RL: `train_data_step<N>.jsonl`, one sample per line.

Design
------
Read from NVIDIA-NeMo/RL `nemo_rl/utils/logger.py` (`log_batched_dict_as_jsonl`),
`nemo_rl/algorithms/grpo.py` and `nemo_rl/distributed/batched_data_dict.py` at 7ea279a.
`log_batched_dict_as_jsonl` slices the step's `BatchedDataDict` one sample at a time, so
every field of a line is a one-element list (`"prev_logprobs": [[...]]`, `"input_lengths":
[123]`, `"sample_loss_mask": [1.0]`) plus a plain `"idx"`; the flat layout
(`"prev_logprobs": [...]`) of other writers is read as well, file by file (`opened`,
`file_schema` and `unwrap` open the wrapped one; a line whose lists hold several samples is a
bad record). Arrays cover prompt + response, padded to the batch's longest sample; they are
cut to `input_lengths` (`trim`; a negative length or one beyond the arrays is a bad record).
`loss_mask = token_loss_mask and sample_loss_mask`. The step comes from the file name,
`sample_id` is `idx` (else the record's index in the file), `position` the token's index.

A file whose `prev_logprobs` are zero on every loss token was written with
`loss_fn.force_on_policy_ratio=True` (grpo.py then logs `torch.zeros_like` placeholders):
p_train = 1 everywhere, a fake mismatch, so it is refused (`_PlaceholderCheck`). Reads at
~0.55M tokens/s on 2 shared cores.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl

from ...errors import DataError
from .base import CAPTURE_HINT, F64, I64, Drops
from .jsonl import first_record
from .records import RecordFormat, as_bool

TRAIN_DATA_FILE = re.compile(r"train_data_step(\d+)\.jsonl")


def _nemo_wrapped(rec: dict) -> bool:
    """NeMo-RL's own layout: `log_batched_dict_as_jsonl` slices the batch with
    `make_microbatch_iterator(1)`, so every field is a one-element list (`[[...]]`, `[n]`)."""
    v = rec.get("prev_logprobs")
    return isinstance(v, list) and len(v) > 0 and isinstance(v[0], list)


def _unwrapped(rec: dict) -> dict:
    """A wrapped NeMo-RL record with its one-element lists opened (for probing types)."""
    return {
        k: (v[0] if k != "idx" and isinstance(v, list) and len(v) == 1 else v)
        for k, v in rec.items()
    }


class _PlaceholderCheck:
    """Counts the loss tokens of a file and those whose trainer log-prob is not 0."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.loss_tokens = self.nonzero = 0

    def add(self, out: pl.DataFrame) -> None:
        loss = out.filter(pl.col("loss_mask"))
        self.loss_tokens += loss.height
        self.nonzero += int((loss["trainer_logprob"] != 0).sum())

    def done(self) -> None:
        if self.loss_tokens and not self.nonzero:
            raise DataError(
                f"{self.path}: key 'prev_logprobs' (the trainer log-probs) is exactly 0 on all "
                f"{self.loss_tokens:,} loss tokens, so p_train = 1 everywhere and every mismatch "
                "figure would be fake. NeMo-RL writes zeros there when "
                "loss_fn.force_on_policy_ratio=True skips the trainer's log-prob pass (grpo.py: "
                "'Skipping prev_logprobs'). Re-run with force_on_policy_ratio=false (or with "
                f"grpo.seq_logprob_error_threshold set, which computes them), {CAPTURE_HINT}."
            )


class NemoRL(RecordFormat):
    """NeMo-RL's train data: wrapped fields, `input_lengths` cuts, the placeholder check."""

    def opened(self, raw: dict) -> tuple[dict, bool]:
        wrapped = _nemo_wrapped(raw)
        return (_unwrapped(raw) if wrapped else raw), wrapped

    def probed(self, path, line, rec, wrapped, schema, columns):
        schema = self._schema(schema, wrapped)
        warnings = []
        if "token_loss_mask" not in rec:
            warnings.append(
                f"{path}: no token_loss_mask in the records, so every token up to "
                "input_lengths counts, prompt tokens included. Log token_loss_mask (recent "
                "NeMo-RL versions do), or expect prompt tokens in the counts."
            )
        if "input_lengths" not in rec:
            warnings.append(
                f"{path}: no input_lengths in the records, so padding cannot be cut off; "
                "only token_loss_mask keeps it out of the counts."
            )
        return schema, warnings

    def file_schema(self, path, schema, drop):
        # the layout is the file's own (NeMo-RL's, or flat): peek at line 1
        first = first_record(path, drop)
        wrapped = first is not None and _nemo_wrapped(first[0])
        return self._schema(schema, wrapped), wrapped

    def _schema(self, schema: dict[str, pl.DataType], wrapped: bool) -> dict[str, pl.DataType]:
        """The flat schema of NeMo-RL keys, or each key wrapped in a one-element list (`idx`,
        added by the logger after slicing, never is)."""
        out = {}
        for k, t in schema.items():
            is_wrapped = k != "idx" and self._is_wrapped_type(k, t)
            if wrapped and not is_wrapped and k != "idx":
                out[k] = pl.List(t)
            elif not wrapped and is_wrapped:
                out[k] = t.inner
            else:
                out[k] = t
        return out

    def _is_wrapped_type(self, key: str, t: pl.DataType) -> bool:
        """Whether a NeMo-RL key's dtype has the extra list level of the wrapped layout."""
        if key in self.scalars or self.arrays.get(key) == "reward":  # one value a sample
            return isinstance(t, pl.List)
        return isinstance(t, pl.List) and isinstance(t.inner, pl.List)

    def unwrap(self, df, lines, ordinals, drops: Drops):
        """NeMo-RL's one-element lists -> their element; a record whose lists hold another
        number of elements (several samples on one line) is not NeMo-RL's layout and is
        reported."""
        wrapped = [c for c in df.columns if c != "idx" and isinstance(df.schema[c], pl.List)]
        if not wrapped:
            return df, lines, ordinals
        bad = pl.any_horizontal([(pl.col(c).list.len() != 1).fill_null(False) for c in wrapped])
        flags = df.select(bad.alias("bad"))["bad"]
        if flags.any():
            sizes = df.select([pl.col(c).list.len() for c in wrapped])
            for i in np.flatnonzero(flags.to_numpy()):
                odd = [
                    f"{c} {sizes[c][int(i)]}" for c in wrapped if sizes[c][int(i)] not in (1, None)
                ]
                drops.bad(
                    f"line {lines[int(i)]}",
                    "not one sample per line",
                    f"NeMo-RL writes one sample per line, each field a one-element list, but "
                    f"{', '.join(odd)} element(s) were found",
                )
            keep = ~flags.to_numpy()
            df = df.filter(pl.Series(keep))
            lines = [x for x, k in zip(lines, keep, strict=True) if k]
            ordinals = [x for x, k in zip(ordinals, keep, strict=True) if k]
        return df.with_columns([pl.col(c).list.first() for c in wrapped]), lines, ordinals

    def trim(self, rec, arrays, drops: Drops):
        if "input_lengths" not in rec.columns:
            return rec
        ref = self.required[0]
        neg = rec.filter(pl.col("input_lengths") < 0)
        for row in neg.select("_line", "input_lengths").iter_rows():
            drops.bad(
                f"line {row[0]}",
                "negative input_lengths",
                f"input_lengths {row[1]} is negative (a sample's length is at least 0)",
            )
        if neg.height:
            rec = rec.filter(~(pl.col("input_lengths") < 0).fill_null(False))
        over = rec.filter(pl.col("input_lengths") > pl.col(ref).list.len())
        for row in over.select("_line", "input_lengths", n=pl.col(ref).list.len()).iter_rows():
            drops.bad(
                f"line {row[0]}",
                "input_lengths beyond the arrays",
                f"input_lengths {row[1]} is longer than the arrays ({row[2]} tokens)",
            )
        if over.height:
            rec = rec.filter(~(pl.col("input_lengths") > pl.col(ref).list.len()))
        n = pl.col("input_lengths").fill_null(pl.col(ref).list.len())
        return rec.with_columns([pl.col(k).list.head(n) for k in arrays])

    def token_columns(self, cols, lit_step):
        mask = as_bool("token_loss_mask") if "token_loss_mask" in cols else pl.lit(True)
        if "sample_loss_mask" in cols:
            mask = mask & (pl.col("sample_loss_mask").fill_null(1.0) != 0)
        sample = pl.col("idx").fill_null(pl.col("_rec")) if "idx" in cols else pl.col("_rec")
        return [
            lit_step.alias("step"),
            sample.alias("sample_id"),
            pl.col("_idx").alias("position"),
            mask.alias("loss_mask"),
        ]

    def watch(self, path):
        return _PlaceholderCheck(path)


NEMO = NemoRL(
    name="nemo-rl",
    arrays={
        "prev_logprobs": "trainer_logprob",
        "generation_logprobs": "inference_logprob",
        "token_loss_mask": "loss_mask",
        "advantages": "advantage",
        "token_ids": "token_id",
        "rewards": "reward",  # one per sample (grpo.py's `rewards`), on each of its tokens
    },
    required=("prev_logprobs", "generation_logprobs"),
    scalars={"input_lengths": I64, "sample_loss_mask": F64, "idx": I64},
    hint="NeMo-RL's GRPO loop writes train_data_step<N>.jsonl into its log directory",
)
