"""SkyRL: a pickled `TrainingInputBatch` (`global_step_<N>_training_input.pkl`), unpickled
restrictively.

Design
------
Read from NovaSky-AI/SkyRL `skyrl/backends/skyrl_train/training_batch.py`,
`skyrl/train/trainer.py` and `skyrl/train/dataset/preprocess.py` at a956457.
`dumped_data/global_step_<N>_training_input.pkl` is `pickle.dump` of a `TrainingInputBatch`,
which pickles as `_rebuild_tensor_batch(cls, state)` with every tensor as `{"format":
"numpy", "data": bytes, "shape", "dtype"}` (bf16: `{"format": "torch"}`, a `torch.save`
blob). `_SkyRLUnpickler` resolves exactly those globals (and `torch.device`, numpy scalars)
to inert stand-ins and refuses every other one, so no code in the file can run; tensors
become numpy arrays straight from their bytes. Response tensors are right-aligned in
`(batch, max_response)`: the trainer log-prob is `action_log_probs`, the sampler's
`rollout_logprobs`, the position `prompt_len + i` with `prompt_len = attention_mask.sum() -
response_mask.sum()`; the rows SkyRL appends as DP padding (`metadata["pad_size"]`) are
left out. The step is N from the file name. The last file loaded is cached for the read
after the probe. Reads at ~3.5M tokens/s on 2 shared cores (numpy straight from the pickled
bytes).

A pickle is a program: `pickle.load` of a file from elsewhere runs whatever code the file
names, which is why the unpickler above resolves only SkyRL's own names to inert stand-ins.
The file is also bounded before any of it is run (issue 37): a regular file only (`os.stat`
first: a FIFO or `/dev/zero` is refused), at most `safe_read.data_cap()` bytes (4 GB: one
SkyRL step is tens to hundreds of MB; MISMATCH_REPLAY_MAX_FILE_MB raises it), memory-mapped
(a length the file declares is never allocated beyond what it holds), and walked with
`pickletools.genops` first, which runs nothing: at most `MAX_PICKLE_OPS` opcodes (a tensor
is a few) and no memo index past the opcodes before it (a 9-byte pickle putting memo slot
2**28 makes the C unpickler allocate 4 GB). Anything the unpickler or the stand-ins then
raise is a DataError naming the file.
"""

from __future__ import annotations

import io as _bytesio
import mmap
import pickle
import pickletools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from ...errors import DataError
from .. import safe_read
from .base import CAPTURE_HINT, FRAMEWORK_BASE, Probe, frame, import_torch

DUMP_FILE = re.compile(r"global_step_(\d+)_training_input\.pkl")

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


MAX_PICKLE_OPS = 1_000_000  # opcodes in a SkyRL batch pickle (each tensor is a few)
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


class _Refused(pickle.UnpicklingError):
    """A global the restricted unpickler does not resolve (its text: module.name)."""


class _SkyRLClass:
    """What the unpickler hands back for SkyRL's batch classes: a name, never the class."""

    def __init__(self, name: str) -> None:
        self.name = name


def _skyrl_rebuild(cls, state):
    """Stand-in for `_rebuild_tensor_batch(cls, state)`: keeps the state, builds nothing."""
    if not isinstance(cls, _SkyRLClass) or not isinstance(state, dict):
        raise _Refused("_rebuild_tensor_batch called with something else")
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
        raise _Refused(f"{module}.{name}")


_SKYRL_CACHE: dict[tuple, dict] = {}


def _check_ops(path: Path, f) -> None:
    """Walk the pickle's opcodes without running any: at most MAX_PICKLE_OPS, and no memo
    slot past the opcodes before it (the C unpickler grows its memo to the index)."""
    ops = 0
    try:
        for op, arg, _pos in pickletools.genops(f):
            ops += 1
            if ops > MAX_PICKLE_OPS:
                raise DataError(
                    f"{path}: the pickle has more than {MAX_PICKLE_OPS:,} opcodes; a SkyRL "
                    "batch's tensors are a few each, so this is not one (or holds Python "
                    f"objects where tensors belong). {_SKYRL_HINT}; {CAPTURE_HINT}."
                )
            if op.name in _MEMO_PUTS and isinstance(arg, int) and arg > ops:
                raise DataError(
                    f"{path}: the pickle stores memo slot {arg:,} after {ops:,} opcodes, "
                    "which no pickler writes (it would make the unpickler allocate that "
                    f"many slots): not a SkyRL dump. {_SKYRL_HINT}."
                )
            if op.name == "STOP":
                return
    except (ValueError, EOFError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{path}: not a readable pickle ({str(exc)[:160]}). Is it complete? {_SKYRL_HINT}."
        ) from None


