"""The fault table against the kernel: a live ``kpng file ... to-nft`` in a node's network
namespace, traffic through a ClusterIP and a NodePort, and another program changing kpng's
table behind its back. Each fault is found within the sync period (1 s here), logged, counted
by kind on ``/metrics``, and repaired to what a fresh full sync programs (compared on the
kernel's own listing); traffic flows again and ``/healthz`` answers 200.

tests/test_nft_drift.py has the same faults over the fake, and the divergence kpng cannot
repair (``/healthz`` 503 after its timeout)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kpng.testing.netns import ClusterSpec, TestBed, available
from kpng.testing.waiting import poll
from tests.test_nft_kernel import _manifest, _table

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

CLUSTER_IP = "10.96.0.10"
NODE_PORT = 30080
METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"


@dataclass
class Live:
    bed: TestBed
    node: str
    log: Path
    manifests: Path
    fresh: dict[str, object]
    """kpng's table as its first (full) sync programmed it."""

    def get(self, address: str, path: str) -> tuple[int, str]:
        script = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            f"    r = urllib.request.urlopen('http://{address}{path}', timeout=5)\n"
            "    print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code); print(e.read().decode())\n"
        )
        out = self.bed.exec(self.node, [sys.executable, "-c", script])
        status, _, body = out.partition("\n")
        return int(status), body

    def repairs(self, kind: str) -> float:
        _, text = self.get(METRICS, "/metrics")
        for line in text.splitlines():
            if line.startswith(
                f'kpng_backend_drift_repairs_total{{backend="to-nft",kind="{kind}"}}'
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def answers(self) -> list[str]:
        """Which pod answered a connection to the ClusterIP, and one to the NodePort."""
        node_ip = self.bed.nodes["node-1"].ip4
        answers = [
            *self.bed.probe(self.node, "tcp", CLUSTER_IP, 80, timeout=1),
            *self.bed.probe(self.node, "tcp", node_ip, NODE_PORT, timeout=1),
        ]
        return [answer.split()[0] for answer in answers]


def _with_node_port(manifest: str) -> str:
    objects = json.loads(manifest)
    for item in objects["items"]:
        if item["kind"] == "Service":
            item["spec"]["type"] = "NodePort"
            item["spec"]["ports"][0]["nodePort"] = NODE_PORT
    return json.dumps(objects)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("faults")
    with TestBed(ClusterSpec.parse({"node-1": ["p1"]})) as bed:
        node = bed.nodes["node-1"].netns
        manifests = tmp / "cluster.json"
        manifests.write_text(_with_node_port(_manifest(bed, CLUSTER_IP)))
        log = tmp / "kpng.log"
        argv = [sys.executable, "-m", "kpng", "--log-level", "debug"]
        argv += ["--healthz-address", HEALTHZ, "--metrics-address", METRICS]
        argv += ["--healthz-timeout", "5", "file", "--input", str(manifests), "--removal-delay"]
        argv += ["3s", "to-local", "--node-name", "node-1", "to-nft", "--sync-period", "1s"]
        with log.open("wb") as stderr:
            kpng = bed.spawn(node, argv, stderr=stderr)
        assert poll(lambda: "applied a full transaction" in log.read_text(), within=30)
        live = Live(bed, node, log, manifests, _table(node))
        assert poll(lambda: live.get(HEALTHZ, "/healthz")[0] == 200, within=10)
        assert live.answers() == ["p1", "p1"]
        yield live
        assert kpng.poll() is None, live.log.read_text()[-3000:]


FAULTS = {
    "ruleset-flushed": ("table", "flush ruleset"),
    "table-deleted": ("table", "delete table inet kpng"),
    "chain-deleted": (
        "chain",
        "flush chain inet kpng service-reject; delete chain inet kpng service-reject",
    ),
    "chain-flushed": ("rules", "flush chain inet kpng services"),
    "foreign-rule": ("rules", f"insert rule inet kpng services ip daddr {CLUSTER_IP} drop"),
    "map-flushed": ("elements", "flush map inet kpng cluster-v4"),
    "node-port-map-flushed": ("elements", "flush map inet kpng nodeport-v4"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_is_found_within_the_sync_period_and_repaired(live: Live, fault: str) -> None:
    kind, command = FAULTS[fault]
    before = live.repairs(kind)
    logged = live.log.read_text().count("changed by another program")
    live.bed.exec(live.node, ["nft", command])
    assert poll(lambda: live.repairs(kind) == before + 1, within=15), live.log.read_text()[-2000:]
    assert live.log.read_text().count("changed by another program") == logged + 1
    assert poll(lambda: _table(live.node) == live.fresh, within=5)
    assert live.answers() == ["p1", "p1"]
    status, body = live.get(HEALTHZ, "/healthz")
    assert status == 200, body


def test_a_file_truncated_then_written_again_keeps_every_rule(live: Live) -> None:
    """``kubectl get ... > cluster.json`` truncates the file before it writes it: within the
    removal delay, nothing is removed."""
    content = live.manifests.read_text()
    transactions = live.log.read_text().count("applied a")
    live.manifests.write_text("")
    assert poll(
        lambda: "would" in live.log.read_text() or "removed if" in live.log.read_text(), within=5
    )
    assert live.answers() == ["p1", "p1"]
    live.manifests.write_text(content)
    time.sleep(4)  # past the removal delay
    assert _table(live.node) == live.fresh
    assert live.answers() == ["p1", "p1"]
    assert live.log.read_text().count("applied a") == transactions
