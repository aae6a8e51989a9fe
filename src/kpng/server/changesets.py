"""Change sets as encoded ops: what one watch answer carries. Pure.

A change set lists, in this order: Sets of services, Sets of endpoints, Deletes of endpoints,
Deletes of services; paths in sorted order within each group.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from kpng.api import codec
from kpng.api.localv1_pb2 import (
    GlobalEndpointInfos,
    GlobalNodeInfos,
    GlobalServiceCIDRInfos,
    GlobalServiceInfos,
)
from kpng.api.ops import EncodeEndpoint, EncodeService, FirstOps, local_ops
from kpng.model.cluster import ServiceCIDR, ServiceKey, Slice, SliceKey
from kpng.model.dumping import endpoint_infos, message_hash, service_cidr_info
from kpng.model.messages import (
    EndpointInfo,
    Node,
    NodeInfo,
    Service,
    ServiceEndpoints,
    ServiceInfo,
)
from kpng.model.paths import endpoint_address, service_path


class Shared:
    """A change set's service and endpoint ops, and their OpBatch framing once asked for."""

    __slots__ = ("_framed", "_held", "ops", "size")

    def __init__(self, ops: list[bytes], held: object = None) -> None:
        self.ops = ops
        self.size = sum(len(op) for op in ops)
        self._framed: bytes | None = None
        self._held = held
        """What the key of a SharedOps entry names by identity: kept alive with the entry."""

    @property
    def framed(self) -> bytes:
        if self._framed is None:
            self._framed = codec.op_batch(self.ops)
        return self._framed


_DELETED = 0  # id() of no object: a deleted service's "new value" in a SharedOps key


class SharedOps:
    """``local_ops`` of one transition, computed and framed once for every view that makes it.

    Node views of one class share their ServiceEndpoints objects (ClusterResolver), so after a
    change a thousand watchers hand in the same (service key, previous value, new value)
    objects: keyed by those identities, the first view's ops and framed bytes serve the rest,
    whose change sets then differ only in their own ops around them (node facts, triggers,
    Reset, Sync). An entry holds its values, so no id in its key can name another object while
    it is cached; the least recently used entries go past ``size``.
    """

    def __init__(
        self,
        encode_service: EncodeService,
        encode_endpoint: EncodeEndpoint,
        first_ops: FirstOps | None = None,
        *,
        size: int = 1024,
    ) -> None:
        self._encode_service = encode_service
        self._encode_endpoint = encode_endpoint
        self._first_ops = first_ops
        self._size = size
        self._cache: OrderedDict[frozenset[tuple[ServiceKey, int, int]], Shared] = OrderedDict()

    def __call__(
        self,
        *,
        updated: Mapping[ServiceKey, ServiceEndpoints],
        deleted: Iterable[ServiceKey],
        previous: Mapping[ServiceKey, ServiceEndpoints],
        remember: bool = True,
    ) -> Shared:
        """The ops of this transition, computed now unless remembered; ``remember`` False
        neither looks it up nor keeps it."""
        deleted = tuple(deleted)
        key: frozenset[tuple[ServiceKey, int, int]] = frozenset()
        if remember:
            transitions = [(k, id(previous.get(k)), id(new)) for k, new in updated.items()]
            transitions += [(k, id(previous.get(k)), _DELETED) for k in deleted]
            key = frozenset(transitions)
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
        ops = local_ops(
            updated=updated,
            deleted=deleted,
            previous=previous,
            encode_service=self._encode_service,
            encode_endpoint=self._encode_endpoint,
            first_ops=self._first_ops,
        )
        if not remember:
            return Shared(ops)
        entry = self._cache[key] = Shared(ops, held=(tuple(updated.values()), dict(previous)))
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return entry


