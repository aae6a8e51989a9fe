"""The brain: the global model to one node's local state, incrementally.

``resolve_service`` computes one service's node-local view (pure, table-tested);
``NodeResolver`` keeps the index from services to their slices and recomputes only the services
that a change touched, so one EndpointSlice event costs one service, whatever the cluster's size.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import msgspec

from kpng.model.cluster import ServiceKey, Slice, SliceEndpoint, SliceKey, node_zone
from kpng.model.messages import (
    EMPTY_IPSET,
    Endpoint,
    EndpointAddress,
    EndpointScopes,
    IPFamilies,
    IPSet,
    Node,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
)
from kpng.model.paths import in_key_order
from kpng.resolver.categorizing import Categories, categorize

_SCOPES = {
    (i, e, c): EndpointScopes(Internal=i, External=e, Cluster=c)
    for i in (False, True)
    for e in (False, True)
    for c in (False, True)
}
_FAMILIES = {
    (v4, v6): IPFamilies(V4=v4, V6=v6) if v4 or v6 else None
    for v4 in (False, True)
    for v6 in (False, True)
}


def _service_externally_accessible(service: Service, ips: IPSet) -> bool:
    """kube-proxy's service-level rule, which gates externalTrafficPolicy: Local."""
    return service.Type in ("NodePort", "LoadBalancer") or bool(ips.V4 or ips.V6)


def _slices_by_port(slices: Sequence[Slice]) -> dict[tuple[str, str], list[tuple[Slice, int]]]:
    """Per port name and protocol, the slices that give it, in order, with their number.

    Made once per family: matching each service port against every slice's ports instead costs
    ports x slices x slice ports, 58 s for one Service of 20,000 ports in 200 slices."""
    found: dict[tuple[str, str], list[tuple[Slice, int]]] = {}
    for sl in slices:
        seen: set[tuple[str, str]] = set()
        for sp in sl.ports:
            key = (sp.name, sp.protocol)
            # A slice naming a port twice is read by its first entry; one without a number
            # gives no endpoint.
            if key not in seen:
                seen.add(key)
                if sp.port:
                    found.setdefault(key, []).append((sl, sp.port))
    return found


def _port_endpoints(
    port: PortMapping, by_port: dict[tuple[str, str], list[tuple[Slice, int]]]
) -> list[tuple[SliceEndpoint, int]]:
    """The endpoints of one service port in one family, deduplicated by address and port.

    Slices are matched by port name and protocol (``_slices_by_port``), and give the port number
    (named target ports resolve this way). One address may sit in several slices: a pod moving
    between slices, or a pod network reusing a terminating pod's IP for a new pod. As kube-proxy
    does since 1.36, one endpoint is kept per address and port, and a terminating copy never
    replaces another: the running pod wins (among several running ones, the last slice by name;
    kube-proxy leaves that case undefined). Until 1.35 the local copy won.
    """
    chosen: dict[tuple[str, int], SliceEndpoint] = {}
    for sl, number in by_port.get((port.Name, port.Protocol), ()):
        for ep in sl.endpoints:
            key = (ep.ip, number)
            if key not in chosen or not ep.terminating:
                chosen[key] = ep
    return [(ep, number) for (_, number), ep in chosen.items()]


class PortDecision(msgspec.Struct, gc=False):
    """How one service port's endpoints in one family were chosen."""

    port: int
    """Index into the service's ports."""
    v6: bool
    candidates: list[tuple[SliceEndpoint, int]]
    """The endpoints considered (one per address and port number), with their port number."""
    categories: Categories
    uses_cluster: bool
    uses_local: bool
    external: bool
    """The port is reached from outside too: a node port, or an external or load-balancer IP."""
    scopes: list[EndpointScopes]
    """Per candidate, the scopes it was given."""


class Decisions(msgspec.Struct, gc=False):
    """Everything decided of one service on one node: what ``resolve_service`` builds its
    answer from, and what ``kpng explain`` words (the same decisions: explain cannot drift)."""

    internal_local: bool
    external_local: bool
    """externalTrafficPolicy is Local and the service is externally accessible."""
    families: tuple[bool, ...]
    """The families resolved (False: IPv4, True: IPv6): those of the service's cluster IPs."""
    ports: list[PortDecision]
    """One per service port and family that has candidates, by family, then port."""


