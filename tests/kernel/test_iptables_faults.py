"""The fault table for to-iptables against the kernel, as tests/kernel/test_nft_faults.py has it for
to-nft: a live ``kpng file ... to-iptables --sync-period 1s`` in a node's network namespace
(in one process, and behind ``kpng local``),
traffic through a ClusterIP and a NodePort, and another program flushing, deleting or adding
to kpng's chains. Each fault is repaired within the period to what the first full sync wrote
(iptables-save's own listing), logged, counted by kind, with traffic flowing and ``/healthz``
200."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

from kpng.testing import netns
from kpng.testing.netns import ClusterSpec, TestBed
from kpng.testing.waiting import poll
from tests.kernel.nft_faults import CLUSTER_IP, HEALTHZ, METRICS, Live, with_node_port
from tests.kernel.test_nft_kernel import _manifest

pytestmark = pytest.mark.skipif(shutil.which("iptables-nft") is None, reason="no iptables-nft")


def _saved(live: Live) -> list[str]:
    """kpng's chains and jumps in the nat and filter tables, as iptables-save prints them,
    without counters."""
    lines = []
    for table in ("nat", "filter"):
        out = live.bed.exec(live.node, ["iptables-nft-save", "-t", table])
        lines += [
            line.split(" [", 1)[0]
            for line in out.splitlines()
            if "KUBE-" in line or "KPNG-" in line
        ]
    return lines


def _healthy(live: Live) -> bool:
    try:
        return live.get(HEALTHZ, "/healthz")[0] == 200
    except netns.TestBedError:
        return False  # not listening yet


@pytest.fixture(scope="module", params=["in-process", "behind-kpng-local"])
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Live, list[str]]]:
    """to-iptables on a node, in kpng's one process or in a ``kpng local`` agent fed by a brain
    (``to-api``) on a unix socket: the repair is the backend's either way."""
    tmp = tmp_path_factory.mktemp("iptables-faults")
    with (
        tempfile.TemporaryDirectory(prefix="kpng-ipt-") as sockets,
        TestBed(ClusterSpec.parse({"node-1": ["p1"]})) as bed,
    ):
        node = bed.nodes["node-1"].netns
        manifests = tmp / "cluster.json"
        manifests.write_text(with_node_port(_manifest(bed, CLUSTER_IP)))
        log = tmp / "kpng.log"
        kpng = [sys.executable, "-m", "kpng", "--log-level", "debug"]
        source = ["file", "--input", str(manifests)]
        processes = []
        if request.param == "in-process":
            source += ["to-local", "--node-name", "node-1"]
        else:
            socket = f"unix://{sockets}/kpng.sock"
            with (tmp / "brain.log").open("wb") as stderr:
                processes.append(
                    bed.spawn(node, [*kpng, *source, "to-api", "--listen", socket], stderr=stderr)
                )
            source = ["local", "--api", socket, "--node-name", "node-1"]
        argv = [*kpng, "--healthz-address", HEALTHZ, "--metrics-address", METRICS]
        argv += ["--healthz-timeout", "5", *source, "to-iptables", "--iptables-mode", "nft"]
        argv += ["--sync-period", "1s", "--cluster-cidr", "10.244.0.0/16"]
        with log.open("wb") as stderr:
            processes.append(bed.spawn(node, argv, stderr=stderr))
        live = Live(bed, node, log, manifests, {})
        assert poll(lambda: _healthy(live), within=30), log.read_text()
        assert live.answers() == ["p1", "p1"]
        yield live, _saved(live)
        assert all(p.poll() is None for p in processes), log.read_text()[-3000:]


FAULTS = {
    "nat-flushed": ("jumps", [["-t", "nat", "-F"]]),
    "nat-flushed-and-chains-deleted": ("jumps", [["-t", "nat", "-F"], ["-t", "nat", "-X"]]),
    "services-chain-flushed": ("rules", [["-t", "nat", "-F", "KUBE-SERVICES"]]),
    "foreign-rule": (
        "rules",
        [["-t", "nat", "-I", "KUBE-SERVICES", "1", "-d", CLUSTER_IP, "-j", "RETURN"]],
    ),
    "filter-chain-flushed": ("rules", [["-t", "filter", "-F", "KUBE-FORWARD"]]),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_is_found_within_the_sync_period_and_repaired(
    live: tuple[Live, list[str]], fault: str
) -> None:
    bed, written = live
    kind, commands = FAULTS[fault]
    before = bed.repairs(kind, "to-iptables")
    for command in commands:
        bed.bed.exec(bed.node, ["iptables-nft", *command])
    assert poll(lambda: bed.repairs(kind, "to-iptables") == before + 1, within=15), (
        bed.log.read_text()[-2000:]
    )
    assert poll(lambda: _saved(bed) == written, within=5)
    assert bed.answers() == ["p1", "p1"]
    status, body = bed.get(HEALTHZ, "/healthz")
    assert status == 200, body
