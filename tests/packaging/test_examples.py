"""The examples and the backend tutorial, run for real against a ``kpng ... to-api`` server.

Each test starts ``kpng file --input <copy of examples/cluster.yaml> to-api --listen
unix://<tmp>/kpng.sock`` as a subprocess, runs the example clients against it, edits the copy and
watches them follow. Every wait is bounded, and every process is stopped in a ``finally``.

The tutorial test reads ``docs/backends/tutorial.md`` and does what it says: it saves each code
block as the prose before it asks ("Save this as `X`", "Add these lines to `X`, above `Y`"),
runs each shell command, and compares what is printed with the ``text`` block that follows. The
commands run in a bash shell whose ``python`` and ``kpng`` are this interpreter's, with
``/tmp/kpng-tutorial`` replaced by a fresh temporary directory. Long-running commands (the server,
and clients with ``--api`` but no ``--once``, which the tutorial runs in another terminal) run in
the background; a ``text`` block after a command that edits the cluster file is what the running
client prints next. Two commands cannot run verbatim in a test: ``make example`` and ``source
.venv/bin/activate`` (the test already runs in the virtualenv), and ``pip install -e .``, which
would change the shared virtualenv: it is replaced by a ``pip install --target`` of the same
project into a temporary directory put on ``PYTHONPATH``, which registers the same entry point.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO

import pytest

from kpng.model.cluster import Slice
from kpng.model.messages import Node, Service
from kpng.sinks.local import run_local
from kpng.sources import manifests
from kpng.store import Store
from kpng.testing.waiting import until
from tests.conftest import EXAMPLE, ROOT

EXAMPLES = ROOT / "examples"
TUTORIAL = ROOT / "docs" / "backends" / "tutorial.md"
BIN = Path(sys.executable).parent
WAIT_S = 30.0  # the bound of every wait: a change normally shows in well under a second
SETTLE_S = 0.5  # a background client's first state is complete once its output is this still

TOY_FIRST_ROUND = [
    "# node-2 revision 1: 11 rules",
    "add     0.0.0.0:30443/TCP -> DROP",
    "add     0.0.0.0:30900/TCP -> 10.244.1.21:9000, 10.244.2.22:9000",
    "add     10.96.0.10:80/TCP -> 10.244.1.11:8080",
    "add     10.96.0.20:9000/TCP -> 10.244.1.21:9000, 10.244.2.22:9000",
    "add     10.96.0.30:443/TCP -> 10.244.1.31:8443, 10.244.3.32:8443",
    "add     10.96.0.53:53/UDP -> 10.244.2.53:53",
    "add     10.96.0.90:9090/TCP -> 10.244.1.90:9090",
    "add     10.96.0.99:80/TCP -> REJECT",
    "add     192.0.2.10:443/TCP -> DROP",
    "add     198.51.100.53:53/UDP -> 10.244.1.53:53, 10.244.2.53:53, 10.244.3.53:53",
    "add     [fd00:96::90]:9090/TCP -> [fd00:10:244:1::90]:9090",
]


# --- processes


class Process:
    """A child process whose output goes to files (no pipe to fill), stopped by ``stop()``."""

    def __init__(
        self,
        argv: list[str] | str,
        *,
        logs: Path,
        name: str,
        cwd: Path = ROOT,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.stdout_path = logs / f"{name}.out"
        self.stderr_path = logs / f"{name}.err"
        self._stdout: IO[bytes] = open(self.stdout_path, "wb")  # noqa: SIM115 (closed in stop)
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                ["bash", "-c", argv] if isinstance(argv, str) else argv,
                stdout=self._stdout,
                stderr=self._stderr,
                cwd=cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                start_new_session=True,  # stop() signals the whole group (bash and its child)
            )
        except BaseException:
            self._stdout.close()
            self._stderr.close()
            raise

    def output(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_until(self, what: str, ready: Callable[[], bool]) -> None:
        """Until ``ready``; failing at once if the process exits first."""

        def check() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited {self.proc.returncode} before {what}:\n{self}")
            return ready()

        until(
            check,
            f"{self.name}: {what}",
            within=WAIT_S,
            error=lambda m: AssertionError(f"{m}\n{self}"),
        )

    def wait_output(self, expected: str, *, start: int = 0) -> None:
        """Until the output from offset ``start`` on is exactly ``expected``."""
        self.wait_until(f"output {expected!r}", lambda: self.output()[start:] == expected)

    def wait_settled(self) -> None:
        """Until there is output and it has not changed for SETTLE_S."""
        last, since = "", time.monotonic()

        def settled() -> bool:
            nonlocal last, since
            now = self.output()
            if now != last:
                last, since = now, time.monotonic()
            return bool(now) and time.monotonic() - since >= SETTLE_S

        self.wait_until("settled output", settled)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
        finally:
            self._stdout.close()
            self._stderr.close()

    def __str__(self) -> str:
        return f"--- stdout\n{self.output()}--- stderr (tail)\n{self.stderr()[-3000:]}"


def server_command(cluster: Path, socket: Path) -> str:
    return shlex.join(
        [
            *(str(BIN / "kpng"), "file", "--input", str(cluster)),
            *("to-api", "--listen", f"unix://{socket}"),
        ]
    )


def start_server(
    command: str, socket: Path, logs: Path, env: dict[str, str] | None = None
) -> Process:
    """Run a ``kpng ... to-api --listen unix://SOCKET`` command; return once SOCKET is there."""
    server = Process(command, logs=logs, name="server", env=env)
    try:
        server.wait_until(f"socket {socket}", socket.exists)
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class Cluster:
    """A copy of the example cluster in a directory of its own (kpng watches that directory),
    served on a unix socket; logs and sockets live outside the watched directory."""

    path: Path
    api: str
    logs: Path

    def edit(self, change: Callable[[str], str]) -> None:
        """Rewrite the cluster file atomically, as ``sed -i`` does."""
        text = self.path.read_text()
        new = change(text)
        assert new != text, "the edit changed nothing"
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(new)
        tmp.replace(self.path)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A short path under /tmp: a unix socket's path must fit in 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kpng-ex-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cluster(workdir: Path) -> Iterator[Cluster]:
    (workdir / "cluster").mkdir()
    (workdir / "logs").mkdir()
    path = workdir / "cluster" / "cluster.yaml"
    shutil.copy(EXAMPLE, path)
    socket = workdir / "kpng.sock"
    server = start_server(server_command(path, socket), socket, workdir / "logs")
    try:
        yield Cluster(path=path, api=f"unix://{socket}", logs=workdir / "logs")
    finally:
        server.stop()


