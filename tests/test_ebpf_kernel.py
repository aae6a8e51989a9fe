"""to-ebpf in the kernel: what the conformance suite does not look at. Connections a program
translated leave no conntrack entry to the service address; removing the pins detaches the
programs; a program the verifier refuses is reported with the verifier's log; syncs reach
kube-proxy's metrics as full or partial."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

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
from tests.test_metrics import IPV4, _scrape

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
