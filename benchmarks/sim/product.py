"""This product's policies on the simulated cluster: the arbiter's own decision function
(elastic_jupyter.arbiter.fairshare.allocate) asked every interval, as the arbiter process asks
it whenever something changes. Nothing here decides: it turns jobs into the arbiter's
``Demand`` and its targets into GPUs (:func:`.cluster.pack`).

The product has one arbiter per machine (or Slurm's queue); a cluster-wide arbiter over 16
nodes is the product's policy on a pool it does not have today. Each job is its own user (the
workloads name none) with weight 1; the hold time (30 s) is below the interval, so no slot is
pinned at a decision.
"""
from __future__ import annotations

from elastic_jupyter.arbiter.fairshare import Demand, allocate
from elastic_jupyter.arbiter.speed import Speed

from .cluster import Cluster, pack
from .jobs import Job


def auto_max(job: Job, cluster: Cluster) -> int:
    """An auto job's most GPUs (its ``most``: for the study's jobs, the batch over the
    application's smallest local batch), at most the cluster."""
    return job.most(cluster.gpus)


class _ArbiterPolicy:
    name = ""

    def __init__(self) -> None:
        self.arrival: dict[str, int] = {}

    def demand(self, job: Job, held: int, cluster: Cluster) -> Demand:
        raise NotImplementedError

    def decide(self, now: float, jobs: list[Job], cluster: Cluster,
               held: dict[str, list[int]]) -> dict[str, list[int]]:
        for job in jobs:
            self.arrival.setdefault(job.name, len(self.arrival))
        demands = [self.demand(j, len(held.get(j.name, [])), cluster) for j in jobs]
        targets = allocate(demands, cluster.gpus).targets
        free = cluster.free({})
        decided: dict[str, list[int]] = {}
        # shrinks first, so that grows find the GPUs they free
        order = sorted(jobs, key=lambda j: targets.get(j.name, 0) - len(held.get(j.name, [])))
        for job in order:
            mine = held.get(job.name, [])
            for n in mine:
                free[n] -= 1
        for job in order:
            mine = held.get(job.name, [])
            if targets.get(job.name, 0) > 0:
                decided[job.name] = pack(targets[job.name], mine, free)
            else:
                for n in mine:
                    free[n] += 1
        return decided


class FixedAllocations(_ArbiterPolicy):
    """Today's manual pools: each job asks for the GPUs of its workload row and holds exactly
    those; the arbiter admits jobs first come, first served, and never takes from them."""

    name = "fixed"

    def demand(self, job: Job, held: int, cluster: Cluster) -> Demand:
        return Demand(job.name, job.name, self.arrival[job.name], min=job.gpus, max=job.gpus,
                      auto=False, wanted=job.gpus, held=held)


class FairShare(_ArbiterPolicy):
    """Today's auto mode: each job between 1 GPU and :func:`auto_max`, by weighted max-min fair
    share of the GPUs among the admitted jobs."""

    name = "fair share"

    def demand(self, job: Job, held: int, cluster: Cluster) -> Demand:
        return Demand(job.name, job.name, self.arrival[job.name], min=1,
                      max=auto_max(job, cluster), auto=True, held=held)


class ValueShare(_ArbiterPolicy):
    """Fair share with each job's measured speed (elastic_jupyter.arbiter.value): the speed it
    last trained at for each GPU count it has held; other counts from the fitted model."""

    name = "by value"

    def demand(self, job: Job, held: int, cluster: Cluster) -> Demand:
        speed = Speed(tuple(sorted(job.measured.items()))) if job.measured else None
        return Demand(job.name, job.name, self.arrival[job.name], min=1,
                      max=auto_max(job, cluster), auto=True, held=held, speed=speed)
