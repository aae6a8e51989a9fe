"""/healthz, /livez and /metrics: the verdict as a table, the feeders' stats with real
backends, and the kpng command answering HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.client import Backoff, NodeState
from kpng.feeding import Fanout, Feeder, FeederStats
from kpng.status import Status
from kpng.status.health import Busy, Verdict, judge
from kpng.testing import states
from kpng.testing.ports import free_port
from kpng.testing.waiting import eventually, until
from tests.conftest import EXAMPLE

WAIT_S = 15.0
T0 = 1000.0  # monotonic time of the table's "now"
WALL = 1_800_000_000.0


def _stats(pending_for: float | None, applied: bool = True, failures: int = 0) -> FeederStats:
    return FeederStats(
        pending_since=None if pending_for is None else T0 - pending_for,
        applied_revision=3 if applied else 0,
        last_applied=WALL - 5 if applied else None,
        failures=failures,
    )


# (backends, sources synced, live, healthy, reasons)
CASES: dict[str, tuple[dict[str, FeederStats], bool, bool, bool, list[str]]] = {
    "up to date": ({"to-nft": _stats(None)}, True, True, True, []),
    "a change waiting, within the timeout": ({"to-nft": _stats(9.9)}, True, True, True, []),
    "a change waiting past the timeout": (
        {"to-nft": _stats(10.5, failures=4)},
        True,
        False,
        False,
        ["to-nft has had a state waiting 10.5 s (timeout 10 s)"],
    ),
    "first state not applied yet, within the timeout": (
        {"to-nft": _stats(2.0, applied=False)},
        True,
        True,
        False,
        ["to-nft has not applied a state yet"],
    ),
    "first state never applied, past the timeout": (
        {"to-nft": _stats(11.0, applied=False)},
        True,
        False,
        False,
        ["to-nft has had a state waiting 11.0 s (timeout 10 s)"],
    ),
    "a first list slower than the timeout: nothing offered, live": (
        {"to-nft": FeederStats()},
        False,
        True,
        False,
        ["the sources have not synced yet", "to-nft has not applied a state yet"],
    ),
    "sources not synced": (
        {"to-nft": _stats(3.0, applied=False)},
        False,
        True,
        False,
        ["the sources have not synced yet", "to-nft has not applied a state yet"],
    ),
    "one of two backends late": (
        {"to-nft": _stats(None), "to-plugin": _stats(30.0)},
        True,
        False,
        False,
        ["to-plugin has had a state waiting 30.0 s (timeout 10 s)"],
    ),
    "no backends (to-api), synced": ({}, True, True, True, []),
    "no backends (to-api), not synced": (
        {},
        False,
        True,
        False,
        ["the sources have not synced yet"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_the_verdict(case: str) -> None:
    backends, synced, live, healthy, reasons = CASES[case]
    verdict = _judge(backends, synced=synced)
    assert (verdict.live, verdict.healthy) == (live, healthy)
    assert verdict.body["healthy"] is healthy
    assert verdict.body.get("reasons", []) == reasons
    assert verdict.body["currentTime"] == "2027-01-15T08:00:00.000+00:00"
    for name, stats in backends.items():
        reported = verdict.body["backends"][name]
        assert reported["failures"] == stats.failures
        assert reported["revision"] == stats.applied_revision


def test_last_updated_is_the_oldest_backends_last_apply() -> None:
    backends = {"a": _stats(None), "b": FeederStats(pending_since=None, last_applied=WALL - 60)}
    verdict = _judge(backends)
    assert verdict.body["lastUpdated"] == "2027-01-15T07:59:00.000+00:00"


def test_a_draining_node_fails_healthz_but_stays_live() -> None:
    verdict = _judge({"to-nft": _stats(None)}, eligible=False)
    assert (verdict.live, verdict.healthy) == (True, False)
    assert verdict.body["nodeEligible"] is False
    assert verdict.body["reasons"] == [
        "the node is unknown to the source, being deleted, or tainted "
        "ToBeDeletedByClusterAutoscaler"
    ]


def test_a_blocked_source_says_why_after_not_synced() -> None:
    blocked = ["source file: no usable state until these files parse: x.yaml: invalid YAML"]
    verdict = _judge({"to-nft": FeederStats()}, synced=False, blocked=blocked)
    assert verdict.body["reasons"] == [
        "the sources have not synced yet",
        *blocked,
        "to-nft has not applied a state yet",
    ]


@pytest.mark.parametrize(
    ("seconds", "live", "shown"), [(4.0, True, True), (10.5, False, True), (0.0, True, False)]
)
def test_a_busy_loop_shows_and_past_the_timeout_is_not_live(
    seconds: float, live: bool, shown: bool
) -> None:
    busy = Busy(seconds, "contribute (backends/_nftables/layout.py:358)") if seconds else None
    verdict = _judge({"to-nft": _stats(None)}, busy=busy)
    assert (verdict.live, verdict.healthy) == (live, live)
    assert ("busy" in verdict.body) == shown
    if not live:
        assert verdict.body["reasons"] == [
            "kpng's loop has not run for 10.5 s (timeout 10 s), busy in contribute "
            "(backends/_nftables/layout.py:358)"
        ]


def test_the_verdict_read_on_another_thread_names_where_the_loop_is_stuck() -> None:
    status = Status(timeout=60.0)
    started, release = threading.Event(), threading.Event()

    def stuck_loop() -> None:
        status.watch_loop(threading.get_ident())
        started.set()
        release.wait(10)

    thread = threading.Thread(target=stuck_loop)
    thread.start()
    try:
        assert started.wait(5)
        assert "busy" not in status.verdict().body
        assert status.loop_beat is not None
        status.loop_beat -= 61.0  # the beat a loop stuck for 61 s left
        verdict = status.verdict()
        assert not verdict.live
        assert verdict.body["busy"]["in"].startswith("stuck_loop (")
    finally:
        release.set()
        thread.join()


def _judge(
    backends: dict[str, FeederStats],
    *,
    synced: bool = True,
    eligible: bool = True,
    blocked: tuple[str, ...] | list[str] = (),
    busy: Busy | None = None,
) -> Verdict:
    return judge(
        backends=backends,
        sources_synced=synced,
        node_eligible=eligible,
        blocked=blocked,
        timeout=10.0,
        monotonic=T0,
        wall=WALL,
        busy=busy,
    )


# --- the feeders' stats, with a backend that fails on demand


class _Flaky:
    """Fails while ``failing``; while ``stepping``, each apply waits for a ``permits`` item."""

    def __init__(self) -> None:
        self.failing = False
        self.stepping = False
        self.permits: asyncio.Queue[None] = asyncio.Queue()
        self.entered: list[int] = []
        self.applied: list[int] = []

    async def apply(self, state: NodeState) -> bool:
        self.entered.append(state.revision)
        if self.stepping:
            await self.permits.get()
        if self.failing:
            raise RuntimeError("refused")
        self.applied.append(state.revision)
        return False

    async def close(self) -> None:
        pass


def test_a_failing_backend_stays_pending_since_its_oldest_unapplied_state() -> None:
    async def scenario() -> None:
        backend = _Flaky()
        feeder = Feeder("flaky", backend, backoff=Backoff(initial=0.01, maximum=0.02))
        assert feeder.stats.pending_since is None  # nothing offered yet: nothing behind
        task = asyncio.create_task(feeder.run())
        try:
            feeder.offer(states.state(1, {"a": states.entry("a")}))
            await eventually(lambda: feeder.stats.applied_revision == 1)
            assert feeder.stats.pending_since is None
            assert feeder.stats.applies == 1
            # Cumulative buckets: an apply of well under 16 s is in the last one at least.
            assert feeder.stats.apply_buckets[-1] == 1
            assert len(feeder.stats.apply_buckets) == len(FeederStats.BUCKETS_S)
            assert feeder.stats.applied_services == 1

            backend.failing = True
            before = time.monotonic()
            feeder.offer(states.state(2, {"a": states.entry("a", ["10.0.0.9"])}))
            await eventually(lambda: feeder.stats.failures >= 3)
            pending = feeder.stats.pending_since
            assert pending is not None
            assert before <= pending <= time.monotonic()
            feeder.offer(states.state(3, {"a": states.entry("a", ["10.0.0.10"])}))
            await eventually(lambda: feeder.stats.failures >= 5)
            assert feeder.stats.pending_since == pending  # retries do not reset the clock

            backend.failing = False
            await eventually(lambda: feeder.stats.applied_revision == 3)
            assert feeder.stats.pending_since is None
            assert backend.applied == [1, 3]

            # A state offered while another is being applied keeps the backend pending.
            backend.stepping = True
            feeder.offer(states.state(4, {}))
            await eventually(lambda: backend.entered[-1:] == [4])
            offered_during = time.monotonic()
            feeder.offer(states.state(5, {}))
            backend.permits.put_nowait(None)
            await eventually(lambda: backend.entered[-1:] == [5])
            assert feeder.stats.applied_revision == 4
            pending = feeder.stats.pending_since
            assert pending is not None
            assert pending >= offered_during
            backend.permits.put_nowait(None)
            await eventually(lambda: feeder.stats.applied_revision == 5)
            assert feeder.stats.pending_since is None
        finally:
            task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))


# --- the kpng command


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = _get(url)
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _start(
    kpng_command: list[str], env: dict[str, str], argv: list[str], log: Path, port: int
) -> subprocess.Popen[bytes]:
    address = f"127.0.0.1:{port}"
    command = [*kpng_command, "--healthz-address", address, "--metrics-address", address]
    with log.open("wb") as stderr:
        return subprocess.Popen([*command, "--healthz-timeout", "1", *argv], stderr=stderr, env=env)


def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()


@pytest.mark.slow
def test_a_backend_that_keeps_failing_turns_healthz_and_then_livez_to_503(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2"]
    argv += ["to-json", "--output", str(tmp_path / "state.json")]
    argv += ["to-plugin", "--plugin", f"gone=unix://{tmp_path / 'gone.sock'}"]
    log = tmp_path / "kpng.log"
    proc = _start(kpng_command, subprocess_env, argv, log, port)
    try:

        def to_json_applied() -> bool:
            status, body = _get(f"{base}/healthz")
            backends = json.loads(body).get("backends", {}) if status else {}
            revision: int = backends.get("to-json", {}).get("revision", 0)
            return revision == 1

        # The server answers from the start, before the file is read: the plugin's state is
        # late only once to-json has had its own.
        until(to_json_applied, "to-json's first state")
        status, body = _get(f"{base}/healthz")
        assert status == 503
        report = json.loads(body)
        assert "to-plugin gone has not applied a state yet" in report["reasons"]
        # The plugin's first state has waited past the 1 s timeout: not live either.
        until(lambda: _get(f"{base}/livez")[0] == 503, "/livez to turn 503")
        samples = _metrics(f"{base}/metrics")
        assert samples[("kpng_backend_applied_revision", (("backend", "to-json"),))] == 1
        gone = (("backend", "to-plugin gone"),)
        assert samples[("kpng_backend_applied_revision", gone)] == 0
        assert samples[("kpng_backend_apply_failures_total", gone)] >= 1
        assert samples[("kpng_backend_pending_seconds", gone)] > 1
        assert samples[("kpng_backend_pending_seconds", (("backend", "to-json"),))] == 0
        assert samples[("kpng_healthy", ())] == 0
        # kube-proxy's /proxyMode, on the metrics address: kpng's backends.
        assert _get(f"{base}/proxyMode") == (200, "to-json,to-plugin")
    finally:
        _stop(proc, log)


NODE_2 = (
    "  name: node-2\n"
    "  labels: {topology.kubernetes.io/zone: zone-a, kubernetes.io/hostname: node-2}\n"
)
DRAINING = (
    NODE_2,
    NODE_2 + "spec:\n  taints: [{key: ToBeDeletedByClusterAutoscaler, effect: NoSchedule}]\n",
)


BAD_SERVICE = """---
apiVersion: v1
kind: Service
metadata: {name: bad, namespace: shop}
spec: {clusterIP: 10.96.0.99, ports: [{port: 70000}]}
"""


@pytest.mark.slow
def test_healthz_follows_the_state_the_node_and_metrics_count_it(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    source = tmp_path / "cluster.yaml"
    source.write_text(EXAMPLE.read_text() + BAD_SERVICE)
    assert NODE_2 in source.read_text()
    argv = ["file", "--input", str(source), "to-local", "--node-name", "node-2"]
    argv += ["to-json", "--output", str(tmp_path / "state.json")]
    log = tmp_path / "kpng.log"
    proc = _start(kpng_command, subprocess_env, argv, log, port)
    try:
        until(lambda: _get(f"{base}/healthz")[0] == 200, "/healthz to answer 200")
        assert _get(f"{base}/livez")[0] == 200
        samples = _metrics(f"{base}/metrics")
        assert samples[("kpng_sources_synced", ())] == 1
        assert samples[("kpng_store_objects", (("kind", "Node"),))] == 3
        assert samples[("kpng_backend_services", (("backend", "to-json"),))] == 6
        count = samples[("kpng_backend_apply_duration_seconds_count", (("backend", "to-json"),))]
        assert count >= 1
        every = (
            "kpng_backend_apply_duration_seconds_bucket",
            (("backend", "to-json"), ("le", "+Inf")),
        )
        assert samples[every] == count
        within_16s = (("backend", "to-json"), ("le", "16.384"))
        assert samples[("kpng_backend_apply_duration_seconds_bucket", within_16s)] == count
        assert samples[("process_resident_memory_bytes", ())] > 0
        assert samples[("kpng_source_synced", (("source", "file"),))] == 1
        assert samples[("kpng_source_skipped_objects_total", (("source", "file"),))] == 1

        source.write_text(source.read_text().replace("port: 80, targetPort: http", "port: 81"))
        to_json = ("kpng_backend_applied_revision", (("backend", "to-json"),))
        until(lambda: _metrics(f"{base}/metrics")[to_json] == 2, "revision 2 to be applied")
        assert _get(f"{base}/healthz")[0] == 200

        # The cluster autoscaler marks node-2 for removal: load balancers must drain it.
        source.write_text(source.read_text().replace(DRAINING[0], DRAINING[1]))
        until(lambda: _get(f"{base}/healthz")[0] == 503, "/healthz to drain the node")
        assert json.loads(_get(f"{base}/healthz")[1])["nodeEligible"] is False
        assert _get(f"{base}/livez")[0] == 200
        assert _metrics(f"{base}/metrics")[("kpng_node_eligible", ())] == 0
        source.write_text(source.read_text().replace(DRAINING[1], DRAINING[0]))
        until(lambda: _get(f"{base}/healthz")[0] == 200, "/healthz after the taint is gone")
    finally:
        _stop(proc, log)


@pytest.mark.slow
def test_a_bad_or_taken_address_is_a_clear_error(
    kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    argv = ["file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2", "to-json"]
    bad = subprocess.run(
        [*kpng_command, "--healthz-address", "localhost", *argv],
        capture_output=True, text=True, env=subprocess_env, timeout=WAIT_S,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--healthz-bind-address wants HOST:PORT, got 'localhost'" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [*kpng_command, "--metrics-address", f"127.0.0.1:{port}", *argv],
            capture_output=True, text=True, env=subprocess_env, timeout=WAIT_S,
        )  # fmt: skip
    assert busy.returncode == 1
    assert f"cannot serve HTTP on 127.0.0.1:{port}: Address already in use" in busy.stderr


@pytest.mark.slow
def test_to_api_reports_its_watches(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    socket_path = tmp_path / "api.sock"
    argv = ["file", "--input", str(EXAMPLE), "to-api", "--listen", f"unix://{socket_path}"]
    log = tmp_path / "kpng.log"
    server = _start(kpng_command, subprocess_env, argv, log, port)
    out = tmp_path / "state.json"
    local = f"local --api unix://{socket_path} --node-name node-2 to-json --output {out}"
    client = subprocess.Popen(
        [*kpng_command, *local.split()], stderr=subprocess.DEVNULL, env=subprocess_env
    )
    watches = ("kpng_api_watches", (("state", "local"),))
    try:
        until(lambda: out.exists() and out.stat().st_size > 0, "the client's first state")
        samples = _metrics(f"{base}/metrics")
        assert samples[watches] == 1
        assert samples[("kpng_api_change_sets_total", (("state", "local"),))] >= 1
        assert samples[("kpng_api_watches", (("state", "global"),))] == 0
        # Its first state was sent: no watch waits for a turn, none was ended.
        for name in (
            "kpng_api_first_states_waiting",
            "kpng_api_first_state_oldest_wait_seconds",
            "kpng_api_first_states_parked",
            "kpng_api_watches_ended_total",
        ):
            assert samples[(name, ())] == 0, name
        assert _get(f"{base}/healthz")[0] == 200  # no backends: synced sources are enough
        assert samples[("kpng_healthy", ())] == 1
        client.terminate()
        client.wait(timeout=WAIT_S)
        until(lambda: _metrics(f"{base}/metrics")[watches] == 0, "the watch to close")
        # The agent ended its stream while the brain waited for a change to send it (CANCELLED):
        # counted, and none ended early.
        ended = {
            labels[0][1]: n
            for (name, labels), n in _metrics(f"{base}/metrics").items()
            if name == "kpng_api_calls_ended_total"
        }
        assert ended["CANCELLED"] == 1, ended
        assert sum(ended.values()) == 1, ended
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        _stop(server, log)


def test_behind_a_remote_brain_a_draining_node_fails_healthz_as_the_brain_says() -> None:
    """kpng local has no store: what it knows of its node is what the brain's states say."""

    async def scenario() -> list[bool]:
        status = Status(timeout=60.0)  # no store: kpng local
        fanout = status.track(Fanout([("to-x", _Flaky())]))
        seen = [status.node_eligible]
        for revision, draining in ((1, True), (2, False)):
            await fanout.apply(
                msgspec.structs.replace(states.keyed_state(revision, {}), draining=draining)
            )
            seen.append(status.node_eligible)
        await fanout.close()
        return seen

    assert asyncio.run(scenario()) == [True, False, True]


