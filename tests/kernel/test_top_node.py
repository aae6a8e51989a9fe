"""The traffic counters in the operator's tools, against a live node: kpng (``file ... to-nft
--traffic-counters service``) in a network namespace, real connections to its Services, and
what ``kpng top --once`` prints from the node's ``/metrics`` and ``/debug/explain`` answers.
Each test connects to Services of its own: they share the node."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kpng.testing.netns import ClusterSpec, TestBed, available
from kpng.testing.ports import free_port
from kpng.testing.waiting import poll

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(180),
]

WEB_IP, BUSY_IP, EMPTY_IP, API_IP = "10.96.0.10", "10.96.0.11", "10.96.0.12", "10.96.0.13"


def _service(name: str, cluster_ip: str, namespace: str = "shop") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    }


def _slice(name: str, ip: str, namespace: str = "shop") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "nodeName": "node-1", "conditions": {"ready": True}}],
    }


def _manifest(bed: TestBed) -> str:
    p1 = bed.pod("p1").ip4
    objects = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}},
        _service("web", WEB_IP),
        _slice("web", p1),
        _service("busy", BUSY_IP),
        _slice("busy", p1),
        _service("empty", EMPTY_IP),  # no endpoints: its connections are refused
        _service("api", API_IP, "ops"),
        _slice("api", p1, "ops"),
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


def _rows(output: str) -> dict[str, list[str]]:
    """The table's rows by service name (every cell is one field)."""
    lines = output.splitlines()
    assert lines[0].split()[:3] == ["NAMESPACE", "SERVICE", "PORT"]
    return {fields[1]: fields for fields in (line.split() for line in lines[1:])}


@dataclass
class _Node:
    bed: TestBed
    netns: str
    metrics: str
    """HOST:PORT of kpng's metrics address, inside the node's namespace."""
    manifests: Path


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Node]:
    tmp_path = tmp_path_factory.mktemp("top")
    # The namespaces' names say whose they are (top-...-node-1), and are unique to the run.
    prefix = f"top{os.getpid() % 100000}{secrets.token_hex(2)}"
    with TestBed(ClusterSpec.parse({"node-1": ["p1"]}), prefix=prefix) as bed:
        netns = bed.nodes["node-1"].netns
        manifests = tmp_path / "manifests"
        manifests.mkdir()
        (manifests / "cluster.json").write_text(_manifest(bed))
        metrics = f"127.0.0.1:{free_port()}"
        log = tmp_path / "kpng.log"
        argv = [sys.executable, "-m", "kpng", "--log-level", "debug"]
        argv += ["--metrics-bind-address", metrics, "file", "--input", str(manifests)]
        argv += ["to-local", "--node-name", "node-1", "to-nft"]
        argv += ["--cluster-cidr", "10.244.0.0/16", "--traffic-counters", "service"]
        with log.open("wb") as stderr:
            bed.spawn(netns, argv, stderr=stderr)
        assert poll(lambda: "applied a full transaction" in log.read_text(), within=30)
        yield _Node(bed, netns, metrics, manifests)


def test_top_once_prints_each_service_ports_connections_rate_and_refused(node: _Node) -> None:
    bed = node.bed
    top = [sys.executable, "-m", "kpng", "top", "--metrics-url", node.metrics, "--once"]
    top += ["--namespace", "shop"]  # the other test's Service is in ops

    def once(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            bed.command_in(node.netns, [*top, *flags]),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    answers = bed.probe(node.netns, "tcp", WEB_IP, 80, count=5, timeout=1)
    assert [a.split()[0] for a in answers] == ["p1"] * 5
    refused = bed.probe(node.netns, "tcp", EMPTY_IP, 80, count=3, timeout=1)
    assert not any(a.startswith("p1") for a in refused)

    def counted() -> bool:  # to-nft reads the kernel's counters every 10 s
        done = once("--window", "0")
        return done.returncode == 0 and _rows(done.stdout).get("web", [""] * 6)[5] == "5"

    assert poll(counted, within=30, interval=1)

    # Connections to busy all along, while top takes its scrapes.
    client = [sys.executable, "-m", "kpng.testing.probe", "tcp", BUSY_IP, "80"]
    bed.spawn(node.netns, [*client, "--for", "40", "--timeout", "1"])
    done = once("--interval", "1", "--window", "40")
    assert done.returncode == 0, done.stderr
    rows = _rows(done.stdout)
    assert list(rows) == ["busy", "web", "empty"]  # by connections per second, then total
    # NAMESPACE SERVICE PORT CONN/S REFUSED/S CONNS REFUSED ENDPOINTS BUSIEST
    assert rows["web"] == ["shop", "web", "http", "0.0", "0.0", "5", "0", "-", "-"]
    assert rows["empty"] == ["shop", "empty", "http", "0.0", "0.0", "3", "3", "-", "-"]
    busy = rows["busy"]
    assert float(busy[3]) > 0
    assert int(busy[5]) > 0
    assert busy[6] == "0"
    assert done.stderr == ""


def test_explain_gives_each_port_its_counted_connections(node: _Node) -> None:
    """/debug/explain from the backend's samples, kpng explain --metrics-url from /metrics."""
    answers = node.bed.probe(node.netns, "tcp", API_IP, 80, count=4, timeout=1)
    assert [a.split()[0] for a in answers] == ["p1"] * 4
    url = f"http://{node.metrics}/debug/explain?service=ops/api"
    get = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"

    def explained() -> dict[str, Any]:
        """The Service's one port."""
        answer = json.loads(node.bed.exec(node.netns, [sys.executable, "-c", get, url]))
        port: dict[str, Any] = answer[0]["ports"][0]
        return port

    # to-nft reads the kernel's counters every 10 s.
    assert poll(lambda: explained().get("connections") == 4, within=30, interval=1)
    port = explained()
    assert (port["name"], port["connections"], port["refused"]) == ("http", 4, 0)
    # The service level counts no endpoint: the endpoints carry no count.
    assert ["connections" in ep for ep in port["endpoints"]] == [False]
    argv = [sys.executable, "-m", "kpng", "file", "--input", str(node.manifests), "explain"]
    argv += ["--node-name", "node-1", "--service", "ops/api", "--metrics-url", node.metrics]
    text = node.bed.exec(node.netns, argv)
    assert "  port http 80/TCP -> 8080; 4 connections counted, 0 refused" in text.splitlines()
