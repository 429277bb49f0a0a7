"""One self-contained HTML report: the figures, the tables, the Decision and the command.

Design
------
`write_report` renders the figures with `render.render_all` (PNG files next to the page;
masked_by_length only where the log has sequence ids, a line in its place otherwise) and
embeds the same bytes in `index.html` as base64 data URIs, so the page alone is enough to
attach to a PR or an issue (~0.5-1 MB for the five figures at 150 dpi). Plain HTML
with inline CSS: no scripts, no external fonts or style sheets. Every piece of text that
comes from data, the command line or the catalogue goes through `html.escape`; the page is
written through `output.atomic_write`. `render_html` builds the page as a string from what
is already computed, so a caller may embed other images or none.

The tables:
* the chosen settings, exactly (`settings_table`): the per-step table summed over steps
  (counts add; sequences are keyed by (step, sample_id), so masked sequences add too);
* what `choose` chose, with the masked fraction at the grid values around each choice;
* the compact sweep: every rule at each of its presets (`tables.preset_points`), exact where
  the preset is a grid point of the sweep, marked "≈" where it falls between two;
* the inspect-style summary and the mismatch metrics with the names frameworks log them under;
* the rule catalogue's defaults and presets.

The page gives answers first: "What this log says" (`findings=`, the sentences of
`analysis.findings`, built from the result objects), the seed's pair of figures (scatter with
the IPO band and the IcePop cone, masked fraction against threshold), then the decisions, the
other figures, and last the reference tables (the summary and metrics, every rule at its
presets, the catalogue), each collapsed in a <details>. At 1280x800 the findings are above
the fold (tests/test_browser.py checks it in headless Chromium).
Extra sections are passed as `sections=[(title, html)]` and placed right after the two
figures: the "Decision" (`decision_html`, from `analysis.decisions()`:
which threshold, which rule, did the run drift, each a small table and one sentence) and
the float32 check (`precision_section`). The Decision rounds its numbers for reading
(4 significant digits); the JSON of `--json` keeps the full precision.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from .. import __version__
from ..errors import UsageError
from ..metrics import NAMES
from ..output import atomic_write
from ..rules import catalogue_records, parse_rule
from . import render
from .style import display_name, spec_label
from .tables import preset_points

if TYPE_CHECKING:
    from ..analysis import (
        Choice,
        CompareResult,
        Decisions,
        DriftResult,
        FigureData,
        PrecisionResult,
    )

INDEX = "index.html"
DPI = 150  # of the report's PNGs (~1 MB for the page)

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
       max-width: 1280px; margin: 2em auto; padding: 0 1.5em; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.meta { color: #555; font-size: 0.92em; }
table { border-collapse: collapse; font-size: 0.86em; margin: 0.6em 0 1em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
div.curve { display: inline-block; vertical-align: top; margin-right: 1.5em; }
div.curve h3 { font-size: 0.95em; margin-bottom: 0.2em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0 2em; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: 0.9em; max-width: 60em; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 0.9em; }
.note { color: #555; font-size: 0.88em; }
section.extra { border-left: 4px solid #0072B2; padding-left: 1em; }
section.findings { background: #f3f8fc; border-left: 4px solid #0072B2; padding: 0.3em 1em; }
section.findings h2 { margin-top: 0.4em; border-bottom: none; }
section.findings ul { margin: 0.3em 0 0.6em; padding-left: 1.2em; }
section.findings li { margin: 0.25em 0; }
details { margin: 0.8em 0; }
details > summary { cursor: pointer; font-weight: 600; font-size: 1.05em; }
"""

