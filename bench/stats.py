"""The order statistics the benches report, defined once: by nearest rank, as the notes quote
them (the smallest sample that a share ``q`` of the samples do not exceed)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The smallest sample that a share ``q`` of ``values`` do not exceed (NaN: none)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def p99(values: Sequence[float]) -> float:
    return nearest_rank(values, 0.99)


def median(values: Sequence[float]) -> float:
    """The median (NaN: no sample)."""
    return statistics.median(values) if values else math.nan
