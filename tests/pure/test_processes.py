"""kpng's processes own what they hold, and every fault ends: a brain's unix socket is its own
(a second brain is refused, a stale socket is taken over, an exit removes only its own); a
one-shot run without the privilege it needs fails at once; SIGTERM ends every command within
seconds, whatever it waits on. Each test runs the real command; every process is killed at the
end whatever happens, and every wait is bounded."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kpng.backoff import Backoff
from kpng.logs import REPEAT_WINDOW_S
from kpng.testing.waiting import until
from tests.conftest import EXAMPLE, ROOT

RUN_S = 30.0
"""A whole one-shot command, start-up (imports) included, on a busy 2-core machine."""
STOP_S = 5.0
"""What SIGTERM may take, at most, to end a command."""
START_S = 20.0


@pytest.fixture
def env(subprocess_env: dict[str, str]) -> dict[str, str]:
    """This checkout's kpng, whatever the virtualenv has installed."""
    return {**subprocess_env, "PYTHONPATH": str(ROOT / "src")}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (their paths are limited to 107 bytes); removed."""
    path = Path(tempfile.mkdtemp(prefix="kpng-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Started:
    """A kpng process, its stderr in a file to read while it runs."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log: Path, *, prefix: Sequence[str] = ()
    ) -> None:
        self.log = log
        with log.open("wb") as stderr:
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kpng", *argv],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
            )

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str) -> None:
        until(
            lambda: text in self.stderr() or self.proc.poll() is not None,
            f"{text!r} in {self.log.name}",
            within=START_S,
        )
        assert text in self.stderr(), self.stderr()

    def terminated_within(self, seconds: float) -> float:
        """SIGTERM, then how long the process took to exit (fails beyond ``seconds``)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {seconds:g} s after SIGTERM:\n{self.stderr()}")
        return time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_S)


def _kpng(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpng", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_S,
        check=False,
    )


def _brain(sock: Path, env: dict[str, str], log: Path) -> _Started:
    brain = _Started(
        ["file", "--input", str(EXAMPLE), "to-api", "--listen", f"unix://{sock}"], env, log
    )
    try:
        brain.wait_for("serving the watch API")
    except BaseException:
        brain.kill()
        raise
    return brain


def _state_from(sock: Path, env: dict[str, str]) -> str:
    done = _kpng(env, "local", "--api", f"unix://{sock}", "--node-name", "n", "to-json", "--once")
    assert done.returncode == 0, done.stderr
    assert '"services"' in done.stdout
    return done.stdout


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "ERROR" in line or "error:" in line]


# --- a brain's unix socket


@pytest.mark.slow
def test_a_second_brain_on_a_live_socket_is_refused_and_the_first_keeps_serving(
    env: dict[str, str], sock_dir: Path, tmp_path: Path
) -> None:
    sock = sock_dir / "api.sock"
    first = _brain(sock, env, tmp_path / "first.log")
    try:
        inode = sock.lstat().st_ino
        second = _kpng(env, "file", "--input", str(EXAMPLE), "to-api", "--listen", f"unix://{sock}")
        assert second.returncode == 1, second.stderr
        [error] = _errors(second.stderr)
        assert f"another process is serving on {sock}" in error
        assert sock.lstat().st_ino == inode  # neither replaced nor removed
        _state_from(sock, env)  # a new client still reaches the first brain
        first.terminated_within(STOP_S)
        assert first.proc.returncode == 0, first.stderr()
        assert not sock.exists()  # its own socket, removed on the way out
    finally:
        first.kill()


@pytest.mark.slow
def test_a_stale_socket_is_taken_over(env: dict[str, str], sock_dir: Path, tmp_path: Path) -> None:
    sock = sock_dir / "api.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(sock))  # a run killed with SIGKILL leaves this: a file nobody listens on
    brain = _brain(sock, env, tmp_path / "brain.log")
    try:
        _state_from(sock, env)
    finally:
        brain.kill()


@pytest.mark.slow
def test_a_path_that_is_not_a_socket_is_refused(env: dict[str, str], sock_dir: Path) -> None:
    path = sock_dir / "api.sock"
    path.write_text("someone's file\n")
    done = _kpng(env, "file", "--input", str(EXAMPLE), "to-api", "--listen", f"unix://{path}")
    assert done.returncode == 1, done.stderr
    [error] = _errors(done.stderr)
    assert f"{path} exists and is not a socket" in error
    assert path.read_text() == "someone's file\n"


@pytest.mark.slow
def test_on_exit_a_brain_leaves_a_socket_that_replaced_its_own(
    env: dict[str, str], sock_dir: Path, tmp_path: Path
) -> None:
    sock = sock_dir / "api.sock"
    brain = _brain(sock, env, tmp_path / "brain.log")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
            sock.unlink()  # a third party takes the path over
            other.bind(str(sock))
            other.listen()
            theirs = sock.lstat().st_ino
            brain.terminated_within(STOP_S)
            assert brain.proc.returncode == 0, brain.stderr()
            assert sock.lstat().st_ino == theirs
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.settimeout(STOP_S)
                client.connect(str(sock))  # still the third party's, still reachable
        assert not list(sock_dir.glob(".kpng-*"))  # nor a private name left behind
    finally:
        brain.kill()


# --- a one-shot run without the privilege it needs

_UNPRIVILEGED = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--"]
"""Root without a single capability: what a container without NET_ADMIN or BPF runs as. (Not
another user: this interpreter may live where only root may read.)"""


def _unprivileged() -> list[str]:
    if os.geteuid() != 0:
        return []  # already without the privilege
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root's capabilities")
    return _UNPRIVILEGED


BACKENDS = ["to-nft", "to-iptables", "to-ebpf"]


def _usable(backend: str) -> bool:
    """Whether this machine has what ``backend`` runs (its privilege aside)."""
    if backend == "to-nft":
        return ctypes.util.find_library("nftables") is not None
    if backend == "to-iptables":
        return any(shutil.which(tool) for tool in ("iptables-nft-save", "iptables-save"))
    return ctypes.util.find_library("bpf") is not None


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_shot_run_without_privilege_fails_at_once_with_one_line(
    env: dict[str, str], backend: str
) -> None:
    """Not a retry a minute for ever: nobody is there to fix the capabilities of a --once."""
    if not _usable(backend):
        pytest.skip(f"{backend} is not usable on this machine")
    argv = ["file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-1", backend, "--once"]
    started = time.monotonic()
    done = subprocess.run(
        [*_unprivileged(), sys.executable, "-m", "kpng", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=RUN_S,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < RUN_S
    [error] = _errors(done.stderr)
    assert f"{backend} failed to apply revision 1: " in error
    assert "not permitted" in error or "Permission denied" in error, error
    assert "retrying" not in done.stderr
    assert "Traceback" not in done.stderr


# --- SIGTERM ends every command


@pytest.mark.slow
def test_sigterm_ends_a_node_agent_that_keeps_reconnecting(
    env: dict[str, str], sock_dir: Path, tmp_path: Path
) -> None:
    api = f"unix://{sock_dir}/nobody-serves.sock"
    agent = _Started(
        ["local", "--api", api, "--node-name", "n", "to-json"], env, tmp_path / "l.log"
    )
    try:
        agent.wait_for("retrying")
        agent.terminated_within(STOP_S)
        assert agent.proc.returncode == 0, agent.stderr()
    finally:
        agent.kill()


@pytest.mark.slow
def test_sigterm_ends_a_node_agent_whose_brain_is_gone(
    env: dict[str, str], sock_dir: Path, tmp_path: Path
) -> None:
    sock = sock_dir / "api.sock"
    out = tmp_path / "state.jsonl"
    brain = _brain(sock, env, tmp_path / "brain.log")
    argv = ["local", "--api", f"unix://{sock}", "--node-name", "n", "to-json", "--output", str(out)]
    agent = _Started(argv, env, tmp_path / "agent.log")
    try:
        until(lambda: out.exists() and out.stat().st_size > 0, "the agent's first state")
        brain.proc.kill()
        brain.proc.wait(timeout=STOP_S)
        agent.wait_for("the last state stays in force; retrying")
        agent.terminated_within(STOP_S)
        assert agent.proc.returncode == 0, agent.stderr()
    finally:
        agent.kill()
        brain.kill()


@pytest.mark.slow
def test_sigterm_ends_a_backend_that_keeps_failing_without_privilege(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A daemon retries (the operator may grant the capability), says why each time, and
    stops when told to, retrying or waiting to."""
    if not _usable("to-nft"):
        pytest.skip("to-nft is not usable on this machine")
    argv = ["file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-1", "to-nft"]
    proxy = _Started(argv, env, tmp_path / "nft.log", prefix=_unprivileged())
    try:
        # The second line is the first past the log's repeat window (the retries in it are
        # counted, not logged), so it comes after that window and a backoff's longest wait:
        # 13 s after the start here when idle, past 20 s under CI's load.
        retried_within = START_S + REPEAT_WINDOW_S + Backoff().maximum
        until(lambda: proxy.stderr().count("retrying") >= 2, "a retry", within=retried_within)
        failure = next(line for line in proxy.stderr().splitlines() if "retrying" in line)
        assert "to-nft failed to apply revision 1: " in failure
        assert "Operation not permitted" in failure
        proxy.terminated_within(STOP_S)
        assert proxy.proc.returncode == 0, proxy.stderr()
    finally:
        proxy.kill()


