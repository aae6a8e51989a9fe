"""Real Kubernetes nodes on one machine: a kubelet and a containerd per network namespace.

``RealCluster`` starts what a kubeadm cluster runs, every program a real one:

- the test control plane of ``rig.cluster`` (etcd, kube-apiserver), listening on a
  bridge the nodes reach, with the Node authorizer and the lease endpoint reconciler, so that
  the ``kubernetes`` Service has the apiserver's real address as its endpoint;
- kube-controller-manager (EndpointSlices, service-account tokens, node IPAM, garbage
  collection, namespaces, ...) and kube-scheduler;
- per node, a network namespace joined to the bridge, with its own containerd (Debian's, with
  its own root, state, socket and runc root) and its own kubelet (``cgroupRoot: /<node>``, the
  cgroupfs driver, ``failCgroupV1: false`` since this machine mounts cgroup v1), both entered
  with ``nsenter --net --uts``: the node's network and host name, but the machine's mounts,
  since kubelet mounts volumes that containerd must see;
- pod networking from Debian's CNI plugins: ``ptp`` (and ``portmap`` for hostPorts) with
  ``host-local`` addresses from the podCIDR kube-controller-manager allocated to the node
  (written once the Node has one, as kind's kindnet does), and routes of our own between
  nodes. With ``ptp`` every pod packet
  crosses its node's IP stack, so a service proxy sees both directions without br_netfilter.

No service proxy runs until a test deploys one (kpng's DaemonSet or kube-proxy's): then the
cluster is what a user has after ``kubeadm init --skip-phases=addon/kube-proxy``.

Addresses: the bridge ``kpngn0`` is ``10.253.0.1/24`` in the machine's namespace, node *i* is
``10.253.0.(10+i)``, pods come from ``10.245.0.0/16``, services from ``10.96.0.0/16``. Nodes
route everything else to the bridge address, where the machine does not forward it
(``net.ipv4.conf.kpngn0.forwarding=0``): no packet of the cluster leaves the machine.

``dual_stack=True`` adds IPv6 beside it, IPv4 staying the primary family: ``fd00:10:253::1/64``
on the bridge, ``fd00:10:253::(10+i)`` on node *i* (kubelet's ``--node-ip`` names both), pods
from ``fd00:10:245::/56`` too (a /64 per node) and services from ``fd00:10:96::/112`` too. Nodes
forward IPv6 (``net.ipv6.conf.all.forwarding=1``, checked) and route only the cluster's own
``fd00:10::/32`` to the bridge, with no IPv6 default route: IPv6 for anywhere else never leaves a
node.

One cluster at a time per machine (the bridge has a fixed name); ``stop()`` (and ``python -m
rig.nodes down``) kills every process of the nodes, containers included, unmounts,
and removes namespaces, cgroups and files, also after a crash of the process that started it.
Needs root and ``REQUIRED_TOOLS``, with the CNI plugins (``missing_requirements()`` says what
is missing).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kpng.testing.ports import free_port
from kpng.testing.waiting import until
from rig.cluster import (
    SERVICE_CIDR,
    ControlPlane,
    ControlPlaneError,
    Daemon,
    Pki,
    ensure_binaries,
    ensure_programs,
    issue_client_cert,
    make_pki,
)
from rig.images import ImageArchive
from rig.kubeapi import write_kubeconfig

log = logging.getLogger(__name__)

BRIDGE = "kpngn0"
BRIDGE_NETWORK = ipaddress.ip_network("10.253.0.0/24")
HOST_IP = "10.253.0.1"
CLUSTER_CIDR = "10.245.0.0/16"
BRIDGE_NETWORK6 = ipaddress.ip_network("fd00:10:253::/64")
HOST_IP6 = "fd00:10:253::1"
CLUSTER_CIDR6 = "fd00:10:245::/56"
SERVICE_CIDR6 = "fd00:10:96::/112"
CLUSTER_NETWORK6 = "fd00:10::/32"
"""Every IPv6 address of a dual-stack cluster (bridge, pods, services): all a node routes."""
CLUSTER_DOMAIN = "cluster.local"
CLUSTER_DNS = str(ipaddress.ip_network(SERVICE_CIDR)[10])
CNI_BIN_DIR = Path("/usr/lib/cni")
NETNS_PREFIX = "kpng-"
NODE_PROGRAMS = ("kubelet", "kube-controller-manager", "kube-scheduler", "kubectl")
_READY_TIMEOUT_S = 180.0
_CGROUP_ROOT = Path("/sys/fs/cgroup")


class NodeError(ControlPlaneError):
    """A node could not be set up, reached or cleaned up."""


def _run(
    argv: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 300
) -> str:
    proc = subprocess.run(
        list(argv), input=input, capture_output=True, text=True, check=False, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


UTS_DIR = Path("/run/kpng-nodes")
"""Where nodes' UTS namespaces are pinned: a private mount, as iproute2 makes /run/netns, since
a namespace cannot be bind-mounted where mounts propagate."""


def _in_node(netns: str, uts: Path, argv: Sequence[str]) -> list[str]:
    # The node's network and host name (hostNetwork pods answer with the node's name, as e2e
    # tests expect), but the machine's mounts: volumes kubelet mounts must be seen by containerd
    # and the shims it starts.
    return ["nsenter", f"--net=/run/netns/{netns}", f"--uts={uts}", "--", *argv]


def _private_uts_dir() -> None:
    UTS_DIR.mkdir(parents=True, exist_ok=True)
    if str(UTS_DIR) not in _mounts_under([str(UTS_DIR)]):
        _run(["mount", "--bind", str(UTS_DIR), str(UTS_DIR)])
        _run(["mount", "--make-private", str(UTS_DIR)])


def _wait_for(what: str, probe: Callable[[], bool], timeout: float = _READY_TIMEOUT_S) -> None:
    until(probe, what, within=timeout, interval=0.5, error=NodeError)


# --- cgroups (v1 here: one hierarchy per controller)


def _hierarchies() -> list[Path]:
    """The v1 hierarchies, and cgroup2's at ``unified`` once mounted (``mount_cgroup2``)."""
    if not _CGROUP_ROOT.is_dir():
        return []
    return sorted(d for d in _CGROUP_ROOT.iterdir() if (d / "cgroup.procs").exists())


