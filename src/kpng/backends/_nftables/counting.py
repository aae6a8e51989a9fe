"""Per-Service (and per-endpoint) traffic counters for ``/metrics`` (``--traffic-counters``).

The counters are those of the dispatch maps' elements (``layout.COUNTED_KINDS``): each element
counts the new connections to its frontend (a ClusterIP, external or LB IP, or node port, with
protocol and port), which its verdict either sends to endpoints or refuses (``goto reject`` or
``drop``). With ``--traffic-counters endpoint``, the same kinds' endpoint maps count too: an
endpoint map's element is looked up by the one DNAT of a pick chain that a new connection to
its frontend takes, so it counts the connections sent to its endpoint. kpng reads them with one
netlink dump per counted map (``READ_PERIOD_S``, under the sync lock, in a thread) and sums them
per service port, named by the dispatch element's comment, which kpng writes anyway
(``namespace/name:port``), and per endpoint of a service port (``IP:port``, ``[IP]:port`` for
IPv6: what the connection was DNATed to), summed over the port's frontends and families.

A counter the kernel holds restarts from zero whenever its element is written again: a full
sync writes every element, an incremental one those whose verdict (the endpoint count...) or
endpoint changed. kpng knows which (``replaced``), and also takes a counter found lower than
last read as restarted; either way the last value read is added to its series' offset, so
that what ``/metrics`` shows only goes up (Prometheus' counter semantics). The connections an
element counted between its last read and its rewrite are lost: at most ``READ_PERIOD_S`` of
them. A service port's offsets go when it has no element left, an endpoint's when no element
sends to it any more (an endpoint that comes back starts again from zero, which Prometheus'
``rate`` takes as a reset): what kpng keeps is bounded by what the table holds.

At most ``series_limit`` service ports are exposed, those with the most connections (refused
ones included), and at most ``series_limit`` endpoints (service port and endpoint pairs), those
with the most connections: the limit bounds each level on its own, so ``endpoint`` exposes at
most twice as many label sets as ``service``. ``kpng_service_traffic_series_dropped`` and
``kpng_endpoint_traffic_series_dropped`` say how many were left out.
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
ENDPOINT_CONNECTIONS = "kpng_endpoint_connections_total"
ENDPOINTS_DROPPED = "kpng_endpoint_traffic_series_dropped"
ENDPOINTS = "kpng_endpoint_traffic_endpoints"
LABELS = ("namespace", "service", "port")
ENDPOINT_LABELS = (*LABELS, "endpoint")

_SERVED, _REFUSED = "", "\0refused"
"""The series' second part for a dispatch element (an endpoint's is its ``IP:port``, which
neither can be)."""

Series = tuple[str, str]
"""(service port, ``_SERVED``, ``_REFUSED`` or an endpoint): what a counter adds to."""


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

    series: Series
    packets: int


class TrafficCounters:
    """The kernel's element counters as monotonic per-service-port (and per-endpoint) totals
    (pure: the backend reads the kernel and says which elements it rewrote)."""

    def __init__(self, series_limit: int = SERIES_LIMIT, *, endpoints: bool = False) -> None:
        self.series_limit = series_limit
        self.endpoints = endpoints
        """Whether endpoint maps' elements are read (the ``endpoint`` level)."""
        self._reads: dict[ElementKey, _Read] = {}
        self._offsets: dict[Series, int] = {}
        """Per series, what counters that restarted or went had counted."""
        self._rewritten: set[ElementKey] = set()
        self._all_rewritten = False
        self._totals: dict[str, tuple[int, int]] = {}
        self._endpoint_totals: dict[Series, int] = {}
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
        dispatched_by: Mapping[str, str] | None = None,
    ) -> None:
        """Take one read of every counted element (key, packets), ``applied`` and ``comments``
        being what kpng wrote (whose each element is, and whether it refuses), and
        ``rewritten`` what ``take_rewritten`` said when it was read. ``dispatched_by`` names
        the dispatch map of each counted endpoint map: an endpoint element's service port is
        the comment of the dispatch element with its key, its endpoint its value. (A commit
        since the read may attribute what it counted to the element's new verdict or service:
        a read's worth at most, never counted twice.)"""
        everything = rewritten is None
        rewritten = rewritten or ()
        dispatched_by = dispatched_by or {}
        offsets = self._offsets
        before, reads = self._reads, {}
        for ek, packets in counts:
            value = applied.get(ek)
            if value is None:
                continue  # not (or no longer) kpng's: it counts nothing of a service's
            dispatch = dispatched_by.get(ek[0])
            if dispatch is None:
                port = comments.get(ek)
                series = (port, _REFUSED if value in REFUSING else _SERVED) if port else None
            else:
                port = comments.get((dispatch, ek[1]))
                series = (port, _endpoint(value)) if port and len(value) == 2 else None
            if series is None:
                continue
            last = before.pop(ek, None)
            if last is not None and (
                everything or ek in rewritten or packets < last.packets or last.series != series
            ):
                _add(offsets, last)
            reads[ek] = _Read(series, packets)
        for last in before.values():  # elements gone with their counts
            _add(offsets, last)
        self._reads = reads
        present: dict[Series, int] = {}
        for read in reads.values():
            present[read.series] = present.get(read.series, 0) + read.packets
        ports = {port for port, part in present if part in (_SERVED, _REFUSED)}
        # A service port with no element left is gone, its series with it: a Service made
        # again with the same name starts from zero, as Prometheus takes a new process. An
        # endpoint no element sends to goes too (pods come and go: kept, they would pile up).
        for series in list(offsets):
            port, part = series
            kept = port in ports if part in (_SERVED, _REFUSED) else series in present
            if not kept:
                del offsets[series]
        totals = {port: [0, 0] for port in ports}
        endpoint_totals: dict[Series, int] = {}
        for series in present.keys() | offsets.keys():
            count = present.get(series, 0) + offsets.get(series, 0)
            port, part = series
            if part == _SERVED:
                totals[port][0] += count
            elif part == _REFUSED:
                totals[port][1] += count
            else:
                endpoint_totals[series] = count
        self._totals = {port: (c, r) for port, (c, r) in totals.items()}
        self._endpoint_totals = endpoint_totals
        self._samples = self._exposed()

    def samples(self) -> list[Sample]:
        """Both counters of the ``series_limit`` service ports with the most connections (and
        the endpoint counter of the ``series_limit`` busiest endpoints), and how many were
        left out, as of the last ``fold``: made there, out of the scrape (which runs on kpng's
        event loop; 0.1 s at 10k service ports)."""
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
        if self.endpoints:
            out += self._endpoint_samples()
        return out

    def _endpoint_samples(self) -> list[Sample]:
        totals = self._endpoint_totals
        if len(totals) > self.series_limit:
            kept = heapq.nlargest(self.series_limit, totals, key=totals.__getitem__)
        else:
            kept = list(totals)
        out = [
            Sample(
                ENDPOINT_CONNECTIONS,
                "new connections to a Service port sent to one of its endpoints (IP:port)",
                totals[series],
                counter=True,
                labels=(*_labels(series[0]), ("endpoint", series[1])),
            )
            for series in sorted(kept)
        ]
        out.append(
            Sample(
                ENDPOINTS,
                "endpoints of Service ports whose traffic kpng counts (--traffic-counters "
                "endpoint)",
                len(totals),
            )
        )
        out.append(
            Sample(
                ENDPOINTS_DROPPED,
                "endpoints left out of kpng_endpoint_connections_total "
                "(--traffic-series-limit), those with the least traffic",
                len(totals) - len(kept),
            )
        )
        return out


def _add(offsets: dict[Series, int], read: _Read) -> None:
    offsets[read.series] = offsets.get(read.series, 0) + read.packets


def _endpoint(value: tuple[str, ...]) -> str:
    """An endpoint element's value (address, port) as the ``endpoint`` label."""
    address, port = value
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _labels(port: str) -> tuple[tuple[str, str], ...]:
    """``namespace/name:port`` (``layout.comment_name``) as the series' labels."""
    namespace, _, rest = port.partition("/")
    service, _, name = rest.partition(":")
    return (("namespace", namespace), ("service", service), ("port", name))
