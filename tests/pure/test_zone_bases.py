"""A new node view starts from its zone's base and resolves only the services its node is
relevant to; its digests start from the base's (issue 42, the brain's CPU per resume). Both
must give exactly what a walk over every service gives."""

from __future__ import annotations

import random

import msgspec
import pytest

from kpng.model.cluster import ServiceKey, Slice, SliceEndpoint, SlicePort
from kpng.model.messages import (
    IPSet,
    Node,
    PortMapping,
    Service,
    ServiceEndpoints,
    ServiceIPs,
    TopologyInfo,
)
from kpng.resolver.resolving import ClusterResolver, NodeResolver, NodeView, resolve_service
from kpng.server.resuming import BaseDigests, ServiceDigests, StateDigests

ZONES = {"n0": "a", "n1": "a", "n2": "a", "n3": "b", "n4": "b", "nz": ""}
"""Node names and their zones; ``ghost`` has no Node object (no zone) either."""
NODES = [*ZONES, "ghost"]


def _service(
    name: str,
    *,
    kind: str = "ClusterIP",
    InternalTrafficToLocal: bool = False,
    ExternalTrafficToLocal: bool = False,
) -> Service:
    return Service(
        Namespace="ns",
        Name=name,
        Type=kind,
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=(f"10.96.0.{len(name)}",))),
        Ports=(
            PortMapping(
                Name="http",
                Protocol="TCP",
                Port=80,
                TargetPort=8080,
                NodePort=30080 if kind == "NodePort" else 0,
            ),
        ),
        InternalTrafficToLocal=InternalTrafficToLocal,
        ExternalTrafficToLocal=ExternalTrafficToLocal,
    )


def _slice(service: str, *endpoints: SliceEndpoint, suffix: str = "1") -> Slice:
    return Slice(
        namespace="ns",
        name=f"{service}-{suffix}",
        service=service,
        v6=False,
        ports=(SlicePort(name="http", protocol="TCP", port=8080),),
        endpoints=endpoints,
    )


def _ep(
    ip: str, node: str, *, zone_hints: tuple[str, ...] = (), node_hints: tuple[str, ...] = ()
) -> SliceEndpoint:
    return SliceEndpoint(
        ip=ip, node=node, zone=ZONES.get(node, ""), zone_hints=zone_hints, node_hints=node_hints
    )


SPREAD = (_ep("10.1.0.1", "n0"), _ep("10.1.0.2", "n3"))

KINDS: dict[str, tuple[Service | None, tuple[Slice, ...]]] = {
    "plain": (_service("plain"), (_slice("plain", *SPREAD),)),
    "no-endpoints": (_service("empty"), ()),
    "internal-local": (
        _service("itp", InternalTrafficToLocal=True),
        (_slice("itp", *SPREAD),),
    ),
    "external-local": (
        _service("etp", kind="NodePort", ExternalTrafficToLocal=True),
        (_slice("etp", *SPREAD),),
    ),
    "zone-hints": (
        _service("zoned"),
        (
            _slice(
                "zoned",
                _ep("10.2.0.1", "n0", zone_hints=("a",)),
                _ep("10.2.0.2", "n3", zone_hints=("b",)),
            ),
        ),
    ),
    "node-hints": (
        _service("hinted"),
        (
            _slice(
                "hinted",
                _ep("10.3.0.1", "n0", zone_hints=("a",), node_hints=("n2",)),
                _ep("10.3.0.2", "n3", zone_hints=("b",), node_hints=("n4",)),
            ),
        ),
    ),
    "two-slices": (
        _service("split"),
        (_slice("split", SPREAD[0]), _slice("split", SPREAD[1], suffix="2")),
    ),
    "slices-without-service": (None, (_slice("orphan", *SPREAD),)),
}


def _cluster(kinds: list[str]) -> tuple[ClusterResolver, dict[ServiceKey, Service]]:
    cluster = ClusterResolver()
    for name, zone in ZONES.items():
        if zone:
            cluster.set_node(name, Node(Name=name, Topology=TopologyInfo(Node=name, Zone=zone)))
    services: dict[ServiceKey, Service] = {}
    for kind in kinds:
        service, slices = KINDS[kind]
        for sl in slices:
            cluster.set_slice((sl.namespace, sl.name), sl)
        if service is not None:
            services[(service.Namespace, service.Name)] = service
            cluster.set_service((service.Namespace, service.Name), service)
    return cluster, services


