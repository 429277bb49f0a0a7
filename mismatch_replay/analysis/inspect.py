"""`inspect`: what is in a log, without failing on what is wrong with it.

Design
------
Inspecting is diagnosis, so invalid rows are counted (per file and column) instead of raising:
the same ingest path runs with `drop_invalid=True` and its `ReadReport` is the invalid-row
report. Everything else comes from one metrics-only pass of the engine (no rules): loss
tokens, steps, sequences and the mismatch metrics, overall and per step. It also counts rows
that repeat a (step, sample_id, position) (`DuplicateCheck`, memory ~40 bytes a sequence)
and warns about them, and checks that the two log-prob columns are about the same tokens
(`alignment.AlignmentCheck`: lag 0 against lags +-1 within sequences, and degenerate columns).

`prime_check` (the proof that a replay equals the run): when a prime-rl export (or trace
annotation) carries `is_masked`, the same tokens are replayed through prime-rl's rule and
compared: "N of M tokens agree with prime-rl's is_masked". At 559b447 the export fills
`is_masked` only under prime-rl's default loss (`DefaultLossConfig`: DPPO-binary-TV with
`dppo_mask_low = dppo_mask_high = 0.2`, `A > 0` on the high side, else the low side), which is
`dppo-tv@prime-rl`; traces may come from IPO runs too, so there the best of the prime-rl
presets is reported, by name. `mismatch_kl` (`r - l - 1`) is compared with the replay's k3.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from ..engine import Tally, columns_needed
from ..errors import DataError, UsageError
from ..ingest import read
from ..ingest.alignment import AlignmentCheck
from ..ingest.canonical import DuplicateCheck, IngestWarning, ReadOptions
from ..ingest.formats.prime_rl import PRIME, PRIME_CHECKS, read_traces
from ..ingest.formats.records import read_records
from ..present import Presentable
from . import summaries


@dataclass
class Summary(Presentable):
    """What a log holds; `.table`: the per-step counts and metrics (`per_step`)."""

    files: list[str]
    format: str  # parquet, prime-rl, nemo-rl, slime, jsonl
    source: dict[str, str]  # canonical -> source column
    layout: str  # "token rows" | "sequence rows (list columns)"
    probs: list[str]  # canonical columns read as probabilities
    rows: int
    loss_tokens: int
    steps: int
    sequences: int | None
    invalid: dict[str, int]  # "file: column" -> rows
    invalid_rows: int
    metrics: dict[str, float | None]
    per_step: pl.DataFrame
    warnings: list[str] = dataclasses.field(default_factory=list)
    alignment: str = ""  # the lag check's verdict and evidence (one line)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["per_step"] = self.per_step.to_dicts()
        return d

    @property
    def table(self) -> pl.DataFrame:
        return self.per_step

    def summary_lines(self) -> list[str]:
        return summaries.inspect_lines(self)


def inspect_log(
    sources: Sequence[str | Path],
    options: ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Summary:
    """Summarise a log: schema found, counts, invalid rows and mismatch metrics."""
    options = dataclasses.replace(options or ReadOptions(), drop_invalid=True)
    plan = read.plan_sources(sources, options)
    checks = Checks(plan.columns)
    cols = sorted({*columns_needed([], "step", plan.columns), *checks.columns})
    tally = Tally([], "step", has_seq="sample_id" in plan.columns)
    total = sum(plan.rows)
    for _, df in read.iter_batches(plan, cols, tally.report):
        if df.height:
            tally.add_batch(df)
            checks(df)
        if progress is not None:
            progress(tally.report.rows, total)
    return summarize(plan, tally, tally, checks)


class Checks:
    """inspect's checks of every batch besides the metrics: repeated (step, sample_id,
    position) rows (`DuplicateCheck`) and the alignment of the two log-prob columns
    (`AlignmentCheck`), where the log has the columns they read (`columns`). A shared read
    (the report's) feeds it the batches it reads anyway."""

    def __init__(self, columns: Sequence[str]):
        self.dups = DuplicateCheck() if DuplicateCheck.possible(columns) else None
        self.aligned = AlignmentCheck() if AlignmentCheck.possible(columns) else None
        cols: set[str] = set()
        if self.dups is not None:
            cols |= {"sample_id", "position"}
        if self.aligned is not None:
            cols |= {c for c in ("sample_id", "position") if c in columns}
        self.columns = sorted(cols)

    def __call__(self, df: pl.DataFrame) -> None:
        if self.dups is not None:
            self.dups.add(df)
        if self.aligned is not None:
            self.aligned.add(df)


def summarize(plan, by_step: Tally, seq: Tally, checks: Checks) -> Summary:
    """The Summary from a read's Tally with metrics per step (`by_step`), a Tally that
    numbered the sequences (`seq`, the same one where it did) and the checks fed its batches."""
    report = by_step.report
    note = checks.dups.warning(plan.files) if checks.dups is not None else None
    if note is not None:
        report.warnings.append(note)
        warnings.warn(note, IngestWarning, stacklevel=3)
    for note in checks.aligned.warnings() if checks.aligned is not None else ():
        report.warnings.append(note)
        warnings.warn(note, IngestWarning, stacklevel=3)
    overall = by_step.metrics.total().table(None, [None]).to_dicts()[0]
    invalid = {f"{f}: {c}": n for (f, c), n in report.dropped.items() if not c.startswith("*")}
    lists = sum(n for (f, c), n in report.dropped.items() if c == "*lists")
    if lists:
        invalid["sequence rows with unequal list lengths"] = lists
    aligned = checks.aligned
    return Summary(
        files=[str(p) for p in plan.files],
        format=plan.format,
        source=dict(plan.source),
        layout="sequence rows (list columns)" if plan.per_sequence else "token rows",
        probs=sorted(plan.probs),
        rows=report.rows,
        loss_tokens=report.loss_rows,
        steps=sum(1 for g in by_step.groups),
        sequences=len(seq.seq_keys) if seq.has_seq else None,
        invalid=invalid,
        invalid_rows=report.dropped_rows,
        metrics=overall,
        per_step=by_step.metrics.table("step", by_step.groups),
        warnings=list(dict.fromkeys([*plan.warnings, *report.warnings])),
        alignment=aligned.line() if aligned is not None else "not checked (no sample_id column)",
    )


# ----------------------------------------------------------------------------- prime-rl checks


# The rule that produced prime-rl's is_masked: at 559b447 the token export fills it only under
# DefaultLossConfig (DPPO binary TV, dppo_mask_low = dppo_mask_high = 0.2); trace annotations
# come from whatever loss the run used, so the prime-rl presets are tried and the best named.
PRIME_EXPORT_RULE = "dppo-tv@prime-rl"


PRIME_TRACE_RULES = ("dppo-tv@prime-rl", "ipo@prime-rl", "ipo@prime-rl-legacy")


KL_ATOL, KL_RTOL = 1e-5, 1e-4  # the logged k3 is float32 arithmetic


@dataclass
class PrimeCheck:
    """How the replay of prime-rl's own rule compares with the run's logged decisions."""

    rule: str  # the rule SPEC replayed
    tried: tuple[str, ...]  # the candidates (the best was kept)
    tokens: int  # loss tokens with a logged is_masked
    agree: int
    logged_masked: int
    replay_masked: int
    disagreements: list[str]  # the first few, as "step S sample I position P (logged X)"
    kl_tokens: int = 0  # loss tokens with a logged mismatch_kl
    kl_agree: int = 0  # within KL_ATOL + KL_RTOL * |k3|

    def line(self) -> str:
        """`N of M tokens agree with prime-rl's is_masked (...)`, the line to print."""
        how = f"replayed as {self.rule}"
        if len(self.tried) > 1:
            how += f", the best of {', '.join(self.tried)}"
        text = (
            f"{self.agree:,} of {self.tokens:,} tokens agree with prime-rl's is_masked ({how}; "
            f"{self.logged_masked:,} masked in the run, {self.replay_masked:,} in the replay)"
        )
        if self.kl_tokens:
            text += (
                f"; mismatch_kl equals the replayed k3 on {self.kl_agree:,} of "
                f"{self.kl_tokens:,} tokens"
            )
        if self.disagreements:
            text += "; first disagreements: " + "; ".join(self.disagreements)
        return text

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"line": self.line()}


