"""The public surface held still: ``elastic_jupyter.__all__``, the public members and
constructors of TrainingRun, EnginePool and RunConfig, every magic's flags and the server
extension's REST routes equal a committed list (tests/public_api.json), so that moving code
cannot break an import, a call or a notebook silently. A deliberate change regenerates the list
(``.venv/bin/python tests/test_public_api.py > tests/public_api.json``) and says so in
CHANGELOG.md."""
import inspect
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "tests" / "public_api.json"
VERBS = ("get", "post", "put", "patch", "delete")


def surface() -> dict:
    import elastic_jupyter
    from elastic_jupyter import EnginePool, RunConfig, TrainingRun
    from elastic_jupyter.config import REMOVED, LauncherOptions, PoolOptions, RunStart, flagged
    from elastic_jupyter.server.serverext import routes
    from elastic_jupyter.ui import magics

    def members(cls) -> list[str]:
        return sorted(name for name, _ in inspect.getmembers(cls) if not name.startswith("_"))

    def flags(*declarations) -> list[str]:
        return sorted({spelled.name for cls, *names in declarations
                       for _, spelled in flagged(cls, *names)}
                      | {old.old for cls, *names in declarations
                         for _, spelled in flagged(cls, *names) for old in spelled.renamed})

    return {
        "__all__": sorted(elastic_jupyter.__all__),
        "importable": sorted(n for n in elastic_jupyter.__all__ if getattr(elastic_jupyter, n)),
        "TrainingRun": members(TrainingRun),
        "TrainingRun()": str(inspect.signature(TrainingRun.__init__)),
        "EnginePool": members(EnginePool),
        "EnginePool()": str(inspect.signature(EnginePool.__init__)),
        "RunConfig()": str(inspect.signature(RunConfig)),
        "magics": {
            "%elastic_pool": flags((magics._PoolLine,), (PoolOptions,), (LauncherOptions,)),
            "%%elastic_train": flags((RunConfig,), (RunStart,), (PoolOptions, "auto", "weight"),
                                     (magics._TrainLine,)) + sorted(r.name for r in REMOVED),
            "%elastic_resize": flags((magics._ResizeLine,)),
        },
        "routes": [f"{pattern} {handler.__name__} "
                   f"{','.join(v for v in VERBS if v in vars(handler))}"
                   for pattern, handler in routes("/")],
    }


def test_the_public_surface_is_the_committed_one():
    now = surface()
    held = json.loads(COMMITTED.read_text())
    for key in held.keys() | now.keys():
        assert now.get(key) == held.get(key), (
            f"{key} changed; if that is meant, regenerate tests/public_api.json (see this "
            "module's docstring) and add it to CHANGELOG.md")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    json.dump(surface(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
