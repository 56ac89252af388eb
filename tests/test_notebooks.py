"""The teaching notebooks run top to bottom in a real Jupyter kernel, as a student runs them.

A notebook cannot restart its own kernel: where one says to (a cell tagged ``restart-kernel``),
the test restarts the kernel as JupyterLab's Kernel > Restart does, then runs the rest. Each
notebook checks what it teaches in its last cells; the tests check a few of its printed lines.
"""
import asyncio
import pathlib
import shutil
import subprocess
import sys

import nbformat
from nbclient import NotebookClient
from test_arbiter import start_arbiter, stop

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
RESTART_TAG = "restart-kernel"


def execute(name: str, folder: pathlib.Path) -> str:
    """Run notebooks/`name` in a copy in `folder`; returns the text its cells printed."""
    return asyncio.run(_execute(name, folder))


async def _execute(name: str, folder: pathlib.Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(NOTEBOOKS / name, folder)
    nb = nbformat.read(folder / name, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(folder)}})
    async with client.async_setup_kernel():
        for index, cell in enumerate(nb.cells):
            if RESTART_TAG in cell.metadata.get("tags", []):
                await client.km.restart_kernel()  # a graceful shutdown, then a new kernel
                await client.kc.wait_for_ready(timeout=60)
            await client.async_execute_cell(cell, index)
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert "never retrieved" not in text  # no background task failed unseen
    return text


def test_notebooks_are_committed_without_outputs():
    """Outputs, execution counts and per-run metadata stay out of git (nbstripout, a
    well-kept tool; strip with `nbstripout notebooks/*.ipynb`)."""
    paths = sorted(str(p) for p in NOTEBOOKS.glob("*.ipynb"))
    assert len(paths) == 6, paths
    check = subprocess.run([sys.executable, "-m", "nbstripout", "--verify", *paths],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_quickstart_trains_resizes_and_reaches_90_percent(tmp_path):
    text = execute("01_quickstart.ipynb", tmp_path)
    assert "held-out accuracy" in text
    assert "resize 2 -> 3" in text and "resize 3 -> 1" in text
    assert (tmp_path / "elastic-checkpoints" / "digits" / "latest.json").exists()


def test_world_size_notebook_shows_resized_and_fixed_runs_agree(tmp_path):
    """Notebook 2: a run resized 2 -> 3 -> 1 ends with a fixed-size run's float64 parameters;
    its own last cells assert it (and that a per-GPU batch would not)."""
    text = execute("02_world_size.ipynb", tmp_path)
    assert "resizes (from, to, first step): [(2, 3, 81), (3, 1, 161)]" in text
    assert "elastic: parameters equal to" in text


def test_faults_notebook_survives_a_killed_engine_and_a_kernel_restart(tmp_path):
    """Notebook 3: an engine killed mid-run and a kernel restarted mid-run (then --resume) end
    with an undisturbed run's parameters."""
    text = execute("03_faults_and_checkpoints.ipynb", tmp_path)
    assert "fault: engines slot" in text  # the fault's line in the progress
    assert "resumed from" in text
    assert "the engine fault and the kernel restart left the result unchanged" in text


def test_sharing_notebook_runs_as_two_students_at_once(tmp_path, monkeypatch):
    """Notebook 4, two copies at the same time on one machine of 4 slots (its arbiter with
    the default hold time): in each, the grower grows, gives a slot back to its newcomer and
    grows again; its own last cells assert it."""
    folder = tmp_path / "arbiter"
    folder.mkdir()
    arbiter = start_arbiter(str(folder), {"cpu_slots": 4, "hold_s": 30})
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))  # the kernels' machine

    async def both():
        return await asyncio.gather(*(_execute("04_sharing_a_machine.ipynb", tmp_path / student)
                                      for student in ("first", "second")))
    try:
        texts = asyncio.run(both())
    finally:
        stop(arbiter)
    for text in texts:
        assert "the grower grew, gave a slot back and grew again" in text


def test_gpt_notebook_learns_python_and_writes_some(tmp_path):
    """Notebook 5: a small GPT with dropout, bf16 autocast and a DataLoader worker per engine,
    resized 2 -> 3 -> 2, gets well below a byte-frequency model's held-out loss."""
    text = execute("05_a_real_model.ipynb", tmp_path)
    assert "resizes [(2, 3), (3, 2)]" in text
    assert (tmp_path / "elastic-checkpoints" / "gpt" / "latest.json").exists()
