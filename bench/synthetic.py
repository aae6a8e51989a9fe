"""A deterministic synthetic cluster: Services, EndpointSlices and Nodes as one ``kind: List``.

The document looks like ``kubectl get svc,endpointslices,nodes -A -o json``: keys sorted, the
fields the API server fills in (uid, resourceVersion, creationTimestamp, the controller's labels
and annotations, ...), services first, then slices, then nodes. Each service has 10 endpoints
spread over 100 nodes (``--nodes``) in 3 zones; about 80% of services are ClusterIP, 15%
NodePort and 5% LoadBalancer (half of those with externalTrafficPolicy Local and a health check
node port; past some 80,000 services the node ports 30000-65535 are spent, and the rest are
ClusterIP). About 10% of services ask for topology-aware routing (PreferClose) and their slices
carry ``hints.forZones``; about 3% of endpoints are not ready and 2% are terminating.

The JSON is compact, as the API server sends it: 10,000 services make 35.5 MB. That is near the
floor for these objects: a slice is some 2.7 KB, 2.1 KB of it its 10 endpoints with their
conditions, node, zone and pod, so 24 MB would take dropping fields a real cluster has.
``--indent 4`` (kubectl's layout) makes the same cluster 88 MB, and ``--full`` adds what a real
cluster also carries but kpng never reads (owner references, copied labels, the pods' namespace
and uid): 47.6 MB compact.

The same arguments always give the same document, byte for byte.

    python bench/synthetic.py --services 10000 --output bench/out/cluster-10k.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

Json = dict[str, Any]

NODES = 100
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c")
REGION = "us-east-1"
ENDPOINTS_PER_SERVICE = 10
SERVICES_PER_NAMESPACE = 50

_SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/12")
_POD_CIDR = ipaddress.IPv4Network("10.128.0.0/9")
_NODE_CIDR = ipaddress.IPv4Network("10.0.0.0/16")
_LB_CIDR = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544, the benchmarking range
_NODE_PORT_BASE = 30000
# The most node ports one service spends: two ports and a health check, each a stride of <= 2.
_NODE_PORTS_PER_SERVICE = 6
_BASE_TIME = dt.datetime(2024, 3, 1, tzinfo=dt.UTC)
# Kubernetes' generated-name alphabet (no vowels, no look-alikes).
_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"

_TEAMS = (
    "payments", "checkout", "catalog", "search", "identity", "platform", "data", "ml",
    "growth", "ads", "messaging", "media", "risk", "ledger", "logistics", "support",
)  # fmt: skip
_ENVS = ("prod", "staging", "canary", "batch")
_COMPONENTS = (
    "api", "web", "auth", "billing", "cart", "orders", "inventory", "shipping", "users",
    "notify", "reports", "gateway", "cache", "queue", "stream", "ledger", "pricing", "profile",
    "session", "feed", "indexer", "ranker", "render", "upload", "thumbs", "events", "audit",
)  # fmt: skip
_ROLES = ("backend", "frontend", "worker", "grpc", "internal", "public", "admin", "proxy", "v2")

# (name, port, target port number, target port as written, protocol); a target written as a
# string is a named container port, which the slice resolves to the number.
_Port = tuple[str, int, int, int | str, str]
_PORT_PROFILES: tuple[tuple[int, tuple[_Port, ...]], ...] = (
    (40, (("http", 80, 8080, 8080, "TCP"),)),
    (15, (("http", 80, 8080, "http", "TCP"), ("https", 443, 8443, "https", "TCP"))),
    (15, (("grpc", 9090, 9090, 9090, "TCP"),)),
    (12, (("http", 8080, 8080, "http", "TCP"), ("metrics", 9100, 9100, 9100, "TCP"))),
    (8, (("tcp-postgres", 5432, 5432, 5432, "TCP"),)),
    (5, (("dns", 53, 53, 53, "UDP"), ("dns-tcp", 53, 53, 53, "TCP"))),
    (5, (("http", 80, 3000, 3000, "TCP"), ("grpc", 9000, 9000, "grpc", "TCP"))),
)


@dataclass(frozen=True)
class _Node:
    name: str
    zone: str
    ip: str
    pod_base: int  # the node's first pod address, as an int
    block_bits: int  # the node's pod CIDR is a /(32 - block_bits)


def node_name(i: int) -> str:
    """The name of node ``i`` (0 <= i < the generated node count, NODES by default)."""
    return f"node-{i:03d}"


def _generated(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(n))


def _uid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


class _Clock:
    """Creation times and resource versions that only go forward, as in a real cluster."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._seconds = 0
        self._version = 1_000_000

    def timestamp(self) -> str:
        self._seconds += self._rng.randrange(0, 120)
        return (_BASE_TIME + dt.timedelta(seconds=self._seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def version(self) -> str:
        self._version += self._rng.randrange(1, 50)
        return str(self._version)


def _nodes(services: int, count: int) -> list[_Node]:
    if not 1 <= count <= 250 * 256:  # node addresses: 250 per /24 of the node network
        raise ValueError(f"{count} nodes: 1 to {250 * 256}")
    expected = services * ENDPOINTS_PER_SERVICE / count
    block_bits = max(8, int(2 * expected + 2).bit_length())  # room for twice the mean
    if count << block_bits > _POD_CIDR.num_addresses:
        raise ValueError(f"{services} services do not fit the pod network")
    base = int(_POD_CIDR.network_address)
    return [
        _Node(
            name=node_name(i),
            zone=ZONES[i % len(ZONES)],
            ip=str(_NODE_CIDR.network_address + (i // 250) * 256 + i % 250 + 10),
            pod_base=base + (i << block_bits) + 2,
            block_bits=block_bits,
        )
        for i in range(count)
    ]


def _node_object(node: _Node, i: int, clock: _Clock, rng: random.Random) -> Json:
    instance = ("m6i.2xlarge", "m6i.4xlarge", "c6i.4xlarge")[i % 3]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            },
            "creationTimestamp": clock.timestamp(),
            "labels": {
                "beta.kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/instance-type": instance,
                "beta.kubernetes.io/os": "linux",
                "failure-domain.beta.kubernetes.io/region": REGION,
                "failure-domain.beta.kubernetes.io/zone": node.zone,
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "node.kubernetes.io/instance-type": instance,
                "topology.kubernetes.io/region": REGION,
                "topology.kubernetes.io/zone": node.zone,
            },
            "name": node.name,
            "resourceVersion": clock.version(),
            "uid": _uid(rng),
        },
        "spec": {
            "podCIDR": f"{ipaddress.IPv4Address(node.pod_base - 2)}/{32 - node.block_bits}",
            "providerID": f"aws:///{node.zone}/i-0{rng.getrandbits(64):016x}",
        },
        "status": {
            "addresses": [
                {"address": node.ip, "type": "InternalIP"},
                {"address": node.name, "type": "Hostname"},
                {"address": node.name, "type": "InternalDNS"},
            ],
            "conditions": [
                {
                    "lastHeartbeatTime": clock.timestamp(),
                    "lastTransitionTime": clock.timestamp(),
                    "message": "kubelet is posting ready status",
                    "reason": "KubeletReady",
                    "status": "True",
                    "type": "Ready",
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "containerRuntimeVersion": "containerd://1.7.11",
                "kernelVersion": "6.1.66-91.160.amzn2023.x86_64",
                "kubeProxyVersion": "v1.29.0",
                "kubeletVersion": "v1.29.0",
                "operatingSystem": "linux",
                "osImage": "Amazon Linux 2023",
            },
        },
    }


class _Generator:
    def __init__(self, services: int, seed: int, full: bool, nodes: int) -> None:
        if services < 0:
            raise ValueError("services must be >= 0")
        if services > _SERVICE_CIDR.num_addresses - 16:
            raise ValueError(f"{services} services do not fit the service network")
        self.full = full
        self.rng = random.Random(seed)
        self.clock = _Clock(self.rng)
        self.nodes = _nodes(services, nodes)
        self.pods_on_node = [0] * nodes
        self.next_node_port = _NODE_PORT_BASE
        self.next_lb_ip = int(_LB_CIDR.network_address) + 10
        namespaces = max(1, -(-services // SERVICES_PER_NAMESPACE))
        self.namespaces = [
            f"{_TEAMS[i % len(_TEAMS)]}-{_ENVS[i // len(_TEAMS) % len(_ENVS)]}"
            + (f"-{i // (len(_TEAMS) * len(_ENVS))}" if i >= len(_TEAMS) * len(_ENVS) else "")
            for i in range(namespaces)
        ]

    def node_port(self) -> int:
        port = self.next_node_port
        self.next_node_port += 1 + self.rng.randrange(2)
        if port > 65535:
            raise ValueError("out of node ports")
        return port

    def pod_ip(self, node: int) -> str:
        n = self.pods_on_node[node]
        self.pods_on_node[node] = n + 1
        if n + 4 > 1 << self.nodes[node].block_bits:
            raise ValueError(f"node {node} is out of pod addresses")
        return str(ipaddress.IPv4Address(self.nodes[node].pod_base + n))

    def service_pair(self, i: int) -> tuple[Json, Json]:
        rng = self.rng
        namespace = self.namespaces[i // SERVICES_PER_NAMESPACE]
        component = _COMPONENTS[rng.randrange(len(_COMPONENTS))]
        role = _ROLES[rng.randrange(len(_ROLES))]
        name = f"{component}-{role}-{i}"
        roll = rng.random()
        kind = "ClusterIP" if roll < 0.80 else "NodePort" if roll < 0.95 else "LoadBalancer"
        if self.next_node_port + _NODE_PORTS_PER_SERVICE > 65535:
            kind = "ClusterIP"  # the range is spent: the rest still fit, as ClusterIPs
        profile = rng.choices(
            [p for _, p in _PORT_PROFILES], weights=[w for w, _ in _PORT_PROFILES]
        )[0]
        labels = {
            "app.kubernetes.io/instance": f"{component}-{i}",
            "app.kubernetes.io/name": component,
        }
        if self.full:
            labels["app.kubernetes.io/managed-by"] = "Helm"
            labels["app.kubernetes.io/part-of"] = namespace
        cluster_ip = str(_SERVICE_CIDR.network_address + 16 + i)
        ports: list[Json] = []
        for port_name, port, _, target, protocol in profile:
            entry: Json = {"name": port_name, "port": port, "protocol": protocol}
            entry["targetPort"] = target
            if kind != "ClusterIP":
                entry["nodePort"] = self.node_port()
            ports.append(entry)
        spec: Json = {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "internalTrafficPolicy": "Cluster",
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": ports,
            "selector": {"app.kubernetes.io/instance": labels["app.kubernetes.io/instance"]},
            "sessionAffinity": "None",
            "type": kind,
        }
        if rng.random() < 0.03:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 10800}}
        topology = rng.random() < 0.10
        if topology:
            spec["trafficDistribution"] = "PreferClose"
        status: Json = {"loadBalancer": {}}
        annotations = {
            "meta.helm.sh/release-name": f"{component}-{i}",
            "meta.helm.sh/release-namespace": namespace,
        }
        if kind != "ClusterIP":
            spec["externalTrafficPolicy"] = "Cluster"
        if kind == "LoadBalancer":
            spec["allocateLoadBalancerNodePorts"] = True
            annotations["service.beta.kubernetes.io/aws-load-balancer-type"] = "nlb"
            if rng.random() < 0.5:
                spec["externalTrafficPolicy"] = "Local"
                spec["healthCheckNodePort"] = self.node_port()
            lb_ip = ipaddress.IPv4Address(self.next_lb_ip)
            self.next_lb_ip += 1
            if lb_ip not in _LB_CIDR:
                raise ValueError("out of load balancer addresses")
            status["loadBalancer"] = {"ingress": [{"ip": str(lb_ip), "ipMode": "VIP"}]}
        service_uid = _uid(rng)
        created = self.clock.timestamp()
        service: Json = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "annotations": annotations,
                "creationTimestamp": created,
                "labels": labels,
                "name": name,
                "namespace": namespace,
                "resourceVersion": self.clock.version(),
                "uid": service_uid,
            },
            "spec": spec,
            "status": status,
        }
        endpoints = self.endpoints(namespace, name, topology)
        # The endpoint slice controller copies the service's labels and adds its own.
        slice_labels = dict(labels) if self.full else {}
        slice_labels["endpointslice.kubernetes.io/managed-by"] = "endpointslice-controller.k8s.io"
        slice_labels["kubernetes.io/service-name"] = name
        slice_metadata: Json = {
            "annotations": {
                "endpoints.kubernetes.io/last-change-trigger-time": self.clock.timestamp()
            },
            "creationTimestamp": created,
            "labels": slice_labels,
            "name": f"{name}-{_generated(rng, 5)}",
            "namespace": namespace,
            "resourceVersion": self.clock.version(),
            "uid": _uid(rng),
        }
        generation = 1 + rng.randrange(20)  # drawn in both modes: the same cluster either way
        if self.full:
            slice_metadata["generateName"] = f"{name}-"
            slice_metadata["generation"] = generation
            slice_metadata["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "blockOwnerDeletion": True,
                    "controller": True,
                    "kind": "Service",
                    "name": name,
                    "uid": service_uid,
                }
            ]
        endpoint_slice: Json = {
            "addressType": "IPv4",
            "apiVersion": "discovery.k8s.io/v1",
            "endpoints": endpoints,
            "kind": "EndpointSlice",
            "metadata": slice_metadata,
            "ports": [
                {"name": port_name, "port": number, "protocol": protocol}
                for port_name, _, number, _, protocol in profile
            ],
        }
        return service, endpoint_slice

    def endpoints(self, namespace: str, service: str, topology: bool) -> list[Json]:
        rng = self.rng
        replica_set = _generated(rng, 10)
        endpoints: list[Json] = []
        for _ in range(ENDPOINTS_PER_SERVICE):
            n = rng.randrange(len(self.nodes))
            node = self.nodes[n]
            roll = rng.random()
            if roll < 0.03:  # starting, or failing its readiness probe
                conditions = {"ready": False, "serving": False, "terminating": False}
            elif roll < 0.05:  # being deleted, still serving while it drains
                conditions = {"ready": False, "serving": roll < 0.045, "terminating": True}
            else:
                conditions = {"ready": True, "serving": True, "terminating": False}
            target = {"kind": "Pod", "name": f"{service}-{replica_set}-{_generated(rng, 5)}"}
            pod_uid = _uid(rng)  # drawn in both modes: the same cluster either way
            if self.full:
                target["namespace"] = namespace
                target["uid"] = pod_uid
            endpoint: Json = {
                "addresses": [self.pod_ip(n)],
                "conditions": conditions,
                "nodeName": node.name,
                "targetRef": target,
                "zone": node.zone,
            }
            if topology:
                endpoint["hints"] = {"forZones": [{"name": node.zone}]}
            endpoints.append(endpoint)
        return endpoints


