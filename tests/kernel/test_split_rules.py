"""The same rules either way: each backend, run by the CLI with kube-proxy's defaults, programs the
same kernel rules beside the brain (``kpng file ... to-local``) and behind it (``kpng local``
fed by ``kpng file ... to-api`` over a unix socket). Compared in the kernel's own listing, each
in a network namespace of the test's."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kpng.backends.ebpf.toolchain import unavailable as ebpf_unavailable
from kpng.testing.netns import ClusterSpec, TestBed

KPNG = [sys.executable, "-m", "kpng"]
NODE = "node-1"
KUBE_PROXY_DEFAULTS = ["--nodeport-addresses", "primary", "--detect-local-mode", "NodeCIDR"]

CLUSTER = """
apiVersion: v1
kind: Node
metadata: {name: node-1}
spec: {podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 192.0.2.11}]}
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  loadBalancerSourceRanges: [192.0.2.0/24]
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: 198.51.100.7}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.5], nodeName: node-1}
- {addresses: [10.244.2.5], nodeName: node-2}
"""

BACKENDS = {
    "to-nft": (["to-nft"], ["nft", "list", "ruleset"]),
    "to-iptables-legacy": (
        ["to-iptables", "--iptables-mode", "legacy"],
        ["iptables-legacy-save"],
    ),
    "to-iptables-nft": (["to-iptables", "--iptables-mode", "nft"], ["iptables-nft-save"]),
}

WHAT_THE_NODE_FACTS_GIVE = {
    # the pod CIDR (local traffic detection), the node's primary IP (node ports), the
    # ServiceCIDR (its unallocated IPs dropped)
    "to-nft": ["10.244.1.0/24", "192.0.2.11", "10.96.0.0/16"],
    "to-iptables-legacy": ["-s 10.244.1.0/24", "-d 10.96.0.0/16 -j DROP", "-d 192.0.2.11/32"],
    "to-iptables-nft": ["-s 10.244.1.0/24", "-d 10.96.0.0/16 -j DROP", "-d 192.0.2.11/32"],
}


def _in(netns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _listing(netns: str, command: list[str]) -> str:
    done = _in(netns, *command)
    assert done.returncode == 0, done.stderr
    # iptables-save's header and footer carry a time; its counters are per namespace
    lines = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    return re.sub(r"\[\d+:\d+\]", "[0:0]", "\n".join(lines))


def _map_entries(netns: str, pin: Path) -> list[str]:
    """A pinned map's entries, in an order of their own (a hash map's is its history's)."""
    done = _in(netns, "bpftool", "--json", "map", "dump", "pinned", str(pin))
    assert done.returncode == 0, done.stderr
    return sorted(json.dumps(entry, sort_keys=True) for entry in json.loads(done.stdout))


@pytest.fixture
def brain(tmp_path: Path) -> Iterator[str]:
    """``kpng file ... to-api`` on a unix socket: its URL."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    socket = tmp_path / "kpng.sock"
    proc = subprocess.Popen(
        [*KPNG, "file", "--input", str(tmp_path / "cluster.yaml"), "to-api", "--listen",
         f"unix://{socket}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert proc.poll() is None, "the brain exited"
            assert time.monotonic() < deadline, "the brain did not listen within 30 s"
            time.sleep(0.05)
        yield f"unix://{socket}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_programs_the_same_rules_behind_the_api(
    backend: str, namespaces: Callable[[], str], brain: str, tmp_path: Path
) -> None:
    beside, behind = namespaces(), namespaces()
    argv, listing = BACKENDS[backend]
    flags = [*argv, "--once", "--no-health-check", *KUBE_PROXY_DEFAULTS]
    done = _in(
        beside, *KPNG, "file", "--input", str(tmp_path / "cluster.yaml"),
        "to-local", "--node-name", NODE, *flags,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = _in(behind, *KPNG, "local", "--api", brain, "--node-name", NODE, *flags)
    assert done.returncode == 0, done.stderr
    assert "no pod CIDRs known" not in done.stderr
    assert "no InternalIP or ExternalIP known" not in done.stderr
    rules = _listing(beside, listing)
    for needed in WHAT_THE_NODE_FACTS_GIVE[backend]:
        assert needed in rules, f"{needed} is not in the rules:\n{rules}"
    assert _listing(behind, listing) == rules


@pytest.mark.skipif(bool(ebpf_unavailable()), reason=str(ebpf_unavailable()))
def test_to_ebpf_programs_the_same_maps_and_rules_behind_the_api(
    brain: str, tmp_path: Path
) -> None:
    """to-ebpf's two parts: the maps its socket programs read (dumped by bpftool from their
    pins) and its nftables rules for traffic from outside."""
    with TestBed(ClusterSpec.parse({"beside": [], "behind": []}), sockets=True) as bed:
        listings = []
        for name, source in (
            ("beside", ["file", "--input", str(tmp_path / "cluster.yaml"), "to-local"]),
            ("behind", ["local", "--api", brain]),
        ):
            node = bed.nodes[name]
            assert node.cgroup is not None
            assert node.pin_dir is not None
            flags = ["--cgroup", str(node.cgroup), "--pin-dir", str(node.pin_dir)]
            done = _in(
                node.netns, *KPNG, *source, "--node-name", NODE,
                "to-ebpf", *flags, "--once", "--no-health-check", *KUBE_PROXY_DEFAULTS,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            maps = {
                pin.name: _map_entries(node.netns, pin)
                for pin in sorted(node.pin_dir.glob("maps-*/*"))
            }
            # Keyed by network namespace cookies, which differ from node to node: compared by
            # what they say of each node's namespaces.
            local_netns = maps.pop("kpng_local_netns")
            maps["local namespaces"] = [
                json.dumps(json.loads(e)["formatted"]["value"]) for e in local_netns
            ]
            listings.append((maps, _listing(node.netns, ["nft", "list", "ruleset"])))
        (maps, rules), (maps_behind, rules_behind) = listings
        assert maps, "no pinned map"
        # NodeCIDR detection, from the Node's podCIDRs: the node's own namespace, local for both
        # families (it has no pod).
        assert maps["local namespaces"] == ["3"]
        # the node port's frontend on the node's primary IP (a word of its address, as bpftool
        # prints the key: network order read as a little-endian u32)
        node_ip = int.from_bytes(ipaddress.IPv4Address("192.0.2.11").packed, "little")
        frontends = [json.loads(entry)["formatted"]["key"] for entry in maps["kpng_frontends"]]
        assert any(key["addr"]["w"][3] == node_ip for key in frontends), frontends
        assert "10.244.1.0/24" in rules
        assert maps_behind == maps
        assert rules_behind == rules
