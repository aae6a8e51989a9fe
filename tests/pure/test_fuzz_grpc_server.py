"""Fuzzing the brain's watch server (to-api) over real gRPC on a real unix socket: every method
it serves (Go KPNG's localv1.Sets/Watch and globalv1.Sets/Watch, kpng's batchv1.Sets/Watch and
WatchGlobal) and a few it does not, called with raw bytes (identity serializers), so the
requests can be anything — random bytes, valid requests truncated or bit-flipped, unknown
fields of every wire type, groups nested deeper than any parser goes, NodeNames that are no
UTF-8, hold control characters or are longer than any node's, a field repeated thousands of
times, a message larger than the server takes — several on one stream, all at once or each
after the answer to the one before.

The properties:

- the server logs no exception and no error (its log, grpc's and asyncio's, are all read);
- every call ends as its requests say it must: each request that decodes and names a node the
  stream does not watch yet is answered with a whole first state (Reset ... Sync, well framed);
  the first request that does not decode ends the stream with INVALID_ARGUMENT; one that
  changes nothing leaves the stream waiting for the next change; the end of the requests ends
  it with OK; an unknown method is UNIMPLEMENTED, an oversized message RESOURCE_EXHAUSTED;
- afterwards nothing is left behind (no watch counted open, no node view, no first-state turn
  kept), and a well-behaved watcher still gets its first state: checked every ``CHECK_EVERY``
  examples and once at the end (the fixture's teardown), to stay fast.

The server runs once for the whole module, in a thread with its own event loop, as the brain
runs it; the calls are made by grpc's blocking client from the test's thread.

Bounded: see tests/pure/fuzzing.py (``KPNG_FUZZ_EXAMPLES`` runs a longer campaign).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import given
from hypothesis import strategies as st

from kpng.api import batchv1_pb2, globalv1_pb2, localv1_pb2
from kpng.api.digests import BUCKETS, DIGEST_BYTES
from kpng.server.hub import FIRST_STATES_AT_ONCE
from kpng.server.serving import ListenAddress, Serving, serve
from kpng.sources.file import stage
from kpng.sources.manifests import parse
from kpng.store import Store
from tests.conftest import EXAMPLE
from tests.pure.fuzzing import fuzz_settings

CALL_S = 10.0
"""A call's deadline: an answer the model expects and that does not come within it is a hang."""
CHECK_EVERY = 25
"""Examples between two checks that the server is whole (they cost a first state each)."""
MAX_REQUEST = 4 << 20
"""gRPC's default receive limit, which the server keeps: a larger request is refused by gRPC."""


@dataclass(frozen=True)
class Method:
    path: str
    request: type[Message] | None
    """What the server parses each request as; None: a method the server does not serve."""
    batched: bool = False
    local: bool = True


METHODS = (
    Method("/localv1.Sets/Watch", localv1_pb2.WatchReq),
    Method("/globalv1.Sets/Watch", globalv1_pb2.GlobalWatchReq, local=False),
    Method("/kpng.batchv1.Sets/Watch", batchv1_pb2.WatchReq, batched=True),
    Method("/kpng.batchv1.Sets/WatchGlobal", batchv1_pb2.GlobalWatchReq, batched=True, local=False),
)
UNSERVED = (
    Method("/localv1.Sets/watch", None),
    Method("/kpng.batchv1.Sets/Nope", None),
    Method("/grpc.health.v1.Health/Check", None),
    Method("/", None),
)

# --- the server, once for the module


class _Records(logging.Handler):
    """Every log record of the process at WARNING or above, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.records.append(record)

    def since(self, start: int) -> list[logging.LogRecord]:
        with self._lock:
            return self.records[start:]


def _bugs(records: list[logging.LogRecord]) -> list[str]:
    """What in the log says the server failed: an error, a traceback, an exception."""
    found = []
    for record in records:
        text = record.getMessage()
        if (
            record.exc_info
            or record.levelno >= logging.ERROR
            or "Traceback" in text
            or "Exception" in text
        ):
            found.append(f"{record.name}: {text[:500]}")
    return found


class Brain:
    """The server, a channel to it, what it logged, and the campaign's counts. Not a dataclass:
    Hypothesis prints a dataclass's fields in a failing example, and these are long."""

    def __init__(
        self, serving: Serving, channel: grpc.Channel, records: _Records, reference: list[bytes]
    ) -> None:
        self.serving = serving
        self.channel = channel
        self.records = records
        self.reference = reference
        """node-1's first state (localv1 ops), as a fresh server sent it."""
        self.examples = 0
        self.first_states = 0
        self.checked_log = 0
        self.statuses: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"Brain({self.serving.addresses[0]}, {self.examples} examples)"


