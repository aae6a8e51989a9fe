"""An HTTP/1.1 server of GET routes, for kpng's status addresses: exact paths, kept-alive
connections, bounded heads and waits, so that a scraper or a stray client can neither hold it up
nor make it read without end."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qsl, urlsplit

from kpng.http1._head import HttpError, encode_fields, keeps_alive, parse_head, read_head

__all__ = ["Handler", "Listener", "Reply", "Request", "serve"]

log = logging.getLogger(__name__)

IDLE_S = 30.0
"""How long a connection may take to send the next request's head (a scraper keeps its
connection open between scrapes; Prometheus' shortest default interval is 15 s), and to take
its answer."""
REQUEST_HEAD_LIMIT = 64 * 1024
"""The longest request head read (asyncio's default stream limit, stated): a scraper's or a
load balancer's is a few hundred bytes."""
BODY_LIMIT = 64 * 1024
"""The largest request body read (and ignored): every route is a GET."""
LINGER_S = 2.0
"""How long a closing connection's unread input is read, for its last answer to arrive."""


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: Mapping[str, str]
    """Each parameter's first value."""
    headers: Mapping[str, str]


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes | str = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Reply]]


class Listener:
    """A serving socket and its open connections."""

    def __init__(self, routes: Mapping[str, Handler]) -> None:
        self._routes = dict(routes)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def close(self) -> None:
        """Stops listening and ends every connection, mid-request or idle."""
        if self._server is not None:
            self._server.close()
        for writer in self._connections:
            writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while await self._exchange(reader, writer):
                pass
        except (OSError, HttpError, TimeoutError):
            pass  # the client went away, stalled or spoke nonsense: its connection ends
        finally:
            await _linger(reader, writer)
            self._connections.discard(writer)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answers one request; whether the connection carries another."""
        async with asyncio.timeout(IDLE_S):
            head = await read_head(reader)
            if not head:
                return False
            start, headers = parse_head(head)
            method, target, version = [*start.split(" "), "", ""][:3]
            if not version.startswith("HTTP/1.") or not target.startswith("/"):
                await _write(writer, "GET", _plain(400), keep=False)
                return False
            if "transfer-encoding" in headers:
                await _write(writer, "GET", _plain(411), keep=False)
                return False
            length = _length(headers.get("content-length", "0"))
            if not 0 <= length <= BODY_LIMIT:
                await _write(writer, "GET", _plain(413), keep=False)
                return False
            if length:
                await reader.readexactly(length)
        keep = keeps_alive(version, headers)
        parts = urlsplit(target)
        handler = self._routes.get(parts.path)
        if handler is None:
            reply = _plain(404)
        elif method not in ("GET", "HEAD"):
            reply = _plain(405, Allow="GET, HEAD")
        else:
            query: dict[str, str] = {}
            for name, value in parse_qsl(parts.query, keep_blank_values=True):
                query.setdefault(name, value)
            try:
                reply = await handler(Request(method, parts.path, query, headers))
            except Exception:
                log.exception("answering %s %s", method, parts.path)
                reply = _plain(500)
        # A client that does not read its answer holds it in memory: not for longer than this.
        async with asyncio.timeout(IDLE_S):
            await _write(writer, method, reply, keep=keep)
        return keep


def _plain(status: int, **headers: str) -> Reply:
    return Reply(status, f"{status}: {HTTPStatus(status).phrase}\n", headers=headers)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Ends the connection without losing the last answer: closing a socket with unread input
    (a request sent after ``Connection: close``, the rest of a refused head) resets it, and the
    reset can overtake the answer. So the sending side is shut first, and the input read until
    the client closes too, for a bounded time."""
    try:
        if not writer.transport.is_closing() and writer.can_write_eof():
            writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(BODY_LIMIT):
                    pass
    except (OSError, TimeoutError):
        pass
    finally:
        writer.transport.abort()


def _length(text: str) -> int:
    """A Content-Length; -1 for one that is not a number."""
    return int(text) if text.isdigit() else -1


async def _write(writer: asyncio.StreamWriter, method: str, reply: Reply, *, keep: bool) -> None:
    body = reply.body.encode() if isinstance(reply.body, str) else reply.body
    fields = {
        # RFC 9110 asks a server with a clock for a Date (Go's servers, kube-proxy's, send one).
        "Date": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()),
        "Content-Type": reply.content_type,
        "Content-Length": str(len(body)),
        **reply.headers,
    }
    if not keep:
        fields["Connection"] = "close"
    phrase = HTTPStatus(reply.status).phrase
    head = f"HTTP/1.1 {reply.status} {phrase}\r\n".encode() + encode_fields(fields) + b"\r\n"
    writer.write(head if method == "HEAD" else head + body)
    await writer.drain()


async def serve(sock: socket.socket, routes: Mapping[str, Handler]) -> Listener:
    """Answers on ``sock``, a bound socket, until the listener is closed."""
    listener = Listener(routes)
    listener._server = await asyncio.start_server(
        listener._connection, sock=sock, limit=REQUEST_HEAD_LIMIT
    )
    return listener
