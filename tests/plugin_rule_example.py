"""A masking rule written outside the package, swept on the fused path.

    python tests/plugin_rule_example.py LOG

defines "masked iff |log p - log q| > eps" as one class, sweeps eps = 0.1, 0.5, 1.0 over LOG
and prints one JSON line, {"masked_tokens": {"0.1": n, "0.5": n, "1.0": n}, "path": "fused"},
where "path" is the path that computed the counts as the sweep result reports it.

A rule is a frozen dataclass subclassing `mismatch_replay.rules.Rule`, with one field per
parameter, `params` (name, help, default grid, domain) and `score(batch, param)`: masked iff
the score exceeds the threshold. For the fused path it also declares `quantities`: per
threshold parameter, the per-token quantity that parameter thresholds, here "|l|" (the names
are `mismatch_replay.fast.QUANTITIES`). The fused path does not take the declaration on
trust: it runs this class's own score() on points of the quantity's coordinate (and on
batches that differ in everything else, to check that nothing else moves it) and derives
its bins from that, so the two paths cannot disagree about the rule.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from mismatch_replay import sweep
from mismatch_replay.rules import Param, Rule

EPS = ("0.1", "0.5", "1.0")


@dataclass(frozen=True)
class AbsLogRatio(Rule):
    """Masked iff |log p_train - log p_infer| > eps."""

    name: ClassVar[str] = "abs-l"
    title: ClassVar[str] = "absolute log-ratio mask"
    definition: ClassVar[str] = "|l| > eps (strict)"
    params: ClassVar[tuple] = (Param("eps", "largest allowed |log p - log q|", "0.1,0.5,1"),)
    quantities: ClassVar[dict] = {"eps": "|l|"}
    eps: float | None = 0.5

    def score(self, b, param):
        return np.abs(b.l)


def run(log: str) -> dict:
    """The sweep's masked-token counts at each eps, and the path that computed them."""
    res = sweep([log], rules=[AbsLogRatio()], sweeps={"eps": [float(e) for e in EPS]})
    counts = {}
    for e in EPS:
        row = res.table.filter(np.isclose(res.table["value"].to_numpy(), float(e)))
        counts[e] = int(row["masked_tokens"].item())
    paths = {p["path"] for p in res.paths}
    return {"masked_tokens": counts, "path": paths.pop() if len(paths) == 1 else sorted(paths)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/plugin_rule_example.py LOG")
    print(json.dumps(run(sys.argv[1])))
