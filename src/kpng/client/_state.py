from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import msgspec

from kpng.model.cluster import ServiceKey, primary_ips
from kpng.model.messages import (
    NO_TRIGGERS,
    ChangeTriggers,
    NodeAddress,
    NodeFacts,
    ServiceEndpoints,
)


class NodeState(msgspec.Struct, frozen=True):
    """One node's complete local state, as a backend receives it after each change.

    ``services``: every service, by (namespace, name), with the endpoints this node may use for
    it (read-only; it changes after the handler returns). ``updated`` and ``deleted``: the
    services that changed since the previous state, so a backend can do work proportional to
    the change; the first state names every service in ``updated``. ``revision`` grows with each
    state: the store's revision in process, the count of change sets over the network.

    What the state says of the node and the cluster is the same in process and over the network
    (the wire's ``NodeFacts``), and empty while the sources do not know the node:
    ``node_addresses`` (its ``status.addresses``, in order), ``node_ips`` (its primary IPs
    among them, one per family, as kube-proxy finds them), ``pod_cidrs`` (its
    ``spec.podCIDRs``), ``service_cidrs`` (the cluster's ServiceCIDRs, the ranges ClusterIPs
    are allocated from) and ``draining`` (the node is being deleted or scaled down: kube-proxy's
    ``/healthz`` then fails, so that load balancers drain it).

    ``triggers``: the trigger times of the EndpointSlice changes since the previous state, by
    family, for network programming latency (from each to the moment this state is in place).
    """

    node: str
    revision: int
    services: Mapping[ServiceKey, ServiceEndpoints]
    updated: frozenset[ServiceKey]
    deleted: frozenset[ServiceKey]
    node_ips: tuple[str, ...] = ()
    pod_cidrs: tuple[str, ...] = ()
    service_cidrs: tuple[str, ...] = ()
    node_addresses: tuple[NodeAddress, ...] = ()
    draining: bool = False
    triggers: ChangeTriggers = NO_TRIGGERS

    @classmethod
    def of(
        cls,
        *,
        node: str,
        revision: int,
        services: Mapping[ServiceKey, ServiceEndpoints],
        updated: frozenset[ServiceKey],
        deleted: frozenset[ServiceKey],
        facts: NodeFacts,
        triggers: ChangeTriggers = NO_TRIGGERS,
    ) -> NodeState:
        """A state whose node and cluster fields are those of ``facts``."""
        return cls(
            node=node,
            revision=revision,
            services=services,
            updated=updated,
            deleted=deleted,
            node_ips=primary_ips(facts.Addresses),
            pod_cidrs=facts.PodCIDRs,
            service_cidrs=facts.ServiceCIDRs,
            node_addresses=facts.Addresses,
            draining=facts.Draining,
            triggers=triggers,
        )

    @property
    def facts(self) -> NodeFacts:
        """What the state says of the node and the cluster, as the wire carries it."""
        return NodeFacts(
            Addresses=self.node_addresses,
            PodCIDRs=self.pod_cidrs,
            ServiceCIDRs=self.service_cidrs,
            Draining=self.draining,
        )


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
