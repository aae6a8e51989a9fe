"""What to-ebpf's local traffic detection sees of a pod's network namespace, through rtnetlink from
threads that enter it as kpng does: a node and a pod joined by a veth on a bridge (the detection's
logic, as tables: tests/pure/test_ebpf_locality.py)."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

from kpng.backends import _rtnetlink as rtnetlink
from kpng.backends._rtnetlink import Link
from kpng.backends.ebpf import namespaces
from kpng.backends.ebpf.locality import Namespace, look, netns_cookie


@pytest.fixture
def veth_pod() -> Iterator[tuple[str, str]]:
    """Two network namespaces, a node and a pod, joined by a veth whose node end is enslaved
    to a bridge: (node, pod)."""
    tag = uuid.uuid4().hex[:6]
    node, pod = f"kpng-loc-n-{tag}", f"kpng-loc-p-{tag}"
    try:
        for ns in (node, pod):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        for argv in (
            ["ip", "-n", node, "link", "add", "br-pods", "type", "bridge"],
            ["ip", "-n", node, "link", "add", "vp7", "type", "veth", "peer", "eth0", "netns", pod],
            ["ip", "-n", node, "link", "set", "vp7", "master", "br-pods"],
            ["ip", "-n", pod, "addr", "add", "10.244.1.7/32", "dev", "eth0"],
            ["ip", "-n", pod, "addr", "add", "fd00:244:1::7/128", "dev", "eth0", "nodad"],
            ["ip", "-n", pod, "link", "set", "eth0", "up"],
        ):
            subprocess.run(argv, check=True)
        yield node, pod
    finally:
        for ns in (pod, node):
            subprocess.run(["ip", "netns", "del", ns], check=False)


def test_a_pods_namespace_is_seen_as_detection_sees_its_traffic(
    veth_pod: tuple[str, str],
) -> None:
    """Through rtnetlink, from threads that enter the namespaces as kpng does: the pod's global
    addresses, the bridge its packets arrive on at the node, and a cookie of its own."""
    node, pod = veth_pod
    holders = [subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "30"]) for ns in veth_pod]
    try:
        inodes = {ns: _inode(holder.pid) for ns, holder in zip(veth_pod, holders, strict=True)}
        pids = {inodes[ns]: h.pid for ns, h in zip(veth_pod, holders, strict=True)}
        node_links: list[Link] = []
        facts: dict[int, tuple[int, Namespace]] = {}
        node_inode, pod_inode = inodes[node], inodes[pod]
        visited = namespaces.visit(
            {node_inode: pids[node_inode]}, lambda _: node_links.extend(rtnetlink.links())
        )
        assert visited == {}

        def pod_facts(inode: int) -> None:
            facts[inode] = (netns_cookie(), look(node_links))

        assert namespaces.visit({pod_inode: pids[pod_inode]}, pod_facts) == {}
        cookie, seen = facts[pod_inode]
        assert seen == Namespace(addresses=("10.244.1.7", "fd00:244:1::7"), arrives_on=("br-pods",))
        assert cookie not in (0, netns_cookie())
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def _inode(pid: int) -> int:
    # ip netns exec has to reach its exec before the PID is in the namespace.
    for _ in range(100):
        inode = os.stat(f"/proc/{pid}/ns/net").st_ino
        if inode != namespaces.own():
            return inode
        time.sleep(0.02)
    raise AssertionError(f"process {pid} never entered its namespace")
