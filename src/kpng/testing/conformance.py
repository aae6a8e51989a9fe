"""The backend conformance suite: real connections through a network-namespace cluster.

Modelled on Kubernetes' sig-network Service e2e tests; the behaviour checked is kube-proxy's as of
Kubernetes 1.37 (docs/design/semantics.md), and cases that follow a rule of one release name it.
Three nodes (``node-1``: pods ``a1``, ``a2``; ``node-2``: ``b1``, ``b2``; ``node-3``: ``c1``) and an
external client; kpng runs in each node namespace as ``kpng file --input DIR to-local
--node-name N <backend>``, and each test writes its Services and EndpointSlices into DIR, then
checks what answers.

Run it against a backend (root, nft and iproute2 needed)::

    KPNG_CONFORMANCE_BACKEND="to-nft --cluster-cidr {cluster_cidrs}" \\
        pytest --pyargs kpng.testing.conformance

``KPNG_CONFORMANCE_BACKEND`` is the backend part of the command line (default as above;
``{cluster_cidrs}`` becomes the bed's pod CIDRs, ``{cgroup}`` and ``{pin_dir}`` the node's
cgroup and bpffs directory, for to-ebpf: see ``kpng.testing.netns``; one case restarts a node's
backend with kube-proxy's ``--nodeport-addresses`` appended), or the ``backend_command`` fixture
of a module that imports the suite, which may also list the cases it cannot pass
(``known_failures``). ``make test`` runs it for ``to-nft`` (``tests/kernel/test_conformance.py``),
``to-ebpf`` and ``to-iptables`` with both iptables variants.
Every wait is bounded.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kpng.testing import objects
from kpng.testing.netns import (
    CLUSTER_CIDRS,
    EXTERNAL_V4,
    ClusterSpec,
    Node,
    TestBed,
    available,
)
from kpng.testing.waiting import poll

DEFAULT_BACKEND = "to-nft --cluster-cidr {cluster_cidrs}"
SPEC = ClusterSpec.parse({"node-1": ["a1", "a2"], "node-2": ["b1", "b2"], "node-3": ["c1"]})
SETTLE_S = 15.0
"""How long a change may take to reach every node's rules."""

