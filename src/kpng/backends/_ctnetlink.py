"""UDP conntrack flows over ctnetlink: listed, deleted and (for tests and benchmarks) made.

What kube-proxy does since 1.32 instead of running the conntrack tool: a dump the kernel
restricts to one family and to UDP (``nfgenmsg``'s family, and ``CTA_FILTER`` on the protocol,
which kernels from 5.9 apply; older ones ignore the attribute and the protocol is checked here
too), optionally to one destination (a few frontends: a dump each costs less than reading every
flow), and one ``IPCTNL_MSG_CT_DELETE`` per stale flow, naming it by its original tuple, zone
and id: a flow made since the dump with the same tuple has another id, and the kernel keeps it.

The encoders and the parser are pure over bytes (tested with tables); ``CtSocket`` does the I/O.
The parser skips every flow whose original destination is not wanted before decoding it: on a
node of 100,000 flows, almost all unrelated to services, that is most of the work.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kpng.backends._netlink import (
    NLM_F_ACK,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    attr,
    nested,
    netfilter_socket,
)

NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_TIMEOUT = 1, 2, 3, 7
CTA_ID, CTA_ZONE, CTA_FILTER = 12, 18, 25
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_FILTER_ORIG_FLAGS, CTA_FILTER_REPLY_FLAGS = 1, 2
FILTER_IP_DST, FILTER_PROTO_NUM, FILTER_PROTO_DST_PORT = 1 << 1, 1 << 3, 1 << 5
IPPROTO_UDP = 17
IPS_CONFIRMED = 1 << 3
NLM_F_CREATE, NLM_F_EXCL = 0x400, 0x200

FAMILIES: dict[str, int] = {"IPv4": socket.AF_INET, "IPv6": socket.AF_INET6}
# CTA_IP_V4_SRC/DST are 1 and 2, CTA_IP_V6_SRC/DST 3 and 4.
_SOURCE_ATTR: dict[int, int] = {socket.AF_INET: 1, socket.AF_INET6: 3}

_HEADER = struct.Struct("=IHHII")
_ATTR = struct.Struct("=HH")
_ATTR_HEADER = _ATTR.unpack_from
_NLMSG_HEADER = _HEADER.unpack_from
_ERROR = struct.Struct("=i").unpack_from
_TYPE_MASK = 0x3FFF
_NEW = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_NEW


class Flow(NamedTuple):
    """A UDP flow as kube-proxy's rule reads it (the first four) and as a delete names it (the
    rest: empty when a flow is only written down for the rule, as the tests do)."""

    orig_dst: str
    orig_dport: str
    reply_src: str
    reply_sport: str
    orig_src: str = ""
    orig_sport: str = ""
    zone: int = 0
    id: int | None = None


@dataclass(frozen=True)
class Wanted:
    """The original destinations worth decoding a flow for: (address, port) as the wire has
    them, and ports alone (node ports, on any address). Anything else the parser skips."""

    destinations: frozenset[tuple[bytes, bytes]] = field(default_factory=frozenset)
    ports: frozenset[bytes] = field(default_factory=frozenset)

    @classmethod
    def of(cls, frontends: Iterable[tuple[str, str]]) -> Wanted:
        destinations, ports = set(), set()
        for address, port in frontends:
            wire_port = struct.pack(">H", int(port))
            if address:
                destinations.add((_pack_address(address), wire_port))
            else:
                ports.add(wire_port)
        return cls(frozenset(destinations), frozenset(ports))


def _pack_address(address: str) -> bytes:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.inet_pton(family, address)


def _message(kind: int, family: int, body: bytes, flags: int, seq: int = 0) -> bytes:
    header = _HEADER.pack(
        20 + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | kind, NLM_F_REQUEST | flags, seq, 0
    )
    return header + struct.pack("=BBH", family, 0, 0) + body


def _u8(kind: int, value: int) -> bytes:
    return attr(kind, bytes((value,)))


def _be16(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack(">H", value))


def _be32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack(">I", value))


def _tuple(
    kind: int,
    family: int,
    source: str | None,
    destination: str | None,
    source_port: int | None,
    destination_port: int | None,
) -> bytes:
    """A CTA_TUPLE_* attribute: the parts given, UDP always."""
    first = _SOURCE_ATTR[family]
    addresses = b""
    if source is not None:
        addresses += attr(first, socket.inet_pton(family, source))
    if destination is not None:
        addresses += attr(first + 1, socket.inet_pton(family, destination))
    proto = _u8(CTA_PROTO_NUM, IPPROTO_UDP)
    if source_port is not None:
        proto += _be16(CTA_PROTO_SRC_PORT, source_port)
    if destination_port is not None:
        proto += _be16(CTA_PROTO_DST_PORT, destination_port)
    body = (nested(CTA_TUPLE_IP, addresses) if addresses else b"") + nested(CTA_TUPLE_PROTO, proto)
    return nested(kind, body)


def dump_udp(family: int, destination: tuple[str, str] | None = None) -> bytes:
    """The request for the UDP flows of ``family``, or only those whose original destination
    is ``destination`` (an address and port; a port alone if the address is empty)."""
    flags = FILTER_PROTO_NUM
    address = port = None
    if destination is not None:
        # An IPv6 address is never asked for: the kernel inverts that test (Linux 5.9 to 6.18
        # at least, ctnetlink_filter_match_tuple: a flow *to* the address is left out), so an
        # IPv6 dump is filtered by port only, and ``flows_to`` keeps the address's flows.
        address = (destination[0] or None) if family == socket.AF_INET else None
        port = int(destination[1])
        flags |= FILTER_PROTO_DST_PORT | (FILTER_IP_DST if address else 0)
    body = _tuple(CTA_TUPLE_ORIG, family, None, address, None, port) + nested(
        CTA_FILTER, _be32_host(CTA_FILTER_ORIG_FLAGS, flags) + _be32_host(CTA_FILTER_REPLY_FLAGS, 0)
    )
    return _message(IPCTNL_MSG_CT_GET, family, body, NLM_F_DUMP)


def _be32_host(kind: int, value: int) -> bytes:
    """CTA_FILTER's flags are NLA_U32: host order, unlike the rest of ctnetlink."""
    return attr(kind, struct.pack("=I", value))


