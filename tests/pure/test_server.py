"""The watch servers over real gRPC on unix sockets and TCP, against kpng's and independent
clients."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import msgspec
import pytest

from kpng.api import batchv1_pb2, codec, localv1_pb2
from kpng.client import Api, Backoff, ClientTls, NodeState, watch, watch_state
from kpng.errors import KpngError
from kpng.model.messages import Service
from kpng.remote.watching import _follow_once, global_rpcs
from kpng.resolver.resolving import NodeResolver
from kpng.server.hub import Turns
from kpng.server.serving import ListenAddress, Serving, TlsFiles, serve
from kpng.sources.api.ops import GlobalOps
from kpng.sources.file import stage
from kpng.sources.manifests import parse
from kpng.store import SourceHandle, Store
from kpng.testing.waiting import eventually
from rig.cluster import make_pki
from tests.conftest import EXAMPLE
from tests.pure import wire
from tests.pure.recording import RecordingSink

T = TypeVar("T")
WAIT_S = 20.0
SERVICES_SET, ENDPOINTS_SET = 1, 2


def _run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


def _example_store(*, synced: bool = True) -> tuple[Store, SourceHandle]:
    store = Store()
    handle = store.source("test")
    parsed = parse(EXAMPLE.read_bytes(), filename="x")
    assert not parsed.errors
    for key, obj in parsed.objects.items():
        stage(handle, key, obj)
    if synced:
        handle.mark_synced()
    return store, handle


def _expected(store: Store, node: str) -> dict[Any, Any]:
    resolver = NodeResolver(node)
    for name, n in store.nodes.items():
        if name == node:
            resolver.set_node(n)
    for key, svc in store.services.items():
        resolver.set_service(key, svc)
    for key, sl in store.slices.items():
        resolver.set_slice(key, sl)
    resolver.resolve()
    return dict(resolver.state)


@contextlib.asynccontextmanager
async def _serving(store: Store, urls: list[str], **kwargs: Any) -> AsyncIterator[Serving]:
    ready: asyncio.Future[Serving] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve(
            store, listen=[ListenAddress.parse(u) for u in urls], started=ready.set_result, **kwargs
        )
    )
    try:
        yield await asyncio.wait_for(asyncio.shield(ready), WAIT_S)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def _connected(
    store: Store, tmp_path: Path
) -> AsyncIterator[tuple[Serving, grpc.aio.Channel]]:
    """A server on a unix socket and a raw channel to it."""
    async with (
        _serving(store, _urls(tmp_path, "unix")) as serving,
        grpc.aio.insecure_channel(_target(serving)) as channel,
    ):
        yield serving, channel


def _urls(tmp_path: Path, transport: str) -> list[str]:
    return [f"unix://{tmp_path}/kpng.sock"] if transport == "unix" else ["tcp://127.0.0.1:0"]


def _target(serving: Serving) -> str:
    url = serving.addresses[0]
    return (
        f"unix:{url.removeprefix('unix://')}"
        if url.startswith("unix://")
        else url.removeprefix("tcp://")
    )


class _RawWatch:
    """localv1.Sets/Watch with raw bytes both ways: the ops are read by tests/pure/wire.py."""

    def __init__(self, channel: grpc.aio.Channel, method: str = "/localv1.Sets/Watch") -> None:
        self.call = channel.stream_stream(
            method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )()  # type: ignore[call-arg]

    async def change_set(self, request: bytes) -> list[wire.Op]:
        await self.call.write(request)
        ops = []
        while True:
            data = await asyncio.wait_for(self.call.read(), WAIT_S)
            assert isinstance(data, bytes), data  # not the end of the stream
            ops.append(wire.op(data))
            if ops[-1].kind == "Sync":
                return ops


async def _write_and_read(call: Any, request: bytes) -> object:
    await call.write(request)
    return await asyncio.wait_for(call.read(), WAIT_S)


def _watch_req(node: str) -> bytes:
    return localv1_pb2.WatchReq(NodeName=node).SerializeToString()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_compatible_watch_reads_with_go_kpng_field_numbers(tmp_path: Path, transport: str) -> None:
    store, _ = _example_store()

    async def scenario() -> list[wire.Op]:
        async with (
            _serving(store, _urls(tmp_path, transport)) as serving,
            grpc.aio.insecure_channel(_target(serving)) as channel,
        ):
            return await _RawWatch(channel).change_set(_watch_req("node-2"))

    ops = _run(scenario())
    assert ops[0].kind == "Reset"
    assert ops[-1].kind == "Sync"
    services = {
        o.path: wire.fields(o.payload) for o in ops if o.kind == "Set" and o.set == SERVICES_SET
    }
    endpoints = {
        o.path: wire.fields(o.payload) for o in ops if o.kind == "Set" and o.set == ENDPOINTS_SET
    }
    assert sorted(services) == [
        "edge/ingress",
        "kube-system/dns-cache",
        "monitoring/metrics",
        "shop/api",
        "shop/pending",
        "shop/web",
    ]
    web = services["shop/web"]
    assert wire.text(web, 1) == "shop"  # Namespace
    assert wire.text(web, 2) == "web"  # Name
    assert wire.text(web, 3) == "ClusterIP"  # Type
    assert wire.strings(wire.sub(wire.sub(web, 4), 1), 1) == ["10.96.0.10"]  # IPs.ClusterIPs.V4
    port = wire.sub(web, 6)  # Ports[0]
    assert (wire.text(port, 1), wire.one(port, 2), wire.one(port, 3)) == ("http", 1, 80)
    assert wire.text(port, 6) == "http"  # TargetPortName
    assert wire.one(services["edge/ingress"], 7) == 1  # ExternalTrafficToLocal
    assert wire.one(services["edge/ingress"], 13) == 32000  # HealthCheckNodePort
    # Endpoint: IPs=2, PortOverrides=4 (PortName{Name=1; Port=2}), Scopes=5 {Internal=1; External=2}
    assert sorted(p for p in endpoints if p.startswith("shop/web/")) == ["shop/web/10.244.1.11"]
    ep = endpoints["shop/web/10.244.1.11"]
    assert wire.strings(wire.sub(ep, 2), 1) == ["10.244.1.11"]
    override = wire.sub(ep, 4)
    assert (wire.text(override, 1), wire.one(override, 2)) == ("http", 8080)
    assert wire.one(wire.sub(ep, 5), 1) == 1  # Internal
    assert wire.one(wire.sub(ep, 5), 2, 0) == 0  # not External: a ClusterIP service


def test_next_change_set_carries_only_the_difference(tmp_path: Path) -> None:
    store, handle = _example_store()

    async def scenario() -> list[wire.Op]:
        async with _connected(store, tmp_path) as (_, channel):
            watch_ = _RawWatch(channel)
            await watch_.change_set(_watch_req("node-2"))
            api = store.slices[("shop", "api-x7k2p")]
            handle.set_slice(api.key, msgspec.structs.replace(api, endpoints=api.endpoints[:1]))
            handle.commit()
            return await watch_.change_set(_watch_req("node-2"))

    ops = _run(scenario())
    assert ops == [wire.Op("Delete", ENDPOINTS_SET, "shop/api/10.244.2.22"), wire.Op("Sync")]


def test_nothing_is_served_before_the_sources_synced(tmp_path: Path) -> None:
    store, handle = _example_store(synced=False)

    async def scenario() -> list[wire.Op]:
        async with _connected(store, tmp_path) as (_, channel):
            watch_ = _RawWatch(channel)
            pending = asyncio.ensure_future(watch_.change_set(_watch_req("node-1")))
            await asyncio.sleep(0.3)
            assert not pending.done()
            handle.mark_synced()
            return await pending

    ops = _run(scenario())
    assert ops[0].kind == "Reset"
    assert len([o for o in ops if o.set == SERVICES_SET]) == 6


@pytest.mark.parametrize("node", ["node-1", "node-3", "not-a-node"])
def test_remote_state_equals_in_process_state(tmp_path: Path, node: str) -> None:
    store, _ = _example_store()
    got: list[NodeState] = []

    async def scenario() -> None:
        async with _serving(store, _urls(tmp_path, "unix")) as serving:
            await watch_state(got.append, api=serving.addresses[0], node_name=node, once=True)

    _run(scenario())
    assert dict(got[0].services) == _expected(store, node)


def test_many_watchers_of_different_nodes_at_once(tmp_path: Path) -> None:
    store, handle = _example_store()
    nodes = [f"node-{i % 4}" for i in range(40)]  # node-0 is unknown
    states: dict[int, list[NodeState]] = {i: [] for i in range(len(nodes))}

    async def scenario() -> None:
        async with _serving(store, _urls(tmp_path, "tcp")) as serving:
            watchers = [
                asyncio.create_task(
                    watch_state(states[i].append, api=serving.addresses[0], node_name=node)
                )
                for i, node in enumerate(nodes)
            ]
            await eventually(lambda: all(states.values()), within=WAIT_S)
            # one change that concerns every node: the api service's port
            api = store.services[("shop", "api")]
            port = msgspec.structs.replace(api.Ports[0], Port=9001)
            handle.set_service(("shop", "api"), msgspec.structs.replace(api, Ports=(port,)))
            handle.commit()
            await eventually(lambda: all(len(s) == 2 for s in states.values()), within=WAIT_S)
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    _run(scenario())
    for i, node in enumerate(nodes):
        _, second = states[i]
        assert second.updated == {("shop", "api")}
        assert dict(second.services) == _expected(store, node)


def test_malformed_request_and_vanished_client_cost_the_server_nothing(tmp_path: Path) -> None:
    store, _ = _example_store()

    async def scenario() -> tuple[grpc.StatusCode, int, int]:
        async with _connected(store, tmp_path) as (serving, channel):
            bad = _RawWatch(channel)
            await bad.call.write(b"\xff\xff\xff not a WatchReq")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await asyncio.wait_for(bad.call.read(), WAIT_S)
            vanishing = _RawWatch(channel)
            await vanishing.change_set(_watch_req("node-1"))
            views_while_open = len(serving.watch.hub.cluster._views)
            vanishing.call.cancel()
            await eventually(lambda: not serving.watch.hub.cluster._views, within=WAIT_S)
            # and the server still serves
            ops = await _RawWatch(channel).change_set(_watch_req("node-1"))
            return error.value.code(), views_while_open, len(ops)

    code, views_while_open, ops = _run(scenario())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert views_while_open == 1
    assert ops > 2


def test_server_restart_resyncs_and_the_backend_sees_only_what_changed(tmp_path: Path) -> None:
    """An outage longer than the connect timeout is waited out: it bounds the first state only."""
    store, handle = _example_store()
    urls = _urls(tmp_path, "unix")
    sink = RecordingSink()

    async def scenario() -> tuple[list[Any], list[Any]]:
        client: asyncio.Task[None] | None = None
        try:
            async with _serving(store, urls) as serving:
                backoff = Backoff(initial=0.05, maximum=0.2)
                client = asyncio.create_task(
                    watch(
                        sink,
                        api=serving.addresses[0],
                        node_name="node-1",
                        backoff=backoff,
                        connect_timeout=CONNECT_TIMEOUT_S,
                    )
                )
                first = await sink.next_sync()
            # the server is gone; meanwhile one endpoint goes away
            api = store.slices[("shop", "api-x7k2p")]
            handle.set_slice(api.key, msgspec.structs.replace(api, endpoints=api.endpoints[1:]))
            handle.commit()
            await asyncio.sleep(CONNECT_TIMEOUT_S * 2)  # an outage past the timeout
            assert not client.done()
            async with _serving(store, urls):
                after = await sink.next_sync()
            return first, after
        finally:
            if client is not None:
                client.cancel()
                await asyncio.gather(client, return_exceptions=True)

    first, after = _run(scenario())
    assert first[0] == ("reset",)
    assert len(first) > 10
    assert after == [("delete_endpoint", "shop", "api", "10.244.1.21"), ("sync",)]


def test_a_watcher_of_an_unknown_node_is_told_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The brain logs it; the client, told in the stream's metadata, logs it too."""
    store, _ = _example_store()
    warning = "node 'Node-1' is not among the 3 nodes the sources list"

    async def scenario() -> None:
        async with _serving(store, _urls(tmp_path, "unix")) as serving:
            states: list[NodeState] = []
            await watch_state(
                states.append, api=serving.addresses[0], node_name="Node-1", once=True
            )
            assert states

    with caplog.at_level(logging.WARNING):
        _run(scenario())
    said = [(r.name, r.getMessage()) for r in caplog.records if warning in r.getMessage()]
    assert [name for name, _ in said] == ["kpng.server.serving", "kpng.remote.watching"]
    assert "(node names are lowercase: node-1)" in said[1][1]


