"""The rows of ``kpng top`` from successive scrapes of a node's traffic counters (pure).

A rate is a counter's increase between two scrapes over the time between them, Prometheus' way:
a counter found lower than in the scrape before restarted from zero (kpng restarted, or a
Service was made again), and its whole value is what it counted since.

Which two scrapes: to-nft reads the kernel's counters every 10 s, not at each scrape, so the
counters on a page move in steps. A rate between any two scrapes 2 s apart would be 0 four
times out of five and five times too high the fifth. So the scrapes whose counters moved
(``fresh``: the first to show a new read) are the ends when the window holds two of them:
the span between them is a whole number of reads, whatever the phase of the scrapes. Without
two, the oldest and newest scrapes of the window are the ends (an idle node's rates are 0 once
the window has passed the last step; a backend that counts at each scrape has every scrape
fresh).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kpng.scraping import PortKey, Scrape


class Sort(Enum):
    CONNS = "conns"
    REFUSED = "refused"
    NAME = "name"


@dataclass(frozen=True)
class Row:
    """One Service port as ``kpng top`` shows it."""

    namespace: str
    service: str
    port: str
    connections: float
    """The total, as of the newest scrape."""
    refused: float
    connections_rate: float | None
    """New connections per second; None without two scrapes of this port."""
    refused_rate: float | None
    endpoints: int | None
    """How many endpoints have a series; None when the node exports no endpoint level."""
    shares: tuple[tuple[str, float], ...] = ()
    """Each endpoint's share of the port's connections, busiest first: of those in the rates'
    span if there were any, else of the totals; empty when neither has any."""


@dataclass(frozen=True)
class View:
    rows: list[Row]
    span: float | None
    """The seconds the rates are taken over; None with a single scrape (totals only)."""
    matched: int
    """Service ports matching the filter, before ``limit``."""


def fresh(scrapes: Sequence[Scrape]) -> list[int]:
    """The indexes of the scrapes whose counters differ from those of the scrape before."""
    return [i for i in range(1, len(scrapes)) if scrapes[i].ports != scrapes[i - 1].ports]


def span(scrapes: Sequence[Scrape], *, window: float) -> tuple[int, int] | None:
    """The indexes of the two scrapes the rates are taken between (see the module's doc), of
    those no older than ``window`` seconds before the newest; None with fewer than two."""
    if not scrapes:
        return None
    newest = scrapes[-1].at
    inside = [i for i, s in enumerate(scrapes) if newest - s.at <= window]
    moved = [i for i in fresh(scrapes) if i in inside]
    if len(moved) >= 2:
        return moved[0], moved[-1]
    if len(inside) >= 2:
        return inside[0], inside[-1]
    return None


def kept(scrapes: Sequence[Scrape], *, window: float) -> list[Scrape]:
    """The scrapes ``span`` may still use once ``window`` has passed over the others: those of
    the window, and the one before its oldest (which tells whether the oldest is fresh)."""
    if not scrapes:
        return []
    newest = scrapes[-1].at
    first = next(i for i, s in enumerate(scrapes) if newest - s.at <= window)
    return list(scrapes[max(0, first - 1) :])


def increase(values: Iterable[float]) -> float:
    """How much a counter went up over these successive values, a drop being a restart."""
    total, last = 0.0, None
    for value in values:
        if last is not None:
            total += value - last if value >= last else value
        last = value
    return total


def _rates(
    scrapes: Sequence[Scrape], key: PortKey
) -> tuple[float | None, float | None, dict[str, float]]:
    """(connections/s, refused/s, each endpoint's increase) over these scrapes, from those
    that have the port (a port that came or went inside them is rated over its own span)."""
    seen = [(s.at, s.ports[key]) for s in scrapes if key in s.ports]
    if len(seen) < 2 or seen[-1][0] <= seen[0][0]:
        return None, None, {}
    seconds = seen[-1][0] - seen[0][0]
    conns = increase(c.connections for _, c in seen) / seconds
    refused = increase(c.refused for _, c in seen) / seconds
    endpoints = {
        endpoint: increase(c.endpoints[endpoint] for _, c in seen if endpoint in c.endpoints)
        for endpoint in seen[-1][1].endpoints
    }
    return conns, refused, endpoints


def _shares(counts: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    total = sum(counts.values())
    if total <= 0:
        return ()
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return tuple((endpoint, value / total) for endpoint, value in ordered)


def _rate_key(rate: float | None, total: float) -> tuple[float, float]:
    # A port without a rate (a single scrape, or new) sorts by its total, after those with one.
    return (-(rate if rate is not None else -math.inf), -total)


_SORT_KEYS: dict[Sort, Callable[[Row], tuple[object, ...]]] = {
    Sort.CONNS: lambda r: (*_rate_key(r.connections_rate, r.connections), r.namespace, r.service),
    Sort.REFUSED: lambda r: (*_rate_key(r.refused_rate, r.refused), r.namespace, r.service),
    Sort.NAME: lambda r: (r.namespace, r.service, r.port),
}


def view(
    scrapes: Sequence[Scrape],
    *,
    window: float,
    sort: Sort = Sort.CONNS,
    limit: int | None = None,
    namespace: str | None = None,
) -> View:
    """The rows of the newest scrape, rated over ``span`` of them, filtered, sorted and cut."""
    if not scrapes:
        return View([], None, 0)
    ends = span(scrapes, window=window)
    rated = scrapes[ends[0] : ends[1] + 1] if ends is not None else scrapes[-1:]
    newest = scrapes[-1]
    rows = []
    for key, counts in newest.ports.items():
        if namespace is not None and key[0] != namespace:
            continue
        conns, refused, endpoint_increase = _rates(rated, key)
        shares = _shares(endpoint_increase) or _shares(counts.endpoints)
        rows.append(
            Row(
                *key,
                connections=counts.connections,
                refused=counts.refused,
                connections_rate=conns,
                refused_rate=refused,
                endpoints=len(counts.endpoints) if counts.endpoints else None,
                shares=shares,
            )
        )
    rows.sort(key=_SORT_KEYS[sort])
    matched = len(rows)
    seconds = rated[-1].at - rated[0].at if ends is not None else None
    return View(rows[:limit] if limit is not None else rows, seconds, matched)


HEADER = (
    "NAMESPACE",
    "SERVICE",
    "PORT",
    "CONN/S",
    "REFUSED/S",
    "CONNS",
    "REFUSED",
    "ENDPOINTS",
    "BUSIEST",
)
_RIGHT = {"CONN/S", "REFUSED/S", "CONNS", "REFUSED", "ENDPOINTS"}


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def cells(row: Row) -> tuple[str, ...]:
    """A row's columns as text: ``-`` for what is not there (an unnamed port, a rate without
    two scrapes), so that each line splits into the same number of fields."""
    busiest = "-"
    if row.shares:
        endpoint, share = row.shares[0]
        busiest = f"{endpoint}={share:.0%}"
    return (
        row.namespace or "-",
        row.service or "-",
        row.port or "-",
        _rate_text(row.connections_rate),
        _rate_text(row.refused_rate),
        f"{row.connections:.0f}",
        f"{row.refused:.0f}",
        "-" if row.endpoints is None else str(row.endpoints),
        busiest,
    )


def table(rows: Sequence[Row]) -> list[str]:
    """The header and the rows as aligned lines of text."""
    lines = [HEADER, *(cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = []
    for line in lines:
        fields = [
            text.rjust(width) if name in _RIGHT else text.ljust(width)
            for name, text, width in zip(HEADER, line, widths, strict=True)
        ]
        out.append("  ".join(fields).rstrip())
    return out