def _check_frames(plan, wanted: set[str]) -> Iterator[pl.DataFrame]:
    """Every loss token of a prime-rl plan with a logged is_masked, with the logged columns."""
    opts = plan.options
    for i, path in enumerate(plan.files):
        step = plan.file_steps[i] if i < len(plan.file_steps) else None
        if plan.format == "prime-rl":
            if not _logs_decisions(path):  # an export without is_masked: nothing to check
                continue
            schema = dict(plan.read_schema) | {k: pl.List(t) for k, t in PRIME_CHECKS.items()}
            frames = read_records(
                PRIME, path, step, schema, None, opts.drop_invalid, None, opts.block_bytes
            )
        else:
            frames = read_traces(path, None, opts.drop_invalid, None, opts.batch_rows, True)
        for df in frames:
            if "logged_is_masked" not in df.columns:
                continue
            df = df.filter(pl.col("loss_mask"), pl.col("logged_is_masked").is_not_null())
            if df.height:
                yield df.select([c for c in df.columns if c in wanted])


def _logs_decisions(path) -> bool:
    """Whether a token-export file's records carry `is_masked` (the exporter writes the same
    keys in every record: the first one tells)."""
    from ..ingest.safe_read import LINE_CAP

    try:
        with open(path, "rb") as f:
            while line := f.readline(LINE_CAP):  # bounded: a file without newlines
                if line.strip():
                    return b'"is_masked"' in line
    except OSError:  # not a local file (an object-store URI): let the reader look
        return True
    return False


