"""Change sets as ops: plain data in, encoded ops out."""

from __future__ import annotations

import msgspec

from kpng.model.cluster import Slice
from kpng.model.messages import Endpoint, Service
from kpng.resolver.resolving import ClusterResolver
from kpng.server.changesets import FirstOps, local_ops
from kpng.sources.manifests import parse
from tests import wire
from tests.conftest import EXAMPLE

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
