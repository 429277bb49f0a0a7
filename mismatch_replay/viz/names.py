"""The figures' names and file formats, apart from the modules that draw them.

A job checks its targets (`jobs._refuse_existing`) before the first pass over the log, and
that needs only these names; the drawing modules import matplotlib (~0.3 s), which `jobs`
imports in a thread while the log is read (`jobs._preload`). render.py re-exports both.
"""

from __future__ import annotations

FIGURES = ("scatter", "masked_fraction", "steps", "where_masked", "masked_by_length")
FORMATS = ("png", "svg", "pdf")

__all__ = ["FIGURES", "FORMATS"]
