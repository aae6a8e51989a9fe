"""The revisioned global store: sources write to it, sinks follow it."""

from kpng.store.storing import Delta, SourceHandle, Store, Subscription

__all__ = ["Delta", "SourceHandle", "Store", "Subscription"]
