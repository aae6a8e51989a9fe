"""The kube source itself: four reflectors feeding four store handles (see the package's
documentation for the behaviour). Kept apart from the package's ``SPEC`` so that ``kpng`` commands
that do not use it do not import its HTTP client, nor kubernetes_asyncio."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from kpng.errors import InvalidObject, KpngError
from kpng.kubeclient.client import MAX_BODY, MAX_LINE, ApiClient
from kpng.kubeclient.config import Connection, load_connection
from kpng.model import k8s
from kpng.model.cluster import ServiceCIDR, Slice, SliceKey
from kpng.model.converting import (
    LABEL_HEADLESS,
    LABEL_SERVICE_PROXY_NAME,
    node_from_k8s,
    service_cidr_from_k8s,
    service_from_k8s,
    slice_from_k8s,
)
from kpng.model.messages import Node, Service
from kpng.sources.kube.reflector import Key, KubeObject, Reflector, ReflectorSettings, Resource
from kpng.store import SourceHandle, Store

log = logging.getLogger(__name__)

SERVICE_FIELD_SELECTOR = "spec.clusterIP!=None"

T = TypeVar("T", bound=KubeObject)
M = TypeVar("M")


AnyReflector = (
    Reflector[k8s.Service]
    | Reflector[k8s.EndpointSlice]
    | Reflector[k8s.Node]
    | Reflector[k8s.ServiceCIDR]
)


class KubeSourceError(KpngError):
    """The API server could not be used (e.g. no complete initial list in time)."""


def label_selector(proxy_name: str | None) -> str:
    """The server-side label selector of Services and EndpointSlices."""
    if proxy_name is None:
        return f"!{LABEL_SERVICE_PROXY_NAME},!{LABEL_HEADLESS}"
    return f"{LABEL_SERVICE_PROXY_NAME}={proxy_name},!{LABEL_HEADLESS}"


def resources(
    proxy_name: str | None, node_name: str | None = None
) -> tuple[
    Resource[k8s.Service],
    Resource[k8s.EndpointSlice],
    Resource[k8s.Node],
    Resource[k8s.ServiceCIDR],
]:
    selector = label_selector(proxy_name)
    node_selector = f"metadata.name={node_name}" if node_name else ""
    return (
        Resource("Service", "/api/v1/services", k8s.Service, selector, SERVICE_FIELD_SELECTOR),
        Resource(
            "EndpointSlice", "/apis/discovery.k8s.io/v1/endpointslices", k8s.EndpointSlice, selector
        ),
        Resource("Node", "/api/v1/nodes", k8s.Node, field_selector=node_selector),
        Resource("ServiceCIDR", "/apis/networking.k8s.io/v1/servicecidrs", k8s.ServiceCIDR),
    )


class _HandleOutput(Generic[T, M]):
    """Converts what a reflector reports into the global model and stages it in a handle."""

    def __init__(
        self,
        handle: SourceHandle,
        convert: Callable[[T], M | None],
        put: Callable[[Key, M | None], None],
    ) -> None:
        self.handle = handle
        self._convert = convert
        self._put = put

    def apply(self, key: Key, obj: T | None) -> None:
        model = None
        if obj is not None:
            try:
                model = self._convert(obj)
            except InvalidObject as exc:
                log.warning("%s; skipped", exc)
                self.handle.skipped += 1
        self._put(key, model)

    def commit(self) -> None:
        self.handle.commit()

    def mark_synced(self) -> None:
        self.handle.mark_synced()


@dataclass(frozen=True)
class KubeOptions:
    kubeconfig: Path | None = None
    context: str | None = None
    proxy_name: str | None = None
    initial_sync_timeout: float = 0.0
    """Seconds to wait for the first complete lists; 0 waits as long as it takes."""
    node_name: str | None = None
    """Watch only this Node (all of them if None): a node's local state needs no other."""
    max_list_bytes: int = MAX_BODY
    """The largest page of a list read, decoded (``--max-list-bytes``)."""
    max_event_bytes: int = MAX_LINE
    """The longest watch event read (``--max-event-bytes``)."""
    settings: ReflectorSettings = field(default_factory=ReflectorSettings)
    orphan_check_s: float = 30.0
    """After the first lists, how often slices without their Service are looked for. One is
    reported once it has been an orphan at two checks in a row: a Service and its slices
    arrive on separate watches, in either order, and a moment apart is no error."""


