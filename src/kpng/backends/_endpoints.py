"""What a node's rules read of each service, whatever renders them (pure): the endpoints of each
kind of traffic, source ranges, the serving endpoints behind UDP flows, hairpin addresses.
Shared by to-nft and to-iptables, so that both read the node-local state the same way."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Sequence

from kpng.client import Endpoint, EndpointScopes, PortMapping, Service

EndpointValue = tuple[str, str]
"""(address, port): the value of an endpoint map element."""

DEFAULT_AFFINITY_TIMEOUT_S = 10800
"""Kubernetes' default ClientIP timeoutSeconds (3 hours)."""


def affinity_timeout(service: Service) -> int:
    """How long a client sticks to its endpoint, in seconds; 0 without ClientIP affinity."""
    if service.ClientIP is None:
        return 0
    return service.ClientIP.TimeoutSeconds or DEFAULT_AFFINITY_TIMEOUT_S


_ServingPort = tuple[str, str, bool]
"""A port's name and protocol, and the family (True: IPv6)."""
_Serving = list[tuple[EndpointScopes, str, int]]
"""The endpoint addresses serving one port in one family, with their scopes and port number."""

_indexed: tuple[Sequence[Endpoint], dict[_ServingPort, _Serving]] = ((), {})


def _by_port(endpoints: Sequence[Endpoint]) -> dict[_ServingPort, _Serving]:
    """``endpoints`` by the ports they serve: one pass over a service's endpoints for all of its
    ports. Scanning them for each port instead cost ports x endpoints x overrides: 40 s for
    one Service of 20,000 ports. Renderers ask port after port of the same service, so the last
    one is kept (by identity: comparing 20,000 endpoints would cost what it saves)."""
    global _indexed
    last, index = _indexed
    if last is endpoints:
        return index
    index = {}
    for ep in endpoints:
        scopes, ips = ep.Scopes, ep.IPs
        if scopes is None or ips is None:
            continue
        seen: set[tuple[str, str]] = set()
        for po in ep.PortOverrides:
            # An endpoint naming a port twice serves it on the first number it gives.
            if not po.Port or (po.Name, po.Protocol) in seen:
                continue
            seen.add((po.Name, po.Protocol))
            for v6, addrs in ((False, ips.V4), (True, ips.V6)):
                for a in addrs:
                    index.setdefault((po.Name, po.Protocol, v6), []).append((scopes, a, po.Port))
    _indexed = (endpoints, index)
    return index


def endpoints_by_scope(
    endpoints: Sequence[Endpoint], port: PortMapping, v6: bool
) -> tuple[list[EndpointValue], list[EndpointValue], list[EndpointValue]]:
    """The endpoints of ``port`` in one family: Internal, External and Cluster scope, each
    ordered by address and port number (the order gives the numgen indexes)."""
    internal: dict[tuple[str, int], EndpointValue] = {}
    external: dict[tuple[str, int], EndpointValue] = {}
    cluster: dict[tuple[str, int], EndpointValue] = {}
    for scopes, a, number in _by_port(endpoints).get((port.Name, port.Protocol, v6), ()):
        # One value tuple per endpoint, shared by every map it appears in; an address that
        # comes twice (two slices, two scope sets) counts once.
        key, value = (a, number), (a, _port_text(number))
        if scopes.Internal:
            internal[key] = value
        if scopes.External:
            external[key] = value
        if scopes.Cluster:
            cluster[key] = value
    return _ordered(internal), _ordered(external), _ordered(cluster)


@functools.cache
def _port_text(number: int) -> str:
    """One string per port number, not one per endpoint (a million at 100k services)."""
    return str(number)


def _ordered(endpoints: dict[tuple[str, int], EndpointValue]) -> list[EndpointValue]:
    return [endpoints[k] for k in sorted(endpoints)]


@functools.cache
def allowed_ranges(ranges: tuple[str, ...], v6: bool) -> tuple[str, ...]:
    """The source ranges of one family, merged: overlapping ranges in one interval set make
    the kernel refuse the transaction ("File exists"), and their union is what is allowed."""
    if v6:
        merged6 = ipaddress.collapse_addresses(
            ipaddress.IPv6Network(r, strict=False) for r in ranges if ":" in r
        )
        return tuple(str(n) for n in merged6)
    merged4 = ipaddress.collapse_addresses(
        ipaddress.IPv4Network(r, strict=False) for r in ranges if ":" not in r
    )
    return tuple(str(n) for n in merged4)


def serving_endpoints(port: PortMapping, used: Iterable[EndpointValue]) -> frozenset[EndpointValue]:
    """The endpoints of ``port`` serving anywhere (the brain's list; from a brain without it, as
    Go KPNG's, those this node may use)."""
    if port.ServingEndpoints:
        return frozenset((e.IP, str(e.Port)) for e in port.ServingEndpoints)
    return frozenset(used)


def allowed_from_node(
    ranges: Sequence[str], node_ips: Sequence[str], lb_ips: Sequence[str]
) -> tuple[str, ...]:
    """kube-proxy's allowFromNode: when the source ranges hold the node's IP, the LB IPs are
    allowed sources too. A VIP-like LB's IP is often a local address of the node, and the node's
    own connections to it then come from that IP, not through the load balancer."""
    nets = [ipaddress.ip_network(r, strict=False) for r in ranges]
    if any(ipaddress.ip_address(ip) in net for ip in node_ips for net in nets):
        return tuple(lb_ips)
    return ()


def local_endpoint_addresses(endpoints: Sequence[Endpoint]) -> frozenset[str]:
    return frozenset(
        a for ep in endpoints if ep.Local and ep.IPs is not None for a in (*ep.IPs.V4, *ep.IPs.V6)
    )
