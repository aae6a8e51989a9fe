"""The server's view of the store: one ClusterResolver shared by every node watcher."""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from kpng.logs import printable
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
        self._updated = asyncio.Event()
        """Set at the next revision, and replaced by a new one then. Not a Condition: each
        woken watcher would take its lock again, in turn (75 ms of CPU to wake 5,000 watchers,
        where an Event takes 42)."""
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
                self._updated.set()
                self._updated = asyncio.Event()
        finally:
            subscription.close()

    async def wait_revision(self, after: int) -> int:
        """Wait until the synced store is past revision ``after``; return the new revision."""
        while not (self.synced and self.revision > after):
            await self._updated.wait()
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

FIRST_STATE_STALL_S = 1.0
"""How long a first state's write may wait on its watcher before the turn passes on: a batch
(256 KiB) takes 0.2 s at 10 Mbit/s, so only a watcher slower than 2 Mbit/s, or not reading,
waits this long."""

FIRST_STATE_HOLD_S = 10.0
"""How long a first state may wait on its watcher in all: then the watch is ended, and the
memory of its first state freed."""

STALLED_FIRST_STATES = 32
"""First states kept in memory, past their turn, for watchers that stalled: slow readers
finish from there. When one more stalls, the one stuck longest is ended."""

ENDED_LOG_S = 10.0
"""Watches ended for not reading are logged once in this long: a peer can open them by the
hundred."""

_TICKS_PER_STALL = 4

Ended = Callable[[str], Awaitable[None]]
"""What ends a holder's watch from outside, with the reason to tell the watcher."""


class Turn:
    """One first state's turn. Its holder says when each write starts (``writing``) and
    completes (``wrote``), and ends it when the whole state is written (``end``)."""

    __slots__ = ("_turns", "ended", "parked", "pending", "stream_end", "ticks", "who")

    def __init__(self, turns: Turns, stream_end: Ended, who: str) -> None:
        self._turns = turns
        self.stream_end = stream_end
        self.who = who
        self.pending = False
        self.ticks = 0
        """Watchdog ticks the pending write has waited through."""
        self.parked = False
        self.ended = False

    def writing(self) -> None:
        self.pending = True

    def wrote(self) -> None:
        self.pending = False
        self.ticks = 0

    def end(self) -> None:
        """Give the turn back (safe to call more than once)."""
        self._turns._forget(self)


