"""Slot providers: what slots the machine has and which of them are busy outside the arbiter.

A slot is a GPU (its NVML index, which is the CUDA index when ``CUDA_DEVICE_ORDER`` is
``PCI_BUS_ID``, as engines set it) or, on a machine without GPUs, one CPU slot. The arbiter
asks its provider every half second which slots processes it did not place are using, and
takes them out of the fair share until they are free again.
"""
from __future__ import annotations

import abc
import json
import logging

from .settings import Settings

log = logging.getLogger(__name__)


class SlotProvider(abc.ABC):
    """The machine's slots, as one kind (``"gpu"`` or ``"cpu"``)."""

    kind: str

    @abc.abstractmethod
    def slots(self) -> list[int]:
        """The slot ids; fixed for the provider's life."""

    @abc.abstractmethod
    def outside(self, placed: dict[int, set[int]]) -> dict[int, str]:
        """Slots busy with processes the arbiter did not place: slot -> who (a description).

        Args:
            placed: slot -> the pids that may use it (every process its holder started).
        """

    def usage(self) -> dict[int, dict]:
        """slot -> {"util": percent, "memory_mib": used} where the provider knows them."""
        return {}


class CpuSlots(SlotProvider):
    """`count` CPU slots. Which are busy outside is read from `outside_file` (a JSON object
    ``{"<slot>": "<who>"}``) when the admin keeps one: no CPU process can be told apart from
    a foreign one by its use of a core."""

    kind = "cpu"

    def __init__(self, count: int, outside_file: str | None = None):
        self._slots = list(range(count))
        self._file = outside_file

    def slots(self) -> list[int]:
        return list(self._slots)

    def outside(self, placed: dict[int, set[int]]) -> dict[int, str]:
        if not self._file:
            return {}
        try:
            with open(self._file) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("arbiter: cannot read %s: %s", self._file, e)
            return {}
        return {int(k): str(v) for k, v in data.items() if str(k).isdigit()
                and int(k) in self._slots}


class NvmlSlots(SlotProvider):
    """The machine's GPUs through NVML (``nvidia-ml-py``).

    A GPU is busy outside when NVML lists a compute process on it other than the engine placed
    there (and its children), or, with no engine of ours on it, when more than `memory_mib` of
    its memory is in use (a process in another container shows no pid we can see). NVML
    reports host pids: an arbiter in a container of its own sees its runs' engines as
    foreign, so it must share the pid namespace of the kernels it serves.
    """

    kind = "gpu"

    def __init__(self, memory_mib: int = 1024):
        import pynvml  # nvidia-ml-py
        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                         for i in range(pynvml.nvmlDeviceGetCount())]
        self._memory = memory_mib

    def slots(self) -> list[int]:
        return list(range(len(self._handles)))

    def outside(self, placed: dict[int, set[int]]) -> dict[int, str]:
        nvml, busy = self._nvml, {}
        for slot, handle in enumerate(self._handles):
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                used = nvml.nvmlDeviceGetMemoryInfo(handle).used >> 20
            except nvml.NVMLError as e:
                busy[slot] = f"unreadable ({e})"
                continue
            ours = placed.get(slot, set())
            foreign = [p.pid for p in procs if p.pid not in ours]
            if foreign:
                busy[slot] = "pid " + ", ".join(f"{pid} ({_owner(pid)})" for pid in foreign)
            elif not any(p.pid in ours for p in procs) and used > self._memory:
                busy[slot] = f"{used} MiB in use by processes not visible here"
        return busy

    def usage(self) -> dict[int, dict]:
        nvml, usage = self._nvml, {}
        for slot, handle in enumerate(self._handles):
            try:
                usage[slot] = {"util": nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                               "memory_mib": nvml.nvmlDeviceGetMemoryInfo(handle).used >> 20}
            except nvml.NVMLError:
                pass
        return usage


def _owner(pid: int) -> str:
    try:
        import psutil  # here: the GPU check imports this module where psutil may be missing
    except ImportError:
        return "unknown user"
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):
        return "unknown user"


def provider(settings: Settings) -> SlotProvider:
    """The provider the settings ask for: NVML's GPUs (``"gpu"``; with ``"auto"``, when NVML
    finds at least one), else CPU slots. Raises RuntimeError when ``"gpu"`` is asked for and
    NVML is unusable."""
    if settings.slots in ("gpu", "auto"):
        try:
            gpus = NvmlSlots(settings.outside_memory_mib)
            if gpus.slots():
                return gpus
            reason = "NVML finds no GPU"
        except Exception as e:  # no driver, no library: pynvml raises its own errors
            reason = f"NVML is unusable: {type(e).__name__}: {e}"
        if settings.slots == "gpu":
            raise RuntimeError(f"the settings ask for GPU slots but {reason}")
    return CpuSlots(settings.cpu_slots, settings.outside_file)
