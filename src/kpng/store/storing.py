"""The global store: the cluster's Services, EndpointSlices, Nodes and ServiceCIDRs as the sources
last saw them.

- **Deduplicated**: writing an object equal to the one stored changes nothing (frozen Structs
  compare in C, so a resent or relisted object costs one comparison, and no revision).
- **Revisioned**: each source ``commit()`` that changed something is one new revision.
- **Never partial**: subscribers hear of nothing before every registered source has marked itself
  synced; then their first delta names every object.
- **Coalescing**: each subscriber accumulates the keys changed since it last read, so a slow
  subscriber reads one merged delta instead of a backlog, and memory stays bounded by the number of
  objects, not of events: keys created and deleted again since a subscriber's last read (churn
  under new names, as rolling deployments make) are forgotten once they outnumber the objects.
- **Checked across sources**: two Services claiming one node port (which the API server would
  not allow, but files and relays are not checked by it) are reported when a revision makes it
  so, naming both; the state is served as it is (``kpng.store.nodeports`` says which one backends
  serve).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

import msgspec

from kpng.errors import object_name
from kpng.model.cluster import ServiceCIDR, ServiceKey, Slice, SliceKey
from kpng.model.messages import NO_TRIGGERS, ChangeTriggers, Node, NodeFacts, Service
from kpng.store.nodeports import NodePortClaims

log = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")


class Delta(msgspec.Struct, frozen=True):
    """Keys changed (set or deleted) since a subscriber's previous read, at ``revision``."""

    revision: int
    services: frozenset[ServiceKey]
    slices: frozenset[SliceKey]
    nodes: frozenset[str]
    service_cidrs: frozenset[str] = frozenset()
    triggers: ChangeTriggers = NO_TRIGGERS
    """The trigger times of the EndpointSlice changes since the previous read (at most
    ``TRIGGER_LIMIT``, the newest), for network programming latency."""


TRIGGER_LIMIT = 100_000
"""Trigger times a subscriber that does not read keeps: past this, the oldest are forgotten
(and with them their network programming times), so memory stays bounded."""


_MIN_NOTED = 1024
"""Keys of one kind a subscriber that does not read accumulates before those it never saw
(created and deleted since its last read) are forgotten; past this, twice the store's table."""


class _Noted(Generic[K]):
    """The keys of one kind changed since a subscriber's last read.

    A key created since then (its first change since the read made it exist) and deleted again
    is none of the subscriber's business: it never saw it. Such keys are forgotten once the set
    outgrows twice the store's table, so a subscriber that does not read costs memory bounded by
    the number of objects (those it saw and those there are), not by the churn.
    """

    __slots__ = ("_born", "_limit", "keys")

    def __init__(self) -> None:
        self.keys: set[K] = set()
        self._born: set[K] = set()
        self._limit = _MIN_NOTED

    def note(self, changed: set[K], created: set[K], live: Mapping[K, object]) -> None:
        if created:
            self._born |= created - self.keys
        self.keys |= changed
        if len(self.keys) > max(self._limit, 2 * len(live)):
            gone = {key for key in self._born if key not in live}
            self.keys -= gone
            self._born -= gone
            self._limit = max(_MIN_NOTED, 2 * len(self.keys))

    def take(self) -> frozenset[K]:
        keys = frozenset(self.keys)
        self.reset(set())
        return keys

    def reset(self, keys: set[K]) -> None:
        self.keys = keys
        self._born = set()
        self._limit = _MIN_NOTED


class Published(msgspec.Struct, frozen=True):
    """What one revision changed, told to ``Store.listeners`` (kpng's metrics count changes and
    time network programming with it)."""

    revision: int
    services: int
    slices: int


