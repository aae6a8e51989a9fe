"""kpng with a central brain on real nodes: deploy/kpng-central.yaml's Deployment of brains and a
backend per node that never talks to the API server. Nodes authenticate with projected tokens,
fail over between brains, and keep serving while one is killed or the Deployment is rolled."""

from __future__ import annotations

import functools
import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kpng.testing.waiting import until
from rig import addons, images
from rig.nodes import RealCluster, RealNode
from tests.nodes.test_real_cluster import (
    Traffic,
    _answers,
    _http_get,
    _node_port_service,
    deployed,
    serve_web,
)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RealCluster]:
    with deployed("central") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def web(cluster: RealCluster) -> int:
    return serve_web(cluster)


def _agent(name: str, node: str, argv: list[str], *, token: bool) -> dict[str, Any]:
    """A one-shot pod on ``node`` that runs ``kpng local`` against the brains, with the node
    agents' projected token or with none."""
    volumes: list[dict[str, Any]] = [{"name": "ca", "configMap": {"name": "kpng-brain-ca"}}]
    mounts = [{"name": "ca", "mountPath": "/etc/kpng/ca"}]
    if token:
        source = {"serviceAccountToken": {"path": "token", "audience": "kpng"}}
        volumes.append({"name": "token", "projected": {"sources": [source]}})
        mounts.append({"name": "token", "mountPath": "/var/run/secrets/kpng"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "kube-system"},
        "spec": {
            "nodeName": node,
            "hostNetwork": True,
            "restartPolicy": "Never",
            "serviceAccountName": "kpng-node",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "kpng",
                    "image": images.KPNG_REFERENCE,
                    "imagePullPolicy": "IfNotPresent",
                    "command": argv,
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        },
    }


def _finished(cluster: RealCluster, name: str) -> tuple[str, str]:
    """The phase a one-shot pod ended in, and its log."""
    until(
        lambda: (
            cluster.get("pod", "-n", "kube-system", name)["status"].get("phase")
            in ("Succeeded", "Failed")
        ),
        f"pod {name} to finish",
        within=120,
    )
    phase = cluster.get("pod", "-n", "kube-system", name)["status"]["phase"]
    return phase, cluster.kubectl("-n", "kube-system", "logs", name)


def test_only_a_node_with_its_token_gets_its_own_state(cluster: RealCluster) -> None:
    brains = ",".join(f"tcp://{n.ip}:{addons.BRAIN_PORT}" for n in cluster.nodes)

    def local(node: str, *, token: bool) -> list[str]:
        credentials = ["--token-file=/var/run/secrets/kpng/token"] if token else []
        return [
            "kpng", "local", f"--api={brains}", "--tls-ca=/etc/kpng/ca/ca.crt", *credentials,
            f"--node-name={node}", "--connect-timeout=10", "to-json", "--once", "--output=-",
        ]  # fmt: skip

    cases = {
        "own": ("node-1", local("node-1", token=True), True),
        "other": ("node-1", local("node-2", token=True), True),
        "none": ("node-1", local("node-1", token=False), False),
    }
    for name, (node, argv, token) in cases.items():
        cluster.apply(_agent(f"agent-{name}", node, argv, token=token))
    phase, log = _finished(cluster, "agent-own")
    assert phase == "Succeeded", log
    state = json.loads(log.splitlines()[-1])
    assert state["node"] == "node-1"
    assert state["facts"]["PodCIDRs"]  # the node facts came too
    phase, log = _finished(cluster, "agent-other")
    assert phase == "Failed"
    assert "PERMISSION_DENIED" in log
    assert "may not watch node node-2" in log
    phase, log = _finished(cluster, "agent-none")
    assert phase == "Failed"
    assert "UNAUTHENTICATED" in log


def _syncs(node: RealNode) -> float:
    """The node's rule syncs so far (kube-proxy's sync duration histogram, every attempt)."""
    script = (
        "import urllib.request\n"
        "body = urllib.request.urlopen('http://127.0.0.1:10249/metrics', timeout=5).read()\n"
        "print(sum(float(l.split()[-1]) for l in body.decode().splitlines()\n"
        "          if l.startswith('kubeproxy_sync_proxy_rules_duration_seconds_count')))\n"
    )
    return float(node.exec("python3", "-c", script).strip())


