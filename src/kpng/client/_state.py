from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import msgspec

from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints


class NodeState(msgspec.Struct, frozen=True):
    """One node's complete local state, as a backend receives it after each change.

    ``services``: every service, by (namespace, name), with the endpoints this node may use for
    it (read-only; it changes after the handler returns). ``updated`` and ``deleted``: the
    services that changed since the previous state, so a backend can do work proportional to
    the change; the first state names every service in ``updated``. ``revision`` grows with each
    state: the store's revision in process, the count of change sets over the network.
    ``node_ips`` (the node's primary IPs, one per family, as kube-proxy finds them in its
    status) and ``pod_cidrs`` (its ``spec.podCIDRs``) are empty while the source does not
    know the node. ``service_cidrs``: the cluster's ServiceCIDRs (networking.k8s.io/v1), the
    ranges ClusterIPs are allocated from, where the source knows them.
    """

    node: str
    revision: int
    services: Mapping[ServiceKey, ServiceEndpoints]
    updated: frozenset[ServiceKey]
    deleted: frozenset[ServiceKey]
    node_ips: tuple[str, ...] = ()
    pod_cidrs: tuple[str, ...] = ()
    service_cidrs: tuple[str, ...] = ()


class Backend(Protocol):
    """A full-state backend: what ``to-local`` and ``kpng local`` feed."""

    async def apply(self, state: NodeState) -> bool:
        """Program ``state``. Return True when the backend is done (e.g. ``--once``)."""
        ...

    async def close(self) -> None:
        """Release what the backend holds; called once, also after a failure."""
        ...


Handler = Callable[[NodeState], "bool | Awaitable[bool | None] | None"]
"""A full-state handler: a plain or async function; returning True stops the client."""