Json = dict[str, Any]

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@dataclass
class Cluster:
    bed: TestBed
    manifests: Path
    logs: Path
    """Where each node's backend writes its stderr (``<node>.log``)."""
    backend: str = DEFAULT_BACKEND.format(cluster_cidrs=",".join(CLUSTER_CIDRS))
    """The backend part of every node's command line."""
    flags: Sequence[str] = ()
    """kpng's own flags, before the source (``--metrics-bind-address ADDRESS``...)."""
    _ips: Iterator[int] = field(default_factory=lambda: itertools.count(10))
    _backends: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start_backend(
        self, node: str, *extra: str, prefix: Sequence[str] = (), api: str | None = None
    ) -> None:
        """(Re)start kpng on ``node``, with ``extra`` arguments after the backend's: the new
        process takes over the rules the old one left. ``prefix`` runs it, e.g. ``setpriv ...``
        to give it only some capabilities; with ``api``, it is a ``kpng local`` agent of the
        brain there (``start_brain``) instead of reading the manifests itself."""
        old = self._backends.pop(node, None)
        if old is not None:
            old.terminate()
            old.wait(timeout=10)
        argv = [*prefix, sys.executable, "-m", "kpng", *self.flags]
        if api is None:
            argv += ["file", "--input", str(self.manifests), "to-local"]
        else:
            argv += ["local", "--api", api]
        n = self.bed.nodes[node]
        backend = self.backend.format(cgroup=n.cgroup, pin_dir=n.pin_dir)
        argv += ["--node-name", node, *shlex.split(backend), *extra]
        with (self.logs / f"{node}.log").open("ab") as log:
            # The child keeps its own copy of the log file.
            self._backends[node] = self.bed.spawn(self.bed.nodes[node].netns, argv, stderr=log)

    def start_brain(self, node: str, api: str) -> subprocess.Popen[bytes]:
        """A brain serving the manifests on ``api`` (a ``unix://`` path), in ``node``'s
        namespace, for agents that ``start_backend(..., api=api)``; stopped with the bed."""
        argv = [sys.executable, "-m", "kpng", "file", "--input", str(self.manifests)]
        argv += ["to-api", "--listen", api]
        with (self.logs / "brain.log").open("ab") as log:
            return self.bed.spawn(self.bed.nodes[node].netns, argv, stderr=log)

    def cluster_ip(self) -> str:
        return f"10.96.0.{next(self._ips)}"

    def vip(self) -> str:
        return f"10.251.0.{next(self._ips)}"

    def write(self, name: str, *objects: Json) -> None:
        """Replace the manifest ``name`` (atomically: the source never sees half a file)."""
        tmp = self.manifests / f".{name}.tmp"
        tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))
        tmp.rename(self.manifests / f"{name}.json")

    def remove(self, name: str) -> None:
        """Remove the manifest ``name``. Its Services stay for the file source's removal delay
        (5 s), into the next test: each test has node ports of its own."""
        (self.manifests / f"{name}.json").unlink(missing_ok=True)

    def ns(self, who: str) -> str:
        """The namespace of a pod, a node or "external"."""
        if who == "external":
            assert self.bed.external is not None
            return self.bed.external.netns
        if who in self.bed.nodes:
            return self.bed.nodes[who].netns
        return self.bed.pods[who].netns

    def probe(self, who: str, proto: str, host: str, port: int, **kw: Any) -> list[str]:
        return self.bed.probe(self.ns(who), proto, host, port, **kw)

    def hold(self, who: str, proto: str, host: str, port: int) -> subprocess.Popen[str]:
        """A probe from ``who`` holding one TCP connection or connected UDP socket for 8 s
        (in the node's cgroup, where socket programs see it), returned once its first answer
        came: the connection stands before the test changes anything. The probe's own timeout
        bounds the wait."""
        argv = [sys.executable, "-m", "kpng.testing.probe", proto, host, str(port), "--hold", "8"]
        held = subprocess.Popen(
            self.bed.command_in(self.ns(who), argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert held.stderr is not None
        assert held.stderr.readline() == "connected\n"
        return held

    def eventually(
        self, who: str, proto: str, host: str, port: int, ok: Any, *, count: int = 1
    ) -> list[str]:
        """Probe until ``ok(results)`` holds (bounded by ``SETTLE_S``); the last results."""
        last: list[str] = []

        def check() -> bool:
            nonlocal last
            last = self.probe(who, proto, host, port, count=count, timeout=1.0)
            return bool(ok(last))

        assert poll(check, within=SETTLE_S, interval=0.2), f"last answers: {last}"
        return last


def node_object(node: Node, *, pod_cidrs: Sequence[str] | None = None) -> Json:
    """``node`` as the API server has it: its addresses, and its pod CIDRs (by default the
    ones the bed routes to it)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": {}},
        "spec": {
            "podCIDRs": list(pod_cidrs if pod_cidrs is not None else node.pod_cidrs),
        },
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node.ip4},
                {"type": "InternalIP", "address": node.ip6},
                {"type": "Hostname", "address": node.name},
            ]
        },
    }


@pytest.fixture(scope="module")
def backend_command() -> str:
    """The backend part of each node's command line: ``KPNG_CONFORMANCE_BACKEND``, or to-nft's.
    A test module that imports the suite overrides this fixture to run it against another."""
    return os.environ.get("KPNG_CONFORMANCE_BACKEND", DEFAULT_BACKEND)


@pytest.fixture(scope="module")
def known_failures() -> dict[str, str]:
    """The cases the backend under test cannot pass, by test id (``name[params]``), with the
    reason: each is run and must fail (a strict xfail), so a fix shows. None by default."""
    return {}


@pytest.fixture(autouse=True)
def known_failure_marker(request: pytest.FixtureRequest, known_failures: dict[str, str]) -> None:
    reason = known_failures.get(request.node.name)
    if reason is not None:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, backend_command: str) -> Iterator[Cluster]:
    """The three-node bed with the backend running on every node."""
    # {cgroup} and {pin_dir} are each node's, filled in as it starts.
    backend = backend_command.replace("{cluster_cidrs}", ",".join(CLUSTER_CIDRS))
    manifests = tmp_path_factory.mktemp("manifests")
    with TestBed(SPEC, sockets="{cgroup}" in backend) as bed:
        logs = tmp_path_factory.mktemp("logs")
        c = Cluster(bed, manifests, logs, backend)
        c.write("nodes", *(node_object(n) for n in bed.nodes.values()))
        for node in bed.nodes:
            c.start_backend(node)
        yield c


# --- manifests


def service(
    name: str,
    cluster_ip: str,
    ports: Sequence[Json],
    *,
    type: str = "ClusterIP",
    labels: Json | None = None,
    **spec: Any,
) -> Json:
    spec.setdefault("clusterIPs", [cluster_ip])
    return objects.service(
        name,
        "conformance",
        ports=list(ports),
        labels=labels,
        cluster_ip=cluster_ip,
        type=type,
        **spec,
    )


def port(name: str, port: int, target: int | str = 8080, proto: str = "TCP", **kw: Any) -> Json:
    return {"name": name, "port": port, "targetPort": target, "protocol": proto, **kw}


def endpoint_slice(
    cluster: Cluster,
    service_name: str,
    pods: Sequence[str],
    *,
    ports: Sequence[Json] = ({"name": "http", "port": 8080, "protocol": "TCP"},),
    v6: bool = False,
    conditions: Json | None = None,
    suffix: str = "x",
) -> Json:
    """A slice of the bed's ``pods`` (by name), in the family ``v6`` says."""
    endpoints = [
        objects.endpoint(
            cluster.bed.pods[p].ip6 if v6 else cluster.bed.pods[p].ip4,
            node=cluster.bed.pods[p].node.name,
            conditions=conditions,
            pod=p,
        )
        for p in pods
    ]
    return objects.endpoint_slice(
        f"{service_name}-{suffix}",
        "conformance",
        service_name,
        endpoints,
        ports=list(ports),
        address_type="IPv6" if v6 else "IPv4",
    )


def names(results: Sequence[str]) -> set[str]:
    return {r.split()[0] for r in results}


def answered(results: Sequence[str]) -> bool:
    return all(" " in r and not r.startswith("error") for r in results)


# --- the tests


def test_clusterip_reaches_every_endpoint_from_pods_on_every_node_and_from_nodes(
    cluster: Cluster,
) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "clusterip",
        service("web", ip, [port("http", 80)]),
        endpoint_slice(cluster, "web", ["a1", "b1"]),
    )
    for who in ("a2", "b2", "c1", "node-1", "node-2", "node-3"):
        cluster.eventually(who, "tcp", ip, 80, lambda r: names(r) == {"a1", "b1"}, count=20)
    cluster.remove("clusterip")


def test_clusterip_ipv6(cluster: Cluster) -> None:
    ip = "fd00:96::10"
    svc = service("web6", ip, [port("http", 80)], ipFamilies=["IPv6"])
    cluster.write("clusterip6", svc, endpoint_slice(cluster, "web6", ["b1"], v6=True))
    results = cluster.eventually("a1", "tcp", ip, 80, answered)
    assert results == [f"b1 {cluster.bed.pods['a1'].ip6}"], results
    cluster.remove("clusterip6")


def test_pod_source_ip_is_preserved_to_clusterip(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "source-ip", service("src", ip, [port("http", 80)]), endpoint_slice(cluster, "src", ["b1"])
    )
    results = cluster.eventually("c1", "tcp", ip, 80, answered)
    assert results == [f"b1 {cluster.bed.pods['c1'].ip4}"]
    cluster.remove("source-ip")


def test_nodeport_from_external_client_via_every_node(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "nodeport",
        service("np", ip, [port("http", 80, nodePort=30080)], type="NodePort"),
        endpoint_slice(cluster, "np", ["a1", "b1"]),
    )
    for node in cluster.bed.nodes.values():
        results = cluster.eventually("external", "tcp", node.ip4, 30080, answered, count=10)
        # eTP=Cluster: masqueraded, so the endpoint saw a node, not the client.
        assert all(not r.endswith(EXTERNAL_V4) for r in results)
    cluster.remove("nodeport")


def test_nodeport_addresses_serve_only_local_addresses_inside_them(cluster: Cluster) -> None:
    """kube-proxy's ``--nodeport-addresses``, given to node-3's backend: the node's own
    addresses inside the CIDRs, all local addresses of a family given none, never loopback, and
    never a packet that only passes through the node."""
    ip = cluster.cluster_ip()
    cluster.write(
        "nodeport-addresses",
        service(
            "npa",
            ip,
            [port("http", 80, nodePort=30090)],
            type="NodePort",
            clusterIPs=[ip, "fd00:96::30"],
            ipFamilies=["IPv4", "IPv6"],
            ipFamilyPolicy="RequireDualStack",
        ),
        endpoint_slice(cluster, "npa", ["a1"]),
        endpoint_slice(cluster, "npa", ["a1"], v6=True, suffix="v6"),
    )
    node3 = cluster.bed.nodes["node-3"]
    outside = "192.0.2.3"  # a node-3 address outside the CIDRs below
    cluster.bed.exec(node3.netns, ["ip", "addr", "add", f"{outside}/32", "dev", "eth0"])
    try:
        cluster.eventually("node-3", "tcp", outside, 30090, answered)  # default: every address
        cluster.start_backend("node-3", "--nodeport-addresses", "10.0.0.0/8,127.0.0.0/8")
        # Refused once the restarted backend's rules are in: nothing listens there.
        cluster.eventually("node-3", "tcp", outside, 30090, lambda r: r == ["refused"])
        assert names(cluster.eventually("external", "tcp", node3.ip4, 30090, answered)) == {"a1"}
        # IPv6 was given no CIDR: every local address of it.
        assert names(cluster.eventually("external", "tcp", node3.ip6, 30090, answered)) == {"a1"}
        # c1 reaches pod b1 on that port number through node-3, not the service, though
        # 10.0.0.0/8 holds b1's address (b1 does not listen there).
        assert cluster.probe("c1", "tcp", cluster.bed.pods["b1"].ip4, 30090) == ["refused"]
        # No localhost node ports, though 127.0.0.0/8 is given.
        assert cluster.probe("node-3", "tcp", "127.0.0.1", 30090) == ["refused"]
    finally:
        cluster.start_backend("node-3")
        cluster.eventually("node-3", "tcp", outside, 30090, answered)
        cluster.bed.exec(node3.netns, ["ip", "addr", "del", f"{outside}/32", "dev", "eth0"])
        cluster.remove("nodeport-addresses")


def test_nodeport_addresses_primary_serves_only_the_nodes_primary_ips(cluster: Cluster) -> None:
    """``--nodeport-addresses primary`` (kube-proxy's nftables default): the InternalIPs of
    node-3's Node object, not its other local addresses."""
    ip = cluster.cluster_ip()
    cluster.write(
        "nodeport-primary",
        service("npp", ip, [port("http", 80, nodePort=30091)], type="NodePort"),
        endpoint_slice(cluster, "npp", ["a1"]),
    )
    node3 = cluster.bed.nodes["node-3"]
    outside = "192.0.2.4"
    cluster.bed.exec(node3.netns, ["ip", "addr", "add", f"{outside}/32", "dev", "eth0"])
    try:
        cluster.eventually("node-3", "tcp", outside, 30091, answered)
        cluster.start_backend("node-3", "--nodeport-addresses", "primary")
        cluster.eventually("node-3", "tcp", outside, 30091, lambda r: r == ["refused"])
        assert names(cluster.eventually("external", "tcp", node3.ip4, 30091, answered)) == {"a1"}
    finally:
        cluster.start_backend("node-3")
        cluster.bed.exec(node3.netns, ["ip", "addr", "del", f"{outside}/32", "dev", "eth0"])
        cluster.remove("nodeport-primary")


@pytest.mark.parametrize(
    ("flags", "masqueraded"),
    [
        (["--masquerade-all"], True),
        (["--detect-local-mode", "NodeCIDR"], False),
        (
            ["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "vp"],
            False,
        ),
        (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "xx"], True),
        (["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"], True),
    ],
)
def test_local_traffic_detection_decides_what_is_masqueraded(
    cluster: Cluster, flags: list[str], masqueraded: bool
) -> None:
    """kube-proxy's --detect-local-mode and --masquerade-all: pod c1 reaches b1 through a
    ClusterIP with its own address unless node-3 does not see it as one of its pods."""
    ip = cluster.cluster_ip()
    cluster.write(
        "detect-local", service("dl", ip, [port("http", 80)]), endpoint_slice(cluster, "dl", ["b1"])
    )
    node3, c1 = cluster.bed.nodes["node-3"], cluster.bed.pods["c1"]
    try:
        cluster.start_backend("node-3", *flags)
        source = node3.ip4 if masqueraded else c1.ip4
        cluster.eventually("c1", "tcp", ip, 80, lambda r: r == [f"b1 {source}"])
    finally:
        cluster.start_backend("node-3")
        cluster.remove("detect-local")


def test_node_cidr_detection_follows_the_node_object(cluster: Cluster) -> None:
    """--detect-local-mode NodeCIDR reads spec.podCIDRs of the Node, and follows a change."""
    ip = cluster.cluster_ip()
    cluster.write(
        "node-cidr", service("nc", ip, [port("http", 80)]), endpoint_slice(cluster, "nc", ["b1"])
    )
    nodes = cluster.bed.nodes
    node3, c1 = nodes["node-3"], cluster.bed.pods["c1"]
    try:
        cluster.start_backend("node-3", "--detect-local-mode", "NodeCIDR")
        cluster.eventually("c1", "tcp", ip, 80, lambda r: r == [f"b1 {c1.ip4}"])
        others = [node_object(n) for n in nodes.values() if n is not node3]
        moved = node_object(node3, pod_cidrs=["10.99.0.0/24"])
        cluster.write("nodes", *others, moved)
        cluster.eventually("c1", "tcp", ip, 80, lambda r: r == [f"b1 {node3.ip4}"])
    finally:
        cluster.write("nodes", *(node_object(n) for n in nodes.values()))
        cluster.start_backend("node-3")
        cluster.remove("node-cidr")


def test_unallocated_ips_of_service_cidrs_are_dropped(cluster: Cluster) -> None:
    """As kube-proxy: a new connection to an IP of a ServiceCIDR that no service holds is
    dropped rather than routed on. Pod b1 also answers at such an IP, routed from node-3: it
    is reached until a ServiceCIDR holds the IP, and again once it is gone."""
    ip = cluster.cluster_ip()
    unallocated = "10.96.0.250"
    bed = cluster.bed
    b1, node2, node3 = bed.pods["b1"], bed.nodes["node-2"], bed.nodes["node-3"]
    veth = f"vp{b1.ip4.rsplit('.', 1)[1]}"
    routes = [
        (b1.netns, ["ip", "addr", "add", f"{unallocated}/32", "dev", "eth0"]),
        (node2.netns, ["ip", "route", "add", f"{unallocated}/32", "dev", veth]),
        (node3.netns, ["ip", "route", "add", f"{unallocated}/32", "via", node2.ip4]),
    ]
    service_cidr = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.0/24", "fd00:96::/112"]},
    }
    held = [service("held", ip, [port("http", 80)]), endpoint_slice(cluster, "held", ["b1"])]
    for netns, argv in routes:
        bed.exec(netns, argv)
    try:
        cluster.write("service-cidrs", *held)
        cluster.eventually("c1", "tcp", unallocated, 8080, answered)
        cluster.write("service-cidrs", *held, service_cidr)
        cluster.eventually("c1", "tcp", unallocated, 8080, lambda r: r == ["timeout"])
        cluster.eventually("c1", "tcp", ip, 80, answered)  # an allocated IP still answers
        cluster.write("service-cidrs", *held)
        cluster.eventually("c1", "tcp", unallocated, 8080, answered)
    finally:
        cluster.remove("service-cidrs")
        for netns, argv in reversed(routes):
            bed.exec(netns, [*argv[:2], "del", *argv[3:]])


