"""An HTTP/1.1 server of GET routes, for kpng's status addresses and health check node ports:
exact paths, kept-alive connections, bounded heads, waits and connections, so that a scraper or a
stray client can neither hold it up nor make it read without end, and a crowd of idle clients
cannot take the process's file descriptors.

h11 parses the requests and frames the answers (it is strict where a hand parser drifts: the
version, the field syntax, Content-Length's digits); the connections, their bounds and the
routes are kpng's own."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl

import h11

__all__ = ["Handler", "Listener", "Reply", "Request", "serve", "serve_address"]

log = logging.getLogger(__name__)

IDLE_S = 30.0
"""How long a connection may take to start the next request (a scraper keeps its connection
open between scrapes; Prometheus' shortest default interval is 15 s), and to take its answer."""
REQUEST_S = 10.0
"""How long a request may take from its first byte to its last, by default (the status
addresses take ``--http-request-timeout``): a client that trickles its head (slowloris) holds a
connection that is not idle, and so cannot be made room for."""
REQUEST_HEAD_LIMIT = 64 * 1024
"""The longest request head read: a scraper's or a load balancer's is a few hundred bytes."""
BODY_LIMIT = 64 * 1024
"""The largest request body read (and ignored): every route is a GET."""
MAX_CONNECTIONS = 512
"""Connections a listener keeps open at most, by default (the status addresses take
``--http-max-connections``). Each is a file descriptor; a scraper or a load balancer holds one
or a few, so 512 leaves room for many while a crowd of idle clients cannot take the process's
descriptors (1,024 in many container runtimes)."""
LINGER_S = 2.0
"""How long a closing connection's unread input is read, for its last answer to arrive."""
_READ_SIZE = 64 * 1024
_VERSIONS = (b"1.0", b"1.1")
_PATH = re.compile(rb"/[A-Za-z0-9\-._~%!$&'()*+,;=:@/]*")
"""An origin-form target's path (RFC 3986's characters): what is no path is refused, not looked
up (h11 takes any visible ASCII)."""


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
    """Serving sockets and their open connections.

    ``routes`` answer their exact paths (GET and HEAD); ``default``, if given, answers every
    other request, whatever its method and path. At most ``max_connections`` are open: a new
    one past them closes the one idle longest (open, between requests), or is itself closed
    when every one is busy. A request is read within ``request_timeout`` seconds of its first
    byte."""

    def __init__(
        self,
        routes: Mapping[str, Handler],
        *,
        default: Handler | None = None,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_S,
    ) -> None:
        self._routes = dict(routes)
        self._default = default
        self._max = max_connections
        self._request_s = request_timeout
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Insertion-ordered: the first is the one idle longest.
        self._idle: dict[asyncio.StreamWriter, None] = {}

    def close(self) -> None:
        """Stops listening and ends every connection, mid-request or idle."""
        if self._server is not None:
            self._server.close()
        for writer in self._connections:
            writer.transport.abort()

    async def wait_closed(self) -> None:
        """Until the connections' tasks have ended too: one left to the loop's end is cancelled
        there, which asyncio's streams (3.11) log as an error."""
        if self._server is not None:
            await self._server.wait_closed()
        if self._tasks:
            await asyncio.wait(self._tasks)

    def _name(self) -> str:
        sockets = self._server.sockets if self._server is not None else ()
        return ", ".join(str(s.getsockname()[:2]) for s in sockets) or "?"

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        if len(self._connections) >= self._max:
            if not self._idle:
                log.warning(
                    "HTTP on %s: %d connections, all busy: refusing a new one",
                    self._name(),
                    self._max,
                )
                return False
            oldest = next(iter(self._idle))
            log.warning(
                "HTTP on %s: %d connections: closing the one idle longest for a new one",
                self._name(),
                self._max,
            )
            self._forget(oldest)
            oldest.transport.abort()
        self._connections.add(writer)
        return True

    def _forget(self, writer: asyncio.StreamWriter) -> None:
        self._connections.discard(writer)
        self._idle.pop(writer, None)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None  # asyncio's streams run each connection in a task
        self._tasks.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=REQUEST_HEAD_LIMIT)
        try:
            while await self._exchange(conn, reader, writer):
                conn.start_next_cycle()
        except (OSError, TimeoutError):
            pass  # the client went away or stalled: its connection ends
        finally:
            # Still a descriptor, so still counted while it lingers; but idle: nothing of its
            # would be lost if a newcomer needs its place.
            self._idle[writer] = None
            await _linger(reader, writer)
            self._forget(writer)
            self._tasks.discard(task)

    async def _exchange(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answers one request; whether the connection carries another."""
        got = await self._read(conn, reader, writer)
        if got is None:
            return False
        request, refusal = got
        # A HEAD's answer has no body, whatever its status (h11 holds kpng to that).
        head_only = request is not None and request.method == b"HEAD"
        if refusal is not None or request is None:
            if refusal is not None and conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _send(conn, writer, refusal, head_only=head_only)
            return False
        method = request.method.decode("ascii")
        reply = await self._answer(method, request)
        try:
            await _send(conn, writer, reply, head_only=head_only)
        except h11.LocalProtocolError:
            # A handler's header h11 will not write (a line break in a value): kpng's bug.
            log.exception("answering %s %s", method, request.target[:80])
            return False
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    async def _read(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[h11.Request | None, Reply | None] | None:
        """The next request (None if its head was not read whole), its body read and dropped,
        and the answer refusing it if it is refused; None at a clean end of the connection.
        Refused requests are returned as soon as seen: their connection ends after the answer."""
        started = bool(conn.trailing_data[0])  # a pipelined request already read
        if not started:
            self._idle[writer] = None
        request: h11.Request | None = None
        async with asyncio.timeout(self._request_s if started else IDLE_S) as deadline:
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    # The peer's bytes, not kpng's fault: a line at DEBUG, and h11's status.
                    log.debug("HTTP from %s: %s", _peer(writer), exc)
                    return request, _plain(exc.error_status_hint)
                if event is h11.NEED_DATA:
                    data = await reader.read(_READ_SIZE)
                    if data and not started:
                        started = True
                        self._idle.pop(writer, None)
                        deadline.reschedule(asyncio.get_running_loop().time() + self._request_s)
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    request = event
                    refusal = _refusal(event)
                    if refusal is not None:
                        return request, refusal
                elif isinstance(event, h11.EndOfMessage) and request is not None:
                    return request, None
                elif isinstance(event, h11.ConnectionClosed):
                    return None

    async def _answer(self, method: str, request: h11.Request) -> Reply:
        target = request.target.decode("ascii")  # h11 takes visible ASCII only
        path, _, query_text = target.partition("?")
        handler = self._routes.get(path)
        if handler is None:
            if self._default is None:
                return _plain(404)
            handler = self._default
        elif method not in ("GET", "HEAD"):
            return _plain(405, Allow="GET, HEAD")
        query: dict[str, str] = {}
        for name, value in parse_qsl(query_text, keep_blank_values=True):
            query.setdefault(name, value)
        headers: dict[str, str] = {}
        for raw_name, raw_value in request.headers:
            key, text = raw_name.decode("ascii"), raw_value.decode("latin-1")
            # A field given more than once is one value, joined by ", " as RFC 9110 allows.
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        try:
            return await handler(Request(method, path, query, headers))
        except Exception:
            log.exception("answering %s %s", method, path)
            return _plain(500)


def _refusal(request: h11.Request) -> Reply | None:
    """The answer to a request refused from its head alone, None for one to answer."""
    path = request.target.partition(b"?")[0]
    if request.http_version not in _VERSIONS or not _PATH.fullmatch(path):
        return _plain(400)
    if any(name == b"transfer-encoding" for name, _ in request.headers):
        return _plain(411)  # a chunked body: no route takes a body worth streaming
    for name, value in request.headers:
        if name == b"content-length" and int(value) > BODY_LIMIT:  # h11 checked the digits
            return _plain(413)
    return None


def _plain(status: int, **headers: str) -> Reply:
    return Reply(status, f"{status}: {HTTPStatus(status).phrase}\n", headers=headers)


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[:2]) if isinstance(peer, tuple) else "?"


async def _send(
    conn: h11.Connection, writer: asyncio.StreamWriter, reply: Reply, *, head_only: bool
) -> None:
    """Writes ``reply``; one that ends the exchange early (a refusal) says it closes."""
    body = reply.body.encode() if isinstance(reply.body, str) else reply.body
    fields = {
        # RFC 9110 asks a server with a clock for a Date (Go's servers, kube-proxy's, send one).
        "Date": time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime()),
        "Content-Type": reply.content_type,
        "Content-Length": str(len(body)),
        **reply.headers,
    }
    if conn.their_state is not h11.DONE:
        fields["Connection"] = "close"
    phrase = HTTPStatus(reply.status).phrase.encode()
    data = conn.send(
        h11.Response(status_code=reply.status, headers=list(fields.items()), reason=phrase)
    )
    assert data is not None  # h11 returns None only for ConnectionClosed
    if not head_only:
        data += conn.send(h11.Data(data=body)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    writer.write(data)
    # A client that does not read its answer holds it in memory: not for longer than this.
    async with asyncio.timeout(IDLE_S):
        await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Ends the connection without losing the last answer: closing a socket with unread input
    (a request sent after ``Connection: close``, the rest of a refused head) resets it, and the
    reset can overtake the answer. So the sending side is shut first, and the input read until
    the client closes too, for a bounded time."""
    try:
        if not writer.transport.is_closing() and writer.can_write_eof():
            writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(_READ_SIZE):
                    pass
    except (OSError, TimeoutError):
        pass
    finally:
        writer.transport.abort()


async def serve(
    sock: socket.socket,
    routes: Mapping[str, Handler],
    *,
    default: Handler | None = None,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout: float = REQUEST_S,
) -> Listener:
    """Answers on ``sock``, a bound socket, until the listener is closed."""
    listener = Listener(
        routes, default=default, max_connections=max_connections, request_timeout=request_timeout
    )
    return await _start(listener, sock=sock)


async def serve_address(
    host: str | Sequence[str],
    port: int,
    routes: Mapping[str, Handler],
    *,
    default: Handler | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> Listener:
    """Answers on ``port`` of ``host`` (one address or several, one connection cap for all)
    until the listener is closed."""
    listener = Listener(routes, default=default, max_connections=max_connections)
    return await _start(listener, host=host, port=port, reuse_address=True)


async def _start(listener: Listener, **where: Any) -> Listener:
    listener._server = await asyncio.start_server(listener._connection, limit=_READ_SIZE, **where)
    return listener
