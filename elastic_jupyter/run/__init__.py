"""The owner loop's run machinery: the run handle (run.py) and the owners it delegates to.
May import pool/, server/, engine/ and the shared modules; ui/ only in run.dashboard() and plot().
"""

# what scripts imported from elastic_jupyter.run when it was one module; loads on first use
_MOVED = {"TrainingRun": "run", "RunSetupError": "run"}


def __getattr__(name):
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(f".{_MOVED[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
