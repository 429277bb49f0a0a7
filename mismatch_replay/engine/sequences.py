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

One read, several Tallies (engine.replay_together): each Tally numbers the same batches'
sequences the same way, so the first one's codes serve the others (`Sequences.lead`): a
follower adds the leader's new keys of the batch to its own dict (the same ids, in the same
order: the dicts stay equal) and takes the leader's arrays, read-only, or copies the ids
into its own `into`. A record's call count, key count and the batch's height and first and
last (step, sample_id) must match, else the follower numbers its own batches from then on.
~1.4 ms a 1M-token batch saved per extra Tally (the codes' ~1.5 ms: seq_runs, the dict
lookups, the id arrays; a follower's ~0.2 ms).

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
MASS = SeqStat("mass", "sum", "abs_dp", doc="sum of |dp|")
SUMS: tuple[SeqStat, ...] = (*SEQ_STATS, MASS)
# What a mask costs, per sequence (a sequence rule's masked tokens' classes, |A| and
# entropy: bins.direction_class): corrective and divergent tokens, |A| sum, finite-entropy
# sum and count; kept only where the log has the column and a sequence job reads them.
COST_SUMS = ("cost_corr", "cost_div", "cost_amass", "cost_ent", "cost_ent_n")
# Codes of a sequence, its first token's: its --by group and its prompt group (-1: none yet).
CODES = ("group", "pgroup")


class Sequences:
    """The per-sequence sums and codes of a Tally, by global sequence id."""

    def __init__(self) -> None:
        self.keys: dict = {}  # (step, sample_id) -> global sequence id
        self.sums: dict[str, Grow] = {s.name: Grow(s.fill) for s in SUMS}
        self.sums |= {name: Grow(-1.0) for name in CODES}
        self.sums |= {name: Grow(0.0) for name in COST_SUMS}
        self.cost_kept = {"dir": False, "ent": False}  # which COST_SUMS were ever added
        self.pgroup_keys: dict = {}  # (step, group_id) -> prompt group code
        self._runs: tuple[np.ndarray, np.ndarray] | None = None  # the last batch's runs
        self._scratch: dict[str, np.ndarray] = {}
        # one read's Tallies (`lead`): the followers take the leader's codes of each batch
        self._calls = 0  # codes() calls so far
        self._leader: Sequences | None = None
        self._followers: list[Sequences] = []
        self._last: tuple | None = None  # the leader's last codes (see `lead`)

    def __len__(self) -> int:
        return len(self.keys)

    def __getstate__(self):  # pickling (Ray): the batch's scratch stays behind
        state = dict(self.__dict__)
        state["_scratch"] = {}
        state["_runs"] = None
        state["_leader"], state["_followers"], state["_last"] = None, [], None
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

    # -- one read's Tallies
    def lead(self, followers: list[Sequences]) -> None:
        """Make `followers` (the Sequences of other Tallies of one read, fed the same rows
        in the same order, each codes() call after this one's: engine.replay's _stream) take
        this one's codes of every batch instead of computing them; [] ends it. All must be
        empty. A follower's `codes` adds this one's new keys of the batch to its own dict
        (so they stay equal: the same ids) and returns this one's arrays, read-only (or
        copied into its `into`); if the call counts or key counts ever differ, it computes
        its own from then on."""
        for f in self._followers:
            f._leader = None
        self._followers, self._last = [], None
        if followers and any(len(s.keys) for s in (self, *followers)):
            raise ValueError("Sequences.lead: only before the first batch")
        for f in followers:
            f._leader, f._calls = self, self._calls
        self._followers = list(followers)

    def _follow(self, df: pl.DataFrame, into: np.ndarray | None):
        """The leader's codes of this batch (None: they are not this batch's)."""
        rec = self._leader._last
        if rec is None or rec[0] != self._calls or rec[1] != len(self.keys):
            return None
        if rec[5] != _ends(df):  # a cheap guard: the same rows, as far as it can tell
            return None
        keys = self.keys
        for key in rec[2]:
            keys[key] = len(keys)
        self._runs = rec[4]
        gid, (uniq, local) = rec[3]
        if into is not None:
            np.copyto(into, gid)
            gid = into
        return _ro(gid) if into is None else gid, (_ro(uniq), _ro(local))

    # -- one batch
    def codes(
        self, df: pl.DataFrame, into: np.ndarray | None = None
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Per-token global sequence ids, and (the batch's distinct global ids, each token's
        index into them), for a batch with step and sample_id columns; new sequences get the
        next ids. The arrays may be this object's scratch: valid until the next call; `into`
        (int64, one per token): where the global ids go instead (m2po's leased slab). A
        follower (`lead`) takes its leader's (read-only, valid until the leader's next call)."""
        self._calls += 1
        if self._leader is not None:
            got = self._follow(df, into)
            if got is not None:
                return got
            self._leader = None  # not the leader's batch: on its own from now on
        if not self._followers:
            return self._codes(df, into, None)
        before, new = len(self.keys), []
        out = self._codes(df, into, new)
        self._last = (self._calls, before, new, out, self._runs, _ends(df))
        return out

    def _codes(self, df: pl.DataFrame, into: np.ndarray | None, new: list | None):
        """codes(); `new`: where the keys added go, in order (None: not kept)."""
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
                if new is not None:
                    new.append(key)
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

    def add_numpy(self, tb: TokenBatch, g: np.ndarray, seq, extras) -> None:
        """The simple path's partials of a batch: every statistic of SUMS (the optional ones
        when `extras`, a set of SeqStat.extras kinds, keeps them) and each sequence's first
        group; `tb` is the float64 batch, `seq` what `codes` gave."""
        uniq, local = seq[1]
        stats = [s for s in SUMS if s.kept(extras)]
        parts = partials(stats, tb, local, uniq.shape[0])
        first = np.full(uniq.shape[0], -1.0)
        first[local[::-1]] = g[::-1]  # first token's group wins
        parts["group"] = first
        self.merge(parts, uniq)

    def add_cost(
        self, uniq: np.ndarray, local: np.ndarray, dirn, absadv, ent, lp=None, lq=None, adv=None
    ) -> None:
        """A batch's per-sequence partials of what a mask costs: each token's direction
        class and |A| (bins.direction_class; None without an advantage) and entropy (None
        without; non-finite ones left out). Given the log-probs and the advantage, on the
        fused backend one kernel pass (`jit.seq_cost`) instead, `dirn` and `absadv` unread."""
        from .bins import CORRECTIVE, DIVERGENT

        m = uniq.shape[0]
        parts = {}
        j = fast.compiled() if lp is not None else None
        if j is not None:  # one pass, GIL free: the sums numpy's bincounts make, bit for bit
            out = np.zeros((m, 5))
            has_adv, has_ent = adv is not None, ent is not None
            z = np.zeros(1)
            j.seq_cost(
                np.ascontiguousarray(lp, dtype=np.float64),
                np.ascontiguousarray(lq, dtype=np.float64),
                np.ascontiguousarray(adv, dtype=np.float64) if has_adv else z,
                np.ascontiguousarray(ent, dtype=np.float64) if has_ent else z,
                np.ascontiguousarray(local, dtype=np.int64),
                has_adv,
                has_ent,
                out,
            )
            names = [*(COST_SUMS[:3] if has_adv else ()), *(COST_SUMS[3:] if has_ent else ())]
            cols = [*((0, 1, 2) if has_adv else ()), *((3, 4) if has_ent else ())]
            self.cost_kept["dir"] |= has_adv
            self.cost_kept["ent"] |= has_ent
            self.merge({n: out[:, c] for n, c in zip(names, cols, strict=True)}, uniq)
            return
        if dirn is not None:
            self.cost_kept["dir"] = True
            parts["cost_corr"] = np.bincount(local, weights=dirn == CORRECTIVE, minlength=m)
            parts["cost_div"] = np.bincount(local, weights=dirn == DIVERGENT, minlength=m)
            parts["cost_amass"] = np.bincount(local, weights=absadv, minlength=m)
        if ent is not None:
            self.cost_kept["ent"] = True
            ok = np.isfinite(ent)
            parts["cost_ent"] = np.bincount(local, weights=np.where(ok, ent, 0.0), minlength=m)
            parts["cost_ent_n"] = np.bincount(local, weights=ok, minlength=m)
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
        for key, kept in other.cost_kept.items():
            self.cost_kept[key] = self.cost_kept[key] or kept
        for name, grow in other.sums.items():
            grow.ensure(k)  # a sum its batches never reached holds its fill up to k
            acc, src = self.sums[name], grow.a[:k].copy()
            acc.ensure(n)
            if name == "group":
                src = np.where(src >= 0, gmap[np.maximum(src, 0).astype(np.int64)], -1.0)
            elif name == "pgroup" and pmap.shape[0]:
                src = np.where(src >= 0, pmap[np.maximum(src, 0).astype(np.int64)], -1.0)
            acc.a[smap] = _combine(_HOW[name], acc.a[smap], src)
        return smap

    # -- results
    def stats(self, has_adv: bool, extras) -> SeqStats:
        """The SeqStats sequence rules score (the optional sums only when kept: `extras`)."""
        cols = {s.name: (self.column(s.name) if s.kept(extras) else None) for s in SEQ_STATS}
        return SeqStats(**cols, has_adv=has_adv)


def partials(stats, tb: TokenBatch, local: np.ndarray, m: int) -> dict[str, np.ndarray]:
    """Per-sequence partials of `stats` over a batch's tokens (`local`: each token's index
    among the batch's m sequences), each from `tb` (float64) or, for a float32 twin, from
    `tb` in float32 (float32 values added in float64). A statistic of a column the batch
    lacks (no advantage) is left out."""
    parts: dict[str, np.ndarray] = {}
    for stat in stats:
        v = stat.per_token(tb)
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


def _ends(df: pl.DataFrame) -> tuple:
    """A batch's height and its first and last (step, sample_id)."""
    if not df.height:
        return (0,)
    step, sid = df["step"], df["sample_id"]
    return df.height, step[0], sid[0], step[-1], sid[-1]


def _ro(a: np.ndarray) -> np.ndarray:
    """A read-only view (a follower's view of its leader's arrays)."""
    a = a.view()
    a.flags.writeable = False
    return a


_HOW = (
    {s.name: s.combine for s in SUMS}
    | dict.fromkeys(CODES, "first")
    | dict.fromkeys(COST_SUMS, "sum")
)


def _combine(how: str, cur: np.ndarray, part: np.ndarray) -> np.ndarray:
    if how == "sum":
        return cur + part
    if how == "max":
        return np.maximum(cur, part)
    if how == "min":
        return np.minimum(cur, part)
    return np.where(cur < 0, part, cur)  # "first": a code not set yet is -1