def decide(service: Service, slices: Iterable[Slice], *, node: str, zone: str) -> Decisions:
    """Which endpoints node ``node`` in ``zone`` gives each port of ``service``, with which
    scopes. Each IP family is decided on its own (kube-proxy runs one proxier per family), and
    each service port on its own."""
    ips = service.IPs
    cluster_ips = ips.ClusterIPs if ips is not None and ips.ClusterIPs is not None else EMPTY_IPSET
    external_ips = ips.ExternalIPs if ips is not None and ips.ExternalIPs else EMPTY_IPSET
    lb_ips = ips.LoadBalancerIPs if ips is not None and ips.LoadBalancerIPs else EMPTY_IPSET
    internal_local = service.InternalTrafficToLocal
    external_local = service.ExternalTrafficToLocal and _service_externally_accessible(
        service, external_ips
    )
    families = tuple(v6 for v6 in (False, True) if cluster_ips.family(v6))
    ordered = sorted(slices, key=lambda sl: sl.name)
    ports: list[PortDecision] = []
    for v6 in families:
        by_port = _slices_by_port([sl for sl in ordered if sl.v6 == v6])
        has_external_ip = bool(external_ips.family(v6) or lb_ips.family(v6))
        for p, port in enumerate(service.Ports):
            candidates = _port_endpoints(port, by_port)
            if not candidates:
                continue
            external = port.NodePort != 0 or has_external_ip
            uses_cluster = not internal_local or external
            uses_local = internal_local or (external_local and external)
            cats = categorize(
                [ep for ep, _ in candidates],
                node=node,
                zone=zone,
                uses_cluster=uses_cluster,
                uses_local=uses_local,
            )
            cluster, local = cats.cluster, cats.local
            scopes = [
                _SCOPES[
                    (
                        (i in local) if internal_local else (i in cluster),
                        external and ((i in local) if external_local else (i in cluster)),
                        i in cluster,
                    )
                ]
                for i in range(len(candidates))
            ]
            ports.append(
                PortDecision(p, v6, candidates, cats, uses_cluster, uses_local, external, scopes)
            )
    return Decisions(internal_local, external_local, families, ports)


def resolve_service(
    service: Service, slices: Iterable[Slice], *, node: str, zone: str
) -> ServiceEndpoints:
    """One service as node ``node`` in ``zone`` sees it: its ports, and its endpoints with scopes
    (``decide``)."""
    return resolved(service, decide(service, slices, node=node, zone=zone), node=node)


_NO_SCOPE = _SCOPES[(False, False, False)]


def resolved(service: Service, decisions: Decisions, *, node: str) -> ServiceEndpoints:
    """The service as ``decisions`` make it on node ``node``: an endpoint whose scopes are the
    same on every port it serves comes out once, with a PortOverride per port."""
    # (endpoint identity, scopes) -> [endpoint, v6, ports]; dicts keep first-seen order.
    grouped: dict[tuple[int, EndpointScopes], tuple[SliceEndpoint, bool, list[PortName]]] = {}
    usable: list[list[bool]] = [[False, False] for _ in service.Ports]
    # kube-proxy's conntrack rule: a UDP flow is stale once its endpoint serves nowhere, whatever
    # the policies and topology let this node use.
    serving: list[set[tuple[str, int]]] = [set() for _ in service.Ports]
    # One PortName for each port and endpoint port number, and one tuple of them for the
    # endpoints that serve the same ports (most of a service's): a 100k-service node holds
    # a million endpoints.
    port_names: dict[tuple[int, int], PortName] = {}
    overrides: dict[tuple[PortName, ...], tuple[PortName, ...]] = {}
    for decision in decisions.ports:
        p, v6, candidates = decision.port, decision.v6, decision.candidates
        port = service.Ports[p]
        if port.Protocol == "UDP":
            serving[p].update((ep.ip, number) for ep, number in candidates if ep.serving)
        usable[p][v6] = decision.categories.has_any
        for (ep, number), scopes in zip(candidates, decision.scopes, strict=True):
            if scopes is _NO_SCOPE:
                continue
            entry = grouped.get((id(ep), scopes))
            if entry is None:
                entry = grouped[(id(ep), scopes)] = (ep, v6, [])
            name = port_names.get((p, number))
            if name is None:
                name = port_names[p, number] = PortName(
                    Name=port.Name, Port=number, Protocol=port.Protocol
                )
            entry[2].append(name)

    entries = [
        (
            ep.ip,
            Endpoint(
                Hostname=ep.hostname,
                IPs=IPSet(V6=(ep.ip,)) if v6 else IPSet(V4=(ep.ip,)),
                Local=ep.node == node,
                PortOverrides=overrides.setdefault(named := tuple(ports), named),
                Scopes=scopes,
                Ready=ep.ready,
                Serving=ep.serving,
                Terminating=ep.terminating,
            ),
        )
        for (_, scopes), (ep, v6, ports) in grouped.items()
    ]
    if len({ip for ip, _ in entries}) == len(entries):
        # Each address once, the usual case: its key is the address (kpng.model.paths).
        entries.sort(key=_first)
        endpoints = tuple(endpoint for _, endpoint in entries)
    else:
        endpoints = in_key_order(endpoint for _, endpoint in entries)
    ports = tuple(
        msgspec.structs.replace(
            port,
            UsableEndpoints=_FAMILIES[(v4, v6)],
            ServingEndpoints=tuple(EndpointAddress(IP=ip, Port=n) for ip, n in sorted(addresses)),
        )
        for port, (v4, v6), addresses in zip(service.Ports, usable, serving, strict=True)
    )
    return ServiceEndpoints(
        service=msgspec.structs.replace(service, Ports=ports), endpoints=endpoints
    )


