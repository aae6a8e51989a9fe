"""The split: a backend behind a remote brain receives exactly the node state it receives beside
one. Over real gRPC on a unix socket, through kpng.client's full-state path (what ``kpng local``
runs), in both payload encodings."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from kpng.api import localv1_pb2
from kpng.client import Backoff, ChangeTriggers, NodeState, watch_state
from kpng.client._sinks import FullState
from kpng.feeding import Fanout, Histogram
from kpng.remote.address import Api
from kpng.remote.watching import LocalOps, _Rpc, follow, global_rpcs
from kpng.server.serving import ListenAddress, Serving, serve
from kpng.sinks.local import run_local
from kpng.sources.api.ops import GlobalOps
from kpng.sources.file import stage
from kpng.sources.local import run_remote
from kpng.sources.manifests import parse
from kpng.status import Status
from kpng.store import SourceHandle, Store
from kpng.testing.recording import RecordingBackend
from kpng.testing.waiting import eventually

T = TypeVar("T")
NODE = "node-1"
TRIGGERED = "2026-11-25T10:00:00Z"

CLUSTER = b"""
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {topology.kubernetes.io/zone: zone-a}}
spec:
  podCIDRs: [10.244.1.0/24, "fd00:10:244:1::/64"]
  taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]
status:
  addresses:
  - {type: Hostname, address: node-1}
  - {type: InternalIP, address: 192.0.2.11}
  - {type: InternalIP, address: "fd00:192::11"}
  - {type: ExternalIP, address: 203.0.113.11}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16, "fd00:96::/112"]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  externalTrafficPolicy: Local
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-1}
- {addresses: [10.244.2.5], nodeName: node-2}
---
apiVersion: v1
kind: Service
metadata: {name: db, namespace: shop}
spec:
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ports: [{name: sql, port: 5432, protocol: TCP}]
"""

CHANGED_SLICE = b"""
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: shop
  labels: {kubernetes.io/service-name: web}
  annotations: {endpoints.kubernetes.io/last-change-trigger-time: "%s"}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.6], nodeName: node-1}
""" % TRIGGERED.encode()

MOVED_NODE = b"""
apiVersion: v1
kind: Node
metadata: {name: node-1, labels: {topology.kubernetes.io/zone: zone-a}}
spec: {podCIDRs: [10.244.9.0/24]}
status: {addresses: [{type: InternalIP, address: 192.0.2.99}]}
"""


def _epoch(rfc3339: str) -> float:
    return datetime.datetime.fromisoformat(rfc3339).timestamp()


def _run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


def _stage(handle: SourceHandle, manifest: bytes) -> None:
    parsed = parse(manifest, filename="test.yaml")
    assert not parsed.errors, parsed.errors
    for key, obj in parsed.objects.items():
        stage(handle, key, obj)


def _pb_watch(api: Api, handler: Callable[[NodeState], Any]) -> Coroutine[Any, Any, None]:
    """Go KPNG's localv1 watch (protobuf payloads, one op per message) into kpng's full-state
    assembly: what kpng.client falls back to against a server without the batched watch."""
    rpc = _Rpc(
        "/localv1.Sets/Watch", localv1_pb2.WatchReq(NodeName=NODE), localv1_pb2.OpItem, False
    )
    full = FullState(handler, node=NODE)
    return follow(
        api,
        batched=rpc,
        compatible=rpc,
        handle=lambda _: LocalOps(full, json=False, url=api.url, warned=set()),
    )


def _json_watch(api: Api, handler: Callable[[NodeState], Any]) -> Coroutine[Any, Any, None]:
    """kpng.client's watch_state: the batched watch, JSON payloads."""
    return watch_state(handler, api=api, node_name=NODE)


WATCHES = {"batched-json": _json_watch, "localv1-protobuf": _pb_watch}


