"""The baseline the Pollux study compares with: Tiresias (Gu et al., NSDI 2019), as its
simulator models it, so that its published figures can be reproduced before anything else is
judged. Each job holds exactly the GPUs it asked for, or none.

Two queues: a job starts in the first and moves to the second once it has run for 16
GPU-hours (its running time times its GPUs); within a queue, first come first served. Every
interval, jobs in queue order run while their GPUs fit what is left (a job that does not fit
waits, those behind it may run); a job that no longer runs is preempted. A job that starts is
packed onto the nodes with the most free GPUs. Running time counts from one decision to the
next, restarts included. (That simulator's starvation rule is off in its runs, so it is not
modelled.)
"""
from __future__ import annotations

from .cluster import Cluster, pack
from .jobs import Job

DEMOTE_GPU_S = 16 * 3600.0


class Tiresias:
    name = "tiresias"

    def __init__(self) -> None:
        self.queues: tuple[list[str], list[str]] = ([], [])
        self.running: set[str] = set()
        self.ran_s: dict[str, float] = {}  # seconds run, by decision intervals
        self._looked: dict[str, float] = {}

    def decide(self, now: float, jobs: list[Job], cluster: Cluster,
               held: dict[str, list[int]]) -> dict[str, list[int]]:
        by_name = {j.name: j for j in jobs}
        self._forget_finished(by_name)
        for job in jobs:
            if job.name not in self.ran_s:
                self.ran_s[job.name] = 0.0
                self.queues[0].append(job.name)
            elif job.name in self.running:
                self.ran_s[job.name] += now - self._looked[job.name]
                if (job.name in self.queues[0]
                        and self.ran_s[job.name] * job.gpus >= DEMOTE_GPU_S):
                    self.queues[0].remove(job.name)
                    self.queues[1].append(job.name)
            self._looked[job.name] = now
        left, self.running = cluster.gpus, set()
        for name in self.queues[0] + self.queues[1]:
            if by_name[name].gpus <= left:
                self.running.add(name)
                left -= by_name[name].gpus
        decided = {n: nodes for n, nodes in held.items() if n in self.running}
        free = cluster.free(decided)
        for name in self.queues[0] + self.queues[1]:
            if name in self.running and name not in decided:
                decided[name] = pack(by_name[name].gpus, [], free)
        return decided

    def _forget_finished(self, active: dict[str, Job]) -> None:
        for queue in self.queues:
            queue[:] = [n for n in queue if n in active]
        self.running &= set(active)
