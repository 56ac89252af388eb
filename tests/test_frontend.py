"""The front end as the package's install step builds it: lint, unit tests of the side panel's
model logic (node's test runner), a self-contained widget bundle, and the installed extensions."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
STATIC = ROOT / "elastic_jupyter" / "static"
BIN = pathlib.Path(sys.executable).parent


def npm(*args, timeout=300):
    return subprocess.run(["npm", "run", "--silent", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_lint_type_checks_and_eslint_pass():
    result = npm("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_panel_model_unit_tests_pass():
    result = npm("test")
    assert result.returncode == 0 and "# fail 0" in result.stdout, result.stdout + result.stderr


def test_widget_bundle_is_self_contained():
    """The chart library is bundled in: no import may reach for a CDN (machines are offline)."""
    bundle = (STATIC / "dashboard.js").read_text()
    assert "uPlot" in bundle or "uplot" in bundle
    assert not re.search(r"""(import\s*\(?|from)\s*["']https?://""", bundle)
    assert (STATIC / "dashboard.css").stat().st_size > 0


def test_pip_install_enabled_both_extensions():
    labext = subprocess.run([BIN / "jupyter", "labextension", "list"], capture_output=True,
                            text=True, timeout=120)
    # the extension's own line, not a folder's: the checkout may itself be named elastic-jupyter
    line = next(l for l in (labext.stdout + labext.stderr).splitlines()
                if re.match(r"\s+elastic-jupyter\s+v", l))
    assert "enabled" in line and "OK" in line, line
    server = subprocess.run([BIN / "jupyter", "server", "extension", "list"], capture_output=True,
                            text=True, timeout=120)
    text = re.sub(r"\x1b\[[0-9;]*m", "", server.stdout + server.stderr)
    assert re.search(r"elastic_jupyter\s+enabled", text) and "elastic_jupyter 0.1.0 OK" in text, text


def test_wheel_carries_the_built_front_end_and_the_server_config(tmp_path):
    """What one `pip install` of the package installs: widget bundle, prebuilt extension, and
    the config that enables the server extension."""
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    [wheel] = tmp_path.glob("elastic_jupyter-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = "elastic_jupyter-0.1.0.data/data/"
    for expected in ("elastic_jupyter/static/dashboard.js",
                     data + "share/jupyter/labextensions/elastic-jupyter/package.json",
                     data + "share/jupyter/labextensions/elastic-jupyter/install.json",
                     data + "share/jupyter/labextensions/elastic-jupyter/schemas/elastic-jupyter/plugin.json",
                     data + "etc/jupyter/jupyter_server_config.d/elastic_jupyter.json"):
        assert expected in names, expected
    assert any(re.search(r"labextensions/elastic-jupyter/static/remoteEntry\.\w+\.js$", n) for n in names)
