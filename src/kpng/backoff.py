"""Jittered exponential backoff, for reconnecting watches and retrying backends."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any


class Backoff:
    """Jittered exponential backoff, kpng's one policy for every retry: the nominal delay starts
    at ``initial`` and grows by ``factor`` up to ``maximum``; each delay is drawn between
    ``spread[0]`` and ``spread[1]`` times the nominal one, so that many clients do not retry in
    step. ``sleep`` and ``random`` are injectable for tests."""

    def __init__(
        self,
        *,
        initial: float = 0.1,
        maximum: float = 10.0,
        factor: float = 2.0,
        spread: tuple[float, float] = (0.5, 1.0),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        random: Callable[[], float] = random.random,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.spread = spread
        self._sleep = sleep
        self._random = random
        self._next = initial

    @classmethod
    def for_backends(cls, **overrides: Any) -> Backoff:
        """How kpng retries a backend that failed (a Feeder, to-exec's program, a plugin's
        session, to-nft's kernel): 0.5 s doubling to 30 s."""
        return cls(**{"initial": 0.5, "maximum": 30.0, **overrides})

    def reset(self) -> None:
        self._next = self.initial

    def delay(self) -> float:
        """The next delay (and one more step towards ``maximum``)."""
        low, high = self.spread
        delay = self._next * (low + (high - low) * self._random())
        self._next = min(self._next * self.factor, self.maximum)
        return delay

    async def wait(self) -> float:
        delay = self.delay()
        await self._sleep(delay)
        return delay
