"""One cluster resolver, many node views: results shared by nodes that see a service alike."""

from __future__ import annotations

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
