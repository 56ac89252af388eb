"""Slurm as the arbiter of an auto pool of Slurm engine jobs.

On one machine our arbiter (:mod:`.table`) leases the slots between runs. On a Slurm cluster
the scheduler already arbitrates between everyone's jobs, and its queue says who waits for
resources, so an auto pool asks Slurm instead. :class:`SlurmArbiter` answers a pool's lease
(:class:`~elastic_jupyter.pool.lease.SlotLease`) as :class:`~.client.ArbiterClient` does, with
grants decided from the pool's partition:

- **grow**: while no other job waits in the partition for resources and every slot leased to
  the pool has its engine up, the pool is leased (up to its max) as many more slots as engines
  fit the partition's idle CPUs and GPUs, node by node; the pool submits a job for each, and
  each engine joins at a step boundary once it runs.
- **give back**: while other jobs wait for resources (Slurm's reason ``Resources`` or
  ``Priority``), the pool gives back, down to its min, as many slots as the CPUs and GPUs those
  jobs lack (at least one): slots whose job is still queued first, then the youngest; their
  ranks leave at the next step boundary and their jobs end. It then waits ``SETTLE_S`` for
  Slurm to start the waiting jobs before it gives back more.
- **auto off**: the pool keeps the size the user asks for (its jobs wait in the queue if they
  must).

Which waiting job runs first stays Slurm's decision (its priorities, its fair share between
users); the pool only makes room, and it uses only what ``squeue`` and ``sinfo`` tell any
user. (Horovod's elastic driver grows into the hosts a discovery script reports; here the
partition's idle resources are that report, and its queue says when to give back.)
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import subprocess
import threading
import time
from typing import cast

from .machine_view import Holder, MachineView, SlotView
from .table import ArbiterError, UnknownRun

QUERY_S = 2.0  # seconds between looks at the partition (squeue + sinfo ask slurmctld)
SETTLE_S = 10.0  # after a give-back: time for Slurm to start the waiting jobs
WAITING_REASONS = ("Resources", "Priority")  # pending for what running jobs hold
USABLE_NODE_STATES = ("idle", "mix")  # sinfo's compact state, without any flag


@dataclasses.dataclass
class Partition:
    """What a look at the partition found: engines that fit its idle resources now, and the
    CPUs and GPUs that other jobs wait for (``waiting``: their ids)."""

    fits: int = 0
    idle_cpus: int = 0
    idle_gpus: int = 0
    waiting: tuple = ()
    wanted_cpus: int = 0
    wanted_gpus: int = 0

    def lacking(self, cpus_per_engine: int, gpus_per_engine: int) -> int:
        """Engines to give back so that the waiting jobs' CPUs and GPUs are free (>= 1)."""
        cpus = max(0, self.wanted_cpus - self.idle_cpus)
        gpus = max(0, self.wanted_gpus - self.idle_gpus) if gpus_per_engine else 0
        return max(1, math.ceil(cpus / cpus_per_engine),
                   math.ceil(gpus / gpus_per_engine) if gpus_per_engine else 0)


def decide(held: int, up: int, kept: int, demand: dict, seen: Partition | None,
           settled: bool, cpus: int, gpus: int) -> int:
    """The pool's target number of training slots.

    Args:
        held: slots leased now; up: of those, slots whose engine runs; kept: held less those
            already being given back.
        demand: the pool's ``min``, ``max``, ``auto``, ``wanted``, ``active`` (whether a run
            trains on it).
        seen: the partition's latest look (None: Slurm did not answer: hold what is held).
        settled: whether the last give-back has had ``SETTLE_S`` to take effect.
        cpus, gpus: each engine's CPUs and GPUs.
    """
    low, high = demand["min"], demand["max"]
    if not demand["auto"]:
        return max(low, min(high, demand["wanted"]))
    if not demand.get("active", True):  # no run trains: an idle auto pool holds its min
        return low
    if seen is None:
        return max(low, kept)
    if seen.waiting:
        return max(low, kept - seen.lacking(cpus, gpus)) if settled else max(low, kept)
    if up < held:  # jobs of ours still start: their resources are not idle any more
        return max(low, kept)
    return max(low, min(high, kept + seen.fits))


