"""Exact counts after a replay, from its tail: refinement and bootstrap with no second pass.

Design
------
A replay given an `engine.Tail` keeps the tokens beyond per-coordinate cutoffs (engine/
tail.py). `TailCounts` scores them with each token rule's own `score()` on a TokenBatch of
the kept tokens -- the simple path's arithmetic, so its bins are the engine's -- and says
where that is the whole story: `cover(job)` compares the kept tokens' masked count with the
replay's exact count at every value the replay evaluated for the rule (its job's grid), and
returns the loosest threshold from which on they agree at every grid value. A token rule's
masked set shrinks as its threshold rises, so at any value at least that strict every masked
token is among the kept ones, and

* `hits(job)`: the masked tokens at each of a job's values (a refinement grid) are exact;
* `replicates(job, B, unit, seed)`: per Poisson replicate, the masked tokens at each value,
  sum over units of the unit's weight (`engine.poisson_weights`, a function of the unit id)
  times its masked tokens there, with the unit's tokens from the replay (a sequence's `n`,
  a step's count). Weights and counts are integers, so the float64 matrix product is exact
  in any order: the replicates equal those of the streaming bootstrap pass
  (`search.one_pass`) bit for bit.

A job whose values are not all covered is left to a pass (`search.one_pass` runs it): the
answers are the same either way, only the time differs.

What it costs: each rule and parameter is scored once on its coordinate's kept tokens. A job
reads only those scoring at least its loosest threshold (`_view`: the others are in bin 0
at all its values, which no count reads): views cut once and cached, each from the
narrowest one that holds it, so that a search's later jobs, near its answer, bin the few
tokens there; a count over most of the coordinate (`cover`'s union grid, a refinement) is
read off the sorted scores instead (`sorted_counts`, no view kept). A view keeps input
order, so every sum over masked tokens is added in the order it would be over all of them;
the grouped tables and compare's table compute q and |dp| for the masked tokens only
(`batch`), the same values elementwise as for every kept token.

What a mask costs (readout.COST_COLUMNS) in the grouped tables (`_cost`): the masked
tokens are all kept, with their log-probs, advantage and entropy, so each group's
corrective and divergent masked tokens and their |A| and entropy sums come from them;
each group's totals (the fraction's |A| denominator, entropy_mean) from the replay's own
per-group sums: the kernel's per-q-bucket sums (`Tail.q_cost`), the per-sequence sums of
a replay holding a sequence job (`Tally.seq_cost`: a sequence lies in one step and one
length bucket) and the step Tally's entropy metrics. Counts are the plain replay's
exactly, sums to the last bits; a column whose totals the replay did not keep stays null
with a note.
"""

from __future__ import annotations

import numpy as np

from .. import engine
from ..engine import readout
from ..engine.bins import direction_class, seq_count
from ..engine.tally import sequence_bins
from ..fast import bin_scores, executor, replicate_bins, threads
from ..rules import TokenBatch

VIEW_SHRINK = 0.75  # `_view`: a narrowed view is cached where it holds at most this share
SORT_MIN = 1 << 16  # `_counts`: views from which it counts on the sorted scores


def _key(job: engine.Job) -> tuple:
    r = job.rule
    return (r.name, r.arith, r.precision, r.setting(job.param), job.param)


