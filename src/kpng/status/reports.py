"""What other parts of kpng give ``/metrics`` and ``/debug/rules`` without importing kpng's
status: the protocols a backend meets structurally (``ShowsRules``, ``ReportsSamples``,
``FeedsOthers``; the backends' conntrack record, ``Reconciles``), and ``Sample``, a value to
report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kpng.feeding import Feeder


@runtime_checkable
class FeedsOthers(Protocol):
    """A backend that feeds other backends, each through its own Feeder (to-plugin, a Feeder
    per plugin): each is reported on its own, so one that keeps failing cannot hide."""

    @property
    def feeders(self) -> list[Feeder]: ...


@runtime_checkable
class ShowsRules(Protocol):
    """A backend that programs the kernel and can show what it left there (``/debug/rules``)."""

    async def applied_rules(self) -> str: ...


class Sampled(Protocol):
    """What ``/metrics`` reads of a sample: ``Sample``'s fields. A backend, which does not
    import kpng's status, gives objects of its own that have them."""

    @property
    def name(self) -> str: ...
    @property
    def help(self) -> str: ...
    @property
    def value(self) -> float: ...
    @property
    def counter(self) -> bool: ...
    @property
    def labels(self) -> tuple[tuple[str, str], ...]: ...


class Reconciles(Protocol):
    """What ``/metrics`` reads of one family's UDP conntrack reconciliations (kube-proxy's
    conntrack reconciler): their durations as a histogram counts them, and the flows deleted.
    The backends' shared conntrack module (which does not import kpng's status) keeps them."""

    @property
    def bounds(self) -> tuple[float, ...]: ...
    @property
    def buckets(self) -> list[int]: ...
    @property
    def count(self) -> int: ...
    @property
    def sum(self) -> float: ...
    @property
    def deleted(self) -> int: ...


@runtime_checkable
class ReportsSamples(Protocol):
    """A backend with figures of its own for ``/metrics`` (to-ebpf: its programs' counters
    and its maps' occupancy), read at each scrape."""

    def metric_samples(self) -> Iterable[Sampled]: ...


@dataclass(frozen=True)
class Sample:
    """One value a part of kpng reports for ``/metrics``, in plain types (``exposition.py``
    writes them as Prometheus' text)."""

    name: str
    help: str
    value: float
    counter: bool = False
    labels: tuple[tuple[str, str], ...] = ()
