"""kpng.http1's server against hostile peers, over loopback: malformed requests are answered 400
(or closed) without a traceback, and no mutated request makes the server raise.

Bounded: every wait has a timeout; the fuzz test runs ``KPNG_FUZZ_EXAMPLES`` examples if set
(tests/fuzzing.py), a few dozen otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kpng.http1 import Reply, Request, serve
from kpng.http1.server import Listener
from tests.fuzzing import fuzz_settings

WAIT_S = 10.0


async def _healthz(_: Request) -> Reply:
    return Reply(200, '{"ok": true}', "application/json")


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[tuple[Listener, int]]:
    sock = socket.create_server(("127.0.0.1", 0))
    listener = await serve(sock, {"/healthz": _healthz})
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
    ],
    ids=["non-ascii-digit-length", "target-//[", "body-cut-short", "http-1.9", "cr", "nul"],
)
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