class Turns:
    """Turns at sending first states that watchers which do not read cannot keep.

    gRPC's asyncio server resumes a response generator only once the message it yielded has
    been taken by the transport, and a watcher that does not read stops that at its HTTP/2
    flow-control window (64 KiB unless it grows it): a write that does not complete is the one
    sign of a watcher not reading, and what is measured here. (A turn that merely lapsed, as
    before, let a non-reader keep its first state in memory forever and its turn for 10 s:
    200 of them held an honest watcher's first state back for 49 s.)

    At most ``size`` first states make progress at once. A holder whose write has waited
    ``stall_s`` is parked: its turn goes to the next watcher, its first state stays in memory
    so that a slow reader can finish it. At most ``stalled`` are parked; parking one more ends
    the watch stuck longest (the new one itself if the others are moving), and a write that
    waits ``hold_s`` ends its watch in any case. Ended watches get RESOURCE_EXHAUSTED once
    their pending write completes (kpng's watchers connect again): their first state's memory
    is freed at once, and gRPC keeps only that one pending message until the peer reads it or
    goes (its Python API cannot cancel a call from outside while a write is pending). So
    ``size + stalled`` first states at most are in memory, and a non-reader delays the others
    by ``stall_s / size``.

    Waits are counted in ticks of a watchdog (``stall_s / 4``), each tick at most its own
    period: an event loop too busy to run the watchdog is too busy to complete writes, and a
    brain short of CPU does not take its watchers for non-readers.
    """

    def __init__(
        self,
        size: int = FIRST_STATES_AT_ONCE,
        *,
        stall_s: float = FIRST_STATE_STALL_S,
        hold_s: float = FIRST_STATE_HOLD_S,
        stalled: int = STALLED_FIRST_STATES,
    ) -> None:
        self._free = asyncio.Semaphore(size)
        self._tick_s = stall_s / _TICKS_PER_STALL
        self._hold_s = hold_s
        self._hold_ticks = max(_TICKS_PER_STALL, round(hold_s / self._tick_s))
        self._stalled = stalled
        self._turns: dict[Turn, None] = {}
        """Every turn not ended, progressing or parked, in the order they were taken."""
        self._parked: dict[Turn, None] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._waiting: dict[object, float] = {}
        """Holders waiting for a turn, by when they began to (monotonic), oldest first."""
        self.ended = 0
        """Watches ended for not reading their first state."""
        self._quiet_until = -math.inf
        self._unlogged = 0

    @property
    def parked(self) -> int:
        return len(self._parked)

    @property
    def waiting(self) -> int:
        """Holders waiting for a turn."""
        return len(self._waiting)

    def oldest_wait(self, now: float) -> float:
        """How long the holder waiting longest has waited at monotonic time ``now`` (0: none)."""
        return now - next(iter(self._waiting.values()), now)

    async def take(self, stream_end: Ended, who: str = "") -> Turn:
        """Wait for a turn. ``stream_end`` ends the holder's watch, should it stall; ``who``
        names it in the log."""
        waiter = object()
        self._waiting[waiter] = time.monotonic()
        try:
            await self._free.acquire()
        finally:
            del self._waiting[waiter]
        turn = Turn(self, stream_end, who)
        self._turns[turn] = None
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.create_task(self._watch(), name="first-state turns")
        return turn

    async def close(self) -> None:
        """Stop the watchdog (the server has stopped: no turn is left to watch)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)

    def _forget(self, turn: Turn) -> None:
        if turn.ended:
            return
        turn.ended = True
        self._turns.pop(turn, None)
        if turn.parked:
            del self._parked[turn]
        else:
            self._free.release()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while self._turns:
            await asyncio.sleep(self._tick_s)
            for turn in list(self._turns):
                if turn.ended or not turn.pending:
                    continue
                turn.ticks += 1
                if turn.ticks >= self._hold_ticks:
                    await self._end(
                        turn, f"its first state was not read for {self._hold_s:g} s", loop
                    )
                elif not turn.parked and turn.ticks >= _TICKS_PER_STALL:
                    await self._park(turn, loop)

    async def _park(self, turn: Turn, loop: asyncio.AbstractEventLoop) -> None:
        victim: Turn | None = None
        if len(self._parked) >= self._stalled:
            # The first of the longest stuck: a parked one before the newcomer, on a tie.
            victim = max([*self._parked, turn], key=_ticks)
            if victim is turn:
                await self._end(turn, self._crowded(turn), loop)
                return
            self._forget(victim)  # its place, before the newcomer takes it
        self._parked[turn] = None
        turn.parked = True
        self._free.release()
        if victim is not None:
            await self._end(victim, self._crowded(victim), loop)

    def _crowded(self, turn: Turn) -> str:
        return (
            f"its first state was not read for {turn.ticks * self._tick_s:g} s, while "
            f"{self._stalled} other unread first states filled the server's memory for them"
        )

    async def _end(self, turn: Turn, why: str, loop: asyncio.AbstractEventLoop) -> None:
        self._forget(turn)
        self.ended += 1
        now = loop.time()
        if now >= self._quiet_until:
            more = f" ({self._unlogged} more ended since the last report)" if self._unlogged else ""
            log.warning(
                "ended the watch of %s: %s (it does not read its stream)%s",
                printable(turn.who),
                why,
                more,
            )
            self._quiet_until = now + ENDED_LOG_S
            self._unlogged = 0
        else:
            self._unlogged += 1
        try:
            await turn.stream_end(why)
        except Exception:  # the watchdog serves every turn: one failing watch must not stop it
            log.exception("could not end the watch of %s", printable(turn.who))


def _ticks(turn: Turn) -> int:
    return turn.ticks


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