_CAPTIONS = {
    "scatter": (
        "Sampled tokens by inference (sampler) probability q and trainer probability p, as a "
        "density (tokens per bin, log colour scale); left on linear axes, right on log-log axes "
        "where rare tokens are visible. Lines: the IPO band p = q ± eps (masked outside, "
        "same width in probability everywhere) and the IcePop ratio cone p = low·q, p = high·q "
        "(straight lines on log-log axes: narrow near zero, wide near one)."
    ),
    "masked_fraction": (
        "Fraction of tokens masked (weight rules: truncated) as a function of each rule's "
        "threshold, one panel per parameter family. Markers: the rules' presets."
    ),
    "steps": (
        "Per trainer step: the mismatch KL (k3 token mean, prime-rl's mismatch_kl/all/mean) "
        "and each chosen setting's masked fraction. Drift shows as both rising."
    ),
    "where_masked": (
        "Masked fraction per inference-probability bucket for each chosen setting: a ratio "
        "band masks rare tokens, a probability band likely ones."
    ),
    "masked_by_length": (
        "Masked fraction per sequence-length bucket: a product-ratio mask (seq-MIS) tightens "
        "as sequences grow, a geometric-mean one (geo-MIS) does not; IcePop for reference."
    ),
    "masked_direction": (
        "What each setting's mask costs the policy gradient (the chosen settings and the "
        "presets of the IPO-vs-DPPO debate). Left: its masked tokens split by the direction "
        "of their update: corrective (A·(p−q) < 0, the step pulls p back toward q), "
        "divergent (A·(p−q) > 0) and neutral (A = 0 or p = q); DPPO and PPO-clip mask "
        "divergent updates only. Middle: the share of the advantage mass Σ|A| it removes "
        "beside its share of the tokens. Right: the masked tokens' mean entropy against "
        "every loss token's."
    ),
}
_TITLES = {
    "scatter": "Trainer vs inference probability",
    "masked_fraction": "Masked fraction vs threshold",
    "steps": "Per step",
    "where_masked": "Where each setting masks",
    "masked_by_length": "Masked fraction by sequence length",
    "masked_direction": "What each mask costs the gradient",
}


# ----------------------------------------------------------------------------- formatting


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _num(v, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "—"
        if v == int(v) and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:.{digits}g}"
    return str(v)


def _pct(f) -> str:
    if f is None or f != f:
        return "—"
    if f == 0:
        return "0"
    return f"{100 * f:.3g}%"


def _table(headers: Sequence[str], rows: Sequence[Sequence], numeric: Sequence[int] = ()) -> str:
    """An HTML table; every cell escaped. `numeric`: column indexes aligned right."""
    num = set(numeric)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{_e(c)}</td>' if i in num else f"<td>{_e(c)}</td>"
            for i, c in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


# ----------------------------------------------------------------------------- tables


def settings_table(data: FigureData) -> pl.DataFrame:
    """The chosen settings over the whole log, exactly: the per-step rows summed over steps."""
    t = data.steps
    if t.height == 0:
        return t
    total_mass = (data.metrics.get("abs_dp_mean") or 0.0) * data.tokens
    agg = (
        t.group_by(["spec", "rule", "kind", "level"], maintain_order=True)
        .agg(
            pl.col("tokens", "masked_tokens", "truncated_tokens", "masked_mass").sum(),
            pl.col("sequences").sum().alias("sequences"),
            pl.col("masked_sequences").sum().alias("masked_sequences"),
            pl.col("sequences").is_null().any().alias("_noseq"),
        )
        .with_columns(
            masked_fraction=pl.col("masked_tokens") / pl.col("tokens"),
            truncated_fraction=pl.col("truncated_tokens") / pl.col("tokens"),
            masked_sequence_fraction=pl.when(~pl.col("_noseq") & (pl.col("sequences") > 0)).then(
                pl.col("masked_sequences") / pl.col("sequences")
            ),
            masked_mass_fraction=(
                pl.col("masked_mass") / total_mass if total_mass > 0 else pl.lit(None)
            ),
        )
    )
    return agg.with_columns(
        pl.when(~pl.col("_noseq")).then(pl.col("sequences")).alias("sequences"),
        pl.when(~pl.col("_noseq")).then(pl.col("masked_sequences")).alias("masked_sequences"),
    ).drop("_noseq")


