"""A multi-node cluster made of Linux network namespaces, from a short description.

    spec = ClusterSpec.parse({"node-1": ["web-1", "web-2"], "node-2": ["web-3"]})
    with TestBed(spec) as bed:
        bed.probe(bed.pod("web-1"), "tcp", "10.96.0.10", 80)

Layout (every address lives only inside the namespaces the bed creates, never leaves them):

- an *underlay* namespace holding a bridge; node ``i`` (from 1) is joined to it with node IPs
  ``10.250.0.i/24`` and ``fd00:250::i/64``; the *external client* is ``10.250.0.200`` and
  ``fd00:250::200``, outside the cluster, and routes ``VIP_CIDRS`` (external and load-balancer
  IPs for tests) through node 1;
- pod ``j`` (from 2) of node ``i`` is ``10.244.i.j/32`` and ``fd00:244:i::j/128`` on a veth
  routed by its node (no bridge: every pod packet crosses the node's IP stack, as with most CNI
  plugins, so the node's conntrack sees both directions); nodes route each other's pod CIDRs
  ``10.244.i.0/24`` and ``fd00:244:i::/64`` over the underlay;
- each pod runs ``kpng.testing.echo`` on ``ECHO_PORTS``;
- nodes' default routes point at the external client (a dead end inside the bed), so that a
  node's own connections to service IPs have a route before DNAT.

With ``sockets=True`` each node also gets a cgroup2 directory (``Node.cgroup``) holding every
process the bed starts in the node or its pods, and a directory on bpffs (``Node.pin_dir``):
what a backend balancing at connect time (to-ebpf) attaches to and pins in. The bed mounts both
file systems under /run, since ``ip netns exec`` hides /sys's mounts.

Names start with a prefix unique to the process and the bed, so parallel runs do not collide,
and everything is removed on exit, also when the body raised. Needs root, ``ip`` (iproute2) and
Python in every namespace (``ip netns exec``).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

ECHO_PORTS = (8080, 8081, 5353)
VIP_CIDRS = ("10.251.0.0/24", "fd00:251::/64")
CLUSTER_CIDRS = ("10.244.0.0/16", "fd00:244::/32")
EXTERNAL_V4 = "10.250.0.200"
EXTERNAL_V6 = "fd00:250::200"
COMMAND_TIMEOUT_S = 30


class TestBedError(Exception):
    """Setting up or using the test bed failed (the message has the command and its output)."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]

    @classmethod
    def parse(cls, description: Mapping[str, Sequence[str]]) -> ClusterSpec:
        """``{"node-1": ["pod-a", ...], ...}``: node names in order, with their pods."""
        return cls(tuple(NodeSpec(name, tuple(pods)) for name, pods in description.items()))


@dataclass
class Node:
    name: str
    index: int
    netns: str
    ip4: str
    ip6: str
    pod_cidr4: str
    pod_cidr6: str
    cgroup: Path | None = None
    pin_dir: Path | None = None

    @property
    def pod_cidrs(self) -> tuple[str, str]:
        return (self.pod_cidr4, self.pod_cidr6)


@dataclass
class Pod:
    name: str
    node: Node
    netns: str
    ip4: str
    ip6: str


@dataclass
class External:
    netns: str
    ip4: str = EXTERNAL_V4
    ip6: str = EXTERNAL_V6