def remove_api_endpoint_on_node_2(text: str) -> str:
    return text.replace("- {addresses: [10.244.2.22], nodeName: node-2, zone: zone-a}\n", "")


def remove_pending_service(text: str) -> str:
    start = text.index("# No endpoints at all")
    return text[:start] + text[text.index("---\n", start) + len("---\n") :]


def example(name: str, api: str, *args: str) -> list[str]:
    """The command running examples/NAME for node-2 against API."""
    return [sys.executable, str(EXAMPLES / name), "--api", api, "--node-name", "node-2", *args]


# --- cluster.yaml


def _header(path: Path) -> str:
    """The comment lines a file starts with, without their ``#``."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").removeprefix(" "))
    return "\n".join(lines)


def test_the_cluster_header_describes_the_file() -> None:
    header = _header(EXAMPLE)
    parsed = manifests.parse(EXAMPLE.read_bytes(), filename=EXAMPLE.name)
    assert parsed.errors == []
    kinds: dict[str, list[object]] = {}
    for (kind, _, _), model in parsed.objects.items():
        kinds.setdefault(kind, []).append(model)
    served = [m for m in kinds["Service"] if isinstance(m, Service)]
    ignored = [m for m in kinds["Service"] if not isinstance(m, Service)]
    words = {1: "one", 2: "two", 3: "three", 6: "six", 9: "nine"}
    zones = {n.Topology.Zone for n in kinds["Node"] if isinstance(n, Node) and n.Topology}
    summary = " ".join(header.split())
    assert f"{words[len(kinds['Node'])]} Nodes in {words[len(zones)]} zones" in summary
    assert f"{words[len(served)]} Services kpng serves" in summary
    assert f"{words[len(ignored)]} it must ignore" in summary
    dual = [s for s in served if isinstance(s, Service) and s.IPs and s.IPs.ClusterIPs
            and s.IPs.ClusterIPs.V4 and s.IPs.ClusterIPs.V6]  # fmt: skip
    assert f"{words[len(dual)]} dual-stack" in summary
    # What the Nodes carry is what the header says they carry: no addresses, no pod CIDRs.
    for node in kinds["Node"]:
        assert isinstance(node, Node)
        assert node.Addresses == ()
        assert node.PodCIDRs == ()
    assert "no addresses or pod CIDRs" in summary
    # The table: each Node, its zone, and the prefixes of the endpoints on it, all of them.
    rows = {}
    for line in header.splitlines():
        words_of = line.split()
        if words_of and words_of[0].startswith("node-"):
            rows[words_of[0]] = (words_of[1], [w.removesuffix("x") for w in words_of[2:]])
    nodes = {n.Name: n for n in kinds["Node"] if isinstance(n, Node)}
    assert set(rows) == set(nodes)
    for name, (zone, prefixes) in rows.items():
        topology = nodes[name].Topology
        assert topology is not None
        assert topology.Zone == zone
        on_node = {
            ep.ip for sl in kinds["EndpointSlice"] if isinstance(sl, Slice)
            for ep in sl.endpoints if ep.node == name
        }  # fmt: skip
        assert on_node, name
        assert all(any(ip.startswith(p) for p in prefixes) for ip in on_node), (name, on_node)
        assert all(any(ip.startswith(p) for ip in on_node) for p in prefixes), (name, prefixes)
    assert "`make example` prints node-2's local state" in summary


# --- print_state.py


def test_print_state_is_under_30_lines() -> None:
    lines = (EXAMPLES / "print_state.py").read_text().splitlines()
    assert len(lines) < 30


def test_print_state_prints_the_node_state(cluster: Cluster) -> None:
    done = subprocess.run(
        example("print_state.py", cluster.api, "--once"),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("node-2, revision 1: 6 services\n")
    # namespace/name, type, IPs and ports; endpoints with their scopes and target ports
    assert "shop/web (ClusterIP) 10.96.0.10 ports 80/TCP, endpoints: 1\n" in out
    assert "    10.244.1.11  Internal Cluster  http→8080\n" in out
    assert "shop/api (NodePort) 10.96.0.20 ports 9000/TCP (node port 30900), endpoints: 2\n" in out
    assert "    10.244.2.22  Internal External Cluster  grpc→9000  local\n" in out
    assert "edge/ingress (LoadBalancer) 10.96.0.30 192.0.2.10 ports 443/TCP" in out
    assert "    10.244.3.32  Internal Cluster  https→8443\n" in out
    assert "monitoring/metrics (ClusterIP) 10.96.0.90 fd00:96::90 ports 9090/TCP" in out
    assert "    fd00:10:244:1::90  Internal Cluster  prom→9090\n" in out
    assert "shop/pending (ClusterIP) 10.96.0.99 ports 80/TCP, endpoints: 0\n" in out
    for ignored in ("other-proxy", "shop/db", "partner"):
        assert ignored not in out
    # services in order, one line each; 10 endpoint lines in all
    heads = [line.split()[0] for line in out.splitlines()[1:] if line and line[0] != " "]
    assert heads == [
        "edge/ingress",
        "kube-system/dns-cache",
        "monitoring/metrics",
        "shop/api",
        "shop/pending",
        "shop/web",
    ]
    assert sum(line.startswith("    ") for line in out.splitlines()) == 10


# --- toy_backend.py


def test_toy_backend_prints_the_minimal_changes(cluster: Cluster) -> None:
    toy = Process(
        example("toy_backend.py", cluster.api),
        logs=cluster.logs,
        name="toy",
    )
    try:
        first = "\n".join(TOY_FIRST_ROUND) + "\n"
        toy.wait_output(first)

        cluster.edit(remove_api_endpoint_on_node_2)
        toy.wait_output(
            "# node-2 revision 2: 11 rules\n"
            "update  0.0.0.0:30900/TCP -> 10.244.1.21:9000\n"
            "update  10.96.0.20:9000/TCP -> 10.244.1.21:9000\n",
            start=len(first),
        )
        second = len(toy.output())

        cluster.edit(remove_pending_service)
        toy.wait_output("# node-2 revision 3: 10 rules\nremove  10.96.0.99:80/TCP\n", start=second)
    finally:
        toy.stop()


def _load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_backend_in_process_is_a_backend() -> None:
    """The same first round from to-local's run_local, in this process, with no server."""
    toy = _load_example("toy_backend")
    parsed = manifests.parse(EXAMPLE.read_bytes(), filename=str(EXAMPLE))
    assert not parsed.errors
    store = Store()
    handle = store.source("test")
    for (_, namespace, name), obj in parsed.objects.items():
        if isinstance(obj, Service):
            handle.set_service((namespace, name), obj)
        elif isinstance(obj, Slice):
            handle.set_slice((namespace, name), obj)
        elif isinstance(obj, Node):
            handle.set_node(name, obj)
    handle.mark_synced()
    out = io.StringIO()
    backend = toy.ToyBackend(out, once=True)

    async def feed() -> None:
        async with asyncio.timeout(WAIT_S):
            await run_local(store, node_name="node-2", backend=backend)
        await backend.close()

    asyncio.run(feed())
    assert out.getvalue().splitlines() == TOY_FIRST_ROUND