@contextlib.asynccontextmanager
async def _serving(store: Store, tmp_path: Path) -> AsyncIterator[Serving]:
    ready: asyncio.Future[Serving] = asyncio.get_running_loop().create_future()
    listen = [ListenAddress.parse(f"unix://{tmp_path}/kpng.sock")]
    task = asyncio.create_task(serve(store, listen=listen, started=ready.set_result))
    try:
        yield await asyncio.wait_for(asyncio.shield(ready), 20)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _both_ways(
    tmp_path: Path, watch: Callable[[Api, Callable[[NodeState], Any]], Coroutine[Any, Any, None]]
) -> tuple[list[NodeState], list[NodeState]]:
    """The states a backend beside the brain and one behind it receive, through three changes:
    the first state, a change of services with a trigger time, and a change of the node alone."""
    store = Store()
    handle = store.source("test")
    _stage(handle, CLUSTER)
    handle.mark_synced()
    beside, behind = RecordingBackend(), RecordingBackend()
    async with _serving(store, tmp_path) as serving:
        tasks = [
            asyncio.create_task(run_local(store, node_name=NODE, backend=beside)),
            asyncio.create_task(watch(Api(serving.addresses[0]), behind.apply)),
        ]
        try:
            for count, change in ((1, None), (2, CHANGED_SLICE), (3, MOVED_NODE)):
                if change is not None:
                    _stage(handle, change)
                    if count == 2:
                        handle.set_service(("shop", "db"), None)
                    handle.commit()
                await eventually(
                    lambda n=count: len(beside.states) >= n and len(behind.states) >= n,  # type: ignore[misc]
                    f"state {count} both ways",
                )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return beside.states, behind.states


def _differing(local: NodeState, remote: NodeState) -> list[str]:
    """The NodeState fields, every one but the revision, whose values differ."""
    differing = []
    for field in msgspec.structs.fields(NodeState):
        here, there = getattr(local, field.name), getattr(remote, field.name)
        if field.name == "services":
            here, there = dict(here), dict(there)
        if field.name != "revision" and here != there:
            differing.append(field.name)
    return differing


@pytest.mark.parametrize("watch", WATCHES.values(), ids=WATCHES.keys())
def test_every_field_of_the_node_state_is_the_same_behind_the_api(
    tmp_path: Path, watch: Callable[[Api, Callable[[NodeState], Any]], Coroutine[Any, Any, None]]
) -> None:
    """Silent loss is impossible: every NodeState field, present and future, must reach a backend
    behind the API as it is in process. A field added without its wire form fails here, since
    the cluster above must make every field differ from its default in some state."""
    beside, behind = _run(_both_ways(tmp_path, watch))
    assert len(beside) == len(behind) == 3
    for i, (local, remote) in enumerate(zip(beside, behind, strict=True)):
        assert _differing(local, remote) == [], f"state {i + 1}"
    # The revision means the brain's revision in process and a count of states behind it: both
    # only grow.
    for states in (beside, behind):
        assert [s.revision for s in states] == sorted({s.revision for s in states})
    fields = [f for f in msgspec.structs.fields(NodeState) if f.name != "revision"]
    unexercised = [
        f.name
        for f in fields
        if f.default is not msgspec.NODEFAULT
        and all(getattr(state, f.name) == f.default for state in beside)
    ]
    assert not unexercised, f"make these differ from their defaults in a state: {unexercised}"


def test_the_node_facts_are_what_the_node_and_the_service_cidrs_say(tmp_path: Path) -> None:
    """What the backends read, as kube-proxy reads it: primary IPs (the first InternalIP, then
    the first of the other family), pod CIDRs, ServiceCIDRs, draining; then the node alone
    changing is a state of its own, with no service in it."""
    beside, _ = _run(_both_ways(tmp_path, _json_watch))
    first, changed, moved = beside
    assert first.node_ips == ("192.0.2.11", "fd00:192::11")
    assert first.pod_cidrs == ("10.244.1.0/24", "fd00:10:244:1::/64")
    assert first.service_cidrs == ("10.96.0.0/16", "fd00:96::/112")
    assert first.draining
    # its IP addresses, in the API server's order (a host name is no address a rule matches)
    assert [(a.Type, a.Address) for a in first.node_addresses] == [
        ("InternalIP", "192.0.2.11"),
        ("InternalIP", "fd00:192::11"),
        ("ExternalIP", "203.0.113.11"),
    ]
    assert first.triggers == ChangeTriggers()  # a first state is not timed
    assert changed.updated == {("shop", "web")}
    assert changed.deleted == {("shop", "db")}
    assert changed.triggers == ChangeTriggers(V4=(_epoch(TRIGGERED),))
    assert (moved.updated, moved.deleted) == (frozenset(), frozenset())
    assert (moved.node_ips, moved.pod_cidrs, moved.draining) == (
        ("192.0.2.99",),
        ("10.244.9.0/24",),
        False,
    )


