"""The caller's side of `TokenWriter.write()`: a training loop's tensors -> a compact batch.

Design
------
`write()` runs on the training loop's thread, so this module does only what must happen
before it returns, and as little of it as it can:

* **Only loss tokens leave the device.** For tensors on an accelerator the mask is applied
  there (`x[mask]`, one `nonzero()` for the token indices) and only the selected values and
  their flat indices are copied to host memory: ~2 bytes (bf16) or 4 (fp32) per value plus
  4 per index, instead of the padded [B, T] grid. That copy synchronises with the device,
  which a data-dependent selection has to anyway.
* **CPU tensors and numpy arrays are selected with numpy, not torch.** A CPU tensor is viewed
  as a numpy array without a copy (bfloat16, which numpy lacks, as its raw 16 bits: `Bits16`),
  and numpy's boolean selection of 1M tokens takes ~0.5 ms a column on one core, where
  torch's takes 3-20 ms on two busy cores (measured while writing this; torch's intra-op
  threads compete with the training loop's). The selected columns are copies, so the caller
  may reuse or change its tensors as soon as `write()` returns; the mask is copied too
  (1 byte a padded token) so that the writer's thread can find each token's row and position
  later. `write()` therefore costs ~2 ms (median; 6-10 ms at worst on two busy cores) for
  1M tokens of CPU tensors (benchmarks/capture_bench.py).
* **Ragged inputs** (a list of per-sequence lists, arrays or 1-D tensors, as slime keeps them)
  are concatenated (on their device, for tensors) and selected the same way; lists of Python
  floats are converted here, at numpy's speed for lists (~30 ns a value).
* **Sampling keeps whole sequences.** Sequence rules (seq-mis, geo-mis, veto ...) need every
  loss token of a sequence, so the per-step token cap picks sequences, never tokens: rows in a
  random order (seeded by seed, step, rank and call), kept while their loss tokens still fit
  the step's remaining budget. A sequence longer than the whole cap is never written.

Values are kept in their own dtype until the writer's thread converts them: bfloat16, float16
and float32 become float32 on disk, float64 stays float64 (`disk_dtype`). Every bfloat16,
float16 and float32 value is exactly a float32 (and every float32 exactly a float64, which is
what the readers compute in), so no value changes and the file is half the size of float64.
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field

import numpy as np

# Default sample ids: rank * SAMPLE_ID_STRIDE + the row's index within the step on that rank
# (rows of earlier write() calls of the same step counted), so that ranks never collide.
SAMPLE_ID_STRIDE = 10**9

TOKEN_COLUMNS = ("trainer_logprob", "inference_logprob", "advantage", "old_logprob", "entropy")
# columns that must arrive as floating point: a bool, uint8 or integer tensor there is a mask or
# token ids passed by mistake (bool would be written as 1.0, a log-prob no token has)
FLOAT_COLUMNS = ("trainer_logprob", "inference_logprob", "old_logprob", "entropy")
STEP_MAX = 2**63 - 1  # the step column is int64


@dataclass(frozen=True)
class Bits16:
    """bfloat16 values as their raw 16 bits (numpy has no bfloat16)."""

    bits: np.ndarray  # uint16

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    def __getitem__(self, key) -> Bits16:
        return Bits16(self.bits[key])

    def to_float32(self) -> np.ndarray:
        """Exact: a bfloat16 is the upper half of a float32."""
        return (self.bits.astype(np.uint32) << 16).view(np.float32)


Column = np.ndarray | Bits16


def disk_dtype(a: Column) -> np.dtype:
    """float32 for values that a float32 holds exactly (bfloat16, float16, float32, small
    integers are not assumed), float64 for everything else."""
    if isinstance(a, Bits16):
        return np.dtype(np.float32)
    if a.dtype.kind == "f" and a.dtype.itemsize <= 4:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def to_disk(a: Column) -> np.ndarray:
    """The column as written: float32 or float64 (see disk_dtype), values unchanged."""
    if isinstance(a, Bits16):
        return a.to_float32()
    return a.astype(disk_dtype(a), copy=False)


@dataclass
class Prepared:
    """One write() call's loss tokens, ready for the writer's thread.

    `tokens` holds one value per loss token, row-major (row by row, positions ascending).
    `index` says how to recover each token's (row, position):
      ("mask", m)              m: bool [rows, T], the tokens are np.nonzero(m)
      ("grid", idx, T)         idx: flat indices into [rows, T]
      ("ragged", idx, starts)  idx: flat indices into the concatenated rows, starts: [rows]
    Rows are those kept by sampling; `row_ids` maps them to the caller's rows (None: all)."""

    step: int
    tokens: dict[str, Column]
    index: tuple
    rows: int
    row_ids: np.ndarray | None = None
    per_row: dict[str, np.ndarray] = field(default_factory=dict)  # advantage, sample_id, env
    env: str | None = None  # one env for every token
    sample_base: int = 0  # default sample id of row 0
    seen_rows: int = 0  # rows and loss tokens handed to write(), before sampling
    seen_tokens: int | None = None  # None: as many as written (no sampling)

    @property
    def columns(self) -> tuple[str, ...]:
        """Canonical columns this batch writes (besides the two log-probs, step, sample_id
        and position, which every batch has)."""
        cols = [c for c in TOKEN_COLUMNS[2:] if c in self.tokens or c in self.per_row]
        if self.env is not None or "env" in self.per_row:
            cols.append("env")
        if "reward" in self.per_row:
            cols.append("reward")
        return tuple(cols)