def generate(
    services: int, *, seed: int = 1, full: bool = False, nodes: int = NODES
) -> dict[str, Any]:
    """The cluster as one ``kind: List`` document (plain dicts and lists, ready for json).

    ``full`` adds what a real API server also writes but kpng never reads (owner references,
    the copied service labels, the pods' namespace and uid in targetRef...): the same cluster,
    about twice the bytes. ``nodes`` spreads the endpoints over that many nodes (each node
    in a zone, round robin); the default NODES gives the same document as ever.
    """
    gen = _Generator(services, seed, full, nodes)
    service_objects: list[Json] = []
    slice_objects: list[Json] = []
    for i in range(services):
        service, endpoint_slice = gen.service_pair(i)
        service_objects.append(service)
        slice_objects.append(endpoint_slice)
    node_objects = [_node_object(node, i, gen.clock, gen.rng) for i, node in enumerate(gen.nodes)]
    return {
        "apiVersion": "v1",
        "items": service_objects + slice_objects + node_objects,
        "kind": "List",
        "metadata": {"resourceVersion": ""},
    }


def describe(document: dict[str, Any]) -> str:
    """What the document holds: objects by kind, services by type, endpoints by condition."""
    items = document["items"]
    kinds = Counter(item["kind"] for item in items)
    services = [item for item in items if item["kind"] == "Service"]
    types = Counter(s["spec"]["type"] for s in services)
    local = sum(1 for s in services if s["spec"].get("externalTrafficPolicy") == "Local")
    topology = sum(1 for s in services if "trafficDistribution" in s["spec"])
    ports = sum(len(s["spec"]["ports"]) for s in services)
    named = sum(1 for s in services for p in s["spec"]["ports"] if isinstance(p["targetPort"], str))
    endpoints = [
        ep for item in items if item["kind"] == "EndpointSlice" for ep in item["endpoints"]
    ]
    conditions = Counter(
        "terminating" if ep["conditions"]["terminating"]
        else "ready" if ep["conditions"]["ready"]
        else "unready"
        for ep in endpoints
    )  # fmt: skip
    zones = Counter(
        item["metadata"]["labels"]["topology.kubernetes.io/zone"]
        for item in items
        if item["kind"] == "Node"
    )

    def share(counter: Counter[str], total: int) -> str:
        return ", ".join(f"{k} {v} ({v / max(total, 1):.1%})" for k, v in sorted(counter.items()))

    return "\n".join(
        (
            f"objects: {share(kinds, len(items))}",
            f"services: {share(types, len(services))}; {local} with externalTrafficPolicy "
            f"Local, {topology} PreferClose; {ports} ports, {named} with a named targetPort",
            f"endpoints: {len(endpoints)}: {share(conditions, len(endpoints))}",
            f"nodes by zone: {share(zones, kinds['Node'])}",
        )
    )


