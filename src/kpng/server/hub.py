"""The server's view of the store: one ClusterResolver shared by every node watcher."""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from kpng.model.messages import NO_TRIGGERS, ChangeTriggers, NodeFacts
from kpng.resolver.resolving import Changes, ClusterResolver, NodeView
from kpng.store import Store

log = logging.getLogger(__name__)

T = TypeVar("T")

TRIGGER_REVISIONS = 65_536
"""Revisions whose trigger times the hub keeps for watchers that have not answered them yet:
a watcher further behind loses the oldest (and their network programming times)."""


class Hub:
    """Follows the store into a ClusterResolver and wakes the watchers at each revision."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cluster = ClusterResolver()
        self.synced = False
        self.revision = 0
        self._updated = asyncio.Condition()
        self._triggers: list[tuple[int, ChangeTriggers]] = []
        """(revision, trigger times) of the revisions that have some, oldest first."""

    async def run(self) -> None:
        subscription = self.store.subscribe()
        try:
            async for delta in subscription:
                for name in delta.nodes:
                    self.cluster.set_node(name, self.store.nodes.get(name))
                for key in delta.services:
                    self.cluster.set_service(key, self.store.services.get(key))
                for sk in delta.slices:
                    self.cluster.set_slice(sk, self.store.slices.get(sk))
                if delta.triggers.V4 or delta.triggers.V6:
                    self._triggers.append((delta.revision, delta.triggers))
                    if len(self._triggers) > TRIGGER_REVISIONS:
                        del self._triggers[: TRIGGER_REVISIONS // 2]
                self.synced = True
                self.revision = delta.revision
                async with self._updated:
                    self._updated.notify_all()
        finally:
            subscription.close()

    async def wait_revision(self, after: int) -> int:
        """Wait until the synced store is past revision ``after``; return the new revision."""
        async with self._updated:
            await self._updated.wait_for(lambda: self.synced and self.revision > after)
        return self.revision

    async def next_change_set(
        self, view: NodeView, *, sent: NodeFacts | None
    ) -> tuple[Changes, NodeFacts, int]:
        """The view's next change set: what changed in its services, its node's facts (changed
        from ``sent`` or not), and the revision it is at. The first one (``sent`` is None) may
        change no service: an empty state."""
        seen = -1
        while True:
            seen = await self.wait_revision(seen)
            changes = view.resolve()
            facts = self.store.node_facts(view.node_name)
            if changes or facts != sent:
                return changes, facts, seen

    def triggers(self, *, after: int, upto: int) -> ChangeTriggers:
        """The trigger times of the revisions after ``after`` up to ``upto``."""
        log_ = self._triggers
        start = bisect.bisect_right(log_, after, key=_revision)
        found = NO_TRIGGERS
        for revision, triggers in log_[start:]:
            if revision > upto:
                break
            found = found.followed_by(triggers)
        return found


def _revision(entry: tuple[int, ChangeTriggers]) -> int:
    return entry[0]


FIRST_STATES_AT_ONCE = 32
"""First states a brain sends at once. Each one in flight holds its node's whole state as ops
and a batch or two of framed bytes (about 4 MB at 10,000 services x 10 endpoints): without a
bound, 500 watchers connecting together (a brain's restart) held 2 GB for as long as they took
to read, and the process kept that peak."""

FIRST_STATE_HOLD_S = 10.0
"""How long one first state may keep its turn: a watcher that does not read (its stream stuck
on flow control) lets the others through after this long, its memory then no longer bounded."""


class Turns:
    """At most ``size`` holders at once; a turn ends when its holder says so, or after
    ``hold_s``, whichever comes first."""

    def __init__(self, size: int = FIRST_STATES_AT_ONCE, hold_s: float = FIRST_STATE_HOLD_S):
        self._free = asyncio.Semaphore(size)
        self._hold_s = hold_s

    async def take(self) -> Callable[[], None]:
        """Wait for a turn; returns what ends it (safe to call more than once)."""
        await self._free.acquire()
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                timer.cancel()
                self._free.release()

        timer = asyncio.get_running_loop().call_later(self._hold_s, end)
        return end


class PayloadCache(Generic[T]):
    """Encoded payloads of the immutable values streams send, shared by every stream.

    Keyed by identity: node views of one class share their value objects, so a thousand
    watchers of one change encode each value once. An entry holds its value, so an id cannot be
    reused while cached; the oldest entries go first past ``size``.
    """

    def __init__(self, encode: Callable[[T], bytes], size: int = 262_144) -> None:
        self._encode = encode
        self._size = size
        self._cache: OrderedDict[int, tuple[T, bytes]] = OrderedDict()

    def __call__(self, value: T) -> bytes:
        entry = self._cache.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
        data = self._encode(value)
        self._cache[id(value)] = (value, data)
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return data
