"""kpng split on real nodes: deploy/kpng-sidecar.yaml's brain and backend containers, started by
real kubelets, serving pods that real controllers publish, and keeping them served while the
brain is away."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kpng.testing.waiting import until
from rig import images
from rig.nodes import RealCluster
from tests.nodes.test_real_cluster import (
    Traffic,
    _answers,
    _http_get,
    _node_port_service,
    deployed,
    serve_web,
)

pytestmark = pytest.mark.timeout(900)

TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RealCluster]:
    with deployed("sidecar") as cluster:
        yield cluster


def _kpng_pods(cluster: RealCluster) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = cluster.get("pods", "-n", "kube-system", "-l", "k8s-app=kpng")[
        "items"
    ]
    return sorted(pods, key=lambda p: str(p["spec"]["nodeName"]))


def _in_container(cluster: RealCluster, pod: str, container: str, code: str) -> str:
    return cluster.kubectl(
        "-n", "kube-system", "exec", pod, "-c", container, "--", "python3", "-c", code
    ).strip()


def test_each_container_holds_one_power_the_brain_the_token_the_backend_net_admin(
    cluster: RealCluster,
) -> None:
    pods = _kpng_pods(cluster)
    assert [p["spec"]["nodeName"] for p in pods] == ["node-1", "node-2"]
    for pod in pods:
        name = pod["metadata"]["name"]
        statuses = {s["name"]: s for s in pod["status"]["containerStatuses"]}
        assert sorted(statuses) == ["backend", "brain"]
        assert all(s["ready"] and s["image"] == images.KPNG_REFERENCE for s in statuses.values())
        # What each process really holds, read from inside: the effective capabilities, and
        # whether a token is there to read.
        caps = "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
        token = f"import os; print(os.path.exists('{TOKEN_DIR}/token'))"
        net_admin = 1 << 12
        assert int(_in_container(cluster, name, "brain", caps), 16) == 0
        assert _in_container(cluster, name, "brain", token) == "True"
        assert int(_in_container(cluster, name, "backend", caps), 16) == net_admin
        assert _in_container(cluster, name, "backend", token) == "False"
    for node in cluster.nodes:
        health = json.loads(_http_get(f"http://{node.ip}:10256/healthz"))
        assert "lastUpdated" in health


@pytest.fixture(scope="module")
def web(cluster: RealCluster) -> int:
    return serve_web(cluster)


def test_a_brain_that_crashes_leaves_the_node_serving_and_catches_it_up(
    cluster: RealCluster, web: int
) -> None:
    """The brain container dies and kubelet restarts it: established connections and new ones
    to an unchanged Service go on; /healthz stays 200 (nothing is pending while no brain says
    anything); a Service made while the brain was away reaches the node once it is back."""
    pod = _kpng_pods(cluster)[0]
    name, node = pod["metadata"]["name"], cluster.nodes[0]
    restarts = {s["name"]: s["restartCount"] for s in pod["status"]["containerStatuses"]}
    ids = {
        s["name"]: s["containerID"].removeprefix("containerd://")
        for s in pod["status"]["containerStatuses"]
    }
    with Traffic([(node.ip, web)]) as traffic:
        time.sleep(2)
        # SIGKILL from the node's containerd: a crash, not a clean stop.
        node.ctr("tasks", "kill", "--signal", "SIGKILL", ids["brain"])
        labels = {"app": "web"}
        cluster.apply(_node_port_service("late", labels))
        late: int = cluster.get("service", "late")["spec"]["ports"][0]["nodePort"]
        health = json.loads(_http_get(f"http://{node.ip}:10256/healthz"))
        assert "lastUpdated" in health
        until(functools.partial(_answers, node.ip, late), "the Service made meanwhile", within=90)
        time.sleep(2)
    assert traffic.new_failed == []
    assert traffic.kept_failed == []
    assert traffic.new_ok >= 20
    after = {
        s["name"]: s["restartCount"]
        for s in next(p for p in _kpng_pods(cluster) if p["metadata"]["name"] == name)["status"][
            "containerStatuses"
        ]
    }
    assert after["brain"] == restarts["brain"] + 1
    assert after["backend"] == restarts["backend"]
