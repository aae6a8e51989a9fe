"""kpng's HTTP client of the API server: one GET, and one streamed GET read line by line.

aiohttp's own ``readline`` refuses lines longer than its buffer limit (128 KiB by default); an
EndpointSlice with 1,000 endpoints is a single watch line of about that size, so lines are split
here from the raw chunks, with no cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
import msgspec

from kpng.kubeclient.config import Connection

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
# Before CPython 3.12.8 and in 3.13.0, asyncio can leak the socket of a TLS connection that is
# lost while it closes (fixed by python/cpython pull request 118960): each API server outage would
# cost file descriptors. aiohttp aborts such transports itself when asked (and warns if asked on a
# fixed version).
_ASYNCIO_LEAKS_SSL_TRANSPORTS = sys.version_info < (3, 12, 8) or (
    (3, 13, 0) <= sys.version_info < (3, 13, 1)
)
_REQUEST_TIMEOUT_S = 60.0


class ApiStatus(msgspec.Struct, tag_field="kind", tag="Status"):
    """The API's error object (metav1.Status)."""

    code: int = 0
    reason: str = ""
    message: str = ""


_status_decoder = msgspec.json.Decoder(ApiStatus)


class TransportError(Exception):
    """The API server could not be reached or the connection broke."""


class StreamIdle(TransportError):
    """A stream delivered nothing for its idle timeout: it is taken as dead."""


class ApiStatusError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"HTTP {status} {reason}: {message}".rstrip(": "))


def _status_error(status: int, body: bytes) -> ApiStatusError:
    try:
        decoded = _status_decoder.decode(body)
        return ApiStatusError(status, decoded.reason, decoded.message)
    except msgspec.DecodeError:
        return ApiStatusError(status, "", body[:200].decode(errors="replace").strip())