def _walked(
    cluster: ClusterResolver, node: str, zone: str | None = None
) -> dict[ServiceKey, ServiceEndpoints]:
    """The node's state as a walk over every service resolves it, with no class or base."""
    zone = cluster.zone(node) if zone is None else zone
    return {
        key: resolve_service(
            service,
            [sl for sl in cluster._slices.values() if sl.service_key == key],
            node=node,
            zone=zone,
        )
        for key, service in cluster.services.items()
    }


# (kind, node, whether the node resolves it for itself: else its zone's base gives it)
PATHS = [
    ("plain", "n0", True),  # hosts an endpoint: Local on it
    ("plain", "n1", False),
    ("plain", "n3", True),
    ("plain", "nz", False),
    ("plain", "ghost", False),
    ("no-endpoints", "n0", False),
    ("internal-local", "n0", True),
    ("internal-local", "n2", False),  # no local endpoint: the zone's (none)
    ("external-local", "n3", True),
    ("external-local", "n4", False),
    ("zone-hints", "n0", True),
    ("zone-hints", "n1", False),  # hinted to its zone, as every node of zone a
    ("zone-hints", "n4", False),
    ("node-hints", "n2", True),  # named by a node hint
    ("node-hints", "n1", False),
    ("node-hints", "n4", True),
    ("two-slices", "n3", True),
    ("two-slices", "n2", False),
]


@pytest.mark.parametrize("warm", [False, True], ids=["first-of-zone", "zone-warm"])
@pytest.mark.parametrize(("kind", "node", "own"), PATHS)
def test_a_new_view_from_its_zone_s_base_sees_what_a_walk_over_every_service_sees(
    kind: str, node: str, own: bool, warm: bool
) -> None:
    cluster, _ = _cluster(["plain", kind, "slices-without-service"])
    others = [cluster.view(n) for n in NODES if n != node] if warm else []
    for other in others:
        other.resolve()
    view = cluster.view(node)
    changes = view.resolve()
    want = _walked(cluster, node)
    assert dict(view.state) == want
    assert dict(changes.updated) == want
    assert not changes.deleted
    base, zone, overlay = view.layers()
    assert zone == cluster.zone(node)
    key = ("ns", KINDS[kind][0].Name)  # type: ignore[union-attr]  # every kind here has one
    assert (key in overlay) is own
    # The base: every service as a node of the zone that hosts none of it sees it.
    assert dict(base) == _walked(cluster, "elsewhere", zone)
    # Every other view still sees its own walk: the base moved under none of them.
    for other in others:
        assert dict(other.state) == _walked(cluster, other.node_name)


class _Counting(ClusterResolver):
    def __init__(self) -> None:
        super().__init__()
        self.resolved: list[ServiceKey] = []

    def _resolve_classed(self, key: ServiceKey, node: str) -> tuple[ServiceEndpoints | None, bool]:
        self.resolved.append(key)
        return super()._resolve_classed(key, node)


def test_a_new_view_of_a_warm_zone_resolves_only_the_services_its_node_is_relevant_to() -> None:
    cluster = _Counting()
    cluster.set_node("n0", Node(Name="n0", Topology=TopologyInfo(Node="n0", Zone="a")))
    cluster.set_node("n1", Node(Name="n1", Topology=TopologyInfo(Node="n1", Zone="a")))
    for i in range(200):
        service = _service(f"s{i}")
        cluster.set_service(("ns", service.Name), service)
        node = "n0" if i < 3 else "n9"
        cluster.set_slice((("ns", f"s{i}-1")), _slice(service.Name, _ep(f"10.9.{i}.1", node)))
    cluster.view("n1").resolve()
    cluster.resolved.clear()
    view = cluster.view("n0")
    assert len(view.resolve().updated) == 200
    assert sorted(cluster.resolved) == [("ns", "s0"), ("ns", "s1"), ("ns", "s2")]
    assert dict(view.state) == _walked(cluster, "n0")


def _encode(value: msgspec.Struct) -> bytes:
    return msgspec.json.encode(value)


def _digests(cluster: ClusterResolver) -> tuple[ServiceDigests, BaseDigests]:
    memo = ServiceDigests(_encode, _encode)
    bases = BaseDigests(memo)
    cluster.on_base_change.append(bases.changed)
    cluster.on_change.append(memo.forget)
    return memo, bases


def _node_digests(bases: BaseDigests, view: NodeView) -> StateDigests:
    base, zone, overlay = view.layers()
    return bases.of(base=base, zone=zone, overlay=overlay, facts=b"f" * 16)


@pytest.mark.parametrize("node", NODES)
def test_a_node_digest_from_its_zone_s_equals_the_digest_of_its_whole_state(node: str) -> None:
    cluster, _ = _cluster(list(KINDS))
    memo, bases = _digests(cluster)
    views = [cluster.view(n) for n in NODES]
    for view in views:
        view.resolve()
    view = views[NODES.index(node)]
    whole = StateDigests.of(dict(view.state), digest=memo, facts=b"f" * 16)
    assert _node_digests(bases, view) == whole


