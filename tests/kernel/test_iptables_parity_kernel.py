"""to-iptables' parity with kube-proxy's iptables mode that only packets show (issue 41): node
ports on 127.0.0.1 (``--localhost-nodeports``) and the drop of forwarded packets conntrack finds
INVALID, each counted in kube-proxy's nfacct object and series of ``/metrics``. Three fresh
namespaces, all deleted afterwards: a client, the node (to-iptables, iptables-nft) and a pod
behind it running the echo server.

    client 10.98.0.2 ---- 10.98.0.1 node 10.99.0.1 ---- 10.99.0.2 pod
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.backends._netlink import netfilter_socket
from kpng.backends._nfacct import (
    INVALID_DROPPED,
    LOCALHOST_ACCEPTED,
    Nfacct,
    parse,
    request,
)
from kpng.backends._node import Options
from kpng.backends.iptables import IptablesBackend
from kpng.backends.iptables.executing import Iptables, Tools
from kpng.feeding import Fanout, Feeder
from kpng.model.messages import ServiceEndpoints
from kpng.status import Status
from kpng.status.metrics import scrape
from kpng.testing import states

pytestmark = pytest.mark.skipif(
    shutil.which("iptables-nft-restore") is None, reason="needs iptables"
)

NODE_PORT = 30080
POD = "10.99.0.2"


@dataclass
class Bed:
    client: str
    node: str
    pod: str


def _in(netns: str, *argv: str, check: bool = True) -> str:
    run = subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True)
    if check and run.returncode != 0:
        raise AssertionError(f"{argv}: {run.stderr.strip()}")
    return run.stdout


def _link(a: str, a_dev: str, a_ip: str, b: str, b_dev: str, b_ip: str) -> None:
    """A veth pair made inside ``a``: nothing is ever named in the host's namespace."""
    _in(a, "ip", "link", "add", a_dev, "type", "veth", "peer", "name", b_dev, "netns", b)
    for ns, dev, ip in ((a, a_dev, a_ip), (b, b_dev, b_ip)):
        _in(ns, "ip", "addr", "add", ip, "dev", dev)
        _in(ns, "ip", "link", "set", dev, "up")


@pytest.fixture
def bed(namespaces: Callable[[], str]) -> Iterator[Bed]:
    made = Bed(namespaces(), namespaces(), namespaces())
    _link(made.client, "eth0", "10.98.0.2/24", made.node, "client0", "10.98.0.1/24")
    _link(made.node, "pod0", "10.99.0.1/24", made.pod, "eth0", f"{POD}/24")
    _in(made.client, "ip", "route", "add", "default", "via", "10.98.0.1")
    _in(made.pod, "ip", "route", "add", "default", "via", "10.99.0.1")
    _in(made.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    echo = subprocess.Popen(
        ["ip", "netns", "exec", made.pod, sys.executable, "-m", "kpng.testing.echo", "pod", "8080"],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert echo.stdout is not None
    try:
        assert echo.stdout.readline().strip() == b"ready"
        yield made
    finally:
        echo.terminate()
        echo.wait(timeout=5)
        echo.stdout.close()


def _backend(netns: str, *, nfacct_in: str | None = None, **options: Any) -> IptablesBackend:
    """to-iptables in ``netns``, its nfacct objects in the namespace at path ``nfacct_in``
    (default: the same)."""
    iptables = Iptables(Tools("nft"), prefix=("ip", "netns", "exec", netns))
    return IptablesBackend(
        iptables=iptables,
        options=Options(cluster_cidrs=("10.244.0.0/16",), **options),
        families=("v4",),
        once=True,
        nfacct=Nfacct(nfacct_in or f"/run/netns/{netns}"),
    )


NFNL_MSG_ACCT_DEL = 3
INVALID = "kubeproxy_iptables_ct_state_invalid_dropped_packets_total"
LOCALHOST = "kubeproxy_iptables_localhost_nodeports_accepted_packets_total"


def _nfacct_series(backend: IptablesBackend) -> dict[str, tuple[str, float]]:
    """kpng's ``/metrics`` with ``backend`` as its one backend: each nfacct series' help text
    and value, by the name kube-proxy gives it."""
    status = Status(timeout=60.0)
    status.track(Fanout([Feeder("to-iptables", backend)]))
    found = {}
    for family in text_string_to_metric_families(scrape(status).decode()):
        for sample in family.samples:
            if sample.name in (INVALID, LOCALHOST):
                assert family.type == "counter"
                found[sample.name] = (family.documentation, sample.value)
    return found


def _web() -> ServiceEndpoints:
    return ServiceEndpoints(
        states.service("web", node_port=NODE_PORT), (states.endpoint(POD, 8080),)
    )


def _apply(backend: IptablesBackend) -> None:
    web = _web()

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"web": web}))
        finally:
            await backend.close()

    asyncio.run(scenario())


