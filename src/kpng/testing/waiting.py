"""Waiting for what other tasks or processes make true, always bounded: the one waiting helper
of kpng's tests, harnesses and benchmarks (blocking ``until``/``poll``, async ``eventually``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def eventually(
    condition: Callable[[], bool], what: str = "the condition", *, within: float = 15.0
) -> None:
    """Poll ``condition`` until it holds; fail after ``within`` seconds naming ``what``."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def poll(condition: Callable[[], bool], *, within: float, interval: float = 0.05) -> bool:
    """Poll ``condition``, blocking, until it holds or ``within`` seconds pass; whether it
    held."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def until(
    condition: Callable[[], bool],
    what: str = "the condition",
    *,
    within: float = 15.0,
    interval: float = 0.05,
    error: Callable[[str], Exception] = AssertionError,
) -> None:
    """``eventually`` for code outside an event loop; raises ``error`` naming ``what``."""
    if not poll(condition, within=within, interval=interval):
        raise error(f"timed out waiting for {what} ({within:g} s)")


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of the complete lines written to a file so far ([] before it exists).

    A line without its newline yet is left out: the writer, another process, may be in the
    middle of a large write, and a reader polling the file sees the prefix written so far.
    """
    if not path.exists():
        return []
    *complete, _partial = path.read_bytes().split(b"\n")
    return [json.loads(line) for line in complete if line]
