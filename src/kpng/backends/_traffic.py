"""Per-Service and per-endpoint traffic counters as ``/metrics`` series, whatever backend reads
them from the kernel (to-nft's element counters, to-iptables' rule counters): pure.

A backend reads its kernel counters now and then and gives each one as (key, series, packets):
the key says which kernel counter it is (an nftables element, an iptables rule), the series
what it counts for, ``(service port, SERVED)``, ``(service port, REFUSED)`` or ``(service port,
"IP:port")`` of an endpoint, the service port being kube-proxy's name of it,
``namespace/name:port``. A kernel counter restarts from zero when its element or rule is written
again; the backend says so (``replaced`` then ``take_rewritten`` for a read made outside its
sync lock, ``restarted`` for one made under it), and a counter found lower than last read is
taken as restarted too. Either way the last value read goes to its series' offset, so that what
``/metrics`` shows only goes up (Prometheus' counter semantics); what a counter counted between
its last read and its restart is lost.

A service port's offsets go when nothing counts for it any more, an endpoint's when nothing
counts for that endpoint (pods come and go; an endpoint that comes back starts again from zero,
a reset Prometheus' ``rate`` takes in its stride): what is kept is bounded by the rules.

At most ``series_limit`` service ports are exposed, those with the most connections (refused
ones included), and, at the endpoint level, at most ``series_limit`` endpoints (service port
and endpoint pairs), those with the most connections: the limit bounds each level on its own.
"""

from __future__ import annotations

import argparse
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable, Mapping

from kpng.backends._samples import Sample

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
LEVELS = ("off", "service", "endpoint")
"""``--traffic-counters``' choices."""

SERVED, REFUSED = "", "\0refused"
"""A series' second part for a service port's served and refused connections (an endpoint's
is its ``IP:port``, which neither can be)."""

Series = tuple[str, str]
Key = Hashable


_Read = tuple[Series, int]
"""What a kernel counter counted when last read, and for which series: a tuple, as there is
one for every element read (a million at 100k services and the endpoint level)."""


class TrafficCounters:
    """Kernel counters as monotonic per-service-port (and per-endpoint) totals."""

    def __init__(self, series_limit: int = SERIES_LIMIT, *, endpoints: bool = False) -> None:
        self.series_limit = series_limit
        self.endpoints = endpoints
        """Whether endpoints' series are exposed (the ``endpoint`` level)."""
        self._reads: dict[Key, _Read] = {}
        self._offsets: dict[Series, int] = {}
        """Per series, what counters that restarted or went had counted."""
        self._rewritten: set[Key] = set()
        self._all_rewritten = False
        self._totals: dict[str, tuple[int, int]] = {}
        self._endpoint_totals: dict[Series, int] = {}
        self._samples = self._exposed()

    def counted(self) -> Collection[Key]:
        """The kernel counters last read."""
        return self._reads.keys()

    def replaced(self, changed: Iterable[Key] | None) -> None:
        """The kernel took a transaction that wrote these counters' elements or rules again
        (None: all of them): their counters restarted, as the next ``take_rewritten`` says."""
        if changed is None:
            self._all_rewritten = True
            self._rewritten.clear()
        elif not self._all_rewritten:
            self._rewritten.update(changed)

    def take_rewritten(self) -> set[Key] | None:
        """The counters rewritten since the last call (None: all of them), for the ``fold``
        of a read made now."""
        rewritten = None if self._all_rewritten else self._rewritten
        self._rewritten, self._all_rewritten = set(), False
        return rewritten

    def restarted(self, keys: Iterable[Key] | None) -> None:
        """These counters (None: all) restart from zero now, with no read in between (a
        backend that reads and writes under one lock)."""
        reads = self._reads
        for key in list(reads) if keys is None else keys:
            read = reads.get(key)
            if read is not None and read[1]:
                _add(self._offsets, read)
                reads[key] = (read[0], 0)

    def fold(
        self,
        counts: Iterable[tuple[Key, Series, int]],
        rewritten: Collection[Key] | None = (),
        *,
        within: Callable[[Key], bool] | None = None,
    ) -> None:
        """Take one read of every counter (key, series, packets); ``rewritten``, what
        ``take_rewritten`` said when it was read. ``within``: the read covers only the counters
        it holds true for (the others keep their last read)."""
        everything = rewritten is None
        rewritten = rewritten or ()
        offsets = self._offsets
        before, reads = self._reads, {}
        if within is not None:
            reads = {key: read for key, read in before.items() if not within(key)}
            before = {key: read for key, read in before.items() if within(key)}
        pop = before.pop
        for key, series, packets in counts:
            last = pop(key, None)
            if last is not None and (
                everything or packets < last[1] or last[0] != series or key in rewritten
            ):
                _add(offsets, last)
            reads[key] = (series, packets)
        for last in before.values():  # counters gone with their counts
            _add(offsets, last)
        self._reads = reads
        present: dict[Series, int] = {}
        get = present.get
        for series, packets in reads.values():
            present[series] = get(series, 0) + packets
        ports = {port for port, part in present if part in (SERVED, REFUSED)}
        # A service port nothing counts for is gone, its series with it: a Service made again
        # with the same name starts from zero, as Prometheus takes a new process.
        for series in list(offsets):
            port, part = series
            kept = port in ports if part in (SERVED, REFUSED) else series in present
            if not kept:
                del offsets[series]
        totals = {port: [0, 0] for port in ports}
        endpoint_totals: dict[Series, int] = {}
        for counts_of in (present, offsets):
            for series, count in counts_of.items():
                port, part = series
                if part == SERVED:
                    totals[port][0] += count
                elif part == REFUSED:
                    totals[port][1] += count
                elif port in ports:
                    endpoint_totals[series] = endpoint_totals.get(series, 0) + count
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
        totals = {_labels(port): (s + r, r) for port, (s, r) in self._totals.items()}
        out = service_port_samples(totals, self.series_limit)
        if self.endpoints:
            out += self._endpoint_samples()
        return out

    def _endpoint_samples(self) -> list[Sample]:
        totals = {
            (*_labels(port), ("endpoint", endpoint)): count
            for (port, endpoint), count in self._endpoint_totals.items()
        }
        return endpoint_samples(totals, self.series_limit)


