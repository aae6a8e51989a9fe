"""Stable paths of the watch API's items (Go KPNG's format) and the order of endpoints.

Services are ``namespace/name``; endpoints ``namespace/name/key``, where the key is the endpoint's
address, or, for an address that appears once per scope set (its scopes differ between ports),
the address and its port names: ``10.0.0.1#http.TCP,metrics.TCP``. Keys never contain ``/``
(Go KPNG's clients split paths on it).
"""

from __future__ import annotations

from collections.abc import Iterable

from kpng.model.cluster import ServiceKey
from kpng.model.messages import Endpoint, ServiceEndpoints


def service_path(key: ServiceKey) -> str:
    return f"{key[0]}/{key[1]}"


def split_service_path(path: str) -> ServiceKey:
    namespace, _, name = path.partition("/")
    return (namespace, name)


def endpoint_address(ep: Endpoint) -> str:
    ips = ep.IPs
    if ips is None:
        return ""
    return (ips.V4 or ips.V6 or ("",))[0]


def endpoint_order(ep: Endpoint) -> tuple[bool, str, tuple[tuple[str, str], ...]]:
    """The order of a service's endpoints everywhere kpng lists them: family, address, ports."""
    ips = ep.IPs
    return (
        bool(ips is not None and ips.V6),
        endpoint_address(ep),
        tuple((p.Name, p.Protocol) for p in ep.PortOverrides),
    )


def endpoint_keys(endpoints: Iterable[Endpoint]) -> dict[str, Endpoint]:
    """Each endpoint by its key (see the module docstring)."""
    eps = list(endpoints)
    seen: dict[str, int] = {}
    for ep in eps:
        address = endpoint_address(ep)
        seen[address] = seen.get(address, 0) + 1
    keyed = {}
    for ep in eps:
        address = endpoint_address(ep)
        if seen[address] == 1:
            keyed[address] = ep
        else:
            ports = ",".join(f"{p.Name}.{p.Protocol}" for p in ep.PortOverrides)
            keyed[f"{address}#{ports}"] = ep
    return keyed


def service_endpoint_keys(state: ServiceEndpoints) -> dict[str, Endpoint]:
    return endpoint_keys(state.endpoints)
