"""`demo` in a real terminal 80 columns wide: after its list of files, "What this log says"
on stderr, each sentence whole (wrapped between words with a hanging indent, never inside a
number) and the same sentences as the report's and as `analysis.findings` computes them
in-process from the same sample (the bootstrap is seeded: the same intervals)."""

from __future__ import annotations

import html
import re

import pytest
from test_pty import check, run_pty

from mismatch_replay import analysis
from mismatch_replay.analysis.diagnose import diagnose
from mismatch_replay.viz.jobs import sample_path

pytestmark = pytest.mark.slow

COLS = 80


def items(lines: list[str], header: str = "What this log says") -> list[str]:
    """The bullet items under `header` on the final screen, their wrapped lines joined."""
    start = lines.index(header) + 1
    out: list[str] = []
    for line in lines[start:]:
        if line.startswith("- "):
            out.append(line[2:])
        elif line.startswith("  ") and out:
            out[-1] += " " + line.strip()
        else:
            break
    return out


def test_demo_ends_with_the_findings_at_80_columns(tmp_path):
    rc, raw = run_pty(["demo", "-o", "d"], COLS, tmp_path)
    out = check(rc, raw, COLS, "demo")
    lines = out.split("\n")
    # after the list of files and the line saying which page to open
    assert lines.index("What this log says") > lines.index("Open d/index.html in a browser.")
    assert all(len(x) <= COLS for x in lines)
    shown = items(lines)
    # the same sentences as the library's, each whole, with its numbers
    got: dict = {}
    data, dec = analysis.report_data([sample_path()], None, 0.0025, bootstrap=200, summary=got)
    # demo runs diagnose too (b291108): its verdicts open the list, after the mismatch
    diagnosis = diagnose([sample_path()])
    found = analysis.findings(data, dec, log_format=got["summary"].format, diagnosis=diagnosis)
    assert shown == found.sentences
    assert found.get("diagnose") is not None and found.get("mask_cost") is not None
    for f in found:
        assert f.numbers and all(n.text in f.sentence for n in f.numbers)
    assert found.get("mismatch").value("tokens") == data.tokens
    # and the report's opening section says the same
    page = (tmp_path / "d" / "index.html").read_text(encoding="utf-8")
    section = page[page.index('<section class="findings">') :]
    section = section[: section.index("</section>")]
    assert [html.unescape(x) for x in re.findall(r"<li>(.*?)</li>", section)] == shown
