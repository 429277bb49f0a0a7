"""Per-sequence sums: what sequence rules score, kept while the tokens stream by.

Design
------
Sequence rules need whole sequences, which may be spread over batches and files, so a
Tally keeps for every sequence -- a run of equal (step, sample_id), numbered in order of
appearance (`Sequences.codes`) -- the statistics of rules.SEQ_STATS (a sum, a max or a min
of a per-token quantity over its loss tokens), plus the engine's own: its |dp| mass, the
--by group of its first token and its prompt group (step, group_id): 12 float64 a sequence
and its dict key, not a token. Sequence rules are scored once, at the end, on
`Sequences.stats()`. Everything follows the table (`SUMS`): the simple path's partials of a
batch (`partials`), the merge of two batches or two Tallies, the SeqStats handed to the
rules; the fused path takes the statistics its kernel accumulates (fast/jit.py SEQ_SUMS, by
name) and computes the others on numpy beside it. So a new statistic is one row of
SEQ_STATS (and a line in the kernel, to have it fused).

Runs are looked up once each (a dict of (step, sample_id) -> id), so a batch of 1M tokens
in 512-token sequences costs 2k dict lookups; with numba one pass finds the runs
(`fast.compiled().seq_runs`). The per-token id arrays are this object's scratch, reused batch
after batch, valid until the next `codes` call (m2po's store copies the ids it keeps).

Prompt groups: with a `group_id` column (verl's `uid`, ...) each sequence keeps its group's
code -- one dict lookup per run of a sequence, one dict entry a group -- from which
readout.py counts the groups whose every sample is masked.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from .. import fast
from ..rules import SEQ_STATS, SeqStat, SeqStats, TokenBatch
from .bins import Grow

# The engine's per-sequence sum beside the rules' statistics: the |dp| mass of a sequence
# (a sequence rule's masked mass), from the float64 batch.
MASS = SeqStat("mass", "sum", "abs_dp", replay_precision=False, doc="sum of |dp|")
SUMS: tuple[SeqStat, ...] = (*SEQ_STATS, MASS)
# Codes of a sequence, its first token's: its --by group and its prompt group (-1: none yet).
CODES = ("group", "pgroup")


class Sequences:
    """The per-sequence sums and codes of a Tally, by global sequence id."""

    def __init__(self) -> None:
        self.keys: dict = {}  # (step, sample_id) -> global sequence id
        self.sums: dict[str, Grow] = {s.name: Grow(s.fill) for s in SUMS}
        self.sums |= {name: Grow(-1.0) for name in CODES}
        self.pgroup_keys: dict = {}  # (step, group_id) -> prompt group code
        self._runs: tuple[np.ndarray, np.ndarray] | None = None  # the last batch's runs
        self._scratch: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def __getstate__(self):  # pickling (Ray): the batch's scratch stays behind
        state = dict(self.__dict__)
        state["_scratch"] = {}
        state["_runs"] = None
        return state

    def _buffer(self, name: str, n: int) -> np.ndarray:
        """A scratch int64 array of n, this object's, reused batch after batch."""
        buf = self._scratch.get(name)
        if buf is None or buf.shape[0] < n:
            buf = self._scratch[name] = np.empty(max(n, 1), dtype=np.int64)
        return buf[:n]

    def column(self, name: str) -> np.ndarray:
        """One per-sequence column (a SUMS name or a code), shape (sequences,)."""
        return self.sums[name].a[: len(self.keys)]

    def group(self) -> np.ndarray:
        """Each sequence's --by group (its first token's), int64."""
        return self.column("group").astype(np.int64)

    # -- one batch
    def codes(
        self, df: pl.DataFrame, into: np.ndarray | None = None
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Per-token global sequence ids, and (the batch's distinct global ids, each token's
        index into them), for a batch with step and sample_id columns; new sequences get the
        next ids. The arrays may be this object's scratch: valid until the next call; `into`
        (int64, one per token): where the global ids go instead (m2po's leased slab)."""
        step = df["step"]
        sid = df["sample_id"]
        run = None
        if sid.dtype.is_integer() and step.dtype.is_integer():
            st = step.to_numpy()
            sd = sid.to_numpy()
            j = fast.compiled()
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
        keys = self.keys
        for i, key in enumerate(zip(steps, sids, strict=True)):
            gid = keys.get(key)
            if gid is None:
                gid = len(keys)
                keys[key] = gid
            gid_of_run[i] = gid
        self._runs = (starts, gid_of_run)  # the batch's runs (prompt groups read them)
        k = gid_of_run.shape[0]
        in_order = run is not None and k and gid_of_run[-1] - gid_of_run[0] == k - 1
        if in_order and (k == 1 or (np.diff(gid_of_run) == 1).all()):
            # every run a new sequence, numbered in order (a log sorted by step and
            # sequence): a token's batch-local id is its run, its global id an offset
            gid = self._buffer("gid", run.shape[0]) if into is None else into
            np.add(run, gid_of_run[0], out=gid)
            return gid, (gid_of_run, run)
        uniq, inv = np.unique(gid_of_run, return_inverse=True)
        if run is None:
            run = np.zeros(df.height, dtype=np.int64)  # each token's run: a cumulative sum
            run[starts[1:]] = 1  # of run starts (np.repeat is slower with per-run counts)
            np.cumsum(run, out=run)
            gid = gid_of_run[run] if into is None else np.take(gid_of_run, run, out=into)
            return gid, (uniq, inv.reshape(-1)[run])
        gid = self._buffer("gid", run.shape[0]) if into is None else into
        local = self._buffer("local", run.shape[0])
        fast.compiled().take_runs(run, gid_of_run, inv.reshape(-1).astype(np.int64), gid, local)
        return gid, (uniq, local)

    def add_pgroups(self, df: pl.DataFrame) -> None:
        """Each new sequence's prompt group, (step, group_id), from the runs of the batch
        `codes` saw last (one dict lookup per run); a sequence keeps its first run's group."""
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
        acc = self.sums["pgroup"]
        acc.ensure(len(self.keys))
        rev = gid_of_run[::-1]  # reversed: among repeats, the first run's write lands last
        cur = acc.a[rev]
        acc.a[rev] = np.where(cur < 0, codes[::-1], cur)

    def add_numpy(self, tb: TokenBatch, ts: TokenBatch, g: np.ndarray, seq, optional: bool) -> None:
        """The simple path's partials of a batch: every statistic of SUMS (the optional ones
        only when `optional`) and each sequence's first group; `tb` is the float64 batch,
        `ts` the batch in the replay's precision, `seq` what `codes` gave."""
        uniq, local = seq[1]
        stats = [s for s in SUMS if optional or not s.optional]
        parts = partials(stats, tb, ts, local, uniq.shape[0])
        first = np.full(uniq.shape[0], -1.0)
        first[local[::-1]] = g[::-1]  # first token's group wins
        parts["group"] = first
        self.merge(parts, uniq)

    def merge(self, parts: dict[str, np.ndarray], uniq: np.ndarray) -> None:
        """Combine a batch's per-sequence partials (indexed like uniq; any subset of SUMS
        and CODES) into the totals."""
        n_total = len(self.keys)
        for name, part in parts.items():
            acc = self.sums[name]
            acc.ensure(n_total)
            acc.a[uniq] = _combine(_HOW[name], acc.a[uniq], part)

    # -- merging
    def absorb(self, other: Sequences, gmap: np.ndarray) -> np.ndarray:
        """Add another Tally's sequences (its --by group g is this one's gmap[g]); returns
        smap, its sequence ids in this numbering. A sequence in both combines."""
        pmap = np.empty(len(other.pgroup_keys), dtype=np.float64)
        for key, i in other.pgroup_keys.items():
            c = self.pgroup_keys.get(key)
            if c is None:
                c = self.pgroup_keys[key] = len(self.pgroup_keys)
            pmap[i] = c
        smap = np.empty(len(other.keys), dtype=np.int64)
        for key, i in other.keys.items():
            gid = self.keys.get(key)
            if gid is None:
                gid = len(self.keys)
                self.keys[key] = gid
            smap[i] = gid
        n = len(self.keys)
        k = len(other.keys)
        for name, grow in other.sums.items():
            acc, src = self.sums[name], grow.a[:k].copy()
            acc.ensure(n)
            if name == "group":
                src = np.where(src >= 0, gmap[np.maximum(src, 0).astype(np.int64)], -1.0)
            elif name == "pgroup" and pmap.shape[0]:
                src = np.where(src >= 0, pmap[np.maximum(src, 0).astype(np.int64)], -1.0)
            acc.a[smap] = _combine(_HOW[name], acc.a[smap], src)
        return smap

    # -- results
    def stats(self, has_adv: bool, optional: bool) -> SeqStats:
        """The SeqStats sequence rules score (the optional sums only when kept)."""
        cols = {
            s.name: (self.column(s.name) if optional or not s.optional else None) for s in SEQ_STATS
        }
        return SeqStats(**cols, has_adv=has_adv)


def partials(
    stats, tb: TokenBatch, ts: TokenBatch, local: np.ndarray, m: int
) -> dict[str, np.ndarray]:
    """Per-sequence partials of `stats` over a batch's tokens (`local`: each token's index
    among the batch's m sequences), each from `tb` (float64) or `ts` (the replay's
    precision; float32 values are added in float64). A statistic of a column the batch
    lacks (no advantage) is left out."""
    parts: dict[str, np.ndarray] = {}
    for stat in stats:
        v = stat.per_token(ts if stat.replay_precision else tb)
        if v is None and stat.quantity is not None:
            continue
        if stat.combine == "sum":
            parts[stat.name] = (
                np.bincount(local, minlength=m).astype(float)
                if v is None
                else np.bincount(local, weights=v, minlength=m)
            )
        else:
            part = np.full(m, stat.fill)
            op = np.maximum if stat.combine == "max" else np.minimum
            op.at(part, local, np.asarray(v, dtype=np.float64))
            parts[stat.name] = part
    return parts


_HOW = {s.name: s.combine for s in SUMS} | dict.fromkeys(CODES, "first")


def _combine(how: str, cur: np.ndarray, part: np.ndarray) -> np.ndarray:
    if how == "sum":
        return cur + part
    if how == "max":
        return np.maximum(cur, part)
    if how == "min":
        return np.minimum(cur, part)
    return np.where(cur < 0, part, cur)  # "first": a code not set yet is -1