# --- the tutorial


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    prose: str
    """The markdown between the previous code block and this one."""


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_SAVE = re.compile(r"Save\s+this\s+as\s+`([^`]+)`")
_ADD = re.compile(r"Add\s+these\s+lines\s+to\s+`([^`]+)`,\s+above\s+`([^`]+)`")
TUTORIAL_DIR = "/tmp/kpng-tutorial"


def tutorial_blocks() -> list[Block]:
    markdown = TUTORIAL.read_text()
    blocks, position = [], 0
    for match in _FENCE.finditer(markdown):
        blocks.append(Block(match[1], match[2], markdown[position : match.start()]))
        position = match.end()
    return blocks


class TutorialShell:
    """Runs the tutorial's commands, keeping the working directory and background processes."""

    def __init__(self, workdir: Path, logs: Path) -> None:
        self.workdir = workdir
        self.logs = logs
        self.cwd = ROOT
        self.site = logs / "site"
        self.env = {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.server: Process | None = None
        self.client: Process | None = None
        self.count = 0
        self.last_stdout = ""
        self.client_mark: int | None = None
        """Where the background client's output stood before the last command, if it edited
        the cluster while a client was running."""

    def path(self, text: str) -> str:
        return re.sub(f"{re.escape(TUTORIAL_DIR)}(?![\\w-])", str(self.workdir), text)

    def save(self, name: str, text: str) -> None:
        (self.cwd / name).write_text(text)

    def insert(self, name: str, text: str, above: str) -> None:
        path = self.cwd / name
        source = path.read_text()
        assert source.count(f"\n{above}") == 1, f"{name}: no single line {above!r}"
        path.write_text(source.replace(f"\n{above}", f"\n{text}\n\n{above}"))

    def run(self, command: str) -> None:
        self.count += 1
        self.client_mark = None
        command = self.path(command)
        words = shlex.split(command)
        if command in ("make example", "source .venv/bin/activate") or words[:2] == [
            "pip",
            "uninstall",
        ]:
            return  # the test runs in the virtualenv already, and installs nothing into it
        if words[0] == "cd":
            self.cwd = Path(words[1])
            return
        if words[:3] == ["pip", "install", "-e"]:
            words = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
            words += ["--no-build-isolation", "--no-index", "--target", str(self.site), "."]
            command = shlex.join(words)
            pythonpath = os.environ.get("PYTHONPATH")
            self.env["PYTHONPATH"] = os.pathsep.join([str(self.site), *filter(None, [pythonpath])])
        if "to-api" in words:
            assert self.server is None
            listen = words[words.index("--listen") + 1]
            socket = Path(listen.removeprefix("unix://"))
            self.server = start_server(command, socket, self.logs, self.env)
            return
        if words[0] == "rm":
            self.stop()  # the tutorial stops everything before it removes the directory
        elif words[0] in ("python", "kpng"):
            self.stop_client()  # Ctrl-C in the tutorial, before the next client
        if "--api" in words and "--once" not in words:
            self.client = Process(
                command, logs=self.logs, name=f"client-{self.count}", cwd=self.cwd, env=self.env
            )
            self.client.wait_settled()  # its first state: now changes can be made
            return
        mark = len(self.client.output()) if self.client is not None else None
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=self.cwd,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=WAIT_S * 2,
            check=False,
        )
        assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stderr}"
        self.last_stdout = done.stdout
        if words[0] not in ("python", "kpng"):
            self.client_mark = mark

    def expect(self, expected: str) -> None:
        """The output of the last command; or, after an edit, the running client's next output."""
        if self.client is not None and self.client_mark is not None:
            self.client.wait_output(expected, start=self.client_mark)
        else:
            assert self.last_stdout == expected

    def stop_client(self) -> None:
        """Ctrl-C, as the tutorial says: the client ends quietly."""
        if self.client is not None:
            self.client.stop(signal.SIGINT)
            assert "Traceback" not in self.client.stderr(), self.client.stderr()
            self.client = None

    def stop(self) -> None:
        try:
            self.stop_client()
        finally:
            if self.server is not None:
                self.server.stop()
                self.server = None


