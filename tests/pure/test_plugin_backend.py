"""to-plugin against real plugin processes on unix sockets: sessions, diffs, and every fault."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from kpng.api import localv1_pb2, pluginv1_pb2
from kpng.backends.plugin import PluginsBackend
from kpng.backends.plugin.changes import ChangeSets
from kpng.backends.plugin.config import PluginSpec, parse_plugin, plugins_in_directory
from kpng.backends.plugin.connection import explain
from kpng.client import Backoff
from kpng.errors import UsageError
from kpng.testing import states
from kpng.testing.waiting import eventually, json_lines, until
from tests.conftest import EXAMPLE

T = TypeVar("T")
WAIT_S = 15.0
LOGGERS = ("kpng.backends.plugin", "kpng.feeding")
Plugin = Callable[..., Path]


def _run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGERS)]


def _backend(*specs: PluginSpec, directory: Path | None = None, timeout: float = 5.0) -> Any:
    return PluginsBackend(
        specs,
        directory=directory,
        timeout=timeout,
        interval=0.1,
        backoff=Backoff(initial=0.05, maximum=0.2),
    )


class Plugins:
    """Test plugin processes (tests/plugin_server.py), stopped at the end of the test."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[Path, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str, socket: Path | None = None) -> Path:
        """Start plugin ``name``; returns its socket. Its record is ``record(name)``."""
        socket = socket or self.tmp / f"{name}.sock"
        socket.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "tests.plugin_server", "--socket", str(socket)]
        proc = subprocess.Popen(
            [*argv, "--record", str(self.record(name)), *args], stdout=subprocess.PIPE
        )
        self.procs[socket] = proc
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        return socket

    def record(self, name: str) -> Path:
        return self.tmp / f"{name}.jsonl"

    def kill(self, socket: Path) -> None:
        proc = self.procs.pop(socket)
        proc.kill()
        proc.wait(timeout=WAIT_S)
        assert proc.stdout is not None
        proc.stdout.close()

    def stop_all(self) -> None:
        for socket in list(self.procs):
            self.kill(socket)


@pytest.fixture
def plugins(tmp_path: Path) -> Iterator[Plugins]:
    started = Plugins(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(autouse=True)
def _info_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kpng")


# --- configuration and encoding: pure


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("a=unix:///run/a.sock", PluginSpec("a", Path("/run/a.sock"))),
        (
            "guard=unix:///run/g.sock,config=/etc/g.conf",
            PluginSpec("guard", Path("/run/g.sock"), Path("/etc/g.conf")),
        ),
    ],
)
def test_plugin_flag_names_a_socket_and_a_config(text: str, spec: PluginSpec) -> None:
    assert parse_plugin(text) == spec


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("unix:///run/a.sock", "expected NAME=unix:///PATH"),
        ("a=tcp://127.0.0.1:1", "a plugin is a unix socket"),
        ("a=unix://relative.sock", "a plugin is a unix socket"),
        ("a=unix:///a.sock,mode=1", "unknown option 'mode=1'"),
        ("a/b=unix:///a.sock", "expected NAME=unix:///PATH"),
    ],
)
def test_bad_plugin_flags_say_why(text: str, error: str) -> None:
    with pytest.raises(UsageError, match=error):
        parse_plugin(text)


def test_a_plugin_directory_offers_each_socket_with_its_optional_config() -> None:
    found = plugins_in_directory(Path("/p"), ["a.sock", "a.conf", "b.sock", "c.conf", "x.txt"])
    assert found == {
        "a": PluginSpec("a", Path("/p/a.sock"), Path("/p/a.conf"), config_optional=True),
        "b": PluginSpec("b", Path("/p/b.sock"), Path("/p/b.conf"), config_optional=True),
    }


def _decoded(request: bytes) -> tuple[int, bool, list[tuple[str, str]]]:
    message = pluginv1_pb2.ApplyRequest.FromString(request)
    ops = []
    for op in message.Ops:
        kind = op.WhichOneof("Op")
        path = op.Set.Ref.Path if kind == "Set" else op.Delete.Path if kind == "Delete" else ""
        ops.append((str(kind), path))
    return message.Revision, message.Full, ops


