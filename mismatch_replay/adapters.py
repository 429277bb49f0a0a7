"""Framework adapters: the token logs trainers write on disk -> canonical frames, streamed.

Design
------
`io.py` owns resolution, planning and validation; this module knows the formats. Each reader
turns one file into a stream of polars frames whose columns are canonical names (for the
framework formats) or the file's own names (plain JSONL, which then goes through the same
alias / `--map` / list-explode path as Parquet). A frame holds every token of the records it
covers, prompt tokens included: io applies `loss_mask` and the value checks exactly as for
Parquet, so a NaN in a prompt token is ignored and a NaN in a loss token is reported.

Every layout below was read from the framework's own writer code, at the commit named (the
test fixtures are built the same way, tests/test_adapters.py):

| format | what is read | detected by |
|---|---|---|
| `prime-rl` | one object per packed sequence, per-token arrays | `step_<n>/rank_<r>.jsonl` |
| `prime-rl-traces` | episode records + the trainer's annotations | `traces/stream.jsonl` |
| `nemo-rl` | one object per sample, every field a one-element list | `train_data_step<N>.jsonl` |
| `slime` | `torch.save` train dumps, `format_version` 2 | the `.pt` suffix |
| `skyrl` | a pickled `TrainingInputBatch`, unpickled restrictively | the `.pkl` suffix |
| `jsonl` | canonical rows (token rows, or sequence rows of lists) | other `.jsonl` / `.ndjson` |
| `parquet` | read in io.py | `.parquet` / `.pq` |

The writers read (repository, file, commit):
- prime-rl: PrimeIntellect-ai/prime-rl `src/prime_rl/trainer/rl/token_export.py`, `train.py`,
  `loss.py` at 559b447; the trace annotations (PR #3444) `src/prime_rl/trainer/rl/
  annotations.py` and `src/prime_rl/monitors/file/traces/update.py` at 65a1858 (a PR #3444-era
  commit found in the code index, not in the 559b447 snapshot); the trace records
  PrimeIntellect-ai/verifiers `verifiers/v1/graph.py`, `trace.py`, `episode.py` at a60a606.
- NeMo-RL: NVIDIA-NeMo/RL `nemo_rl/utils/logger.py` (`log_batched_dict_as_jsonl`),
  `nemo_rl/algorithms/grpo.py`, `nemo_rl/distributed/batched_data_dict.py` at 7ea279a.
- slime: THUDM/slime `slime/observability/train_data_utils.py`, `rollout_data_utils.py`,
  `slime/utils/arguments.py` at 624b824.
- SkyRL: NovaSky-AI/SkyRL `skyrl/backends/skyrl_train/training_batch.py`,
  `skyrl/train/trainer.py`, `skyrl/train/dataset/preprocess.py` at a956457.

JSON lines are read in blocks of whole lines (`block_bytes`, ~48 MB for the default 1M-row
batch: memory is bounded by the block, never by the file or the tree) and parsed by polars'
NDJSON reader with a fixed schema, ~70 MB/s. A block it rejects (a truncated line, `NaN`,
`1e400`, a value of the wrong type) is re-parsed line by line with the standard library, ~4x
slower, which names the offending line: the error gives file and line, or with
`--drop-invalid` the record is skipped and counted (`ReadReport.dropped`, column
`records: <why>`). `json` reads `NaN`, `Infinity` and `1e400` (-> inf), so such values reach
the value checks, which report them per column with counts.

Per-format conventions (RULES.md, "On-disk token logs in the wild"):
- prime-rl token export: index 0 of every record is the sample's first token, whose trainer
  log-prob crosses the packing boundary (train.py shifts the packed micro batch right: log
  1/vocab for its first sample, the previous sample's last value otherwise), so its
  `loss_mask` is forced false.
  `sample_id = rank * 1_000_000 + export_sequence_idx` (unique within a step across ranks,
  and readable: 2000017 is rank 2, sequence 17). The step is the record's `step`, else the
  `step_<n>` directory. Tokens with `rl_weights == 0` and `ref_kl_weights == 0` (a null
  stream is the default: rl 1.0, ref_kl 0.0) are CE / SFT / distillation tokens without a
  sampling mismatch: they leave the loss mask, as in prime-rl's own mismatch metric
  (`loss_mask & (rl_weights != 0 | ref_kl_weights != 0)`, train.py). `is_masked` and
  `mismatch_kl` are the run's own decisions: `prime_check` replays them (see below).
- prime-rl traces (PR #3444, replaced the export on 2026-08-31): `traces/stream.jsonl` holds
  one episode record per line (`{"id", "env", "run", "traces": [trace, ...]}`; a bare trace,
  `{"id", "nodes", ...}`, is read too). A trace is a message graph: each node adds
  `token_ids`, a per-token `mask` (True on sampled tokens) and `logprobs` over its sampled
  tokens only; a branch is a root-to-leaf path, branches numbered by leaf in node order, and a
  branch's tokens are its nodes' `token_ids` concatenated (the sample the trainer packed).
  `traces/annotations/<producer>.jsonl` holds update records `{"version", "trace_id", "info",
  "branches": [{"index", "trainer_logprobs", "entropies", "is_masked", "advantages"}]}`,
  whose streams run over the branch's whole token prefix, null outside the trainer's loss
  mask and at position 0 (the right shift crosses the packing boundary), floats rounded to
  the monitor's `float_decimals`. Updates are folded in file order, newest wins. A token is
  a loss token where the trainer stream is not null; a node's `loss_weights` ("rl",
  "ref_kl") and a null `is_masked` inside an annotated branch (prime-rl leaves tokens outside
  its RL component unannotated: the fold rule of update.py) mark CE tokens, which leave the
  mask. The step is the update's `info.train.trained_at_step`, else the episode's
  `run.work.step`; `sample_id` numbers the (trace, branch) pairs in stream order; `env` is
  the episode's `env.name` (else `env.id`). The annotations are indexed before the stream is
  read: 8 bytes per annotated value (one per stream and token).
- nemo-rl: `log_batched_dict_as_jsonl` slices the step's `BatchedDataDict` one sample at a
  time, so every field of a line is a one-element list (`"prev_logprobs": [[...]]`,
  `"input_lengths": [123]`, `"sample_loss_mask": [1.0]`) plus a plain `"idx"`; the flat
  layout (`"prev_logprobs": [...]`) of other writers is read as well, file by file. Arrays
  cover prompt + response, padded to the batch's longest sample; they are cut to
  `input_lengths`. `loss_mask = token_loss_mask and sample_loss_mask`. The step comes from the
  file name, `sample_id` is `idx` (else the record's index in the file). A file whose
  `prev_logprobs` are zero on every loss token was written with
  `loss_fn.force_on_policy_ratio=True` (grpo.py then logs `torch.zeros_like` placeholders):
  p_train = 1 everywhere, a fake mismatch, so it is refused.
- slime: arrays are response-only; `position = len(tokens) - response_length + i`, the step is
  `rollout_id`, `sample_id` the index in `samples` (sorted by `rollout_position` by the
  writer). Loaded with `torch.load(weights_only=True, mmap=True)`: nothing but tensors,
  lists, dicts and numbers is ever unpickled, and tensors are paged in on use. torch is
  imported only here, on demand. `--dump-details DIR` also writes `DIR/rollout_data/{id}.pt`
  (the sampler's samples, no trainer log-probs): io skips those with a note
  (`is_slime_rollout_dump`), and one read on its own is refused with the way to the
  train dumps.
- skyrl: `dumped_data/global_step_<N>_training_input.pkl` is `pickle.dump` of a
  `TrainingInputBatch`, which pickles as `_rebuild_tensor_batch(cls, state)` with every tensor
  as `{"format": "numpy", "data": bytes, "shape", "dtype"}` (bf16: `{"format": "torch"}`, a
  `torch.save` blob). `_SkyRLUnpickler` resolves exactly those globals (and `torch.device`,
  numpy scalars) to inert stand-ins and refuses every other one, so no code in the file can
  run; tensors become numpy arrays straight from their bytes. Response tensors are
  right-aligned in `(batch, max_response)`: the trainer log-prob is `action_log_probs`, the
  sampler's `rollout_logprobs`, the position `prompt_len + i` with
  `prompt_len = attention_mask.sum() - response_mask.sum()`; the rows SkyRL appends as DP
  padding (`metadata["pad_size"]`) are left out. The step is N from the file name.

`prime_check` (the proof that a replay equals the run): when a prime-rl export (or trace
annotation) carries `is_masked`, the same tokens are replayed through prime-rl's rule and
compared: "N of M tokens agree with prime-rl's is_masked". At 559b447 the export fills
`is_masked` only under prime-rl's default loss (`DefaultLossConfig`: DPPO-binary-TV with
`dppo_mask_low = dppo_mask_high = 0.2`, `A > 0` on the high side, else the low side), which is
`dppo-tv@prime-rl`; traces may come from IPO runs too, so there the best of the prime-rl
presets is reported, by name. `mismatch_kl` (`r - l - 1`) is compared with the replay's k3.

Throughput, reading ~1M loss tokens (the golden log x 50, written as each framework does) on
2 shared cores: prime-rl 0.4M tokens/s (~200 bytes of JSON a token: every key of the
exporter; the default-null weight streams are dropped per block, ~6% over not reading them),
NeMo-RL 0.55M tokens/s, prime-rl traces 0.2M tokens/s (the standard library's JSON parser on
whole episode records), slime 0.44M tokens/s (torch's safe unpickler, ~0.3 ms a tensor,
dominates when samples are short), SkyRL 3.5M tokens/s (numpy straight from the pickled
bytes); plain JSONL token rows 0.2M tokens/s.
"""

from __future__ import annotations

import io as _bytesio
import json
import math
import pickle
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

from .errors import DataError, UsageError

FORMATS = ("parquet", "jsonl", "prime-rl", "prime-rl-traces", "nemo-rl", "slime", "skyrl")
FRAMEWORKS = ("prime-rl", "prime-rl-traces", "nemo-rl", "slime", "skyrl")
JSON_FORMATS = ("jsonl", "prime-rl", "nemo-rl")
FILE_FORMATS = ("slime", "skyrl", "prime-rl-traces")  # read whole by probe_file / read_file
SUFFIXES = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".pt": "slime",
    ".pkl": "skyrl",
}
RECORDS = "records: "  # ReadReport.dropped column prefix for skipped records
PRIME_SEQ_STRIDE = 1_000_000  # prime-rl sample_id = rank * stride + export_sequence_idx

