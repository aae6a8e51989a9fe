"""kpng's DaemonSet on a dual-stack cluster of real nodes (issue 41): Services of both families
answer over their IPv4 and their IPv6 ClusterIP from a pod on another node, and over both
families' node ports.

Opt-in like the other real-node tests (root and the node programs); upstream's dual-stack e2e
tests run with ``make e2e DUAL_STACK=1``.
"""

from __future__ import annotations

import functools
import ipaddress
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kpng.testing.waiting import until
from rig import addons, images
from rig import kubeapi as k
from rig.nodes import RealCluster, missing_requirements

pytestmark = [
    pytest.mark.realcluster,
    pytest.mark.skipif(bool(missing_requirements()), reason=missing_requirements() or "-"),
    pytest.mark.timeout(900),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RealCluster]:
    with RealCluster(
        nodes=2,
        images=images.node_images(),
        pause_image=images.pause_reference(),
        dual_stack=True,
    ) as cluster:
        addons.deploy_kpng(cluster, images.KPNG_REFERENCE, shape="daemonset")
        yield cluster


def _url(host: str, port: int) -> str:
    literal = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    return f"http://{literal}:{port}/hostname"


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as response:
        body: bytes = response.read()
        return body.decode()


def _curl(cluster: RealCluster, pod: str, url: str) -> str:
    # -g: the brackets of an IPv6 literal are not a curl glob.
    return cluster.kubectl("exec", pod, "--", "curl", "-gsS", "--max-time", "3", url, check=False)


def _answered(cluster: RealCluster, pod: str, url: str, expected: str) -> bool:
    return _curl(cluster, pod, url) == expected


def _service(name: str, policy: str, selector: dict[str, str]) -> dict[str, Any]:
    ports = [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]
    service = k.service(name, "default", type="NodePort", ports=ports, selector=selector)
    service["spec"]["ipFamilyPolicy"] = policy
    return service


def test_nodes_are_dual_stack_and_forward_ipv6(cluster: RealCluster) -> None:
    for item in cluster.get("nodes")["items"]:
        families = {ipaddress.ip_network(c).version for c in item["spec"]["podCIDRs"]}
        internal = [a["address"] for a in item["status"]["addresses"] if a["type"] == "InternalIP"]
        assert families == {4, 6}
        assert [ipaddress.ip_address(a).version for a in internal] == [4, 6]
    for node in cluster.nodes:
        for key in ("net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"):
            assert node.exec("sysctl", "-n", key).strip() == "1"


@pytest.mark.parametrize("policy", ["PreferDualStack", "RequireDualStack"])
def test_a_dual_stack_service_answers_on_both_families(cluster: RealCluster, policy: str) -> None:
    name = f"ds-{policy.lower()}"
    labels = {"app": f"{name}-server"}
    server, client = f"{name}-server", f"{name}-client"
    agnhost = images.agnhost_reference()
    cluster.apply(
        k.pod(server, "default", agnhost, ["netexec", "--http-port=8080"], node="node-2",
              labels=labels),
        k.pod(client, "default", agnhost, ["pause"], node="node-1", labels={"app": client}),
        _service(name, policy, labels),
    )  # fmt: skip
    cluster.kubectl(
        "wait", "--for=condition=Ready", "--timeout=180s", f"pod/{server}", f"pod/{client}"
    )
    spec = cluster.get("service", name)["spec"]
    cluster_ips = spec["clusterIPs"]
    assert spec["ipFamilies"] == ["IPv4", "IPv6"]
    assert [ipaddress.ip_address(ip).version for ip in cluster_ips] == [4, 6]
    node_port = spec["ports"][0]["nodePort"]
    node_ips = [ip for node in cluster.nodes for ip in (node.ip, node.ip6) if ip is not None]
    assert len(node_ips) == 4

    # From the pod on node-1: both ClusterIPs, and both families' node ports of both nodes (its
    # own node's sends the connection across to node-2).
    urls = [_url(ip, 80) for ip in cluster_ips] + [_url(ip, node_port) for ip in node_ips]
    for url in urls:
        answered = functools.partial(_answered, cluster, client, url, server)
        until(answered, f"{url} from {client}", within=60)
    # And from outside the cluster: the machine, on the bridge, to node-1's node port of each
    # family.
    node = cluster.nodes[0]
    assert node.ip6 is not None
    for ip in (node.ip, node.ip6):
        assert _http_get(_url(ip, node_port)) == server
