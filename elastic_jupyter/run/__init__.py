"""The owner loop's run machinery: the run handle (run.py) and the owners it delegates to.
May import pool/, server/, engine/ and the shared modules; ui/ only in run.dashboard() and plot().
"""