UNIFIED = _CGROUP_ROOT / "unified"
BPFFS = Path("/sys/fs/bpf")


def mount_cgroup2() -> None:
    """cgroup2 at /sys/fs/cgroup/unified beside the v1 hierarchies, and bpffs at /sys/fs/bpf,
    as systemd mounts them on a hybrid host: runc then puts every container in the node's
    cgroup2 directory too (``node_cgroup2``), where cgroup BPF programs (to-ebpf) see just that
    node's sockets. Left mounted: other clusters' containers are in it too, harmlessly."""
    if not _mounted(UNIFIED):
        UNIFIED.mkdir(exist_ok=True)
        _run(["mount", "-t", "cgroup2", "cgroup2", str(UNIFIED)])
    if not _mounted(BPFFS):
        BPFFS.mkdir(exist_ok=True)
        _run(["mount", "-t", "bpf", "bpf", str(BPFFS)])


def _mounted(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0


def _make_cgroup(name: str) -> None:
    """``/<name>`` in every hierarchy, which kubelet's ``cgroupRoot`` must find existing."""
    for hierarchy in _hierarchies():
        path = hierarchy / name
        path.mkdir(exist_ok=True)
        if hierarchy.name == "cpuset":  # a new cpuset has no CPUs until it is given some
            for knob in ("cpuset.cpus", "cpuset.mems"):
                (path / knob).write_text((hierarchy / knob).read_text())


def _cgroup_dirs(root: Path) -> list[Path]:
    """``root`` and the cgroups under it, deepest first. os.walk, not Path.rglob: a container
    exiting meanwhile removes its cgroup, which rglob raises on (seen stopping a cluster)."""
    found = [Path(directory) for directory, _, _ in os.walk(root)]
    return sorted(found, key=lambda p: -len(p.parts))


def _cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for hierarchy in _hierarchies():
        for directory in _cgroup_dirs(hierarchy / name):
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (directory / "cgroup.procs").read_text().split())
    return pids


def _remove_cgroup(name: str) -> None:
    for hierarchy in _hierarchies():
        for path in _cgroup_dirs(hierarchy / name):
            with contextlib.suppress(OSError):
                path.rmdir()


# --- processes and mounts left by containers


def _pids_with_argument(argument: str) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in argv:
            pids.add(int(entry.name))
    return pids


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _mounts_under(prefixes: Sequence[str]) -> list[str]:
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
            mounts.append(point)
    return mounts


