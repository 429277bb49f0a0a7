"""How a result shows itself: `print(result)` and a notebook cell.

Design
------
Every result the public API returns (`SweepResult`, `Tally`, `ChooseResult`,
`CompareResult`, `DriftResult`, `CheckResult`, the inspect `Summary`, `ConvertResult`,
`FigureData`) is a dataclass with `.table` (a polars DataFrame: its rows), `.to_dict()`
(plain Python values: what `--json` prints) and `summary_lines()` (a few lines of words and
numbers). This mixin turns the last two into the two ways a result is looked at:

* `__str__`: the summary lines, so that `print(result)` reads like the command line's answer
  and not like a dataclass repr of numpy arrays (the repr stays the dataclass's, for
  debugging);
* `_repr_pretty_`: the same text where IPython echoes a result (its text/plain);
* `_repr_html_`: the summary lines as a heading and a list, then the head of `.table` as
  polars renders it (`HTML_ROWS` rows: a notebook cell stays short; the whole table is
  `result.table`).

It sits below every layer (imports nothing of the package) so that the engine's and the
analyses' results can share it; polars is imported by the caller's module already.
"""

from __future__ import annotations

import html

HTML_ROWS = 10  # table rows a notebook cell shows


class Presentable:
    """Mixin: `__str__` and `_repr_html_` from `summary_lines()` and `.table`."""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        # IPython takes the first class of the MRO that defines `_repr_pretty_` or
        # `__repr__`, and @dataclass writes a `__repr__` into each result class itself
        cls._repr_pretty_ = Presentable._repr_pretty_

    def summary_lines(self) -> list[str]:  # pragma: no cover - every result defines it
        raise NotImplementedError

    def __str__(self) -> str:
        return "\n".join(self.summary_lines())

    def _repr_pretty_(self, p, cycle: bool) -> None:
        """IPython's text form (a notebook's text/plain, the shell's echo): the summary."""
        p.text(str(self))

    def _repr_html_(self) -> str:
        lines = self.summary_lines()
        head, rest = (lines[0], lines[1:]) if lines else (type(self).__name__, [])
        items = "".join(f"<li>{html.escape(s.strip())}</li>" for s in rest)
        table = self.table
        body = ""
        if table is not None and table.width:
            import polars as pl

            with pl.Config(tbl_rows=HTML_ROWS):
                body = table.head(HTML_ROWS)._repr_html_()
            if table.height > HTML_ROWS:
                body += (
                    f"<p><i>first {HTML_ROWS} of {table.height:,} rows; "
                    "the whole table is <code>.table</code></i></p>"
                )
        return (
            '<div class="mismatch-replay-result">'
            f"<p><b>{html.escape(head)}</b></p>"
            f"{f'<ul>{items}</ul>' if items else ''}{body}</div>"
        )


def pct(x: float | None, digits: int = 3) -> str:
    """A fraction as a percentage with `digits` significant digits ('n/a' for None / NaN)."""
    if x is None or x != x:
        return "n/a"
    return f"{100 * x:.{digits}g}%"


def num(x: float | None, digits: int = 4) -> str:
    """A number with `digits` significant digits ('n/a' for None / NaN)."""
    if x is None or x != x:
        return "n/a"
    return f"{x:.{digits}g}"


def sweep_lines(
    kind: str, table, metrics, tokens: int, by: str | None, paths, notes, warnings
) -> list[str]:
    """The summary of a sweep table (`SweepResult`, `Tally`): one line a rule setting and
    swept parameter (its values and masked fractions, over all groups), the headline
    metrics, the paths, the notes. `table`, `metrics`: polars DataFrames."""
    import polars as pl

    grouped = f", by {by}" if by else ""
    out = [f"{kind}: {table.height:,} rows, {tokens:,} loss tokens{grouped}"]
    if table.height:
        flat = table.group_by(["rule", "setting", "param", "value"], maintain_order=True).agg(
            pl.col("kind").first(),
            pl.col("spec").first(),
            pl.col("masked_tokens").sum(),
            pl.col("truncated_tokens").sum(),
            pl.col("tokens").sum(),
        )
        jobs = flat.group_by(["rule", "setting", "param"], maintain_order=True).agg(
            pl.col("value"),
            pl.col("kind").first(),
            pl.col("spec").first(),
            (pl.col("masked_tokens") / pl.col("tokens")).alias("masked"),
            (pl.col("truncated_tokens") / pl.col("tokens")).alias("truncated"),
        )
        shown = 12
        for row in jobs.head(shown).iter_rows(named=True):
            what = "truncates" if row["kind"] == "weight" else "masks"
            f = row["truncated"] if row["kind"] == "weight" else row["masked"]
            vals = row["value"]
            if len(vals) == 1:
                out.append(f"  {row['spec']} {what} {pct(f[0])} of tokens")
            else:
                name = f"{row['rule']}{':' + row['setting'] if row['setting'] else ''}"
                out.append(
                    f"  {name} {row['param']} {num(vals[0])} .. {num(vals[-1])} "
                    f"({len(vals)} values): {what} {pct(f[0])} .. {pct(f[-1])} of tokens"
                )
        if jobs.height > shown:
            out.append(f"  ... and {jobs.height - shown} more settings (see .table)")
    if metrics is not None and metrics.height == 1 and "kl_k3" in metrics.columns:
        m = metrics.row(0, named=True)
        out.append(
            f"mismatch: kl_k3 {num(m.get('kl_k3'))}, kl_k1 {num(m.get('kl_k1'))}, "
            f"mean |p - q| {num(m.get('abs_dp_mean'))}"
        )
    elif metrics is not None and metrics.height:
        out.append(f"mismatch metrics per {by}: .metrics ({metrics.height:,} rows)")
    if paths:
        fused = sum(p.get("path") == "fused" for p in paths)
        out.append(f"paths: {fused} of {len(paths)} jobs fused, {len(paths) - fused} simple")
    out += [f"note: {n}" for n in notes] + [f"warning: {w}" for w in warnings]
    return out


__all__ = ["HTML_ROWS", "Presentable", "num", "pct", "sweep_lines"]
