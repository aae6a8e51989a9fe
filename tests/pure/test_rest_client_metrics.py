"""client-go's ``rest_client_*`` metrics, as kpng's API client counts its requests: by the
answer's status (``<error>`` without one), method and host; timed to the whole answer, but a
watch only to its head. Against a scripted server on loopback, read from ``/metrics``' text."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from kubernetes_asyncio.client import Configuration
from prometheus_client.parser import text_string_to_metric_families

from kpng.kubeclient import metrics
from kpng.kubeclient.client import ApiClient, ApiStatusError, TransportError
from kpng.kubeclient.config import Connection
from kpng.status import Status
from kpng.status.metrics import scrape
from kpng.testing.ports import free_port

SLOW_BODY_S = 0.3
"""The whole answer's body comes this long after its head."""
WATCH_LASTS_S = 1.5
"""A watch's stream ends this long after its head."""

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _connection(server: str) -> Connection:
    return Connection(
        server=server,
        ssl_context=ssl.create_default_context() if server.startswith("https") else None,
        tls_server_name=None,
        proxy=None,
        source="test",
        _configuration=Configuration(),
        _loader=None,
    )


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b" ", 2)
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if b"watch=1" in target:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(WATCH_LASTS_S)
                line = b'{"type":"BOOKMARK"}\n'
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(line), line))
            elif target.startswith(b"/missing"):
                body = b'{"kind":"Status","code":404,"reason":"NotFound"}'
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body))
                writer.write(body)
            elif method == b"POST":
                writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(SLOW_BODY_S)
                writer.write(b"{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _series(text: str, prefix: str) -> Series:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    }


@pytest.mark.slow
def test_requests_are_counted_by_status_method_and_host_and_timed_as_client_go() -> None:
    async def scenario() -> str:
        server = await asyncio.start_server(_serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with ApiClient(_connection(f"http://127.0.0.1:{port}")) as client:
                await client.get("/api/v1/nodes", {})
                await client.get("/api/v1/nodes", {})
                with pytest.raises(ApiStatusError):
                    await client.get("/missing", {})
                await client.post("/apis/authentication.k8s.io/v1/tokenreviews", b"{}")
                params = {"watch": "1"}
                async with client.stream_lines("/api/v1/nodes", params, idle_timeout=10) as lines:
                    async for _ in lines:
                        pass
        finally:
            server.close()
        return f"127.0.0.1:{port}"

    host = asyncio.run(scenario())
    series = _series(scrape(Status(timeout=1.0)).decode(), "rest_client_")

    def requests(code: str, method: str) -> float:
        labels = (("code", code), ("host", host), ("method", method))
        return series.get(("rest_client_requests_total", labels), 0.0)

    assert requests("200", "GET") == 3  # two lists and the watch
    assert requests("404", "GET") == 1
    assert requests("201", "POST") == 1

    def bucket(verb: str, le: str) -> float:
        labels = (("host", host), ("le", le), ("verb", verb))
        return series[("rest_client_request_duration_seconds_bucket", labels)]

    buckets = {
        le
        for (name, labels) in series
        if name == "rest_client_request_duration_seconds_bucket"
        for key, le in labels
        if key == "le"
    }
    assert buckets == {f"{b:g}" for b in metrics.BUCKETS_S} | {"+Inf"}
    assert bucket("GET", "+Inf") == 4
    # The two lists waited for their bodies; the watch, which streamed for longer, only for
    # its head, and the 404 not at all.
    assert bucket("GET", "0.25") == 2
    assert bucket("GET", "1") == 4
    assert bucket("POST", "0.25") == 1


def test_a_request_without_an_answer_is_counted_as_client_go_counts_it() -> None:
    server = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with ApiClient(_connection(server)) as client:
            with pytest.raises(TransportError):
                await client.get("/api/v1/services", {})
            with pytest.raises(TransportError):
                async with client.stream_lines("/api/v1/services", {}, idle_timeout=5):
                    pass

    asyncio.run(scenario())
    requests = metrics.HOSTS[metrics.host_label(server)]
    assert requests.results == {"GET": {metrics.NO_ANSWER: 2}}
    assert requests.durations["GET"].cumulative()[-1] == 2
    series = _series(scrape(Status(timeout=1.0)).decode(), "rest_client_requests_total")
    labels = (("code", "<error>"), ("host", metrics.host_label(server)), ("method", "GET"))
    assert series[("rest_client_requests_total", labels)] == 2


@pytest.mark.parametrize(
    ("server", "host"),
    [
        ("https://10.0.0.1:6443", "10.0.0.1:6443"),
        ("https://api.example.com", "api.example.com"),
        ("https://user:secret@[fd00::1]:443", "[fd00::1]:443"),
    ],
)
def test_the_host_label_is_the_urls_host_as_written(server: str, host: str) -> None:
    assert metrics.host_label(server) == host


def test_a_duration_on_a_bound_counts_under_it_and_one_past_the_last_only_under_inf() -> None:
    durations = metrics.Durations()
    for seconds in (0.005, 0.0051, 60.0, 61.0):
        durations.observe(seconds)
    cumulative = durations.cumulative()
    assert cumulative[0] == 1  # le="0.005"
    assert cumulative[1] == 2  # le="0.025"
    assert cumulative[-2:] == [3, 4]  # le="60", le="+Inf"
    assert durations.sum == pytest.approx(121.0101)
