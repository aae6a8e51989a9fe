"""A node's traffic counters, read from its ``/metrics`` (Prometheus text).

The page is a peer's: what is read is bounded (``BODY_LIMIT``, ``TIMEOUT_S``), prometheus_client's
parser reads it (a malformed page is an error naming the address, not a traceback), and a
sample without the labels or with a value no counter has (negative, NaN) is skipped.
"""

from __future__ import annotations

import asyncio
import math
from urllib.parse import urlsplit, urlunsplit

from kpng.errors import KpngError
from kpng.http1.client import HttpClient, HttpError
from kpng.top.ranking import PortCounts, PortKey, Scrape

CONNECTIONS = "kpng_service_connections_total"
REJECTED = "kpng_service_rejected_total"
ENDPOINT_CONNECTIONS = "kpng_endpoint_connections_total"
SERVICE_PORTS = "kpng_service_traffic_service_ports"
DROPPED = "kpng_service_traffic_series_dropped"
ENDPOINTS_DROPPED = "kpng_endpoint_traffic_series_dropped"
"""The names the backends export (docs/reference/metrics.md): kpng top's test against a live
node (tests/test_top_node.py) holds them to to-nft's."""

BODY_LIMIT = 64 * 1024 * 1024
"""The largest page read, decoded: 100,000 Service ports at the endpoint level take some 30
MiB."""
TIMEOUT_S = 10.0
"""How long one scrape may take, connect to last byte."""

DEFAULT_URL = "http://127.0.0.1:10249/metrics"
"""kube-proxy's metrics address, which ``kpng kube-proxy`` and the deploy manifests keep."""


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

    connections: dict[PortKey, float] = {}
    refused: dict[PortKey, float] = {}
    endpoints: dict[PortKey, dict[str, float]] = {}
    counting, dropped, endpoints_dropped = False, 0.0, 0.0
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, value, labels = sample.name, sample.value, sample.labels
                if name in (SERVICE_PORTS, DROPPED, ENDPOINTS_DROPPED):
                    counting = True
                    if name == DROPPED and math.isfinite(value):
                        dropped = value
                    elif name == ENDPOINTS_DROPPED and math.isfinite(value):
                        endpoints_dropped = value
                    continue
                if name not in (CONNECTIONS, REJECTED, ENDPOINT_CONNECTIONS):
                    continue
                counting = True
                key = _key(labels)
                if key is None or not (math.isfinite(value) and value >= 0):
                    continue
                if name == CONNECTIONS:
                    connections[key] = value
                elif name == REJECTED:
                    refused[key] = value
                elif "endpoint" in labels:
                    endpoints.setdefault(key, {})[labels["endpoint"]] = value
    except ValueError as exc:  # the parser's every complaint
        raise ReadError(f"not Prometheus text: {exc}") from None
    ports = {
        key: PortCounts(value, refused.get(key, 0.0), endpoints.get(key, {}))
        for key, value in connections.items()
    }
    return Scrape(
        at, ports, counting=counting, dropped=dropped, endpoints_dropped=endpoints_dropped
    )


def _key(labels: dict[str, str]) -> PortKey | None:
    try:
        return (labels["namespace"], labels["service"], labels["port"])
    except KeyError:
        return None


async def fetch(client: HttpClient, url: str) -> str:
    """The page at ``url``, bounded in size and time; ReadError if it cannot be had."""
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
