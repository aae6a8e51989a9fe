"""The kube source's pure logic with plain data: backoff, relist diff, line splitting, watch
events, selectors and the choice of configuration. No API server: the tests that connect dial a
loopback port where nothing listens, or a scripted plain-HTTP server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import cast
from urllib.parse import parse_qs, urlsplit

import msgspec
import pytest
from kubernetes_asyncio.client import Configuration

from kpng.kubeclient.client import (
    MAX_LINE,
    ApiClient,
    StreamIdle,
    TransportError,
    WatchLineSplitter,
)
from kpng.kubeclient.config import IN_CLUSTER, Connection, KubeConfigError, choose_config
from kpng.model import k8s
from kpng.model.cluster import Slice
from kpng.model.converting import service_from_k8s
from kpng.model.messages import Service
from kpng.sources.kube.reflector import (
    BackoffPolicy,
    Gone,
    Key,
    Reflector,
    ReflectorSettings,
    RelistDiff,
    Resource,
    WatchFailed,
    relist_diff,
    watch_idle_timeout,
    watch_timeout,
)
from kpng.sources.kube.source import (
    SERVICE_FIELD_SELECTOR,
    OrphanReports,
    _HandleOutput,
    label_selector,
    orphan_slices,
    resources,
)
from kpng.store import Store
from kpng.testing.ports import free_port


@pytest.mark.parametrize(
    ("rand", "expected"),
    [
        (0.0, [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0, 30.0]),
        (1.0, [1.6, 3.2, 6.4, 12.8, 25.6, 51.2, 60.0, 60.0]),
        (0.5, [1.2, 2.4, 4.8, 9.6, 19.2, 38.4, 45.0, 45.0]),
    ],
)
def test_backoff_doubles_to_the_cap_with_jitter(rand: float, expected: list[float]) -> None:
    backoff = BackoffPolicy().backoff(lambda: rand)
    assert [round(backoff.delay(), 6) for _ in expected] == expected
    backoff.reset()
    assert backoff.delay() == pytest.approx(expected[0])


def test_backoff_without_jitter_is_exact() -> None:
    backoff = BackoffPolicy(initial=1, factor=3, maximum=10, jitter=0).backoff(lambda: 0.99)
    assert [backoff.delay() for _ in range(4)] == [1, 3, 9, 10]


@pytest.mark.parametrize(
    ("known", "listed", "expected"),
    [
        ({}, {}, RelistDiff(frozenset(), frozenset(), frozenset(), 0)),
        (
            {},
            {("a", "x"): "1"},
            RelistDiff(frozenset({("a", "x")}), frozenset(), frozenset(), 0),
        ),
        (
            {("a", "x"): "1", ("a", "y"): "2", ("b", "z"): "3"},
            {("a", "x"): "1", ("a", "y"): "7", ("c", "w"): "8"},
            RelistDiff(
                added=frozenset({("c", "w")}),
                changed=frozenset({("a", "y")}),
                deleted=frozenset({("b", "z")}),
                unchanged=1,
            ),
        ),
        (
            {("a", "x"): "1"},
            {},
            RelistDiff(frozenset(), frozenset(), frozenset({("a", "x")}), 0),
        ),
    ],
    ids=["empty", "added", "mixed", "all-deleted"],
)
def test_relist_diff(known: dict[Key, str], listed: dict[Key, str], expected: RelistDiff) -> None:
    assert relist_diff(known, listed) == expected


@pytest.mark.parametrize(("rand", "expected"), [(0.0, 300), (0.5, 450), (0.999, 599)])
def test_watch_timeouts_spread_between_one_and_two_bases(rand: float, expected: int) -> None:
    assert watch_timeout(300, lambda: rand) == expected


@pytest.mark.parametrize(
    ("server_timeout", "idle", "expected"),
    [(300, 150.0, 150.0), (599, 150.0, 150.0), (10, 150.0, 40.0), (300, 1000.0, 330.0)],
)
def test_a_watch_may_be_silent_for_the_idle_bound_and_never_long_past_its_end(
    server_timeout: int, idle: float, expected: float
) -> None:
    assert watch_idle_timeout(server_timeout, idle) == expected


@pytest.mark.parametrize(
    ("chunks", "expected"),
    [
        ([b'{"a":1}\n'], [[b'{"a":1}']]),
        ([b'{"a"', b":1}\n{", b'"b":2}\n'], [[], [b'{"a":1}'], [b'{"b":2}']]),
        ([b"x\ny\nz"], [[b"x", b"y"]]),
        ([b"\n\n  \nx\n"], [[b"x"]]),
        ([b"x" * 100_000] * 5 + [b"\n"], [[]] * 5 + [[b"x" * 500_000]]),
    ],
    ids=["one", "split", "partial-tail", "blank-lines", "long-line"],
)
def test_line_splitter(chunks: list[bytes], expected: list[list[bytes]]) -> None:
    splitter = WatchLineSplitter()
    assert [splitter.feed(c) for c in chunks] == expected


def test_selectors_are_kube_proxys() -> None:
    assert label_selector(None) == (
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    )
    assert label_selector("mine") == (
        "service.kubernetes.io/service-proxy-name=mine,!service.kubernetes.io/headless"
    )
    services, slices, nodes, _ = resources(None)
    assert services.selectors() == {
        "labelSelector": label_selector(None),
        "fieldSelector": SERVICE_FIELD_SELECTOR,
    }
    assert slices.selectors() == {"labelSelector": label_selector(None)}
    assert nodes.selectors() == {}
    _, _, only_n1, _ = resources(None, "n1")
    assert only_n1.selectors() == {"fieldSelector": "metadata.name=n1"}


# --- watch events through a reflector, with a sink that records


class RecordingSink:
    def __init__(self) -> None:
        self.applied: list[tuple[Key, str | None]] = []
        self.commits = 0
        self.changed = asyncio.Event()

    def apply(self, key: Key, obj: k8s.Service | None) -> None:
        self.applied.append((key, None if obj is None else obj.spec.cluster_ip))
        self.changed.set()

    def commit(self) -> None:
        self.commits += 1

    def mark_synced(self) -> None:
        pass


def _reflector() -> tuple[Reflector[k8s.Service], RecordingSink]:
    sink = RecordingSink()
    resource = Resource("Service", "/api/v1/services", k8s.Service)
    # No request is made: only the event handling is exercised.
    return Reflector(cast(ApiClient, None), resource, sink), sink


def _event(kind: str, obj: Mapping[str, object]) -> bytes:
    return msgspec.json.encode({"type": kind, "object": obj})


def _svc(name: str, rv: str, ip: str = "10.0.0.1", **spec: object) -> dict[str, object]:
    return {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": rv},
        "spec": {"clusterIP": ip, **spec},
    }


def test_events_update_the_cache_and_the_resource_version() -> None:
    reflector, sink = _reflector()
    reflector._event(_event("ADDED", _svc("a", "10")))
    reflector._event(_event("MODIFIED", _svc("a", "11", "10.0.0.2")))
    reflector._event(_event("ADDED", _svc("b", "12")))
    reflector._event(_event("DELETED", _svc("b", "13")))
    bookmark = {"kind": "Service", "apiVersion": "v1", "metadata": {"resourceVersion": "20"}}
    reflector._event(_event("BOOKMARK", bookmark))
    assert sink.applied == [
        (("ns", "a"), "10.0.0.1"),
        (("ns", "a"), "10.0.0.2"),
        (("ns", "b"), "10.0.0.1"),
        (("ns", "b"), None),
    ]
    assert reflector.known == {("ns", "a"): "11"}
    assert reflector.resource_version == "20"
    assert (reflector.stats.events, reflector.stats.bookmarks) == (4, 1)


def test_an_undecodable_object_is_reported_and_treated_as_absent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reflector, sink = _reflector()
    reflector._event(_event("ADDED", _svc("a", "10")))
    reflector._event(_event("MODIFIED", _svc("a", "11", ports=[{"port": "eighty"}])))
    assert sink.applied[-1] == (("ns", "a"), None)
    assert reflector.resource_version == "11"
    assert "Service ns/a: Expected `int | null`, got `str`" in caplog.text


def test_error_events() -> None:
    reflector, _ = _reflector()
    expired = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    with pytest.raises(Gone, match="too old"):
        reflector._event(_event("ERROR", expired))
    failed = {"kind": "Status", "code": 500, "reason": "InternalError", "message": "boom"}
    with pytest.raises(WatchFailed, match="500 InternalError: boom"):
        reflector._event(_event("ERROR", failed))


# --- which configuration


@pytest.mark.parametrize(
    ("kubeconfig", "environ", "existing", "expected"),
    [
        ("/k", {"KUBECONFIG": "/e"}, ["/k", "/e"], "/k"),
        (None, {"KUBECONFIG": "/e"}, ["/e", "/h/.kube/config"], "/e"),
        (None, {"KUBECONFIG": "/x:/e:/f"}, ["/e", "/f"], "/e:/f"),
        (
            None,
            {"KUBERNETES_SERVICE_HOST": "10.96.0.1"},
            ["/var/run/secrets/kubernetes.io/serviceaccount/token", "/h/.kube/config"],
            IN_CLUSTER,
        ),
        (None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, ["/h/.kube/config"], "/h/.kube/config"),
        (None, {}, ["/h/.kube/config"], "/h/.kube/config"),
    ],
    ids=["flag", "env", "env-list", "in-cluster", "no-token-file", "home"],
)
def test_configuration_order(
    kubeconfig: str | None, environ: dict[str, str], existing: list[str], expected: str
) -> None:
    chosen = choose_config(
        Path(kubeconfig) if kubeconfig else None,
        environ,
        is_file=lambda p: str(p) in existing,
        home=Path("/h"),
    )
    assert chosen == expected


@pytest.mark.parametrize(
    ("kubeconfig", "environ", "message"),
    [
        ("/k", {}, "kubeconfig /k: no such file"),
        (None, {"KUBECONFIG": "/e"}, r"\$KUBECONFIG=/e: no such file"),
        (None, {}, "no configuration: pass --kubeconfig"),
    ],
)
def test_missing_configuration(
    kubeconfig: str | None, environ: dict[str, str], message: str
) -> None:
    with pytest.raises(KubeConfigError, match=message):
        choose_config(
            Path(kubeconfig) if kubeconfig else None,
            environ,
            is_file=lambda p: False,
            home=Path("/h"),
        )


def test_orphan_slices_are_those_whose_service_is_not_served() -> None:
    store = Store()
    handle = store.source("t")
    handle.set_service(("a", "web"), Service(Namespace="a", Name="web"))
    for ns, name, service in (("a", "web-1", "web"), ("a", "db-1", "db"), ("b", "web-1", "web")):
        handle.set_slice((ns, name), Slice(ns, name, service, False, (), ()))
    handle.mark_synced()
    assert orphan_slices(store) == [("a", "db-1"), ("b", "web-1")]


def test_the_reflector_retries_an_unreachable_server_with_backoff() -> None:
    """The run loop against a loopback port where nothing listens: each failure is followed by
    the policy's next delay, through the injected sleep (so no time passes)."""
    delays: list[float] = []

    async def scenario() -> Reflector[k8s.Service]:
        enough = asyncio.Event()

        async def sleep(delay: float) -> None:
            delays.append(delay)
            if len(delays) == 5:
                enough.set()
                await asyncio.Event().wait()  # park until cancelled

        connection = _connection(f"https://127.0.0.1:{free_port()}", ssl.create_default_context())
        async with ApiClient(connection) as client:
            resource = Resource("Service", "/api/v1/services", k8s.Service)
            reflector = Reflector(client, resource, RecordingSink(), sleep=sleep, rand=lambda: 0.5)
            task = asyncio.create_task(reflector.run())
            await asyncio.wait_for(enough.wait(), 10)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return reflector

    reflector = asyncio.run(scenario())
    assert delays == pytest.approx([1.2, 2.4, 4.8, 9.6, 19.2])
    assert reflector.stats.failures == 5
    assert "Connection refused" in reflector.last_error
    assert not reflector.synced.is_set()


