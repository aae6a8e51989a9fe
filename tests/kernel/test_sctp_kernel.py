"""An SCTP packet through to-nft and to-iptables (both variants), in three fresh namespaces, all
deleted afterwards (issue 41): a client sends an SCTP INIT to a Service's ClusterIP and port,
and the pod behind the node reads it on a raw socket, addressed to its own IP and the target
port, its checksum still right; a Service with no endpoint rejects it (ICMP port unreachable).
This kernel has no SCTP sockets, so both ends use raw ones (``tests/kernel/sctp.py``).

    client 10.97.0.2 ---- 10.97.0.1 node 10.95.0.1 ---- 10.95.0.2 pod
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._node import Options
from kpng.backends.iptables import IptablesBackend
from kpng.backends.iptables.executing import Iptables, Tools
from kpng.client import Backend
from kpng.model.messages import Service, ServiceEndpoints
from kpng.testing import states
from kpng.testing.netns import available
from tests.kernel.sctp import SOURCE_PORT, init_packet, parse

kernel = pytest.mark.skipif(available() is not None, reason=str(available()))

POD = "10.95.0.2"
SERVED = "10.96.7.10"
EMPTY = "10.96.7.11"
PORT, TARGET = 3868, 13868
"""Diameter's port, a protocol that runs over SCTP, and the pod's."""
BACKENDS = ["to-nft", "to-iptables-nft", "to-iptables-legacy"]


@dataclass
class Bed:
    client: str
    node: str
    pod: str


def _in(netns: str, *argv: str) -> str:
    run = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True)
    if run.returncode != 0:
        raise AssertionError(f"{argv}: {run.stderr.strip()}")
    return run.stdout


def _link(a: str, a_dev: str, a_ip: str, b: str, b_dev: str, b_ip: str) -> None:
    """A veth pair made inside ``a``: nothing is ever named in the host's namespace."""
    _in(a, "ip", "link", "add", a_dev, "type", "veth", "peer", "name", b_dev, "netns", b)
    for ns, dev, ip in ((a, a_dev, a_ip), (b, b_dev, b_ip)):
        _in(ns, "ip", "addr", "add", ip, "dev", dev)
        _in(ns, "ip", "link", "set", dev, "up")


@pytest.fixture
def bed(namespaces: Callable[[], str]) -> Bed:
    made = Bed(namespaces(), namespaces(), namespaces())
    _link(made.client, "eth0", "10.97.0.2/24", made.node, "client0", "10.97.0.1/24")
    _link(made.node, "pod0", "10.95.0.1/24", made.pod, "eth0", f"{POD}/24")
    _in(made.client, "ip", "route", "add", "default", "via", "10.97.0.1")
    _in(made.pod, "ip", "route", "add", "default", "via", "10.95.0.1")
    # ClusterIPs need a route on the node before DNAT: to the pod, which does not forward (back
    # out to the client, the node would send an ICMP redirect, and the rate limit of ICMP
    # messages would eat the REJECT's).
    _in(made.node, "ip", "route", "add", "default", "via", POD)
    _in(made.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    return made


def _backend(kind: str, netns: str) -> Backend:
    prefix = ("ip", "netns", "exec", netns)
    # The client as one of the node's pods: not masqueraded, so the pod sees who sent.
    options = Options(cluster_cidrs=("10.97.0.0/24",))
    if kind == "to-nft":
        return NftBackend(nft=KernelNft((*prefix, "nft")), options=options)
    if shutil.which("iptables-nft-restore") is None:
        pytest.skip("needs iptables")
    iptables = Iptables(Tools(kind.removeprefix("to-iptables-")), prefix=prefix)
    return IptablesBackend(iptables=iptables, options=options, families=("v4",))


def _apply(backend: Backend) -> None:
    def sctp(name: str, cluster_ip: str, *, usable: bool) -> Service:
        return states.service(
            name,
            cluster_ip=cluster_ip,
            protocol="SCTP",
            port=PORT,
            target_port=TARGET,
            usable=usable,
        )

    endpoint = states.endpoint(POD, TARGET, protocol="SCTP")
    services = {
        "diameter": ServiceEndpoints(sctp("diameter", SERVED, usable=True), (endpoint,)),
        # No endpoint anywhere: both backends reject, as kube-proxy (not drop: that is for
        # a Local policy with endpoints elsewhere only).
        "empty": ServiceEndpoints(sctp("empty", EMPTY, usable=False), ()),
    }

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, services))
        finally:
            await backend.close()

    asyncio.run(scenario())


def _sctp(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tests.kernel.sctp", *argv]


def _send_and_listen(bed: Bed, host: str) -> tuple[dict[str, object] | None, list[int]]:
    """What the pod read of one INIT sent to ``host``:``PORT``, and the ICMP unreachable codes
    the client got back."""
    listener = subprocess.Popen(
        ["ip", "netns", "exec", bed.pod, *_sctp("listen", str(TARGET), "--timeout", "3")],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert listener.stdout is not None
    try:
        assert listener.stdout.readline().strip() == "ready"
        sent = json.loads(_in(bed.client, *_sctp("send", host, str(PORT))))
        received = json.loads(listener.stdout.readline())
        listener.wait(timeout=5)
    finally:
        listener.kill()
        listener.wait()
        listener.stdout.close()
    return received, sent["unreachable"]


@kernel
@pytest.mark.parametrize("kind", BACKENDS)
def test_an_sctp_init_to_a_clusterip_reaches_the_endpoint_and_one_without_endpoints_is_rejected(
    bed: Bed, kind: str
) -> None:
    _apply(_backend(kind, bed.node))

    received, unreachable = _send_and_listen(bed, SERVED)
    assert received == {
        "source": "10.97.0.2",
        "destination": POD,
        "source_port": SOURCE_PORT,
        "destination_port": TARGET,
        "chunk": 1,
        "checksum_ok": True,
    }
    assert unreachable == []

    received, unreachable = _send_and_listen(bed, EMPTY)
    assert received is None
    assert unreachable == [3]  # port unreachable


def test_the_init_packet_has_the_checksum_the_parser_checks() -> None:
    packet = init_packet(SOURCE_PORT, PORT)
    ip_header = bytes(12) + bytes([10, 0, 0, 1, 10, 0, 0, 2])
    received = parse(bytes([0x45]) + ip_header[1:] + packet)
    assert received is not None
    assert (received.source_port, received.destination_port, received.chunk) == (
        SOURCE_PORT,
        PORT,
        1,
    )
    assert received.checksum_ok
    corrupted = packet[:-1] + bytes([packet[-1] ^ 1])
    assert not parse(bytes([0x45]) + ip_header[1:] + corrupted).checksum_ok  # type: ignore[union-attr]
