"""Per-Service traffic counters of to-ebpf (``--traffic-counters service``), pure: the kernel's
per-frontend counts folded into per-service-port totals that only go up, summed with those of
the nftables part.

The programs count, per CPU, each connection they translate to a frontend's endpoints in
``kpng_traffic``: a connect, and an unconnected UDP send that starts a flow (as conntrack counts
a new connection). kpng makes each frontend's entry (zeroed) before it writes the frontend and
deletes it after the frontend, and never writes it otherwise: a sync, full or not, leaves the
counts alone. The pinned map keeps them across restarts of kpng, but the series start from zero
with kpng's process all the same (``begin``), as to-nft's do: the nftables part's counters
restart with it (its full sync writes every element anew), and a total that went down only in
part would read to Prometheus as a restart from zero followed by the rest, counted again.

What the programs leave untranslated reaches the nftables part, which counts it as to-nft does
(``_nftables/counting.py``): connections refused for want of endpoints, connected UDP sockets
(``--connected-udp packets``), sockets of namespaces local traffic detection does not count as
the node's pods', and everything from outside the node. A connection goes one way or the other,
never both: the totals are the sum of the two.

``fold`` takes a read of every entry with the service port each frontend serves: an entry
found lower than last read (deleted and made again), a frontend gone, or one that changed hands
(two Services, one after the other, with the same external IP and port), adds what its last
owner had counted to that owner's offset. A service port with no frontend left is gone, its
series with it, as in to-nft.

With ``--traffic-counters endpoint`` the programs also count, in ``kpng_endpoint_traffic``, each
connection by the endpoint they picked and the set they picked it from (a set is one scope of
one service port's endpoints: ``entries.py``). ``EndpointEntries`` says which entries kpng makes
and deletes so that there is one for each endpoint of each set a frontend points at, no more:
an entry is keyed by the endpoint itself, not by its slot, so that a slot passed on to another
endpoint never hands one endpoint's count to the next, and an entry that stays is never
written again (a full sync, after a restart or a drift, included). The same ``FrontendTraffic``
folds them, each entry owned by its endpoint's series (service port and ``IP:port``): an entry
deleted with its endpoint leaves its count in the series while another set of the service port
still has the endpoint, an endpoint gone from all of them is gone with its series (one that
comes back starts from zero, a reset Prometheus' ``rate`` takes in its stride, as in to-nft).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kpng.backends._samples import Sample
from kpng.backends._traffic import (
    CONNECTIONS,
    ENDPOINT_CONNECTIONS,
    REJECTED,
    endpoint_samples,
    service_port_samples,
)

KEY_SIZE = 20
"""``struct frontend_key``."""
ENDPOINT_KEY_SIZE = 32
"""``struct member_key``: set id, endpoint."""
VALUE_SIZE = 8
"""One CPU's count, a ``__u64``."""

Labels = tuple[tuple[str, str], ...]
"""A service port as its series' labels: namespace, service, port."""


def labels(namespace: str, service: str, port: str) -> Labels:
    return (("namespace", namespace), ("service", service), ("port", port))


def sum_counts(values: Iterable[bytes]) -> int:
    """An entry's count: its CPUs' values summed."""
    return sum(int.from_bytes(v, sys.byteorder) for v in values)


@dataclass
class _Read:
    owner: Labels
    value: int
    base: int
    """What the entry had counted for earlier owners when this one took it over."""


