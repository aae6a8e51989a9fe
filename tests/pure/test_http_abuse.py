"""kpng.http1's server against hostile peers, over loopback: malformed requests are answered 400
(or closed) without a traceback, a crowd of idle connections cannot keep ``/healthz`` from
answering, and no mutated request makes the server raise. Also the two process-wide guards that
go with it: the open files limit raised at start, and repeated warnings logged once a window.

Bounded: every wait has a timeout; the fuzz test runs ``KPNG_FUZZ_EXAMPLES`` examples if set
(tests/pure/fuzzing.py), a few dozen otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import resource
import socket
import statistics
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kpng import cli
from kpng.http1 import Reply, Request, serve
from kpng.http1 import server as http_server
from kpng.http1.server import Listener
from kpng.logs import RepeatFilter
from tests.pure.fuzzing import fuzz_settings

WAIT_S = 10.0


async def _healthz(_: Request) -> Reply:
    return Reply(200, '{"ok": true}', "application/json")


@contextlib.asynccontextmanager
async def _serving(
    max_connections: int = http_server.MAX_CONNECTIONS,
) -> AsyncIterator[tuple[Listener, int]]:
    sock = socket.create_server(("127.0.0.1", 0))
    listener = await serve(sock, {"/healthz": _healthz}, max_connections=max_connections)
    try:
        yield listener, sock.getsockname()[1]
    finally:
        listener.close()
        await listener.wait_closed()


async def _exchange(port: int, request: bytes) -> bytes:
    """What the server answers to ``request``, the client's sending side shut after it (a body
    cut short stays short), until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        writer.write_eof()
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


