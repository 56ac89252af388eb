"""Slurm's launcher: one batch job per engine.

Engines start through ipyparallel's ``SlurmEngineSetLauncher`` with our batch template. A grow
submits jobs and the run grows when Slurm starts them; a rank that left exits (its job ends
with it). Slurm's SIGTERM ahead of a kill (``scancel --signal=TERM``, preemption with a grace
time, the time limit through ``--signal=TERM@grace``) drains the engine at the next step
boundary (engine.group.drain).
"""
from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from typing import Any, Callable

from ...arbiter.slurm import SlurmArbiter
from ...config import UsageError
from ...config.environment import OWNER_ADDRESS
from .base import Job, Launcher, listen_address


SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{{cluster_id}}
#SBATCH --ntasks=1
#SBATCH --output={{output_file}}
{options}
# Slurm's SIGTERM (preemption, the time limit) reaches the engine, which drains at its next
# step boundary; the batch shell must outlive it, or the job would end with the shell.
trap : TERM
srun --cpus-per-task={cpus} {{program_and_args}}
"""


class SlurmLauncher(Launcher):
    """Engines are Slurm batch jobs, one per slot.

    Args:
        partition, account, time: ``sbatch --partition --account --time`` (unset: Slurm's
            defaults). `time` in Slurm's formats, such as ``30`` (minutes) or ``1-00:00:00``.
        gpus_per_engine: GPUs each engine's job asks for (``--gpus-per-task``); 0 for CPU
            engines (gloo), else the pool uses nccl.
        cpus_per_engine: ``--cpus-per-task`` (also the engine's torch threads).
        grace: seconds before the time limit when Slurm sends SIGTERM (``--signal``): the
            engine drains and a replacement job is queued.
        interface: the network interface the controller and the rendezvous listen on (the
            engines' hosts must reach it). Default: the one on the route to slurmctld.
        options: more ``#SBATCH`` options, one per item, such as ``--qos=debug``.
    Raises:
        UsageError: no Slurm commands on PATH, an unknown interface, one without an IPv4
            address, or ``0.0.0.0`` (every interface).
    """

    kind, local = "slurm", False
    cpus_per_engine: int  # always set: Slurm's --cpus-per-task

    def __init__(self, partition: str | None = None, account: str | None = None,
                 time: str | None = None, gpus_per_engine: int = 0, cpus_per_engine: int = 1,
                 grace: int = 60, interface: str | None = None, options: tuple = ()):
        for command in ("sbatch", "squeue", "scancel", "scontrol"):
            if shutil.which(command) is None:
                raise UsageError(f"--launcher slurm needs Slurm's {command} on PATH: run on a "
                                 "Slurm login node, or load Slurm's module first")
        for label, value in (("--gpus-per-engine", gpus_per_engine),
                             ("--cpus-per-engine", cpus_per_engine), ("--grace", grace)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"{label} must be an integer >= 0, got {value!r}")
        self.partition, self.account, self.time = partition, account, time
        self.gpus_per_engine, self.cpus_per_engine = gpus_per_engine, max(1, cpus_per_engine)
        self.grace, self.options = grace, tuple(options)
        self.address = listen_address(interface, _slurmctld_host)

    def batch_options(self) -> list[str]:
        """The ``#SBATCH`` lines of an engine's job."""
        opts = [f"--cpus-per-task={self.cpus_per_engine}", f"--signal=TERM@{self.grace}"]
        for flag, value in (("--partition", self.partition), ("--account", self.account),
                            ("--time", self.time)):
            if value:
                opts.append(f"{flag}={value}")
        if self.gpus_per_engine:
            opts.append(f"--gpus-per-task={self.gpus_per_engine}")
        return [f"#SBATCH {o}" for o in opts + list(self.options)]

    def cluster_options(self, folder: str) -> dict[str, Any]:
        from traitlets.config import Config
        # braces are the template's fields: any in an option are literal
        options = "\n".join(self.batch_options()).replace("{", "{{").replace("}", "}}")
        config = Config()
        config.SlurmEngineSetLauncher.batch_template = SLURM_TEMPLATE.format(
            options=options, cpus=self.cpus_per_engine)  # some Slurms' srun does not inherit it
        # ipyparallel writes the script into the kernel's folder (the notebook's) by default
        config.SlurmEngineSetLauncher.batch_file_name = f"{folder}/slurm_engine.sbatch"
        return {"engine_launcher_class": "slurm", "controller_ip": self.address,
                "config": config}

    def engine_env(self) -> dict[str, str]:
        env = {OWNER_ADDRESS.name: self.address}
        if not self.gpus_per_engine:  # Slurm sets it for a job with GPUs
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    async def jobs(self, engine_sets: dict[str, Any]) -> dict[str, Job] | None:
        known = await _squeue([s.job_id for s in engine_sets.values() if s.job_id])
        if known is None:
            return None
        return {set_id: Job(s.job_id, *known.get(s.job_id, ("", "")), output=s.output_file)
                for set_id, s in engine_sets.items() if s.job_id}

    def arbiter(self, own_jobs: Callable[[], list[str]]) -> SlurmArbiter:
        """Slurm decides: the pool grows while the partition is idle and gives back when
        other jobs wait (:mod:`.arbiter.slurm`). Raises UsageError where Slurm hides other
        users' jobs (``PrivateData=jobs``): nobody would be seen waiting."""
        if re.search(r"^PrivateData\s*=.*\bjobs\b", _scontrol_config(), re.M):
            raise UsageError("this Slurm hides other users' jobs (PrivateData=jobs), so an auto "
                             "pool could not see who waits for its resources: give the pool's "
                             "size (-n) and resize it by hand")
        return SlurmArbiter(self.partition, self.cpus_per_engine, self.gpus_per_engine,
                            own_jobs)

    def describe(self) -> str:
        where = f"partition {self.partition}" if self.partition else "the default partition"
        return f"Slurm jobs in {where}"


def _scontrol_config() -> str:
    """``scontrol show config``. Raises UsageError when Slurm does not answer."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                         timeout=30)
    if out.returncode:
        raise UsageError(f"Slurm does not answer (scontrol show config: "
                         f"{out.stderr.strip() or out.returncode})")
    return out.stdout


def _slurmctld_host() -> str:
    """The address (or name) of the first slurmctld in Slurm's configuration."""
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", _scontrol_config(),
                  re.M)
    if not m:
        raise UsageError("Slurm's configuration names no SlurmctldHost: give --interface")
    return m.group(2) or m.group(1)


async def _squeue(job_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """job id -> (state, reason) for those Slurm still knows; None when squeue failed (a busy
    slurmctld: no answer is not an answer that the jobs are gone)."""
    if not job_ids:
        return {}
    proc = await asyncio.create_subprocess_exec(
        "squeue", "-h", "-t", "all", "-o", "%i|%T|%r", "-j", ",".join(job_ids),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    if proc.returncode:
        return None
    jobs = {}
    for line in out.decode().splitlines():
        job_id, state, reason = (line.split("|") + ["", ""])[:3]
        jobs[job_id.strip()] = (state.strip(), reason.strip())
    return jobs
