"""First states from a zone's packed base and the node's corrections (issue 42, item 2): what a
watcher that asked for packing applies must be exactly its node's state, through any change;
a change repacks only its bucket; a Packed entry a peer sends is bounded; and the watcher hands
its sink the Sink's order whatever order the whole state came in."""

from __future__ import annotations

import asyncio
import random
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest

from kpng.api import batchv1_pb2, codec, localv1_pb2
from kpng.api.digests import bucket_of
from kpng.api.localv1_pb2 import EndpointsSet, ServicesSet
from kpng.api.ops import FirstOps, local_ops
from kpng.client import watch
from kpng.errors import WireError
from kpng.model.cluster import ServiceKey
from kpng.model.messages import Endpoint, ServiceEndpoints
from kpng.remote.watching import LocalOps
from kpng.resolver.resolving import ClusterResolver, NodeView
from kpng.server.changesets import SharedOps
from kpng.server.firststates import BaseFrames, corrections
from kpng.store import Store
from tests.pure.recording import RecordingSink
from tests.pure.test_server import _run, _serving, _target
from tests.pure.test_zone_bases import (
    KINDS,
    NODES,
    _apply,
    _cluster,
    _random_service,
    _random_slice,
    _service,
    _slice,
)

_encode = msgspec.json.encode


def _frames(cluster: ClusterResolver, message_bytes: int = 1 << 18) -> tuple[BaseFrames, SharedOps]:
    """Wired to ``cluster`` as ``serving.WatchServer`` wires its JSON ``Encoders``."""
    first_ops = FirstOps(_encode, _encode)
    frames = BaseFrames(first_ops, message_bytes=message_bytes)
    cluster.on_change.append(first_ops.forget)
    cluster.on_base_change.append(frames.changed)
    return frames, SharedOps(_encode, _encode, first_ops)


def _inflated(pieces: Iterable[bytes]) -> list[bytes]:
    """The ops of OpBatches of Packed entries, as a watcher reads them."""
    ops: list[bytes] = []
    for piece in pieces:
        for entry in batchv1_pb2.OpBatch.FromString(piece).Packed:
            inner = batchv1_pb2.OpBatch.FromString(codec.unpacked(entry))
            ops += [op.SerializeToString() for op in inner.Ops]
    return ops


def _applied(ops: Iterable[bytes]) -> dict[tuple[int, str], bytes]:
    """What a watcher holds after ``ops`` from nothing: payload by (set, path)."""
    held: dict[tuple[int, str], bytes] = {}
    for data in ops:
        op = localv1_pb2.OpItem.FromString(data)
        if op.HasField("Set"):
            held[(op.Set.Ref.Set, op.Set.Ref.Path)] = op.Set.Bytes
        elif op.HasField("Delete"):
            held.pop((op.Delete.Set, op.Delete.Path), None)
    return held


def _whole(state: Mapping[ServiceKey, ServiceEndpoints]) -> dict[tuple[int, str], bytes]:
    ops = local_ops(
        updated=state, deleted=(), previous={}, encode_service=_encode, encode_endpoint=_encode
    )
    return _applied(ops)


def _first_state(frames: BaseFrames, shared_ops: SharedOps, view: NodeView) -> list[bytes]:
    base, zone, overlay = view.layers()
    assert zone is not None
    return _inflated(frames.messages(zone, base)) + corrections(base, overlay, shared_ops).ops


@pytest.mark.parametrize("node", NODES)
def test_a_packed_base_and_the_node_s_corrections_make_the_node_s_state(node: str) -> None:
    cluster, _ = _cluster(list(KINDS))
    frames, shared_ops = _frames(cluster)
    others = [cluster.view(n) for n in NODES if n != node]  # the zones' bases, made by others
    for other in others:
        other.resolve()
    view = cluster.view(node)
    view.resolve()
    _, _, overlay = view.layers()
    assert overlay or node in ("n1", "nz", "ghost")  # hosts, or is hinted, some endpoints
    assert _applied(_first_state(frames, shared_ops, view)) == _whole(view.state)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_packed_bases_follow_random_changes(seed: int) -> None:
    """Random changes, views coming, resolving and going: at every step, the first state each
    open view would be sent now is exactly its state (pieces made at earlier steps reused)."""
    rng = random.Random(seed)
    cluster = ClusterResolver()
    frames, shared_ops = _frames(cluster, message_bytes=rng.choice([64, 1 << 18]))
    views: list[NodeView] = []
    for _step in range(150):
        action = rng.random()
        i = rng.randrange(12)
        if action < 0.25:
            service = _random_service(rng, i) if rng.random() < 0.85 else None
            _apply(cluster, ("service", ("ns", f"s{i}"), service))
        elif action < 0.6:
            sl = _random_slice(rng, i)
            _apply(cluster, ("slice", (sl.namespace, sl.name), sl if rng.random() < 0.85 else None))
        elif action < 0.65 and views:
            views.pop(rng.randrange(len(views))).close()
        elif action < 0.8 and len(views) < 6:
            views.append(view := cluster.view(rng.choice(NODES)))
            view.resolve()
        elif views:
            rng.choice(views).resolve()
        for view in views:
            assert _applied(_first_state(frames, shared_ops, view)) == _whole(view.state)


