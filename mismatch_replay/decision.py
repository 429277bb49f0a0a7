"""The report's "Decision" section: `analysis.decisions()` results -> escaped HTML.

Design
------
Presentation only: it receives the plain records of `choose`, `compare` and `drift` and turns
them into three small tables with one sentence of reading each, so that the report answers
the three questions users bring (which eps, which rule, did my run drift?) without sending
them to the command line. Every string is escaped; numbers are rounded for reading, and the
JSON of `--json` keeps the full precision.
"""

from __future__ import annotations

import html


def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _num(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    if v == 0:
        return "0"
    return f"{v:.4g}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.3g}%"


def _table(headers, rows) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _choose(d: dict) -> str:
    t = d["target_fraction"]
    rows = []
    for r in d["choose"]:
        label = r["rule"] + (f" [{r['setting']}]" if r["setting"] else "")
        ci = "–" if r["ci_low"] is None else f"{_num(r['ci_low'])} – {_num(r['ci_high'])}"
        status = r["status"] + (f" ({r['note']})" if r["note"] else "")
        rows.append([label, r["param"], _num(r["value"]), ci, _pct(r["masked_fraction"]), status])
    return (
        f"<h3>Which threshold masks {_e(_pct(t))} of the tokens?</h3>"
        + _table(
            ["rule [fixed]", "param", "value", "95% bootstrap interval", "masked", "status"], rows
        )
        + "<p>The interval is how much the answer would move on another log of the same run "
        "(Poisson bootstrap over sequences, or steps when the log has no sequence ids).</p>"
    )


def _compare(c: dict, title: str) -> str:
    names = {"both": "masked by both", "only_a": "only A", "only_b": "only B", "neither": "neither"}
    rows = [
        [
            label,
            _num(c["cells"][k]["tokens"]),
            _pct(c["cells"][k]["fraction"]),
            _num(c["cells"][k]["mean_q"]),
            _num(c["cells"][k]["mean_p"]),
            _num(c["cells"][k]["mass"]),
        ]
        for k, label in names.items()
    ]
    a, b = c["cells"]["only_a"], c["cells"]["only_b"]
    reading = (
        f"A masks {_num(a['tokens'])} tokens that B keeps (mean inference probability "
        f"{_num(a['mean_q'])}, |p−q| mass {_num(a['mass'])}); B masks {_num(b['tokens'])} that A "
        f"keeps (mean inference probability {_num(b['mean_q'])}, mass {_num(b['mass'])}). "
        f"Jaccard overlap {_num(c['jaccard'])}."
    )
    return (
        f"<h3>{_e(title)}</h3><p>A = <code>{_e(c['rule_a'])}</code>, "
        f"B = <code>{_e(c['rule_b'])}</code></p>"
        + _table(
            ["", "tokens", "fraction", "mean q (inference)", "mean p (trainer)", "|p−q| mass"], rows
        )
        + f"<p>{_e(reading)}</p>"
    )


def _drift(d: dict | None, note: str | None) -> str:
    if d is None:
        return f"<h3>Did the run drift?</h3><p>{_e(note or 'not computed')}</p>"
    flagged = ", ".join(map(str, d["flagged_steps"])) or "none"
    spikes = ", ".join(map(str, d["spike_steps"])) or "none"
    rows = [
        [
            v["rule"],
            _pct(v["baseline_fraction"]),
            _pct(v.get("drift_fraction")),
            _num(v.get("ratio")),
            v["verdict"],
        ]
        for v in d["rules"]
    ]
    return (
        "<h3>Did the run drift?</h3>"
        f"<p>Baseline: steps {_e(d['baseline_steps'][0])}–{_e(d['baseline_steps'][-1])}; "
        f"a step departs when its {_e(d['statistic'])} exceeds the baseline "
        f"{_e(d['factor'])}×, and {_e(d['min_run'])} departing steps in a row are drift. "
        f"Drift: {_e(flagged)}. Lone spikes (a handful of extreme tokens): {_e(spikes)}.</p>"
        + _table(["rule", "masked, baseline", "masked, drift steps", "ratio", "verdict"], rows)
    )


def decision_html(d: dict) -> str:
    """The Decision section's HTML from `analysis.decisions()`."""
    return (
        _choose(d)
        + _compare(d["compare"], "IPO and IcePop at their prime-rl defaults")
        + _compare(
            d["compare_budget"],
            f"At an equal budget ({_pct(d['target_fraction'])} of tokens each): which tokens "
            "does each rule choose?",
        )
        + _drift(d.get("drift"), d.get("drift_note"))
    )
