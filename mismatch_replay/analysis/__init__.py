"""Questions over Tallies: which eps (`choose`), which rule (`compare`), did it drift (`drift`),
does it hold in CI (`check`), and the data behind the figures.

Design
------
Functions here take sources, run the engine (each call is one or a few streaming passes) and
return dataclasses; they never draw and never print. Each result has `to_dict()`, the JSON
the command line prints with `--json`.

* `search`       the threshold search `choose` and `compare --budget` share, and its one pass
                 that refines every bracket and accumulates the bootstrap together;
* `choose`       per rule, the threshold that masks a target fraction (`ChooseResult`, a
                 sequence of `Choice`), with a bootstrap interval;
* `compare`      two rules on the same tokens (`CompareResult`: the 2 x 2 `Cell`s, where
                 they disagree, the most disputed tokens);
* `drift`        per-step mismatch with robust statistics, drift and spikes, and whether each
                 rule followed (`DriftResult`);
* `check`        a CI gate: a `Verdict` per limit (`CheckResult`);
* `figure_data`  the three views the figures draw (`FigureData`);
* `findings`     "What this log says": the sentences, with numbers, that open the report
                 and end `demo` / `report` on the terminal (`Findings`);
* `decisions`    the report's Decision section (`Decisions`), and `report_data`, which builds
                 it and the figure data sharing passes (5 in all);
* `precision`    float32 against float64 decisions per rule (`PrecisionResult`).

`check` is a module here (`analysis.check.check(...)`): its name is not re-exported, so that
`from mismatch_replay.analysis import check` is the module.
"""

from __future__ import annotations

from . import check
from .choose import CURVE_POINTS, Choice, ChooseResult, CurvePoint, choose
from .compare import CELLS, BucketRow, BudgetSetting, Cell, CompareResult, compare
from .decisions import DECISION_RULES, Decisions, decisions, report_data
from .drift import Baseline, DriftResult, RuleVerdict, Spike, StepRow, drift
from .figure_data import DEFAULT_SETTINGS, FigureData, default_settings, figure_data
from .findings import Finding, Findings, findings
from .precision import (
    PRECISION_SETTINGS,
    PRECISION_THRESHOLD,
    PrecisionResult,
    PrecisionRow,
    has_float32_preset,
    precision_check,
)

__all__ = [
    "CELLS",
    "CURVE_POINTS",
    "DECISION_RULES",
    "DEFAULT_SETTINGS",
    "PRECISION_SETTINGS",
    "PRECISION_THRESHOLD",
    "Baseline",
    "BucketRow",
    "BudgetSetting",
    "Cell",
    "Choice",
    "ChooseResult",
    "CompareResult",
    "CurvePoint",
    "Decisions",
    "DriftResult",
    "FigureData",
    "Finding",
    "Findings",
    "PrecisionResult",
    "PrecisionRow",
    "RuleVerdict",
    "Spike",
    "StepRow",
    "check",
    "choose",
    "compare",
    "decisions",
    "default_settings",
    "drift",
    "figure_data",
    "findings",
    "has_float32_preset",
    "precision_check",
    "report_data",
]
