"""`precision_check`: does a rule decide differently in the frameworks' float32 arithmetic?

Design
------
Two replays of the same jobs in one read of the log, one in float64 (exact: a preset's
formula with correctly rounded exp) and one in the float32 arithmetic the frameworks run on
the GPU (`engine.replay(precision=...)`: the log-probs rounded to float32
and every rule value computed in float32), give each rule's masked (or truncated) tokens
both ways; a rule whose two fractions differ by more than `threshold` (absolute,
PRECISION_THRESHOLD = 1e-3 by default) gets a line: a disagreement no dashboard shows
(AReaL's binary KL turns p = 1 into NaN in float32 and masks it). The settings default to
the report's (`figure_data.DEFAULT_SETTINGS`) and the presets whose framework code turns a
float32 NaN or rounding into a decision. The answer is a `PrecisionResult`; the report
shows it as its "float32 vs float64" section, led by the precision notes: every
framework preset (float32 by default) whose two counts differ by more than 1% or 10 tokens
(engine/precision_note.py), with both numbers and the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from .. import engine, ingest
from ..engine import readout
from ..engine.precision_note import PrecisionNote, differs, note_for
from ..rules import FRAMEWORK_OF, Rule, parse_rule
from .figure_data import DEFAULT_SETTINGS

# The settings `precision_check` replays by default: the report's, and the presets whose
# framework code turns a float32 NaN or rounding into a decision (AReaL's binary KL).
PRECISION_SETTINGS = (*DEFAULT_SETTINGS, "kpop@areal", "icepop@areal", "dppo-kl@verl")
PRECISION_THRESHOLD = 1e-3  # masked-fraction difference (absolute) worth a line


def has_float32_preset(settings: Sequence[str | Rule] | None = None) -> bool:
    """Whether any of the settings (default: PRECISION_SETTINGS) is a framework preset that
    replays in float32 by default (a precision note may concern it)."""
    for s in settings or PRECISION_SETTINGS:
        r = parse_rule(s) if isinstance(s, str) else s
        if r.preset in FRAMEWORK_OF and r.precision == "float32":
            return True
    return False


@dataclass
class PrecisionRow:
    spec: str
    tokens: int
    masked_float64: int
    masked_float32: int
    fraction_float64: float
    fraction_float32: float
    difference: float  # float32 - float64
    flagged: bool  # |difference| > threshold

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PrecisionResult:
    threshold: float
    rows: list[PrecisionRow]
    lines: list[str]  # the precision notes first, then one sentence per other flagged rule
    notes: list[PrecisionNote] = field(default_factory=list)  # presets: float32 vs exact

    def to_dict(self) -> dict:
        return {
            "threshold": self.threshold,
            "rows": [r.to_dict() for r in self.rows],
            "lines": self.lines,
            "notes": [n.to_dict() for n in self.notes],
        }


def precision_check(
    sources: Sequence[str | Path],
    rules: Sequence[str | Rule] | None = None,
    threshold: float = PRECISION_THRESHOLD,
    options: ingest.ReadOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PrecisionResult:
    """Each rule's masked (or truncated) tokens in float64 and in float32 (one read of the
    log: both replays together), the precision note of every framework preset whose two
    counts differ by more than 1% or 10 tokens (engine.precision_note; first), and a line
    for every other rule whose two fractions differ by more than `threshold` (absolute)."""
    plan = ingest.plan_sources(sources, options)
    if rules:
        chosen = [parse_rule(r) if isinstance(r, str) else r for r in rules]
    else:
        chosen = [parse_rule(s) for s in PRECISION_SETTINGS]
        chosen = [r for r in chosen if all(c in plan.columns for c in r.needs)]
    jobs = [engine.single_job(r) for r in chosen]
    parts = [{"jobs": jobs, "precision": p, "scatter": False} for p in ("float64", "float32")]
    tallies = engine.replay_together(plan, parts, progress=progress, final=True)
    counts = {
        p: [readout.job_counts(t, ji) for ji in range(len(jobs))]
        for p, t in zip(("float64", "float32"), tallies, strict=True)
    }
    rows, lines, notes = [], [], []
    for ji, rule in enumerate(chosen):
        _, h64, tokens = counts["float64"][ji]
        _, h32, _ = counts["float32"][ji]
        n64, n32 = int(h64[0]), int(h32[0])
        f64, f32 = n64 / tokens, n32 / tokens
        diff = f32 - f64
        flagged = abs(diff) > threshold
        what = "truncates" if rule.kind == "weight" else "masks"
        rows.append(PrecisionRow(rule.spec(), int(tokens), n64, n32, f64, f32, diff, flagged))
        native = rule.preset in FRAMEWORK_OF and type(rule).native_precision(rule.preset)
        if native == "float32" and differs(n32, n64):
            job = jobs[ji]
            notes.append(note_for(job, float(job.values[0]), n32, n64, int(tokens)))
        elif flagged:
            lines.append(
                f"{rule.spec()} {what} {f32:.3%} of the tokens in float32 ({n32:,}) against "
                f"{f64:.3%} in float64 ({n64:,}): in the float32 arithmetic the framework "
                "runs on the GPU it decides differently (a NaN, a rounding at a threshold), "
                "and no dashboard shows it."
            )
    return PrecisionResult(threshold, rows, [n.line for n in notes] + lines, notes)
