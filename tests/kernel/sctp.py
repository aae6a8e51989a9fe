"""SCTP packets on raw sockets, for kernels without SCTP sockets (issue 41).

    python -m tests.kernel.sctp send HOST PORT [--wait S]  # one INIT; ICMP unreachables, as JSON
    python -m tests.kernel.sctp listen PORT [--timeout S]  # "ready", then the first packet

A kernel built without SCTP refuses ``socket(AF_INET, SOCK_STREAM, IPPROTO_SCTP)``, but raw
sockets of protocol 132 work and netfilter still tracks, translates and filters SCTP: what a
test needs to see a Service's SCTP port DNATed. The packet is an INIT chunk with a correct
CRC32c (RFC 9260), since conntrack checks SCTP checksums.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import google_crc32c

IPPROTO_SCTP = 132
INIT = 1
SOURCE_PORT = 40132

_HEADER = struct.Struct("!HHII")
"""Source port, destination port, verification tag, checksum."""
_INIT = struct.Struct("!BBHIIHHI")
"""Chunk type, flags, length; initiate tag, a_rwnd, outbound and inbound streams, initial TSN."""


def _checksum(packet: bytes) -> bytes:
    """The CRC32c of ``packet`` with its checksum field zero, as the field holds it: the CRC's
    least significant byte first (RFC 9260, appendix A)."""
    zeroed = packet[:8] + b"\0\0\0\0" + packet[12:]
    return struct.pack("<I", google_crc32c.value(zeroed))


def init_packet(source_port: int, destination_port: int, *, tag: int = 0x6B706E67) -> bytes:
    """An SCTP packet holding one INIT chunk (verification tag 0, as an INIT has)."""
    chunk = _INIT.pack(INIT, 0, _INIT.size, tag, 65536, 10, 10, 1)
    packet = _HEADER.pack(source_port, destination_port, 0, 0) + chunk
    return packet[:8] + _checksum(packet) + packet[12:]


@dataclass(frozen=True)
class Received:
    source: str
    destination: str
    source_port: int
    destination_port: int
    chunk: int
    checksum_ok: bool


def parse(datagram: bytes) -> Received | None:
    """An IPv4 datagram of SCTP as a raw socket reads it (IP header first); None if short."""
    if len(datagram) < 20:
        return None
    header = (datagram[0] & 0x0F) * 4
    packet = datagram[header:]
    if len(packet) < _HEADER.size + 4:
        return None
    source_port, destination_port, _, _ = _HEADER.unpack_from(packet)
    return Received(
        source=socket.inet_ntoa(datagram[12:16]),
        destination=socket.inet_ntoa(datagram[16:20]),
        source_port=source_port,
        destination_port=destination_port,
        chunk=packet[_HEADER.size],
        checksum_ok=packet[8:12] == _checksum(packet),
    )


def unreachable_code(datagram: bytes, host: str, port: int) -> int | None:
    """The code of an ICMP destination unreachable (a raw ICMP socket's read, IP header first)
    about an SCTP packet to ``host``:``port``; None for any other ICMP message."""
    icmp = datagram[(datagram[0] & 0x0F) * 4 :]
    if len(icmp) < 8 + 20 or icmp[0] != 3:
        return None
    quoted = icmp[8:]
    inner = quoted[(quoted[0] & 0x0F) * 4 :]
    if quoted[9] != IPPROTO_SCTP or socket.inet_ntoa(quoted[16:20]) != host or len(inner) < 4:
        return None
    (destination_port,) = struct.unpack_from("!H", inner, 2)
    return icmp[1] if destination_port == port else None


def send(host: str, port: int, wait: float) -> dict[str, list[int]]:
    """Send one INIT to ``host``:``port``; the codes of the ICMP unreachables about it that
    come within ``wait`` seconds."""
    icmp = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    with icmp, socket.socket(socket.AF_INET, socket.SOCK_RAW, IPPROTO_SCTP) as sctp:
        sctp.sendto(init_packet(SOURCE_PORT, port), (host, 0))
        codes = []
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([icmp], [], [], left)[0]:
                break
            code = unreachable_code(icmp.recv(65535), host, port)
            if code is not None:
                codes.append(code)
    return {"unreachable": codes}


def listen(port: int, timeout: float) -> dict[str, object] | None:
    """The first SCTP packet to ``port`` that comes within ``timeout`` seconds."""
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, IPPROTO_SCTP) as sock:
        print("ready", flush=True)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([sock], [], [], left)[0]:
                break
            received = parse(sock.recv(65535))
            if received is not None and received.destination_port == port:
                return asdict(received)
    return None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.kernel.sctp")
    commands = parser.add_subparsers(dest="command", required=True)
    sending = commands.add_parser("send")
    sending.add_argument("host")
    sending.add_argument("port", type=int)
    sending.add_argument("--wait", type=float, default=1.0)
    listening = commands.add_parser("listen")
    listening.add_argument("port", type=int)
    listening.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "send":
        result: object = send(args.host, args.port, args.wait)
    else:
        result = listen(args.port, args.timeout)
    json.dump(result, sys.stdout)
    print(flush=True)


if __name__ == "__main__":
    main()