def test_change_sets_are_whole_states_or_diffs_in_the_watch_framing() -> None:
    a1, b = states.entry("a", ["10.0.0.1"]), states.entry("b", ["10.0.0.9"])
    a2 = states.entry("a", ["10.0.0.2"])
    changes = ChangeSets(pluginv1_pb2.PROTOBUF)
    first = states.state(1, {"a": a1, "b": b})
    assert _decoded(changes.whole(first)) == (
        1,
        True,
        [
            ("Reset", ""),
            ("Set", "node"),  # the node's facts, before the services
            ("Set", "ns/a"),
            ("Set", "ns/a/10.0.0.1"),
            ("Set", "ns/b"),
            ("Set", "ns/b/10.0.0.9"),
            ("Sync", ""),
        ],
    )
    second = states.state(2, {"a": a2}, updated=["a"], deleted=["b"])
    assert _decoded(changes.diff(second, first.services)) == (
        2,
        False,
        [
            ("Set", "ns/a/10.0.0.2"),
            ("Delete", "ns/a/10.0.0.1"),
            ("Delete", "ns/b/10.0.0.9"),
            ("Delete", "ns/b"),
            ("Sync", ""),
        ],
    )
    message = pluginv1_pb2.ApplyRequest.FromString(changes.whole(second))
    assert localv1_pb2.NodeFacts.FromString(message.Ops[1].Set.Bytes) == localv1_pb2.NodeFacts()
    assert localv1_pb2.Endpoint.FromString(message.Ops[3].Set.Bytes).IPs.V4 == ["10.0.0.2"]
    as_json = pluginv1_pb2.ApplyRequest.FromString(ChangeSets(pluginv1_pb2.JSON).whole(second))
    assert json.loads(as_json.Ops[2].Set.Bytes)["Name"] == "a"


def test_failed_calls_are_explained_in_the_plugins_terms() -> None:
    code = grpc.StatusCode
    assert explain(code.DEADLINE_EXCEEDED, "", call="Apply", timeout=2) == (
        "Apply got no answer within 2 s"
    )
    assert "not a kpng plugin" in explain(code.UNIMPLEMENTED, "x", call="Describe", timeout=2)
    assert explain(code.FAILED_PRECONDITION, "busy", call="Apply", timeout=2) == (
        "it refused Apply: FAILED_PRECONDITION: busy"
    )
    too_large = explain(code.RESOURCE_EXHAUSTED, "larger than max", call="Health", timeout=2)
    assert too_large.startswith("Health: a message was larger than its receiver takes")
    assert "kpng takes answers up to 16 MiB" in too_large


# --- real plugins


A1 = states.entry("a", ["10.0.0.1"])
A2 = states.entry("a", ["10.0.0.2"])
B = states.entry("b", ["10.0.0.9"])


def test_a_diffs_plugin_gets_the_whole_state_then_only_changes(plugins: Plugins) -> None:
    socket = plugins.start("d", "--wants", "diffs")
    backend = _backend(PluginSpec("d", socket))
    record = plugins.record("d")

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1, "b": B}))
            await eventually(lambda: len(json_lines(record)) == 1, "the first state")
            await backend.apply(states.state(2, {"a": A2}, updated=["a"], deleted=["b"]))
            await eventually(lambda: len(json_lines(record)) == 2, "the change")
        finally:
            await backend.close()

    _run(scenario())
    first, second = json_lines(record)
    assert (first["revision"], first["full"]) == (1, True)
    # Reset, the node's facts, two services and their endpoints, Sync
    assert [op[0] for op in first["ops"]] == ["Reset", "Set", "Set", "Set", "Set", "Set", "Sync"]
    assert (second["revision"], second["full"]) == (2, False)
    assert second["ops"] == [
        ["Set", 2, "ns/a/10.0.0.2", "['10.0.0.2']"],
        ["Delete", 2, "ns/a/10.0.0.1"],
        ["Delete", 2, "ns/b/10.0.0.9"],
        ["Delete", 1, "ns/b"],
        ["Sync"],
    ]


