"""kpng with a central brain on real nodes: deploy/kpng-central.yaml's Deployment of brains and a
backend per node that never talks to the API server. Nodes authenticate with projected tokens,
fail over between brains, and keep serving while one is killed or the Deployment is rolled."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.testing.waiting import until
from rig import addons, images, tcpinfo
from rig.nodes import RealCluster, RealNode
from tests.nodes.test_real_cluster import (
    Traffic,
    _answers,
    _http_get,
    _node_port_service,
    deployed,
    serve_web,
)
from tests.pure.test_metrics import Samples

pytestmark = pytest.mark.timeout(900)

RESUMED_BYTES = 1024
"""An unchanged resume's bytes received, at most, beyond what opening any connection costs
(docs/design/resume.md)."""


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


_GET = (
    "import sys, urllib.request as u; "
    "sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())"
)
AGENT_METRICS = 10249
"""The node agents' /metrics, on their nodes' loopback (deploy/kpng-central.yaml)."""


def _scraped(node: RealNode, port: int) -> Samples:
    """A scrape of the /metrics on ``node``'s loopback ``port``, from inside the node."""
    text = node.exec("python3", "-c", _GET, f"http://127.0.0.1:{port}/metrics")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


def _syncs(node: RealNode) -> float:
    """The node's rule syncs so far (kube-proxy's sync duration histogram, every attempt)."""
    return _sum(_scraped(node, AGENT_METRICS), "kubeproxy_sync_proxy_rules_duration_seconds_count")


def _brain_pods(cluster: RealCluster) -> list[dict[str, Any]]:
    pods: list[dict[str, Any]] = cluster.get(
        "pods", "-n", "kube-system", "-l", "k8s-app=kpng-brain"
    )["items"]
    return pods


def _watching(node: RealNode) -> tcpinfo.Connection:
    """The node agent's one connection to a brain, from the node's end."""
    connections = tcpinfo.established(f":{addons.BRAIN_PORT}", run=lambda argv: node.exec(*argv))
    assert len(connections) == 1, f"{node.name}'s agent: {connections}"
    return connections[0]


def _brain_container(cluster: RealCluster, brain: RealNode) -> dict[str, Any]:
    """The status of the brain container on ``brain``."""
    (pod,) = [p for p in _brain_pods(cluster) if p["spec"]["nodeName"] == brain.name]
    statuses: list[dict[str, Any]] = pod["status"]["containerStatuses"]
    (container,) = statuses
    return container


def _kill_brain(cluster: RealCluster, brain: RealNode) -> int:
    """SIGKILL the brain on ``brain`` (its kubelet starts it again). Returns the container's
    restarts before the kill."""
    container = _brain_container(cluster, brain)
    brain.ctr("tasks", "kill", "--signal", "SIGKILL", container["containerID"].split("//")[1])
    return int(container["restartCount"])


def _brains_ready(cluster: RealCluster, restarted: RealNode, restarts: int) -> bool:
    """Every brain Ready, the one on ``restarted`` in a container started after ``restarts``.
    Ready alone is not enough: until the kubelet notices the kill, the API still shows the dead
    container Ready."""
    pods = _brain_pods(cluster)
    return (
        len(pods) == len(cluster.nodes)
        and all(
            status["ready"] for p in pods for status in p["status"].get("containerStatuses", [])
        )
        and _brain_container(cluster, restarted)["restartCount"] > restarts
    )


def _live_elsewhere(node: RealNode, left: str, *, firsts: float = -1.0) -> bool:
    """The node's agent is live on one connection, to a brain other than ``left``, after more
    than ``firsts`` first states."""
    connections = tcpinfo.established(f":{addons.BRAIN_PORT}", run=lambda argv: node.exec(*argv))
    if len(connections) != 1 or connections[0].peer_host == left:
        return False
    samples = _scraped(node, AGENT_METRICS)
    return (
        _sum(samples, "kpng_watch_up") == 1
        and _sum(samples, "kpng_watch_first_states_total") > firsts
    )


_BARE = """
import sys, grpc
channel = grpc.secure_channel(
    sys.argv[1], grpc.ssl_channel_credentials(open(sys.argv[2], "rb").read())
)
grpc.channel_ready_future(channel).result(timeout=30)
print("connected", flush=True)
sys.stdin.read()
"""
"""A gRPC channel to a brain that opens no call: the node agents' TLS (gRPC's own), both
HTTP/2 prefaces and their settings."""


def _bare_connection(cluster: RealCluster, node: RealNode, brain: RealNode) -> tcpinfo.Connection:
    """The bytes any connection from ``node`` to ``brain``'s watch costs before its first call,
    by the kernel's count, read a second after it connected: what a resume cannot save."""
    ca = cluster.workdir / "kpng-brain-ca.crt"
    ca.write_text(cluster.get("configmap", "-n", "kube-system", "kpng-brain-ca")["data"]["ca.crt"])
    target = f"{brain.ip}:{addons.BRAIN_PORT}"

    def connections() -> list[tcpinfo.Connection]:
        return tcpinfo.established(target, run=lambda argv: node.exec(*argv))

    others = {c.local for c in connections()}
    argv = node.netns_argv([sys.executable, "-c", _BARE, target, str(ca)])
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdin is not None
        try:
            assert proc.stdout.readline().strip() == "connected"
            time.sleep(1)
            (connection,) = [c for c in connections() if c.local not in others]
        finally:
            proc.stdin.close()
    return connection


