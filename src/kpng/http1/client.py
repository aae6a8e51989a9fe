"""An HTTP/1.1 client with kept-alive connections, TLS, an HTTP(S) proxy and gzip.

What it does not do, because kpng never asks: redirects, cookies, HTTP/2, request bodies of
unknown length, SOCKS proxies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
import time
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlencode, urlsplit

from kpng.http1._head import HttpError, encode_fields, keeps_alive, parse_head, read_head

__all__ = ["HttpClient", "HttpError", "Response"]

HEAD_LIMIT = 256 * 1024
"""The longest response head read, in bytes (the streams' buffer limit): the API server's have a
few hundred bytes."""

_READ_SIZE = 256 * 1024
"""The most one read of a body takes at once: a watch's events come as they arrive, in pieces
of up to this."""

IDLE_KEEP_S = 15.0
"""How long a connection waits unused for its next request before it is closed."""

DEFAULT_PORTS = {"http": 80, "https": 443}
"""Each scheme's port when a URL names none."""


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

    def __init__(
        self,
        connection: _Connection,
        version: str,
        status: int,
        headers: dict[str, str],
        *,
        bodiless: bool,
    ) -> None:
        self.status = status
        self.headers = headers
        self._connection = connection
        self._keep = keeps_alive(version, headers)
        self._bodiless = bodiless
        self.complete = bodiless
        """The whole body has been read: the connection may carry another request."""

    @property
    def reusable(self) -> bool:
        return self.complete and self._keep

    async def read(self, *, limit: int | None = None) -> bytes:
        """The whole body, decoded; HttpError once it passes ``limit`` bytes (decoded: a small
        gzip body can inflate to gigabytes), before the rest is read."""
        pieces, size = [], 0
        async for piece in self.chunks():
            size += len(piece)
            if limit is not None and size > limit:
                self._keep = False
                raise HttpError(f"a body larger than {limit} bytes")
            pieces.append(piece)
        return b"".join(pieces)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, decoded (gzip); ends at the body's end. Raises HttpError or
        OSError if the connection breaks first."""
        if self._bodiless:
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
        reader = self._connection.reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                line = await _line(reader)
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise HttpError(f"a malformed chunk size {line[:40]!r}") from None
                if size == 0:
                    while await _line(reader):  # trailer fields, unused
                        pass
                    return
                async for piece in _exactly(reader, size):
                    yield piece
                if await _line(reader):
                    raise HttpError("a chunk longer than its size")
        elif "content-length" in self.headers:
            text = self.headers["content-length"]
            # ASCII digits only: str.isdigit() takes "²", which int() then refuses.
            if not (text.isascii() and text.isdigit()):
                raise HttpError(f"a malformed Content-Length {text[:40]!r}")
            length = int(text)
            async for piece in _exactly(reader, length):
                yield piece
        else:  # the body ends with the connection
            self._keep = False
            while piece := await reader.read(_READ_SIZE):
                yield piece


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        return (await reader.readuntil(b"\r\n"))[:-2]
    except asyncio.IncompleteReadError:
        raise HttpError("the connection closed inside a chunked body") from None
    except asyncio.LimitOverrunError:
        raise HttpError("a chunk header line too long") from None


async def _exactly(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
    while length > 0:
        piece = await reader.read(min(length, _READ_SIZE))
        if not piece:
            raise HttpError(f"the connection closed {length} bytes before the body's end")
        length -= len(piece)
        yield piece


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
        message = f"{method} {target} HTTP/1.1\r\n".encode() + encode_fields(fields) + b"\r\n"
        message += body or b""
        response = await self._exchange(origin, method, message)
        connection = response._connection
        try:
            yield response
        finally:
            self._busy.discard(connection)
            if response.reusable and connection.usable():
                connection.idle_since = time.monotonic()
                connection.reused = True
                self._idle.append(connection)
            else:
                connection.abort()

    async def _exchange(self, origin: _Origin, method: str, message: bytes) -> Response:
        connection = await self._connection(origin)
        try:
            return await self._send(connection, method, message)
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
            return await self._send(connection, method, message)
        except BaseException:
            self._drop(connection)
            raise

    def _drop(self, connection: _Connection) -> None:
        connection.abort()
        self._busy.discard(connection)

    async def _send(self, connection: _Connection, method: str, message: bytes) -> Response:
        connection.writer.write(message)
        await connection.writer.drain()
        while True:
            head = await read_head(connection.reader)
            if not head:
                raise HttpError("the server closed the connection before answering")
            start, headers = parse_head(head)
            version, _, rest = start.partition(" ")
            code = rest.partition(" ")[0]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise HttpError(f"not an HTTP/1 status line: {start[:80]!r}")
            status = int(code)
            if not 100 <= status < 200:  # interim answers (103 Early Hints) come before the one
                break
        bodiless = method == "HEAD" or status in (204, 304)
        return Response(connection, version, status, headers, bodiless=bodiless)

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
        fields = encode_fields({"Host": authority, **self.authorization()})
        writer.write(f"CONNECT {authority} HTTP/1.1\r\n".encode() + fields + b"\r\n")
        await writer.drain()
        head = await read_head(reader)
        start = parse_head(head)[0] if head else ""
        # A 2xx to CONNECT has no body: what follows is the server's.
        if not start.partition(" ")[2].startswith("2"):
            raise HttpError(f"the proxy {self.host}:{self.port} refused the tunnel: {start!r}")
