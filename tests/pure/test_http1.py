"""kpng.http1 over real loopback sockets: the client against servers scripted byte by byte (and a
real TLS server, a real CONNECT proxy), the server against raw requests and against the client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import re
import socket
import ssl
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kpng.http1 import HttpClient, HttpError, Reply, Request, serve
from kpng.http1 import server as http_server
from kpng.http1.client import HEAD_LIMIT
from rig.cluster import Pki, make_pki
from tests.proxying import ConnectProxy

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """A loopback server that runs ``script`` on each connection and notes what it was sent."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def head(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        return head

    @contextlib.asynccontextmanager
    async def running(self, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ssl_context)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        finally:
            server.close()


def _ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), b"".join(extra), body)


def test_a_kept_alive_connection_carries_the_next_request() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await server.head(reader)
            writer.write(_ok(head.split(b" ")[1]))

    server = Scripted(script)

    async def scenario() -> list[bytes]:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            bodies = []
            for path in ("/a", "/b?x=1"):
                async with client.request("GET", url + path, params={"y": "2 3"}) as response:
                    assert response.status == 200
                    bodies.append(await response.read())
            await client.close()
            return bodies

    assert asyncio.run(scenario()) == [b"/a?y=2+3", b"/b?x=1&y=2+3"]
    assert server.connections == 1
    first = server.heads[0]
    assert first.startswith(b"GET /a?y=2+3 HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in first
    assert b"\r\nAccept-Encoding: gzip\r\n" in first


def test_a_chunked_gzip_body_is_decoded_as_its_chunks_arrive() -> None:
    """Each chunk is delivered before the server sends the next (a watch's events must not wait
    for the ones after them); chunk extensions and trailers are skipped."""
    sent_second = asyncio.Event()
    # A gzip stream flushed after the first line: its first part decompresses to that line.
    compressor = zlib.compressobj(wbits=31)
    first = compressor.compress(b"first line\n") + compressor.flush(zlib.Z_SYNC_FLUSH)
    rest = compressor.compress(b"second line\n") + compressor.flush()
    pieces: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Encoding: gzip\r\n\r\n"
        )
        writer.write(b"%x;ext=1\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        await asyncio.wait_for(sent_second.wait(), 10)
        writer.write(b"%x\r\n%s\r\n0\r\nTrailer: x\r\n\r\n" % (len(rest), rest))
        await writer.drain()
        await reader.read()

    server = Scripted(script)

    async def scenario() -> None:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            async with client.request("GET", url + "/w") as response:
                async for piece in response.chunks():
                    pieces.append(piece)
                    sent_second.set()
                assert response.reusable
            await client.close()

    asyncio.run(scenario())
    assert pieces == [b"first line\n", b"second line\n"]


def test_a_body_without_a_length_ends_with_its_connection_which_is_not_reused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server = Scripted(script)

    async def scenario() -> list[bytes]:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            bodies = []
            for _ in range(2):
                async with client.request("GET", url + "/") as response:
                    bodies.append(await response.read())
            await client.close()
            return bodies

    assert asyncio.run(scenario()) == [b"all of it", b"all of it"]
    assert server.connections == 2


@pytest.mark.parametrize(("method", "retried"), [("GET", True), ("POST", False)])
def test_a_kept_alive_connection_the_server_dropped_is_retried_only_for_a_get(
    method: str, retried: bool
) -> None:
    """The server reads the second request and hangs up without an answer, as a server whose
    idle timeout fired at that moment does."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(_ok(b"one"))
        if server.connections == 1:
            await server.head(reader)
            writer.transport.abort()

    server = Scripted(script)

    async def scenario() -> None:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            for expected in (b"one", b"one"):
                async with client.request(method, url + "/", body=b"{}") as response:
                    assert await response.read() == expected
            await client.close()

    if retried:
        asyncio.run(scenario())
        assert server.connections == 2
    else:
        with pytest.raises(HttpError, match="closed the connection before answering"):
            asyncio.run(scenario())
        assert server.connections == 1


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "illegal status line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf", r"received 4 bytes, expected 10"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "illegal chunk header"),
        (b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n", "illegal header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\n\r\n", "unasked encoding"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\nbody", "bad Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nnope",
            "corrupt gzip body",
        ),
    ],
    ids=["status-line", "short-body", "chunk-size", "header", "encoding", "length", "gzip"],
)
def test_a_broken_answer_is_an_http_error(answer: bytes, error: str) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = Scripted(script)

    async def scenario() -> None:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            try:
                async with client.request("GET", url + "/") as response:
                    await response.read()
            finally:
                await client.close()

    with pytest.raises(HttpError, match=error):
        asyncio.run(scenario())


_LENGTH_2 = b"Content-Length: 2\r\n"


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.9 200 OK\r\n" + _LENGTH_2 + b"\r\nok", r"in HTTP/1\.9, not HTTP/1\.1"),
        (b"HTTP/2.0 200 OK\r\n" + _LENGTH_2 + b"\r\nok", r"in HTTP/2\.0, not HTTP/1\.1"),
        (b"HTTP/1.1 200 OK\r\nX: a\rb\r\n" + _LENGTH_2 + b"\r\nok", "illegal header line"),
        (b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n" + _LENGTH_2 + b"\r\nok", "illegal header line"),
        (b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n" + _LENGTH_2 + b"\r\nok", r"folded.*obs-fold"),
        (b"HTTP/1.1 200 OK\r\n\tX: a\r\n" + _LENGTH_2 + b"\r\nok", r"folded.*obs-fold"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", "conflicting"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\nok", "bad Content-Length"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            "Only Transfer-Encoding: chunked",
        ),
    ],
    ids=[
        "http-1.9",
        "http-2.0",
        "cr-in-value",
        "nul-in-value",
        "obs-fold",
        "fold-at-start",
        "two-lengths",
        "unicode-digit-length",
        "unknown-coding",
    ],
)
def test_a_malformed_head_is_refused_at_once_on_a_connection_left_open(
    answer: bytes, error: str
) -> None:
    """What the hand parser took (issue 40) is an HttpError as soon as the head is read: the
    server keeps the connection open, so a client waiting for more would hang."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()

    server = Scripted(script)

    async def scenario() -> None:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            try:
                async with asyncio.timeout(10), client.request("GET", url + "/") as response:
                    await response.read()
            finally:
                await client.close()

    with pytest.raises(HttpError, match=error):
        asyncio.run(scenario())


@pytest.mark.parametrize(
    ("chunks", "error"),
    [
        (b"-5\r\nhello\r\n0\r\n\r\n", "illegal chunk header"),
        (b"0x5\r\nhello\r\n0\r\n\r\n", "illegal chunk header"),
        (b"5 5\r\nhello\r\n0\r\n\r\n", "illegal chunk header"),
        (b"3\r\nhello\r\n0\r\n\r\n", "malformed chunk footer"),
        (b"%x\r\n" % (HEAD_LIMIT + 1) + b"x" * 10, "incomplete chunked read"),
        (b"1" * (HEAD_LIMIT + 10), "Receive buffer too long"),
    ],
    ids=["negative", "hex-prefix", "two-numbers", "longer-than-its-size", "cut-short", "endless"],
)
def test_a_bad_chunk_size_is_an_http_error_on_a_connection_left_open(
    chunks: bytes, error: str
) -> None:
    """The chunk's size line is bounded (HEAD_LIMIT) as the head is; a chunk larger than the
    connection brings ends with the connection."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        await writer.drain()
        if b"x" * 10 in chunks:
            writer.close()  # the huge chunk: its size is legal, its bytes never come
        await reader.read()

    server = Scripted(script)

    async def scenario() -> None:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            try:
                async with asyncio.timeout(10), client.request("GET", url + "/") as response:
                    await response.read()
            finally:
                await client.close()

    with pytest.raises(HttpError, match=error):
        asyncio.run(scenario())


def test_bytes_past_the_end_of_an_answer_are_not_taken_for_the_next_one() -> None:
    """A server that sends more than its answer has lost track of its framing: the next
    request goes over a new connection, not after bytes that would pass for its answer."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await server.head(reader)
            writer.write(_ok(b"one") + _ok(b"smuggled"))

    server = Scripted(script)

    async def scenario() -> list[bytes]:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            bodies = []
            for _ in range(2):
                async with client.request("GET", url + "/") as response:
                    bodies.append(await response.read())
                await asyncio.sleep(0.05)  # the extra bytes arrive with or after the answer
            await client.close()
            return bodies

    assert asyncio.run(scenario()) == [b"one", b"one"]


def test_interim_answers_and_an_http_1_0_answer_are_read() -> None:
    """1xx answers before the final one are skipped; an HTTP/1.0 body ends with the connection,
    which is then not reused."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nX-Twice: a\r\nX-Twice: b\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    server = Scripted(script)

    async def scenario() -> tuple[dict[str, str], bytes, bool]:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            async with client.request("GET", url + "/") as response:
                body = await response.read()
                reusable = response.reusable
            await client.close()
            return response.headers, body, reusable

    headers, body, reusable = asyncio.run(scenario())
    assert (headers["x-twice"], body, reusable) == ("a, b", b"all of it", False)


def test_a_header_value_with_a_line_break_is_refused() -> None:
    async def scenario() -> None:
        client = HttpClient(ssl_context=None)
        headers = {"Authorization": "Bearer x\r\nX-Evil: 1"}
        async with client.request("GET", "http://127.0.0.1:1/", headers=headers):
            pass

    with pytest.raises(ValueError, match="line break"):
        asyncio.run(scenario())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _contexts(pki: Pki) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(pki.serving_cert, pki.serving_key)
    trusting = ssl.create_default_context(cafile=str(pki.ca_cert))
    return serving, trusting


@pytest.mark.parametrize(
    ("trust", "server_hostname", "error"),
    [
        (True, None, None),
        (True, "localhost", None),
        (True, "elsewhere.example", "Hostname mismatch"),
        (False, None, "unable to get local issuer certificate"),
    ],
    ids=["verified", "named", "wrong-name", "unknown-ca"],
)
def test_tls_verifies_the_server_against_the_given_name(
    pki: Pki, trust: bool, server_hostname: str | None, error: str | None
) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(_ok(b"secret"))
        await writer.drain()

    server = Scripted(script)
    serving, trusting = _contexts(pki)

    async def scenario() -> bytes:
        async with server.running(serving) as url:
            client = HttpClient(ssl_context=trusting if trust else ssl.create_default_context())
            try:
                async with client.request(
                    "GET", url + "/", server_hostname=server_hostname
                ) as response:
                    return await response.read()
            finally:
                await client.close()

    if error is None:
        assert asyncio.run(scenario()) == b"secret"
    else:
        with pytest.raises(ssl.SSLCertVerificationError, match=error):
            asyncio.run(scenario())


@pytest.mark.parametrize(
    ("tls", "proxy_tls"),
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["https-tunnel", "http-absolute-form", "https-tunnel-in-tls", "http-over-tls"],
)
def test_requests_go_through_a_proxy_with_its_credentials(
    pki: Pki, tls: bool, proxy_tls: bool
) -> None:
    """An https:// proxy is verified with the client's TLS settings, as Go's client does."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await server.head(reader)
        writer.write(_ok(head.split(b" ")[1]))
        await writer.drain()

    server = Scripted(script)
    proxy = ConnectProxy(base64.b64encode(b"user:p@ss").decode())
    serving, trusting = _contexts(pki)

    async def scenario() -> bytes:
        async with (
            server.running(serving if tls else None) as url,
            proxy.running(serving if proxy_tls else None) as port,
        ):
            scheme = "https" if proxy_tls else "http"
            client = HttpClient(
                ssl_context=trusting if tls or proxy_tls else None,
                proxy=f"{scheme}://user:p%40ss@127.0.0.1:{port}",
            )
            try:
                async with client.request("GET", url + "/via?x=1") as response:
                    return await response.read()
            finally:
                await client.close()

    assert asyncio.run(scenario()) == b"/via?x=1"
    (asked,) = proxy.asked
    authority = server.heads[0].split(b"Host: ")[1].split(b"\r\n")[0].decode()
    if tls:
        assert asked == f"CONNECT {authority} HTTP/1.1"
        assert b"Proxy-Authorization" not in server.heads[0]
    else:
        assert asked == f"GET http://{authority}/via?x=1 HTTP/1.1"


def test_a_proxy_that_refuses_the_tunnel_is_an_http_error(pki: Pki) -> None:
    proxy = ConnectProxy("right")
    _, trusting = _contexts(pki)

    async def scenario() -> None:
        async with proxy.running() as port:
            client = HttpClient(ssl_context=trusting, proxy=f"http://127.0.0.1:{port}")
            async with client.request("GET", "https://127.0.0.1:1/"):
                pass

    with pytest.raises(HttpError, match=r"refused the tunnel: 'HTTP/1\.1 407"):
        asyncio.run(scenario())


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.9 200 OK\r\n\r\n", r"in HTTP/1\.9, not HTTP/1\.1"),
        (b"HTTP/1.1 200 OK\r\nX: a\x00\r\n\r\n", "illegal header line"),
        (b"HTTP/1.1 200 OK\n\n\x16\x03\x01\r\n\r\n", "bytes ahead of the tunnel"),
        (b"", "closed the connection before answering"),
    ],
    ids=["http-1.9", "nul-in-value", "bytes-ahead", "no-answer"],
)
def test_a_malformed_answer_to_connect_is_an_http_error(
    pki: Pki, answer: bytes, error: str
) -> None:
    """A tunnel is only taken after a well-formed 2xx with nothing after it that h11 has read:
    such bytes would be lost to the TLS handshake, which reads from the socket. (Bytes after a
    CRLF head stay in the stream's buffer, unseen, and the handshake waits for the connect
    timeout, as it did before h11.)"""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await proxy.head(reader)
        writer.write(answer)
        await writer.drain()
        if answer:
            await reader.read()

    proxy = Scripted(script)
    _, trusting = _contexts(pki)

    async def scenario() -> None:
        async with proxy.running() as proxy_url:
            client = HttpClient(ssl_context=trusting, proxy=proxy_url)
            try:
                async with asyncio.timeout(10), client.request("GET", "https://127.0.0.1:1/"):
                    pass
            finally:
                await client.close()

    with pytest.raises(HttpError, match=error):
        asyncio.run(scenario())
    assert proxy.heads[0].startswith(b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\n")


def test_only_http_proxies_are_taken() -> None:
    with pytest.raises(ValueError, match="only http:// and https:// proxies"):
        HttpClient(ssl_context=None, proxy="socks5://127.0.0.1:1080")


# The server.


async def _hello(request: Request) -> Reply:
    return Reply(body=f"hello {request.query.get('who', '?')}")


async def _broken(_: Request) -> Reply:
    raise RuntimeError("a handler's bug")


@contextlib.asynccontextmanager
async def _serving(request_timeout: float = http_server.REQUEST_S) -> AsyncIterator[int]:
    sock = socket.create_server(("127.0.0.1", 0))
    listener = await serve(
        sock, {"/hello": _hello, "/broken": _broken}, request_timeout=request_timeout
    )
    try:
        yield sock.getsockname()[1]
    finally:
        listener.close()
        await listener.wait_closed()


async def _raw(port: int, *requests: bytes) -> bytes:
    """What the server answers to ``requests`` sent on one connection, until it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for r in requests:
        writer.write(r)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def test_the_server_answers_routes_and_keeps_the_connection() -> None:
    async def scenario() -> bytes:
        async with _serving() as port:
            return await _raw(
                port,
                b"GET /hello?who=you&who=them HTTP/1.1\r\nHost: x\r\n\r\n",
                b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n",
                b"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
                b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n",  # after the close: never answered
            )

    answer = asyncio.run(scenario())
    dates = re.findall(rb"Date: ([^\r]*)\r\n", answer)
    assert len(dates) == 6
    for date in dates:  # the format of RFC 9110's IMF-fixdate, within a minute of now
        sent = datetime.datetime.strptime(date.decode(), "%a, %d %b %Y %H:%M:%S GMT")
        now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
        assert abs((now - sent).total_seconds()) < 60
    answer = re.sub(rb"Date: [^\r]*\r\n", b"", answer)
    text = "text/plain; charset=utf-8"
    assert (
        answer
        == (
            f"HTTP/1.1 200 OK\r\nContent-Type: {text}\r\nContent-Length: 9\r\n\r\nhello you"
            f"HTTP/1.1 200 OK\r\nContent-Type: {text}\r\nContent-Length: 7\r\n\r\n"
            f"HTTP/1.1 404 Not Found\r\nContent-Type: {text}\r\nContent-Length: 15\r\n\r\n"
            "404: Not Found\n"
            f"HTTP/1.1 405 Method Not Allowed\r\nContent-Type: {text}\r\nContent-Length: 24\r\n"
            "Allow: GET, HEAD\r\n\r\n405: Method Not Allowed\n"
            f"HTTP/1.1 500 Internal Server Error\r\nContent-Type: {text}\r\nContent-Length: 27\r\n"
            "\r\n500: Internal Server Error\n"
            f"HTTP/1.1 200 OK\r\nContent-Type: {text}\r\nContent-Length: 7\r\nConnection: close\r\n"
            "\r\nhello ?"
        ).encode()
    )


@pytest.mark.parametrize(
    ("request_bytes", "answer"),
    [
        (b"GET /hello HTTP/1.0\r\n\r\n", b"HTTP/1.1 200 OK"),
        (b"GET hello\r\n\r\n", b"HTTP/1.1 400 Bad Request"),
        # Go's servers, kube-proxy's, refuse an HTTP/1.1 request without a Host (RFC 9112).
        (b"GET /hello HTTP/1.1\r\n\r\n", b"HTTP/1.1 400 Bad Request"),
        (b"GET /hello HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"HTTP/1.1 411 "),
        (b"GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", b"HTTP/1.1 413 "),
        (b"GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", b"HTTP/1.1 400 "),
        (b"GET /hello HTTP/1.1\r\nX: " + b"y" * 300_000, b"HTTP/1.1 431 "),
    ],
    ids=["http-1.0", "no-version", "no-host", "chunked", "too-large", "bad-length", "endless-head"],
)
def test_the_server_answers_once_and_closes_what_it_will_not_keep(
    request_bytes: bytes, answer: bytes
) -> None:
    async def scenario() -> bytes:
        async with _serving() as port:
            return await _raw(port, request_bytes)

    got = asyncio.run(scenario())
    assert got.startswith(answer)
    assert got.count(b"HTTP/1.1") == 1
    assert b"\r\nConnection: close\r\n" in got


@pytest.mark.parametrize(
    ("sent", "bound"),
    [(b"", "IDLE_S"), (b"GET /hello HTTP/1.1\r\n", "REQUEST_S")],
    ids=["idle", "a-head-never-finished"],
)
def test_a_connection_past_its_bound_is_closed(
    monkeypatch: pytest.MonkeyPatch, sent: bytes, bound: str
) -> None:
    """Waiting for a request is bounded, and so, from its first byte, is reading it: each bound
    alone ends the connection."""
    monkeypatch.setattr(http_server, "IDLE_S", 0.2 if bound == "IDLE_S" else 60)

    async def scenario() -> bytes:
        async with _serving(request_timeout=0.2 if bound == "REQUEST_S" else 60) as port:
            return await _raw(port, sent)

    assert asyncio.run(scenario()) == b""


def test_the_client_and_the_server_speak_to_each_other() -> None:
    async def scenario() -> list[tuple[int, bytes]]:
        async with _serving() as port:
            client = HttpClient(ssl_context=None)
            answers = []
            for path in ("/hello?who=client", "/nowhere"):
                async with client.request("GET", f"http://127.0.0.1:{port}{path}") as response:
                    answers.append((response.status, await response.read()))
            await client.close()
            return answers

    assert asyncio.run(scenario()) == [(200, b"hello client"), (404, b"404: Not Found\n")]


def test_closing_the_client_ends_a_request_in_flight() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client goes
        ended.set()

    server = Scripted(script)
    ended = asyncio.Event()

    async def scenario() -> None:
        async with server.running() as url:
            client = HttpClient(ssl_context=None)
            async with client.request("GET", url + "/w"):
                await client.close()
                await asyncio.wait_for(ended.wait(), 10)

    asyncio.run(scenario())


def test_a_client_that_does_not_read_its_answer_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer larger than the sockets' buffers waits on the client; past the idle bound the
    connection ends, and with it the answer kept in memory."""
    monkeypatch.setattr(http_server, "IDLE_S", 0.3)
    big = b"x" * (64 << 20)

    async def large(_: Request) -> Reply:
        return Reply(body=big)

    async def scenario() -> tuple[int, int]:
        sock = socket.create_server(("127.0.0.1", 0))
        listener = await serve(sock, {"/large": large})
        try:
            _reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            writer.write(b"GET /large HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.2)
            held = len(listener._connections)
            await asyncio.sleep(LINGER_AND_IDLE_S)
            after = len(listener._connections)
            writer.close()
            return held, after
        finally:
            listener.close()
            await listener.wait_closed()

    assert asyncio.run(scenario()) == (1, 0)


LINGER_AND_IDLE_S = 0.3 + http_server.LINGER_S + 0.5
