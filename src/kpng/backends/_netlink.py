"""Netlink framing shared by kpng's nf_tables and ctnetlink messages (pure: no I/O).

Both are nfnetlink subsystems: the same message header, the same ``nfgenmsg`` after it, the same
attributes. Kept apart from either user so that neither imports the other's package (the
conntrack clean-up is used by backends that have no nf_tables table).
"""

from __future__ import annotations

import struct
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
