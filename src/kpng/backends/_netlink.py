"""Netlink framing shared by kpng's nf_tables, ctnetlink and nfacct messages (pure), and the
socket they travel on.

All are nfnetlink subsystems: the same message header, the same ``nfgenmsg`` after it, the same
attributes. Kept apart from every user so that none imports another's package (the conntrack
clean-up is used by backends that have no nf_tables table).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Iterator

NETLINK_NETFILTER = 12
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLA_F_NESTED = 0x8000
NLMSG_ERROR = 2
NLMSG_DONE = 3


def attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def nested(kind: int, payload: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, payload)


def nested_attributes(payload: bytes) -> Iterator[tuple[int, bytes]]:
    """Each attribute of ``payload``: its type without the nesting and byte-order flags, and
    its value. Stops at a malformed one: the kernel wrote it, a short read is all it can be."""
    offset = 0
    while offset + 4 <= len(payload):
        size, kind = struct.unpack_from("=HH", payload, offset)
        if size < 4:
            return
        yield kind & 0x3FFF, payload[offset + 4 : offset + size]
        offset += (size + 3) & ~3


def messages(reply: bytes) -> Iterator[tuple[int, bytes]]:
    """Each netlink message of ``reply``: its type (without the subsystem) and its bytes."""
    offset = 0
    while offset + 16 <= len(reply):
        length, kind = struct.unpack_from("=IH", reply, offset)
        if length < 16:
            return
        yield kind, reply[offset : offset + length]
        offset += (length + 3) & ~3


_CLONE_NEWNET = 0x40000000


def netfilter_socket(netns: str | None = None) -> socket.socket:
    """A NETLINK_NETFILTER socket (unbound) in this thread's network namespace, or in the one
    at path ``netns`` (``/run/netns/NAME``, ``/proc/PID/ns/net``): a socket stays in the
    namespace it was made in."""
    if netns is None:
        return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    made: list[socket.socket | OSError] = []

    def enter_and_make() -> None:
        # setns moves only the calling thread: this short one, which ends there.
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(netns) as there:
                if libc.setns(there.fileno(), _CLONE_NEWNET) != 0:
                    number = ctypes.get_errno()
                    raise OSError(number, f"setns {netns}: {os.strerror(number)}")
            made.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER))
        except OSError as exc:
            made.append(exc)

    thread = threading.Thread(target=enter_and_make, name="netfilter-netns")
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]