class Subscription:
    """A subscriber's view of the store's changes; iterate it (async) to receive Deltas."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._services: _Noted[ServiceKey] = _Noted()
        self._slices: _Noted[SliceKey] = _Noted()
        self._nodes: _Noted[str] = _Noted()
        self._service_cidrs: _Noted[str] = _Noted()
        self._triggers: list[tuple[bool, float]] = []
        self._revision = 0  # the last revision delivered
        self._wakeup = asyncio.Event()
        self._closed = False

    def _note(self, staged: SourceHandle) -> None:
        store = self._store
        if self._revision:  # (the first delivery names every object)
            self._services.note(staged._services, staged._created_services, store._services)
            self._slices.note(staged._slices, staged._created_slices, store._slices)
            self._nodes.note(staged._nodes, staged._created_nodes, store._nodes)
            self._service_cidrs.note(
                staged._service_cidrs, staged._created_service_cidrs, store._service_cidrs
            )
        triggers = staged._triggers
        if triggers:
            self._triggers += triggers
            if len(self._triggers) > TRIGGER_LIMIT:
                del self._triggers[: len(self._triggers) - TRIGGER_LIMIT]
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._store._subscriptions.discard(self)
        self._wakeup.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Delta:
        store = self._store
        while True:
            if self._closed:
                raise StopAsyncIteration
            if store.synced and store.revision > self._revision:
                if self._revision == 0:
                    # First delivery: everything (nothing was noted before it).
                    self._services.reset(set(store.services))
                    self._slices.reset(set(store.slices))
                    self._nodes.reset(set(store.nodes))
                    self._service_cidrs.reset(set(store.service_cidrs))
                delta = Delta(
                    revision=store.revision,
                    services=self._services.take(),
                    slices=self._slices.take(),
                    nodes=self._nodes.take(),
                    service_cidrs=self._service_cidrs.take(),
                    triggers=_by_family(self._triggers),
                )
                self._triggers = []
                self._revision = store.revision
                return delta
            self._wakeup.clear()
            await self._wakeup.wait()


def _by_family(triggers: Sequence[tuple[bool, float]]) -> ChangeTriggers:
    if not triggers:
        return NO_TRIGGERS
    return ChangeTriggers(
        V4=tuple(t for v6, t in triggers if not v6), V6=tuple(t for v6, t in triggers if v6)
    )


class SourceCounter(NamedTuple):
    """One counter a source keeps about itself (``SourceHandle.counters``)."""

    name: str
    help: str
    value: int


class SourceHandle:
    """What one source writes through. Writes are staged until ``commit()``."""

    def __init__(self, store: Store, name: str) -> None:
        self._store = store
        self.name = name
        self.synced = False
        self.skipped = 0
        """Objects the source reported as unusable and skipped (for ``/metrics``)."""
        self.blocked_by: str | None = None
        """Why the source cannot sync until something outside kpng changes (a file that never
        parsed), for ``/healthz`` and for one-shot runs, which then fail instead of waiting."""
        self.counters: Callable[[], Iterable[SourceCounter]] | None = None
        """The counters the source keeps about itself, read at each scrape of ``/metrics``,
        each exported as ``kpng_source_<name>_total`` (the kube source: its lists, watches,
        events, failures...)."""
        self._services: set[ServiceKey] = set()
        self._slices: set[SliceKey] = set()
        self._nodes: set[str] = set()
        self._service_cidrs: set[str] = set()
        # Of the staged keys, those that did not exist before this commit.
        self._created_services: set[ServiceKey] = set()
        self._created_slices: set[SliceKey] = set()
        self._created_nodes: set[str] = set()
        self._created_service_cidrs: set[str] = set()
        self._triggers: list[tuple[bool, float]] = []

    def set_service(self, key: ServiceKey, service: Service | None) -> None:
        if _stage(self._store._services, key, service, self._services, self._created_services):
            self._store._node_ports.update(key, service)

    def ignore_service(self, key: ServiceKey, reason: str | None) -> None:
        """Say why Service ``key`` is there but not kpng's (None: it is not ignored), for
        ``kpng explain``; the state backends see does not change."""
        if reason is None:
            self._store._ignored_services.pop(key, None)
        else:
            self._store._ignored_services[key] = reason

    def set_slice(self, key: SliceKey, sl: Slice | None) -> None:
        store = self._store
        old = store._slices.get(key)
        if _stage(store._slices, key, sl, self._slices, self._created_slices):
            store._index_slice(key, old, sl)
            if sl is not None and sl.trigger_time:
                self._triggers.append((sl.v6, sl.trigger_time))

    def set_node(self, name: str, node: Node | None) -> None:
        _stage(self._store._nodes, name, node, self._nodes, self._created_nodes)

    def set_service_cidr(self, name: str, cidr: ServiceCIDR | None) -> None:
        _stage(
            self._store._service_cidrs, name, cidr, self._service_cidrs, self._created_service_cidrs
        )

    def commit(self) -> bool:
        """Publish the staged changes as one revision; False if nothing really changed."""
        if not (self._services or self._slices or self._nodes or self._service_cidrs):
            return False
        self._store._publish(self)
        if self._store.listeners:
            published = Published(
                revision=self._store.revision,
                services=len(self._services),
                slices=len(self._slices),
            )
            for listener in self._store.listeners:
                listener(published)
        self._services, self._slices, self._nodes = set(), set(), set()
        self._service_cidrs = set()
        self._created_services, self._created_slices = set(), set()
        self._created_nodes, self._created_service_cidrs = set(), set()
        self._triggers = []
        return True

    def block(self, reason: str) -> None:
        """The source cannot deliver its initial state until ``reason`` is fixed (by a user)."""
        if self.synced or self.blocked_by == reason:
            return
        self.blocked_by = reason
        for listener in self._store.block_listeners:
            listener(self)

    def mark_synced(self) -> None:
        """The source has delivered its complete initial state (commits what is staged)."""
        self.commit()
        self.blocked_by = None
        if not self.synced:
            self.synced = True
            self._store._source_synced(self)


def _stage(table: dict[K, V], key: K, value: V | None, staged: set[K], created: set[K]) -> bool:
    """Write ``value`` at ``key``; if that changed it, stage the key (and note it created if it
    did not exist before this commit: its first write since made it exist)."""
    existed = key in table
    if not _put(table, key, value):
        return False
    if key not in staged:
        staged.add(key)
        if not existed:
            created.add(key)
    return True


def _put(table: dict[K, V], key: K, value: V | None) -> bool:
    if value is None:
        return table.pop(key, None) is not None
    if table.get(key) == value:
        return False
    table[key] = value
    return True


class Store:
    def __init__(self) -> None:
        self._services: dict[ServiceKey, Service] = {}
        self._ignored_services: dict[ServiceKey, str] = {}
        self._slices: dict[SliceKey, Slice] = {}
        self._slices_by_service: dict[ServiceKey, dict[SliceKey, Slice]] = {}
        self._nodes: dict[str, Node] = {}
        self._service_cidrs: dict[str, ServiceCIDR] = {}
        self._service_cidr_ranges: tuple[str, ...] | None = ()
        self._node_ports = NodePortClaims()
        self._sources: list[SourceHandle] = []
        self._subscriptions: set[Subscription] = set()
        self.revision = 0
        self.listeners: list[Callable[[Published], None]] = []
        """Told of each revision as it is published."""
        self.block_listeners: list[Callable[[SourceHandle], None]] = []
        """Told when a source says it cannot sync (``SourceHandle.block``)."""

    @property
    def services(self) -> Mapping[ServiceKey, Service]:
        return self._services

    @property
    def ignored_services(self) -> Mapping[ServiceKey, str]:
        """Services a source has but kube-proxy's rules ignore, and why (sources that see them:
        the file source; the kube source's label selector keeps most from ever arriving)."""
        return self._ignored_services

    @property
    def slices(self) -> Mapping[SliceKey, Slice]:
        return self._slices

    def slices_of(self, service: ServiceKey) -> tuple[Slice, ...]:
        """The slices naming Service ``service`` (known to the store or not), in no set order:
        one Service's, without scanning every slice (``/debug/explain`` asks per request)."""
        return tuple(self._slices_by_service.get(service, {}).values())

    def _index_slice(self, key: SliceKey, old: Slice | None, new: Slice | None) -> None:
        if old is not None:
            siblings = self._slices_by_service[old.service_key]
            del siblings[key]
            if not siblings:
                del self._slices_by_service[old.service_key]
        if new is not None:
            self._slices_by_service.setdefault(new.service_key, {})[key] = new

    @property
    def nodes(self) -> Mapping[str, Node]:
        return self._nodes

    @property
    def service_cidrs(self) -> Mapping[str, ServiceCIDR]:
        return self._service_cidrs

    @property
    def service_cidr_ranges(self) -> tuple[str, ...]:
        """Every ServiceCIDR's ranges, each once, sorted."""
        if self._service_cidr_ranges is None:
            self._service_cidr_ranges = tuple(
                sorted({c for sc in self._service_cidrs.values() for c in sc.cidrs})
            )
        return self._service_cidr_ranges

    def node_facts(self, name: str) -> NodeFacts:
        """What a backend of node ``name`` reads of it and of the cluster (empty for a node the
        sources do not know, but the ServiceCIDRs)."""
        node = self._nodes.get(name)
        if node is None:
            return NodeFacts(ServiceCIDRs=self.service_cidr_ranges)
        return NodeFacts(
            Addresses=node.Addresses,
            PodCIDRs=node.PodCIDRs,
            ServiceCIDRs=self.service_cidr_ranges,
            Draining=node.Draining,
        )

    @property
    def sources(self) -> Sequence[SourceHandle]:
        return tuple(self._sources)

    @property
    def synced(self) -> bool:
        """Every source has delivered its initial state (and there is at least one source)."""
        return bool(self._sources) and all(s.synced for s in self._sources)

    def source(self, name: str) -> SourceHandle:
        """Register a source; until it marks itself synced, no subscriber hears anything."""
        handle = SourceHandle(self, name)
        self._sources.append(handle)
        return handle

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        self._subscriptions.add(sub)
        return sub

    def _publish(self, staged: SourceHandle) -> None:
        services, slices, nodes = staged._services, staged._slices, staged._nodes
        service_cidrs = staged._service_cidrs
        self.revision += 1
        if service_cidrs:
            self._service_cidr_ranges = None
        log.debug(
            "revision %d: %d services, %d slices, %d nodes, %d service CIDRs changed",
            self.revision,
            len(services),
            len(slices),
            len(nodes),
            len(service_cidrs),
        )
        if services:
            self._report_node_port_conflicts()
        for sub in self._subscriptions:
            sub._note(staged)

    def _report_node_port_conflicts(self) -> None:
        # Checked per revision, not per write: a source's batch that moves a node port from one
        # Service to another (both in one commit) is no conflict.
        for conflict in self._node_ports.new_conflicts():
            names = [object_name(*key) for key in conflict.services]
            log.warning(
                "node port %d/%s is claimed by Services %s; all are kept in the state, and "
                "kpng's backends program the port for %s (the first by namespace/name)",
                conflict.port,
                conflict.protocol,
                ", ".join(names[:-1]) + " and " + names[-1],
                names[0],
            )

    def _source_synced(self, source: SourceHandle) -> None:
        log.info("source %s synced", source.name)
        if self.synced:
            if self.revision == 0:
                self.revision = 1  # an empty cluster is a complete state too
            for sub in self._subscriptions:
                sub._wakeup.set()
