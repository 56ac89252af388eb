"""End to end in a real browser: the "Elastic training" side panel of JupyterLab (served under a
non-root base URL, as on JupyterHub) lists the quick-start run; its slider, dragged with the
mouse while the notebook's kernel executes another cell, resizes the run; checkpoints open in
the file browser; Stop asks for confirmation. Screenshots go to artifacts/.
"""
import os
import shutil

import pytest

from elastic_jupyter import control, registry
from lab_harness import (ARTIFACTS, JupyterLab, browser_page, drag_slider, live_run,
                         open_and_run_all, quickstart_copy, screenshot, wait_for)


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

    # Stop asks first (JupyterLab dialog), then the run stops and the slider goes away
    page.locator(".jp-SideBar .lm-TabBar-tab[title='Elastic training']").click()
    detail.locator(".ejp-stop").click()
    page.locator(".jp-Dialog button", has_text="Stop").click()
    wait_for(lambda: control.request(socket_path, {"op": "status"})["state"] == "stopped", 60,
             "the run to stop")
    wait_for(lambda: detail.locator(".ejp-controls").is_hidden(), 15, "the slider to go away")
    assert "stopped" in detail.locator(".ejp-reason").inner_text()