def _random_service(rng: random.Random, i: int) -> Service:
    return _service(
        f"s{i}",
        kind=rng.choice(["ClusterIP", "NodePort"]),
        InternalTrafficToLocal=rng.random() < 0.2,
        ExternalTrafficToLocal=rng.random() < 0.2,
    )


def _random_slice(rng: random.Random, i: int) -> Slice:
    endpoints = []
    for e in range(rng.randrange(4)):
        node = rng.choice(NODES)
        hinted = rng.random() < 0.3
        endpoints.append(
            SliceEndpoint(
                ip=f"10.{i}.0.{rng.choice([e, 9])}",
                node=node,
                zone_hints=(rng.choice("ab"),) if hinted else (),
                node_hints=(rng.choice(NODES),) if hinted and rng.random() < 0.5 else (),
                ready=rng.random() < 0.8,
            )
        )
    return _slice(f"s{i}", *endpoints, suffix=str(rng.randrange(2)))


def _apply(brain: ClusterResolver, change: tuple[str, object, object]) -> None:
    what, key, value = change
    if what == "service":
        brain.set_service(key, value)  # type: ignore[arg-type]
    elif what == "slice":
        brain.set_slice(key, value)  # type: ignore[arg-type]
    else:
        brain.set_node(key, value)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(10))
def test_views_and_digests_from_zone_bases_match_a_walk_through_random_changes(
    seed: int,
) -> None:
    """Random changes, views coming, resolving and going: every view's state is its own walk
    as of its last resolve, and its digest from the zone's equals the digest of that state;
    two brains fed the same objects in another order, their views made in another order,
    give the same digests."""
    rng = random.Random(seed)
    brains = [ClusterResolver(), ClusterResolver()]
    digests = [_digests(brain) for brain in brains]
    views: list[list[NodeView]] = [[], []]
    seen: list[dict[ServiceKey, ServiceEndpoints]] = []
    for _step in range(200):
        action = rng.random()
        i = rng.randrange(10)
        change: tuple[str, object, object] | None = None
        if action < 0.2:
            service = _random_service(rng, i) if rng.random() < 0.85 else None
            change = ("service", ("ns", f"s{i}"), service)
        elif action < 0.5:
            sl = _random_slice(rng, i)
            change = ("slice", (sl.namespace, sl.name), sl if rng.random() < 0.85 else None)
        elif action < 0.55:
            node = rng.choice(NODES)
            zone = rng.choice("abc")
            obj = Node(Name=node, Topology=TopologyInfo(Node=node, Zone=zone))
            change = ("node", node, obj if zone != "c" else None)
        elif action < 0.65 and views[0]:
            w = rng.randrange(len(views[0]))
            for brain_views in views:
                brain_views.pop(w).close()
            seen.pop(w)
        elif action < 0.8 and len(views[0]) < 6:
            node = rng.choice(NODES)
            for brain, brain_views in zip(brains, views, strict=True):
                brain_views.insert(0, view := brain.view(node))
                view.resolve()
            seen.insert(0, _walked(brains[0], node))
        elif views[0]:
            w = rng.randrange(len(views[0]))
            for brain_views in views:
                brain_views[w].resolve()
            seen[w] = _walked(brains[0], views[0][w].node_name)
        if change is not None:
            for brain in brains if rng.random() < 0.5 else reversed(brains):
                _apply(brain, change)
        for w, state in enumerate(seen):
            node_digests = []
            for brain_views, (memo, bases) in zip(views, digests, strict=True):
                view = brain_views[w]
                assert dict(view.state) == state
                whole = StateDigests.of(state, digest=memo, facts=b"f" * 16)
                got = _node_digests(bases, view)
                assert got == whole
                node_digests.append(got.node)
            assert node_digests[0] == node_digests[1]
    for brain_views in views:
        for view in brain_views:
            view.close()
    for brain in brains:
        assert brain._bases == {}
        assert brain._base_stale == {}


def test_a_node_s_own_resolver_keeps_no_index_of_the_cluster_s_nodes() -> None:
    """It has one view, never shared: an entry per node and service would be memory for
    nothing, on every node."""
    resolver = NodeResolver("n0")
    for kind in KINDS:
        for sl in KINDS[kind][1]:
            resolver.set_slice((sl.namespace, sl.name), sl)
    assert resolver._cluster._node_services == {}
    cluster, _ = _cluster(["plain"])
    assert set(cluster.relevant_services("n0")) == {("ns", "plain")}