_PRIME_FILE = re.compile(r"rank_(\d+)\.jsonl")
_PRIME_DIR = re.compile(r"step_(\d+)")
_NEMO_FILE = re.compile(r"train_data_step(\d+)\.jsonl")
_SKYRL_FILE = re.compile(r"global_step_(\d+)_training_input\.pkl")
_ANY_STEP = re.compile(r"step[_=-]?(\d+)")
_HIVE_STEP = re.compile(r"step=(-?\d+)")
TRACE_STREAM = "stream.jsonl"

F64, I64, BOOL, STR = pl.Float64, pl.Int64, pl.Boolean, pl.String

_FIX_RECORD = (
    "Fix or remove the record, or pass --drop-invalid to skip such records (they are counted "
    "on stderr)."
)
_CAPTURE = (
    "or log the tokens from the training loop with mismatch_replay.capture.TokenWriter, "
    "which writes the canonical table"
)


# ----------------------------------------------------------------------------- detection


def _traces_dir(path: Path) -> Path | None:
    """The prime-rl `traces/` directory a file sits in (up to two levels down), when it holds
    the trace stream; None otherwise."""
    for d in (path.parent, path.parent.parent, path.parent.parent.parent):
        if d.name == "traces" and (d / TRACE_STREAM).is_file():
            return d
    return None


def detect(path: Path) -> str | None:
    """The format a file's path says it holds (None: not a token log we know, or a sidecar
    read along with one: prime-rl's trace annotations and indexes)."""
    if _PRIME_FILE.fullmatch(path.name) and _PRIME_DIR.fullmatch(path.parent.name):
        return "prime-rl"
    if _NEMO_FILE.fullmatch(path.name):
        return "nemo-rl"
    if path.name == TRACE_STREAM and (
        path.parent.name == "traces" or (path.parent / "annotations").is_dir()
    ):
        return "prime-rl-traces"
    if path.suffix.lower() == ".jsonl" and (
        _traces_dir(path) is not None
        or (path.parent.name == "annotations" and (path.parent.parent / TRACE_STREAM).is_file())
        or (path.name.endswith(".index.jsonl") and (path.parent / TRACE_STREAM).is_file())
    ):
        return None  # annotations/<producer>.jsonl, *.index.jsonl, live/: read with the stream
    return SUFFIXES.get(path.suffix.lower())


def is_slime_rollout_dump(path: Path) -> bool:
    """A `--dump-details DIR` rollout dump, `DIR/rollout_data/{id}.pt` beside `DIR/train_data/`:
    the sampler's samples without trainer log-probs. io skips these with a note."""
    return (
        path.suffix.lower() == ".pt"
        and path.parent.name == "rollout_data"
        and (path.parent.parent / "train_data").is_dir()
    )


def sniff(path: Path) -> str:
    """The format of a file with an unknown suffix, from its first bytes (default parquet)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return "parquet"  # the Parquet reader reports the problem
    if head.startswith(b"PK"):  # torch.save's zip container
        return "slime"
    if head[:1] == b"\x80":  # a pickle (protocol 2+): SkyRL's dump_data_batch
        return "skyrl"
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    return "parquet"


def prime_step_dir(path: Path) -> Path | None:
    """The `step_<n>` directory of a prime-rl rank file (None when not in one)."""
    return path.parent if _PRIME_DIR.fullmatch(path.parent.name) else None


def path_step(path: Path, fmt: str) -> int | None:
    """The step a file's path implies: hive `step=N`, prime-rl `step_N`, nemo `..._stepN`,
    SkyRL `global_step_N_...`."""
    if fmt == "parquet":
        for part in reversed(path.parent.parts):
            m = _HIVE_STEP.fullmatch(part)
            if m:
                return int(m.group(1))
        return None
    if fmt == "prime-rl":
        m = _PRIME_DIR.fullmatch(path.parent.name)
        return int(m.group(1)) if m else None
    if fmt in ("nemo-rl", "skyrl"):
        m = _NEMO_FILE.fullmatch(path.name) or _SKYRL_FILE.fullmatch(path.name)
        m = m or _ANY_STEP.search(path.stem)
        return int(m.group(1)) if m else None
    return None


def natural_key(path: Path) -> tuple:
    """Sort key with digit runs compared as numbers (step_2 before step_10)."""
    return tuple(
        (0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", str(path)) if t
    )


# ----------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class _Spec:
    """A JSON-lines framework format: which keys feed which canonical column."""

    name: str
    arrays: dict[str, str]  # per-token array key -> canonical column
    required: tuple[str, ...]  # keys a record must have
    scalars: dict[str, pl.DataType]  # per-record keys read (dtype)
    hint: str  # how to turn the export on, for error messages
    # per-token arrays read for the loss mask only (never a column): key -> inner dtype
    extras: dict[str, pl.DataType] = field(default_factory=dict)


PRIME = _Spec(
    name="prime-rl",
    arrays={
        "trainer_logprobs": "trainer_logprob",
        "inference_logprobs": "inference_logprob",
        "loss_mask": "loss_mask",
        "advantages": "advantage",
        "entropy": "entropy",
        "token_ids": "token_id",
        "position_ids": "position",
    },
    required=("trainer_logprobs", "inference_logprobs", "loss_mask"),
    scalars={"step": I64, "rank": I64, "export_sequence_idx": I64, "env_name": STR},
    hint="prime-rl writes these with trainer.enable_token_export",
    extras={"rl_weights": F64, "ref_kl_weights": F64},
)
NEMO = _Spec(
    name="nemo-rl",
    arrays={
        "prev_logprobs": "trainer_logprob",
        "generation_logprobs": "inference_logprob",
        "token_loss_mask": "loss_mask",
        "advantages": "advantage",
        "token_ids": "token_id",
    },
    required=("prev_logprobs", "generation_logprobs"),
    scalars={"input_lengths": I64, "sample_loss_mask": F64, "idx": I64},
    hint="NeMo-RL's GRPO loop writes train_data_step<N>.jsonl into its log directory",
)
# Keys of prime-rl's own per-token decisions, read by prime_check only, and the columns
# they become (never canonical: io drops them).
PRIME_CHECKS = {"is_masked": BOOL, "mismatch_kl": F64}
_LOGGED = ("logged_is_masked", "logged_mismatch_kl")
SPECS = {"prime-rl": PRIME, "nemo-rl": NEMO}

# Canonical columns each framework format delivers (beyond what a record's keys add).
_FRAMEWORK_BASE = ("step", "sample_id", "position", "trainer_logprob", "inference_logprob")
_CANON_TYPES: dict[str, pl.DataType] = {
    "step": I64,
    "sample_id": I64,
    "position": I64,
    "trainer_logprob": F64,
    "inference_logprob": F64,
    "old_logprob": F64,
    "advantage": F64,
    "entropy": F64,
    "loss_mask": BOOL,
    "env": STR,
    "token_id": I64,
}


@dataclass
class Probe:
    """What the first record of a file says: the columns a read will deliver."""

    columns: dict[str, bool]  # delivered column (source name) -> is a list column
    schema: dict[str, pl.DataType]  # JSON key -> dtype the reader parses it as
    rows: int  # estimated rows (tokens) in the file, for progress
    warnings: list[str] = field(default_factory=list)


class _Drops:
    """Record-level problems: raise (naming file and line) or skip and count."""

    def __init__(self, path: Path, drop: bool, report) -> None:
        self.path, self.drop, self.report = path, drop, report

    def bad(self, where: str, why: str, detail: str) -> None:
        if not self.drop:
            raise DataError(f"{self.path}, {where}: {detail}. {_FIX_RECORD}")
        if self.report is not None:
            key = (str(self.path), RECORDS + why)
            self.report.dropped[key] = self.report.dropped.get(key, 0) + 1


# ----------------------------------------------------------------------------- JSON lines


def _open(path: Path):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing or rotating its logs? Wait for the step to "
            "finish, or leave the file out."
        ) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot open it ({exc}). Check permissions.") from exc


def _blocks(path: Path, block_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(block of whole lines, number of its first line); the last line may lack a newline."""
    with _open(path) as f:
        line = 1
        tail = b""
        while True:
            try:
                data = f.read(block_bytes)
            except OSError as exc:
                raise DataError(
                    f"{path}: reading failed part-way ({exc}). The file may have been removed "
                    "or truncated while being read; re-run when the trainer is done with it."
                ) from exc
            if not data:
                if tail.strip():
                    yield tail, line
                return
            data = tail + data
            cut = data.rfind(b"\n")
            if cut < 0:
                tail = data
                continue
            block, tail = data[: cut + 1], data[cut + 1 :]
            yield block, line
            line += block.count(b"\n")


def _first_record(path: Path, drop: bool) -> tuple[dict, int, int] | None:
    """(first parseable JSON object, its line number, its size in bytes); None: no record."""
    drops = _Drops(path, drop, report=None)  # the read counts drops; the probe only peeks
    with _open(path) as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                drops.bad(f"line {n}", "not valid JSON", f"not valid JSON ({exc})")
                continue
            if not isinstance(obj, dict):
                drops.bad(f"line {n}", "not a JSON object", "not a JSON object")
                continue
            return obj, n, len(raw)
    return None


def _kind(v) -> pl.DataType | None:
    """The dtype of one JSON value (None for null)."""
    if isinstance(v, bool):
        return BOOL
    if isinstance(v, int):
        return I64
    if isinstance(v, float):
        return F64
    if isinstance(v, str):
        return STR
    return None


def _list_kind(values: list) -> pl.DataType:
    kinds = {_kind(x) for x in values} - {None}
    if kinds <= {BOOL}:
        return BOOL
    if kinds <= {I64}:
        return I64
    if kinds <= {I64, F64}:
        return F64
    return STR


def _mask_dtype(v) -> pl.DataType:
    """Masks are bools in some exports and 0/1 numbers in others."""
    inner = _list_kind(v) if isinstance(v, list) else (_kind(v) or BOOL)
    return BOOL if inner == BOOL else F64


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _estimate(path: Path, tokens: int, nbytes: int) -> int:
    return int(tokens * _file_size(path) / max(nbytes, 1))


