"""First states from their zone's base: the base packed once for every node of the zone, and each
node's own services as corrections after it. Pure.

A node's state is its zone's base (every service as the zone's nodes see it that host none of
its endpoints) under the node's overlay, some 20 services of 10,000 (``NodeView.layers``). So
to a watcher that asked for packing (``WatchReq.Packed``) a first state is sent as the base's
ops, framed and compressed once per bucket of services for every node of the zone
(``codec.packed``), followed by the ops that turn the base's value of each overlay service
into the node's (their ops from the base's value): some 2.2 MB a node instead of 27 MB at
10,000 services x 10 endpoints in JSON, and no framing per node (docs/design/mass-connect.md).

Such a first state is in bucket order, not path order, and sets some paths twice (the later
wins): all after one Reset and applied at one Sync, so the watcher never acts on the base
alone, and puts the ops in order itself (``kpng.remote.watching.LocalOps``). A watcher that
did not ask gets every first state framed for it, in path order, as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from kpng.api import codec
from kpng.api.digests import BUCKETS, bucket_of
from kpng.api.ops import FirstOps
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.model.paths import service_path
from kpng.server.changesets import Shared, SharedOps, batches, joined
from kpng.server.zonecaches import ZoneCaches


class _ZoneFrames:
    """One zone's base as packed buckets: the services of each, and its pieces once made."""

    __slots__ = ("members", "messages", "pieces")

    def __init__(self) -> None:
        self.members: list[set[ServiceKey]] = [set() for _ in range(BUCKETS)]
        self.pieces: list[list[bytes] | None] = [None] * BUCKETS
        """A bucket's ops as encoded OpBatches of one Packed entry each (None: not made since
        it changed)."""
        self.messages: list[bytes] | None = None
        """The pieces joined into messages (None: not made since a bucket changed)."""


class BaseFrames(ZoneCaches[_ZoneFrames]):
    """The packed buckets of every zone's base, for one encoding (``first_ops`` frames each
    service's ops); follows the bases through ``changed``, a ``ClusterResolver.on_base_change``
    listener. A bucket is packed at the first first state that needs it after it changed, so
    a churning cluster costs nothing until a node connects."""

    def __init__(self, first_ops: FirstOps, *, message_bytes: int) -> None:
        super().__init__(_ZoneFrames)
        self._first_ops = first_ops
        self._message_bytes = message_bytes
        """A bucket's ops are cut into pieces of about this size before they are packed (a
        bucket of a few huge services is not one entry beyond what a watcher inflates), and the
        packed pieces are joined into messages of about this size."""

    def messages(self, zone: str, base: Mapping[ServiceKey, ServiceEndpoints]) -> list[bytes]:
        """``zone``'s ``base`` as encoded OpBatches of Packed entries, in bucket order; they
        concatenate into one OpBatch whose ops are every Set of the base. The same bytes
        objects for every node of the zone until the base changes: not even copied per node."""
        entry = self._current(zone, base)
        if entry.messages is None:
            made = entry.pieces
            found: list[bytes] = []
            for index in range(BUCKETS):
                pieces = made[index]
                if pieces is None:
                    pieces = made[index] = self._pack(entry.members[index], base)
                found.extend(pieces)
            entry.messages = list(joined(found, self._message_bytes))
        return entry.messages

    def _pack(
        self, members: set[ServiceKey], base: Mapping[ServiceKey, ServiceEndpoints]
    ) -> list[bytes]:
        service_ops: list[bytes] = []
        endpoint_ops: list[bytes] = []
        for key in sorted(members):
            service_op, ops = self._first_ops(key, base[key])
            service_ops.append(service_op)
            endpoint_ops.extend(ops)
        ops = service_ops + endpoint_ops
        return [codec.packed(batch) for batch in batches(ops, self._message_bytes)]

    def _current(self, zone: str, base: Mapping[ServiceKey, ServiceEndpoints]) -> _ZoneFrames:
        """``zone``'s frames, their buckets' members brought up to its base and the pieces of
        changed buckets dropped."""
        entry, stale = self._take(zone)
        if stale is None:
            for key in base:
                entry.members[bucket_of(service_path(key))].add(key)
        else:
            for key in stale:
                index = bucket_of(service_path(key))
                if key in base:
                    entry.members[index].add(key)
                else:
                    entry.members[index].discard(key)
                entry.pieces[index] = None
                entry.messages = None
        return entry


def corrections(
    base: Mapping[ServiceKey, ServiceEndpoints],
    overlay: Mapping[ServiceKey, ServiceEndpoints | None],
    shared_ops: SharedOps,
) -> Shared:
    """The ops that turn a watcher holding ``base`` into one holding ``overlay`` over it (None
    in the overlay: a service the state lacks): a node's own services after its zone's base."""
    updated: dict[ServiceKey, ServiceEndpoints] = {}
    deleted: list[ServiceKey] = []
    previous: dict[ServiceKey, ServiceEndpoints] = {}
    for key, value in overlay.items():
        old = base.get(key)
        if value is old:
            continue
        if old is not None:
            previous[key] = old
        if value is not None:
            updated[key] = value
        elif old is not None:
            deleted.append(key)
    # Not remembered: they are the node's own.
    return shared_ops(updated=updated, deleted=deleted, previous=previous, remember=False)
