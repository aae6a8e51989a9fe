"""to-exec with real programs: what they read, restarts, stderr, slow readers, bad commands."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from kpng.backends._jsonlines import StateLines
from kpng.backends.exec import ExecBackend
from kpng.backends.exec.formats import FullFormat, OpsFormat
from kpng.backends.exec.output import BoundedLineSplitter, LineLimiter
from kpng.client import Backoff
from kpng.feeding import Feeder
from kpng.testing import states
from kpng.testing.waiting import eventually, json_lines
from tests.conftest import EXAMPLE

T = TypeVar("T")
WAIT_S = 15.0
LOGGER = "kpng.backends.exec"

# A program that appends what it reads to a file, line by line, until EOF.
COPY = (
    "import sys\nout = open(sys.argv[1], 'ab', buffering=0)\n"
    "for line in sys.stdin.buffer:\n    out.write(line)\n"
)


def _run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


def _fast() -> Backoff:
    return Backoff(initial=0.05, maximum=0.2)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]


# --- formats and stderr handling: pure


def test_ops_format_writes_each_change_as_one_line_and_closes_states_with_sync() -> None:
    a1 = states.entry("a", ["10.0.0.1"])
    a2 = states.entry("a", ["10.0.0.2"])
    b = states.entry("b")
    form = OpsFormat()

    async def encode() -> list[bytes]:
        return [
            await form.encode(
                msgspec.structs.replace(states.state(1, {"a": a1}), service_cidrs=("10.96.0.0/16",))
            ),
            await form.encode(states.state(2, {"a": a2, "b": b})),
            await form.encode(states.state(3, {"b": b}, updated=[], deleted=["a"])),
        ]

    first, second, third = (
        [json.loads(line) for line in chunk.splitlines()] for chunk in _run(encode())
    )
    ep1 = json.loads(json.dumps({"IPs": {"V4": ["10.0.0.1"]}}))
    assert first[0] == {"op": "reset", "node": "node-1"}
    # the node's facts first, as a watch sends them; again only when they change
    assert first[1] == {"op": "set_node", "facts": {"ServiceCIDRs": ["10.96.0.0/16"]}}
    assert first[2]["op"] == "set_service"
    assert first[2]["service"]["Name"] == "a"
    assert first[3]["op"] == "set_endpoint"
    assert (first[3]["namespace"], first[3]["service"], first[3]["key"]) == ("ns", "a", "10.0.0.1")
    assert first[3]["endpoint"]["IPs"] == ep1["IPs"]
    assert first[4] == {"op": "sync", "revision": 1}
    assert [(op["op"], op.get("key") or op.get("service", {}).get("Name")) for op in second] == [
        ("set_node", None),  # the facts went back to none
        ("set_service", "b"),  # the watch API's order: every service set first
        ("set_endpoint", "10.0.0.2"),
        ("delete_endpoint", "10.0.0.1"),
        ("sync", None),
    ]
    assert third == [
        {"op": "delete_endpoint", "namespace": "ns", "service": "a", "key": "10.0.0.2"},
        {"op": "delete_service", "namespace": "ns", "name": "a"},
        {"op": "sync", "revision": 3},
    ]


def test_full_format_is_the_to_json_line() -> None:
    services = {"a": states.entry("a", ["10.0.0.1"]), "b": states.entry("b")}
    state = states.state(7, services)
    assert _run(FullFormat().encode(state)) == StateLines().encode(state)


@pytest.mark.parametrize(
    ("chunks", "lines"),
    [
        pytest.param([b"one\ntwo\n"], ["one", "two"], id="whole-lines"),
        pytest.param([b"o", b"ne\ntw", b"o"], ["one", "two"], id="split-across-reads"),
        pytest.param([b"x" * 10 + b"\nok\n"], ["xxxx [cut]", "ok"], id="long-line-cut"),
        pytest.param([b"x" * 6, b"x" * 6, b"\nok\n"], ["xxxx [cut]", "ok"], id="long-unfinished"),
        pytest.param([b"a\xffb\r\n"], ["a\ufffdb"], id="undecodable-and-crlf"),
        pytest.param([b"\x1b[2J\rok\n"], ["\\x1b[2J\\x0dok"], id="control-escaped"),
    ],
)
def test_stderr_is_cut_into_bounded_lines(chunks: list[bytes], lines: list[str]) -> None:
    splitter = BoundedLineSplitter(max_bytes=max(4, len(lines[-1])))
    out: list[str] = []
    for chunk in chunks:
        out += splitter.feed(chunk)
    assert out + splitter.finish() == lines


def test_limiter_lets_a_window_s_worth_through_and_reports_the_rest_after_it() -> None:
    limiter = LineLimiter(lines=2, window=10.0)
    assert [limiter.admit(t) for t in (0.0, 1.0, 2.0, 3.0)] == [
        (True, 0),
        (True, 0),
        (False, 0),
        (False, 0),
    ]
    assert limiter.due(4.0) == 6.0
    assert limiter.expire(5.0) == 0
    assert limiter.expire(10.0) == 2
    assert limiter.due(10.0) is None
    assert limiter.admit(11.0) == (True, 0)


# --- real programs


def test_full_state_then_changes_reach_the_program(tmp_path: Path) -> None:
    out = tmp_path / "read"
    backend = ExecBackend([sys.executable, "-c", COPY, str(out)], make_format=FullFormat)
    a = states.entry("a", ["10.0.0.1"])

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": a}))
            await backend.apply(states.state(2, {"a": a, "b": states.entry("b")}, updated=["b"]))
            await eventually(lambda: len(json_lines(out)) == 2, "two lines")
        finally:
            await backend.close()

    _run(scenario())
    first, second = json_lines(out)
    assert (first["revision"], len(first["services"])) == (1, 1)
    assert (second["revision"], len(second["services"])) == (2, 2)
    assert backend.starts == 1


def test_program_that_exits_at_once_is_restarted_and_gets_the_whole_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    out = tmp_path / "read"
    # Reads one state (up to its sync line), then exits with status 3.
    program = (
        "import sys\nout = open(sys.argv[1], 'ab', buffering=0)\n"
        "for line in sys.stdin.buffer:\n    out.write(line)\n"
        "    if b'\"sync\"' in line:\n        sys.exit(3)\n"
    )
    backend = ExecBackend(
        [sys.executable, "-c", program, str(out)], make_format=OpsFormat, backoff=_fast()
    )
    a = states.entry("a", ["10.0.0.1"])

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": a}))
            await backend.apply(states.state(2, {"a": a, "b": states.entry("b")}, updated=["b"]))
            await eventually(lambda: backend.starts >= 3, "three starts")
        finally:
            await backend.close()

    _run(scenario())
    ops = json_lines(out)
    runs: list[list[dict[str, Any]]] = []
    for op in ops:
        if op["op"] == "reset":
            runs.append([])
        runs[-1].append(op)
    # every run starts with the whole state; after the second start it holds both services
    assert len(runs) >= 2
    assert all(run[0]["op"] == "reset" and run[-1]["op"] == "sync" for run in runs[:2])
    last = runs[1]
    assert {op["service"]["Name"] for op in last if op["op"] == "set_service"} == {"a", "b"}
    assert last[-1] == {"op": "sync", "revision": 2}
    assert any("python" in m and "exited with status 3 after" in m for m in _messages(caplog))


def test_command_that_cannot_be_executed_is_logged_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-such-program"
    backend = ExecBackend([str(missing)], make_format=FullFormat, backoff=_fast())

    async def scenario() -> bool:
        applying = asyncio.create_task(backend.apply(states.state(1, {"a": states.entry("a")})))
        try:
            await eventually(
                lambda: sum("cannot run" in m for m in _messages(caplog)) >= 2, "two attempts"
            )
            return applying.done()
        finally:
            applying.cancel()
            await backend.close()

    assert _run(scenario()) is False  # the state waits for a program to take it
    assert (
        f"to-exec: cannot run {missing}: No such file or directory; trying again in"
        in (_messages(caplog)[0])
    )


def test_stderr_flood_is_rate_limited_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    out = tmp_path / "read"
    program = (
        "import sys\nfor i in range(5000):\n    print('noise', i, file=sys.stderr)\n"
        "sys.stderr.flush()\n" + COPY
    )
    backend = ExecBackend(
        [sys.executable, "-c", program, str(out)],
        make_format=FullFormat,
        limiter=lambda: LineLimiter(lines=10, window=0.3),
    )

    def reported() -> int:
        counts = [m.split(": ")[1] for m in _messages(caplog) if "lines suppressed" in m]
        return sum(int(c.split()[0]) for c in counts)

    def relayed() -> int:
        return sum(1 for m in _messages(caplog) if m.startswith("python") and ": noise " in m)

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"a": states.entry("a")}))
            await eventually(lambda: relayed() + reported() == 5000, "every line accounted")
        finally:
            await backend.close()

    _run(scenario())
    assert len(json_lines(out)) == 1  # the state went through all the same
    assert relayed() <= 10 * 5
    assert reported() >= 5000 - 50


@pytest.mark.slow
def test_slow_reader_gets_coalesced_states_and_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    out = tmp_path / "read"
    program = "import time\ntime.sleep(1.5)\n" + COPY
    backend = ExecBackend(
        [sys.executable, "-c", program, str(out)], make_format=FullFormat, slow_s=0.3
    )
    services = states.many(3000)  # some 1.5 MB a line: more than the pipe holds

    async def scenario() -> None:
        feeder = Feeder("to-exec", backend)
        task = asyncio.create_task(feeder.run())
        try:
            feeder.offer(states.state(1, services))
            await asyncio.sleep(0.2)  # the first state is in the pipe, the program not reading
            for revision in (2, 3, 4):
                feeder.offer(states.state(revision, services, updated=[]))
                await asyncio.sleep(0.05)
            await eventually(lambda: len(json_lines(out)) == 2, "two states read")
        finally:
            task.cancel()
            await backend.close()

    _run(scenario())
    assert [line["revision"] for line in json_lines(out)] == [1, 4]
    messages = _messages(caplog)
    assert any("is slow to read its input: revision 1" in m for m in messages)
    assert any("took revision 1 after" in m for m in messages)


def test_close_ends_the_program_with_eof_first(tmp_path: Path) -> None:
    out = tmp_path / "read"
    marker = tmp_path / "eof"
    program = COPY + f"open({str(marker)!r}, 'w').close()\n"
    backend = ExecBackend([sys.executable, "-c", program, str(out)], make_format=FullFormat)

    async def scenario() -> None:
        await backend.apply(states.state(1, {"a": states.entry("a")}))
        proc = backend.process
        assert proc is not None
        await backend.close()
        assert proc.returncode == 0

    _run(scenario())
    assert marker.exists()


def test_a_program_that_closes_its_stdin_is_stopped_and_started_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It lives on, but takes no state: kpng says so, ends it and starts it again, and the
    backend's applies do not wait on it for ever."""
    out = tmp_path / "read"
    # The first run reads one line, closes its stdin and sleeps; later runs copy.
    program = (
        "import os, sys, time\n"
        f"first = not os.path.exists({str(out)!r})\n"
        f"out = open({str(out)!r}, 'ab', buffering=0)\n"
        "if first:\n"
        "    out.write(sys.stdin.buffer.readline()); sys.stdin.close(); os.close(0)\n"
        "    time.sleep(600)\n"
        "for line in sys.stdin.buffer:\n    out.write(line)\n"
    )
    backend = ExecBackend([sys.executable, "-c", program], make_format=FullFormat, backoff=_fast())

    async def scenario() -> None:
        await backend.apply(states.state(1, {"a": states.entry("a")}))
        await eventually(lambda: out.exists() and out.read_bytes().count(b"\n") == 1, within=WAIT_S)
        # A state too big for the pipe's buffer: written to a closed pipe, it breaks.
        big = {f"s{i}": states.entry(f"s{i}") for i in range(2000)}
        await asyncio.wait_for(backend.apply(states.state(2, big)), WAIT_S)
        await eventually(lambda: backend.starts == 2, within=WAIT_S)
        await eventually(lambda: b'"revision":2' in out.read_bytes(), within=WAIT_S)
        await backend.close()

    with caplog.at_level(logging.INFO, logger=LOGGER):
        _run(scenario())
    assert any("closed its stdin" in m for m in _messages(caplog))


