"""An HTTP/1.1 client with kept-alive connections, TLS, an HTTP(S) proxy and gzip.

h11 parses the answers and frames the requests, as it does for kpng's server: a hand parser took
``HTTP/1.9``, a CR or a NUL in a header value and other answers no server should send (issue
40); h11 refuses them, and each refusal is an HttpError. The connections, their reuse, the
tunnel and the bounds are kpng's own.

What it does not do, because kpng never asks: redirects, cookies, HTTP/2, request bodies of
unknown length, SOCKS proxies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlencode, urlsplit

import h11

__all__ = ["HttpClient", "HttpError", "Response"]

HEAD_LIMIT = 256 * 1024
"""The longest response head read, in bytes (the streams' buffer limit, and h11's bound on a
chunk's size line and the trailer fields): the API server's have a few hundred bytes."""

_READ_SIZE = 256 * 1024
"""The most one read of a body takes at once: a watch's events come as they arrive, in pieces
of up to this."""

IDLE_KEEP_S = 15.0
"""How long a connection waits unused for its next request before it is closed."""

DEFAULT_PORTS = {"http": 80, "https": 443}
"""Each scheme's port when a URL names none."""

_VERSIONS = (b"1.0", b"1.1")
"""The versions an answer may have: h11 takes any digit.digit, ``HTTP/1.9`` and ``HTTP/2.0``
too, whose framing kpng cannot know."""
_HEAD_END = re.compile(rb"\n\r?\n")
"""Where h11 ends a head: at the first blank line, CRLF or bare LF."""
_FOLD = re.compile(rb"\n[ \t]")


class HttpError(Exception):
    """A peer broke the protocol: a malformed head, a body cut short, a refused tunnel."""


_Event = h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]
"""What h11's next_event gives."""


def _parser() -> h11.Connection:
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=HEAD_LIMIT)


def _next_event(parser: h11.Connection) -> _Event:
    try:
        return parser.next_event()
    except h11.RemoteProtocolError as exc:
        raise HttpError(f"a malformed answer: {exc}") from None


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """The next head, up to and including its blank line, read exactly: the bytes after it are
    the body's, or, after a CONNECT, the tunnel's."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise HttpError("the server closed the connection before answering") from None
        raise HttpError("the connection closed inside a response head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"a response head longer than {HEAD_LIMIT} bytes") from None
    # h11 joins a folded field's lines (RFC 9112 lets a user agent); kpng refuses the fold, as
    # it always did: no API server or proxy folds, and a value read as one field here may be
    # read as two by a proxy in between.
    end = _HEAD_END.search(head)
    if _FOLD.search(head, 0, end.start() if end else len(head)):
        raise HttpError("a header field folded over lines (obs-fold)")
    return head


async def _read_answer(parser: h11.Connection, reader: asyncio.StreamReader) -> h11.Response:
    """The head of the final answer; interim ones (100 Continue, 103 Early Hints) are skipped."""
    while True:
        event = _next_event(parser)
        if event is h11.NEED_DATA:
            parser.receive_data(await _read_head(reader))
        elif isinstance(event, h11.InformationalResponse | h11.Response):
            if event.http_version not in _VERSIONS:
                version = event.http_version.decode("ascii")  # h11 took [0-9].[0-9] only
                raise HttpError(f"an answer in HTTP/{version}, not HTTP/1.1")
            if isinstance(event, h11.Response):
                return event
        else:  # ConnectionClosed cannot come: _read_head raises at the end of the stream
            raise HttpError(f"an unexpected {type(event).__name__} instead of an answer")


def _encoded_fields(fields: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Header fields as h11 takes them. A value with a line break would start a header of its
    own (request smuggling): refused here, by name, before h11 refuses it less clearly."""
    out = []
    for name, value in fields.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"a line break in the header field {name!r}")
        out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int
    server_hostname: str | None

    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


@dataclass(eq=False)
class _Connection:
    origin: _Origin
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    parser: h11.Connection = field(default_factory=_parser)
    reused: bool = False
    idle_since: float = field(default_factory=time.monotonic)

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.transport.is_closing()

    def abort(self) -> None:
        # Abort, not close: a polite TLS close waits for the peer's answer, and before CPython
        # 3.12.8 a TLS transport lost while closing leaks its socket (python/cpython#118960).
        self.writer.transport.abort()


