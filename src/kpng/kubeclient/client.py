"""kpng's client of the API server: one GET, one POST, and one streamed GET read line by line
(a watch), over ``kpng.http1``. Lines are split here from the raw chunks, with no cap: an
EndpointSlice with 1,000 endpoints is a single watch line of about 128 KiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import msgspec

from kpng.http1 import HttpClient, HttpError, Response
from kpng.kubeclient import metrics
from kpng.kubeclient.config import Connection
from kpng.logs import printable

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
_REQUEST_TIMEOUT_S = 60.0
MAX_BODY = 256 << 20
"""The largest answer kpng reads whole by default (a page of a list, 500 objects): an API
server's pages are a few MB; past this, the answer is refused (decoded, so a gzip bomb stops
here too). ``kpng kube --max-list-bytes``."""
MAX_LINE = 16 << 20
"""The longest watch event by default: one object (etcd stores at most 1.5 MiB of one).
``kpng kube --max-event-bytes``."""


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
        return ApiStatusError(status, printable(decoded.reason, 200), printable(decoded.message))
    except msgspec.DecodeError:
        return ApiStatusError(status, "", printable(body[:200].decode(errors="replace").strip()))


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
    """Connections that carry one client certificate."""

    http: HttpClient
    in_flight: int = 0


class ApiClient:
    """Requests to one API server; use as an async context manager. ``max_body``: the largest
    answer read whole (decoded); ``max_line``: the longest line of a streamed one."""

    def __init__(
        self, connection: Connection, *, max_body: int = MAX_BODY, max_line: int = MAX_LINE
    ) -> None:
        self.connection = connection
        self._max_body = max_body
        self._max_line = max_line
        self._session: _Session | None = None
        self._retired: list[_Session] = []
        """Sessions of replaced client certificates, closed once their last request ends."""
        self._requests = metrics.for_server(connection.server)

    def _open(self) -> _Session:
        http = HttpClient(
            ssl_context=self.connection.ssl_context,
            proxy=self.connection.proxy,
            connect_timeout=_CONNECT_TIMEOUT_S,
        )
        return _Session(http)

    async def __aenter__(self) -> ApiClient:
        self._session = self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        sessions, self._retired = self._retired, []
        if self._session is not None:
            sessions.append(self._session)
            self._session = None
        for session in sessions:
            await session.http.close()

    async def _current(self) -> _Session:
        """The session for a new request. The server checks the client certificate on every
        request, also over a kept-alive connection: once the certificate changes, requests need
        new connections, hence a new session. Requests in flight (watches) end on the old one."""
        assert self._session is not None
        self.connection.refresh_client_certificate()
        if self.connection.ssl_context is not self._session.http.ssl_context:
            self._retired.append(self._session)
            self._session = self._open()
        idle = [s for s in self._retired if s.in_flight == 0]
        self._retired = [s for s in self._retired if s.in_flight > 0]
        for session in idle:
            await session.http.close()
        return self._session

    @contextlib.asynccontextmanager
    async def _request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        body: bytes | None = None,
        *,
        stream: bool = False,
    ) -> AsyncIterator[Response]:
        """One request with the connection's headers, proxy and TLS name; its response's body
        must be read within the block. Counted as client-go counts: by the status of its answer
        or as having none, and timed to the end of the block, or for a ``stream`` (a watch,
        which lasts minutes) to the answer's head."""
        requests = self._requests
        start = time.monotonic()
        head = False
        try:
            # Headers first: an exec plugin run for them may bring a new client certificate.
            headers = await self._headers()
            if body is not None:
                headers["Content-Type"] = "application/json"
            session = await self._current()
            session.in_flight += 1
            try:
                async with session.http.request(
                    method,
                    self.connection.server + path,
                    params=params,
                    headers=headers,
                    body=body,
                    server_hostname=self.connection.tls_server_name,
                ) as response:
                    head = True
                    requests.answered(method, response.status)
                    if stream:
                        requests.took(method, time.monotonic() - start)
                    yield response
            finally:
                session.in_flight -= 1
        finally:
            if not head:
                requests.answered(method, metrics.NO_ANSWER)
            if not (head and stream):
                requests.took(method, time.monotonic() - start)

    async def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "kpng"}
        authorization = await self.connection.authorization()
        if authorization:
            headers["Authorization"] = authorization
        return headers

    def _describe(self, exc: BaseException) -> str:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return f"TLS verification of {self.connection.server} failed: {exc.verify_message}"
        if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.errno:
            return f"cannot connect to {self.connection.server}: {os.strerror(exc.errno)}"
        if isinstance(exc, TimeoutError):
            return f"{self.connection.server}: timed out"
        return f"{self.connection.server}: {exc.__class__.__name__}: {exc}".rstrip(": ")

    async def get(self, path: str, params: Mapping[str, str]) -> bytes:
        """The body of a successful GET; raises ApiStatusError or TransportError."""
        return await self._whole("GET", path, params, None, (200,))

    async def post(self, path: str, body: bytes) -> bytes:
        """The body of a successful POST of a JSON ``body`` (a create: 200 or 201); raises
        ApiStatusError or TransportError."""
        return await self._whole("POST", path, None, body, (200, 201))

    async def _whole(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None,
        body: bytes | None,
        success: tuple[int, ...],
    ) -> bytes:
        try:
            async with (
                asyncio.timeout(_REQUEST_TIMEOUT_S),
                self._request(method, path, params, body) as response,
            ):
                answer = await response.read(limit=self._max_body)
        except (HttpError, OSError, ValueError) as exc:  # OSError: TimeoutError too
            raise TransportError(self._describe(exc)) from exc
        if response.status not in success:
            self._note_status(response.status)
            raise _status_error(response.status, answer)
        return answer

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
        async with contextlib.AsyncExitStack() as stack:
            try:
                async with asyncio.timeout(_CONNECT_TIMEOUT_S + idle_timeout):
                    response = await stack.enter_async_context(
                        self._request("GET", path, params, stream=True)
                    )
            except (HttpError, OSError, ValueError) as exc:
                raise TransportError(self._describe(exc)) from exc
            if response.status != 200:
                self._note_status(response.status)
                try:
                    async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                        body = await response.read(limit=self._max_body)
                except (HttpError, OSError) as exc:
                    raise TransportError(self._describe(exc)) from exc
                raise _status_error(response.status, body)
            yield self._lines(response, idle_timeout)

    async def _lines(self, response: Response, idle_timeout: float) -> AsyncIterator[list[bytes]]:
        splitter = WatchLineSplitter()
        chunks = aiter(response.chunks())
        while True:
            try:
                async with asyncio.timeout(idle_timeout):
                    chunk = await anext(chunks, b"")
            except TimeoutError as exc:
                raise StreamIdle(
                    f"{self.connection.server}: no data for {idle_timeout:g} s"
                ) from exc
            except (HttpError, OSError) as exc:
                raise TransportError(self._describe(exc)) from exc
            if not chunk:
                break
            lines = splitter.feed(chunk)
            limit = self._max_line
            if splitter.pending > limit or any(len(line) > limit for line in lines):
                raise TransportError(
                    f"{self.connection.server}: a watch event longer than {limit} bytes"
                )
            if lines:
                yield lines
        if splitter.pending:
            log.debug("stream ended inside a line (%d bytes dropped)", splitter.pending)
