"""Node-local states as plain data, for backend tests and `kpng check`: services with a node port
and endpoints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kpng.client import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    ClientIPAffinity,
    Endpoint,
    EndpointScopes,
    IPFamilies,
    IPFilter,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)

ALL_SCOPES = EndpointScopes(Internal=True, External=True, Cluster=True)


def service(
    name: str = "web",
    *,
    index: int = 1,
    cluster_ip: str | None = None,
    port: int = 80,
    port_name: str = "http",
    protocol: str = "TCP",
    target_port: int = 8080,
    node_port: int = 0,
    external_ips: tuple[str, ...] = (),
    usable: bool = True,
    etp_local: bool = False,
    affinity: int = 0,
    filters: tuple[IPFilter, ...] = (),
) -> Service:
    """A single-port IPv4 service in namespace ``ns``; its cluster IP from ``index`` unless
    given. The one builder of node-local services for backend tests and ``kpng check``."""
    ip = cluster_ip or f"10.96.{index // 250}.{index % 250 + 1}"
    return Service(
        Namespace="ns",
        Name=name,
        Type="NodePort" if node_port else "ClusterIP",
        IPs=ServiceIPs(
            ClusterIPs=IPSet(V4=(ip,)),
            ExternalIPs=IPSet(V4=external_ips) if external_ips else None,
        ),
        Ports=(
            PortMapping(
                Name=port_name,
                Protocol=protocol,
                Port=port,
                NodePort=node_port,
                TargetPort=target_port,
                UsableEndpoints=IPFamilies(V4=usable),
            ),
        ),
        ExternalTrafficToLocal=etp_local,
        ClientIP=ClientIPAffinity(TimeoutSeconds=affinity) if affinity else None,
        IPFilters=filters,
    )


def endpoint(
    address: str,
    port: int = 8080,
    *,
    port_name: str = "http",
    protocol: str = "TCP",
    scopes: EndpointScopes = ALL_SCOPES,
    local: bool = False,
    ready: bool = True,
) -> Endpoint:
    """A serving endpoint at ``address`` (IPv4 or IPv6) for the port named ``port_name``."""
    return Endpoint(
        IPs=IPSet(V6=(address,)) if ":" in address else IPSet(V4=(address,)),
        Local=local,
        PortOverrides=(PortName(Name=port_name, Port=port, Protocol=protocol),),
        Scopes=scopes,
        Ready=ready,
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
