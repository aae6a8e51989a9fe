"""to-ebpf in the kernel: what the conformance suite does not look at. Connections a program
translated leave no conntrack entry to the service address, connected UDP sockets included,
which kpng destroys once their endpoint is gone (or, without the kernel's or kpng's means for
that, leaves to conntrack as before); removing the pins detaches the
programs, and `kpng cleanup ebpf` leaves no program, map or pin; a restart fails no connection;
the capabilities of deploy/kpng-ebpf.yaml are enough, and each is needed; a program the verifier
refuses is reported with the verifier's log; syncs reach kube-proxy's metrics as full or
partial; the programs' counters and the maps' occupancy reach kpng's /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._node import FromNode, Options
from kpng.backends.ebpf import EbpfBackend, SocketBalancer, remove_pins, toolchain
from kpng.backends.ebpf.entries import LAYOUT_VERSION
from kpng.backends.ebpf.libbpf import BpfError, BpfObject
from kpng.backends.ebpf.toolchain import compile_object, compiler_unavailable, unavailable
from kpng.client import NodeState
from kpng.feeding import Fanout, Feeder, SyncStats
from kpng.model.messages import ServiceEndpoints
from kpng.status import Status
from kpng.testing import states
from kpng.testing.conformance import (
    SETTLE_S,
    Cluster,
    endpoint_slice,
    node_object,
    port,
    service,
)
from kpng.testing.netns import CLUSTER_CIDRS, ClusterSpec, TestBed, available
from kpng.testing.states import keyed_state
from kpng.testing.waiting import poll
from tests.conftest import ROOT
from tests.pure.test_metrics import IPV4, Samples, _scrape

pytestmark = pytest.mark.skipif(
    available() is not None or unavailable() is not None,
    reason=str(available() or unavailable()),
)

IP = "10.96.0.10"


CIDRS = ",".join(CLUSTER_CIDRS)
BACKEND = f"to-ebpf --cluster-cidr {CIDRS} --cgroup {{cgroup}} --pin-dir {{pin_dir}}"


@pytest.fixture
def bed_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A node with two pods and a service to the second, no kpng started yet."""
    (tmp_path / "manifests").mkdir()
    with TestBed(ClusterSpec.parse({"node-1": ["a1", "a2"]}), sockets=True) as bed:
        c = Cluster(bed, tmp_path / "manifests", tmp_path, BACKEND)
        c.write("nodes", *(node_object(n) for n in bed.nodes.values()))
        c.write("web", service("web", IP, [port("http", 80)]), endpoint_slice(c, "web", ["a2"]))
        yield c


@pytest.fixture
def cluster(bed_cluster: Cluster) -> Cluster:
    bed_cluster.start_backend("node-1")
    bed_cluster.eventually("a1", "tcp", IP, 80, lambda r: r == ["a2 10.244.1.2"])
    return bed_cluster


def _forget_flows(cluster: Cluster) -> None:
    """Drop the node's conntrack entries: the fixture's first probes may have gone out before
    the first sync (unreplied, they stay two minutes)."""
    cluster.bed.exec(cluster.bed.nodes["node-1"].netns, ["conntrack", "-F"], check=False)


def _conntrack(bed: TestBed, netns: str, dst: str) -> int:
    out = bed.exec(netns, ["conntrack", "-L", "-d", dst], check=False)
    return sum(1 for line in out.splitlines() if line.startswith(("tcp", "udp")))


def test_translated_connections_leave_no_conntrack_entry_to_the_service(cluster: Cluster) -> None:
    node = cluster.bed.nodes["node-1"]
    _forget_flows(cluster)
    assert cluster.probe("a1", "tcp", IP, 80, count=20) == ["a2 10.244.1.2"] * 20
    assert _conntrack(cluster.bed, node.netns, IP) == 0
    # The same connections through the nftables part (a process outside the cgroup) do.
    assert subprocess.run(
        ["ip", "netns", "exec", cluster.bed.pods["a1"].netns, sys.executable, "-m",
         "kpng.testing.probe", "tcp", IP, "80"],
        capture_output=True, check=True,
    ).returncode == 0  # fmt: skip
    assert _conntrack(cluster.bed, node.netns, IP) == 1


