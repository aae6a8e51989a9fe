"""A node's traffic counters (``--traffic-counters``), read from its ``/metrics`` page or from
its backends' samples: for ``kpng top`` and ``kpng explain --metrics-url`` (the page) and
``/debug/explain`` (the samples).

The page is a peer's: what is read is bounded (``BODY_LIMIT``, ``TIMEOUT_S``), prometheus_client's
parser reads it (a malformed page is an error naming the address, not a traceback), and a
sample without the labels or with a value no counter has (negative, NaN) is skipped.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from kpng.errors import KpngError

if TYPE_CHECKING:
    # Imported when a page is fetched: /debug/explain reads samples, and h11 need not load.
    from kpng.http1.client import HttpClient

CONNECTIONS = "kpng_service_connections_total"
REJECTED = "kpng_service_rejected_total"
ENDPOINT_CONNECTIONS = "kpng_endpoint_connections_total"
SERVICE_PORTS = "kpng_service_traffic_service_ports"
DROPPED = "kpng_service_traffic_series_dropped"
ENDPOINTS_DROPPED = "kpng_endpoint_traffic_series_dropped"
"""The names the backends export (docs/reference/metrics.md): the tests against a live node
(tests/kernel/test_top_node.py) hold them to to-nft's."""

BODY_LIMIT = 64 * 1024 * 1024
"""The largest page read, decoded: 100,000 Service ports at the endpoint level take some 30
MiB."""
TIMEOUT_S = 10.0
"""How long one scrape may take, connect to last byte."""

DEFAULT_URL = "http://127.0.0.1:10249/metrics"
"""kube-proxy's metrics address, which ``kpng kube-proxy`` and the deploy manifests keep."""


PortKey = tuple[str, str, str]
"""A Service port: namespace, service, port name (empty for an unnamed port)."""


@dataclass(frozen=True)
class PortCounts:
    """One Service port's counters."""

    connections: float
    """New connections, refused ones included (``kpng_service_connections_total``)."""
    refused: float
    """Refused for want of endpoints (``kpng_service_rejected_total``)."""
    endpoints: Mapping[str, float] = field(default_factory=dict)
    """New connections per endpoint (``kpng_endpoint_connections_total``) by ``IP:port``, when
    exported."""


@dataclass(frozen=True)
class Scrape:
    """The traffic counters of one node's ``/metrics``, read at ``at`` (monotonic seconds)."""

    at: float
    ports: Mapping[PortKey, PortCounts]
    counting: bool = True
    """The page has the traffic metrics at all (else the node counts nothing)."""
    dropped: float = 0.0
    """Service ports the node left out past its series limit."""
    endpoints_dropped: float = 0.0
    """Endpoints (of a service port) the node left out past its series limit."""


def counts_of(samples: Iterable[tuple[str, Mapping[str, str], float]]) -> dict[PortKey, PortCounts]:
    """Each Service port's counters among these (name, labels, value) samples, those of the
    same series summed (two backends of one node each count what they program)."""
    connections: dict[PortKey, float] = {}
    refused: dict[PortKey, float] = {}
    endpoints: dict[PortKey, dict[str, float]] = {}
    for name, labels, value in samples:
        if name not in (CONNECTIONS, REJECTED, ENDPOINT_CONNECTIONS):
            continue
        key = _key(labels)
        if key is None or not (math.isfinite(value) and value >= 0):
            continue
        if name == CONNECTIONS:
            connections[key] = connections.get(key, 0.0) + value
        elif name == REJECTED:
            refused[key] = refused.get(key, 0.0) + value
        elif "endpoint" in labels:
            counted = endpoints.setdefault(key, {})
            counted[labels["endpoint"]] = counted.get(labels["endpoint"], 0.0) + value
    return {
        key: PortCounts(value, refused.get(key, 0.0), endpoints.get(key, {}))
        for key, value in connections.items()
    }


class ReadError(KpngError):
    """A node's metrics could not be read: unreachable, an HTTP error, not Prometheus text."""


def metrics_url(address: str) -> str:
    """``HOST:PORT`` or an ``http(s)://`` URL as the URL of a ``/metrics`` page (the path is
    ``/metrics`` unless the URL names another)."""
    text = address if "://" in address else f"http://{address}"
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReadError(f"--metrics-url: not HOST:PORT or an http(s) URL: {address!r}")
    try:
        parts.port  # noqa: B018 (urlsplit checks the port when it is read)
    except ValueError as exc:
        raise ReadError(f"--metrics-url: {exc}: {address!r}") from None
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def parse(text: str, *, at: float) -> Scrape:
    """The traffic counters of a page of Prometheus text, read at ``at``."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: list[tuple[str, Mapping[str, str], float]] = []
    counting, dropped, endpoints_dropped = False, 0.0, 0.0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, value = sample.name, sample.value
                if name in (CONNECTIONS, REJECTED, ENDPOINT_CONNECTIONS):
                    counting = True
                    samples.append((name, sample.labels, value))
                elif name in (SERVICE_PORTS, DROPPED, ENDPOINTS_DROPPED):
                    counting = True
                    if name == DROPPED and math.isfinite(value):
                        dropped = value
                    elif name == ENDPOINTS_DROPPED and math.isfinite(value):
                        endpoints_dropped = value
    # The parser's complaints, and the IndexError some malformed lines raise in it (found by
    # fuzzing; tests/pure/test_top.py has one).
    except (ValueError, IndexError) as exc:
        raise ReadError(f"not Prometheus text: {exc}") from None
    return Scrape(
        at,
        counts_of(samples),
        counting=counting,
        dropped=dropped,
        endpoints_dropped=endpoints_dropped,
    )


def _key(labels: Mapping[str, str]) -> PortKey | None:
    try:
        return (labels["namespace"], labels["service"], labels["port"])
    except KeyError:
        return None


async def fetch(client: HttpClient, url: str) -> str:
    """The page at ``url``, bounded in size and time; ReadError if it cannot be had."""
    from kpng.http1.client import HttpError

    try:
        async with asyncio.timeout(TIMEOUT_S):
            async with client.request("GET", url, headers={"Accept": "text/plain"}) as response:
                if response.status != 200:
                    raise ReadError(f"{url} answered HTTP {response.status}")
                body = await response.read(limit=BODY_LIMIT)
    except TimeoutError:
        raise ReadError(f"{url} did not answer within {TIMEOUT_S:g} s") from None
    except (OSError, HttpError, ValueError) as exc:
        raise ReadError(f"cannot read {url}: {exc}") from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReadError(f"{url}: not UTF-8 text: {exc}") from None
