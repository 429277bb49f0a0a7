"""`runs.png`: the arms of an ablation on one step axis (the seed's ablation figure).

Design
------
One figure, panels stacked on a shared x = step, one colour a run (Okabe & Ito, in the
order the runs were given): the mismatch KL k3 (token mean, log y) with each run's first
drift step marked by a dotted vertical line of its colour; the masked fraction under each
of a run's own rules (its colour, one line style and marker a rule: solid, dashed,
dash-dot; percent of loss tokens, linear: a rule that stays flat while its run's k3 climbs
is the collapse signature, and a flat line near zero must look flat); the trainer
entropy's token mean; the mean reward. The entropy and reward panels are drawn only where
some run logged them. It takes computed data only: `RunsResult.table` (one row per run and
step, analysis/runs.py) and, optionally, each run's departure step; it never reads tokens.
`ax=None` builds the Figure (never pyplot); otherwise the caller's Axes, one per panel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..gcpause import paused
from .style import LABEL, NOTE, OKABE_ITO, SMALL, draw_line, light_log_ticks, spec_label

# run colours: Okabe & Ito without black and yellow (a thin yellow line vanishes on white)
RUN_COLORS = tuple(OKABE_ITO[k] for k in ("blue", "vermillion", "bluish_green", "reddish_purple",
                                          "orange", "sky_blue"))  # fmt: skip


# a run's own rules in the masked panel: (line style, marker), the first solid with dots
# (dotted lines are the departure steps)
OWN_STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), ((0, (6, 2, 1, 2, 1, 2)), "D"))


def own_label(spec: str, pct: pl.Series | None = None) -> str:
    """A run's own rule in the legend: `spec_label` with its numbers to 4 significant
    digits (verl's 1/0.6 is 1.667); a line at 0 at every step (hidden under another) says so."""
    import re

    text = re.sub(r"\d+\.\d{4,}", lambda m: f"{float(m.group()):.4g}", spec_label(spec))
    seen = pct.drop_nulls().drop_nans() if pct is not None else None
    if seen is not None and seen.len() and (seen == 0).all():
        text += ": 0 at every step"
    return text


def panels_of(table: pl.DataFrame) -> list[str]:
    """The panels this table can draw, top to bottom."""
    out = ["k3", "masked_own"]
    for col in ("entropy_mean", "reward_mean"):
        if col in table.columns and table[col].drop_nulls().drop_nans().len():
            out.append(col)
    return out


def run_colors(names: Sequence[str], colors: dict[str, str] | None = None) -> dict[str, str]:
    colors = colors or {}
    return {n: colors.get(n, RUN_COLORS[i % len(RUN_COLORS)]) for i, n in enumerate(names)}


@paused()
def runs_figure(
    table: pl.DataFrame,
    ax: Sequence[Axes] | None = None,
    *,
    departs: dict[str, int | None] | None = None,
    colors: dict[str, str] | None = None,
) -> Figure:
    """The runs side by side (see the module docstring). `table`: `RunsResult.table`;
    `departs`: run -> its first drift step (None: no drift); `colors`: run -> colour."""
    names = list(dict.fromkeys(table["run"].to_list()))
    panels = panels_of(table)
    if ax is None:
        fig = Figure(figsize=(8.0, 1.0 + 1.9 * len(panels)), layout="constrained")
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    else:
        axes = list(ax)
        if len(axes) != len(panels):
            raise ValueError(f"runs_figure draws {len(panels)} panels ({panels}); got {len(axes)}")
        fig = axes[0].figure
    col = run_colors(names, colors)
    mk = "o" if table.filter(pl.col("run") == names[0]).height <= 60 else None
    departs = departs or {}
    # a run's own rules: own_rule / masked_own, then own_rule_2 / masked_own_2, ...
    more = [c.removeprefix("masked_own") for c in table.columns if c.startswith("masked_own_")]
    suffixes = ["", *sorted(more, key=lambda x: int(x[1:]))]
    for name in names:
        t = table.filter(pl.col("run") == name).sort("step")
        x = t["step"].to_numpy().astype(float)
        for a, panel in zip(axes, panels, strict=True):
            if panel == "masked_own":  # one line a rule of the run's own, a style each
                for k, suffix in enumerate(suffixes):
                    own = t[f"own_rule{suffix}"].drop_nulls()
                    if k and not own.len():
                        continue
                    y = 100 * t[f"masked_own{suffix}"].cast(pl.Float64).fill_null(np.nan)
                    label = f"{name}: {own_label(own[0], y)}" if own.len() else (
                        f"{name}: no rule of its own")  # fmt: skip
                    st = OWN_STYLES[k % len(OWN_STYLES)]
                    draw_line(a, x, y.to_numpy(), gid=f"masked_own{suffix}:{name}", label=label,
                              color=col[name], lw=1.6, ls=st[0], marker=mk and st[1],
                              ms=3)  # fmt: skip
            else:
                if panel == "k3":
                    y = t["kl_k3"].to_numpy().astype(float)
                    y = np.where(y > 0, y, np.nan)
                else:
                    y = t[panel].cast(pl.Float64).fill_null(np.nan).to_numpy()
                draw_line(a, x, y, gid=f"{panel}:{name}", label=name, color=col[name], lw=1.6,
                          marker=mk, ms=3)  # fmt: skip
            at = departs.get(name)
            if at is not None:
                a.axvline(at, color=col[name], ls=":", lw=1.2, gid=f"departs:{name}")
    titles = {
        "k3": "mismatch KL k3 (token mean)",
        "masked_own": f"masked, own rule{'s' if len(suffixes) > 1 else ''} (% of tokens)",
        "entropy_mean": "trainer entropy (mean)",
        "reward_mean": "reward (mean)",
    }
    for a, panel in zip(axes, panels, strict=True):
        a.set_ylabel(titles[panel], fontsize=SMALL)
        a.tick_params(labelsize=SMALL)
        a.grid(alpha=0.25, lw=0.6)
        if panel == "k3":
            a.set_yscale("log")
            light_log_ticks(a)
            a.legend(fontsize=SMALL, frameon=False, loc="upper left", ncols=min(len(names), 4))
        elif panel == "masked_own":
            n = len(a.get_legend_handles_labels()[1])
            ncols = 1 if n <= 3 else 2
            a.set_ylim(0, a.get_ylim()[1] * (1 + 0.14 * -(-n // ncols)))  # room for the legend
            a.legend(fontsize=NOTE, frameon=False, loc="upper left", ncols=ncols)
    axes[-1].set_xlabel("step", fontsize=LABEL)
    marked = [f"{n} {departs[n]}" for n in names if departs.get(n) is not None]
    if marked:
        axes[0].set_title(
            "dotted: the step each run first departs from its own baseline ("
            + ", ".join(marked)
            + ")",
            fontsize=NOTE,
            loc="right",
        )
    return fig


def write_runs(res, outdir, image_format: str = "png", force: bool = False, dpi: int = 150):
    """`runs.<format>` in `outdir` from a RunsResult; returns the path."""
    from pathlib import Path

    from .render import save

    Path(outdir).mkdir(parents=True, exist_ok=True)
    path = Path(outdir) / f"runs.{image_format}"
    if path.exists() and not force:
        from ..errors import UsageError

        raise UsageError(f"{path} exists; pass --force to overwrite it.")
    departs = {r.run.name: r.verdict.departs_at for r in res.runs}
    fig = runs_figure(res.table, departs=departs)
    return save(fig, path, image_format, dpi=dpi, force=force)


def _cell(v) -> str:
    import html

    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def runs_page(res, findings, image: bytes, command: str = "") -> str:
    """`report --run`'s page: what these runs say, runs.png, the verdicts, the per-step
    table (collapsed). Self-contained: the figure is embedded as a data URI."""
    import base64
    import html

    from .. import __version__

    said = "".join(f"<li>{html.escape(f.sentence)}</li>" for f in findings)
    v = res.verdicts
    cols = [c for c in v.columns]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(x)}</td>" for x in row) + "</tr>" for row in v.iter_rows()
    )
    t = res.table
    thead = "".join(f"<th>{html.escape(c)}</th>" for c in t.columns)
    tbody = "".join(
        "<tr>" + "".join(f"<td>{_cell(x)}</td>" for x in row) + "</tr>" for row in t.iter_rows()
    )
    src = base64.b64encode(image).decode()
    names = ", ".join(html.escape(n) for n in res.names)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>mismatch-replay: runs {names}</title><style>"
        "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
        "table{border-collapse:collapse;font-size:.85rem}td,th{border:1px solid #ddd;"
        "padding:.2rem .4rem;text-align:right}img{max-width:100%}</style></head><body>"
        f"<h1>Runs side by side: {names}</h1><h2>What these runs say</h2><ul>{said}</ul>"
        f'<img alt="runs" src="data:image/png;base64,{src}">'
        f"<h2>Verdict per run</h2><table><tr>{head}</tr>{body}</table>"
        f"<details><summary>Per run and step ({t.height:,} rows)</summary>"
        f"<table><tr>{thead}</tr>{tbody}</table></details>"
        f"<p><small>{html.escape(command)} · mismatch-replay {__version__}</small></p>"
        "</body></html>"
    )


def write_runs_report(res, findings, outdir, command: str = "", force: bool = False) -> dict:
    """`report --run`: DIR/index.html, DIR/runs.png and DIR/runs.csv; returns the paths."""
    from pathlib import Path

    from ..errors import UsageError
    from ..output import atomic_write
    from .render import encode

    out = Path(outdir)
    paths = {n: out / n for n in ("index.html", "runs.png", "runs.csv")}
    taken = [str(p) for p in paths.values() if p.exists()]
    if taken and not force:
        raise UsageError(f"{taken[0]} exists; pass --force to overwrite it.")
    out.mkdir(parents=True, exist_ok=True)
    departs = {r.run.name: r.verdict.departs_at for r in res.runs}
    image = encode(runs_figure(res.table, departs=departs), "png")
    page = runs_page(res, findings, image, command)
    atomic_write(paths["runs.png"], lambda tmp: tmp.write_bytes(image), force)
    atomic_write(paths["runs.csv"], lambda tmp: res.table.write_csv(tmp), force)
    atomic_write(paths["index.html"], lambda tmp: tmp.write_text(page), force)
    return paths


__all__ = [
    "RUN_COLORS",
    "panels_of",
    "run_colors",
    "runs_figure",
    "runs_page",
    "write_runs",
    "write_runs_report",
]