def test_namespaces_detection_does_not_count_as_local_are_left_to_the_nftables_part(
    bed_cluster: Cluster,
) -> None:
    """With the pods' veths named vp*, detection by the prefix xx counts no pod local: a1's
    connections go through the nftables part (a conntrack entry), which masquerades them, as
    the conformance suite checks; by the prefix vp, they are translated at connect. A pod's
    namespace made after kpng started is translated from kpng's next look at the cgroup on."""
    bed, node = bed_cluster.bed, bed_cluster.bed.nodes["node-1"]
    assert node.cgroup is not None
    bed_cluster.start_backend("node-1", "--detect-local-mode", "InterfaceNamePrefix",
                              "--pod-interface-name-prefix", "xx")  # fmt: skip
    a1 = bed.pods["a1"].ip4
    # Masqueraded: to a2's veth, the node's address there.
    masqueraded = ["a2 10.244.1.1"]
    bed_cluster.eventually("a1", "tcp", IP, 80, lambda r: r == masqueraded)
    _forget_flows(bed_cluster)
    assert bed_cluster.probe("a1", "tcp", IP, 80) == masqueraded
    assert _conntrack(bed, node.netns, IP) == 1

    bed_cluster.start_backend("node-1", "--detect-local-mode", "InterfaceNamePrefix",
                              "--pod-interface-name-prefix", "vp")  # fmt: skip
    bed_cluster.eventually("a1", "tcp", IP, 80, lambda r: r == [f"a2 {a1}"])
    _forget_flows(bed_cluster)
    assert bed_cluster.probe("a1", "tcp", IP, 80) == [f"a2 {a1}"]
    assert _conntrack(bed, node.netns, IP) == 0
    late, address, gateway = f"{bed.prefix}late", "10.244.1.9", "10.244.1.1"
    for argv in (
        ["ip", "netns", "add", late],
        ["ip", "-n", node.netns, "link", "add", "vp9", "type", "veth", "peer", "eth0", "netns",
         late],
        ["ip", "-n", node.netns, "addr", "add", f"{gateway}/32", "dev", "vp9"],
        ["ip", "-n", node.netns, "link", "set", "vp9", "up"],
        ["ip", "-n", node.netns, "route", "add", f"{address}/32", "dev", "vp9"],
        ["ip", "-n", late, "addr", "add", f"{address}/32", "dev", "eth0"],
        ["ip", "-n", late, "link", "set", "eth0", "up"],
        ["ip", "-n", late, "route", "add", gateway, "dev", "eth0"],
        ["ip", "-n", late, "route", "add", "default", "via", gateway, "dev", "eth0"],
    ):  # fmt: skip
        subprocess.run(argv, check=True)
    in_cgroup = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(node.cgroup / "cgroup.procs")]
    holder = subprocess.Popen([*in_cgroup, "ip", "netns", "exec", late, "sleep", "30"])
    probe = [sys.executable, "-m", "kpng.testing.probe", "tcp", IP, "80"]
    try:

        def translated() -> bool:
            _forget_flows(bed_cluster)
            out = subprocess.run([*in_cgroup, "ip", "netns", "exec", late, *probe],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            return f"a2 {address}" in out and _conntrack(bed, node.netns, IP) == 0

        assert poll(translated, within=SETTLE_S, interval=0.5)
    finally:
        holder.kill()
        holder.wait()
        subprocess.run(["ip", "netns", "del", late], check=False)


def test_removing_the_pins_detaches_the_programs(cluster: Cluster) -> None:
    node = cluster.bed.nodes["node-1"]
    assert node.cgroup is not None
    assert node.pin_dir is not None

    def attached() -> str:
        show = ["bpftool", "cgroup", "show", str(node.cgroup)]
        return subprocess.run(show, capture_output=True, text=True, check=True).stdout

    assert "kpng_connect4" in attached()
    _forget_flows(cluster)
    cluster._backends.pop("node-1").terminate()
    assert remove_pins(node.pin_dir)
    assert not node.pin_dir.exists()
    assert "kpng_" not in attached()
    # The nftables part still DNATs, so the service answers, now with a conntrack entry.
    assert cluster.probe("a1", "tcp", IP, 80) == ["a2 10.244.1.2"]
    assert _conntrack(cluster.bed, node.netns, IP) == 1


@pytest.mark.skipif(compiler_unavailable() is not None, reason=str(compiler_unavailable()))
def test_a_program_the_verifier_refuses_is_reported_with_its_log(tmp_path: Path) -> None:
    source = tmp_path / "bad.bpf.c"
    source.write_text(
        "#include <linux/bpf.h>\n#include <bpf/bpf_helpers.h>\n"
        'SEC("cgroup/connect4") int bad(struct bpf_sock_addr *ctx) {\n'
        "  int *p = (int *)(long)ctx->user_ip4; return *p; }\n"
        'char LICENSE[] SEC("license") = "GPL";\n'
    )
    obj = compile_object(tmp_path / "bad.o", source)
    with pytest.raises(BpfError, match="verifier's log") as refused:
        BpfObject(obj, tmp_path)
    assert "R1 invalid mem access 'scalar'" in str(refused.value)


def test_to_ebpf_reports_its_syncs_as_full_or_partial_in_kube_proxy_metrics() -> None:
    """Wired as the CLI wires it: the first state is a full sync, a change a partial one, and
    both reach kube-proxy's sync metrics and kpng's applied revision."""
    web = ("ns", "web")

    def state(revision: int, *eps: str) -> NodeState:
        se = ServiceEndpoints(states.service(cluster_ip=IP), tuple(states.endpoint(e) for e in eps))
        return keyed_state(revision, {web: se})

    with TestBed(ClusterSpec.parse({"node-1": ["a1"]}), sockets=True) as bed:
        node = bed.nodes["node-1"]
        syncs = SyncStats()
        backend = EbpfBackend(
            sockets=SocketBalancer(
                options=Options(), from_node=FromNode(), cgroup=node.cgroup,
                pin_dir=node.pin_dir or Path(), bpf_object=None,
            ),
            packets=NftBackend(
                nft=KernelNft(("ip", "netns", "exec", node.netns, "nft")), options=Options()
            ),
            syncs=syncs,
        )  # fmt: skip
        status = Status(timeout=60.0)
        fanout = status.track(Fanout([Feeder("to-ebpf", backend, sync=syncs, reports_syncs=True)]))

        async def scenario() -> None:
            await fanout.apply(state(1, "10.244.1.2"))
            await fanout.apply(state(2, "10.244.1.2", "10.244.1.3"))
            await backend.close()

        asyncio.run(scenario())
        got = _scrape(status)
    assert got[("kubeproxy_sync_full_proxy_rules_duration_seconds_count", IPV4)] == 1
    assert got[("kubeproxy_sync_partial_proxy_rules_duration_seconds_count", IPV4)] == 1
    assert got[("kpng_backend_applied_revision", (("backend", "to-ebpf"),))] == 2


EMPTY_IP = "10.96.0.11"
DNS_IP = "10.96.0.12"
METRICS = "127.0.0.1:10249"
_GET = "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1]).read().decode())"
_UDP = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
for _ in range(int(sys.argv[3])):
    s.sendto(b"hello\\n", (sys.argv[1], int(sys.argv[2])))
    data, peer = s.recvfrom(4096)
    print(peer[0], peer[1], data.decode().strip())
"""
"""Unconnected UDP: each datagram is translated at sendmsg4, each answer's source back at
recvmsg4 (recvfrom asks for it)."""


@pytest.fixture
def metered(tmp_path: Path) -> Iterator[Cluster]:
    with metered_cluster(tmp_path) as cluster:
        yield cluster


@contextlib.contextmanager
def metered_cluster(
    tmp_path: Path, *flags: str, pods: tuple[str, ...] = ("a1", "a2"), local: bool = False
) -> Iterator[Cluster]:
    """kpng (to-ebpf with ``flags``) on node-1 (with ``pods``, a1 and a2 among them) serving
    /metrics in the node's namespace; web (TCP, on a2), dns (UDP, on a2) and empty (no
    endpoint). With ``local``, to-ebpf runs in a ``kpng local`` agent fed by a brain on a unix
    socket in the node's namespace."""
    cidrs = ",".join(CLUSTER_CIDRS)
    backend = " ".join(
        ("to-ebpf", f"--cluster-cidr {cidrs} --cgroup {{cgroup}} --pin-dir {{pin_dir}}", *flags)
    )
    (tmp_path / "manifests").mkdir()
    # A unix socket's path is at most 107 bytes: pytest's temporary paths can be longer.
    with (
        tempfile.TemporaryDirectory(prefix="kpng-ebpf-") as sockets,
        TestBed(ClusterSpec.parse({"node-1": list(pods)}), sockets=True) as bed,
    ):
        flags = ("--metrics-bind-address", METRICS)
        c = Cluster(bed, tmp_path / "manifests", tmp_path, backend, flags=flags)
        c.write("nodes", *(node_object(n) for n in bed.nodes.values()))
        c.write("web", service("web", IP, [port("http", 80)]), endpoint_slice(c, "web", ["a2"]))
        dns = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
        c.write(
            "dns",
            service("dns", DNS_IP, [port("dns", 53, 5353, "UDP")]),
            endpoint_slice(c, "dns", ["a2"], ports=dns),
        )
        c.write("empty", service("empty", EMPTY_IP, [port("http", 80)]))
        api = None
        if local:
            api = f"unix://{sockets}/kpng.sock"
            c.start_brain("node-1", api)
        c.start_backend("node-1", api=api)
        c.eventually("a1", "tcp", IP, 80, lambda r: r == ["a2 10.244.1.2"])
        yield c