class KubeSource:
    def __init__(self, store: Store, options: KubeOptions) -> None:
        self.options = options
        self._store = store
        proxy_name = options.proxy_name
        services, slices, nodes, cidrs = self._handles = tuple(
            store.source(f"kube-{n}") for n in ("services", "slices", "nodes", "servicecidrs")
        )
        self._outputs = (
            _HandleOutput[k8s.Service, Service](
                services, lambda o: service_from_k8s(o, proxy_name=proxy_name), services.set_service
            ),
            _HandleOutput[k8s.EndpointSlice, Slice](
                slices, lambda o: slice_from_k8s(o, proxy_name=proxy_name), slices.set_slice
            ),
            _HandleOutput[k8s.Node, Node](
                nodes, node_from_k8s, lambda key, node: nodes.set_node(key[1], node)
            ),
            _HandleOutput[k8s.ServiceCIDR, ServiceCIDR](
                cidrs, service_cidr_from_k8s, lambda key, cidr: cidrs.set_service_cidr(key[1], cidr)
            ),
        )
        self.reflectors: list[AnyReflector] = []
        self.connection: Connection | None = None
        self._orphans = OrphanReports()

    async def run(self) -> None:
        """Load the configuration, then list and watch until cancelled."""
        options = self.options
        self.connection = await load_connection(options.kubeconfig, options.context)
        svc_res, slice_res, node_res, cidr_res = resources(options.proxy_name, options.node_name)
        async with ApiClient(
            self.connection, max_body=options.max_list_bytes, max_line=options.max_event_bytes
        ) as client:
            # The four watch one server: a bookmark on any of them says that it sends some, so
            # that a silent watch is a fault even on a collection that has had none yet.
            def seen() -> bool:
                return any(r.stats.bookmarks for r in self.reflectors)

            settings = options.settings
            self.reflectors = [
                Reflector(client, svc_res, self._outputs[0], settings, bookmarks_seen=seen),
                Reflector(client, slice_res, self._outputs[1], settings, bookmarks_seen=seen),
                Reflector(client, node_res, self._outputs[2], settings, bookmarks_seen=seen),
                Reflector(client, cidr_res, self._outputs[3], settings, bookmarks_seen=seen),
            ]
            for reflector, handle in zip(self.reflectors, self._handles, strict=True):
                handle.counters = reflector.stats.counters
            tasks = [
                asyncio.create_task(r.run(), name=f"reflector {r.name}") for r in self.reflectors
            ]
            try:
                await self._wait_synced()
                # After a complete list, both halves are there: orphans are real at once.
                self._report_orphans(self._orphans.first(orphan_slices(self._store)))
                tasks.append(asyncio.create_task(self._check_orphans(), name="orphan slices"))
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _wait_synced(self) -> None:
        waits = [r.synced.wait() for r in self.reflectors]
        timeout = self.options.initial_sync_timeout or None
        try:
            await asyncio.wait_for(asyncio.gather(*waits), timeout)
        except TimeoutError:
            assert self.connection is not None
            missing = [r for r in self.reflectors if not r.synced.is_set()]
            errors = {r.last_error or "still listing" for r in missing}
            reasons = (
                errors.pop()
                if len(errors) == 1
                else "; ".join(f"{r.name}: {r.last_error or 'still listing'}" for r in missing)
            )
            raise KubeSourceError(
                f"no complete list from {self.connection.server} within "
                f"{self.options.initial_sync_timeout:g} s ({reasons})"
            ) from None
        log.info("synced with %s", self.connection.server if self.connection else "?")

    async def _check_orphans(self) -> None:
        while True:
            await asyncio.sleep(self.options.orphan_check_s)
            self._report_orphans(self._orphans.check(orphan_slices(self._store)))

    def _report_orphans(self, orphans: list[SliceKey]) -> None:
        for namespace, name in orphans[:_ORPHANS_LISTED]:
            service = self._store.slices[(namespace, name)].service
            log.warning(
                "EndpointSlice %s/%s: Service %s/%s is missing or not served; its endpoints are "
                "unused until it is",
                namespace,
                name,
                namespace,
                service,
            )
        if len(orphans) > _ORPHANS_LISTED:
            log.warning("... and %d more such EndpointSlices", len(orphans) - _ORPHANS_LISTED)


class OrphanReports:
    """Which orphan slices to report, each once while it stays an orphan (pure)."""

    def __init__(self) -> None:
        self._seen: set[SliceKey] = set()
        self._reported: set[SliceKey] = set()

    def first(self, orphans: Iterable[SliceKey]) -> list[SliceKey]:
        """After the first complete lists: every orphan."""
        self._seen = set(orphans)
        self._reported = set(self._seen)
        return sorted(self._seen)

    def check(self, orphans: Iterable[SliceKey]) -> list[SliceKey]:
        """The orphans of this check that were orphans at the previous one too and have not
        been reported since they became orphans."""
        current = set(orphans)
        new = (current & self._seen) - self._reported
        # A slice that found its Service is forgotten: orphaned again later, it is reported again.
        self._reported = (self._reported & current) | new
        self._seen = current
        return sorted(new)


_ORPHANS_LISTED = 20


def orphan_slices(store: Store) -> list[SliceKey]:
    """Slices whose Service kpng does not serve (missing, or ignored), sorted."""
    return sorted(k for k, sl in store.slices.items() if sl.service_key not in store.services)
