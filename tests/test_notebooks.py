"""The notebooks run top to bottom, headless, on 8 CPU devices with small sizes."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "training.ipynb"])
def test_notebook_executes(name, monkeypatch):
  monkeypatch.setenv("CPJAX_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
      "commit notebooks with outputs cleared"
  # execute() raises CellExecutionError on the first cell that fails.
  nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                          resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
