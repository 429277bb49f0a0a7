"""The walk-through notebook runs top to bottom on the bundled sample."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow  # a Jupyter kernel executes the notebook

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "choose_eps.ipynb"


def test_choose_eps_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 4  # scatter, masked fraction, where masked, steps
    errs = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    assert "Warning" not in errs and "Traceback" not in errs, errs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "204,800 loss tokens" in text and "drift steps:" in text
