"""The dashboard in Notebook 7 (a real browser): the quick-start notebook runs from the menu and
the dashboard shows the run training, with points and resize markers in its chart."""
import os
import shutil

from lab_harness import (ARTIFACTS, JupyterLab, browser_page, open_and_run_all, quickstart_copy,
                         wait_for)


def test_dashboard_in_notebook_7(tmp_path):
    quickstart_copy(tmp_path)
    with JupyterLab(str(tmp_path), str(tmp_path / "nb7.log"), app="notebook") as server, \
            browser_page("notebook7.png") as page:
        open_and_run_all(page, server, "notebooks/01_quickstart.ipynb")
        dashboard = page.locator(".ej-dashboard")
        dashboard.wait_for(timeout=120_000)
        chart = dashboard.locator(".ej-chart")
        wait_for(lambda: int(chart.get_attribute("data-markers-resized") or 0) >= 2, 120,
                 "the scheduled resizes drawn")
        # markers and rows reach the chart separately: the rows of the step after the
        # second resize may come a moment after its marker
        wait_for(lambda: int(chart.get_attribute("data-points") or 0) > 450, 15,
                 "the rows after the second resize")
        assert dashboard.locator(".ej-state").inner_text() in ("training", "resizing")
        dashboard.scroll_into_view_if_needed()
    os.makedirs(ARTIFACTS, exist_ok=True)
    shutil.copy(tmp_path / "nb7.log", os.path.join(ARTIFACTS, "notebook7.log"))
