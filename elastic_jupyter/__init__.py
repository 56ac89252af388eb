"""elastic-jupyter: elastic distributed PyTorch training from Jupyter notebooks.

``%load_ext elastic_jupyter`` registers the magics; scripts use :class:`EnginePool` and
:class:`TrainingRun` directly.
"""
from .config import PoolConfig, RunConfig, UsageError
from .pool import Engine, EnginePool
from .run import RunSetupError, TrainingRun

__version__ = "0.1.0"
__all__ = ["EnginePool", "Engine", "TrainingRun", "RunConfig", "PoolConfig", "UsageError",
           "RunSetupError", "load_ipython_extension"]


def load_ipython_extension(ipython):
    from .magics import ElasticMagics
    ipython.register_magics(ElasticMagics(ipython))
