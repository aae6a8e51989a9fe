"""Node-local states as plain data, for backend tests and `kpng check`: services with a node port
and endpoints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kpng.client import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    Endpoint,
    EndpointScopes,
    IPFamilies,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)


def service(name: str, *, node_port: int = 0, index: int = 1) -> Service:
    return Service(
        Namespace="ns",
        Name=name,
        Type="NodePort" if node_port else "ClusterIP",
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=(f"10.96.{index // 250}.{index % 250 + 1}",))),
        Ports=(
            PortMapping(
                Name="http",
                Protocol="TCP",
                Port=80,
                NodePort=node_port,
                TargetPort=8080,
                UsableEndpoints=IPFamilies(V4=True),
            ),
        ),
    )


def endpoint(address: str) -> Endpoint:
    return Endpoint(
        IPs=IPSet(V4=(address,)),
        PortOverrides=(PortName(Name="http", Port=8080, Protocol="TCP"),),
        Scopes=EndpointScopes(Internal=True, External=True, Cluster=True),
        Ready=True,
        Serving=True,
    )


def entry(name: str, addresses: Sequence[str] = (), *, node_port: int = 0) -> ServiceEndpoints:
    return ServiceEndpoints(
        service=service(name, node_port=node_port),
        endpoints=tuple(endpoint(a) for a in sorted(addresses)),
    )


def state(
    revision: int,
    services: Mapping[str, ServiceEndpoints],
    *,
    updated: Sequence[str] | None = None,
    deleted: Sequence[str] = (),
    node: str = "node-1",
) -> NodeState:
    """A state of ``services`` (by name, in namespace ``ns``); every one updated by default."""
    by_key: dict[ServiceKey, ServiceEndpoints] = {("ns", n): se for n, se in services.items()}
    names = list(services) if updated is None else updated
    return NodeState(
        node=node,
        revision=revision,
        services=by_key,
        updated=frozenset(("ns", n) for n in names),
        deleted=frozenset(("ns", n) for n in deleted),
    )


def many(count: int) -> dict[str, ServiceEndpoints]:
    """``count`` services with two endpoints each: big enough to fill a pipe."""
    return {
        f"svc-{i:05d}": entry(f"svc-{i:05d}", (f"10.244.{i // 250}.{i % 250 + 1}", "10.245.0.1"))
        for i in range(count)
    }


def keyed_state(
    revision: int,
    services: Mapping[ServiceKey, ServiceEndpoints],
    updated: Iterable[ServiceKey] | None = None,
    deleted: Iterable[ServiceKey] = (),
) -> NodeState:
    """A state of ``services`` by key, for node ``n1``; every one updated by default."""
    return NodeState(
        node="n1",
        revision=revision,
        services=dict(services),
        updated=frozenset(services if updated is None else updated),
        deleted=frozenset(deleted),
    )
