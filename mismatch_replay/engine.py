"""The sweep engine: one streaming pass over token batches -> an additive `Tally`.

Design
------
A *job* is one rule with one swept parameter over a grid of K values (a single setting is a
grid of one). For a token rule the engine bins the rule's per-token score against the K sorted
thresholds and adds per-bin sums into arrays of shape (groups, K + 2): bin j holds the tokens
that exceed exactly j thresholds, and the last bin holds the tokens masked by a fixed side of
the rule (score +inf). The masked count at grid point k is the suffix sum over bins j > k:
exact at every grid point, whatever K.

Per bin it keeps the token count, the |dp| mass and, for weight rules, the sum, square sum and
max of the natural weight, from which the weight mean, max and effective sample size at every
cap follow exactly (a truncated token's weight is the cap itself).

Two paths fill the same bins (kernels.py): the *fused* one (numba) bins each token's four
coordinates (dp, l, a binary KL per clamp) once for every known token job, with the metrics,
the scatter and the sequence sums, in one loop over a batch split over the cores (~115 ns a
token on one core for the default sweep's 22 token jobs, vs ~3.5 us for the simple path); the
tokens it cannot settle (ties with a threshold) come back in `BatchOut.flagged` and take the
simple path here. The *simple* one is numpy, rule by rule (`rule.score()`,
`np.searchsorted`, `np.bincount`), the reference the fused path is tested against, and what
runs without numba. Batches are read ahead in a background thread (`_prefetch`), so Parquet
decoding overlaps the kernel. On 20M tokens and 2 cores the default sweep takes 2.8-3.0 s in
a warm process, 3.6-4.0 s in a fresh one (benchmarks/README.md).

Sequence rules need whole sequences, which may be spread over batches and files. The engine
therefore keeps per-sequence sums (`SeqStats`: token count, sum of l, sum of k3, max k2,
min l, ...) keyed by (step, sample_id) -- memory ~ 100 bytes per sequence, not per token -- and
scores sequences once at the end. For token rules it also keeps each sequence's highest bin,
so that every rule reports how many sequences it touches. `m2po` ranks each step's tokens: the
`M2POStore` keeps 24 bytes a token per step, in memory up to a cap (768 MiB) and on disk
beyond it, and tables.py resolves one step at a time, so memory stays bounded by the cap plus
the largest step; with `final=True` (sweep, the CLI) a step is resolved during the replay as
soon as the Parquet row-group statistics rule out more of its rows (`Tally.seal_m2po`).

Grouping (`by`): every token gets a group code `g` before the kernels run, so the fused and
the simple paths group identically. `step` and `env` are the token's column; `q_bucket` its
inference probability's bucket (Q_BUCKET_EDGES; a sequence then spans groups, tables.py);
`length` its sequence's bucket [2^k, 2^(k+1)) of loss tokens, labelled 2^k
(`length_bucket`, exact floor(log2 n)). A length is known only once the whole sequence is
read, so `by="length"` costs a pre-pass (`_count_sequences`, shared with match="prime-rl"):
one read of step and sample_id that numbers the sequences as the replay will and counts
their loss tokens (`Tally.seq_len`, 8 bytes a sequence); a token's code is then one lookup by
its sequence id (`_length_codes`). A sequence never spans length buckets, so every sequence
column stays defined. The local engine only: a Ray shard cannot know the length of a
sequence another shard holds (and adding Tallies that share a sequence is refused).

Prompt groups: with a `group_id` column (verl's `uid`, ...) the replay also keeps each
sequence's group (step, group_id) -- one dict lookup per run of a sequence, 8 bytes a
sequence (`seq["pgroup"]`), one dict entry a group -- from which tables.py counts, per rule
and value, the groups whose every sample is masked.

Every piece of a Tally is a sum, a max or a min, so `Tally + Tally` merges shards exactly:
the counts do not depend on how the log is split into files, batches or threads, and the Ray
engine (distributed.py) is the same Tally computed per file and added up (a step that m2po
resolved in one Tally cannot take tokens from another: adding them is refused).
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import polars as pl

from . import io, kernels, pmath
from ._recycle import Recycler
from .errors import DataError, UsageError
from .metrics import MetricSums
from .rules import (
    LOG_CLAMP,
    PRECISIONS,
    REGISTRY,
    Rule,
    SeqStats,
    TokenBatch,
    check_grid_size,
    parse_grid,
    parse_rule,
    round_to,
    spec_warnings,
)

GROUP_KEYS = ("step", "env", "q_bucket", "length")
# --by q_bucket: inference-probability buckets, labelled by their lower edge.
Q_BUCKET_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99)
# The scatter: fixed 2-D histograms of (q, p), additive like everything else in a Tally.
SCATTER_BINS = 200
SCATTER_LOG10_MIN = -8.0  # log panel spans 1e-8 .. 1; smaller probabilities go to the edge bin


def scatter_edges(log: bool) -> np.ndarray:
    """Bin edges of the scatter histograms (probability, or log10 probability)."""
    lo = SCATTER_LOG10_MIN if log else 0.0
    hi = 0.0 if log else 1.0
    return np.linspace(lo, hi, SCATTER_BINS + 1)


def _scatter_index(x: np.ndarray, log: bool) -> np.ndarray:
    lo = SCATTER_LOG10_MIN if log else 0.0
    width = ((0.0 if log else 1.0) - lo) / SCATTER_BINS
    hi = 0.0 if log else 1.0
    i = np.floor((np.clip(x, lo, hi) - lo) / width).astype(np.int64)  # no overflow warning
    return np.clip(i, 0, SCATTER_BINS - 1)


# ----------------------------------------------------------------------------- jobs


@dataclass(frozen=True)
class Job:
    """One rule swept over one parameter. `values` are in parameter space, ascending."""

    rule: Rule
    param: str
    values: np.ndarray
    report_param: str | None = None  # a non-threshold parameter expanded into single jobs
    report_value: float | None = None

    @property
    def thresholds(self) -> np.ndarray:
        """The values mapped into score space; a float32 replay rounds them to float32, as
        a framework's comparison of a float32 tensor with a Python float does."""
        t = np.array([self.rule.threshold(self.param, v) for v in self.values], dtype=float)
        return round_to(t, self.rule.precision)

    @property
    def order(self) -> np.ndarray:
        """Positions of the values in ascending threshold order."""
        return np.argsort(self.thresholds, kind="stable")

    @property
    def label(self) -> str:
        name = f"{self.rule.name}@{self.rule.preset}" if self.rule.preset else self.rule.name
        return f"{name}[{self.rule.setting(self.param)}]:{self.param}"


def _sweep_targets(sweeps: dict[str, np.ndarray], rule: Rule) -> dict[str, np.ndarray]:
    out = {}
    for key, grid in sweeps.items():
        name, _, param = key.rpartition(".")
        if (name == "" or name == rule.name) and param in rule.param_names():
            out[param] = grid
    return out


