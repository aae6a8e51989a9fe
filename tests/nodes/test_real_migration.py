"""The runbook (docs/operators/migration.md) run on real nodes, under traffic: two nodes start
with kube-proxy's add-on in iptables mode; the runbook's step 1 deploys kpng (to-iptables) on no
node yet; each node is moved to kpng (step 2: its label, kpng's warning, ``kpng cleanup
kube-proxy`` from ``kubectl debug node``), then rolled back ("Rolling back": the label removed,
kpng's mark chain removed), then the whole cluster is (step 1's patch undone, kpng's DaemonSet
deleted). It runs twice, once per way the runbook deploys kpng: deploy/kpng.yaml with its node
selector uncommented, and the Helm chart installed with that selector in its values (``helm
uninstall`` then removes it).

Meanwhile a client pod on each node opens a new connection after another to the Service's
ClusterIP and to both nodes' node ports, and the machine keeps one connection alive to a node
port beside new ones: no connection may fail, at any step. Zero holds because neither proxy
removes the other's rules when it starts or stops: to-iptables takes kube-proxy's chains and
jumps over in its first restore (and kube-proxy takes them back), and conntrack keeps
established connections on their endpoints meanwhile.

Bounded: the clients stop after a number of rounds or minutes (their pods' deadline too), the
machine's requests likewise, every wait has a timeout, and the cluster (pods included) is
removed whatever happens.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kpng.testing.waiting import until
from rig import addons, chart, images
from rig import kubeapi as k
from rig.nodes import RealCluster, RealNode
from tests.nodes.test_real_cluster import Traffic, _answers, _node_port_service

pytestmark = pytest.mark.timeout(600)

LABEL = "kpng.io/proxy"
FAMILIES = ("iptables", "ip6tables")
"""kube-proxy and kpng program both, the nodes having IPv6 on their loopback."""
BUILT_IN_CHAINS = ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING")
SELECTOR_LINE = "# kpng.io/proxy: kpng"
"""The line of deploy/kpng.yaml that the runbook's step 1 uncomments (with sed)."""
MIGRATION_VALUES = {"nodeSelector": {LABEL: "kpng"}}
"""The runbook's ``kpng-migration.yaml``, given to ``helm install`` after the cluster's values."""
DEPLOYS = ("manifest", "chart")
"""How the runbook deploys kpng: deploy/kpng.yaml (with ``envsubst`` and ``sed``), or the chart."""
KUBE_PROXY_AFFINITY = {
    "spec": {
        "template": {
            "spec": {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": LABEL, "operator": "NotIn", "values": ["kpng"]}
                                    ]
                                }
                            ]
                        }
                    }
                }
            }
        }
    }
}
"""Step 1's patch of kube-proxy's DaemonSet."""

CLIENT_SCRIPT = r"""
ok=0 failed=0 rounds=0
end=$((SECONDS + DEADLINE))
while [ "$rounds" -lt "$ROUNDS" ] && [ "$SECONDS" -lt "$end" ] && [ ! -e /tmp/stop ]; do
  for url in $TARGETS; do
    if err=$(curl -sSf --max-time 3 -o /dev/null "$url" 2>&1); then
      ok=$((ok + 1))
    else
      failed=$((failed + 1))
      echo "failed $(date +%s.%N) $url $err"
    fi
  done
  rounds=$((rounds + 1))
  sleep 0.2
done
why=rounds
[ "$SECONDS" -ge "$end" ] && why=deadline
[ -e /tmp/stop ] && why=stopped
echo "total ok=$ok failed=$failed rounds=$rounds end=$why"
"""
"""A new connection to each target after another, bounded in rounds and time; one line per
failure (with when), one line of totals."""
CLIENT_ROUNDS = 2000
CLIENT_DEADLINE_S = 480

_TOTAL = re.compile(r"^total ok=(\d+) failed=(\d+) rounds=(\d+) end=(\w+)$", re.MULTILINE)


@dataclass
class ClientResult:
    node: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    end: str = ""


@pytest.fixture
def cluster() -> Iterator[RealCluster]:
    """Two real nodes with kube-proxy's add-on in iptables mode, as kubeadm deploys it."""
    archives = images.node_images(with_kube_proxy=True)
    with RealCluster(nodes=2, images=archives, pause_image=images.pause_reference()) as cluster:
        addons.deploy_kube_proxy(cluster, images.kube_proxy_reference(), mode="iptables")
        yield cluster


