"""A tiny TCP and UDP echo server for test pods: it answers who it is and whom it saw.

    python -m kpng.testing.echo NAME PORT[,PORT...]

Every TCP line and every UDP datagram is answered with ``NAME CLIENT_ADDRESS\\n``, so a test can
tell which endpoint served it and whether the client's source address was preserved; the line
``port`` is answered with ``NAME CLIENT_ADDRESS CLIENT_PORT\\n``, to tell how the client's
source port was translated. It listens on both families (one IPv6 socket that accepts IPv4 too)
and stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import Sequence
from typing import cast


def answer(name: str, peer: str, request: bytes = b"", port: int = 0) -> bytes:
    # IPv4 clients of a dual-stack socket appear as ::ffff:a.b.c.d.
    seen = f"{name} {peer.removeprefix('::ffff:')}"
    return f"{seen} {port}\n".encode() if request.strip() == b"port" else f"{seen}\n".encode()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A datagram endpoint's transport, whatever class the event loop gives it.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        assert self.transport is not None
        self.transport.sendto(answer(self.name, str(addr[0]), data, int(addr[1])), addr)


def _socket(kind: int, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6, kind)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("::", port))
    return sock


async def serve(name: str, ports: Sequence[int]) -> None:
    async def tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        peer, port = str(peername[0]), int(peername[1])
        try:
            while line := await reader.readline():
                writer.write(answer(name, peer, line, port))
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    servers = []
    for port in ports:
        servers.append(await asyncio.start_server(tcp, sock=_socket(socket.SOCK_STREAM, port)))
        await loop.create_datagram_endpoint(
            lambda: _Udp(name), sock=_socket(socket.SOCK_DGRAM, port)
        )
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    asyncio.run(serve(args[0], [int(p) for p in args[1].split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
