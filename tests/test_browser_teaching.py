"""The teaching notebooks in JupyterLab, in headless Chromium: each opens without an error,
and notebook 2, run from the Run menu, shows its run's dashboard with the loss chart drawn
(every step a point, a marker at each resize) and its matplotlib figure."""
import json
import os
import shutil

import pytest

from lab_harness import ARTIFACTS, JupyterLab, browser_page, open_and_run_all, screenshot, wait_for
from test_notebooks import NOTEBOOKS

TEACHING = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def title(name: str) -> str:
    """The notebook's title: the first "# " line of its markdown cells."""
    cells = json.loads((NOTEBOOKS / name).read_text())["cells"]
    lines = ("".join(c["source"]).splitlines() for c in cells if c["cell_type"] == "markdown")
    return next(line[2:] for cell in lines for line in cell if line.startswith("# "))


@pytest.fixture
def lab(tmp_path):
    for name in TEACHING:
        shutil.copy(NOTEBOOKS / name, tmp_path)
    with JupyterLab(str(tmp_path), str(tmp_path / "lab.log")) as server:
        yield server
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(tmp_path / "lab.log", os.path.join(ARTIFACTS, "lab-teaching.log"))


def test_every_notebook_opens_and_notebook_2_draws_its_chart(lab):
    with browser_page("teaching-last.png") as page:
        open_and_run_all(page, lab, "lab/tree/02_world_size.ipynb")
        last = page.locator(".jp-CodeCell").last  # pool.stop(): it ran once every cell did
        wait_for(lambda: last.locator(".jp-InputPrompt").inner_text().strip() not in
                 ("[ ]:", "[*]:", ""), 240, "every cell to run")
        assert not page.locator("[data-mime-type='application/vnd.jupyter.error']").count(), \
            page.locator("[data-mime-type='application/vnd.jupyter.error']").first.inner_text()
        chart = page.locator(".ej-dashboard .ej-chart")
        chart.scroll_into_view_if_needed()
        wait_for(lambda: chart.get_attribute("data-points") == "240", 30, "240 points drawn")
        assert chart.get_attribute("data-markers-resized") == "2"
        assert chart.locator("canvas").first.bounding_box()["height"] > 100
        assert page.locator(".jp-RenderedImage img").count() >= 1  # the matplotlib figure
        screenshot(page, "teaching-02-dashboard.png")

        for name in TEACHING:
            page.goto(lab.page_url(f"lab/tree/{name}"))
            # The workspace restores notebooks opened before in hidden tabs: wait for this
            # one's own title, shown.
            heading = page.locator(".jp-Notebook .jp-MarkdownCell h1", has_text=title(name))
            heading.first.wait_for(state="visible", timeout=60_000)
            assert not page.locator(".jp-Dialog").count(), f"{name}: an error dialog"