def _unmount_under(prefixes: Sequence[str]) -> None:
    for point in sorted(set(_mounts_under(prefixes)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


# --- one node


@dataclass(frozen=True)
class NodeLayout:
    """Where one node lives: names, addresses and files, all derived from its index."""

    name: str
    index: int
    workdir: Path
    dual_stack: bool = False

    @property
    def netns(self) -> str:
        return f"{NETNS_PREFIX}{self.name}"

    @property
    def ip(self) -> str:
        return str(BRIDGE_NETWORK[10 + self.index])

    @property
    def ip6(self) -> str:
        return str(BRIDGE_NETWORK6[10 + self.index])

    @property
    def ips(self) -> tuple[str, ...]:
        """The node's addresses, the primary (IPv4) first: kubelet's ``--node-ip``."""
        return (self.ip, self.ip6) if self.dual_stack else (self.ip,)

    @property
    def uts(self) -> Path:
        return UTS_DIR / f"{self.name}.uts"

    @property
    def veth(self) -> str:
        return f"kpngv{self.index}"

    @property
    def cgroup(self) -> str:
        return f"kpng-{self.name}"

    @property
    def pins(self) -> Path:
        """The node's own directory of the host's bpffs: to-ebpf's /sys/fs/bpf there."""
        return BPFFS / self.cgroup

    @property
    def containerd_socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.workdir / "cni"

    @property
    def kubelet_dir(self) -> Path:
        return self.workdir / "kubelet"


def containerd_config(node: NodeLayout, pause_image: str) -> str:
    state = node.workdir / "containerd"
    return f"""\
version = 2
root = "{state}/root"
state = "{state}/state"

[grpc]
  address = "{node.containerd_socket}"

[ttrpc]
  address = "{node.containerd_socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{state}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  # This machine gives root no CAP_SYS_RESOURCE, so runc may not lower a container's
  # oom_score_adj below containerd's (kubelet asks -998 for sandboxes).
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{node.cni_conf_dir}"

  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
      # Each node's containers under its own runc root, so that nodes never see each other's.
      Root = "{state}/runc"
"""


def kubelet_config(node: NodeLayout, ca_cert: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine mounts cgroup v1, which kubelet 1.35 refuses unless told otherwise.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{node.cgroup}",
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "address": node.ip,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        # The apiserver's kubelet client certificate is the only one the CA signs that reaches
        # a node's port, so authenticating it is enough for a test cluster.
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [CLUSTER_DNS],
        "clusterDomain": CLUSTER_DOMAIN,
        # Pods get the cluster's DNS only, never the machine's resolvers (nothing leaves).
        "resolvConf": str(node.workdir / "resolv.conf"),
        "podLogsDir": str(node.workdir / "pod-logs"),
        # Nodes share one disk: evicting pods because the machine's disk is 85 % full would
        # fail tests that have nothing to do with it.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "rotateCertificates": False,
    }


def cni_config(pod_cidrs: Sequence[str]) -> dict[str, Any]:
    """ptp with a host-local range and a default route per family of the node's ``pod_cidrs``."""
    families = [ipaddress.ip_network(cidr).version for cidr in pod_cidrs]
    return {
        "cniVersion": "0.4.0",
        "name": "kpng-nodes",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": False,
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": cidr}] for cidr in pod_cidrs],
                    "routes": [{"dst": "0.0.0.0/0" if v == 4 else "::/0"} for v in families],
                },
            },
            # hostPort, as kind's CNI configuration has it (e2e's CLOSE_WAIT test uses one).
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


class RealNode:
    """One node's namespace, containerd and kubelet."""

    def __init__(self, layout: NodeLayout, *, detach: bool) -> None:
        self.layout = layout
        self.name = layout.name
        self.ip = layout.ip
        self.ip6 = layout.ip6 if layout.dual_stack else None
        self._detach = detach
        self.containerd: Daemon | None = None
        self.kubelet: Daemon | None = None
        self._kubelet_argv: list[str] = []

    def netns_argv(self, argv: Sequence[str]) -> list[str]:
        return _in_node(self.layout.netns, self.layout.uts, argv)

    def exec(self, *argv: str, check: bool = True) -> str:
        """Runs a command in the node's network namespace (as the node's own programs do)."""
        return _run(self.netns_argv(argv), check=check)

    def create_network(self) -> None:
        n = self.layout
        _private_uts_dir()
        n.uts.touch()
        _run(["unshare", f"--uts={n.uts}", "hostname", n.name])
        _run(["ip", "netns", "add", n.netns])
        _run(
            ["ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns]
        )
        _run(["ip", "link", "set", n.veth, "master", BRIDGE, "up"])
        for argv in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "addr", "add", f"{n.ip}/{BRIDGE_NETWORK.prefixlen}", "dev", "eth0"],
            ["ip", "link", "set", "eth0", "up"],
            ["ip", "route", "add", "default", "via", HOST_IP],
            ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
        ):
            self.exec(*argv)
        if n.dual_stack:
            self._add_ipv6()

    def _add_ipv6(self) -> None:
        n = self.layout
        # nodad: the address is ours alone on the bridge, and a tentative one would refuse
        # kubelet's bind for a second or two.
        prefix = BRIDGE_NETWORK6.prefixlen
        self.exec("ip", "-6", "addr", "add", f"{n.ip6}/{prefix}", "dev", "eth0", "nodad")
        self.exec("ip", "-6", "route", "add", CLUSTER_NETWORK6, "via", HOST_IP6)
        # all: forwarding on every interface, pods' veths made later included; default: what a
        # new interface starts with, as kube-proxy's and kpng's checks read it.
        forwarding = ("net.ipv6.conf.all.forwarding", "net.ipv6.conf.default.forwarding")
        for key in forwarding:
            self.exec("sysctl", "-qw", f"{key}=1")
        read = [self.exec("sysctl", "-n", key).strip() for key in forwarding]
        if read != ["1", "1"]:
            raise NodeError(f"{n.name}: {', '.join(forwarding)} read {read} after setting 1")

    def start_containerd(self, containerd: str, pause_image: str) -> None:
        n = self.layout
        n.workdir.mkdir(parents=True, exist_ok=True)
        n.cni_conf_dir.mkdir(exist_ok=True)
        config = n.workdir / "containerd.toml"
        config.write_text(containerd_config(n, pause_image))
        self.containerd = Daemon(
            f"containerd:{n.name}",
            self.netns_argv([containerd, "--config", str(config)]),
            n.workdir / "containerd.log",
            detach=self._detach,
        )

        def serving() -> bool:
            assert self.containerd is not None
            self.containerd.check_alive()
            return self.ctr("version", check=False) != ""

        _wait_for(f"containerd of {n.name}", serving, 30)

    def ctr(self, *args: str, check: bool = True) -> str:
        argv = ["ctr", "--address", str(self.layout.containerd_socket), "-n", "k8s.io", *args]
        return _run(argv, check=check)

    def import_image(self, archive: Path) -> None:
        self.ctr("images", "import", "--no-unpack", str(archive))

    def start_kubelet(self, kubelet: str, kubeconfig: Path, ca_cert: Path) -> None:
        n = self.layout
        _make_cgroup(n.cgroup)
        (n.workdir / "resolv.conf").write_text(f"nameserver {CLUSTER_DNS}\n")
        config = n.workdir / "kubelet.yaml"
        config.write_text(yaml.safe_dump(kubelet_config(n, ca_cert), sort_keys=False))
        self._kubelet_argv = self.netns_argv(
            [
                kubelet,
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={n.kubelet_dir}",
                f"--hostname-override={n.name}",
                f"--node-ip={','.join(n.ips)}",
                "--v=1",
            ]
        )
        self._spawn_kubelet()

    def _spawn_kubelet(self) -> None:
        self.kubelet = Daemon(
            f"kubelet:{self.name}",
            self._kubelet_argv,
            self.layout.workdir / "kubelet.log",
            detach=self._detach,
        )

    def restart_kubelet(self) -> None:
        """Stops kubelet and starts it again; pods (and their traffic) live on meanwhile."""
        if self.kubelet is not None:
            self.kubelet.stop()
        self._spawn_kubelet()

    def write_cni_config(self, pod_cidrs: Sequence[str]) -> None:
        path = self.layout.cni_conf_dir / "10-kpng-nodes.conflist"
        path.write_text(json.dumps(cni_config(pod_cidrs), indent=2) + "\n")

    def address_of(self, cidr: str) -> str:
        """The node's address of ``cidr``'s family: the next hop to pods there."""
        if ipaddress.ip_network(cidr).version == 6:
            assert self.ip6 is not None, f"{cidr} on a node without IPv6"
            return self.ip6
        return self.ip

    def pids(self) -> list[int]:
        return [d.pid for d in (self.kubelet, self.containerd) if d is not None]

    def reap(self) -> None:
        """Collects the exit of the node's daemons (``remove_node`` killed them)."""
        for daemon in (self.kubelet, self.containerd):
            if daemon is not None:
                daemon.stop()


