"""The client library's pieces, with plain data: no server needed."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

import kpng.client
from kpng.api import localv1_pb2
from kpng.api.ops import local_ops
from kpng.client import Backoff, DiffStore, NodeState, ServiceKey, SinkBackend
from kpng.client._sinks import FilterReset, FullState
from kpng.model.messages import Endpoint, EndpointScopes, Service, ServiceEndpoints
from kpng.remote.watching import LocalOps
from kpng.testing import states


def test_public_names_are_exactly_the_documented_surface() -> None:
    public = {name for name in dir(kpng.client) if not name.startswith("_")}
    assert public == set(kpng.client.__all__)
    for name in kpng.client.__all__:
        assert getattr(kpng.client, name) is not None


def test_diffstore_reports_created_updated_deleted_per_round() -> None:
    store: DiffStore[str, int] = DiffStore()
    store.set("a", 1)
    store.set("b", 2)
    first = store.done()
    assert (first.created, first.updated, first.deleted) == ({"a": 1, "b": 2}, {}, {})
    store.set("a", 1)
    store.set("b", 3)
    store.set("c", 4)
    second = store.done()
    assert (second.created, second.updated, second.deleted) == ({"c": 4}, {"b": 3}, {})
    store.set("c", 4)
    third = store.done()
    assert (third.created, third.updated, third.deleted) == ({}, {}, {"a": 1, "b": 3})
    assert dict(store) == {"c": 4}
    store.set("c", 4)
    assert not store.done()


def _svc(name: str, port: int = 80) -> Service:
    return Service(Namespace="ns", Name=name, Type="ClusterIP")


def _ep(ip: str, *, internal: bool = True) -> Endpoint:
    return states.endpoint(ip, scopes=EndpointScopes(Internal=internal, Cluster=True))


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def reset(self) -> None:
        self.calls.append(("reset",))

    def set_service(self, service: Service) -> None:
        self.calls.append(("set_service", service.Name, service.Type))

    def delete_service(self, namespace: str, name: str) -> None:
        self.calls.append(("delete_service", name))

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None:
        self.calls.append(("set_endpoint", service, key))

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        self.calls.append(("delete_endpoint", service, key))

    def sync(self) -> None:
        self.calls.append(("sync",))


def test_filter_reset_turns_a_resync_into_the_differences() -> None:
    sink = _Recorder()
    f = FilterReset(sink)
    f.reset()
    f.set_service(_svc("a"))
    f.set_service(_svc("b"))
    f.set_endpoint("ns", "a", "10.0.0.1", _ep("10.0.0.1"))
    f.set_endpoint("ns", "a", "10.0.0.2", _ep("10.0.0.2"))
    f.sync()
    sink.calls.clear()
    # reconnection: the whole state again, with b gone, one endpoint changed, one removed
    f.reset()
    f.set_service(_svc("a"))
    f.set_endpoint("ns", "a", "10.0.0.1", _ep("10.0.0.1", internal=False))
    f.sync()
    assert sink.calls == [
        ("set_endpoint", "a", "10.0.0.1"),
        ("delete_endpoint", "a", "10.0.0.2"),
        ("delete_service", "b"),
        ("sync",),
    ]


def test_full_state_assembles_states_and_reports_what_changed() -> None:
    states: list[NodeState] = []
    full = FullState(states.append, node="n1")
    full.reset()
    full.set_service(_svc("a"))
    full.set_endpoint("ns", "a", "10.0.0.2", _ep("10.0.0.2"))
    full.set_endpoint("ns", "a", "10.0.0.1", _ep("10.0.0.1"))
    full.set_service(_svc("b"))
    asyncio.run(full.sync())
    assert states[0].updated == {("ns", "a"), ("ns", "b")}
    a = states[0].services[("ns", "a")]
    assert [e.IPs.V4 for e in a.endpoints if e.IPs] == [("10.0.0.1",), ("10.0.0.2",)]
    full.delete_service("ns", "b")
    full.set_endpoint("ns", "a", "10.0.0.1", _ep("10.0.0.1"))  # unchanged
    asyncio.run(full.sync())
    assert states[1].updated == frozenset()
    assert states[1].deleted == {("ns", "b")}
    assert states[1].revision == 2
    asyncio.run(full.sync())  # nothing changed: no call
    assert len(states) == 2


def test_sink_backend_gives_a_sink_the_calls_the_network_would() -> None:
    """Call for call, in order: the ops the server encodes, decoded by the client's LocalOps."""
    in_process, networked = _Recorder(), _Recorder()
    backend = SinkBackend(in_process)
    remote = LocalOps(networked, json=True, url="test", warned=set())
    remote.op("Reset", 0, "", b"")
    a1 = ServiceEndpoints(service=_svc("a"), endpoints=(_ep("10.0.0.1"), _ep("10.0.0.2")))
    b1 = ServiceEndpoints(service=_svc("b"), endpoints=(_ep("10.0.1.1"),))
    a2 = ServiceEndpoints(service=_svc("a"), endpoints=(_ep("10.0.0.3"), _ep("10.0.0.1")))
    c1 = ServiceEndpoints(service=_svc("c"), endpoints=(_ep("10.0.2.1"),))
    steps: list[tuple[dict[ServiceKey, ServiceEndpoints], set[ServiceKey]]] = [
        ({("ns", "b"): b1, ("ns", "a"): a1}, set()),
        ({("ns", "a"): a2, ("ns", "c"): c1}, {("ns", "b")}),
        ({}, {("ns", "a"), ("ns", "c")}),
    ]
    services: dict[ServiceKey, ServiceEndpoints] = {}
    for revision, (updated, deleted) in enumerate(steps, 1):
        previous = dict(services)
        services.update(updated)
        for key in deleted:
            del services[key]
        state = NodeState(
            node="n", revision=revision, services=dict(services),
            updated=frozenset(updated), deleted=frozenset(deleted),
        )  # fmt: skip
        asyncio.run(backend.apply(state))
        for op in local_ops(
            updated=updated, deleted=deleted, previous=previous,
            encode_service=msgspec.json.encode, encode_endpoint=msgspec.json.encode,
        ):  # fmt: skip
            item = localv1_pb2.OpItem.FromString(op)
            kind = item.WhichOneof("Op")
            if kind == "Set":
                remote.op(kind, item.Set.Ref.Set, item.Set.Ref.Path, item.Set.Bytes)
            elif kind == "Delete":
                remote.op(kind, item.Delete.Set, item.Delete.Path, b"")
        asyncio.run(remote.sync())
    assert in_process.calls == networked.calls
    assert in_process.calls[:7] == [
        ("reset",),
        ("set_service", "a", "ClusterIP"),
        ("set_service", "b", "ClusterIP"),
        ("set_endpoint", "a", "10.0.0.1"),
        ("set_endpoint", "a", "10.0.0.2"),
        ("set_endpoint", "b", "10.0.1.1"),
        ("sync",),
    ]
    assert in_process.calls[7:12] == [
        ("set_service", "c", "ClusterIP"),
        ("set_endpoint", "a", "10.0.0.3"),
        ("set_endpoint", "c", "10.0.2.1"),
        ("delete_endpoint", "a", "10.0.0.2"),
        ("delete_endpoint", "b", "10.0.1.1"),
    ]


