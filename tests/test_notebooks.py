"""The teaching notebooks run top to bottom in a real Jupyter kernel."""
import pathlib
import shutil

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def _outputs(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))


def test_quickstart_trains_resizes_and_reaches_90_percent(tmp_path):
    shutil.copy(NOTEBOOKS / "01_quickstart.ipynb", tmp_path)
    nb = nbformat.read(tmp_path / "01_quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _outputs(nb)
    assert "never retrieved" not in text  # no background task failed unseen
    assert "held-out accuracy" in text
    assert "resize 2 -> 3" in text and "resize 3 -> 1" in text
    assert (tmp_path / "elastic-checkpoints" / "digits" / "latest.json").exists()


def test_world_size_notebook_shows_resized_and_fixed_runs_agree(tmp_path):
    """Notebook 2: a run resized 2 -> 3 -> 1 ends with a fixed-size run's float64 parameters;
    its own last cells assert it (and that a per-GPU batch would not)."""
    shutil.copy(NOTEBOOKS / "02_world_size.ipynb", tmp_path)
    nb = nbformat.read(tmp_path / "02_world_size.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = _outputs(nb)
    assert "never retrieved" not in text
    assert "resizes: [(2, 3, 81), (3, 1, 161)]" in text
    assert "elastic: parameters equal to" in text
