"""The C heap: large buffers kept out of it, and its free memory given back once a minute.

glibc serves a request of at least M_MMAP_THRESHOLD bytes with a mapping of its own, unmapped
when freed; but by default it raises that threshold to the size of each such mapping freed, up
to 32 MiB, so after kpng's first large buffer (a relist's body, a transaction's text, a batch of
framed bytes) every later one up to that size is carved from the heap, where it leaves holes
between live chunks that glibc keeps. ``configure`` fixes the threshold at 128 KiB (glibc's
starting value), which turns that adjustment off, and caps the arenas at two: each thread's
first allocation otherwise makes an arena with holes of its own, and kpng's few threads
(libnftables' calls, the gRPC server's) are not contended. Under the soak's churn
(bench/soak.py, ``kpng kube ... to-nft``, 60 minutes) the heap's free-but-held memory grew from
22 to 25 MiB and RSS by 5.1 %/h without it; with it, free-but-held stays near 5 MiB and RSS
levels off after the first churn wave.

``malloc_trim`` hands back every whole free page of the heap, where it lies: a brain with 1,000
idle watchers of 10,000 services kept 929 MB after their first states, 505 MB with it. Other C
libraries (musl) have neither call: there both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 60.0
MMAP_THRESHOLD = 128 * 1024
ARENAS = 2
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's malloc.h


@functools.cache
def _libc() -> ctypes.CDLL | None:
    # The process' own symbols, the C library's among them: ctypes.util.find_library("c") ran
    # ldconfig in a subprocess at every start for the same answer.
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return _function("malloc_trim", [ctypes.c_size_t])


def _function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """``name`` of the C library, typed; None where it has no such function."""
    function = getattr(_libc(), name, None)
    if function is not None:
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def configure() -> bool:
    """Large buffers in mappings of their own, and at most ``ARENAS`` arenas (glibc's
    ``mallopt``); whether this C library took both. Called once, before kpng's work starts."""
    mallopt = _function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is None:
        return False
    threshold = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    arenas = mallopt(_M_ARENA_MAX, ARENAS)
    return bool(threshold and arenas)


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
