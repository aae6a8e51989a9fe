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
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kpng.backends._samples import Sample
from kpng.backends._traffic import CONNECTIONS, REJECTED, service_port_samples

KEY_SIZE = 20
"""``struct frontend_key``."""
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


def merged_samples(
    translated: Mapping[Labels, int], packets: Iterable[Sample], series_limit: int
) -> list[Sample]:
    """The service ports' series of kpng's ``/metrics``: the programs' ``translated``
    connections added to the nftables part's counts (its samples, every service port's: it
    is given no limit of its own), at most ``series_limit`` service ports, those with the
    most connections; the gauges of how many there are and how many were left out."""
    totals: dict[Labels, list[int]] = {port: [n, 0] for port, n in translated.items()}
    for sample in packets:
        if sample.name == CONNECTIONS:
            totals.setdefault(sample.labels, [0, 0])[0] += int(sample.value)
        elif sample.name == REJECTED:
            totals.setdefault(sample.labels, [0, 0])[1] += int(sample.value)
    return service_port_samples({port: (c, r) for port, (c, r) in totals.items()}, series_limit)
