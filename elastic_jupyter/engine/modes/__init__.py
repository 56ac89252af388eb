"""The modes wing: who holds the training state, as one interface and two implementations.

``state_mode`` is the interface (StateMode) that Generation, Worker and the evaluation call;
``replicated`` is the mode where every rank holds the whole state, ``sharded`` the one where each
rank holds its rows (``--shard``, every refusal a method of it). ``factory`` is the one place on
the engine side that reads the option. The kernel side's counterpart is run.run_mode.
"""