def test_a_full_plugin_gets_every_state_whole_in_json(plugins: Plugins) -> None:
    socket = plugins.start("f", "--encoding", "json")
    backend = _backend(PluginSpec("f", socket))
    record = plugins.record("f")

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: len(json_lines(record)) == 1, "the first state")
            await backend.apply(states.state(2, {"a": A1, "b": B}, updated=["b"]))
            await eventually(lambda: len(json_lines(record)) == 2, "the second state")
        finally:
            await backend.close()

    _run(scenario())
    second = json_lines(record)[1]
    assert second["full"] is True
    assert [op[2] for op in second["ops"] if op[0] == "Set"] == [
        "node",  # a whole state has the node's facts again
        "ns/a",
        "ns/a/10.0.0.1",
        "ns/b",
        "ns/b/10.0.0.9",
    ]
    assert second["ops"][4][3] == "b"  # the JSON payload, decoded by the plugin


def test_a_refused_state_is_logged_and_retried_whole(
    plugins: Plugins, caplog: pytest.LogCaptureFixture
) -> None:
    socket = plugins.start("r", "--wants", "diffs", "--refuse", "2")
    backend = _backend(PluginSpec("r", socket))
    record = plugins.record("r")

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: len(json_lines(record)) == 1, "a state taken")
        finally:
            await backend.close()

    _run(scenario())
    assert json_lines(record)[0]["full"] is True
    refusals = [m for m in _messages(caplog) if "it refused" in m]
    assert (
        refusals
        == [
            "to-plugin r failed to apply revision 1: it refused Apply: FAILED_PRECONDITION: "
            "not ready for states yet; retrying with the whole state"
        ]
        * 2
    )


@pytest.mark.slow
def test_a_hung_plugin_hits_the_deadline_and_the_others_go_on(
    plugins: Plugins, caplog: pytest.LogCaptureFixture
) -> None:
    hung = plugins.start("hung", "--hang")
    good = plugins.start("good")
    backend = _backend(PluginSpec("hung", hung), PluginSpec("good", good), timeout=0.3)

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await backend.apply(states.state(2, {"a": A2}, updated=["a"]))
            await eventually(
                lambda: [r["revision"] for r in json_lines(plugins.record("good"))][-1:] == [2],
                "the good plugin to keep up",
            )
            await eventually(
                lambda: sum("got no answer within 0.3 s" in m for m in _messages(caplog)) >= 2,
                "two deadlines",
            )
        finally:
            await backend.close()

    _run(scenario())
    assert not json_lines(plugins.record("hung"))


def test_a_missing_socket_is_logged_and_the_plugin_fed_once_it_appears(
    plugins: Plugins, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    socket = tmp_path / "late.sock"
    backend = _backend(PluginSpec("late", socket))

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: any("does not exist" in m for m in _messages(caplog)), "log")
            await asyncio.to_thread(plugins.start, "late", socket=socket)
            await eventually(lambda: bool(json_lines(plugins.record("late"))), "a state")
        finally:
            await backend.close()

    _run(scenario())
    assert f"socket {socket} does not exist (is the plugin running?)" in "\n".join(
        _messages(caplog)
    )
    assert json_lines(plugins.record("late"))[0]["full"] is True


@pytest.mark.slow
def test_a_crashed_plugin_gets_the_whole_state_when_it_is_back_without_a_new_change(
    plugins: Plugins, caplog: pytest.LogCaptureFixture
) -> None:
    socket = plugins.start("c", "--wants", "diffs")
    backend = _backend(PluginSpec("c", socket))
    record = plugins.record("c")

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: len(json_lines(record)) == 1, "the first state")
            plugins.kill(socket)
            await eventually(
                lambda: any("starting a new session" in m for m in _messages(caplog)), "noticed"
            )
            await asyncio.to_thread(plugins.start, "c", "--wants", "diffs", socket=socket)
            await eventually(lambda: len(json_lines(record)) == 2, "the state again")
        finally:
            await backend.close()

    _run(scenario())
    again = json_lines(record)[1]
    assert (again["revision"], again["full"]) == (1, True)


def test_a_changed_config_starts_a_new_session_with_it(plugins: Plugins, tmp_path: Path) -> None:
    config = tmp_path / "c.conf"
    config.write_text("one")
    socket = plugins.start("cf", "--wants", "diffs")
    backend = _backend(PluginSpec("cf", socket, config))
    record = plugins.record("cf")

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: len(json_lines(record)) == 1, "the first state")
            config.write_text("two")
            await eventually(lambda: len(json_lines(record)) == 2, "the state again")
        finally:
            await backend.close()

    _run(scenario())
    assert [(r["config"], r["full"]) for r in json_lines(record)] == [("one", True), ("two", True)]