def _cut(items: Iterable[bytes], limit: int) -> Iterator[list[bytes]]:
    """``items`` in runs, each cut once it holds ``limit`` bytes or more."""
    chunk: list[bytes] = []
    size = 0
    for item in items:
        chunk.append(item)
        size += len(item)
        if size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def batches(ops: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """Encoded OpBatches of ``ops``, each cut once it holds ``limit`` bytes of ops or more."""
    return map(codec.op_batch, _cut(ops, limit))


def joined(pieces: Iterable[bytes], limit: int) -> Iterator[bytes]:
    """Encoded OpBatches concatenated (which makes one OpBatch of all their entries) into
    messages, each cut once it holds ``limit`` bytes or more."""
    return map(b"".join, _cut(pieces, limit))


@dataclass(frozen=True)
class ChangeSet:
    """One node watch answer: the node's own ops around the ops its class of views shares."""

    head: list[bytes]
    """Reset, node facts: this watcher's own."""
    shared: Shared
    tail: list[bytes]
    """Change triggers, Sync."""
    base: Sequence[bytes] = ()
    """A first state's zone base, as the messages every watcher of the zone is sent
    (``firststates.BaseFrames``), between ``head`` and ``shared``: ``shared`` then holds the
    node's corrections to it. Sent only to batched watchers that asked for packing."""

    def ops(self) -> list[bytes]:
        if self.base:
            raise ValueError("a change set over a zone's base is for packing watchers only")
        return [*self.head, *self.shared.ops, *self.tail]

    def batches(self, limit: int) -> Iterator[bytes]:
        """What ``batches(self.ops(), limit)`` gives, byte for byte, without a base. A change
        set under the limit is one batch, and OpBatch encodings concatenate into the OpBatch of
        all their ops (Ops is the only field, repeated): the shared ops are framed once for all
        views. With a base: the head alone (a Reset must come before any Packed entry), the
        base's messages, then the rest."""
        if self.base:
            yield codec.op_batch(self.head)
            yield from self.base
            yield from batches(itertools.chain(self.shared.ops, self.tail), limit)
            return
        size = sum(len(op) for op in self.head) + self.shared.size
        size += sum(len(op) for op in self.tail)
        if 0 < size < limit:
            yield codec.op_batch(self.head) + self.shared.framed + codec.op_batch(self.tail)
        else:  # a first state: not copied into one more list of a hundred thousand ops
            yield from batches(itertools.chain(self.head, self.shared.ops, self.tail), limit)


EncodeInfo = Callable[[msgspec.Struct], bytes]


class GlobalTracker:
    """What one global watcher holds, and the ops that bring it to the store's current state.

    Paths: services ``namespace/name``, nodes ``name``, endpoints
    ``namespace/service/slice/address`` (one EndpointInfo per slice endpoint), ServiceCIDRs
    ``name`` (a set of kpng's, GlobalServiceCIDRInfos).
    """

    def __init__(self, encode: EncodeInfo) -> None:
        self._encode = encode
        self._services: dict[str, bytes] = {}
        self._nodes: dict[str, bytes] = {}
        self._service_cidrs: dict[str, bytes] = {}
        self._endpoints: dict[SliceKey, dict[str, bytes]] = {}

    def ops(
        self,
        *,
        services: Mapping[ServiceKey, Service],
        slices: Mapping[SliceKey, Slice],
        nodes: Mapping[str, Node],
        changed_services: Iterable[ServiceKey],
        changed_slices: Iterable[SliceKey],
        changed_nodes: Iterable[str],
        service_cidrs: Mapping[str, ServiceCIDR],
        changed_service_cidrs: Iterable[str],
    ) -> list[bytes]:
        sets: list[bytes] = []
        deletes: list[bytes] = []
        for name in sorted(changed_service_cidrs):
            cidr = service_cidrs.get(name)
            cidr_info = None if cidr is None else service_cidr_info(cidr)
            self._put(self._service_cidrs, GlobalServiceCIDRInfos, name, cidr_info, sets, deletes)
        for name in sorted(changed_nodes):
            node = nodes.get(name)
            info = None if node is None else NodeInfo(Hash=message_hash(node), Node=node)
            self._put(self._nodes, GlobalNodeInfos, name, info, sets, deletes)
        for key in sorted(changed_services):
            service = services.get(key)
            sinfo = (
                None
                if service is None
                else ServiceInfo(Hash=message_hash(service), Service=service)
            )
            self._put(self._services, GlobalServiceInfos, service_path(key), sinfo, sets, deletes)
        for key in sorted(changed_slices):
            sl = slices.get(key)
            sent = self._endpoints.pop(key, {})
            wanted: dict[str, EndpointInfo] = {}
            if sl is not None:
                for epinfo in endpoint_infos(sl):
                    ep = epinfo.Endpoint
                    assert ep is not None
                    address = endpoint_address(ep)
                    path = f"{sl.namespace}/{sl.service}/{sl.name}/{address}"
                    wanted[path] = msgspec.structs.replace(epinfo, Hash=message_hash(epinfo))
            kept: dict[str, bytes] = {}
            for path in sorted(wanted.keys() | sent.keys()):
                if path in sent:
                    kept[path] = sent[path]
                self._put(kept, GlobalEndpointInfos, path, wanted.get(path), sets, deletes)
            if kept:
                self._endpoints[key] = kept
        return sets + deletes

    def _put(
        self,
        sent: dict[str, bytes],
        set_: int,
        path: str,
        info: msgspec.Struct | None,
        sets: list[bytes],
        deletes: list[bytes],
    ) -> None:
        if info is None:
            if sent.pop(path, None) is not None:
                deletes.append(codec.op_delete(set_, path))
            return
        payload = self._encode(info)
        if sent.get(path) != payload:
            sent[path] = payload
            sets.append(codec.op_set(set_, path, payload))
