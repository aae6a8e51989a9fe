"""to-nft's traffic counters (``--traffic-counters service`` and ``endpoint``), made monotonic
series by ``backends/_traffic.py``.

The counters are those of the dispatch maps' elements (``layout.COUNTED_KINDS``): each element
counts the new connections to its frontend (a ClusterIP, external or LB IP, or node port, with
protocol and port), which its verdict either sends to endpoints or refuses (``goto reject`` or
``drop``). With ``endpoint``, the same kinds' endpoint maps count too: an endpoint map's element
is looked up by the one DNAT of a pick chain (or of a ClientIP-affinity chain, ``layout.py``)
that a new connection to its frontend takes, so it counts the connections sent to its
endpoint. kpng reads them with one netlink dump per counted
map (``READ_PERIOD_S``, under the sync lock, in a thread) and sums them per service port, named
by the dispatch element's comment, which kpng writes anyway (``namespace/name:port``), and per
endpoint of a service port (``IP:port``, ``[IP]:port`` for IPv6: what the connection was DNATed
to), summed over the port's frontends and families.

An element's counter restarts whenever it is written again: a full sync writes every element,
an incremental one those whose verdict (the endpoint count...) or endpoint changed. kpng knows
which (``replaced``); the read made after says so to ``fold``. The connections an element
counted between its last read and its rewrite are lost: at most ``READ_PERIOD_S`` of them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

from kpng.backends import _traffic
from kpng.backends._nftables.layout import REFUSING, ElementKey
from kpng.backends._samples import Sample as Sample
from kpng.backends._traffic import (
    CONNECTIONS as CONNECTIONS,
)
from kpng.backends._traffic import (
    DROPPED as DROPPED,
)
from kpng.backends._traffic import (
    ENDPOINT_CONNECTIONS as ENDPOINT_CONNECTIONS,
)
from kpng.backends._traffic import (
    ENDPOINTS_DROPPED as ENDPOINTS_DROPPED,
)
from kpng.backends._traffic import (
    READ_PERIOD_S as READ_PERIOD_S,
)
from kpng.backends._traffic import (
    REFUSED,
    SERVED,
    Series,
    endpoint_label,
)
from kpng.backends._traffic import (
    REJECTED as REJECTED,
)
from kpng.backends._traffic import (
    SERIES_LIMIT as SERIES_LIMIT,
)
from kpng.backends._traffic import (
    SERVICE_PORTS as SERVICE_PORTS,
)


class TrafficCounters(_traffic.TrafficCounters):
    """The kernel's element counters as monotonic series (pure: the backend reads the kernel
    and says which elements it rewrote)."""

    def __init__(self, series_limit: int = SERIES_LIMIT, *, endpoints: bool = False) -> None:
        super().__init__(series_limit, endpoints=endpoints)
        self._series: dict[ElementKey, Series] = {}
        """Each element's series as last found, kept until kpng rewrites it (``rewritten``):
        a read then looks one thing up per element, not its value, its comment and its
        dispatch element's comment."""

    def fold_elements(
        self,
        counts: Collection[tuple[ElementKey, int]],
        applied: Mapping[ElementKey, tuple[str, ...]],
        comments: Mapping[ElementKey, str],
        rewritten: Collection[_traffic.Key] | None,
        dispatched_by: Mapping[str, str] | None = None,
    ) -> None:
        """Take one read of every counted element (key, packets), ``applied`` and ``comments``
        being what kpng wrote (whose each element is, and whether it refuses), and
        ``rewritten`` what ``take_rewritten`` said when it was read: every element whose
        value or comment kpng changed since the last read must be in it. ``dispatched_by``
        names the dispatch map of each counted endpoint map: an endpoint element's service
        port is the comment of the dispatch element with its key, its endpoint its value. (A
        commit since the read may attribute what it counted to the element's new verdict or
        service: a read's worth at most, never counted twice.)"""
        dispatched_by = dispatched_by or {}
        known = self._series
        if rewritten is None:
            known.clear()
        else:
            endpoint_maps: dict[str, list[str]] = {}
            for name, dispatch in dispatched_by.items():
                endpoint_maps.setdefault(dispatch, []).append(name)
            for ek in rewritten:
                if not isinstance(ek, tuple):
                    continue
                known.pop(ek, None)
                # A dispatch element's comment names its endpoint elements' service port.
                for name in endpoint_maps.get(ek[0], ()):
                    known.pop((name, ek[1]), None)
        self.fold(_series(counts, applied, comments, dispatched_by, known), rewritten)
        if len(known) > 2 * len(counts) + 1024:
            known.clear()  # elements gone: found again at the next read


def _series(
    counts: Iterable[tuple[ElementKey, int]],
    applied: Mapping[ElementKey, tuple[str, ...]],
    comments: Mapping[ElementKey, str],
    dispatched_by: Mapping[str, str],
    known: dict[ElementKey, Series],
) -> Iterator[tuple[ElementKey, Series, int]]:
    # Once per element read: a million at 100k services and the endpoint level. Each series
    # made once, so that its every element carries the same (hashed) tuple.
    made: dict[Series, Series] = {}
    labels: dict[tuple[str, ...], str] = {}
    container, dispatch = "", None
    for ek, packets in counts:
        series = known.get(ek)
        if series is not None:
            yield ek, series, packets
            continue
        value = applied.get(ek)
        if value is None:
            continue  # not (or no longer) kpng's: it counts nothing of a service's
        if ek[0] != container:
            container = ek[0]
            dispatch = dispatched_by.get(container)
        if dispatch is None:
            port = comments.get(ek)
            if port:
                series = (port, REFUSED if value in REFUSING else SERVED)
                series = known[ek] = made.setdefault(series, series)
                yield ek, series, packets
        else:
            port = comments.get((dispatch, ek[1]))
            if port and len(value) == 2:
                label = labels.get(value)
                if label is None:
                    label = labels[value] = endpoint_label(*value)
                series = (port, label)
                series = known[ek] = made.setdefault(series, series)
                yield ek, series, packets
