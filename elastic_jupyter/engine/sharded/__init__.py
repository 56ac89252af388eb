"""The sharded wing: the machinery of ``--shard`` (FSDP2) that moves in memory.

``resizable_model`` builds the FSDP2 model again over each generation's mesh from a skeleton,
``reshard`` moves the rows whose owner changes, ``reduce_scatter`` sums the gradients in our
step protocol, ``lifecycle`` is the Worker's part (the layout the ranks agree on, start,
refresh, leave with a hand-over), ``replicas`` keeps each rank's part in its partner's host
memory, ``checkpoint_parts`` and ``part_writer`` write and read a part per rank, and
``memory_need`` counts a rank's memory at each world size before training. The sharded state
mode (engine.modes.sharded) is its one user in a step.
"""