class Response:
    """A response whose head has been read; its body is read with ``read`` or ``chunks``, once."""

    def __init__(self, connection: _Connection, head: h11.Response, first: _Event) -> None:
        self.status = head.status_code
        self.headers: dict[str, str] = {}
        """The header fields by lower-case name; a field given more than once is one value,
        joined by ", " as RFC 9110 allows."""
        for name, value in head.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text
        self._connection = connection
        self._first: _Event | None = first
        """The body's first event, taken to know a bodiless answer complete at once."""
        self.complete = isinstance(first, h11.EndOfMessage)
        """The whole body has been read: the connection may carry another request."""

    @property
    def reusable(self) -> bool:
        parser = self._connection.parser
        # Bytes past the answer's end would be taken for the next request's answer.
        return (
            self.complete
            and parser.our_state is h11.DONE
            and parser.their_state is h11.DONE
            and not parser.trailing_data[0]
        )

    async def read(self, *, limit: int | None = None) -> bytes:
        """The whole body, decoded; HttpError once it passes ``limit`` bytes (decoded: a small
        gzip body can inflate to gigabytes), before the rest is read."""
        pieces, size = [], 0
        async for piece in self.chunks():
            size += len(piece)
            if limit is not None and size > limit:
                raise HttpError(f"a body larger than {limit} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, decoded (gzip); ends at the body's end. Raises HttpError or
        OSError if the connection breaks first."""
        if self.complete:
            return
        encoding = self.headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", "gzip"):
            raise HttpError(f"a body in the unasked encoding {encoding!r}")
        inflate = zlib.decompressobj(wbits=31) if encoding == "gzip" else None
        try:
            async for raw in self._framed():
                if inflate is None:
                    yield raw
                    continue
                # At most a read's worth inflated at a time: the caller stops a bomb between.
                data = raw
                while data:
                    piece = inflate.decompress(data, _READ_SIZE)
                    data = inflate.unconsumed_tail
                    if piece:
                        yield piece
            if inflate is not None:
                rest = inflate.flush()
                if not inflate.eof:
                    raise HttpError("a gzip body cut short")
                if rest:
                    yield rest
        except zlib.error as exc:
            raise HttpError(f"a corrupt gzip body: {exc}") from None
        self.complete = True

    async def _framed(self) -> AsyncIterator[bytes]:
        """The body's bytes as h11 unframes them (Content-Length, chunked, or to the end of
        the connection), a read's worth at most at a time."""
        parser, reader = self._connection.parser, self._connection.reader
        while True:
            if self._first is not None:
                event, self._first = self._first, None
            else:
                event = _next_event(parser)
            if event is h11.NEED_DATA:
                parser.receive_data(await reader.read(_READ_SIZE))
            elif isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:  # ConnectionClosed: h11 reports a body cut short as an error first
                raise HttpError(f"an unexpected {type(event).__name__} inside the body")


