"""What auto mode would have done on a Slurm cluster's history: jobs from an accounting export.

The export is ``sacct --parsable2`` output with a header line (``|``-separated), from the
accounting database or, where a cluster keeps only job completion records
(``JobCompType=jobcomp/filetxt``), from ``sacct --completion``::

    sacct --allusers --parsable2 --starttime 2026-11-01 --endtime 2026-12-01 \\
          --format=JobID,Eligible,Submit,Start,End,AllocTRES,AllocCPUS,State > history.txt

Fields read: ``JobID`` (job steps, ``123.batch``, are skipped), when the job could start
(``Eligible``, else ``Submit``: from completion records sacct reports the start as the submit
time, and the eligible time right), ``Start`` and ``End`` (ISO times; a job that never
started is skipped), and the slots it held: with
``slots="gpu"`` the ``gres/gpu=N`` of ``AllocTRES`` (a job without GPUs is skipped), with
``slots="cpu"`` ``AllocCPUS`` (or ``NCPUS``).

sacct holds no scaling data, so how a job's speed depends on its slots is assumed: Amdahl's
law, speedup(n) = 1 / ((1 - p) + p / n) with parallel fraction ``p`` (default 0.9, settable).
A job's work is its recorded run time at the slots it held, in progress of one slot
(elapsed × speedup(held)); an auto run takes between 1 slot and ``max_factor`` times what it
held (default 2), at most the cluster.
"""
from __future__ import annotations

import csv
import datetime
from dataclasses import dataclass, field

import numpy as np

from .jobs import Job


def speedup(n: int, parallel: float) -> float:
    """Amdahl's law: how much faster n slots train than one, with `parallel` of the work
    spread over them."""
    return 1.0 / ((1.0 - parallel) + parallel / n)


@dataclass
class SacctJob(Job):
    """A job of a Slurm history: `work` (progress of one slot, s) at the assumed speedup."""

    work: float = 0.0
    parallel: float = 0.9
    max_factor: float = 2.0
    recorded: dict[str, float] = field(default_factory=dict)  # start, end as sacct says

    def most(self, gpus: int) -> int:
        return max(1, min(gpus, int(self.gpus * self.max_factor)))

    def _goal(self) -> float:
        return self.work

    def _reached(self) -> bool:
        return True

    def _goodput(self, placement: tuple[int, ...]) -> float:
        n = sum(placement)
        self.measured[n] = speedup(n, self.parallel)  # steps per second, one step a slot-second
        return self.measured[n]


def _time(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:  # "Unknown", "None", empty
        return None


def _slots(row: dict[str, str], slots: str) -> int:
    if slots == "cpu":
        return int(row.get("AllocCPUS") or row.get("NCPUS") or 0)
    for tres in (row.get("AllocTRES") or "").split(","):
        key, _, value = tres.partition("=")
        if key == "gres/gpu":
            return int(value)
    return 0


def load_sacct(path: str, slots: str = "gpu", parallel: float = 0.9,
               max_factor: float = 2.0) -> list[SacctJob]:
    """The jobs of a ``sacct --parsable2`` export, in order of arrival (when each could start),
    times from the first arrival (s). Raises ValueError naming a missing field or an empty
    history."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="|"))
    fields = set(rows[0] if rows else ())
    arrival = "Eligible" if "Eligible" in fields else "Submit"
    need = {"JobID", arrival, "Start", "End"} | ({"AllocTRES"} if slots == "gpu" else set())
    if missing := need - fields:
        raise ValueError(f"{path}: the export lacks field(s) {', '.join(sorted(missing))}: "
                         "export with --parsable2 --format=JobID,Eligible,Submit,Start,End,"
                         "AllocTRES,AllocCPUS,State")
    jobs = []
    for row in rows:
        submit, start, end = (_time(row[k]) for k in (arrival, "Start", "End"))
        n = _slots(row, slots)
        if "." in row["JobID"] or None in (submit, start, end) or n <= 0 or end <= start:
            continue
        jobs.append(SacctJob(row["JobID"], submit, n, work=(end - start) * speedup(n, parallel),
                             parallel=parallel, max_factor=max_factor,
                             recorded={"start": start, "end": end}))
    if not jobs:
        raise ValueError(f"{path}: no job that ran on {slots} slots")
    first = min(j.submitted for j in jobs)
    for job in jobs:
        job.submitted -= first
        job.recorded = {k: v - first for k, v in job.recorded.items()}
    return sorted(jobs, key=lambda j: j.submitted)


@dataclass(frozen=True)
class Recorded:
    """What Slurm did: mean and p99 completion (submission to end), mean wait (to start), the
    makespan and the share of `slots` slot-time held by jobs."""

    mean_jct: float
    p99_jct: float
    mean_wait: float
    makespan: float
    utilisation: float


def recorded(jobs: list[SacctJob], slots: int) -> Recorded:
    jct = [j.recorded["end"] - j.submitted for j in jobs]
    makespan = max(j.recorded["end"] for j in jobs) - min(j.submitted for j in jobs)
    held = sum((j.recorded["end"] - j.recorded["start"]) * j.gpus for j in jobs)
    return Recorded(float(np.mean(jct)), float(np.percentile(jct, 99)),
                    float(np.mean([j.recorded["start"] - j.submitted for j in jobs])),
                    makespan, held / (slots * makespan))


def busiest(jobs: list[SacctJob]) -> int:
    """The most slots the history's jobs held at once (the cluster's size when not given)."""
    edges = sorted([(j.recorded["start"], j.gpus) for j in jobs]
                   + [(j.recorded["end"], -j.gpus) for j in jobs])
    most = now = 0
    for _, change in edges:
        now += change
        most = max(most, now)
    return most
