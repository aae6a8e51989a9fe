"""The incremental interface of a watch: what a stream's ops are handed to, one call each.

Defined under the client library (which re-exports both protocols as part of ``kpng.client``), so
that the gRPC watching here needs nothing from the library above it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from kpng.model.messages import ChangeTriggers, Endpoint, NodeFacts, Service


@runtime_checkable
class Sink(Protocol):
    """An incremental backend: the watch API's ops, one call each.

    Between two ``sync`` calls the state is in flux; at ``sync`` it is complete and consistent.
    ``reset`` means: forget everything, the whole state follows. Endpoint keys are stable within
    a service (see kpng.model.paths). ``sync`` may be a coroutine function; it is awaited.

    The calls between two syncs come in four runs, each sorted by namespace, name and endpoint
    key: every ``set_service``, then every ``set_endpoint``, then every ``delete_endpoint``, then
    every ``delete_service``. So a service is set before its endpoints, and its endpoints are
    deleted before it. In process (SinkBackend) and over the network alike.
    """

    def reset(self) -> None: ...

    def set_service(self, service: Service) -> None: ...

    def delete_service(self, namespace: str, name: str) -> None: ...

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None: ...

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None: ...

    def sync(self) -> Any: ...


@runtime_checkable
class NodeSink(Sink, Protocol):
    """A Sink that also reads what the state says of its node and the cluster (addresses, pod
    CIDRs, ServiceCIDRs, draining), the ``NodeState`` fields that are not services.

    ``set_node`` comes first in a change set (right after ``reset``), in the first change set and
    in every later one where the facts changed. A plain Sink is not called with them: it is not
    told of what it did not ask for. A Go KPNG brain sends none (kpng logs that once).
    """

    def set_node(self, facts: NodeFacts) -> None: ...


@runtime_checkable
class TriggerSink(Protocol):
    """A Sink told of each change set's EndpointSlice trigger times (before its ``sync``): what
    kpng's own full-state assembly reads to time network programming. Not part of the library's
    surface: no backend needs them."""

    def triggered(self, triggers: ChangeTriggers) -> None: ...
