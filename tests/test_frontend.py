"""The front end as built by the package's install step: type-checked, bundled, offline."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
STATIC = ROOT / "elastic_jupyter" / "static"


def test_typescript_type_checks():
    result = subprocess.run(["npm", "run", "--silent", "lint"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bundle_is_self_contained():
    """The chart library is bundled in: no import may reach for a CDN (machines are offline)."""
    bundle = (STATIC / "dashboard.js").read_text()
    assert "uPlot" in bundle or "uplot" in bundle
    assert not re.search(r"""(import\s*\(?|from)\s*["']https?://""", bundle)
    assert (STATIC / "dashboard.css").stat().st_size > 0