def _connection(server: str, context: ssl.SSLContext | None = None) -> Connection:
    return Connection(
        server=server,
        ssl_context=context,
        tls_server_name=None,
        proxy=None,
        source="test",
        _configuration=Configuration(),
        _loader=None,
    )


class ScriptedServer:
    """Just enough of an API server, in plain HTTP on a loopback port: a list answers
    ``listed``; each watch sends the lines of the next script, then nothing more until the
    client hangs up (a stream that stopped delivering). Notes each watch's resourceVersion."""

    def __init__(self, listed: object, watches: list[list[bytes]]) -> None:
        self.listed = msgspec.json.encode(listed)
        self.watches = watches
        self.watched_from: list[str] = []
        self._handlers: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                query = parse_qs(urlsplit(head.split(b" ", 2)[1].decode()).query)
                ok = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                if "watch" not in query:
                    writer.write(ok + b"Content-Length: %d\r\n\r\n" % len(self.listed))
                    writer.write(self.listed)
                    continue
                self.watched_from.append(query["resourceVersion"][0])
                writer.write(ok + b"Transfer-Encoding: chunked\r\n\r\n")
                for line in self.watches.pop(0) if self.watches else []:
                    writer.write(b"%x\r\n%s\n\r\n" % (len(line) + 1, line))
                await writer.drain()
                await reader.read()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def client(self, *, max_line: int = MAX_LINE) -> AsyncIterator[ApiClient]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            connection = _connection(f"http://127.0.0.1:{port}")
            async with ApiClient(connection, max_line=max_line) as client:
                yield client
        finally:
            server.close()
            # The client has hung up: its connections' handlers end, before the loop does.
            if self._handlers:
                await asyncio.wait(self._handlers, timeout=5)


