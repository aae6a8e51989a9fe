"""The C heap's free memory given back to the kernel, once a minute.

glibc keeps what the process frees for its next allocations, and under churn the freed chunks
end up scattered between live ones, where glibc never returns them by itself: ``malloc_trim``
hands back every whole free page, where it lies. Measured: a brain with 1,000 idle watchers of
10,000 services kept 929 MB after their first states, 505 MB with this; ``kpng kube ... to-nft``
under the soak's churn (bench/soak.py) held 95 MiB at 10 minutes where it held 110. It lowers
the level, not the slope: the soak's slow growth is that free-but-held memory, and continues.
Other C libraries (musl) have no such call: there this does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).malloc_trim
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def trim() -> bool:
    """Give the heap's free pages back to the kernel; whether this C library can."""
    function = _malloc_trim()
    if function is None:
        return False
    function(0)
    return True


async def trim_periodically(every_s: float = TRIM_EVERY_S) -> None:
    """``trim`` every ``every_s`` seconds until cancelled, in a thread: on a brain's
    gigabytes it takes milliseconds the event loop need not wait for."""
    if _malloc_trim() is None:
        log.debug("no malloc_trim in this C library: the heap is not trimmed")
        await asyncio.Event().wait()
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(trim)
