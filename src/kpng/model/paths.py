"""Stable paths of the watch API's items (Go KPNG's format), and the order of endpoints.

Services are ``namespace/name``; endpoints ``namespace/name/key``, where the key is the endpoint's
address, or, for an address that appears in several Endpoints (its scopes differ between ports,
or slices give it different numbers for one port), the address and its ports:
``10.0.0.1#http.TCP.8080,metrics.TCP.9090``. Keys never contain ``/`` (Go KPNG's clients split
paths on it).
"""

from __future__ import annotations

from collections.abc import Iterable

from kpng.model.cluster import ServiceKey
from kpng.model.messages import Endpoint

NODE_FACTS_PATH = "node"
"""The path of the NodeFacts item: without a ``/``, it is no service's or endpoint's path (Go
KPNG's full-state client deletes by path alone, whatever the set)."""
TRIGGERS_PATH = "triggers"
"""The path of a change set's ChangeTriggers item."""


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


def endpoint_keys(endpoints: Iterable[Endpoint]) -> dict[str, Endpoint]:
    """Each endpoint by its key (see the module docstring), in the given order."""
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
            ports = ",".join(f"{p.Name}.{p.Protocol}.{p.Port}" for p in ep.PortOverrides)
            keyed[f"{address}#{ports}"] = ep
    return keyed


def in_key_order(endpoints: Iterable[Endpoint]) -> tuple[Endpoint, ...]:
    """Endpoints in kpng's canonical order, everywhere it lists them: by key."""
    keyed = endpoint_keys(endpoints)
    return tuple(keyed[key] for key in sorted(keyed))
