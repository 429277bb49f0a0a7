"""The Tally: the additive summary of one pass over a log, filled batch by batch.

Design
------
`Tally.add_batch` takes a batch of canonical rows and adds, for every job (jobs.py), its
tokens to per-bin sums (bins.py: bin j holds the tokens above exactly j of the K sorted
thresholds, so the masked count at every grid point is a suffix sum), plus the mismatch
metric sums (metrics.py), the two scatter histograms and, for a log with sequence ids, the
per-sequence sums (sequences.py) and each token job's highest bin per sequence (every rule
then reports the sequences it touches). Its parts, each with one owner:

- token bins (`bins`, `seq_max`), filled by the fused path or the simple path;
- the sequences (`sequences`: keys, SEQ_STATS sums, codes), scored at the end
  (`job_bins` bins the sequence rules' scores);
- m2po (`m2po_part`, m2po.py: the per-step store and the bins of the steps resolved);
- the scatter (`hist_lin`, `hist_log`) and the metrics (`metrics`);
- with bootstrap=, the Poisson replicates of the token jobs' counts (`boot_*`); with
  robust=, per-group log10 k3 histograms and top tokens (`k3_hist`, `top`); with a
  `tail` (tail.py, fused path only), the tokens beyond per-coordinate cutoffs, kept for
  exact counts at thresholds chosen after the pass.

One read, several Tallies (engine.replay_together): a Tally that needs no kernel pass of
its own (the report's per-step one) takes its metrics and sequence sums from the first
Tally's pass, bit for bit what its own pass would give (lead.py: `Leading`, a mixin).

Bins counted elsewhere come in two ways, both from a replay's kept tokens
(analysis/tail_counts.py): `set_bins` makes an unfed Tally one with those groups and bins
(the report's per-bucket and by-length tables), `attach` adds token jobs to a replayed one
(its per-step settings, on its sequences and metrics). The readout reads them as it reads
a replay's.

Two paths fill the token bins. The *fused* one (fast/: numba) bins each token's
coordinates once for every token job the program derives from the rules' score(), with the
metrics, the scatter and the sequence sums, in one loop over the batch split over the
cores; the tokens it cannot settle (ties with a threshold) come back flagged and take the
simple path here. The *simple* one is numpy, rule by rule (`rule.score()`, a search against
the sorted thresholds, `np.bincount`): the reference the fused path is tested against, and
what runs without numba, for bootstraps and for float32 replays. `paths()` says which path
computed each job, and why.

Grouping (`by`): every token gets a group code before the paths run, so both group
identically (groups.py: `Grouping`, a mixin, with the groups' design). Every piece of a
Tally is a sum, a max or a min, so `Tally + Tally` merges shards exactly, whatever the
split into files, batches or threads (a sequence of unknown length, or an m2po step
resolved in one of them, is refused).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from .. import fast
from ..ingest import ReadReport
from ..metrics import MetricSums
from ..present import Presentable, sweep_lines
from ..rules import LOG_CLAMP, SeqStats, TokenBatch, seq_extras
from .bins import (
    SCATTER_BINS,
    SCATTER_LOG10_MIN,
    Grow,
    JobBins,
    accumulate,
    direction_class,
    new_bins,
    poisson_weights,
    scatter_index,
    seq_count,
)
from .groups import Q_EDGES, Grouping
from .jobs import Job
from .lead import Leading
from .m2po import M2POStore, M2POTally
from .readout import sweep_table
from .robust import add_robust
from .sequences import SUMS, Sequences, partials
from .tail import Tail, sample_of

_NONE = np.zeros(0, dtype=np.int64)


@dataclass
class SweepResult(Presentable):
    """What sweep() returns: the table, the metrics, the Tally, and each job's path."""

    table: pl.DataFrame  # the long sweep table (one row per job x value x group)
    metrics: pl.DataFrame  # mismatch metrics per group
    tally: Tally
    notes: list[str] = field(default_factory=list)  # e.g. rules skipped for lack of a column
    warnings: list[str] = field(default_factory=list)  # e.g. a preset's framework quirk
    # where a float32 preset's count differs from its exact one (engine/precision_note.py)
    precision_notes: list = field(default_factory=list)
    # per job, in job order: {"rule", "param", "path": "fused" | "simple", "reason"}
    # (Tally.paths)
    paths: list[dict] = field(default_factory=list)

    def summary_lines(self) -> list[str]:
        """What `print(result)` shows (present.sweep_lines)."""
        t = self.tally
        n = t.report.loss_rows
        return sweep_lines("SweepResult", self.table, self.metrics, n, t.by, self.paths,
                           self.notes, self.warnings)  # fmt: skip

    def to_dict(self) -> dict:
        """The table's rows, the metrics, each job's path, the notes (plain Python)."""
        return {
            "rows": self.table.to_dicts(),
            "metrics": self.metrics.to_dicts(),
            "paths": [dict(p) for p in self.paths],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
        }


