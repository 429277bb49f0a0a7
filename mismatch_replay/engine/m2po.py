"""m2po's side of the engine: the per-step store of its inputs, the spill, the resolution.

Design
------
m2po ranks a whole step's tokens by l^2 (rules/m2po.py), so nothing short of the step's
values decides a token's fate, and a step may be spread over any number of batches and
files. `M2POStore` keeps, per step and in input order (ties are broken by it), 16 bytes a
token (float64 l^2 and |dp|), plus 8 for the sequence id when the log has sequences and 4
for the group with --by; past MISMATCH_REPLAY_M2PO_MEMORY MiB (default 768) it spills every
step to its own files in TMPDIR. It owns its memory: `add` copies a batch's values (24-28
bytes a token, ~0.13 ms per 8 MB here) into a slab of its own, leased from its free list,
and a slab goes back there when the last step viewing it is spilled or resolved (`pop`
hands out a `Lease`, released after resolution). So a sorted log's replay cycles through a
few slabs instead of faulting in fresh memory for every batch, and whoever produced the
values (the fused runner, the Tally's sequence ids) may reuse its buffers at once.

Resolving a step (`resolve_steps`): one of at most `M2POStore.chunk` tokens is binned in
memory by the kernel (`fast.m2po_step_bins`); a larger one (a log without a step column is
one step) is streamed (`resolve_big`: an external sort, then one pass in chunks), so memory
is bounded by the budget plus a chunk per thread whatever the size of a step.

`M2POTally` is m2po's part of a Tally: the store of the steps still open and the bins of
the steps resolved so far. With final=True (sweep(), the CLI) a step is resolved during the
replay, in a thread beside it, as soon as the Parquet row-group statistics of the step
column rule out more of its rows (`M2POTally.seal`), so a log sorted by step keeps only the
steps in flight; the rest is resolved step by step over the cores when the table is read
(`M2POTally.job_bins`).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .. import fast
from ..output import HOST_TAG, SCRATCH_DIRS, output_error, pid_alive
from .bins import JobBins, new_bins, seq_count
from .jobs import Job

M2PO_MEMORY_ENV = "MISMATCH_REPLAY_M2PO_MEMORY"  # MiB kept in memory before spilling to disk
M2PO_MEMORY_MIB = 768
M2PO_SPILL_PREFIX = "mismatch-replay-m2po-"
# bytes a token of a chunk costs the streamed resolve of a large step (its fields, bins, the
# searches' temporaries): a chunk is a quarter of the budget
_STREAM_BYTES_PER_TOKEN = 320
_M2PO_FIELDS = (("x", np.float64), ("mass", np.float64), ("g", np.int32), ("seq", np.int64))


def _spill_error(exc: BaseException, where: str, tokens: int, limit: int) -> Exception:
    """A full (or unwritable) TMPDIR while m2po spills: one sentence and the fixes."""
    base = output_error(exc, os.path.join(where, "x"), "m2po's spill")
    return type(base)(
        f"m2po's store could not write to {where} ({exc.strerror or exc}): beyond "
        f"{limit / 2**20:.0f} MiB in memory it spills ~24 bytes a token to TMPDIR ({tokens:,} "
        f"tokens so far). Point TMPDIR at a disk with room, raise {M2PO_MEMORY_ENV} (MiB kept "
        "in memory), or leave m2po out of the rules."
        if isinstance(exc, OSError)
        else str(base)
    )


def reclaim_spills(base: str | None = None) -> list[str]:
    """Remove the spill directories that killed runs of this host left in TMPDIR (named
    mismatch-replay-m2po-HOST-PID-...: the process is gone); returns them. Called whenever a
    store starts spilling, so a SIGKILLed sweep's spill is reclaimed by the next one."""
    base = base or tempfile.gettempdir()
    pat = re.compile(re.escape(M2PO_SPILL_PREFIX) + r"([0-9a-f]{6})-(\d+)-")
    gone = []
    try:
        names = os.listdir(base)
    except OSError:
        return gone
    for name in names:
        m = pat.match(name)
        mine = m is not None and m.group(1) == HOST_TAG and int(m.group(2)) != os.getpid()
        if mine and not pid_alive(int(m.group(2))):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            gone.append(os.path.join(base, name))
    return gone


class _SpillDir:
    """A spill directory in TMPDIR, named after this host and process (reclaim_spills), and
    removed when the store is collected, at exit, on SIGTERM (output.terminate_as_interrupt)
    and before an os._exit (output.SCRATCH_DIRS)."""

    def __init__(self) -> None:
        reclaim_spills()
        self.name = tempfile.mkdtemp(prefix=f"{M2PO_SPILL_PREFIX}{HOST_TAG}-{os.getpid()}-")
        SCRATCH_DIRS.add(self.name)
        self._finalizer = weakref.finalize(self, _SpillDir._remove, self.name)

    @staticmethod
    def _remove(name: str) -> None:
        shutil.rmtree(name, ignore_errors=True)
        SCRATCH_DIRS.discard(name)

    def cleanup(self) -> None:
        self._finalizer()


