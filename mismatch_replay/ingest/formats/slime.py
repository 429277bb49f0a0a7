"""slime: `torch.save` train dumps, `format_version` 2 (the `.pt` suffix).

Design
------
Read from THUDM/slime `slime/observability/train_data_utils.py`, `rollout_data_utils.py` and
`slime/utils/arguments.py` at 624b824. A dump (`--save-debug-train-data PATH/{rollout_id}.pt`)
is `{"format_version": 2, "rollout_id", "samples": [...]}`, each sample a dict of
response-only arrays (`log_probs`, `rollout_log_probs`, optional `loss_masks`, `advantages`,
`response_lengths`, `tokens`, `entropy`). `position = len(tokens) - response_length + i`,
the step is `rollout_id`, `sample_id` the index in `samples` (sorted by `rollout_position`
by the writer). Every sample must have the optional keys samples[0] has; one that does not,
or whose arrays differ in length, is a bad record (`samples[i]`).

Loaded with `torch.load(weights_only=True, mmap=True)`: nothing but tensors, lists, dicts and
numbers is ever unpickled, and tensors are paged in on use. torch is imported only here, on
demand. `--dump-details DIR` also writes `DIR/rollout_data/{id}.pt` (the sampler's samples, no
trainer log-probs): sources.py skips those with a note (`is_slime_rollout_dump`), and one read
on its own is refused with the way to the train dumps. Reads at ~0.44M tokens/s on 2 shared
cores (torch's safe unpickler, ~0.3 ms a tensor, dominates when samples are short). A dump
is a regular file of at most `safe_read.data_cap()` bytes (4 GB; MISMATCH_REPLAY_MAX_FILE_MB
raises it), checked with `os.stat` before torch opens it (issue 37).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from ...errors import DataError
from .. import safe_read
from .base import CANON_TYPES, FRAMEWORK_BASE, Drops, Probe, floats, import_torch

SLIME_TOP = ("format_version", "rollout_id", "samples")
SLIME_REQUIRED = ("log_probs", "rollout_log_probs")
SLIME_OPTIONAL = ("loss_masks", "advantages", "response_lengths", "tokens", "entropy")
_SLIME_HINT = (
    "slime writes train dumps with --save-debug-train-data PATH/{rollout_id}.pt (format_version 2)"
)


def is_slime_rollout_dump(path: Path) -> bool:
    """A `--dump-details DIR` rollout dump, `DIR/rollout_data/{id}.pt` beside `DIR/train_data/`:
    the sampler's samples without trainer log-probs. sources.py skips these with a note."""
    return (
        path.suffix.lower() == ".pt"
        and path.parent.name == "rollout_data"
        and (path.parent.parent / "train_data").is_dir()
    )


def load_slime(path: Path) -> dict:
    """Load a slime dump safely (weights_only: tensors, lists, dicts, numbers; no code)."""
    if not path.exists():
        raise DataError(
            f"{path}: the file disappeared before it could be read (it was listed a moment "
            "ago). Is the trainer still writing? Wait for it, or leave the file out."
        )
    safe_read.check_file(
        path,
        safe_read.data_cap(),
        "slime train dump",
        "One slime rollout's dump is tens to hundreds of MB; set "
        f"{safe_read.ENV_CAP} to a larger number of megabytes to read a bigger one.",
        DataError,
    )
    torch = import_torch()
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
    except DataError:
        raise
    except Exception as exc:  # whatever a broken or hostile file makes torch.load raise
        raise DataError(
            f"{path}: cannot read it as a torch.save file ({type(exc).__name__}: "
            f"{str(exc)[:200]}). Is it complete? {_SLIME_HINT}."
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
    columns = dict.fromkeys([*FRAMEWORK_BASE, "loss_mask"], False)
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
    lp = floats(s["log_probs"])
    n = len(lp)
    rlen = s.get("response_lengths", s.get("response_length"))
    if rlen is not None:
        rlen = _scalar_int(rlen)
    cols = {"trainer_logprob": lp, "inference_logprob": floats(s["rollout_log_probs"])}
    if "loss_masks" in s:
        cols["loss_mask"] = floats(s["loss_masks"])
    if "advantages" in s:
        cols["advantage"] = floats(s["advantages"], n)
    if "entropy" in s:
        cols["entropy"] = floats(s["entropy"], n)
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
    drops = Drops(path, drop, report)
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
    for c, dtype in CANON_TYPES.items():
        if c in buf and (wanted is None or c in wanted or c in ("step", "loss_mask")):
            cols[c] = pl.Series(c, np.concatenate(buf[c]), dtype=dtype)
    return pl.DataFrame(cols)
