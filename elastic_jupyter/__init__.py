"""elastic-jupyter: elastic distributed PyTorch training from Jupyter notebooks.

``%load_ext elastic_jupyter`` registers the magics; scripts use :class:`EnginePool` and
:class:`TrainingRun` directly. Importing the package is light (the Jupyter server imports it to
load its extension): the training stack loads on first use of a name below.
"""
from .config import PoolConfig, RunConfig, UsageError

__version__ = "0.1.0"
__all__ = ["EnginePool", "Engine", "TrainingRun", "RunConfig", "PoolConfig", "UsageError",
           "RunSetupError", "MeanOver", "LocalLauncher", "SSHLauncher", "SlurmLauncher",
           "load_ipython_extension"]
_LAZY = {"EnginePool": "pool.pool", "Engine": "pool.processes", "TrainingRun": "run.run",
         "RunSetupError": "run.run", "MeanOver": "engine.step.losses",
         "LocalLauncher": "pool.launchers", "SSHLauncher": "pool.launchers",
         "SlurmLauncher": "pool.launchers"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ipython):
    from .ui.magics import ElasticMagics
    ipython.register_magics(ElasticMagics(ipython))


def _jupyter_server_extension_points():
    return [{"module": "elastic_jupyter.server.serverext"}]


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "elastic-jupyter"}]