_first = operator.itemgetter(0)


def _sharing(value: ServiceEndpoints, like: ServiceEndpoints) -> ServiceEndpoints:
    """``value``, its service and endpoints the objects of ``like`` where they are equal."""
    known = {endpoint: endpoint for endpoint in like.endpoints}
    return ServiceEndpoints(
        service=like.service if like.service == value.service else value.service,
        endpoints=tuple(known.get(endpoint, endpoint) for endpoint in value.endpoints),
    )


class Changes(msgspec.Struct, frozen=True):
    """What one ``resolve`` changed in a node-local state."""

    updated: Mapping[ServiceKey, ServiceEndpoints]
    deleted: frozenset[ServiceKey]
    previous: Mapping[ServiceKey, ServiceEndpoints] = {}
    """The values the updated and deleted services had before (absent for new services)."""

    def __bool__(self) -> bool:
        return bool(self.updated or self.deleted)


# The change log is trimmed as views read it; past this many entries (or twice the number of
# services) views that lag behind are switched to a full re-read.
_MIN_LOG = 4096

# A node name no endpoint can have (Kubernetes names are DNS labels): resolving for it gives the
# view of every node that hosts none of a service's endpoints and is named by none of its hints.
_ELSEWHERE = "\x00"


class _ServiceResults:
    """One service's resolutions, shared by every node that sees it the same way."""

    __slots__ = ("node_relevant", "results", "zone_relevant")

    def __init__(self, slices: Iterable[Slice]) -> None:
        endpoints = [ep for sl in slices for ep in sl.endpoints]
        nodes = {ep.node for ep in endpoints}
        for ep in endpoints:
            if ep.node_hints:
                nodes.update(ep.node_hints)
        self.node_relevant = frozenset(nodes)
        self.zone_relevant = any(ep.zone_hints for ep in endpoints)
        self.results: dict[tuple[str, str], ServiceEndpoints] = {}

    def class_of(self, node: str, zone: str) -> tuple[str, str]:
        """Nodes of one class see the service identically: resolve_service reads the node name
        only to compare it with endpoints' nodes and node hints, and the zone only through zone
        hints."""
        return (
            node if node in self.node_relevant else _ELSEWHERE,
            zone if self.zone_relevant else "",
        )


