"""Traffic counters behind ``kpng local``: a brain (``kpng file ... to-api`` on a unix socket)
and a node agent (``kpng local ... to-nft`` or ``to-iptables`` with ``--traffic-counters
endpoint``) in a node's network namespace. Real connections reach the agent's ``/metrics`` as
they went: N connections to a Service as N, split over its endpoints as the servers saw them,
and those to a Service without endpoints as refused. The counters' logic and the backends'
reads in one process: tests/kernel/test_nft_counters_kernel.py,
tests/kernel/test_iptables_counters.py; to-ebpf's agent (its programs need the node's cgroup):
tests/kernel/test_ebpf_traffic.py."""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.backends._traffic import CONNECTIONS, ENDPOINT_CONNECTIONS, REJECTED
from kpng.testing import netns
from kpng.testing.netns import ClusterSpec, TestBed
from kpng.testing.waiting import poll
from tests.kernel.nft_faults import HEALTHZ, METRICS, http_get

KPNG = [sys.executable, "-m", "kpng"]
NODE = "node-1"
WEB_IP, EMPTY_IP = "10.96.0.40", "10.96.0.41"
CONNECTS, REFUSALS = 30, 4

BACKENDS = {
    "to-nft": ["to-nft", "--sync-period", "1s"],
    "to-iptables": ["to-iptables", "--iptables-mode", "nft", "--sync-period", "1s"],
}


def _service(name: str, ip: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "clusterIP": ip,
            "clusterIPs": [ip],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    }


def _manifest(pods: list[str]) -> str:
    """``ns/web`` served by ``pods`` (port 8080), and ``ns/empty`` served by none."""
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-x",
            "namespace": "ns",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "nodeName": NODE, "conditions": {"ready": True}} for ip in pods
        ],
    }
    items = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}},
        _service("web", WEB_IP),
        slice_,
        _service("empty", EMPTY_IP),
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def _scraped(bed: TestBed, node: str) -> dict[tuple[str, str, str], float]:
    """The agent's traffic series: (metric, service, endpoint or "") -> value."""
    status, text = http_get(bed, node, METRICS, "/metrics")
    assert status == 200, text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (CONNECTIONS, REJECTED, ENDPOINT_CONNECTIONS):
                labels = sample.labels
                key = (sample.name, labels["service"], labels.get("endpoint", ""))
                out[key] = sample.value
    return out


def _healthy(bed: TestBed, node: str) -> bool:
    try:
        return http_get(bed, node, HEALTHZ, "/healthz")[0] == 200
    except netns.TestBedError:
        return False  # not listening yet


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_connections_behind_kpng_local_are_counted_per_service_and_endpoint(
    backend: str, tmp_path: Path
) -> None:
    if backend == "to-iptables" and shutil.which("iptables-nft") is None:
        pytest.skip("no iptables-nft")
    # A unix socket's path is at most 107 bytes: pytest's temporary paths can be longer.
    with (
        tempfile.TemporaryDirectory(prefix="kpng-traffic-") as sockets,
        TestBed(
            ClusterSpec.parse({NODE: ["p1", "p2"]}),
            prefix=f"ktlocalcount{secrets.token_hex(2)}",
        ) as bed,
    ):
        node = bed.nodes[NODE].netns
        pods = {name: bed.pod(name).ip4 for name in ("p1", "p2")}
        manifests = tmp_path / "cluster.json"
        manifests.write_text(_manifest(list(pods.values())))
        socket = f"unix://{sockets}/kpng.sock"
        brain = [*KPNG, "file", "--input", str(manifests), "to-api", "--listen", socket]
        with (tmp_path / "brain.log").open("wb") as stderr:
            bed.spawn(node, brain, stderr=stderr)
        agent = [*KPNG, "--healthz-address", HEALTHZ, "--metrics-address", METRICS]
        agent += ["--healthz-timeout", "5", "local", "--api", socket, "--node-name", NODE]
        agent += [*BACKENDS[backend], "--cluster-cidr", "10.244.0.0/16"]
        agent += ["--traffic-counters", "endpoint"]
        log = tmp_path / "agent.log"
        with log.open("wb") as stderr:
            process = bed.spawn(node, agent, stderr=stderr)
        assert poll(lambda: _healthy(bed, node), within=30), log.read_text()[-3000:]

        # Which pod took each connection, as the server says (the echo server answers with
        # its pod's name).
        answers = bed.probe(node, "tcp", WEB_IP, 80, count=CONNECTS, timeout=1)
        taken = Counter(answer.split()[0] for answer in answers)
        assert sum(taken.values()) == CONNECTS, answers
        refused = bed.probe(node, "tcp", EMPTY_IP, 80, count=REFUSALS, timeout=1)
        assert not any(r.split()[0] in pods for r in refused), refused

        expected = {
            (CONNECTIONS, "web", ""): CONNECTS,
            (REJECTED, "web", ""): 0,
            (CONNECTIONS, "empty", ""): REFUSALS,
            (REJECTED, "empty", ""): REFUSALS,
            **{
                (ENDPOINT_CONNECTIONS, "web", f"{ip}:8080"): taken[name]
                for name, ip in pods.items()
            },
        }
        seen: dict[tuple[str, str, str], float] = {}

        def counted() -> bool:
            seen.clear()
            seen.update(_scraped(bed, node))
            return seen == expected

        # The agent reads the kernel's counters every READ_PERIOD_S (10 s).
        assert poll(counted, within=35, interval=1), (seen, log.read_text()[-3000:])
        assert process.poll() is None, log.read_text()[-3000:]
