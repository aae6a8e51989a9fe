"""kpng check: its scripted states, and its verdicts on well- and badly-behaved plugins and exec
programs, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kpng.check import scripted
from tests.conftest import ROOT

TIMEOUT_S = 120


def test_each_scripted_state_names_exactly_what_changed() -> None:
    previous: dict[tuple[str, str], object] = {}
    cases = []
    for case, state in scripted(50):
        cases.append(case)
        changed = {k for k, v in state.services.items() if previous.get(k) != v}
        assert state.updated == changed, case
        assert state.deleted == previous.keys() - state.services.keys(), case
        previous = dict(state.services)
    assert cases == [
        "first state", "adds", "changes", "deletes", "50 services", "back from 50 services",
    ]  # fmt: skip


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpng", "check", *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT, check=False,
    )  # fmt: skip


def _verdicts(out: str) -> list[tuple[str, str]]:
    """(case, PASS or FAIL) from the report's lines, in order."""
    return [
        (line[6:51].strip(), line[:4]) for line in out.splitlines() if line[:4] in ("PASS", "FAIL")
    ]


@pytest.fixture
def plugin_server(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Starts tests/plugin_server.py with the given flags; yields its check arguments."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> str:
        socket = tmp_path / f"p{len(procs)}.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.plugin_server", "--socket", str(socket),
             "--record", str(tmp_path / f"p{len(procs)}.jsonl"), *flags],
            stdout=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        return f"unix://{socket}"

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.mark.slow
def test_a_plugin_that_takes_a_state_without_sync_fails_that_case_only(
    plugin_server: Callable[..., str],
) -> None:
    done = _check("plugin", plugin_server(), "--services", "300")
    verdicts = _verdicts(done.stdout)
    assert [case for case, v in verdicts if v == "FAIL"] == [
        "malformed: a whole state without Sync"
    ], done.stdout
    assert len(verdicts) == 16
    assert "it acknowledged it (OK): a plugin must refuse what it cannot program" in done.stdout
    assert done.stdout.splitlines()[-1] == "15 passed, 1 failed"
    assert done.returncode == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "failed", "message"),
    [
        (["--refuse", "2"], ["first state", "adds"], "not ready for states yet"),
        (["--unhealthy", "disk full"], ["health"], "it reports it is unhealthy: disk full"),
    ],
    ids=["refusing", "unhealthy"],
)
def test_what_a_plugin_refuses_or_reports_fails_with_its_message(
    plugin_server: Callable[..., str], flags: list[str], failed: list[str], message: str
) -> None:
    done = _check("plugin", plugin_server("--wants", "diffs", *flags), "--services", "300")
    verdicts = _verdicts(done.stdout)
    failures = {case for case, v in verdicts if v == "FAIL"}
    assert failures == {*failed, "malformed: a whole state without Sync"}, done.stdout
    assert message in done.stdout
    assert done.returncode == 1


@pytest.mark.slow
def test_no_plugin_at_the_socket_fails_at_describe(tmp_path: Path) -> None:
    done = _check("plugin", f"unix://{tmp_path}/none.sock", "--timeout", "2")
    assert done.stdout.splitlines()[0].startswith("FAIL  describe")
    assert done.returncode == 1


READER = "import json, sys\nfor line in sys.stdin: json.loads(line)\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("program", "args", "verdict", "message"),
    [
        (READER, ["--format", "ops"], "7 passed, 0 failed", "it exited 0 when its input ended"),
        (READER, ["--format", "full"], "7 passed, 0 failed", "it exited 0 when its input ended"),
        (
            "import sys\nsys.stdin.readline()\nprint('giving up', file=sys.stderr)\nsys.exit(3)\n",
            [],
            "0 passed, 1 failed",
            "it exited with status 3; its stderr ends: giving up",
        ),
        (
            "import time\ntime.sleep(60)\n",
            ["--timeout", "1"],
            "4 passed, 1 failed",
            "it did not read revision 5",
        ),
        (
            "import sys, time\nsys.stdin.read()\ntime.sleep(60)\n",
            [],
            "6 passed, 1 failed",
            "it still runs 3 s after its input ended",
        ),
    ],
    ids=["ops-reader", "full-reader", "exits", "never-reads", "ignores-eof"],
)
def test_exec_programs(
    tmp_path: Path, program: str, args: list[str], verdict: str, message: str
) -> None:
    script = tmp_path / "program.py"
    script.write_text(program)
    done = _check("exec", "--command", f"{sys.executable} {script}", "--services", "20000", *args)
    assert done.stdout.splitlines()[-1] == verdict, done.stdout
    assert message in done.stdout
    assert done.returncode == (0 if verdict.endswith(" 0 failed") else 1)
