"""Fuzzing kpng.client against a broken or hostile server: a real gRPC server on a unix socket
serves, on kpng's batched watch (JSON payloads) or on Go KPNG's localv1 watch (protobuf), a
valid change set with hostile ops mixed in — payloads that do not decode, are truncated, hold
unknown enum values or name another service than their path, paths that name nothing, unknown
sets, Deletes of what was never Set, duplicate Resets, a message larger than the client takes —
or streams of bytes that are no message at all.

The property: nothing escapes the watch but kpng's own errors (NoStateError, when no state ever
comes); a hostile op changes nothing: the state the backend gets is exactly the valid change
set's.

Bounded: see tests/pure/fuzzing.py (``KPNG_FUZZ_EXAMPLES`` runs a longer campaign).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kpng.api import batchv1_pb2, codec, localv1_pb2
from kpng.api.localv1_pb2 import ChangeTriggersSet, EndpointsSet, NodeFactsSet, ServicesSet
from kpng.client import Backoff, NodeState, watch_state
from kpng.errors import KpngError, WireError
from kpng.model.messages import (
    ChangeTriggers,
    Endpoint,
    EndpointScopes,
    IPSet,
    NodeFacts,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)
from kpng.model.paths import endpoint_keys, in_key_order
from kpng.remote.address import MAX_MESSAGE
from kpng.remote.watching import LocalOps
from tests.pure.fuzzing import fuzz_settings, json_values
from tests.pure.recording import RecordingSink

# --- a valid state, as kpng's brain would send it


@st.composite
def _states(draw: st.DrawFn) -> dict[tuple[str, str], ServiceEndpoints]:
    state: dict[tuple[str, str], ServiceEndpoints] = {}
    for name in draw(st.lists(st.sampled_from(["web", "api", "db"]), unique=True, max_size=3)):
        service = Service(
            Namespace="shop",
            Name=name,
            Type="ClusterIP",
            IPs=ServiceIPs(ClusterIPs=IPSet(V4=(f"10.96.0.{len(state) + 1}",))),
            Ports=(PortMapping(Name="http", Protocol="TCP", Port=80, TargetPort=8080),),
        )
        endpoints = tuple(
            Endpoint(
                IPs=IPSet(V4=(f"10.244.{len(state)}.{i}",)),
                PortOverrides=(PortName(Name="http", Port=8080, Protocol="TCP"),),
                Scopes=EndpointScopes(Internal=True, External=True, Cluster=True),
            )
            for i in range(draw(st.integers(0, 2)))
        )
        state[("shop", name)] = ServiceEndpoints(service, in_key_order(endpoints))
    return state


def _valid_ops(state: dict[tuple[str, str], ServiceEndpoints], json_: bool) -> list[bytes]:
    encode: Any = msgspec.json.encode if json_ else None
    service = encode or codec.SERVICE.encode
    endpoint = encode or codec.ENDPOINT.encode
    facts = encode or codec.NODE_FACTS.encode
    ops = [codec.op_set(NodeFactsSet, "node", facts(FACTS))]
    for (namespace, name), se in sorted(state.items()):
        ops.append(codec.op_set(ServicesSet, f"{namespace}/{name}", service(se.service)))
        for key, ep in sorted(endpoint_keys(se.endpoints).items()):
            ops.append(codec.op_set(EndpointsSet, f"{namespace}/{name}/{key}", endpoint(ep)))
    return ops


FACTS = NodeFacts(PodCIDRs=("10.244.0.0/24",))

# --- hostile ops: none may change the state

_garbage = st.one_of(
    st.binary(max_size=40),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"{", b'{"Name": 1}', b"\x0a\xff", b"\x12\x05ab", b"\x08\x80\x80\x80\x80"]),
    # A well-formed payload cut short.
    st.integers(1, 30).map(lambda n: msgspec.json.encode(FACTS)[:n]),
)  # fmt: skip
_hostile_paths = st.one_of(
    st.sampled_from(["", "/", "shop", "shop/", "zz/web", "zz/web/1.2.3.4", "a/b/c/d", "node"]),
    st.text(max_size=8).map(lambda t: "zz" + t),
)


@st.composite
def _hostile_op(draw: st.DrawFn, json_: bool) -> bytes:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        # Garbage for a known set, at any path, a valid one included. Only what does not decode:
        # ``{}`` is a well-formed (empty) Endpoint, whose Set a server may well mean.
        set_ = draw(st.sampled_from([ServicesSet, EndpointsSet, NodeFactsSet, ChangeTriggersSet]))
        path = draw(st.one_of(_hostile_paths, st.just("shop/web"), st.just("shop/web/10.244.0.0")))
        payload = draw(_garbage.filter(lambda p: not _decodes(set_, p, json_)))
        return codec.op_set(set_, path, payload)
    if kind == 1:
        # Well-formed payloads whose path names nothing (or another object).
        path = draw(_hostile_paths)
        other = Service(Namespace="zz", Name="other")
        payload = msgspec.json.encode(other) if json_ else codec.SERVICE.encode(other)
        return codec.op_set(draw(st.sampled_from([ServicesSet, EndpointsSet])), path, payload)
    if kind == 2:
        return codec.op_set(draw(st.integers(5, 2**31)), draw(_hostile_paths), draw(_garbage))
    if kind == 3:
        deleted: int = draw(st.sampled_from([ServicesSet, EndpointsSet, NodeFactsSet, 77]))
        return codec.op_delete(deleted, draw(_hostile_paths))
    if kind == 4 and not json_:
        # Proto3 enums are open: a protocol number the model has no name for.
        port = localv1_pb2.PortMapping(Name="http", Protocol=9, Port=80)  # type: ignore[arg-type]
        message = localv1_pb2.Service(Namespace="shop", Name="web", Ports=[port])
        return codec.op_set(ServicesSet, "shop/web", message.SerializeToString())
    return codec.OP_RESET  # only before the first Set (below): a Reset later is a real one


_TYPES: dict[int, tuple[type[Any], codec.Codec[Any]]] = {
    ServicesSet: (Service, codec.SERVICE),
    EndpointsSet: (Endpoint, codec.ENDPOINT),
    NodeFactsSet: (NodeFacts, codec.NODE_FACTS),
    ChangeTriggersSet: (ChangeTriggers, codec.CHANGE_TRIGGERS),
}


def _decodes(set_: int, payload: bytes, json_: bool) -> bool:
    struct, proto = _TYPES[set_]
    try:
        if json_:
            msgspec.json.decode(payload, type=struct)
        else:
            proto.decode(payload)
    except (msgspec.DecodeError, WireError):
        return False
    return True


# --- the hostile server


class _Script:
    """What the server sends: per connection, messages (a change set, or raw bytes that may be
    no message at all), then it hangs up, or waits for the client to go."""

    def __init__(self) -> None:
        self.connections: list[tuple[list[bytes], bool]] = []
        self.served = 0

    def next(self) -> tuple[list[bytes], bool]:
        script = self.connections[min(self.served, len(self.connections) - 1)]
        self.served += 1
        return script


async def _serve(socket: Path, script: _Script, batched: bool) -> grpc.aio.Server:
    async def watch(requests: AsyncIterator[bytes], _: Any) -> AsyncIterator[bytes]:
        await anext(aiter(requests))
        messages, hang_up = script.next()
        for message in messages:
            yield message
        if hang_up:
            return
        async for _ in requests:
            pass

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(watch)  # raw bytes both ways
    service = "kpng.batchv1.Sets" if batched else "localv1.Sets"
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(service, {"Watch": handler})]
    )
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    return server


def _messages(ops: list[bytes], batched: bool) -> list[bytes]:
    """The stream: one OpBatch of everything (batched), or one OpItem a message (localv1)."""
    ops = [*ops, codec.OP_SYNC]
    return [codec.op_batch(ops)] if batched else ops


async def _watched(socket: Path, script: _Script, batched: bool) -> NodeState | None:
    """The first state a client watching the script gets; None if it gets none."""
    server = await _serve(socket, script, batched)
    states: list[NodeState] = []
    try:
        await watch_state(
            states.append,
            api=f"unix://{socket}",
            node_name="node-1",
            once=True,
            backoff=Backoff(initial=0.001, maximum=0.01),
            connect_timeout=1.0,
        )
    except KpngError:
        pass  # NoStateError: what a client of a server that never sends a state must say
    finally:
        await server.stop(grace=None)
    return states[0] if states else None


@pytest.fixture(scope="module")
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-client")


@fuzz_settings(60, deadline_ms=5000)
@given(data=st.data(), state=_states(), batched=st.booleans())
def test_hostile_ops_change_nothing_the_backend_gets(
    socket_dir: Path, data: st.DataObject, state: dict[Any, ServiceEndpoints], batched: bool
) -> None:
    ops = _valid_ops(state, json_=batched)
    hostile = data.draw(st.lists(_hostile_op(json_=batched), max_size=6))
    resets = [op for op in hostile if op == codec.OP_RESET]
    others = [op for op in hostile if op != codec.OP_RESET]
    for op in others:  # each at a random place among the valid ops
        ops.insert(data.draw(st.integers(0, len(ops))), op)
    script = _Script()
    script.connections = [(_messages([codec.OP_RESET, *resets, *ops], batched), False)]
    got = asyncio.run(_watched(socket_dir / "kpng.sock", script, batched))
    assert got is not None
    assert dict(got.services) == state
    assert got.pod_cidrs == FACTS.PodCIDRs


_raw_messages = st.one_of(
    st.binary(max_size=64),
    # A valid batch cut short, or with bytes after it.
    st.integers(1, 40).map(lambda n: codec.op_batch([codec.OP_RESET, codec.OP_SYNC])[:-n]),
    st.binary(min_size=1, max_size=8).map(lambda b: codec.op_batch([codec.OP_SYNC]) + b),
)


@fuzz_settings(40, deadline_ms=5000)
@given(garbage=st.lists(_raw_messages, min_size=1, max_size=3), state=_states())
def test_a_stream_of_garbage_is_survived_and_the_next_connection_served(
    socket_dir: Path, garbage: list[bytes], state: dict[Any, ServiceEndpoints]
) -> None:
    """Bytes that are no OpBatch end the connection (what they held is unknown); the client
    connects again, and the next connection's state is served as if nothing happened. Bytes
    that happen to be a change set are served, but then only what they hold."""
    script = _Script()
    script.connections = [
        (garbage, True),
        (_messages([codec.OP_RESET, *_valid_ops(state, True)], True), False),
    ]
    got = asyncio.run(_watched(socket_dir / "kpng.sock", script, batched=True))
    assert got is not None
    if script.served > 1:
        assert dict(got.services) == state


def _replaced(
    old: dict[tuple[str, str], ServiceEndpoints], new: dict[tuple[str, str], ServiceEndpoints]
) -> list[bytes]:
    """The ops of a change set from ``old`` to ``new``: every endpoint and service of ``old``
    deleted, then ``new`` set."""
    ops = []
    for (namespace, name), se in sorted(old.items()):
        for key in sorted(endpoint_keys(se.endpoints)):
            ops.append(codec.op_delete(EndpointsSet, f"{namespace}/{name}/{key}"))
        ops.append(codec.op_delete(ServicesSet, f"{namespace}/{name}"))
    return ops + _valid_ops(new, True)


_FOLLOWING = batchv1_pb2.OpBatch(Following=True).SerializeToString()


@fuzz_settings(40, deadline_ms=5000)
@given(data=st.data(), first=_states(), then=_states(), garbage=st.none() | _raw_messages)
def test_a_followed_stream_survives_hostile_ops_and_garbage_past_its_first_state(
    socket_dir: Path,
    data: st.DataObject,
    first: dict[Any, ServiceEndpoints],
    then: dict[Any, ServiceEndpoints],
    garbage: bytes | None,
) -> None:
    """Past its first change set a followed watch reads on by itself (it reads ahead while its
    backend syncs): hostile ops in a later change set change nothing the backend gets, and bytes
    that are no OpBatch end the connection, the next one serving the state."""
    assume(first != then)
    change = _replaced(first, then)
    hostile = data.draw(st.lists(_hostile_op(json_=True), max_size=6))
    for op in hostile:
        if op != codec.OP_RESET:  # a Reset there is a real one
            change.insert(data.draw(st.integers(0, len(change))), op)
    followed = [_messages([codec.OP_RESET, *_valid_ops(first, True)], True)[0] + _FOLLOWING]
    if garbage is not None:  # before the change: the watch stops once it has the state
        followed.append(garbage)
    followed += _messages(change, True)
    script = _Script()
    script.connections = [
        (followed, False),
        (_messages([codec.OP_RESET, *_valid_ops(then, True)], True), False),
    ]
    seen: list[tuple[dict[Any, ServiceEndpoints], tuple[str, ...]]] = []

    def handle(state: NodeState) -> bool:
        # Copied: a NodeState's services are the client's own, changed by the next state.
        seen.append((dict(state.services), state.pod_cidrs))
        return seen[-1][0] == then

    async def watched() -> None:
        server = await _serve(socket_dir / "kpng.sock", script, True)
        try:
            await asyncio.wait_for(
                watch_state(
                    handle,
                    api=f"unix://{socket_dir / 'kpng.sock'}",
                    node_name="node-1",
                    backoff=Backoff(initial=0.001, maximum=0.01),
                ),
                10,
            )
        finally:
            await server.stop(grace=None)

    asyncio.run(watched())
    assert seen[0][0] == first
    assert seen[-1][0] == then
    assert all(pod_cidrs == FACTS.PodCIDRs for _, pod_cidrs in seen)


@pytest.mark.slow
def test_a_message_larger_than_the_client_takes_ends_the_connection_not_the_client(
    socket_dir: Path,
) -> None:
    """A change set above the client's bound is refused by its channel (RESOURCE_EXHAUSTED),
    unread: the client connects again and takes the next, normal one."""
    huge = codec.op_set(ServicesSet, "zz/huge", b"x" * (MAX_MESSAGE + 1))
    state = {("shop", "web"): _web()}
    script = _Script()
    script.connections = [
        (_messages([codec.OP_RESET, huge], True), False),
        (_messages([codec.OP_RESET, *_valid_ops(state, True)], True), False),
    ]
    got = asyncio.run(_watched(socket_dir / "kpng.sock", script, batched=True))
    assert script.served == 2
    assert got is not None
    assert dict(got.services) == state


def _web() -> ServiceEndpoints:
    return ServiceEndpoints(Service(Namespace="shop", Name="web", Type="ClusterIP"), ())


# --- the seeds of the bugs the fuzzing found, as plain regression tests


class _Recorder(RecordingSink):
    """test_server's recording sink, with the node's facts recorded too."""

    def set_node(self, facts: NodeFacts) -> None:
        self.calls.append(("set_node",))


@pytest.mark.parametrize(
    ("json_", "kind", "set_", "path", "payload"),
    [
        # ValueError (unpacking path.split) killed the watch: no namespace/service/key.
        (True, "Delete", EndpointsSet, "shop", b""),
        (True, "Set", EndpointsSet, "shop/web", msgspec.json.encode(Endpoint())),
        # msgspec.DecodeError and protobuf's DecodeError escaped the watch.
        (True, "Set", ServicesSet, "shop/web", b"{"),
        (False, "Set", EndpointsSet, "shop/web/10.0.0.1", b"\x0a\xff"),
        (True, "Set", NodeFactsSet, "node", b"[1]"),
        # KeyError: proto3 enums are open, and Protocol 9 has no name in the model.
        (False, "Set", ServicesSet, "shop/web", localv1_pb2.Service(
            Namespace="shop", Name="web",
            Ports=[localv1_pb2.PortMapping(Protocol=9)],  # type: ignore[arg-type]
        ).SerializeToString()),
        # A payload for another service than its path: the key it is deleted by holds nothing.
        (True, "Set", ServicesSet, "shop/web", msgspec.json.encode(Service(Name="other"))),
        (True, "Set", ServicesSet, "/", msgspec.json.encode(Service())),
    ],
)  # fmt: skip
def test_an_op_kpng_cannot_read_is_reported_and_skipped(
    json_: bool, kind: str, set_: int, path: str, payload: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    sink = _Recorder()
    ops = LocalOps(sink, json=json_, url="tcp://brain:1", warned=set())
    ops.op(kind, set_, path, payload)
    assert sink.calls == []
    assert f"tcp://brain:1 sent a {kind} of set {set_}, path {path!r}" in caplog.text
    assert "skipped" in caplog.text
