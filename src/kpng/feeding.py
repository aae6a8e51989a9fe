"""Feeding backends: each at its own pace, each failing on its own, none ever partial.

A backend whose ``apply`` raises keeps what it last programmed (kpng does not touch it), is
logged, and is retried with backoff with a full resync (every service in ``updated``) of the
latest state. States that arrive meanwhile are coalesced: a slow or failing backend gets the
newest state with the union of what changed, never a backlog.

kpng's own machinery, beside the client library rather than in it: ``to-local`` and ``kpng
local`` feed their backends with a ``Fanout``, composite backends (``to-plugin``, a ``Feeder``
per plugin) and ``to-exec`` feed through a ``Feeder``, and ``/healthz`` and ``/metrics`` read
their stats. A backend author needs none of it: kpng feeds every backend this way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec

from kpng.client import Backend, Backoff, NodeState, ProxyMode
from kpng.errors import KpngError
from kpng.model.cluster import ServiceKey
from kpng.model.messages import NO_TRIGGERS, ServiceEndpoints

log = logging.getLogger(__name__)


_BUCKETS_S = tuple(0.001 * 2**i for i in range(15))


@dataclass
class FeederStats:
    """How a backend keeps up, for health checks and metrics (kpng's ``/healthz`` and
    ``/metrics`` read it). Monotonic times are ``time.monotonic()``; wall times ``time.time()``."""

    pending_since: float | None = None
    """Since when the backend has had a state to apply that it has not applied: the oldest such
    offer, kept across failed attempts; ``None`` when it is up to date or has been offered
    nothing yet (a source still listing is not the backend falling behind)."""
    applied_revision: int = 0
    """The revision of the last state the backend applied (0: none yet)."""
    applied_services: int = 0
    """The number of services in that state."""
    last_applied: float | None = None
    """Wall time of the last successful apply."""
    applies: int = 0
    apply_seconds: float = 0.0
    """Time spent in successful applies, in total (with ``applies``: the mean)."""
    last_apply_seconds: float = 0.0
    apply_buckets: list[int] = field(default_factory=lambda: [0] * len(_BUCKETS_S))
    """Successful applies that took at most each of ``BUCKETS_S`` (cumulative, as Prometheus
    histograms count), for percentiles of apply times."""

    BUCKETS_S: ClassVar[tuple[float, ...]] = _BUCKETS_S
    """Upper bounds of the apply-time histogram: 1 ms to 16 s, doubling, as kube-proxy's
    ``sync_proxy_rules_duration_seconds``."""
    failures: int = 0
    diverged_since: float | None = None
    """Monotonic time since when the backend has known that the kernel differs from what it
    applied (another program changed its rules), until a sync repairs it; None otherwise."""
    diverged_why: str = ""
    """What it found, for ``/healthz``."""


@dataclass
class Histogram:
    """Observations counted under each of ``bounds`` (cumulative, as Prometheus counts them)."""

    bounds: tuple[float, ...] = _BUCKETS_S
    buckets: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.buckets:
            self.buckets = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.buckets[i] += 1


SyncListener = Callable[[int, float], None]
"""Called with the revision whose rules are now in place, and the wall time they were."""


@dataclass
class SyncStats:
    """A backend's syncs in kube-proxy's terms (its ``sync_proxy_rules_*`` metrics); a
    ``kpng.client.SyncReporter``.

    The ``Feeder`` keeps these from each ``apply``, unless the backend's spec says it reports
    them itself (``reports_syncs``: to-nft, which alone knows when a transaction was refused and
    retried within one apply); it then reports into the same object, given to its constructor."""

    revision: int = 0
    """The revision whose rules are in place (0: none yet)."""
    last_synced: float | None = None
    """Wall time the rules were last brought up to date."""
    last_queued: float | None = None
    """Wall time a state was last queued for the backend."""
    failures: int = 0
    """Syncs that failed (the rules stayed as they were)."""
    full: Histogram = field(default_factory=Histogram)
    """Durations of full syncs (every service rewritten), failed ones included, as
    kube-proxy times every attempt."""
    partial: Histogram = field(default_factory=Histogram)
    """Durations of incremental syncs."""
    no_local_endpoints: dict[tuple[str, str], int] = field(default_factory=dict)
    """Service ports dropping traffic for want of a local endpoint, by (traffic policy:
    ``internal`` or ``external``, family: ``IPv4`` or ``IPv6``), in the state last given."""
    listeners: list[SyncListener] = field(default_factory=list)
    refused_services: dict[ServiceKey, str] = field(default_factory=dict)
    """The services the kernel does not hold as the last state asks, with why."""
    diverged_since: float | None = None
    """Monotonic time since when the kernel has been known to differ from what was applied."""
    diverged_why: str = ""
    drift_kinds: set[str] = field(default_factory=set)
    """What the divergence under way found: counted as repaired when it ends."""
    repairs: dict[str, int] = field(default_factory=dict)
    """Divergences repaired by a sync, by what was found (``table``, ``chain``...)."""

    def attempted(self, *, seconds: float, full: bool) -> None:
        (self.full if full else self.partial).observe(seconds)

    def failed(self) -> None:
        self.failures += 1

    def synced(self, *, revision: int, wall: float | None = None) -> None:
        """The rules of ``revision`` are in place since ``wall`` (default: now)."""
        wall = time.time() if wall is None else wall
        self.revision = revision
        self.last_synced = wall
        for kind in self.drift_kinds:
            self.repairs[kind] = self.repairs.get(kind, 0) + 1
        self.drift_kinds.clear()
        self.diverged_since = None
        self.diverged_why = ""
        for listener in self.listeners:
            listener(revision, wall)

    def refused(self, services: Mapping[ServiceKey, str]) -> None:
        self.refused_services = dict(services)

    def diverged(self, *, kind: str, detail: str) -> None:
        if self.diverged_since is None:
            self.diverged_since = time.monotonic()
            self.diverged_why = detail
        self.drift_kinds.add(kind)


def no_local_endpoints(se: ServiceEndpoints) -> Mapping[tuple[str, str], int]:
    """The ports of ``se`` whose traffic of a Local policy is dropped because this node has no
    endpoint for it while the service has some elsewhere (kube-proxy's
    ``sync_proxy_rules_no_local_endpoints_total``), by (policy, family). Pure."""
    service = se.service
    internal, external = service.InternalTrafficToLocal, service.ExternalTrafficToLocal
    if not (internal or external) or service.IPs is None:
        return {}
    found: dict[tuple[str, str], int] = {}
    ips = service.IPs
    for v6, family in ((False, "IPv4"), (True, "IPv6")):
        reachable = bool(
            (ips.ExternalIPs and ips.ExternalIPs.family(v6))
            or (ips.LoadBalancerIPs and ips.LoadBalancerIPs.family(v6))
        )
        by_port = _scopes_by_port(se, v6)
        for port in service.Ports:
            usable = port.UsableEndpoints
            if usable is None or not (usable.V6 if v6 else usable.V4):
                continue  # no endpoint anywhere: rejected, not dropped
            scopes = by_port.get((port.Name, port.Protocol), set())
            if internal and "internal" not in scopes:
                found[("internal", family)] = found.get(("internal", family), 0) + 1
            if external and (reachable or port.NodePort) and "external" not in scopes:
                found[("external", family)] = found.get(("external", family), 0) + 1
    return found


def _scopes_by_port(se: ServiceEndpoints, v6: bool) -> dict[tuple[str, str], set[str]]:
    """The scopes of the endpoints serving each port (name, protocol) in one family: one pass
    over the endpoints for every port, as a Service may have 20,000 ports."""
    served: dict[tuple[str, str], set[str]] = {}
    for ep in se.endpoints:
        if ep.Scopes is None or ep.IPs is None or not (ep.IPs.V6 if v6 else ep.IPs.V4):
            continue
        scopes = {"internal"} if ep.Scopes.Internal else set()
        if ep.Scopes.External:
            scopes.add("external")
        for po in ep.PortOverrides:
            served.setdefault((po.Name, po.Protocol), set()).update(scopes)
    return served


class Feeder:
    """One backend, fed the latest state offered to it.

    A failure the backend explains (a ``KpngError``: a plugin that refused a state, a kernel that
    refused a transaction) is logged as one line with its message; anything else with its
    traceback, as a bug. ``stats`` tells how it keeps up.
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        *,
        backoff: Backoff | None = None,
        sync: SyncStats | None = None,
        reports_syncs: bool = False,
        proxy_mode: ProxyMode = "nftables",
        once: bool = False,
    ) -> None:
        self.name = name
        self.proxy_mode = proxy_mode
        """The kube-proxy mode whose metrics its syncs are counted under (its spec's)."""
        self.once = once
        """A one-shot run (``--once``): the first failure is raised, as a ``KpngError`` naming
        the backend; nobody waits for a retry, and one that cannot succeed (no privilege)
        would retry forever."""
        self.backend = backend
        self.done = False
        self._backoff = backoff or Backoff.for_backends()
        self._latest: NodeState | None = None
        self._updated: set[ServiceKey] = set()
        self._deleted: set[ServiceKey] = set()
        self._triggers = NO_TRIGGERS
        self._resync = False
        self._offered = asyncio.Event()
        self._queued_at: float | None = None  # when the oldest state still queued was offered
        self.stats = FeederStats()
        self.reports_syncs = reports_syncs
        """The backend reports into ``sync`` itself: it says when its rules are in place."""
        self.sync = sync or SyncStats()
        self._no_local: dict[ServiceKey, Mapping[tuple[str, str], int]] = {}

    def offer(self, state: NodeState) -> None:
        """Queue ``state``, merged with any state not yet applied."""
        now = time.monotonic()
        self.sync.last_queued = time.time()
        if self._queued_at is None:
            self._queued_at = now
        if self.stats.pending_since is None:
            self.stats.pending_since = now
        self._latest = state
        self._updated.difference_update(state.deleted)
        self._deleted.difference_update(state.updated)
        self._updated.update(state.updated)
        self._deleted.update(state.deleted)
        self._triggers = self._triggers.followed_by(state.triggers)
        self._offered.set()

    def _take(self) -> NodeState:
        latest = self._latest
        assert latest is not None
        updated = frozenset(latest.services) if self._resync else frozenset(self._updated)
        state = msgspec.structs.replace(
            latest, updated=updated, deleted=frozenset(self._deleted), triggers=self._triggers
        )
        self._latest = None
        self._triggers = NO_TRIGGERS
        self._queued_at = None
        self._updated.clear()
        self._deleted.clear()
        self._offered.clear()
        return state

    async def feed_pending(self, *, stop_on_failure: bool = False) -> bool:
        """Apply what is queued, retrying with backoff until the backend takes a state (or,
        ``stop_on_failure``, returning False at the first failure, the state queued again for
        ``retry_later``); True once all is applied."""
        while self._latest is not None:
            full = self._resync or self.stats.applies == 0
            state = self._take()
            started = time.monotonic()
            try:
                self.done = bool(await self.backend.apply(state))
            except Exception as exc:
                self.stats.failures += 1
                if not self.reports_syncs:
                    self.sync.failed()
                    self.sync.attempted(seconds=time.monotonic() - started, full=full)
                if self.once:
                    raise self._given_up(state, exc) from exc
                self._log_failure(state, exc)
                if self._latest is None:
                    # A copy: the caller's mapping changes with its next state.
                    self.offer(msgspec.structs.replace(state, services=dict(state.services)))
                self._resync = True
                if stop_on_failure:
                    return False
                await self.until_retry_or_newer()
                continue
            self._record_applied(state, time.monotonic() - started, full=full)
            if self._resync:
                log.info("%s is applying states again (revision %d)", self.name, state.revision)
            self._resync = False
            self._backoff.reset()
        return True

    async def until_retry_or_newer(self) -> None:
        """Wait out the backoff, unless a newer state comes first: it may be what the backend
        can apply (the service it refused deleted), and it must not wait behind the retry."""
        self._offered.clear()
        waits = {
            asyncio.ensure_future(self._backoff.wait()),
            asyncio.ensure_future(self._offered.wait()),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        if self._latest is not None:
            self._offered.set()  # what is queued is due now

    def _record_applied(self, state: NodeState, seconds: float, *, full: bool) -> None:
        self._count_no_local_endpoints(state)
        wall = time.time()
        if not self.reports_syncs:
            self.sync.attempted(seconds=seconds, full=full)
            self.sync.synced(revision=state.revision, wall=wall)
        stats = self.stats
        # Still pending if a newer state arrived while this one was being applied.
        stats.pending_since = self._queued_at
        stats.applied_revision = state.revision
        stats.applied_services = len(state.services)
        stats.last_applied = wall
        stats.applies += 1
        stats.apply_seconds += seconds
        stats.last_apply_seconds = seconds
        for i, bound in enumerate(FeederStats.BUCKETS_S):
            if seconds <= bound:
                stats.apply_buckets[i] += 1

    def _count_no_local_endpoints(self, state: NodeState) -> None:
        """Kept per service and summed, so an apply costs what changed, not every service."""
        counts, per_service = self.sync.no_local_endpoints, self._no_local
        for key in state.deleted | state.updated:
            for label, n in per_service.pop(key, {}).items():
                counts[label] -= n
        for key in state.updated:
            found = no_local_endpoints(state.services[key])
            if found:
                per_service[key] = found
                for label, n in found.items():
                    counts[label] = counts.get(label, 0) + n

    def _given_up(self, state: NodeState, exc: Exception) -> KpngError:
        if not isinstance(exc, (KpngError, OSError)):
            log.error("%s failed to apply revision %d", self.name, state.revision, exc_info=exc)
        return KpngError(f"{self.name} failed to apply revision {state.revision}: {exc}")

    def _log_failure(self, state: NodeState, exc: Exception) -> None:
        if isinstance(exc, (KpngError, PermissionError)):
            log.warning(
                "%s failed to apply revision %d: %s; retrying with the whole state",
                self.name,
                state.revision,
                exc,
            )
        else:
            log.error(
                "%s failed to apply revision %d; it keeps its last state, retrying",
                self.name,
                state.revision,
                exc_info=exc,
            )

    async def run(self) -> None:
        """Feed offered states until the backend says it is done (or cancelled)."""
        while not self.done:
            await self._offered.wait()
            await self.feed_pending()


class Fanout:
    """Several backends behind one: each gets its own Feeder, task and copy of each state.

    With a single backend the state is applied inline, before the caller reads the next one:
    there is nothing to isolate it from, and the caller's source then coalesces states upstream.
    Once it fails, it is fed in the background like one of several: its retries never hold up
    the caller, and a newer state overtakes a retry.
    """

    def __init__(self, backends: Sequence[Feeder | tuple[str, Backend]]) -> None:
        """Each backend's own ``Feeder``, or its name and the backend, fed with defaults."""
        self.feeders = [b if isinstance(b, Feeder) else Feeder(*b) for b in backends]
        self._tasks: list[asyncio.Task[None]] = []
        self.all_done = asyncio.Event()
        self.failure: KpngError | None = None
        """Why a one-shot feeder fed in the background gave up (``until_done`` raises it)."""
        self.listeners: list[Callable[[NodeState], None]] = []
        """Told of each state before the backends get it (kpng's metrics time network
        programming from its triggers to the backends' syncs)."""

    async def apply(self, state: NodeState) -> bool:
        for listener in self.listeners:
            listener(state)
        if len(self.feeders) == 1 and not self._tasks:
            feeder = self.feeders[0]
            feeder.offer(state)
            if await feeder.feed_pending(stop_on_failure=True):
                if feeder.done:
                    self.all_done.set()
                return feeder.done
            self._tasks = [asyncio.create_task(self._retry(feeder), name=feeder.name)]
            return False
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(f), name=f.name) for f in self.feeders]
        # The caller's mapping changes with its next state; each backend keeps its own.
        snapshot = msgspec.structs.replace(state, services=dict(state.services))
        for feeder in self.feeders:
            if not feeder.done:
                feeder.offer(snapshot)
        return False

    async def _retry(self, feeder: Feeder) -> None:
        await feeder.until_retry_or_newer()
        await self._run(feeder)

    async def _run(self, feeder: Feeder) -> None:
        try:
            await feeder.run()
        except KpngError as exc:  # only a one-shot feeder's: the others retry
            self.failure = exc
            self.all_done.set()
            return
        if all(f.done for f in self.feeders):
            self.all_done.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for feeder in self.feeders:
            try:
                await feeder.backend.close()
            except Exception:
                log.exception("%s failed to close", feeder.name)


async def until_done(fanout: Fanout, work: Awaitable[None]) -> None:
    """Run ``work`` until it returns or every backend of ``fanout`` is done."""
    task = asyncio.ensure_future(work)
    done_waiter = asyncio.ensure_future(fanout.all_done.wait())
    try:
        await asyncio.wait({task, done_waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        if fanout.failure is not None:
            raise fanout.failure
    finally:
        for pending in (task, done_waiter):
            pending.cancel()
        await asyncio.gather(task, done_waiter, return_exceptions=True)