def _replay_mask(spec: str, lp: np.ndarray, lq: np.ndarray, adv: np.ndarray | None) -> np.ndarray:
    from ..rules import TokenBatch, parse_rule

    rule = parse_rule(spec)
    param = rule.primary_param()
    score = rule.score(TokenBatch(lp, lq, adv), param)
    th = rule.threshold(param, getattr(rule, param))
    return score >= th if rule.inclusive else score > th


def prime_check(
    sources: Sequence[str | Path], options=None, rule: str | None = None, examples: int = 3
) -> PrimeCheck | None:
    """Replay prime-rl's own rule on the tokens whose decision the run logged (`is_masked` in
    the token export or the trace annotations) and count the agreements; compare the logged
    `mismatch_kl` with the replayed k3. None when the sources are not prime-rl or log no
    decision. `rule`: the SPEC to replay (default: dppo-tv@prime-rl for the export, the best
    of PRIME_TRACE_RULES for traces)."""
    plan = sources if hasattr(sources, "files") else read.plan_sources(sources, options)
    if plan.format not in ("prime-rl", "prime-rl-traces"):
        return None
    tried = (
        (rule,)
        if rule
        else ((PRIME_EXPORT_RULE,) if plan.format == "prime-rl" else PRIME_TRACE_RULES)
    )
    wanted = {
        "step",
        "sample_id",
        "position",
        "trainer_logprob",
        "inference_logprob",
        "advantage",
        "logged_is_masked",
        "logged_mismatch_kl",
    }
    stats = {s: {"agree": 0, "replay": 0, "examples": []} for s in tried}
    tokens = logged = kl_tokens = kl_agree = 0
    for df in _check_frames(plan, wanted):
        lp = df["trainer_logprob"].to_numpy()
        lq = df["inference_logprob"].to_numpy()
        adv = df["advantage"].to_numpy() if "advantage" in df.columns else None
        got = df["logged_is_masked"].to_numpy().astype(bool)
        tokens += got.size
        logged += int(got.sum())
        for s in tried:
            try:
                mine = _replay_mask(s, lp, lq, adv)
            except UsageError as exc:
                raise DataError(
                    f"{plan.files[0]}: cannot replay {s} on this log ({exc})."
                ) from None
            st = stats[s]
            same = mine == got
            st["agree"] += int(same.sum())
            st["replay"] += int(mine.sum())
            for i in np.flatnonzero(~same)[: max(0, examples - len(st["examples"]))]:
                st["examples"].append(
                    f"step {df['step'][int(i)]} sample {df['sample_id'][int(i)]} position "
                    f"{df['position'][int(i)]} (run {'masked' if got[i] else 'kept'})"
                )
        if "logged_mismatch_kl" in df.columns:
            kl = df["logged_mismatch_kl"].to_numpy()
            have = ~np.isnan(kl)
            if have.any():
                x = lp[have] - lq[have]
                k3 = np.expm1(x) - x
                kl_tokens += int(have.sum())
                kl_agree += int((np.abs(k3 - kl[have]) <= KL_ATOL + KL_RTOL * np.abs(k3)).sum())
    if not tokens:
        return None
    best = max(tried, key=lambda s: stats[s]["agree"])
    st = stats[best]
    return PrimeCheck(
        rule=best,
        tried=tuple(tried),
        tokens=tokens,
        agree=st["agree"],
        logged_masked=logged,
        replay_masked=st["replay"],
        disagreements=st["examples"],
        kl_tokens=kl_tokens,
        kl_agree=kl_agree,
    )
