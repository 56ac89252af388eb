"""The owner loop's run machinery: the run handle, its driver, sizing, membership, recovery,
the run's log and setup. May import pool/, server/ (publishing a run), engine/ (checkpoint
files) and the shared modules; never ui/ except the handle's dashboard() and plot().
"""