def _example_store() -> Store:
    store = Store()
    handle = store.source("test")
    parsed = parse(EXAMPLE.read_bytes(), filename="x")
    assert not parsed.errors
    for key, obj in parsed.objects.items():
        stage(handle, key, obj)
    handle.mark_synced()
    return store


def _run_server(
    store: Store, socket: Path, started: Callable[[Serving], None]
) -> tuple[threading.Thread, Callable[[], None]]:
    """``serve`` in a thread of its own; returns the thread and what stops it."""
    loop = asyncio.new_event_loop()
    task: list[asyncio.Task[None]] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            task.append(asyncio.current_task())  # type: ignore[arg-type]
            await serve(store, listen=[ListenAddress.parse(f"unix://{socket}")], started=started)

        try:
            loop.run_until_complete(main())
        except asyncio.CancelledError:
            pass
        finally:
            loop.close()

    def stop() -> None:
        if task:
            loop.call_soon_threadsafe(task[0].cancel)

    thread = threading.Thread(target=run, name="brain", daemon=True)
    thread.start()
    return thread, stop


@pytest.fixture(scope="module")
def brain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Brain]:
    socket = tmp_path_factory.mktemp("fuzz-grpc-server") / "kpng.sock"
    records = _Records()
    root = logging.getLogger()
    root.addHandler(records)
    ready: queue.Queue[Serving] = queue.Queue()
    thread, stop = _run_server(_example_store(), socket, ready.put)
    try:
        serving = ready.get(timeout=20)
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            reference = _first_state(channel)
            brain = Brain(serving, channel, records, reference)
            yield brain
            # The end of the campaign: the server is still whole, and said nothing wrong.
            _check_whole(brain)
            assert _bugs(records.since(0)) == []
            # What a campaign reports (seen with -s): how many calls, and how they ended.
            print(
                f"\n{brain.examples} examples, {brain.first_states} first states answered;"
                f" calls ended: {brain.statuses}"
            )
    finally:
        stop()
        thread.join(20)
        root.removeHandler(records)


def _first_state(channel: grpc.Channel) -> list[bytes]:
    """node-1's first state, as a well-behaved localv1 watcher reads it."""
    call = _call(channel, "/localv1.Sets/Watch", iter([_valid(localv1_pb2.WatchReq, "node-1")]))
    ops: list[bytes] = []
    try:
        for message in call:
            ops.append(message)
            if localv1_pb2.OpItem.FromString(message).WhichOneof("Op") == "Sync":
                return ops
    finally:
        call.cancel()
    raise AssertionError(f"no first state: {call.code()} {call.details()}")


def _check_whole(brain: Brain) -> None:
    """Nothing is left of the calls made (each was ended by now), and a well-behaved watcher
    gets the same first state as at the start, in good time."""
    watch = brain.serving.watch
    started = time.monotonic()
    assert _first_state(brain.channel) == brain.reference
    # In good time: a first state of this store takes milliseconds, unless the loop is stuck
    # or every turn is kept (by calls that ended), which would hold it for a turn's hold time.
    assert time.monotonic() - started < 2.0

    def left() -> tuple[Any, ...]:
        # Every call has ended (this one's cancel is seen by the server a moment later).
        return (
            watch.stats.local_watches,
            watch.stats.global_watches,
            len(watch.hub.cluster._views),
            FIRST_STATES_AT_ONCE - watch.first_states._free._value,
        )

    deadline = time.monotonic() + CALL_S
    while any(left()):
        assert time.monotonic() < deadline, f"left open: watches, views, turns {left()}"
        time.sleep(0.01)


def _call(channel: grpc.Channel, path: str, requests: Iterator[bytes]) -> Any:
    method = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
    return method(requests, timeout=CALL_S)


# --- the requests