@pytest.mark.slow
def test_sigterm_ends_a_brain(env: dict[str, str], sock_dir: Path, tmp_path: Path) -> None:
    sock = sock_dir / "api.sock"
    brain = _brain(sock, env, tmp_path / "brain.log")
    try:
        brain.terminated_within(STOP_S)
        assert brain.proc.returncode == 0, brain.stderr()
        assert not sock.exists()
    finally:
        brain.kill()


_STUBBORN = """
import asyncio, sys
from kpng.stopping import until_signalled

async def stubborn() -> None:
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            print("cancelled, carrying on", flush=True)

async def main() -> None:
    print("ready", flush=True)
    await stubborn()

asyncio.run(until_signalled(main(), grace=float(sys.argv[1])))
"""


@pytest.mark.parametrize("signals", [1, 2], ids=["after the grace", "at a second signal"])
def test_a_task_that_ignores_its_cancellation_does_not_keep_the_process(
    env: dict[str, str], tmp_path: Path, signals: int
) -> None:
    """The safety net under every command: whatever swallows its cancellation, the process
    ends, naming it."""
    grace = 1.0 if signals == 1 else 60.0
    out = tmp_path / "out.txt"
    with out.open("wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-c", _STUBBORN, str(grace)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    try:
        until(lambda: "ready" in out.read_text(), "the script to start", within=START_S)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        until(lambda: "carrying on" in out.read_text(), "the task to ignore it", within=STOP_S)
        if signals == 2:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=grace + STOP_S if signals == 1 else STOP_S)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_S)
    assert proc.returncode == 1
    assert grace <= took if signals == 1 else took < STOP_S, took
    [line] = stderr.splitlines()
    why = "did not stop within 1 s of SIGTERM" if signals == 1 else "SIGTERM after SIGTERM"
    assert line.startswith(f"kpng: error: {why}"), line
    assert " at stubborn (<string>:" in line, line
