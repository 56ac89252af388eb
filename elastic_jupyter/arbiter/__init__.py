"""The slot arbiter: one per machine, consulted by every run on it.

A run asks the arbiter for slots (GPUs, or CPU slots on a machine without GPUs) and holds them
under leases; the arbiter decides how many each run should hold (:mod:`.fairshare`, and for
runs that report their speed, :mod:`.value` over :mod:`.speed`), keeps the
leases (:mod:`.table`), serves them on a Unix socket (:mod:`.service`), learns which slots are
busy outside from a provider (:mod:`.providers`, NVML for GPUs) and reads the admin's caps and
weights (:mod:`.settings`). Runs talk to it through :class:`.client.ArbiterClient`, which starts
a private arbiter on demand when the machine has no shared one; both ends find its folder with
:mod:`.location`. On a Slurm cluster an auto pool asks Slurm's queue instead (:mod:`.slurm`),
with the same calls; pools of several hosts ask each host's (:mod:`.hosts`, :mod:`.relay`).

Of the package it imports only the shared :mod:`elastic_jupyter.host`: never the run, pool,
server, UI or engine.
"""