class _Records(logging.Handler):
    """Every record of every logger, asyncio's included (caplog is per test function, which
    Hypothesis' examples share)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _recording() -> Iterator[_Records]:
    records = _Records()
    root = logging.getLogger()
    level = root.level
    root.addHandler(records)
    root.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        root.removeHandler(records)
        root.setLevel(level)


def _no_traceback(records: list[logging.LogRecord]) -> None:
    bad = [r for r in records if r.exc_info or r.levelno > logging.WARNING]
    assert not bad, [r.getMessage()[:200] for r in bad]


HOST = b"Host: node\r\n"


@pytest.mark.parametrize(
    "request_bytes",
    [
        # "²" as the server reads it (latin-1), a digit to str.isdigit, not to int
        b"GET /healthz HTTP/1.1\r\n" + HOST + b"Content-Length: \xb2\r\n\r\n",
        b"GET //[ HTTP/1.1\r\n" + HOST + b"\r\n",
        b"POST /healthz HTTP/1.1\r\n" + HOST + b"Content-Length: 10\r\n\r\nhalf",
        b"GET /healthz HTTP/1.9\r\n" + HOST + b"\r\n",
        b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-A: one\rtwo\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\n" + HOST + b"X-A: one\x00two\r\n\r\n",
        # Found by the fuzz test: a HEAD's refusal, whose answer has no body.
        b"HEAD /healthz HTTP/1.9\r\n" + HOST + b"\r\n",
        b"HEAD /healthz HTTP/1.1\r\n" + HOST + b"Content-Length: 10\r\n\r\nhalf",
    ],
    ids=[
        "non-ascii-digit-length", "target-//[", "body-cut-short", "http-1.9", "cr", "nul",
        "head-http-1.9", "head-body-cut-short",
    ],
)  # fmt: skip
def test_a_malformed_request_gets_400_and_one_quiet_line(request_bytes: bytes) -> None:
    async def scenario() -> bytes:
        async with _serving() as (_, port):
            answer = await _exchange(port, request_bytes)
            await asyncio.sleep(0.05)  # for a failed connection's traceback, if any, to be logged
            return answer

    with _recording() as records:
        answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"\r\nConnection: close\r\n" in answer
    _no_traceback(records.records)
    ours = [r for r in records.records if r.name.startswith("kpng")]
    assert len(ours) <= 1, [r.getMessage() for r in ours]


def test_past_the_cap_the_longest_idle_connection_makes_room_else_the_new_one_is_refused() -> None:
    """An idle connection is one between requests: one that has sent a byte of its next request
    is not closed for a newcomer."""

    async def is_closed(reader: asyncio.StreamReader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(), 0.3) == b""
        except TimeoutError:
            return False

    async def scenario() -> None:
        async with _serving(max_connections=3) as (listener, port):
            clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            await asyncio.sleep(0.1)
            clients[0][1].write(b"GET /heal")  # busy: a request begun
            clients[2][1].write(b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n")  # answered: idle
            assert (await clients[2][0].readuntil(b'{"ok": true}')).startswith(b"HTTP/1.1 200")
            # The 4th connection: of the idle ones, #1 has waited longest.
            fourth = await asyncio.open_connection("127.0.0.1", port)
            assert await is_closed(clients[1][0])
            assert not await is_closed(clients[0][0])
            assert not await is_closed(clients[2][0])
            fourth[1].write(b"GET /hea")  # now every connection is busy
            clients[2][1].write(b"G")
            await asyncio.sleep(0.1)
            fifth = await asyncio.open_connection("127.0.0.1", port)
            assert await is_closed(fifth[0])
            assert len(listener._connections) == 3
            for _, writer in [*clients, fourth, fifth]:
                writer.close()

    with _recording() as records:
        asyncio.run(scenario())
    _no_traceback(records.records)


IDLE_CLIENTS = 5_000


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_healthz_answers_with_thousands_of_idle_connections_open(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """5,000 connections opened and left idle, as the audit's 1,100 that stopped /healthz. The
    process may open the clients', the server's cap and what it has open already, not more: a
    server without a cap runs out of descriptors here as kpng did at the runtime's 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = IDLE_CLIENTS + http_server.MAX_CONNECTIONS + len(os.listdir("/proc/self/fd")) + 64
    if hard < need:
        pytest.skip(f"the hard open files limit, {hard}, is under the {need} this test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    idle: list[socket.socket] = []

    async def connect_idle(port: int) -> None:
        loop = asyncio.get_running_loop()

        async def one() -> None:
            sock = socket.socket()
            idle.append(sock)
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))

        # In batches no larger than the listening socket's backlog: past it, connections wait
        # for the kernel's SYN retry, a second.
        for start in range(0, IDLE_CLIENTS, 50):
            await asyncio.gather(*(one() for _ in range(start, min(start + 50, IDLE_CLIENTS))))

    def closed_by_server() -> int:
        count = 0
        for sock in idle:
            try:
                count += sock.recv(1, socket.MSG_PEEK) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                count += 1
        return count

    async def healthz(port: int) -> float:
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
        await reader.readexactly(length)
        took = time.perf_counter() - started
        writer.close()
        assert head.startswith(b"HTTP/1.1 200 OK")
        return took

    async def scenario() -> tuple[float, list[float]]:
        async with asyncio.timeout(45), _serving() as (listener, port):
            started = time.perf_counter()
            await connect_idle(port)
            # Every newcomer past the cap closed the connection idle longest.
            for _ in range(200):
                if closed_by_server() == IDLE_CLIENTS - http_server.MAX_CONNECTIONS:
                    break
                await asyncio.sleep(0.1)
            assert closed_by_server() == IDLE_CLIENTS - http_server.MAX_CONNECTIONS
            assert len(listener._connections) == http_server.MAX_CONNECTIONS
            opened = time.perf_counter() - started
            return opened, [await healthz(port) for _ in range(5)]

    try:
        with _recording() as records:
            opened, took = asyncio.run(scenario())
    finally:
        for sock in idle:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with capsys.disabled():
        print(
            f"\n{IDLE_CLIENTS} idle connections opened in {opened:.1f} s; /healthz answered in "
            f"{statistics.median(took) * 1000:.1f} ms (median of 5), {max(took) * 1000:.1f} ms "
            "at most"
        )
    _no_traceback(records.records)
    # 100 ms is the aim (and the usual figure); 1 s leaves room for a loaded 2-core machine.
    assert max(took) < 1.0


# --- fuzzing

_METHODS = [b"GET", b"HEAD", b"POST", b"OPTIONS", b"get", b"G\x00T", b""]
_TARGETS = [
    b"/healthz", b"/healthz?x=1&x=2&y", b"/nowhere", b"//[", b"/a[]", b"*", b"http://node/healthz",
    b"/%zz", b"/\xff", b"/?\x7f", b"",
]  # fmt: skip
_VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.9", b"HTTP/2.0", b"HTTP/1.", b"http/1.1", b""]
_NAMES = [
    b"Host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Expect", b"X-A", b"",
    b"Bad Name", b"X\x00", b" Host",
]  # fmt: skip
_VALUES = [
    b"node", b"0", b"4", b"\xb2", b"-1", b"99999999999999999999", b"4, 4", b"chunked", b"gzip",
    b"close", b"keep-alive", b"100-continue", b"a\rb", b"a\x00b", b"a\nb", b" ", b"\xff", b"",
]  # fmt: skip
_BODIES = [b"", b"body", b"4\r\nbody\r\n0\r\n\r\n", b"0" * 70_000]


