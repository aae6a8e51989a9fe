"""Jittered exponential backoff, for reconnecting watches and retrying backends."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable


class Backoff:
    """Jittered exponential backoff; ``sleep`` and ``random`` are injectable for tests."""

    def __init__(
        self,
        *,
        initial: float = 0.1,
        maximum: float = 10.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        random: Callable[[], float] = random.random,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self._sleep = sleep
        self._random = random
        self._next = initial

    def reset(self) -> None:
        self._next = self.initial

    def delay(self) -> float:
        """The next delay: doubling up to ``maximum``, each drawn from [50%, 100%] of it."""
        delay = self._next * (0.5 + self._random() / 2)
        self._next = min(self._next * 2, self.maximum)
        return delay

    async def wait(self) -> float:
        delay = self.delay()
        await self._sleep(delay)
        return delay