def _settings_html(data: FigureData) -> str:
    t = settings_table(data)
    if t.height == 0:
        return '<p class="note">No settings were chosen.</p>'
    rows = []
    for r in t.iter_rows(named=True):
        weight = r["kind"] == "weight"
        seqs = (
            f"{_num(r['masked_sequences'])} / {_num(r['sequences'])} "
            f"({_pct(r['masked_sequence_fraction'])})"
            if r["sequences"] is not None
            else "—"
        )
        rows.append(
            [
                spec_label(r["spec"]),
                r["spec"],
                _num(r["tokens"]),
                _num(r["truncated_tokens" if weight else "masked_tokens"]),
                _pct(r["truncated_fraction" if weight else "masked_fraction"])
                + (" truncated" if weight else ""),
                seqs,
                _pct(r["masked_mass_fraction"]) if not weight else "—",
            ]
        )
    headers = [
        "setting",
        "spec",
        "tokens",
        "masked tokens",
        "masked fraction",
        "sequences with a masked token",
        "share of |p−q| mass masked",
    ]
    return _table(headers, rows, numeric=(2, 3, 4, 6))


def _choices_html(choices: Sequence[Choice], target_fraction: float | None) -> str:
    """What `choose` chose (the Decision section's thresholds), then per rule the exact
    masked fraction at the default grid values around the chosen one."""
    if not choices:
        return '<p class="note">No threshold was chosen.</p>'
    rows = []
    for c in choices:
        ci = "—"
        if c.ci_low is not None:  # enough digits to tell the two ends apart
            d = next((d for d in range(4, 9) if _num(c.ci_low, d) != _num(c.ci_high, d)), 4)
            ci = f"{_num(c.ci_low, d)} – {_num(c.ci_high, d)}"
        status = c.status + (f" ({c.note})" if c.note else "")
        rows.append(
            [
                c.spec,
                f"{c.param}={_num(c.value)}",
                ci,
                _num(c.masked_tokens),
                _pct(c.masked_fraction),
                status,
            ]
        )
    headers = ["setting", "chosen", "95% bootstrap interval", "masked tokens", "masked", "status"]
    out = _table(headers, rows, numeric=(3, 4))
    curves = [c for c in choices if c.curve]
    if curves:
        out += (
            '<p class="note">Masked fraction against the threshold around each choice: the '
            "default grid's values nearest the chosen one and the chosen value (bold), exact "
            "counts on these tokens.</p>"
        )
    for c in curves:
        label = f"{display_name(c.rule)}: {c.param}" + (
            f" ({c.setting.replace(',', ', ')})" if c.setting else ""
        )
        head = "".join(f"<th>{_e(h)}</th>" for h in (c.param, "masked tokens", "masked"))
        body = []
        for pt in c.curve:
            cells = [_num(pt.value), _num(pt.masked_tokens), _pct(pt.masked_fraction)]
            tds = "".join(f'<td class="num">{_e(x)}</td>' for x in cells)
            style = ' style="font-weight:bold"' if pt.chosen else ""
            body.append(f"<tr{style}>{tds}</tr>")
        out += (
            f'<div class="curve"><h3>{_e(label)}</h3><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>"
        )
    return out


def _spec_of(rule: str, setting: str, param: str, value: float) -> str | None:
    try:
        extra = f"{setting}," if setting else ""
        return parse_rule(f"{rule}:{extra}{param}={value!r}").spec()
    except Exception:  # a rule this version cannot rebuild: no exact value to look up
        return None


def _exact_presets_html(data: FigureData) -> str:
    """Every catalogue preset at its values with its exact fraction (`data.presets`, counted
    in the report's one read), presets with the same values on one row."""
    from ..rules import REGISTRY

    rows, seen = [], {}
    for name, cls in REGISTRY.items():
        for pname, vals in list(cls.presets.items()) or [("default", {})]:
            try:
                spec = cls(**vals).spec()
            except Exception:
                continue
            if spec not in data.presets:
                continue
            if spec in seen:
                rows[seen[spec]][1] += f", {pname}"
                continue
            seen[spec] = len(rows)
            kvs = [kv.partition("=") for kv in spec.partition(":")[2].split(",") if kv]
            setting = ", ".join(f"{k}={_num(float(v))}" for k, _, v in kvs) or "—"
            kind = "truncated" if cls.kind == "weight" else "masked"
            rows.append([display_name(name), pname, setting, _pct(data.presets[spec]), kind])
    note = (
        '<p class="note">Every rule of the catalogue at each of its presets (or its default), '
        "counted exactly on this log in the report's read (the rules' stable arithmetic; a "
        "preset's own, e.g. float32 or prob-space, replays with "
        "<code>sweep -r NAME@PRESET</code>).</p>"
    )
    headers = ["rule", "preset(s)", "setting", "fraction", ""]
    return note + _table(headers, rows, numeric=(3,))