def parse_sweeps(items: Sequence[str]) -> dict[str, str]:
    """`--sweep PARAM=GRID` / `--sweep RULE.PARAM=GRID` items -> {key: GRID text}."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, grid = item.partition("=")
        if not sep or not key.strip() or not grid.strip():
            raise UsageError(
                f"--sweep {item}: use PARAM=GRID or RULE.PARAM=GRID, e.g. --sweep eps=0.05:0.5:46"
            )
        parse_grid(grid)  # fail early on a bad grid
        out[key.strip()] = grid.strip()
    return out


def plan_jobs(
    rules: Sequence[Rule | str] | None = None,
    sweeps: dict[str, str | np.ndarray] | None = None,
    columns: Sequence[str] = ("trainer_logprob", "inference_logprob"),
) -> tuple[list[Job], list[str]]:
    """Rules + sweeps -> jobs, and notes on what was skipped (data lacking a column).

    rules=None: every rule that the columns support, each threshold parameter swept over
    its default grid (rules=[]: no rule, metrics only). `sweeps` maps `param` or
    `rule.param` to a GRID (text or array).
    """
    for k, v in (sweeps or {}).items():
        if not isinstance(v, str):
            check_grid_size(v, f"{k} ({np.size(v):,} values)")
    grids = {
        k: (parse_grid(v) if isinstance(v, str) else np.unique(np.asarray(v, float)))
        for k, v in (sweeps or {}).items()
    }
    notes: list[str] = []
    explicit = rules is not None
    if explicit:
        chosen = [parse_rule(r) if isinstance(r, str) else r for r in rules]
    else:
        chosen = []
        for cls in REGISTRY.values():
            lacking = [c for c in cls.needs if c not in columns]
            if lacking:
                notes.append(f"{cls.name}: skipped, the log has no {' / '.join(lacking)} column")
                continue
            chosen.append(cls())
    used: set[str] = set()
    jobs: list[Job] = []
    for rule in chosen:
        lacking = [c for c in rule.needs if c not in columns]
        if lacking and explicit:
            raise DataError(
                f"rule '{rule.name}' needs the column(s) {', '.join(lacking)}, which the log "
                f"does not have (found: {', '.join(columns)}). Map one with --map "
                f"{lacking[0]}=COLUMN."
            )
        targets = _sweep_targets(grids, rule)
        for key in grids:
            name, _, param = key.rpartition(".")
            if (name in ("", rule.name)) and param in targets:
                used.add(key)
        if not targets and not explicit:
            targets = {p.name: parse_grid(p.grid) for p in rule.params if p.threshold}
        if not targets:
            jobs.append(_single(rule))
            continue
        for param, grid in targets.items():
            spec = rule.param(param)
            for v in grid:  # a grid point outside the domain: a usage error, not a row
                spec.check(rule.name, float(v), f"--sweep {rule.name}.{param}")
            if spec.threshold:
                others = [p.name for p in rule.params if p.threshold and p.name != param]
                rule.require(*others)
                jobs.append(Job(rule, param, grid))
            else:  # e.g. kpop's clamp: one single-setting job per value
                for v in grid:
                    j = _single(rule.replace(**{param: float(v)}))
                    jobs.append(Job(j.rule, j.param, j.values, param, float(v)))
    unused = [k for k in grids if k not in used]
    if unused:
        names = ", ".join(sorted({r.name for r in chosen}))
        raise UsageError(
            f"--sweep {unused[0]}: no selected rule has that parameter (rules: {names}). "
            "Use PARAM=GRID with a parameter of a selected rule, or RULE.PARAM=GRID."
        )
    return jobs, notes


def _single(rule: Rule) -> Job:
    """A rule at one setting: a one-value job on its first active threshold parameter."""
    names = [p.name for p in rule.params if p.threshold]
    rule.require(*names)
    active = [n for n in names if getattr(rule, n) not in (0, 0.0)]
    first = (active or names)[0]
    return Job(rule, first, np.array([float(getattr(rule, first))]))


# ----------------------------------------------------------------------------- helpers


def _bins(score: np.ndarray, thr_sorted: np.ndarray, inclusive: bool) -> np.ndarray:
    """Bin j = number of thresholds the score exceeds (>= when inclusive).

    A score of +inf marks a token masked by a fixed side of the rule: it goes to bin K + 1 and
    counts as masked at every value, even at a threshold of +inf (e.g. IcePop's low = 0).
    """
    return kernels.bin_scores(score, thr_sorted, inclusive)


class _Grow:
    """A 1-D float array that grows by doubling (per-sequence accumulators)."""

    def __init__(self, fill: float):
        self.fill = fill
        self.a = np.full(1024, fill)

    def ensure(self, n: int) -> None:
        if n > self.a.shape[0]:
            new = np.full(max(n, 2 * self.a.shape[0]), self.fill)
            new[: self.a.shape[0]] = self.a
            self.a = new


_SEQ_FIELDS = {  # name -> (fill, how partials combine)
    "n": (0.0, "sum"),
    "sum_l": (0.0, "sum"),
    "sum_k3": (0.0, "sum"),
    "max_k2": (-math.inf, "max"),
    "min_l": (math.inf, "min"),
    "sum_exp_abs_l": (0.0, "sum"),
    "sum_adv": (0.0, "sum"),
    "sum_lc": (0.0, "sum"),  # verl's k1 sums: clip(l, -20, 20)
    "sum_k3c": (0.0, "sum"),  # verl's k3 sums: l clamped to +-20
    "mass": (0.0, "sum"),
    "group": (-1.0, "first"),
    "pgroup": (-1.0, "first"),  # the prompt group (step, group_id) of the sample, a code
}


@dataclass
class _JobBins:
    """Per-bin sums of one job, shape (groups, K + 2)."""

    count: np.ndarray
    mass: np.ndarray
    wsum: np.ndarray | None = None
    wsq: np.ndarray | None = None
    wmax: np.ndarray | None = None
    seq_count: np.ndarray | None = None  # sequences per bin (sequence-level counts)
    seqfrac: np.ndarray | None = None  # sum of 1/n_i per bin (prime-rl's is_masked/mean)
    # each sequence's bin (sequence rules) or highest bin over its tokens (token rules, m2po),
    # by global sequence id: what the prompt-group counts read (tables.py); not additive
    seq_bin: np.ndarray | None = None

    def grow(self, groups: int) -> None:
        for name in ("count", "mass", "wsum", "wsq", "wmax", "seq_count", "seqfrac"):
            a = getattr(self, name)
            if a is not None and a.shape[0] < groups:
                fill = -math.inf if name == "wmax" else 0
                pad = np.full((groups - a.shape[0], a.shape[1]), fill, dtype=a.dtype)
                setattr(self, name, np.vstack([a, pad]))


_POISSON1_CDF = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(25)])


def poisson_weights(units: np.ndarray, replicates: int, seed: int) -> np.ndarray:
    """Poisson(1) bootstrap weights, shape (replicates, units), a pure function of the unit id.

    A counter-based hash (splitmix64 of unit id, replicate and seed) makes each unit's weight
    the same in every batch and file it appears in, so the bootstrap streams: the weighted
    counts of each replicate are accumulated batch by batch, with no second pass.
    """
    u = units.astype(np.uint64)[None, :]
    r = np.arange(replicates, dtype=np.uint64)[:, None]
    with np.errstate(over="ignore"):
        z = u * np.uint64(0x9E3779B97F4A7C15) + (r + np.uint64(seed) * np.uint64(1_000_003)) * (
            np.uint64(0xD1B54A32D192ED03)
        )
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    uni = (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return np.searchsorted(_POISSON1_CDF, uni, side="right").astype(np.float64)


# --robust: per-group histogram of log10 k3 (k3 = 0 goes to bin 0), for medians and trimmed
# means that a handful of extreme tokens cannot move; and each group's top tokens by k3.
K3_LOG10_MIN, K3_LOG10_MAX, K3_BINS = -20.0, 4.0, 2400  # 0.01-decade bins
TOP_TOKENS = 5


def _k3_bin(k3: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        x = np.log10(np.where(k3 > 0, k3, 1.0))  # k3 = 0 goes to bin 0 below
    i = np.floor((x - K3_LOG10_MIN) / (K3_LOG10_MAX - K3_LOG10_MIN) * K3_BINS).astype(np.int64)
    return np.where(k3 > 0, np.clip(i, 0, K3_BINS - 1) + 1, 0)


def _new_bins(k: int, groups: int, weight: bool, seqfrac: bool = False) -> _JobBins:
    z = np.zeros((groups, k + 2))
    return _JobBins(
        count=np.zeros((groups, k + 2), dtype=np.int64),
        mass=z.copy(),
        wsum=z.copy() if weight else None,
        wsq=z.copy() if weight else None,
        wmax=np.full((groups, k + 2), -math.inf) if weight else None,
        seqfrac=z.copy() if seqfrac else None,
    )


def _accumulate(
    bins: _JobBins,
    b: np.ndarray,
    g: np.ndarray,
    groups: int,
    mass,
    weight=None,
    count=None,
    inv_n=None,
) -> None:
    width = bins.count.shape[1]
    idx = g * width + b
    size = groups * width
    cnt = np.ones_like(b, dtype=float) if count is None else count
    bins.count += (
        np.bincount(idx, weights=cnt, minlength=size).reshape(groups, width).astype(np.int64)
    )
    bins.mass += np.bincount(idx, weights=mass, minlength=size).reshape(groups, width)
    if weight is not None:
        bins.wsum += np.bincount(idx, weights=weight * cnt, minlength=size).reshape(groups, width)
        bins.wsq += np.bincount(idx, weights=weight * weight * cnt, minlength=size).reshape(
            groups, width
        )
        flat = bins.wmax.reshape(-1)
        np.maximum.at(flat, idx, weight)
    if inv_n is not None and bins.seqfrac is not None:
        bins.seqfrac += np.bincount(idx, weights=inv_n, minlength=size).reshape(groups, width)


# ----------------------------------------------------------------------------- m2po store

M2PO_MEMORY_ENV = "MISMATCH_REPLAY_M2PO_MEMORY"  # MiB kept in memory before spilling to disk
M2PO_MEMORY_MIB = 768
M2PO_SPILL_PREFIX = "mismatch-replay-m2po-"
# bytes a token of a chunk costs the streamed resolve of a large step (its fields, bins, the
# searches' temporaries): a chunk is a quarter of the budget
_STREAM_BYTES_PER_TOKEN = 320
_M2PO_FIELDS = (("x", np.float64), ("mass", np.float64), ("g", np.int32), ("seq", np.int64))


def _spill_error(exc: BaseException, where: str, tokens: int, limit: int) -> Exception:
    """A full (or unwritable) TMPDIR while m2po spills: one sentence and the fixes."""
    from .output import output_error

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
    import re
    import shutil

    from .output import HOST_TAG, pid_alive

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
        import weakref

        from .output import HOST_TAG, SCRATCH_DIRS

        reclaim_spills()
        self.name = tempfile.mkdtemp(prefix=f"{M2PO_SPILL_PREFIX}{HOST_TAG}-{os.getpid()}-")
        SCRATCH_DIRS.add(self.name)
        self._finalizer = weakref.finalize(self, _SpillDir._remove, self.name)

    @staticmethod
    def _remove(name: str) -> None:
        import shutil

        from .output import SCRATCH_DIRS

        shutil.rmtree(name, ignore_errors=True)
        SCRATCH_DIRS.discard(name)

    def cleanup(self) -> None:
        self._finalizer()


class _BigStep:
    """A step too large to resolve in memory (more than `M2POStore.chunk` tokens): its tokens
    stay where the store keeps them (a prefix in the step's spill files, then in-memory
    parts) and `_resolve_big` reads them in chunks. Iterating it gives the whole arrays, as
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


class M2POStore:
    """m2po's input: l^2, |dp|, group and sequence of every loss token, kept per step.

    m2po ranks a whole step's tokens by l^2, so nothing short of the step's values decides a
    token's fate, and a step may be spread over any number of batches and files. The store
    keeps 16 bytes a token (float64 l^2 and |dp|), plus 8 for the sequence id when the log
    has sequences and 4 for the group with --by, grouped by step in input order (ties are
    broken by it). Up to MISMATCH_REPLAY_M2PO_MEMORY MiB (default 768: 33M tokens of a
    log with sequence ids) stay in memory; beyond that every step's values are appended to
    its own files in a spill directory in TMPDIR (disk: the same 24-28 bytes a token).

    Resolving a step: one of at most `chunk` tokens (a quarter of the budget at ~320 bytes
    a token: 2.5M tokens for 768 MiB) is loaded and resolved in memory (`step()`: arrays);
    a larger one (a log without a step column is one step) comes back as a `_BigStep` and
    `_resolve_big` streams it: an external sort of its l^2 (sorted runs of `chunk` values on
    disk, merged), the suffix means summed in the same order as the in-memory kernel (so
    the bins are the same), then one pass over its tokens in chunks. So memory is bounded by
    the budget plus a chunk per thread, whatever the size of the log or of a step.
    Tallies merge by appending (the other's tokens come after).

    A replay with final=True (sweep(), the CLI) empties it as it goes: once the Parquet
    row-group statistics of the step column say that no row still to come holds a step
    (io.step_bounds), the step is popped and resolved (Tally.seal_m2po, in a thread beside
    the replay), so a log sorted by step keeps only the steps in flight: 0.6 GiB peak at
    20M tokens instead of 1.0, 0.8 GiB at 200M instead of 1.45 and no spill to disk.

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

    @property
    def chunk(self) -> int:
        """Tokens of the largest step resolved in memory, and of a streamed chunk."""
        return max(1024, self.limit // _STREAM_BYTES_PER_TOKEN)

    def __len__(self) -> int:
        return self.tokens

    def add(self, step, x, mass, g=None, seq=None) -> None:
        """Append a batch's tokens (arrays of equal length, in input order); g / seq None:
        all zero (no grouping / no sequence ids), not stored."""
        n = len(x)
        if n == 0:
            return
        if self.tokens == 0:
            self._absent = {k for k, v in (("g", g), ("seq", seq)) if v is None}
        cols = (
            np.asarray(x, np.float64),
            np.asarray(mass, np.float64),
            None if "g" in self._absent else np.asarray(g).astype(np.int32),
            None if "seq" in self._absent else np.asarray(seq, dtype=np.int64),
        )
        step = np.asarray(step, dtype=np.int64)
        if step[0] == step[-1] and (step == step[0]).all():
            groups = [(int(step[0]), slice(None))]
        elif (step[1:] >= step[:-1]).all():  # sorted: slices, no copies
            cut = np.flatnonzero(step[1:] != step[:-1]) + 1
            bounds = zip(np.r_[0, cut], np.r_[cut, n], strict=True)
            groups = [(int(step[a]), slice(a, b)) for a, b in bounds]
        else:
            order = np.argsort(step, kind="stable")
            st = step[order]
            cut = np.flatnonzero(st[1:] != st[:-1]) + 1
            groups = [
                (int(st[a]), order[a:b]) for a, b in zip(np.r_[0, cut], np.r_[cut, n], strict=True)
            ]
        for s, idx in groups:
            self.parts.setdefault(s, []).append(tuple(None if c is None else c[idx] for c in cols))
        self.nbytes += sum(c.nbytes for c in cols if c is not None)
        self.tokens += n
        if self.nbytes > self.limit:
            self.spill()

    def _path(self, step: int, name: str) -> str:
        return os.path.join(self._dir.name, f"step{step}.{name}")

    def _spill_dir(self) -> str:
        with self._lock:  # resolving threads may ask at once (tables._m2po_bins)
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
        """Step s for m2po_resolve: its arrays (`arrays`), or a `_BigStep` (which iterates
        as the same four arrays) when it has more than `chunk` tokens."""
        if self.step_tokens(s) > self.chunk:
            return _BigStep(self, s, own=False)
        return self.arrays(s)

    def steps(self) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
        for s in self.step_ids():
            yield s, self.step(s)

    def pop(self, s: int):
        """step(s), then forget the step (its memory; its files, or a _BigStep's files go
        with it and are removed once it is resolved)."""
        n = self.step_tokens(s)
        big = n > self.chunk
        out = _BigStep(self, s, own=True) if big else self.arrays(s)
        for part in self.parts.pop(s, []):
            self.nbytes -= sum(c.nbytes for c in part if c is not None)
        if self._on_disk.pop(s, None) is not None and not big:
            for name, _ in self.FIELDS:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._path(s, name))
        self.tokens -= n
        return out

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


def _sorted_runs(big: _BigStep, where: str) -> tuple[list[str], list[int]]:
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


def _resolve_big(big: _BigStep, tally: Tally, out: dict, seq_bin: dict) -> None:
    """m2po's bins for one large step, in memory bounded by big.chunk tokens: the same
    bins as kernels.m2po_step_bins gives for the whole step (tested against it).

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
            job = tally.jobs[ji]
            thr = np.ascontiguousarray(job.thresholds[job.order], dtype=np.float64)
            _resolve_big_job(big, tally, thr, b, seq_bin[ji], paths, sizes, n)
    finally:
        for p in paths:
            with contextlib.suppress(OSError):
                os.remove(p)


def _resolve_big_job(big, tally, thr, b, seq_bin, paths, sizes, n) -> None:
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
    inv_n = tally.inv_n if b.seqfrac is not None else None
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


_M2PO_POOL: ThreadPoolExecutor | None = None


def _m2po_pool() -> ThreadPoolExecutor:
    """One thread resolving m2po's steps apart from the kernel's threads (whose batches must
    not queue behind it): completed steps during the replay, the rest while tables.py builds
    the other jobs' columns."""
    global _M2PO_POOL
    if _M2PO_POOL is None:
        _M2PO_POOL = ThreadPoolExecutor(1, thread_name_prefix="mismatch-replay-m2po")
    return _M2PO_POOL


def _m2po_special(rule) -> bool:
    return bool(getattr(rule, "keep_last", False)) or rule.precision != "float64"


def m2po_resolve(
    tally: Tally,
    steps: Iterable[tuple[np.ndarray, ...]],
    out: dict,
    seq_bin: dict,
    G: int,
    n_seq: int,
) -> None:
    """Add whole steps' m2po bins (steps: (l^2, |dp|, group, sequence) each, or a _BigStep
    to stream) into out[ji] (_JobBins of G groups) and seq_bin[ji] (each of n_seq
    sequences' highest bin) for every m2po job ji."""
    for item in steps:
        if isinstance(item, _BigStep):  # more than a chunk: streamed, memory bounded
            # AReaL's keep-last (m2po@areal) and float32 take the whole step (not bounded)
            special = {ji: b for ji, b in out.items() if _m2po_special(tally.jobs[ji].rule)}
            plain = {ji: b for ji, b in out.items() if ji not in special}
            try:
                if plain:
                    _resolve_big(item, tally, plain, seq_bin)
                whole = list(item) if special else None
            finally:
                item.close()
            if special:
                m2po_resolve(tally, [tuple(whole)], special, seq_bin, G, n_seq)
            continue
        x, mass, g, seq = item
        inv = tally.inv_n[seq] if tally.inv_n is not None else None
        for ji, b in out.items():
            job = tally.jobs[ji]
            kernels.m2po_step_bins(
                x,
                g,
                mass,
                seq,
                inv,
                job.thresholds[job.order],
                G,
                n_seq,
                b.count,
                b.mass,
                b.seqfrac,
                seq_bin[ji],
                keep_last=job.rule.keep_last,
                precision=job.rule.precision,
            )


# ----------------------------------------------------------------------------- tally


@dataclass
class Tally:
    """Additive summary of one pass over a log: enough to answer every sweep question."""

    jobs: list[Job]
    by: str | None = None
    has_seq: bool = False
    has_adv: bool = False
    groups: list = field(default_factory=list)
    bins: list[_JobBins | None] = field(default_factory=list)
    metrics: MetricSums = field(default_factory=MetricSums)
    seq_keys: dict = field(default_factory=dict)
    seq: dict[str, _Grow] = field(default_factory=dict)
    seq_max: dict[int, _Grow] = field(default_factory=dict)
    m2po: M2POStore = field(default_factory=M2POStore)
    # m2po's steps resolved during the replay (seal_m2po): per job, their bins and each
    # sequence's highest bin; the store keeps the steps not known to be complete yet
    m2po_done: dict[int, _JobBins] = field(default_factory=dict)
    m2po_done_seq: dict[int, np.ndarray] = field(default_factory=dict)
    m2po_sealed: set = field(default_factory=set)  # the steps resolved so far
    # scatter histograms, [q bin, p bin]: linear probability axes and log10 axes
    hist_lin: np.ndarray = field(
        default_factory=lambda: np.zeros((SCATTER_BINS, SCATTER_BINS), np.int64)
    )
    hist_log: np.ndarray = field(
        default_factory=lambda: np.zeros((SCATTER_BINS, SCATTER_BINS), np.int64)
    )
    report: io.ReadReport = field(default_factory=io.ReadReport)
    notes: list[str] = field(default_factory=list)
    # prime-rl conventions (match="prime-rl"): 1 / loss tokens of each sequence, by sequence id
    inv_n: np.ndarray | None = None
    # --by length: loss tokens of each sequence, by sequence id, counted by replay's pre-pass
    seq_len: np.ndarray | None = None
    # prompt groups (the log has a group_id): (step, group_id) -> code; each sequence's code
    # is seq["pgroup"]. A sample with a null group_id is a group of its own.
    has_pgroup: bool = False
    pgroup_keys: dict = field(default_factory=dict)
    rule_warnings: list[str] = field(default_factory=list)
    # streaming Poisson bootstrap over units ("sequence" or "step"), see poisson_weights
    boot_replicates: int = 0
    boot_unit: str | None = None
    boot_seed: int = 0
    boot_counts: dict[int, np.ndarray] = field(default_factory=dict)  # (B, K + 2) per job
    boot_tokens: np.ndarray | None = None  # (B,) weighted loss tokens
    robust: bool = False
    k3_hist: np.ndarray | None = None  # (G, K3_BINS + 1) token counts
    k3_hist_sum: np.ndarray | None = None  # (G, K3_BINS + 1) sum of k3 per bin
    top: dict = field(default_factory=dict)  # group index -> {"k3", "step", "sample_id", ...}
    # the arithmetic of the rule decisions ("float32": as the frameworks run them on the
    # GPU; the simple path, see replay()); metrics and the scatter stay float64
    precision: str = "float64"

    def __post_init__(self):
        if not self.bins:
            self.bins = [
                None
                if j.rule.level != "token"
                else _new_bins(len(j.values), 0, j.rule.kind == "weight", self.inv_n is not None)
                for j in self.jobs
            ]
        if not self.seq:
            self.seq = {k: _Grow(f) for k, (f, _) in _SEQ_FIELDS.items()}
        self._gidx = {v: i for i, v in enumerate(self.groups)}
        self._fused: kernels.Fused | None = None  # the fused path's accumulators
        self._fused_off = False  # numpy backend or bootstrap: the simple path only
        self._scratch: dict[str, np.ndarray] = {}
        self._bufs = Recycler()  # arrays m2po's store keeps a while (sequence ids)
        self.version = 0  # bumped by every change (tables caches m2po bins on it)
        # verl's sequence presets read sums of l clamped to +-20 (SeqStats.sum_lc, sum_k3c):
        # kept only when a job needs them (the fused kernel does not compute them)
        if any(j.rule.precision == "float32" for j in self.jobs):
            self.precision = "float32"
        self.clamped_seq = any(
            j.rule.level == "sequence" and j.rule.arith in ("verl", "verl-k1") for j in self.jobs
        )

    # -- groups and sequences
    def _group_codes(self, df: pl.DataFrame, seq=None) -> np.ndarray:
        if self.by == "length":
            return self._length_codes(seq[0])
        if self.by is None:
            if not self.groups:
                self.groups.append(None)
                self._gidx[None] = 0
            z = self._scratch.get("zeros")  # one read-only array of zeros: a fresh one per
            if z is None or z.shape[0] < df.height:  # batch cost a page fault per 512 tokens
                z = self._scratch["zeros"] = np.zeros(max(df.height, 1), dtype=np.int64)
                z.flags.writeable = False
            return z[: df.height]
        if self.by == "q_bucket":
            q = pmath.exp(df["inference_logprob"].to_numpy())
            col = pl.Series("q_bucket", np.asarray(Q_BUCKET_EDGES)[_bucket(q)])
            df = pl.DataFrame([col])
        else:
            col = df[self.by]
        u = col.unique(maintain_order=True).to_list()
        for v in u:
            if v not in self._gidx:
                self._gidx[v] = len(self.groups)
                self.groups.append(v)
        lut = pl.DataFrame(
            {self.by: pl.Series(u, dtype=col.dtype), "_g": [self._gidx[v] for v in u]}
        )
        return (
            df.select(self.by)
            .join(lut, on=self.by, how="left", maintain_order="left")["_g"]
            .to_numpy()
            .astype(np.int64)
        )

    def _length_codes(self, gid: np.ndarray) -> np.ndarray:
        """--by length: each token's group is its sequence's length bucket (from the
        pre-pass's counts, `seq_len`); the buckets are registered once, in ascending order."""
        codes = self._scratch.get("len_codes")
        if codes is None:
            if self.seq_len is None:
                raise UsageError(
                    "--by length needs each sequence's loss tokens up front: run it through "
                    "replay(), which counts them in a first pass."
                )
            b = length_bucket(self.seq_len)
            present = np.unique(b)
            lut = np.full(int(present.max(initial=0)) + 1, -1, dtype=np.int64)
            for v in present.tolist():
                label = 1 << v
                if label not in self._gidx:
                    self._gidx[label] = len(self.groups)
                    self.groups.append(label)
                lut[v] = self._gidx[label]
            codes = self._scratch["len_codes"] = lut[b]
        if gid.shape[0] and gid.max() >= codes.shape[0]:
            raise AssertionError("internal error: a sequence the length pre-pass did not see")
        return codes[gid]

    def _add_pgroups(self, df: pl.DataFrame) -> None:
        """Each new sequence's prompt group, (step, group_id), from the batch's runs (one
        dict lookup per run); a sequence keeps the group of its first run."""
        starts, gid_of_run = self._runs
        idx = pl.Series(np.asarray(starts, dtype=np.int64))
        steps = df["step"].gather(idx).to_list()
        gids = df["group_id"].gather(idx).to_list()
        keys = self.pgroup_keys
        codes = np.empty(len(steps), dtype=np.float64)
        sids = None
        for i, (s, g) in enumerate(zip(steps, gids, strict=True)):
            if g is None:  # no group id: a group of its own
                if sids is None:
                    sids = df["sample_id"].gather(idx).to_list()
                key = (s, None, sids[i])
            else:
                key = (s, g)
            c = keys.get(key)
            if c is None:
                c = keys[key] = len(keys)
            codes[i] = c
        acc = self.seq["pgroup"]
        acc.ensure(len(self.seq_keys))
        rev = gid_of_run[::-1]  # reversed: among repeats, the first run's write lands last
        cur = acc.a[rev]
        acc.a[rev] = np.where(cur < 0, codes[::-1], cur)

    def _seq_codes(self, df: pl.DataFrame) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Per-token global sequence ids, and (the batch's distinct global ids, each token's
        index into them). A sequence is a run of equal (step, sample_id); runs are looked up
        once each, so a batch of 1M tokens in 512-token sequences costs 2k dict lookups."""
        step = df["step"]
        sid = df["sample_id"]
        run = None
        if sid.dtype.is_integer() and step.dtype.is_integer():
            st = step.to_numpy()
            sd = sid.to_numpy()
            j = kernels.jit()
            if j is not None:  # one pass: each token's run and the runs' starts
                run = self._buffer("run", st.shape[0])
                starts = j.seq_runs(
                    np.ascontiguousarray(st, np.int64), np.ascontiguousarray(sd, np.int64), run
                )
            else:
                flags = np.empty(st.shape[0], dtype=bool)
                flags[:1] = True
                np.not_equal(st[1:], st[:-1], out=flags[1:])
                flags[1:] |= sd[1:] != sd[:-1]
                starts = np.flatnonzero(flags)
            steps, sids = st[starts].tolist(), sd[starts].tolist()
        else:
            new_run = (
                (pl.col("step") != pl.col("step").shift(1))
                | (pl.col("sample_id") != pl.col("sample_id").shift(1))
            ).fill_null(True)
            flags = df.select(new_run.alias("r"))["r"].to_numpy()
            starts = np.flatnonzero(flags)
            steps = step.gather(starts).to_list()
            sids = sid.gather(starts).to_list()
        gid_of_run = np.empty(starts.shape[0], dtype=np.int64)
        seq_keys = self.seq_keys
        for i, key in enumerate(zip(steps, sids, strict=True)):
            gid = seq_keys.get(key)
            if gid is None:
                gid = len(seq_keys)
                seq_keys[key] = gid
            gid_of_run[i] = gid
        self._runs = (starts, gid_of_run)  # the batch's runs (prompt groups read them)
        k = gid_of_run.shape[0]
        in_order = run is not None and k and gid_of_run[-1] - gid_of_run[0] == k - 1
        if in_order and (k == 1 or (np.diff(gid_of_run) == 1).all()):
            # every run a new sequence, numbered in order (a log sorted by step and
            # sequence): a token's batch-local id is its run, its global id an offset
            gid = self._bufs.empty("gid", run.shape[0], np.int64)
            np.add(run, gid_of_run[0], out=gid)
            return gid, (gid_of_run, run)
        uniq, inv = np.unique(gid_of_run, return_inverse=True)
        if run is None:
            run = np.zeros(df.height, dtype=np.int64)  # each token's run: a cumulative sum
            run[starts[1:]] = 1  # of run starts (np.repeat is slower with per-run counts)
            np.cumsum(run, out=run)
            return gid_of_run[run], (uniq, inv.reshape(-1)[run])
        # m2po's store keeps views of gid until the step is resolved: reused after that
        gid = self._bufs.empty("gid", run.shape[0], np.int64)
        local = self._buffer("local", run.shape[0])
        kernels.jit().take_runs(run, gid_of_run, inv.reshape(-1).astype(np.int64), gid, local)
        return gid, (uniq, local)

    def _buffer(self, name: str, n: int) -> np.ndarray:
        """A scratch int64 array of n, reused batch after batch: fresh 8 MB arrays cost page
        faults, which are slow while the reader's threads allocate too."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[name] = np.empty(max(n, 1), dtype=np.int64)
        return buf[:n]

    # -- one batch
    def _fused_state(self) -> kernels.Fused | None:
        """The fused path's state, or None where the simple path runs everything."""
        if self._fused is not None:
            return self._fused
        if (
            self._fused_off
            or self.boot_replicates
            or self.precision != "float64"
            or kernels.backend() != "numba"
        ):
            self._fused_off = True
            return None
        try:
            program = kernels.Program(self.jobs)
        except kernels.TooManyCoordinates as exc:  # rare: the simple path, same counts
            self.notes.append(f"fast path off ({exc}); the numpy path runs every rule")
            self._fused_off = True
            return None
        self._fused = kernels.Fused(program, seqfrac=self.inv_n is not None)
        return self._fused

    def add_batch(self, df: pl.DataFrame) -> None:
        lp = df["trainer_logprob"].to_numpy()
        lq = df["inference_logprob"].to_numpy()
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        seq = self._seq_codes(df) if self.has_seq else None
        if self.has_pgroup and seq is not None:
            self._add_pgroups(df)
        g = self._group_codes(df, seq)
        G = len(self.groups)
        ent = df["entropy"].to_numpy() if "entropy" in df.columns else None
        self.version += 1
        fused = self._fused_state()
        if fused is None:
            self._add_batch_numpy(df, TokenBatch(lp, lq, adv), g, G, ent, seq)
            return
        has_m2po = any(j.rule.level == "step" for j in self.jobs)
        inv_tok = self.inv_n[seq[0]] if self.inv_n is not None else None
        lin_w = 1.0 / SCATTER_BINS
        log_w = (0.0 - SCATTER_LOG10_MIN) / SCATTER_BINS
        out = fused.run(
            lp,
            lq,
            adv,
            g,
            G,
            seq[1][1] if seq is not None else None,
            seq[1][0].shape[0] if seq is not None else 0,
            inv_tok,
            ent,
            m2po=has_m2po,
            scatter_consts=(0.0, lin_w, SCATTER_LOG10_MIN, log_w, SCATTER_BINS),
            log_clamp=LOG_CLAMP,
        )
        self.metrics.add_sums(out.msum, out.mmax, G)
        self.hist_lin += out.hist_lin.reshape(SCATTER_BINS, SCATTER_BINS)
        self.hist_log += out.hist_log.reshape(SCATTER_BINS, SCATTER_BINS)
        if seq is not None:
            parts = {
                "n": out.seq_sum[:, 0],
                "sum_l": out.seq_sum[:, 1],
                "sum_k3": out.seq_sum[:, 2],
                "sum_exp_abs_l": out.seq_sum[:, 3],
                "mass": out.seq_sum[:, 4],
                "max_k2": out.seq_max_k2,
                "min_l": out.seq_min_l,
                "group": out.seq_first.astype(np.float64),
            }
            if adv is not None:
                parts["sum_adv"] = out.seq_sum[:, 5]
            if self.clamped_seq:
                parts |= self._clamped_parts(TokenBatch(lp, lq), seq[1][1], seq[1][0].shape[0])
            self._merge_seq(parts, seq[1][0])
        tb = None
        for ji, job in enumerate(self.jobs):
            level = job.rule.level
            if level == "sequence":
                continue
            if level == "step":
                if out.m2po_x is not None:
                    self.m2po.add(
                        df["step"].to_numpy(),
                        out.m2po_x,
                        out.m2po_mass,
                        g if self.by is not None else None,
                        seq[0] if seq is not None else None,
                    )
                    out.m2po_x = None  # once per batch, whatever the number of m2po jobs
                continue
            slot = fused.p.slot[ji]
            if slot < 0:  # a rule the kernel does not know: the simple path
                tb = tb if tb is not None else TokenBatch(lp, lq, adv)
                self._add_job_numpy(ji, job, tb, g, G, seq, None)
            elif seq is not None:
                uniq = seq[1][0]
                acc = self.seq_max.setdefault(ji, _Grow(-1.0))
                acc.ensure(len(self.seq_keys))
                acc.a[uniq] = np.maximum(acc.a[uniq], out.smax[:, slot])
        for c, idx in out.flagged:  # tokens inside a coordinate's window: the simple path
            sub = TokenBatch(lp[idx], lq[idx], adv[idx] if adv is not None else None)
            sseq = None if seq is None else (seq[0][idx], (seq[1][0], seq[1][1][idx]))
            for ji in fused.p.coord_jobs[c]:
                self._add_job_numpy(ji, self.jobs[ji], sub, g[idx], G, sseq, None)
        if self.robust:
            tb = tb if tb is not None else TokenBatch(lp, lq, adv)
            self._add_robust(df, tb, g, G)

    def _add_batch_numpy(self, df, tb: TokenBatch, g, G: int, ent, seq) -> None:
        """The simple path: numpy, rule by rule (the reference for the fused path)."""
        self.metrics.add(tb, g, G, ent)
        self._add_scatter(tb)
        if seq is not None:
            self._add_seq(tb, g, seq)
        boot = self._boot_units(df, seq) if self.boot_replicates else None
        if self.robust:
            self._add_robust(df, tb, g, G)
        m2po_done = False
        for ji, job in enumerate(self.jobs):
            rule = job.rule
            if rule.level == "sequence":
                continue
            if rule.level == "step":
                if not m2po_done:
                    ts = tb.at(self.precision)  # l^2 in the replay's arithmetic
                    with np.errstate(over="ignore"):  # inf for absurd l: masked first
                        x2 = ts.l * ts.l
                    self.m2po.add(
                        df["step"].to_numpy(),
                        x2,
                        tb.abs_dp,
                        g if self.by is not None else None,
                        seq[0] if seq is not None else None,
                    )
                    m2po_done = True
                continue
            self._add_job_numpy(ji, job, tb, g, G, seq, boot)

    def _add_job_numpy(self, ji: int, job: Job, tb: TokenBatch, g, G: int, seq, boot) -> None:
        rule = job.rule
        bins = self.bins[ji]
        bins.grow(G)
        score = np.asarray(rule.score(tb, job.param), dtype=np.float64)
        thr = job.thresholds[job.order]
        if np.isnan(score).any():
            raise AssertionError("internal error: a rule produced NaN scores")
        b = np.searchsorted(thr, score, side="right" if rule.inclusive else "left")
        b[score == math.inf] = thr.shape[0] + 1
        w = rule.weight(tb, job.param) if rule.kind == "weight" else None
        inv_n = self.inv_n[seq[0]] if self.inv_n is not None else None
        _accumulate(bins, b, g, G, tb.abs_dp, w, inv_n=inv_n)
        if boot is not None:
            uniq, local, wts = boot
            width = len(job.values) + 2
            c = np.bincount(local * width + b, minlength=uniq.shape[0] * width)
            acc = self.boot_counts.setdefault(ji, np.zeros((self.boot_replicates, width)))
            acc += wts @ c.reshape(uniq.shape[0], width)
        if seq is not None:
            uniq, local = seq[1]
            part = np.full(uniq.shape[0], -1.0)
            np.maximum.at(part, local, b)
            acc = self.seq_max.setdefault(ji, _Grow(-1.0))
            acc.ensure(len(self.seq_keys))
            acc.a[uniq] = np.maximum(acc.a[uniq], part)

    def flush(self) -> None:
        """Move the fused path's per-thread accumulators into `bins` (idempotent)."""
        f = self._fused
        if f is None or not f.dirty:
            return
        G = len(self.groups)
        taken = f.take(G)
        for ji, slot in enumerate(f.p.slot):
            if slot < 0 or self.jobs[ji].rule.level != "token":
                continue
            bins = self.bins[ji]
            bins.grow(G)
            v = f.job_view(taken, slot)
            bins.count += v["count"]
            bins.mass += v["mass"]
            if bins.seqfrac is not None and "seqfrac" in v:
                bins.seqfrac += v["seqfrac"]
            if bins.wsum is not None and "wsum" in v:
                bins.wsum += v["wsum"]
                bins.wsq += v["wsq"]
                np.maximum(bins.wmax, v["wmax"], out=bins.wmax)

    def __getstate__(self):
        self.flush()
        self.wait_m2po()
        state = dict(self.__dict__)
        state["_fused"] = None
        state["_scratch"] = {}  # per-batch buffers: nothing to ship
        return state

    def _add_robust(self, df: pl.DataFrame, tb: TokenBatch, g: np.ndarray, G: int) -> None:
        width = K3_BINS + 1
        for name in ("k3_hist", "k3_hist_sum"):
            a = getattr(self, name)
            if a is None:
                a = np.zeros((0, width))
            if a.shape[0] < G:
                a = np.vstack([a, np.zeros((G - a.shape[0], width))])
            setattr(self, name, a)
        k3 = np.clip(tb.l, -LOG_CLAMP, LOG_CLAMP)
        k3 = pmath.expm1(k3) - k3
        idx = g * width + _k3_bin(k3)
        self.k3_hist += np.bincount(idx, minlength=G * width).reshape(G, width)
        self.k3_hist_sum += np.bincount(idx, weights=k3, minlength=G * width).reshape(G, width)
        extra = {c: df[c].to_numpy() for c in ("step", "sample_id", "position") if c in df.columns}
        order = np.lexsort((-k3, g))  # by group, k3 descending
        gs = g[order]
        starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
        for st in starts:
            gi = int(gs[st])
            sel = order[st : st + TOP_TOKENS]
            sel = sel[g[sel] == gi]
            new = {"k3": k3[sel], "p": tb.p[sel], "q": tb.q[sel]} | {
                c: v[sel] for c, v in extra.items()
            }
            old = self.top.get(gi)
            if old is not None:
                new = {c: np.concatenate([old[c], new[c]]) for c in new}
            keep = np.argsort(-new["k3"], kind="stable")[:TOP_TOKENS]
            self.top[gi] = {c: v[keep] for c, v in new.items()}

    def _boot_units(self, df: pl.DataFrame, seq):
        """(distinct units, per-token unit index, (B, units) Poisson weights) of a batch."""
        ids = seq[0] if self.boot_unit == "sequence" else df["step"].to_numpy()
        uniq, local = np.unique(ids, return_inverse=True)
        wts = poisson_weights(uniq, self.boot_replicates, self.boot_seed)
        tokens = wts @ np.bincount(local, minlength=uniq.shape[0]).astype(float)
        self.boot_tokens = tokens if self.boot_tokens is None else self.boot_tokens + tokens
        return uniq, local, wts

    def seq_unit_weights(self) -> np.ndarray:
        """(B, sequences) bootstrap weights of each sequence (by its own id or its step)."""
        n = len(self.seq_keys)
        if self.boot_unit == "sequence":
            ids = np.arange(n)
        else:
            ids = np.empty(n, dtype=np.int64)
            for (step, _), i in self.seq_keys.items():
                ids[i] = step
        return poisson_weights(ids, self.boot_replicates, self.boot_seed)

    def _add_scatter(self, tb: TokenBatch) -> None:
        n = SCATTER_BINS
        for hist, x, y, log in (
            (self.hist_lin, tb.q, tb.p, False),
            (self.hist_log, tb.lq / math.log(10), tb.lp / math.log(10), True),
        ):
            idx = _scatter_index(x, log) * n + _scatter_index(y, log)
            hist += np.bincount(idx, minlength=n * n).reshape(n, n)

    def _clamped_parts(self, tb: TokenBatch, local: np.ndarray, m: int) -> dict:
        """Per-sequence sums of clip(l, -20, 20) and of verl's k3 on it (verl's presets)."""
        ts = tb.at(self.precision)
        return {
            "sum_lc": np.bincount(local, weights=ts.lc, minlength=m),
            "sum_k3c": np.bincount(local, weights=ts.k3_verl, minlength=m),
        }

    def _add_seq(self, tb: TokenBatch, g: np.ndarray, seq) -> None:
        uniq, local = seq[1]
        m = uniq.shape[0]
        ts = tb.at(self.precision)  # the per-token values in the replay's arithmetic
        parts = {
            "n": np.bincount(local, minlength=m).astype(float),
            "sum_l": np.bincount(local, weights=ts.l, minlength=m),
            "sum_k3": np.bincount(local, weights=ts.k3, minlength=m),
            "sum_exp_abs_l": np.bincount(local, weights=ts.X.exp(np.abs(ts.l)), minlength=m),
            "mass": np.bincount(local, weights=tb.abs_dp, minlength=m),
        }
        if self.clamped_seq:
            parts |= self._clamped_parts(tb, local, m)
        if tb.advantage is not None:
            parts["sum_adv"] = np.bincount(local, weights=tb.advantage, minlength=m)
        mx = np.full(m, -math.inf)
        np.maximum.at(mx, local, _f64(ts.k2))
        mn = np.full(m, math.inf)
        np.minimum.at(mn, local, _f64(ts.l))
        parts["max_k2"], parts["min_l"] = mx, mn
        first = np.full(m, -1.0)
        first[local[::-1]] = g[::-1]  # first token's group wins
        parts["group"] = first
        self._merge_seq(parts, uniq)

    def _merge_seq(self, parts: dict[str, np.ndarray], uniq: np.ndarray) -> None:
        """Combine a batch's per-sequence partials (indexed like uniq) into the totals."""
        n_total = len(self.seq_keys)
        for name, (_fill, how) in _SEQ_FIELDS.items():
            if name not in parts:
                continue
            acc = self.seq[name]
            acc.ensure(n_total)
            cur = acc.a[uniq]
            if how == "sum":
                acc.a[uniq] = cur + parts[name]
            elif how == "max":
                acc.a[uniq] = np.maximum(cur, parts[name])
            elif how == "min":
                acc.a[uniq] = np.minimum(cur, parts[name])
            else:
                acc.a[uniq] = np.where(cur < 0, parts[name], cur)

    # -- merging
    def __add__(self, other: Tally) -> Tally:
        if [j.label for j in self.jobs] != [j.label for j in other.jobs] or self.by != other.by:
            raise ValueError("can only add Tallies of the same jobs and grouping")
        if self.robust or other.robust:
            raise ValueError("robust Tallies (per-group top tokens) cannot be added yet")
        if self.boot_replicates or other.boot_replicates:
            raise ValueError("bootstrap Tallies number units per run and cannot be added")
        out = Tally(self.jobs, self.by, self.has_seq, self.has_adv)
        out.has_pgroup = self.has_pgroup and other.has_pgroup
        out._absorb(self)
        out._absorb(other)
        return out

    def _absorb(self, t: Tally) -> None:
        self.flush()
        t.flush()
        self.wait_m2po()
        t.wait_m2po()
        self.version += 1
        gmap = []
        for v in t.groups:
            if v not in self._gidx:
                self._gidx[v] = len(self.groups)
                self.groups.append(v)
            gmap.append(self._gidx[v])
        gmap = np.asarray(gmap, dtype=np.int64)
        G = len(self.groups)
        for mine, theirs in zip(self.bins, t.bins, strict=True):
            if mine is None:
                continue
            mine.grow(G)
            for name in ("count", "mass", "wsum", "wsq", "seqfrac"):
                a = getattr(theirs, name)
                if a is not None and a.shape[0]:
                    np.add.at(getattr(mine, name), gmap[: a.shape[0]], a)
            if theirs.wmax is not None and theirs.wmax.shape[0]:
                np.maximum.at(mine.wmax, gmap[: theirs.wmax.shape[0]], theirs.wmax)
        self.metrics.absorb(t.metrics, gmap, G)
        if self.by == "length" and any(key in self.seq_keys for key in t.seq_keys):
            raise ValueError(  # a sequence in both: neither Tally knew its length
                "--by length: a sequence is in both Tallies, so neither knows its length; "
                "replay those files together instead of adding Tallies"
            )
        pmap = np.empty(len(t.pgroup_keys), dtype=np.float64)
        for key, i in t.pgroup_keys.items():
            c = self.pgroup_keys.get(key)
            if c is None:
                c = self.pgroup_keys[key] = len(self.pgroup_keys)
            pmap[i] = c
        smap = np.empty(len(t.seq_keys), dtype=np.int64)
        for key, i in t.seq_keys.items():
            gid = self.seq_keys.get(key)
            if gid is None:
                gid = len(self.seq_keys)
                self.seq_keys[key] = gid
            smap[i] = gid
        n = len(self.seq_keys)
        k = len(t.seq_keys)
        for name, (_f, how) in _SEQ_FIELDS.items():
            acc, src = self.seq[name], t.seq[name].a[:k].copy()
            acc.ensure(n)
            if name == "group":
                src = np.where(src >= 0, gmap[np.maximum(src, 0).astype(np.int64)], -1.0)
            elif name == "pgroup" and pmap.shape[0]:
                src = np.where(src >= 0, pmap[np.maximum(src, 0).astype(np.int64)], -1.0)
            cur = acc.a[smap]
            acc.a[smap] = {
                "sum": lambda c, s: c + s,
                "max": np.maximum,
                "min": np.minimum,
                "first": lambda c, s: np.where(c < 0, s, c),
            }[how](cur, src)
        for ji, grow in t.seq_max.items():
            acc = self.seq_max.setdefault(ji, _Grow(-1.0))
            acc.ensure(n)
            acc.a[smap] = np.maximum(acc.a[smap], grow.a[:k])
        clash = (self.m2po_sealed & (t.m2po_sealed | set(t.m2po.step_ids()))) | (
            t.m2po_sealed & set(self.m2po.step_ids())
        )
        if clash:  # m2po ranks a whole step: a step resolved on one side is final there
            raise ValueError(
                f"m2po step {min(clash)} is in both Tallies and was resolved in one of them "
                "during its replay: replay those files together instead of adding Tallies"
            )
        self._absorb_sealed_m2po(t, gmap, smap, G, n)
        self.m2po.absorb(t.m2po, gmap, smap if self.has_seq else None)
        self.report += t.report
        self.hist_lin += t.hist_lin
        self.hist_log += t.hist_log
        self.notes = list(dict.fromkeys([*self.notes, *t.notes]))

    def _absorb_sealed_m2po(self, t: Tally, gmap, smap, G: int, n: int) -> None:
        for ji, theirs in t.m2po_done.items():
            self._sealed_bins(ji, G, n)
            mine = self.m2po_done[ji]
            for name in ("count", "mass", "seqfrac"):
                a, into = getattr(theirs, name), getattr(mine, name)
                if a is not None and into is not None and a.shape[0]:
                    np.add.at(into, gmap[: a.shape[0]], a)
            sb = t.m2po_done_seq[ji][: smap.shape[0]]
            acc = self.m2po_done_seq[ji]
            acc[smap[: sb.shape[0]]] = np.maximum(acc[smap[: sb.shape[0]]], sb)
        self.m2po_sealed |= t.m2po_sealed

    def _sealed_bins(self, ji: int, G: int, n_seq: int) -> None:
        """m2po_done[ji] with G groups and m2po_done_seq[ji] with n_seq sequences (at least)."""
        b = self.m2po_done.get(ji)
        if b is None:
            k = len(self.jobs[ji].values)
            b = self.m2po_done[ji] = _new_bins(k, G, False, self.inv_n is not None)
        b.grow(G)
        sb = self.m2po_done_seq.get(ji)
        if sb is None or sb.shape[0] < n_seq:
            new = np.full(max(n_seq, 1024, 2 * (0 if sb is None else sb.shape[0])), -1, np.int64)
            if sb is not None:
                new[: sb.shape[0]] = sb
            self.m2po_done_seq[ji] = new

    def seal_m2po(self, below: float, background: bool = False) -> int:
        """Resolve m2po's steps below `below`, now that every token of them has been added
        (the caller knows: io.step_bounds); their tokens leave the store, so it holds only
        the steps in flight. background: resolve them in a thread, alongside the next
        batches (`wait_m2po` joins it; the next call does too). Returns the steps taken."""
        self.wait_m2po()
        todo = [ji for ji, job in enumerate(self.jobs) if job.rule.level == "step"]
        steps = [s for s in self.m2po.step_ids() if s < below]
        if not todo or not steps:
            return 0
        G = len(self.groups)
        n_seq = len(self.seq_keys)
        for ji in todo:
            self._sealed_bins(ji, G, n_seq)
        data = [self.m2po.pop(s) for s in steps]
        out = {ji: self.m2po_done[ji] for ji in todo}
        seq_bin = {ji: self.m2po_done_seq[ji] for ji in todo}
        self.m2po_sealed.update(steps)
        self.version += 1
        if background:
            self._m2po_pending = _m2po_pool().submit(
                m2po_resolve, self, data, out, seq_bin, G, n_seq
            )
        else:
            m2po_resolve(self, data, out, seq_bin, G, n_seq)
        return len(steps)

    def wait_m2po(self) -> None:
        """Join a background seal_m2po (its errors are raised here)."""
        pending = self.__dict__.pop("_m2po_pending", None)
        if pending is not None:
            pending.result()

    # -- results
    def seq_stats(self) -> SeqStats:
        n = len(self.seq_keys)
        s = {k: v.a[:n] for k, v in self.seq.items()}
        return SeqStats(
            n=s["n"],
            sum_l=s["sum_l"],
            sum_k3=s["sum_k3"],
            max_k2=s["max_k2"],
            min_l=s["min_l"],
            sum_exp_abs_l=s["sum_exp_abs_l"],
            sum_adv=s["sum_adv"],
            has_adv=self.has_adv,
            sum_lc=s["sum_lc"] if self.clamped_seq else None,
            sum_k3c=s["sum_k3c"] if self.clamped_seq else None,
        )

    def result(self) -> SweepResult:
        from .tables import sweep_table

        self.flush()
        return SweepResult(
            table=sweep_table(self),
            metrics=self.metrics.table(self.by, self.groups),
            tally=self,
        )


def length_bucket(n: np.ndarray) -> np.ndarray:
    """--by length: floor(log2 n) of each positive count, exactly (frexp, no rounding): the
    bucket [2^b, 2^(b+1)) is labelled by its lower edge 2^b."""
    _, e = np.frexp(np.asarray(n, dtype=np.float64))
    return (e - 1).astype(np.int64)


def _bucket(q: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(Q_BUCKET_EDGES), q, side="right") - 1


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


@dataclass
class SweepResult:
    table: pl.DataFrame  # the long sweep table (one row per job x value x group)
    metrics: pl.DataFrame  # mismatch metrics per group
    tally: Tally
    notes: list[str] = field(default_factory=list)  # e.g. rules skipped for lack of a column
    warnings: list[str] = field(default_factory=list)  # e.g. a preset's framework quirk


# ----------------------------------------------------------------------------- running


def columns_needed(jobs: Sequence[Job], by: str | None, available: Sequence[str]) -> list[str]:
    cols = {"trainer_logprob", "inference_logprob", "step"}
    for j in jobs:
        cols |= set(j.rule.needs)
        if j.rule.level == "step":
            cols.add("step")
    if "sample_id" in available:
        cols.add("sample_id")
    if "entropy" in available:
        cols.add("entropy")
    if "advantage" in available and any("advantage" in j.rule.needs for j in jobs):
        cols.add("advantage")
    if "group_id" in available and "sample_id" in available:
        cols.add("group_id")  # prompt groups: fully masked groups per rule (tables.py)
    if by is not None:
        if by not in GROUP_KEYS:
            raise UsageError(f"--by {by}: group by one of {', '.join(GROUP_KEYS)}.")
        if by == "q_bucket":
            return sorted(cols)
        if by == "length":
            if "sample_id" not in available:
                raise DataError(
                    "--by length buckets sequences by their loss tokens, so it needs a "
                    f"sample_id column (found: {', '.join(available)}). Map one with --map "
                    "sample_id=COLUMN."
                )
            return sorted(cols)
        if by not in available and by != "step":
            raise UsageError(
                f"--by {by}: the log has no '{by}' column (found: {', '.join(available)})."
            )
        cols.add(by)
    return sorted(cols)


MATCH = ("prime-rl",)
_PRECISION: list[str] = []  # use_precision's stack: the default of replay(precision=None)


@contextlib.contextmanager
def use_precision(precision: str | None):
    """Replay every rule in `precision` ("float64" or "float32") within a block, unless a
    call says otherwise: how analysis.choose / compare and the report pass --precision down
    to their replays. None leaves the default as it is."""
    if precision is None:
        yield
        return
    check_precision(precision)
    _PRECISION.append(precision)
    try:
        yield
    finally:
        _PRECISION.pop()


def current_precision() -> str | None:
    """use_precision's default (None outside any block)."""
    return _PRECISION[-1] if _PRECISION else None


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: use one of {', '.join(PRECISIONS)}.")
    return precision


def with_precision(jobs: Sequence[Job], precision: str) -> list[Job]:
    """The jobs with every rule in `precision`."""
    return [
        j if j.rule.precision == precision else replace(j, rule=j.rule.replace(precision=precision))
        for j in jobs
    ]


def replay(
    sources: Sequence[str | Path] | io.Plan,
    rules: Sequence[Rule | str] | None = None,
    sweeps: dict[str, str | np.ndarray] | None = None,
    by: str | None = None,
    options: io.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    match: str | None = None,
    bootstrap: tuple[int, str, int] | None = None,
    robust: bool = False,
    jobs: Sequence[Job] | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    final: bool = False,
    precision: str | None = None,
) -> Tally:
    """Stream the sources once and return the Tally for these rules and sweeps.

    `precision="float32"` replays every rule decision in the float32 arithmetic the
    frameworks run on the GPU (rules.TokenBatch, rules._F32): the log-probs rounded to
    float32, each rule's score computed in float32 (a preset's in its framework's formula),
    the thresholds rounded to float32, NaN decided as the framework's comparison decides it.
    Sequence sums are float32 values added in float64 and rounded once (a GPU's float32
    reduction order cannot be reproduced). It runs on the simple path; the metrics and the
    scatter stay float64. None: `use_precision`'s default, else "float64".

    `final=True` promises that this Tally will not be added to another: m2po's steps are
    then resolved during the replay as soon as the rows still to come cannot hold them (from
    the Parquet row-group statistics of the step column), so its store keeps only the steps
    in flight instead of every token (sweep() and the CLI pass it).

    `match="prime-rl"` reproduces prime-rl's logging conventions: zero-advantage tokens are
    left out of everything, and the table gains `is_masked_mean`, the mean over sequences of
    each sequence's masked fraction (prime-rl's `is_masked/mean`). That needs each sequence's
    token count up front, so it costs one extra pass over the log.

    `bootstrap=(replicates, unit, seed)` also accumulates Poisson-bootstrap replicates of every
    token rule's per-bin counts over units "sequence" or "step" (analysis.choose uses it).
    `robust=True` keeps per-group k3 histograms and top-k3 tokens (analysis.drift uses it).
    `jobs` replaces rules and sweeps with ready-made jobs.

    `engine="ray"` computes the same Tally per file on a Ray cluster (distributed.py;
    `ray_address` attaches to a running one, else `ray.init()` decides) and adds them up.
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: use one of {', '.join(ENGINES)}.")
    plan = sources if isinstance(sources, io.Plan) else io.plan_sources(sources, options)
    jobs, notes = _resolve_jobs(plan, rules, sweeps, jobs)
    if precision is None and _PRECISION:
        precision = _PRECISION[-1]
    if precision is not None:
        jobs = with_precision(jobs, check_precision(precision))
    precision = "float32" if any(j.rule.precision == "float32" for j in jobs) else "float64"
    if engine == "ray":
        if match is not None or bootstrap is not None or robust or by == "length":
            raise UsageError(
                "--engine ray computes sweeps, metrics and scatters; --match, --by length, "
                "bootstraps and robust drift statistics run on the local engine (drop "
                "--engine ray)."
            )
        from . import distributed

        tally = distributed.replay(plan, jobs, by, address=ray_address, progress=progress)
        tally.notes = [*notes, *tally.notes]
        tally.rule_warnings = spec_warnings(rules or [])
        return tally
    available = plan.columns
    cols = columns_needed(jobs, by, available)
    keep = None
    pre = None
    if match is not None:
        if match not in MATCH:
            raise UsageError(f"--match {match}: known conventions: {', '.join(MATCH)}.")
        need = [c for c in ("advantage", "sample_id") if c not in available]
        if need:
            raise DataError(
                f"{plan.files[0]}: --match prime-rl drops zero-advantage tokens and averages "
                f"over sequences, so it needs the column(s) {', '.join(need)} "
                f"(found: {', '.join(available)}). Map them with --map."
            )
        cols = sorted(set(cols) | {"advantage", "sample_id"})

        def keep(df):
            return df.filter(pl.col("advantage") != 0)

    if robust and "position" in available and "position" not in cols:
        cols = [*cols, "position"]
    if match is not None or by == "length":
        pre = _count_sequences(plan, cols, keep)
    inv_n = None if pre is None or match is None else 1.0 / pre[1]
    tally = Tally(
        jobs,
        by,
        has_seq="sample_id" in cols,
        has_adv="advantage" in cols,
        inv_n=inv_n,
        seq_len=None if pre is None or by != "length" else pre[1].astype(np.int64),
        has_pgroup="group_id" in cols and "sample_id" in cols,
        precision=precision,
    )
    if pre is not None:
        tally.seq_keys = dict(pre[0])
    tally.robust = robust
    if bootstrap is not None:
        tally.boot_replicates, tally.boot_unit, tally.boot_seed = bootstrap
        if tally.boot_unit == "sequence" and not tally.has_seq:
            raise DataError(
                f"{plan.files[0]}: a bootstrap over sequences needs a sample_id column; "
                "use --bootstrap-unit step, or map one with --map sample_id=COLUMN."
            )
    tally.notes = notes
    total = sum(plan.rows)
    dropped_zero = 0
    # m2po's steps are resolved as soon as the rows still to come cannot hold them (sorted
    # logs: one step at a time, so its store stays small); None: all at the end
    m2po = final and any(j.rule.level == "step" for j in jobs)
    bounds = io.step_bounds(plan) if m2po else None
    report = tally.report
    checked = False
    with _plain_pages():
        batches = ((df, report.rows) for _, df in io.iter_batches(plan, cols, report))
        for df, rows in _prefetch(batches):  # rows: raw rows read up to this batch
            if keep is not None:
                before = df.height
                df = keep(df)
                dropped_zero += before - df.height
            if df.height and not checked:  # are the two columns about the same tokens?
                checked = True
                _warn_alignment(plan, df)
            if df.height:
                tally.add_batch(df)
            if bounds is not None:
                done = bisect.bisect_right(bounds[0], rows)  # row groups read to their end
                if done:
                    tally.seal_m2po(bounds[1][done - 1], background=True)
            if progress is not None:
                progress(tally.report.rows, total)
        tally.wait_m2po()
    check_loss_tokens(plan, tally)
    if match is not None:
        tally.notes.append(
            f"prime-rl conventions: {dropped_zero:,} zero-advantage loss tokens left out; "
            "is_masked_mean = mean over sequences of per-sequence masked fractions"
        )
    tally.rule_warnings = spec_warnings(rules or [])
    return tally


ENGINES = ("local", "ray")


def _count_sequences(plan: io.Plan, cols: Sequence[str], keep=None) -> tuple[dict, np.ndarray]:
    """The pre-pass of `match="prime-rl"` and `by="length"`: every sequence's id (the
    replay numbers them in the same order) and its loss tokens (float64), from one read of
    the replay's own columns `cols` (so that --drop-invalid drops the same rows; `keep`:
    prime-rl's filter). ~0.04 s of a 0.26 s default sweep on 2M tokens."""
    pre = Tally([], None, has_seq=True)
    n = _Grow(0.0)
    for _, df in io.iter_batches(plan, cols, pre.report):
        if keep is not None:
            df = keep(df)
        if df.height:
            _, (uniq, local) = pre._seq_codes(df)
            n.ensure(len(pre.seq_keys))
            n.a[uniq] += np.bincount(local, minlength=uniq.shape[0])
    return pre.seq_keys, n.a[: len(pre.seq_keys)].copy()