class ClusterResolver:
    """The brain for any number of nodes: one index of the cluster, results shared by nodes.

    Feed it with ``set_service``, ``set_slice`` and ``set_node`` (None deletes). Each node's state
    is a ``NodeView``; ``NodeView.resolve`` recomputes only the services changed since its last
    call. Resolutions are cached per service and per class of nodes that see it alike (those
    hosting none of its endpoints share one), so a thousand nodes cost a handful of resolutions
    per changed service, not a thousand.
    """

    def __init__(self, *, shared: bool = True) -> None:
        """``shared``: views may read their zone's base (False: each holds its whole state, and
        the index that shared views start from is not kept: a node's own resolver has one
        view, and would hold an entry for every node of the cluster)."""
        self._shared = shared
        self._services: dict[ServiceKey, Service] = {}
        self._slices: dict[SliceKey, Slice] = {}
        self._slices_by_service: dict[ServiceKey, dict[SliceKey, Slice]] = {}
        self._zones: dict[str, str] = {}
        self._results: dict[ServiceKey, _ServiceResults] = {}
        # Changed service keys, read by each view from its own position on.
        self._log: list[ServiceKey] = []
        self._log_start = 0
        self._views: set[NodeView] = set()
        # Per zone, the services as every view of the zone sees those it is not relevant to
        # (it hosts none of their endpoints, no hint names it), shared by those views: each
        # view holds only the services it sees otherwise (NodeView).
        self._bases: dict[str, dict[ServiceKey, ServiceEndpoints]] = {}
        self._zone_views: dict[str, set[NodeView]] = {}
        # Zones whose base is complete (a value for every service the zone's nodes share:
        # ``_current_base``), with the services changed since it was last brought up to date.
        self._base_stale: dict[str, set[ServiceKey]] = {}
        # Per node name, the services it is relevant to (it hosts one of their endpoints or a
        # hint names it), with how many endpoints and hints say so: the services a new view
        # resolves for itself, all others being its zone's base (``NodeView._resolve_first``).
        self._node_services: dict[str, dict[ServiceKey, int]] = {}
        self.on_change: list[Callable[[ServiceKey], None]] = []
        """Called with each service key whose resolutions are dropped (changed or deleted):
        caches of values resolved before go stale then."""
        self.on_base_change: list[Callable[[str, ServiceKey | None], None]] = []
        """Called with a zone and a service key whose value in the zone's base changed (None:
        the zone's base is dropped): what caches of a base's values (its digests) follow."""
        # Views still at the log's start: only when the last of them moves on can the log be
        # trimmed, so each read costs O(1) and not a pass over every view (5,000 watchers of
        # one change would otherwise cost 25 million steps).
        self._at_start = 0

    @property
    def services(self) -> Mapping[ServiceKey, Service]:
        return self._services

    def zone(self, node: str) -> str:
        return self._zones.get(node, "")

    def _changed(self, key: ServiceKey) -> None:
        self._results.pop(key, None)
        for zone, stale in list(self._base_stale.items()):
            stale.add(key)
            if len(stale) > max(_MIN_LOG, 2 * len(self._services)):
                # Services made and deleted by the thousand while no view came to the zone: a
                # complete pass at its next view costs less than keeping their names.
                del self._base_stale[zone]
        for listener in self.on_change:
            listener(key)
        if self._views:
            self._log.append(key)
            if len(self._log) > max(_MIN_LOG, 2 * len(self._services)):
                self._catch_up_laggards()

    def _catch_up_laggards(self) -> None:
        """Views that have not read the older half of the log re-read every service instead.

        This bounds the log by the cluster's size, whatever a slow watcher does, at the price
        of a full pass for that watcher only (which its next resolve would need anyway).
        """
        end = self._log_start + len(self._log)
        middle = self._log_start + len(self._log) // 2
        for view in self._views:
            if view._position < middle:
                view._everything_dirty = True
                view._position = end
        self._trim_log()

    def set_service(self, key: ServiceKey, service: Service | None) -> None:
        if service is None:
            if self._services.pop(key, None) is None:
                return
        else:
            self._services[key] = service
        self._changed(key)

    def set_slice(self, key: SliceKey, sl: Slice | None) -> None:
        old = self._slices.pop(key, None)
        if old is not None:
            self._index_nodes(old, -1)
            siblings = self._slices_by_service[old.service_key]
            del siblings[key]
            if not siblings:
                del self._slices_by_service[old.service_key]
            self._changed(old.service_key)
        if sl is not None:
            self._index_nodes(sl, 1)
            self._slices[key] = sl
            self._slices_by_service.setdefault(sl.service_key, {})[key] = sl
            if old is None or old.service_key != sl.service_key:
                self._changed(sl.service_key)

    def _index_nodes(self, sl: Slice, step: int) -> None:
        """Count (``step`` 1) or uncount (-1) the node names ``sl`` makes its service relevant
        to, as ``_ServiceResults.node_relevant`` reads them."""
        if not self._shared:
            return
        key = sl.service_key
        for ep in sl.endpoints:
            self._count_node(ep.node, key, step)
            for hinted in ep.node_hints:
                self._count_node(hinted, key, step)

    def _count_node(self, node: str, key: ServiceKey, step: int) -> None:
        services = self._node_services.setdefault(node, {})
        count = services.get(key, 0) + step
        if count:
            services[key] = count
        else:
            del services[key]
            if not services:
                del self._node_services[node]

    def relevant_services(self, node: str) -> Iterable[ServiceKey]:
        """The services ``node`` may see otherwise than its zone's other nodes: those with an
        endpoint on it or a hint naming it (some may have no Service)."""
        return self._node_services.get(node, {}).keys()

    def set_node(self, name: str, node: Node | None) -> None:
        """A node's object: its zone drives topology-aware routing for that node."""
        zone = node_zone(node)
        if zone == self._zones.get(name, ""):
            return
        if node is None or not zone:
            self._zones.pop(name, None)
        else:
            self._zones[name] = zone
        for view in self._views:
            if view.node_name == name:
                view._everything_dirty = True

    def resolve(self, key: ServiceKey, node: str) -> ServiceEndpoints | None:
        """Service ``key`` as ``node`` sees it, None if there is no such service."""
        return self._resolve_classed(key, node)[0]

    def _resolve_classed(self, key: ServiceKey, node: str) -> tuple[ServiceEndpoints | None, bool]:
        """``resolve``, and whether the result is the one every node of ``node``'s zone that is
        not relevant to the service shares (its zone's base holds it); a deletion is shared."""
        resolved, cls = self._resolve_for(key, node, self._zones.get(node, ""))
        return resolved, cls[0] == _ELSEWHERE

    def _resolve_shared(self, key: ServiceKey, zone: str) -> ServiceEndpoints | None:
        """Service ``key`` as every node of ``zone`` sees it that it is not relevant to: the
        value of the zone's base."""
        return self._resolve_for(key, _ELSEWHERE, zone)[0]

    def _resolve_for(
        self, key: ServiceKey, node: str, zone: str
    ) -> tuple[ServiceEndpoints | None, tuple[str, str]]:
        """Service ``key`` as node ``node`` of ``zone`` sees it, and that node's class."""
        service = self._services.get(key)
        if service is None:
            return None, (_ELSEWHERE, "")
        slices = self._slices_by_service.get(key, {}).values()
        results = self._results.get(key)
        if results is None:
            results = self._results[key] = _ServiceResults(slices)
        cls = results.class_of(node, zone)
        resolved = results.results.get(cls)
        if resolved is None:
            resolved = resolve_service(service, slices, node=cls[0], zone=cls[1])
            like = results.results.get((_ELSEWHERE, cls[1])) if cls[0] != _ELSEWHERE else None
            if like is not None:
                # A node's own resolution differs from its zone's shared one in a few endpoints
                # (those it hosts, those hinted to it): it keeps the shared objects of the rest,
                # a few kB less for each of some 20 services per node, times 5,000 nodes.
                resolved = _sharing(resolved, like)
            results.results[cls] = resolved
        return resolved, cls

    def view(self, node_name: str, *, shared: bool = True) -> NodeView:
        """A new node-local state; its first ``resolve`` yields every service. ``shared``: its
        state reads its zone's base (False: a whole dict of its own, faster to read)."""
        if shared and not self._shared:
            raise ValueError("a ClusterResolver made with shared=False has no shared views")
        view = NodeView(self, node_name, self._log_start + len(self._log), shared=shared)
        self._views.add(view)
        if view._position == self._log_start:
            self._at_start += 1
        return view

    def _read_log(self, view: NodeView) -> list[ServiceKey]:
        old = view._position
        keys = self._log[old - self._log_start :]
        view._position = self._log_start + len(self._log)
        if old == self._log_start and view._position != old:
            self._left_start()
        return keys

    def _left_start(self) -> None:
        self._at_start -= 1
        if self._at_start <= 0:
            self._trim_log()

    def _trim_log(self) -> None:
        done = min((v._position for v in self._views), default=self._log_start + len(self._log))
        if done > self._log_start:
            del self._log[: done - self._log_start]
            self._log_start = done
        self._at_start = sum(1 for v in self._views if v._position == self._log_start)

    def _close(self, view: NodeView) -> None:
        if view in self._views:
            self._views.discard(view)
            if view._position == self._log_start:
                self._left_start()
        view._leave()

    # --- zone bases: the state most views of a zone share

    def _base_of(self, zone: str, view: NodeView) -> dict[ServiceKey, ServiceEndpoints]:
        """Zone ``zone``'s base, ``view`` now one of the views reading it."""
        self._zone_views.setdefault(zone, set()).add(view)
        return self._bases.setdefault(zone, {})

    def _leave_base(self, zone: str, view: NodeView) -> None:
        views = self._zone_views.get(zone)
        if views is not None:
            views.discard(view)
            if not views:  # the last view of the zone: its base goes with it
                del self._zone_views[zone]
                self._bases.pop(zone, None)
                self._base_stale.pop(zone, None)
                for listener in self.on_base_change:
                    listener(zone, None)

    def _current_base(self, zone: str, view: NodeView) -> dict[ServiceKey, ServiceEndpoints]:
        """Zone ``zone``'s base, complete and up to date: the value of every service as the
        zone's nodes that it is not relevant to see it; ``view`` now one of those reading it.

        Made complete once per zone (a pass over every service), then kept so by re-resolving
        only the services changed since (a lookup each when the zone's views resolved them
        already): a new view of the zone then costs only the services it is relevant to.
        """
        base = self._base_of(zone, view)
        stale = self._base_stale.get(zone)
        if stale is None:
            keys: Iterable[ServiceKey] = [
                *self._services,
                *(k for k in base if k not in self._services),
            ]
        else:
            keys = stale
        for key in keys:
            self._set_base(zone, key, self._resolve_shared(key, zone), view)
        self._base_stale[zone] = set()
        return base

    def _set_base(
        self, zone: str, key: ServiceKey, value: ServiceEndpoints | None, writer: NodeView
    ) -> None:
        """Zone ``zone``'s base now has ``value`` for ``key`` (None: none), for ``writer``.

        A view's state changes only in its own ``resolve``: every other view of the zone that
        reads this key from the base keeps the value it had, in its overlay, until its next
        ``resolve`` compares it with the new one (and drops it). One pass over the zone's views
        per service and change, for the first view of the zone to resolve it.
        """
        base = self._bases[zone]
        old = base.get(key)
        if old is value:
            return
        for view in self._zone_views[zone]:
            overlay = view._overlay
            if view is not writer and key not in overlay:
                overlay[key] = old
        if value is None:
            del base[key]
        else:
            base[key] = value
        for listener in self.on_base_change:
            listener(zone, key)


