"""Per-Service traffic counters for ``/metrics`` (``--traffic-counters service``).

The counters are those of the dispatch maps' elements (``layout.COUNTED_KINDS``): each element
counts the new connections to its frontend (a ClusterIP, external or LB IP, or node port, with
protocol and port), which its verdict either sends to endpoints or refuses (``goto reject`` or
``drop``). kpng reads them with one netlink dump per counted map (``READ_PERIOD_S``, under the
sync lock, in a thread) and sums them per service port, named by the element's comment, which
kpng writes anyway (``namespace/name:port``).

A counter the kernel holds restarts from zero whenever its element is written again: a full
sync writes every element, an incremental one those whose verdict (the endpoint count...)
changed. kpng knows which (``replaced``), and also takes a counter found lower than last read
as restarted; either way the last value read is added to the service port's offset, so that
what ``/metrics`` shows only goes up (Prometheus' counter semantics). The connections an element
counted between its last read and its rewrite are lost: at most ``READ_PERIOD_S`` of them.

At most ``series_limit`` service ports are exposed, those with the most connections (refused
ones included); ``kpng_service_traffic_series_dropped`` says how many were left out.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from kpng.backends._nftables.layout import REFUSING, ElementKey

READ_PERIOD_S = 10.0
"""How often the kernel's counters are read: a scrape shows them as of the last read."""
SERIES_LIMIT = 10_000

CONNECTIONS = "kpng_service_connections_total"
REJECTED = "kpng_service_rejected_total"
DROPPED = "kpng_service_traffic_series_dropped"
SERVICE_PORTS = "kpng_service_traffic_service_ports"
LABELS = ("namespace", "service", "port")


@dataclass(frozen=True)
class Sample:
    """One value for ``/metrics``: the fields of ``kpng.status.Sample`` (backends do not import
    kpng's status)."""

    name: str
    help: str
    value: float
    counter: bool = False
    labels: tuple[tuple[str, str], ...] = ()


@dataclass
class _Read:
    """What an element counted when last read, and whose it was then."""

    port: str
    """The service port: the element's comment."""
    refused: bool
    packets: int


class TrafficCounters:
    """The kernel's element counters as monotonic per-service-port totals (pure: the backend
    reads the kernel and says which elements it rewrote)."""

    def __init__(self, series_limit: int = SERIES_LIMIT) -> None:
        self.series_limit = series_limit
        self._reads: dict[ElementKey, _Read] = {}
        self._offsets: dict[str, list[int]] = {}
        """Per service port, [connections, refused] of counters that restarted or went."""
        self._rewritten: set[ElementKey] = set()
        self._all_rewritten = False
        self._totals: dict[str, tuple[int, int]] = {}
        self._samples = self._exposed()

    def replaced(self, changed: Iterable[ElementKey] | None) -> None:
        """The kernel took a transaction that wrote these counted elements again (None: all
        of them, a full sync): their counters restarted."""
        if changed is None:
            self._all_rewritten = True
            self._rewritten.clear()
        elif not self._all_rewritten:
            self._rewritten.update(changed)

    def take_rewritten(self) -> set[ElementKey] | None:
        """The elements rewritten since the last call (None: all of them), for the ``fold``
        of a read made now."""
        rewritten = None if self._all_rewritten else self._rewritten
        self._rewritten, self._all_rewritten = set(), False
        return rewritten

    def fold(
        self,
        counts: Iterable[tuple[ElementKey, int]],
        applied: Mapping[ElementKey, tuple[str, ...]],
        comments: Mapping[ElementKey, str],
        rewritten: Collection[ElementKey] | None,
    ) -> None:
        """Take one read of every counted element (key, packets), ``applied`` and ``comments``
        being what kpng wrote (whose each element is, and whether it refuses), and
        ``rewritten`` what ``take_rewritten`` said when it was read. (A commit since the
        read may attribute what it counted to the element's new verdict or service: a
        read's worth at most, never counted twice.)"""
        everything = rewritten is None
        rewritten = rewritten or ()
        offsets = self._offsets
        before, reads = self._reads, {}
        for ek, packets in counts:
            value, port = applied.get(ek), comments.get(ek)
            if value is None or not port:
                continue  # not (or no longer) kpng's: it counts nothing of a service's
            refused = value in REFUSING
            last = before.pop(ek, None)
            if last is not None and (
                everything
                or ek in rewritten
                or packets < last.packets
                or (last.port, last.refused) != (port, refused)
            ):
                _add(offsets, last)
            reads[ek] = _Read(port, refused, packets)
        for last in before.values():  # elements gone with their counts
            _add(offsets, last)
        self._reads = reads
        totals: dict[str, list[int]] = {}
        for read in reads.values():
            total = totals.setdefault(read.port, [0, 0])
            total[read.refused] += read.packets
        # A service port with no element left is gone, its series with it: a Service made
        # again with the same name starts from zero, as Prometheus takes a new process.
        for port in offsets.keys() - totals.keys():
            del offsets[port]
        for port, (served_before, refused_before) in offsets.items():
            total = totals[port]
            total[0] += served_before
            total[1] += refused_before
        self._totals = {port: (c, r) for port, (c, r) in totals.items()}
        self._samples = self._exposed()

    def samples(self) -> list[Sample]:
        """Both counters of the ``series_limit`` service ports with the most connections,
        and how many were left out, as of the last ``fold``: made there, out of the scrape
        (which runs on kpng's event loop; 0.1 s at 10k service ports)."""
        return self._samples

    def _exposed(self) -> list[Sample]:
        totals = self._totals
        if len(totals) > self.series_limit:
            kept = heapq.nlargest(self.series_limit, totals, key=lambda p: sum(totals[p]))
        else:
            kept = list(totals)
        out = []
        for port in sorted(kept):
            labels = _labels(port)
            served, refused = totals[port]
            out.append(
                Sample(
                    CONNECTIONS,
                    "new connections to a Service port (its ClusterIPs, external and "
                    "load-balancer IPs and node ports), refused ones included",
                    served + refused,
                    counter=True,
                    labels=labels,
                )
            )
            out.append(
                Sample(
                    REJECTED,
                    "new connections to a Service port refused (rejected or dropped) for want of "
                    "endpoints",
                    refused,
                    counter=True,
                    labels=labels,
                )
            )
        out.append(
            Sample(
                SERVICE_PORTS,
                "Service ports whose traffic kpng counts (--traffic-counters)",
                len(totals),
            )
        )
        out.append(
            Sample(
                DROPPED,
                "Service ports left out of kpng_service_connections_total and "
                "kpng_service_rejected_total (--traffic-series-limit), those with the least "
                "traffic",
                len(totals) - len(kept),
            )
        )
        return out


def _add(offsets: dict[str, list[int]], read: _Read) -> None:
    offsets.setdefault(read.port, [0, 0])[read.refused] += read.packets


def _labels(port: str) -> tuple[tuple[str, str], ...]:
    """``namespace/name:port`` (``layout.comment_name``) as the series' labels."""
    namespace, _, rest = port.partition("/")
    service, _, name = rest.partition(":")
    return (("namespace", namespace), ("service", service), ("port", name))