def test_watch_once_returns_after_the_first_sync(tmp_path: Path) -> None:
    store, _ = _example_store()
    sink = RecordingSink()

    async def scenario() -> None:
        async with _serving(store, _urls(tmp_path, "unix")) as serving:
            await watch(sink, api=serving.addresses[0], node_name="node-1", once=True)

    _run(scenario())
    assert sink.calls[0] == ("reset",)
    assert sink.calls.count(("sync",)) == 1
    assert sink.calls[-1] == ("sync",)


CONNECT_TIMEOUT_S = 0.5


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_no_first_state_within_the_connect_timeout_is_an_error(
    tmp_path: Path, transport: str
) -> None:
    """Nothing listening, or a server whose sources never sync: either way, no state."""
    store, _ = _example_store(synced=False)

    async def scenario(url: str) -> None:
        with pytest.raises(KpngError, match=f"no state from {re.escape(url)} within 0.5 s"):
            await watch(RecordingSink(), api=url, node_name="n", connect_timeout=CONNECT_TIMEOUT_S)

    async def against_unsynced_server() -> None:
        async with _serving(store, _urls(tmp_path, transport)) as serving:
            await scenario(serving.addresses[0])

    nowhere = f"unix://{tmp_path}/none.sock" if transport == "unix" else "tcp://127.0.0.1:9"
    _run(scenario(nowhere))
    _run(against_unsynced_server())