def test_a_missing_named_config_is_an_error_the_plugin_is_retried_for(
    plugins: Plugins, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "absent.conf"
    socket = plugins.start("nc")
    backend = _backend(PluginSpec("nc", socket, config))

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: any("absent.conf" in m for m in _messages(caplog)), "log")
            config.write_text("{}")
            await eventually(lambda: bool(json_lines(plugins.record("nc"))), "a state")
        finally:
            await backend.close()

    _run(scenario())
    assert f"its configuration {config} does not exist" in "\n".join(_messages(caplog))


@pytest.mark.slow
def test_a_plugin_directory_is_followed_as_plugins_come_and_go(
    plugins: Plugins, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "plugins"
    directory.mkdir()
    (directory / "one.conf").write_text("cidrs")
    plugins.start("one", socket=directory / "one.sock")
    backend = _backend(directory=directory)

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: bool(json_lines(plugins.record("one"))), "one fed")
            await asyncio.to_thread(plugins.start, "two", socket=directory / "two.sock")
            await eventually(lambda: bool(json_lines(plugins.record("two"))), "two found and fed")
            plugins.kill(directory / "two.sock")
            (directory / "two.sock").unlink()
            await eventually(lambda: "two" not in backend.members, "two forgotten")
        finally:
            await backend.close()

    _run(scenario())
    assert json_lines(plugins.record("one"))[0]["config"] == "cidrs"
    assert json_lines(plugins.record("two"))[0]["config"] == ""
    messages = _messages(caplog)
    assert f"to-plugin: found plugin two at unix://{directory / 'two.sock'}" in messages
    assert f"to-plugin: plugin two left {directory}" in messages


def test_a_plugin_directorys_entry_that_is_no_socket_is_no_plugin(
    plugins: Plugins, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "plugins"
    directory.mkdir()
    (directory / "file.sock").write_text("")
    (directory / "dir.sock").mkdir()
    plugins.start("one", socket=directory / "one.sock")
    backend = _backend(directory=directory)

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: bool(json_lines(plugins.record("one"))), "one fed")
            await asyncio.sleep(0.3)  # rescans
            assert set(backend.members) == {"one"}
        finally:
            await backend.close()

    _run(scenario())
    warned = [m for m in _messages(caplog) if "is not a socket" in m]
    assert sorted(warned) == [
        f"to-plugin: {directory / 'dir.sock'} is not a socket: not a plugin",
        f"to-plugin: {directory / 'file.sock'} is not a socket: not a plugin",
    ]


def test_an_unhealthy_plugin_is_logged_once(
    plugins: Plugins, caplog: pytest.LogCaptureFixture
) -> None:
    socket = plugins.start("u", "--unhealthy", "the kernel table is gone")
    backend = _backend(PluginSpec("u", socket))

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await asyncio.sleep(0.6)  # several health checks
        finally:
            await backend.close()

    _run(scenario())
    unhealthy = [m for m in _messages(caplog) if "reports it is" in m]
    assert unhealthy == ["plugin u reports it is unhealthy: the kernel table is gone"]


@pytest.mark.slow
def test_a_grpc_server_of_another_api_is_reported_as_the_wrong_protocol(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kpng_command: list[str]
) -> None:
    socket = tmp_path / "api.sock"
    argv = [*kpng_command, "file", "--input", str(EXAMPLE), "to-api", "--listen"]
    server = subprocess.Popen([*argv, f"unix://{socket}"], stderr=subprocess.DEVNULL)
    backend = _backend(PluginSpec("api", socket))

    async def scenario() -> None:
        try:
            await eventually(socket.exists, "the kpng server")
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(lambda: any("not a kpng plugin" in m for m in _messages(caplog)), "")
        finally:
            await backend.close()

    try:
        _run(scenario())
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=WAIT_S)
    assert "does not serve kpng.pluginv1.Plugin/Describe" in "\n".join(_messages(caplog))