def load_skyrl(path: Path) -> dict:
    """The state of a pickled SkyRL TrainingInputBatch: `batch_dict` (key -> serialized tensor
    or None), `batch_size`, `metadata`. The last file loaded is kept for the read after the
    probe. Bounded and restricted before anything runs (module docstring)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing? Wait for it, or leave the file out."
        ) from None
    except OSError:
        st = None  # check_file says why
    cap = safe_read.data_cap()
    fix = (
        f"One SkyRL step is tens to hundreds of MB; set {safe_read.ENV_CAP} to a larger number "
        "of megabytes to read a bigger one on a machine with the memory."
    )
    st = safe_read.check_file(path, cap, "SkyRL batch pickle", fix, DataError)
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key in _SKYRL_CACHE:
        return _SKYRL_CACHE[key]
    if st.st_size == 0:
        raise DataError(f"{path}: an empty file, not a pickled SkyRL batch. {_SKYRL_HINT}.")
    try:
        with (
            safe_read.open_checked(path, cap, "SkyRL batch pickle", fix, DataError) as f,
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        ):
            _check_ops(path, mm)
            mm.seek(0)
            obj = _SkyRLUnpickler(mm).load()
    except FileNotFoundError:
        raise DataError(f"{path}: the file disappeared while being read.") from None
    except _Refused as exc:
        what = str(exc).strip() or "an object"
        raise DataError(
            f"{path}: the pickle names {what[:120]}, which is not part of a SkyRL "
            "TrainingInputBatch dump (tensors, numpy arrays, dicts, lists). A pickle can run "
            "any code it names, so mismatch-replay never unpickles arbitrary objects and the "
            "file is not read. If it is a SkyRL dump of another version, re-save the batch as "
            f"plain tensors, {CAPTURE_HINT}."
        ) from None
    except DataError:
        raise
    except Exception as exc:  # whatever an untrusted pickle makes the unpickler raise
        raise DataError(
            f"{path}: cannot read it as a pickled SkyRL batch ({type(exc).__name__}: "
            f"{str(exc)[:160]}). Is it complete? {_SKYRL_HINT}."
        ) from None
    if not isinstance(obj, dict) or "__skyrl_batch__" not in obj:
        raise DataError(
            f"{path}: the pickle holds a {type(obj).__name__}, not a SkyRL TrainingInputBatch. "
            f"{_SKYRL_HINT}; {CAPTURE_HINT}."
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
        torch = import_torch()
        try:
            t = torch.load(_bytesio.BytesIO(v["data"]), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise DataError(f"{path}: batch key '{key}': unreadable tensor ({exc}).") from None
        if not isinstance(t, torch.Tensor):
            raise DataError(f"{path}: batch key '{key}' holds a {type(t).__name__}, not a tensor.")
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
            f"(trainer.algorithm.off_policy_correction), {CAPTURE_HINT}."
        )
    if lq is None:
        raise DataError(
            f"{path}: the batch holds no rollout_logprobs (the sampler's log-probs; keys found: "
            f"{found}). SkyRL keeps them when the inference engine returns them "
            f"(generator.sampling_params.logprobs = 1, the default); {CAPTURE_HINT}."
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
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    pad = meta.get("pad_size", 0) or 0
    if isinstance(pad, bool) or not isinstance(pad, int | np.integer) or not 0 <= pad <= len(lp):
        raise DataError(
            f"{path}: metadata pad_size = {str(pad)[:40]!r}, not a count of padding rows between "
            f"0 and the batch's {len(lp)} rows. {_SKYRL_HINT}."
        )
    rows = lp.shape[0] - int(pad)  # DP padding rows at the end
    out = {"lp": lp[:rows], "lq": lq[:rows], "lm": lm[:rows], "rm": rm[:rows] != 0}
    if adv is not None:
        out["adv"] = adv[:rows]
    if am is not None:
        if am.ndim != 2 or am.shape[0] != lp.shape[0]:
            raise DataError(
                f"{path}: attention_mask has shape {tuple(am.shape)}, not ({lp.shape[0]}, "
                "sequence length)."
            )
        out["am"] = am[:rows]
    return out


def probe_skyrl(path: Path) -> Probe:
    obj = load_skyrl(path)
    a = _skyrl_arrays(path, obj)
    columns = dict.fromkeys([*FRAMEWORK_BASE, "loss_mask"], False)
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
        yield frame(cols, wanted)
