"""The Jupyter server's side and the runs' discovery: the REST extension, the run registry, the
control channel, the snapshot and series models. May import engine/ (checkpoint listing), arbiter/
and the shared modules; never run/, pool/ or ui/.
"""
