"""The fault table against to-nft in the kernel, shared by the shapes that run it: kpng in one
process (tests/kernel/test_nft_faults.py) and split in a brain and a node agent
(tests/kernel/test_faults_split.py). What another program does to kpng's table, what kpng must
count it as, and how a test sees a live node (its traffic, /metrics, /healthz) and checks the
repair."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from kpng.testing.netns import TestBed
from kpng.testing.waiting import poll
from tests.kernel.test_nft_kernel import _table

CLUSTER_IP = "10.96.0.10"
NODE_PORT = 30080
METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"

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
"""fault: (the kind ``kpng_backend_drift_repairs_total`` counts it as, the nft command)."""


@dataclass
class Live:
    bed: TestBed
    node: str
    log: Path
    """The log of the process that runs to-nft."""
    manifests: Path
    fresh: dict[str, object]
    """kpng's table as a full sync of the manifests programs it."""

    def get(self, address: str, path: str) -> tuple[int, str]:
        return http_get(self.bed, self.node, address, path)

    def repairs(self, kind: str, backend: str = "to-nft") -> float:
        return drift_repairs(self.bed, self.node, backend, kind)

    def answers(self) -> list[str]:
        """Which pod answered a connection to the ClusterIP, and one to the NodePort."""
        node_ip = self.bed.nodes["node-1"].ip4
        answers = [
            *self.bed.probe(self.node, "tcp", CLUSTER_IP, 80, timeout=1),
            *self.bed.probe(self.node, "tcp", node_ip, NODE_PORT, timeout=1),
        ]
        return [answer.split()[0] for answer in answers]


def http_get(bed: TestBed, netns: str, address: str, path: str) -> tuple[int, str]:
    """The status and body of a GET of ``http://ADDRESS/PATH`` from ``netns`` (where kpng's
    status addresses listen, on the node's loopback)."""
    script = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    r = urllib.request.urlopen('http://{address}{path}', timeout=5)\n"
        "    print(r.status); print(r.read().decode())\n"
        "except urllib.error.HTTPError as e:\n"
        "    print(e.code); print(e.read().decode())\n"
    )
    out = bed.exec(netns, [sys.executable, "-c", script])
    status, _, body = out.partition("\n")
    return int(status), body


def drift_repairs(bed: TestBed, netns: str, backend: str, kind: str) -> float:
    """``kpng_backend_drift_repairs_total`` of ``backend`` and ``kind`` on the node's
    ``/metrics`` (0 before the first)."""
    _, text = http_get(bed, netns, METRICS, "/metrics")
    wanted = f'kpng_backend_drift_repairs_total{{backend="{backend}",kind="{kind}"}}'
    for line in text.splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def with_node_port(manifest: str) -> str:
    objects = json.loads(manifest)
    for item in objects["items"]:
        if item["kind"] == "Service":
            item["spec"]["type"] = "NodePort"
            item["spec"]["ports"][0]["nodePort"] = NODE_PORT
    return json.dumps(objects)


def assert_found_and_repaired(live: Live, fault: str) -> None:
    """Make ``fault``, then check that it was found within the sync period, logged once, counted
    by kind, and repaired to the fresh table with traffic flowing and /healthz 200."""
    kind, command = FAULTS[fault]
    before = live.repairs(kind)
    logged = live.log.read_text().count("changed by another program")
    live.bed.exec(live.node, ["nft", command])
    assert poll(lambda: live.repairs(kind) == before + 1, within=15), live.log.read_text()[-2000:]
    # Logged once, unless the same finding was logged less than 10 s ago: kpng's log lets one
    # of identical warnings through per 10 s (kpng.logs.RepeatFilter); the metric counts all.
    after = live.log.read_text().count("changed by another program")
    assert after in (logged, logged + 1)
    assert after >= 1
    assert poll(lambda: _table(live.node) == live.fresh, within=5)
    assert live.answers() == ["p1", "p1"]
    status, body = live.get(HEALTHZ, "/healthz")
    assert status == 200, body
