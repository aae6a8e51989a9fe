"""The links and addresses of the calling thread's network namespace, from rtnetlink.

to-ebpf asks them of each pod's namespace it enters (``ebpf/locality``), where ``ip`` would be
a process per pod and /sys shows the namespace kpng's mounts were made in; the health check node
ports ask the node's own (``_healthchecks``). Two dump requests,
parsed here (pure over the bytes the kernel answers, so the parsers are tested with tables);
only the attributes kpng reads.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_GETLINK, RTM_NEWADDR, RTM_GETADDR = 16, 18, 20, 22
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
IFLA_IFNAME, IFLA_LINK, IFLA_MASTER, IFLA_LINKINFO, IFLA_LINK_NETNSID = 3, 5, 10, 18, 37
IFLA_INFO_KIND = 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RT_SCOPE_UNIVERSE = 0

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, index
_ATTR = struct.Struct("=HH")  # rtattr: length, type
_ADDRESS_SIZES = {int(socket.AF_INET): 4, int(socket.AF_INET6): 16}


class NetlinkError(OSError):
    """The kernel refused a request, or answered what kpng cannot read."""


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str = ""
    """``veth``, ``bridge``...: empty for a device without one (loopback, a physical NIC)."""
    peer: int | None = None
    """IFLA_LINK: a veth's other end (its index in ``peer_netns`` if set, else here)."""
    peer_elsewhere: bool = False
    """IFLA_LINK_NETNSID present: the other end is in another network namespace."""
    master: int | None = None
    """The bridge (or bond) this device is enslaved to."""


@dataclass(frozen=True)
class Address:
    index: int
    address: str
    scope: int

    @property
    def is_global(self) -> bool:
        return self.scope == RT_SCOPE_UNIVERSE


def _attributes(data: bytes, offset: int, end: int) -> Iterator[tuple[int, bytes]]:
    while offset + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, offset)
        if length < _ATTR.size or offset + length > end:
            raise NetlinkError(f"a netlink attribute of {length} bytes at {offset} overruns")
        # The top bits flag nesting and byte order, not the type.
        yield kind & 0x3FFF, data[offset + _ATTR.size : offset + length]
        offset += (length + 3) & ~3


def _messages(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(type, start of the payload, end of the message) of each message in ``data``."""
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise NetlinkError(f"a netlink message of {length} bytes at {offset} overruns")
        yield kind, offset + _HEADER.size, offset + length
        offset += (length + 3) & ~3


def _records(
    data: bytes, kind: int, header: struct.Struct
) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """Each message of type ``kind`` in ``data``: its fixed header's fields, where its
    attributes start and where it ends."""
    for found, start, end in _messages(data):
        if found != kind:
            continue
        if end - start < header.size:
            raise NetlinkError(f"a netlink message of {end - start} bytes, shorter than its header")
        yield header.unpack_from(data, start), start + header.size, end


def _text(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode("utf-8", "replace")


def parse_links(data: bytes) -> list[Link]:
    """The links of RTM_NEWLINK messages in ``data`` (others are skipped)."""
    links = []
    for (_, _, index, _, _), attrs, end in _records(data, RTM_NEWLINK, _IFINFO):
        name, kind, peer, master, elsewhere = "", "", None, None, False
        for attr, value in _attributes(data, attrs, end):
            if attr == IFLA_IFNAME:
                name = _text(value)
            elif attr == IFLA_LINK and len(value) >= 4:
                peer = int.from_bytes(value[:4], sys.byteorder, signed=True)
            elif attr == IFLA_MASTER and len(value) >= 4:
                master = int.from_bytes(value[:4], sys.byteorder)
            elif attr == IFLA_LINK_NETNSID:
                elsewhere = True
            elif attr == IFLA_LINKINFO:
                for info, nested in _attributes(value, 0, len(value)):
                    if info == IFLA_INFO_KIND:
                        kind = _text(nested)
        links.append(Link(index, name, kind, peer, elsewhere, master))
    return links


def parse_addresses(data: bytes) -> list[Address]:
    """The IPv4 and IPv6 addresses of RTM_NEWADDR messages in ``data``."""
    addresses = []
    for (family, _, _, scope, index), start, end in _records(data, RTM_NEWADDR, _IFADDR):
        attrs = dict(_attributes(data, start, end))
        # IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer's on a
        # point-to-point link, and the only one an IPv6 address has.
        raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
        if raw is None or len(raw) != _ADDRESS_SIZES.get(family):
            continue
        addresses.append(Address(index, str(ipaddress.ip_address(raw)), scope))
    return addresses


def _dump(request_type: int, body: bytes) -> bytes:
    """Every answer to a dump request, in this thread's network namespace."""
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE
    ) as sock:
        sock.bind((0, 0))
        header = _HEADER.pack(
            _HEADER.size + len(body), request_type, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
        )
        sock.sendall(header + body)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            for kind, start, _ in _messages(chunk):
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", chunk, start)[0]
                    raise NetlinkError(code, f"rtnetlink: {os.strerror(code)}")
                if kind == NLMSG_DONE:
                    chunks.append(chunk)
                    return b"".join(chunks)
            chunks.append(chunk)


def links() -> list[Link]:
    """The links of the calling thread's network namespace."""
    return parse_links(_dump(RTM_GETLINK, _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)))


def addresses() -> list[Address]:
    """The IPv4 and IPv6 addresses of the calling thread's network namespace."""
    return parse_addresses(_dump(RTM_GETADDR, _IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)))
