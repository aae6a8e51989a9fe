"""``Status``: what ``/healthz``, ``/livez``, ``/metrics`` and ``/debug/...`` read, gathered as
it happens (the store's revisions, the states given to the backends, their syncs) or read when
asked (the feeders' stats, the backends' reports), and kube-proxy's counters kept from it."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kpng.client import NodeState
from kpng.feeding import Fanout, Feeder, FeederStats, Histogram, SyncStats
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ChangeTriggers
from kpng.status.frames import where_running
from kpng.status.health import BUSY_SHOWN_S, Busy, Verdict, judge
from kpng.status.reports import FeedsOthers, Reconciles, ReportsSamples, Sample, Sampled
from kpng.store import Published, Store

FAMILIES = ("IPv4", "IPv6")
"""kube-proxy's ``ip_family`` label values. kpng's ``inet`` table serves both families in one
transaction, as kube-proxy's two proxiers do on a kernel with IPv6: each sync counts for both."""

PROGRAMMING_BUCKETS_S = (
    0.25,
    0.5,
    *(float(s) for s in range(1, 60)),
    *(float(s) for s in range(60, 120, 5)),
    *(float(s) for s in range(120, 330, 30)),
)
"""kube-proxy's buckets of ``network_programming_duration_seconds``: 0.25 s, 0.5 s, each second to
59 s, each 5 s to 115 s, each 30 s to 5 min."""

LEDGER_LIMIT = 100_000
"""Revisions kept waiting for the backends: past this (backends stuck for that many changes)
the oldest are forgotten, and with them their change counts and network programming times."""


@dataclass
class ProxyCounters:
    """kube-proxy's metrics that count events as they happen (the rest are read when scraped)."""

    service_changes: int = 0
    endpoint_changes: int = 0
    """Services and EndpointSlices that changed, counted once per revision that changed them."""
    service_changes_pending: int = 0
    endpoint_changes_pending: int = 0
    """Of those, the ones whose revision some backend has not applied yet."""
    programming: dict[str, Histogram] = field(
        default_factory=lambda: {f: Histogram(PROGRAMMING_BUCKETS_S) for f in FAMILIES}
    )
    """By family: from each EndpointSlice change's trigger time to the moment every backend had
    its rules in place."""
    healthz: collections.Counter[int] = field(default_factory=collections.Counter)
    livez: collections.Counter[int] = field(default_factory=collections.Counter)
    """Answers of ``/healthz`` and ``/livez``, by HTTP status."""