def _keys_error(path: Path, where: str, spec: _Spec, found) -> DataError:
    optional = [k for k in [*spec.arrays, *spec.scalars] if k not in spec.required]
    return DataError(
        f"{path}, {where}: not a {spec.name} record: required key(s) "
        f"{', '.join(k for k in spec.required if k not in found)} missing. Keys found: "
        f"{', '.join(sorted(found)) or 'none'}. Keys expected: {', '.join(spec.required)} "
        f"(optional: {', '.join(optional)}). {spec.hint}; pass --format to read the file as "
        "another format."
    )


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


def _nemo_schema(schema: dict[str, pl.DataType], wrapped: bool) -> dict[str, pl.DataType]:
    """The flat schema of NeMo-RL keys, or each key wrapped in a one-element list (`idx`,
    added by the logger after slicing, never is)."""
    out = {}
    for k, t in schema.items():
        is_wrapped = k != "idx" and _is_wrapped_type(k, t)
        if wrapped and not is_wrapped and k != "idx":
            out[k] = pl.List(t)
        elif not wrapped and is_wrapped:
            out[k] = t.inner
        else:
            out[k] = t
    return out


def _is_wrapped_type(key: str, t: pl.DataType) -> bool:
    """Whether a NeMo-RL key's dtype has the extra list level of the wrapped layout."""
    if key in NEMO.scalars:
        return isinstance(t, pl.List)
    return isinstance(t, pl.List) and isinstance(t.inner, pl.List)


def probe_framework(fmt: str, path: Path, drop: bool) -> Probe | None:
    """Columns a prime-rl / nemo-rl file delivers, from its first record (None: empty)."""
    spec = SPECS[fmt]
    first = _first_record(path, drop)
    if first is None:
        return None
    raw, line, nbytes = first
    missing = [k for k in spec.required if k not in raw]
    if missing:
        raise _keys_error(path, f"line {line}", spec, raw)
    wrapped = fmt == "nemo-rl" and _nemo_wrapped(raw)
    rec = _unwrapped(raw) if wrapped else raw
    schema: dict[str, pl.DataType] = {}
    columns = dict.fromkeys(_FRAMEWORK_BASE, False)
    for key, canon in spec.arrays.items():
        if key not in rec:
            continue
        v = rec[key]
        if canon == "loss_mask":
            schema[key] = pl.List(_mask_dtype(v))
        elif canon == "advantage" and isinstance(v, int | float) and not isinstance(v, bool):
            schema[key] = _CANON_TYPES[canon]  # per-sample advantage (some versions): broadcast
        else:
            schema[key] = pl.List(_CANON_TYPES[canon])
        columns[canon] = False
    for key, dtype in spec.scalars.items():
        if key in rec:
            schema[key] = dtype
    for key, dtype in spec.extras.items():
        if key in rec:
            schema[key] = pl.List(dtype)
    warnings = []
    if fmt == "prime-rl":
        columns["loss_mask"] = False
        if "env_name" in rec:
            columns["env"] = False
        ce = _prime_ce_tokens(rec)
        if ce:
            warnings.append(
                f"{path}: line {line} has {ce} loss token(s) with rl_weights == 0 and "
                "ref_kl_weights == 0 (CE, SFT or distillation tokens): they carry no sampling "
                "mismatch and are left out, as prime-rl's own mismatch metric does "
                "(loss_mask & (rl_weights != 0 | ref_kl_weights != 0))."
            )
    if fmt == "nemo-rl":
        columns["loss_mask"] = False
        schema = _nemo_schema(schema, wrapped)
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
    ref = rec[spec.required[0]]
    tokens = len(ref) if isinstance(ref, list) else 1
    return Probe(
        columns=columns, schema=schema, rows=_estimate(path, tokens, nbytes), warnings=warnings
    )


def _prime_ce_tokens(rec: dict) -> int:
    """Loss tokens of one prime-rl record outside the rl and ref_kl components."""
    mask = rec.get("loss_mask") or []
    rl = rec.get("rl_weights") or [None] * len(mask)
    ref = rec.get("ref_kl_weights") or [None] * len(mask)
    if not isinstance(mask, list) or not isinstance(rl, list) or not isinstance(ref, list):
        return 0
    n = 0
    for m, w, k in zip(mask[1:], rl[1:], ref[1:], strict=False):
        if m and (w if w is not None else 1.0) == 0 and (k if k is not None else 0.0) == 0:
            n += 1
    return n


# Canonical roles with a fixed dtype in plain JSONL; the rest is inferred from the values.
_ROLE_TYPES = {
    "trainer_logprob": F64,
    "inference_logprob": F64,
    "old_logprob": F64,
    "advantage": F64,
    "entropy": F64,
    "step": I64,
    "position": I64,
    "token_id": I64,
    "env": STR,
}


def probe_jsonl(path: Path, drop: bool, roles: dict[str, str]) -> Probe | None:
    """Columns of a plain JSONL file from its first record. `roles`: key -> canonical role
    (for the keys that are known aliases), which fixes the dtype of float columns."""
    first = _first_record(path, drop)
    if first is None:
        return None
    rec, _line, nbytes = first
    schema: dict[str, pl.DataType] = {}
    columns: dict[str, bool] = {}
    tokens = 1
    for key, v in rec.items():
        is_list = isinstance(v, list)
        role = roles.get(key)
        if role == "loss_mask":
            inner = _mask_dtype(v)
        elif role in _ROLE_TYPES:
            inner = _ROLE_TYPES[role]
        elif is_list:
            inner = _list_kind(v)
        elif isinstance(v, dict):
            continue  # nested objects are never a token column
        else:
            inner = _kind(v) or STR
        if role == "sample_id" and inner == F64:
            inner = I64
        schema[key] = pl.List(inner) if is_list else inner
        columns[key] = is_list
        if is_list:
            tokens = max(tokens, len(v))
    return Probe(columns=columns, schema=schema, rows=_estimate(path, tokens, nbytes))


def _coerce(v, dtype: pl.DataType):
    """One JSON value -> the Python value of dtype (slow path); ValueError when impossible."""
    if v is None:
        return None
    if isinstance(dtype, pl.List):
        if not isinstance(v, list):
            raise ValueError(f"expected an array, found {type(v).__name__} {_short(v)}")
        inner = dtype.inner
        return [_coerce(x, inner) for x in v]
    if dtype == F64:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"expected a number, found {_short(v)}")
        return float(v)
    if dtype == I64:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"expected an integer, found {_short(v)}")
        if isinstance(v, float):
            if not v.is_integer():
                raise ValueError(f"expected an integer, found {_short(v)}")
            v = int(v)
        return v
    if dtype == BOOL:
        if isinstance(v, bool):
            return v
        if isinstance(v, int | float):
            return v != 0
        raise ValueError(f"expected true/false or 0/1, found {_short(v)}")
    if isinstance(v, list | dict):
        raise ValueError(f"expected a scalar, found {type(v).__name__}")
    return str(v)


def _short(v) -> str:
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _record_lines(block: bytes, first_line: int) -> list[int]:
    return [first_line + i for i, raw in enumerate(block.split(b"\n")) if raw.strip()]


def _parse_block(
    block: bytes, first_line: int, schema: dict[str, pl.DataType], drops: _Drops
) -> tuple[pl.DataFrame, list[int], list[int], int]:
    """Parse a block: (one row per good record, their lines, their ordinals among the block's
    records, number of records incl. skipped ones).

    Fast path: polars' NDJSON reader. A block it rejects is re-read line by line.
    """
    lines = _record_lines(block, first_line)
    if schema:
        try:
            df = pl.read_ndjson(_bytesio.BytesIO(block), schema=schema)
        except Exception:  # any rejection: the slow path names the line
            df = None
        if df is not None and df.height == len(lines):
            return df, lines, list(range(len(lines))), len(lines)
    rows: list[dict] = []
    kept: list[int] = []
    ordinals: list[int] = []
    records = (r for r in block.split(b"\n") if r.strip())
    for k, (raw, line) in enumerate(zip(records, lines, strict=True)):
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            drops.bad(f"line {line}", "not valid JSON", f"not valid JSON ({exc})")
            continue
        if not isinstance(obj, dict):
            drops.bad(f"line {line}", "not a JSON object", f"not a JSON object: {_short(obj)}")
            continue
        row = {}
        try:
            for key, dtype in schema.items():
                row[key] = _coerce(obj.get(key), dtype)
        except ValueError as exc:
            drops.bad(f"line {line}", "values of the wrong type", f"key '{key}': {exc}")
            continue
        rows.append(row)
        kept.append(line)
        ordinals.append(k)
    return pl.DataFrame(rows, schema=schema, orient="row"), kept, ordinals, len(lines)


def read_jsonl(
    path: Path,
    schema: dict[str, pl.DataType],
    drop: bool,
    report,
    block_bytes: int,
) -> Iterator[pl.DataFrame]:
    """Plain JSONL: one frame of raw rows (the file's own names) per block."""
    drops = _Drops(path, drop, report)
    for block, first_line in _blocks(path, block_bytes):
        df, _lines, _ords, _n = _parse_block(block, first_line, schema, drops)
        if df.height:
            yield df


def read_framework(
    fmt: str,
    path: Path,
    file_step: int | None,
    schema: dict[str, pl.DataType],
    wanted: set[str] | None,
    drop: bool,
    report,
    block_bytes: int,
) -> Iterator[pl.DataFrame]:
    """prime-rl / nemo-rl JSON lines -> canonical token frames, one per block."""
    spec = SPECS[fmt]
    drops = _Drops(path, drop, report)
    wrapped = False
    if spec is NEMO:  # the layout is the file's own (NeMo-RL's, or flat): peek at line 1
        first = _first_record(path, drop)
        wrapped = first is not None and _nemo_wrapped(first[0])
        schema = _nemo_schema(schema, wrapped)
    rec_base = 0
    loss_tokens = nonzero = 0
    for block, first_line in _blocks(path, block_bytes):
        df, lines, ordinals, n = _parse_block(block, first_line, schema, drops)
        if df.height and wrapped:
            df, lines, ordinals = _unwrap(df, lines, ordinals, drops)
        if df.height and spec.extras:
            df = _drop_null_streams(df, spec)
        if df.height:
            rec = df.with_columns(
                _line=pl.Series(lines, dtype=I64),
                _rec=pl.Series(ordinals, dtype=I64) + rec_base,
            )
            out = _explode(spec, rec, file_step, drops)
            if spec is NEMO and out.height:
                loss = out.filter(pl.col("loss_mask"))
                loss_tokens += loss.height
                nonzero += int((loss["trainer_logprob"] != 0).sum())
            if out.height:
                if wanted is not None:
                    keep = wanted | {"step", "logged_is_masked", "logged_mismatch_kl"}
                    out = out.select([c for c in out.columns if c in keep])
                yield out
        rec_base += n
    if spec is NEMO and loss_tokens and not nonzero:
        raise DataError(
            f"{path}: key 'prev_logprobs' (the trainer log-probs) is exactly 0 on all "
            f"{loss_tokens:,} loss tokens, so p_train = 1 everywhere and every mismatch figure "
            "would be fake. NeMo-RL writes zeros there when loss_fn.force_on_policy_ratio=True "
            "skips the trainer's log-prob pass (grpo.py: 'Skipping prev_logprobs'). Re-run with "
            "force_on_policy_ratio=false (or with grpo.seq_logprob_error_threshold set, which "
            f"computes them), {_CAPTURE}."
        )