def test_a_change_repacks_only_its_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = ClusterResolver()
    for i in range(300):
        cluster.set_service(("ns", f"s{i}"), _service(f"s{i}"))
    frames, shared_ops = _frames(cluster)
    view = cluster.view("n0")
    view.resolve()
    base, zone, _ = view.layers()
    assert zone is not None
    packs: list[bytes] = []
    pack = codec.packed

    def counted(batch: bytes) -> bytes:
        packs.append(batch)
        return pack(batch)

    monkeypatch.setattr(codec, "packed", counted)
    before = frames.messages(zone, base)
    assert len(packs) == len({bucket_of(f"ns/s{i}") for i in range(300)})  # one per bucket
    assert frames.messages(zone, base) is before  # nothing changed: the same messages
    packs.clear()
    cluster.set_slice(("ns", "s7-1"), _slice("s7", *KINDS["plain"][1][0].endpoints))
    cluster.view("n1").resolve()  # moves the zone's base on
    after = frames.messages(zone, base)
    assert len(packs) == 1
    assert b"ns/s7" in packs[0]
    assert after != before
    assert _applied(_first_state(frames, shared_ops, view)) == _whole(view.state)


def test_packed_is_15_times_smaller_than_the_json_it_holds() -> None:
    cluster = ClusterResolver()
    for i in range(2000):
        cluster.set_service(("ns", f"s{i}"), _service(f"s{i}"))
        cluster.set_slice(("ns", f"s{i}-1"), _slice(f"s{i}", *KINDS["plain"][1][0].endpoints))
    frames, _ = _frames(cluster)
    view = cluster.view("n1")
    view.resolve()
    base, zone, _ = view.layers()
    assert zone is not None
    packed = sum(map(len, frames.messages(zone, base)))
    plain = sum(map(len, _inflated(frames.messages(zone, base))))
    assert plain > 10 * packed


# --- a Packed entry a peer sends


def test_an_entry_inflates_back_to_its_ops() -> None:
    batch = codec.op_batch([codec.OP_RESET, codec.OP_SYNC])
    (entry,) = batchv1_pb2.OpBatch.FromString(codec.packed(batch)).Packed
    assert codec.unpacked(entry) == batch


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (zlib.compress(b"\0" * (2 << 20)), "more than 1048576 bytes"),  # 2 MiB from 2 kB
        (b"not zlib at all", "does not inflate"),
        (zlib.compress(b"ops")[:-3], "not one whole zlib stream"),
        (zlib.compress(b"ops") + b"more", "not one whole zlib stream"),
    ],
)
def test_an_entry_that_inflates_too_far_or_badly_is_refused(entry: bytes, says: str) -> None:
    with pytest.raises(WireError, match=says):
        codec.unpacked(entry, limit=1 << 20)


def test_packing_refuses_what_no_watcher_would_inflate() -> None:
    with pytest.raises(ValueError, match="more than a Packed entry may hold"):
        codec.packed(b"\0" * (codec.PACKED_BYTES_MAX + 1))


# --- the watcher's side


def _set(set_: int, path: str, value: msgspec.Struct) -> tuple[str, int, str, bytes]:
    return ("Set", set_, path, _encode(value))