def test_backoff_doubles_with_jitter_up_to_the_maximum_and_resets() -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    draws = iter([1.0, 0.0, 1.0, 1.0, 1.0, 0.5])
    backoff = Backoff(initial=1.0, maximum=4.0, sleep=sleep, random=lambda: next(draws))

    async def scenario() -> None:
        for _ in range(5):
            await backoff.wait()
        backoff.reset()
        await backoff.wait()

    asyncio.run(scenario())
    assert slept == [1.0, 1.0, 4.0, 4.0, 4.0, 0.75]


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("tcp://127.0.0.1:12090", "127.0.0.1:12090"),
        ("localhost:1", "localhost:1"),
        ("unix:///run/kpng.sock", "unix:/run/kpng.sock"),
    ],
)
def test_api_targets(url: str, target: str) -> None:
    assert kpng.client.Api(url).check().grpc_target == target


@pytest.mark.parametrize(
    "url",
    [
        "unix://relative.sock",
        "tcp://nohost",
        "http://x:1/",
        "http://127.0.0.1:12090",
        "grpc://127.0.0.1:12090",
        "tcp://:12090",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:70000",
        "127.0.0.1:12090/watch",
    ],
)
def test_bad_api_targets_are_usage_errors(url: str) -> None:
    from kpng.errors import UsageError

    with pytest.raises(UsageError, match="--api"):
        kpng.client.Api(url).check()