def _drop_null_streams(df: pl.DataFrame, spec: _Spec) -> pl.DataFrame:
    """Weight streams that are null in every record of a block (prime-rl writes `[null] * n`
    for a default stream, the common case) mean their default: not exploded at all."""
    keys = [k for k in spec.extras if k in df.columns]
    if not keys:
        return df
    counts = df.select([pl.col(k).list.drop_nulls().list.len().sum() for k in keys]).row(0)
    return df.drop([k for k, n in zip(keys, counts, strict=True) if not n])


def _unwrap(
    df: pl.DataFrame, lines: list[int], ordinals: list[int], drops: _Drops
) -> tuple[pl.DataFrame, list[int], list[int]]:
    """NeMo-RL's one-element lists -> their element; a record whose lists hold another number
    of elements (several samples on one line) is not NeMo-RL's layout and is reported."""
    wrapped = [c for c in df.columns if c != "idx" and isinstance(df.schema[c], pl.List)]
    if not wrapped:
        return df, lines, ordinals
    bad = pl.any_horizontal([(pl.col(c).list.len() != 1).fill_null(False) for c in wrapped])
    flags = df.select(bad.alias("bad"))["bad"]
    if flags.any():
        sizes = df.select([pl.col(c).list.len() for c in wrapped])
        for i in np.flatnonzero(flags.to_numpy()):
            odd = [f"{c} {sizes[c][int(i)]}" for c in wrapped if sizes[c][int(i)] not in (1, None)]
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


def _explode(spec: _Spec, rec: pl.DataFrame, file_step: int | None, drops: _Drops) -> pl.DataFrame:
    """Records (one row each, list columns) -> token rows with canonical names."""
    keys = [*spec.arrays, *spec.extras, *(PRIME_CHECKS if spec is PRIME else ())]
    arrays = [k for k in keys if k in rec.columns and isinstance(rec.schema[k], pl.List)]
    ref = spec.required[0]
    # structural checks: required keys present, arrays of one length
    missing = pl.any_horizontal([pl.col(k).is_null() for k in spec.required if k in rec.columns])
    lens = {k: pl.col(k).list.len() for k in arrays}
    unequal = pl.any_horizontal(
        [(lens[k] != lens[ref]).fill_null(False) for k in arrays if k != ref] or [pl.lit(False)]
    )
    checks = rec.select(
        _line=pl.col("_line"),
        missing=missing.fill_null(True),
        unequal=unequal,
        **{f"_len_{k}": lens[k] for k in arrays},
    )
    bad = checks.filter(pl.col("missing") | pl.col("unequal"))
    for row in bad.iter_rows(named=True):
        where = f"line {row['_line']}"
        if row["missing"]:
            absent = [k for k in spec.required if row.get(f"_len_{k}") is None]
            drops.bad(
                where,
                "required keys missing",
                f"{spec.name} record without {', '.join(absent)} (null or absent). Keys "
                f"expected: {', '.join(spec.required)}",
            )
        else:
            sizes = ", ".join(
                f"{k} {row[f'_len_{k}']}" for k in arrays if row[f"_len_{k}"] is not None
            )
            drops.bad(
                where,
                "arrays of unequal length",
                f"per-token arrays of unequal length ({sizes}), so tokens cannot be aligned",
            )
    if bad.height:
        rec = rec.filter(~(checks["missing"] | checks["unequal"]))
    if spec is NEMO and "input_lengths" in rec.columns:
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
        rec = rec.with_columns([pl.col(k).list.head(n) for k in arrays])
    rec = rec.filter(pl.col(ref).list.len() > 0)
    if rec.height == 0:
        return pl.DataFrame(schema={c: _CANON_TYPES[c] for c in _FRAMEWORK_BASE})
    rec = rec.with_columns(_idx=pl.int_ranges(0, pl.col(ref).list.len(), dtype=I64))
    tok = rec.explode([*arrays, "_idx"])
    return _finish(spec, tok, file_step)


def _finish(spec: _Spec, tok: pl.DataFrame, file_step: int | None) -> pl.DataFrame:
    cols = tok.columns
    exprs: list[pl.Expr] = []
    for key, canon in spec.arrays.items():
        if key not in cols or canon == "loss_mask":
            continue
        exprs.append(pl.col(key).cast(_CANON_TYPES[canon]).alias(canon))
    lit_step = pl.lit(file_step if file_step is not None else 0, dtype=I64)
    if spec is PRIME:
        step = pl.col("step").fill_null(lit_step) if "step" in cols else lit_step
        rank = pl.col("rank").fill_null(0) if "rank" in cols else pl.lit(0, dtype=I64)
        seq = (
            pl.col("export_sequence_idx").fill_null(pl.col("_rec"))
            if "export_sequence_idx" in cols
            else pl.col("_rec")
        )
        mask = _as_bool("loss_mask") & (pl.col("_idx") != 0)  # index 0: the shift pad
        # CE / SFT / distillation tokens (rl and ref_kl weight 0) were not sampled by the
        # policy: prime-rl's mismatch mask is loss_mask & (rl_weights != 0 | ref_kl_weights
        # != 0), a null stream meaning its default (rl 1.0, ref_kl 0.0)
        if "rl_weights" in cols or "ref_kl_weights" in cols:
            rl = pl.col("rl_weights").fill_null(1.0) != 0 if "rl_weights" in cols else pl.lit(True)
            ref = (
                pl.col("ref_kl_weights").fill_null(0.0) != 0
                if "ref_kl_weights" in cols
                else pl.lit(False)
            )
            mask = mask & (rl | ref)
        exprs += [
            step.alias("step"),
            (rank * PRIME_SEQ_STRIDE + seq).cast(I64).alias("sample_id"),
            mask.alias("loss_mask"),
        ]
        if "position_ids" not in cols:
            exprs.append(pl.col("_idx").alias("position"))
        if "env_name" in cols:
            exprs.append(pl.col("env_name").cast(STR).alias("env"))
        if "is_masked" in cols:
            exprs.append(pl.col("is_masked").cast(BOOL).alias("logged_is_masked"))
        if "mismatch_kl" in cols:
            exprs.append(pl.col("mismatch_kl").cast(F64).alias("logged_mismatch_kl"))
    else:  # nemo-rl
        mask = _as_bool("token_loss_mask") if "token_loss_mask" in cols else pl.lit(True)
        if "sample_loss_mask" in cols:
            mask = mask & (pl.col("sample_loss_mask").fill_null(1.0) != 0)
        exprs += [
            lit_step.alias("step"),
            (pl.col("idx").fill_null(pl.col("_rec")) if "idx" in cols else pl.col("_rec")).alias(
                "sample_id"
            ),
            pl.col("_idx").alias("position"),
            mask.alias("loss_mask"),
        ]
    out = tok.select(exprs)
    order = [c for c in (*_CANON_TYPES, *_LOGGED) if c in out.columns]
    return out.select(order)


def _as_bool(key: str) -> pl.Expr:
    return pl.col(key).cast(F64) != 0


# ----------------------------------------------------------------------------- slime


SLIME_TOP = ("format_version", "rollout_id", "samples")
SLIME_REQUIRED = ("log_probs", "rollout_log_probs")
SLIME_OPTIONAL = ("loss_masks", "advantages", "response_lengths", "tokens", "entropy")
_SLIME_HINT = (
    "slime writes train dumps with --save-debug-train-data PATH/{rollout_id}.pt (format_version 2)"
)


def _torch():
    try:
        import torch
    except ImportError:
        raise DataError(
            "reading slime .pt dumps needs torch, which is not installed: pip install "
            "torch==2.13.0 (the CPU build) or pip install 'mismatch-replay[torch]'. Or convert "
            "the dumps to Parquet where torch is installed (mismatch-replay convert)."
        ) from None
    return torch


