"""The server extension against real runs: a Jupyter server under a non-root base URL, kernels
started by that server through its REST API (as a browser starts them), real pools.

Resize while the kernel executes another cell, stop, every error code, lost runs after a kernel
dies, discovery across a server restart, and every handler the extension registers refusing a
request without credentials.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import DIGITS_CELL
from elastic_jupyter.server import registry
from lab_harness import JupyterLab, ServerKernel as Kernel, call, wait_for

BASE = "/user/alice/"


def train(kernel: Kernel, name: str) -> None:
    kernel.run("%load_ext elastic_jupyter\n%elastic_pool start -n 2 --max 3")
    kernel.run(f"%%elastic_train --name {name} --global-batch 64 --steps 1000000 "
               f"--checkpoint-every 50 --no-dashboard\n{DIGITS_CELL}")


def runs_named(server, name: str) -> list[dict]:
    status, body = call(server, "GET", "elastic/api/runs")
    assert status == 200
    return [r for r in body["runs"] if r["name"] == name]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-root")
    with JupyterLab(str(root), str(root / "server.log"), base_url=BASE) as lab:
        yield lab


@pytest.fixture(scope="module")
def busy_run(server):
    """A run named 'api' training in a server-started kernel that is executing another cell."""
    kernel = Kernel(server)
    train(kernel, "api")
    kernel.client.execute("import time\nfor _ in range(600): time.sleep(1)")  # the busy cell
    wait_for(lambda: kernel.execution_state() == "busy", 10, "the busy cell")
    run = runs_named(server, "api")[0]
    yield kernel, run["id"]
    kernel.client.stop_channels()


def test_list_and_get_describe_the_run(server, busy_run):
    kernel, run_id = busy_run
    [run] = runs_named(server, "api")
    assert run["id"] == run_id and run["state"] == "training"
    assert run["world_size"] == 2 and run["min_size"] == 1 and run["max_size"] == 3
    assert run["slots"] == ["cpu", "cpu"] and run["kernel_id"] == kernel.id
    status, one = call(server, "GET", f"elastic/api/runs/{run_id}")
    assert status == 200 and one["name"] == "api" and one["step"] >= run["step"]
    assert all(c["browser_path"].startswith("elastic-checkpoints/api/") for c in one["checkpoints"])
    status, reply = call(server, "POST", f"elastic/api/runs/{run_id}/dismiss", {})
    assert status == 409 and "stop it first" in reply["message"]  # only ended runs go


def test_resize_while_the_kernel_runs_another_cell(server, busy_run):
    kernel, run_id = busy_run
    started = time.monotonic()
    status, model = call(server, "PATCH", f"elastic/api/runs/{run_id}", {"world_size": 3})
    accepted = time.monotonic() - started
    assert status == 202 and model["requested_size"] == 3 and accepted < 1.0, (status, model)
    grown = wait_for(lambda: call(server, "GET", f"elastic/api/runs/{run_id}")[1]["world_size"] == 3,
                     60, "the grow to 3")
    grow_s = time.monotonic() - started
    assert grown and kernel.execution_state() == "busy"
    started = time.monotonic()
    assert call(server, "PATCH", f"elastic/api/runs/{run_id}", {"world_size": 1})[0] == 202
    wait_for(lambda: call(server, "GET", f"elastic/api/runs/{run_id}")[1]["world_size"] == 1,
             30, "the shrink to 1")
    shrink_s = time.monotonic() - started
    print(f"\nREST resize while a cell runs: accepted in {accepted:.3f} s, grow 2->3 {grow_s:.2f} s, "
          f"shrink 3->1 {shrink_s:.2f} s")
    assert kernel.execution_state() == "busy"


def test_two_tabs_resizing_at_once_the_last_request_wins(server, busy_run):
    _, run_id = busy_run
    assert call(server, "PATCH", f"elastic/api/runs/{run_id}", {"world_size": 3})[0] == 202
    assert call(server, "PATCH", f"elastic/api/runs/{run_id}", {"world_size": 2})[0] == 202
    wait_for(lambda: call(server, "GET", f"elastic/api/runs/{run_id}")[1]["world_size"] == 2,
             60, "the last request")
    time.sleep(1.5)
    model = call(server, "GET", f"elastic/api/runs/{run_id}")[1]
    assert model["world_size"] == 2 and model["requested_size"] == 2


def test_history_is_read_with_a_cursor(server, busy_run):
    _, run_id = busy_run
    status, page = call(server, "GET", f"elastic/api/runs/{run_id}/history?since=0&events_since=0")
    assert status == 200 and page["columns"][:3] == ["step", "epoch", "loss"]
    steps = page["data"][0]
    assert steps == list(range(1, len(steps) + 1)) and page["next"]["since"] == steps[-1]
    assert any(e["kind"] == "resized" for e in page["events"])
    status, later = call(server, "GET", f"elastic/api/runs/{run_id}/history?since={steps[-1]}"
                                        f"&events_since={page['next']['events_since']}")
    later_steps = later["data"][0] if later["data"] else []  # empty when no step ran meanwhile
    assert status == 200 and later_steps[:1] in ([], [steps[-1] + 1])
    assert call(server, "GET", f"elastic/api/runs/{run_id}/history?since=-1")[0] == 400
    status, logs = call(server, "GET", f"elastic/api/runs/{run_id}/logs")
    assert status == 200 and "run.log" in logs["text"]


@pytest.mark.parametrize("body, raw, message", [
    (None, b"{not json", "must be JSON"),
    ({"world_size": "3"}, None, "must be an integer"),
    ({"world_size": 2.5}, None, "must be an integer"),
    ({"size": 3}, None, "must be an integer"),
    ({"world_size": 9}, None, "bounds [1, 3]"),
    ({"world_size": 0}, None, "bounds [1, 3]"),
    ({"auto": "yes"}, None, '"auto" must be true or false'),
    ({"auto": True}, None, "does not take its slots from the machine's arbiter"),
])
def test_bad_resize_requests_answer_400(server, busy_run, body, raw, message):
    _, run_id = busy_run
    status, reply = call(server, "PATCH", f"elastic/api/runs/{run_id}", body, raw=raw)
    assert status == 400 and message in reply["message"], reply


def test_the_machine_view_says_when_no_arbiter_answers(server):
    status, view = call(server, "GET", "elastic/api/machine")
    assert status == 200 and view["available"] is False, view
    assert "no slot arbiter answers" in view["message"]


def test_unknown_run_answers_404(server):
    for method, body in (("GET", None), ("PATCH", {"world_size": 2}), ("DELETE", None)):
        status, reply = call(server, method, "elastic/api/runs/no-such-run", body)
        assert status == 404 and "no run with id 'no-such-run'" in reply["message"]


def test_stop_then_every_change_answers_409(server, busy_run):
    _, run_id = busy_run
    status, model = call(server, "DELETE", f"elastic/api/runs/{run_id}")
    assert status == 202
    wait_for(lambda: call(server, "GET", f"elastic/api/runs/{run_id}")[1]["state"] == "stopped",
             60, "the stop")
    for method, body in (("PATCH", {"world_size": 2}), ("DELETE", None)):
        status, reply = call(server, method, f"elastic/api/runs/{run_id}", body)
        assert status == 409 and "stopped" in reply["message"]


def test_a_dead_kernel_shows_lost_and_survives_a_server_restart(server, busy_run, tmp_path):
    kernel = Kernel(server)
    train(kernel, "doomed")
    [run] = runs_named(server, "doomed")
    wait_for(lambda: call(server, "GET", f"elastic/api/runs/{run['id']}")[1]["checkpoints"], 60,
             "a checkpoint")
    os.kill(kernel.pid(), signal.SIGKILL)
    kernel.client.stop_channels()
    lost = wait_for(lambda: [r for r in runs_named(server, "doomed") if r["state"] == "lost"], 30,
                    "the run to show as lost")[0]
    assert lost["step"] >= 50 and lost["checkpoints"]
    assert "--resume" in lost["error"] and "%%elastic_train --name doomed" in lost["error"]
    status, reply = call(server, "PATCH", f"elastic/api/runs/{run['id']}", {"world_size": 2})
    assert status == 409 and "lost" in reply["message"]
    # a fresh server process (as after a restart) finds the same runs from the registry
    with JupyterLab(str(tmp_path), str(tmp_path / "restarted.log"), base_url=BASE) as again:
        states = {r["name"]: r["state"] for r in call(again, "GET", "elastic/api/runs")[1]["runs"]
                  if r["id"] in (run["id"], busy_run[1])}
    assert states == {"doomed": "lost", "api": "stopped"}


ENUMERATE = textwrap.dedent("""
    import json, re
    from jupyter_server.serverapp import ServerApp
    app = ServerApp()
    app.initialize(argv=["--ServerApp.base_url=%s"], new_httpserver=False)
    found = []
    def walk(router):
        for rule in getattr(router, "rules", []):
            target = rule.target
            if isinstance(target, type) and target.__module__ == "elastic_jupyter.server.serverext":
                methods = [m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
                           if m.lower() in vars(target) or any(m.lower() in vars(b) for b in target.__mro__[1:-1]
                                                               if b.__module__ == "elastic_jupyter.server.serverext")]
                found.append([rule.matcher.regex.pattern, methods])
            else:
                walk(target)
    walk(app.web_app.default_router)
    print(json.dumps(found))
