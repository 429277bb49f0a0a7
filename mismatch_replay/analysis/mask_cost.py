"""What a mask costs the learning signal, per setting: the table the figure and the finding read.

Design
------
Every sweep row carries what its mask costs (engine/readout.py, RULES.md "What a mask
costs"): the masked tokens split corrective / divergent / neutral, the share of the
advantage mass sum |A| they hold, their mean entropy beside the log's. `cost_table` picks the
one-value rows of a replay's table for a list of settings (the report's chosen settings
and the presets the field argues about, `COST_PRESETS`) into a small frame, one row a
setting, in the order given: what `masked_direction.png` draws (viz/plane.py) and what the
mask-cost finding quotes (findings.py), computed data only. The full replay already holds
these settings as one-value jobs (decisions.report_data's presets, figure_data's extras),
so the table costs no pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from ..engine.readout import COST_COLUMNS
from ..rules import Rule

# the presets of the IPO-vs-DPPO debate (issue 32): IPO's current and first prime-rl
# defaults, IcePop, DPPO's binary TV and KPop, all at prime-rl's values
COST_PRESETS = (
    "ipo@prime-rl",
    "ipo@prime-rl-legacy",
    "icepop@prime-rl",
    "dppo-tv@prime-rl",
    "kpop@prime-rl",
)
COLUMNS = ("spec", "rule", "kind", "tokens", "masked_tokens", *COST_COLUMNS)


def cost_table(table: pl.DataFrame, settings: Sequence[Rule]) -> pl.DataFrame | None:
    """One row per setting (in order, each once) from the one-value rows of `table` whose
    spec is the setting's: its masked (weight rules: truncated) tokens and what they cost.
    None where the table has no such row, or no cost columns (no advantage column)."""
    need = {"spec", "masked_corrective", "masked_adv_mass_fraction"}
    if table is None or table.height == 0 or not need <= set(table.columns):
        return None
    rows, seen = [], set()
    for rule in settings:
        spec = rule.spec()
        if spec in seen:
            continue
        got = table.filter(pl.col("spec") == spec).head(1)
        if got.height == 0:
            continue
        r = got.row(0, named=True)
        if r["masked_corrective"] is None:
            continue
        seen.add(spec)
        hit = r["truncated_tokens"] if r["kind"] == "weight" else r["masked_tokens"]
        rows.append({c: (hit if c == "masked_tokens" else r.get(c)) for c in COLUMNS})
    if not rows:
        return None
    return pl.DataFrame(rows, schema={c: _dtype(c) for c in COLUMNS})


def _dtype(c: str):
    if c in ("spec", "rule", "kind"):
        return pl.String
    if c in ("tokens", "masked_tokens", "masked_corrective", "masked_divergent", "masked_neutral"):
        return pl.Int64
    return pl.Float64
