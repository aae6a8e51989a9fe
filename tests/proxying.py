"""A real HTTP proxy on loopback, for tests of kpng's client behind one."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator


class ConnectProxy:
    """A real HTTP proxy on loopback: CONNECT tunnels and absolute-form requests (relayed over
    a new connection each), each only with the right Basic credentials when ``credentials`` is
    set. Notes what it was asked."""

    def __init__(self, credentials: str | None = None, hosts: dict[str, str] | None = None) -> None:
        self.credentials = credentials
        self.hosts = hosts or {}
        """Names the proxy resolves itself (to loopback), as a proxy resolves what its clients
        cannot."""
        self.asked: list[str] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            start = head.split(b"\r\n", 1)[0].decode()
            self.asked.append(start)
            expected = f"Proxy-Authorization: Basic {self.credentials}"
            if self.credentials and expected.encode() not in head:
                writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
                return
            method, target, _ = start.split(" ")
            if method == "CONNECT":
                host, port = target.rsplit(":", 1)
                host = self.hosts.get(host, host)
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                authority = target.split("/")[2]
                host, port = authority.rsplit(":", 1)
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
                path = "/" + target.split("/", 3)[3]
                fields = head.split(b"\r\n")[1:]
                rest = b"\r\n".join(f for f in fields if not f.startswith(b"Proxy-Auth"))
                up_writer.write(f"{method} {path} HTTP/1.1\r\n".encode() + rest)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[int]:
        """The proxy's port; an https:// proxy with ``ssl_context``."""
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ssl_context)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