def _presets_html(data: FigureData) -> str:
    if getattr(data, "presets", None):
        return _exact_presets_html(data)
    pts = preset_points(data.sweep)
    if pts.height == 0:
        return '<p class="note">No preset lies on the swept grids.</p>'
    chosen = settings_table(data)
    exact: dict[str, float] = {}
    for r in chosen.iter_rows(named=True) if chosen.height else ():
        exact[r["spec"]] = r["truncated_fraction" if r["kind"] == "weight" else "masked_fraction"]
    rows = []
    shown: set[str] = set()
    between: dict[str, None] = {}
    for r in pts.iter_rows(named=True):
        spec = _spec_of(r["rule"], r["setting"], r["param"], r["value"])
        if not r["exact"] and spec in exact:  # a chosen setting: its exact value is known
            r["fraction"], r["exact"] = exact[spec], True
        if not r["exact"]:  # an interpolation would disagree with the exact counts shown
            between[f"{display_name(r['rule'])} {r['param']}={_num(r['value'])}"] = None
            continue
        shown.add(r["rule"])
        rows.append(
            [
                display_name(r["rule"]),
                r["presets"],
                f"{r['param']}={_num(r['value'])}",
                r["setting"].replace(",", ", ") or "—",
                _pct(r["fraction"]),
                "truncated" if r["kind"] == "weight" else "masked",
            ]
        )
    swept = dict.fromkeys(data.sweep["rule"].to_list()) if data.sweep.height else {}
    absent = [display_name(n) for n in swept if n not in shown]
    note = (
        '<p class="note">Every rule of the sweep at those of its presets (or its default) '
        "that are grid points of the sweep, or chosen settings: exact counts only."
    )
    if between:
        note += (
            " Left out, between two grid points (an interpolated value would disagree with "
            f"the exact counts elsewhere on this page): {_e(', '.join(between))}."
        )
    if absent:
        note += (
            " No preset on a swept line (its other parameters differ from the sweep's): "
            f"{_e(', '.join(dict.fromkeys(absent)))}."
        )
    note += " Replay any of them exactly with <code>sweep -r NAME@PRESET</code>.</p>"
    headers = ["rule", "preset(s)", "swept parameter", "other parameters", "fraction", ""]
    return note + _table(headers, rows, numeric=(4,))


def _summary_html(data: FigureData, summary: dict | None) -> str:
    steps = data.step_metrics.height
    seq = None
    if data.steps.height and "sequences" in data.steps.columns:
        first = data.steps.filter(pl.col("spec") == data.steps["spec"][0])
        if first["sequences"].null_count() == 0:
            seq = int(first["sequences"].sum())
    facts: dict[str, str] = {
        "sources": ", ".join(data.sources) or "—",
        "loss tokens": _num(data.tokens),
        "steps": _num(steps),
        "sequences": _num(seq),
    }
    if summary:  # an inspect summary (Summary.to_dict()) adds what ingest saw
        known = {
            "files": "sources",
            "layout": "layout",
            "rows": "rows read",
            "loss_tokens": "loss tokens",
            "steps": "steps",
            "sequences": "sequences",
            "invalid_rows": "invalid rows",
        }
        for key, label in known.items():
            v = summary.get(key)
            if v is not None:
                facts[label] = ", ".join(map(str, v)) if isinstance(v, list) else _num(v)
        if summary.get("invalid"):
            facts["invalid rows by file and column"] = "; ".join(
                f"{k}: {_num(v)}" for k, v in summary["invalid"].items()
            )
        if summary.get("source"):
            facts["columns read"] = ", ".join(f"{k} ← {v}" for k, v in summary["source"].items())
    out = _table(["", "value"], list(facts.items()))
    metrics = dict(data.metrics)
    if summary and isinstance(summary.get("metrics"), dict):
        metrics.update({k: v for k, v in summary["metrics"].items() if v is not None})
    rows = []
    for key, value in metrics.items():
        if key == "tokens":
            continue
        framework, doc = NAMES.get(key, ("", ""))
        rows.append([key, _num(value), framework or "—", doc])
    out += "<h3>Mismatch metrics (all loss tokens)</h3>"
    out += _table(["metric", "value", "framework name", "definition"], rows, numeric=(1,))
    return out


