"""The teaching notebooks run top to bottom in a real Jupyter kernel, as a student runs them.

A notebook cannot restart its own kernel: where one says to (a cell tagged ``restart-kernel``),
the test restarts the kernel as JupyterLab's Kernel > Restart does, then runs the rest. Each
notebook checks what it teaches in its last cells; the tests check a few of its printed lines.
"""
import asyncio
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import nbformat
from nbclient import NotebookClient
from test_arbiter import UserClient, start_arbiter, stop, two_users  # noqa: F401 (a fixture)

from elastic_jupyter.arbiter.service import SOCKET

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
    assert len(paths) == 7, paths
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


def neighbour(client: UserClient, done: threading.Event, held: list) -> None:
    """Another user's run in auto mode, through that user's wire-protocol client: gives back
    what the arbiter asks for and appends the slots it holds to `held` whenever they change,
    until `done`."""
    grant = client.ask(op="poll", run="neighbour")
    while not done.wait(0.25):
        if grant["give_back"] or grant["revoke"]:
            grant = client.ask(op="release", run="neighbour",
                               slots=grant["give_back"] + grant["revoke"])
        if grant["slots"] != held[-1]:
            held.append(grant["slots"])
        grant = client.ask(op="poll", run="neighbour")


def test_sharing_notebook_runs_beside_another_users_run(tmp_path, monkeypatch, request):
    """Notebook 4 on a shared machine of 4 slots (the admin's arbiter, default hold time)
    while a neighbour, another user, trains in auto mode: users share the machine equally, so
    the student's grower grows into the student's part, gives a slot back to the student's
    newcomer and grows again (the notebook's last cells assert it), and the neighbour never
    drops below its half. (Two copies run by one user share that user's part: one copy's
    newcomer may take its slot from the other's grower, so the notebook asks for one copy per
    user.) Without root, which makes the second user, the notebook runs alone."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ej-arbiter-"))  # reachable by every user
    os.chmod(folder, 0o755)
    arbiter = start_arbiter(str(folder), {"cpu_slots": 4, "hold_s": 30}, shared=True)
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))  # the kernel's machine
    client, polls, done, held = None, None, threading.Event(), []
    try:
        if os.getuid() == 0:
            client = UserClient(request.getfixturevalue("two_users")[0], str(folder / SOCKET))
            held.append(client.ask(op="register", run="neighbour", name="neighbour", min=1,
                                   max=4, auto=True)["slots"])
            assert len(held[0]) == 4  # alone on the machine: all of it
            polls = threading.Thread(target=neighbour, args=(client, done, held))
            polls.start()
        text = execute("04_sharing_a_machine.ipynb", tmp_path)
    finally:
        done.set()
        if polls is not None:
            polls.join()  # its last request answered before its client goes
        if client is not None:
            client.close()
        stop(arbiter)
        shutil.rmtree(folder, ignore_errors=True)
    assert "the grower grew, gave a slot back and grew again" in text
    assert client is None or min(map(len, held)) == 2  # gave back the student's half, no more


def test_gpt_notebook_learns_python_and_writes_some(tmp_path):
    """Notebook 5: a small GPT with dropout, bf16 autocast and a DataLoader worker per engine,
    resized 2 -> 3 -> 2, gets well below a byte-frequency model's held-out loss."""
    text = execute("05_a_real_model.ipynb", tmp_path)
    assert "resizes [(2, 3), (3, 2)]" in text
    assert (tmp_path / "elastic-checkpoints" / "gpt" / "latest.json").exists()


def test_streaming_notebook_reads_shards_once_per_epoch_across_resizes(tmp_path):
    """Notebook 7: a `datasets` stream over shard files, resized 2 -> 3 -> 2 with loader
    processes: each sample once per epoch, the fixed run's float64 parameters; its own last
    cells assert it."""
    text = execute("07_streaming.ipynb", tmp_path)
    assert "1600 samples, trained on [2] times each" in text
    assert "streamed: each sample once per epoch; parameters equal to the fixed run's" in text