def test_close_ends_the_programs_children_too(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    program = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "for line in sys.stdin.buffer: pass\n"
        "import time; time.sleep(600)\n"  # ignores EOF: SIGTERM ends it, and its child
    )
    backend = ExecBackend([sys.executable, "-c", program], make_format=FullFormat)

    async def scenario() -> int:
        await backend.apply(states.state(1, {"a": states.entry("a")}))
        await eventually(lambda: pid_file.exists() and pid_file.read_text() != "", within=WAIT_S)
        child = int(pid_file.read_text())
        await backend.close()
        return child

    child = _run(scenario())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return status != "Z"


# --- in kpng, beside other backends


@pytest.mark.slow
def test_failing_exec_and_plugin_backends_leave_kpng_and_the_other_backends_working(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    copied, json_out = tmp_path / "copied", tmp_path / "state.json"
    argv = [*kpng_command, "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2"]
    argv += ["to-exec", "--command", str(tmp_path / "missing")]
    argv += ["to-exec", "--command", shlex.join([sys.executable, "-c", "raise SystemExit(1)"])]
    copy = shlex.join([sys.executable, "-c", COPY, str(copied)])
    argv += ["to-exec", "--format", "ops", "--command", copy]
    argv += ["to-plugin", "--plugin", f"gone=unix://{tmp_path / 'gone.sock'}"]
    argv += ["to-json", "--output", str(json_out)]
    log = tmp_path / "kpng.log"
    with log.open("wb") as stderr_file:
        proc = subprocess.Popen(argv, stderr=stderr_file, env=subprocess_env)
    try:
        deadline = time.monotonic() + WAIT_S
        while not (json_out.exists() and json_out.stat().st_size and json_lines(copied)):
            assert proc.poll() is None, "kpng stopped"
            assert time.monotonic() < deadline, "no state reached the working backends"
            time.sleep(0.05)
        time.sleep(1.0)  # let the failing ones fail a few times
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    assert f"cannot run {tmp_path / 'missing'}: No such file or directory" in stderr
    assert "exited with status 1 after" in stderr
    assert f"to-plugin gone failed to apply revision 1: socket {tmp_path / 'gone.sock'}" in stderr
    ops = json_lines(copied)
    assert ops[0] == {"op": "reset", "node": "node-2"}
    assert ops[-1]["op"] == "sync"
    assert json.loads(json_out.read_text())["node"] == "node-2"
