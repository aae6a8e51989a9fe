"""What a backend tells kpng's ``/healthz`` and ``/metrics`` of its syncs, when kpng cannot tell.

kpng times each ``apply`` and counts one that raises as a failed sync: for most backends that is
the truth. A backend that knows better (to-nft retries a refused transaction within one apply,
and a dry run programs nothing) declares ``BackendSpec(reports_syncs=True)`` and reports each
attempt through the ``SyncReporter`` its ``create`` is given.

A backend that programs a kernel also says what it alone can see: the services it left out (the
kernel refused them), and the moments another program changed its rules behind its back
(``diverged``), until a sync puts them back. ``/healthz`` fails while such a divergence lasts
longer than its timeout, so that a node is never silently wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kpng.model.cluster import ServiceKey


class SyncReporter(Protocol):
    """Given to every backend's constructor (``BackendSpec.create``); read by kpng only when the
    spec says ``reports_syncs``, but for ``refused`` and ``diverged``, which any backend may
    call."""

    def attempted(self, *, seconds: float, full: bool) -> None:
        """A sync took ``seconds``, whether it got through or not; ``full``: every service was
        rewritten (kube-proxy's full and partial sync durations)."""
        ...

    def failed(self) -> None:
        """A sync failed: the rules stayed as they were."""
        ...

    def synced(self, *, revision: int) -> None:
        """The rules of ``revision`` are in place, as of now (a divergence, if any, is over)."""
        ...

    def refused(self, services: Mapping[ServiceKey, str]) -> None:
        """After a sync: every service the kernel does not hold as the state asks, each with
        why (empty: none). Replaces what was said before."""
        ...

    def diverged(self, *, kind: str, detail: str) -> None:
        """The kernel no longer holds what was last applied: another program changed it.
        ``kind`` is a short word for what was found (``table``, ``chain``, ``rules``,
        ``elements``...), ``detail`` a sentence for the log and ``/healthz``. The next
        ``synced`` ends it and counts it as repaired."""
        ...


class NoReporting:
    """A ``SyncReporter`` that forgets: for a backend built outside kpng's feeding (a test, a
    client of its own)."""

    def attempted(self, *, seconds: float, full: bool) -> None:
        pass

    def failed(self) -> None:
        pass

    def synced(self, *, revision: int) -> None:
        pass

    def refused(self, services: Mapping[ServiceKey, str]) -> None:
        pass

    def diverged(self, *, kind: str, detail: str) -> None:
        pass