def test_slow_client_gets_one_coalesced_change_set(tmp_path: Path) -> None:
    store, handle = _example_store()

    async def scenario() -> list[wire.Op]:
        async with _connected(store, tmp_path) as (_, channel):
            watch_ = _RawWatch(channel)
            await watch_.change_set(_watch_req("node-1"))
            api = store.services[("shop", "api")]
            for port in range(9001, 9101):  # 100 revisions the client does not ask for
                ports = (msgspec.structs.replace(api.Ports[0], Port=port),)
                handle.set_service(("shop", "api"), msgspec.structs.replace(api, Ports=ports))
                handle.commit()
                await asyncio.sleep(0)
            return await watch_.change_set(_watch_req("node-1"))

    ops = _run(scenario())
    assert [o.kind for o in ops] == ["Set", "Sync"]
    port = wire.sub(wire.fields(ops[0].payload), 6)
    assert wire.one(port, 3) == 9100


@pytest.mark.parametrize("follow", [True, False], ids=["following", "asking"])
def test_a_following_watcher_is_sent_each_change_set_unasked(tmp_path: Path, follow: bool) -> None:
    """batchv1's Follow: one request, then every change set as it comes, the first one saying
    so (Following). Without it, the next change set waits for its request."""
    store, handle = _example_store()
    api = store.slices[("shop", "api-x7k2p")]

    async def change_set(call: Any) -> list[batchv1_pb2.OpBatch]:
        batches = [await asyncio.wait_for(call.read(), WAIT_S)]
        while batches[-1].Ops[-1].WhichOneof("Op") != "Sync":
            batches.append(await asyncio.wait_for(call.read(), WAIT_S))
        return batches

    async def scenario() -> tuple[list[batchv1_pb2.OpBatch], list[list[str | None]]]:
        async with _connected(store, tmp_path) as (_, channel):
            call = channel.stream_stream(
                "/kpng.batchv1.Sets/Watch",
                request_serializer=batchv1_pb2.WatchReq.SerializeToString,
                response_deserializer=batchv1_pb2.OpBatch.FromString,
            )()  # type: ignore[call-arg]
            await call.write(batchv1_pb2.WatchReq(NodeName="node-2", Follow=follow))
            first = await change_set(call)
            unasked: list[list[str | None]] = []
            for endpoints in (api.endpoints[:1], api.endpoints):
                handle.set_slice(api.key, msgspec.structs.replace(api, endpoints=endpoints))
                handle.commit()
                read = asyncio.ensure_future(change_set(call))
                done, _ = await asyncio.wait([read], timeout=WAIT_S if follow else 0.5)
                if not done:
                    read.cancel()
                    break
                unasked.append([op.WhichOneof("Op") for b in read.result() for op in b.Ops])
            call.cancel()
            return first, unasked

    first, unasked = _run(scenario())
    assert first[0].Following is follow
    assert not any(batch.Following for batch in first[1:])
    assert unasked == ([["Delete", "Sync"], ["Set", "Sync"]] if follow else [])