_ALIGNMENT_WARNED: set[tuple] = set()


def _warn_alignment(plan: io.Plan, df: pl.DataFrame) -> None:
    """The lag check on the first batch (alignment.py), warned once per log and process."""
    import warnings

    from .alignment import first_batch_warnings

    for note in first_batch_warnings(df):
        key = (tuple(map(str, plan.files)), note)
        if key not in _ALIGNMENT_WARNED:
            _ALIGNMENT_WARNED.add(key)
            warnings.warn(f"{plan.files[0]}: {note}", io.IngestWarning, stacklevel=3)


def _resolve_jobs(plan: io.Plan, rules, sweeps, jobs) -> tuple[list[Job], list[str]]:
    available = plan.columns
    if jobs is None:
        return plan_jobs(rules, sweeps, available)
    for j in jobs:  # pre-built jobs (analysis refines grids this way)
        lacking = [c for c in j.rule.needs if c not in available]
        if lacking:
            raise DataError(
                f"{plan.files[0]}: rule '{j.rule.name}' needs the column(s) "
                f"{', '.join(lacking)} (found: {', '.join(available)}). Map one with --map."
            )
    return list(jobs), []


def check_loss_tokens(plan: io.Plan, tally: Tally) -> None:
    if tally.report.loss_rows == 0:
        raise DataError(
            f"{plan.files[0]}{' and others' if len(plan.files) > 1 else ''}: no loss tokens "
            f"to replay ({tally.report.rows:,} row(s) read, none with loss_mask true and valid). "
            "Check the loss_mask column and the --map options."
        )


