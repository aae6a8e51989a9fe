"""to-ebpf in the kernel: what the conformance suite does not look at. Connections a program
translated leave no conntrack entry to the service address; removing the pins detaches the
programs; a program the verifier refuses is reported with the verifier's log; syncs reach
kube-proxy's metrics as full or partial; the programs' counters and the maps' occupancy reach
kpng's /metrics."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._node import FromNode, Options
from kpng.backends.ebpf import EbpfBackend, SocketBalancer, remove_pins
from kpng.backends.ebpf.libbpf import BpfError, BpfObject
from kpng.backends.ebpf.toolchain import compile_object, unavailable
from kpng.client import NodeState
from kpng.feeding import Fanout, Feeder, SyncStats
from kpng.model.messages import ServiceEndpoints
from kpng.status import Status
from kpng.testing import states
from kpng.testing.conformance import Cluster, endpoint_slice, node_object, port, service
from kpng.testing.netns import CLUSTER_CIDRS, ClusterSpec, TestBed, available
from kpng.testing.states import keyed_state
from kpng.testing.waiting import poll
from tests.test_metrics import IPV4, Samples, _scrape

pytestmark = pytest.mark.skipif(
    available() is not None or unavailable() is not None,
    reason=str(available() or unavailable()),
)

IP = "10.96.0.10"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cidrs = ",".join(CLUSTER_CIDRS)
    backend = f"to-ebpf --cluster-cidr {cidrs} --cgroup {{cgroup}} --pin-dir {{pin_dir}}"
    (tmp_path / "manifests").mkdir()
    with TestBed(ClusterSpec.parse({"node-1": ["a1", "a2"]}), sockets=True) as bed:
        c = Cluster(bed, tmp_path / "manifests", tmp_path, backend)
        c.write("nodes", *(node_object(n) for n in bed.nodes.values()))
        c.write("web", service("web", IP, [port("http", 80)]), endpoint_slice(c, "web", ["a2"]))
        c.start_backend("node-1")
        c.eventually("a1", "tcp", IP, 80, lambda r: r == ["a2 10.244.1.2"])
        yield c


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
    """kpng on node-1 serving /metrics in the node's namespace; web (TCP, on a2), dns (UDP, on
    a2) and empty (no endpoint)."""
    cidrs = ",".join(CLUSTER_CIDRS)
    backend = f"to-ebpf --cluster-cidr {cidrs} --cgroup {{cgroup}} --pin-dir {{pin_dir}}"
    (tmp_path / "manifests").mkdir()
    with TestBed(ClusterSpec.parse({"node-1": ["a1", "a2"]}), sockets=True) as bed:
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
        c.start_backend("node-1")
        c.eventually("a1", "tcp", IP, 80, lambda r: r == ["a2 10.244.1.2"])
        yield c


def _metrics(cluster: Cluster) -> Samples:
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
    before = _metrics(metered)
    n = 7
    assert metered.probe("a1", "tcp", IP, 80, count=n) == ["a2 10.244.1.2"] * n
    a1 = metered.bed.pods["a1"].netns
    udp = metered.bed.exec(a1, [sys.executable, "-c", _UDP, DNS_IP, "53", str(n)])
    assert udp.splitlines() == [f"{DNS_IP} 53 a2 10.244.1.2"] * n
    assert metered.probe("a1", "tcp", EMPTY_IP, 80, count=n) == ["refused"] * n
    after = _metrics(metered)

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


def test_the_counters_outlive_a_restart_of_kpng(metered: Cluster) -> None:
    """They are pinned with the maps: a restarted kpng reports what the programs counted
    before, as the kernel's own counters (kube-proxy's rules' counters) outlive kube-proxy."""
    # The fixture's first probe may have gone out before the programs were attached.
    assert metered.probe("a1", "tcp", IP, 80, count=3) == ["a2 10.244.1.2"] * 3
    before = _metrics(metered)[_hook("translations", "connect4")]
    assert before >= 3
    metered.start_backend("node-1")
    got: Samples = {}

    def scraped() -> bool:
        nonlocal got
        try:
            got = _metrics(metered)
        except Exception:  # not listening yet
            return False
        return _hook("translations", "connect4") in got

    assert poll(scraped, within=15, interval=0.2)
    assert got[_hook("translations", "connect4")] >= before
