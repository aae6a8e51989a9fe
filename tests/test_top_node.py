"""``kpng top --once`` against a live node: kpng (``file ... to-nft --traffic-counters service``)
in a network namespace, real connections to its Services, and the rows ``kpng top`` prints
from the node's ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
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

WEB_IP, BUSY_IP, EMPTY_IP = "10.96.0.10", "10.96.0.11", "10.96.0.12"


def _service(name: str, cluster_ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    }


def _slice(name: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-x",
            "namespace": "shop",
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
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


def _rows(output: str) -> dict[str, list[str]]:
    """The table's rows by service name (every cell is one field)."""
    lines = output.splitlines()
    assert lines[0].split()[:3] == ["NAMESPACE", "SERVICE", "PORT"]
    return {fields[1]: fields for fields in (line.split() for line in lines[1:])}


def test_top_once_prints_each_service_ports_connections_rate_and_refused(
    tmp_path: Path,
) -> None:
    with TestBed(ClusterSpec.parse({"node-1": ["p1"]})) as bed:
        node = bed.nodes["node-1"].netns
        manifests = tmp_path / "manifests"
        manifests.mkdir()
        (manifests / "cluster.json").write_text(_manifest(bed))
        metrics = f"127.0.0.1:{free_port()}"  # inside the node's namespace
        log = tmp_path / "kpng.log"
        argv = [sys.executable, "-m", "kpng", "--log-level", "debug"]
        argv += ["--metrics-bind-address", metrics, "file", "--input", str(manifests)]
        argv += ["to-local", "--node-name", "node-1", "to-nft"]
        argv += ["--cluster-cidr", "10.244.0.0/16", "--traffic-counters", "service"]
        with log.open("wb") as stderr:
            bed.spawn(node, argv, stderr=stderr)
        assert poll(lambda: "applied a full transaction" in log.read_text(), within=30)

        top = [sys.executable, "-m", "kpng", "top", "--metrics-url", metrics, "--once"]

        def once(*flags: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                bed.command_in(node, [*top, *flags]),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        answers = bed.probe(node, "tcp", WEB_IP, 80, count=5, timeout=1)
        assert [a.split()[0] for a in answers] == ["p1"] * 5
        refused = bed.probe(node, "tcp", EMPTY_IP, 80, count=3, timeout=1)
        assert not any(a.startswith("p1") for a in refused)

        def counted() -> bool:  # to-nft reads the kernel's counters every 10 s
            done = once("--window", "0")
            return done.returncode == 0 and _rows(done.stdout).get("web", [""] * 6)[5] == "5"

        assert poll(counted, within=30, interval=1)

        # Connections to busy all along, while top takes its scrapes.
        client = [sys.executable, "-m", "kpng.testing.probe", "tcp", BUSY_IP, "80"]
        bed.spawn(node, [*client, "--for", "40", "--timeout", "1"])
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
