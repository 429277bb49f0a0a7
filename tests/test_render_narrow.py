"""sweep's and compare's tables on a narrow terminal (cli/render.py), in-process with a rich
Console of a fixed width: where the whole table does not fit, the mask-cost columns (issue
32) go to a second table of the same rows, and sweep's folded tables are one per job (a rule
setting and its swept parameter), never one per row (86eb9c5 grouped them by the per-value
SPEC: a table for every value)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

import mismatch_replay as mr
from mismatch_replay.cli import render

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")


def printed(fn, width: int) -> str:
    """What `fn` prints on stdout at `width` columns."""
    buf = io.StringIO()
    old, render.out = render.out, Console(file=buf, width=width, color_system=None)
    try:
        fn()
    finally:
        render.out = old
    text = buf.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= width, text
    return text


def rows(text: str) -> list[list[str]]:
    """The body rows of every table in `text`, as their cells."""
    return [[c.strip() for c in line.split("│")] for line in text.splitlines() if "│" in line]


@pytest.fixture(scope="module")
def table():
    return mr.sweep([GOLDEN], rules=["ipo:eps=0.3", "ipo:eps=0.1", "dppo-kl"]).table


def test_sweep_wide_is_one_table_with_its_cost_columns(table):
    text = printed(lambda: render.print_sweep(table, None, False), 160)
    assert text.count("masked by each mask rule") == 1 and "tokens cost" not in text
    head = next(x for x in text.splitlines() if "┃" in x)
    assert "|dp| masked" in head and "corrective" in head and "|A| masked" in head


def test_sweep_at_80_columns_the_costs_in_a_second_table_of_the_same_rows(table):
    text = printed(lambda: render.print_sweep(table, None, False), 80)
    first, second = text.split("what each mask rule's masked tokens cost")
    assert "masked by each mask rule" in first and "|dp| masked" in first
    assert "corrective" not in first and "masked n" not in second
    values = [render.fmt_num(v) for v in table["value"]]
    assert [r[2] for r in rows(first) if r[2]] == values
    want = [
        [render.fmt_num(v), render.pct(c), render.pct(a)]
        for v, c, a in zip(
            table["value"],
            table["masked_corrective_fraction"],
            table["masked_adv_mass_fraction"],
            strict=True,
        )
    ]
    assert [r[2:] for r in rows(second) if r[2]] == want


def test_sweep_folded_one_table_per_job_not_per_row(table):
    text = printed(lambda: render.print_sweep(table, None, False), 50)
    flat = " ".join(text.split())
    # two jobs (ipo's two values share one; dppo-kl low), each its counts and its costs
    assert len(re.findall(r"\bswept\b", flat)) == 4, text
    assert flat.count("masked by ipo, eps swept") == 1
    assert flat.count("what ipo's masked tokens cost, eps swept") == 1
    assert "masked by dppo-kl [high=0.05, clamp=1e-06], low swept" in flat
    ipo = text.split("masked by dppo-kl")[0]
    assert [r[0] for r in rows(ipo)] == ["0.3", "0.1", "0.3", "0.1"]  # counts, then costs


def test_compare_at_80_columns_the_cells_costs_in_a_second_table():
    res = mr.compare([GOLDEN], "ipo:eps=0.3", "icepop:low=0.2,high=5")
    wide = printed(lambda: render.print_compare(res, None), 160)
    assert "tokens cost" not in wide and "corrective" in wide
    text = printed(lambda: render.print_compare(res, None), 80)
    first, second = text.split("what each cell's tokens cost")
    assert "corrective" not in first and "fraction" not in second
    cells = [res.cells[k] for k in ("both", "only_a", "only_b", "neither")]
    got = [r for r in rows(second) if len(r) == 4]
    assert got == [
        [label, f"{c.corrective:,}", f"{c.divergent:,}", render.fmt_num(c.adv_mass)]
        for label, c in zip(["masked by both", "only A", "only B", "neither"], cells, strict=True)
    ]
    assert [r[1] for r in rows(first) if len(r) == 6] == [f"{c.tokens:,}" for c in cells]
