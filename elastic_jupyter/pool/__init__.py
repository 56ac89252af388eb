"""The engine pool: engine processes, slots, the arbiter's lease, launchers and every call into
the engines. May import engine/ (entry points), arbiter/ and the shared modules; never run/ or ui/.
"""
