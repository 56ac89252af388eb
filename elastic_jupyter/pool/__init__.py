"""The engine pool: its public API (pool), engine sets, slots, the arbiter's lease, engine
processes, launchers and every call into the engines. May import engine/, arbiter/ and the
shared modules (config, owner, host); never run/, server/ or ui/ (a run is a claimant.Claimant).
"""
