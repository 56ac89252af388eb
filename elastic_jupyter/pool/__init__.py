"""The engine pool: its public API (pool), engine sets, slots, the arbiter's lease, engine
processes, launchers and every call into the engines. May import engine/, arbiter/ and the
shared modules (config, owner, host); never run/, server/ or ui/ (a run is a claimant.Claimant).
"""

# what scripts imported from elastic_jupyter.pool when it was one module; loads on first use
_MOVED = {"EnginePool": "pool", "Engine": "processes"}


def __getattr__(name):
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(f".{_MOVED[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