class BigStep:
    """A step too large to resolve in memory (more than `M2POStore.chunk` tokens): its tokens
    stay where the store keeps them (a prefix in the step's spill files, then in-memory
    parts) and `resolve_big` reads them in chunks. Iterating it gives the whole arrays, as
    M2POStore.step gives for a small step (for m2po_scores and pickling: not bounded)."""

    def __init__(self, store: M2POStore, s: int, own: bool):
        self.step = s
        self.dir = store._spill_dir()  # its sorted runs go there (removed with the store)
        self.n_disk = store._on_disk.get(s, 0)
        self.paths = {name: store._path(s, name) for name, _ in _M2PO_FIELDS}
        self.parts = list(store.parts.get(s, []))
        self.n = self.n_disk + sum(len(p[0]) for p in self.parts)
        self.absent = set(store._absent)
        self.chunk = store.chunk
        self.limit = store.limit
        self.own = own  # popped: the files are this object's to remove

    def chunks(self, fields: Sequence[str], size: int | None = None) -> Iterator[list]:
        """The step's tokens in input order, at most `size` at a time: one array per field
        (an absent field: zeros)."""
        size = size or self.chunk
        idx = [k for k, (name, _) in enumerate(_M2PO_FIELDS) if name in fields]
        for a in range(0, self.n_disk, size):
            m = min(size, self.n_disk - a)
            out = []
            for k in idx:
                name, dt = _M2PO_FIELDS[k]
                if name in self.absent:
                    out.append(np.zeros(m, np.int64))
                else:
                    off = a * np.dtype(dt).itemsize
                    out.append(np.fromfile(self.paths[name], dtype=dt, count=m, offset=off))
            yield out
        for part in self.parts:
            n = len(part[0])
            for a in range(0, n, size):
                yield [
                    np.zeros(min(size, n - a), np.int64)
                    if part[k] is None
                    else part[k][a : a + size]
                    for k in idx
                ]

    def __iter__(self):
        cols = [[] for _ in _M2PO_FIELDS]
        for got in self.chunks([name for name, _ in _M2PO_FIELDS]):
            for c, a in zip(cols, got, strict=True):
                c.append(a)
        out = [np.concatenate(c) if c else np.zeros(0) for c in cols]
        out[2] = out[2].astype(np.int64)
        return iter(out)

    def __len__(self) -> int:
        return 4

    def close(self) -> None:
        if self.own:
            for p in self.paths.values():
                with contextlib.suppress(OSError):
                    os.remove(p)


def _address(a: np.ndarray) -> int:
    """Where an array's data starts."""
    return a.__array_interface__["data"][0]


class _Slab:
    """Store-owned arrays, one per stored field, that the parts of one batch view: leased
    by `M2POStore.add`, back on the store's free list when the last of its parts is
    spilled or resolved."""

    __slots__ = ("absent", "arrays", "holders")

    def __init__(self, n: int, absent: frozenset):
        self.absent = absent
        self.arrays = tuple(
            None if name in absent else np.empty(n, dt) for name, dt in _M2PO_FIELDS
        )
        self.holders = 0  # parts viewing it

    @property
    def size(self) -> int:
        return self.arrays[0].shape[0]


class Lease:
    """What a popped step's arrays still view in the store (`M2POStore.pop`):
    `release()`, once the step is resolved, hands it back (idempotent)."""

    def __init__(self, store: M2POStore, slabs: list[_Slab]):
        self._store = store
        self._slabs = slabs

    def release(self) -> None:
        slabs, self._slabs = self._slabs, []
        self._store.give_back(slabs)


_FREE_SLABS = 4  # released slabs a store keeps for the next batches


