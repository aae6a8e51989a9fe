"""The incremental interface, and the pieces that convert between it and full states."""

from __future__ import annotations

import inspect
from typing import Any

from kpng.client._compat import complete
from kpng.client._state import Handler, NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    NO_TRIGGERS,
    ChangeTriggers,
    Endpoint,
    NodeFacts,
    Service,
    ServiceEndpoints,
)
from kpng.model.paths import endpoint_keys
from kpng.remote.sinks import NodeSink, Sink, TriggerSink


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


class FilterReset:
    """A Sink wrapper that turns a reset (a reconnection) into the differences only.

    After a reset, values equal to those already forwarded are dropped, and at the next sync
    whatever was not sent again is deleted: the wrapped sink never sees a reset after its
    first one, only what really changed while the connection was down.
    """

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._node_sink = sink if isinstance(sink, NodeSink) else None
        self._trigger_sink = sink if isinstance(sink, TriggerSink) else None
        self._facts: NodeFacts | None = None
        self._services: dict[ServiceKey, Service] = {}
        self._endpoints: dict[tuple[str, str, str], Endpoint] = {}
        self._resetting = False
        self._started = False
        self._seen_services: set[ServiceKey] = set()
        self._seen_endpoints: set[tuple[str, str, str]] = set()

    def reset(self) -> None:
        if not self._started:
            self._started = True
            self._sink.reset()
            return
        self._resetting = True
        self._seen_services.clear()
        self._seen_endpoints.clear()

    def set_node(self, facts: NodeFacts) -> None:
        if self._node_sink is not None and facts != self._facts:
            self._facts = facts
            self._node_sink.set_node(facts)

    def triggered(self, triggers: ChangeTriggers) -> None:
        if self._trigger_sink is not None:
            self._trigger_sink.triggered(triggers)

    def set_service(self, service: Service) -> None:
        key = (service.Namespace, service.Name)
        if self._resetting:
            self._seen_services.add(key)
        if self._services.get(key) != service:
            self._services[key] = service
            self._sink.set_service(service)

    def delete_service(self, namespace: str, name: str) -> None:
        if self._services.pop((namespace, name), None) is not None:
            self._sink.delete_service(namespace, name)

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None:
        ek = (namespace, service, key)
        if self._resetting:
            self._seen_endpoints.add(ek)
        if self._endpoints.get(ek) != endpoint:
            self._endpoints[ek] = endpoint
            self._sink.set_endpoint(namespace, service, key, endpoint)

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        if self._endpoints.pop((namespace, service, key), None) is not None:
            self._sink.delete_endpoint(namespace, service, key)

    def sync(self) -> Any:
        if self._resetting:
            self._resetting = False
            for ek in [k for k in self._endpoints if k not in self._seen_endpoints]:
                self.delete_endpoint(*ek)
            for sk in [k for k in self._services if k not in self._seen_services]:
                self.delete_service(*sk)
        return self._sink.sync()