class Runbook:
    """docs/operators/migration.md's commands, each noted with the time it ran."""

    def __init__(self, cluster: RealCluster, deploy: str) -> None:
        self.cluster = cluster
        self.deploy = deploy
        self.timeline: list[str] = []

    def note(self, what: str) -> None:
        self.timeline.append(f"{time.time():.1f} {what}")

    def kube_system(self, *args: str) -> str:
        return self.cluster.kubectl("-n", "kube-system", *args)

    def proxy_pods(self, app: str, node: str) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = self.cluster.get(
            "pods", "-n", "kube-system", "-l", f"k8s-app={app}",
            "--field-selector", f"spec.nodeName={node}",
        )["items"]  # fmt: skip
        return pods

    def ready_alone(self, app: str, node: str) -> bool:
        """``app``'s pod is Ready on the node, and no other proxy's pod is left there."""
        other = "kube-proxy" if app == "kpng" else "kpng"
        pods = self.proxy_pods(app, node)
        return (
            len(pods) == 1
            and "deletionTimestamp" not in pods[0]["metadata"]
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in pods[0]["status"].get("conditions", [])
            )
            and not self.proxy_pods(other, node)
        )

    def on_node(self, node: str, *argv: str) -> str:
        return addons.debug_node(self.cluster, node, images.KPNG_REFERENCE, argv)

    # The runbook's sections.

    def deploy_kpng_on_no_node(self) -> None:
        self.note("step 1: kube-proxy's affinity, kpng's DaemonSet")
        patch = json.dumps(KUBE_PROXY_AFFINITY)
        self.kube_system("patch", "daemonset", "kube-proxy", "--type", "merge", "-p", patch)
        addons.wait_rollout(self.cluster, "daemonset/kube-proxy", 180)
        # kube-proxy's ConfigMap, copied: its mode; clusterCIDR is the cluster's in both.
        if self.deploy == "chart":
            cluster_values = addons.chart_values(
                self.cluster, images.KPNG_REFERENCE, mode="iptables"
            )
            chart.install(self.cluster.kubeconfig, cluster_values, MIGRATION_VALUES)
        else:
            self.cluster.kubectl("apply", "-f", "-", input=addons.rbac_manifest())
            manifest = addons.kpng_manifest(self.cluster, images.KPNG_REFERENCE, mode="iptables")
            assert SELECTOR_LINE in manifest
            manifest = manifest.replace(SELECTOR_LINE, SELECTOR_LINE.removeprefix("# "))
            self.cluster.kubectl("apply", "-f", "-", input=manifest)
        daemonset = self.cluster.get("daemonset", "-n", "kube-system", "kpng")
        selector = daemonset["spec"]["template"]["spec"]["nodeSelector"]
        assert selector == {LABEL: "kpng", "kubernetes.io/os": "linux"}, selector
        assert daemonset["status"].get("desiredNumberScheduled", 0) == 0
        self.note("step 1 done")

    def move(self, node: RealNode) -> None:
        self.note(f"step 2: {node.name} labelled")
        self.cluster.kubectl("label", "node", node.name, f"{LABEL}=kpng")
        until(lambda: self.ready_alone("kpng", node.name), f"kpng alone on {node.name}", within=120)
        self.note(f"step 2.1: kpng Ready on {node.name}, kube-proxy gone")
        (pod,) = self.proxy_pods("kpng", node.name)
        log = self.kube_system("logs", pod["metadata"]["name"])
        (warning,) = [
            line for line in log.splitlines() if "kube-proxy's leftovers are here" in line
        ]
        # to-iptables took kube-proxy's chains over; its canaries and health check chain stay.
        assert "iptables mode's iptables-nft IPv4 chains: " in warning, warning
        assert "KUBE-PROXY-CANARY" in warning, warning
        removed = self.on_node(node.name, "kpng", "cleanup", "kube-proxy")
        self.note(f"step 2.3: kube-proxy's leftovers removed on {node.name}")
        assert removed.startswith("kube-proxy: removed iptables mode's iptables-nft IPv4 chains: ")
        for family in FAMILIES:
            saved = node.exec(f"{family}-save")
            assert "KUBE-PROXY-CANARY" not in saved
            assert ":KPNG-IPTABLES" in saved
            _assert_one_jump_each(saved)
        assert self.on_node(node.name, "kpng", "cleanup", "kube-proxy") == (
            "kube-proxy: nothing to remove\n"
        )

    def roll_back(self, node: RealNode) -> None:
        self.note(f"rolling back: {node.name} unlabelled")
        self.cluster.kubectl("label", "node", node.name, f"{LABEL}-")
        until(
            lambda: self.ready_alone("kube-proxy", node.name),
            f"kube-proxy alone on {node.name}",
            within=120,
        )
        self.note(f"rolling back: kube-proxy Ready on {node.name}, kpng gone")
        for family in FAMILIES:
            self.on_node(node.name, family, "-t", "nat", "-X", "KPNG-IPTABLES")
        self.note(f"rolling back: kpng's marks removed on {node.name}")
        for family in FAMILIES:
            saved = node.exec(f"{family}-save")
            assert ":KPNG-IPTABLES" not in saved
            assert ":KUBE-PROXY-CANARY" in saved
            _assert_one_jump_each(saved)

    def roll_back_the_cluster(self) -> None:
        self.note("rolling back the cluster: step 1 undone")
        unpatch = json.dumps([{"op": "remove", "path": "/spec/template/spec/affinity"}])
        self.kube_system("patch", "daemonset", "kube-proxy", "--type", "json", "-p", unpatch)
        if self.deploy == "chart":
            chart.uninstall(self.cluster.kubeconfig)
        else:
            self.kube_system("delete", "daemonset", "kpng")
        addons.wait_rollout(self.cluster, "daemonset/kube-proxy", 180)
        self.note("rolling back the cluster: done")


