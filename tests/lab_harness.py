"""Real-browser test harness: a JupyterLab server on loopback and headless Debian Chromium driven
by Playwright (no browser download: Playwright is pointed at /usr/bin/chromium).

Missing Chromium is an error, never a skip: .ci/run installs it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from jupyter_client import BlockingKernelClient
from jupyter_core.paths import jupyter_runtime_dir

CHROMIUM = os.environ.get("ELASTIC_CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts")


NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks",
                        "01_quickstart.ipynb")


def quickstart_copy(root, epochs: int = 2000) -> None:
    """The quick-start notebook as shipped, with more epochs so the run outlasts the checks."""
    with open(NOTEBOOK) as f:
        nb = json.load(f)
    for cell in nb["cells"]:
        cell["source"] = "".join(cell["source"]).replace("--epochs 30", f"--epochs {epochs}")
    with open(os.path.join(root, "01_quickstart.ipynb"), "w") as f:
        json.dump(nb, f)


def wait_for(condition, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def live_run(name: str) -> dict | None:
    """The registry entry of the live run called `name` (this user's runtime dir)."""
    from elastic_jupyter.server import registry
    entries = [e for e in registry.list_runs() if e["name"] == name and e["live"]
               and os.path.exists(e["control"])]
    return entries[-1] if entries else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """`jupyter lab` (or `jupyter notebook`, Notebook 7, with app="notebook") serving `root` on
    127.0.0.1 with a random token, logging to `log_path`."""

    def __init__(self, root: str, log_path: str, base_url: str = "/", extra_args=(),
                 app: str = "lab"):
        self.root, self.log_path, self.base_url, self.app = root, log_path, base_url, app
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{base_url}"
        self.extra_args = list(extra_args)
        self.process = None

    def __enter__(self) -> "JupyterLab":
        # own user settings (no "get notified about Jupyter news?" toast over the page) and
        # workspaces (no layout restored from an earlier test)
        settings = os.path.join(self.root, ".lab-settings")
        news = os.path.join(settings, "@jupyterlab", "apputils-extension")
        os.makedirs(news, exist_ok=True)
        with open(os.path.join(news, "notification.jupyterlab-settings"), "w") as f:
            f.write('{"fetchNews": "false", "checkForUpdates": false}')
        env = dict(os.environ)
        self._log = open(self.log_path, "w")
        front = "LabApp" if self.app == "lab" else "JupyterNotebookApp"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyter", self.app, "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", f"--ServerApp.base_url={self.base_url}",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--ServerApp.allow_root=True", f"--{front}.news_url=None",
             f"--{front}.user_settings_dir={settings}",
             f"--{front}.workspaces_dir={os.path.join(self.root, '.lab-workspaces')}",
             *(["--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
               if self.app == "lab" else []),
             *self.extra_args],
            cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jupyter lab exited; see {self.log_path}")
            try:
                urllib.request.urlopen(f"{self.url}api/status?token={self.token}", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer within 90 s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        # SIGTERM is jupyter's own stop: the server shuts its kernels down (their atexit
        # handlers stop runs and pools) and its extensions, then exits. SIGINT's handling
        # depends on whether stdin is a terminal (a confirmation prompt), and in the full
        # suite it left servers running until the 60 s kill below.
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()

    def page_url(self, path: str) -> str:
        return f"{self.url}{path}?token={self.token}"


def call(server, method: str, path: str, body=None, token=True, raw: bytes | None = None,
         headers: dict | None = None):
    """(status, JSON body) of a request to the server; no redirects followed."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(f"{server.url}{path}", data=data, method=method,
                                     headers=headers or {})
    if token:
        request.add_header("Authorization", f"token {server.token}")
    try:
        with _NO_REDIRECTS.open(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, {"text": text.decode(errors="replace")}


class _KeepRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect (to the login page) is an answer, not something to follow


_NO_REDIRECTS = urllib.request.build_opener(_KeepRedirects)


class ServerKernel:
    """A kernel started by the server (POST api/kernels), driven over its own channels."""

    def __init__(self, server):
        status, model = call(server, "POST", "api/kernels", {"name": "python3"})
        assert status == 201, model
        self.id, self.server = model["id"], server
        self.client = BlockingKernelClient(
            connection_file=os.path.join(jupyter_runtime_dir(), f"kernel-{self.id}.json"))
        self.client.load_connection_file()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 180) -> str:
        out = []
        reply = self.client.execute_interactive(
            code, timeout=timeout, output_hook=lambda m: out.append(m["content"].get("text", "")
                                                                    or str(m["content"].get("evalue", ""))))
        assert reply["content"]["status"] == "ok", "".join(out) + str(reply["content"])
        return "".join(out)

    def execution_state(self) -> str:
        return call(self.server, "GET", f"api/kernels/{self.id}")[1]["execution_state"]

    def pid(self) -> int:
        return int(self.run("import os; print(os.getpid())").strip())



@contextlib.contextmanager
def chromium():
    """A headless Chromium browser (Playwright, sync API)."""
    if not os.access(CHROMIUM, os.X_OK):
        raise RuntimeError(f"no Chromium at {CHROMIUM}: install Debian's chromium "
                           "(apt-get install chromium; .ci/run does) or set ELASTIC_CHROMIUM")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def browser_page(last_screenshot: str):
    """A page in headless Chromium; `last_screenshot` keeps how the test left it."""
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page
        finally:
            screenshot(page, last_screenshot)


def drag_slider(page, slider, value: int) -> None:
    """Drag a range input's thumb to `value` with real mouse events (down, moves, up)."""
    box = slider.bounding_box()
    lo, hi = float(slider.get_attribute("min")), float(slider.get_attribute("max"))
    current = float(slider.input_value())
    thumb = 16  # Chromium's default thumb width (px): the track spans width - thumb

    def x_of(v: float) -> float:
        return box["x"] + thumb / 2 + (v - lo) / (hi - lo) * (box["width"] - thumb)

    y = box["y"] + box["height"] / 2
    page.mouse.move(x_of(current), y)
    page.mouse.down()
    for i in range(1, 11):
        page.mouse.move(x_of(current) + (x_of(value) - x_of(current)) * i / 10, y)
    page.mouse.up()


def menu(page, top: str, item: str) -> None:
    """Click a main-menu entry, like menu(page, "Run", "Run All Cells")."""
    page.locator(".lm-MenuBar-item", has_text=top).first.click()
    page.locator(".lm-Menu-itemLabel:visible", has_text=re.compile(f"^{re.escape(item)}")).first.click()


def open_and_run_all(page, server: JupyterLab, path: str) -> None:
    """Open a notebook (`path` under the server's root URL, like "lab/tree/x.ipynb"), wait
    until its kernel is idle, then Run All Cells from the menu (a Run All issued before the
    kernel connected is dropped)."""
    page.goto(server.page_url(path))
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)

    def kernel_idle():
        sessions = call(server, "GET", "api/sessions")[1]
        return sessions and all(s["kernel"]["execution_state"] == "idle" for s in sessions)
    wait_for(kernel_idle, 90, "the notebook's kernel to be idle")
    time.sleep(1)  # the page's own kernel connection settles
    menu(page, "Run", "Run All Cells")
    first = page.locator(".jp-CodeCell .jp-InputPrompt").first
    deadline = time.monotonic() + 60
    while first.inner_text().strip() in ("[ ]:", "") and time.monotonic() < deadline:
        time.sleep(0.5)


def screenshot(page, name: str) -> str:
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    page.screenshot(path=path, full_page=False)
    return path