@dataclass
class Status:
    timeout: float
    """How long a state may wait unapplied before kpng is unhealthy."""
    store: Store | None = None
    """The brain's store; ``None`` for ``kpng local``, whose source is a remote kpng."""
    node: str | None = None
    """The node whose rules this kpng programs (``to-local``): its draining drains kpng too."""
    nodes_listed: bool = False
    """The source lists every node (``kpng kube``): one it does not list does not exist."""
    fanouts: list[Fanout] = field(default_factory=list)
    samplers: list[Callable[[], Iterable[Sample]]] = field(default_factory=list)
    """What other parts (the to-api server) report, read at each scrape."""
    counters: ProxyCounters = field(default_factory=ProxyCounters)
    conntrack: Mapping[str, Reconciles] = field(default_factory=dict)
    """The backends' UDP conntrack reconciliations by ``ip_family``, for the whole process (the
    CLI gives the backends' shared record; a family is there once reconciled)."""
    draining: bool = False
    """The node was draining in the last state given to the backends: what ``kpng local``,
    which has no store, knows of it (from the brain)."""
    last_state: NodeState | None = None
    """The last node-local state given to the backends (``/debug/state``)."""
    explain: Callable[[str, ServiceKey], bytes] | None = None
    """Answers ``/debug/explain`` for a node and a Service, as ``kpng explain -o json``: given
    by the CLI when this kpng holds the global state (not behind a remote brain)."""
    started: float = field(default_factory=time.time)
    """Wall time kpng started: older trigger times are not this kpng's to time (as kube-proxy)."""
    loop_beat: float | None = None
    """When the pipeline's event loop last ran (monotonic), as the HTTP server's beat says."""
    _loop_thread: int | None = None
    _ledger: collections.deque[Published] = field(default_factory=collections.deque)
    """The store's revisions not yet applied by every backend, oldest first."""
    _triggered: collections.deque[tuple[int, ChangeTriggers]] = field(
        default_factory=collections.deque
    )
    """The states given to the backends, with the trigger times they carry, that not every
    backend has applied yet, oldest first: in process and behind a remote brain alike."""

    def __setattr__(self, name: str, value: Any) -> None:
        # The CLI gives the store after building Status; changes are counted from then on.
        super().__setattr__(name, value)
        if name == "store" and isinstance(value, Store):
            value.listeners.append(self._published)

    def track(self, fanout: Fanout) -> Fanout:
        self.fanouts.append(fanout)
        fanout.listeners.append(self._offered)
        for feeder in fanout.feeders:
            feeder.sync.listeners.append(self._synced)
        return fanout

    @property
    def direct(self) -> list[Feeder]:
        """The backends fed directly (those whose rules are the node's)."""
        return [feeder for fanout in self.fanouts for feeder in fanout.feeders]

    @property
    def syncs(self) -> list[SyncStats]:
        """The sync stats of the backends fed directly."""
        return [feeder.sync for feeder in self.direct]

    def _published(self, published: Published) -> None:
        counters = self.counters
        counters.service_changes += published.services
        counters.endpoint_changes += published.slices
        counters.service_changes_pending += published.services
        counters.endpoint_changes_pending += published.slices
        self._ledger.append(published)
        if len(self._ledger) > LEDGER_LIMIT:
            self._forget(self._ledger.popleft())

    def _offered(self, state: NodeState) -> None:
        self.last_state = state
        self.draining = state.draining
        triggers = state.triggers
        if triggers.V4 or triggers.V6:
            self._triggered.append((state.revision, triggers))
            if len(self._triggered) > LEDGER_LIMIT:
                self._triggered.popleft()

    def _synced(self, _: int, wall: float) -> None:
        """A backend has its rules in place: the revisions every backend now has are done."""
        done = min(sync.revision for sync in self.syncs)
        ledger = self._ledger
        while ledger and ledger[0].revision <= done:
            self._forget(ledger.popleft())
        triggered = self._triggered
        while triggered and triggered[0][0] <= done:
            triggers = triggered.popleft()[1]
            for family, times in zip(FAMILIES, (triggers.V4, triggers.V6), strict=True):
                for time_ in times:
                    if time_ > self.started:
                        self.counters.programming[family].observe(max(0.0, wall - time_))

    def _forget(self, published: Published) -> None:
        self.counters.service_changes_pending -= published.services
        self.counters.endpoint_changes_pending -= published.slices

    def samples(self) -> Iterator[Sampled]:
        """What other parts (``samplers``) and the backends (``ReportsSamples``) report."""
        for sampler in self.samplers:
            yield from sampler()
        for feeder in self.feeders():
            if isinstance(feeder.backend, ReportsSamples):
                yield from feeder.backend.metric_samples()

    def fanout_names(self) -> list[str]:
        """The backends fed directly, in command-line order (``to-nft``, ``to-plugin``...)."""
        return [feeder.name for fanout in self.fanouts for feeder in fanout.feeders]

    def feeders(self) -> list[Feeder]:
        """Every feeder, those of composite backends' own feeders included."""
        found: list[Feeder] = []
        pending = [f for fanout in self.fanouts for f in fanout.feeders]
        while pending:
            feeder = pending.pop(0)
            found.append(feeder)
            if isinstance(feeder.backend, FeedsOthers):
                pending.extend(feeder.backend.feeders)
        return found

    @property
    def backends(self) -> Mapping[str, FeederStats]:
        """Every feeder's stats by name, those of composite backends' own feeders included."""
        return {feeder.name: _with_backend_stats(feeder) for feeder in self.feeders()}

    @property
    def sources_synced(self) -> bool:
        return self.store is None or self.store.synced

    @property
    def node_eligible(self) -> bool:
        """False while this node is being deleted or about to be (``Node.Draining``), or does
        not exist (as kube-proxy's). Manifests need not list nodes: with none listed, an unknown
        node is eligible. Behind a remote brain (no store), as the brain last said."""
        if self.store is None:
            return not self.draining
        if self.node is None:
            return True
        node = self.store.nodes.get(self.node)
        if node is None:
            return not (self.nodes_listed or self.store.nodes)
        return not node.Draining

    def verdict(self, backends: Mapping[str, FeederStats] | None = None) -> Verdict:
        """The verdict now; ``backends``, when the caller has just read them, spares a second
        walk over the feeders."""
        now = time.monotonic()
        return judge(
            backends=self.backends if backends is None else backends,
            sources_synced=self.sources_synced,
            node_eligible=self.node_eligible,
            timeout=self.timeout,
            monotonic=now,
            wall=time.time(),
            blocked=self.blocked,
            busy=self._busy(now),
        )

    def watch_loop(self, thread: int) -> None:
        """The pipeline's loop runs on ``thread`` and beats (``loop_beat``) from now on: the
        verdict, read on another thread, tells how long it has not run, and where it is."""
        self._loop_thread, self.loop_beat = thread, time.monotonic()

    def _busy(self, now: float) -> Busy | None:
        if self.loop_beat is None or now - self.loop_beat < BUSY_SHOWN_S:
            return None
        return Busy(now - self.loop_beat, where_running(self._loop_thread))

    @property
    def blocked(self) -> list[str]:
        """Why sources cannot sync, when they know: ``source NAME: REASON``."""
        if self.store is None:
            return []
        return [f"source {s.name}: {s.blocked_by}" for s in self.store.sources if s.blocked_by]


def _with_backend_stats(feeder: Feeder) -> FeederStats:
    """The feeder's stats, completed by what the backend says of a divergence of the kernel,
    and, for one keeping its own ``SyncStats`` (to-nft), of when its rules were last in place."""
    stats, sync = feeder.stats, feeder.sync
    if sync.diverged_since is not None:
        stats = dataclasses.replace(
            stats, diverged_since=sync.diverged_since, diverged_why=sync.diverged_why
        )
    if not feeder.reports_syncs:
        return stats
    return dataclasses.replace(stats, last_applied=sync.last_synced, applied_revision=sync.revision)