def test_the_http_limits_are_flags_with_the_servers_defaults() -> None:
    from kpng import cli
    from kpng.http1 import server as http_server

    parser = cli._main_parser()
    assert parser.get_default("http_max_connections") == http_server.MAX_CONNECTIONS
    assert parser.get_default("http_request_timeout") == http_server.REQUEST_S


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.slow
def test_http_max_connections_and_request_timeout_take_effect(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    """With 2 connections a listener and half a second a request: a trickled head is closed
    long before the default's 10 s, and a third connection closes the one idle longest."""
    port = free_port()
    limits = ["--http-max-connections", "2", "--http-request-timeout", "0.5"]
    argv = [*limits, "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2"]
    argv += ["to-json", "--output", str(tmp_path / "state.json")]
    log = tmp_path / "kpng.log"
    proc = _start(kpng_command, subprocess_env, argv, log, port)

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
        time.sleep(0.1)  # accepted, and so counted, before the next one
        return sock

    try:
        until(lambda: _get(f"http://127.0.0.1:{port}/healthz")[0] == 200, "/healthz to answer")
        with connect() as trickler:
            trickler.sendall(b"GET /healthz HTTP/1.1\r\n")
            started = time.monotonic()
            assert _closed_by_server(trickler)
            assert time.monotonic() - started < 5.0
        with connect() as first, connect() as second, connect():
            assert _closed_by_server(first)  # for the newcomer
            second.settimeout(0.5)
            with pytest.raises(TimeoutError):
                second.recv(1)  # still open, idle
    finally:
        _stop(proc, log)
