"""``/debug/explain`` and ``kpng explain --metrics-url`` with the node's traffic counters: the
counts read from the backends' samples, put beside each port and endpoint, and the text that
shows them (pure); the explain sink reading a served page."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator

import msgspec
import pytest

from kpng.resolver.explaining import (
    EndpointExplanation,
    PortExplanation,
    ServiceExplanation,
    render_text,
)
from kpng.scraping import PortCounts
from kpng.sinks.explain import traffic_of, with_traffic
from kpng.status import Sample
from tests.conftest import EXAMPLE

WEB = ("shop", "web", "http")


def _labels(*endpoint: str) -> tuple[tuple[str, str], ...]:
    base = (("namespace", "shop"), ("service", "web"), ("port", "http"))
    return (*base, ("endpoint", endpoint[0])) if endpoint else base


def test_the_counters_are_read_from_the_samples_summed_over_backends() -> None:
    samples = [
        Sample("kpng_service_connections_total", "", 10, True, _labels()),
        Sample("kpng_service_connections_total", "", 5, True, _labels()),  # a second backend
        Sample("kpng_service_rejected_total", "", 2, True, _labels()),
        Sample("kpng_endpoint_connections_total", "", 7, True, _labels("10.244.1.2:8080")),
        Sample("kpng_endpoint_connections_total", "", 6, True, _labels("[fd00::2]:8080")),
        Sample("kpng_service_connections_total", "", 1, True, (("namespace", "x"),)),
        Sample("kpng_store_revision", "", 9),
    ]
    assert traffic_of(samples) == {
        WEB: PortCounts(15, 2, {"10.244.1.2:8080": 7, "[fd00::2]:8080": 6}),
    }


def _endpoint(address: str) -> EndpointExplanation:
    return EndpointExplanation(
        address, 8080, "web-x", "node-1", True, True, False, True, True, True, True, ()
    )


def _explanation() -> ServiceExplanation:
    endpoints = [_endpoint("10.244.1.2"), _endpoint("fd00::2"), _endpoint("10.244.1.3")]
    port = PortExplanation("http", "TCP", 80, 0, "8080", "Cluster", "", ("v4",), (), endpoints)
    other = PortExplanation("admin", "TCP", 81, 0, "9000", "Cluster", "", ("v4",), (), [])
    return ServiceExplanation("shop", "web", "node-1", "", True, (), [port, other])


def test_each_counted_port_and_endpoint_gets_its_count_and_the_rest_none() -> None:
    counted = with_traffic(
        _explanation(),
        {WEB: PortCounts(15, 2, {"10.244.1.2:8080": 7, "[fd00::2]:8080": 6})},
    )
    port, other = counted.ports
    assert (port.connections, port.refused) == (15, 2)
    assert [ep.connections for ep in port.endpoints] == [7, 6, 0]
    assert (other.connections, other.refused) == (None, None)
    # In JSON, what was not counted is absent, as before there were counters.
    ports = msgspec.json.decode(msgspec.json.encode(counted))["ports"]
    assert (ports[0]["connections"], "connections" in ports[1]) == (15, False)


def test_a_port_counted_without_its_endpoints_leaves_them_uncounted() -> None:
    port = with_traffic(_explanation(), {WEB: PortCounts(15, 2)}).ports[0]
    assert port.connections == 15
    assert [ep.connections for ep in port.endpoints] == [None, None, None]


def test_the_text_shows_the_counts_beside_the_decisions() -> None:
    counted = with_traffic(
        _explanation(), {WEB: PortCounts(15, 2, {"10.244.1.2:8080": 7, "[fd00::2]:8080": 6})}
    )
    lines = render_text([counted]).splitlines()
    assert lines[1] == "  port http 80/TCP -> 8080; 15 connections counted, 2 refused"
    assert lines[2].split() == ["ENDPOINT", "NODE", "CLUSTER", "LOCAL", "CONNS", "WHY"]
    assert lines[3].split() == ["10.244.1.2:8080", "node-1", "yes", "yes", "7"]
    assert lines[4].split() == ["[fd00::2]:8080", "node-1", "yes", "yes", "6"]
    assert render_text([_explanation()]).splitlines()[1] == "  port http 80/TCP -> 8080"


_WEB = 'namespace="shop",service="web",port="http"'
PAGE = f"""\
# TYPE kpng_service_connections_total counter
kpng_service_connections_total{{{_WEB}}} 40
# TYPE kpng_service_rejected_total counter
kpng_service_rejected_total{{{_WEB}}} 1
# TYPE kpng_endpoint_connections_total counter
kpng_endpoint_connections_total{{{_WEB},endpoint="10.244.1.11:8080"}} 39
"""


@pytest.fixture
def page() -> Iterator[tuple[str, list[bytes]]]:
    """A served /metrics page: its address, and the body to change."""
    body = [PAGE.encode()]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body[0])))
            self.end_headers()
            self.wfile.write(body[0])

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", body
    finally:
        server.shutdown()
        server.server_close()


def _explain(address: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kpng", "file", "--input", str(EXAMPLE), "explain"]
    argv += ["--node-name", "node-2", "--service", "shop/web", "--metrics-url", address]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.slow
def test_explain_shows_the_counts_read_from_the_nodes_metrics(
    page: tuple[str, list[bytes]],
) -> None:
    done = _explain(page[0])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1] == "  port http 80/TCP -> http; 40 connections counted, 1 refused"
    rows = {line.split()[0]: line.split()[4] for line in lines[5:8]}
    assert rows == {"10.244.1.11:8080": "39", "10.244.2.13:8080": "0", "10.244.3.12:8080": "0"}


@pytest.mark.slow
def test_explain_fails_naming_a_page_without_counters(page: tuple[str, list[bytes]]) -> None:
    address, body = page
    body[0] = b"kpng_store_revision 7\n"
    done = _explain(address)
    assert done.returncode == 1
    assert done.stdout == ""
    assert "has no traffic counters" in done.stderr