class _SlowSink(RecordingSink):
    """A backend whose syncs take ``slow`` seconds; notes any call made while one runs."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = 0.0
        self.syncing = False
        self.during_sync: list[tuple[Any, ...]] = []
        self.ports: list[int] = []  # shop/api's port, at each set_service of it

    def set_service(self, service: Service) -> None:
        if self.syncing:
            self.during_sync.append(("set_service", service.Namespace, service.Name))
        if (service.Namespace, service.Name) == ("shop", "api"):
            self.ports.append(service.Ports[0].Port)
        super().set_service(service)

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        if self.syncing:
            self.during_sync.append(("delete_endpoint", namespace, service, key))
        super().delete_endpoint(namespace, service, key)

    async def sync(self) -> None:  # type: ignore[override]  # a Sink's sync may be async
        self.syncing = True
        try:
            await asyncio.sleep(self.slow)
        finally:
            self.syncing = False
        super().sync()


def test_a_backend_slower_than_the_changes_applies_them_merged(tmp_path: Path) -> None:
    """A followed watch reads on while its backend syncs, and hands the change sets that came
    meanwhile on together, with one sync: the backend applies the latest state, not each step
    to it, as when the server merged them for a watcher that had not asked yet. No call comes
    while a sync runs."""
    store, handle = _example_store()
    sink = _SlowSink()
    api = store.services[("shop", "api")]
    slice_ = store.slices[("shop", "api-x7k2p")]

    async def scenario() -> list[list[tuple[Any, ...]]]:
        async with _serving(store, _urls(tmp_path, "unix")) as serving:
            client = asyncio.create_task(watch(sink, api=serving.addresses[0], node_name="node-1"))
            try:
                await sink.next_sync()
                sink.slow = 2.0  # the four changes below come well within it
                handle.set_slice(
                    slice_.key, msgspec.structs.replace(slice_, endpoints=slice_.endpoints[1:])
                )
                handle.commit()
                await eventually(lambda: sink.syncing, "the slow sync", within=WAIT_S)
                for port in range(9001, 9005):  # four change sets while it runs
                    ports = (msgspec.structs.replace(api.Ports[0], Port=port),)
                    handle.set_service(("shop", "api"), msgspec.structs.replace(api, Ports=ports))
                    handle.commit()
                    await asyncio.sleep(0.05)
                await eventually(
                    lambda: sink.calls[-1:] == [("sync",)] and sink.ports[-1] == 9004,
                    "the last port synced",
                    within=WAIT_S,
                )
                await asyncio.sleep(1.5)  # time for any further sync
                syncs: list[list[tuple[Any, ...]]] = [[]]
                for call in sink.calls:
                    syncs[-1].append(call)
                    if call == ("sync",):
                        syncs.append([])
                return syncs
            finally:
                client.cancel()
                await asyncio.gather(client, return_exceptions=True)

    removed, merged, after = _run(scenario())  # each a sync's calls
    assert removed == [("delete_endpoint", "shop", "api", "10.244.1.21"), ("sync",)]
    assert merged[-1] == ("sync",)
    assert {call[0] for call in merged[:-1]} == {"set_service"}
    assert sink.ports[-1] == 9004
    assert after == []
    assert sink.during_sync == []


def test_unix_socket_is_owner_only_unless_told_otherwise(tmp_path: Path) -> None:
    store, _ = _example_store()

    async def scenario(mode: int | None) -> int:
        kwargs = {} if mode is None else {"socket_mode": mode}
        async with _serving(store, [f"unix://{tmp_path}/s.sock"], **kwargs):
            return stat.S_IMODE(os.stat(tmp_path / "s.sock").st_mode)

    assert _run(scenario(None)) == 0o600
    assert _run(scenario(0o660)) == 0o660
    assert not (tmp_path / "s.sock").exists()


def test_mutual_tls(tmp_path: Path) -> None:
    store, _ = _example_store()
    # the control-plane harness's PKI: a CA, a localhost serving certificate, a client one
    (tmp_path / "pki").mkdir()
    (tmp_path / "other").mkdir()
    pki = make_pki(tmp_path / "pki")
    other_ca = make_pki(tmp_path / "other").ca_cert  # signed nothing here
    tls = TlsFiles(cert=pki.serving_cert, key=pki.serving_key, ca=pki.ca_cert)
    trusted = ClientTls(ca=pki.ca_cert, cert=pki.admin_cert, key=pki.admin_key)

    async def scenario() -> tuple[NodeState, grpc.StatusCode, grpc.StatusCode]:
        async with _serving(store, ["tcp://127.0.0.1:0"], tls=tls) as serving:
            port = serving.addresses[0].rpartition(":")[2]
            url = f"tcp://localhost:{port}"
            got: list[NodeState] = []
            await watch_state(got.append, api=Api(url, tls=trusted), node_name="node-1", once=True)
            codes = []
            for client_tls in (
                ClientTls(ca=pki.ca_cert),  # no client certificate
                ClientTls(ca=other_ca, cert=pki.admin_cert, key=pki.admin_key),
            ):
                channel = Api(url, tls=client_tls).channel()
                async with channel:
                    call = channel.stream_stream(
                        "/localv1.Sets/Watch",
                        request_serializer=lambda b: b,
                        response_deserializer=lambda b: b,
                    )()  # type: ignore[call-arg]
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await _write_and_read(call, _watch_req("node-1"))
                    codes.append(error.value.code())
            return got[0], codes[0], codes[1]

    state, without_cert, wrong_ca = _run(scenario())
    assert dict(state.services) == _expected(store, "node-1")
    assert without_cert == grpc.StatusCode.UNAVAILABLE
    assert wrong_ca == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "compatible"])
def test_global_watch_relays_the_store(tmp_path: Path, batched: bool) -> None:
    store, handle = _example_store()
    relay = Store()
    ops = GlobalOps(relay.source("api"))

    async def follow_raw(serving: Serving) -> None:
        rpc = global_rpcs()[0 if batched else 1]
        async with grpc.aio.insecure_channel(_target(serving)) as channel:
            await _follow_once(channel, rpc, ops.handler(batched))

    async def scenario() -> None:
        async with _serving(store, _urls(tmp_path, "unix")) as serving:
            task = asyncio.create_task(follow_raw(serving))
            try:
                await eventually(lambda: relay.synced, within=WAIT_S)
                assert dict(relay.services) == dict(store.services)
                assert dict(relay.slices) == dict(store.slices)
                assert dict(relay.nodes) == dict(store.nodes)
                handle.set_slice(("shop", "web-abc12"), None)
                handle.set_node("node-3", None)
                handle.commit()
                await eventually(
                    lambda: (
                        ("shop", "web-abc12") not in relay.slices and "node-3" not in relay.nodes
                    ),
                    within=WAIT_S,
                )
                assert dict(relay.slices) == dict(store.slices)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    _run(scenario())


def test_first_states_take_turns_and_a_stalled_turn_passes_on() -> None:
    ended: list[tuple[str, str]] = []

    def ender(name: str) -> Callable[[str], Awaitable[None]]:
        async def end_stream(why: str) -> None:
            ended.append((name, why))

        return end_stream

    async def scenario() -> None:
        turns = Turns(size=1, stall_s=0.2, hold_s=1.0, stalled=1)
        loop = asyncio.get_running_loop()
        a = await turns.take(ender("a"), "a")
        b = asyncio.ensure_future(turns.take(ender("b"), "b"))
        await asyncio.sleep(0.5)
        assert not b.done()  # a holds the one turn: no write pending is no stall
        assert turns.waiting == 1
        a.end()
        a.end()  # ending a turn twice gives back one turn, not two
        turn_b = await asyncio.wait_for(b, 1)
        c = asyncio.ensure_future(turns.take(ender("c"), "c"))
        d = asyncio.ensure_future(turns.take(ender("d"), "d"))
        await asyncio.sleep(0.05)
        assert not c.done()
        started = loop.time()
        turn_b.writing()  # and never completes: b is parked, its turn passes on
        turn_c = await asyncio.wait_for(c, 2)
        assert 0.15 < loop.time() - started < 1.0
        assert turns.parked == 1
        assert not ended
        turn_b.wrote()  # a slow reader moves again: it stays parked, and is not ended
        turn_c.writing()  # c stalls too: one parked at most, and b is the one moving
        turn_d = await asyncio.wait_for(d, 2)
        assert [name for name, _ in ended] == ["c"]  # stuck longest: b moved since
        assert turns.parked == 1
        turn_c.end()  # ended already: no extra turn appears
        turn_b.writing()  # parked b waits hold_s in all: ended
        await asyncio.sleep(1.5)
        assert ended[1] == ("b", "its first state was not read for 1 s")
        assert turns.parked == 0
        assert turns.ended == 2
        turn_b.end()
        turn_d.end()
        (await asyncio.wait_for(turns.take(ender("e"), "e"), 1)).end()

    _run(scenario())


async def _no_end(why: str) -> None:
    raise AssertionError(why)


def test_watchers_beyond_the_turns_all_get_their_first_states(tmp_path: Path) -> None:
    store, _ = _example_store()

    async def scenario() -> list[int]:
        async with _connected(store, tmp_path) as (serving, channel):
            serving.watch.first_states = Turns(size=1, hold_s=30)
            watches = [_RawWatch(channel) for _ in range(6)]
            firsts = await asyncio.gather(
                *(w.change_set(_watch_req(f"node-{1 + i % 3}")) for i, w in enumerate(watches))
            )
            # every turn was given back once its first state was sent
            turn = await asyncio.wait_for(serving.watch.first_states.take(_no_end), 1)
            turn.end()
            return [len(ops) for ops in firsts]

    lengths = _run(scenario())
    assert len(lengths) == 6
    assert min(lengths) > 2


def test_a_node_agent_whose_calls_a_busy_brain_cancels_resumes_with_backoff_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A brain that cannot take new calls fast enough (a mass connect) ends some before its own
    code sees them: CANCELLED, or INTERNAL once the request was sent. The agent retries each
    after a backoff, and logs the first failure, with its code, and the recovery, not every
    retry."""
    endings = [grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED]
    calls = 0

    async def handler(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        nonlocal calls
        calls += 1
        await anext(aiter(requests))
        if endings:
            await context.abort(endings.pop(0), "")
        yield codec.op_batch([codec.OP_RESET, codec.OP_SYNC])
        await asyncio.sleep(WAIT_S)

    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    async def scenario() -> list[Any]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "kpng.batchv1.Sets", {"Watch": grpc.stream_stream_rpc_method_handler(handler)}
                )
            ]
        )
        server.add_insecure_port(f"unix:{tmp_path}/busy.sock")
        await server.start()
        sink = RecordingSink()
        client = asyncio.create_task(
            watch(
                sink,
                api=f"unix://{tmp_path}/busy.sock",
                node_name="node-1",
                backoff=Backoff(initial=0.5, maximum=4.0, sleep=sleep, random=lambda: 1.0),
            )
        )
        try:
            return await sink.next_sync()
        finally:
            client.cancel()
            await asyncio.gather(client, return_exceptions=True)
            await server.stop(None)

    with caplog.at_level(logging.DEBUG, logger="kpng.remote.watching"):
        synced = _run(scenario())
    assert synced == [("reset",), ("sync",)]
    assert calls == 4
    assert slept == [0.5, 1.0, 2.0]  # growing, never a retry at once
    # (The fake brain sends no node facts, which the agent warns of too: not counted here.)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.getMessage().startswith("watch of")
    ]
    assert len(warnings) == 1, warnings
    assert "CANCELLED" in warnings[0]
    assert "no state yet; retrying" in warnings[0]
    retries = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("INTERNAL" in message for message in retries)
    assert any(r.getMessage().endswith("is back") for r in caplog.records)
