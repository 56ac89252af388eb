"""Kept for scripts written before the layout: the launchers live in
elastic_jupyter.pool.launchers; import them from elastic_jupyter."""
from .pool.launchers import (SLURM_TEMPLATE, Job, Launcher, LocalLauncher, SlurmLauncher,
                             SSHLauncher, StartWithdrawn, make_launcher)

__all__ = ["Launcher", "LocalLauncher", "SSHLauncher", "SlurmLauncher", "make_launcher", "Job",
           "StartWithdrawn", "SLURM_TEMPLATE"]
