"""replay() and sweep(): a log streamed once into a Tally, and the Tally's sweep table.

Design
------
`replay` plans the read (ingest: the schemas alone), the jobs (jobs.py) and the columns
(stream.py), then streams the batches, read ahead in a thread, into one Tally
(tally.py); `sweep` is `replay(final=True)` and the Tally's readout. With final=True m2po's
steps are resolved during the replay as soon as the Parquet row-group statistics of the
step column rule out more of their rows (`Tally.seal_m2po`, in a thread beside the
replay). match="prime-rl" and --by length cost a pre-pass that numbers the sequences and
counts their loss tokens (`stream.count_sequences`). `replay_together` streams one read
into several Tallies; those with sequences take the first one's sequence codes of each
batch (`Sequences.lead`) instead of numbering the same rows again, and one that needs only
metrics and sequence sums (the report's per-step Tally) takes them from the first one's
kernel pass (`Tally.lead_metrics`) instead of a pass of its own. engine="ray" computes
the same Tally per shard on a Ray cluster and adds them up (ray.py). The timings of the
default sweep are in benchmarks/README.md.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from ..errors import DataError, UsageError
from ..gcpause import frozen
from ..ingest import Plan, ReadOptions, iter_batches, plan_sources, step_bounds
from ..rules import FRAMEWORK_OF, Rule, parse_rule, spec_warnings
from . import ray as ray_engine
from . import readout, stream
from .jobs import (
    Job,
    check_jobs,
    check_precision,
    current_precision,
    plan_jobs,
    single_job,
    with_precision,
)
from .precision_note import PrecisionNote, differs, note_for, noted_jobs, twin
from .tail import Tail
from .tally import SweepResult, Tally

ENGINES = ("local", "ray")
MATCH = ("prime-rl",)


def replay(
    sources: Sequence[str | Path] | Plan,
    rules: Sequence[Rule | str] | None = None,
    sweeps: dict[str, str | np.ndarray] | None = None,
    by: str | None = None,
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    match: str | None = None,
    bootstrap: tuple[int, str, int] | None = None,
    robust: bool = False,
    jobs: Sequence[Job] | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    final: bool = False,
    precision: str | None = None,
    tail: Tail | None = None,
    seq_lengths: tuple[dict, np.ndarray] | None = None,
    scatter: bool = True,
    shape: Callable | None = None,
) -> Tally:
    """Stream the sources once and return the Tally for these rules and sweeps.

    Precision: each rule decides in its own `precision`: a framework preset in its
    framework's (float32: `Rule.native_precision`), a bare rule in float64. `precision=
    "float32"` forces every rule decision into the float32 arithmetic the frameworks run on
    the GPU (rules.TokenBatch): the log-probs rounded to float32, each rule's score computed
    in float32 (a preset's in its framework's formula), the thresholds rounded to float32,
    NaN decided as the framework's comparison decides it; `"float64"` forces exact
    arithmetic (a preset's formula with correctly rounded exp: crmath). Sequence sums of a
    float32 rule are float32 values added in float64 and rounded once (a GPU's float32
    reduction order cannot be reproduced). float32 jobs run on the simple path, job by job;
    the metrics and the scatter stay float64. None: `use_precision`'s default, else each
    rule's own.

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
    `scatter=False` skips the scatter histograms (a replay whose caller draws none).
    `seq_lengths` (by="length"): each sequence's id and loss tokens, as another replay of the
    same rows counted them (Tally.seq_keys, seq_stats().n), instead of the pre-pass.
    `jobs` replaces rules and sweeps with ready-made jobs. `tail` (tail.py) is filled with
    the tokens beyond its per-coordinate cutoffs (fused path only; else it says why not).
    `shape` (Tally.shape; local engine): given the first batch's sample, the jobs to count
    instead of `jobs` (a search's first grids, placed with no read ahead).

    `engine="ray"` computes the same Tally per file on a Ray cluster (ray.py;
    `ray_address` attaches to a running one, else `ray.init()` decides) and adds them up.
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: use one of {', '.join(ENGINES)}.")
    plan = sources if isinstance(sources, Plan) else plan_sources(sources, options)
    if jobs is None:
        jobs, notes = plan_jobs(rules, sweeps, plan.columns)
    else:
        jobs, notes = check_jobs(jobs, plan.columns, str(plan.files[0])), []
    if precision is None:
        precision = current_precision()
    jobs, precision, more = resolve_precision(jobs, precision)
    notes = [*notes, *more]
    if engine == "ray":
        if shape is not None:
            raise ValueError("replay(shape=...) runs on the local engine")
        if match is not None or bootstrap is not None or robust or by == "length":
            raise UsageError(
                "--engine ray computes sweeps, metrics and scatters; --match, --by length, "
                "bootstraps and robust drift statistics run on the local engine (drop "
                "--engine ray)."
            )
        tally = ray_engine.replay(plan, jobs, by, address=ray_address, progress=progress)
        if tail is not None:
            tail.refuse("the Ray engine")
        tally.notes = [*notes, *tally.notes]
        tally.rule_warnings = spec_warnings(rules or [])
        return tally
    tally, cols, keep = _local_tally(
        plan, jobs, notes, by, match, bootstrap, robust, tail, precision, seq_lengths
    )
    tally.scatter = scatter
    tally.shape = shape
    (dropped_zero,) = _stream(plan, [(tally, cols, keep)], progress, final, ())
    if match is not None:
        tally.notes.append(
            f"prime-rl conventions: {dropped_zero:,} zero-advantage loss tokens left out; "
            "is_masked_mean = mean over sequences of per-sequence masked fractions"
        )
    tally.rule_warnings = spec_warnings(rules or [])
    return tally


def resolve_precision(jobs, precision: str | None) -> tuple[list[Job], str, list[str]]:
    """(jobs, the Tally's m2po precision, notes): `precision` (None: each rule's own) forced
    on every job; m2po ranks one l^2 per token, so where m2po jobs of both precisions meet
    all rank in float32 (a note says so)."""
    jobs = list(jobs)
    notes = []
    if precision is not None:
        jobs = with_precision(jobs, check_precision(precision))
    steps = {j.rule.precision for j in jobs if j.rule.level == "step"}
    if steps == {"float64", "float32"}:
        jobs = [
            replace(j, rule=j.rule.replace(precision="float32")) if j.rule.level == "step" else j
            for j in jobs
        ]
        notes.append(
            "m2po jobs in float64 and float32 together: every m2po job ranks in float32 here "
            "(replay them apart, or pass --precision, for the float64 ranking)"
        )
    return jobs, ("float32" if "float32" in steps else "float64"), notes


def _local_tally(plan, jobs, notes, by, match, bootstrap, robust, tail, precision, lengths=None):
    """The Tally of a local replay, the columns it reads and its row filter (--match)."""
    available = plan.columns
    cols = stream.columns_needed(jobs, by, available)
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
    if match is None and by == "length" and lengths is not None:
        pre = lengths
    elif match is not None or by == "length":
        pre = stream.count_sequences(plan, cols, keep)
    inv_n = None if pre is None or match is None else 1.0 / pre[1]
    has_seq = "sample_id" in cols
    if tail is not None:  # the kept tokens' own columns (compare's examples name them)
        cols = [*cols, *(c for c in tail.extra if c in available and c not in cols)]
    tally = Tally(
        jobs,
        by,
        has_seq=has_seq,
        has_adv="advantage" in cols,
        inv_n=inv_n,
        seq_len=None if pre is None or by != "length" else pre[1].astype(np.int64),
        has_pgroup="group_id" in cols and has_seq,
        precision=precision,
    )
    if pre is not None:
        tally.seq_keys = dict(pre[0])
    tally.robust = robust
    tally.tail = tail
    if tail is not None:  # its buffers sized once from the first batch (Tail.expected)
        tail.expected = max(tail.expected, sum(plan.rows))
    if bootstrap is not None:
        tally.boot_replicates, tally.boot_unit, tally.boot_seed = bootstrap[:3]
        # a 4th item "adv": the replicates sum |A| (choose --of adv-mass, Tally.boot_weight)
        tally.boot_weight = bootstrap[3] if len(bootstrap) > 3 else None
        if tally.boot_unit == "sequence" and not tally.has_seq:
            raise DataError(
                f"{plan.files[0]}: a bootstrap over sequences needs a sample_id column; "
                "use --bootstrap-unit step, or map one with --map sample_id=COLUMN."
            )
    tally.notes = notes
    return tally, cols, keep


def _stream(plan, parts, progress, final: bool, observers, extra=()) -> list[int]:
    """One read of the log into every (tally, columns, row filter) of `parts`: the union
    of their columns is read once, each Tally gets its own columns of each batch;
    `observers` (callables) see every batch with all the columns. Returns, per part, the
    rows its filter left out."""
    dropped = [0] * len(parts)
    cols = sorted({c for _, cs, _ in parts for c in cs} | set(extra))
    total = sum(plan.rows)
    # m2po's steps are resolved as soon as the rows still to come cannot hold them (sorted
    # logs: one step at a time, so its store stays small); None: all at the end
    m2po = final and any(j.rule.level == "step" for t, _, _ in parts for j in t.jobs)
    bounds = step_bounds(plan) if m2po else None
    report = parts[0][0].report
    # the Tallies with sequences see the same rows: the first one's codes serve them all
    seqs = [t.sequences for t, _, keep in parts if t.has_seq and keep is None]
    if len(seqs) > 1:
        seqs[0].lead(seqs[1:])
    # a Tally that needs only metrics and sequence sums (the report's per-step one) takes
    # them from the first one's kernel pass (Tally.lead_metrics), the first such Tally
    lead, lead_cols, lead_keep = parts[0]
    for t, tcols, keep in parts[1:] if lead_keep is None else []:
        if keep is None and lead.lead_metrics(t, lead_cols, tcols):
            break
    try:
        checked = False
        batches = ((df, report.rows) for _, df in iter_batches(plan, cols, report))
        if observers:  # in the reader's thread, which waits for this one most of the time
            batches = _observed(batches, observers)
        for df, rows in stream.prefetch(batches):  # rows: raw rows read up to this batch
            if df.height and not checked:  # are the two columns about the same tokens?
                checked = True
                stream.warn_alignment(plan, df)
            for k, (tally, tcols, keep) in enumerate(parts):
                part = df if len(parts) == 1 and tcols == cols else df.select(tcols)
                if keep is not None:
                    before = part.height
                    part = keep(part)
                    dropped[k] += before - part.height
                if part.height:
                    tally.add_batch(part)
            if bounds is not None:
                done = bisect.bisect_right(bounds[0], rows)  # row groups read to their end
                if done:
                    for tally, _, _ in parts:
                        tally.seal_m2po(bounds[1][done - 1], background=True)
            if progress is not None:
                progress(report.rows, total)
    finally:  # unlinked however the read ends
        if len(seqs) > 1:
            seqs[0].lead([])
        lead.lead_metrics(None)
    for tally, _, _ in parts:
        if tally.report is not report:  # the read's counts, as a read of its own would give
            tally.report = dataclasses.replace(
                report, dropped=dict(report.dropped), warnings=list(report.warnings)
            )
        tally.wait_m2po()
        stream.check_loss_tokens(plan, tally)
    return dropped


def replay_together(
    sources: Sequence[str | Path] | Plan,
    parts: Sequence[dict],
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
    final: bool = False,
    observers: Sequence[Callable[[pl.DataFrame], None]] = (),
    columns: Sequence[str] = (),
) -> list[Tally]:
    """Several local replays in ONE read of the log: each part is replay()'s keywords
    (rules / sweeps / jobs, by, robust, tail, precision; not match, bootstrap, by="length" or
    Ray, which have passes of their own), plus scatter=False for a Tally that needs no
    scatter histograms and `shape` (replay()'s), and gets the Tally replay() would give it.
    `observers` see every batch (e.g. inspect's duplicate and alignment checks), with the
    log's `columns` too (those it has) beside the parts' own (drift's per-sample reward)."""
    plan = sources if isinstance(sources, Plan) else plan_sources(sources, options)
    built = []
    warned = []
    for kw in parts:
        known = {"rules", "sweeps", "jobs", "by", "robust", "tail", "precision", "scatter"}
        known.add("shape")
        bad = set(kw) - known
        if bad or kw.get("by") == "length":
            raise UsageError(
                f"replay_together: {sorted(bad) or 'by=length'} needs a replay of its own"
            )
        jobs = kw.get("jobs")
        if jobs is None:
            jobs, notes = plan_jobs(kw.get("rules"), kw.get("sweeps"), plan.columns)
        else:
            jobs, notes = check_jobs(jobs, plan.columns, str(plan.files[0])), []
        jobs, precision, more = resolve_precision(jobs, kw.get("precision") or current_precision())
        notes = [*notes, *more]
        tally, cols, keep = _local_tally(
            plan, jobs, notes, kw.get("by"), None, None, kw.get("robust", False),
            kw.get("tail"), precision,
        )  # fmt: skip
        tally.scatter = kw.get("scatter", True)
        tally.shape = kw.get("shape")
        built.append((tally, cols, keep))
        warned.append(spec_warnings(kw.get("rules") or []))
    extra = [c for c in columns if c in plan.columns]
    _stream(plan, built, progress, final, observers, extra)
    for (tally, _, _), w in zip(built, warned, strict=True):
        tally.rule_warnings = w
    return [t for t, _, _ in built]


def _observed(batches, observers):
    """`batches` with every observer called on each non-empty batch, in order, as the
    batch is made: inside `stream.prefetch`'s reader thread, so that the observers (inspect's
    checks: numba kernels that release the GIL) run while this thread feeds the Tallies.
    They only accumulate; an error is raised in the replay's thread, in order (prefetch)."""
    for df, rows in batches:
        if df.height:
            for obs in observers:
                obs(df)
        yield df, rows


@frozen()  # a whole job: the collector's passes skip what it found (gcpause.py)
def sweep(*args, **kwargs) -> SweepResult:
    """`replay(..., final=True)` then the sweep table (see `replay` for the arguments), and
    `precision_notes`: where a preset's float32 count differs from its exact one
    (engine/precision_note.py; one more read of the log when a float32 preset ran)."""
    kwargs.setdefault("final", True)
    tally = replay(*args, **kwargs)
    res = tally.result()
    res.notes = list(tally.notes)
    res.warnings = list(tally.rule_warnings)
    res.precision_notes = []
    if noted_jobs(tally.jobs):  # a float32 preset: its exact count beside (precision_note)
        src = args[0] if args else kwargs["sources"]
        plan = src if isinstance(src, Plan) else plan_sources(src, kwargs.get("options"))
        res.precision_notes = precision_notes(plan, tally)
    return res


# ----------------------------------------------------------------------------- precision notes


def precision_notes(plan, tally, progress=None) -> list[PrecisionNote]:
    """The notes of a finished Tally's float32 preset jobs (module docstring)."""
    idx = noted_jobs(tally.jobs)
    if not idx:
        return []
    twins = [twin(tally.jobs[ji]) for ji in idx]
    exact = replay(plan, jobs=twins, final=True, scatter=False, progress=progress)
    out = []
    for k, ji in enumerate(idx):
        job = tally.jobs[ji]
        values, n32, tokens = readout.job_counts(tally, ji)
        _, n64, _ = readout.job_counts(exact, k)
        diffs = [abs(int(a) - int(b)) for a, b in zip(n32, n64, strict=True)]
        at = max(range(len(diffs)), key=diffs.__getitem__)
        a, b = int(n32[at]), int(n64[at])
        if not differs(a, b):
            continue
        out.append(note_for(job, float(values[at]), a, b, tokens))
    return out


def precision_notes_for(sources, settings, options=None, precision=None, progress=None):
    """The notes of single settings (SPECs or Rules: what choose, compare and check print)
    that are framework presets in float32 (`precision`: the command's --precision, which
    forces theirs; "float64": no note): one read of the log replays each in float32 and in
    exact arithmetic."""
    if precision == "float64":
        return []
    rules = [parse_rule(s) if isinstance(s, str) else s for s in settings]
    if precision is not None:
        rules = [r.replace(precision=precision) for r in rules]
    rules = list({r: None for r in rules if r.preset in FRAMEWORK_OF and r.precision == "float32"})
    if not rules:
        return []
    plan = sources if isinstance(sources, Plan) else plan_sources(sources, options)
    jobs = [single_job(r) for r in rules]
    parts = [{"jobs": jobs, "scatter": False}, {"jobs": [twin(j) for j in jobs], "scatter": False}]
    t32, t64 = replay_together(plan, parts, progress=progress, final=True)
    out = []
    for ji, job in enumerate(jobs):
        _, n32, tokens = readout.job_counts(t32, ji)
        _, n64, _ = readout.job_counts(t64, ji)
        if differs(int(n32[0]), int(n64[0])):
            out.append(note_for(job, float(job.values[0]), int(n32[0]), int(n64[0]), tokens))
    return out
