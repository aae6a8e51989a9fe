"""What a Go KPNG brain leaves out of a service's node-local state, filled in once (pure).

Go KPNG's to-api server (server/pkg/endpoints/node.go) sends a node the ready endpoints of each
service, those of its zone when hints say so, with ``Local`` and ``Scopes.Internal`` and
``External`` set from the traffic policies, and ``PortOverrides`` holding the slice's ports by
name and number only (its PortName has no protocol). Endpoints its file source made have no
overrides at all: the service port's target port applies. None of kpng's extension fields
(numbers 100 and up) come, and kpng's backends read them: the protocol of an override (a port is
matched by name and protocol), ``Scopes.Cluster`` (the eTP=Local short-circuit),
``PortMapping.UsableEndpoints`` (REJECT or DROP) and ``ServingEndpoints`` (UDP flows).

``complete`` fills them in as Go KPNG's semantics imply, for a service whose endpoints show they
came from such a brain (an override without a protocol, or an endpoint without overrides: kpng's
brain writes neither). A state from kpng's brain is returned as it is.
"""

from __future__ import annotations

import msgspec

from kpng.model.messages import (
    Endpoint,
    EndpointAddress,
    EndpointScopes,
    IPFamilies,
    PortMapping,
    PortName,
    ServiceEndpoints,
)

_ALL = EndpointScopes(Internal=True, External=True)


def from_go_kpng(se: ServiceEndpoints) -> bool:
    """Whether ``se``'s endpoints have the shape a Go KPNG brain gives them."""
    return any(
        not ep.PortOverrides or any(not po.Protocol for po in ep.PortOverrides)
        for ep in se.endpoints
    )


def complete(se: ServiceEndpoints) -> ServiceEndpoints:
    """``se`` with what Go KPNG leaves out filled in (``se`` itself when nothing is missing)."""
    if not from_go_kpng(se):
        return se
    service = se.service
    by_name = {p.Name: p for p in service.Ports}
    endpoints = tuple(_endpoint(ep, service.Ports, by_name) for ep in se.endpoints)
    ports = tuple(_port(port, endpoints) for port in service.Ports)
    return ServiceEndpoints(msgspec.structs.replace(service, Ports=ports), endpoints)


def _endpoint(
    ep: Endpoint, ports: tuple[PortMapping, ...], by_name: dict[str, PortMapping]
) -> Endpoint:
    if ep.PortOverrides:
        overrides = tuple(
            msgspec.structs.replace(po, Protocol=by_name[po.Name].Protocol)
            if not po.Protocol and po.Name in by_name
            else po
            for po in ep.PortOverrides
        )
    else:
        # A named target port cannot be resolved without the endpoint's ports: not served.
        overrides = tuple(
            PortName(Name=p.Name, Port=p.TargetPort or p.Port, Protocol=p.Protocol)
            for p in ports
            if p.TargetPort or not p.TargetPortName
        )
    # Every endpoint Go KPNG sends is ready and in the node's zone: kube-proxy's cluster-wide
    # set, where eTP=Local traffic of the node and its pods is short-circuited to.
    scopes = msgspec.structs.replace(ep.Scopes or _ALL, Cluster=True)
    return msgspec.structs.replace(ep, PortOverrides=overrides, Scopes=scopes)


def _port(port: PortMapping, endpoints: tuple[Endpoint, ...]) -> PortMapping:
    serving = [
        (ep, po)
        for ep in endpoints
        for po in ep.PortOverrides
        if po.Name == port.Name and po.Protocol == port.Protocol and ep.IPs is not None
    ]
    v4 = any(ep.IPs is not None and ep.IPs.V4 for ep, _ in serving)
    v6 = any(ep.IPs is not None and ep.IPs.V6 for ep, _ in serving)
    addresses: tuple[EndpointAddress, ...] = ()
    if port.Protocol == "UDP":
        addresses = tuple(
            sorted(
                {
                    EndpointAddress(IP=ip, Port=po.Port)
                    for ep, po in serving
                    if ep.IPs is not None
                    for ip in (*ep.IPs.V4, *ep.IPs.V6)
                },
                key=lambda a: (a.IP, a.Port),
            )
        )
    return msgspec.structs.replace(
        port,
        UsableEndpoints=port.UsableEndpoints or (IPFamilies(V4=v4, V6=v6) if v4 or v6 else None),
        ServingEndpoints=port.ServingEndpoints or addresses,
    )
