"""kpng deployed as users deploy it, on real nodes: deploy/'s DaemonSet, installed with the Helm
chart (``helm template``, which renders deploy/kpng.yaml's objects), started by real kubelets
from the locally built image, serving pods that real controllers publish.

The CI smoke part of the real-cluster work; upstream's e2e suite runs with ``make e2e``.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kpng.testing.waiting import until
from rig import addons, images
from rig import kubeapi as k
from rig.nodes import RealCluster

pytestmark = pytest.mark.timeout(900)


@contextlib.contextmanager
def deployed(shape: str) -> Iterator[RealCluster]:
    """Two real nodes with kpng deployed in ``shape`` (``addons.SHAPES``), removed on exit."""
    with RealCluster(
        nodes=2, images=images.node_images(), pause_image=images.pause_reference()
    ) as cluster:
        addons.deploy_kpng(cluster, images.KPNG_REFERENCE, shape=shape)
        yield cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[RealCluster]:
    with deployed("daemonset") as cluster:
        yield cluster


def _pod(
    name: str, node: str, args: list[str], labels: dict[str, str], **spec: Any
) -> dict[str, Any]:
    image = images.agnhost_reference()
    return k.pod(name, "default", image, args, node=node, labels=labels, **spec)


def _answered_by(get: Callable[[str], str], url: str, expected: str) -> bool:
    return get(url) == expected


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as response:
        body: bytes = response.read()
        return body.decode()


def test_the_daemonset_runs_kpng_from_the_local_image_on_every_node(
    cluster: RealCluster,
) -> None:
    pods = cluster.get("pods", "-n", "kube-system", "-l", "k8s-app=kpng")["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["node-1", "node-2"]
    for pod in pods:
        (status,) = pod["status"]["containerStatuses"]
        assert status["image"] == images.KPNG_REFERENCE
        assert status["ready"] is True
        assert status["restartCount"] == 0
    for node in cluster.nodes:
        # kube-proxy's health port, on the node's address, answered by the pod (hostNetwork).
        health = json.loads(_http_get(f"http://{node.ip}:10256/healthz"))
        assert "lastUpdated" in health
        # The init container set the node's conntrack timeouts, kube-proxy's defaults.
        netfilter = "/proc/sys/net/netfilter"
        close_wait = node.exec("cat", f"{netfilter}/nf_conntrack_tcp_timeout_close_wait")
        established = node.exec("cat", f"{netfilter}/nf_conntrack_tcp_timeout_established")
        assert (close_wait.strip(), established.strip()) == ("3600", "86400")


def test_a_pod_reaches_a_pod_on_the_other_node_through_a_cluster_ip_and_a_node_port(
    cluster: RealCluster,
) -> None:
    labels = {"app": "smoke-server"}
    cluster.apply(
        _pod("smoke-server", "node-2", ["netexec", "--http-port=8080"], labels),
        _pod("smoke-client", "node-1", ["pause"], {"app": "smoke-client"}),
        _node_port_service("smoke", labels),
    )
    cluster.kubectl("wait", "--for=condition=Ready", "pod/smoke-server", "pod/smoke-client")
    service = cluster.get("service", "smoke")
    cluster_ip = service["spec"]["clusterIP"]
    node_port = service["spec"]["ports"][0]["nodePort"]

    def from_client(url: str) -> str:
        return cluster.kubectl(
            "exec", "smoke-client", "--", "curl", "-sS", "--max-time", "3", url, check=False
        )

    targets = [
        f"http://{cluster_ip}/hostname",
        # Both nodes' node ports: the client's own node sends it across to node-2.
        *(f"http://{node.ip}:{node_port}/hostname" for node in cluster.nodes),
    ]
    for url in targets:
        until(functools.partial(_answered_by, from_client, url, "smoke-server"), url, within=60)
    # And from outside the cluster: the machine, on the bridge, to node-1's node port.
    assert _http_get(f"http://{cluster.nodes[0].ip}:{node_port}/hostname") == "smoke-server"


class Traffic:
    """HTTP requests from the machine to node ports while something happens, counted: one
    keep-alive connection (established traffic) and a new connection per request, in a thread,
    bounded in count and time."""

    def __init__(self, targets: list[tuple[str, int]], *, max_requests: int = 5000) -> None:
        self.targets = targets
        self.max_requests = max_requests
        self.new_ok = 0
        self.new_failed: list[str] = []
        self.kept_ok = 0
        self.kept_failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        host, port = self.targets[0]
        kept = http.client.HTTPConnection(host, port, timeout=3)
        deadline = time.monotonic() + 600
        for i in range(self.max_requests):
            if self._stop.is_set() or time.monotonic() > deadline:
                break
            try:
                kept.request("GET", "/hostname")
                response = kept.getresponse()
                response.read()
                self.kept_ok += 1
            except (OSError, http.client.HTTPException) as exc:
                self.kept_failed.append(f"{time.monotonic():.1f} {exc!r}")
                kept.close()
                kept = http.client.HTTPConnection(host, port, timeout=3)
            target = self.targets[i % len(self.targets)]
            try:
                _http_get(f"http://{target[0]}:{target[1]}/hostname")
                self.new_ok += 1
            except OSError as exc:
                self.new_failed.append(f"{target} {exc!r}")
            time.sleep(0.05)
        kept.close()


@pytest.fixture(scope="module")
def web(cluster: RealCluster) -> int:
    return serve_web(cluster)


def serve_web(cluster: RealCluster) -> int:
    """Two netexec pods behind a NodePort Service, answering on every node: its node port."""
    labels = {"app": "web"}
    netexec = ["netexec", "--http-port=8080"]
    cluster.apply(
        k.deployment("web", "default", images.agnhost_reference(), netexec, replicas=2),
        _node_port_service("web", labels),
    )
    cluster.kubectl("rollout", "status", "deployment/web", "--timeout=120s")
    node_port: int = cluster.get("service", "web")["spec"]["ports"][0]["nodePort"]
    for node in cluster.nodes:
        until(functools.partial(_answers, node.ip, node_port), f"web on {node.name}", within=60)
    return node_port


def _node_port_service(name: str, selector: dict[str, str]) -> dict[str, Any]:
    ports = [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]
    return k.service(name, "default", type="NodePort", ports=ports, selector=selector)


def _answers(host: str, port: int) -> bool:
    try:
        _http_get(f"http://{host}:{port}/hostname")
    except OSError:
        return False
    return True


def _check(traffic: Traffic) -> None:
    assert traffic.new_failed == []
    assert traffic.kept_failed == []
    # Enough traffic went through to mean something.
    assert traffic.new_ok >= 20
    assert traffic.kept_ok >= 20


def test_rolling_the_daemonset_breaks_no_connection(cluster: RealCluster, web: int) -> None:
    before = {p["metadata"]["uid"] for p in cluster.get("pods", "-n", "kube-system")["items"]}
    with Traffic([(n.ip, web) for n in cluster.nodes]) as traffic:
        time.sleep(2)
        cluster.kubectl("-n", "kube-system", "rollout", "restart", "daemonset/kpng")
        addons.wait_rollout(cluster, "daemonset/kpng", 180)
        time.sleep(2)
    after = cluster.get("pods", "-n", "kube-system", "-l", "k8s-app=kpng")["items"]
    assert len(after) == 2
    assert not {p["metadata"]["uid"] for p in after} & before
    _check(traffic)


def test_traffic_flows_while_kubelets_and_the_api_server_restart(
    cluster: RealCluster, web: int
) -> None:
    plane = cluster.plane
    assert plane is not None
    with Traffic([(n.ip, web) for n in cluster.nodes]) as traffic:
        for node in cluster.nodes:
            node.restart_kubelet()
        cluster.wait_nodes_ready()
        port = plane.apiserver_port
        plane.stop_apiserver()
        time.sleep(5)
        plane.start_apiserver(port)
        time.sleep(2)
    _check(traffic)
    # kpng followed the API server back: a Service made afterwards is programmed.
    cluster.apply(_node_port_service("after-restart", {"app": "web"}))
    node_port = cluster.get("service", "after-restart")["spec"]["ports"][0]["nodePort"]
    host = cluster.nodes[0].ip
    until(lambda: _answers(host, node_port), "a Service made after the restart", within=60)


def test_a_deleted_pod_is_served_while_it_terminates_then_rejected(
    cluster: RealCluster,
) -> None:
    """With no other endpoint, traffic falls back to the serving, terminating one, and the
    Service rejects connections at once when it is gone."""
    labels = {"app": "lame"}
    pod = _pod(
        "lame", "node-2", ["netexec", "--http-port=8080"], labels, terminationGracePeriodSeconds=60
    )
    pod["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "20"]}}}
    cluster.apply(pod, _node_port_service("lame", labels))
    cluster.kubectl("wait", "--for=condition=Ready", "pod/lame")
    node_port = cluster.get("service", "lame")["spec"]["ports"][0]["nodePort"]
    host = cluster.nodes[0].ip
    until(lambda: _answers(host, node_port), "lame's node port", within=60)

    with Traffic([(host, node_port)]) as traffic:
        cluster.kubectl("delete", "pod", "lame", "--wait=false")

        def terminating() -> bool:
            slices = cluster.get("endpointslices", "-l", "kubernetes.io/service-name=lame")
            conditions = [
                e["conditions"] for s in slices["items"] for e in s.get("endpoints") or []
            ]
            return conditions == [{"ready": False, "serving": True, "terminating": True}]

        until(terminating, "lame's endpoint serving and terminating", within=30)
        time.sleep(5)  # new connections keep reaching it through the fallback
    _check(traffic)
    cluster.kubectl("wait", "--for=delete", "pod/lame", "--timeout=90s")

    def refused() -> bool:
        try:
            _http_get(f"http://{host}:{node_port}/hostname")
        except urllib.error.URLError as exc:
            return isinstance(exc.reason, ConnectionRefusedError)
        except OSError:
            return False
        return False

    until(refused, "connection refused (REJECT) once no endpoint is left", within=30)