# ----------------------------------------------------------------------------- validation


def check_step(step) -> int:
    """The step as an int, or a clear error: a bool, a fraction (1.7 would be written as
    step 1), a negative step or one beyond int64 (the thread could not write it)."""
    if type(step) is int and 0 <= step <= STEP_MAX:  # the fast path
        return step
    if isinstance(step, bool):
        raise TypeError(f"step={step!r}: a bool; pass the trainer's integer step counter")
    if isinstance(step, str | bytes):
        raise TypeError(
            f"step={step!r}: expected an integer (the trainer's step counter), got a string"
        )
    try:
        value = operator.index(step)  # int, numpy integer, 0-d integer tensor
    except TypeError:
        try:
            f = float(step)  # a float, numpy float, 0-d float tensor
        except (TypeError, ValueError):
            raise TypeError(
                f"step={step!r}: expected an integer (the trainer's step counter), got "
                f"{type(step).__name__}"
            ) from None
        if not f.is_integer():
            raise ValueError(
                f"step={step!r}: not a whole number; pass the trainer's integer step "
                "(int(step) only if the float really counts steps)"
            ) from None
        value = int(f)
    if not 0 <= value <= STEP_MAX:
        raise ValueError(
            f"step={value}: outside 0 .. 2**63-1 (the step column is int64, and steps count "
            "from 0); pass the trainer's step counter"
        )
    return value


def same_values(a, b) -> bool:
    """The same values in memory (one tensor or array under two names, or a ragged list of
    the same sequences): nothing to compare."""
    if a is b:
        return True
    if is_tensor(a) and is_tensor(b):
        return (
            a.device == b.device
            and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape
            and a.stride() == b.stride()
        )
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        # ragged: the same sequences (the first pair decides cheaply when they differ)
        return (
            len(a) == len(b)
            and len(a) > 0
            and _same_sequence(a[0], b[0])
            and all(_same_sequence(x, y) for x, y in zip(a, b, strict=True))
        )
    return False


def _same_sequence(x, y) -> bool:
    """One ragged sequence object, or one tensor/array's memory (a list of Python floats
    copied is not the same memory)."""
    if x is y:
        return True
    return (is_tensor(x) or isinstance(x, np.ndarray)) and same_values(x, y)


def _check_floats(tokens: dict[str, Column]) -> None:
    for name in FLOAT_COLUMNS:
        a = tokens.get(name)
        if a is None or isinstance(a, Bits16) or a.dtype.kind == "f":
            continue
        what = "log-probs" if name != "entropy" else "entropies"
        raise TypeError(
            f"{_arg(name)}: {what} must be floating point, got {a.dtype} (a mask or token ids "
            "passed by mistake?); pass the per-token values as bf16, fp16, fp32 or fp64 "
            "(x.float() for a tensor, np.asarray(x, dtype=np.float32) for an array)"
        )


# ----------------------------------------------------------------------------- kinds of input


def _torch():
    return sys.modules.get("torch")  # never imported here: a tensor exists only if torch does


