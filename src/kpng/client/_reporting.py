"""What a backend tells kpng's ``/healthz`` and ``/metrics`` of its syncs, when kpng cannot tell.

kpng times each ``apply`` and counts one that raises as a failed sync: for most backends that is
the truth. A backend that knows better (to-nft retries a refused transaction within one apply,
and a dry run programs nothing) declares ``BackendSpec(reports_syncs=True)`` and reports each
attempt through the ``SyncReporter`` its ``create`` is given.
"""

from __future__ import annotations

from typing import Protocol


class SyncReporter(Protocol):
    """Given to every backend's constructor (``BackendSpec.create``); read by kpng only when the
    spec says ``reports_syncs``."""

    def attempted(self, *, seconds: float, full: bool) -> None:
        """A sync took ``seconds``, whether it got through or not; ``full``: every service was
        rewritten (kube-proxy's full and partial sync durations)."""
        ...

    def failed(self) -> None:
        """A sync failed: the rules stayed as they were."""
        ...

    def synced(self, *, revision: int) -> None:
        """The rules of ``revision`` are in place, as of now."""
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