class FrontendTraffic:
    """The programs' per-frontend counts as monotonic per-service-port totals."""

    def __init__(self) -> None:
        self._reads: dict[bytes, _Read] = {}
        self._before: dict[bytes, int] = {}
        """What entries had counted before this process (``begin``)."""
        self.begun = False
        self._offsets: dict[Labels, int] = {}
        self.totals: dict[Labels, int] = {}
        """Per service port, the connections the programs translated, as of the last fold."""

    def begin(self, counts: Iterable[tuple[bytes, int]]) -> None:
        """What the entries had counted when this process first found them (before it wrote
        any frontend): left out of the totals."""
        self._before = dict(counts)
        self.begun = True

    def fold(self, counts: Iterable[tuple[bytes, int]], owners: Mapping[bytes, Labels]) -> None:
        """Take one read of every entry (frontend key, connections summed over the CPUs),
        ``owners`` being the service port each frontend kpng wrote serves."""
        offsets, before, reads = self._offsets, self._reads, {}
        for key, value in counts:
            owner = owners.get(key)
            if owner is None:
                continue  # a frontend kpng no longer writes: its entry is being deleted
            last = before.pop(key, None)
            base = self._before.pop(key, 0)
            if base > value:  # deleted and made again since
                base = 0
            if last is not None:
                base = 0
                if value < last.value:  # made again: it counts from zero
                    _add(offsets, last)
                elif last.owner != owner:
                    _add(offsets, last)
                    base = last.value
                else:
                    base = last.base
            reads[key] = _Read(owner, value, base)
        for last in before.values():  # frontends gone with their counts
            _add(offsets, last)
        self._reads = reads
        totals: dict[Labels, int] = {}
        for read in reads.values():
            totals[read.owner] = totals.get(read.owner, 0) + read.value - read.base
        for owner in offsets.keys() - totals.keys():
            del offsets[owner]
        for owner, offset in offsets.items():
            totals[owner] += offset
        self.totals = totals


def _add(offsets: dict[Labels, int], read: _Read) -> None:
    offsets[read.owner] = offsets.get(read.owner, 0) + read.value - read.base


class EndpointEntries:
    """The entries kpng holds in ``kpng_endpoint_traffic``, by set: which to make and which to
    delete for the sets' endpoints to have one each (pure)."""

    def __init__(self) -> None:
        self.held: dict[int, set[bytes]] = {}
        """Set id: the endpoints (packed) an entry is held for."""

    def found(self, keys: Iterable[tuple[int, bytes]]) -> None:
        """What the map holds (set id, endpoint), read at a full sync: the map, pinned,
        outlives kpng's process, and another program may have changed it."""
        held: dict[int, set[bytes]] = {}
        for set_id, endpoint in keys:
            held.setdefault(set_id, set()).add(endpoint)
        self.held = held

    def changes(
        self, wanted: Mapping[int, Iterable[bytes]], set_ids: Iterable[int] | None = None
    ) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]]]:
        """The entries to make and those to delete (set id, endpoint) so that the sets
        ``set_ids`` (None: every set, held or wanted) hold an entry for each endpoint
        ``wanted`` gives them, and no other; recorded as done."""
        held = self.held
        if set_ids is None:
            set_ids = held.keys() | wanted.keys()
        made: list[tuple[int, bytes]] = []
        gone: list[tuple[int, bytes]] = []
        for set_id in set_ids:
            want = set(wanted.get(set_id, ()))
            have = held.get(set_id, set())
            made += [(set_id, ep) for ep in want - have]
            gone += [(set_id, ep) for ep in have - want]
            if want:
                held[set_id] = want
            else:
                held.pop(set_id, None)
        return sorted(made), sorted(gone)


def endpoint_labels(port: Labels, endpoint: str) -> Labels:
    return (*port, ("endpoint", endpoint))


def merged_samples(
    translated: Mapping[Labels, int],
    packets: Iterable[Sample],
    series_limit: int,
    endpoints: Mapping[Labels, int] | None = None,
) -> list[Sample]:
    """The service ports' series of kpng's ``/metrics``: the programs' ``translated``
    connections added to the nftables part's counts (its samples, every service port's: it
    is given no limit of its own), at most ``series_limit`` service ports, those with the
    most connections; the gauges of how many there are and how many were left out. With
    ``endpoints`` (the programs' per-endpoint totals, ``endpoint_labels``), the endpoints'
    series too, summed with the nftables part's likewise, at most ``series_limit`` of them."""
    totals: dict[Labels, list[int]] = {port: [n, 0] for port, n in translated.items()}
    per_endpoint = dict(endpoints) if endpoints is not None else {}
    for sample in packets:
        if sample.name == CONNECTIONS:
            totals.setdefault(sample.labels, [0, 0])[0] += int(sample.value)
        elif sample.name == REJECTED:
            totals.setdefault(sample.labels, [0, 0])[1] += int(sample.value)
        elif sample.name == ENDPOINT_CONNECTIONS and endpoints is not None:
            per_endpoint[sample.labels] = per_endpoint.get(sample.labels, 0) + int(sample.value)
    out = service_port_samples({port: (c, r) for port, (c, r) in totals.items()}, series_limit)
    if endpoints is not None:
        out += endpoint_samples(per_endpoint, series_limit)
    return out