def is_tensor(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _on_device(x) -> bool:
    return is_tensor(x) and x.device.type != "cpu"


def _is_ragged(x) -> bool:
    return isinstance(x, list | tuple) or (isinstance(x, np.ndarray) and x.dtype == object)


def _cpu_view(t) -> Column:
    """A CPU tensor as numpy, without a copy (bfloat16 as its bits)."""
    torch = _torch()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return Bits16(t.view(torch.int16).numpy().view(np.uint16))
    if t.dtype == torch.bool:
        return t.numpy()
    if t.is_complex() or not (t.is_floating_point() or t.dtype.is_signed or t.dtype == torch.uint8):
        raise TypeError(f"unsupported tensor dtype {t.dtype}")
    return t.numpy()


def _array(x, name: str) -> Column:
    """A dense numeric input as numpy (CPU tensors viewed, no copy)."""
    if is_tensor(x):
        return _cpu_view(x)
    a = np.asarray(x)
    if a.dtype.kind not in "fiub":
        raise TypeError(f"{name}: expected numbers, got an array of dtype {a.dtype}")
    return a


def _bool_mask(m: np.ndarray) -> np.ndarray:
    return m if m.dtype == np.bool_ else m != 0


def _per_row(x, rows: int, name: str) -> np.ndarray:
    """sample ids or env given per row -> numpy [rows] (int64 or str)."""
    if is_tensor(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1 or a.shape[0] != rows:
        raise ValueError(f"{name}: expected one value per sequence ({rows}), got shape {a.shape}")
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    if a.dtype.kind in "US" or (a.dtype == object and all(isinstance(v, str) for v in a)):
        return a.astype(str)
    raise TypeError(f"{name}: expected integers or strings, got dtype {a.dtype}")


def add_rewards(prep: Prepared, rewards) -> Prepared:
    """One reward per sequence (B values: a list, an array or a tensor) as the batch's
    `reward` column, for the rows the batch keeps; finite floats only."""
    if is_tensor(rewards):
        rewards = rewards.detach().cpu().double().numpy()
    a = np.asarray(rewards)
    if a.ndim != 1 or a.shape[0] != prep.seen_rows:
        raise ValueError(
            f"rewards: expected one value per sequence ({prep.seen_rows}), got shape {a.shape}"
        )
    if a.dtype.kind not in "fiub":
        raise TypeError(f"rewards: expected numbers, got dtype {a.dtype}")
    a = a.astype(np.float64)
    bad = int((~np.isfinite(a)).sum())
    if bad:
        raise ValueError(f"rewards: {bad} of {a.shape[0]} are NaN or infinite")
    prep.per_row["reward"] = a if prep.row_ids is None else a[prep.row_ids]
    return prep


def _row_advantage(adv: Column, rows: int) -> np.ndarray | None:
    """A [B] (or [B, 1]) advantage as float numpy, else None (it is per token)."""
    shape = adv.shape
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1 and shape[0] == rows):
        if shape[0] != rows:
            raise ValueError(f"advantages: expected {rows} sequences, got shape {tuple(shape)}")
        flat = adv.bits.reshape(-1) if isinstance(adv, Bits16) else np.asarray(adv).reshape(-1)
        a = Bits16(flat).to_float32() if isinstance(adv, Bits16) else flat
        return np.array(a, dtype=disk_dtype(a) if a.dtype.kind == "f" else np.float64)
    return None


# ----------------------------------------------------------------------------- sampling


def choose_rows(
    counts: np.ndarray, budget: int | None, rng: np.random.Generator
) -> np.ndarray | None:
    """Rows to keep (sorted) so that their loss tokens fit `budget`, whole rows only, in a
    random order; None when every row fits."""
    if budget is None or int(counts.sum()) <= budget:
        return None
    order = rng.permutation(counts.shape[0])
    fits = np.cumsum(counts[order]) <= budget
    # a prefix of the random order: the first row that does not fit ends it, so which rows
    # are kept does not depend on how short the rows after it are
    k = int(np.argmin(fits)) if not fits.all() else fits.shape[0]
    return np.sort(order[:k])


# ----------------------------------------------------------------------------- prepare


def prepare(
    step: int,
    values: dict[str, object],
    mask,
    sample_ids,
    env,
    *,
    sample_base: int,
    budget: int | None,
    rng_seed: tuple[int, ...],
) -> Prepared:
    """Select the loss tokens of one write() call (see the module docstring).

    `values`: canonical column -> input ([B, T] tensor or array, or ragged per-row
    sequences; "advantage" may also be [B]); `budget`: loss tokens still allowed this step
    (None: no cap)."""
    trainer = values["trainer_logprob"]
    if _is_ragged(trainer):
        return _prepare_ragged(step, values, mask, sample_ids, env, sample_base, budget, rng_seed)
    if any(_on_device(v) for v in (*values.values(), mask)):
        return _prepare_device(step, values, mask, sample_ids, env, sample_base, budget, rng_seed)
    return _prepare_dense(step, values, mask, sample_ids, env, sample_base, budget, rng_seed)


def _check_2d(cols: dict[str, Column], mask_shape, rows_adv: bool) -> tuple[int, int]:
    shape = cols["trainer_logprob"].shape
    if len(shape) != 2:
        raise ValueError(
            f"trainer_logprobs: expected a [batch, tokens] tensor or array, got shape "
            f"{tuple(shape)} (a single sequence: add a batch dimension, x[None])"
        )
    for name, a in cols.items():
        if name == "advantage" and rows_adv:
            continue
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{_arg(name)}: shape {tuple(a.shape)} != {tuple(shape)}")
    if mask_shape is not None and tuple(mask_shape) != tuple(shape):
        raise ValueError(f"mask: shape {tuple(mask_shape)} != {tuple(shape)}")
    return int(shape[0]), int(shape[1])


def _arg(col: str) -> str:
    """The write() argument that feeds a canonical column, for error messages."""
    return {
        "trainer_logprob": "trainer_logprobs",
        "inference_logprob": "inference_logprobs",
        "advantage": "advantages",
        "old_logprob": "old_logprobs",
        "entropy": "entropy",
    }[col]


def _finish(
    step, tokens, index, rows, keep, per_row, sample_ids, env, sample_base, seen_rows, seen
) -> Prepared:
    _check_floats(tokens)
    if sample_ids is not None:
        ids = _per_row(sample_ids, seen_rows, "sample_ids")
        per_row["sample_id"] = ids if keep is None else ids[keep]
    const_env = None
    if isinstance(env, str):
        const_env = env
    elif env is not None:
        e = _per_row(env, seen_rows, "env").astype(str)
        per_row["env"] = e if keep is None else e[keep]
    return Prepared(
        step=step,
        tokens=tokens,
        index=index,
        rows=rows,
        row_ids=keep,
        per_row=per_row,
        env=const_env,
        sample_base=sample_base,
        seen_rows=seen_rows,
        seen_tokens=seen,
    )


def _prepare_dense(step, values, mask, sample_ids, env, sample_base, budget, rng_seed):
    cols = {k: _array(v, _arg(k)) for k, v in values.items()}
    adv = cols.get("advantage")
    row_adv = None if adv is None else _row_advantage(adv, cols["trainer_logprob"].shape[0])
    if row_adv is not None:
        del cols["advantage"]
    m = None if mask is None else _bool_mask(np.asarray(_array(mask, "mask")))
    rows, width = _check_2d(cols, None if m is None else m.shape, row_adv is not None)
    if m is None:
        m = np.ones((rows, width), dtype=bool)
    keep = None
    seen = None
    if budget is not None:
        counts = m.sum(axis=1)
        keep = choose_rows(counts, budget, np.random.default_rng(rng_seed))
        if keep is not None:
            seen = int(counts.sum())
            m = m[keep]
            cols = {k: a[keep] for k, a in cols.items()}
            row_adv = None if row_adv is None else row_adv[keep]
    tokens = {k: a[m] for k, a in cols.items()}
    per_row = {} if row_adv is None else {"advantage": row_adv}
    n_rows = m.shape[0]
    # the mask itself may be the caller's (a view): keep a copy for the writer's thread
    index = ("mask", m.copy() if keep is None else m)
    return _finish(
        step, tokens, index, n_rows, keep, per_row, sample_ids, env, sample_base, rows, seen
    )


def _prepare_device(
    step, values, mask, sample_ids, env, sample_base, budget, rng_seed, device=None
):
    """Tensors on an accelerator (`device`: the first one's device). The same torch code runs
    on CPU tensors, which is how the tests check it without an accelerator."""
    torch = _torch()
    if device is None:
        device = next(v.device for v in (*values.values(), mask) if _on_device(v))

    def dev(x):
        if is_tensor(x):
            return x.detach().to(device)
        return torch.as_tensor(np.asarray(x), device=device)

    cols = {k: dev(v) for k, v in values.items()}
    rows = cols["trainer_logprob"].shape[0] if cols["trainer_logprob"].dim() else 0
    adv = cols.get("advantage")
    row_adv = None
    if adv is not None and (adv.dim() == 1 or (adv.dim() == 2 and adv.shape[1] == 1)):
        row_adv = _row_advantage(_cpu_view(adv.reshape(-1).cpu()), rows)
        del cols["advantage"]
    m = None if mask is None else dev(mask)
    rows, width = _check_2d(cols, None if m is None else m.shape, row_adv is not None)
    if m is None:
        m = torch.ones((rows, width), dtype=torch.bool, device=device)
    elif m.dtype != torch.bool:
        m = m != 0
    keep = None
    seen = None
    if budget is not None:
        counts = m.sum(dim=1).cpu().numpy()
        keep = choose_rows(counts, budget, np.random.default_rng(rng_seed))
        if keep is not None:
            seen = int(counts.sum())
            kt = torch.as_tensor(keep, device=device)
            m = m.index_select(0, kt)
            cols = {k: a.index_select(0, kt) for k, a in cols.items()}
            row_adv = None if row_adv is None else row_adv[keep]
    idx = m.reshape(-1).nonzero().reshape(-1)
    if m.numel() < 2**31:
        idx = idx.to(torch.int32)  # half the bytes to copy
    picked = {k: a[m] for k, a in cols.items()}  # on the device: only these leave it
    tokens = {k: _cpu_view(a.cpu()) for k, a in picked.items()}
    per_row = {} if row_adv is None else {"advantage": row_adv}
    index = ("grid", idx.cpu().numpy(), width)
    return _finish(
        step, tokens, index, m.shape[0], keep, per_row, sample_ids, env, sample_base, rows, seen
    )


def _prepare_ragged(step, values, mask, sample_ids, env, sample_base, budget, rng_seed):
    seqs = {k: list(v) for k, v in values.items()}  # the caller's outer lists may change later
    rows = len(seqs["trainer_logprob"])
    adv = values.get("advantage")
    row_adv = None
    if adv is not None and not _is_ragged(adv):
        row_adv = _row_advantage(_array(adv, "advantages"), rows)
        if row_adv is None:
            raise ValueError(
                f"advantages: with ragged log-probs give one value per sequence or a ragged "
                f"list, got shape {tuple(getattr(adv, 'shape', ()))}"
            )
        del seqs["advantage"]
    elif adv is not None and all(np.ndim(a) == 0 for a in seqs["advantage"]):
        row_adv = np.asarray([float(a) for a in seqs["advantage"]], dtype=np.float64)
        del seqs["advantage"]
    masks = None if mask is None else list(mask)
    lengths = np.fromiter((_length(s) for s in seqs["trainer_logprob"]), np.int64, rows)
    for name, col in seqs.items():
        if len(col) != rows:
            raise ValueError(f"{_arg(name)}: {len(col)} sequences, trainer_logprobs has {rows}")
        for i, s in enumerate(col):
            if _length(s) != lengths[i]:
                raise ValueError(
                    f"{_arg(name)}: sequence {i} has {_length(s)} tokens, trainer_logprobs "
                    f"has {lengths[i]}"
                )
    if masks is not None:
        if len(masks) != rows:
            raise ValueError(f"mask: {len(masks)} sequences, trainer_logprobs has {rows}")
        for i, s in enumerate(masks):
            if _length(s) != lengths[i]:
                raise ValueError(
                    f"mask: sequence {i} has {_length(s)} tokens, trainer_logprobs has {lengths[i]}"
                )
    keep = None
    seen = None
    if budget is not None:
        if masks is None:
            counts = lengths
        else:
            counts = np.fromiter((_count(s) for s in masks), np.int64, rows)
        keep = choose_rows(counts, budget, np.random.default_rng(rng_seed))
        if keep is not None:
            seen = int(counts.sum())
            seqs = {k: [col[i] for i in keep] for k, col in seqs.items()}
            masks = None if masks is None else [masks[i] for i in keep]
            lengths = lengths[keep]
            row_adv = None if row_adv is None else row_adv[keep]
    n_rows = lengths.shape[0]
    starts = np.zeros(n_rows, dtype=np.int64)
    if n_rows > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    every = [*seqs.values(), *([masks] if masks is not None else [])]
    on_device = any(_on_device(s) for col in every for s in col)
    if on_device:
        tokens, idx = _ragged_device(seqs, masks, int(lengths.sum()))
    else:
        flat = {k: _concat(col, _arg(k)) for k, col in seqs.items()}
        if masks is None:
            tokens, idx = flat, None
        else:
            fm = _bool_mask(np.asarray(_concat(masks, "mask")))
            tokens = {k: a[fm] for k, a in flat.items()}
            idx = np.flatnonzero(fm)
    if idx is None:
        idx = np.arange(int(lengths.sum()), dtype=np.int64)
    per_row = {} if row_adv is None else {"advantage": row_adv}
    index = ("ragged", idx, starts)
    return _finish(
        step, tokens, index, n_rows, keep, per_row, sample_ids, env, sample_base, rows, seen
    )


def _length(s) -> int:
    if is_tensor(s) or isinstance(s, np.ndarray):
        if s.ndim != 1:
            raise ValueError(f"a ragged sequence must be 1-D, got shape {tuple(s.shape)}")
        return int(s.shape[0])
    return len(s)


def _count(s) -> int:
    if is_tensor(s):
        return int((s != 0).sum())
    return int(np.count_nonzero(np.asarray(s)))


def _concat(col: list, name: str) -> Column:
    """Per-row sequences (lists, arrays, CPU tensors) -> one flat column (a copy)."""
    if not col:
        return np.zeros(0, dtype=np.float64)
    parts = [_cpu_view(s) if is_tensor(s) else np.asarray(s) for s in col]
    if any(isinstance(p, Bits16) for p in parts):
        if not all(isinstance(p, Bits16) for p in parts):
            raise TypeError(f"{name}: bfloat16 sequences mixed with other dtypes")
        return Bits16(np.concatenate([p.bits for p in parts]))
    out = np.concatenate([p.reshape(-1) for p in parts])
    if out.dtype.kind not in "fiub":
        raise TypeError(f"{name}: expected numbers, got dtype {out.dtype}")
    return out


def _ragged_device(seqs: dict[str, list], masks: list | None, total: int):
    """Ragged tensors on an accelerator: concatenated and selected there."""
    torch = _torch()
    device = next(s.device for col in seqs.values() for s in col if _on_device(s))

    def cat(col):
        parts = [
            s.detach().reshape(-1).to(device)
            if is_tensor(s)
            else torch.as_tensor(np.asarray(s), device=device)
            for s in col
        ]
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    flat = {k: cat(col) for k, col in seqs.items()}
    if masks is None:
        return {k: _cpu_view(a.cpu()) for k, a in flat.items()}, None
    fm = cat(masks)
    fm = fm if fm.dtype == torch.bool else fm != 0
    idx = fm.nonzero().reshape(-1)
    if total < 2**31:
        idx = idx.to(torch.int32)
    tokens = {k: _cpu_view(a[fm].cpu()) for k, a in flat.items()}
    return tokens, idx.cpu().numpy()


# ----------------------------------------------------------------------------- the writer's side


def token_rows(p: Prepared) -> tuple[np.ndarray, np.ndarray]:
    """(row within the batch, position) of every token of a prepared batch."""
    kind = p.index[0]
    if kind == "mask":
        rows, pos = np.nonzero(p.index[1])
        return rows, pos.astype(np.int64, copy=False)
    if kind == "grid":
        idx = p.index[1].astype(np.int64, copy=False)
        rows = idx // p.index[2]
        return rows, idx - rows * p.index[2]
    idx = p.index[1].astype(np.int64, copy=False)
    starts = p.index[2]
    rows = np.searchsorted(starts, idx, side="right") - 1
    return rows, idx - starts[rows]
