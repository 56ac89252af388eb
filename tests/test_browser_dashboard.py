"""End to end in a real browser: JupyterLab on loopback, headless Chromium, the quick-start
notebook run from the Run menu, the dashboard's slider dragged with the mouse while another
cell is executing, then light/dark themes and a kernel restart. Screenshots go to artifacts/.
"""
import json
import os
import shutil
import time

import pytest

from elastic_jupyter import registry
from lab_harness import ARTIFACTS, JupyterLab, chromium, drag_slider, menu, open_and_run_all, screenshot

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "01_quickstart.ipynb")


def wait_for(condition, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def lab(tmp_path):
    # the quick-start notebook as shipped, with more epochs so the run outlasts the checks
    nb = json.load(open(NOTEBOOK))
    for cell in nb["cells"]:
        cell["source"] = "".join(cell["source"]).replace("--epochs 30", "--epochs 200")
    (tmp_path / "01_quickstart.ipynb").write_text(json.dumps(nb))
    with JupyterLab(str(tmp_path), str(tmp_path / "lab.log")) as server:
        yield server
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(tmp_path / "lab.log", os.path.join(ARTIFACTS, "lab-dashboard.log"))


def live_run(name: str) -> dict:
    entries = [e for e in registry.list_runs() if e["name"] == name and e["live"]
               and os.path.exists(e["control"])]
    return entries[-1] if entries else None


@pytest.fixture
def page(lab):
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page
        finally:
            screenshot(page, "dashboard-last.png")  # the page as the test left it


def test_slider_drag_resizes_while_a_cell_runs(lab, page):
    page.on("dialog", lambda dialog: dialog.accept())  # the Stop button's confirmation
    open_and_run_all(page, lab.page_url("lab/tree/01_quickstart.ipynb"))

    dashboard = page.locator(".ej-dashboard")
    dashboard.wait_for(timeout=120_000)
    slider = dashboard.locator(".ej-slider")
    entry = wait_for(lambda: live_run("digits"), 60, "the run in the registry")
    control = entry["control"]

    # wait until the world size is not 3 and the run.wait cell is executing ([*])
    wait_cell = page.locator(".jp-CodeCell", has_text="run.wait(progress=True)")

    def ready():
        status = registry.request(control, {"op": "status"})
        busy = wait_cell.locator(".jp-InputPrompt").inner_text().strip() == "[*]:"
        return (status["state"] == "training" and status["world_size"] != 3
                and status["requested_size"] != 3 and busy and not slider.is_disabled())
    wait_for(ready, 120, "training at a world size other than 3 while run.wait executes")
    step_at_drag = registry.request(control, {"op": "status"})["step"]
    slider.scroll_into_view_if_needed()
    drag_slider(page, slider, 3)
    assert slider.input_value() == "3"
    assert wait_cell.locator(".jp-InputPrompt").inner_text().strip() == "[*]:", \
        "the drag must happen while another cell executes"

    # the request reaches the run at once (no waiting for the busy cell), then takes effect
    requested = wait_for(
        lambda: registry.request(control, {"op": "status"})["requested_size"] == 3, 10,
        "the kernel to receive the slider's request")
    assert requested
    events = wait_for(lambda: [e for e in registry.request(control, {"op": "events"})["events"]
                               if e["kind"] == "resized" and e["to"] == 3
                               and e["step"] > step_at_drag], 60, "the resize to 3")
    assert registry.request(control, {"op": "status"})["world_size"] == 3
    requests = [e for e in registry.request(control, {"op": "events"})["events"]
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
    screenshot(page, "dashboard-light.png")

    # dark theme: the dashboard follows JupyterLab's theme variables
    light_bg = dashboard.evaluate("e => getComputedStyle(e).backgroundColor")
    menu(page, "Settings", "Theme")
    page.locator(".lm-Menu-itemLabel:visible", has_text="JupyterLab Dark").first.click()
    wait_for(lambda: dashboard.evaluate("e => getComputedStyle(e).backgroundColor") != light_bg,
             20, "the dark theme")
    page.wait_for_selector("#jupyterlab-splash", state="detached", timeout=20_000)
    dashboard.scroll_into_view_if_needed()
    screenshot(page, "dashboard-dark.png")

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
    screenshot(page, "dashboard-disconnected.png")
