"""Resize through the server extension (the side panel's path) while the notebook's kernel is
busy executing another cell: time until the request is accepted (PATCH answered), and until the
new world size trains (seen through GET, polled every 50 ms). Grows are measured without and
with a standby engine (--standby 1), side by side in one run.

    .venv/bin/python benchmarks/panel_resize.py [--cycles 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from conftest import DIGITS_CELL  # noqa: E402
from lab_harness import JupyterLab, ServerKernel, call, wait_for  # noqa: E402


def resize(server, run_id: str, size: int) -> tuple[float, float]:
    started = time.monotonic()
    status, model = call(server, "PATCH", f"elastic/api/runs/{run_id}", {"world_size": size})
    accepted = time.monotonic() - started
    assert status == 202, model

    def done():
        time.sleep(0.05)
        return call(server, "GET", f"elastic/api/runs/{run_id}")[1]["world_size"] == size
    wait_for(done, 120, f"world size {size}", interval=0)
    return accepted, time.monotonic() - started


def measure(server, name: str, standby: int, cycles: int) -> dict:
    kernel = ServerKernel(server)
    kernel.run("%load_ext elastic_jupyter\n%elastic_pool start -n 2 --max 3")
    kernel.run(f"%%elastic_train --name {name} --global-batch 64 --steps 10000000 "
               f"--checkpoint-every 0 --standby {standby} --no-dashboard\n{DIGITS_CELL}")
    kernel.client.execute("import time\nwhile True: time.sleep(1)")  # the busy cell
    wait_for(lambda: kernel.execution_state() == "busy", 10, "the busy cell")
    run_id = [r for r in call(server, "GET", "elastic/api/runs")[1]["runs"] if r["name"] == name][0]["id"]
    time.sleep(3 if standby else 1)  # the standby engine boots
    out = {"accept": [], "grow": [], "shrink": []}
    for _ in range(cycles):
        accepted, grow = resize(server, run_id, 3)
        out["accept"].append(accepted)
        out["grow"].append(grow)
        time.sleep(6 if standby else 0.5)  # the next standby boots (engine start + the cell)
        accepted, shrink = resize(server, run_id, 2)
        out["accept"].append(accepted)
        out["shrink"].append(shrink)
    assert kernel.execution_state() == "busy"
    call(server, "DELETE", f"elastic/api/runs/{run_id}")
    kernel.client.stop_channels()
    call(server, "DELETE", f"api/kernels/{kernel.id}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root, JupyterLab(root, os.path.join(root, "lab.log")) as server:
        results = {standby: measure(server, f"bench-standby{standby}", standby, args.cycles)
                   for standby in (0, 1)}
    print(f"{'standby':>8} {'accepted (median s)':>20} {'shrink 3->2 (median s)':>23} "
          f"{'grow 2->3 (median s)':>21} {'grow max s':>11}")
    for standby, r in results.items():
        print(f"{standby:>8} {statistics.median(r['accept']):>20.3f} "
              f"{statistics.median(r['shrink']):>23.3f} {statistics.median(r['grow']):>21.3f} "
              f"{max(r['grow']):>11.3f}")


if __name__ == "__main__":
    main()