""")


def test_every_registered_handler_requires_authentication(server):
    out = subprocess.run([sys.executable, "-c", ENUMERATE % BASE], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    handlers = json.loads(out.strip().splitlines()[-1])
    assert len(handlers) >= 4, handlers
    for pattern, methods in handlers:
        assert methods, pattern
        path = pattern.replace("(?P<run_id>[^/]+)", "some-run").rstrip("$")
        assert path.startswith(BASE), path
        for method in methods:
            body = {"world_size": 2} if method == "PATCH" else None
            status, _ = call(server, method, path[len(BASE):], body, token=False)
            assert status in (403, 302), f"{method} {path} answered {status} without credentials"
            # a valid XSRF pair is not a login: the handler itself must refuse
            xsrf = {"Cookie": "_xsrf=2|abc|def|1", "X-XSRFToken": "2|abc|def|1"}
            status, _ = call(server, method, path[len(BASE):], body, token=False, headers=xsrf)
            assert status in (403, 302), f"{method} {path} answered {status} with XSRF only"


def test_an_ended_run_keeps_its_figures_and_can_be_dismissed(server, busy_run):
    """Last in this module: it ends the busy kernel."""
    _, run_id = busy_run
    call(server, "DELETE", f"elastic/api/runs/{run_id}")  # stopped already, unless run alone
    wait_for(lambda: call(server, "GET", f"elastic/api/runs/{run_id}")[1]["state"] == "stopped",
             60, "the stop")
    [entry] = [e for e in registry.list_runs() if e["id"] == run_id]
    os.kill(entry["pid"], signal.SIGKILL)  # the figures must outlive the kernel (busy: no .pid())
    wait_for(lambda: not [e for e in registry.list_runs() if e["id"] == run_id and e["live"]],
             30, "the kernel to be gone")
    status, run = call(server, "GET", f"elastic/api/runs/{run_id}")
    assert status == 200 and run["state"] == "stopped", run
    assert run["total_steps"] == 1_000_000 and run["loss"] is not None and run["world_size"] >= 1
    assert run["checkpoints"] and run["step"] >= run["checkpoints"][-1]["step"]
    status, _ = call(server, "POST", f"elastic/api/runs/{run_id}/dismiss", {})
    assert status == 204
    assert call(server, "GET", f"elastic/api/runs/{run_id}")[0] == 404
    assert not [r for r in runs_named(server, "api") if r["id"] == run_id]
    assert os.path.isdir(os.path.dirname(run["checkpoints"][-1]["path"]))  # checkpoints stay