class SlurmArbiter:
    """The answers of :class:`~.client.ArbiterClient` for one pool, decided from Slurm's
    queue (see the module's docstring). Thread-safe: the pool's lease calls it from worker
    threads.

    Args:
        partition: the pool's partition (None: Slurm's default one).
        cpus_per_engine, gpus_per_engine: what each engine's job asks for.
        own_jobs: returns the ids of the pool's own jobs (they do not count as others waiting).
    Raises:
        ArbiterError (from its calls): Slurm's commands fail.
    """

    def __init__(self, partition: str | None, cpus_per_engine: int, gpus_per_engine: int,
                 own_jobs):
        self.partition = partition
        self.cpus, self.gpus = max(1, cpus_per_engine), gpus_per_engine
        self.own_jobs = own_jobs
        self.run: str | None = None
        self.demand: dict = {}
        self.held: list[int] = []  # leased slots, oldest lease first
        self.give_back: set[int] = set()
        self.engines: dict[str, int] = {}  # slot -> engine pid, as the pool last said
        self.events: list[dict] = []
        self.seen: Partition | None = None
        self._looked = -math.inf  # monotonic time of the last look at the partition
        self._gave = -math.inf  # monotonic time of the last give-back
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- ArbiterClient's calls

    def register(self, run: str, **demand) -> dict:
        with self._lock:
            self.run = run
            self.demand.update({k: demand[k] for k in ("min", "max", "auto", "wanted", "name",
                                                       "active") if k in demand})
            self.engines = dict(demand.get("engines") or self.engines)
            return self._grant()

    def poll(self, run: str, active: bool = True, engines: dict | None = None,
             speed: list | None = None) -> dict:
        """As the machine's arbiter's; `speed` is not used: Slurm's queue decides."""
        with self._lock:
            self._known(run)
            self.demand["active"] = active
            self.engines = {str(k): v for k, v in (engines or {}).items()}
            return self._grant()

    def release(self, run: str, slots: list[int]) -> dict:
        with self._lock:
            self._known(run)
            self.held = [s for s in self.held if s not in slots]
            if self.give_back & set(slots):  # the waiting jobs may start from now
                self._gave = time.monotonic()
            self.give_back -= set(slots)
            return self._grant()

    def unregister(self, run: str) -> None:
        with self._lock:
            self.run, self.held, self.give_back = None, [], set()

    def view(self) -> MachineView:
        """The pool's slots and, as ``scheduler``, what the partition's last look found."""
        with self._lock:
            seen = dataclasses.asdict(self.seen) if self.seen else None
            holder = {"run": self.run, "name": self.demand.get("name"), "standby": False}
            slots: list[SlotView] = [
                {"slot": s, "outside": None,
                 "holder": cast(Holder, dict(holder, engine_pid=self.engines.get(str(s))))}
                for s in sorted(self.held)]
            return {"slots": slots, "runs": [], "time": time.time(),
                    "scheduler": {"kind": "slurm", "partition": self.partition, "seen": seen}}

    # ---------------------------------------------------------------- decisions

    def _known(self, run: str) -> None:
        if run != self.run:
            raise UnknownRun(f"run {run} is not registered")

    def _grant(self) -> dict:
        now = time.monotonic()
        if now - self._looked >= QUERY_S:
            self.seen = self._look()
            self._looked = now
        kept = len(self.held) - len(self.give_back)
        up = sum(1 for s in self.held if str(s) in self.engines)
        settled = not self.give_back and now - self._gave >= SETTLE_S  # the last one's done
        target = decide(len(self.held), up, kept, self.demand, self.seen, settled, self.cpus,
                        self.gpus)
        if target > kept:
            self._lease(target - kept)
        elif target < kept:
            self._take_back(kept - target)
            self._gave = now
        training = sorted(self.held)
        return {"run": self.run, "target": target, "slots": training, "standby": [],
                "give_back": sorted(self.give_back), "revoke": [], "queued": None,
                "fair": target, "grantable": self.demand.get("max", 0),
                "events": self._take_events()}

    def _lease(self, k: int) -> None:
        """Lease `k` more slots: slots being given back are kept first, then new ones."""
        for slot in sorted(self.give_back, reverse=True)[:k]:
            self.give_back.discard(slot)
            k -= 1
        free = (s for s in itertools.count() if s not in self.held)
        for _ in range(k):
            slot = next(free)
            self.held.append(slot)
            self.events.append({"kind": "grew", "slot": slot, "why": self._why_grew()})

    def _take_back(self, k: int) -> None:
        """Mark `k` slots to give back: queued jobs' first, then the newest leases."""
        keep = [s for s in self.held if s not in self.give_back]
        order = ([s for s in reversed(keep) if str(s) not in self.engines]
                 + [s for s in reversed(keep) if str(s) in self.engines])
        for slot in order[:k]:
            self.give_back.add(slot)
            self.events.append({"kind": "gave", "slot": slot, "why": self._why_gave()})

    def _why_grew(self) -> str:
        if not self.demand["auto"]:
            return "the size asked for"
        return f"idle in Slurm partition {self.partition or '(default)'}"

    def _why_gave(self) -> str:
        if not self.demand["auto"]:
            return "the size asked for"
        if not self.demand.get("active", True):
            return "no run trains: the pool keeps its min"
        jobs = ", ".join(self.seen.waiting[:3]) if self.seen else ""
        return f"Slurm job(s) {jobs} wait for resources" if jobs else "Slurm wants it back"

    def _take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def _look(self) -> Partition | None:
        """The partition now (None when Slurm does not answer: nothing changes then)."""
        try:
            if self.partition is None:  # the others waiting are those of the pool's partition
                self.partition = _default_partition()
            nodes = _run(["sinfo", "-h", "-N", *self._where(),
                          "-O", "NodeHost:|,CPUsState:|,Gres:|,GresUsed:|,StateCompact:"])
            queue = _run(["squeue", "-h", "-t", "PENDING", *self._where(),
                          "-O", "JobID:|,NumCPUs:|,NumNodes:|,NumTasks:|,tres-per-node:|,"
                          "tres-per-task:|,tres-per-job:|,Reason:"])
        except ArbiterError:
            return None
        seen = _idle(nodes, self.cpus, self.gpus)
        mine = set(self.own_jobs())
        waiting, cpus, gpus = [], 0, 0
        for line in queue.splitlines():
            f = line.split("|")
            if len(f) < 8 or f[0] in mine or f[7] not in WAITING_REASONS:
                continue
            waiting.append(f[0])
            cpus += _int(f[1])
            gpus += _job_gpus(nodes=f[2], tasks=f[3], per_node=f[4], per_task=f[5],
                              per_job=f[6])
        return dataclasses.replace(seen, waiting=tuple(waiting), wanted_cpus=cpus,
                                   wanted_gpus=gpus)

    def _where(self) -> list[str]:
        return ["-p", self.partition] if self.partition else []