@dataclass
class Tally(Leading, Grouping, Presentable):
    """Additive summary of one pass over a log: enough to answer every sweep question."""

    jobs: list[Job]
    by: str | None = None
    has_seq: bool = False
    has_adv: bool = False
    groups: list = field(default_factory=list)
    bins: list[JobBins | None] = field(default_factory=list)
    metrics: MetricSums = field(default_factory=MetricSums)
    # each token job's highest bin per sequence (by global sequence id; -1: none)
    seq_max: dict[int, Grow] = field(default_factory=dict)
    # scatter histograms, [q bin, p bin]: linear probability axes and log10 axes
    hist_lin: np.ndarray = field(
        default_factory=lambda: np.zeros((SCATTER_BINS, SCATTER_BINS), np.int64)
    )
    hist_log: np.ndarray = field(
        default_factory=lambda: np.zeros((SCATTER_BINS, SCATTER_BINS), np.int64)
    )
    report: ReadReport = field(default_factory=ReadReport)
    notes: list[str] = field(default_factory=list)
    # prime-rl conventions (match="prime-rl"): 1 / loss tokens of each sequence, by sequence id
    inv_n: np.ndarray | None = None
    # --by length: loss tokens of each sequence, by sequence id, counted by replay's pre-pass
    seq_len: np.ndarray | None = None
    # prompt groups (the log has a group_id): each sequence's (step, group_id) code
    has_pgroup: bool = False
    rule_warnings: list[str] = field(default_factory=list)
    # streaming Poisson bootstrap over units ("sequence" or "step"), see poisson_weights
    boot_replicates: int = 0
    boot_unit: str | None = None
    boot_seed: int = 0
    boot_counts: dict[int, np.ndarray] = field(default_factory=dict)  # (B, K + 2) per job
    boot_tokens: np.ndarray | None = None  # (B,) weighted loss tokens
    # "adv": the replicates sum |A| instead of counting tokens (choose --of adv-mass)
    boot_weight: str | None = None
    robust: bool = False
    # the tokens beyond per-coordinate cutoffs, kept for exact counts after the pass (tail.py)
    tail: Tail | None = None
    # False: no scatter histograms (a side Tally of a shared read, whose figures need none)
    scatter: bool = True
    k3_hist: np.ndarray | None = None  # (G, K3_BINS + 1) token counts
    k3_hist_sum: np.ndarray | None = None  # (G, K3_BINS + 1) sum of k3 per bin
    top: dict = field(default_factory=dict)  # group index -> {"k3", "step", "sample_id", ...}
    # the arithmetic of the rule decisions ("float32": as the frameworks run them on the
    # GPU; the simple path, see replay()); metrics and the scatter stay float64
    precision: str = "float64"
    # called once, on the first batch's sample (tail.sample_of), before any token is
    # counted: returns the jobs to count instead (the same rules and parameters, in order;
    # a search's first grids shaped on the log: analysis/search.py)
    shape: Callable | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not self.bins:
            self.bins = [
                None
                if j.rule.level != "token"
                else new_bins(len(j.values), 0, j.rule.kind == "weight", self.inv_n is not None)
                for j in self.jobs
            ]
        self.sequences = Sequences()
        self.m2po_part = M2POTally(self.jobs)
        self._gidx = {v: i for i, v in enumerate(self.groups)}
        self._fused: fast.Fused | None = None  # the fused path's accumulators
        self._fused_off: str | None = None  # why the simple path runs everything
        self._paths: list[dict] | None = None  # each job's path, once decided
        self._scratch: dict[str, np.ndarray] = {}
        self._prompt_cache: tuple[int, tuple | None] | None = None
        self._external = False  # set_bins: the bins were counted elsewhere
        self._cost_cols: tuple[bool, bool] | None = None  # (advantage, entropy) in the log
        self._init_leading()  # one read's Tallies: lead.py
        self.version = 0  # bumped by every change (m2po's bins and the layout cache on it)
        # m2po ranks one l^2 per token: in float32 when a float32 m2po job runs (then every
        # m2po job of this Tally ranks in float32; replay() says so). Token and sequence
        # jobs decide in their own rule's precision.
        if any(j.rule.precision == "float32" and j.rule.level == "step" for j in self.jobs):
            self.precision = "float32"
        # verl's sequence presets read sums of l clamped to +-20 (SeqStats.sum_lc, sum_k3c),
        # float32 sequence rules the float32 twins: kept only when a job needs them (the
        # fused kernel does not compute them)
        self.seq_extras = seq_extras(self.jobs)
        self.clamped_seq = "clamped" in self.seq_extras

    # -- the parts' public faces
    @property
    def seq_keys(self) -> dict:
        """(step, sample_id) -> global sequence id, in order of appearance."""
        return self.sequences.keys

    @seq_keys.setter
    def seq_keys(self, keys: dict) -> None:
        self.sequences.keys = keys

    @property
    def program(self) -> fast.Program | None:
        """The fused path's program of this Tally's token jobs (None: the simple path runs
        them, or no batch came yet): which kernel coordinate bins which job."""
        return self._fused.p if self._fused is not None else None

    @property
    def m2po(self) -> M2POStore:
        """m2po's store of the steps not resolved yet."""
        return self.m2po_part.store

    @property
    def m2po_sealed(self) -> set:
        """m2po's steps resolved during the replay."""
        return self.m2po_part.sealed

    # -- groups and sequences
    def seq_codes(self, df: pl.DataFrame) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Per-token global sequence ids of a batch, and (its distinct ids, each token's
        index into them): `Sequences.codes` (the arrays may be reused by the next call)."""
        return self.sequences.codes(df)

    # -- one batch
    def _fused_state(self) -> fast.Fused | None:
        """The fused path's state, or None where the simple path runs everything (the
        reason in `_fused_off`)."""
        if self._fused is not None or self._fused_off is not None:
            return self._fused
        if self.boot_replicates:
            self._fused_off = "bootstrap replicates (the simple path)"
        elif self.precision != "float64":
            self._fused_off = f"{self.precision} m2po replay"
        elif fast.backend() != "numba":
            self._fused_off = _numpy_backend_reason()
        if self._fused_off is not None:
            return None
        has_adv, has_ent = self._cost_cols if self._cost_cols is not None else (self.has_adv, False)
        try:
            program = fast.Program(self.jobs, direction=has_adv, entropy=has_ent)
        except fast.TooManyCoordinates as exc:  # rare: the simple path, same counts
            self.notes.append(f"fast path off ({exc}); the numpy path runs every rule")
            self._fused_off = str(exc)
            return None
        self._fused = fast.Fused(program, seqfrac=self.inv_n is not None)
        return self._fused

    def _cost_notes(self) -> None:
        """Say why the columns of what a mask costs are null (readout.COST_COLUMNS)."""
        has_adv, has_ent = self._cost_cols
        if not has_adv:
            self.notes.append(
                "masked_corrective, masked_divergent, masked_neutral, "
                "masked_corrective_fraction, masked_adv_mass and masked_adv_mass_fraction "
                "are null: the log has no advantage column (map one with --map "
                "advantage=COLUMN)"
            )
        if not has_ent:
            self.notes.append(
                "entropy_mean and masked_entropy_mean are null: the log has no entropy column"
            )
        if any(j.rule.level == "step" for j in self.jobs) and (has_adv or has_ent):
            self.notes.append(
                "m2po's rows leave what a mask costs null (its steps keep no per-token classes)"
            )

    def paths(self) -> list[dict]:
        """Each job's path, in job order: {"rule": spec, "param": the swept parameter (None
        for a single setting), "path": "fused" or "simple", "reason": why simple (None when
        fused)}. Decided on the first batch (a Tally that saw none: as it would decide)."""
        if self._paths is None:
            fused = self._fused_state()
            reasons = fused.p.reasons if fused is not None else [self._fused_off] * len(self.jobs)
            self._paths = [_path(job, why) for job, why in zip(self.jobs, reasons, strict=True)]
        return self._paths

    def add_batch(self, df: pl.DataFrame) -> None:
        """Add a batch of canonical rows (loss tokens only) to every part."""
        self._batches += 1
        staged = self._staged
        if staged is not None and (staged[0] != self._batches or staged[1] != df.height):
            staged = self._staged = None  # not this batch's
        lp = df["trainer_logprob"].to_numpy()
        lq = df["inference_logprob"].to_numpy()
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        if self._cost_cols is None:  # the fused program keeps what a mask costs: decided
            self._cost_cols = (adv is not None, "entropy" in df.columns)  # on the 1st batch
            self._cost_notes()
            f = self._fused
            if (
                f is not None
                and not f.dirty
                and f.p.n
                and (f.p.direction, f.p.entropy) != (self._cost_cols)
            ):  # built before any batch (paths()): again, knowing, on as many threads
                self._fused, self._paths = None, None
                again = self._fused_state()
                if again is not None:
                    again.t = f.t
        if self.shape is not None and df.height:
            self._reshape(self.shape(sample_of(TokenBatch(lp, lq, adv))))
        has_m2po = bool(self.m2po_part.jobs)
        fused = self._fused_state()
        if self._paths is None:
            self.paths()
        slab = None
        if has_m2po and fused is not None:  # m2po's inputs go straight into its store's slab:
            # the kernel writes l^2 and |dp| there, the sequence ids are computed there
            slab = self.m2po_part.lease(len(lp), self.by is not None, self.has_seq)
        seq = None
        if self.has_seq:
            seq = self.sequences.codes(df, slab.arrays[3][: len(lp)] if slab else None)
        if self.has_pgroup and seq is not None:
            self.sequences.add_pgroups(df)
        g = staged[2] if staged is not None else self._group_codes(df, seq)
        G = len(self.groups)
        ent = df["entropy"].to_numpy() if "entropy" in df.columns else None
        self.version += 1
        cost = _Cost(lp, lq, adv, ent)  # what a mask costs: computed where first read
        if seq is not None and self._seq_cost and (adv is not None or ent is not None):
            if fused is not None:  # the kernel's pass (jit.seq_cost): no per-token arrays
                self.sequences.add_cost(seq[1][0], seq[1][1], None, None, ent, lp, lq, adv)
            else:
                self.sequences.add_cost(seq[1][0], seq[1][1], cost.dirn, cost.absadv, ent)
        if fused is None:
            if self.tail is not None:  # nothing kept: its consumers make a pass instead
                self.tail.refuse(f"the simple path ({self._fused_off})")
                self.tail.add(_NONE, _NONE, df, lp, lq, adv, None)
            self._add_batch_numpy(df, TokenBatch(lp, lq, adv), g, G, ent, seq, cost)
            return
        inv_tok = self.inv_n[seq[0]] if self.inv_n is not None else None
        tail_cut = None
        if self.tail is not None:
            if self.tail.cut is None:
                self.tail.set_cutoffs(fused.p.coords, TokenBatch(lp, lq, adv))
            tail_cut = self.tail.cut
        lin_w = 1.0 / SCATTER_BINS
        log_w = (0.0 - SCATTER_LOG10_MIN) / SCATTER_BINS
        into = None if slab is None else (slab.arrays[0][: len(lp)], slab.arrays[1][: len(lp)])
        out = self._shared_out(seq) if staged is not None else None
        self._staged = None
        self.led_batches += out is not None
        follow = None
        if out is None and self._follower is not None:  # a follower's metrics in this pass
            fused._grow(G)
            follow = self._follower._stage(df, fused)
        if out is None:
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
                m2po_into=into,
                scatter_consts=(0.0, lin_w, SCATTER_LOG10_MIN, log_w, SCATTER_BINS),
                log_clamp=LOG_CLAMP,
                tail_cut=tail_cut,
                q_edges=Q_EDGES if self.tail is not None and self.tail.count_q else None,
                scatter=self.scatter,
                clamped_seq=self.clamped_seq,
                follow=follow,
            )
        if follow is not None:  # for the follower's add_batch of this batch
            f = self._follower
            f._staged = (*f._staged[:3], (out.follow, out.seq, seq))
        if self.tail is not None:
            self._keep_tail(out.tail, df, lp, lq, adv, seq)
            self.tail.add_q_counts(out.q_counts, out.q_mass, out.q_cost)
        self.metrics.add_sums(out.msum, out.mmax, G)
        if self.scatter:
            self.hist_lin += out.hist_lin.reshape(SCATTER_BINS, SCATTER_BINS)
            self.hist_log += out.hist_log.reshape(SCATTER_BINS, SCATTER_BINS)
        if seq is not None:
            uniq, local = seq[1]
            parts = {k: v for k, v in out.seq.items() if adv is not None or k != "sum_adv"}
            parts["group"] = out.seq_first.astype(np.float64)
            rest = [s for s in SUMS if s.name not in out.seq and s.kept(self.seq_extras)]
            if rest:  # statistics the kernel does not compute (clamped, float32): numpy
                tb = TokenBatch(lp, lq, adv)
                parts |= partials(rest, tb, local, uniq.shape[0])
            self.sequences.merge(parts, uniq)
        if has_m2po and out.m2po_x is not None:
            self.m2po_part.add(
                df["step"].to_numpy(),
                out.m2po_x,
                out.m2po_mass,
                g if self.by is not None else None,
                seq[0] if seq is not None else None,
                slab,
            )
        tb = None
        for ji, job in enumerate(self.jobs):
            if job.rule.level != "token":
                continue
            slot = fused.p.slot[ji]
            if slot < 0:  # a rule the program does not compile: the simple path
                tb = tb if tb is not None else TokenBatch(lp, lq, adv)
                self._add_job_numpy(ji, job, tb, g, G, seq, None, cost.all())
            elif seq is not None:
                uniq = seq[1][0]
                acc = self.seq_max.setdefault(ji, Grow(-1.0))
                acc.ensure(len(self.sequences))
                acc.a[uniq] = np.maximum(acc.a[uniq], out.smax[:, slot])
        for c, idx in out.flagged:  # tokens inside a coordinate's window: the simple path
            sub = TokenBatch(lp[idx], lq[idx], adv[idx] if adv is not None else None)
            sseq = None if seq is None else (seq[0][idx], (seq[1][0], seq[1][1][idx]))
            sub_cost = cost.take(idx)
            for ji in fused.p.coord_jobs[c]:
                self._add_job_numpy(ji, self.jobs[ji], sub, g[idx], G, sseq, None, sub_cost)
        if self.robust:
            tb = tb if tb is not None else TokenBatch(lp, lq, adv)
            add_robust(self, df, tb, g, G)

    def _keep_tail(self, kept, df, lp, lq, adv, seq) -> None:
        """The kernel's kept tokens into the tail: the columns it wrote out where the batch's
        own have their type (float64 log-probs and advantage), the rest gathered there."""
        if kept is None:
            self.tail.add(_NONE, _NONE.astype(np.uint32), df, lp, lq, adv, None)
            return
        idx, bits, cols = kept
        got = {k: cols[k] for k, a in (("lp", lp), ("lq", lq)) if a.dtype == np.float64}
        if adv is not None and adv.dtype == np.float64:
            got["advantage"] = cols["adv"]
        if seq is not None:  # batch-local sequences -> the global ids (a small table)
            got["seq"] = seq[1][0][cols["seq"]]
        self.tail.add(idx, bits, df, lp, lq, adv, seq[0] if seq is not None else None, got)

    def _add_batch_numpy(self, df, tb: TokenBatch, g, G: int, ent, seq, cost=None) -> None:
        """The simple path: numpy, rule by rule (the reference for the fused path)."""
        self.metrics.add(tb, g, G, ent)
        if self.scatter:
            self._add_scatter(tb)
        if seq is not None:
            self.sequences.add_numpy(tb, g, seq, self.seq_extras)
        boot = self._boot_units(df, seq) if self.boot_replicates else None
        if self.robust:
            add_robust(self, df, tb, g, G)
        if self.m2po_part.jobs:
            ts = tb.at(self.precision)  # l^2 in the replay's arithmetic
            with np.errstate(over="ignore"):  # inf for absurd l: masked first
                x2 = ts.l * ts.l
            self.m2po_part.add(
                df["step"].to_numpy(),
                x2,
                tb.abs_dp,
                g if self.by is not None else None,
                seq[0] if seq is not None else None,
            )
        kept = cost.all() if cost is not None else None
        for ji, job in enumerate(self.jobs):
            if job.rule.level == "token":
                self._add_job_numpy(ji, job, tb, g, G, seq, boot, kept)

    def _add_job_numpy(
        self, ji: int, job: Job, tb: TokenBatch, g, G: int, seq, boot, cost=None
    ) -> None:
        """One token job on the simple path; `cost` = (direction classes, |A|, entropy) of
        the tokens (each None where the log lacks the column: _Cost.all)."""
        rule = job.rule
        bins = self.bins[ji]
        bins.grow(G)
        score = np.asarray(rule.score(tb, job.param), dtype=np.float64)
        thr = job.sorted_thresholds
        if np.isnan(score).any():
            raise AssertionError("internal error: a rule produced NaN scores")
        b = np.searchsorted(thr, score, side="right" if rule.inclusive else "left")
        b[score == math.inf] = thr.shape[0] + 1
        w = rule.weight(tb, job.param) if rule.kind == "weight" else None
        inv_n = self.inv_n[seq[0]] if self.inv_n is not None else None
        dirn, absadv, ent = cost if cost is not None else (None, None, None)
        accumulate(bins, b, g, G, tb.abs_dp, w, inv_n=inv_n, dirn=dirn, absadv=absadv, ent=ent)
        if boot is not None:
            uniq, local, wts = boot
            width = len(job.values) + 2
            w = cost[1] if self.boot_weight == "adv" and cost is not None else None
            c = np.bincount(local * width + b, weights=w, minlength=uniq.shape[0] * width)
            acc = self.boot_counts.setdefault(ji, np.zeros((self.boot_replicates, width)))
            acc += wts @ c.reshape(uniq.shape[0], width)
        if seq is not None:
            uniq, local = seq[1]
            part = np.full(uniq.shape[0], -1.0)
            np.maximum.at(part, local, b)
            acc = self.seq_max.setdefault(ji, Grow(-1.0))
            acc.ensure(len(self.sequences))
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
            for name in ("corr", "div", "amass", "ent", "ent_n"):  # what a mask costs
                if name in v:
                    a = bins._cost(name)
                    a += v[name] if a.dtype == v[name].dtype else np.rint(v[name]).astype(a.dtype)
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
        state["_prompt_cache"] = None
        state["_follower"] = state["_leader"] = state["_staged"] = None
        return state

    def _boot_units(self, df: pl.DataFrame, seq):
        """(distinct units, per-token unit index, (B, units) Poisson weights) of a batch."""
        ids = seq[0] if self.boot_unit == "sequence" else df["step"].to_numpy()
        uniq, local = np.unique(ids, return_inverse=True)
        wts = poisson_weights(uniq, self.boot_replicates, self.boot_seed)
        w = np.abs(df["advantage"].to_numpy()) if self.boot_weight == "adv" else None
        tokens = wts @ np.bincount(local, weights=w, minlength=uniq.shape[0]).astype(float)
        self.boot_tokens = tokens if self.boot_tokens is None else self.boot_tokens + tokens
        return uniq, local, wts

    def seq_unit_weights(self) -> np.ndarray:
        """(B, sequences) bootstrap weights of each sequence (by its own id or its step)."""
        n = len(self.sequences)
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
            idx = scatter_index(x, log) * n + scatter_index(y, log)
            hist += np.bincount(idx, minlength=n * n).reshape(n, n)

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
        out.absorb(self)
        out.absorb(other)
        return out

    def absorb(self, t: Tally) -> None:
        """Add another Tally of the same jobs into this one, in place (`+` builds a new one
        from two; the Ray engine absorbs each shard's in input order). Its groups and
        sequences are renumbered after this one's, as if its batches came after."""
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
            if mine is not None:
                mine.grow(G)
                mine.absorb(theirs, gmap)
        self.metrics.absorb(t.metrics, gmap, G)
        if self.by == "length" and any(key in self.seq_keys for key in t.seq_keys):
            raise ValueError(  # a sequence in both: neither Tally knew its length
                "--by length: a sequence is in both Tallies, so neither knows its length; "
                "replay those files together instead of adding Tallies"
            )
        smap = self.sequences.absorb(t.sequences, gmap)
        n = len(self.sequences)
        k = len(t.sequences)
        for ji, grow in t.seq_max.items():
            acc = self.seq_max.setdefault(ji, Grow(-1.0))
            acc.ensure(n)
            acc.a[smap] = np.maximum(acc.a[smap], grow.a[:k])
        self.m2po_part.absorb(t.m2po_part, gmap, smap, G, n, self.has_seq, self.inv_n is not None)
        self.report += t.report
        self.hist_lin += t.hist_lin
        self.hist_log += t.hist_log
        self.notes = list(dict.fromkeys([*self.notes, *t.notes]))
        if self._paths is None:
            self._paths = t._paths

    # -- m2po
    def seal_m2po(self, below: float, background: bool = False) -> int:
        """Resolve m2po's steps below `below`, now that every token of them has been added
        (the caller knows: ingest's step bounds); their tokens leave the store, so it holds
        only the steps in flight (M2POTally.seal). Returns the steps taken."""
        G, n_seq = len(self.groups), len(self.sequences)
        taken = self.m2po_part.seal(below, G, n_seq, self.inv_n, background)
        if taken:
            self.version += 1
        return taken

    def wait_m2po(self) -> None:
        """Join a background seal_m2po (its errors are raised here)."""
        self.m2po_part.wait()

    def m2po_bins(self) -> dict[int, JobBins]:
        """Every m2po job's finished bins (M2POTally.job_bins), cached until a change."""
        return self.m2po_part.job_bins(
            self.version,
            len(self.groups),
            len(self.sequences),
            self.inv_n,
            self.sequences.group() if self.has_seq else None,
            fast.threads(),
        )

    def _reshape(self, jobs) -> None:
        """Count `jobs` instead of this Tally's jobs (`shape`: before the first token)."""
        self.shape = None
        jobs = list(jobs)
        same = [(j.rule.spec(), j.param) for j in jobs] == [
            (j.rule.spec(), j.param) for j in self.jobs
        ]
        fed = self._fused is not None or bool(self.groups) or len(self.sequences) > 0
        if not same or fed:
            raise ValueError("shape: the same rules and parameters, before any token")
        self.jobs = jobs
        self.bins = [
            None
            if j.rule.level != "token"
            else new_bins(len(j.values), 0, j.rule.kind == "weight", self.inv_n is not None)
            for j in jobs
        ]
        self.m2po_part = M2POTally(self.jobs)
        self._paths = None

    def set_bins(self, groups: list, bins: list[JobBins]) -> None:
        """Make this (unfed) Tally one counted elsewhere: its groups, in order, and its
        token jobs' bins (groups x K + 2), e.g. from a replay's kept tokens
        (analysis/tail_counts.py). The readout then reads them as a replay's."""
        if self.report.rows or self._fused is not None:
            raise ValueError("set_bins: this Tally was fed batches already")
        self.groups = list(groups)
        self._gidx = {v: i for i, v in enumerate(self.groups)}
        self.bins = list(bins)
        self._external = True  # every job's bins are these, sequence jobs' too
        self.version += 1

    def attach(self, jobs, bins: list[JobBins], seq_bins: list[np.ndarray] | None = None) -> None:
        """Add token jobs counted elsewhere, after this Tally's replay (from a shared read's
        kept tokens: analysis/tail_counts.py): their bins (this Tally's groups x K + 2) and,
        with sequences, each sequence's highest bin by this Tally's sequence ids. Their
        path reads as the kernel's (it saw their tokens)."""
        paths = self.paths()
        n = len(self.jobs)
        self.jobs = [*self.jobs, *jobs]
        self.bins = [*self.bins, *bins]
        for k, sb in enumerate(seq_bins or []):
            acc = self.seq_max[n + k] = Grow(-1.0)
            acc.ensure(sb.shape[0])
            acc.a[: sb.shape[0]] = sb
        self._paths = [*paths, *(_path(j, None) for j in jobs)]
        self.version += 1

    # -- results
    def seq_stats(self) -> SeqStats:
        """The per-sequence statistics sequence rules score."""
        return self.sequences.stats(self.has_adv, self.seq_extras)

    def job_bins(self, ji: int) -> JobBins:
        """The finished per-bin sums of job `ji`, shape (groups, K + 2): a token job's bins
        (with sequences per bin), a sequence job's from the sequence statistics, an m2po
        job's from its steps."""
        self.flush()
        job = self.jobs[ji]
        G = len(self.groups)
        if job.rule.level == "sequence":
            return self.bins[ji] if self._external else self._sequence_job_bins(job, G)
        if job.rule.level == "step":
            return self.m2po_bins()[ji]
        bins = self.bins[ji]
        bins.grow(G)
        if self.has_seq and ji in self.seq_max:
            maxbin = self.seq_max[ji].a[: len(self.sequences)]
            bins.seq_count = seq_count(self.sequences.group(), maxbin, len(job.values) + 2, G)
            bins.seq_bin = maxbin
        return bins

    def _sequence_job_bins(self, job: Job, G: int) -> JobBins:
        return sequence_bins(
            job,
            self.seq_stats(),
            self.sequences.group(),
            G,
            self.sequences.column("mass"),
            self.seq_cost(),
        )

    @property
    def cost_columns(self) -> tuple[bool, bool]:
        """(advantage, entropy): the columns of what a mask costs the log has (decided on
        the first batch; (False, False) before one)."""
        return self._cost_cols if self._cost_cols is not None else (False, False)

    @property
    def _seq_cost(self) -> bool:
        """Whether sequence jobs read the per-sequence sums of what a mask costs."""
        return any(j.rule.level == "sequence" for j in self.jobs)

    def seq_cost(self) -> tuple | None:
        """Per sequence, what a mask costs: ((corrective, divergent) tokens or None, |A|
        sum or None, (entropy sum, finite count) or None), or None where neither was
        added (sequence_bins' `cost`)."""
        sq, kept = self.sequences, self.sequences.cost_kept
        if not (kept["dir"] or kept["ent"]):
            return None
        col = sq.column
        dirn = (col("cost_corr"), col("cost_div")) if kept["dir"] else None
        ent = (col("cost_ent"), col("cost_ent_n")) if kept["ent"] else None
        return dirn, col("cost_amass") if kept["dir"] else None, ent

    def prompt_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(sequence order by prompt group, each group's first position in it, each group's
        --by group), or None where prompt-group counts are undefined: no group id, or a
        prompt group whose samples fall in different --by groups (always for q_bucket and
        length; for env where an env is not constant within a prompt group). Cached until
        the tally changes."""
        if self._prompt_cache is not None and self._prompt_cache[0] == self.version:
            return self._prompt_cache[1]
        out = None
        n = len(self.sequences)
        if (
            self.has_pgroup
            and self.has_seq
            and n
            and self.by not in ("q_bucket", "length", "lag", "position")
        ):
            pg = self.sequences.column("pgroup").astype(np.int64)
            sg = self.sequences.group()
            order = np.argsort(pg, kind="stable")
            ps = pg[order]
            starts = np.flatnonzero(np.r_[True, ps[1:] != ps[:-1]])
            gs = sg[order]
            lo = np.minimum.reduceat(gs, starts)
            hi = np.maximum.reduceat(gs, starts)
            if (ps[0] >= 0) and (lo == hi).all():
                out = (order, starts, lo)
        self._prompt_cache = (self.version, out)
        return out

    @property
    def table(self) -> pl.DataFrame:
        """The sweep table (`result().table`)."""
        return self.result().table

    def summary_lines(self) -> list[str]:
        """What `print(tally)` shows: its sweep table's summary (present.sweep_lines)."""
        r = self.result()
        return sweep_lines("Tally", r.table, r.metrics, self.report.loss_rows, self.by,
                           r.paths, self.notes, self.rule_warnings)  # fmt: skip

    def to_dict(self) -> dict:
        """`result().to_dict()`: the sweep table's rows, the metrics, the paths."""
        return {**self.result().to_dict(), "notes": list(self.notes)}

    def result(self) -> SweepResult:
        """The sweep table, the metrics per group and each job's path."""
        self.flush()
        return SweepResult(
            table=sweep_table(self),
            metrics=self.metrics.table(self.by, self.groups),
            tally=self,
            paths=[dict(p) for p in self.paths()],
        )


def sequence_bins(
    job: Job, st: SeqStats, g: np.ndarray, G: int, mass: np.ndarray, cost: tuple | None = None
) -> JobBins:
    """A sequence job's bins from per-sequence statistics `st`, each sequence in group
    g[i] of G, with its |dp| mass and what masking it costs (`cost`: Tally.seq_cost): what a
    Tally's readout reads (`job_bins`)."""
    rule = job.rule
    b = fast.bin_scores(rule.score(st, job.param), job.sorted_thresholds, rule.inclusive)
    bins = new_bins(len(job.values), G, rule.kind == "weight")
    w = rule.weight(st, job.param) if rule.kind == "weight" else None
    dirn, absadv, ent = cost if cost is not None else (None, None, None)
    accumulate(bins, b, g, G, mass, w, count=st.n, dirn=dirn, absadv=absadv, ent=ent)
    bins.seq_count = seq_count(g, b, len(job.values) + 2, G)
    bins.seq_bin = b
    return bins


class _Cost:
    """A batch's per-token inputs of what a mask costs, computed on first use (the fused
    path reads them only for the tokens it sends to the simple path): `dirn` the direction
    classes (bins.direction_class) and `absadv` |A|, None without an advantage; `ent`."""

    def __init__(self, lp, lq, adv, ent):
        self.lp, self.lq, self.adv, self.ent = lp, lq, adv, ent
        self._d = None

    @property
    def dirn(self):
        if self.adv is None:
            return None
        if self._d is None:
            self._d = direction_class(self.lp, self.lq, self.adv)
        return self._d

    @property
    def absadv(self):
        return None if self.adv is None else np.abs(np.asarray(self.adv, dtype=np.float64))

    def all(self) -> tuple:
        return self.dirn, self.absadv, self.ent

    def take(self, idx: np.ndarray) -> tuple:
        """all() of the tokens at idx."""
        if self.adv is None:
            d = a = None
        else:
            d = direction_class(self.lp[idx], self.lq[idx], self.adv[idx])
            a = np.abs(np.asarray(self.adv[idx], dtype=np.float64))
        return d, a, None if self.ent is None else self.ent[idx]


def _path(job: Job, why: str | None) -> dict:
    """One entry of Tally.paths(): the rule without the swept parameter, the swept one."""
    rule = job.rule
    swept = job.report_param or (job.param if len(job.values) > 1 else None)
    if swept is None:
        spec = rule.spec()
    else:
        name = f"{rule.name}@{rule.preset}" if rule.preset else rule.name
        setting = rule.setting(swept)
        spec = f"{name}:{setting}" if setting else name
    return {
        "rule": spec,
        "param": swept,
        "path": "simple" if why is not None else "fused",
        "reason": why,
    }


def _numpy_backend_reason() -> str:
    """Why the numpy backend runs: numba missing, or asked for."""
    if importlib.util.find_spec("numba") is None:
        return "numba not installed"
    return "MISMATCH_REPLAY_KERNEL=numpy"
