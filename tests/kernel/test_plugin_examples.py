"""The example plugins with kpng: the Node.js state-summary end to end, and the Python
nodeport-guard dropping real packets in a network-namespace cluster."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kpng.api import localv1_pb2
from kpng.testing.conformance import Cluster, endpoint_slice, port, service
from kpng.testing.netns import CLUSTER_CIDRS, ClusterSpec, TestBed, available
from kpng.testing.waiting import json_lines, until
from tests.conftest import ROOT

EXAMPLES = ROOT / "examples" / "plugins"
SUMMARY = EXAMPLES / "state-summary"
GO_SUMMARY = EXAMPLES / "go-summary"
GO_PROTOC_PLUGINS = (
    "google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12",
    "google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.0",
)
"""As examples/plugins/go-summary/generate.sh and docs/backends/plugins.md name them."""
GUARD = EXAMPLES / "nodeport-guard" / "guard.py"
WAIT_S = 20.0


def _load_guard() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nodeport_guard", GUARD)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard: Any = _load_guard()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _objects(*objects: dict[str, Any]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})


def _write(path: Path, text: str) -> None:
    """Replace ``path`` atomically: kpng's file source never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.rename(path)


# --- nodeport-guard's pure parts


@pytest.mark.parametrize(
    ("text", "v4", "v6"),
    [
        pytest.param(b"", [], [], id="empty"),
        pytest.param(
            b"# the bad ones\n192.0.2.0/24\n\n2001:db8::/32  # v6 too\n",
            ["192.0.2.0/24"],
            ["2001:db8::/32"],
            id="comments-and-families",
        ),
        pytest.param(
            b"10.0.0.0/8\n10.1.0.0/16\n10.0.0.1\n", ["10.0.0.0/8"], [], id="overlaps-merged"
        ),
        pytest.param(b"192.0.2.7/24\n", ["192.0.2.0/24"], [], id="host-bits-dropped"),
    ],
)
def test_guard_config_is_a_cidr_per_line(text: bytes, v4: list[str], v6: list[str]) -> None:
    blocked4, blocked6 = guard.parse_config(text)
    assert [str(n) for n in blocked4] == v4
    assert [str(n) for n in blocked6] == v6


def test_guard_config_with_a_bad_line_says_which() -> None:
    with pytest.raises(guard.ConfigError, match="line 2: 'nope' is not a CIDR"):
        guard.parse_config(b"10.0.0.0/8\nnope\n")


def test_guard_takes_node_ports_with_their_protocols() -> None:
    svc = localv1_pb2.Service(
        Ports=[
            localv1_pb2.PortMapping(Protocol=localv1_pb2.TCP, Port=80, NodePort=30080),
            localv1_pb2.PortMapping(Protocol=localv1_pb2.UDP, Port=53, NodePort=30053),
            localv1_pb2.PortMapping(Protocol=localv1_pb2.TCP, Port=443),
        ]
    )
    assert guard.node_ports(svc) == {("tcp", 30080), ("udp", 30053)}


def test_guard_table_replaces_itself_in_one_transaction() -> None:
    blocked: tuple[list[ipaddress.IPv4Network], list[ipaddress.IPv6Network]] = (
        [ipaddress.IPv4Network("192.0.2.0/24")],
        [],
    )
    text = guard.render(blocked, [("udp", 30053), ("tcp", 30080), ("tcp", 30080)])
    lines = text.splitlines()
    assert lines[:3] == [
        "table inet kpng-guard",
        "delete table inet kpng-guard",
        "table inet kpng-guard {",
    ]
    assert "\t\telements = { 192.0.2.0/24 }" in lines
    assert "\t\telements = { tcp . 30080, udp . 30053 }" in lines
    # an empty set has no elements line (nft refuses "elements = { }")
    v6 = lines.index("\tset blocked-v6 {")
    assert lines[v6 + 1 : v6 + 4] == ["\t\ttype ipv6_addr", "\t\tflags interval", "\t}"]


# --- the Node.js plugin, end to end