@dataclasses.dataclass(frozen=True)
class Resume:
    """One node agent's move to the surviving brain, as the kernel, the agent and the brain
    counted it."""

    node: str
    up: int
    down: int
    first_state: str
    """How the agent's new stream began (kpng_watch_first_states_total{how})."""
    applies: float
    """Its backend's applies over the move (kpng_backend_apply_duration_seconds_count)."""
    bare: tcpinfo.Connection
    """A connection from the node to the same brain that opens no call, for comparison."""


def _fail_over(cluster: RealCluster) -> tuple[list[Resume], dict[str, float], float]:
    """Kill the brain every node agent watches; each moves to the other. Returns each agent's
    resume (its connection's bytes read once it is live again), the surviving brain's resumes
    by outcome over the move (kpng_api_resumes_total), and the seconds until every agent was
    live again."""
    by_ip = {n.ip: n for n in cluster.nodes}
    watched = {_watching(n).peer_host for n in cluster.nodes}
    if len(watched) > 1:
        # The agents came up on different brains: gather them on one first (a fail-over too,
        # not measured), so that the one measured moves every node.
        moved = by_ip[_watching(cluster.nodes[-1]).peer_host]
        print(f"\n(the agents watched both brains: {moved.name}'s is killed first, unmeasured)")
        restarts = _kill_brain(cluster, moved)
        for n in cluster.nodes:
            until(
                functools.partial(_live_elsewhere, n, moved.ip),
                f"{n.name}'s agent live off {moved.name}'s brain",
                within=60,
            )
        until(
            functools.partial(_brains_ready, cluster, moved, restarts),
            f"both brains Ready, {moved.name}'s restarted",
            within=120,
        )
    (victim_ip,) = {_watching(n).peer_host for n in cluster.nodes}
    victim = by_ip[victim_ip]
    (survivor,) = [n for n in cluster.nodes if n is not victim]
    agents = {n.name: _scraped(n, AGENT_METRICS) for n in cluster.nodes}
    brain = _scraped(survivor, addons.BRAIN_METRICS_PORT)
    start = time.monotonic()
    _kill_brain(cluster, victim)
    for n in cluster.nodes:
        firsts = _sum(agents[n.name], "kpng_watch_first_states_total")
        until(
            functools.partial(_live_elsewhere, n, victim.ip, firsts=firsts),
            f"{n.name}'s agent live on {survivor.name}'s brain",
            within=60,
        )
    seconds = time.monotonic() - start
    resumes: list[Resume] = []
    for n in cluster.nodes:
        connection = _watching(n)
        assert connection.peer_host == survivor.ip
        now = _scraped(n, AGENT_METRICS)
        before = agents[n.name]
        (how,) = [
            how
            for how in ("whole", "resumed")
            if _sum(now, "kpng_watch_first_states_total", how=how)
            > _sum(before, "kpng_watch_first_states_total", how=how)
        ]
        count = "kpng_backend_apply_duration_seconds_count"
        applies = _sum(now, count, backend="to-nft") - _sum(before, count, backend="to-nft")
        bare = _bare_connection(cluster, n, survivor)
        resumes.append(Resume(n.name, connection.up, connection.down, how, applies, bare))
    after = _scraped(survivor, addons.BRAIN_METRICS_PORT)
    outcomes = {
        labels[0][1]: value - brain.get((name, labels), 0.0)
        for (name, labels), value in after.items()
        if name == "kpng_api_resumes_total" and value > brain.get((name, labels), 0.0)
    }
    return resumes, outcomes, seconds


def _table(resumes: list[Resume], outcomes: dict[str, float], seconds: float) -> str:
    """The fail-over, a node a line. The brain counts outcomes, not whose they were: with one
    outcome for every resume, it is each node's."""
    (outcome,) = outcomes if len(outcomes) == 1 else [", ".join(sorted(outcomes)) or "none"]
    lines = [
        f"A brain lost: every node agent live on the other in {seconds:.1f} s. Bytes on its "
        "new connection (TCP payload), and beyond a connection that opens no call (+):",
        "| node | bytes received | + | bytes sent | + | brain's outcome | agent's first state "
        "| backend applies |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.node} | {r.down:,} | {r.down - r.bare.down:,} | {r.up:,} | {r.up - r.bare.up:,} "
        f"| {outcome} | {r.first_state} | {r.applies:g} |"
        for r in resumes
    ]
    return "\n".join(lines)


def test_a_killed_brain_and_a_rolled_deployment_break_nothing(
    cluster: RealCluster, web: int
) -> None:
    """Killing the brain the nodes watch moves them to the other: each resumes from what it
    holds (the brain finds nothing changed), receives some bytes only, and its backend applies
    nothing. Rolling the Deployment replaces both, one at a time; traffic flows throughout, and
    a change made while a brain was away reaches both nodes."""
    with Traffic([(n.ip, web) for n in cluster.nodes]) as traffic:
        time.sleep(2)
        syncs = [_syncs(node) for node in cluster.nodes]
        resumes, outcomes, seconds = _fail_over(cluster)
        print("\n" + _table(resumes, outcomes, seconds))
        assert outcomes == {"unchanged": len(cluster.nodes)}
        for resume in resumes:
            assert resume.first_state == "resumed"
            assert resume.applies == 0
            # TLS (gRPC's handshake, with its post-quantum key shares) and HTTP/2's prefaces are
            # paid by any connection; what the resume itself brought is within a kilobyte.
            assert resume.down - resume.bare.down <= RESUMED_BYTES, resume
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
