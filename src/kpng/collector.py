"""Pausing Python's cyclic garbage collector around a step that allocates heavily without
awaiting: the sources' parsing, to-local's resolver, and the backends' syncs, which all share
the process's one collector."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a step that allocates without awaiting.

    A full sync makes about a million small objects (tuples, dicts) that cannot form cycles;
    the collector's passes over the growing heap took a quarter of its time. Reference counting
    still frees everything. What stays is the state kpng keeps (the store, the records, the
    table's contents), so it is frozen (``gc.freeze``) as the step ends: enabled again over it,
    the collector walked it all once more, 0.5 s of a 10,000-service start. Frozen objects are
    still freed by reference counting; only a cycle made in the step would never be collected,
    and these steps make none but a few of msgspec's type caches, once (some 80 objects).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
