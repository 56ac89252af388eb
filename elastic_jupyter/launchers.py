"""Kept for scripts written before the layout; import from elastic_jupyter."""
from .pool.launchers import LocalLauncher, SlurmLauncher, SSHLauncher

__all__ = ["LocalLauncher", "SSHLauncher", "SlurmLauncher"]