def _default_partition() -> str | None:
    """The partition Slurm gives a job that names none (``sinfo`` marks it with ``*``)."""
    for name in _run(["sinfo", "-h", "-o", "%P"]).split():
        if name.endswith("*"):
            return name[:-1]
    return None


def _run(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ArbiterError(f"{command[0]}: {e}") from None
    if out.returncode:
        raise ArbiterError(f"{' '.join(command[:2])}: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _idle(sinfo: str, cpus_per_engine: int, gpus_per_engine: int) -> Partition:
    """Idle CPUs and GPUs of the usable nodes, and how many engines fit them node by node."""
    fits = idle_cpus = idle_gpus = 0
    for line in sinfo.splitlines():
        f = line.split("|")
        if len(f) < 5 or f[4].strip() not in USABLE_NODE_STATES:  # a flag: not responding,
            continue  # powered off, rebooting, planned for a waiting job...
        cpu_state = [_int(x) for x in f[1].split("/")]  # allocated/idle/other/total
        cpus = cpu_state[1] if len(cpu_state) == 4 else 0
        gpus = max(0, _gres_gpus(f[2]) - _gres_gpus(f[3]))
        idle_cpus, idle_gpus = idle_cpus + cpus, idle_gpus + gpus
        n = cpus // cpus_per_engine
        fits += min(n, gpus // gpus_per_engine) if gpus_per_engine else n
    return Partition(fits=fits, idle_cpus=idle_cpus, idle_gpus=idle_gpus)


def _gres_gpus(gres: str) -> int:
    """GPUs in a gres or tres string: ``gpu:4``, ``gpu:h100:4(S:0-1)``,
    ``gpu:a100:2(IDX:0,2),gpu:v100:1``, ``gpu:(null):2``, ``gres/gpu:1``, ``gres/gpu`` (1)."""
    gres = re.sub(r"\((?:S|IDX):[^)]*\)", "", gres)  # sockets, indexes: may hold commas
    total = 0
    for item in gres.split(","):
        parts = item.strip().removeprefix("gres/").split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def _job_gpus(nodes: str, tasks: str, per_node: str, per_task: str, per_job: str) -> int:
    """GPUs a pending job asks for, from its tres-per-job/-node/-task fields."""
    for tres, times in ((per_job, 1), (per_node, _int(nodes)), (per_task, _int(tasks))):
        if n := _gres_gpus(tres):
            return n * max(1, times)
    return 0


def _int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        return 0
