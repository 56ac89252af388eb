"""Engine-side code: what runs inside each engine (the Worker, a generation's loop, the commit
vote, checkpoints); engine.protocol is its contract with the kernel. It imports nothing of
this package outside engine/ but config and events: only torch, numpy and the standard library.

Its wings, each ``__init__`` docstring that wing's part of the map, stand in layers (an import
contract in pyproject.toml): entrypoints, generation and worker on ``modes`` (who holds the
state), on ``sharded`` (--shard's machinery), on ``step`` (one optimizer step's parts), on
``data`` (samples per rank), on ``state`` (the state as data, its files), on ``group`` (what the
ranks do together), on the protocol.

``MeanOver`` (engine.step.losses) is what a cell's ``loss_fn`` returns for a loss that is a mean
over items other than samples; it loads on first use, so importing this package stays light.
"""


def __getattr__(name):
    if name == "MeanOver":
        from .step.losses import MeanOver
        return MeanOver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
