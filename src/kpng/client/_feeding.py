"""Feeding backends: each at its own pace, each failing on its own, none ever partial.

A backend whose ``apply`` raises keeps what it last programmed (kpng does not touch it), is
logged, and is retried with backoff with a full resync (every service in ``updated``) of the
latest state. States that arrive meanwhile are coalesced: a slow or failing backend gets the
newest state with the union of what changed, never a backlog.

This lives in the client library because composite backends need it too: ``to-plugin`` feeds
each of its plugins through its own ``Feeder``, exactly as ``to-local`` feeds its backends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec

from kpng.client._backoff import Backoff
from kpng.client._state import Backend, NodeState
from kpng.errors import KpngError
from kpng.model.cluster import ServiceKey

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


class Feeder:
    """One backend, fed the latest state offered to it.

    A failure the backend explains (a ``KpngError``: a plugin that refused a state, a kernel that
    refused a transaction) is logged as one line with its message; anything else with its
    traceback, as a bug. ``stats`` tells how it keeps up.
    """

    def __init__(self, name: str, backend: Backend, *, backoff: Backoff | None = None) -> None:
        self.name = name
        self.backend = backend
        self.done = False
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self._latest: NodeState | None = None
        self._updated: set[ServiceKey] = set()
        self._deleted: set[ServiceKey] = set()
        self._resync = False
        self._offered = asyncio.Event()
        self._queued_at: float | None = None  # when the oldest state still queued was offered
        self.stats = FeederStats()

    def offer(self, state: NodeState) -> None:
        """Queue ``state``, merged with any state not yet applied."""
        now = time.monotonic()
        if self._queued_at is None:
            self._queued_at = now
        if self.stats.pending_since is None:
            self.stats.pending_since = now
        self._latest = state
        self._updated.difference_update(state.deleted)
        self._deleted.difference_update(state.updated)
        self._updated.update(state.updated)
        self._deleted.update(state.deleted)
        self._offered.set()

    def _take(self) -> NodeState:
        latest = self._latest
        assert latest is not None
        updated = frozenset(latest.services) if self._resync else frozenset(self._updated)
        state = msgspec.structs.replace(latest, updated=updated, deleted=frozenset(self._deleted))
        self._latest = None
        self._queued_at = None
        self._updated.clear()
        self._deleted.clear()
        self._offered.clear()
        return state

    async def feed_pending(self) -> None:
        """Apply what is queued, retrying with backoff until the backend takes a state."""
        while self._latest is not None:
            state = self._take()
            started = time.monotonic()
            try:
                self.done = bool(await self.backend.apply(state))
            except Exception as exc:
                self.stats.failures += 1
                self._log_failure(state, exc)
                if self._latest is None:
                    self.offer(state)
                self._resync = True
                await self._backoff.wait()
                continue
            self._record_applied(state, time.monotonic() - started)
            if self._resync:
                log.info("%s is applying states again (revision %d)", self.name, state.revision)
            self._resync = False
            self._backoff.reset()

    def _record_applied(self, state: NodeState, seconds: float) -> None:
        stats = self.stats
        # Still pending if a newer state arrived while this one was being applied.
        stats.pending_since = self._queued_at
        stats.applied_revision = state.revision
        stats.applied_services = len(state.services)
        stats.last_applied = time.time()
        stats.applies += 1
        stats.apply_seconds += seconds
        stats.last_apply_seconds = seconds
        for i, bound in enumerate(FeederStats.BUCKETS_S):
            if seconds <= bound:
                stats.apply_buckets[i] += 1

    def _log_failure(self, state: NodeState, exc: Exception) -> None:
        if isinstance(exc, KpngError):
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
    """

    def __init__(self, backends: Sequence[tuple[str, Backend]]) -> None:
        self.feeders = [Feeder(name, backend) for name, backend in backends]
        self._tasks: list[asyncio.Task[None]] = []
        self.all_done = asyncio.Event()

    async def apply(self, state: NodeState) -> bool:
        if len(self.feeders) == 1:
            feeder = self.feeders[0]
            feeder.offer(state)
            await feeder.feed_pending()
            if feeder.done:
                self.all_done.set()
            return feeder.done
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._run(f), name=f.name) for f in self.feeders]
        # The caller's mapping changes with its next state; each backend keeps its own.
        snapshot = msgspec.structs.replace(state, services=dict(state.services))
        for feeder in self.feeders:
            if not feeder.done:
                feeder.offer(snapshot)
        return False

    async def _run(self, feeder: Feeder) -> None:
        await feeder.run()
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
