"""The precision note: where a preset's count in its framework's float32 differs from exact.

Design
------
A framework preset replays in its framework's precision by default (float32: the log-prob
tensors a real run holds; `Rule.native_precision`). Where that answer differs from the
same formula in exact arithmetic (float64, correctly rounded exp: `--precision float64`) by
more than 1% or more than 10 tokens, every command that prints the count adds one line
with both numbers and the cause, e.g. "kpop@areal masks 21,555 tokens in AReaL's float32
arithmetic; 304 in exact arithmetic (its clamp 1 - 1e-8 is 1.0 in float32)".

`precision_notes(plan, tally)` (engine/replay.py, beside the replays it runs) finds the
float32 preset jobs of a finished Tally, replays their float64 twins (one more read of the
log, on the fused path where their arithmetic allows it; nothing when no float32 preset
ran) and compares the counts at each grid value: a swept job gets one line, at the value
where the two differ most. `differs` is the threshold; `note_line` the sentence
(viz.report and the commands print the same lines). `precision_notes_for(sources,
settings)` (replay.py too) does the same for single settings (what choose, compare and
check print): both replays in one read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..rules import FRAMEWORK_OF, fmt_value
from .jobs import Job

ABS_TOKENS = 10  # a difference above this many tokens is worth a note
REL = 0.01  # or above this fraction of the exact count
GENERIC_CAUSE = "float32 rounding of the log-probs and of its comparisons at the thresholds"


@dataclass(frozen=True)
class PrecisionNote:
    """One preset job whose float32 count differs from its exact one (at `value`)."""

    spec: str  # the rule SPEC (the preset's name and values)
    label: str  # name@preset, and the swept value where it is not the preset's own
    framework: str
    kind: str  # "masks" | "truncates"
    float32: int
    exact: int
    tokens: int
    cause: str

    @property
    def line(self) -> str:
        return note_line(self)

    def to_dict(self) -> dict:
        return {
            "spec": self.spec,
            "label": self.label,
            "framework": self.framework,
            "float32": self.float32,
            "exact": self.exact,
            "tokens": self.tokens,
            "cause": self.cause,
            "line": self.line,
        }


def differs(float32: int, exact: int) -> bool:
    """More than 1% of the exact count, or more than 10 tokens, apart."""
    d = abs(float32 - exact)
    return d > ABS_TOKENS or (d > 0 and d > REL * exact)


def note_line(n: PrecisionNote) -> str:
    return (
        f"{n.label} {n.kind} {n.float32:,} tokens in {n.framework}'s float32 arithmetic; "
        f"{n.exact:,} in exact arithmetic ({n.cause}); --precision float64 gives the exact count"
    )


def noted_jobs(jobs) -> list[int]:
    """The jobs a note may concern: a framework's preset replayed in float32."""
    return [
        ji
        for ji, j in enumerate(jobs)
        if j.rule.preset in FRAMEWORK_OF and j.rule.precision == "float32"
    ]


def twin(job: Job) -> Job:
    """The job in exact arithmetic (float64)."""
    return replace(job, rule=job.rule.replace(precision="float64"))


def note_for(job: Job, value: float, a: int, b: int, tokens: int) -> PrecisionNote:
    """The note of `job` at `value`: a float32 count `a`, the exact one `b`."""
    rule = job.rule
    name = f"{rule.name}@{rule.preset}"
    own = type(rule).presets.get(rule.preset, {})
    if all(getattr(rule, k) == v for k, v in own.items()) and getattr(rule, job.param) == value:
        label = name  # the preset as it stands
    else:
        label = f"{name}:{rule.setting(job.param)},{job.param}={fmt_value(value)}".replace(
            ":,", ":"
        )
    cause = type(rule).precision_causes.get(rule.preset, GENERIC_CAUSE)
    return PrecisionNote(
        spec=rule.spec(),
        label=label,
        framework=FRAMEWORK_OF[rule.preset],
        kind="truncates" if rule.kind == "weight" else "masks",
        float32=a,
        exact=b,
        tokens=tokens,
        cause=cause,
    )
