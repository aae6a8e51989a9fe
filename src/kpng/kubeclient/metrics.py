"""What kpng's API client counts of its requests, for ``/metrics`` as client-go's
``rest_client_requests_total`` and ``rest_client_request_duration_seconds``: kube-proxy exports
these, and its dashboards chart them.

Process-wide, as client-go's are: every ``ApiClient`` (the kube source's, to-api's token
reviews) counts here, and a scrape reads the counts. Kept apart from ``client`` so that
``/metrics`` reads them without importing the HTTP client.
"""

from __future__ import annotations

import bisect
import itertools
from urllib.parse import urlsplit

BUCKETS_S = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
"""client-go's buckets of ``rest_client_request_duration_seconds`` (since Kubernetes 1.24)."""

NO_ANSWER = 0
"""The status under which a request that got no answer is counted: client-go's ``<error>``."""

NO_ANSWER_CODE = "<error>"


class Durations:
    """A histogram over ``BUCKETS_S``: an observation is one binary search and one increment
    (counted in its own bucket; made cumulative, as Prometheus writes them, when scraped)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        """By bucket, the last one past 60 s."""
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[int]:
        """Observations at most each bound of ``BUCKETS_S``, then all of them."""
        return list(itertools.accumulate(self.counts.copy()))


class HostRequests:
    """The requests to one API server (``host``: its URL's host and port, client-go's label).

    Counting is a few dictionary look-ups and an increment: no object is made for a request
    once its method and status have been seen (the status is kept as the int it came as, and
    written as text only when scraped)."""

    __slots__ = ("durations", "host", "results")

    def __init__(self, host: str) -> None:
        self.host = host
        self.results: dict[str, dict[int, int]] = {}
        """By method, then status (``NO_ANSWER``: none): requests."""
        self.durations: dict[str, Durations] = {}
        """By method: from a request's start to its whole answer, or a watch's head."""

    def answered(self, method: str, status: int) -> None:
        by_status = self.results.get(method)
        if by_status is None:
            by_status = self.results[method] = {}
        by_status[status] = by_status.get(status, 0) + 1

    def took(self, method: str, seconds: float) -> None:
        histogram = self.durations.get(method)
        if histogram is None:
            histogram = self.durations[method] = Durations()
        histogram.observe(seconds)


HOSTS: dict[str, HostRequests] = {}
"""Every API server this process has sent requests to, by host."""


def for_server(server: str) -> HostRequests:
    """The counts of requests to ``server`` (a URL, as a kubeconfig names it)."""
    host = host_label(server)
    requests = HOSTS.get(host)
    if requests is None:
        requests = HOSTS[host] = HostRequests(host)
    return requests


def host_label(server: str) -> str:
    """client-go's ``host`` label: the URL's host and port as written, without user info."""
    return urlsplit(server).netloc.rpartition("@")[2]


def code_label(status: int) -> str:
    return NO_ANSWER_CODE if status == NO_ANSWER else str(status)
