"""mismatch-replay: replay logged trainer/inference token probabilities through every
masking rule (IPO, IcePop, KPop, DPPO, TIS, sequence rules, ...) across threshold sweeps.

The public API is the names below; each is imported on first use, so that `import
mismatch_replay` (and `mismatch-replay --help`) stays fast:

    sweep, replay      every rule x threshold in one streaming pass -> SweepResult / Tally
    choose, compare, drift, check      questions over one replay, dataclass results
    diagnose           why the run is mismatched: seven findings from one read
    inspect, convert   what a log holds; any supported log to the canonical Parquet
    figure_data        what the figures of `mismatch_replay.viz` draw
    TokenWriter        capture: what a training loop calls to write the canonical table
    Rule, Param, parse_rule            rules: the catalogue, and what a new rule subclasses

The functions live in api.py: sources first, keyword-only options, typed and documented
(docs/library.md has an example of each); every result is a dataclass with `.table`,
`.to_dict()` and a notebook rendering, and `print(result)` gives its summary in words.

The packages follow the layers of DESIGN.md, each depending only on those below it:
cli -> viz / analysis -> engine -> fast -> rules / metrics -> ingest (tests/test_architecture.py
checks that no import goes the other way and that no module reads another's private names).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> (module, attribute): the functions are api.py's (typed, keyword-only options,
# the internal functions behind them take the engine's plumbing); the classes are their own
_API = {
    "sweep": ("api", "sweep"),
    "replay": ("api", "replay"),
    "choose": ("api", "choose"),
    "compare": ("api", "compare"),
    "drift": ("api", "drift"),
    "drift_runs": ("api", "drift_runs"),
    "diagnose": ("api", "diagnose"),
    "check": ("api", "check"),
    "inspect": ("api", "inspect"),
    "convert": ("api", "convert"),
    "figure_data": ("api", "figure_data"),
    "TokenWriter": ("capture", "TokenWriter"),
    "Rule": ("rules", "Rule"),
    "Param": ("rules", "Param"),
    "parse_rule": ("rules", "parse_rule"),
}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        module, attr = _API[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