def delete(flow: Flow, seq: int = 0, *, ack: bool = False) -> bytes:
    """The request deleting ``flow``, named by its original tuple, zone and id."""
    family = socket.AF_INET6 if ":" in flow.orig_dst else socket.AF_INET
    body = _tuple(
        CTA_TUPLE_ORIG,
        family,
        flow.orig_src,
        flow.orig_dst,
        int(flow.orig_sport),
        int(flow.orig_dport),
    )
    if flow.zone:
        body += _be16(CTA_ZONE, flow.zone)
    if flow.id is not None:
        body += _be32(CTA_ID, flow.id)
    return _message(IPCTNL_MSG_CT_DELETE, family, body, NLM_F_ACK if ack else 0, seq)


def new(
    family: int,
    source: str,
    destination: str,
    source_port: int,
    destination_port: int,
    reply_source: str | None = None,
    reply_port: int | None = None,
    *,
    timeout_s: int = 600,
) -> bytes:
    """The request making a confirmed UDP flow from ``source`` to ``destination``, answered by
    ``reply_source`` (as after a DNAT; the destination itself if None): what tests and
    benchmarks fill a node's table with, thousands a second."""
    replier = destination if reply_source is None else reply_source
    answer_port = destination_port if reply_port is None else reply_port
    body = (
        _tuple(CTA_TUPLE_ORIG, family, source, destination, source_port, destination_port)
        + _tuple(CTA_TUPLE_REPLY, family, replier, source, answer_port, source_port)
        + _be32(CTA_TIMEOUT, timeout_s)
    )
    return _message(IPCTNL_MSG_CT_NEW, family, body, NLM_F_CREATE | NLM_F_EXCL)


def _ports(data: bytes, start: int, end: int) -> tuple[int, bytes, bytes]:
    """Protocol number, source and destination port of a CTA_TUPLE_PROTO's payload."""
    proto, sport, dport = -1, b"", b""
    while start + 4 <= end:
        size, kind = _ATTR_HEADER(data, start)
        if size < 4 or start + size > end:
            break
        kind &= _TYPE_MASK
        if kind == CTA_PROTO_NUM:
            proto = data[start + 4]
        elif kind == CTA_PROTO_SRC_PORT:
            sport = data[start + 4 : start + 6]
        elif kind == CTA_PROTO_DST_PORT:
            dport = data[start + 4 : start + 6]
        start += (size + 3) & ~3
    return proto, sport, dport


def _addresses(data: bytes, start: int, end: int) -> tuple[bytes, bytes]:
    """Source and destination of a CTA_TUPLE_IP's payload, either family."""
    source = destination = b""
    while start + 4 <= end:
        size, kind = _ATTR_HEADER(data, start)
        if size < 4 or start + size > end:
            break
        kind &= _TYPE_MASK
        if kind in (1, 3):
            source = data[start + 4 : start + size]
        elif kind in (2, 4):
            destination = data[start + 4 : start + size]
        start += (size + 3) & ~3
    return source, destination