def _catalogue_html() -> str:
    rows = []
    for rec in catalogue_records():
        defaults = ", ".join(
            f"{p['name']}={_num(p['default'])}" for p in rec["params"] if p["default"] is not None
        )
        presets = "; ".join(
            f"{name}: " + ", ".join(f"{k}={_num(v)}" for k, v in vals.items())
            for name, vals in rec["presets"].items()
        )
        needs = ", ".join(rec["needs"]) or "—"
        rows.append(
            [
                rec["name"],
                f"{rec['level']} {rec['kind']}",
                rec["definition"],
                defaults or "— (user sets)",
                presets or "—",
                needs,
                rec["source"],
            ]
        )
    headers = ["rule", "level / kind", "masked when", "defaults", "presets", "needs", "source"]
    return _table(headers, rows)


# ----------------------------------------------------------------------------- page


def _atomic_text(path: Path, text: str, force: bool = True) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), force)


def precision_section(check: PrecisionResult) -> tuple[str, str]:
    """`analysis.precision_check`'s result as an extra report section (write_report's
    `sections`): a line per rule whose float32 and float64 masked fractions differ by more
    than the threshold, then the table of both."""
    rows = [
        [
            r.spec,
            _num(r.tokens),
            _num(r.masked_float64),
            _num(r.masked_float32),
            _pct(r.fraction_float64),
            _pct(r.fraction_float32),
        ]
        for r in check.rows
    ]
    lines = check.lines or [
        f"float32 and float64 agree within {_pct(check.threshold)} for every rule replayed."
    ]
    body = "".join(f'<p class="note">{_e(line)}</p>' for line in lines)
    headers = ["rule", "tokens", "masked, float64", "masked, float32", "float64", "float32"]
    return "float32 vs float64", body + _table(headers, rows, numeric=(1, 2, 3, 4, 5))


FIRST_FIGURES = ("scatter", "masked_fraction")  # the seed's pair, right after the findings


_GIVEN_CAPTIONS = {
    "scatter": (
        "Sampled tokens by inference (sampler) probability q and trainer probability p, as a "
        "density (tokens per bin, log colour scale); left on linear axes, right on log-log "
        "axes where rare tokens are visible. Lines: the boundaries of the rules given that "
        "have one in this plane (a ratio band is the cone p = low·q, p = high·q, straight on "
        "log-log axes; a probability band p = q ± eps); masked outside."
    ),
    "masked_fraction": (
        "Fraction of tokens masked (weight rules: truncated) as a function of each rule's "
        "threshold, the panels of the rules given: a rule given by its name alone is swept "
        "over its default grids (the other parameter at its default), its markers the "
        "rules' presets; one given at a setting (one row of sweep.csv) is marked, with its "
        "preset or SPEC, on its curves: each threshold over its default grid, the other "
        "parameters at the setting's values."
    ),
    "masked_by_length": (
        "Masked fraction per sequence-length bucket for the rules given that mask tokens: a "
        "product-ratio sequence mask tightens as sequences grow, a geometric-mean one and a "
        "token rule do not."
    ),
}


