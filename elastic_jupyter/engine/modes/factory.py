"""The state mode a run's options choose (engine.modes.state_mode): the one place on the engine side
that reads ``--shard``."""
from __future__ import annotations

from ...config.run import RunConfig
from .replicated import Replicated
from .sharded import Sharded
from .state_mode import StateMode


def state_mode(config: RunConfig) -> StateMode:
    """The mode `config` asks for: each rank its rows with ``--shard``, else the whole state."""
    return Sharded(config) if config.shard else Replicated(config)