# A never-mutated empty base: that of views reading no zone's base.
_NO_BASE: dict[ServiceKey, ServiceEndpoints] = {}


class NodeView:
    """One node's local state inside a ClusterResolver, updated by ``resolve``.

    Most nodes see most services as every node of their zone does that hosts none of the
    service's endpoints and is named by none of its hints: that resolution sits once in the
    zone's base (``ClusterResolver._bases``), shared by the zone's views. A view holds only its
    overlay: the services it sees otherwise (None: a service its state lacks), and the values
    it still had when another view moved the base on (``ClusterResolver._set_base``). Its
    state is the overlay over the base. 5,000 views of 10,000 services cost a few base dicts
    and small overlays instead of 5,000 dicts of 10,000 entries.

    A view not reading a base (``shared`` False, or before its first ``resolve``) holds its
    whole state in its overlay, a plain dict.
    """

    def __init__(
        self, cluster: ClusterResolver, node_name: str, position: int, *, shared: bool = True
    ) -> None:
        self.node_name = node_name
        self._cluster = cluster
        self._position = position
        self._everything_dirty = True
        self._shared = shared
        self._zone: str | None = None
        """The zone whose base this view reads; None: none (its overlay is its whole state)."""
        self._base = _NO_BASE
        self._overlay: dict[ServiceKey, ServiceEndpoints | None] = {}

    @property
    def state(self) -> Mapping[ServiceKey, ServiceEndpoints]:
        """The node-local state, by service key (read-only, live: resolve() updates it)."""
        if self._zone is None:
            return self._overlay  # type: ignore[return-value]  # no None: nothing to hide
        return _Layered(self)

    def resolve(self) -> Changes:
        """Bring the state up to date; return what changed since the previous call."""
        cluster = self._cluster
        if self._everything_dirty and self._shared and self._zone is None and not self._overlay:
            return self._resolve_first()
        if self._everything_dirty:
            self._everything_dirty = False
            cluster._read_log(self)
            if self._zone is not None and self._zone != cluster.zone(self.node_name):
                self._detach()  # a new zone: re-read whole, then onto that zone's base
            keys: Iterable[ServiceKey] = set(cluster.services) | set(self.state)
        else:
            keys = set(cluster._read_log(self))
        if self._zone is None:
            changes = self._resolve_whole(keys)
        else:
            changes = self._resolve_layered(keys, self._zone)
        if self._zone is not None and len(self._overlay) < sys.getsizeof(self._overlay) // 256:
            # Emptied since it grew (pins, or a first state): a table of its size again.
            self._overlay = dict(self._overlay)
        return changes

    def _resolve_first(self) -> Changes:
        """The first ``resolve`` of a shared view: its zone's base, made up to date, and the
        services it is relevant to (``ClusterResolver.relevant_services``) resolved for it. So
        a new watcher of 10,000 services costs some 20 resolutions and a copy of the base,
        not 10,000 resolutions (a fleet's fail-over opens 5,000 at once)."""
        cluster = self._cluster
        node = self.node_name
        self._everything_dirty = False
        cluster._read_log(self)
        zone = cluster.zone(node)
        base = cluster._current_base(zone, self)
        overlay: dict[ServiceKey, ServiceEndpoints | None] = {}
        for key in cluster.relevant_services(node):
            resolved, shared = cluster._resolve_classed(key, node)
            if resolved is not None and not shared:
                overlay[key] = resolved
        self._zone, self._base, self._overlay = zone, base, overlay
        updated = dict(base)
        updated.update(overlay)  # type: ignore[arg-type]  # no None: made just above
        return Changes(updated=updated, deleted=frozenset())

    def layers(
        self,
    ) -> tuple[
        Mapping[ServiceKey, ServiceEndpoints],
        str | None,
        Mapping[ServiceKey, ServiceEndpoints | None],
    ]:
        """The state as its zone's base, that zone (None: no base, the overlay is the whole
        state) and the view's overlay over it (None: a service the state lacks). Read-only, and
        live: the base moves as other views of the zone resolve (the overlay then keeps the
        values this view still has)."""
        return self._base, self._zone, self._overlay

    def _resolve_whole(self, keys: Iterable[ServiceKey]) -> Changes:
        """``resolve`` of a state held whole in the overlay; onto the zone's base after, if
        shared."""
        cluster = self._cluster
        node = self.node_name
        state = self._overlay
        updated: dict[ServiceKey, ServiceEndpoints] = {}
        deleted: set[ServiceKey] = set()
        previous: dict[ServiceKey, ServiceEndpoints] = {}
        shared_keys: set[ServiceKey] = set()
        for key in keys:
            resolved, shared = cluster._resolve_classed(key, node)
            old = state.get(key)
            if resolved is None:
                if old is not None:
                    del state[key]
                    deleted.add(key)
                    previous[key] = old
                continue
            if old is not resolved and old != resolved:
                state[key] = resolved
                updated[key] = resolved
                if old is not None:
                    previous[key] = old
            if shared and self._shared:
                shared_keys.add(key)
        if self._shared:
            self._attach(shared_keys, updated)
        return Changes(updated=updated, deleted=frozenset(deleted), previous=previous)

    def _resolve_layered(self, keys: Iterable[ServiceKey], zone: str) -> Changes:
        """``resolve`` of a state read over the zone's base: the shared values go to the base
        (moving it on for every view of the zone, ``ClusterResolver._set_base``), the others
        to the overlay."""
        cluster = self._cluster
        node = self.node_name
        overlay = self._overlay
        base = self._base
        updated: dict[ServiceKey, ServiceEndpoints] = {}
        deleted: set[ServiceKey] = set()
        previous: dict[ServiceKey, ServiceEndpoints] = {}
        for key in keys:
            resolved, shared = cluster._resolve_classed(key, node)
            old = overlay.get(key, base.get(key))
            if resolved is None:
                if old is not None:
                    deleted.add(key)
                    previous[key] = old
                if key in base:
                    cluster._set_base(zone, key, None, self)
                overlay.pop(key, None)
            elif old is not resolved and old != resolved:
                if old is not None:
                    previous[key] = old
                if shared:
                    resolved = self._share(key, resolved, zone)
                else:
                    overlay[key] = resolved
                updated[key] = resolved
            elif shared and key in overlay:
                self._share(key, resolved, zone)  # an equal value: the shared one instead
        return Changes(updated=updated, deleted=frozenset(deleted), previous=previous)

    def _share(self, key: ServiceKey, value: ServiceEndpoints, zone: str) -> ServiceEndpoints:
        """Read ``key`` from the zone's base, which gets ``value`` unless it has an equal one;
        the value the state now has."""
        current = self._base.get(key)
        if current is not value:
            if current is not None and current == value:
                value = current
            else:
                self._cluster._set_base(zone, key, value, self)
        self._overlay.pop(key, None)
        return value

    def _attach(
        self, shared_keys: set[ServiceKey], updated: dict[ServiceKey, ServiceEndpoints]
    ) -> None:
        """From a whole state of its own onto its zone's base, the state the same: the base
        takes (for every view of the zone) the shared values it lacks or has older. Where the
        base has an equal value the state takes it, in ``updated`` too."""
        cluster = self._cluster
        zone = cluster.zone(self.node_name)
        state = self._overlay
        base = cluster._base_of(zone, self)
        self._zone, self._base, self._overlay = zone, base, {}
        for key in [key for key in base if key not in state]:
            cluster._set_base(zone, key, None, self)  # deleted since the base had it
        for key, value in state.items():
            if value is None:  # not in a whole state
                continue
            if key in shared_keys:
                if (now := self._share(key, value, zone)) is not value and key in updated:
                    updated[key] = now
            elif base.get(key) is not value:
                self._overlay[key] = value

    def _detach(self) -> None:
        """Off its zone's base, to a whole state of its own."""
        if self._zone is not None:
            self._overlay = dict(self.state.items())
            self._leave()

    def _leave(self) -> None:
        if self._zone is not None:
            self._cluster._leave_base(self._zone, self)
            self._zone, self._base = None, _NO_BASE

    def close(self) -> None:
        self._cluster._close(self)


