"""The analyses' results in words and in one table: what `print(result)` and a notebook show.

Design
------
Each result class of this package (`ChooseResult`, `CompareResult`, `DriftResult`,
`CheckResult`, the inspect `Summary`, `FigureData`) is a `present.Presentable`: its
`summary_lines()` and its `.table` come from the functions here, which read the result's
fields only (duck-typed: this module imports none of the result modules, so every one of
them can import it). A table is one row per item the result lists (a choice, a cell of the
2 x 2 table, a step, a verdict), with the columns of that item's `to_dict()`.
"""

from __future__ import annotations

import polars as pl

from ..present import num, pct

SHOWN = 12  # items listed in a summary before "... and N more"


def frame(rows: list[dict]) -> pl.DataFrame:
    """Rows of plain values as a DataFrame (every row read for the schema)."""
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def _more(items: list, shown: int = SHOWN) -> list[str]:
    return [f"  ... and {len(items) - shown} more (see .table)"] if len(items) > shown else []


def choose_table(res) -> pl.DataFrame:
    return frame([{k: v for k, v in c.to_dict().items() if k != "curve"} for c in res.rows])


def choose_lines(res) -> list[str]:
    t = res.target_fraction
    aim = f"target {pct(t)} of tokens" if t is not None else "masked fraction at each setting"
    out = [f"ChooseResult: {aim}; choices: {len(res.rows)}"]
    for c in res.rows[:SHOWN]:
        what = "truncates" if c.kind == "weight" else "masks"
        if t is None:
            ci = f" (95% CI {pct(c.ci_low)} .. {pct(c.ci_high)})" if c.ci_low is not None else ""
            out.append(f"  {c.spec} {what} {pct(c.masked_fraction)}{ci}")
            continue
        ci = f" (95% CI {num(c.ci_low)} .. {num(c.ci_high)})" if c.ci_low is not None else ""
        rule = f"{c.rule}:{c.setting}" if c.setting else c.rule
        out.append(
            f"  {rule} {c.param} = {num(c.value)}{ci} {what} {pct(c.masked_fraction)} [{c.status}]"
        )
    return out + _more(res.rows)


def compare_table(res) -> pl.DataFrame:
    return frame([{"cell": k, **v.to_dict()} for k, v in res.cells.items()])


def compare_lines(res) -> list[str]:
    budget = f", each set to mask {pct(res.budget)}" if res.budget is not None else ""
    a, b, n = res.rule_a, res.rule_b, res.tokens
    out = [f"CompareResult: {a} (a) vs {b} (b) on {n:,} tokens{budget}"]
    out.append(
        f"  a masks {res.masked_a:,} ({pct(res.masked_a / n if n else None)}), "
        f"b masks {res.masked_b:,} ({pct(res.masked_b / n if n else None)}); "
        f"Jaccard {num(res.jaccard, 3)}"
    )
    out.append(
        f"  both {res.both:,}, only a {res.only_a:,}, only b {res.only_b:,}, "
        f"neither {res.neither:,}"
    )
    for name in ("only_a", "only_b"):
        c = res.cells.get(name)
        if c is not None and c.tokens:
            out.append(
                f"  {name}: mean q {num(c.mean_q, 3)}, mean p {num(c.mean_p, 3)}, "
                f"|p - q| mass {num(c.mass, 4)}"
            )
    for name in CELL_NAMES:  # what each cell's mask costs (with an advantage)
        c = res.cells.get(name)
        if c is not None and c.corrective is not None and name != "neither":
            out.append(
                f"  {name}: {c.corrective:,} corrective, {c.divergent:,} divergent, "
                f"{c.neutral:,} neutral; |A| mass {num(c.adv_mass, 4)}"
            )
    return out


CELL_NAMES = ("both", "only_a", "only_b", "neither")


def drift_table(res) -> pl.DataFrame:
    return frame([r.to_dict() for r in res.steps])


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:20])) + (" ..." if len(steps) > 20 else "") or "none"


def drift_lines(res) -> list[str]:
    base = res.baseline_steps
    span = f"{base[0]}..{base[-1]}" if base else "none"
    out = [
        f"DriftResult: {len(res.steps)} steps; baseline steps {span} "
        f"(trimmed k3 {num(res.baseline.kl_k3_trimmed)}); factor {num(res.factor)}, "
        f"min run {res.min_run}",
        f"  drift steps: {_steps(res.flagged_steps)}",
        f"  spike steps: {_steps(res.spike_steps)}",
    ]
    for v in res.rules[:SHOWN]:
        moved = ""
        if v.drift_fraction is not None:
            moved = f" -> {pct(v.drift_fraction)} in the drift steps"
        out.append(f"  {v.rule}: {pct(v.baseline_fraction)} in the baseline{moved}: {v.verdict}")
    return out + _more(res.rules)


def check_table(res) -> pl.DataFrame:
    return frame([v.to_dict() for v in res.verdicts])


def check_lines(res) -> list[str]:
    where = f", every one of {res.steps:,} steps" if res.per_step else ""
    n = len(res.verdicts)
    state = "passed" if res.passed else f"FAILED ({len(res.violations)} of {n} exceeded)"
    out = [f"CheckResult: {state}; limits: {n}, {res.tokens:,} tokens{where}"]
    for v in res.verdicts[:SHOWN]:
        worst = ""
        if v.worst_step is not None:
            worst = f" (worst step {v.worst_step}: {num(v.worst_value)})"
        mark = "ok  " if v.ok else "FAIL"
        out.append(f"  {mark} {v.limit.label} <= {num(v.limit.limit)}: {num(v.value)}{worst}")
    return out + _more(res.verdicts) + [f"note: {n}" for n in res.notes]


def inspect_lines(res) -> list[str]:
    seqs = f", {res.sequences:,} sequences" if res.sequences is not None else ""
    out = [
        f"Summary: {res.loss_tokens:,} loss tokens of {res.rows:,} rows, {res.steps:,} steps"
        f"{seqs} ({res.format}, {res.layout})",
        f"  files: {res.files[0]}" + (f" and {len(res.files) - 1:,} more" if res.files[1:] else ""),
        f"  columns: {', '.join(f'{k}={v}' if k != v else k for k, v in res.source.items())}",
        f"  invalid rows: {res.invalid_rows:,}",
    ]
    m = res.metrics
    out.append(
        f"  mismatch: kl_k3 {num(m.get('kl_k3'))}, kl_k1 {num(m.get('kl_k1'))}, "
        f"mean |p - q| {num(m.get('abs_dp_mean'))}"
    )
    if res.alignment:
        out.append(f"  alignment: {res.alignment}")
    return out + [f"warning: {w}" for w in res.warnings]


def figure_lines(res) -> list[str]:
    specs = ", ".join(r.spec() for r in res.settings)
    out = [
        f"FigureData: {res.tokens:,} tokens; sweep {res.sweep.height:,} rows; "
        f"{res.step_metrics.height:,} steps",
        f"  settings: {specs}",
    ]
    return out + [f"note: {n}" for n in res.notes]


__all__ = [
    "check_lines",
    "check_table",
    "choose_lines",
    "choose_table",
    "compare_lines",
    "compare_table",
    "drift_lines",
    "drift_table",
    "figure_lines",
    "frame",
    "inspect_lines",
]
