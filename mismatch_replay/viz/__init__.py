"""Drawing and reporting computed results: the figures, the HTML report, the jobs that write them.

Nothing here reads tokens or files of the log: every figure takes a `FigureData`
(analysis.figure_data) or a sweep table, counted by the engine, and draws it. The modules,
bottom up:

  style    palette, a rule's colour and display name (from the rule: `Rule.color`,
           `Rule.label`), font sizes, SPEC labels, the small drawing helpers
  tables   the sweep table's lines and the presets on them (`preset_points`)
  plane    the (q, p) scatter with the rules' boundaries (scatter.png)
  curves   masked fraction vs threshold, one panel per unit (`Rule.panel`) (masked_fraction.png)
  labels   labels beside markers, off the data (`place_labels`: masked_fraction's presets)
  groups   per step (steps.png), per q bucket (where_masked.png), per sequence length
           (masked_by_length.png)
  render   the six figures as files (FIGURES, `render_all`, `save`)
  report   the self-contained index.html, its tables and its Decision section
  jobs     `plot`, `report`, `demo`: whole jobs from sources to files (what the CLI runs)

Every figure function takes `ax=None` (or `axes`), `colors=None` (rule name -> colour over
the rules' own) and returns a matplotlib Figure built without pyplot: headless, thread-safe,
and the caller's rcParams are left alone. The names below are the figure API (what a
notebook uses); `jobs` and `report` are used as modules (`from mismatch_replay.viz import
jobs; jobs.report(...)`), since `report` names both the page module and the job.
"""

from __future__ import annotations

from .curves import FAMILIES, OTHER, Family, family_of, masked_fraction
from .groups import bucket_labels, masked_by_length, steps, where_masked
from .plane import scatter, scatter_panels
from .render import FIGURES, FORMATS, figures, render_all, save, scatter_kwargs
from .style import OKABE_ITO, TOL_MUTED, display_name, preset_names, rule_color, spec_label
from .tables import preset_points, sweep_lines, ungrouped

__all__ = [
    "FAMILIES",
    "FIGURES",
    "FORMATS",
    "OKABE_ITO",
    "OTHER",
    "TOL_MUTED",
    "Family",
    "bucket_labels",
    "display_name",
    "family_of",
    "figures",
    "masked_by_length",
    "masked_fraction",
    "preset_names",
    "preset_points",
    "render_all",
    "rule_color",
    "save",
    "scatter",
    "scatter_kwargs",
    "scatter_panels",
    "spec_label",
    "steps",
    "sweep_lines",
    "ungrouped",
    "where_masked",
]
