"""Jobs: what a replay computes, one rule swept over one parameter's grid.

Design
------
A *job* is one rule with one swept threshold parameter over a grid of K values (a single
setting is a grid of one: `single_job`). `plan_jobs` turns the user's rules (objects or SPEC
text) and `--sweep` grids into jobs: with no rules, every rule of the registry that the log's
columns support, each threshold parameter over its default grid; a rule *class* (what
`rules.sweep_specs` makes of a bare name, `sweep -r ipo`) the same for that rule alone; a
rule instance or SPEC is one setting unless `--sweep` names one of its parameters; a swept
parameter that is not a threshold (kpop's clamp) becomes one single-setting job per value.
A job's values are in parameter space, ascending; `Job.thresholds` maps them into score
space, rounded to float32 for a float32 replay (as a framework's comparison of a float32
tensor with a Python float rounds them).

Precision: `use_precision` sets, for a block, the arithmetic every replay in it decides
rules in (how analysis and the report pass --precision down); `with_precision` rewrites jobs
into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import DataError, UsageError
from ..rules import (
    PRECISIONS,
    REGISTRY,
    Rule,
    check_grid_size,
    parse_grid,
    parse_rule,
    round_to,
)


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
    def sorted_thresholds(self) -> np.ndarray:
        """The thresholds in ascending order: what scores are binned against."""
        return self.thresholds[self.order]

    @property
    def label(self) -> str:
        name = f"{self.rule.name}@{self.rule.preset}" if self.rule.preset else self.rule.name
        return f"{name}[{self.rule.setting(self.param)}]:{self.param}"


def single_job(rule: Rule) -> Job:
    """A rule at one setting: a one-value job on its first active threshold parameter (the
    first whose value is not 0, else the first)."""
    names = [p.name for p in rule.params if p.threshold]
    rule.require(*names)
    active = [n for n in names if getattr(rule, n) not in (0, 0.0)]
    first = (active or names)[0]
    return Job(rule, first, np.array([float(getattr(rule, first))]))


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
    its default grid (rules=[]: no rule, metrics only). A rule class in `rules` (e.g.
    `REGISTRY["ipo"]`, `rules.sweep_specs(["ipo"])`) is swept the same way; a SPEC or a Rule
    is one setting. `sweeps` maps `param` or `rule.param` to a GRID (text or array).
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
    swept: set[int] = set()  # positions in `chosen` swept over their default grids
    if explicit:
        chosen = []
        for r in rules:
            if isinstance(r, type) and issubclass(r, Rule):  # the rule itself: swept
                swept.add(len(chosen))
                r = r()
            chosen.append(parse_rule(r) if isinstance(r, str) else r)
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
    for k, rule in enumerate(chosen):
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
        if not targets and (not explicit or k in swept):
            targets = {p.name: parse_grid(p.grid) for p in rule.params if p.threshold}
        if not targets:
            jobs.append(single_job(rule))
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
                    j = single_job(rule.replace(**{param: float(v)}))
                    jobs.append(Job(j.rule, j.param, j.values, param, float(v)))
    unused = [k for k in grids if k not in used]
    if unused:
        names = ", ".join(sorted({r.name for r in chosen}))
        raise UsageError(
            f"--sweep {unused[0]}: no selected rule has that parameter (rules: {names}). "
            "Use PARAM=GRID with a parameter of a selected rule, or RULE.PARAM=GRID."
        )
    return jobs, notes


def check_jobs(jobs: Sequence[Job], available: Sequence[str], where: str) -> list[Job]:
    """Ready-made jobs (analysis refines grids this way), checked against the columns."""
    for j in jobs:
        lacking = [c for c in j.rule.needs if c not in available]
        if lacking:
            raise DataError(
                f"{where}: rule '{j.rule.name}' needs the column(s) "
                f"{', '.join(lacking)} (found: {', '.join(available)}). Map one with --map."
            )
    return list(jobs)


# ----------------------------------------------------------------------------- precision

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
    """`precision` if it is one of rules.PRECISIONS, else a usage error."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: use one of {', '.join(PRECISIONS)}.")
    return precision


def with_precision(jobs: Sequence[Job], precision: str) -> list[Job]:
    """The jobs with every rule in `precision`."""
    return [
        j if j.rule.precision == precision else replace(j, rule=j.rule.replace(precision=precision))
        for j in jobs
    ]
