"""What a backend adds to kpng's ``/metrics``: values in plain types, which ``kpng.status``
reads structurally (backends do not import kpng's status)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One value for ``/metrics``: the fields of ``kpng.status.Sample``."""

    name: str
    help: str
    value: float
    counter: bool = False
    labels: tuple[tuple[str, str], ...] = ()