def _caption(name: str, data: FigureData) -> str:
    """A figure's caption: of the rules given where they drew it (`data.given`)."""
    if getattr(data, "given", False) and name in _GIVEN_CAPTIONS:
        return _GIVEN_CAPTIONS[name]
    return _CAPTIONS[name]


def _figure_html(data: FigureData, images: dict[str, bytes], names: Sequence[str]) -> list[str]:
    """The named figures as <figure>s with their titles and captions (data URIs); a line in
    masked_by_length's place where the log has no sequence ids."""
    parts = []
    for name in names:
        if name not in images:
            if name == "masked_by_length" and getattr(data, "by_length", 0) is None:
                parts.append(f"<h2>{_e(_TITLES[name])}</h2>")
                parts.append(
                    '<p class="note">Not drawn: the log has no sequence ids (sample_id) to '
                    "bucket sequences by length; map one with --map sample_id=COLUMN.</p>"
                )
            continue
        uri = base64.b64encode(images[name]).decode("ascii")
        parts.append(f"<h2>{_e(_TITLES[name])}</h2>")
        parts.append(
            f'<figure><img alt="{_e(_TITLES[name])}" src="data:image/png;base64,{uri}">'
            f"<figcaption>{_e(_caption(name, data))}</figcaption></figure>"
        )
    return parts


def render_html(
    data: FigureData,
    images: dict[str, bytes],
    *,
    command: str,
    summary: dict | None = None,
    target_fraction: float | None = None,
    sections: Sequence[tuple[str, str]] = (),
    date: str | None = None,
    choices: Sequence[Choice] | None = None,
    findings: Sequence[str] = (),
) -> str:
    """The page as a string, answers first: `findings` (the sentences of
    `analysis.findings`) under "What this log says", the scatter and masked-fraction
    figures, the `sections` (extra (title, trusted HTML) sections: the Decision), the chosen
    settings, the other figures, then the reference tables (log summary and metrics, every
    rule at its presets, the catalogue) collapsed in <details>. `images`: figure name -> PNG
    bytes (embedded as data URIs); `choices`: `analysis.choose` rows (with `curve=True`),
    listed under "Chosen settings" (the plotted settings then follow under their own
    title)."""
    date = date or _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>mismatch-replay report: {_e(', '.join(data.sources) or 'log')}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>mismatch-replay report</h1>",
        f'<p class="meta">{_e(_num(data.tokens))} loss tokens from '
        f"{_e(', '.join(data.sources) or 'the log')} · mismatch-replay {_e(__version__)} · "
        f"{_e(date)}</p>",
    ]
    if findings:
        items = "".join(f"<li>{_e(x)}</li>" for x in findings)
        parts.append(
            f'<section class="findings"><h2>What this log says</h2><ul>{items}</ul></section>'
        )
    parts.extend(_figure_html(data, images, FIRST_FIGURES))
    parts.append(
        "<!-- extra sections (e.g. Decision): write_report(..., sections=[(title, html)]) -->"
    )
    for title, body in sections:
        parts.append(f'<section class="extra"><h2>{_e(title)}</h2>{body}</section>')
    parts.append("<h2>Chosen settings</h2>")
    if target_fraction is not None:
        parts.append(
            f'<p class="note">Target masked fraction: {_e(_pct(target_fraction))} '
            "(dashed line in the masked-fraction figure).</p>"
        )
    if choices is not None:
        parts.append(_choices_html(choices, target_fraction))
        parts.append("<h2>Plotted settings</h2>")
        parts.append(
            '<p class="note">The settings the figures draw (presets), over the whole log.</p>'
        )
    parts.append(_settings_html(data))
    rest = [n for n in render.FIGURES if n not in FIRST_FIGURES]
    parts.extend(_figure_html(data, images, rest))
    parts.append("<h2>Reference tables</h2>")
    for title, body in (
        ("Summary", _summary_html(data, summary)),
        ("Every rule at its presets", _presets_html(data)),
        ("Rule catalogue: defaults and presets", _catalogue_html()),
    ):
        parts.append(f"<details><summary>{_e(title)}</summary>{body}</details>")
    if data.notes:
        parts.append("<h2>Notes</h2><ul>")
        parts.extend(f"<li>{_e(n)}</li>" for n in data.notes)
        parts.append("</ul>")
    parts.append("<h2>Reproduce</h2>")
    parts.append(f"<pre>{_e(command)}</pre>")
    parts.append(
        f'<p class="meta">mismatch-replay {_e(__version__)} · generated {_e(date)}</p>'
        "</body></html>"
    )
    return "\n".join(parts) + "\n"