def _assert_one_jump_each(saved: str) -> None:
    """Each built-in chain jumps once to each KUBE- chain: kpng's jumps are kube-proxy's, so
    that neither adds its own beside the other's."""
    jumps: list[tuple[str, str, str]] = []
    table = ""
    for line in saved.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith("-A ") and line.split()[1] in BUILT_IN_CHAINS and "-j KUBE-" in line:
            jumps.append((table, line.split()[1], line.rsplit("-j ", 1)[1]))
    twice = [jump for jump, count in collections.Counter(jumps).items() if count > 1]
    assert twice == [], saved


def _serve(cluster: RealCluster) -> tuple[str, int]:
    """A netexec pod on each node behind a NodePort Service: its ClusterIP and node port,
    answering on both nodes."""
    labels = {"app": "web"}
    image = images.agnhost_reference()
    netexec = ["netexec", "--http-port=8080"]
    cluster.apply(
        *(k.pod(f"web-{n.name}", "default", image, netexec, node=n.name, labels=labels)
          for n in cluster.nodes),
        _node_port_service("web", labels),
    )  # fmt: skip
    cluster.kubectl("wait", "--for=condition=Ready", "pod", "-l", "app=web", "--timeout=120s")
    spec = cluster.get("service", "web")["spec"]
    node_port: int = spec["ports"][0]["nodePort"]
    for node in cluster.nodes:
        answers = functools.partial(_answers, node.ip, node_port)
        until(answers, f"web on {node.name}", within=60)
    return spec["clusterIP"], node_port


def _start_clients(cluster: RealCluster, cluster_ip: str, node_port: int) -> None:
    targets = [f"http://{cluster_ip}/hostname"]
    targets += [f"http://{n.ip}:{node_port}/hostname" for n in cluster.nodes]
    env = {"TARGETS": " ".join(targets), "ROUNDS": CLIENT_ROUNDS, "DEADLINE": CLIENT_DEADLINE_S}
    pods = []
    for node in cluster.nodes:
        pod = k.pod(
            f"client-{node.name}", "default", images.agnhost_reference(), [],
            node=node.name, labels={"app": "client"}, restartPolicy="Never",
            activeDeadlineSeconds=CLIENT_DEADLINE_S + 60,
        )  # fmt: skip
        container = pod["spec"]["containers"][0]
        container["command"] = ["bash", "-c", CLIENT_SCRIPT]
        container["env"] = [{"name": n, "value": str(v)} for n, v in env.items()]
        pods.append(pod)
    cluster.apply(*pods)
    cluster.kubectl("wait", "--for=condition=Ready", "pod", "-l", "app=client", "--timeout=120s")


def _stop_clients(cluster: RealCluster) -> list[ClientResult]:
    results = []
    for node in cluster.nodes:
        pod = f"client-{node.name}"
        cluster.kubectl("exec", pod, "--", "touch", "/tmp/stop")
        cluster.kubectl(
            "wait", "--for=jsonpath={.status.phase}=Succeeded", f"pod/{pod}", "--timeout=60s"
        )
        log = cluster.kubectl("logs", pod)
        total = _TOTAL.search(log)
        assert total is not None, log
        failed = [line for line in log.splitlines() if line.startswith("failed ")]
        assert len(failed) == int(total.group(2))
        results.append(ClientResult(node.name, int(total.group(1)), failed, total.group(4)))
    return results


@pytest.mark.parametrize("deploy", DEPLOYS)
def test_each_node_moves_to_kpng_and_back_as_the_runbook_says_without_a_failed_connection(
    cluster: RealCluster, deploy: str
) -> None:
    cluster_ip, node_port = _serve(cluster)
    runbook = Runbook(cluster, deploy)
    _start_clients(cluster, cluster_ip, node_port)
    runbook.note("clients started")
    max_requests = 20000
    with Traffic([(n.ip, node_port) for n in cluster.nodes], max_requests=max_requests) as traffic:
        runbook.deploy_kpng_on_no_node()
        for node in cluster.nodes:
            runbook.move(node)
        for node in cluster.nodes:
            runbook.roll_back(node)
        runbook.roll_back_the_cluster()
        time.sleep(2)
    clients = _stop_clients(cluster)
    runbook.note("clients stopped")

    timeline = "\n".join(runbook.timeline)
    for client in clients:
        assert client.failed == [], f"{client.node}'s client:\n{timeline}"
        # It ran throughout, and enough to mean something: each step saw connections.
        assert client.end == "stopped", client
        assert client.ok >= 300, client
    assert traffic.new_failed == [], timeline
    assert traffic.kept_failed == [], timeline
    assert traffic.new_ok + len(traffic.new_failed) < max_requests
    assert traffic.new_ok >= 300
    assert traffic.kept_ok >= 300
    print(
        timeline,
        *(f"{c.node}'s client: {c.ok} connections, {len(c.failed)} failed" for c in clients),
        f"the machine: {traffic.new_ok} new and {traffic.kept_ok} kept-alive requests",
        sep="\n",
    )
