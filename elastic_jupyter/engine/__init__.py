"""Engine-side code: what runs inside each engine (the Worker, a generation's loop, the commit
vote, checkpoints); engine.protocol is its contract with the kernel. It imports nothing of
this package outside engine/: only torch, numpy and the standard library.

``MeanOver`` (engine.losses) is what a cell's ``loss_fn`` returns for a loss that is a mean over
items other than samples; it loads on first use, so importing this package stays light.
"""


def __getattr__(name):
    if name == "MeanOver":
        from .losses import MeanOver
        return MeanOver
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
