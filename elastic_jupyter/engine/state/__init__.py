"""The state wing: the training state as data, and where it is kept.

``training_state`` captures and restores the state as plain data (what a checkpoint holds
and a newcomer receives; it loads with ``weights_only=True``); ``frozen`` keeps the weights no
step changes where the cell built them; ``checkpoint`` owns the files on disk (atomic writes,
the pointer to the latest, the last N kept), written beside training by ``checkpoint_writer``
through its ``checkpoint_process`` (``direct_io`` past the page cache, staged in
``shared_memory``); ``whole_checkpoints`` is rank 0's pairing of reused copies and that writer
(when to copy, when to wait); ``history`` keeps a rank's newest per-step records and decides
which it may forget.
"""
