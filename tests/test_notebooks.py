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
import textwrap

import nbformat
from nbclient import NotebookClient
from test_arbiter import start_arbiter, stop, two_users  # noqa: F401 (a fixture, by name)

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


# A neighbour's run in auto mode, as another user: plain Python speaking the arbiter's wire
# protocol (that user may not be able to read this checkout). It gives back what the arbiter
# asks for and prints the slots it holds whenever they change.
NEIGHBOUR = textwrap.dedent("""
    import json, socket, sys, time
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sys.argv[1])
    wire = sock.makefile("rwb")
    def ask(**request):
        wire.write(json.dumps(request).encode() + b"\\n")
        wire.flush()
        reply = json.loads(wire.readline())
        assert reply["ok"], reply
        return reply
    grant, held = ask(op="register", run="neighbour", name="neighbour", min=1, max=4,
                      auto=True), None
    while True:
        if grant["give_back"] or grant["revoke"]:
            grant = ask(op="release", run="neighbour", slots=grant["give_back"] + grant["revoke"])
        if grant["slots"] != held:
            held = grant["slots"]
            print(len(held), flush=True)
        time.sleep(0.25)
        grant = ask(op="poll", run="neighbour")
""")


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
    neighbour, held = None, []
    try:
        if os.getuid() == 0:
            neighbour = subprocess.Popen(
                ["/usr/bin/python3", "-c", NEIGHBOUR, str(folder / SOCKET)],
                stdout=subprocess.PIPE, text=True, cwd="/",
                user=request.getfixturevalue("two_users")[0])
            assert neighbour.stdout.readline().strip() == "4"  # alone: all of the machine
        text = execute("04_sharing_a_machine.ipynb", tmp_path)
    finally:
        if neighbour is not None:
            neighbour.kill()
            held = [int(n) for n in neighbour.communicate()[0].split()]
        stop(arbiter)
        shutil.rmtree(folder, ignore_errors=True)
    assert "the grower grew, gave a slot back and grew again" in text
    assert neighbour is None or min(held) == 2  # gave back the student's half, never more


def test_gpt_notebook_learns_python_and_writes_some(tmp_path):
    """Notebook 5: a small GPT with dropout, bf16 autocast and a DataLoader worker per engine,
    resized 2 -> 3 -> 2, gets well below a byte-frequency model's held-out loss."""
    text = execute("05_a_real_model.ipynb", tmp_path)
    assert "resizes [(2, 3), (3, 2)]" in text
    assert (tmp_path / "elastic-checkpoints" / "gpt" / "latest.json").exists()