def test_a_stream_whose_reading_is_paused_still_ends_at_the_idle_bound() -> None:
    """A connection whose reading is held paused (flow control) delivers nothing, and must still
    end at the idle bound: the bound is a timer around each read, not a socket timeout."""
    server = ScriptedServer({}, [[b'{"n":1}']])

    async def scenario() -> None:
        async with server.client() as client:
            params = {"watch": "1", "resourceVersion": "1"}
            async with client.stream_lines("/w", params, idle_timeout=0.3) as batches:
                assert await anext(batches) == [b'{"n":1}']
                assert client._session is not None
                (connection,) = client._session.http._busy
                transport = connection.writer.transport
                assert isinstance(transport, asyncio.ReadTransport)
                transport.pause_reading()
                with pytest.raises(StreamIdle, match=r"no data for 0\.3 s"):
                    await asyncio.wait_for(anext(batches), 10)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("bookmarks_seen", "level"),
    [(False, logging.INFO), (True, logging.WARNING)],
    ids=["no-bookmark-yet", "server-sends-bookmarks"],
)
def test_a_silent_watch_is_resumed_at_once_from_where_it_was(
    bookmarks_seen: bool, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A watch that delivers nothing (not even a bookmark) past the idle bound is ended and
    started again from the same resourceVersion, which then brings what the first withheld."""
    caplog.set_level(logging.INFO, logger="kpng.sources.kube.reflector")
    listed = {"metadata": {"resourceVersion": "10"}, "items": [_svc("a", "5")]}
    server = ScriptedServer(listed, [[], [_event("ADDED", _svc("b", "11", "10.0.0.2"))]])
    sink = RecordingSink()

    async def scenario() -> Reflector[k8s.Service]:
        async with server.client() as client:
            resource = Resource("Service", "/api/v1/services", k8s.Service)
            settings = ReflectorSettings(watch_idle_s=0.5)
            reflector = Reflector(
                client, resource, sink, settings, bookmarks_seen=lambda: bookmarks_seen
            )
            task = asyncio.create_task(reflector.run())
            try:
                async with asyncio.timeout(10):
                    while len(sink.applied) < 2:
                        sink.changed.clear()
                        await sink.changed.wait()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        return reflector

    reflector = asyncio.run(scenario())
    assert sink.applied == [(("ns", "a"), "10.0.0.1"), (("ns", "b"), "10.0.0.2")]
    assert server.watched_from == ["10", "10"]
    stats = reflector.stats
    assert (stats.watches, stats.idle_watches, stats.failures) == (2, 1, 0)
    (record,) = [r for r in caplog.records if "no data" in r.getMessage()]
    assert record.levelno == level
    assert record.getMessage().endswith(
        "no data for 0.5 s on the watch, not even a bookmark; watching again from "
        "resourceVersion 10"
    )


def test_objects_the_converters_reject_are_logged_and_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store()
    handle = store.source("t")
    sink = _HandleOutput[k8s.Service, Service](
        handle, lambda o: service_from_k8s(o, proxy_name=None), handle.set_service
    )
    good = msgspec.json.decode(msgspec.json.encode(_svc("a", "1")), type=k8s.Service)
    sink.apply(("ns", "a"), good)
    assert ("ns", "a") in store.services
    # The API would not accept this protocol; kpng must survive an API server that does.
    bad = msgspec.json.decode(
        msgspec.json.encode(_svc("a", "2", ports=[{"port": 80, "protocol": "QUIC"}])),
        type=k8s.Service,
    )
    sink.apply(("ns", "a"), bad)
    assert ("ns", "a") not in store.services
    assert "Service ns/a: spec.ports[0]: unknown protocol 'QUIC'; skipped" in caplog.text


# --- orphan slices after the first lists: reported once each, after a grace check

A, B, C = ("ns", "a"), ("ns", "b"), ("ns", "c")


def test_orphans_are_reported_once_and_only_when_they_last() -> None:
    reports = OrphanReports()
    assert reports.first([B, A]) == [A, B]  # after a complete list: at once
    steps = [
        ([A, B, C], []),  # C just arrived: maybe its Service is a watch event away
        ([A, B, C], [C]),  # still an orphan one check later
        ([A, B, C], []),  # nothing twice
        ([B], []),  # A and C found their Services
        ([A, B], []),  # A orphaned again: grace once more
        ([A, B], [A]),
        ([], []),
    ]
    for orphans, reported in steps:
        assert reports.check(orphans) == reported, orphans


# --- answers a broken or hostile API server can send


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def test_an_object_nested_too_deeply_is_reported_and_skipped_and_the_rest_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not even its metadata decodes (msgspec skips the rest recursively too): it is absent."""
    reflector, sink = _reflector()
    deep = msgspec.json.encode(_svc("a", "10")).replace(
        b'"spec":{', b'"spec":{"x":' + _deep(5000) + b","
    )
    listed: dict[Key, str] = {}
    reflector._apply_listed(msgspec.Raw(deep), listed)
    reflector._apply_listed(msgspec.Raw(msgspec.json.encode(_svc("b", "11"))), listed)
    assert listed == {("ns", "b"): "11"}
    assert sink.applied == [(("ns", "b"), "10.0.0.1")]
    assert "an object that does not decode (maximum recursion depth exceeded" in caplog.text
    assert reflector.stats.undecodable == 1


def test_a_watch_event_that_does_not_decode_fails_the_watch_and_lists_again() -> None:
    reflector, _ = _reflector()
    reflector._event(_event("ADDED", _svc("a", "10")))
    with pytest.raises(WatchFailed, match="does not decode"):
        reflector._event(b'{"type":"ADDED","object":' + _deep(5000) + b"}")
    assert reflector.resource_version == ""  # the next round lists


@pytest.mark.slow
@pytest.mark.parametrize(
    ("head", "body", "error"),
    [
        (b"Content-Length: \xc2\xb2\r\n", b"", "a malformed answer: bad Content-Length"),
        (
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\n",
            gzip.compress(b"\0" * (300 << 20)),
            "a body larger than",
        ),
    ],
    ids=["non-ascii-length", "gzip-bomb"],
)
def test_a_list_answer_past_the_bounds_is_a_reported_failure_not_a_crash(
    head: bytes, body: bytes, error: str
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        fields = head % len(body) if b"%d" in head else head
        writer.write(b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n" + body)
        await writer.drain()
        writer.close()

    async def scenario() -> str:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with ApiClient(_connection(f"http://127.0.0.1:{port}")) as client:
                with pytest.raises(TransportError) as failed:
                    await client.get("/api/v1/services", {})
                return str(failed.value)
        finally:
            server.close()

    assert error in asyncio.run(scenario())


def test_a_watch_line_past_the_bound_ends_the_watch() -> None:
    server = ScriptedServer({}, [[b"x" * (1 << 17)]])

    async def scenario() -> None:
        async with server.client(max_line=1 << 16) as client:
            params = {"watch": "1", "resourceVersion": "1"}
            async with client.stream_lines("/w", params, idle_timeout=5) as batches:
                with pytest.raises(TransportError, match="a watch event longer than 65536"):
                    await asyncio.wait_for(anext(batches), 10)

    asyncio.run(scenario())
