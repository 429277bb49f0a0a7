"""The figures' names and file formats, apart from the modules that draw them.

A job checks its targets (`jobs._refuse_existing`) before the first pass over the log, and
the figure helper process (pool.py) starts by importing this package: both need only these
names, not the drawing modules, which import matplotlib (~0.3 s). render.py re-exports both.
"""

from __future__ import annotations

FIGURES = ("scatter", "masked_fraction", "steps", "where_masked", "masked_by_length")
FORMATS = ("png", "svg", "pdf")

__all__ = ["FIGURES", "FORMATS"]
