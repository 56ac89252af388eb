"""What a person touches in the kernel: the magics, the dashboard widget and run.plot().

May import run/, pool/, server/ (its data models) and the shared modules; nothing imports ui/
except the package's entry points and the run handle's two view methods.
"""
