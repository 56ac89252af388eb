"""End to end in a real browser: the "Elastic training" side panel of JupyterLab (served under a
non-root base URL, as on JupyterHub) lists the quick-start run; its slider, dragged with the
mouse while the notebook's kernel executes another cell, resizes the run; checkpoints open in
the file browser; Stop asks for confirmation. Its machine view shows the slots of a machine
shared by three runs and a process outside, and its Auto toggle takes effect. Screenshots go
to artifacts/.
"""
import json
import os
import pwd
import shutil
import time

import pytest

from elastic_jupyter import EnginePool, RunConfig, TrainingRun
from elastic_jupyter.server import control, registry
from elastic_jupyter.arbiter.client import ArbiterClient
from lab_harness import (ARTIFACTS, JupyterLab, browser_page, drag_slider, live_run,
                         open_and_run_all, quickstart_copy, screenshot, wait_for)
from test_arbiter import start_arbiter, stop


@pytest.fixture
def lab(tmp_path):
    quickstart_copy(tmp_path)
    with JupyterLab(str(tmp_path), str(tmp_path / "lab.log"), base_url="/user/alice/") as server:
        yield server
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(tmp_path / "lab.log", os.path.join(ARTIFACTS, "lab-panel.log"))


@pytest.fixture
def page(lab):
    with browser_page("panel-last.png") as page:
        yield page


def test_panel_lists_the_run_and_its_slider_resizes_while_the_kernel_is_busy(lab, page):
    open_and_run_all(page, lab, "lab/tree/01_quickstart.ipynb")
    socket_path = wait_for(lambda: live_run("digits"), 120, "the run in the registry")["control"]

    page.locator(".jp-SideBar .lm-TabBar-tab[title='Elastic training']").click()
    panel = page.locator("#elastic-jupyter-panel")
    row = panel.locator(".ejp-run[data-state='training']", has_text="digits").first
    row.wait_for(timeout=30_000)
    row.click()
    detail = panel.locator(".ejp-detail-box")
    slider = detail.locator(".ejp-slider")
    slider.wait_for(timeout=30_000)

    wait_cell = page.locator(".jp-CodeCell", has_text="run.wait(progress=True)")

    def busy() -> bool:
        return wait_cell.locator(".jp-InputPrompt").inner_text().strip() == "[*]:"

    def ready():  # after the notebook's scheduled resizes (150:3, 450:1), with the kernel busy
        status = control.request(socket_path, {"op": "status"})
        return status["step"] > 460 and status["world_size"] == 1 and busy() and \
            detail.get_attribute("data-world-size") == "1"
    wait_for(ready, 120, "world size 1 after step 460 while run.wait executes")
    assert "training" in row.inner_text() and "W 1/1" in row.inner_text()
    step_at_drag = control.request(socket_path, {"op": "status"})["step"]

    slider.scroll_into_view_if_needed()
    drag_slider(page, slider, 3)
    assert slider.input_value() == "3" and busy()
    wait_for(lambda: detail.locator(".ejp-feedback").get_attribute("data-kind") in ("pending", "done"),
             2, "the request shown as pending within a second")
    wait_for(lambda: detail.get_attribute("data-world-size") == "3", 60, "world size 3 in the panel")
    wait_for(lambda: detail.locator(".ejp-feedback").get_attribute("data-kind") == "done", 10,
             "the resize shown as done")
    assert "done in" in detail.locator(".ejp-feedback").inner_text() and busy()
    requests = [e for e in control.request(socket_path, {"op": "events"})["events"]
                if e["kind"] == "resize" and e["step"] >= step_at_drag]
    assert requests and requests[0]["to"] == 3 and not requests[0].get("scheduled"), requests

    chart = detail.locator(".ej-chart")
    wait_for(lambda: int(chart.get_attribute("data-points") or 0) > step_at_drag, 15,
             "the loss chart's points")
    wait_for(lambda: int(chart.get_attribute("data-markers-resized") or 0) >= 3, 15,
             "resize markers (two scheduled, one from the slider)")
    assert row.locator(".ejp-spark polyline").get_attribute("points")
    screenshot(page, "panel.png")

    # a checkpoint link opens the file browser at the checkpoint's folder
    detail.locator(".ejp-link").first.click()
    wait_for(lambda: "digits" in page.locator(".jp-FileBrowser .jp-BreadCrumbs").first.inner_text(),
             15, "the file browser at elastic-checkpoints/digits")

    # Stop asks first (JupyterLab dialog), then the run stops and the slider goes away. The
    # link's last command (go-to-path on the file) may activate the file browser again after
    # the breadcrumbs changed: come back until the panel stays (a click on the current tab
    # would collapse the sidebar)
    tab = page.locator(".jp-SideBar .lm-TabBar-tab[title='Elastic training']")

    def panel_shown() -> bool:
        if "lm-mod-current" not in (tab.get_attribute("class") or ""):
            tab.click()
            time.sleep(0.5)  # and still shown half a second later
        return "lm-mod-current" in (tab.get_attribute("class") or "") and \
            detail.locator(".ejp-stop").is_visible()
    wait_for(panel_shown, 15, "the panel shown again")
    detail.locator(".ejp-stop").click()
    page.locator(".jp-Dialog button", has_text="Stop").click()
    wait_for(lambda: control.request(socket_path, {"op": "status"})["state"] == "stopped", 60,
             "the run to stop")
    # both from the same poll's render: wait for them together, not one then the other
    wait_for(lambda: detail.locator(".ejp-controls").is_hidden()
             and "stopped" in detail.locator(".ejp-reason").inner_text(), 15,
             "the slider to go away and the reason to say stopped")