class _Layered(Mapping[ServiceKey, ServiceEndpoints]):
    """A view's state: its overlay over its zone's base. Live, as a dict would be."""

    __slots__ = ("_view",)

    def __init__(self, view: NodeView) -> None:
        self._view = view

    def __getitem__(self, key: ServiceKey) -> ServiceEndpoints:
        view = self._view
        value = view._overlay.get(key, view._base.get(key))
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        view = self._view
        return view._overlay.get(key, view._base.get(key)) is not None  # type: ignore[call-overload]

    def __iter__(self) -> Iterator[ServiceKey]:
        overlay, base = self._view._overlay, self._view._base
        for key in base:
            if key not in overlay:
                yield key
        for key, value in overlay.items():
            if value is not None:
                yield key

    def __len__(self) -> int:
        overlay, base = self._view._overlay, self._view._base
        size = len(base)
        for key, value in overlay.items():
            if key in base:
                size -= value is None
            else:
                size += value is not None
        return size


class NodeResolver:
    """The node-local state of one node, kept up to date from global-model changes.

    Feed it with ``set_service``, ``set_slice`` and ``set_node`` (None deletes; other nodes'
    objects are ignored), then call ``resolve``: it recomputes exactly the services those calls
    touched and returns what changed.
    """

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._cluster = ClusterResolver(shared=False)
        self._view = self._cluster.view(node_name, shared=False)  # one view: nothing to share

    @property
    def state(self) -> Mapping[ServiceKey, ServiceEndpoints]:
        return self._view.state

    def set_service(self, key: ServiceKey, service: Service | None) -> None:
        self._cluster.set_service(key, service)

    def set_slice(self, key: SliceKey, sl: Slice | None) -> None:
        self._cluster.set_slice(key, sl)

    def set_node(self, node: Node | None) -> None:
        if node is None or node.Name == self.node_name:
            self._cluster.set_node(self.node_name, node)

    def resolve(self) -> Changes:
        return self._view.resolve()