def dumps(document: dict[str, Any], *, indent: int | None = None) -> bytes:
    """The document as JSON bytes: compact like the API server's answer, or indented."""
    if indent is None:
        text = json.dumps(document, separators=(",", ":"), sort_keys=True)
    else:
        text = json.dumps(document, indent=indent, sort_keys=True)
    return text.encode() + b"\n"


def write(
    path: Path,
    services: int,
    *,
    seed: int = 1,
    full: bool = False,
    nodes: int = NODES,
    indent: int | None = None,
    describe_to: TextIO | None = None,
) -> int:
    """Generate and write the cluster; returns the size in bytes."""
    document = generate(services, seed=seed, full=full, nodes=nodes)
    if describe_to is not None:
        print(describe(document), file=describe_to)
    data = dumps(document, indent=indent)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return len(data)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000, help="default: 10000")
    parser.add_argument("--seed", type=int, default=1, help="default: 1")
    parser.add_argument("--nodes", type=int, default=NODES, help=f"default: {NODES}")
    parser.add_argument("--indent", type=int, default=None, help="pretty-print (default: compact)")
    parser.add_argument("--full", action="store_true", help="add the fields kpng never reads")
    parser.add_argument("--output", required=True, type=Path, help="the JSON file to write")
    parser.add_argument("--describe", action="store_true", help="print what the cluster holds")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    size = write(
        args.output,
        args.services,
        seed=args.seed,
        full=args.full,
        nodes=args.nodes,
        indent=args.indent,
        describe_to=sys.stdout if args.describe else None,
    )
    elapsed = time.perf_counter() - start
    print(
        f"{args.output}: {args.services} services, {size / 1e6:.1f} MB ({size} bytes) "
        f"in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
