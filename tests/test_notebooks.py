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
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
    "commit notebooks with outputs cleared"
  )
  # execute() raises CellExecutionError on the first cell that fails.
  nbclient.NotebookClient(
    nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(NOTEBOOKS)}}
  ).execute()


def test_committed_notebooks_are_what_the_builder_writes():
  """notebooks/build_notebooks.py is the notebooks' source: an edit to a
  committed .ipynb alone would be lost at the next build."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS / "build_notebooks.py")
  builder = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(builder)
  for name, cells in (
    ("quickstart.ipynb", builder.QUICKSTART),
    ("training.ipynb", builder.TRAINING),
  ):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert [(c.cell_type, c.source) for c in nb.cells] == list(cells), name
