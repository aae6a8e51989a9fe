"""Python's cyclic garbage collector in kpng: its thresholds, and pausing it around a step that
allocates heavily without awaiting (the sources' parsing, to-local's resolver, and the
backends' syncs, which all share the process's one collector)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

THRESHOLDS = (100_000, 20, 100)
"""The collector's thresholds (``gc.set_threshold``) in a kpng process. Python's (700, 10, 10)
walk the young objects every 700 allocations, and each object alive then is walked again in
the older generations: a brain fanning a change out to 5,000 watchers makes some hundred
objects a watcher that live the second the fan-out takes, and spent 0.2 to 0.5 s of its CPU a
change collecting them (1,942 young, 176 middle and 15 full collections in one run); with
these, 12 in all, and 0.2 s less CPU a change (bench/bench_fanout.py). kpng makes few cycles,
so collecting them later costs little memory."""

FREEZE_AFTER = 100_000
"""Objects a step must have left behind for them to be frozen: a full sync, a list or a parse
of thousands of services leaves millions; a change, a few hundred."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a step that allocates without awaiting.

    A full sync makes about a million small objects (tuples, dicts) that cannot form cycles;
    the collector's passes over the growing heap took a quarter of its time. Reference counting
    still frees everything. What a big step leaves is the state kpng keeps (the store, the
    records, the table's contents), so it is frozen (``gc.freeze``) as the step ends: enabled
    again over it, the collector walked it all once more, 0.5 s of a 10,000-service start.

    Frozen objects are still freed by reference counting, but a cycle among them is never
    collected. These steps make none (but a few of msgspec's type caches, once). A freeze also
    takes whatever else is young then, though: garbage the event loop made while a step ran in
    a thread, say. So only a big step's objects are frozen (``FREEZE_AFTER``); a small step's
    are left to the collector, which then walks only them.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    young = gc.get_count()[0]  # up to a threshold's worth of others' objects: not the step's
    try:
        yield
    finally:
        if gc.get_count()[0] - young >= FREEZE_AFTER:
            gc.freeze()
        gc.enable()


def configure() -> None:
    """The collector's thresholds for a kpng process (``THRESHOLDS``). Called once, before
    kpng's work starts."""
    gc.set_threshold(*THRESHOLDS)