def load_slime(path: Path) -> dict:
    """Load a slime dump safely (weights_only: tensors, lists, dicts, numbers; no code)."""
    torch = _torch()
    if not path.exists():
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing? Wait for it, or leave the file out."
        )
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:  # legacy (non-zip) files cannot be memory-mapped
            if "mmap" not in str(exc):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"{path}: the file disappeared while being read.") from None
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling refused"
        raise DataError(
            f"{path}: the dump holds objects other than tensors, lists, dicts and numbers "
            f"({first[:200]}). mismatch-replay loads .pt files with weights_only=True and "
            "never unpickles arbitrary objects: re-save the samples as plain tensors/lists."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise DataError(
            f"{path}: cannot read it as a torch.save file ({str(exc)[:200]}). Is it complete? "
            f"{_SLIME_HINT}."
        ) from None
    if not isinstance(obj, dict) or "samples" not in obj or "rollout_id" not in obj:
        found = ", ".join(sorted(map(str, obj))) if isinstance(obj, dict) else type(obj).__name__
        old = (
            " (an older slime dump: rollout_data is format 1, not read)"
            if (isinstance(obj, dict) and "rollout_data" in obj)
            else ""
        )
        raise DataError(
            f"{path}: not a slime train dump{old}. Top-level keys found: {found}. Keys "
            f"expected: {', '.join(SLIME_TOP)} (samples: a list of dicts with "
            f"{', '.join(SLIME_REQUIRED)}, optional {', '.join(SLIME_OPTIONAL)}). "
            f"{_SLIME_HINT}; pass --format to read the file as another format."
        )
    if _is_rollout_payload(obj):
        where = (
            f"; read {path.parent.parent / 'train_data'} instead"
            if is_slime_rollout_dump(path)
            else ""
        )
        first = obj["samples"][0]
        keys = [
            k for k in ("tokens", "response_length", "loss_mask", "rollout_log_probs") if k in first
        ]
        raise DataError(
            f"{path}: a slime rollout dump ({len(obj['samples'])} samples with "
            f"{', '.join(keys) or 'Sample fields'}), not a train dump: it "
            "holds the sampler's tokens and rollout_log_probs but no trainer log-probs "
            "(log_probs) to compare them with. slime writes those to the train dumps: "
            "--dump-details DIR puts them in DIR/train_data/{rollout_id}.pt beside "
            f"DIR/rollout_data/, --save-debug-train-data PATH writes PATH{where}."
        )
    version = obj.get("format_version", 2)
    if version != 2:
        raise DataError(
            f"{path}: slime dump format_version {version}; this reader knows format_version 2 "
            f"(keys {', '.join(SLIME_TOP)}). {_SLIME_HINT}."
        )
    if not isinstance(obj["samples"], list | tuple):
        raise DataError(
            f"{path}: 'samples' is a {type(obj['samples']).__name__}, expected a list of dicts "
            f"with {', '.join(SLIME_REQUIRED)}."
        )
    return obj


def _is_rollout_payload(obj: dict) -> bool:
    """slime's rollout debug dump (`save_debug_rollout_data`): `{"rollout_id", "samples"}`,
    each sample a `Sample.to_dict()` (singular `response_length`, `loss_mask`, `status`) and
    no `format_version`; train dumps (`_build_dump_payload`) carry `format_version` 2."""
    samples = obj.get("samples")
    if "format_version" in obj or not isinstance(samples, list | tuple) or not samples:
        return False
    first = samples[0]
    return (
        isinstance(first, dict)
        and "log_probs" not in first
        and ("response_length" in first or "status" in first)
    )


def _slime_rollout(path: Path, obj: dict) -> int:
    rid = obj["rollout_id"]
    try:
        return int(rid.item() if hasattr(rid, "item") else rid)
    except (TypeError, ValueError):
        raise DataError(
            f"{path}: rollout_id is {rid!r}, expected an integer (it becomes the step)."
        ) from None


def probe_slime(path: Path) -> Probe:
    obj = load_slime(path)
    columns = dict.fromkeys([*_FRAMEWORK_BASE, "loss_mask"], False)
    samples = obj["samples"]
    tokens = 0
    first = samples[0] if samples else {}
    if samples and not isinstance(first, dict):
        raise DataError(
            f"{path}: samples[0] is a {type(first).__name__}, expected a dict with "
            f"{', '.join(SLIME_REQUIRED)}."
        )
    missing = [k for k in SLIME_REQUIRED if k not in first]
    if samples and missing:
        raise DataError(
            f"{path}: samples[0] is not a slime train sample: key(s) {', '.join(missing)} "
            f"missing. Keys found: {', '.join(sorted(map(str, first)))}. Keys expected: "
            f"{', '.join(SLIME_REQUIRED)} (optional: {', '.join(SLIME_OPTIONAL)}). "
            f"{_SLIME_HINT}."
        )
    if "advantages" in first:
        columns["advantage"] = False
    if "entropy" in first:
        columns["entropy"] = False
    if "tokens" in first:
        columns["token_id"] = False
    for s in samples:
        if isinstance(s, dict) and "log_probs" in s:
            tokens += _length(s["log_probs"])
    return Probe(columns=columns, schema={}, rows=tokens)


def _length(v) -> int:
    try:
        return len(v)
    except TypeError:
        return 1


def _floats(v, n: int | None = None) -> np.ndarray:
    """A tensor, list or number -> float64 array (a number is broadcast to n)."""
    if hasattr(v, "detach"):
        import torch

        return v.detach().to(device="cpu", dtype=torch.float64).reshape(-1).numpy()
    if isinstance(v, list | tuple):  # a null in a list reads as NaN (tensors have no null)
        s = pl.Series(values=list(v), dtype=F64, strict=True)
        return s.fill_null(math.nan).to_numpy()
    if isinstance(v, int | float) and not isinstance(v, bool) and n is not None:
        return np.full(n, float(v))
    raise TypeError(f"expected a tensor or a list of numbers, found {type(v).__name__}")


def _ints(v) -> np.ndarray:
    if hasattr(v, "detach"):
        return v.detach().cpu().reshape(-1).long().numpy()
    return np.asarray(v, dtype=np.int64).reshape(-1)


def _scalar_int(v) -> int:
    return int(v.item() if hasattr(v, "item") else v)


def _slime_sample(
    i: int, s, step: int, want_tokens: bool, optional: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """One sample -> per-token arrays; raises ValueError naming what is wrong. `optional`:
    the optional keys samples[0] has, which every sample must have too."""
    if not isinstance(s, dict):
        raise ValueError(f"a {type(s).__name__}, expected a dict")
    missing = [k for k in (*SLIME_REQUIRED, *optional) if k not in s]
    if missing:
        raise ValueError(
            f"key(s) {', '.join(missing)} missing (keys found: "
            f"{', '.join(sorted(map(str, s)))}; expected: {', '.join(SLIME_REQUIRED)}, and "
            "the optional keys samples[0] has)"
        )
    lp = _floats(s["log_probs"])
    n = len(lp)
    rlen = s.get("response_lengths", s.get("response_length"))
    if rlen is not None:
        rlen = _scalar_int(rlen)
    cols = {"trainer_logprob": lp, "inference_logprob": _floats(s["rollout_log_probs"])}
    if "loss_masks" in s:
        cols["loss_mask"] = _floats(s["loss_masks"])
    if "advantages" in s:
        cols["advantage"] = _floats(s["advantages"], n)
    if "entropy" in s:
        cols["entropy"] = _floats(s["entropy"], n)
    sizes = {k: len(v) for k, v in cols.items()}
    expect = rlen if rlen is not None else n
    if any(v != expect for v in sizes.values()):
        names = {
            "trainer_logprob": "log_probs",
            "inference_logprob": "rollout_log_probs",
            "loss_mask": "loss_masks",
            "advantage": "advantages",
            "entropy": "entropy",
        }
        detail = ", ".join(f"{names[k]} {v}" for k, v in sizes.items())
        extra = f" (response_lengths {rlen})" if rlen is not None else ""
        raise _Unequal(f"response arrays of unequal length: {detail}{extra}")
    prompt = 0
    if "tokens" in s:
        toks = _ints(s["tokens"])
        prompt = len(toks) - n
        if prompt < 0:
            raise _Unequal(f"tokens ({len(toks)}) shorter than the response ({n})")
        if want_tokens:
            cols["token_id"] = toks[prompt:].astype(np.int64)
    mask = cols.get("loss_mask")
    cols["loss_mask"] = np.ones(n, bool) if mask is None else (mask != 0)
    cols["position"] = np.arange(prompt, prompt + n, dtype=np.int64)
    cols["sample_id"] = np.full(n, i, np.int64)
    cols["step"] = np.full(n, step, np.int64)
    return cols


class _Unequal(ValueError):
    pass


def read_slime(
    path: Path, wanted: set[str] | None, drop: bool, report, batch_rows: int
) -> Iterator[pl.DataFrame]:
    """One slime dump -> canonical token frames of about batch_rows rows."""
    obj = load_slime(path)
    step = _slime_rollout(path, obj)
    drops = _Drops(path, drop, report)
    want_tokens = wanted is None or "token_id" in wanted
    samples = obj["samples"]
    first = samples[0] if samples and isinstance(samples[0], dict) else {}
    optional = tuple(k for k in ("loss_masks", "advantages", "entropy", "tokens") if k in first)
    buf: dict[str, list[np.ndarray]] = {}
    nbuf = 0
    for i, s in enumerate(samples):
        try:
            cols = _slime_sample(i, s, step, want_tokens, optional)
        except _Unequal as exc:
            drops.bad(f"samples[{i}]", "arrays of unequal length", str(exc))
            continue
        except (ValueError, TypeError, RuntimeError) as exc:
            drops.bad(f"samples[{i}]", "not a slime train sample", str(exc))
            continue
        for k, v in cols.items():
            buf.setdefault(k, []).append(v)
        nbuf += len(cols["trainer_logprob"])
        if nbuf >= batch_rows:
            yield _slime_frame(buf, wanted)
            buf, nbuf = {}, 0
    if nbuf:
        yield _slime_frame(buf, wanted)


def _slime_frame(buf: dict[str, list[np.ndarray]], wanted: set[str] | None) -> pl.DataFrame:
    cols = {}
    for c, dtype in _CANON_TYPES.items():
        if c in buf and (wanted is None or c in wanted or c in ("step", "loss_mask")):
            cols[c] = pl.Series(c, np.concatenate(buf[c]), dtype=dtype)
    return pl.DataFrame(cols)


# ----------------------------------------------------------------------------- whole-file formats


def probe_file(fmt: str, path: Path, drop: bool = False) -> Probe | None:
    """Columns a slime / SkyRL dump or a prime-rl trace stream delivers (None: empty)."""
    if fmt == "slime":
        return probe_slime(path)
    if fmt == "skyrl":
        return probe_skyrl(path)
    if fmt == "prime-rl-traces":
        return probe_traces(path, drop)
    raise ValueError(fmt)


def read_file(
    fmt: str,
    path: Path,
    file_step: int | None,
    wanted: set[str] | None,
    drop: bool,
    report,
    batch_rows: int,
    checks: bool = False,
) -> Iterator[pl.DataFrame]:
    """One slime / SkyRL dump or prime-rl trace stream -> canonical frames of ~batch_rows rows.
    `checks`: also deliver the run's own decisions (`logged_is_masked`, ...), for prime_check."""
    if fmt == "slime":
        yield from read_slime(path, wanted, drop, report, batch_rows)
    elif fmt == "skyrl":
        yield from read_skyrl(path, file_step, wanted, batch_rows)
    elif fmt == "prime-rl-traces":
        yield from read_traces(path, wanted, drop, report, batch_rows, checks)
    else:
        raise ValueError(fmt)


def _frame(cols: dict[str, np.ndarray], wanted: set[str] | None) -> pl.DataFrame:
    """Canonical columns (plus the logged decisions) as a frame, projected to `wanted`."""
    keep = {"step", "loss_mask", *_LOGGED}
    out = {}
    for c, dtype in _CANON_TYPES.items():
        if c in cols and (wanted is None or c in wanted or c in keep):
            out[c] = pl.Series(c, cols[c], dtype=dtype, strict=False)
    df = pl.DataFrame(out)
    if "logged_is_masked" in cols:  # int8: 1 masked, 0 kept, -1 not annotated
        flag = pl.Series(cols["logged_is_masked"], dtype=pl.Int8)
        df = df.with_columns(
            logged_is_masked=pl.when(pl.lit(flag) == -1).then(None).otherwise(pl.lit(flag) == 1)
        )
    if "logged_mismatch_kl" in cols:
        df = df.with_columns(logged_mismatch_kl=pl.Series(cols["logged_mismatch_kl"]))
    return df


def _concat(buf: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in buf.items()}


# ----------------------------------------------------------------------------- SkyRL


_SKYRL_MODULE = "skyrl.backends.skyrl_train.training_batch"
_SKYRL_BATCHES = ("TrainingInputBatch", "TrainingOutputBatch", "TensorBatch")
# The only other globals a TrainingInputBatch pickle can name: the batch's device, and numpy
# scalars / dtypes that may sit in its metadata (e.g. metrics). Each builds inert data.
_SKYRL_GLOBALS = {
    ("numpy", "dtype"): ("numpy", "dtype"),
    ("numpy", "ndarray"): ("numpy", "ndarray"),
    ("numpy.core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"): ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
    ("builtins", "set"): ("builtins", "set"),
    ("builtins", "frozenset"): ("builtins", "frozenset"),
    ("builtins", "complex"): ("builtins", "complex"),
    ("collections", "OrderedDict"): ("collections", "OrderedDict"),
}
_SKYRL_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    | {"float16", "float32", "float64"}
)
_SKYRL_HINT = (
    "SkyRL writes these with trainer.dump_data_batch=true, to "
    "{export_path}/dumped_data/global_step_{N}_training_input.pkl"
)


class _SkyRLClass:
    """What the unpickler hands back for SkyRL's batch classes: a name, never the class."""

    def __init__(self, name: str) -> None:
        self.name = name


def _skyrl_rebuild(cls, state):
    """Stand-in for `_rebuild_tensor_batch(cls, state)`: keeps the state, builds nothing."""
    if not isinstance(cls, _SkyRLClass) or not isinstance(state, dict):
        raise pickle.UnpicklingError("_rebuild_tensor_batch called with something else")
    return {"__skyrl_batch__": cls.name, **state}


def _skyrl_device(*args):
    return str(args[0]) if args else "cpu"


class _SkyRLUnpickler(pickle.Unpickler):
    """Resolves only the globals a pickled SkyRL batch names, each to an inert stand-in;
    anything else (a class, a function such as os.system) is refused before it exists."""

    def find_class(self, module: str, name: str):
        if module == _SKYRL_MODULE:
            if name == "_rebuild_tensor_batch":
                return _skyrl_rebuild
            if name in _SKYRL_BATCHES:
                return _SkyRLClass(name)
        if (module, name) == ("torch", "device"):
            return _skyrl_device
        target = _SKYRL_GLOBALS.get((module, name))
        if target is not None:
            import importlib

            return getattr(importlib.import_module(target[0]), target[1])
        raise pickle.UnpicklingError(f"{module}.{name}")


_SKYRL_CACHE: dict[tuple, dict] = {}


def load_skyrl(path: Path) -> dict:
    """The state of a pickled SkyRL TrainingInputBatch: `batch_dict` (key -> serialized tensor
    or None), `batch_size`, `metadata`. The last file loaded is kept for the read after the
    probe."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing? Wait for it, or leave the file out."
        ) from None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key in _SKYRL_CACHE:
        return _SKYRL_CACHE[key]
    try:
        with open(path, "rb") as f:
            obj = _SkyRLUnpickler(f).load()
    except FileNotFoundError:
        raise DataError(f"{path}: the file disappeared while being read.") from None
    except pickle.UnpicklingError as exc:
        what = str(exc).strip() or "an object"
        raise DataError(
            f"{path}: the pickle names {what[:120]}, which is not part of a SkyRL "
            "TrainingInputBatch dump (tensors, numpy arrays, dicts, lists). mismatch-replay "
            "never unpickles arbitrary objects, so the file is not read. If it is a SkyRL dump "
            f"of another version, re-save the batch as plain tensors, {_CAPTURE}."
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, OSError) as exc:
        raise DataError(
            f"{path}: cannot read it as a pickled SkyRL batch ({type(exc).__name__}: "
            f"{str(exc)[:160]}). Is it complete? {_SKYRL_HINT}."
        ) from None
    if not isinstance(obj, dict) or "__skyrl_batch__" not in obj:
        raise DataError(
            f"{path}: the pickle holds a {type(obj).__name__}, not a SkyRL TrainingInputBatch. "
            f"{_SKYRL_HINT}; {_CAPTURE}."
        )
    if not isinstance(obj.get("batch_dict"), dict):
        raise DataError(f"{path}: the SkyRL batch has no batch_dict. {_SKYRL_HINT}.")
    _SKYRL_CACHE.clear()
    _SKYRL_CACHE[key] = obj
    return obj


def _skyrl_tensor(path: Path, obj: dict, key: str) -> np.ndarray | None:
    """One serialized tensor of the batch as a numpy array (None when absent or None)."""
    v = obj["batch_dict"].get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise DataError(f"{path}: batch key '{key}' is a {type(v).__name__}, not a tensor.")
    fmt = v.get("format", "numpy")
    if fmt == "torch":  # SkyRL's fallback for dtypes numpy lacks (bfloat16): a torch.save blob
        torch = _torch()
        try:
            t = torch.load(_bytesio.BytesIO(v["data"]), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise DataError(f"{path}: batch key '{key}': unreadable tensor ({exc}).") from None
        return t.detach().to(dtype=torch.float64).numpy()
    if fmt != "numpy":
        raise DataError(
            f"{path}: batch key '{key}' is stored as '{fmt}' (a TensorList?), not one tensor."
        )
    dtype = str(v.get("dtype"))
    if dtype not in _SKYRL_DTYPES:
        raise DataError(f"{path}: batch key '{key}' has dtype '{dtype}', not a number type.")
    try:
        return np.frombuffer(v["data"], dtype=np.dtype(dtype)).reshape(tuple(v["shape"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise DataError(
            f"{path}: batch key '{key}': bytes do not match its shape ({exc})."
        ) from None


def _skyrl_arrays(path: Path, obj: dict) -> dict[str, np.ndarray]:
    """The token arrays of a SkyRL batch, checked: (batch, response) tensors, real rows only."""
    get = lambda k: _skyrl_tensor(path, obj, k)  # noqa: E731
    lp, lq = get("action_log_probs"), get("rollout_logprobs")
    found = ", ".join(sorted(k for k, v in obj["batch_dict"].items() if v is not None))
    if lp is None:
        raise DataError(
            f"{path}: the batch holds no action_log_probs (the trainer's log-probs at the "
            "rollout weights; keys found: " + found + "). SkyRL skips that forward pass when "
            "the loss reads only the rollout log-probs (trainer.py, _skip_policy_forward), so "
            "there is nothing to compare the sampler with. Turn on an off-policy correction "
            f"(trainer.algorithm.off_policy_correction), {_CAPTURE}."
        )
    if lq is None:
        raise DataError(
            f"{path}: the batch holds no rollout_logprobs (the sampler's log-probs; keys found: "
            f"{found}). SkyRL keeps them when the inference engine returns them "
            f"(generator.sampling_params.logprobs = 1, the default); {_CAPTURE}."
        )
    lm, rm, am = get("loss_mask"), get("response_mask"), get("attention_mask")
    if lm is None or rm is None:
        raise DataError(
            f"{path}: the batch lacks loss_mask or response_mask (keys found: {found}). "
            f"{_SKYRL_HINT}."
        )
    shapes = {"action_log_probs": lp.shape, "rollout_logprobs": lq.shape}
    shapes |= {"loss_mask": lm.shape, "response_mask": rm.shape}
    adv = get("advantages")
    if adv is not None:
        shapes["advantages"] = adv.shape
    if len(set(shapes.values())) != 1 or lp.ndim != 2:
        raise DataError(
            f"{path}: the response tensors differ in shape ("
            + ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())
            + "), so tokens cannot be aligned. Expected (batch, max_response) for each."
        )
    meta = obj.get("metadata") or {}
    rows = lp.shape[0] - int(meta.get("pad_size", 0) or 0)  # DP padding rows at the end
    out = {"lp": lp[:rows], "lq": lq[:rows], "lm": lm[:rows], "rm": rm[:rows] != 0}
    if adv is not None:
        out["adv"] = adv[:rows]
    if am is not None:
        if am.shape[0] != lp.shape[0]:
            raise DataError(f"{path}: attention_mask has {am.shape[0]} rows, not {lp.shape[0]}.")
        out["am"] = am[:rows]
    return out


def probe_skyrl(path: Path) -> Probe:
    obj = load_skyrl(path)
    a = _skyrl_arrays(path, obj)
    columns = dict.fromkeys([*_FRAMEWORK_BASE, "loss_mask"], False)
    if "adv" in a:
        columns["advantage"] = False
    warnings = []
    if "am" not in a:
        warnings.append(
            f"{path}: no attention_mask in the batch, so prompt lengths are unknown: positions "
            "count from the first response token."
        )
    return Probe(columns=columns, schema={}, rows=int(a["rm"].sum()), warnings=warnings)


def read_skyrl(
    path: Path, file_step: int | None, wanted: set[str] | None, batch_rows: int
) -> Iterator[pl.DataFrame]:
    """One SkyRL batch -> canonical token frames (response tokens; loss_mask as logged)."""
    a = _skyrl_arrays(path, load_skyrl(path))
    rm = a["rm"]
    width = rm.shape[1]
    resp = rm.sum(axis=1)
    prompt = a["am"].sum(axis=1) - resp if "am" in a else np.zeros_like(resp)
    step = file_step if file_step is not None else 0
    rows_per = max(1, batch_rows // max(width, 1))
    for r0 in range(0, rm.shape[0], rows_per):
        r, j = np.nonzero(rm[r0 : r0 + rows_per])
        if not r.size:
            continue
        r = r + r0
        cols = {
            "step": np.full(r.size, step, np.int64),
            "sample_id": r.astype(np.int64),
            "position": (prompt[r] + j - (width - resp[r])).astype(np.int64),
            "trainer_logprob": a["lp"][r, j].astype(np.float64),
            "inference_logprob": a["lq"][r, j].astype(np.float64),
            "loss_mask": a["lm"][r, j] > 0,
        }
        if "adv" in a:
            cols["advantage"] = a["adv"][r, j].astype(np.float64)
        yield _frame(cols, wanted)


# ----------------------------------------------------------------------------- prime-rl traces


_STREAMS = ("trainer_logprobs", "entropies", "advantages", "is_masked")
_TRACES_HINT = (
    "prime-rl's file monitor writes <run>/monitors/file/traces/stream.jsonl and its RL trainer "
    "the annotations beside it (traces/annotations/trainer.jsonl, PR #3444)"
)


@dataclass
class _Annotations:
    """The folded update records of a trace stream: trace id -> branch -> stream -> values
    (float64, NaN for null; is_masked as int8, -1 for null), and trace id -> merged info."""

    branches: dict[str, dict[int, dict[str, np.ndarray]]]
    info: dict[str, dict]
    files: list[Path]
    tokens: int
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)  # skipped update lines

    def count_drops(self, report) -> None:
        """Add the update lines skipped (--drop-invalid) to a read's report."""
        if report is not None:
            for k, v in self.dropped.items():
                report.dropped[k] = report.dropped.get(k, 0) + v


_ANNOTATION_CACHE: dict[tuple, _Annotations] = {}


def _annotation_files(stream: Path) -> list[Path]:
    d = stream.parent / "annotations"
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("*.jsonl") if not p.name.endswith(".index.jsonl"))


