"""The localv1 ops of node-local changes: what a watch answer carries, and what to-plugin sends
its plugins. Pure.

A change set lists, in this order: Sets of services, Sets of endpoints, Deletes of endpoints,
Deletes of services; paths in sorted order within each group.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

from kpng.api import codec
from kpng.api.localv1_pb2 import EndpointsSet, ServicesSet
from kpng.model.cluster import ServiceKey
from kpng.model.messages import Endpoint, Service, ServiceEndpoints
from kpng.model.paths import NODE_FACTS_PATH, endpoint_keys, service_path

__all__ = [
    "NODE_FACTS_PATH",
    "EncodeEndpoint",
    "EncodeService",
    "FirstOps",
    "ResolvedMemo",
    "local_ops",
]

T = TypeVar("T")

EncodeService = Callable[[Service], bytes]
EncodeEndpoint = Callable[[Endpoint], bytes]


class ResolvedMemo(Generic[T]):
    """What is computed once per resolved value of a service (``_compute``), for every watcher.

    Node views of one class share their ServiceEndpoints objects, so a thousand watchers of
    one class cost one computation per service. Keyed by identity; an entry holds its value, so
    an id is not reused while cached. ``forget`` drops a service's entries once its values are
    replaced or it is gone (the server calls it at each change of the service): else every
    value a churning cluster ever resolved stayed until ``size``, many times the live state (a
    soak of 1,000 to 5,000 services grew a brain by 220 %/hour); past ``size`` the oldest go.
    """

    def __init__(self, size: int = 65_536) -> None:
        self._size = size
        self._cache: OrderedDict[int, tuple[ServiceEndpoints, T, ServiceKey]] = OrderedDict()
        self._by_key: dict[ServiceKey, set[int]] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def forget(self, key: ServiceKey) -> None:
        """Drop the entries of service ``key``: its values are outdated."""
        for ident in self._by_key.pop(key, ()):
            self._cache.pop(ident, None)

    def __call__(self, key: ServiceKey, value: ServiceEndpoints) -> T:
        entry = self._cache.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
        computed = self._compute(key, value)
        self._cache[id(value)] = (value, computed, key)
        self._by_key.setdefault(key, set()).add(id(value))
        if len(self._cache) > self._size:
            ident, (*_, oldest) = self._cache.popitem(last=False)
            idents = self._by_key.get(oldest)
            if idents is not None:
                idents.discard(ident)
                if not idents:
                    del self._by_key[oldest]
        return computed

    def _compute(self, key: ServiceKey, value: ServiceEndpoints) -> T:
        raise NotImplementedError


class FirstOps(ResolvedMemo[tuple[bytes, list[bytes]]]):
    """The ops that add one service from nothing, framed once per resolved value: every new
    watcher of a thousand reuses the framing of the first, and its initial state costs a list
    concatenation per service."""

    def __init__(self, encode_service: EncodeService, encode_endpoint: EncodeEndpoint) -> None:
        super().__init__()
        self._encode_service = encode_service
        self._encode_endpoint = encode_endpoint

    def _compute(self, key: ServiceKey, value: ServiceEndpoints) -> tuple[bytes, list[bytes]]:
        path = service_path(key)
        service_op = codec.op_set(ServicesSet, path, self._encode_service(value.service))
        keyed = endpoint_keys(value.endpoints)
        endpoint_ops = [
            codec.op_set(EndpointsSet, f"{path}/{k}", self._encode_endpoint(keyed[k]))
            for k in sorted(keyed)
        ]
        return service_op, endpoint_ops


def local_ops(
    *,
    updated: Mapping[ServiceKey, ServiceEndpoints],
    deleted: Iterable[ServiceKey],
    previous: Mapping[ServiceKey, ServiceEndpoints],
    encode_service: EncodeService,
    encode_endpoint: EncodeEndpoint,
    first_ops: FirstOps | None = None,
) -> list[bytes]:
    """The ops turning a node-local state with ``previous`` values into one with ``updated``."""
    service_sets: list[bytes] = []
    endpoint_sets: list[bytes] = []
    endpoint_deletes: list[bytes] = []
    service_deletes: list[bytes] = []
    for key in sorted(updated):
        new = updated[key]
        old = previous.get(key)
        if old is None and first_ops is not None:
            service_op, endpoint_ops = first_ops(key, new)
            service_sets.append(service_op)
            endpoint_sets.extend(endpoint_ops)
            continue
        path = service_path(key)
        if old is None or old.service != new.service:
            service_sets.append(codec.op_set(ServicesSet, path, encode_service(new.service)))
        old_eps = endpoint_keys(old.endpoints) if old is not None else {}
        new_eps = endpoint_keys(new.endpoints)
        for ep_key in sorted(new_eps):
            ep = new_eps[ep_key]
            if old_eps.get(ep_key) != ep:
                payload = encode_endpoint(ep)
                endpoint_sets.append(codec.op_set(EndpointsSet, f"{path}/{ep_key}", payload))
        for ep_key in sorted(old_eps.keys() - new_eps.keys()):
            endpoint_deletes.append(codec.op_delete(EndpointsSet, f"{path}/{ep_key}"))
    for key in sorted(deleted):
        path = service_path(key)
        old = previous.get(key)
        if old is not None:
            for ep_key in sorted(endpoint_keys(old.endpoints)):
                endpoint_deletes.append(codec.op_delete(EndpointsSet, f"{path}/{ep_key}"))
        service_deletes.append(codec.op_delete(ServicesSet, path))
    return service_sets + endpoint_sets + endpoint_deletes + service_deletes
