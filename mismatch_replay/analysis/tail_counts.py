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
"""

from __future__ import annotations

import numpy as np

from .. import engine
from ..engine import readout
from ..engine.bins import seq_count
from ..engine.tally import sequence_bins
from ..fast import bin_scores, executor, replicate_bins, threads
from ..rules import TokenBatch


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
        self._sub: dict[int | None, tuple[np.ndarray | None, TokenBatch]] = {}
        self._scores: dict[tuple, np.ndarray] = {}
        self._cover: dict[tuple, float] = {}
        self._live: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # `_view`
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

    def _coordinate(self, job: engine.Job) -> int | None:
        """The kernel coordinate the replay binned this rule and parameter on (its kept
        tokens are those with that coordinate's bit), or None: every kept token."""
        program = self.main.program
        if program is None:
            return None
        k = _key(job)
        for ji, mj in enumerate(self.main.jobs):
            if mj.rule.level == "token" and _key(mj) == k and program.slot[ji] >= 0:
                slot = program.slot[ji]
                for c, coord in enumerate(program.coords):
                    if slot in coord.slots:
                        return c
        return None

    def _subset(self, c: int | None) -> tuple[np.ndarray | None, TokenBatch]:
        """(indices into the kept tokens, their TokenBatch) of coordinate c's tail."""
        got = self._sub.get(c)
        if got is None:
            a = self.tail.arrays()
            idx = None if c is None else np.flatnonzero(a["bits"] & np.uint32(1 << c))
            adv = a.get("advantage")
            if idx is None:
                tb = TokenBatch(a["lp"], a["lq"], adv)
            else:
                tb = TokenBatch(a["lp"][idx], a["lq"][idx], None if adv is None else adv[idx])
            got = self._sub[c] = (idx, tb)
        return got

    def score(self, job: engine.Job) -> np.ndarray:
        """The rule's score of the kept tokens on its coordinate (cached per rule and
        parameter)."""
        k = _key(job)
        s = self._scores.get(k)
        if s is None:
            _, tb = self._subset(self._coordinate(job))
            s = np.asarray(job.rule.score(tb, job.param), dtype=np.float64)
            self._scores[k] = s
        return s

    def _view(self, job: engine.Job) -> tuple[np.ndarray, np.ndarray]:
        """(kept-token indices, their scores) of the tokens the job's counts read: its
        coordinate's kept tokens, or, where every value of the job is at least as strict as
        the covered threshold, only those masked there (`live`: the others are masked at
        none of its values). Cached per rule and parameter."""
        k = _key(job)
        idx, _ = self._subset(self._coordinate(job))
        s = self.score(job)
        c = self._cover.get(k)
        if c is None or not np.isfinite(c) or len(job.values) == 0 or job.thresholds.min() < c:
            return (np.arange(s.shape[0]) if idx is None else idx), s
        got = self._live.get(k)
        if got is None:
            live = np.flatnonzero(s >= c if job.rule.inclusive else s > c)
            got = self._live[k] = ((live if idx is None else idx[live]), s[live])
        return got

    def _bins(self, job: engine.Job) -> tuple[np.ndarray, np.ndarray]:
        """(kept-token indices, each one's bin on the job's sorted thresholds)."""
        rows, s = self._view(job)
        return rows, bin_scores(s, job.sorted_thresholds, job.rule.inclusive)

    def _counts(self, job: engine.Job) -> np.ndarray:
        """Kept tokens masked at each of the job's values (values' order)."""
        _, b = self._bins(job)
        width = len(job.values) + 2
        return suffix_values(job, np.bincount(b, minlength=width))

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
        """Are all of the job's values at least as strict as the covered threshold?"""
        if job.rule.level != "token" or len(job.values) == 0:
            return False
        return bool(job.thresholds.min() >= self.cover(job))

    def masked(self, job: engine.Job) -> np.ndarray:
        """Which kept tokens (all of them, in input order) the rule masks at the job's one
        value (every masked token of the log where `covers(job)`)."""
        rows, b = self._bins(job)
        out = np.zeros(self.tail.kept, dtype=bool)
        out[rows[b > 0]] = True
        return out

    def kept_batch(self) -> TokenBatch:
        """Every kept token as a TokenBatch (input order)."""
        return self._subset(None)[1]

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
        if unit == "sequence":
            n = self.main.seq_stats().n
            got = np.arange(n.shape[0], dtype=np.int64), n, a["seq"]
        else:
            steps = sorted(self.tail.step_counts)
            ids = np.asarray(steps, dtype=np.int64)
            n = np.asarray([self.tail.step_counts[s] for s in steps], dtype=np.float64)
            got = ids, n, np.searchsorted(ids, a["step"].astype(np.int64))
        self._unit_cache[unit] = got
        return got

    def prepare(self, jobs, bootstrap: tuple[int, str, int] | None = None) -> None:
        """Score and check the coverage of every token job's rule and parameter in `jobs`,
        and draw the bootstrap's weights ((B, unit, seed)), before `map` runs work on them
        in threads (what the threads then read is in the caches, made once)."""
        todo: dict[tuple, engine.Job] = {}
        for j in jobs:
            if j.rule.level == "token" and _key(j) not in self._cover:
                todo.setdefault(_key(j), j)
        for k, j in todo.items():  # what threads must not make at once: the Tally's
            self._subset(self._coordinate(j))  # flush (its exact counts), the subsets
            if k not in self._exact:
                self._exact[k] = self._evaluated(k)
        if bootstrap is not None and bootstrap[0] and self.can_resample(bootstrap[1]):
            self._unit_weights(*bootstrap)
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
        rows, b = self._bins(job)
        hit = b > 0
        units = where[rows[hit]]
        rep = replicate_bins(units, b[hit], np.ones(units.shape[0]), wt, len(job.values) + 2)
        return suffix_values(job, rep), tokens

    def _settings(self, rules) -> list[engine.Job] | None:
        """Each rule at its setting as a one-value job, where every one is a token mask rule
        this replay held at that value with every masked token kept (`covers`); else None."""
        jobs = [engine.single_job(r) for r in rules]
        if not all(j.rule.level == "token" and j.rule.kind == "mask" for j in jobs):
            return None
        if not all(self.covers(j) and self._coordinate(j) is not None for j in jobs):
            return None
        return jobs

    def _grouped(self, job: engine.Job, group: np.ndarray, n, mass) -> tuple:
        """A one-value job's bins (G x 3) with each kept token in group `group[i]` (-1:
        none), the rest of each group from its totals `n` (tokens) and `mass` (|dp|), and
        its masked tokens' (kept-token indices, bins)."""
        rows, b = self._bins(job)
        hit = b > 0
        rows, bh = rows[hit], b[hit]
        G, width = n.shape[0], len(job.values) + 2
        bins = engine.JobBins(count=np.zeros((G, width), dtype=np.int64), mass=np.zeros((G, width)))
        g = group[rows]
        np.add.at(bins.count, (g, bh), 1)
        np.add.at(bins.mass, (g, bh), self.kept_batch().abs_dp[rows])
        bins.count[:, 0] = np.asarray(n, dtype=np.int64) - bins.count[:, 1:].sum(axis=1)
        bins.mass[:, 0] = mass - bins.mass[:, 1:].sum(axis=1)
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
        group = row[np.searchsorted(edges, self.kept_batch().q, side="right") - 1]
        n, mass = t.q_counts[present], t.q_mass[present]
        bins = [self._grouped(j, group, n, mass)[0] for j in jobs]
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
        group = seq_group[a["seq"]]
        done = iter(tjobs)
        jobs, bins = [], []
        for rule in rules:
            if rule.level == "sequence":
                job = engine.single_job(rule)
                got = sequence_bins(job, st, seq_group, G, mass)
            else:
                job = next(done)
                got, rows, bh = self._grouped(job, group, n_g, mass_g)
                sb = np.zeros(len(main.sequences))
                np.maximum.at(sb, a["seq"][rows], bh.astype(float))
                got.seq_count = seq_count(seq_group, sb, len(job.values) + 2, G)
                got.seq_bin = sb
            jobs.append(job)
            bins.append(got)
        tally = engine.Tally(jobs, "length", scatter=False)
        tally.set_bins([1 << int(v) for v in present], bins)
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
        bins, seq_bins = [], []
        for j in jobs:
            got, rows, bh = self._grouped(j, group, n, mass)
            bins.append(got)
            if by_step.has_seq:
                sb = np.zeros(len(by_step.sequences))
                np.maximum.at(sb, a["seq"][rows], bh.astype(float))
                seq_bins.append(sb)
        by_step.attach(jobs, bins, seq_bins if by_step.has_seq else None)
        return True

    def spread(self, job: engine.Job, unit: str) -> float | None:
        """The bootstrap's relative standard error of the masked fraction at the job's one
        value (units resampled with Poisson(1) weights, the ratio estimator's delta
        method); None where nothing is masked."""
        _, n, where = self._units(unit)
        rows, b = self._bins(job)
        c = np.bincount(where[rows[b > 0]], minlength=n.shape[0]).astype(float)
        total = c.sum()
        if total == 0:
            return None
        f = total / n.sum()
        var = (c * c).sum() - 2.0 * f * (c * n).sum() + f * f * (n * n).sum()
        return float(np.sqrt(max(var, 0.0)) / total)


def replicate_tokens(n: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """(B,) per replicate, the sum over units of the unit's tokens `n` times its weight
    (wt: (units, B), uint8 or float64): integers, exact in any order, with no float64 copy
    of the weights."""
    units = np.arange(n.shape[0], dtype=np.int64)
    return replicate_bins(units, np.zeros(n.shape[0], dtype=np.int64), n, wt, 1)[:, 0]


def suffix_values(job: engine.Job, a: np.ndarray) -> np.ndarray:
    """Per-bin counts (..., K + 2) in threshold order -> masked at each value (..., K), in
    the job's value order (bin j holds the tokens that pass exactly j thresholds)."""
    rev = np.cumsum(a[..., ::-1], axis=-1)[..., ::-1]
    inv = np.empty(len(job.values), dtype=np.int64)
    inv[job.order] = np.arange(len(job.values))
    return rev[..., inv + 1]


__all__ = ["TailCounts", "replicate_tokens", "suffix_values"]