def test_tutorial_blocks_are_all_used() -> None:
    """Every code block is saved, added to a file, run, or the output of what was run."""
    blocks = tutorial_blocks()
    assert len(blocks) > 10
    previous = ""
    for block in blocks:
        if block.lang in ("python", "toml"):
            assert _SAVE.search(block.prose) or _ADD.search(block.prose), block.text[:80]
        elif block.lang == "text":
            assert previous == "sh", f"text block after {previous}: {block.text[:80]}"
        else:
            assert block.lang == "sh", f"unexpected block {block.lang}: {block.text[:80]}"
        previous = block.lang


@pytest.mark.timeout(300)
def test_tutorial_runs_as_written(workdir: Path) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kpng-logs-"))
    shell = TutorialShell(workdir, logs)
    try:
        for block in tutorial_blocks():
            if block.lang in ("python", "toml"):
                saved = _SAVE.search(block.prose)
                if saved:
                    shell.save(saved[1], block.text)
                else:
                    added = _ADD.search(block.prose)
                    assert added is not None
                    shell.insert(added[1], block.text, added[2])
            elif block.lang == "sh":
                for line in block.text.splitlines():
                    if line.strip() and not line.startswith("#"):
                        shell.run(line)
            elif block.lang == "text":
                shell.expect(block.text)
        assert shell.count > 15
        assert not workdir.exists(), "the tutorial cleans up after itself"
    finally:
        shell.stop()
        shutil.rmtree(logs, ignore_errors=True)