class TailCounts:
    """Counts at any threshold of a token rule, from a replay's kept tokens (see the
    module docstring). `main`: the Tally the tail was filled by."""

    def __init__(self, main: engine.Tally):
        main.flush()  # its accumulators into its bins now, not in two threads at once later
        self.main = main
        self.tail = main.tail
        self._idx: dict[int | None, np.ndarray | None] = {}  # `_index`
        self._sub: dict[int | None, TokenBatch] = {}  # `_subset`'s batches, until let go
        self._scores: dict[tuple, np.ndarray] = {}
        self._cover: dict[tuple, float] = {}
        self._live: dict[tuple, list] = {}  # `_view`: [(bound, rows, scores)], bound ascending
        self._coord: dict[tuple, int | None] = {}  # `_coordinate`
        self._hit: dict[tuple, tuple] = {}  # `_grouped`: a setting's masked rows, bins, batch
        self._exact: dict[tuple, list] = {}  # `_evaluated`, per rule and parameter
        self._weights: tuple | None = None
        self._unit_cache: dict[str, tuple] = {}

    @classmethod
    def of(cls, main: engine.Tally | None) -> TailCounts | None:
        """The tail's counts, or None where the replay kept none (no tail, or it says why
        not: the simple path, a tail that outgrew its limit)."""
        if main is None or main.tail is None or main.tail.off is not None:
            return None
        if main.tail.cut is None and main.tail.tokens:  # a replay with no token job
            return None
        got = main.tail.cache.get("counts")  # one per replay: its scores and weights
        if got is None or got.main is not main:
            got = main.tail.cache["counts"] = cls(main)
        return got

    def _coordinate(self, job: engine.Job, k: tuple | None = None) -> int | None:
        """The kernel coordinate the replay binned this rule and parameter on (its kept
        tokens are those with that coordinate's bit), or None: every kept token (cached per
        rule and parameter; `k`: the job's `_key`)."""
        k = _key(job) if k is None else k
        if k in self._coord:
            return self._coord[k]
        got = None
        program = self.main.program
        for ji, mj in enumerate(self.main.jobs if program is not None else []):
            if got is None and mj.rule.level == "token" and _key(mj) == k:
                slot = program.slot[ji]
                if slot >= 0:
                    got = next((c for c, co in enumerate(program.coords) if slot in co.slots), None)
        self._coord[k] = got
        return got

    def _index(self, c: int | None) -> np.ndarray | None:
        """Indices into the kept tokens of coordinate c's tail (None: every kept token)."""
        if c not in self._idx:
            # a tail that kept no token has no "bits" (Tail.arrays): no coordinate's tokens
            bits = self.tail.arrays().get("bits", np.zeros(0, dtype=np.uint32))
            # (a bool array: numpy's nonzero on one is several times faster than on uint32)
            self._idx[c] = None if c is None else np.flatnonzero((bits & np.uint32(1 << c)) != 0)
        return self._idx[c]

    def _subset(self, c: int | None) -> tuple[np.ndarray | None, TokenBatch]:
        """(indices into the kept tokens, their TokenBatch) of coordinate c's tail: the
        batch made (gathered) where it is not cached, e.g. after `prepare` let it go."""
        idx = self._index(c)
        tb = self._sub.get(c)
        if tb is None:
            a = self.tail.arrays()
            adv = a.get("advantage")
            if adv is None and self.tail.kept == 0:  # nothing kept: an empty advantage
                adv = np.zeros(0)
            if idx is None:
                tb = TokenBatch(a["lp"], a["lq"], adv)
            else:
                tb = TokenBatch(a["lp"][idx], a["lq"][idx], None if adv is None else adv[idx])
            self._sub[c] = tb
        return idx, tb

    def score(self, job: engine.Job, k: tuple | None = None) -> np.ndarray:
        """The rule's score of the kept tokens on its coordinate (cached per rule and
        parameter; `k`: the job's `_key`)."""
        k = _key(job) if k is None else k
        s = self._scores.get(k)
        if s is None:
            _, tb = self._subset(self._coordinate(job, k))
            s = np.asarray(job.rule.score(tb, job.param), dtype=np.float64)
            if np.isnan(s).any():  # before a view drops them (`bin_scores` raises too)
                raise AssertionError("internal error: a rule produced NaN scores")
            self._scores[k] = s
        return s

    def _view(
        self, job: engine.Job, k: tuple, lo: float, narrow: bool = True
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """(kept-token indices, their scores, in input order, and whether that is the whole
        coordinate) of a superset of the tokens the job masks at some value: its
        coordinate's kept tokens scoring at least `lo`, its loosest threshold (all of them
        where `lo` is NaN: a job with no value). Cut from the narrowest view cached that
        holds them (`narrow`: else that view), and cached per rule and parameter where at
        most VIEW_SHRINK of that one, so that a search's later jobs, near its answer, bin
        the few tokens near it. The tokens a view leaves out exceed no threshold of the job
        (bin 0 at every value, which no count reads); the ones it keeps stay in input order,
        so every sum over the masked tokens is added in the same order as over the whole
        coordinate."""
        idx = self._index(self._coordinate(job, k))
        s = self.score(job, k)
        full = (np.arange(s.shape[0]) if idx is None else idx), s, True
        if np.isnan(lo):
            return full
        views = self._live.get(k, [])
        parent = next((v for v in reversed(views) if v[0] <= lo), (-np.inf, *full))
        if parent[0] == lo or not narrow:
            return parent[1:]
        keep = np.flatnonzero(parent[2] >= lo)  # +inf scores (masked everywhere) included
        if keep.size > VIEW_SHRINK * parent[2].shape[0]:
            return parent[1:]
        got = (lo, parent[1][keep], parent[2][keep], False)
        self._live[k] = sorted([*views, got], key=lambda v: v[0])  # a new list: threads
        return got[1:]

    def _bins(self, job: engine.Job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kept-token indices, each one's bin on the job's sorted thresholds, the job's
        `order`), the thresholds computed once."""
        thr = job.thresholds
        rows, s, _ = self._view(job, _key(job), float(thr.min()) if thr.size else np.nan)
        order = np.argsort(thr, kind="stable")
        return rows, bin_scores(s, thr[order], job.rule.inclusive), order

    def _counts(self, job: engine.Job) -> np.ndarray:
        """Kept tokens masked at each of the job's values (values' order). Where no view
        narrower than the whole coordinate holds the job's tokens (`cover`'s union grid, a
        refinement's), from the sorted scores of those at or above its loosest threshold
        (`sorted_counts`: the same counts as the bins', and no view kept), else from the
        view's bins."""
        k, thr = _key(job), job.thresholds
        lo = float(thr.min()) if thr.size else np.nan
        _, s, whole = self._view(job, k, lo, narrow=False)
        if whole and s.shape[0] >= SORT_MIN and not np.isnan(thr).any():
            beyond = s[np.flatnonzero(s >= lo)]  # (faster than a boolean mask's indexing)
            return sorted_counts(np.sort(beyond), thr, job.rule.inclusive)
        _, s, _ = self._view(job, k, lo)
        order = np.argsort(thr, kind="stable")
        b = bin_scores(s, thr[order], job.rule.inclusive)
        return suffix_values(job, np.bincount(b, minlength=len(job.values) + 2), order)

    def cover(self, job: engine.Job) -> float:
        """The loosest threshold (score space) from which on the kept tokens are every
        masked token: +inf where the replay holds no job of this rule and parameter, or
        the kept tokens miss some at its strictest value."""
        k = _key(job)
        got = self._cover.get(k)
        if got is not None:
            return got
        got = np.inf
        found = self._exact.get(k)
        if found is None:
            found = self._exact[k] = self._evaluated(k)
        if found:
            mj = found[0][0]
            values = np.concatenate([c[0] for _, c in found])
            exact = np.concatenate([c[1] for _, c in found])
            union = engine.Job(mj.rule, mj.param, values)
            mine, thr = self._counts(union), union.thresholds
            for i in np.argsort(thr, kind="stable")[::-1]:
                if mine[i] != exact[i]:
                    break
                got = min(got, float(thr[i]))
        self._cover[k] = got
        return got

    def _evaluated(self, k: tuple) -> list:
        """Every grid the replay evaluated for this rule and parameter (the sweep's and a
        search's first grid may both be there), with its exact counts: [(job, counts)].
        Reading them flushes the Tally: `prepare` does it for all keys before threads run."""
        return [
            (mj, readout.job_counts(self.main, ji))
            for ji, mj in enumerate(self.main.jobs)
            if mj.rule.level == "token" and _key(mj) == k
        ]

    def covers(self, job: engine.Job) -> bool:
        """Are all of the job's values at least as strict as the covered threshold? (Not
        for a float32 job: the tail is the fused path's, float64; its replays run apart.)"""
        if job.rule.level != "token" or len(job.values) == 0 or job.rule.precision != "float64":
            return False
        return bool(job.thresholds.min() >= self.cover(job))

    def masked(self, job: engine.Job) -> np.ndarray:
        """Which kept tokens (all of them, in input order) the rule masks at the job's one
        value (every masked token of the log where `covers(job)`)."""
        out = np.zeros(self.tail.kept, dtype=bool)
        out[self.masked_rows(job)] = True
        return out

    def masked_rows(self, job: engine.Job) -> np.ndarray:
        """`masked` as the kept-token indices, ascending."""
        rows, b, _ = self._bins(job)
        return rows[b > 0]

    def batch(self, rows: np.ndarray) -> TokenBatch:
        """The kept tokens `rows` as a TokenBatch (no advantage): their per-token values,
        elementwise, are the same bits as `kept_batch()`'s at those rows."""
        a = self.tail.arrays()
        return TokenBatch(a["lp"][rows], a["lq"][rows])

    def kept_batch(self) -> TokenBatch:
        """Every kept token as a TokenBatch (input order)."""
        return self._subset(None)[1]  # (never let go)

    def hits(self, job: engine.Job) -> np.ndarray:
        """Masked tokens at each of the job's values (exact where `covers(job)`)."""
        return self._counts(job)

    def _unit_weights(self, B: int, unit: str, seed: int):
        """(ids of the units, (units, B) weights, (B,) weighted tokens, unit of each kept
        token as an index into ids)."""
        if self._weights is not None and self._weights[0] == (B, unit, seed):
            return self._weights[1]
        ids, n, where = self._units(unit)
        wt = engine.poisson_weights(ids, B, seed, transposed=True, dtype=np.uint8)
        got = (ids, wt, replicate_tokens(n, wt), where)
        self._weights = ((B, unit, seed), got)
        return got

    def _units(self, unit: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids of the bootstrap units, each unit's loss tokens, the unit of each kept token
        as an index into ids): sequences as the replay numbered them, or steps (cached)."""
        got = self._unit_cache.get(unit)
        if got is not None:
            return got
        a = self.tail.arrays()
        none = np.zeros(0, dtype=np.int64)  # a tail that kept no token has no "seq", "step"
        if unit == "sequence":
            n = self.main.seq_stats().n
            got = np.arange(n.shape[0], dtype=np.int64), n, a.get("seq", none)
        else:
            steps = sorted(self.tail.step_counts)
            ids = np.asarray(steps, dtype=np.int64)
            n = np.asarray([self.tail.step_counts[s] for s in steps], dtype=np.float64)
            got = ids, n, np.searchsorted(ids, a.get("step", none).astype(np.int64))
        self._unit_cache[unit] = got
        return got

    def prepare(self, jobs, bootstrap: tuple[int, str, int] | None = None) -> None:
        """Score and check the coverage of every token job's rule and parameter in `jobs`,
        and draw the bootstrap's weights ((B, unit, seed)), before `map` runs work on them
        in threads (what the threads then read is in the caches, made once). The scores are
        made a coordinate at a time, each coordinate's batch (its tokens' log-probs and
        derived values: l, |dp|, the ratio, the KLs, ~0.17 GB at 50M tokens for choose's four)
        let go once its rules are scored, so that the next one, and what comes after,
        reuse that memory rather than touch new pages; a rule scored later on the subset
        gathers it again."""
        todo: dict[tuple, engine.Job] = {}
        for j in jobs:
            if j.rule.level == "token" and _key(j) not in self._cover:
                todo.setdefault(_key(j), j)
        groups: dict[int | None, list] = {}
        for k, j in todo.items():  # what threads must not make at once: the Tally's
            c = self._coordinate(j, k)  # flush (its exact counts), the subsets' indices
            self._index(c)
            groups.setdefault(c, []).append((k, j))
            if k not in self._exact:
                self._exact[k] = self._evaluated(k)
        if bootstrap is not None and bootstrap[0] and self.can_resample(bootstrap[1]):
            self._unit_weights(*bootstrap)

        def score_all(c):  # one coordinate's rules, then its batch goes
            for k, j in groups[c]:
                self.score(j, k)
            if c is not None:
                self._sub.pop(c, None)

        self.map(score_all, sorted(groups, key=lambda c: -len(groups[c])))
        self.map(self.cover, list(todo.values()))

    def map(self, fn, items: list) -> list:
        """[fn(x) for x in items], in the process's worker threads (fast.executor: the
        kernels and numpy's large operations release the GIL); in order."""
        n = min(threads(), len(items))
        if n < 2:
            return [fn(x) for x in items]
        return list(executor(n).map(fn, items))

    def sequence_weights(self, B: int, seed: int) -> np.ndarray:
        """(B, sequences) Poisson weights of the sequences (Tally.seq_unit_weights' draws
        with unit "sequence"), made once for this tail's replicates and the sequence rules'."""
        return self._unit_weights(B, "sequence", seed)[1].T

    def can_resample(self, unit: str) -> bool:
        """Does the tail know each unit's tokens (sequence ids, or step counts)?"""
        if unit == "sequence":
            return self.main.has_seq and "seq" in self.tail.arrays()
        return self.tail.count_steps and "step" in self.tail.arrays()

    def replicates(self, job: engine.Job, B: int, unit: str, seed: int):
        """((B, K) replicate masked tokens at the job's values, (B,) replicate tokens)."""
        _, wt, tokens, where = self._unit_weights(B, unit, seed)
        rows, b, order = self._bins(job)
        hit = b > 0
        units, bh = where[rows[hit]], b[hit]
        # a run of tokens of one unit in one bin (a sequence's tokens are adjacent) as one
        # entry with its length: weights and counts are integers, so the sums are the same
        new = np.ones(units.shape[0], dtype=bool)
        new[1:] = (units[1:] != units[:-1]) | (bh[1:] != bh[:-1])
        starts = np.flatnonzero(new)
        mult = np.diff(np.append(starts, units.shape[0])).astype(np.float64)
        rep = replicate_bins(units[starts], bh[starts], mult, wt, len(job.values) + 2)
        return suffix_values(job, rep, order), tokens

    def _settings(self, rules) -> list[engine.Job] | None:
        """Each rule at its setting as a one-value job, where every one is a token mask rule
        this replay held at that value with every masked token kept (`covers`); else None."""
        jobs = [engine.single_job(r) for r in rules]
        if not all(j.rule.level == "token" and j.rule.kind == "mask" for j in jobs):
            return None
        if not all(self.covers(j) and self._coordinate(j) is not None for j in jobs):
            return None
        return jobs

    def _cost(self, bins: engine.JobBins, rows, bh, g, totals: dict) -> None:
        """What a mask costs into a one-value job's group bins (`_grouped`'s): the masked
        kept tokens `rows` (bins `bh`, groups `g`) by direction, their |A| and finite
        entropies from the kept ones; bin 0 of the sums the rest of each group's `totals`
        ("amass", "ent", "ent_n": (G,) each, those the replay kept). Bin 0 of the
        corrective and divergent counts stays 0: no column reads it (the masked tokens
        are the bins above it)."""
        has_adv, has_ent = self.main.cost_columns
        a = self.tail.arrays()
        width = bins.count.shape[1]
        idx = g * width + bh
        size = bins.count.size
        dirn = absadv = ent = None
        if has_adv and "amass" in totals:
            adv = a.get("advantage", np.zeros(0))[rows]
            dirn, absadv = direction_class(a["lp"][rows], a["lq"][rows], adv), np.abs(adv)
        if has_ent and "ent" in totals and "ent_n" in totals:
            ent = a.get("entropy", np.zeros(0))[rows]
        if dirn is None and ent is None:
            return
        bins.add_cost(idx, size, dirn, absadv, ent)
        for name in ("amass",) * (dirn is not None) + ("ent", "ent_n") * (ent is not None):
            arr = getattr(bins, name)
            arr[:, 0] = np.asarray(totals[name], dtype=arr.dtype) - arr[:, 1:].sum(axis=1)

    def _grouped(self, job: engine.Job, group_of, n, mass, totals=None) -> tuple:
        """A one-value job's bins (G x 3) with each masked token in group `group_of(rows,
        batch)[i]` (its kept-token indices and `batch` of them -> groups; -1: none), the rest
        of each group from its totals `n` (tokens) and `mass` (|dp|), what a mask costs
        where `totals` has the groups' sums of it (`_cost`), and its masked tokens'
        (kept-token indices, bins). The groups and |dp| are computed for the masked tokens
        only (once per setting: by_q_bucket and attach_by_step share them), in input order:
        the same values, added in the same order, as read from every kept token's."""
        k = (_key(job), tuple(job.values.tolist()))
        got = self._hit.get(k)  # by_q_bucket, attach_by_step: the same settings
        if got is None:
            rows, b, _ = self._bins(job)
            hit = b > 0
            got = self._hit[k] = (rows[hit], b[hit], self.batch(rows[hit]))
        rows, bh, tb = got
        G, width = n.shape[0], len(job.values) + 2
        bins = engine.JobBins(count=np.zeros((G, width), dtype=np.int64), mass=np.zeros((G, width)))
        g = group_of(rows, tb)
        np.add.at(bins.count, (g, bh), 1)
        np.add.at(bins.mass, (g, bh), tb.abs_dp)
        bins.count[:, 0] = np.asarray(n, dtype=np.int64) - bins.count[:, 1:].sum(axis=1)
        bins.mass[:, 0] = mass - bins.mass[:, 1:].sum(axis=1)
        if totals:
            self._cost(bins, rows, bh, g, totals)
        return bins, rows, bh

    def by_q_bucket(self, rules) -> engine.Tally | None:
        """The settings `rules` by inference-probability bucket, as a `--by q_bucket` replay
        counts them (its table: `readout.sweep_table`), from the kept tokens: each
        setting's masked tokens and their |dp| per bucket, the rest of each bucket from the
        kernel's per-bucket totals (`Tail.q_counts`, `q_mass`). None where the tail cannot
        say (`_settings`), or the replay counted no bucket totals. Counts are the replay's
        exactly; the mass sums, added in another order, to the last bits."""
        t = self.tail
        jobs = self._settings(rules) if t.q_counts is not None and t.q_mass is not None else None
        if jobs is None:
            return None
        edges = np.asarray(engine.Q_BUCKET_EDGES)
        present = np.flatnonzero(t.q_counts > 0)
        row = np.full(edges.size, -1, dtype=np.int64)
        row[present] = np.arange(present.size)

        def group_of(rows, tb):  # the q bucket of the masked tokens only
            return row[np.searchsorted(edges, tb.q, side="right") - 1]

        n, mass = t.q_counts[present], t.q_mass[present]
        totals = {k: v[present] for k, v in t.q_cost.items()}
        bins = [self._grouped(j, group_of, n, mass, totals)[0] for j in jobs]
        tally = engine.Tally(jobs, "q_bucket", scatter=False)
        tally.set_bins([float(edges[k]) for k in present], bins)
        return tally

    def by_length(self, rules) -> engine.Tally | None:
        """The settings `rules` by sequence-length bucket, as a `--by length` replay counts
        them (its table: `readout.sweep_table`), from this replay's sequences and kept
        tokens: each sequence's bucket is that of its loss tokens (the replay's sequence
        statistics), a sequence rule is scored on those statistics, a token rule's masked
        tokens are kept ones (`_settings`), the rest of each bucket from its sequences'
        tokens and |dp|. None where the replay has no sequences, or a rule is neither (or
        a token rule's masked tokens are not all kept)."""
        main, a = self.main, self.tail.arrays()
        if not main.has_seq or "seq" not in a or not len(main.sequences):
            return None
        token = [r for r in rules if r.level == "token"]
        if any(r.level not in ("token", "sequence") for r in rules):
            return None
        tjobs = self._settings(token) if token else []
        if tjobs is None:
            return None
        st = main.seq_stats()
        b = engine.length_bucket(st.n.astype(np.int64))
        present = np.unique(b)
        seq_group = np.searchsorted(present, b)
        G = present.size
        mass = main.sequences.column("mass")
        n_g = np.bincount(seq_group, weights=st.n, minlength=G)
        mass_g = np.bincount(seq_group, weights=mass, minlength=G)
        seq = a["seq"]
        cost = main.seq_cost()
        totals = seq_totals(cost, seq_group, G)
        done = iter(tjobs)
        jobs, bins = [], []
        for rule in rules:
            if rule.level == "sequence":
                job = engine.single_job(rule)
                got = sequence_bins(job, st, seq_group, G, mass, cost)
            else:
                job = next(done)
                got, rows, bh = self._grouped(
                    job, lambda r, _: seq_group[seq[r]], n_g, mass_g, totals
                )
                sb = np.zeros(len(main.sequences))
                np.maximum.at(sb, a["seq"][rows], bh.astype(float))
                got.seq_count = seq_count(seq_group, sb, len(job.values) + 2, G)
                got.seq_bin = sb
            jobs.append(job)
            bins.append(got)
        tally = engine.Tally(jobs, "length", scatter=False)
        tally.set_bins([1 << int(v) for v in present], bins)
        tally.notes += self._cost_notes(totals)
        return tally

    def attach_by_step(self, rules, by_step: engine.Tally) -> bool:
        """Add the settings `rules` to `by_step`, a Tally by step of the same read (its
        metrics and sequences, no jobs of these), counted from the kept tokens as its replay
        would count them: per step the masked tokens and |dp|, the rest from its metric
        sums, each sequence's highest bin (the masked-sequence and prompt-group counts).
        False (nothing added) where the tail cannot say (`_settings`), or the kept tokens
        carry no step, or `by_step` numbered other sequences."""
        a = self.tail.arrays()
        jobs = self._settings(rules)
        if jobs is None or by_step.by != "step" or "step" not in a:
            return False
        if by_step.has_seq and ("seq" not in a or by_step.seq_keys != self.main.seq_keys):
            return False
        values = np.asarray(by_step.groups)
        order = np.argsort(values, kind="stable")
        pos = np.minimum(np.searchsorted(values[order], a["step"]), max(values.size - 1, 0))
        if values.size == 0 or (values[order][pos] != a["step"]).any():
            return False
        group = order[pos]
        G = values.size
        n, mass = by_step.metrics.s["n"][:G], by_step.metrics.s["abs_dp"][:G]
        # each step's |A| from the per-sequence sums (a sequence lies in one step), its
        # entropy from the step Tally's metrics
        totals = {
            "ent": by_step.metrics.s["entropy"][:G],
            "ent_n": by_step.metrics.s["entropy_n"][:G],
        }
        cost = self.main.seq_cost() if by_step.has_seq else None
        if cost is not None and cost[1] is not None:
            totals["amass"] = seq_totals(cost, by_step.sequences.group(), G)["amass"]
        bins, seq_bins = [], []
        for j in jobs:
            got, rows, bh = self._grouped(j, lambda r, _: group[r], n, mass, totals)
            bins.append(got)
            if by_step.has_seq:
                sb = np.zeros(len(by_step.sequences))
                np.maximum.at(sb, a["seq"][rows], bh.astype(float))
                seq_bins.append(sb)
        by_step.attach(jobs, bins, seq_bins if by_step.has_seq else None)
        by_step.notes += [w for w in self._cost_notes(totals) if w not in by_step.notes]
        return True

    def _cost_notes(self, totals: dict) -> list[str]:
        """Why a grouped table from the tail leaves columns of what a mask costs null
        where the log has them: the replay kept no per-group totals of them."""
        has_adv, _ = self.main.cost_columns
        if has_adv and "amass" not in totals:
            return [
                "masked_corrective, masked_divergent, masked_neutral, "
                "masked_corrective_fraction, masked_adv_mass and masked_adv_mass_fraction "
                "are null in the grouped table: the replay kept no per-group |A| sums "
                "(no sequence rule, or no sample_id)"
            ]
        return []

    def spread(self, job: engine.Job, unit: str) -> float | None:
        """The bootstrap's relative standard error of the masked fraction at the job's one
        value (units resampled with Poisson(1) weights, the ratio estimator's delta
        method); None where nothing is masked."""
        _, n, where = self._units(unit)
        c = np.bincount(where[self.masked_rows(job)], minlength=n.shape[0]).astype(float)
        total = c.sum()
        if total == 0:
            return None
        f = total / n.sum()
        var = (c * c).sum() - 2.0 * f * (c * n).sum() + f * f * (n * n).sum()
        return float(np.sqrt(max(var, 0.0)) / total)


def seq_totals(cost: tuple | None, seq_group: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """Each group's sums of what a mask costs ("amass", "ent", "ent_n") from the
    per-sequence sums `cost` (Tally.seq_cost; None: none) and each sequence's group."""
    out: dict[str, np.ndarray] = {}
    if cost is None:
        return out
    _, amass, ent = cost
    if amass is not None:
        out["amass"] = np.bincount(seq_group, weights=amass, minlength=G)[:G]
    if ent is not None:
        out["ent"] = np.bincount(seq_group, weights=ent[0], minlength=G)[:G]
        out["ent_n"] = np.bincount(seq_group, weights=ent[1], minlength=G)[:G]
    return out


def replicate_tokens(n: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """(B,) per replicate, the sum over units of the unit's tokens `n` times its weight
    (wt: (units, B), uint8 or float64): integers, exact in any order, with no float64 copy
    of the weights."""
    units = np.arange(n.shape[0], dtype=np.int64)
    return replicate_bins(units, np.zeros(n.shape[0], dtype=np.int64), n, wt, 1)[:, 0]


def sorted_counts(s_sorted: np.ndarray, thr: np.ndarray, inclusive: bool) -> np.ndarray:
    """The scores `s_sorted` (ascending) masked at each threshold `thr` (not NaN): those
    above it (at or above, `inclusive`), and +inf at every one -- the counts that binning
    (`fast.bin_scores`, +inf in bin K + 1) and `suffix_values` give, in O(K log n). NaN
    scores raise, as there."""
    n = s_sorted.shape[0]
    if n and np.isnan(s_sorted[-1]):  # np.sort puts NaN last
        raise AssertionError("internal error: a rule produced NaN scores")
    side = "left" if inclusive else "right"
    got = n - np.searchsorted(s_sorted, thr, side=side).astype(np.int64)
    if not inclusive and (thr == np.inf).any():  # nothing exceeds +inf; +inf is masked
        got[thr == np.inf] = n - np.searchsorted(s_sorted, np.inf, side="left")
    return got


def suffix_values(job: engine.Job, a: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
    """Per-bin counts (..., K + 2) in threshold order -> masked at each value (..., K), in
    the job's value order (bin j holds the tokens that pass exactly j thresholds); `order`:
    the job's `order`, where the caller has it."""
    rev = np.cumsum(a[..., ::-1], axis=-1)[..., ::-1]
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order if order is None else order] = np.arange(len(job.values))
    return rev[..., inv + 1]


__all__ = ["TailCounts", "replicate_tokens", "suffix_values"]
