"""Pausing Python's cyclic garbage collector around a step that allocates heavily without
awaiting: a helper for backends, which share the process's one collector with all of kpng, and
for to-local's resolver."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a step that allocates without awaiting.

    A full sync makes about a million small objects (tuples, dicts) that cannot form cycles;
    the collector's passes over the growing heap took a quarter of its time. Reference counting
    still frees everything, and the collector's next pass untracks most of what stays (tuples
    and dicts of strings).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
