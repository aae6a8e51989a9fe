"""Change sets as ops: plain data in, encoded ops out."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from kpng.api import codec
from kpng.api.localv1_pb2 import ChangeTriggersSet, NodeFactsSet, ServicesSet
from kpng.api.ops import FirstOps, local_ops
from kpng.model.cluster import Slice
from kpng.model.messages import Endpoint, Service
from kpng.resolver.resolving import ClusterResolver
from kpng.server.changesets import (
    ChangeSet,
    Shared,
    SharedOps,
    batches,
)
from kpng.sources.manifests import parse
from tests.conftest import EXAMPLE
from tests.pure import wire

_json = msgspec.json.Encoder()


def _encode_service(service: Service) -> bytes:
    return _json.encode(service)


def _encode_endpoint(endpoint: Endpoint) -> bytes:
    return _json.encode(endpoint)


def _cluster() -> ClusterResolver:
    cluster = ClusterResolver()
    for (_, namespace, name), obj in parse(EXAMPLE.read_bytes(), filename="x").objects.items():
        if isinstance(obj, Service):
            cluster.set_service((namespace, name), obj)
        elif isinstance(obj, Slice):
            cluster.set_slice((namespace, name), obj)
    return cluster


def test_framed_first_ops_are_the_ops_and_are_shared_between_watchers() -> None:
    cluster = _cluster()
    first_ops = FirstOps(_encode_service, _encode_endpoint)
    outputs = []
    for node in ("elsewhere-1", "elsewhere-2"):
        changes = cluster.view(node).resolve()
        plain, cached = (
            local_ops(
                updated=changes.updated,
                deleted=changes.deleted,
                previous=changes.previous,
                encode_service=_encode_service,
                encode_endpoint=_encode_endpoint,
                first_ops=cache,
            )
            for cache in (None, first_ops)
        )
        assert cached == plain
        outputs.append(cached)
    # two nodes hosting no endpoint: the second reuses the first's framed bytes
    assert all(a is b for a, b in zip(outputs[0], outputs[1], strict=True))
    ops = [wire.op(o) for o in outputs[0]]
    kinds = [(o.kind, o.set) for o in ops]
    services = kinds.count(("Set", 1))
    assert kinds[:services] == [("Set", 1)] * services == [("Set", 1)] * 6
    assert all(k == ("Set", 2) for k in kinds[services:])


class _Counting:
    """An encoder that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, value: msgspec.Struct) -> bytes:
        self.calls += 1
        return _json.encode(value)


def _slices() -> list[Slice]:
    slices = [
        obj
        for obj in parse(EXAMPLE.read_bytes(), filename="x").objects.values()
        if isinstance(obj, Slice) and obj.endpoints
    ]
    assert len(slices) >= 2
    return slices


def _moved(sl: Slice, address: str) -> Slice:
    """``sl`` with its first endpoint moved to ``address``."""
    first = msgspec.structs.replace(sl.endpoints[0], ip=address)
    return msgspec.structs.replace(sl, endpoints=(first, *sl.endpoints[1:]))


def test_views_of_one_class_share_a_change_sets_ops_and_framed_bytes() -> None:
    cluster = _cluster()
    views = [cluster.view(node) for node in ("elsewhere-1", "elsewhere-2")]
    for view in views:
        view.resolve()
    sl = _slices()[0]
    cluster.set_slice(sl.key, _moved(sl, "10.255.0.1"))
    endpoint = _Counting()
    shared_ops = SharedOps(_encode_service, endpoint)
    shared = []
    for view in views:
        changes = view.resolve()
        assert changes.updated
        assert changes.previous
        shared.append(
            shared_ops(updated=changes.updated, deleted=changes.deleted, previous=changes.previous)
        )
    assert shared[0] is shared[1]
    assert shared[0].framed is shared[1].framed
    assert endpoint.calls == 1  # the moved endpoint, encoded for the first view only


def test_shared_ops_are_the_ops_of_each_view() -> None:
    """Nodes hosting endpoints and nodes elsewhere, through moves, deletions and new services:
    the shared ops are what each view's own local_ops gives."""
    cluster = _cluster()
    slices = _slices()
    nodes = sorted({ep.node for sl in slices for ep in sl.endpoints if ep.node})
    views = [cluster.view(node) for node in [*nodes, "elsewhere-1", "elsewhere-2"]]
    for view in views:
        view.resolve()
    shared_ops = SharedOps(
        _encode_service, _encode_endpoint, FirstOps(_encode_service, _encode_endpoint), size=2
    )
    services = dict(cluster.services)
    two = list(services)[:2]

    def delete_two() -> None:
        for key in two:
            cluster.set_service(key, None)

    def restore_two() -> None:
        for key in two:
            cluster.set_service(key, services[key])

    steps: list[Callable[[], None]] = [
        lambda: cluster.set_slice(slices[0].key, _moved(slices[0], "10.255.0.1")),
        lambda: cluster.set_slice(slices[1].key, None),
        lambda: cluster.set_slice(slices[1].key, _moved(slices[1], "10.255.0.2")),
        delete_two,
        restore_two,
    ]
    compared = 0
    for step in steps:
        step()
        for view in views:
            changes = view.resolve()
            expected = local_ops(
                updated=changes.updated,
                deleted=changes.deleted,
                previous=changes.previous,
                encode_service=_encode_service,
                encode_endpoint=_encode_endpoint,
            )
            got = shared_ops(
                updated=changes.updated, deleted=changes.deleted, previous=changes.previous
            )
            assert got.ops == expected
            assert got.framed == codec.op_batch(expected)
            compared += bool(expected)
    assert compared >= len(steps) * len(views) - 1


@pytest.mark.parametrize("limit", [1 << 20, 64, 1])
@pytest.mark.parametrize("own", [False, True])
def test_a_change_sets_batches_are_those_of_its_ops(limit: int, own: bool) -> None:
    """Byte for byte what framing the whole list gives, however the limit cuts it."""
    body = [codec.op_set(ServicesSet, f"ns/s{i}", b"x" * (i * 10)) for i in range(8)]
    head = [codec.OP_RESET, codec.op_set(NodeFactsSet, "facts", b"f")] if own else []
    tail = [codec.op_set(ChangeTriggersSet, "triggers", b"t")] if own else []
    change_set = ChangeSet(head, Shared(body), [*tail, codec.OP_SYNC])
    ops = change_set.ops()
    assert ops == [*head, *body, *tail, codec.OP_SYNC]
    assert list(change_set.batches(limit)) == list(batches(ops, limit))
    assert b"".join(change_set.batches(limit)) == codec.op_batch(ops)


def test_first_ops_forget_the_values_of_a_changed_or_deleted_service() -> None:
    # A churning cluster resolves new values all the time: the framing cache keeps only the
    # values of services as they are now (the soak's brain grew 220 %/hour before).
    cluster = _cluster()
    first_ops = FirstOps(_encode_service, _encode_endpoint)
    cluster.on_change.append(first_ops.forget)
    state = cluster.view("elsewhere").resolve().updated
    for key, value in state.items():
        first_ops(key, value)
    assert len(first_ops) == len(state) > 1
    key = sorted(state)[0]
    cluster.set_service(key, None)
    assert len(first_ops) == len(state) - 1
    for _ in range(3):  # the same service, made and deleted again and again
        cluster.set_service(key, state[key].service)
        first_ops(key, cluster.resolve(key, "elsewhere"))  # type: ignore[arg-type]
        cluster.set_service(key, None)
    assert len(first_ops) == len(state) - 1
