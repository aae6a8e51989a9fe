"""What the brain's caches of each zone's base share: an entry per zone, and the services
changed in its base since the entry was last brought up to date. Pure.

A ``ClusterResolver`` keeps, per zone, the services as the zone's nodes see them (its base) and
says which changed through ``on_base_change``. The node digests (``resuming.BaseDigests``) and
the packed first states (``firststates.BaseFrames``) each cache something per zone and bucket,
made once and then redone only for the services that changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from kpng.model.cluster import ServiceKey

E = TypeVar("E")


class ZoneCaches(Generic[E]):
    """Entries made by ``make``, one per zone, following the bases through ``changed`` (a
    ``ClusterResolver.on_base_change`` listener)."""

    def __init__(self, make: Callable[[], E]) -> None:
        self._make = make
        self._zones: dict[str, tuple[E, set[ServiceKey]]] = {}

    def changed(self, zone: str, key: ServiceKey | None) -> None:
        """Service ``key`` changed in ``zone``'s base (None: the base is dropped, and with it
        the zone's entry)."""
        if key is None:
            self._zones.pop(zone, None)
            return
        held = self._zones.get(zone)
        if held is not None:
            held[1].add(key)

    def _take(self, zone: str) -> tuple[E, set[ServiceKey] | None]:
        """``zone``'s entry and the services changed in its base since the last take (None: a
        new entry, which every service of the base is to fill)."""
        held = self._zones.get(zone)
        if held is None:
            entry = self._make()
            self._zones[zone] = (entry, set())
            return entry, None
        entry, changed = held
        self._zones[zone] = (entry, set())
        return entry, changed