def _add(offsets: dict[Series, int], read: _Read) -> None:
    series, packets = read
    offsets[series] = offsets.get(series, 0) + packets


def endpoint_label(address: str, port: str) -> str:
    """An endpoint as the ``endpoint`` label: ``IP:port``, ``[IP]:port`` for IPv6."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


async def read_paced(
    read: Callable[[], Awaitable[None]],
    *,
    sleep: Callable[[float], Awaitable[None]],
    failure: type[Exception],
    log: logging.Logger,
) -> None:
    """Call ``read`` every ``READ_PERIOD_S``, or ten times as long as the last read took, so
    that reads (under a backend's sync lock) hold it a tenth of the time at most; a ``failure``
    is logged and the read tried again at the next period. Until cancelled."""
    period = READ_PERIOD_S
    while True:
        await sleep(period)
        started = time.monotonic()
        try:
            await read()
        except failure as exc:
            log.warning("the traffic counters were not read: %s; again in %gs", exc, period)
        period = max(READ_PERIOD_S, 10 * (time.monotonic() - started))


def service_port_samples(
    totals: Mapping[tuple[tuple[str, str], ...], tuple[int, int]], series_limit: int
) -> list[Sample]:
    """The two counters of each of the ``series_limit`` service ports with the most
    connections, then how many service ports are counted and how many were left out.
    ``totals``: each service port's labels, with its connections (refused ones included) and
    its refused connections."""
    if len(totals) > series_limit:
        kept = heapq.nlargest(series_limit, totals, key=lambda p: totals[p][0])
    else:
        kept = list(totals)
    out = []
    for labels in sorted(kept):
        connections, refused = totals[labels]
        out.append(
            Sample(
                CONNECTIONS,
                "new connections to a Service port (its ClusterIPs, external and "
                "load-balancer IPs and node ports), refused ones included",
                connections,
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
            "kpng_service_rejected_total (--traffic-series-limit), those with the least traffic",
            len(totals) - len(kept),
        )
    )
    return out


def endpoint_samples(
    totals: Mapping[tuple[tuple[str, str], ...], int], series_limit: int
) -> list[Sample]:
    """The endpoint counter of each of the ``series_limit`` endpoints with the most
    connections, then how many endpoints are counted and how many were left out. ``totals``:
    each endpoint's labels (its service port's, then ``endpoint``), with its connections."""
    if len(totals) > series_limit:
        kept = heapq.nlargest(series_limit, totals, key=totals.__getitem__)
    else:
        kept = list(totals)
    out = [
        Sample(
            ENDPOINT_CONNECTIONS,
            "new connections to a Service port sent to one of its endpoints (IP:port)",
            totals[labels],
            counter=True,
            labels=labels,
        )
        for labels in sorted(kept)
    ]
    out.append(
        Sample(
            ENDPOINTS,
            "endpoints of Service ports whose traffic kpng counts (--traffic-counters endpoint)",
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


def _labels(port: str) -> tuple[tuple[str, str], ...]:
    """``namespace/name:port`` (kube-proxy's name of a service port) as the series' labels."""
    namespace, _, rest = port.partition("/")
    service, _, name = rest.partition(":")
    return (("namespace", namespace), ("service", service), ("port", name))


def add_arguments(parser: argparse.ArgumentParser, *, where: str) -> None:
    """``--traffic-counters`` and ``--traffic-series-limit``; ``where`` says what counts (for
    ``--help``)."""
    parser.add_argument(
        "--traffic-counters",
        choices=LEVELS,
        default="off",
        help="service: count each Service port's new connections, and those refused for want "
        "of endpoints, for /metrics (kpng_service_connections_total, "
        "kpng_service_rejected_total); endpoint: those too, and each endpoint's new "
        f"connections (kpng_endpoint_connections_total, endpoint label IP:port); {where} "
        "(default off)",
    )
    parser.add_argument(
        "--traffic-series-limit",
        type=_positive,
        default=SERIES_LIMIT,
        metavar="N",
        help="the most Service ports --traffic-counters exposes, and the most endpoints with "
        "endpoint: past it, those with the least traffic are left out "
        "(kpng_service_traffic_series_dropped, kpng_endpoint_traffic_series_dropped; default "
        f"{SERIES_LIMIT})",
    )


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"a positive number, not {value!r}")
    return int(value)