@st.composite
def _request(draw: st.DrawFn) -> bytes:
    """A request of parts each valid or chosen to break a parser (a "²" for a Content-Length,
    "//[" for a target, HTTP/1.9, CR or NUL in a value), mostly with a Host as HTTP/1.1 asks."""
    fields = [(b"Host", b"node")] if draw(st.integers(0, 4)) else []
    fields += draw(
        st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from(_VALUES)), max_size=3)
    )
    line = b" ".join(draw(st.sampled_from(choices)) for choices in (_METHODS, _TARGETS, _VERSIONS))
    head = b"".join(b"%s: %s\r\n" % field for field in fields)
    return line + b"\r\n" + head + b"\r\n" + draw(st.sampled_from(_BODIES))


@st.composite
def _mutated_requests(draw: st.DrawFn) -> bytes:
    """One to three requests, some of their bytes then inserted, removed or replaced, and the
    whole perhaps cut short."""
    data = bytearray(b"".join(draw(st.lists(_request(), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(0, 2))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.integers(0, 2))
        if kind == 0:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == 1:
            del data[at : at + draw(st.integers(1, 8))]
        else:
            data[at : at + 1] = draw(st.binary(min_size=1, max_size=1))
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))) :]
    return bytes(data)


_STATUS = re.compile(rb"HTTP/1\.1 (\d{3}) ")


@fuzz_settings(60, deadline_ms=5000)
@given(_mutated_requests())
def test_fuzz_the_server_answers_or_closes_and_never_raises(request_bytes: bytes) -> None:
    async def scenario() -> bytes:
        async with _serving() as (_, port):
            answer = await _exchange(port, request_bytes)
            await asyncio.sleep(0.01)
            return answer

    with _recording() as records:
        answer = asyncio.run(scenario())
    _no_traceback(records.records)
    # Answers, whole, one after another, or none: the connection closed.
    while answer:
        status = _STATUS.match(answer)
        assert status is not None, answer[:100]
        assert int(status[1]) in {200, 400, 404, 405, 411, 413, 431, 501}
        head, _, rest = answer.partition(b"\r\n\r\n")
        found = re.search(rb"\r\nContent-Length: (\d+)(?:\r\n|$)", head)
        assert found is not None, (request_bytes, answer)
        length = int(found[1])
        if rest and not rest.startswith(b"HTTP/1.1 "):  # not a HEAD's answer: a body follows
            assert len(rest) >= length
            rest = rest[length:]
        answer = rest


# --- the process-wide guards that go with it


def test_the_open_files_limit_is_raised_to_the_hard_one_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kpng")
    limits = [(1024, 1_048_576)]
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits[-1])
    monkeypatch.setattr(resource, "setrlimit", lambda _, new: limits.append(new))
    cli._raise_open_files_limit()
    assert limits[-1] == (1_048_576, 1_048_576)
    assert "open files limit: 1024, raised to 1048576" in caplog.messages

    def refuse(_: int, __: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    cli._raise_open_files_limit()  # a failure is a line at DEBUG, not kpng's end
    assert "open files limit: 1024, not raised to 4096: not allowed" in caplog.messages


def test_identical_warnings_are_logged_once_a_window_with_a_count_of_the_rest() -> None:
    now = [0.0]
    repeats = RepeatFilter(window_s=10.0, clock=lambda: now[0])

    def passes(message: str, *args: object, level: int = logging.WARNING) -> str | None:
        record = logging.LogRecord("kpng.x", level, __file__, 1, message, args, None)
        return record.getMessage() if repeats.filter(record) else None

    assert passes("cap reached on %s", "a") == "cap reached on a"
    for _ in range(100):
        assert passes("cap reached on %s", "a") is None
    assert passes("cap reached on %s", "b") == "cap reached on b"  # another text
    assert passes("accept failed\nsocket: 7") == "accept failed\nsocket: 7"
    assert passes("accept failed\nsocket: 8") is None  # the same first line
    assert passes("cap reached on %s", "a", level=logging.DEBUG) == "cap reached on a"
    now[0] = 10.0
    assert passes("cap reached on %s", "a") == "cap reached on a (100 more like it not logged)"
    assert passes("cap reached on %s", "a") is None