def _probe(netns: str, host: str) -> str:
    argv = [sys.executable, "-m", "kpng.testing.probe", "tcp", host, str(NODE_PORT)]
    out = _in(netns, *argv, "--count", "1", "--timeout", "2")
    result: str = json.loads(out)["results"][0]
    return result


@pytest.mark.parametrize("localhost", [True, False], ids=["localhost-nodeports", "off"])
def test_a_node_port_answers_on_127_0_0_1_from_the_node_only_when_asked(
    bed: Bed, localhost: bool
) -> None:
    _in(bed.node, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=0")
    backend = _backend(bed.node, localhost_nodeports=localhost)
    _apply(backend)
    answer = _probe(bed.node, "127.0.0.1")
    if localhost:
        # DNATed to the pod and masqueraded: the pod sees the node's address, not 127.0.0.1.
        assert answer == "pod 10.99.0.1"
        assert _in(bed.node, "sysctl", "-n", "net.ipv4.conf.all.route_localnet").strip() == "1"
        assert "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8" in _in(
            bed.node, "iptables-nft-save", "-t", "filter"
        )
    else:
        assert answer == "refused"
    # The node's own address serves it either way.
    assert _probe(bed.node, "10.99.0.1") == "pod 10.99.0.1"
    # One connection to 127.0.0.1, counted once (nat sees its first packet), as kube-proxy
    # counts it; the object is there, at 0, without the option too.
    text = "Number of packets accepted on nodeports of loopback interface"
    assert _nfacct_series(backend)[LOCALHOST] == (text, 1 if localhost else 0)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _lone_rst(source: str, destination: str, port: int) -> bytes:
    """A TCP RST of no connection: conntrack has no state to start from it, so INVALID."""
    header = struct.pack("!HHIIBBHHH", 40000, port, 1, 0, 5 << 4, 0x04, 0, 0, 0)
    pseudo = socket.inet_aton(source) + socket.inet_aton(destination)
    pseudo += struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(header))
    checksum = _checksum(pseudo + header)
    return header[:16] + struct.pack("!H", checksum) + header[18:]


def _send_invalid(bed: Bed, count: int) -> None:
    packet = _lone_rst("10.98.0.2", POD, 8080).hex()
    code = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)\n"
        f"for _ in range({count}): s.sendto(bytes.fromhex('{packet}'), ('{POD}', 0))\n"
    )
    _in(bed.client, sys.executable, "-c", code)


def _invalid_drops(bed: Bed) -> int | None:
    """The packets kube-proxy's INVALID rule counted, from ``iptables-save -c`` (None: no such
    rule)."""
    saved = _in(bed.node, "iptables-nft-save", "-c", "-t", "filter")
    match = re.search(
        r"^\[(\d+):\d+\] -A KUBE-FORWARD -m conntrack --ctstate INVALID "
        r"(?:-m nfacct --nfacct-name +ct_state_invalid_dropped_pkts )?-j DROP$",
        saved,
        re.MULTILINE,
    )
    return None if match is None else int(match.group(1))


