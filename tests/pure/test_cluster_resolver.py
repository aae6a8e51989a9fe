"""One cluster resolver, many node views: results shared by nodes that see a service alike."""

from __future__ import annotations

import random

import pytest

from kpng.model.cluster import Slice, SliceEndpoint, SlicePort
from kpng.model.messages import IPSet, Node, PortMapping, Service, ServiceIPs, TopologyInfo
from kpng.resolver import resolving
from kpng.resolver.resolving import ClusterResolver

KEY = ("ns", "web")


def _service(port: int = 80) -> Service:
    return Service(
        Namespace="ns",
        Name="web",
        Type="ClusterIP",
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=("10.96.0.1",))),
        Ports=(PortMapping(Name="http", Protocol="TCP", Port=port, TargetPort=8080),),
    )


def _slice(*endpoints: SliceEndpoint) -> Slice:
    return Slice(
        namespace="ns",
        name="web-1",
        service="web",
        v6=False,
        ports=(SlicePort(name="http", protocol="TCP", port=8080),),
        endpoints=endpoints,
    )


def _node(name: str, zone: str) -> Node:
    return Node(Name=name, Topology=TopologyInfo(Node=name, Zone=zone))


def _cluster(*endpoints: SliceEndpoint) -> ClusterResolver:
    cluster = ClusterResolver()
    for i in range(6):
        cluster.set_node(f"n{i}", _node(f"n{i}", "a" if i < 3 else "b"))
    cluster.set_service(KEY, _service())
    cluster.set_slice(("ns", "web-1"), _slice(*endpoints))
    return cluster


def test_nodes_without_endpoints_share_one_result(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    real = resolving.resolve_service

    def counting(service: Service, slices: object, *, node: str, zone: str) -> object:
        calls.append((node, zone))
        return real(service, slices, node=node, zone=zone)  # type: ignore[arg-type]

    monkeypatch.setattr(resolving, "resolve_service", counting)
    cluster = _cluster(
        SliceEndpoint(ip="10.0.0.1", node="n0"), SliceEndpoint(ip="10.0.0.2", node="n1")
    )
    views = {f"n{i}": cluster.view(f"n{i}") for i in range(6)}
    for view in views.values():
        view.resolve()
    # n0 and n1 host endpoints; n2..n5 see the service identically (no zone hints in play)
    assert len(calls) == 3
    assert views["n2"].state[KEY] is views["n5"].state[KEY]
    assert views["n0"].state[KEY] != views["n1"].state[KEY]  # Local differs


def test_a_node_s_own_result_shares_the_endpoints_it_sees_as_other_nodes_do() -> None:
    cluster = _cluster(
        SliceEndpoint(ip="10.0.0.1", node="n0"), SliceEndpoint(ip="10.0.0.2", node="n1")
    )
    elsewhere = cluster.resolve(KEY, "n2")
    own = cluster.resolve(KEY, "n0")
    assert elsewhere is not None
    assert own is not None
    assert own.service is elsewhere.service
    assert [e.Local for e in own.endpoints] == [True, False]
    assert own.endpoints[0] is not elsewhere.endpoints[0]
    assert own.endpoints[1] is elsewhere.endpoints[1]


def test_zone_hints_split_the_shared_results_by_zone() -> None:
    cluster = _cluster(
        SliceEndpoint(ip="10.0.0.1", node="n0", zone_hints=("a",)),
        SliceEndpoint(ip="10.0.0.4", node="n4", zone_hints=("b",)),
    )
    views = {f"n{i}": cluster.view(f"n{i}") for i in range(6)}
    for view in views.values():
        view.resolve()
    assert views["n1"].state[KEY] is views["n2"].state[KEY]
    assert views["n3"].state[KEY] is views["n5"].state[KEY]
    ips = {n: [e.IPs.V4 for e in v.state[KEY].endpoints if e.IPs] for n, v in views.items()}
    assert ips["n2"] == [("10.0.0.1",)]
    assert ips["n5"] == [("10.0.0.4",)]


def test_a_change_reaches_every_view_once() -> None:
    cluster = _cluster(SliceEndpoint(ip="10.0.0.1", node="n0"))
    views = [cluster.view(f"n{i}") for i in range(6)]
    for view in views:
        view.resolve()
    cluster.set_service(KEY, _service(port=81))
    for view in views:
        changes = view.resolve()
        assert set(changes.updated) == {KEY}
        assert changes.previous[KEY].service.Ports[0].Port == 80
        assert not view.resolve()
    assert cluster._log == []


def test_a_view_that_never_reads_cannot_grow_the_log_without_bound() -> None:
    cluster = _cluster(SliceEndpoint(ip="10.0.0.1", node="n0"))
    idle = cluster.view("n1")
    busy = cluster.view("n2")
    idle.resolve()
    for port in range(20_000):
        cluster.set_service(KEY, _service(port=1 + port % 60_000))
        if port % 100 == 0:
            busy.resolve()
    assert len(cluster._log) <= resolving._MIN_LOG
    # the idle view catches up with one full pass, and is right
    changes = idle.resolve()
    assert changes.updated[KEY] == cluster.resolve(KEY, "n1")
    assert idle.state[KEY].service.Ports[0].Port == 1 + 19_999 % 60_000


def test_closing_a_view_releases_the_log() -> None:
    cluster = _cluster(SliceEndpoint(ip="10.0.0.1", node="n0"))
    view = cluster.view("n1")
    cluster.set_service(KEY, _service(port=81))
    assert cluster._log
    view.close()
    assert cluster._log == []


def _random_service(rng: random.Random, i: int) -> Service:
    return Service(
        Namespace="ns",
        Name=f"s{i}",
        Type=rng.choice(["ClusterIP", "NodePort"]),
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=(f"10.96.0.{i}",))),
        Ports=(PortMapping(Name="http", Protocol="TCP", Port=rng.choice([80, 81]), TargetPort=1),),
        InternalTrafficToLocal=rng.random() < 0.2,
        ExternalTrafficToLocal=rng.random() < 0.2,
    )