@dataclass
class TestBed:
    """The cluster of ``spec``, built on ``__enter__`` and removed on ``__exit__``."""

    spec: ClusterSpec
    prefix: str = field(default_factory=lambda: f"kt{os.getpid() % 100000}{secrets.token_hex(2)}")
    nodes: dict[str, Node] = field(default_factory=dict)
    pods: dict[str, Pod] = field(default_factory=dict)
    external: External | None = None
    sockets: bool = False
    _namespaces: list[str] = field(default_factory=list)
    _cgroups: dict[str, Path] = field(default_factory=dict)
    """netns: the cgroup its processes are started in."""
    _mounts: list[Path] = field(default_factory=list)
    _processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    __test__ = False  # not a pytest test class, whatever its name

    def __enter__(self) -> TestBed:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- building

    def _netns(self, role: str) -> str:
        name = f"{self.prefix}-{role}"
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)
        for cmd in (
            ["ip", "link", "set", "lo", "up"],
            ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
            ["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"],
            ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0"],
            ["sysctl", "-qw", "net.ipv4.conf.default.rp_filter=0"],
            ["sysctl", "-qw", "net.ipv6.conf.default.accept_dad=0"],
        ):
            self.exec(name, cmd)
        return name

    def _mount(self, fstype: str, name: str) -> Path:
        target = Path("/run/kpng-tests") / self.prefix / name
        target.mkdir(parents=True)
        _run(["mount", "-t", fstype, fstype, str(target)])
        self._mounts.append(target)
        return target

    def _build(self) -> None:
        if self.sockets:
            cgroups, pins = self._mount("cgroup2", "cgroup2"), self._mount("bpf", "bpf")
        underlay = self._netns("ul")
        self.exec(underlay, ["ip", "link", "add", "br0", "type", "bridge"])
        self.exec(underlay, ["ip", "link", "set", "br0", "up"])
        for i, node_spec in enumerate(self.spec.nodes, start=1):
            ns = self._netns(f"n{i}")
            node = Node(
                node_spec.name, i, ns, f"10.250.0.{i}", f"fd00:250::{i}",
                f"10.244.{i}.0/24", f"fd00:244:{i}::/64",
            )  # fmt: skip
            self.nodes[node.name] = node
            if self.sockets:
                node.cgroup, node.pin_dir = cgroups / self.prefix / node.name, pins / node.name
                node.cgroup.mkdir(parents=True)
                self._cgroups[ns] = node.cgroup
            self._uplink(underlay, ns, f"n{i}", node.ip4, node.ip6)
            for j, pod_name in enumerate(node_spec.pods, start=2):
                self._pod(node, pod_name, j)
        for node in self.nodes.values():
            for other in self.nodes.values():
                if other is not node:
                    self.exec(node.netns, ["ip", "route", "add", other.pod_cidr4, "via", other.ip4])
                    self.exec(
                        node.netns, ["ip", "-6", "route", "add", other.pod_cidr6, "via", other.ip6]
                    )
        ext = self._netns("ext")
        self.external = External(ext)
        self._uplink(underlay, ext, "ext", EXTERNAL_V4, EXTERNAL_V6)
        # Nodes route the rest of the world to the external client, as to a gateway: so that
        # the node itself can open connections to service IPs (its output path needs a route
        # before DNAT). Nothing the bed sends leaves its namespaces.
        for node in self.nodes.values():
            self.exec(node.netns, ["ip", "route", "add", "default", "via", EXTERNAL_V4])
            self.exec(node.netns, ["ip", "-6", "route", "add", "default", "via", EXTERNAL_V6])
        first = next(iter(self.nodes.values()))
        self.exec(ext, ["ip", "route", "add", VIP_CIDRS[0], "via", first.ip4])
        self.exec(ext, ["ip", "-6", "route", "add", VIP_CIDRS[1], "via", first.ip6])
        for pod in self.pods.values():
            self._start_echo(pod)

    def _uplink(self, underlay: str, ns: str, port: str, ip4: str, ip6: str) -> None:
        self.exec(
            underlay,
            ["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
        )
        self.exec(underlay, ["ip", "link", "set", port, "master", "br0", "up"])
        self.exec(ns, ["ip", "addr", "add", f"{ip4}/24", "dev", "eth0"])
        self.exec(ns, ["ip", "addr", "add", f"{ip6}/64", "dev", "eth0", "nodad"])
        self.exec(ns, ["ip", "link", "set", "eth0", "up"])

    def _pod(self, node: Node, name: str, j: int) -> None:
        i = node.index
        ns = self._netns(f"n{i}p{j}")
        if node.cgroup is not None:
            self._cgroups[ns] = node.cgroup
        pod = Pod(name, node, ns, f"10.244.{i}.{j}", f"fd00:244:{i}::{j:x}")
        self.pods[name] = pod
        veth = f"vp{j}"
        gw4, gw6 = f"10.244.{i}.1", f"fd00:244:{i}::1"
        self.exec(
            node.netns,
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
        )
        self.exec(node.netns, ["ip", "addr", "add", f"{gw4}/32", "dev", veth])
        self.exec(node.netns, ["ip", "addr", "add", f"{gw6}/128", "dev", veth, "nodad"])
        self.exec(node.netns, ["ip", "link", "set", veth, "up"])
        self.exec(node.netns, ["ip", "route", "add", f"{pod.ip4}/32", "dev", veth])
        self.exec(node.netns, ["ip", "-6", "route", "add", f"{pod.ip6}/128", "dev", veth])
        self.exec(ns, ["ip", "addr", "add", f"{pod.ip4}/32", "dev", "eth0"])
        self.exec(ns, ["ip", "addr", "add", f"{pod.ip6}/128", "dev", "eth0", "nodad"])
        self.exec(ns, ["ip", "link", "set", "eth0", "up"])
        self.exec(ns, ["ip", "route", "add", gw4, "dev", "eth0"])
        self.exec(ns, ["ip", "route", "add", "default", "via", gw4, "dev", "eth0"])
        self.exec(ns, ["ip", "-6", "route", "add", gw6, "dev", "eth0"])
        self.exec(ns, ["ip", "-6", "route", "add", "default", "via", gw6, "dev", "eth0"])

    def _start_echo(self, pod: Pod) -> None:
        ports = ",".join(str(p) for p in ECHO_PORTS)
        proc = self.spawn(
            pod.netns,
            [sys.executable, "-m", "kpng.testing.echo", pod.name, ports],
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready" once listening; EOF if it died
        if line.strip() != b"ready":
            raise TestBedError(f"echo server of pod {pod.name} did not start")

    # --- using

    def exec(
        self, netns: str, argv: Sequence[str], *, check: bool = True, input: bytes | None = None
    ) -> str:
        """Run ``argv`` in ``netns`` and return its output; ``TestBedError`` if it fails."""
        return _run(self.command_in(netns, argv), check=check, input=input)

    def command_in(self, netns: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run in ``netns``, and in its node's cgroup if the bed has them (where the
        node's socket programs see it): for a process a test starts itself."""
        command = ["ip", "netns", "exec", netns, *argv]
        cgroup = self._cgroups.get(netns)
        if cgroup is None:
            return command
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *command]

    def spawn(
        self,
        netns: str,
        argv: Sequence[str],
        *,
        stdout: int | None = subprocess.DEVNULL,
        stderr: Any = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in ``netns``; it is stopped when the bed closes."""
        proc = subprocess.Popen(
            self.command_in(netns, argv),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._processes.append(proc)
        return proc

    def pod(self, name: str) -> Pod:
        return self.pods[name]

    def probe(
        self,
        netns: str,
        proto: str,
        host: str,
        port: int,
        *,
        count: int = 1,
        timeout: float = 2.0,
        hold: float = 0.0,
        source: str | None = None,
        ports: bool = False,
        source_port: int = 0,
    ) -> list[str]:
        """Answers of ``count`` connections from ``netns``, from its address ``source`` if given,
        with the source ports seen and sent if ``ports``; ``source_port`` for
        ``udp-same-source`` (see ``kpng.testing.probe``)."""
        argv = [sys.executable, "-m", "kpng.testing.probe", proto, host, str(port)]
        argv += ["--count", str(count), "--timeout", str(timeout), "--hold", str(hold)]
        if source:
            argv += ["--source", source]
        if ports:
            argv.append("--ports")
        if source_port:
            argv += ["--source-port", str(source_port)]
        result: list[str] = json.loads(self.exec(netns, argv))["results"]
        return result

    def close(self) -> None:
        """Stop every process and delete every namespace (also after a partial build)."""
        for proc in self._processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            if proc.stdout is not None:
                proc.stdout.close()
        self._processes.clear()
        for name in reversed(self._namespaces):
            _run(["ip", "netns", "del", name], check=False)
        self._namespaces.clear()
        # A cgroup's programs' links go with it; unmounting bpffs drops every pin in it.
        # (cgroup2 is one hierarchy for the whole machine: its directories outlive the mount.)
        for cgroup in set(self._cgroups.values()):
            _rmdir(cgroup)
        if self._cgroups:
            _rmdir(next(iter(self._cgroups.values())).parent)
        for target in reversed(self._mounts):
            _run(["umount", str(target)], check=False)
            _rmdir(target)
        if self._mounts:
            _rmdir(self._mounts[0].parent)
        self._cgroups.clear()
        self._mounts.clear()


def _rmdir(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError as exc:
        log.warning("test bed: cannot remove %s: %s", directory, exc)


def _run(argv: Sequence[str], *, check: bool = True, input: bytes | None = None) -> str:
    try:
        proc = subprocess.run(
            argv, input=input, capture_output=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestBedError(f"{' '.join(argv)}: {exc}") from exc
    if check and proc.returncode != 0:
        raise TestBedError(f"{' '.join(argv)}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode(errors="replace")


def available() -> str | None:
    """Why a test bed cannot be built here (not root, no ``ip``), or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft"):
        if not any(Path(d, tool).exists() for d in os.environ.get("PATH", "").split(":")):
            return f"{tool} is not installed"
    return None


def testbed_fixture(spec: ClusterSpec) -> Iterator[TestBed]:
    """The body of a pytest fixture: ``yield from testbed_fixture(spec)``."""
    with TestBed(spec) as bed:
        yield bed