def test_a_socket_that_does_not_speak_grpc_is_reported_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    socket = tmp_path / "http.sock"
    backend = _backend(PluginSpec("http", socket), timeout=1.0)
    accepted = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_unix_server(answer, path=str(socket))
        try:
            await backend.apply(states.state(1, {"a": A1}))
            await eventually(
                lambda: sum("failed to apply" in m for m in _messages(caplog)) >= 2, "retries"
            )
        finally:
            await backend.close()
            server.close()
            await server.wait_closed()

    _run(scenario())
    failures = [m for m in _messages(caplog) if "failed to apply" in m]
    assert accepted >= 2
    assert all("to-plugin http failed to apply revision 1: " in m for m in failures)
    assert all("cannot reach it" in m or "no answer" in m for m in failures), failures


def _cluster(port: int) -> str:
    """One Service, node-local to any node, whose port is ``port``: a change per step."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.10",
            "clusterIPs": ["10.96.0.10"],
            "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 8080}],
        },
    }
    return json.dumps(service)


def _json_port(line: dict[str, Any]) -> int | None:
    services = line.get("services") or []
    return services[0]["service"]["Ports"][0]["Port"] if services else None


def _has_port(output: Path, port: int) -> Callable[[], bool]:
    return lambda: _json_port(json_lines(output)[-1]) == port


def _has_revision(record: Path, revision: int) -> Callable[[], bool]:
    return lambda: bool(json_lines(record)) and json_lines(record)[-1]["revision"] >= revision


@pytest.mark.slow
def test_a_slow_plugin_stalls_neither_the_fast_one_nor_the_other_backends(
    plugins: Plugins, tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    """One kpng: to-plugin with a plugin that takes 5 s per Apply and one that answers at
    once, and to-json. Each change reaches the fast plugin and to-json within 2.5 s of its
    write (well under the slow plugin's 5 s), while the slow one lags, fed coalesced states."""
    slow = plugins.start("slow", "--delay", "5")
    fast = plugins.start("fast")
    cluster, output = tmp_path / "cluster.json", tmp_path / "states.jsonl"
    cluster.write_text(_cluster(80))
    argv = [
        *kpng_command, "file", "--input", str(cluster), "to-local", "--node-name", "node-1",
        "to-plugin", "--plugin", f"slow=unix://{slow}", "--plugin", f"fast=unix://{fast}",
        "to-json", "--output", str(output),
    ]  # fmt: skip
    kpng = subprocess.Popen(argv, env=subprocess_env, stderr=subprocess.DEVNULL)
    bound_s = 2.5
    lags: list[tuple[float, float]] = []
    try:
        until(lambda: _json_port((json_lines(output) or [{}])[-1]) == 80, "the first state")
        until(lambda: bool(json_lines(plugins.record("fast"))), "the fast plugin fed")
        for port in range(81, 87):
            written = time.time()
            cluster.write_text(_cluster(port))
            until(_has_port(output, port), f"to-json: {port}")
            json_at = time.time()
            revision = json_lines(output)[-1]["revision"]
            until(_has_revision(plugins.record("fast"), revision), f"the fast plugin: {revision}")
            fast_at = json_lines(plugins.record("fast"))[-1]["at"]
            lags.append((json_at - written, fast_at - written))
            time.sleep(0.3)
        slow_revisions = [r["revision"] for r in json_lines(plugins.record("slow"))]
        fast_revisions = [r["revision"] for r in json_lines(plugins.record("fast"))]
    finally:
        kpng.send_signal(signal.SIGTERM)
        kpng.wait(timeout=WAIT_S)
    assert all(json_lag < bound_s and fast_lag < bound_s for json_lag, fast_lag in lags), lags
    assert len(slow_revisions) < len(fast_revisions) - 3, (slow_revisions, fast_revisions)


@pytest.mark.parametrize(
    ("text", "limit", "shown"),
    [
        ("ok", 10, "ok"),
        ("\x1b[31mred\rover\nline\ttab", 100, "\\x1b[31mred\\x0dover\\x0aline\ttab"),
        ("x" * 20, 8, "xxxxxxxx [cut]"),
    ],
    ids=["plain", "controls-escaped", "cut"],
)
def test_a_peers_text_is_logged_escaped_and_bounded(text: str, limit: int, shown: str) -> None:
    from kpng.logs import printable

    assert printable(text, limit) == shown
