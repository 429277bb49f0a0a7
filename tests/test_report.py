"""report: the self-contained HTML page (figures embedded, tables, command, version, date)."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import polars as pl
import pytest

from mismatch_replay import __version__, analysis
from mismatch_replay.errors import UsageError
from mismatch_replay.viz import render, report

GOLDEN = Path(__file__).parent / "data" / "golden_log.parquet"
COMMAND = "mismatch-replay report tests/data/golden_log.parquet -o out --rule 'ipo:eps=0.3' <&>"


@pytest.fixture(scope="module")
def data():
    return analysis.figure_data([str(GOLDEN)])


@pytest.fixture(scope="module")
def written(data, tmp_path_factory):
    """One real report (figures rendered for real), shared by the tests below."""
    out = tmp_path_factory.mktemp("report")
    summary = {"rows": 20969, "loss_tokens": data.tokens, "invalid_rows": 0, "layout": "x<y"}
    decision = ("Decision", "<p><b>eps = 0.3</b>: masks only the tail.</p>")
    index = report.write_report(
        data,
        out,
        command=COMMAND,
        summary=summary,
        target_fraction=0.01,
        sections=[decision],
        dpi=40,
    )
    return index, index.read_text(encoding="utf-8")


def stub_render(data, outdir, fmt="png", target_fraction=None, force=False, dpi=150):
    """render_all's file behaviour with 1-pixel PNGs (fast)."""
    png = base64.b64decode(
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
    )
    outdir = Path(outdir)
    paths = {n: outdir / f"{n}.{fmt}" for n in render.FIGURES}
    existing = [p for p in paths.values() if p.exists()]
    if existing and not force:
        raise UsageError(f"{existing[0]}: the file exists; pass --force to overwrite it.")
    outdir.mkdir(parents=True, exist_ok=True)
    for p in paths.values():
        p.write_bytes(png)
    return paths


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_files(written):
    index, _ = written
    assert index.name == "index.html"
    for name in render.FIGURES:
        assert (index.parent / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in index.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_is_self_contained(written):
    index, page = written
    uris = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(uris) == len(render.FIGURES) == 6  # masked_direction since 1a02320
    # the embedded bytes are the PNGs written next to the page, in figure order
    for name, uri in zip(render.FIGURES, uris, strict=True):
        assert base64.b64decode(uri) == (index.parent / f"{name}.png").read_bytes()
    assert "<script" not in page.lower()
    assert not re.search(r'(src|href)="(https?:)?//', page)  # no external resources
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_command_version_date_escaped(written):
    _, page = written
    escaped = "mismatch-replay report tests/data/golden_log.parquet -o out --rule &#x27;ipo:"
    assert escaped in page
    assert "&lt;&amp;&gt;" in page and "<&>" not in page
    assert f"mismatch-replay {__version__}" in page
    assert re.search(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC", page)
    assert "x&lt;y" in page  # summary values are escaped too


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_tables(written, data):
    _, page = written
    for header in (
        "<th>setting</th>",
        "<th>masked fraction</th>",
        "<th>sequences with a masked token</th>",
        "<th>preset(s)</th>",
        "<th>swept parameter</th>",
        "<th>metric</th>",
        "<th>framework name</th>",
        "<th>masked when</th>",
        "<th>presets</th>",
    ):
        assert header in page, header
    # the chosen settings with their exact counts
    for spec in data.steps["spec"].unique().to_list():
        assert f"<td>{spec}</td>" in page
    ipo = data.steps.filter(pl.col("spec") == "ipo@prime-rl:eps=0.3")
    masked = int(ipo["masked_tokens"].sum())
    assert f'<td class="num">{masked:,}</td>' in page
    # the summary, the metrics and the catalogue
    assert "19,598" in page and "20,969" in page
    assert "mismatch_kl/all/mean (prime-rl)" in page
    assert "<td>kpop</td>" in page and "prime-rl: eps=0.3" in page
    assert "Target masked fraction: 1%" in page


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_extra_sections(written):
    _, page = written
    assert '<section class="extra"><h2>Decision</h2><p><b>eps = 0.3</b>' in page
    # answers first: after the seed's pair of figures, before the settings; the summary is a
    # reference table, collapsed at the end
    assert page.index("<h2>Masked fraction vs threshold</h2>") < page.index("<h2>Decision</h2>")
    assert page.index("<h2>Decision</h2>") < page.index("<h2>Chosen settings</h2>")
    assert page.index("<h2>Decision</h2>") < page.index("<details><summary>Summary</summary>")


def test_settings_table_is_exact(data):
    t = report.settings_table(data)
    assert t["spec"].to_list() == data.steps["spec"].unique(maintain_order=True).to_list()
    for row in t.iter_rows(named=True):
        rows = data.steps.filter(pl.col("spec") == row["spec"])
        assert row["tokens"] == data.tokens
        assert row["masked_tokens"] == rows["masked_tokens"].sum()
        assert row["masked_fraction"] == pytest.approx(row["masked_tokens"] / data.tokens)
        assert row["sequences"] == rows["sequences"].sum()


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_refuses_overwrite(written, data):
    index, page = written
    with pytest.raises(UsageError, match=r"index\.html.*pass --force"):
        report.write_report(data, index.parent, command="again")
    assert index.read_text(encoding="utf-8") == page


def test_report_force_and_figures_guard(data, tmp_path, monkeypatch):
    monkeypatch.setattr(render, "render_all", stub_render)
    first = report.write_report(data, tmp_path, command="one")
    assert "<pre>one</pre>" in first.read_text(encoding="utf-8")
    second = report.write_report(data, tmp_path, command="two", force=True)
    assert "<pre>two</pre>" in second.read_text(encoding="utf-8")
    # a figure in the way (no index.html yet) is refused too
    other = tmp_path / "other"
    other.mkdir()
    (other / "steps.png").write_bytes(b"x")
    with pytest.raises(UsageError, match="pass --force"):
        report.write_report(data, other, command="three")
    assert not (other / "index.html").exists()
    with pytest.raises(UsageError, match="a file"):
        report.write_report(data, tmp_path / "index.html", command="four", force=True)


def test_chosen_settings_list_what_choose_chose(data):
    rows = analysis.choose(
        [str(GOLDEN)], 0.01, ["ipo", "icepop@prime-rl"], bootstrap=20, curve=True
    )
    page = report.render_html(data, {}, command="c", choices=rows, date="d")
    chosen = page[page.index("<h2>Chosen settings</h2>") : page.index("<h2>Plotted settings</h2>")]
    for r in rows:
        assert html_escape(r.spec) in chosen
        assert f"{r.param}={report._num(r.value)}" in chosen
        for pt in r.curve:  # the masked-fraction-vs-threshold table around the choice
            assert f'<td class="num">{report._num(pt.masked_tokens)}</td>' in chosen
    assert chosen.count('<div class="curve">') == len(rows)
    assert chosen.count('style="font-weight:bold"') == len(rows)  # the chosen value, per rule
    # without choices the page is as before: the plotted settings under "Chosen settings"
    plain = report.render_html(data, {}, command="c", date="d")
    assert "Plotted settings" not in plain and "sequences with a masked token" in plain


def html_escape(s: str) -> str:
    import html

    return html.escape(s, quote=True)


@pytest.mark.slow  # the module's real report (figures drawn)
def test_report_embeds_masked_by_length_with_its_caption(written):
    _, page = written
    part = page[page.index("<h2>Masked fraction by sequence length</h2>") :]
    part = part[: part.index("</figure>")]
    assert 'alt="Masked fraction by sequence length" src="data:image/png;base64,' in part
    caption = part[part.index("<figcaption>") :]
    assert "product-ratio" in caption and "geometric-mean" in caption


def test_report_without_sequence_ids_says_why_the_length_figure_is_missing(data):
    import dataclasses

    from mismatch_replay.analysis.figure_data import NO_LENGTH_NOTE

    bare = dataclasses.replace(data, by_length=None, notes=[*data.notes, NO_LENGTH_NOTE])
    assert "masked_by_length" not in render.figures(bare)
    page = report.render_html(bare, {"steps": b"x"}, command="c", date="d")
    part = page[page.index("<h2>Masked fraction by sequence length</h2>") :]
    assert part.index("no sequence ids (sample_id)") < part.index("<h2>", 1)  # in its place
    assert "--map sample_id=COLUMN" in page