class M2POStore:
    """m2po's input: l^2, |dp|, group and sequence of every loss token, kept per step.

    16 bytes a token (float64 l^2 and |dp|), plus 8 for the sequence id when the log has
    sequences and 4 for the group with --by, grouped by step in input order. Up to
    MISMATCH_REPLAY_M2PO_MEMORY MiB (default 768: 33M tokens of a log with sequence ids)
    stay in memory; beyond that every step's values are appended to its own files in a
    spill directory in TMPDIR (disk: the same 24-28 bytes a token).

    A step of at most `chunk` tokens (a quarter of the budget at ~320 bytes a token: 2.5M
    tokens for 768 MiB) is loaded and resolved whole (`step()`: arrays); a larger one comes
    back as a `BigStep`, which `resolve_big` streams. Stores merge by appending (`absorb`:
    the other's tokens come after).

    The spill directory is named after the host and process: it is removed when the store
    is collected, at exit and on SIGTERM; one left by a killed process (SIGKILL) is removed
    by the next store that spills (`reclaim_spills`). A full TMPDIR is one sentence naming
    the directory and the fixes.
    """

    FIELDS = _M2PO_FIELDS

    def __init__(self, limit_bytes: int | None = None):
        if limit_bytes is None:
            limit_bytes = int(float(os.environ.get(M2PO_MEMORY_ENV, M2PO_MEMORY_MIB)) * 2**20)
        self.limit = limit_bytes
        self.parts: dict[int, list[tuple]] = {}
        self.nbytes = 0
        self.tokens = 0
        self.spilled_tokens = 0
        self._dir: _SpillDir | None = None
        self._lock = threading.Lock()
        self._on_disk: dict[int, int] = {}  # step -> tokens on disk
        self._absent: set[str] = set()  # columns never given (all zero): not stored
        self._slabs: dict[int, list[_Slab]] = {}  # step -> the slabs its parts view
        self._free: list[_Slab] = []  # released slabs, for the next batches
        self._pool_lock = threading.Lock()  # resolving threads release slabs

    @property
    def chunk(self) -> int:
        """Tokens of the largest step resolved in memory, and of a streamed chunk."""
        return max(1024, self.limit // _STREAM_BYTES_PER_TOKEN)

    def __len__(self) -> int:
        return self.tokens

    def lease(self, n: int, has_g: bool, has_seq: bool) -> _Slab:
        """A slab of at least n tokens for a batch whose columns the caller writes into
        `slab.arrays[i][:n]` (the fused kernel writes l^2 and |dp| there, the engine the
        sequence ids), then hands over with `add(..., slab=slab)`: a column that already
        lies in the slab is not copied."""
        absent = {k for k, v in (("g", has_g), ("seq", has_seq)) if not v}
        return self._lease(n, frozenset(absent))

    def add(self, step, x, mass, g=None, seq=None, slab: _Slab | None = None) -> None:
        """Append a batch's tokens (arrays of equal length, in input order); g / seq None:
        all zero (no grouping / no sequence ids), not stored. The values are copied into a
        slab of the store's own (a released one when one is free), grouped by step, so the
        caller may reuse its arrays at once; `slab`: a `lease`d slab, which the store keeps,
        columns already in it uncopied."""
        n = len(x)
        if n == 0:
            return
        if self.tokens == 0:
            self._absent = {k for k, v in (("g", g), ("seq", seq)) if v is None}
        cols = (x, mass, g, seq)
        step = np.asarray(step, dtype=np.int64)
        order = None
        if step[0] == step[-1] and (step == step[0]).all():
            bounds = [(int(step[0]), 0, n)]
        else:
            if not (step[1:] >= step[:-1]).all():  # unsorted: the slab holds them by step
                order = np.argsort(step, kind="stable")
                step = step[order]
            cut = np.flatnonzero(step[1:] != step[:-1]) + 1
            bounds = [
                (int(step[a]), int(a), int(b))
                for a, b in zip(np.r_[0, cut], np.r_[cut, n], strict=True)
            ]
        leased = slab is not None and slab.absent == frozenset(self._absent)
        if not leased:
            slab = self._lease(n)
        kept = []
        for col, into in zip(cols, slab.arrays, strict=True):
            if into is None:
                kept.append(None)
                continue
            into = into[:n]
            col = np.asarray(col)
            if leased and order is None and _address(col) == _address(into):
                pass  # written into the slab already (x, mass by the kernel; seq ids)
            elif order is None:
                np.copyto(into, col, casting="unsafe")  # the groups: int64 codes -> int32
            else:
                into[:] = col[order]
            kept.append(into)
            self.nbytes += into.nbytes
        for s, a, b in bounds:
            self.parts.setdefault(s, []).append(tuple(None if c is None else c[a:b] for c in kept))
            self._slabs.setdefault(s, []).append(slab)
            slab.holders += 1
        self.tokens += n
        if self.nbytes > self.limit:
            self.spill()

    def _lease(self, n: int, absent: frozenset | None = None) -> _Slab:
        """A slab of at least n tokens for the current fields (or those not `absent`): the
        smallest free one that fits, else a new one."""
        absent = frozenset(self._absent) if absent is None else absent
        with self._pool_lock:
            fit = [sl for sl in self._free if sl.size >= n and sl.absent == absent]
            if fit:
                slab = min(fit, key=lambda sl: sl.size)
                self._free.remove(slab)
                return slab
        return _Slab(max(n, 1), absent)

    def give_back(self, slabs: Iterable[_Slab]) -> None:
        """Parts that viewed these slabs are gone (spilled, or resolved after `pop`): a slab
        no part views any more goes back on the free list."""
        with self._pool_lock:
            for slab in slabs:
                slab.holders -= 1
                if slab.holders == 0 and len(self._free) < _FREE_SLABS:
                    self._free.append(slab)

    def _path(self, step: int, name: str) -> str:
        return os.path.join(self._dir.name, f"step{step}.{name}")

    def _spill_dir(self) -> str:
        with self._lock:  # resolving threads may ask at once (M2POTally.job_bins)
            if self._dir is None:
                try:
                    self._dir = _SpillDir()
                except OSError as exc:
                    where = tempfile.gettempdir()
                    raise _spill_error(exc, where, self.tokens, self.limit) from exc
            return self._dir.name

    def spill(self) -> None:
        """Append every in-memory part to its step's files and free the memory."""
        if not self.parts:
            return
        where = self._spill_dir()
        try:
            for s, parts in self.parts.items():
                for k, (name, _) in enumerate(self.FIELDS):
                    if name in self._absent:
                        continue
                    with open(self._path(s, name), "ab") as f:
                        for part in parts:
                            f.write(part[k].tobytes())
                n = sum(len(p[0]) for p in parts)
                self._on_disk[s] = self._on_disk.get(s, 0) + n
                self.spilled_tokens += n
        except OSError as exc:  # a full TMPDIR: one sentence (the files go with the store)
            raise _spill_error(exc, where, self.tokens, self.limit) from exc
        self.parts = {}
        self.nbytes = 0
        for slabs in self._slabs.values():
            self.give_back(slabs)
        self._slabs = {}

    def step_ids(self) -> list[int]:
        return sorted(set(self.parts) | set(self._on_disk))

    def step_tokens(self, s: int) -> int:
        return self._on_disk.get(s, 0) + sum(len(p[0]) for p in self.parts.get(s, []))

    def arrays(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(l^2, |dp|, group, sequence) of step s's tokens, in input order, whole."""
        out = []
        n = self.step_tokens(s)
        for k, (name, dt) in enumerate(self.FIELDS):
            if name in self._absent:
                out.append(np.zeros(n, np.int64))
                continue
            chunks = []
            if s in self._on_disk:
                chunks.append(np.fromfile(self._path(s, name), dtype=dt))
            chunks += [p[k] for p in self.parts.get(s, [])]
            a = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
            out.append(a.astype(np.int64) if name == "g" else a)
        return out[0], out[1], out[2], out[3]

    def step(self, s: int):
        """Step s for resolve_steps: its arrays (`arrays`), or a `BigStep` (which iterates
        as the same four arrays) when it has more than `chunk` tokens."""
        if self.step_tokens(s) > self.chunk:
            return BigStep(self, s, own=False)
        return self.arrays(s)

    def steps(self) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
        for s in self.step_ids():
            yield s, self.step(s)

    def pop(self, s: int) -> tuple[object, Lease]:
        """step(s), then forget the step: (its data, the Lease of what the data still views
        in the store, to release once the step is resolved). Its memory goes with it; its
        files too, or a BigStep's once it is resolved and closed."""
        n = self.step_tokens(s)
        big = n > self.chunk
        whole = not big and s not in self._on_disk and len(self.parts.get(s, ())) == 1
        out = BigStep(self, s, own=True) if big else self.arrays(s)
        for part in self.parts.pop(s, []):
            self.nbytes -= sum(c.nbytes for c in part if c is not None)
        lease = Lease(self, self._slabs.pop(s, []))
        if not (big or whole):  # the arrays are copies: nothing in the store is viewed
            lease.release()
        if self._on_disk.pop(s, None) is not None and not big:
            for name, _ in self.FIELDS:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path(s, name))
        self.tokens -= n
        return out, lease

    def absorb(self, other: M2POStore, gmap: np.ndarray, smap: np.ndarray | None) -> None:
        """Append another store's tokens, mapping its group and sequence ids."""
        if other.tokens == 0:
            return
        if self.tokens == 0:
            self._absent = set(other._absent)
        for s in other.step_ids():
            x, mass, g, seq = other.arrays(s)
            g2 = None if "g" in self._absent else gmap[g]
            seq2 = None if "seq" in self._absent else (smap[seq] if smap is not None else seq)
            self.add(np.full(x.shape[0], s, np.int64), x, mass, g2, seq2)

    def __getstate__(self):  # pickling (Ray): materialise, no temporary directory
        return {
            "limit": self.limit,
            "absent": set(self._absent),
            "steps": {s: self.arrays(s) for s in self.step_ids()},
        }

    def __setstate__(self, state):
        self.__init__(state["limit"])
        absent = set(state["absent"])
        for s, (x, mass, g, seq) in state["steps"].items():
            g2 = None if "g" in absent else g
            seq2 = None if "seq" in absent else seq
            self.add(np.full(x.shape[0], s, np.int64), x, mass, g2, seq2)


def _sorted_runs(big: BigStep, where: str) -> tuple[list[str], list[int]]:
    """Write the step's l^2 as sorted runs of at most big.chunk values (files in `where`)."""
    paths, sizes = [], []
    try:
        for (x,) in big.chunks(["x"]):
            fd, p = tempfile.mkstemp(prefix=f"step{big.step}.run", dir=where)
            with os.fdopen(fd, "wb") as f:
                np.sort(x).tofile(f)
            paths.append(p)
            sizes.append(x.shape[0])
    except OSError as exc:
        for p in paths:
            with contextlib.suppress(OSError):
                os.remove(p)
        raise _spill_error(exc, where, big.n, big.limit) from exc
    return paths, sizes


def _merged(paths: list[str], sizes: list[int], budget: int) -> Iterator[np.ndarray]:
    """The values of sorted runs in ascending order, in blocks; memory ~ budget values.
    Each round takes from every run's buffer the values <= the smallest buffer end of the
    runs not yet exhausted (no value still on disk can be below it), sorts them, yields."""
    r = len(paths)
    per = max(256, budget // max(r, 1))
    pos = [0] * r
    bufs: list[np.ndarray] = [np.zeros(0)] * r

    def refill(j: int) -> None:
        if bufs[j].shape[0] == 0 and pos[j] < sizes[j]:
            m = min(per, sizes[j] - pos[j])
            bufs[j] = np.fromfile(paths[j], dtype=np.float64, count=m, offset=pos[j] * 8)
            pos[j] += m

    for j in range(r):
        refill(j)
    while any(b.shape[0] for b in bufs):
        ends = [b[-1] for j, b in enumerate(bufs) if b.shape[0] and pos[j] < sizes[j]]
        cut = min(ends) if ends else math.inf
        take = []
        for j, b in enumerate(bufs):
            if b.shape[0]:
                m = int(np.searchsorted(b, cut, side="right"))
                take.append(b[:m])
                bufs[j] = b[m:]
                refill(j)
        block = np.concatenate(take)
        block.sort(kind="stable")
        yield block


# ----------------------------------------------------------------------------- resolving


def resolve_big(
    big: BigStep, jobs: dict[int, Job], inv_n: np.ndarray | None, out: dict, seq_bin: dict
) -> None:
    """m2po's bins for one large step, in memory bounded by big.chunk tokens: the same
    bins as fast.m2po_step_bins gives for the whole step (tested against it); `jobs` maps
    each m2po job's index to the job, `out` and `seq_bin` as in `resolve_steps`.

    Pass 1 streams the step's l^2 in ascending order (`_merged` over sorted runs on disk):
    the suffix sums accumulate from the smallest value up, one addition at a time in that
    order (np.cumsum with the carry in front: the kernel's loop, bit for bit); the mean at
    rank m (0 = largest) is its sum over the n - m values so far, binned against the sorted
    thresholds (>=: m2po is inclusive; +inf -> K + 1). Only the ranks where the bin changes
    are kept (about one per threshold): the boundary's value, whether it splits a run of
    equal values, and for such a value the number of larger ones. Pass 2 reads the tokens
    in input order in chunks: a token's bin is the level after the boundaries whose value
    is >= its own (a search over the boundaries); the tokens of a split run take their rank
    from their order among the equal values (the k-th in input order has rank #larger + k),
    as the kernel's m2po_ties does."""
    n = big.n
    paths, sizes = _sorted_runs(big, big.dir)
    try:
        for ji, b in out.items():
            thr = np.ascontiguousarray(jobs[ji].sorted_thresholds, dtype=np.float64)
            _resolve_big_job(big, inv_n, thr, b, seq_bin[ji], paths, sizes, n)
    finally:
        for p in paths:
            with contextlib.suppress(OSError):
                os.remove(p)


def _resolve_big_job(big, inv_n, thr, b, seq_bin, paths, sizes, n) -> None:
    k = thr.shape[0]
    acc = 0.0
    i0 = 0  # values consumed so far
    prev_v = prev_b = None
    b_rank: list[int] = []  # boundaries, found from the highest rank down
    b_val: list[float] = []
    b_level: list[int] = []  # the level at and above the boundary's rank
    tie_vals: set[float] = set()
    tie_last: dict[float, int] = {}  # value -> values <= it (its last position, 1-based)
    for block in _merged(paths, sizes, big.chunk):
        m = block.shape[0]
        c = np.cumsum(np.concatenate(([acc], block)))[1:]
        acc = float(c[-1])
        sc = c / np.arange(i0 + 1, i0 + m + 1, dtype=np.float64)
        if np.isnan(sc).any():
            raise AssertionError("internal error: m2po produced NaN scores")
        bins = np.searchsorted(thr, sc, side="right")
        bins[sc == math.inf] = k + 1
        if prev_b is not None:
            vals = np.concatenate(([prev_v], block))
            bb = np.concatenate(([prev_b], bins))
            base = i0  # element j of vals has i = base + j (j = 0: the previous block's last)
        else:
            vals, bb, base = block, bins, 1
        ch = np.flatnonzero(bb[:-1] != bb[1:])
        for j in ch:
            v, p = float(vals[j]), float(vals[j + 1])
            b_rank.append(n - (base + int(j)))
            b_val.append(v)
            b_level.append(int(bb[j]))
            if p == v:
                tie_vals.add(v)
        for v in tie_vals:
            if block[0] <= v:
                tie_last[v] = i0 + int(np.searchsorted(block, v, side="right"))
        prev_v, prev_b = float(block[-1]), int(bins[-1])
        i0 += m
    if i0 != n:  # pragma: no cover
        raise AssertionError("internal error: m2po's merge lost tokens")
    rank = np.array(b_rank[::-1], dtype=np.int64)  # ascending ranks
    bval = np.array(b_val[::-1], dtype=np.float64)  # non-increasing
    level = np.array([prev_b, *b_level[::-1]], dtype=np.int64)
    neg = -bval
    lo = {v: n - tie_last[v] for v in tie_vals}  # values larger than v
    ties = np.array(sorted(tie_vals), dtype=np.float64)
    seen = dict.fromkeys(tie_vals, 0)
    width = k + 2
    size = b.count.size
    inv_n = inv_n if b.seqfrac is not None else None
    for x, mass, g, seq in big.chunks(["x", "mass", "g", "seq"]):
        bi = level[np.searchsorted(neg, -x, side="right")]  # #(boundary values >= x)
        if ties.size:
            hit = np.flatnonzero(np.isin(x, ties))
            for v in np.unique(x[hit]) if hit.size else ():
                sel = hit[x[hit] == v]
                r = lo[float(v)] + seen[float(v)] + np.arange(sel.shape[0])
                seen[float(v)] += sel.shape[0]
                bi[sel] = level[np.searchsorted(rank, r, side="right")]
        idx = g.astype(np.int64) * width + bi
        b.count += np.bincount(idx, minlength=size).reshape(b.count.shape)
        b.mass += np.bincount(idx, weights=mass, minlength=size).reshape(b.mass.shape)
        if inv_n is not None:
            b.seqfrac += np.bincount(idx, weights=inv_n[seq], minlength=size).reshape(
                b.seqfrac.shape
            )
        np.maximum.at(seq_bin, seq, bi)


def _whole_step_only(rule) -> bool:
    """AReaL's keep-last (m2po@areal) and float32 replays bin a step only whole."""
    return bool(getattr(rule, "keep_last", False)) or rule.precision != "float64"


def resolve_steps(
    jobs: dict[int, Job],
    inv_n: np.ndarray | None,
    steps: Iterable,
    out: dict[int, JobBins],
    seq_bin: dict[int, np.ndarray],
    G: int,
    n_seq: int,
) -> None:
    """Add whole steps' m2po bins into out[ji] (bins of G groups) and seq_bin[ji] (each of
    n_seq sequences' highest bin) for every m2po job ji of `jobs`. A step is (l^2, |dp|,
    group, sequence) arrays, or a BigStep to stream; `inv_n`: 1 / loss tokens of each
    sequence (prime-rl's conventions) or None."""
    for item in steps:
        if isinstance(item, BigStep):  # more than a chunk: streamed, memory bounded
            whole = {ji: b for ji, b in out.items() if _whole_step_only(jobs[ji].rule)}
            plain = {ji: b for ji, b in out.items() if ji not in whole}
            try:
                if plain:
                    resolve_big(item, jobs, inv_n, plain, seq_bin)
                arrays = list(item) if whole else None
            finally:
                item.close()
            if whole:  # not bounded
                resolve_steps(jobs, inv_n, [tuple(arrays)], whole, seq_bin, G, n_seq)
            continue
        x, mass, g, seq = item
        inv = inv_n[seq] if inv_n is not None else None
        for ji, b in out.items():
            job = jobs[ji]
            fast.m2po_step_bins(
                x,
                g,
                mass,
                seq,
                inv,
                job.sorted_thresholds,
                G,
                n_seq,
                b.count,
                b.mass,
                b.seqfrac,
                seq_bin[ji],
                keep_last=job.rule.keep_last,
                precision=job.rule.precision,
            )


def m2po_scores(store: M2POStore) -> dict[str, np.ndarray]:
    """Per-token m2po scores: the mean l^2 of the step's tokens ranked at or below this one.

    Within a step, sort l^2 descending: x_1 >= ... >= x_n. The token of rank m (0-based) gets
    M_m = mean(x_{m+1..n}); M is non-increasing in m, so "mask the largest until the rest's
    mean is < tau" masks exactly the tokens with M_m >= tau. Ties are broken by input order.
    The running sums restart at each step (a step's scores never depend on another step).
    For inspection and tests: it holds every token; a replay bins step by step
    (`resolve_steps`).
    """
    out: dict[str, list[np.ndarray]] = {"score": [], "g": [], "mass": [], "seq": []}
    for _, (x, mass, g, seq) in store.steps():
        n = x.shape[0]
        order = np.argsort(-x, kind="stable")
        xs = x[order]
        suffix = np.cumsum(xs[::-1])[::-1]  # from the smallest up: no cancellation
        out["score"].append(suffix / (n - np.arange(n)))
        out["g"].append(g[order])
        out["mass"].append(mass[order])
        out["seq"].append(seq[order])
    z = np.zeros(0)
    kinds = {"score": z, "g": z.astype(np.int64), "mass": z, "seq": z.astype(np.int64)}
    return {k: np.concatenate(v) if v else kinds[k] for k, v in out.items()}


# ----------------------------------------------------------------------------- a Tally's part

_SEAL_POOL: ThreadPoolExecutor | None = None


def seal_pool() -> ThreadPoolExecutor:
    """One thread resolving m2po's steps apart from the kernel's threads (whose batches must
    not queue behind it): completed steps during the replay, the rest while readout.py
    builds the other jobs' columns."""
    global _SEAL_POOL
    if _SEAL_POOL is None:
        _SEAL_POOL = ThreadPoolExecutor(1, thread_name_prefix="mismatch-replay-m2po")
    return _SEAL_POOL


class M2POTally:
    """m2po's part of a Tally: the store of the steps still open, and the bins of the steps
    resolved during the replay (`seal`), per m2po job; `job_bins` adds the two up. A step
    resolved here is final: adding a Tally that holds tokens of it is refused (`absorb`)."""

    def __init__(self, jobs: Sequence[Job]):
        self.jobs = {ji: job for ji, job in enumerate(jobs) if job.rule.level == "step"}
        self.store = M2POStore()
        self.done: dict[int, JobBins] = {}  # per job: the bins of the sealed steps
        self.done_seq: dict[int, np.ndarray] = {}  # and each sequence's highest bin there
        self.sealed: set[int] = set()  # the steps resolved so far
        self._pending: Future | None = None
        self._cache: tuple[int, dict[int, JobBins]] | None = None  # (Tally version, bins)

    def add(self, step, x, mass, g=None, seq=None, slab=None) -> None:
        """A batch's m2po inputs (M2POStore.add: copied into the store's slabs, but for x
        and mass written into a `lease`d slab)."""
        self.store.add(step, x, mass, g, seq, slab)

    def lease(self, n: int, has_g: bool, has_seq: bool):
        """M2POStore.lease: where the fused kernel writes a batch's l^2 and |dp|."""
        return self.store.lease(n, has_g, has_seq)

    def _done_bins(self, ji: int, G: int, n_seq: int, seqfrac: bool) -> None:
        """done[ji] with G groups and done_seq[ji] with n_seq sequences (at least)."""
        b = self.done.get(ji)
        if b is None:
            b = self.done[ji] = new_bins(len(self.jobs[ji].values), G, False, seqfrac)
        b.grow(G)
        sb = self.done_seq.get(ji)
        if sb is None or sb.shape[0] < n_seq:
            new = np.full(max(n_seq, 1024, 2 * (0 if sb is None else sb.shape[0])), -1, np.int64)
            if sb is not None:
                new[: sb.shape[0]] = sb
            self.done_seq[ji] = new

    def seal(
        self, below: float, G: int, n_seq: int, inv_n: np.ndarray | None, background: bool
    ) -> int:
        """Resolve the steps below `below`, now that every token of them has been added
        (the caller knows: ingest's step bounds); their tokens leave the store. background:
        in `seal_pool`'s thread, alongside the next batches (`wait` joins it; the next call
        does too). Returns the number of steps taken."""
        self.wait()
        steps = [s for s in self.store.step_ids() if s < below]
        if not self.jobs or not steps:
            return 0
        for ji in self.jobs:
            self._done_bins(ji, G, n_seq, inv_n is not None)
        popped = [self.store.pop(s) for s in steps]
        out = {ji: self.done[ji] for ji in self.jobs}
        seq_bin = {ji: self.done_seq[ji] for ji in self.jobs}
        self.sealed.update(steps)

        def resolve() -> None:
            try:
                resolve_steps(self.jobs, inv_n, [d for d, _ in popped], out, seq_bin, G, n_seq)
            finally:  # the steps' slabs are free for the next batches
                for _, lease in popped:
                    lease.release()

        if background:
            self._pending = seal_pool().submit(resolve)
        else:
            resolve()
        return len(steps)

    def wait(self) -> None:
        """Join a background `seal` (its errors are raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def job_bins(
        self,
        version: int,
        G: int,
        n_seq: int,
        inv_n: np.ndarray | None,
        seq_group: np.ndarray | None,
        threads: int,
    ) -> dict[int, JobBins]:
        """Bins of every m2po job: the sealed steps' plus the store's, resolved step by step
        (memory: one step per thread), steps spread over `threads` threads; with
        `seq_group` (each sequence's --by group) also sequences per bin. Cached for the
        Tally's `version` (bumped by every change)."""
        if self._cache is not None and self._cache[0] == version:
            return self._cache[1]
        self.wait()
        matching = inv_n is not None
        todo = self.jobs
        store = self.store
        steps = store.step_ids()
        nt = max(1, min(threads, len(steps)))

        def work(part: list[int]):
            out = {ji: new_bins(len(job.values), G, False, matching) for ji, job in todo.items()}
            seq_bin = {ji: np.full(max(n_seq, 1), -1, np.int64) for ji in todo}
            resolve_steps(todo, inv_n, (store.step(s) for s in part), out, seq_bin, G, n_seq)
            return out, seq_bin

        if nt == 1:
            parts = [work(steps)]
        else:
            parts = list(fast.executor(nt).map(work, [steps[t::nt] for t in range(nt)]))
        out, seq_bin = parts[0]
        sealed = []  # steps resolved during the replay
        if any(ji in self.done for ji in todo):
            for ji in todo:
                self._done_bins(ji, G, n_seq, matching)
            sealed = [(self.done, self.done_seq)]
        for o, sb in [*parts[1:], *sealed]:
            for ji in todo:
                out[ji].count += o[ji].count[:G]
                out[ji].mass += o[ji].mass[:G]
                if matching:
                    out[ji].seqfrac += o[ji].seqfrac[:G]
                np.maximum(seq_bin[ji], sb[ji][: seq_bin[ji].shape[0]], out=seq_bin[ji])
        if seq_group is not None:
            for ji, job in todo.items():
                b = seq_bin[ji][:n_seq]
                out[ji].seq_count = seq_count(seq_group, b, len(job.values) + 2, G)
                out[ji].seq_bin = b
        self._cache = (version, out)
        return out

    def absorb(
        self, other: M2POTally, gmap, smap, G: int, n: int, has_seq: bool, seqfrac: bool
    ) -> None:
        """Add another Tally's m2po part: its groups map by gmap, its sequences by smap (of
        n sequences now; `seqfrac`: this Tally keeps 1/n sums). Refused where a step
        resolved on one side has tokens on the other."""
        self.wait()
        other.wait()
        clash = (self.sealed & (other.sealed | set(other.store.step_ids()))) | (
            other.sealed & set(self.store.step_ids())
        )
        if clash:  # m2po ranks a whole step: a step resolved on one side is final there
            raise ValueError(
                f"m2po step {min(clash)} is in both Tallies and was resolved in one of them "
                "during its replay: replay those files together instead of adding Tallies"
            )
        for ji, theirs in other.done.items():
            self._done_bins(ji, G, n, seqfrac)
            self.done[ji].absorb(theirs, gmap)
            sb = other.done_seq[ji][: smap.shape[0]]
            acc = self.done_seq[ji]
            acc[smap[: sb.shape[0]]] = np.maximum(acc[smap[: sb.shape[0]]], sb)
        self.sealed |= other.sealed
        self.store.absorb(other.store, gmap, smap if has_seq else None)
        self._cache = None

    def __getstate__(self):  # pickling (Ray): joined, without the cache
        self.wait()
        state = dict(self.__dict__)
        state["_pending"] = state["_cache"] = None
        return state