def scraped(cluster: Cluster) -> Samples:
    """A scrape of the running kpng's /metrics, from inside the node's namespace."""
    netns = cluster.bed.nodes["node-1"].netns
    text = cluster.bed.exec(netns, [sys.executable, "-c", _GET, f"http://{METRICS}/metrics"])
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _hook(name: str, hook: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return (f"kpng_ebpf_{name}_total", (("hook", hook),))


def test_translations_and_services_without_endpoints_are_counted_per_hook(
    metered: Cluster,
) -> None:
    """N connections through a ClusterIP are N translations at connect4; N datagrams to a UDP
    ClusterIP, N at sendmsg4 and their N answers N at recvmsg4; N connections to a service
    without endpoints, N at no_endpoint (and no translation). The counters are the kernel's,
    summed over CPUs, scraped from the running kpng."""
    before = scraped(metered)
    n = 7
    assert metered.probe("a1", "tcp", IP, 80, count=n) == ["a2 10.244.1.2"] * n
    a1 = metered.bed.pods["a1"].netns
    udp = metered.bed.exec(a1, [sys.executable, "-c", _UDP, DNS_IP, "53", str(n)])
    assert udp.splitlines() == [f"{DNS_IP} 53 a2 10.244.1.2"] * n
    assert metered.probe("a1", "tcp", EMPTY_IP, 80, count=n) == ["refused"] * n
    after = scraped(metered)

    def grew(name: str, hook: str) -> float:
        return after[_hook(name, hook)] - before[_hook(name, hook)]

    assert grew("translations", "connect4") == n
    assert grew("translations", "sendmsg4") == n
    assert grew("translations", "recvmsg4") == n
    assert grew("no_endpoint", "connect4") == n
    assert grew("no_endpoint", "sendmsg4") == 0
    assert grew("translations", "connect6") == 0
    # What kpng wrote, against the maps' capacity: web's, dns's and empty's frontends.
    assert after[("kpng_ebpf_map_entries", (("map", "kpng_frontends"),))] == 3
    assert after[("kpng_ebpf_map_capacity", (("map", "kpng_frontends"),))] == 262144
    assert after[("kpng_ebpf_map_entries", (("map", "kpng_slots"),))] == 3
    # The node's, a1's and a2's network namespaces, all local by --cluster-cidr.
    assert after[("kpng_ebpf_network_namespaces", (("local", "true"),))] == 3
    assert after[("kpng_ebpf_network_namespaces", (("local", "false"),))] == 0
    # Connected UDP sockets are left to the nftables part (--connected-udp packets): none is
    # destroyed, and the count is not reported.
    assert ("kpng_ebpf_udp_sockets_destroyed_total", ()) not in after


def test_the_counters_outlive_a_restart_of_kpng(metered: Cluster) -> None:
    """They are pinned with the maps: a restarted kpng reports what the programs counted
    before, as the kernel's own counters (kube-proxy's rules' counters) outlive kube-proxy."""
    # The fixture's first probe may have gone out before the programs were attached.
    assert metered.probe("a1", "tcp", IP, 80, count=3) == ["a2 10.244.1.2"] * 3
    before = scraped(metered)[_hook("translations", "connect4")]
    assert before >= 3
    metered.start_backend("node-1")
    got: Samples = {}

    def reported() -> bool:
        nonlocal got
        try:
            got = scraped(metered)
        except Exception:  # not listening yet
            return False
        return _hook("translations", "connect4") in got

    assert poll(reported, within=15, interval=0.2)
    assert got[_hook("translations", "connect4")] >= before


def _bpftool(*argv: str) -> Any:
    done = subprocess.run(["bpftool", "-j", *argv], capture_output=True, text=True, check=False)
    return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None


def _attached(cgroup: Path) -> dict[int, str]:
    """The programs attached to ``cgroup``: id -> name."""
    found = _bpftool("cgroup", "show", str(cgroup))
    return {p["id"]: p["name"] for p in found or []}


def _attach_log_lines(cluster: Cluster) -> int:
    return (cluster.logs / "node-1.log").read_text().count("to-ebpf: programs attached")


def test_a_restart_takes_the_pins_over_and_fails_no_connection(cluster: Cluster) -> None:
    """Connections in a loop through the ClusterIP while kpng stops and a new kpng starts: the
    pinned programs keep balancing in the gap, and the new process writes the pinned maps and
    switches the links to its programs without a window where a connect goes unbalanced."""
    node = cluster.bed.nodes["node-1"]
    assert node.cgroup is not None
    before = _attached(node.cgroup)
    assert sorted(before.values())[0] == "kpng_connect4"
    argv = [sys.executable, "-m", "kpng.testing.probe", "tcp", IP, "80", "--for", "10",
            "--timeout", "2"]  # fmt: skip
    loop = subprocess.Popen(
        cluster.bed.command_in(cluster.bed.pods["a1"].netns, argv),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(1.5)
    cluster.start_backend("node-1")  # terminates the old process, starts a new one
    deadline = time.monotonic() + 8
    while _attach_log_lines(cluster) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    out, _ = loop.communicate(timeout=30)
    assert _attach_log_lines(cluster) == 2, "the new process did not take over during the loop"
    results = json.loads(out)["results"]
    failed = [r for r in results if r != "a2 10.244.1.2"]
    assert len(results) > 50
    assert failed == [], f"{len(failed)} of {len(results)} connects failed: {failed[:5]}"
    # The same eight hooks, now running the new process's programs.
    after = _attached(node.cgroup)
    assert sorted(after.values()) == sorted(before.values())
    assert not set(after) & set(before)


def _capabilities(container: dict[str, object]) -> list[str]:
    context = container["securityContext"]
    assert isinstance(context, dict)
    assert context["capabilities"]["drop"] == ["ALL"]
    return [c.lower() for c in context["capabilities"]["add"]]


def _deployed_capabilities() -> list[str]:
    documents = yaml.safe_load_all((ROOT / "deploy" / "kpng-ebpf.yaml").read_text())
    (daemonset,) = [d for d in documents if d and d["kind"] == "DaemonSet"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "privileged" not in container["securityContext"]
    return _capabilities(container)


_CAP_NUMBERS = {"net_admin": 12, "sys_ptrace": 19, "sys_admin": 21, "sys_resource": 24, "bpf": 39}
"""<linux/capability.h>'s numbers of the capabilities the manifest names."""


def _with_only(capabilities: list[str]) -> list[str]:
    """setpriv, as root, keeping only ``capabilities`` (a container's ``add`` after ``drop:
    [ALL]``). One this test runs without itself cannot be given (a container running the suite
    may lack SYS_RESOURCE): left out, which only kernels before 5.11 would notice."""
    bounding = int(
        next(
            line.split()[1]
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("CapBnd:")
        ),
        16,
    )
    have = [c for c in capabilities if bounding >> _CAP_NUMBERS[c] & 1]
    if set(capabilities) - set(have) - {"sys_resource"}:
        pytest.skip(f"this test runs without {sorted(set(capabilities) - set(have))}")
    caps = ",".join(["-all", *(f"+{c}" for c in have)])
    return ["setpriv", "--reuid=0", f"--inh-caps={caps}", f"--ambient-caps={caps}",
            f"--bounding-set={caps}"]  # fmt: skip


def test_the_deployed_capabilities_are_enough(udp_cluster: Cluster) -> None:
    """For the programs, and for the socket destroy in the pods' network namespaces."""
    caps = _deployed_capabilities()
    assert caps == ["bpf", "net_admin", "sys_admin", "sys_ptrace", "sys_resource"]
    udp_cluster.start_backend("node-1", "--connected-udp", "destroy", prefix=_with_only(caps))
    _connected_udp_is_destroyed_with_its_endpoint(udp_cluster)
    node = udp_cluster.bed.nodes["node-1"]
    assert node.cgroup is not None
    assert len(_attached(node.cgroup)) == 8
    assert "not checked in" not in (udp_cluster.logs / "node-1.log").read_text()


_BASE_CAPABILITIES = ["bpf", "net_admin", "sys_resource"]
"""The deployed capabilities without those of the socket destroy: what to-ebpf runs with at
all (SYS_ADMIN would stand for BPF and NET_ADMIN in bpf() calls)."""


@pytest.mark.parametrize(
    ("dropped", "refusal"),
    [
        # No map, no BTF, no program without CAP_BPF.
        ("bpf", "Operation not permitted"),
        # A cgroup sock_addr program is of a networking type: CAP_NET_ADMIN to load it.
        ("net_admin", "Operation not permitted"),
    ],
)
def test_each_deployed_capability_but_sys_resource_is_needed(
    bed_cluster: Cluster, dropped: str, refusal: str
) -> None:
    """SYS_RESOURCE is for kernels before 5.11 only (RLIMIT_MEMLOCK), so not needed here."""
    assert set(_BASE_CAPABILITIES) < set(_deployed_capabilities())
    caps = [c for c in _BASE_CAPABILITIES if c != dropped]
    bed_cluster.start_backend("node-1", prefix=_with_only(caps))
    log = bed_cluster.logs / "node-1.log"
    deadline = time.monotonic() + 20
    while "cannot load BPF object" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    text = log.read_text()
    assert "cannot load BPF object" in text
    assert refusal in text
    node = bed_cluster.bed.nodes["node-1"]
    assert node.cgroup is not None
    assert _attached(node.cgroup) == {}


_ENTER = """
import os, sys
from kpng.backends.ebpf.system import enter_netns
try:
    fd = os.open(f"/proc/{sys.argv[1]}/ns/net", os.O_RDONLY)
    enter_netns(fd)
except OSError as exc:
    print(exc.errno)
else:
    print("entered")
"""


@pytest.mark.parametrize(
    ("dropped", "refusal"),
    [
        (None, "entered"),
        # A process whose capabilities kpng's do not include: ptrace's read access to open
        # its namespace.
        ("sys_ptrace", str(errno.EACCES)),
        # setns into another network namespace.
        ("sys_admin", str(errno.EPERM)),
    ],
)
def test_the_destroy_needs_sys_admin_and_sys_ptrace_to_enter_a_pods_namespace(
    bed_cluster: Cluster, dropped: str | None, refusal: str
) -> None:
    """What kpng does in each pod's network namespace, with the deployed capabilities but
    ``dropped``, against a process of a pod running as root with every capability."""
    bed = bed_cluster.bed
    pod_process = bed.spawn(bed.pods["a2"].netns, ["sleep", "60"])
    caps = [c for c in _deployed_capabilities() if c != dropped]
    entered = subprocess.run(
        [*_with_only(caps), sys.executable, "-c", _ENTER, str(pod_process.pid)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert entered.stdout.strip() == refusal


def test_kpng_cleanup_ebpf_removes_every_program_map_and_pin(bed_cluster: Cluster) -> None:
    """With the default pin dir, /sys/fs/bpf/kpng, on a bpffs of a mount namespace of the
    test's own: to-ebpf --once leaves its programs attached, and `kpng cleanup ebpf` leaves no
    program, map, pin or nftables table behind."""
    bed = bed_cluster.bed
    node = bed.nodes["node-1"]
    assert node.cgroup is not None
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sleep", "120"],
        stdin=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)
        base = ["nsenter", "-t", str(holder.pid), "-m", f"--net=/run/netns/{node.netns}"]

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            return subprocess.run(
                [*base, *argv], capture_output=True, text=True, check=False, env=env, timeout=60
            )

        assert run("mount", "-t", "bpf", "bpf", "/sys/fs/bpf").returncode == 0
        once = run(
            sys.executable, "-m", "kpng", "file", "--input", str(bed_cluster.manifests),
            "to-local", "--node-name", "node-1", "to-ebpf", "--cluster-cidr", CIDRS,
            "--cgroup", str(node.cgroup), "--once",
        )  # fmt: skip
        assert once.returncode == 0, once.stderr
        programs = _attached(node.cgroup)
        assert len(programs) == 8
        maps = set()
        for prog in programs:
            shown = _bpftool("prog", "show", "id", str(prog))
            assert isinstance(shown, dict)
            maps |= set(shown["map_ids"])
        assert len(maps) >= 7
        pins = run("ls", "/sys/fs/bpf/kpng").stdout.split()
        assert pins == ["links", f"maps-v{LAYOUT_VERSION}"]
        # Still balancing with kpng gone: the pins hold the programs.
        assert bed_cluster.probe("a1", "tcp", IP, 80) == ["a2 10.244.1.2"]

        done = run(sys.executable, "-m", "kpng", "cleanup", "ebpf")
        assert done.returncode == 0, done.stderr
        assert "to-ebpf: removed" in done.stdout + done.stderr
        assert run("test", "-e", "/sys/fs/bpf/kpng").returncode != 0
        assert run("nft", "list", "table", "inet", "kpng").returncode != 0
        assert _attached(node.cgroup) == {}
        # The kernel frees programs and maps once their last reference goes (after an RCU
        # grace period): none of them is left.
        deadline = time.monotonic() + 10
        left: list[str] = []
        while time.monotonic() < deadline:
            left = [f"prog {p}" for p in programs if _bpftool("prog", "show", "id", str(p))]
            left += [f"map {m}" for m in maps if _bpftool("map", "show", "id", str(m))]
            if not left:
                break
            time.sleep(0.2)
        assert left == []
    finally:
        holder.kill()
        holder.wait()


# --- connected UDP sockets: translated at connect and destroyed once their endpoint is gone, or
# left to the nftables part where kpng cannot destroy them.

UDP_IP = "10.96.0.20"
_DNS_PORT = [{"name": "dns", "port": 5353, "protocol": "UDP"}]
_HELD_UDP = """
import socket, sys

def connected():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    s.connect((sys.argv[1], int(sys.argv[2])))
    return s

def ask(s):
    try:
        s.send(b"hello\\n")
        return s.recv(4096).decode().strip()
    except OSError as exc:
        return f"error: {exc.errno}"

s = connected()
print(ask(s), s.getpeername()[0], flush=True)
sys.stdin.readline()  # the test moves the service to another endpoint meanwhile
answer = ask(s)
print(answer, flush=True)
if answer.startswith("error"):
    s.close()
    s = connected()  # as glibc's resolver does: a new socket, connected anew
print(ask(s), flush=True)
"""
"""One connected UDP socket held across a change of the service's endpoint: its first answer
and the peer getpeername gives, the answer of the same socket after the change, and the answer
after a reconnect if that one failed."""


@pytest.fixture
def udp_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A node with three pods, a UDP service on a2, no kpng started yet."""
    (tmp_path / "manifests").mkdir()
    with TestBed(ClusterSpec.parse({"node-1": ["a1", "a2", "a3"]}), sockets=True) as bed:
        c = Cluster(bed, tmp_path / "manifests", tmp_path, BACKEND)
        c.write("nodes", *(node_object(n) for n in bed.nodes.values()))
        _serve_udp(c, "a2")
        yield c


def _serve_udp(cluster: Cluster, pod: str) -> None:
    cluster.write(
        "dns",
        service("dns", UDP_IP, [port("dns", 53, 5353, "UDP")]),
        endpoint_slice(cluster, "dns", [pod], ports=_DNS_PORT),
    )


def _hold_and_move(cluster: Cluster, settled: Callable[[], bool]) -> tuple[list[str], int, int]:
    """A connected socket held while the service moves from a2 to a3, asking again once
    ``settled``: the held socket's lines, and the node's conntrack entries of UDP to the
    ClusterIP and to a2 while it stood."""
    bed = cluster.bed
    node = bed.nodes["node-1"].netns
    cluster.eventually("a1", "udp", UDP_IP, 53, lambda r: r == ["a2 10.244.1.2"])
    _forget_flows(cluster)
    argv = [sys.executable, "-c", _HELD_UDP, UDP_IP, "53"]
    held = subprocess.Popen(
        bed.command_in(bed.pods["a1"].netns, argv),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert held.stdout is not None
        first = held.stdout.readline().strip()
        to_service = _udp_conntrack(bed, node, UDP_IP)
        to_endpoint = _udp_conntrack(bed, node, bed.pods["a2"].ip4)
        _serve_udp(cluster, "a3")
        cluster.eventually("a1", "udp", UDP_IP, 53, lambda r: r == ["a3 10.244.1.2"])
        assert poll(settled, within=SETTLE_S, interval=0.2)
        out, _ = held.communicate("go\n", timeout=30)
    finally:
        if held.poll() is None:
            held.kill()
            held.wait()
    return [first, *out.splitlines()], to_service, to_endpoint


def _udp_conntrack(bed: TestBed, netns: str, dst: str) -> int:
    out = bed.exec(netns, ["conntrack", "-L", "-p", "udp", "-d", dst], check=False)
    return sum(1 for line in out.splitlines() if line.startswith("udp"))


def _log_has(cluster: Cluster, text: str, within: float = 20) -> bool:
    log = cluster.logs / "node-1.log"
    return poll(lambda: text in log.read_text(), within=within, interval=0.2)


_STEADY_UDP = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.5)
s.connect((sys.argv[1], int(sys.argv[2])))
deadline, reached, failed = time.monotonic() + 40, 0, 0
while reached < 5 and failed < 3 and time.monotonic() < deadline:
    time.sleep(0.05)
    try:
        s.send(b"hello\\n")
    except OSError as exc:
        print("send failed:", exc.errno, flush=True)
        failed += 1
        continue
    try:
        pod = s.recv(4096).decode().split()[0]
    except OSError as exc:
        print("no answer:", exc.errno, flush=True)
        continue
    print(pod, flush=True)
    reached += pod == sys.argv[3]
"""
"""A metrics client's way: one connected UDP socket, never connected again, a datagram every
50 ms, a send's error ignored (printed); each answer's pod printed, until five came from
``argv[3]``, three sends failed, or 40 s passed."""


def test_a_connected_udp_socket_reaches_the_remaining_endpoint_without_a_failed_send(
    udp_cluster: Cluster,
) -> None:
    """By default (--connected-udp packets), as with kube-proxy: a client that keeps sending on
    one connected socket while a2 leaves the service (a3 taking its place) is never refused a
    send, and its datagrams reach a3 on the same socket. The nftables part DNATs the socket (a
    conntrack entry to the ClusterIP) and deletes that entry once a2 is gone. With the socket
    translated at connect and destroyed instead (the old default), the sends fail."""
    udp_cluster.start_backend("node-1")
    assert _log_has(udp_cluster, "(--connected-udp packets)")
    bed = udp_cluster.bed
    udp_cluster.eventually("a1", "udp", UDP_IP, 53, lambda r: r == ["a2 10.244.1.2"])
    _forget_flows(udp_cluster)
    argv = [sys.executable, "-c", _STEADY_UDP, UDP_IP, "53", "a3"]
    client = subprocess.Popen(
        bed.command_in(bed.pods["a1"].netns, argv), stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "a2"
        node = bed.nodes["node-1"].netns
        assert _udp_conntrack(bed, node, UDP_IP) == 1
        _serve_udp(udp_cluster, "a3")
        out, _ = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    lines = out.splitlines()
    assert [line for line in lines if line.startswith("send failed")] == [], lines
    # a2's answers until its entry went, then only a3's: the same socket moved once.
    assert lines[-5:] == ["a3"] * 5, lines
    moved = lines.index("a3")
    assert set(lines[:moved]) <= {"a2"}, lines
    assert set(lines[moved:]) == {"a3"}, lines


def test_a_connected_udp_socket_leaves_no_conntrack_entry_and_is_destroyed_with_its_endpoint(
    udp_cluster: Cluster,
) -> None:
    """Translated at connect (getpeername still says the ClusterIP): the node's conntrack sees
    the pod talk to a2, never to the ClusterIP. Once a2 no longer serves the service, kpng
    destroys the socket in a1's network namespace: its next send fails, and a new socket
    reaches a3 (--connected-udp destroy)."""
    udp_cluster.start_backend("node-1", "--connected-udp", "destroy")
    _connected_udp_is_destroyed_with_its_endpoint(udp_cluster)


def _connected_udp_is_destroyed_with_its_endpoint(cluster: Cluster) -> None:
    assert _log_has(cluster, "connected UDP sockets are translated at connect")
    log = cluster.logs / "node-1.log"

    def destroyed() -> bool:
        return "1 connected UDP sockets of gone endpoints destroyed" in log.read_text()

    lines, to_service, to_endpoint = _hold_and_move(cluster, destroyed)
    assert lines[0] == f"a2 10.244.1.2 {UDP_IP}"
    assert to_service == 0
    assert to_endpoint == 1
    # EDESTADDRREQ: the destroyed socket is no longer connected.
    assert lines[1] == f"error: {errno.EDESTADDRREQ}", lines
    assert lines[2] == "a3 10.244.1.2"


def test_a_socket_connected_to_a_pod_ip_is_never_destroyed(udp_cluster: Cluster) -> None:
    """Only sockets kpng translated are destroyed: one connected to a2's own address keeps
    working after a2 leaves the service."""
    udp_cluster.start_backend("node-1", "--connected-udp", "destroy")
    bed = udp_cluster.bed
    udp_cluster.eventually("a1", "udp", UDP_IP, 53, lambda r: r == ["a2 10.244.1.2"])
    argv = [sys.executable, "-c", _HELD_UDP, bed.pods["a2"].ip4, "5353"]
    held = subprocess.Popen(
        bed.command_in(bed.pods["a1"].netns, argv),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert held.stdout is not None
    assert held.stdout.readline().strip() == "a2 10.244.1.2 10.244.1.3"
    _serve_udp(udp_cluster, "a3")
    udp_cluster.eventually("a1", "udp", UDP_IP, 53, lambda r: r == ["a3 10.244.1.2"])
    out, _ = held.communicate("go\n", timeout=30)
    assert out.splitlines() == ["a2 10.244.1.2", "a2 10.244.1.2"]


def test_without_the_privileges_to_destroy_connected_udp_is_left_to_conntrack(
    udp_cluster: Cluster,
) -> None:
    """kpng without CAP_SYS_ADMIN cannot enter the pods' namespaces: connect leaves connected
    UDP untranslated, as before the destroy existed. The nftables part DNATs it (a conntrack
    entry to the ClusterIP) and moves it when its endpoint goes: the same socket goes on, to a3."""
    caps = [c for c in _deployed_capabilities() if c != "sys_admin"]
    udp_cluster.start_backend("node-1", "--connected-udp", "destroy", prefix=_with_only(caps))
    assert _log_has(udp_cluster, "destroy cannot be had; connected UDP sockets are left")
    assert "lacks CAP_SYS_ADMIN" in (udp_cluster.logs / "node-1.log").read_text()
    bed = udp_cluster.bed
    a2 = f"src={bed.pods['a2'].ip4} "

    def flow_deleted() -> bool:
        node = bed.nodes["node-1"].netns
        return a2 not in bed.exec(node, ["conntrack", "-L", "-p", "udp", "-d", UDP_IP])

    lines, to_service, _ = _hold_and_move(udp_cluster, flow_deleted)
    assert lines[0] == f"a2 10.244.1.2 {UDP_IP}"
    assert to_service == 1
    assert lines[1:] == ["a3 10.244.1.2", "a3 10.244.1.2"]


@pytest.mark.skipif(compiler_unavailable() is not None, reason=str(compiler_unavailable()))
def test_a_kernel_refusing_the_destroy_program_keeps_connected_udp_on_conntrack(
    udp_cluster: Cluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As on a kernel before 6.5: the iterator's kfunc is not there (here, one of another name),
    so the kernel refuses the destroy program; the cgroup programs load and attach all the same,
    and leave connected UDP sockets untranslated."""
    source = tmp_path / "udp_destroy.bpf.c"
    source.write_text(
        toolchain.UDP_DESTROY.source.read_text().replace("bpf_sock_destroy", "kpng_no_such_kfunc")
    )
    header = tmp_path / toolchain.MAPS_HEADER.name
    header.write_bytes(toolchain.MAPS_HEADER.read_bytes())
    made = compile_object(tmp_path / "d.o", source)
    monkeypatch.setattr(toolchain, "UDP_DESTROY", toolchain.Unit(source, made, (header,)))
    node = udp_cluster.bed.nodes["node-1"]
    balancer = SocketBalancer(
        options=Options(), from_node=FromNode(), cgroup=node.cgroup,
        pin_dir=node.pin_dir or Path(), bpf_object=None, connected_udp="destroy",
    )  # fmt: skip
    se = ServiceEndpoints(
        states.service(cluster_ip=UDP_IP, port=53, protocol="UDP", target_port=5353),
        (states.endpoint(udp_cluster.bed.pods["a2"].ip4, 5353, protocol="UDP"),),
    )
    with caplog.at_level(logging.INFO, logger="kpng"):
        asyncio.run(balancer.apply(keyed_state(1, {("ns", "dns"): se})))
    try:
        assert "conntrack: the socket destroy program did not load" in caplog.text
        assert node.cgroup is not None
        assert len(_attached(node.cgroup)) == 8
        a1 = udp_cluster.bed.pods["a1"].netns
        # Unconnected: translated at sendmsg4. Connected: left alone, and no nftables part here.
        unconnected = udp_cluster.bed.exec(a1, [sys.executable, "-c", _UDP, UDP_IP, "53", "1"])
        assert unconnected.splitlines() == [f"{UDP_IP} 53 a2 10.244.1.2"]
        assert udp_cluster.probe("a1", "udp", UDP_IP, 53, timeout=1.0) == ["timeout"]
    finally:
        balancer.close()