def shard_tally(
    plan: io.Plan,
    jobs: Sequence[Job],
    by: str | None,
    cols: Sequence[str],
    has_seq: bool,
    has_adv: bool,
    sample_id_offset: int | None = None,
) -> Tally:
    """The Tally of one shard's plan (the Ray engine's task body), flushed for shipping.
    `sample_id_offset` is added to sample ids that ingest numbers by row (one row per
    sequence without a sample_id column), so that they stay unique across shards."""
    tally = Tally(list(jobs), by, has_seq=has_seq, has_adv=has_adv)
    tally.has_pgroup = has_seq and "group_id" in cols
    for _, df in _prefetch(io.iter_batches(plan, cols, tally.report)):
        if sample_id_offset:
            df = df.with_columns(pl.col("sample_id") + sample_id_offset)
        if df.height:
            tally.add_batch(df)
    tally.flush()
    return tally


@contextlib.contextmanager
def _plain_pages():
    """numpy asks the kernel for transparent huge pages on every array >= 4 MiB; where
    defrag is 'madvise' (common), a first touch can then stall on memory compaction. The
    replay allocates such arrays per batch (sequence ids, m2po's inputs), and measured ~10%
    faster with plain pages (benchmarks/README.md), so it turns the advice off while it runs
    and restores numpy's setting after."""
    try:
        from numpy._core import multiarray as ma

        old = ma._set_madvise_hugepage(False)
    except (ImportError, AttributeError):  # pragma: no cover - another numpy
        yield
        return
    try:
        yield
    finally:
        ma._set_madvise_hugepage(old)


def _prefetch(batches: Iterator, depth: int = 2) -> Iterator:
    """Iterate `batches` in a background thread, `depth` batches ahead: Parquet decoding and
    canonicalisation (pyarrow and polars release the GIL) overlap the kernel. Errors are
    raised here, in order; stopping early stops the reader."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in batches:
                while not stop.is_set():
                    try:
                        q.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((True, done))
        except BaseException as exc:  # handed to the consumer
            q.put((False, exc))

    t = threading.Thread(target=produce, name="mismatch-replay-reader", daemon=True)
    t.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while t.is_alive():
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(timeout=0.05)


def sweep(*args, **kwargs) -> SweepResult:
    """`replay(..., final=True)` then the sweep table (see `replay` for the arguments)."""
    kwargs.setdefault("final", True)
    tally = replay(*args, **kwargs)
    res = tally.result()
    res.notes = list(tally.notes)
    res.warnings = list(tally.rule_warnings)
    return res