def write_report(
    data: FigureData,
    outdir: Path,
    *,
    command: str,
    summary: dict | None = None,
    force: bool = False,
    target_fraction: float | None = None,
    sections: Sequence[tuple[str, str]] = (),
    dpi: int = DPI,
    choices: Sequence[Choice] | None = None,
    progress=None,
    pool=None,
    findings: Sequence[str] = (),
) -> Path:
    """Write outdir/index.html and the figure PNGs next to it; return the page's path.

    `command`: the exact command line that produced the report (shown verbatim, escaped).
    `summary`: an inspect summary (`Summary.to_dict()`), optional. `sections`: extra
    (title, HTML) sections, e.g. a "Decision"; their HTML is trusted, their titles escaped.
    `dpi`: of the PNGs (150: ~1 MB for the page). Refuses to overwrite index.html or a figure
    unless `force`. `choices`, `findings`: see `render_html`; `progress(done, total)`: per
    figure drawn;
    `pool`: a `pool.FigurePool` that draws some of the figures meanwhile (`render_all`).
    """
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise UsageError(f"-o {outdir}: that is a file; give a directory for the report.")
    index = outdir / INDEX
    if index.exists() and not force:
        raise UsageError(f"{index}: the file exists; pass --force to overwrite it.")
    extra = {"progress": progress} if progress is not None else {}
    if pool is not None:
        extra["pool"] = pool
    paths = render.render_all(
        data,
        outdir,
        "png",
        target_fraction=target_fraction,
        force=force,
        dpi=dpi,
        **extra,
    )
    images = {name: p.read_bytes() for name, p in paths.items()}
    page = render_html(
        data,
        images,
        command=command,
        summary=summary,
        target_fraction=target_fraction,
        sections=sections,
        choices=choices,
        findings=findings,
    )
    _atomic_text(index, page, force)
    return index


# ----------------------------------------------------------------------------- Decision
# The "Decision" section from `analysis.decisions()`: three small tables with one sentence
# of reading each (which eps, which rule, did the run drift?). Its numbers are rounded for
# reading (4 significant digits, "–" when absent); the JSON of `--json` keeps full precision.


