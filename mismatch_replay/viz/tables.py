"""The tables the figures and the report draw from a sweep table: its lines and the presets.

Design
------
A sweep table has one row per (rule, setting, param, value), and per group when the sweep
was grouped (step, env, q_bucket). `ungrouped` sums the groups back to one row per value
(counts add, fractions are recomputed); `sweep_lines` cuts the table into the curves of the
masked-fraction figure, one per (rule, setting, param), NaN-free and sorted by value.
`preset_points` places every rule's catalogue presets (its default when it has none) on
those lines: exact where a preset is a grid point, interpolated between the two neighbouring
grid points otherwise (masked fractions are monotone in a threshold, so the true value lies
between them). The masked-fraction figure draws these points as markers and the report lists
them ("Every rule at its presets"), so both read one table computed here, in plain polars.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from ..rules import REGISTRY
from .style import fraction_column

_LINE_KEYS = ["rule", "setting", "param"]
_GROUP_KEYS = ("step", "env", "q_bucket")


def ungrouped(table: pl.DataFrame) -> pl.DataFrame:
    """A sweep table with one row per (rule, setting, param, value): groups summed."""
    groups = [c for c in _GROUP_KEYS if c in table.columns]
    if not groups:
        return table
    keys = [*_LINE_KEYS, "value", "kind"]
    return (
        table.group_by(keys, maintain_order=True)
        .agg(pl.col("tokens", "masked_tokens", "truncated_tokens").sum())
        .with_columns(
            masked_fraction=pl.when(pl.col("tokens") > 0).then(
                pl.col("masked_tokens") / pl.col("tokens")
            ),
            truncated_fraction=pl.when(pl.col("tokens") > 0).then(
                pl.col("truncated_tokens") / pl.col("tokens")
            ),
        )
    )


def sweep_lines(table: pl.DataFrame) -> list[dict]:
    """One dict per (rule, setting, param) line of a sweep table: rule, setting, param, kind,
    and the arrays x (values, sorted), y (fractions, null and NaN rows dropped), tokens."""
    out = []
    for (rule, setting, param), part in table.group_by(_LINE_KEYS, maintain_order=True):
        kind = part["kind"][0] if "kind" in part.columns else "mask"
        col = fraction_column(kind)
        part = part.filter(pl.col(col).is_not_null() & pl.col(col).is_not_nan()).sort("value")
        if part.height == 0:
            continue
        out.append(
            {
                "rule": rule,
                "setting": setting or "",
                "param": param,
                "kind": kind,
                "x": part["value"].to_numpy().astype(float),
                "y": part[col].to_numpy().astype(float),
                "tokens": part["tokens"].to_numpy().astype(float),
            }
        )
    return out


def preset_points(table: pl.DataFrame) -> pl.DataFrame:
    """The rules' presets (or their default, when a rule has none) on each sweep line.

    A preset lies on the line (rule, setting, param) when its other parameters equal the
    line's setting. `fraction` is the table's value there when the preset value is a grid
    point (`exact` true); otherwise it is interpolated between the two neighbouring grid
    points (the true value lies between them: masked fractions are monotone in a threshold).
    Presets outside the grid are left out. Columns: rule, setting, param, value, presets,
    kind, fraction, exact.
    """
    rows = []
    for line in sweep_lines(ungrouped(table)):
        cls = REGISTRY.get(line["rule"])
        if cls is None:
            continue
        cands = list(cls.presets.items()) or [("default", {})]
        by_value: dict[float, list[str]] = {}
        for pname, vals in cands:
            try:
                r = cls(**vals)
            except TypeError:
                continue
            v = getattr(r, line["param"], None)
            if v is None or r.setting(line["param"]) != line["setting"]:
                continue
            by_value.setdefault(float(v), []).append(pname)
        x, y = line["x"], line["y"]
        for v, names in by_value.items():
            hit = np.flatnonzero(np.isclose(x, v, rtol=1e-9, atol=0.0))
            if hit.size:
                frac, exact = float(y[hit[0]]), True
            elif x.size >= 2 and x[0] < v < x[-1]:
                lx = np.log(x) if np.all(x > 0) else x
                lv = math.log(v) if np.all(x > 0) else v
                frac, exact = float(np.interp(lv, lx, y)), False
            else:
                continue
            rows.append(
                {
                    "rule": line["rule"],
                    "setting": line["setting"],
                    "param": line["param"],
                    "value": v,
                    "presets": ", ".join(names),
                    "kind": line["kind"],
                    "fraction": frac,
                    "exact": exact,
                }
            )
    schema = {
        "rule": pl.String,
        "setting": pl.String,
        "param": pl.String,
        "value": pl.Float64,
        "presets": pl.String,
        "kind": pl.String,
        "fraction": pl.Float64,
        "exact": pl.Boolean,
    }
    return pl.DataFrame(rows, schema=schema)