class FullState:
    """A Sink that assembles complete node states and hands each one to a handler at sync."""

    def __init__(self, handler: Handler, *, node: str) -> None:
        self._handler = handler
        self._node = node
        self._services: dict[ServiceKey, Service] = {}
        self._endpoints: dict[ServiceKey, dict[str, Endpoint]] = {}
        self._state: dict[ServiceKey, ServiceEndpoints] = {}
        self._dirty: set[ServiceKey] = set()
        self._revision = 0
        self._first = True
        self._facts = NodeFacts()
        self._facts_changed = False
        self._triggers = NO_TRIGGERS
        self.done = False
        """True once the handler asked to stop."""

    def set_node(self, facts: NodeFacts) -> None:
        if facts != self._facts:
            self._facts = facts
            self._facts_changed = True

    def triggered(self, triggers: ChangeTriggers) -> None:
        self._triggers = self._triggers.followed_by(triggers)

    def reset(self) -> None:
        self._dirty.update(self._state)
        self._services.clear()
        self._endpoints.clear()

    def set_service(self, service: Service) -> None:
        key = (service.Namespace, service.Name)
        self._services[key] = service
        self._dirty.add(key)

    def delete_service(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        self._services.pop(key, None)
        self._endpoints.pop(key, None)
        self._dirty.add(key)

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None:
        self._endpoints.setdefault((namespace, service), {})[key] = endpoint
        self._dirty.add((namespace, service))

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        endpoints = self._endpoints.get((namespace, service))
        if endpoints is not None and endpoints.pop(key, None) is not None:
            self._dirty.add((namespace, service))

    async def sync(self) -> bool:
        """Hand the state to the handler if it changed; True once the handler asked to stop."""
        updated: set[ServiceKey] = set()
        deleted: set[ServiceKey] = set()
        for key in self._dirty:
            service = self._services.get(key)
            if service is None:
                if self._state.pop(key, None) is not None:
                    deleted.add(key)
                continue
            keyed = self._endpoints.get(key, {})
            # by key: the canonical order (kpng.model.paths), as in process; from a Go KPNG
            # brain, with what its semantics imply filled in
            value = complete(
                ServiceEndpoints(service=service, endpoints=tuple(keyed[k] for k in sorted(keyed)))
            )
            if self._state.get(key) != value:
                self._state[key] = value
                updated.add(key)
        self._dirty.clear()
        if not (updated or deleted or self._first or self._facts_changed):
            return self.done  # the triggers wait for the state they are part of
        self._first = self._facts_changed = False
        self._revision += 1
        state = NodeState.of(
            node=self._node,
            revision=self._revision,
            services=self._state,
            updated=frozenset(updated),
            deleted=frozenset(deleted),
            facts=self._facts,
            triggers=self._triggers,
        )
        self._triggers = NO_TRIGGERS
        if await _maybe_await(self._handler(state)):
            self.done = True
        return self.done


class SinkBackend:
    """A full-state Backend that drives an incremental Sink: in process, a Sink gets the same
    calls, in the same order, as over the network (see Sink)."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._node_sink = sink if isinstance(sink, NodeSink) else None
        self._started = False
        self._facts: NodeFacts | None = None
        self._sent: dict[ServiceKey, ServiceEndpoints] = {}

    async def apply(self, state: NodeState) -> bool:
        sink = self._sink
        if not self._started:
            self._started = True
            sink.reset()
        if self._node_sink is not None and (facts := state.facts) != self._facts:
            self._facts = facts
            self._node_sink.set_node(facts)
        # The watch API's order (kpng.api.ops.local_ops), call for call.
        service_sets: list[Service] = []
        endpoint_sets: list[tuple[str, str, str, Endpoint]] = []
        endpoint_deletes: list[tuple[str, str, str]] = []
        for key in sorted(state.updated):
            new = state.services[key]
            old = self._sent.get(key)
            if old is None or old.service != new.service:
                service_sets.append(new.service)
            old_eps = endpoint_keys(old.endpoints) if old is not None else {}
            new_eps = endpoint_keys(new.endpoints)
            endpoint_sets += (
                (*key, ep_key, new_eps[ep_key])
                for ep_key in sorted(new_eps)
                if old_eps.get(ep_key) != new_eps[ep_key]
            )
            endpoint_deletes += ((*key, k) for k in sorted(old_eps.keys() - new_eps.keys()))
            self._sent[key] = new
        service_deletes = sorted(state.deleted)
        for key in service_deletes:
            gone = self._sent.pop(key, None)
            if gone is not None:
                endpoint_deletes += ((*key, k) for k in sorted(endpoint_keys(gone.endpoints)))
        for service in service_sets:
            sink.set_service(service)
        for namespace, name, ep_key, endpoint in endpoint_sets:
            sink.set_endpoint(namespace, name, ep_key, endpoint)
        for namespace, name, ep_key in endpoint_deletes:
            sink.delete_endpoint(namespace, name, ep_key)
        for namespace, name in service_deletes:
            sink.delete_service(namespace, name)
        return bool(await _maybe_await(sink.sync()))  # True: the sink is done, as over a watch

    async def close(self) -> None:
        return None