class WatchLineSplitter:
    """Splits a byte stream into lines. Linear in the stream's size: a chunk without a newline
    is only appended, so a long line is not rescanned as it grows."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        """The complete, non-blank lines that ``chunk`` completes."""
        if b"\n" not in chunk:
            self._buffer += chunk
            return []
        self._buffer += chunk
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = rest
        return [bytes(line) for line in lines if line.strip()]

    @property
    def pending(self) -> int:
        """Bytes of an incomplete last line."""
        return len(self._buffer)


@dataclass(eq=False)
class _Session:
    """An aiohttp session, whose pooled connections carry one client certificate."""

    http: aiohttp.ClientSession
    ssl_context: ssl.SSLContext | None
    in_flight: int = 0


async def _close(session: _Session) -> None:
    # Abort rather than shut TLS down politely: the polite close waits for the server's reply,
    # and an event loop that stops first leaks the sockets.
    if session.http.connector is not None:
        await session.http.connector.close(abort_ssl=True)
    await session.http.close()


class ApiClient:
    """Requests to one API server; use as an async context manager."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._session: _Session | None = None
        self._retired: list[_Session] = []
        """Sessions of replaced client certificates, closed once their last request ends."""

    def _open(self) -> _Session:
        context = self.connection.ssl_context
        connector = aiohttp.TCPConnector(
            ssl=context if context is not None else False,
            enable_cleanup_closed=_ASYNCIO_LEAKS_SSL_TRANSPORTS,
        )
        # raise_for_status off: error bodies are Status objects worth reading.
        return _Session(aiohttp.ClientSession(connector=connector, auto_decompress=True), context)

    async def __aenter__(self) -> ApiClient:
        self._session = self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        sessions, self._retired = self._retired, []
        if self._session is not None:
            sessions.append(self._session)
            self._session = None
        for session in sessions:
            await _close(session)

    async def _current(self) -> _Session:
        """The session for a new request. The server checks the client certificate on every
        request, also over a kept-alive connection: once the certificate changes, requests need
        new connections, hence a new session. Requests in flight (watches) end on the old one."""
        assert self._session is not None
        self.connection.refresh_client_certificate()
        if self.connection.ssl_context is not self._session.ssl_context:
            self._retired.append(self._session)
            self._session = self._open()
        idle = [s for s in self._retired if s.in_flight == 0]
        self._retired = [s for s in self._retired if s.in_flight > 0]
        for session in idle:
            await _close(session)
        return self._session

    @contextlib.asynccontextmanager
    async def _request(self) -> AsyncIterator[tuple[_Session, dict[str, str]]]:
        """The session and headers of one request, which must end within the block."""
        # Headers first: an exec plugin run for them may bring a new client certificate.
        headers = await self._headers()
        session = await self._current()
        session.in_flight += 1
        try:
            yield session, headers
        finally:
            session.in_flight -= 1

    async def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "kpng"}
        authorization = await self.connection.authorization()
        if authorization:
            headers["Authorization"] = authorization
        return headers

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return f"TLS verification of {self.connection.server} failed: {exc.certificate_error}"
        if isinstance(exc, aiohttp.ClientConnectorError):
            error = exc.os_error
            reason = os.strerror(error.errno) if error.errno else (error.strerror or str(exc))
            return f"cannot connect to {self.connection.server}: {reason}"
        if isinstance(exc, asyncio.TimeoutError | TimeoutError):
            return f"{self.connection.server}: timed out"
        return f"{self.connection.server}: {exc.__class__.__name__}: {exc}".rstrip(": ")

    async def get(self, path: str, params: Mapping[str, str]) -> bytes:
        """The body of a successful GET; raises ApiStatusError or TransportError."""
        timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S)
        try:
            async with (
                self._request() as request,
                await self._get(request, path, params, timeout) as response,
            ):
                body = await response.read()
                if response.status != 200:
                    self._note_status(response.status)
                    raise _status_error(response.status, body)
                return body
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise TransportError(self._describe(exc)) from exc

    async def post(self, path: str, body: bytes) -> bytes:
        """The body of a successful POST of a JSON ``body`` (a create: 200 or 201); raises
        ApiStatusError or TransportError."""
        timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S, connect=_CONNECT_TIMEOUT_S)
        try:
            async with (
                self._request() as (session, headers),
                session.http.post(
                    self.connection.server + path,
                    data=body,
                    headers={**headers, "Content-Type": "application/json"},
                    timeout=timeout,
                    proxy=self.connection.proxy,
                    server_hostname=self.connection.tls_server_name,
                ) as response,
            ):
                answer = await response.read()
                if response.status not in (200, 201):
                    self._note_status(response.status)
                    raise _status_error(response.status, answer)
                return answer
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise TransportError(self._describe(exc)) from exc

    async def _get(
        self,
        request: tuple[_Session, dict[str, str]],
        path: str,
        params: Mapping[str, str],
        limits: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        """One GET with the connection's headers, proxy and TLS name (responses must be
        released: ``async with`` or ``release()``)."""
        session, headers = request
        return await session.http.get(
            self.connection.server + path,
            params=dict(params),
            headers=headers,
            timeout=limits,
            proxy=self.connection.proxy,
            server_hostname=self.connection.tls_server_name,
        )

    def _note_status(self, status: int) -> None:
        if status == 401:
            self.connection.credentials_rejected()

    @contextlib.asynccontextmanager
    async def stream_lines(
        self, path: str, params: Mapping[str, str], *, idle_timeout: float
    ) -> AsyncIterator[AsyncIterator[list[bytes]]]:
        """A streamed GET whose body is yielded as the lists of complete lines each network read
        completes. ``idle_timeout``: the stream is considered dead after so long without data
        (StreamIdle once its headers have come, TransportError before)."""
        timeout = aiohttp.ClientTimeout(
            total=None, connect=_CONNECT_TIMEOUT_S, sock_read=idle_timeout
        )
        async with contextlib.AsyncExitStack() as stack:
            try:
                request = await stack.enter_async_context(self._request())
                response = await self._get(request, path, params, timeout)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise TransportError(self._describe(exc)) from exc
            try:
                if response.status != 200:
                    self._note_status(response.status)
                    try:
                        body = await response.read()
                    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                        raise TransportError(self._describe(exc)) from exc
                    raise _status_error(response.status, body)
                yield self._lines(response, idle_timeout)
            finally:
                response.release()

    async def _lines(
        self, response: aiohttp.ClientResponse, idle_timeout: float
    ) -> AsyncIterator[list[bytes]]:
        splitter = WatchLineSplitter()
        while True:
            try:
                # A timer of our own, besides aiohttp's sock_read: aiohttp stops that one while
                # it holds reading paused (flow control) and once the peer's EOF arrives, so a
                # stream wedged in either state would never time out.
                async with asyncio.timeout(idle_timeout):
                    chunk = await response.content.readany()
            except TimeoutError as exc:  # ours, or aiohttp's sock_read (a TimeoutError too)
                raise StreamIdle(
                    f"{self.connection.server}: no data for {idle_timeout:g} s"
                ) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise TransportError(self._describe(exc)) from exc
            if not chunk:
                break
            lines = splitter.feed(chunk)
            if lines:
                yield lines
        if splitter.pending:
            log.debug("stream ended inside a line (%d bytes dropped)", splitter.pending)
