"""kpng run in process against an API server, with a backend that records what it is given.

    async with KpngUnderTest.start(kubeconfig, node_name="n1") as kpng:
        await kpng.wait_for(lambda view: "ns/web" in view, within=10)

``view`` is the node-local state reduced to ``{"namespace/name": (endpoint IPs...)}``, what most
assertions need; ``kpng.states`` keeps every NodeState the backend received.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kpng.backends.registry import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.sinks.local import run_local
from kpng.sources.kube.reflector import ReflectorSettings
from kpng.sources.kube.source import KubeOptions, KubeSource
from kpng.store import Store

View = dict[str, tuple[str, ...]]


def view_of(services: Mapping[ServiceKey, ServiceEndpoints], namespace: str | None = None) -> View:
    """``{"namespace/name": sorted endpoint IPs}`` of a node-local state."""
    view: View = {}
    for (ns, name), entry in services.items():
        if namespace is not None and ns != namespace:
            continue
        ips: list[str] = []
        for ep in entry.endpoints:
            if ep.IPs is not None:
                ips.extend(ep.IPs.V4)
                ips.extend(ep.IPs.V6)
        view[f"{ns}/{name}"] = tuple(sorted(set(ips)))
    return view


class RecordingBackend:
    """A to-local backend that keeps every state it is handed and wakes waiters."""

    def __init__(self) -> None:
        self.states: list[NodeState] = []
        self.applied_at: list[float] = []
        self.changed = asyncio.Event()

    async def apply(self, state: NodeState) -> bool:
        # `services` is live (it changes after apply returns): keep a copy.
        self.states.append(msgspec.structs.replace(state, services=dict(state.services)))
        self.applied_at.append(time.monotonic())
        self.changed.set()
        return False

    async def close(self) -> None:
        pass


@dataclass
class KpngUnderTest:
    store: Store
    source: KubeSource
    backend: RecordingBackend
    namespace: str | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls,
        kubeconfig: Path,
        *,
        node_name: str = "n1",
        namespace: str | None = None,
        proxy_name: str | None = None,
        settings: ReflectorSettings | None = None,
        orphan_check_s: float = 30.0,
    ) -> AsyncIterator[KpngUnderTest]:
        store = Store()
        source = KubeSource(
            store,
            KubeOptions(
                kubeconfig=kubeconfig,
                proxy_name=proxy_name,
                settings=settings or ReflectorSettings(),
                node_name=node_name,
                orphan_check_s=orphan_check_s,
            ),
        )
        backend = RecordingBackend()
        kpng = cls(store, source, backend, namespace)
        kpng.tasks = [
            asyncio.create_task(source.run(), name="kube source"),
            asyncio.create_task(run_local(store, node_name=node_name, backend=backend)),
        ]
        try:
            yield kpng
        finally:
            for task in kpng.tasks:
                task.cancel()
            await asyncio.gather(*kpng.tasks, return_exceptions=True)

    @property
    def view(self) -> View:
        """The latest node-local state (of ``namespace`` if set); {} before the first."""
        if not self.backend.states:
            return {}
        return view_of(self.backend.states[-1].services, self.namespace)

    async def wait_for(self, predicate: Callable[[View], bool], within: float = 15.0) -> View:
        """The first view (the current one included) that satisfies ``predicate``."""
        deadline = time.monotonic() + within
        while True:
            for task in self.tasks:
                if task.done():
                    task.result()  # a failure of kpng itself is the test's failure
                    raise AssertionError(f"{task.get_name()} ended")
            view = self.view
            if self.backend.states and predicate(view):
                return view
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"not so after {within} s; the last view: {view}")
            self.backend.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.backend.changed.wait(), min(remaining, 0.5))