MACHINE_BODY = '''
import time
import torch
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
dataset = torch.utils.data.TensorDataset(torch.tensor(X, dtype=torch.float32) / 16, torch.tensor(y))
model = torch.nn.Linear(64, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
def loss_fn(model, batch):
    time.sleep(0.02)
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
'''


def test_panel_shows_the_machine_and_its_auto_toggle_takes_effect(tmp_path, monkeypatch):
    """Three runs share a machine of 4 CPU slots, one of them busy outside: the panel's machine
    view shows every holder, and ticking Auto on the manual run turns its auto mode on; once
    that run stops, its idle pool lends its slot and the view says so."""
    folder = tmp_path / "arbiter"
    folder.mkdir(mode=0o700)
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"3": "pid 4242 (a job outside)"}))
    arbiter = start_arbiter(str(folder), {"hold_s": 0, "lend_s": 10,
                                          "outside_file": str(outside)})
    monkeypatch.setenv("ELASTIC_JUPYTER_ARBITER", str(folder))  # the runs' and the server's
    pools = []
    try:
        for name, options in (("alpha", {"auto": True}), ("beta", {"auto": True}),
                              ("gamma", {"n": 1})):
            pool = EnginePool(min_size=1, max_size=2, gpus="none", **options).start()
            pools.append(pool)
            TrainingRun(pool, RunConfig(name=name, steps=100000, global_batch=32,
                                        checkpoint_every=0),
                        source=MACHINE_BODY, workspace=str(tmp_path),
                        notebook=f"{name}.ipynb").start()
        wait_for(lambda: [p.size for p in pools] == [1, 1, 1], 120, "one slot each")
        with JupyterLab(str(tmp_path), str(tmp_path / "lab.log")) as lab, \
                browser_page("panel-machine-last.png") as page:
            page.goto(lab.page_url("lab"))
            tab = page.locator(".jp-SideBar .lm-TabBar-tab[title='Elastic training']")
            tab.wait_for(timeout=60_000)
            tab.click()
            panel = page.locator("#elastic-jupyter-panel")
            slots = panel.locator(".ejp-machine .ejp-slot")

            def holders():
                return [slots.nth(i).get_attribute("data-holder") for i in range(slots.count())]
            wait_for(lambda: sorted(holders()) == ["alpha", "beta", "gamma", "outside"], 60,
                     "every holder in the machine view")
            assert "pid 4242" in slots.nth(3).inner_text()
            assert "gamma.ipynb" in panel.locator(".ejp-slot[data-holder='gamma']").inner_text()

            panel.locator(".ejp-run", has_text="gamma").first.click()
            chart = panel.locator(".ejp-detail-box .ej-chart")
            wait_for(lambda: int(chart.get_attribute("data-markers-slot") or 0) >= 1, 30,
                     "the slot gamma grew into, marked on its chart")
            auto = panel.locator(".ejp-detail-box .ejp-auto")
            auto.wait_for(timeout=30_000)
            assert not auto.is_checked()
            auto.click()
            wait_for(lambda: pools[2].lease.demand["auto"], 15, "gamma's pool in auto mode")
            wait_for(lambda: panel.locator(".ejp-machine-run[data-run='gamma']")
                     .get_attribute("data-auto") == "true", 15, "auto shown in the machine view")
            screenshot(page, "panel-machine.png")

            pools[2].run.stop()  # gamma's pool idles: after lend_s, alpha or beta borrows
            lent = panel.locator(".ejp-slot[data-lent-by='gamma']")
            lent.wait_for(timeout=60_000)
            assert f"lent by {pwd.getpwuid(os.getuid()).pw_name}/gamma" in lent.inner_text()
        view = ArbiterClient(str(folder)).view()
        assert [r["auto"] for r in view["runs"]] == [True, True, True]
    finally:
        for pool in pools:
            pool.stop()
        stop(arbiter)