def _tuple_of(data: bytes, start: int, end: int) -> tuple[bytes, bytes, int, bytes, bytes]:
    """(source, destination, protocol, source port, destination port) of a CTA_TUPLE_*'s
    payload."""
    source = destination = sport = dport = b""
    proto = -1
    while start + 4 <= end:
        size, kind = _ATTR_HEADER(data, start)
        if size < 4 or start + size > end:
            break
        kind &= _TYPE_MASK
        if kind == CTA_TUPLE_IP:
            source, destination = _addresses(data, start + 4, start + size)
        elif kind == CTA_TUPLE_PROTO:
            proto, sport, dport = _ports(data, start + 4, start + size)
        start += (size + 3) & ~3
    return source, destination, proto, sport, dport


def _text(address: bytes) -> str:
    return socket.inet_ntop(socket.AF_INET6 if len(address) == 16 else socket.AF_INET, address)


def _port(wire: bytes) -> str:
    return str(int.from_bytes(wire, "big"))


# Where the kernel puts an original tuple's destination and destination port, after the
# message and nfgenmsg headers: ctnetlink_fill_info writes CTA_TUPLE_ORIG first, its addresses
# then its ports, in this order, for as long as ctnetlink has existed. ``parse`` reads them there
# only after checking the attribute headers in front of them, else it walks the attributes.
# (attribute header of the destination at, its bytes at; the same for the destination port)
_V4_AT = (36, b"\x08\x00\x02\x00", 40, 44, 64, b"\x06\x00\x03\x00", 68)
_V6_AT = (48, b"\x14\x00\x04\x00", 52, 68, 88, b"\x06\x00\x03\x00", 92)


def _destination(data: bytes, offset: int, end: int) -> tuple[bytes, bytes]:
    """The original destination address and port of the message at ``offset``."""
    for at, header, start, stop, port_at, port_header, port in (_V4_AT, _V6_AT):
        if (
            offset + port + 2 <= end
            and data[offset + at : offset + at + 4] == header
            and data[offset + port_at : offset + port_at + 4] == port_header
        ):
            return data[offset + start : offset + stop], data[offset + port : offset + port + 2]
    for size, kind in _attributes_at(data, offset + 20, end):
        if kind == CTA_TUPLE_ORIG:
            _, dst, _, _, dport = _tuple_of(data, size, _attr_end(data, size - 4))
            return dst, dport
    return b"", b""


def _attributes_at(data: bytes, start: int, end: int) -> Iterator[tuple[int, int]]:
    """(where the payload starts, type) of each attribute from ``start`` to ``end``."""
    while start + 4 <= end:
        size, kind = _ATTR_HEADER(data, start)
        if size < 4 or start + size > end:
            return
        yield start + 4, kind & _TYPE_MASK
        start += (size + 3) & ~3


def _attr_end(data: bytes, start: int) -> int:
    return start + int(_ATTR_HEADER(data, start)[0])


def parse(data: bytes, wanted: Wanted | None = None) -> Iterator[Flow]:
    """The UDP flows of a dump's messages in ``data`` whose original destination is
    ``wanted`` (every one if None). Other messages are skipped; so is a flow that lacks a
    part, which the rule could not judge."""
    offset, total = 0, len(data)
    destinations = wanted.destinations if wanted is not None else frozenset()
    ports = wanted.ports if wanted is not None else frozenset()
    while offset + 20 <= total:
        length, kind, _, _, _ = _NLMSG_HEADER(data, offset)
        if length < 16 or offset + length > total:
            return  # cut: the kernel sends whole messages, so nothing else can be read
        here, end = offset, offset + length
        offset += (length + 3) & ~3
        if kind != _NEW:
            continue
        if wanted is not None:
            # Most flows of a node are not to a frontend: they cost this, and no more.
            dst, dport = _destination(data, here, end)
            if dport not in ports and (dst, dport) not in destinations:
                continue
        flow = _flow(data, here + 20, end)
        if flow is not None:
            yield flow