def _dnum(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    if v == 0:
        return "0"
    return f"{v:.4g}"


def _dpct(v) -> str:
    return "–" if v is None else f"{100 * v:.3g}%"


def _dtable(headers, rows) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _choose(d: Decisions) -> str:
    t = d.target_fraction
    rows = []
    for r in d.choose:
        label = _given(r.spec, r.param)
        ci = "–" if r.ci_low is None else f"{_dnum(r.ci_low)} – {_dnum(r.ci_high)}"
        status = r.status + (f" ({r.note})" if r.note else "")
        rows.append([label, r.param, _dnum(r.value), ci, _dpct(r.masked_fraction), status])
    return (
        f"<h3>Which threshold masks {_e(_dpct(t))} of the tokens?</h3>"
        + _dtable(
            ["rule [fixed]", "param", "value", "95% bootstrap interval", "masked", "status"], rows
        )
        + "<p>The interval is how much the answer would move on another log of the same run "
        "(Poisson bootstrap over sequences, or steps when the log has no sequence ids).</p>"
    )


def _compare(c: CompareResult, title: str) -> str:
    names = {"both": "masked by both", "only_a": "only A", "only_b": "only B", "neither": "neither"}
    rows = [
        [
            label,
            _dnum(c.cells[k].tokens),
            _dpct(c.cells[k].fraction),
            _dnum(c.cells[k].mean_q),
            _dnum(c.cells[k].mean_p),
            _dnum(c.cells[k].mass),
        ]
        for k, label in names.items()
    ]
    a, b = c.cells["only_a"], c.cells["only_b"]
    reading = (
        f"A masks {_dnum(a.tokens)} tokens that B keeps (mean inference probability "
        f"{_dnum(a.mean_q)}, |p−q| mass {_dnum(a.mass)}); B masks {_dnum(b.tokens)} "
        f"that A keeps (mean inference probability {_dnum(b.mean_q)}, "
        f"mass {_dnum(b.mass)}). "
        f"Jaccard overlap {_dnum(c.jaccard)}."
    )
    return (
        f"<h3>{_e(title)}</h3><p>A = <code>{_e(c.rule_a)}</code>, "
        f"B = <code>{_e(c.rule_b)}</code></p>"
        + _dtable(
            ["", "tokens", "fraction", "mean q (inference)", "mean p (trainer)", "|p−q| mass"], rows
        )
        + f"<p>{_e(reading)}</p>"
    )


def _drift(d: DriftResult | None, note: str | None) -> str:
    if d is None:
        return f"<h3>Did the run drift?</h3><p>{_e(note or 'not computed')}</p>"

    def steps_text(steps) -> str:  # "step 0", "steps 3, 4", "none": never a bare "0"
        if not steps:
            return "none"
        return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))

    flagged = steps_text(d.flagged_steps)
    spikes = steps_text(d.spike_steps)
    rows = [
        [
            _given(v.rule),
            _dpct(v.baseline_fraction),
            _dpct(v.drift_fraction),
            _dnum(v.ratio),
            v.verdict,
        ]
        for v in d.rules
    ]
    return (
        "<h3>Did the run drift?</h3>"
        f"<p>Baseline: steps {_e(d.baseline_steps[0])}–{_e(d.baseline_steps[-1])}; "
        f"a step departs when its {_e(d.statistic)} exceeds the baseline "
        f"{_e(d.factor)}×, and {_e(d.min_run)} departing steps in a row are drift. "
        f"Drift: {_e(flagged)}. Lone spikes (a handful of extreme tokens): {_e(spikes)}.</p>"
        + _dtable(["rule", "masked, baseline", "masked, drift steps", "ratio", "verdict"], rows)
    )


def _given(spec: str, exclude: str | None = None) -> str:
    """A SPEC named as the user gave it: 'token-mis@verl-k1', the fixed parameters that
    differ from the preset's in brackets, numbers as the report writes them."""
    from ..rules.spec import given_label

    return given_label(spec, exclude, _dnum)


def decision_html(d: Decisions) -> str:
    """The Decision section's HTML from `analysis.decisions()` (or `report_data`): for the
    rules given (`d.given`), else the defaults (prime-rl's IPO and IcePop)."""
    if d.compare is None or d.compare_budget is None:
        pair = f"<h3>Which tokens do two rules mask?</h3><p>{_e(d.compare_note or '')}</p>"
    else:
        a, b = (d.pair or (d.compare.rule_a, d.compare.rule_b))[:2]
        first = (
            f"{_given(a)} and {_given(b)} at their settings"
            if d.given
            else "IPO and IcePop at their prime-rl defaults"
        )
        moved = [
            f"{k.upper()}'s {s.param} (its {_side(s.param)}) set to {_dnum(s.value)}"
            for k, s in d.compare_budget.settings.items()
        ]
        pair = _compare(d.compare, first) + _compare(
            d.compare_budget,
            f"At an equal budget ({_dpct(d.target_fraction)} of tokens each"
            + (f": {'; '.join(moved)}" if moved else "")
            + "): which tokens does each rule choose?",
        )
    return _choose(d) + pair + _drift(d.drift, d.drift_note)


def _side(param: str) -> str:
    """Which side of a rule a parameter moves, in words."""
    if param in ("high", "hi", "cap", "tau", "phi", "delta", "c") or param.endswith("high"):
        return "upper bound"
    if param == "low" or param.endswith("low") or param == "v":
        return "lower bound"
    return "band half-width" if param == "eps" else "threshold"