def _random_slice(rng: random.Random, i: int, nodes: int) -> Slice:
    endpoints = []
    for e in range(rng.randrange(4)):
        node = f"n{rng.randrange(nodes)}"
        hinted = rng.random() < 0.3
        endpoints.append(
            SliceEndpoint(
                ip=f"10.{i}.0.{rng.choice([e, 9])}",
                node=node,
                zone="a",
                zone_hints=(rng.choice("ab"),) if hinted else (),
                node_hints=(f"n{rng.randrange(nodes)}",) if hinted and rng.random() < 0.5 else (),
                ready=rng.random() < 0.8,
            )
        )
    return Slice(
        namespace="ns",
        name=f"s{i}-{rng.randrange(2)}",
        service=f"s{i}",
        v6=False,
        ports=(SlicePort(name="http", protocol="TCP", port=8080 + rng.randrange(2)),),
        endpoints=tuple(endpoints),
    )


@pytest.mark.parametrize("seed", range(12))
def test_views_sharing_their_zone_s_base_see_what_views_of_their_own_do(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random changes, views resolving at random times, coming and going: each shared view
    (state over its zone's base) yields the Changes and state of an unshared twin resolved at
    the same times, and no view's state moves but in its own resolve."""
    monkeypatch.setattr(resolving, "_MIN_LOG", 8)  # laggards re-read whole now and then
    rng = random.Random(seed)
    nodes = 6
    cluster = ClusterResolver()
    for n in range(nodes):
        cluster.set_node(f"n{n}", _node(f"n{n}", rng.choice("ab")))
    twins: list[tuple[resolving.NodeView, resolving.NodeView]] = []

    def watch() -> None:
        node = f"n{rng.randrange(nodes)}"
        twins.append((cluster.view(node), cluster.view(node, shared=False)))

    for _ in range(8):
        watch()
    seen = [dict(ref.state) for _, ref in twins]
    for _step in range(400):
        action = rng.random()
        i = rng.randrange(8)
        if action < 0.25:
            service = _random_service(rng, i) if rng.random() < 0.85 else None
            cluster.set_service(("ns", f"s{i}"), service)
        elif action < 0.6:
            sl = _random_slice(rng, i, nodes)
            key = (sl.namespace, sl.name)
            cluster.set_slice(key, sl if rng.random() < 0.85 else None)
        elif action < 0.65:
            n = rng.randrange(nodes)
            zone = rng.choice("abc")
            cluster.set_node(f"n{n}", _node(f"n{n}", zone) if zone != "c" else None)
        elif action < 0.7:
            shared, ref = twins.pop(rng.randrange(len(twins)))
            shared.close()
            ref.close()
            watch()
            seen = [dict(r.state) for _, r in twins]
        else:
            for w in rng.sample(range(len(twins)), rng.randrange(1, len(twins) + 1)):
                shared, ref = twins[w]
                got, want = shared.resolve(), ref.resolve()
                assert dict(got.updated) == dict(want.updated)
                assert got.deleted == want.deleted
                assert dict(got.previous) == dict(want.previous)
                assert all(shared.state[k] is v for k, v in got.updated.items())
                current = {
                    k: v
                    for k in cluster.services
                    if (v := cluster.resolve(k, shared.node_name)) is not None
                }
                assert dict(ref.state) == current
                seen[w] = dict(ref.state)
        for (shared, _), state in zip(twins, seen, strict=True):
            assert dict(shared.state) == state
            assert len(shared.state) == len(state)
            assert all(k in shared.state for k in state)
            assert ("ns", "none") not in shared.state
    for shared, ref in twins:
        shared.close()
        ref.close()
    assert cluster._bases == {}
    assert cluster._zone_views == {}
