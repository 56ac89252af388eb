"""The simulated cluster: nodes of GPUs, a workload's jobs, a policy asked every interval.

Each interval (60 s, as the Pollux study's simulator) every job trains on what it holds, then
the policy sees the jobs submitted and not finished and says which GPUs each holds next; a job
whose GPUs changed pays its change's cost (:class:`.jobs.Costs`). Policies that decide only how
many GPUs a job holds (this product's arbiter decides slot counts) have them placed by
:func:`pack`, a simulator's choice, not the product's.
"""
from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .applications import application
from .jobs import Costs, Job, SimJob

WORKLOADS = pathlib.Path(__file__).resolve().parent.parent / "data" / "pollux" / "workloads"


class Policy(Protocol):
    """Who holds which GPUs. `held`: job name -> the node of each GPU it holds now; returns the
    same for the next interval (a job left out holds none)."""

    name: str

    def decide(self, now: float, jobs: list[Job], cluster: Cluster,
               held: dict[str, list[int]]) -> dict[str, list[int]]: ...


@dataclass(frozen=True)
class Cluster:
    nodes: int = 16
    gpus_per_node: int = 4
    interval: float = 60.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def free(self, held: dict[str, list[int]]) -> dict[int, int]:
        """node -> GPUs nobody holds."""
        free = {n: self.gpus_per_node for n in range(self.nodes)}
        for nodes in held.values():
            for n in nodes:
                free[n] -= 1
        return free


def pack(count: int, nodes: list[int], free: dict[int, int]) -> list[int]:
    """`count` GPUs for a job that holds `nodes` now: a shrink gives back GPUs on the nodes it
    holds fewest on; a grow takes GPUs on the nodes with the most free first (``free`` is
    updated). Raises ValueError when the free GPUs do not cover a grow."""
    nodes = list(nodes)
    while len(nodes) > count:
        fewest = min(set(nodes), key=lambda n: (nodes.count(n), -n))
        nodes.remove(fewest)
        free[fewest] += 1
    while len(nodes) < count:
        node = max(free, key=lambda n: (free[n], -n))
        if free[node] == 0:
            raise ValueError(f"{count} GPUs asked, {len(nodes) + sum(free.values())} there")
        take = min(free[node], count - len(nodes))
        nodes += [node] * take
        free[node] -= take
    return nodes


def load_workload(number: int) -> list[SimJob]:
    """The jobs of ``workload-<number>.csv``, in submission order."""
    with open(WORKLOADS / f"workload-{number}.csv", newline="") as f:
        return [SimJob(r["name"], float(r["time"]), int(r["num_replicas"]),
                       app=application(r["application"]), batch=int(r["batch_size"]))
                for r in csv.DictReader(f)]


@dataclass(frozen=True)
class Outcome:
    """One policy on one workload: job completion times (s), the last completion (makespan,
    from the first submission) and the share of GPU time held by jobs."""

    jcts: dict[str, float]
    makespan: float
    utilisation: float
    restarts: int

    @property
    def mean_jct(self) -> float:
        return float(np.mean(list(self.jcts.values())))

    @property
    def p99_jct(self) -> float:
        return float(np.percentile(list(self.jcts.values()), 99))


def simulate(jobs: list[Job], policy: Policy, costs: Costs, cluster: Cluster = Cluster(),
             limit_s: float = 14 * 24 * 3600) -> Outcome:
    """Run `jobs` to completion under `policy`. Raises RuntimeError past `limit_s` simulated
    seconds (a policy that starves a job)."""
    held: dict[str, list[int]] = {}
    now, busy = 0.0, 0.0
    while not all(j.done for j in jobs):
        for job in jobs:
            job.advance(cluster.interval)
        busy += cluster.interval * sum(len(n) for n in held.values())
        now += cluster.interval
        if now > limit_s:
            raise RuntimeError(f"{policy.name}: jobs unfinished after {limit_s:.0f} s")
        active = [j for j in jobs if j.submitted <= now and not j.done]
        for job in jobs:
            if job.done and job.nodes:
                job.place([], costs)
        held = {j.name: j.nodes for j in active if j.nodes}
        decided = policy.decide(now, active, cluster, held)
        _check(decided, cluster)
        for job in active:
            if sorted(decided.get(job.name, [])) != sorted(job.nodes):
                job.place(decided.get(job.name, []), costs)
        held = {j.name: j.nodes for j in active if j.nodes}
    start = min(j.submitted for j in jobs)
    makespan = max(j.completed for j in jobs) - start  # type: ignore[type-var]
    return Outcome({j.name: j.completed - j.submitted for j in jobs},  # type: ignore[operator]
                   makespan, busy / (cluster.gpus * makespan), sum(j.restarts for j in jobs))


def _check(decided: dict[str, list[int]], cluster: Cluster) -> None:
    """No GPU held twice: the policy's decision fits the nodes."""
    free = cluster.free(decided)
    if any(v < 0 for v in free.values()):
        raise AssertionError(f"a GPU held twice: {free}")
