"""The revisioned global store: sources write to it, sinks follow it."""

from kpng.store.storing import (
    Delta,
    Published,
    SourceCounter,
    SourceHandle,
    Store,
    Subscription,
)

__all__ = ["Delta", "Published", "SourceCounter", "SourceHandle", "Store", "Subscription"]