def remove_node(layout: NodeLayout) -> None:
    """Everything a node made, gone: kubelet, containers and shims, containerd, mounts,
    cgroups, network namespaces (its own and its pods'). Safe to repeat."""
    socket = str(layout.containerd_socket)
    kubelet_config_path = str(layout.workdir / "kubelet.yaml")
    _kill(_pids_with_argument(f"--config={kubelet_config_path}"))
    # Shims name their containerd's socket; containers live in the node's cgroups. Repeated,
    # because a shim may start a process while the first pass kills.
    for _ in range(3):
        _kill(_pids_with_argument(socket) | _cgroup_pids(layout.cgroup))
        time.sleep(0.2)
    _kill(_pids_with_argument(str(layout.workdir / "containerd.toml")))
    # Pods' network namespaces are bind mounts that containerd made under /run/netns.
    pod_netns = []
    for point in _mounts_under(["/run/netns"]):
        name = Path(point).name
        if name.startswith("cni-") and not _netns_in_use(point):
            pod_netns.append(point)
    _unmount_under([str(layout.workdir), *pod_netns])
    for point in pod_netns:
        with contextlib.suppress(OSError):
            Path(point).unlink()
    # to-ebpf's pinned links are its programs' last references: without them the programs
    # leave the node's cgroup, and nothing of a run stays on the host's bpffs.
    shutil.rmtree(layout.pins, ignore_errors=True)
    _remove_cgroup(layout.cgroup)
    subprocess.run(["ip", "netns", "delete", layout.netns], capture_output=True, check=False)
    # The namespace's veth goes with it only once the kernel has torn the namespace down, which
    # may take minutes after a busy run (seen): the next cluster's pair of the same name would
    # not be made till then. Deleting our end deletes both now.
    subprocess.run(["ip", "link", "delete", layout.veth], capture_output=True, check=False)
    subprocess.run(["umount", str(layout.uts)], capture_output=True, check=False)
    layout.uts.unlink(missing_ok=True)
    shutil.rmtree(layout.workdir, ignore_errors=True)


