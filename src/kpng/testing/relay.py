"""A relay that counts the bytes of each connection, both ways: what a watch costs on the wire
(TLS, HTTP/2 and gRPC framing included), where gRPC's own API does not say.

    relay = Relay("unix:///run/kpng.sock")
    await relay.start("tcp://127.0.0.1:0")  # relay.url: where clients connect
    ...
    relay.connections[-1].up, relay.connections[-1].down

``accepting`` False closes new connections at once (a peer away), and ``cut`` ends the open
ones (a network blip).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Connection", "Relay"]

_CHUNK = 1 << 16


@dataclass
class Connection:
    """What one relayed connection carried: ``up`` from the client, ``down`` to it."""

    up: int = 0
    down: int = 0
    opened: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    """When the last byte passed, either way (monotonic)."""
    closed: bool = False

    @property
    def total(self) -> int:
        return self.up + self.down


class Relay:
    """Relays connections to ``target`` (``tcp://HOST:PORT`` or ``unix:///PATH``)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.url = ""
        self.accepting = True
        self.connections: list[Connection] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        """The copies and the connections' handlers, for ``close`` to wait for."""

    async def start(self, listen: str) -> None:
        """Listen on ``listen`` (port 0: any free one; ``url`` says which)."""
        if listen.startswith("unix://"):
            path = listen.removeprefix("unix://")
            self._server = await asyncio.start_unix_server(self._relay, path)
            self.url = listen
        else:
            host, _, port = listen.removeprefix("tcp://").rpartition(":")
            self._server = await asyncio.start_server(self._relay, host, int(port))
            bound = self._server.sockets[0].getsockname()
            self.url = f"tcp://{bound[0]}:{bound[1]}"

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.target.startswith("unix://"):
            return await asyncio.open_unix_connection(self.target.removeprefix("unix://"))
        host, _, port = self.target.removeprefix("tcp://").rpartition(":")
        return await asyncio.open_connection(host, int(port))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.accepting:
            writer.close()
            return
        try:
            up_reader, up_writer = await self._open()
        except OSError:
            writer.close()
            return
        connection = Connection()
        self.connections.append(connection)
        handler = asyncio.current_task()
        if handler is not None:
            self._tasks.add(handler)
        self._writers |= {writer, up_writer}
        copies = [
            asyncio.create_task(self._copy(reader, up_writer, connection, up=True)),
            asyncio.create_task(self._copy(up_reader, writer, connection, up=False)),
        ]
        self._tasks.update(copies)
        try:
            # Either side ending ends both, as a dropped TCP connection would.
            await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in copies:
                task.cancel()
            await asyncio.gather(*copies, return_exceptions=True)
            self._tasks.difference_update(copies)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.close()
            connection.closed = True
            if handler is not None:
                self._tasks.discard(handler)

    @staticmethod
    async def _copy(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        connection: Connection,
        *,
        up: bool,
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(_CHUNK):
                if up:
                    connection.up += len(data)
                else:
                    connection.down += len(data)
                connection.last = time.monotonic()
                writer.write(data)
                await writer.drain()

    def cut(self) -> None:
        """End every open connection."""
        for writer in list(self._writers):
            writer.transport.abort()

    async def quiet(self, seconds: float, *, within: float = 30.0) -> None:
        """Wait until no byte has passed for ``seconds`` (TimeoutError after ``within``)."""
        async with asyncio.timeout(within):
            while True:
                last = max((c.last for c in self.connections), default=0.0)
                idle = time.monotonic() - last
                if idle >= seconds:
                    return
                await asyncio.sleep(seconds - idle)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