def test_a_brain_that_sends_no_node_facts_is_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Go KPNG brain sends services and endpoints only: the backend runs on them, and the log
    says once what it cannot know."""
    full_states: list[NodeState] = []
    full = FullState(full_states.append, node=NODE)
    warned: set[str] = set()  # what one watch has said, across its reconnections
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # a stream, then another after a reconnection
            ops = LocalOps(full, json=True, url="go", warned=warned)
            ops.op("Reset", 0, "", b"")
            _run(ops.sync())
    assert caplog.text.count("sends no node facts") == 1
    assert full_states[0].node_ips == ()


def test_behind_the_api_network_programming_is_timed_from_the_slices_trigger_times(
    tmp_path: Path,
) -> None:
    """kube-proxy's network programming latency on the node that applies the rules, as ``kpng
    local`` wires it: from an EndpointSlice's trigger time to the backend's sync."""

    async def scenario() -> Histogram:
        store = Store()
        handle = store.source("test")
        _stage(handle, CLUSTER)
        handle.mark_synced()
        status = Status(timeout=60.0)  # kpng local's: no store
        status.started = _epoch(TRIGGERED) - 60
        recorder = RecordingBackend()
        fanout = status.track(Fanout([("to-x", recorder)]))
        async with _serving(store, tmp_path) as serving:
            api = Api(serving.addresses[0])
            task = asyncio.create_task(
                run_remote(api, node_name=NODE, backends=fanout, connect_timeout=20)
            )
            try:
                await eventually(lambda: len(recorder.states) == 1, "the first state")
                _stage(handle, CHANGED_SLICE)
                handle.commit()
                await eventually(lambda: len(recorder.states) == 2, "the changed slice")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return status.counters.programming["IPv4"]

    programmed = _run(scenario())
    assert programmed.count == 1
    assert programmed.sum > 60  # the trigger time is hours before the sync


def test_a_node_moves_to_another_replica_and_nothing_changes_on_it(tmp_path: Path) -> None:
    """Two brains of one cluster: the replica a node watches goes away, the node's client moves
    to the other, and the backend is handed nothing (no reset, no rewrite) until the cluster
    really changes, which then comes from the other replica."""

    async def scenario() -> list[NodeState]:
        store = Store()
        handle = store.source("test")
        _stage(handle, CLUSTER)
        handle.mark_synced()
        recorder = RecordingBackend()
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        async with _serving(store, tmp_path / "b") as second:
            first = _serving(store, tmp_path / "a")
            serving = await first.__aenter__()
            api = Api.parse(f"{serving.addresses[0]},{second.addresses[0]}")
            fast = Backoff(initial=0.05, maximum=0.2)
            task = asyncio.create_task(
                watch_state(recorder.apply, api=api, node_name=NODE, backoff=fast)
            )
            try:
                await eventually(lambda: len(recorder.states) == 1, "the first state")
                await first.__aexit__(None, None, None)  # the first replica goes away
                await eventually(
                    lambda: second.watch.stats.local_watches == 1, "a watch of the second"
                )
                assert len(recorder.states) == 1
                handle.set_service(("shop", "db"), None)
                handle.commit()
                await eventually(lambda: len(recorder.states) == 2, "the change")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return recorder.states

    _, changed = _run(scenario())
    assert changed.deleted == {("shop", "db")}
    assert changed.updated == frozenset()


def test_while_the_brain_is_away_the_node_stays_healthy_and_live(tmp_path: Path) -> None:
    """The split shapes' decision (docs/operators/deploy.md): with no brain, the node's rules
    stay in force and nothing is pending, so /healthz and /livez keep answering 200, as
    kube-proxy's do while its API server is away; the load balancers keep sending traffic to a
    node that still serves it."""

    async def scenario() -> list[tuple[bool, bool]]:
        store = Store()
        handle = store.source("test")
        _stage(handle, CLUSTER.replace(b"taints:", b"oldTaints:"))  # not draining
        handle.mark_synced()
        status = Status(timeout=0.5)  # a change may wait half a second
        recorder = RecordingBackend()
        fanout = status.track(Fanout([("to-x", recorder)]))
        brain = _serving(store, tmp_path)
        serving = await brain.__aenter__()
        task = asyncio.create_task(
            run_remote(
                Api(serving.addresses[0]), node_name=NODE, backends=fanout, connect_timeout=20
            )
        )
        try:
            await eventually(lambda: len(recorder.states) == 1, "the first state")
            verdicts = [(status.verdict().healthy, status.verdict().live)]
            await brain.__aexit__(None, None, None)
            await asyncio.sleep(1.5)  # three times the healthz timeout
            verdicts.append((status.verdict().healthy, status.verdict().live))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return verdicts

    assert _run(scenario()) == [(True, True), (True, True)]


def test_a_relays_nodes_get_the_node_state_a_brains_nodes_get(tmp_path: Path) -> None:
    """A relay tier (``kpng api`` from a brain's global watch, then to-local): its node's
    states equal the brain's own, ServiceCIDRs and trigger times included."""

    async def scenario() -> tuple[list[NodeState], list[NodeState]]:
        brain = Store()
        handle = brain.source("test")
        _stage(handle, CLUSTER)
        handle.mark_synced()
        relay = Store()
        beside, behind = RecordingBackend(), RecordingBackend()
        async with _serving(brain, tmp_path) as serving:
            ops = GlobalOps(relay.source("api"))
            batched, compatible = global_rpcs()
            upstream = Api(serving.addresses[0])
            tasks = [
                asyncio.create_task(run_local(brain, node_name=NODE, backend=beside)),
                asyncio.create_task(
                    follow(upstream, batched=batched, compatible=compatible, handle=ops.handler)
                ),
                asyncio.create_task(run_local(relay, node_name=NODE, backend=behind)),
            ]
            try:
                await eventually(lambda: len(behind.states) == 1, "the relay's first state")
                _stage(handle, CHANGED_SLICE)
                handle.commit()
                await eventually(lambda: len(behind.states) == 2, "the changed slice")
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return beside.states, behind.states

    beside, behind = _run(scenario())
    for i, (local, relayed) in enumerate(zip(beside, behind, strict=True)):
        assert _differing(local, relayed) == [], f"state {i + 1}"
    assert behind[0].service_cidrs == ("10.96.0.0/16", "fd00:96::/112")
    assert behind[1].triggers == ChangeTriggers(V4=(_epoch(TRIGGERED),))


@pytest.mark.parametrize(
    ("urls", "tls", "refused"),
    [
        ("tcp://10.0.0.1:8443", False, True),
        ("unix:///run/kpng.sock,tcp://10.0.0.2:8443", False, True),  # a fallback too
        ("tcp://10.0.0.1:8443", True, False),
        ("unix:///run/kpng.sock", False, False),
    ],
    ids=["tcp", "tcp-fallback", "tcp-with-tls", "unix"],
)
def test_a_token_is_never_sent_in_the_clear_over_tcp(
    urls: str, tls: bool, refused: bool, tmp_path: Path
) -> None:
    from kpng.errors import UsageError
    from kpng.remote.address import ClientTls

    api = Api.parse(
        urls, tls=ClientTls(ca=tmp_path / "ca.crt") if tls else None, token_file=tmp_path / "t"
    )
    if refused:
        with pytest.raises(UsageError, match="in the clear"):
            api.check()
    else:
        assert api.check() is api
