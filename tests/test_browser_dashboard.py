"""End to end in a real browser: JupyterLab on loopback, headless Chromium, the quick-start
notebook run from the Run menu, the dashboard's slider dragged with the mouse while another
cell is executing, then light/dark themes and a kernel restart. Screenshots go to artifacts/.

Run twice: with the server extension (the slider's request goes over its REST API) and with it
disabled (the request goes over the widget's comm, on the subshell JupyterLab chose).
"""
import os
import shutil

import pytest

from elastic_jupyter.server import control, registry
from lab_harness import (ARTIFACTS, JupyterLab, browser_page, drag_slider, live_run, menu,
                         open_and_run_all, quickstart_copy, screenshot, wait_for)

WITHOUT_EXTENSION = "--ServerApp.jpserver_extensions={'elastic_jupyter': False}"


@pytest.fixture(params=["server", "comm"])
def lab(request, tmp_path):
    quickstart_copy(tmp_path)
    extra = [WITHOUT_EXTENSION] if request.param == "comm" else []
    with JupyterLab(str(tmp_path), str(tmp_path / "lab.log"), extra_args=extra) as server:
        server.request_path = request.param
        yield server
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(tmp_path / "lab.log", os.path.join(ARTIFACTS, f"lab-dashboard-{request.param}.log"))


@pytest.fixture
def page(lab):
    with browser_page(f"dashboard-{lab.request_path}-last.png") as page:
        yield page


def test_slider_drag_resizes_while_a_cell_runs(lab, page):
    page.on("dialog", lambda dialog: dialog.accept())  # the Stop button's confirmation
    open_and_run_all(page, lab, "lab/tree/01_quickstart.ipynb")

    dashboard = page.locator(".ej-dashboard")
    dashboard.wait_for(timeout=120_000)
    slider = dashboard.locator(".ej-slider")
    socket_path = wait_for(lambda: live_run("digits"), 60, "the run in the registry")["control"]

    # wait until the notebook's scheduled resizes (150:3, 450:1) are done and the run.wait cell
    # is executing ([*]): a resize to 3 can then only come from the slider
    wait_cell = page.locator(".jp-CodeCell", has_text="run.wait(progress=True)")

    def busy() -> bool:
        return wait_cell.locator(".jp-InputPrompt").inner_text().strip() == "[*]:"

    def ready():
        status = control.request(socket_path, {"op": "status"})
        # the dashboard shows it too: a view that still shows 3 (its snapshot lags the run
        # on a loaded machine) takes a drag to 3 for "already 3" and sends nothing
        return (status["state"] == "training" and status["step"] > 460 and status["world_size"] == 1
                and status["requested_size"] != 3 and busy() and not slider.is_disabled()
                and dashboard.get_attribute("data-world-size") == "1")
    wait_for(ready, 120, "training at world size 1 after step 460 while run.wait executes")
    step_at_drag = control.request(socket_path, {"op": "status"})["step"]
    slider.scroll_into_view_if_needed()
    drag_slider(page, slider, 3)
    assert slider.input_value() == "3"
    assert busy(), "the drag must happen while another cell executes"

    # the request reaches the run at once (no waiting for the busy cell), then takes effect
    wait_for(lambda: control.request(socket_path, {"op": "status"})["requested_size"] == 3, 10,
             "the run to receive the slider's request")
    assert busy()
    wait_for(lambda: dashboard.get_attribute("data-request-path") == lab.request_path, 10,
             f"the request to go over the {lab.request_path} path")
    events = wait_for(lambda: [e for e in control.request(socket_path, {"op": "events"})["events"]
                               if e["kind"] == "resized" and e["to"] == 3
                               and e["step"] > step_at_drag], 60, "the resize to 3")
    assert control.request(socket_path, {"op": "status"})["world_size"] == 3
    requests = [e for e in control.request(socket_path, {"op": "events"})["events"]
                if e["kind"] == "resize" and e["step"] >= step_at_drag]
    assert requests and requests[0]["to"] == 3 and not requests[0].get("scheduled"), requests

    # the page shows it: world size 3 with the latency, points and a resize marker drawn
    wait_for(lambda: dashboard.get_attribute("data-world-size") == "3", 10, "world size 3")
    wait_for(lambda: "took" in dashboard.locator(".ej-size").inner_text(), 10,
             "the resize's latency in the status")
    chart = dashboard.locator(".ej-chart")
    wait_for(lambda: int(chart.get_attribute("data-points") or 0) > events[0]["step"], 10,
             "points up to the resize in the chart")
    assert int(chart.get_attribute("data-markers-resized")) >= 1
    dashboard.scroll_into_view_if_needed()
    screenshot(page, f"dashboard-{lab.request_path}-light.png")

    # and while the kernel is idle: interrupt the waiting cell (the run keeps training), let
    # the remaining cells end, then drag to 2
    menu(page, "Kernel", "Interrupt Kernel")
    page.locator(".jp-StatusBar-TextItem", has_text="Idle").first.wait_for(timeout=60_000)
    wait_for(lambda: not busy() and control.request(socket_path, {"op": "status"})["state"] == "training",
             30, "an idle kernel with the run still training")
    slider.scroll_into_view_if_needed()
    drag_slider(page, slider, 2)
    wait_for(lambda: control.request(socket_path, {"op": "status"})["world_size"] == 2, 30,
             "the resize to 2 from an idle kernel")
    wait_for(lambda: dashboard.get_attribute("data-world-size") == "2", 10, "world size 2 shown")

    # dark theme: the dashboard follows JupyterLab's theme variables
    light_bg = dashboard.evaluate("e => getComputedStyle(e).backgroundColor")
    menu(page, "Settings", "Theme")
    page.locator(".lm-Menu-itemLabel:visible", has_text="JupyterLab Dark").first.click()
    wait_for(lambda: dashboard.evaluate("e => getComputedStyle(e).backgroundColor") != light_bg,
             20, "the dark theme")
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=20_000)
    dashboard.scroll_into_view_if_needed()
    screenshot(page, f"dashboard-{lab.request_path}-dark.png")

    # stop from the dashboard; the slider is disabled with the reason shown
    dashboard.locator("button", has_text="Stop").click()
    wait_for(lambda: dashboard.locator(".ej-state").inner_text() == "stopped", 60,
             "the run to stop")
    assert slider.is_disabled()
    assert "resizing is off" in dashboard.locator(".ej-reason").inner_text()

    # a kernel restart: the dashboard says it is disconnected instead of freezing silently
    menu(page, "Kernel", "Restart Kernel")
    page.locator(".jp-Dialog button", has_text="Restart").click()
    wait_for(lambda: "Disconnected" in dashboard.locator(".ej-reason").inner_text(), 30,
             "the disconnected notice")
    # the restart done before the server stops (one stopped mid-restart hangs in
    # jupyter_client's shutdown_all: InvalidStateError on the kernel's ready future)
    wait_for(lambda: "Kernel restarted" in open(lab.log_path).read(), 60, "the restart")