def _netns_in_use(path: str) -> bool:
    try:
        target = os.stat(path).st_ino
    except OSError:
        return False
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(entry / "ns" / "net").st_ino == target:
                    return True
    return False


# --- the cluster


REQUIRED_TOOLS = ("nsenter", "unshare", "ip", "iptables", "containerd", "ctr", "runc", "mmdebstrap")


def missing_requirements() -> str:
    """Why real nodes cannot run on this machine, or "" if they can."""
    if os.geteuid() != 0:
        return "they need root"
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if not (CNI_BIN_DIR / "ptp").exists():
        missing.append(f"the CNI plugins in {CNI_BIN_DIR}")
    return f"missing {', '.join(missing)}" if missing else ""


class RealCluster:
    """A control plane, controllers and ``nodes`` real nodes; a context manager that removes
    everything on exit. ``images`` are imported into every node before kubelet starts;
    ``pause_image`` (one of them) is containerd's sandbox image. ``dual_stack``: IPv6 beside
    IPv4 everywhere (bridge, nodes, pods, services; see the module's docstring)."""

    def __init__(
        self,
        *,
        nodes: int = 2,
        images: Sequence[ImageArchive] = (),
        pause_image: str,
        workdir: Path | None = None,
        detach: bool = False,
        cgroup2: bool = False,
        dual_stack: bool = False,
    ) -> None:
        if not 1 <= nodes <= 200:
            raise NodeError(f"{nodes} nodes: between 1 and 200")
        self._detach = detach
        self._cgroup2 = cgroup2
        self.dual_stack = dual_stack
        """Whether the nodes get cgroup2 directories of their own (``mount_cgroup2``)."""
        self._own_workdir = workdir is None
        # Not /tmp's default: containerd's overlay snapshots need a real file system, and the
        # path must be short (unix sockets are limited to 107 bytes).
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="kpng-nodes-", dir="/var/tmp"))
        self.images = list(images)
        self.pause_image = pause_image
        self.layouts = [
            NodeLayout(f"node-{i}", i, self.workdir / f"node-{i}", dual_stack)
            for i in range(1, nodes + 1)
        ]
        self.nodes = [RealNode(layout, detach=detach) for layout in self.layouts]
        self.plane: ControlPlane | None = None
        self.pki: Pki
        self._controllers: list[Daemon] = []
        self.programs: dict[str, Path] = {}

    @property
    def kubeconfig(self) -> Path:
        assert self.plane is not None, "start() the cluster first"
        return self.plane.kubeconfig

    @property
    def server(self) -> str:
        assert self.plane is not None, "start() the cluster first"
        return self.plane.server

    @property
    def cluster_cidrs(self) -> tuple[str, ...]:
        """The pod CIDRs, the primary first: a proxy's ``clusterCIDR``, comma-joined."""
        return (CLUSTER_CIDR, CLUSTER_CIDR6) if self.dual_stack else (CLUSTER_CIDR,)

    @property
    def service_cidrs(self) -> tuple[str, ...]:
        return (SERVICE_CIDR, SERVICE_CIDR6) if self.dual_stack else (SERVICE_CIDR,)

    # Lifecycle.

    def start(self) -> RealCluster:
        missing = missing_requirements()
        if missing:
            raise NodeError(f"real nodes cannot run here: {missing}")
        try:
            self.programs = ensure_programs(NODE_PROGRAMS)
            if self._cgroup2:
                mount_cgroup2()
            self._create_bridge()
            directory = self.workdir / "control-plane"
            directory.mkdir(parents=True, exist_ok=True)
            self.pki = make_pki(directory, (HOST_IP, "127.0.0.1"))
            kubelet_client = self._write_cert(
                "kubelet-client", "kube-apiserver-kubelet-client", "system:masters"
            )
            self.plane = ControlPlane(
                ensure_binaries(),
                workdir=directory,
                detach=self._detach,
                address=HOST_IP,
                pki=self.pki,
                apiserver_args=[
                    *self._apiserver_args(*kubelet_client),
                    # Replaces ControlPlane's single-stack flag of the same name.
                    *self._service_range_args(),
                ],
            )
            self.plane.start()
            self._start_controllers()
            containerd = shutil.which("containerd")
            assert containerd is not None
            for node in self.nodes:
                node.create_network()
                node.start_containerd(containerd, self.pause_image)
                for image in self.images:
                    node.import_image(image.path)
                node.start_kubelet(
                    str(self.programs["kubelet"]), self._node_kubeconfig(node), self.pki.ca_cert
                )
            self._connect_pod_networks()
            self.wait_nodes_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            remove_node(node.layout)
            node.reap()
        for daemon in self._controllers:
            daemon.stop()
        self._controllers.clear()
        if self.plane is not None:
            self.plane.stop()
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RealCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def node_cgroup2(self, node: RealNode) -> Path:
        """The cgroup2 directory of ``node``'s kubelet and containers (``cgroup2`` only)."""
        assert self._cgroup2, "a cluster with cgroup2=True"
        return UNIFIED / node.layout.cgroup

    def pids(self) -> list[int]:
        """Nodes first, then controllers, then the control plane: the order to stop them."""
        plane = self.plane.pids() if self.plane is not None else []
        return [
            *(p for n in self.nodes for p in n.pids()),
            *(d.pid for d in self._controllers),
            *plane,
        ]

    # Using it.

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        argv = [str(self.programs["kubectl"]), f"--kubeconfig={self.kubeconfig}", *args]
        return _run(argv, input=input, check=check)

    def apply(self, *documents: dict[str, Any]) -> None:
        """``kubectl apply`` of the objects, as a user applies manifests."""
        self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(d) for d in documents))

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def wait_nodes_ready(self, timeout: float = _READY_TIMEOUT_S) -> None:
        def ready() -> bool:
            for node in self.nodes:
                if node.kubelet is not None:
                    node.kubelet.check_alive()
            items = self.get("nodes")["items"]
            ready = {
                item["metadata"]["name"]
                for item in items
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in item.get("status", {}).get("conditions", [])
                )
            }
            return ready >= {n.name for n in self.nodes}

        _wait_for("every node Ready", ready, timeout)

    # Setting up.

    @staticmethod
    def _apiserver_args(kubelet_client_cert: Path, kubelet_client_key: Path) -> list[str]:
        return [
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            # The `kubernetes` Service's endpoint is the apiserver's real address, as in kubeadm.
            "--endpoint-reconciler-type=lease",
            "--allow-privileged=true",
            # Node names resolve nowhere; kubectl exec and logs go to the node's address.
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={kubelet_client_cert}",
            f"--kubelet-client-key={kubelet_client_key}",
            "--enable-priority-and-fairness=true",
        ]

    def _service_range_args(self) -> list[str]:
        if not self.dual_stack:
            return []
        return [f"--service-cluster-ip-range={','.join(self.service_cidrs)}"]

    def _node_cidr_args(self) -> list[str]:
        """kube-controller-manager's node IPAM: a /24 per node, and a /64 too if dual-stack
        (where the single-stack ``--node-cidr-mask-size`` is refused)."""
        if not self.dual_stack:
            return [f"--cluster-cidr={CLUSTER_CIDR}", "--node-cidr-mask-size=24"]
        return [
            f"--cluster-cidr={','.join(self.cluster_cidrs)}",
            "--node-cidr-mask-size-ipv4=24",
            "--node-cidr-mask-size-ipv6=64",
        ]

    def _create_bridge(self) -> None:
        # A previous run killed hard may have left nodes behind.
        for layout in self.layouts:
            remove_node(layout)
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{HOST_IP}/{BRIDGE_NETWORK.prefixlen}", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        # Nodes route what is not theirs here; the machine must not forward it anywhere.
        _run(["sysctl", "-qw", f"net.ipv4.conf.{BRIDGE}.forwarding=0"])
        if self.dual_stack:
            prefix = BRIDGE_NETWORK6.prefixlen
            _run(["ip", "-6", "addr", "add", f"{HOST_IP6}/{prefix}", "dev", BRIDGE, "nodad"])

    def _write_cert(self, stem: str, common_name: str, organization: str) -> tuple[Path, Path]:
        cert = issue_client_cert(
            self.pki,
            common_name=common_name,
            organization=organization,
        )
        directory = self.workdir / "control-plane"
        crt, key = directory / f"{stem}.crt", directory / f"{stem}.key"
        crt.write_bytes(cert.cert_pem)
        key.write_bytes(cert.key_pem)
        key.chmod(0o600)
        return crt, key

    def _user_kubeconfig(self, stem: str, common_name: str, organization: str) -> Path:
        assert self.plane is not None
        crt, key = self._write_cert(stem, common_name, organization)
        path = write_kubeconfig(
            self.workdir / "control-plane" / f"{stem}.kubeconfig",
            server=self.plane.server,
            ca=self.pki.ca_cert,
            user={"client-certificate": str(crt), "client-key": str(key)},
        )
        path.chmod(0o600)
        return path

    def _node_kubeconfig(self, node: RealNode) -> Path:
        return self._user_kubeconfig(node.name, f"system:node:{node.name}", "system:nodes")

    def _start_controllers(self) -> None:
        pki = self.pki
        kcm = self._user_kubeconfig("controller-manager", "system:kube-controller-manager", "")
        scheduler = self._user_kubeconfig("scheduler", "system:kube-scheduler", "")
        logs = self.workdir / "control-plane"
        self._controllers.append(
            Daemon(
                "kube-controller-manager",
                [
                    str(self.programs["kube-controller-manager"]),
                    f"--kubeconfig={kcm}",
                    f"--authentication-kubeconfig={kcm}",
                    f"--authorization-kubeconfig={kcm}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    "--leader-elect=false",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={pki.service_account_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    f"--cluster-signing-cert-file={pki.ca_cert}",
                    f"--cluster-signing-key-file={pki.ca_key}",
                    "--allocate-node-cidrs=true",
                    *self._node_cidr_args(),
                    f"--service-cluster-ip-range={','.join(self.service_cidrs)}",
                    "--controllers=*,bootstrapsigner,tokencleaner",
                    "--v=1",
                ],
                logs / "kube-controller-manager.log",
                detach=self._detach,
            )
        )
        self._controllers.append(
            Daemon(
                "kube-scheduler",
                [
                    str(self.programs["kube-scheduler"]),
                    f"--kubeconfig={scheduler}",
                    f"--authentication-kubeconfig={scheduler}",
                    f"--authorization-kubeconfig={scheduler}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    "--leader-elect=false",
                    "--v=1",
                ],
                logs / "kube-scheduler.log",
                detach=self._detach,
            )
        )

    def _connect_pod_networks(self) -> None:
        """Once kube-controller-manager gave each Node its podCIDRs (one per family): each node's
        CNI configuration, and routes to every pod CIDR from the other nodes and from the
        machine."""
        cidrs: dict[str, list[str]] = {}
        families = len(self.cluster_cidrs)

        def allocated() -> bool:
            for controller in self._controllers:
                controller.check_alive()
            for item in self.get("nodes")["items"]:
                given = item["spec"].get("podCIDRs") or []
                if len(given) == families:
                    cidrs[item["metadata"]["name"]] = given
            return set(cidrs) >= {n.name for n in self.nodes}

        _wait_for("a podCIDR of each family for every node", allocated)
        for node in self.nodes:
            node.write_cni_config(cidrs[node.name])
            for cidr in cidrs[node.name]:
                for other in self.nodes:
                    if other is not node:
                        other.exec("ip", "route", "replace", cidr, "via", node.address_of(cidr))
                _run(["ip", "route", "replace", cidr, "via", node.address_of(cidr)])