@pytest.mark.parametrize("drop", [True, False], ids=["dropped", "no-drop-invalid"])
def test_a_forwarded_packet_conntrack_finds_invalid_is_dropped_and_counted(
    bed: Bed, drop: bool
) -> None:
    backend = _backend(bed.node, drop_invalid=drop)
    _apply(backend)
    _send_invalid(bed, 3)
    assert _invalid_drops(bed) == (3 if drop else None)
    text = "packets dropped by iptables to work around conntrack problems"
    assert _nfacct_series(backend)[INVALID] == (text, 3 if drop else 0)
    # A connection through the node is still forwarded.
    assert _probe(bed.client, "10.98.0.1") == "pod 10.99.0.1"


def test_without_nfacct_the_rules_have_no_match_and_metrics_no_series(bed: Bed) -> None:
    """A kernel without nfnetlink_acct refuses to make the objects: kube-proxy then writes
    its rules without the match and exports neither series. Here the objects' namespace is
    one that does not exist, so every request fails as on such a kernel."""
    backend = _backend(
        bed.node, localhost_nodeports=True, nfacct_in="/run/netns/kpng-no-such-namespace"
    )
    _apply(backend)
    _send_invalid(bed, 2)
    assert _invalid_drops(bed) == 2
    assert _probe(bed.node, "127.0.0.1") == "pod 10.99.0.1"
    assert "nfacct" not in _in(bed.node, "iptables-nft-save")
    assert _nfacct_series(backend) == {}


def test_objects_deleted_with_the_rules_are_made_again_by_the_repair(bed: Bed) -> None:
    """A program that flushes kpng's chains may delete the objects they named as well (the
    kernel refuses while a rule names one): the repair's full sync makes them again, or its
    restore, naming them, would be refused."""
    netns = f"/run/netns/{bed.node}"
    backend = _backend(bed.node)
    iptables = Iptables(Tools("nft"), prefix=("ip", "netns", "exec", bed.node))

    async def scenario() -> None:
        try:
            await backend.apply(states.state(1, {"web": _web()}))
            _in(bed.node, "iptables-nft", "-F", "KUBE-FORWARD")
            for name in (INVALID_DROPPED, LOCALHOST_ACCEPTED):
                with netfilter_socket(netns) as sock:
                    sock.bind((0, 0))
                    sock.send(request(NFNL_MSG_ACCT_DEL, name))
                    assert parse(sock.recv(1 << 16)).error == 0
            assert Nfacct(netns).packets(INVALID_DROPPED) is None
            drift = await backend.check_kernel(iptables)
            assert drift is not None
            assert drift.kind == "rules"
        finally:
            await backend.close()

    asyncio.run(scenario())
    assert Nfacct(netns).packets(INVALID_DROPPED) == 0
    _send_invalid(bed, 2)
    assert _invalid_drops(bed) == 2
    assert Nfacct(netns).packets(INVALID_DROPPED) == 2


RULES_TOTAL = "kubeproxy_sync_proxy_rules_iptables_total"
RULES_LAST = "kubeproxy_sync_proxy_rules_iptables_last"


def test_the_rule_counts_are_the_rules_kpng_holds_in_the_kernel(bed: Bed) -> None:
    """kube-proxy's ``sync_proxy_rules_iptables_total`` and ``_last`` per table and family: what
    kpng's own chains hold in the kernel after a full sync, which wrote them all."""
    backend = _backend(bed.node)
    _apply(backend)
    status = Status(timeout=60.0)
    status.track(Fanout([Feeder("to-iptables", backend)]))
    series: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(scrape(status).decode()):
        for sample in family.samples:
            if sample.name in (RULES_TOTAL, RULES_LAST):
                assert family.type == "gauge"
                labels = sample.labels
                series[(sample.name, labels["table"], labels["ip_family"])] = sample.value
    for table in ("filter", "nat"):
        saved = _in(bed.node, "iptables-nft-save", "-t", table).splitlines()
        # kpng's chains are KUBE-*; the jumps into them from the built-in chains are kept, not
        # counted (as kube-proxy's natRules and filterRules hold its chains' rules only).
        held = sum(1 for line in saved if line.startswith("-A KUBE-"))
        assert held > 0
        assert series[(RULES_TOTAL, table, "IPv4")] == held, (table, saved)
        assert series[(RULES_LAST, table, "IPv4")] == held  # a full sync writes them all