def _brain_pods(cluster: RealCluster) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = cluster.get(
        "pods", "-n", "kube-system", "-l", "k8s-app=kpng-brain"
    )["items"]
    return pods


def test_a_killed_brain_and_a_rolled_deployment_break_nothing(
    cluster: RealCluster, web: int
) -> None:
    """Killing a brain moves its nodes to the other without rewriting their rules; rolling the
    Deployment replaces both, one at a time; traffic flows throughout, and a change made while
    a brain was away reaches both nodes."""
    syncs = [_syncs(node) for node in cluster.nodes]
    with Traffic([(n.ip, web) for n in cluster.nodes]) as traffic:
        time.sleep(2)
        victim = _brain_pods(cluster)[0]
        node = next(n for n in cluster.nodes if n.name == victim["spec"]["nodeName"])
        (brain,) = victim["status"]["containerStatuses"]
        node.ctr("tasks", "kill", "--signal", "SIGKILL", brain["containerID"].split("//")[1])
        time.sleep(5)  # the nodes notice and move to the other brain
        # Nothing changed in the cluster: no node rewrote its rules.
        assert [_syncs(n) for n in cluster.nodes] == syncs
        cluster.apply(_node_port_service("late", {"app": "web"}))
        late: int = cluster.get("service", "late")["spec"]["ports"][0]["nodePort"]
        for n in cluster.nodes:
            until(functools.partial(_answers, n.ip, late), f"late on {n.name}", within=60)
        cluster.kubectl("-n", "kube-system", "rollout", "restart", "deployment/kpng-brain")
        addons.wait_rollout(cluster, "deployment/kpng-brain", 240)
        for n in cluster.nodes:
            health = json.loads(_http_get(f"http://{n.ip}:10256/healthz"))
            assert "lastUpdated" in health
        time.sleep(2)
    assert traffic.new_failed == []
    assert traffic.kept_failed == []
    assert traffic.new_ok >= 20
    assert traffic.kept_ok >= 20


def test_brains_unreachable_for_a_minute_leave_the_nodes_serving(
    cluster: RealCluster, web: int
) -> None:
    """Every node cut off from every brain for 60 s (packets to and from port 12090 dropped): the
    nodes keep their rules, traffic goes on, /healthz and /livez stay 200, and a Service made
    meanwhile reaches every node once the brains are reachable again."""
    # Both ways: brains and agents share the nodes' network namespaces (host network).
    cuts = [f"tcp dport {addons.BRAIN_PORT} drop", f"tcp sport {addons.BRAIN_PORT} drop"]
    with Traffic([(n.ip, web) for n in cluster.nodes]) as traffic:
        for node in cluster.nodes:
            node.exec("nft", "add table inet kpng-test-cut")
            node.exec(
                "nft", "add chain inet kpng-test-cut out { type filter hook output priority 0 ; }"
            )
            for cut in cuts:
                node.exec("nft", f"add rule inet kpng-test-cut out {cut}")
        try:
            cluster.apply(_node_port_service("away", {"app": "web"}))
            away: int = cluster.get("service", "away")["spec"]["ports"][0]["nodePort"]
            time.sleep(60)
            for node in cluster.nodes:
                assert not _answers(node.ip, away)  # no brain told the node of it
                for path in ("healthz", "livez"):
                    with urllib.request.urlopen(f"http://{node.ip}:10256/{path}", timeout=3) as r:
                        assert r.status == 200
        finally:
            for node in cluster.nodes:
                node.exec("nft", "delete table inet kpng-test-cut", check=False)
        for node in cluster.nodes:
            until(functools.partial(_answers, node.ip, away), f"away on {node.name}", within=120)
    assert traffic.new_failed == []
    assert traffic.kept_failed == []
    assert traffic.new_ok >= 100