# --- the command


def _state_dir(arg: Path | None) -> Path:
    return arg or Path("/var/tmp/kpng-nodes")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rig.nodes",
        description="start and stop a real cluster: control plane, controllers, kubelets",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "build", help="build (or find) the programs and images real nodes need, if they can run"
    )
    up = sub.add_parser("up", help="start in the background; prints `export KUBECONFIG=...`")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument(
        "--dual-stack",
        action="store_true",
        help="IPv6 beside IPv4 on the bridge, nodes, pods and services (IPv4 primary)",
    )
    sub.add_parser("env", help="print `export KUBECONFIG=...` of the running cluster")
    sub.add_parser("down", help="stop everything `up` started and remove it")
    parser.add_argument("--dir", type=Path, help="state directory (default /var/tmp/kpng-nodes)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    directory = _state_dir(args.dir)
    state_file = directory / "state.json"
    try:
        if args.command == "build":
            missing = missing_requirements()
            if missing:
                print(f"real nodes cannot run here ({missing}): nothing to build")
                return 0
            from rig import images

            started = time.monotonic()
            ensure_programs(NODE_PROGRAMS)
            # kube-proxy's too: the migration test runs it, and the leftovers test, which skips
            # unless it is built before the tests are collected, reads what it leaves behind.
            for image in images.node_images(with_kube_proxy=True):
                print(f"{image.reference}: {image.path}")
            print(f"ready in {time.monotonic() - started:.1f} s")
        elif args.command == "up":
            if state_file.exists():
                print(f"already up (state in {directory}); `down` first", file=sys.stderr)
                return 1
            from rig import images

            directory.mkdir(parents=True, exist_ok=True)
            cluster = RealCluster(
                nodes=args.nodes,
                images=images.node_images(),
                pause_image=images.pause_reference(),
                workdir=directory,
                detach=True,
                dual_stack=args.dual_stack,
            )
            cluster.start()
            state = {"pids": cluster.pids(), "nodes": args.nodes, "server": cluster.server}
            state_file.write_text(json.dumps(state) + "\n")
            stack = " (dual-stack)" if args.dual_stack else ""
            print(f"{args.nodes} nodes Ready{stack}; API server {cluster.server}")
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.command == "env":
            if not state_file.exists():
                print(f"not up (no state in {directory})", file=sys.stderr)
                return 1
            print(f"export KUBECONFIG={directory / 'control-plane' / 'kubeconfig'}")
        else:
            if not directory.is_dir():
                print(f"not up (nothing in {directory})", file=sys.stderr)
                return 1
            down(directory)
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def down(directory: Path) -> None:
    """Stops and removes a cluster started with ``up``, or what a killed process left in its
    working directory."""
    state_file = directory / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"pids": []}
    for node_dir in sorted(directory.glob("node-*")):
        index = int(node_dir.name.removeprefix("node-"))
        remove_node(NodeLayout(node_dir.name, index, node_dir))
    for pid in state["pids"]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
