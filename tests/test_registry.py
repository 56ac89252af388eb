"""Discovery and the control channel: another process of this user finds the run and resizes it."""
import json
import os
import stat
import subprocess
import sys
import time

import psutil

from elastic_jupyter import RunConfig, TrainingRun
from elastic_jupyter.server import control, registry
from elastic_jupyter.host import alive, process_start

CELL = '''
import time
import torch
dataset = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def loss_fn(model, batch):
    time.sleep(0.01)
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''

CLIENT = '''
import json, sys
from elastic_jupyter.server import control, registry
entry = [e for e in registry.list_runs() if e["id"] == sys.argv[1]][0]
print(json.dumps({"live": entry["live"],
                  "status": control.request(entry["control"], {"op": "status"}),
                  "bad": control.request(entry["control"], {"op": "resize", "world_size": 99}),
                  "resize": control.request(entry["control"], {"op": "resize", "world_size": 1})}))
'''


def _listeners(pids):
    return [c for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


def test_another_process_finds_and_resizes_the_run(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="findme", steps=2000, checkpoint_every=0),
                      source=CELL, engines=2, workspace=str(tmp_path)).start()
    try:
        reg = run._registration
        deadline = time.time() + 10
        while not os.path.exists(reg.socket_path) and time.time() < deadline:
            time.sleep(0.05)
        for path in (reg.path, reg.socket_path, os.path.dirname(reg.path)):
            mode = stat.S_IMODE(os.stat(path).st_mode)
            assert mode & 0o077 == 0, (path, oct(mode))  # owner only

        out = subprocess.run([sys.executable, "-c", CLIENT, reg.run_id], capture_output=True,
                             text=True, timeout=60, check=True)
        reply = json.loads(out.stdout)
        assert reply["live"] is True
        assert reply["status"]["name"] == "findme" and reply["status"]["world_size"] == 2
        assert reply["bad"]["code"] == 400 and "[1, 4]" in reply["bad"]["error"]
        assert reply["resize"] == {"ok": True}
        deadline = time.time() + 30
        while run.world_size != 1 and time.time() < deadline:
            time.sleep(0.05)
        assert run.world_size == 1
    finally:
        run.stop()
        run.wait(timeout=60)
    entry = [e for e in registry.list_runs() if e["id"] == reg.run_id][0]
    assert entry["state"] == "stopped"
    # the ended run stays readable while the kernel lives; requests to change it are refused
    assert control.request(reg.socket_path, {"op": "status"})["state"] == "stopped"
    assert control.request(reg.socket_path, {"op": "resize", "world_size": 2})["code"] == 409


def test_nothing_the_pool_opens_listens_beyond_loopback(idle_pool, tmp_path):
    run = TrainingRun(idle_pool, RunConfig(name="net", steps=300, checkpoint_every=0),
                      source=CELL, engines=2, workspace=str(tmp_path)).start()
    try:
        time.sleep(1.0)  # the group is formed and gloo's sockets are open
        me = psutil.Process()
        pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
        assert {e.pid for e in idle_pool.engine_sets.engines} <= pids
        listeners = _listeners(pids)
        assert listeners, "expected the controller, the store and gloo to listen somewhere"
        exposed = [(c.laddr, c.pid) for c in listeners if not c.laddr.ip.startswith("127.")]
        assert exposed == []
    finally:
        run.stop()
        run.wait(timeout=60)


def test_ended_runs_are_pruned_by_age_and_count_live_runs_never(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    me = psutil.Process()
    now = time.time()

    def entry(run_id, live, age_days, state):
        pid, start = (me.pid, process_start(me.pid)) if live else (me.pid, 1.0)  # wrong start: gone
        data = {"id": run_id, "name": run_id, "pid": pid, "pid_start_time": start,
                "checkpoint_dir": str(tmp_path), "started": now - age_days * 86400,
                "control": str(tmp_path / f"{run_id}.sock"), "snapshot": {"state": state}}
        (tmp_path / "elastic-jupyter").mkdir(exist_ok=True)
        (tmp_path / "elastic-jupyter" / f"{run_id}.json").write_text(json.dumps(data))

    entry("live-old", True, 90, "training")
    entry("live-done", True, 1, "finished")
    for i in range(4):
        entry(f"gone-{i}", False, i, "training")
    entry("gone-ancient", False, 40, "stopped")
    kept = registry.prune(registry.list_runs(), max_age_s=30 * 86400, max_count=3)
    names = sorted(e["id"] for e in kept)
    # the 3 newest ended runs stay; the oldest beyond the count and the one past 30 days go
    assert names == ["gone-0", "gone-1", "live-done", "live-old"]
    assert sorted(e["id"] for e in registry.list_runs()) == names


# ----------------------------------------------------------------------------- long names

LONG_NAME = "resnet18_cifar10_sgd_lr0.1_bs256_wd5e-4_cosine_warmup5_seed0_run1"


def _deep_runtime_dir(tmp_path) -> str:
    return str(tmp_path / ("runtime-" + "d" * 60) / ("jupyter-" + "r" * 60))


def test_the_socket_path_fits_whatever_the_name_and_the_runtime_dir(tmp_path, monkeypatch):
    for runtime, inside_registry in ((str(tmp_path / "rt"), True),
                                     (_deep_runtime_dir(tmp_path), False)):
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)
        paths = [registry.socket_path(f"{name}-0123abcd")
                 for name in ("a", LONG_NAME, "n" * 200)]
        assert len({len(p) for p in paths}) == 1, paths  # the name never changes the length
        assert all(len(os.fsencode(p)) <= registry.SOCKET_PATH_MAX for p in paths)
        assert (os.path.dirname(paths[0]) == registry.registry_dir()) is inside_registry
        assert stat.S_IMODE(os.stat(os.path.dirname(paths[0])).st_mode) == 0o700


def test_a_long_run_name_in_a_deep_runtime_dir_answers_on_its_control_channel(
        idle_pool, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", _deep_runtime_dir(tmp_path))
    assert len(os.fsencode(os.path.join(registry.registry_dir(), LONG_NAME))) > 200
    run = TrainingRun(idle_pool, RunConfig(name=LONG_NAME, steps=2000, checkpoint_every=0),
                      source=CELL, engines=1, workspace=str(tmp_path)).start()
    try:
        reg = run._registration
        entry = [e for e in registry.list_runs() if e["id"] == reg.run_id][0]
        assert entry["control"] == reg.socket_path and entry["live"]
        deadline = time.time() + 10
        while not os.path.exists(reg.socket_path) and time.time() < deadline:
            time.sleep(0.05)
        status = control.request(entry["control"], {"op": "status"})
        assert status["name"] == LONG_NAME and status["state"] == "training"
        assert not [e for e in run.events if e["kind"] == "warning"]
    finally:
        run.stop()
        run.wait(timeout=60)


def test_a_control_channel_that_cannot_start_is_reported(idle_pool, tmp_path, monkeypatch):
    too_long = "/tmp/" + "x" * 200 + ".sock"
    monkeypatch.setattr(registry, "socket_path", lambda run_id: too_long)
    run = TrainingRun(idle_pool, RunConfig(name="nochannel", steps=2000, checkpoint_every=0),
                      source=CELL, engines=1, workspace=str(tmp_path)).start()
    try:
        deadline = time.time() + 10
        while not [e for e in run.events if e["kind"] == "warning"] and time.time() < deadline:
            time.sleep(0.05)
        warnings = [e["message"] for e in run.events if e["kind"] == "warning"]
        assert warnings and warnings[0].startswith("control channel not started: OSError")
    finally:
        run.stop()
        run.wait(timeout=60)


def test_a_process_is_told_by_its_start_in_ticks_not_by_the_wall_clock():
    """psutil's create_time adds a boot time that /proc/stat derives from the slewed wall clock
    in whole seconds: it moved by 1 s under a soak, and the server read a live kernel as gone.
    The start in clock ticks after boot does not move."""
    me = os.getpid()
    start = process_start(me)
    with open(f"/proc/{me}/stat") as f:
        assert start == float(f.read().rsplit(")", 1)[1].split()[19])
    assert alive(me, start) and not alive(me, start + 1) and not alive(2 ** 22 + 1, start)