def _node_modules() -> str | None:
    """Why the Node.js example cannot run here, or None once its dependencies are in place."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        return "node and npm are not installed (.ci/run installs them)"
    if not (SUMMARY / "node_modules" / "@grpc" / "grpc-js").is_dir():
        # As .ci/run does: the versions package-lock.json pins.
        done = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=SUMMARY,
            capture_output=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(f"npm ci failed: {done.stderr.decode(errors='replace')}")
    return None


NODEPORT_SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web", "namespace": "shop"},
    "spec": {
        "type": "NodePort",
        "clusterIP": "10.96.0.10",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
    },
}
SLICE = {
    "apiVersion": "discovery.k8s.io/v1",
    "kind": "EndpointSlice",
    "metadata": {
        "name": "web-x",
        "namespace": "shop",
        "labels": {"kubernetes.io/service-name": "web"},
    },
    "addressType": "IPv4",
    "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    "endpoints": [{"addresses": ["10.244.1.2"], "nodeName": "node-1"}],
}


def _go_summary(out: Path) -> Path:
    """The Go example plugin, built into ``out``."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        pytest.skip("Go is not installed (the README's prerequisites)")
    binary = out / "go-summary"
    done = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=GO_SUMMARY, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return binary


def _go_tool(go: str, package: str) -> Path:
    """A Go program installed (once, cached) from the module proxy."""
    bin_dir = Path.home() / ".cache" / "kpng" / "go-bin"
    name = package.split("@")[0].rsplit("/", 1)[-1]
    if not (bin_dir / name).exists():
        done = subprocess.run(
            [go, "install", package],
            env={**os.environ, "GOBIN": str(bin_dir)},
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    return bin_dir / name


def test_the_go_plugin_code_is_what_the_documented_command_generates(tmp_path: Path) -> None:
    """docs/backends/plugins.md's command (examples/plugins/go-summary/generate.sh), run afresh,
    makes
    exactly the Go code committed beside the plugin: the protos' go_package options hold."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        pytest.skip("Go is not installed (the README's prerequisites)")
    tools = [_go_tool(go, p) for p in GO_PROTOC_PLUGINS]
    copy = tmp_path / "go-summary"
    shutil.copytree(GO_SUMMARY, copy, ignore=shutil.ignore_patterns("*.pb.go"))
    done = subprocess.run(
        ["sh", str(copy / "generate.sh")],
        env={
            **os.environ,
            "PATH": os.pathsep.join([str(tools[0].parent), os.environ["PATH"]]),
            "PROTOC": f"{sys.executable} -m grpc_tools.protoc",
            "KPNG_PROTOS": str(ROOT / "src"),
        },
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    committed = sorted(p.relative_to(GO_SUMMARY) for p in GO_SUMMARY.rglob("*.pb.go"))
    generated = sorted(p.relative_to(copy) for p in copy.rglob("*.pb.go"))
    assert generated == committed
    assert len(committed) == 4
    for path in committed:
        assert (copy / path).read_text() == (GO_SUMMARY / path).read_text(), path


def _summary_program(language: str, tmp_path: Path) -> tuple[str, list[str]]:
    """The summary plugin in ``language``: its name and command (without --socket)."""
    if language == "nodejs":
        missing = _node_modules()
        if missing is not None:
            pytest.skip(missing)
        return "state-summary", ["node", str(SUMMARY / "index.js")]
    return "go-summary", [str(_go_summary(tmp_path))]


@pytest.mark.parametrize("language", ["nodejs", "go"])
def test_the_summary_plugins_pass_kpng_check(
    tmp_path: Path, kpng_command: list[str], language: str
) -> None:
    _, program = _summary_program(language, tmp_path)
    socket = tmp_path / "summary.sock"
    plugin = subprocess.Popen(
        [*program, "--socket", str(socket), "--output", str(tmp_path / "out.jsonl")],
        stderr=subprocess.DEVNULL,
    )
    try:
        until(socket.exists, "the plugin's socket", within=WAIT_S)
        done = subprocess.run(
            [*kpng_command, "check", "plugin", f"unix://{socket}", "--services", "2000"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    finally:
        _stop(plugin)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "16 passed, 0 failed"


@pytest.mark.parametrize("language", ["nodejs", "go"])
def test_the_summary_plugins_follow_the_state_with_kpng(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str], language: str
) -> None:
    """The same summaries from the Node.js plugin (FULL states in JSON) and the Go one (DIFFS in
    protobuf, keeping the state itself)."""
    name, program = _summary_program(language, tmp_path)
    manifests, out = tmp_path / "manifests", tmp_path / "summary.jsonl"
    manifests.mkdir()
    socket, config = tmp_path / "summary.sock", tmp_path / "summary.conf"
    config.write_text('{"label": "edge"}')
    _write(manifests / "cluster.json", _objects(NODEPORT_SERVICE, SLICE))
    logs = tmp_path / "logs"
    with logs.open("wb") as log:
        plugin = subprocess.Popen(
            [*program, "--socket", str(socket), "--output", str(out)], stderr=log
        )
        argv = [*kpng_command, "file", "--input", str(manifests), "to-local"]
        argv += ["--node-name", "node-1", "to-json", "--output", str(tmp_path / "state.json")]
        argv += ["to-plugin", "--plugin", f"summary=unix://{socket},config={config}"]
        kpng = subprocess.Popen(argv, stderr=log, env=subprocess_env)
    try:
        until(lambda: len(json_lines(out)) >= 1, "the first summary", within=WAIT_S)
        first = json_lines(out)[0]
        assert first == {
            "node": "node-1",
            "revision": first["revision"],
            "services": 1,
            "endpoints": 1,
            "nodePorts": [30080],
            "label": "edge",
        }
        second_service = json.loads(json.dumps(NODEPORT_SERVICE))
        second_service["metadata"]["name"] = "api"
        second_service["spec"]["clusterIP"] = "10.96.0.11"
        second_service["spec"]["ports"][0]["nodePort"] = 30081
        _write(manifests / "cluster.json", _objects(NODEPORT_SERVICE, SLICE, second_service))
        until(
            lambda: json_lines(out)[-1]["nodePorts"] == [30080, 30081],
            "the new node port",
            within=WAIT_S,
        )
        # Killed and started again: the plugin gets the whole state without a new change.
        plugin.kill()
        plugin.wait(timeout=10)
        with logs.open("ab") as log:
            plugin = subprocess.Popen(
                [*program, "--socket", str(socket), "--output", str(out)], stderr=log
            )
        count = len(json_lines(out))
        until(lambda: len(json_lines(out)) > count, "the state after the restart", within=WAIT_S)
        assert json_lines(out)[-1]["nodePorts"] == [30080, 30081]
        assert kpng.poll() is None
    finally:
        _stop(kpng)
        _stop(plugin)
    text = logs.read_text()
    assert f"plugin summary: connected to {name} 1.0.0" in text
    assert f"{name}: configured for node node-1" in text
    assert kpng.returncode == 0, text


# --- nodeport-guard with real packets

GUARD_SPEC = ClusterSpec.parse({"node-1": ["a1"]})
OTHER_CLIENT = "10.250.0.201"


def _connect_from(bed: TestBed, source: str, host: str, port_: int) -> str:
    """One TCP connection from the external client's namespace, from address ``source``."""
    assert bed.external is not None
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    s = socket.create_connection(({host!r}, {port_}), timeout=1.0,"
        f" source_address=({source!r}, 0))\n"
        "    s.sendall(b'hello\\n'); print(s.recv(4096).decode().strip())\n"
        "except OSError as e:\n"
        "    print('timeout' if isinstance(e, TimeoutError) else f'error: {e}')\n"
    )
    return bed.exec(bed.external.netns, [sys.executable, "-c", code]).strip()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[TestBed, Cluster, Path]]:
    reason = available()
    if reason is not None:
        pytest.skip(reason)
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    with TestBed(GUARD_SPEC) as bed:
        assert bed.external is not None
        bed.exec(bed.external.netns, ["ip", "addr", "add", f"{OTHER_CLIENT}/24", "dev", "eth0"])
        logs = tmp_path / "node-logs"
        logs.mkdir()
        yield bed, Cluster(bed, manifests, logs), manifests


def test_the_guard_drops_blocked_sources_to_node_ports(
    guarded: tuple[TestBed, Cluster, Path], tmp_path: Path
) -> None:
    bed, cluster, manifests = guarded
    assert bed.external is not None
    node = bed.nodes["node-1"]
    cluster.write("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}})
    ip = cluster.cluster_ip()
    np_service = service("np", ip, [port("http", 80, nodePort=30080)], type="NodePort")
    cluster.write("np", np_service, endpoint_slice(cluster, "np", ["a1"]))
    config, socket = tmp_path / "guard.conf", tmp_path / "guard.sock"
    blocked = bed.external.ip4
    config.write_text(f"# the external client\n{blocked}/32\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    with (logs / "guard.log").open("wb") as log:
        bed.spawn(node.netns, [sys.executable, str(GUARD), "--socket", str(socket)], stderr=log)
    argv = [sys.executable, "-m", "kpng", "file", "--input", str(manifests), "to-local"]
    argv += ["--node-name", "node-1", "to-nft", "--cluster-cidr", ",".join(CLUSTER_CIDRS)]
    argv += ["to-plugin", "--plugin", f"guard=unix://{socket},config={config}"]
    with (logs / "kpng.log").open("wb") as log:
        bed.spawn(node.netns, argv, stderr=log)

    def reach(source: str) -> str:
        return _connect_from(bed, source, node.ip4, 30080)

    try:
        # the other client gets through to-nft's node port; the blocked one is dropped
        until(
            lambda: reach(OTHER_CLIENT).startswith("a1 "),
            "the node port for the other",
            within=WAIT_S,
        )
        until(lambda: reach(blocked) == "timeout", "the blocked client dropped", within=WAIT_S)
        assert reach(OTHER_CLIENT).startswith("a1 ")
        # removing the CIDR from the configuration restores access
        config.write_text("# nobody\n")
        until(lambda: reach(blocked).startswith("a1 "), "access restored", within=WAIT_S)
        # blocked again; then the service goes, and its node port leaves the guard's set
        config.write_text(f"{blocked}/32\n")
        until(lambda: reach(blocked) == "timeout", "blocked again", within=WAIT_S)
        cluster.remove("np")

        listing = ["nft", "list", "set", "inet", "kpng-guard", "node-ports"]
        until(
            lambda: "30080" not in bed.exec(node.netns, listing),
            "the node port unguarded",
            within=WAIT_S,
        )
    except AssertionError:
        for name in ("guard.log", "kpng.log"):
            print(f"--- {name}\n{(logs / name).read_text()}")
        raise