class HttpClient:
    """Requests to HTTP or HTTPS servers over kept-alive connections.

    ``ssl_context`` verifies servers (and carries a client certificate): one client per context.
    ``proxy`` is an ``http(s)://[user:password@]host:port`` proxy that every request goes
    through (a CONNECT tunnel for HTTPS). An ``https://`` proxy is verified with
    ``ssl_context``, as Go's client verifies it with the transport's TLS settings.
    ``connect_timeout`` bounds the TCP connect, the tunnel and the TLS handshake together; the
    rest of a request is bounded by its caller.
    """

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None,
        proxy: str | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self.ssl_context = ssl_context
        self._default_tls: ssl.SSLContext | None = None
        """The system's CAs, for TLS without ``ssl_context``: loaded once, at first use (the
        bundle takes some 45 ms to load)."""
        self._proxy = _Proxy.parse(proxy) if proxy else None
        self._connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()

    @contextlib.asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        body: bytes | None = None,
        server_hostname: str | None = None,
    ) -> AsyncIterator[Response]:
        """The response to one request, whose body must be read within the block for its
        connection to serve another request. ``server_hostname``: the name the server's
        certificate is checked against, if not the URL's host."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        origin = _Origin(
            parts.scheme,
            parts.hostname,
            parts.port or DEFAULT_PORTS[parts.scheme],
            server_hostname,
        )
        target = parts.path or "/"
        query = "&".join(q for q in (parts.query, urlencode(params or {})) if q)
        if query:
            target += "?" + query
        fields = {"Host": origin.authority(), "Accept-Encoding": "gzip", **(headers or {})}
        if body is not None:
            fields["Content-Length"] = str(len(body))
        if self._proxy is not None and origin.scheme == "http":
            target = f"http://{origin.authority()}{target}"  # absolute form, to the proxy
            fields.update(self._proxy.authorization())
        try:
            events: list[h11.Event] = [
                h11.Request(method=method, target=target, headers=_encoded_fields(fields))
            ]
        except h11.LocalProtocolError as exc:  # a method, target or field h11 will not send
            raise ValueError(f"a request that cannot be sent: {exc}") from None
        if body:
            events.append(h11.Data(data=body))
        events.append(h11.EndOfMessage())
        response = await self._exchange(origin, method, events)
        connection = response._connection
        try:
            yield response
        finally:
            self._busy.discard(connection)
            if response.reusable and connection.usable():
                connection.parser.start_next_cycle()
                connection.idle_since = time.monotonic()
                connection.reused = True
                self._idle.append(connection)
            else:
                connection.abort()

    async def _exchange(self, origin: _Origin, method: str, events: list[h11.Event]) -> Response:
        connection = await self._connection(origin)
        try:
            return await self._send(connection, events)
        except (OSError, HttpError):
            self._drop(connection)
            # A kept-alive connection the server closed meanwhile fails before any answer: a
            # request that changes nothing is sent again once, on a new connection.
            if not (method in ("GET", "HEAD") and connection.reused):
                raise
        except BaseException:
            self._drop(connection)
            raise
        connection = await self._connection(origin, fresh=True)
        try:
            return await self._send(connection, events)
        except BaseException:
            self._drop(connection)
            raise

    def _drop(self, connection: _Connection) -> None:
        connection.abort()
        self._busy.discard(connection)

    async def _send(self, connection: _Connection, events: list[h11.Event]) -> Response:
        parser = connection.parser
        connection.writer.write(b"".join(parser.send(event) or b"" for event in events))
        await connection.writer.drain()
        head = await _read_answer(parser, connection.reader)
        # A bodiless answer (to a HEAD, a 204, a 304, a Content-Length of 0) ends with its head:
        # h11 says so at once, without a read.
        return Response(connection, head, _next_event(parser))

    async def _connection(self, origin: _Origin, *, fresh: bool = False) -> _Connection:
        now = time.monotonic()
        keep: list[_Connection] = []
        found: _Connection | None = None
        for c in self._idle:
            if not c.usable() or now - c.idle_since > IDLE_KEEP_S:
                c.abort()
            elif found is None and not fresh and c.origin == origin:
                found = c
            else:
                keep.append(c)
        self._idle = keep
        if found is None:
            async with asyncio.timeout(self._connect_timeout):
                found = await self._open(origin)
        self._busy.add(found)
        return found

    async def _open(self, origin: _Origin) -> _Connection:
        tls = origin.scheme == "https"
        context = self._tls() if tls else None
        name = origin.server_hostname or origin.host
        if self._proxy is None:
            reader, writer = await asyncio.open_connection(
                origin.host,
                origin.port,
                ssl=context,
                server_hostname=name if tls else None,
                limit=HEAD_LIMIT,
            )
            return _Connection(origin, reader, writer)
        proxy_tls = self._tls() if self._proxy.tls else None
        reader, writer = await asyncio.open_connection(
            self._proxy.host,
            self._proxy.port,
            ssl=proxy_tls,
            server_hostname=self._proxy.host if proxy_tls else None,
            limit=HEAD_LIMIT,
        )
        try:
            if context is not None:
                await self._proxy.tunnel(reader, writer, origin.authority())
                await writer.start_tls(context, server_hostname=name)
        except BaseException:
            writer.transport.abort()
            raise
        return _Connection(origin, reader, writer)

    def _tls(self) -> ssl.SSLContext:
        if self.ssl_context is not None:
            return self.ssl_context
        if self._default_tls is None:
            self._default_tls = ssl.create_default_context()
        return self._default_tls

    async def close(self) -> None:
        """Ends every connection, idle or in use."""
        for c in [*self._idle, *self._busy]:
            c.abort()
        self._idle.clear()
        self._busy.clear()
        await asyncio.sleep(0)  # the transports' connection_lost callbacks run


@dataclass(frozen=True)
class _Proxy:
    host: str
    port: int
    tls: bool
    credentials: str | None

    @classmethod
    def parse(cls, url: str) -> _Proxy:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"only http:// and https:// proxies are supported, not {url!r}")
        credentials = None
        if parts.username is not None:
            user_password = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            credentials = base64.b64encode(user_password.encode()).decode()
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or DEFAULT_PORTS[parts.scheme], tls, credentials)

    def authorization(self) -> dict[str, str]:
        if self.credentials is None:
            return {}
        return {"Proxy-Authorization": f"Basic {self.credentials}"}

    async def tunnel(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, authority: str
    ) -> None:
        parser = _parser()
        fields = _encoded_fields({"Host": authority, **self.authorization()})
        try:
            request = h11.Request(method="CONNECT", target=authority, headers=fields)
        except h11.LocalProtocolError as exc:
            raise ValueError(f"a tunnel that cannot be asked for: {exc}") from None
        writer.write((parser.send(request) or b"") + (parser.send(h11.EndOfMessage()) or b""))
        await writer.drain()
        answer = await _read_answer(parser, reader)
        if not 200 <= answer.status_code < 300:
            version, reason = answer.http_version.decode(), answer.reason.decode("latin-1")
            start = f"HTTP/{version} {answer.status_code} {reason}"
            raise HttpError(f"the proxy {self.host}:{self.port} refused the tunnel: {start!r}")
        # A 2xx to CONNECT has no body, and h11 has switched to the tunnel: what follows is the
        # server's TLS, which waits for the client's hello. Bytes already there would be lost.
        if parser.trailing_data[0]:
            raise HttpError(f"the proxy {self.host}:{self.port} sent bytes ahead of the tunnel")
