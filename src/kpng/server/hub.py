"""The server's view of the store: one ClusterResolver shared by every node watcher."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from kpng.resolver.resolving import Changes, ClusterResolver, NodeView
from kpng.store import Store

log = logging.getLogger(__name__)

T = TypeVar("T")


class Hub:
    """Follows the store into a ClusterResolver and wakes the watchers at each revision."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cluster = ClusterResolver()
        self.synced = False
        self.revision = 0
        self._updated = asyncio.Condition()

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

    async def next_changes(self, view: NodeView, *, first: bool) -> Changes:
        """The view's next non-empty change set (the first one may be empty: an empty state)."""
        seen = -1
        while True:
            seen = await self.wait_revision(seen)
            changes = view.resolve()
            if changes or first:
                return changes


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