def test_external_ip_from_external_client(cluster: Cluster) -> None:
    ip, vip = cluster.cluster_ip(), cluster.vip()
    cluster.write(
        "external-ip",
        service("ext", ip, [port("http", 80)], externalIPs=[vip]),
        endpoint_slice(cluster, "ext", ["b1"]),
    )
    assert names(cluster.eventually("external", "tcp", vip, 80, answered)) == {"b1"}
    cluster.remove("external-ip")


def test_load_balancer_ip_honours_source_ranges(cluster: Cluster) -> None:
    ip, vip = cluster.cluster_ip(), cluster.vip()

    def lb(ranges: list[str]) -> Json:
        svc = service(
            "lb",
            ip,
            [port("http", 80, nodePort=30081)],
            type="LoadBalancer",
            loadBalancerSourceRanges=ranges,
        )
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": vip}]}}
        return svc

    slice_ = endpoint_slice(cluster, "lb", ["a1"])
    cluster.write("lb", lb([f"{EXTERNAL_V4}/32"]), slice_)
    assert names(cluster.eventually("external", "tcp", vip, 80, answered)) == {"a1"}
    cluster.write("lb", lb(["10.99.0.0/16"]), slice_)
    cluster.eventually("external", "tcp", vip, 80, lambda r: r == ["timeout"])
    # Source ranges apply to the LB IP only, not to the node port.
    node1 = cluster.bed.nodes["node-1"].ip4
    assert names(cluster.eventually("external", "tcp", node1, 30081, answered)) == {"a1"}
    cluster.remove("lb")


