"""Which network interface reaches an address: the one the rendezvous, gloo and nccl use.

A pool across hosts binds to one interface, never to all (the rendezvous store has no
authentication): the owner binds to the interface the user names or the one that reaches the
engines' hosts, and each engine takes its own interface that reaches the owner (interface names
differ between hosts, so the owner cannot name it for them).
"""
from __future__ import annotations

import fcntl
import os
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def address_of(name: str) -> str | None:
    """The IPv4 address of interface `name` (like "eth0"), or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def address_towards(host: str) -> str:
    """This host's IPv4 address on the route to `host` (a name or an address). Raises OSError
    when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: nothing is sent; the kernel only picks the route
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 `address`, or None."""
    for _, name in socket.if_nameindex():
        if address_of(name) == address:
            return name
    return None


def use_interface_towards(host: str) -> str | None:
    """Make gloo and nccl of this process use the interface that reaches `host` (unless the
    user set them); returns its name (None when it has no name, as 127.0.0.2 on lo)."""
    name = interface_of(address_towards(host))
    if name:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return name
