"""The group wing: what the ranks of one generation do together.

Every module here is a step of the protocol between the ranks of a process group: the commit
vote (``vote``) that makes a step all-or-nothing, the owner's ``abort`` that ends a wait when
a peer died, the ``work_barrier`` after local work of any length, ``collective`` (our own
collectives and the exception that names a failed peer), the gradient sum of the replicated
mode (``reduce``), the newcomers' ``state_transfer``, a ``drain`` at a step boundary, and the
``network_interface`` the rendezvous, gloo and nccl use. It imports only engine.protocol.
"""