def test_load_balancer_source_ranges_holding_the_node_let_it_reach_a_local_lb_ip(
    cluster: Cluster,
) -> None:
    """kube-proxy's allowFromNode: with node-3's IP inside the source ranges, node-3 reaches a
    VIP-like LB IP that is one of its own addresses, its connections coming from that IP."""
    ip, vip = cluster.cluster_ip(), cluster.vip()
    node3 = cluster.bed.nodes["node-3"]
    svc = service(
        "lb-local",
        ip,
        [port("http", 80)],
        type="LoadBalancer",
        loadBalancerSourceRanges=[f"{node3.ip4}/32"],
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": vip}]}}
    cluster.bed.exec(node3.netns, ["ip", "addr", "add", f"{vip}/32", "dev", "lo"])
    try:
        cluster.write("lb-local", svc, endpoint_slice(cluster, "lb-local", ["a1"]))
        assert names(cluster.eventually("node-3", "tcp", vip, 80, answered)) == {"a1"}
    finally:
        cluster.remove("lb-local")
        cluster.bed.exec(node3.netns, ["ip", "addr", "del", f"{vip}/32", "dev", "lo"])


def test_load_balancer_source_ranges_of_one_family_leave_the_other_open(
    cluster: Cluster,
) -> None:
    """As kube-proxy: a dual-stack LB service with IPv4 ranges only filters its IPv4 LB IP."""
    ip, vip = cluster.cluster_ip(), cluster.vip()
    vip6 = f"fd00:251::{vip.rsplit('.', 1)[1]}"
    svc = service(
        "lb-ds",
        ip,
        [port("http", 80, nodePort=30092)],
        type="LoadBalancer",
        clusterIPs=[ip, "fd00:96::31"],
        ipFamilies=["IPv4", "IPv6"],
        ipFamilyPolicy="RequireDualStack",
        loadBalancerSourceRanges=["10.99.0.0/16"],
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": vip}, {"ip": vip6}]}}
    cluster.write(
        "lb-dual-stack",
        svc,
        endpoint_slice(cluster, "lb-ds", ["a1"]),
        endpoint_slice(cluster, "lb-ds", ["a1"], v6=True, suffix="v6"),
    )
    assert names(cluster.eventually("external", "tcp", vip6, 80, answered)) == {"a1"}
    assert cluster.probe("external", "tcp", vip, 80, timeout=1.0) == ["timeout"]
    cluster.remove("lb-dual-stack")


def test_masquerade_picks_random_source_ports(cluster: Cluster) -> None:
    """As kube-proxy (``fully-random``): a masqueraded connection leaves the node from a random
    port, not the client's, which the kernel would otherwise keep."""
    ip = cluster.cluster_ip()
    dns = {"name": "dns", "port": 5353, "protocol": "UDP"}
    cluster.write(
        "masquerade-ports",
        service("masq", ip, [port("dns", 53, 5353, "UDP", nodePort=30089)], type="NodePort"),
        endpoint_slice(cluster, "masq", ["b1"], ports=[dns]),
    )
    node1 = cluster.bed.nodes["node-1"]
    cluster.eventually("external", "udp", node1.ip4, 30089, answered)
    results = cluster.probe("external", "udp", node1.ip4, 30089, count=10, ports=True)
    assert answered(results), results
    # eTP=Cluster: masqueraded to node-1, which sends from a port of its choice.
    assert {tuple(r.split()[:2]) for r in results} == {("b1", node1.ip4)}, results
    kept = [r for r in results if r.split()[2] == r.split()[3]]
    assert len(kept) <= 1, results  # random: each keeps its port with a chance of 1 in ~64k
    cluster.remove("masquerade-ports")


def test_session_affinity_client_ip_is_sticky(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "affinity",
        service(
            "sticky",
            ip,
            [port("http", 80)],
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice(cluster, "sticky", ["a1", "a2", "b1"]),
    )
    results = cluster.eventually("c1", "tcp", ip, 80, answered, count=15)
    assert len(names(results)) == 1, results
    cluster.remove("affinity")


def test_session_affinity_client_ip_sticks_through_node_ports_and_external_ips(
    cluster: Cluster,
) -> None:
    ip, vip = cluster.cluster_ip(), cluster.vip()
    cluster.write(
        "affinity-external",
        service(
            "sticky-ext",
            ip,
            [port("http", 80, nodePort=30084)],
            type="NodePort",
            externalIPs=[vip],
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice(cluster, "sticky-ext", ["a1", "b1", "c1"]),
    )
    for node in cluster.bed.nodes.values():
        results = cluster.eventually("external", "tcp", node.ip4, 30084, answered, count=15)
        assert len(names(results)) == 1, (node.name, results)
    results = cluster.eventually("external", "tcp", vip, 80, answered, count=15)
    assert len(names(results)) == 1, results
    cluster.remove("affinity-external")


def test_session_affinity_client_ip_is_sticky_over_ipv6(cluster: Cluster) -> None:
    ip = "fd00:96::20"
    cluster.write(
        "affinity6",
        service(
            "sticky6",
            ip,
            [port("http", 80)],
            ipFamilies=["IPv6"],
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice(cluster, "sticky6", ["a1", "b1", "c1"], v6=True),
    )
    results = cluster.eventually("b2", "tcp", ip, 80, answered, count=15)
    assert len(names(results)) == 1, results
    cluster.remove("affinity6")


AFFINITY_TIMEOUT_S = 2


def test_session_affinity_is_released_after_its_timeout(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "affinity-timeout",
        service(
            "brief",
            ip,
            [port("http", 80, nodePort=30085)],
            type="NodePort",
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": AFFINITY_TIMEOUT_S}},
        ),
        endpoint_slice(cluster, "brief", ["a1", "b1", "c1"]),
    )
    # Ten client hosts: addresses added to the external client on the underlay.
    ext = cluster.ns("external")
    sources = [f"10.250.0.{210 + i}" for i in range(10)]
    for source in sources:
        cluster.bed.exec(ext, ["ip", "addr", "add", f"{source}/24", "dev", "eth0"])
    try:
        node = cluster.bed.nodes["node-2"].ip4
        cluster.eventually("external", "tcp", node, 30085, answered)
        first = {}
        for source in sources:
            results = cluster.probe("external", "tcp", node, 30085, count=3, source=source)
            assert answered(results), (source, results)
            assert len(names(results)) == 1, (source, results)
            first[source] = names(results)
        time.sleep(AFFINITY_TIMEOUT_S + 1.5)
        after = {
            source: names(cluster.probe("external", "tcp", node, 30085, source=source))
            for source in sources
        }
        # Released, each client's next connection is a new pick among three endpoints: all ten
        # would keep their endpoint with a probability of (1/3)^10.
        assert any(after[source] != first[source] for source in sources), (first, after)
    finally:
        for source in sources:
            cluster.bed.exec(ext, ["ip", "addr", "del", f"{source}/24", "dev", "eth0"], check=False)
        cluster.remove("affinity-timeout")


def _sticky(who: str, results: Sequence[str]) -> str:
    """The one endpoint that answered ``who``."""
    assert answered(results), (who, results)
    got = names(results)
    assert len(got) == 1, (who, results)
    return got.pop()


def _own_node_ip(cluster: Cluster, who: str) -> str:
    """The address of the node whose rules handle ``who``'s connections (a pod's or a node's)."""
    if who in cluster.bed.nodes:
        return cluster.bed.nodes[who].ip4
    return cluster.bed.pods[who].node.ip4


def test_session_affinity_is_shared_by_cluster_ip_and_node_port(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "affinity-shared",
        service(
            "shared",
            ip,
            [port("http", 80, nodePort=30087)],
            type="NodePort",
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice(cluster, "shared", ["a1", "b1", "b2"]),
    )
    # Affinity is each node's: every client reaches the node port at its own node's address.
    # Five clients: with a memory per kind of traffic, all five would land on the same
    # endpoint both ways with a probability of (1/3)^5.
    for who in ("a2", "c1", "node-1", "node-2", "node-3"):
        first = _sticky(who, cluster.eventually(who, "tcp", ip, 80, answered, count=5))
        then = cluster.probe(who, "tcp", _own_node_ip(cluster, who), 30087, count=5)
        assert _sticky(who, then) == first, (who, first, then)
    cluster.remove("affinity-shared")


def test_session_affinity_survives_a_restart_of_the_backend(cluster: Cluster) -> None:
    """kube-proxy keeps its affinity memory across restarts: the new backend's first (full)
    sync must not empty it."""
    ip, marker = cluster.cluster_ip(), cluster.cluster_ip()
    cluster.write(
        "affinity-restart",
        service(
            "restart",
            ip,
            [port("http", 80)],
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}},
        ),
        endpoint_slice(cluster, "restart", ["a1", "b1", "b2"]),
    )
    # Five clients on every node: with the memory lost, all five would get their endpoint
    # again with a probability of (1/3)^5.
    clients = ("a2", "b1", "c1", "node-1", "node-3")
    before = {
        who: _sticky(who, cluster.eventually(who, "tcp", ip, 80, answered, count=3))
        for who in clients
    }
    try:
        for node in cluster.bed.nodes:
            cluster.start_backend(node)
        # A service written after the restarts answers once each new backend has synced.
        cluster.write(
            "affinity-restart-marker",
            service("marker", marker, [port("http", 80)]),
            endpoint_slice(cluster, "marker", ["c1"]),
        )
        for who in clients:
            cluster.eventually(who, "tcp", marker, 80, answered)
        after = {who: _sticky(who, cluster.probe(who, "tcp", ip, 80, count=3)) for who in clients}
        assert after == before
    finally:
        cluster.remove("affinity-restart")
        cluster.remove("affinity-restart-marker")


def test_session_affinity_survives_the_removal_of_another_endpoint(cluster: Cluster) -> None:
    ip, control = cluster.cluster_ip(), cluster.cluster_ip()
    pods = ["a1", "b1", "c1"]

    def write(endpoints: list[str], control_pod: str) -> None:
        # The control service changes in the same file, so in the same revision: once a node
        # sends it to the new pod, that node's rules have the endpoint change too.
        cluster.write(
            "affinity-removal",
            service(
                "keeps",
                ip,
                [port("http", 80)],
                sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
            ),
            endpoint_slice(cluster, "keeps", endpoints),
            service("keeps-control", control, [port("http", 80)]),
            endpoint_slice(cluster, "keeps-control", [control_pod]),
        )

    write(pods, "a1")
    clients = ("a2", "b2", "node-1", "node-2", "node-3")
    before = {
        who: _sticky(who, cluster.eventually(who, "tcp", ip, 80, answered, count=3))
        for who in clients
    }
    # The endpoint fewest clients stick to: at least four of the five keep theirs.
    gone = min(pods, key=lambda pod: list(before.values()).count(pod))
    write([pod for pod in pods if pod != gone], "b1")
    for who in clients:
        cluster.eventually(who, "tcp", control, 80, lambda r: names(r) == {"b1"})
        after = _sticky(who, cluster.probe(who, "tcp", ip, 80, count=3))
        if before[who] == gone:
            assert after != gone, who
        else:
            assert after == before[who], (who, before, after)
    cluster.remove("affinity-removal")


def test_session_affinity_with_etp_local_keeps_external_traffic_on_local_endpoints(
    cluster: Cluster,
) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "affinity-local",
        service(
            "sticky-local",
            ip,
            [port("http", 80, nodePort=30088)],
            type="NodePort",
            externalTrafficPolicy="Local",
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice(cluster, "sticky-local", ["a1", "b1", "c1"]),
    )
    node2 = cluster.bed.nodes["node-2"].ip4
    # External client hosts that reach the cluster IP through node-2 too, so that node-2
    # remembers an endpoint for them that is not its own (b1) for most.
    ext = cluster.ns("external")
    sources = [f"10.250.0.{220 + i}" for i in range(8)]
    for source in sources:
        cluster.bed.exec(ext, ["ip", "addr", "add", f"{source}/24", "dev", "eth0"])
    cluster.bed.exec(ext, ["ip", "route", "add", f"{ip}/32", "via", node2])
    try:
        cluster.eventually("external", "tcp", ip, 80, answered)
        remembered = {
            source: _sticky(
                source, cluster.probe("external", "tcp", ip, 80, count=3, source=source)
            )
            for source in sources
        }
        # All eight on b1 has a probability of (1/3)^8.
        assert set(remembered.values()) != {"b1"}, remembered
        for source in sources:
            # External traffic of eTP=Local: node-2's own endpoint only, the client's address
            # kept, whatever endpoint the client has from the cluster IP.
            results = cluster.probe("external", "tcp", node2, 30088, count=3, source=source)
            assert results == [f"b1 {source}"] * 3, (source, remembered[source], results)
    finally:
        cluster.bed.exec(ext, ["ip", "route", "del", f"{ip}/32"], check=False)
        for source in sources:
            cluster.bed.exec(ext, ["ip", "addr", "del", f"{source}/24", "dev", "eth0"], check=False)
    # Pods and the node itself are short-circuited to every endpoint: their memory holds there.
    for who in ("a2", "c1", "node-3"):
        first = _sticky(who, cluster.eventually(who, "tcp", ip, 80, answered, count=5))
        then = cluster.probe(who, "tcp", _own_node_ip(cluster, who), 30088, count=5)
        assert _sticky(who, then) == first, (who, first, then)
    cluster.remove("affinity-local")


def test_hairpin_pod_reaches_itself_through_its_service(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "hairpin",
        service("self", ip, [port("http", 80)]),
        endpoint_slice(cluster, "self", ["a2"]),
    )
    assert names(cluster.eventually("a2", "tcp", ip, 80, answered)) == {"a2"}
    cluster.remove("hairpin")


def test_external_traffic_policy_local(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "etp-local",
        service(
            "local",
            ip,
            [port("http", 80, nodePort=30082)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice(cluster, "local", ["b1"]),
    )
    node2, node3 = cluster.bed.nodes["node-2"].ip4, cluster.bed.nodes["node-3"].ip4
    # Only local endpoints, and the client's address is preserved.
    results = cluster.eventually("external", "tcp", node2, 30082, answered, count=5)
    assert set(results) == {f"b1 {EXTERNAL_V4}"}
    # A node without a local endpoint drops (a timeout, not a refusal): once node-3 has the
    # rules, which may come after node-2's (before them nothing listens there: a refusal).
    cluster.eventually("external", "tcp", node3, 30082, lambda r: r == ["timeout"])
    # Pods and the node itself are short-circuited to the cluster-wide endpoints.
    assert names(cluster.eventually("c1", "tcp", node3, 30082, answered)) == {"b1"}
    assert names(cluster.eventually("node-3", "tcp", node3, 30082, answered)) == {"b1"}
    cluster.remove("etp-local")


def test_health_check_node_port_reports_local_ready_endpoints(cluster: Cluster) -> None:
    ip, vip = cluster.cluster_ip(), cluster.vip()

    def write(pods: list[str]) -> None:
        svc = service(
            "health",
            ip,
            [port("http", 80, nodePort=30086)],
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32086,
        )
        svc["status"] = {"loadBalancer": {"ingress": [{"ip": vip}]}}
        cluster.write("health", svc, endpoint_slice(cluster, "health", pods))

    def answers(node: str, expected: str) -> None:
        host = cluster.bed.nodes[node].ip4
        cluster.eventually("external", "http", host, 32086, lambda r: r == [expected])

    def healthy(count: int) -> str:
        # kube-proxy's body, which load balancers' health checks are set up for.
        body = {"service": {"namespace": "conformance", "name": "health"}, "localEndpoints": count}
        status = 200 if count else 503
        return f"{status} {json.dumps({**body, 'serviceProxyHealthy': True})}"

    write(["b1"])
    answers("node-2", healthy(1))
    answers("node-1", healthy(0))
    write(["b1", "b2", "a1"])  # the count follows the endpoints
    answers("node-2", healthy(2))
    answers("node-1", healthy(1))
    cluster.remove("health")
    answers("node-2", "refused")


def test_internal_traffic_policy_local(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "itp-local",
        service("itp", ip, [port("http", 80)], internalTrafficPolicy="Local"),
        endpoint_slice(cluster, "itp", ["a1", "b1"]),
    )
    assert names(cluster.eventually("a2", "tcp", ip, 80, answered, count=10)) == {"a1"}
    assert names(cluster.eventually("b2", "tcp", ip, 80, answered, count=10)) == {"b1"}
    cluster.remove("itp-local")


def test_service_without_endpoints_refuses_at_once(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write("empty", service("empty", ip, [port("http", 80)]))
    cluster.eventually("a1", "tcp", ip, 80, lambda r: r == ["refused"])
    started = time.monotonic()
    assert cluster.probe("a1", "tcp", ip, 80, timeout=5.0) == ["refused"]
    assert time.monotonic() - started < 2.0  # the process start included; no timeout waited
    cluster.remove("empty")


def test_clusterip_on_a_port_no_service_defines_refuses_at_once(cluster: Cluster) -> None:
    """As kube-proxy: a new connection to a ClusterIP on an undefined port is rejected (ICMP
    port unreachable) from pods and from the node, TCP and UDP, both families; the defined
    port still answers, though its packets cross the same check after DNAT."""
    ip, ip6 = cluster.cluster_ip(), "fd00:96::32"
    cluster.write(
        "undefined-port",
        service(
            "defined",
            ip,
            [port("http", 80)],
            clusterIPs=[ip, ip6],
            ipFamilies=["IPv4", "IPv6"],
            ipFamilyPolicy="RequireDualStack",
        ),
        endpoint_slice(cluster, "defined", ["b1"]),
        endpoint_slice(cluster, "defined", ["b1"], v6=True, suffix="v6"),
    )
    # The node's own datagram is rejected on its way out, before any ICMP: its send fails.
    node_udp = ["error: [Errno 1] Operation not permitted"]
    for who in ("a1", "node-1"):  # forwarded, and the node's own
        for address in (ip, ip6):
            assert names(cluster.eventually(who, "tcp", address, 80, answered)) == {"b1"}
            for proto in ("tcp", "udp"):
                started = time.monotonic()
                result = cluster.probe(who, proto, address, 81, timeout=5.0)
                expected = node_udp if (who, proto) == ("node-1", "udp") else ["refused"]
                assert result == expected, (who, proto, address, result)
                assert time.monotonic() - started < 2.0  # the process start included
    cluster.remove("undefined-port")


def test_terminating_endpoints_serve_when_none_is_ready(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "terminating",
        service("term", ip, [port("http", 80)]),
        endpoint_slice(
            cluster,
            "term",
            ["b1"],
            conditions={"ready": False, "serving": True, "terminating": True},
        ),
    )
    assert names(cluster.eventually("a1", "tcp", ip, 80, answered)) == {"b1"}
    cluster.remove("terminating")


def _udp_service(cluster: Cluster, name: str, ip: str, pod: str) -> None:
    """``name``: UDP port 53 of ``ip``, served by ``pod``'s port 5353."""
    cluster.write(
        name,
        service(name, ip, [port("dns", 53, 5353, "UDP")]),
        endpoint_slice(
            cluster, name, [pod], ports=[{"name": "dns", "port": 5353, "protocol": "UDP"}]
        ),
    )


def test_udp_service_moves_to_the_new_endpoint_after_removal(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()

    def write(pod: str) -> None:
        _udp_service(cluster, "udp", ip, pod)

    write("a1")
    assert names(cluster.eventually("c1", "udp", ip, 53, answered)) == {"a1"}
    write("b1")
    # One socket, so one conntrack entry: it must move once the old endpoint is gone.
    cluster.eventually("c1", "udp-same-source", ip, 53, lambda r: "b1" in r[-1], count=5)
    cluster.remove("udp")


def test_udp_flows_stay_with_an_endpoint_while_it_serves(cluster: Cluster) -> None:
    """kube-proxy 1.35+'s conntrack rule: a UDP flow keeps its endpoint while that endpoint
    serves anywhere, though new flows no longer go to it (terminating, a ready one exists), and
    moves once it serves nowhere."""
    ip = cluster.cluster_ip()
    udp_port = {"name": "dns", "port": 5353, "protocol": "UDP"}
    terminating = {"ready": False, "serving": True, "terminating": True}

    def write(*slices: Json) -> None:
        cluster.write(
            "udp-flows", service("udp-flows", ip, [port("dns", 53, 5353, "UDP")]), *slices
        )

    def same_flow() -> list[str]:  # one source port: one conntrack entry across probes
        return cluster.probe("c1", "udp-same-source", ip, 53, count=2, source_port=40053)

    write(endpoint_slice(cluster, "udp-flows", ["a1"], ports=[udp_port]))
    cluster.eventually("c1", "udp-same-source", ip, 53, lambda r: r[-1].startswith("a1"))
    assert same_flow()[-1].startswith("a1")
    write(
        endpoint_slice(cluster, "udp-flows", ["a1"], ports=[udp_port], conditions=terminating),
        endpoint_slice(cluster, "udp-flows", ["b1"], ports=[udp_port], suffix="y"),
    )
    # New flows go to the ready endpoint, the flow of a1 stays there.
    cluster.eventually("c1", "udp", ip, 53, lambda r: names(r) == {"b1"}, count=3)
    assert same_flow()[-1].startswith("a1")
    write(endpoint_slice(cluster, "udp-flows", ["b1"], ports=[udp_port], suffix="y"))
    cluster.eventually("c1", "udp-same-source", ip, 53, lambda r: r[-1].startswith("b1"))
    assert same_flow()[-1].startswith("b1")
    cluster.remove("udp-flows")


def test_a_connected_udp_socket_moves_when_its_endpoint_is_removed(cluster: Cluster) -> None:
    """A client that connects its UDP socket once (a resolver, a metrics agent) keeps sending
    on it: once its endpoint is gone, kube-proxy deletes the flow and the next datagram reaches
    another endpoint. The old endpoint's pod still answers here, so a socket left on it shows."""
    ip = cluster.cluster_ip()

    def write(pod: str) -> None:
        _udp_service(cluster, "udp-connected", ip, pod)

    write("a1")
    cluster.eventually("c1", "udp", ip, 53, lambda r: names(r) == {"a1"})
    held = cluster.hold("c1", "udp", ip, 53)
    write("b1")
    cluster.eventually("c1", "udp", ip, 53, lambda r: names(r) == {"b1"})
    out, _ = held.communicate(timeout=30)
    results = json.loads(out)["results"]
    assert results[0].startswith("a1"), results
    assert results[-1].startswith("b1"), collections.Counter(results)
    cluster.remove("udp-connected")


def test_multiple_ports_and_named_target_ports(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "multiport",
        service("multi", ip, [port("http", 80, "web"), port("admin", 81, "admin")]),
        endpoint_slice(
            cluster,
            "multi",
            ["b1"],
            ports=[
                {"name": "http", "port": 8080, "protocol": "TCP"},
                {"name": "admin", "port": 8081, "protocol": "TCP"},
            ],
        ),
    )
    assert names(cluster.eventually("a1", "tcp", ip, 80, answered)) == {"b1"}
    assert names(cluster.eventually("a1", "tcp", ip, 81, answered)) == {"b1"}
    cluster.remove("multiport")


def test_services_of_another_proxy_are_ignored(cluster: Cluster) -> None:
    ip, control = cluster.cluster_ip(), cluster.cluster_ip()
    cluster.write(
        "other-proxy",
        service(
            "other",
            ip,
            [port("http", 80)],
            labels={"service.kubernetes.io/service-proxy-name": "someone-else"},
        ),
        endpoint_slice(cluster, "other", ["b1"]),
        service("control", control, [port("http", 80)]),
        endpoint_slice(cluster, "control", ["b1"]),
    )
    cluster.eventually("a1", "tcp", control, 80, answered)  # the file was read
    assert not answered(cluster.probe("a1", "tcp", ip, 80, timeout=1.0))
    cluster.remove("other-proxy")


def test_endpoint_changes_keep_established_connections(cluster: Cluster) -> None:
    ip = cluster.cluster_ip()
    cluster.write(
        "established",
        service("keep", ip, [port("http", 80)]),
        endpoint_slice(cluster, "keep", ["a1"]),
    )
    cluster.eventually("c1", "tcp", ip, 80, answered)
    held = cluster.hold("c1", "tcp", ip, 80)
    cluster.write(
        "established",
        service("keep", ip, [port("http", 80)]),
        endpoint_slice(cluster, "keep", ["a1", "b1", "b2"]),
    )
    # The change is in force while the connection is held: new connections reach the new
    # endpoints (without this, the case would pass with a change never applied).
    cluster.eventually(
        "c1",
        "tcp",
        ip,
        80,
        lambda got: any(r.split()[:1] in (["b1"], ["b2"]) for r in got),
        count=6,
    )
    assert held.poll() is None, "the held connection ended before the change was in force"
    out, _ = held.communicate(timeout=20)
    results = json.loads(out)["results"]
    assert len(results) > 5
    assert set(results) == {f"a1 {cluster.bed.pods['c1'].ip4}"}, collections.Counter(results)
    cluster.remove("established")