_ENCODINGS = st.one_of(
    st.sampled_from([batchv1_pb2.PROTOBUF, batchv1_pb2.JSON]),
    st.integers(-(2**31), 2**31 - 1),  # proto3 enums are open
)
_node_names = st.one_of(
    st.sampled_from(["node-1", "node-2", "node-3", "Node-1", "", "node-1 ", "node-0", "a/b"]),
    st.text(max_size=20),
    # Control characters, DEL and the C1 controls: in logs, and in the warning's metadata.
    st.text(st.characters(codec="utf-8", max_codepoint=0x9F, exclude_categories=()), max_size=12),
    # Longer than any node's name (253): a log line and a metadata value, both bounded.
    st.tuples(st.integers(250, 70_000), st.sampled_from("xé\n\x00😀")).map(lambda t: t[1] * t[0]),
)
_NOT_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3(", b"\xed\xa0\x80", b"a\xf0\x28\x8c\x28", b"\xc0\xaf"]


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32/int64: ten bytes, as protobuf writes them
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _delimited(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _varint(len(payload)) + payload


class Wire(bytes):
    """A request's bytes, shown short in a failing example (some are megabytes)."""

    def __repr__(self) -> str:
        head = bytes(self[:48])
        return f"Wire({head!r}{'...' if len(self) > 48 else ''}, {len(self)} bytes)"


def _valid(request: type[Message], node: str, encoding: int = 0) -> bytes:
    kwargs: dict[str, Any] = {}
    names = {f.name for f in request.DESCRIPTOR.fields}
    if "NodeName" in names:
        kwargs["NodeName"] = node
    if "Encoding" in names:
        kwargs["Encoding"] = encoding
    return request(**kwargs).SerializeToString()


@st.composite
def _unknown_field(draw: st.DrawFn) -> bytes:
    """A field the request has not (or has, with another wire type), of any wire type, well
    formed or not."""
    number = draw(st.one_of(st.integers(1, 20), st.integers(1, 2**29 - 1)))
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return _key(number, 0) + _varint(draw(st.integers(0, 2**64 - 1)))
    if kind == 1:
        return _key(number, 1) + draw(st.binary(min_size=8, max_size=8))
    if kind == 2:
        return _delimited(number, draw(st.binary(max_size=30)))
    if kind == 3:
        return _key(number, 5) + draw(st.binary(min_size=4, max_size=4))
    if kind == 4:  # a group, closed or not
        inner = draw(st.binary(max_size=10))
        return _key(number, 3) + inner + (_key(number, 4) if draw(st.booleans()) else b"")
    if kind == 5:  # a length past the end
        return _key(number, 2) + _varint(draw(st.integers(1, 2**35)))
    return _key(number, draw(st.sampled_from([4, 6, 7])))  # an end-group alone, no wire type


@st.composite
def _nested(draw: st.DrawFn) -> bytes:
    """Groups (which a parser must recurse into even unknown) or messages in unknown fields,
    nested up to far deeper than protobuf's recursion limit (100)."""
    depth = draw(st.integers(1, 5000))
    number = draw(st.integers(3, 1000))
    if draw(st.booleans()):
        return _key(number, 3) * depth + _key(number, 4) * depth
    inner = b""
    for _ in range(min(depth, 300)):  # each level's length prefix grows the message
        inner = _delimited(number, inner)
    return inner


@st.composite
def _request(draw: st.DrawFn, method: Method) -> Wire:
    return Wire(draw(_request_bytes(method)))


@st.composite
def _request_bytes(draw: st.DrawFn, method: Method) -> bytes:
    request = method.request or localv1_pb2.WatchReq
    valid = _valid(request, draw(_node_names), draw(_ENCODINGS))
    kind = draw(st.integers(0, 14))
    if kind <= 3:
        return valid
    if kind >= 13 and request is not batchv1_pb2.WatchReq:
        return valid
    if kind == 13:  # says what it holds (Holds, field 3): a node digest or not
        holds = draw(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40)))
        return valid + _delimited(3, holds)
    if kind == 14:  # answers an ask for bucket digests (Buckets, field 4), of any length
        size = draw(st.sampled_from([0, 16, BUCKETS * DIGEST_BYTES - 1, BUCKETS * DIGEST_BYTES]))
        return valid + _delimited(4, draw(st.binary(min_size=size, max_size=size)))
    if kind == 4:
        return draw(st.binary(max_size=64))
    if kind == 5:  # cut short
        return valid[: draw(st.integers(0, max(0, len(valid) - 1)))] if valid else b"\x0a"
    if kind == 6 and valid:  # a bit flipped
        bit = draw(st.integers(0, len(valid) * 8 - 1))
        flipped = bytearray(valid)
        flipped[bit // 8] ^= 1 << (bit % 8)
        return bytes(flipped)
    if kind == 7:  # unknown fields, before, among or after the known ones
        fields = draw(st.lists(_unknown_field(), min_size=1, max_size=4))
        at = draw(st.integers(0, len(fields)))
        return b"".join(fields[:at]) + valid + b"".join(fields[at:])
    if kind == 8:
        return valid + draw(_nested())
    if kind == 9:  # NodeName (field 1; Encoding for a global watch) that is no UTF-8
        return valid + _delimited(1, draw(st.sampled_from(_NOT_UTF8)))
    if kind == 10:  # a field repeated thousands of times: the last one counts
        repeated = _delimited(1, b"node-1") if method.local else _key(1, 0) + _varint(1)
        return repeated * draw(st.integers(2, 20_000)) + valid
    if kind == 11:  # one huge field, sometimes past what gRPC takes
        size = draw(st.sampled_from([1 << 10, 1 << 16, 1 << 20, MAX_REQUEST + 1]))
        return valid + _delimited(draw(st.integers(1, 3)), b"n" * size)
    return b""  # all fields at their defaults


# --- what the server must answer


@dataclass(frozen=True)
class Expected:
    states: int
    """First states answered, one per request that names a node the stream did not watch."""
    end: grpc.StatusCode | None
    """How the call ends; None: it waits for the next change of the state (cancelled then)."""
    oversized: bool = False
    """A request gRPC refuses (RESOURCE_EXHAUSTED) comes before the end: it may come at once."""
    asked: bool = False
    """The first request says what the watcher holds (batchv1's Holds): the brain asks for its
    bucket digests (a message of no ops) and takes the next request for the answer."""
    foreseen: bool = True
    """False: an answer of well-formed digests, which the brain goes on from (the model does
    not follow it further)."""


def _expected(method: Method, requests: list[bytes]) -> Expected:
    if method.request is None:
        return Expected(0, grpc.StatusCode.UNIMPLEMENTED)
    watching: str | None = None
    for index, data in enumerate(requests):
        if len(data) > MAX_REQUEST:
            return Expected(index, grpc.StatusCode.RESOURCE_EXHAUSTED, oversized=True)
        try:
            request = method.request.FromString(data)
        except DecodeError:
            return Expected(index, grpc.StatusCode.INVALID_ARGUMENT)
        holds = getattr(request, "Holds", b"")  # batchv1's watch alone has it
        if index == 0 and method.batched and method.local and holds:
            return _resumed(requests, holds)
        if method.local:
            node = getattr(request, "NodeName")  # noqa: B009  # the request's type varies
            if node == watching:
                return Expected(index, None)
            watching = node
        elif index > 0:
            return Expected(index, None)
    return Expected(len(requests), grpc.StatusCode.OK)


def _resumed(requests: list[bytes], holds: bytes) -> Expected:
    """A first request that says what it holds: refused unless a node digest; else the brain
    asks, and the next request, its answer, must hold the 256 bucket digests."""
    if len(holds) != DIGEST_BYTES:
        return Expected(0, grpc.StatusCode.INVALID_ARGUMENT)
    if len(requests) == 1:
        return Expected(0, grpc.StatusCode.OK, asked=True)  # no answer: the stream ends
    answer = requests[1]
    if len(answer) > MAX_REQUEST:
        return Expected(0, grpc.StatusCode.RESOURCE_EXHAUSTED, oversized=True, asked=True)
    try:
        buckets = batchv1_pb2.WatchReq.FromString(answer).Buckets
    except DecodeError:
        return Expected(0, grpc.StatusCode.INVALID_ARGUMENT, asked=True)
    if len(buckets) != BUCKETS * DIGEST_BYTES:
        return Expected(0, grpc.StatusCode.INVALID_ARGUMENT, asked=True)
    return Expected(0, None, asked=True, foreseen=False)


def _ops(method: Method, message: bytes) -> list[str | None]:
    """The kinds of the ops a response holds; it must be a well-formed message."""
    if method.batched:
        return [op.WhichOneof("Op") for op in batchv1_pb2.OpBatch.FromString(message).Ops]
    return [localv1_pb2.OpItem.FromString(message).WhichOneof("Op")]


@dataclass
class Outcome:
    states: int = 0
    code: grpc.StatusCode | None = None
    details: str = ""


def _exchange(brain: Brain, method: Method, requests: list[bytes], paced: bool) -> Outcome:
    """Make the call: requests all at once, or (``paced``) each after the answer to the one
    before; read until it ends, or until the states the model expects came and it waits."""
    expected = _expected(method, requests)
    outgoing: queue.Queue[bytes | None] = queue.Queue()

    def pending() -> Iterator[bytes]:
        while (item := outgoing.get()) is not None:
            yield bytes(item)  # grpc sends bytes, not a subclass

    left = list(requests)
    if paced and left and not expected.asked:  # a resume's answer follows the ask, not a state
        outgoing.put(left.pop(0))
    else:
        for data in left:
            outgoing.put(data)
        left = []
    if not left:
        outgoing.put(None)
    call = _call(brain.channel, method.path, pending())
    outcome = Outcome()
    ops: list[str | None] = []
    try:
        for message in call:
            assert isinstance(message, bytes)
            ops += _ops(method, message)
            if not ops:
                assert expected.asked, "a message of no ops, though nothing was resumed"
                continue
            if ops[-1] != "Sync":
                continue
            assert ops[0] == "Reset", ops  # each answer here is a whole first state
            assert ops.count("Reset") == 1, ops
            assert ops.count("Sync") == 1, ops
            ops = []
            outcome.states += 1
            if left:
                outgoing.put(left.pop(0))
                if not left:
                    outgoing.put(None)
            if expected.end is None and outcome.states == expected.states:
                return outcome  # it waits for a change that never comes: cancelled
        outcome.code = call.code()
        outcome.details = call.details() or ""
    except grpc.RpcError:
        outcome.code = call.code()
        outcome.details = call.details() or ""
    finally:
        outgoing.put(None)  # the request thread must not wait on us forever
        call.cancel()
    assert not ops, f"the stream ended inside a change set: {ops}, {outcome}"
    return outcome


def _check(brain: Brain, method: Method, requests: list[bytes], outcome: Outcome) -> None:
    expected = _expected(method, requests)
    said = f"{method.path}, {[Wire(r) for r in requests]}: {outcome}"
    if not expected.foreseen:
        pass
    elif expected.oversized:
        # gRPC refuses the large message as it arrives, maybe before earlier answers are sent.
        assert outcome.states <= expected.states, said
    else:
        assert outcome.states == expected.states, said
    if expected.end is not None and expected.foreseen:
        assert outcome.code == expected.end, said
    brain.first_states += outcome.states
    name = outcome.code.name if outcome.code is not None else "WAITING"
    brain.statuses[name] = brain.statuses.get(name, 0) + 1


# --- the fuzz test

_requests = st.sampled_from(METHODS * 3 + UNSERVED).flatmap(
    lambda m: st.tuples(st.just(m), st.lists(_request(m), max_size=4))
)


@fuzz_settings(300, deadline_ms=10_000)
@given(call=_requests, paced=st.booleans())
def test_no_request_breaks_the_server_or_another_watcher(
    brain: Brain, call: tuple[Method, list[bytes]], paced: bool
) -> None:
    method, requests = call
    outcome = _exchange(brain, method, requests, paced)
    _check(brain, method, requests, outcome)
    brain.examples += 1
    logged = brain.records.since(brain.checked_log)
    brain.checked_log += len(logged)
    bugs = _bugs(logged)
    assert bugs == [], bugs
    if brain.examples % CHECK_EVERY == 0:
        _check_whole(brain)


# --- the seeds of the bugs the fuzzing found, as plain regression tests


@pytest.mark.parametrize("name", ["x" * 8_000, "é" * 3_000, "x" * 100_000, "\n" * 20_000])
def test_a_watcher_of_an_unknown_node_with_a_long_name_gets_its_state_and_a_short_warning(
    brain: Brain, name: str
) -> None:
    """The warning quoted the whole name in the stream's metadata: past 8 KiB, grpc clients
    refused it (RESOURCE_EXHAUSTED, "received metadata size exceeds soft limit"), and the
    watch failed before its first state; the log line was as long, and the brain remembered
    every such name whole (4096 of them, up to 4 MiB each)."""
    call = _call(brain.channel, "/localv1.Sets/Watch", iter([_valid(localv1_pb2.WatchReq, name)]))
    ops: list[str | None] = []
    try:
        for message in call:
            ops += _ops(METHODS[0], message)
            if ops[-1] == "Sync":
                break
        warnings = [v for k, v in call.initial_metadata() if k == "kpng-warning"]
    finally:
        call.cancel()
    assert ops[0] == "Reset", (call.code(), call.details())
    assert ops[-1] == "Sync", ops
    assert len(warnings) == 1
    assert f"... ({len(name)} characters) is not among the 3 nodes" in warnings[0]
    assert len(warnings[0]) < 4096
    assert all(len(key) <= 253 for key, _ in brain.serving.watch._warned)