def _deep_merge(old, new):
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _deep_merge(old.get(k), v) for k, v in new.items()}}
    return new


def _stream_values(name: str, v: list) -> np.ndarray:
    if name == "is_masked":
        return np.array([-1 if x is None else int(bool(x)) for x in v], dtype=np.int8)
    return _floats(v)


class _SkipCounts:
    """Where _Drops counts skipped records while the annotations are indexed (the index is
    cached and shared by the probe and every read, each of which takes the counts)."""

    def __init__(self) -> None:
        self.dropped: dict[tuple[str, str], int] = {}


def load_annotations(stream: Path, drop: bool = False) -> _Annotations:
    """Fold every producer's update records (file order, newest wins), as prime-rl's
    `fold_trace_updates` does onto the stream. The last stream's annotations are cached."""
    files = _annotation_files(stream)
    key = (str(stream), drop, *((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files))
    if key in _ANNOTATION_CACHE:
        return _ANNOTATION_CACHE[key]
    branches: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    info: dict[str, dict] = {}
    seen = _SkipCounts()
    for path in files:
        drops = _Drops(path, drop, seen)
        for n, upd in _json_lines(path, drops):
            tid = upd.get("trace_id") if isinstance(upd, dict) else None
            if not isinstance(tid, str) or not isinstance(upd.get("branches", []), list):
                drops.bad(
                    f"line {n}",
                    "not a trace update",
                    "not a prime-rl trace update (expected keys version, trace_id, info, branches)",
                )
                continue
            if isinstance(upd.get("info"), dict) and upd["info"]:
                info[tid] = _deep_merge(info.get(tid, {}), upd["info"])
            for br in upd.get("branches") or []:
                idx = br.get("index") if isinstance(br, dict) else None
                if not isinstance(idx, int) or isinstance(idx, bool):
                    drops.bad(f"line {n}", "not a trace update", "a branch without an index")
                    continue
                slot = branches.setdefault(tid, {}).setdefault(idx, {})
                for name in _STREAMS:
                    v = br.get(name)
                    if not v:
                        continue
                    try:
                        slot[name] = _stream_values(name, v)
                    except (TypeError, ValueError, pl.exceptions.PolarsError) as exc:
                        drops.bad(
                            f"line {n}",
                            "values of the wrong type",
                            f"branch {idx}, key '{name}': {str(exc)[:120]}",
                        )
    tokens = sum(
        len(s["trainer_logprobs"])
        for b in branches.values()
        for s in b.values()
        if "trainer_logprobs" in s
    )
    ann = _Annotations(branches, info, files, tokens, dropped=seen.dropped)
    _ANNOTATION_CACHE.clear()
    _ANNOTATION_CACHE[key] = ann
    return ann


def _lines(block: bytes) -> list[bytes]:
    return [r for r in block.split(b"\n") if r.strip()]


def _json_lines(path: Path, drops: _Drops) -> Iterator[tuple[int, object]]:
    """(line number, parsed object) of every non-empty line of a trace file, read in 16 MB
    blocks; a line that is not JSON is a bad record (`drops`)."""
    for block, first_line in _blocks(path, 16 << 20):
        for n, raw in zip(_record_lines(block, first_line), _lines(block), strict=True):
            try:
                yield n, json.loads(raw)
            except (ValueError, UnicodeDecodeError) as exc:
                drops.bad(f"line {n}", "not valid JSON", f"not valid JSON ({exc})")


def _leaf_paths(nodes: list) -> list[list[int]]:
    """Root-to-leaf node indexes, one per branch, leaves in node order (verifiers'
    `graph.leaves`: a leaf is no node's parent)."""
    n = len(nodes)
    parents = {
        p
        for node in nodes
        if isinstance(node, dict)
        and isinstance(p := node.get("parent"), int)
        and not isinstance(p, bool)
        and 0 <= p < n
    }
    paths = []
    for leaf in (i for i in range(n) if i not in parents):
        path: list[int] = []
        seen: set[int] = set()
        i: int | None = leaf
        while isinstance(i, int) and 0 <= i < n and i not in seen:
            seen.add(i)
            path.append(i)
            i = nodes[i].get("parent") if isinstance(nodes[i], dict) else None
        paths.append(path[::-1])
    return paths


def _spread(nodes: list[dict], key: str) -> tuple[np.ndarray, bool]:
    """A per-sampled-token node field widened to the branch's tokens: each node's values on
    its sampled positions, 0.0 elsewhere (verifiers `Branch.spread`); and whether any node
    carries the field."""
    out, any_values = [], False
    for node in nodes:
        mask = np.asarray(node.get("mask") or [], dtype=bool)
        vals = node.get(key)
        row = np.zeros(len(mask))
        if vals:
            any_values = True
            at = np.flatnonzero(mask)
            k = min(at.size, len(vals))
            row[at[:k]] = _floats(vals[:k]) if k else row[:0]
        out.append(row)
    return (np.concatenate(out) if out else np.zeros(0)), any_values


def _loss_weight(nodes: list[dict], name: str) -> np.ndarray | None:
    """A named loss-weight stream over the branch's tokens (0.0 where a node lacks it), or
    None when no node carries a nonzero weight (prime-rl then applies its default)."""
    parts, found = [], False
    for node in nodes:
        n = len(node.get("token_ids") or [])
        w = (node.get("loss_weights") or {}).get(name)
        if w is None or len(w) != n:
            parts.append(np.zeros(n))
        else:
            found = True
            parts.append(_floats(w))
    if not found:
        return None
    arr = np.concatenate(parts) if parts else np.zeros(0)
    return arr if arr.any() else None


def _trace_records(obj) -> list[tuple[dict, dict]] | None:
    """(episode, trace) pairs of one stream line: an episode record, or a bare trace."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("traces"), list):
        return [(obj, t) for t in obj["traces"] if isinstance(t, dict)]
    if isinstance(obj.get("nodes"), list):
        return [({}, obj)]
    return None


def _trace_step(episode: dict, info: dict) -> int:
    train = info.get("train") if isinstance(info.get("train"), dict) else {}
    for v in (
        train.get("trained_at_step"),
        ((episode.get("run") or {}).get("work") or {}).get("step"),
    ):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


def _env_name(episode: dict) -> str | None:
    env = episode.get("env") if isinstance(episode.get("env"), dict) else {}
    return env.get("name") or env.get("id") or None


def _branch_tokens(
    nodes: list[dict], streams: dict[str, np.ndarray]
) -> dict[str, np.ndarray] | str:
    """One annotated branch -> token arrays over its trainer stream, or why it cannot be read."""
    n = sum(len(node.get("token_ids") or []) for node in nodes)
    mask = np.concatenate(
        [np.asarray(node.get("mask") or [], dtype=bool) for node in nodes] or [np.zeros(0, bool)]
    )
    if mask.size != n:
        return f"node masks cover {mask.size} tokens but the nodes hold {n} token_ids"
    tr = streams.get("trainer_logprobs")
    if tr is None:
        return "no trainer_logprobs stream"
    length = tr.size
    if length > n:
        return f"the trainer_logprobs stream has {length} values but the branch {n} tokens"
    lq, _ = _spread(nodes, "logprobs")
    k = np.arange(length)
    loss = mask[:length] & ~np.isnan(tr) & (k > 0)
    rl, ref = _loss_weight(nodes, "rl"), _loss_weight(nodes, "ref_kl")
    if rl is not None or ref is not None:
        sampled = (rl[:length] != 0) if rl is not None else np.ones(length, bool)
        if ref is not None:
            sampled |= ref[:length] != 0
        loss &= sampled
    im = streams.get("is_masked")
    if im is not None:
        im = np.concatenate([im[:length], np.full(max(0, length - im.size), -1, np.int8)])
        if (im[loss] != -1).any():  # an RL-annotated branch: unannotated tokens are CE tokens
            loss &= im != -1
    out = {
        "position": k.astype(np.int64),
        "trainer_logprob": tr,
        "inference_logprob": lq[:length],
        "loss_mask": loss,
    }
    adv = streams.get("advantages")
    if adv is None:
        node_adv, found = _spread(nodes, "advantages")
        adv = node_adv if found else None
    if adv is not None:
        out["advantage"] = np.concatenate(
            [adv[:length], np.full(max(0, length - adv.size), np.nan)]
        )
    ent = streams.get("entropies")
    if ent is not None:
        out["entropy"] = np.concatenate([ent[:length], np.full(max(0, length - ent.size), np.nan)])
    if im is not None:
        out["logged_is_masked"] = im
    return out


def probe_traces(path: Path, drop: bool) -> Probe | None:
    """Columns a prime-rl trace stream delivers: the annotations decide (the stream holds only
    the sampler's side)."""
    ann = load_annotations(path, drop)
    if not ann.files or not ann.branches:
        where = path.parent / "annotations"
        seen = (
            f"{len(ann.files)} annotation file(s) with no update record"
            if ann.files
            else (f"no {where}")
        )
        raise DataError(
            f"{path}: no trainer annotations beside the trace stream ({seen}), so there are no "
            "trainer log-probs to replay: the traces hold only the sampler's. "
            f"{_TRACES_HINT}; point at a run whose trainer has written some, {_CAPTURE}."
        )
    streams = [s for b in ann.branches.values() for s in b.values()]
    if not any("trainer_logprobs" in s for s in streams):
        raise DataError(
            f"{path}: the annotations ({', '.join(p.name for p in ann.files)}) carry no "
            "trainer_logprobs stream. " + _TRACES_HINT + "."
        )
    columns = dict.fromkeys([*_FRAMEWORK_BASE, "loss_mask", "env"], False)
    adv = any("advantages" in s for s in streams)
    if not adv:
        first = _first_record(path, drop)
        pairs = _trace_records(first[0]) if first else None
        adv = any(
            node.get("advantages")
            for _, t in pairs or []
            for node in t.get("nodes") or []
            if isinstance(node, dict)
        )
    if adv:
        columns["advantage"] = False
    if any("entropies" in s for s in streams):
        columns["entropy"] = False
    return Probe(columns=columns, schema={}, rows=ann.tokens)


def read_traces(
    path: Path,
    wanted: set[str] | None,
    drop: bool,
    report,
    batch_rows: int,
    checks: bool = False,
) -> Iterator[pl.DataFrame]:
    """A prime-rl trace stream with its annotations -> canonical token frames, one row per
    token of each annotated branch's trainer stream."""
    ann = load_annotations(path, drop)
    ann.count_drops(report)
    drops = _Drops(path, drop, report)
    seen: set[str] = set()
    sample = 0
    buf: dict[str, list[np.ndarray]] = {}
    nbuf = 0
    for n, obj in _json_lines(path, drops):
        pairs = _trace_records(obj)
        if pairs is None:
            drops.bad(
                f"line {n}",
                "not an episode record",
                "neither an episode record (key 'traces') nor a trace (key 'nodes')",
            )
            continue
        for episode, trace in pairs:
            tid = trace.get("id")
            todo = ann.branches.get(tid) if isinstance(tid, str) else None
            if not todo:
                continue  # never trained on (eval, filtered, still in flight)
            seen.add(tid)
            nodes = trace.get("nodes") or []
            paths = _leaf_paths(nodes)
            step = _trace_step(episode, ann.info.get(tid, {}))
            env = _env_name(episode)
            for b in sorted(todo):
                if not 0 <= b < len(paths):
                    drops.bad(
                        f"line {n}",
                        "branch not in the trace",
                        f"trace {tid}: the annotations name branch {b}, the trace has "
                        f"{len(paths)} branch(es)",
                    )
                    continue
                toks = _branch_tokens([nodes[i] for i in paths[b]], todo[b])
                if isinstance(toks, str):
                    drops.bad(
                        f"line {n}",
                        "branch and stream disagree",
                        f"trace {tid}, branch {b}: {toks}",
                    )
                    continue
                if not checks:
                    toks.pop("logged_is_masked", None)
                size = toks["position"].size
                toks["step"] = np.full(size, step, np.int64)
                toks["sample_id"] = np.full(size, sample, np.int64)
                toks["env"] = np.full(size, env, dtype=object)
                sample += 1
                for k, v in toks.items():
                    buf.setdefault(k, []).append(v)
                nbuf += size
                if nbuf >= batch_rows:
                    yield _frame(_concat(buf), wanted)
                    buf, nbuf = {}, 0
    if nbuf:
        yield _frame(_concat(buf), wanted)
    missing = [t for t in ann.branches if t not in seen]
    if missing and report is not None:
        note = (
            f"{path}: {len(missing):,} trace(s) named by the trainer annotations are not in the "
            f"stream (e.g. {missing[0]}); their tokens are not read."
        )
        if note not in report.warnings:
            report.warnings.append(note)


# ----------------------------------------------------------------------------- prime-rl checks


# The rule that produced prime-rl's is_masked: at 559b447 the token export fills it only under
# DefaultLossConfig (DPPO binary TV, dppo_mask_low = dppo_mask_high = 0.2); trace annotations
# come from whatever loss the run used, so the prime-rl presets are tried and the best named.
PRIME_EXPORT_RULE = "dppo-tv@prime-rl"
PRIME_TRACE_RULES = ("dppo-tv@prime-rl", "ipo@prime-rl", "ipo@prime-rl-legacy")
KL_ATOL, KL_RTOL = 1e-5, 1e-4  # the logged k3 is float32 arithmetic


@dataclass
class PrimeCheck:
    """How the replay of prime-rl's own rule compares with the run's logged decisions."""

    rule: str  # the rule SPEC replayed
    tried: tuple[str, ...]  # the candidates (the best was kept)
    tokens: int  # loss tokens with a logged is_masked
    agree: int
    logged_masked: int
    replay_masked: int
    disagreements: list[str]  # the first few, as "step S sample I position P (logged X)"
    kl_tokens: int = 0  # loss tokens with a logged mismatch_kl
    kl_agree: int = 0  # within KL_ATOL + KL_RTOL * |k3|

    def line(self) -> str:
        """`N of M tokens agree with prime-rl's is_masked (...)`, the line to print."""
        how = f"replayed as {self.rule}"
        if len(self.tried) > 1:
            how += f", the best of {', '.join(self.tried)}"
        text = (
            f"{self.agree:,} of {self.tokens:,} tokens agree with prime-rl's is_masked ({how}; "
            f"{self.logged_masked:,} masked in the run, {self.replay_masked:,} in the replay)"
        )
        if self.kl_tokens:
            text += (
                f"; mismatch_kl equals the replayed k3 on {self.kl_agree:,} of "
                f"{self.kl_tokens:,} tokens"
            )
        if self.disagreements:
            text += "; first disagreements: " + "; ".join(self.disagreements)
        return text

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"line": self.line()}


def _check_frames(plan, wanted: set[str]) -> Iterator[pl.DataFrame]:
    """Every loss token of a prime-rl plan with a logged is_masked, with the logged columns."""
    opts = plan.options
    for i, path in enumerate(plan.files):
        step = plan.file_steps[i] if i < len(plan.file_steps) else None
        if plan.format == "prime-rl":
            if not _logs_decisions(path):  # an export without is_masked: nothing to check
                continue
            schema = dict(plan.read_schema) | {k: pl.List(t) for k, t in PRIME_CHECKS.items()}
            frames = read_framework(
                "prime-rl", path, step, schema, None, opts.drop_invalid, None, opts.block_bytes
            )
        else:
            frames = read_traces(path, None, opts.drop_invalid, None, opts.batch_rows, True)
        for df in frames:
            if "logged_is_masked" not in df.columns:
                continue
            df = df.filter(pl.col("loss_mask"), pl.col("logged_is_masked").is_not_null())
            if df.height:
                yield df.select([c for c in df.columns if c in wanted])


def _logs_decisions(path) -> bool:
    """Whether a token-export file's records carry `is_masked` (the exporter writes the same
    keys in every record: the first one tells)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    return b'"is_masked"' in line
    except OSError:  # not a local file (an object-store URI): let the reader look
        return True
    return False


def _replay_mask(spec: str, lp: np.ndarray, lq: np.ndarray, adv: np.ndarray | None) -> np.ndarray:
    from .rules import TokenBatch, parse_rule

    rule = parse_rule(spec)
    param = rule.primary_param()
    score = rule.score(TokenBatch(lp, lq, adv), param)
    th = rule.threshold(param, getattr(rule, param))
    return score >= th if rule.inclusive else score > th


def prime_check(
    sources: Sequence[str | Path], options=None, rule: str | None = None, examples: int = 3
) -> PrimeCheck | None:
    """Replay prime-rl's own rule on the tokens whose decision the run logged (`is_masked` in
    the token export or the trace annotations) and count the agreements; compare the logged
    `mismatch_kl` with the replayed k3. None when the sources are not prime-rl or log no
    decision. `rule`: the SPEC to replay (default: dppo-tv@prime-rl for the export, the best
    of PRIME_TRACE_RULES for traces)."""
    from . import io as _io

    plan = sources if hasattr(sources, "files") else _io.plan_sources(sources, options)
    if plan.format not in ("prime-rl", "prime-rl-traces"):
        return None
    tried = (
        (rule,)
        if rule
        else ((PRIME_EXPORT_RULE,) if plan.format == "prime-rl" else PRIME_TRACE_RULES)
    )
    wanted = {
        "step",
        "sample_id",
        "position",
        "trainer_logprob",
        "inference_logprob",
        "advantage",
        "logged_is_masked",
        "logged_mismatch_kl",
    }
    stats = {s: {"agree": 0, "replay": 0, "examples": []} for s in tried}
    tokens = logged = kl_tokens = kl_agree = 0
    for df in _check_frames(plan, wanted):
        lp = df["trainer_logprob"].to_numpy()
        lq = df["inference_logprob"].to_numpy()
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        got = df["logged_is_masked"].to_numpy().astype(bool)
        tokens += got.size
        logged += int(got.sum())
        for s in tried:
            try:
                mine = _replay_mask(s, lp, lq, adv)
            except UsageError as exc:
                raise DataError(
                    f"{plan.files[0]}: cannot replay {s} on this log ({exc})."
                ) from None
            st = stats[s]
            same = mine == got
            st["agree"] += int(same.sum())
            st["replay"] += int(mine.sum())
            for i in np.flatnonzero(~same)[: max(0, examples - len(st["examples"]))]:
                st["examples"].append(
                    f"step {df['step'][int(i)]} sample {df['sample_id'][int(i)]} position "
                    f"{df['position'][int(i)]} (run {'masked' if got[i] else 'kept'})"
                )
        if "logged_mismatch_kl" in df.columns:
            kl = df["logged_mismatch_kl"].to_numpy()
            have = ~np.isnan(kl)
            if have.any():
                x = lp[have] - lq[have]
                k3 = np.expm1(x) - x
                kl_tokens += int(have.sum())
                kl_agree += int((np.abs(k3 - kl[have]) <= KL_ATOL + KL_RTOL * np.abs(k3)).sum())
    if not tokens:
        return None
    best = max(tried, key=lambda s: stats[s]["agree"])
    st = stats[best]
    return PrimeCheck(
        rule=best,
        tried=tuple(tried),
        tokens=tokens,
        agree=st["agree"],
        logged_masked=logged,
        replay_masked=st["replay"],
        disagreements=st["examples"],
        kl_tokens=kl_tokens,
        kl_agree=kl_agree,
    )