def test_a_whole_state_in_any_order_reaches_the_sink_in_the_sink_s_order() -> None:
    """A packed first state comes in bucket order and sets some paths twice; a Set kpng cannot
    read keeps the value set before it."""
    sink = RecordingSink()
    ops = LocalOps(sink, json=True, url="test", warned=set())
    web, api = _service("web"), _service("api")
    web_b = msgspec.structs.replace(web, Namespace="ns-b")
    ep = Endpoint()
    script = [
        ("Reset", 0, "", b""),
        _set(EndpointsSet, "ns/web/b", ep),
        _set(ServicesSet, "ns/web", web),
        _set(EndpointsSet, "ns-b/web/a", ep),
        _set(ServicesSet, "ns-b/web", web_b),
        _set(EndpointsSet, "ns/web/a", ep),
        _set(ServicesSet, "ns/api", api),
        _set(EndpointsSet, "ns/api/z", ep),
        _set(EndpointsSet, "ns/web/b", ep),  # twice: the corrections after the base
        ("Delete", EndpointsSet, "ns/api/z", b""),
        ("Set", ServicesSet, "ns/api", b"{not json"),  # skipped: the first value stays
    ]
    for op in script:
        ops.op(*op)
    assert asyncio.run(ops.sync()) is False
    assert sink.calls == [
        ("reset",),
        ("set_service", "ns", "api"),
        ("set_service", "ns", "web"),
        ("set_service", "ns-b", "web"),  # by namespace first: "ns-b/" sorts before "ns/"
        ("set_endpoint", "ns", "web", "a"),
        ("set_endpoint", "ns", "web", "b"),
        ("set_endpoint", "ns-b", "web", "a"),
        ("sync",),
    ]


# --- over real gRPC


def _store(services: int) -> Store:
    store = Store()
    handle = store.source("test")
    for i in range(services):
        handle.set_service(("ns", f"s{i}"), _service(f"s{i}"))
        handle.set_slice(("ns", f"s{i}-1"), _slice(f"s{i}", *KINDS["plain"][1][0].endpoints))
    handle.mark_synced()
    return store


async def _first_state_bytes(channel: grpc.aio.Channel, packed: bool) -> tuple[int, list[bytes]]:
    call = channel.stream_stream(
        "/kpng.batchv1.Sets/Watch",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )()  # type: ignore[call-arg]
    # n1 hosts no endpoint: its state is its zone's base (n0's would be corrections only).
    request = batchv1_pb2.WatchReq(NodeName="n1", Encoding=batchv1_pb2.JSON, Packed=packed)
    await call.write(request.SerializeToString())
    size, ops = 0, list[bytes]()
    while not ops or localv1_pb2.OpItem.FromString(ops[-1]).HasField("Sync") is False:
        data = await asyncio.wait_for(call.read(), 20)
        assert isinstance(data, bytes)
        size += len(data)
        batch = batchv1_pb2.OpBatch.FromString(data)
        ops += _inflated([data]) if batch.Packed else []
        ops += [op.SerializeToString() for op in batch.Ops]
    call.cancel()
    return size, ops


def test_a_watcher_that_asks_for_packing_gets_the_same_state_in_a_fifth_of_the_bytes(
    tmp_path: Path,
) -> None:
    store = _store(1000)

    async def scenario() -> tuple[tuple[int, list[bytes]], ...]:
        async with (
            _serving(store, [f"unix://{tmp_path}/kpng.sock"]) as serving,
            grpc.aio.insecure_channel(_target(serving)) as channel,
        ):
            plain = await _first_state_bytes(channel, packed=False)
            packed = await _first_state_bytes(channel, packed=True)
            return plain, packed

    (plain_bytes, plain_ops), (packed_bytes, packed_ops) = _run(scenario())
    assert _applied(packed_ops) == _applied(plain_ops)
    assert len(_applied(plain_ops)) > 3000  # services, endpoints, the node's facts
    assert packed_bytes * 5 < plain_bytes  # buckets of 4 services here; of 40 at 10k: 15 times


def test_kpng_s_watcher_asks_for_packing_and_hands_its_sink_the_sink_s_order(
    tmp_path: Path,
) -> None:
    store = _store(300)
    sink = RecordingSink()

    async def scenario() -> list[tuple[Any, ...]]:
        async with _serving(store, [f"unix://{tmp_path}/kpng.sock"]) as serving:
            task = asyncio.create_task(watch(sink, api=serving.addresses[0], node_name="n0"))
            try:
                return await sink.next_sync()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    calls = _run(scenario())
    services = [c[1:] for c in calls if c[0] == "set_service"]
    endpoints = [c[1:] for c in calls if c[0] == "set_endpoint"]
    assert (calls[0], calls[-1]) == (("reset",), ("sync",))
    assert (services, len(services)) == (sorted(services), 300)
    assert (endpoints, len(endpoints)) == (sorted(endpoints), 600)
    assert calls[1 : 1 + len(services)] == [("set_service", *s) for s in services]
