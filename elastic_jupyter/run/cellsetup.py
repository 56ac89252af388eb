"""Setting a run up on engines: the cell (or setup function) on every engine, in the notebook's
working folder, with the same dataset everywhere.

Used when the run starts and whenever membership boots new engines. A failure of the cell is a
:class:`RunSetupError` with that engine's traceback; the pool stays usable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..events import EventKind
from ..pool.engine_calls import remote_message, remote_summary
from .memory_bound import MemoryBound
from .runlog import RunLog

if TYPE_CHECKING:
    from ..pool.engine_calls import EngineCalls
    from ..pool.processes import Engine


class RunSetupError(RuntimeError):
    """The run's setup failed on an engine; the message carries that engine's traceback."""


class CellSetup:
    """Runs the run's cell (or setup function) on engines and checks that they built the same
    dataset.

    Args:
        calls: EngineCalls. log: the RunLog (each engine logs to its file in the run's log
            folder). config: the run's config as plain data, with the pool's bounds.
        source / setup_bytes: the cell's code, or a cloudpickled setup function.
        push: notebook variables defined on the engines first.
        workdir: the notebook's working folder when the cell ran; engines run the cell there
            (on a host without that folder, in their own: a warning says so, once a host).
        preload: told the modules the first engines' setup imported (the launcher's
            :meth:`~..pool.launchers.Launcher.preload`: later engines start with them).

    Attributes:
        total_steps: the run's length in steps, fixed by the first engines' setup.
        dataset: their dataset's fingerprint ({"samples", "hash"}); an engine that builds
            another dataset later is refused (the run's steps never change mid-run).
        memory: the run's memory bound (run.memory_bound), set up by the first engines'
            counts; a pool whose --min is below it fails the setup with UsageError.
        frozen: the digests of their frozen weights ({key: digest}, engine.state.frozen); an engine
            that builds other ones is refused (they are never sent: each keeps its own).
    """

    def __init__(self, calls: EngineCalls, log: RunLog, config: dict, source: str | None,
                 setup_bytes: bytes | None, push: dict, workdir: str, memory: MemoryBound,
                 preload: Callable[[list[str]], None] = lambda modules: None):
        self.calls, self.log, self.config, self.preload = calls, log, config, preload
        self.memory = memory  # the run's bound, filled by the first engines' setup
        self.source, self.setup_bytes, self.push = source, setup_bytes, push
        self.workdir = workdir
        self._elsewhere: set[str] = set()  # hosts that run the cell outside `workdir`
        self.total_steps = 0
        self.dataset: dict | None = None
        self.frozen: dict[str, str] | None = None

    async def run_cell(self, engines: list[Engine]) -> None:
        """Run the cell on `engines`; the first engines fix the run's dataset and length.
        Raises RunSetupError (the cell failed on one, or it built another dataset)."""
        results = await self.calls.setup_run(engines, self.config, self.source, self.setup_bytes,
                                             self.push, lambda e: self.log.engine_log(e.slot),
                                             self.workdir)
        for engine, result in zip(engines, results):
            if isinstance(result, BaseException):
                detail = remote_message(result)
                self.log.log(f"setup failed on engine slot {engine.slot}:\n{detail}")
                raise RunSetupError(
                    f"the cell failed on engine slot {engine.slot}: {remote_summary(result)}\n"
                    f"--- engine traceback ---\n{detail}")
        for engine, result in zip(engines, results):
            # the notebook's folder is not on its host: said once per host
            if result["workdir"] != self.workdir and engine.host not in self._elsewhere:
                self._elsewhere.add(engine.host)
                self.log.event(EventKind.WARNING, message=(
                    f"host {engine.host} has no folder {self.workdir}: the cell runs in "
                    f"{result['workdir']} there (relative paths and the notebook's own modules"
                    " resolve there)"))
        self._check_datasets(engines, [r["dataset"] for r in results])
        self._check_frozen(engines, [r["frozen"]["tensors"] for r in results])
        if self.dataset is None:
            self.memory.set_up([r["memory"] for r in results if r["memory"]],
                               self.config.get("pool_min_size", 1),
                               self.config.get("pool_max_size", 1))
            self.dataset, self.total_steps = results[0]["dataset"], results[0]["total_steps"]
            self.frozen = results[0]["frozen"]["tensors"]
            self.preload(results[0]["imported"])
            if self.frozen:
                self._say_frozen([r["frozen"] for r in results])

    def _say_frozen(self, manifests: list[dict]) -> None:
        first = manifests[0]
        self.log.event(EventKind.FROZEN, message=(
            f"{len(first['tensors'])} frozen tensors ({first['bytes'] / 1e6:.1f} MB) stay on "
            "each engine, built by its cell and checked by a hash (hashing took at most "
            f"{max(m['seconds'] for m in manifests):.2f} s): grows send, and checkpoints write, "
            "the trained state only (--move-frozen moves them too)"))

    def _check_frozen(self, engines: list[Engine], found: list[dict[str, str]]) -> None:
        """Raise RunSetupError naming an engine that built other frozen weights than the run's
        (or, at the start, than the first engine's), and the first tensor that differs."""
        reference = found[0] if self.frozen is None else self.frozen
        whose = f"slot {engines[0].slot}'s" if self.frozen is None else "the run's"
        for engine, digests in zip(engines, found):
            odd = [k for k in {**reference, **digests} if reference.get(k) != digests.get(k)]
            if odd:
                message = (
                    f"engine slot {engine.slot} built other frozen weights than {whose} "
                    f"({len(odd)} tensor(s) differ, first {odd[0]!r}). Frozen weights stay on "
                    "each engine (they are never sent), so the cell must build the same ones "
                    "everywhere: load them from a file, or seed before building them; or run "
                    "with --move-frozen to send them from rank 0")
                self.log.log(message)
                raise RunSetupError(message)

    def _check_datasets(self, engines: list[Engine], found: list[dict]) -> None:
        """Raise RunSetupError naming the engines whose dataset differs from the run's (or,
        at the start, from the first engine's)."""
        reference = self.dataset or found[0]
        odd = [(e, d) for e, d in zip(engines, found) if d != reference]
        if not odd:
            return
        why = (f"the cell must build the same dataset on every engine: each runs it in "
               f"{self.workdir}; check the files it reads and seed any random split")
        if self.dataset is None:
            listed = "; ".join(f"slot {e.slot}: {describe_dataset(d)}"
                               for e, d in zip(engines, found))
            slots = ", ".join(str(e.slot) for e, _ in odd)
            differ = f"slots {slots} differ" if len(odd) > 1 else f"slot {slots} differs"
            message = (f"the engines built different datasets (engine {differ} from slot "
                       f"{engines[0].slot}): {listed}. {why[0].upper()}{why[1:]}")
        else:
            theirs = describe_dataset(reference)
            message = "; ".join(f"engine slot {e.slot} built another dataset than the run's "
                                f"({describe_dataset(d)}; the run's: {theirs})" for e, d in odd)
            message += f": refused, since a run's steps never change mid-run; {why}"
        self.log.log(message)
        raise RunSetupError(message)


def describe_dataset(dataset: dict) -> str:
    """A dataset's fingerprint in words: its samples and the hash of its items."""
    samples = dataset["samples"]
    return (f"{samples} samples" if samples is not None else "a stream of unknown length") + \
        f", items hash {dataset['hash']}"


def pickle_by_value(fn: Callable[[], dict]) -> bytes:
    """Pickle a setup function with its module's code, so engines need not import the module."""
    import sys
    import cloudpickle
    module = sys.modules.get(fn.__module__)
    by_value = module is not None and fn.__module__ not in ("__main__",)
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)