def _flow(data: bytes, start: int, end: int) -> Flow | None:
    """The flow of the attributes from ``start`` to ``end`` of one message, if UDP and whole."""
    orig = reply = (0, 0)
    zone, ident = 0, None
    for at, kind in _attributes_at(data, start, end):
        if kind == CTA_TUPLE_ORIG:
            orig = (at, _attr_end(data, at - 4))
        elif kind == CTA_TUPLE_REPLY:
            reply = (at, _attr_end(data, at - 4))
        elif kind == CTA_ZONE:
            zone = int.from_bytes(data[at : at + 2], "big")
        elif kind == CTA_ID:
            ident = int.from_bytes(data[at : at + 4], "big")
    src, dst, proto, sport, dport = _tuple_of(data, *orig)
    reply_src, _, _, reply_sport, _ = _tuple_of(data, *reply)
    if proto != IPPROTO_UDP or not (sport and dport and reply_sport):
        return None
    if len(dst) not in (4, 16) or len(src) != len(dst) or len(reply_src) != len(dst):
        return None
    return Flow(
        _text(dst),
        _port(dport),
        _text(reply_src),
        _port(reply_sport),
        _text(src),
        _port(sport),
        zone,
        ident,
    )


def _errors(data: bytes) -> Iterator[tuple[int, int]]:
    """(sequence, errno) of each NLMSG_ERROR in ``data``; errno 0 is an acknowledgement."""
    offset = 0
    while offset + 20 <= len(data):
        length, kind, _, seq, _ = _NLMSG_HEADER(data, offset)
        if length < 16:
            return
        if kind == NLMSG_ERROR:
            (error,) = _ERROR(data, offset + 16)
            yield seq, -error
        offset += (length + 3) & ~3


_SO_RCVBUFFORCE = 33


class CtSocket:
    """One ctnetlink socket, in the network namespace of the thread that made it: blocking,
    so callers run it off the event loop."""

    BATCH = 256
    """Requests sent in one datagram: the kernel handles them one after the other inside
    ``sendmsg``, and writes an error only for those it refused."""
    BUFFER = 1 << 22
    """The receive buffer asked for: a dump comes in 32 KiB parts, but a batch's refusals are a
    message each, counted at the size of a kernel buffer."""

    def __init__(self, netns: str | None = None) -> None:
        """A socket in this thread's network namespace, or in the one at path ``netns``
        (``/run/netns/NAME``, ``/proc/PID/ns/net``)."""
        sock = netfilter_socket(netns)
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, self.BUFFER)
            except OSError:  # without CAP_NET_ADMIN: what net.core.rmem_max allows
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.BUFFER)
            sock.bind((0, 0))
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def __enter__(self) -> CtSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    def dump(self, request: bytes) -> Iterator[bytes]:
        """The parts of the answer to a dump ``request``, as they come. Raises ``OSError``
        with the kernel's errno if it refuses the dump."""
        self._sock.send(request)
        while True:
            part = self._sock.recv(1 << 16)
            if not part:
                return
            offset = 0
            while offset + 16 <= len(part):
                length, kind = struct.unpack_from("=IH", part, offset)
                if kind == NLMSG_DONE:
                    yield part[:offset]
                    return
                if kind == NLMSG_ERROR:
                    (error,) = _ERROR(part, offset + 16)
                    if error:
                        raise OSError(-error, os.strerror(-error))
                if length < 16:
                    break
                offset += (length + 3) & ~3
            yield part

    def flows(self, family: int, wanted: Wanted | None = None) -> list[Flow]:
        """The UDP flows of ``family`` whose original destination is ``wanted``: one dump,
        filtered to the family and to UDP in the kernel."""
        return [flow for part in self.dump(dump_udp(family)) for flow in parse(part, wanted)]

    def flows_to(self, family: int, destination: tuple[str, str]) -> list[Flow]:
        """The UDP flows of ``family`` to ``destination`` (address and port, or a port alone),
        filtered so in the kernel (an IPv6 address here, ``dump_udp`` says why)."""
        wanted = Wanted.of([destination])
        request = dump_udp(family, destination)
        return [flow for part in self.dump(request) for flow in parse(part, wanted)]

    def send(self, requests: Sequence[bytes]) -> list[int]:
        """Send ``requests`` (without NLM_F_ACK) in batches: the errno of each refusal, in
        order. Those not listed were done."""
        refused: list[int] = []
        for start in range(0, len(requests), self.BATCH):
            chunk = requests[start : start + self.BATCH]
            self._sock.send(b"".join(chunk))
            refused.extend(error for _, error in self._pending())
        return refused

    def _pending(self) -> Iterator[tuple[int, int]]:
        while True:
            try:
                part = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            yield from _errors(part)

    def delete(self, flows: Sequence[Flow]) -> tuple[int, list[int]]:
        """Delete ``flows``: how many the kernel deleted, and the errnos of the refusals that
        are errors. A flow gone meanwhile (expired, or replaced: another id) is not one."""
        refused = self.send([delete(flow) for flow in flows])
        return len(flows) - len(refused), [error for error in refused if error != errno.ENOENT]
