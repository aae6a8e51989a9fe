"""kube-proxy's leftovers of every mode (backends/_kube_proxy.py): each backend names them at
start, ``kpng cleanup kube-proxy`` removes them and nothing of kpng's or of other software, and
says what it removed, a line per kind. Real nftables, iptables (both variants) and ip sets, in
network namespaces of the tests'; the leftovers are written as kube-proxy 1.37 writes them
(its chains, jumps and set names). IPVS itself is not in every kernel: its part is checked
against ``/proc/net/ip_vs`` listings given to the module."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kpng.backends._commands import CommandError
from kpng.backends._kube_proxy import KubeProxyLeftovers, Leftovers, parse_virtual_servers
from kpng.testing.netns import available
from rig import kubeapi as k
from rig.cluster import ControlPlane
from rig.kubeapi import KubeApi
from rig.portforward import forwarded_into

NETNS = pytest.mark.skipif(available() is not None, reason=str(available()))
IPTABLES = pytest.mark.skipif(
    shutil.which("iptables-legacy-restore") is None, reason="needs iptables (both variants)"
)
IPSET = pytest.mark.skipif(shutil.which("ipset") is None, reason="needs ipset")

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
"""

# kube-proxy's iptables mode, one service with one endpoint, as it writes them (IPv4).
IPTABLES_MODE = """\
*mangle
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SVC-XGLOHA7QRQ3V22RZ - [0:0]
:KUBE-SEP-IT2ZTR26TO4XFPTO - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp --dport 80 -j KUBE-SVC-XGLOHA7QRQ3V22RZ
-A KUBE-SVC-XGLOHA7QRQ3V22RZ -j KUBE-SEP-IT2ZTR26TO4XFPTO
-A KUBE-SEP-IT2ZTR26TO4XFPTO -p tcp -j DNAT --to-destination 10.244.1.2:8080
COMMIT
*filter
:KUBE-SERVICES - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT
COMMIT
"""  # noqa: E501 (rules as iptables-save prints them)

# kube-proxy's ipvs mode (IPv6: its ip sets are KUBE-6-*), its rules referencing an ip set.
IPVS_MODE = """\
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES -m set --match-set KUBE-6-CLUSTER-IP dst,dst -j ACCEPT
COMMIT
*filter
:KUBE-FORWARD - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SOURCE-RANGES-FIREWALL - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:KUBE-IPVS-OUT-FILTER - [0:0]
-A INPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-FILTER
-A OUTPUT -m comment --comment "kubernetes ipvs access filter" -j KUBE-IPVS-OUT-FILTER
COMMIT
"""

IPTABLES_MODE_CHAINS = (
    "nat KUBE-MARK-MASQ, nat KUBE-NODEPORTS, nat KUBE-POSTROUTING, nat KUBE-PROXY-CANARY, "
    "nat KUBE-SERVICES, nat KUBE-SEP-IT2ZTR26TO4XFPTO, nat KUBE-SVC-XGLOHA7QRQ3V22RZ, "
    "filter KUBE-EXTERNAL-SERVICES, filter KUBE-FORWARD, filter KUBE-NODEPORTS, "
    "filter KUBE-PROXY-CANARY, filter KUBE-PROXY-FIREWALL, filter KUBE-SERVICES, "
    "mangle KUBE-PROXY-CANARY"
)
IPVS_MODE_CHAINS = (
    "nat KUBE-LOAD-BALANCER, nat KUBE-MARK-MASQ, nat KUBE-NODE-PORT, nat KUBE-POSTROUTING, "
    "nat KUBE-SERVICES, filter KUBE-FORWARD, filter KUBE-IPVS-FILTER, filter KUBE-IPVS-OUT-FILTER, "
    "filter KUBE-NODE-PORT, filter KUBE-PROXY-FIREWALL, filter KUBE-SOURCE-RANGES-FIREWALL"
)


def _in(netns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _ok(netns: str, *argv: str, stdin: str | None = None) -> str:
    done = _in(netns, *argv, stdin=stdin)
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def _kpng(netns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return _in(netns, sys.executable, "-m", "kpng", *argv)


def _run_backend(netns: str, services: Path, *backend: str) -> str:
    done = _kpng(
        netns, "file", "--input", str(services),
        "to-local", "--node-name", "n", *backend, "--once", "--no-health-check",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "kube-proxy's leftovers" in line]


def _chains(netns: str, save: str) -> set[str]:
    return set(re.findall(r"^:(\S+)", _ok(netns, save), re.MULTILINE))


@pytest.fixture
def services(tmp_path: Path) -> Path:
    (tmp_path / "web.yaml").write_text(SERVICE)
    return tmp_path


@NETNS
@IPTABLES
@IPSET
@pytest.mark.parametrize("variant", ["nft", "legacy"])
def test_every_modes_leftovers_are_named_then_removed_leaving_others_rules(
    netns: str, services: Path, variant: str
) -> None:
    """A node's history: kube-proxy in nftables mode, iptables mode (IPv4) and ipvs mode
    (IPv6), in the iptables variant of the node. to-nft names each kind; the cleanup removes
    them, and leaves kubelet's chain, another program's chain, set and interface, and kpng's
    table."""
    for family in ("ip", "ip6"):
        _ok(netns, "nft", "add", "table", family, "kube-proxy")
    _ok(netns, "ipset", "create", "KUBE-6-CLUSTER-IP", "hash:ip,port", "family", "inet6")
    _ok(netns, "ipset", "create", "KUBE-LOOP-BACK", "hash:ip,port,ip")
    _ok(netns, "ipset", "create", "cni-allowed", "hash:ip")
    _ok(netns, f"iptables-{variant}-restore", "--noflush", stdin=IPTABLES_MODE)
    _ok(netns, f"ip6tables-{variant}-restore", "--noflush", stdin=IPVS_MODE)
    for command in (f"iptables-{variant}", f"ip6tables-{variant}"):
        _ok(netns, command, "-t", "nat", "-N", "CNI-HOSTPORT")
        _ok(netns, command, "-t", "nat", "-A", "PREROUTING", "-j", "CNI-HOSTPORT")
    # Only a dummy interface of that name is kube-proxy's; this one is another program's.
    _ok(netns, "ip", "link", "add", "kube-ipvs0", "type", "bridge")

    warned = _warnings(_run_backend(netns, services, "to-nft"))
    assert len(warned) == 1, warned
    label = f"iptables-{variant}"
    for part in (
        "nftables mode's tables: ip kube-proxy, ip6 kube-proxy",
        f"iptables mode's {label} IPv4 chains: {IPTABLES_MODE_CHAINS}",
        f"ipvs mode's {label} IPv6 chains: {IPVS_MODE_CHAINS}",
        "ipvs mode's ip sets: KUBE-6-CLUSTER-IP, KUBE-LOOP-BACK",
        "`kpng cleanup kube-proxy`",
    ):
        assert part in warned[0]
    assert "kube-ipvs0" not in warned[0]
    assert "KUBE-FIREWALL" not in warned[0]

    done = _kpng(netns, "cleanup", "kube-proxy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "kube-proxy: removed nftables mode's tables: ip kube-proxy, ip6 kube-proxy",
        f"kube-proxy: removed iptables mode's {label} IPv4 chains: {IPTABLES_MODE_CHAINS}",
        f"kube-proxy: removed ipvs mode's {label} IPv6 chains: {IPVS_MODE_CHAINS}",
        "kube-proxy: removed ipvs mode's ip sets: KUBE-6-CLUSTER-IP, KUBE-LOOP-BACK",
    ]

    tables = _ok(netns, "nft", "list", "tables")
    assert "kube-proxy" not in tables
    assert "table inet kpng" in tables
    assert _chains(netns, f"iptables-{variant}-save") == {
        *("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
        "CNI-HOSTPORT",
        "KUBE-FIREWALL",  # kubelet's: kube-proxy's cleanup leaves it too
    }
    saved = _ok(netns, f"iptables-{variant}-save")
    assert "-A INPUT -j KUBE-FIREWALL" in saved
    assert "-A PREROUTING -j CNI-HOSTPORT" in saved
    assert "kubernetes" not in saved
    assert not [c for c in _chains(netns, f"ip6tables-{variant}-save") if c.startswith("KUBE-")]
    assert _ok(netns, "ipset", "list", "-n").split() == ["cni-allowed"]
    assert _in(netns, "ip", "link", "show", "kube-ipvs0").returncode == 0

    assert _kpng(netns, "cleanup", "kube-proxy").stdout == "kube-proxy: nothing to remove\n"
    assert _warnings(_run_backend(netns, services, "to-nft")) == []


@NETNS
@IPTABLES
def test_to_iptables_takes_its_variants_chains_over_and_names_the_rest(
    netns: str, services: Path
) -> None:
    """kube-proxy's iptables mode in both variants; to-iptables runs in iptables-nft. Its first
    sync takes over the chains of its layout there, which are then kpng's: neither named nor
    removed. kube-proxy's chains outside kpng's layout there (its canaries, its health check
    chain), and the whole of the other variant's, are."""
    for variant in ("nft", "legacy"):
        _ok(netns, f"iptables-{variant}-restore", "--noflush", stdin=IPTABLES_MODE)

    warned = _warnings(_run_backend(netns, services, "to-iptables", "--iptables-mode", "nft"))
    assert len(warned) == 1, warned
    theirs_in_kpngs = (
        "nat KUBE-PROXY-CANARY, filter KUBE-NODEPORTS, filter KUBE-PROXY-CANARY, "
        "mangle KUBE-PROXY-CANARY"
    )
    assert f"iptables mode's iptables-nft IPv4 chains: {theirs_in_kpngs};" in warned[0]
    assert f"iptables mode's iptables-legacy IPv4 chains: {IPTABLES_MODE_CHAINS}" in warned[0]

    done = _kpng(netns, "cleanup", "kube-proxy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"kube-proxy: removed iptables mode's iptables-nft IPv4 chains: {theirs_in_kpngs}",
        f"kube-proxy: removed iptables mode's iptables-legacy IPv4 chains: {IPTABLES_MODE_CHAINS}",
    ]
    kpngs = _chains(netns, "iptables-nft-save")
    assert {"KPNG-IPTABLES", "KUBE-SERVICES", "KUBE-MARK-MASQ", "KUBE-FORWARD"} <= kpngs
    assert "KUBE-PROXY-CANARY" not in kpngs
    # kpng's chains still hold the service's rules (a REJECT: it has no endpoints), and the
    # jumps to them.
    saved = _ok(netns, "iptables-nft-save")
    assert '-A PREROUTING -m comment --comment "kubernetes service portals"' in saved
    assert "-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp" in saved
    assert "KUBE-SERVICES" not in _ok(netns, "iptables-legacy-save")
    # What kube-proxy left is gone; kpng's own cleanup still finds kpng's.
    assert _kpng(netns, "cleanup", "kube-proxy").stdout == "kube-proxy: nothing to remove\n"
    assert _kpng(netns, "cleanup", "iptables").stdout == "to-iptables: removed\n"


@NETNS
def test_each_backends_cleanup_reports_only_what_it_removed(netns: str, services: Path) -> None:
    """Regression: in a network namespace, to-nft's table went and `kpng cleanup` said
    "to-ebpf: removed" and "to-nft: nothing to remove" (to-ebpf's packet part is to-nft's
    table, and to-ebpf removed it without having pinned anything)."""
    _run_backend(netns, services, "to-nft")
    done = _kpng(netns, "cleanup")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "to-nft: removed" in lines
    assert "to-ebpf: nothing to remove" in lines
    assert "table inet kpng" not in _ok(netns, "nft", "list", "tables")
    done = _kpng(netns, "cleanup", "ebpf", "nft")
    assert done.stdout.splitlines() == ["to-ebpf: nothing to remove", "to-nft: nothing to remove"]


PROC_IP_VS = """\
IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port Forward Weight ActiveConn InActConn
TCP  0A600001:01BB rr
  -> 0AF40102:1F90      Masq    1      0          0
UDP  0A60000A:0035 rr
TCP  [fd00:0096:0000:0000:0000:0000:0000:0001]:01BB rr
FWM  00000010 wlc
"""


def test_ipvs_virtual_servers_read_from_the_kernels_listing() -> None:
    assert parse_virtual_servers(PROC_IP_VS) == [
        "TCP 10.96.0.1:443",
        "UDP 10.96.0.10:53",
        "TCP [fd00:0096:0000:0000:0000:0000:0000:0001]:443",
        "FWM 16",
    ]


class _Node:
    """A node's commands, answered from what it holds (as a kernel without IPVS cannot)."""

    def __init__(self, *, dummy: bool, sets: str) -> None:
        self.dummy, self.sets = dummy, sets
        self.ran: list[list[str]] = []

    async def run(self, argv: Sequence[str], stdin: bytes) -> tuple[int, str, str]:
        self.ran.append(list(argv))
        match list(argv):
            case ["cat", "/proc/net/ip_vs"]:
                return 0, PROC_IP_VS, ""
            case ["ip", "-d", "-o", "link", "show", "dev", "kube-ipvs0"]:
                kind = "dummy" if self.dummy else "bridge"
                return (0, f"5: kube-ipvs0: <BROADCAST,NOARP> mtu 1500\\    {kind} addrgenmode", "")
            case ["ipset", "list", "-n"]:
                return 0, self.sets, ""
            case ["ipvsadm", "--clear"] | ["ip", "link", "del", "kube-ipvs0"]:
                return 0, "", ""
            case ["ipset", "destroy", _]:
                return 0, "", ""
        raise CommandError(f"cannot run {argv[0]}: not on this node")  # iptables, nft


@pytest.mark.parametrize(
    ("dummy", "sets", "expected"),
    [
        (False, "cni-allowed\n", []),
        (
            True,
            "",
            [
                Leftovers(
                    "ipvs",
                    "virtual servers",
                    (
                        "TCP 10.96.0.1:443",
                        "UDP 10.96.0.10:53",
                        "TCP [fd00:0096:0000:0000:0000:0000:0000:0001]:443",
                        "FWM 16",
                    ),
                ),
                Leftovers("ipvs", "interface", ("kube-ipvs0",)),
            ],
        ),
    ],
    ids=["others-virtual-servers-stay", "kube-proxys-go"],
)
def test_ipvs_virtual_servers_are_kube_proxys_only_beside_its_other_ipvs_leftovers(
    dummy: bool, sets: str, expected: list[Leftovers]
) -> None:
    """IPVS virtual servers say nothing of who made them (keepalived makes them too): they are
    kube-proxy's where its interface, ip sets or ipvs chains are; then they are flushed, as
    kube-proxy's cleanup does, and the interface deleted."""
    node = _Node(dummy=dummy, sets=sets)
    leftovers = KubeProxyLeftovers(run=node.run)
    assert asyncio.run(leftovers.find()) == expected
    node.ran.clear()
    assert asyncio.run(leftovers.remove()) == expected
    removals = [argv for argv in node.ran if argv[:2] in (["ipvsadm", "--clear"], ["ip", "link"])]
    assert removals == (
        [["ipvsadm", "--clear"], ["ip", "link", "del", "kube-ipvs0"]] if dummy else []
    )


def _kube_proxy_binary() -> Path | None:
    """The real kube-proxy of the newest supported release, if a real-node or e2e run has built
    it (rig.cluster); building it takes minutes, which this test does not spend. The
    newest one against every control plane: what is tested is what it leaves in iptables, and
    the other releases' control planes (make compat) build no kube-proxy."""
    from rig.cluster import KUBERNETES_VERSION, cache_root

    path = cache_root() / KUBERNETES_VERSION / "programs" / "kube-proxy"
    return path if os.access(path, os.X_OK) else None


@NETNS
@IPTABLES
@pytest.mark.apiserver
@pytest.mark.skipif(_kube_proxy_binary() is None, reason="needs a built kube-proxy (real nodes)")
def test_real_kube_proxys_iptables_mode_is_named_and_cleaned_up(
    netns: str,
    services: Path,
    control_plane: ControlPlane,
    kube_api: KubeApi,
    kube_namespace: str,
    tmp_path: Path,
) -> None:
    """kube-proxy itself, in iptables mode, in the namespace for as long as its first sync
    takes (the control plane's port is forwarded into the namespace's loopback), then stopped,
    as on a node being migrated: what it leaves is named by to-nft and removed, with nothing
    of kpng's."""
    ns = kube_namespace
    kube_api.create(k.service("web", ns))
    kube_api.create(k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.244.1.2")]))
    binary = _kube_proxy_binary()
    assert binary is not None
    argv = [
        "ip", "netns", "exec", netns, str(binary), "--proxy-mode=iptables",
        f"--kubeconfig={control_plane.kubeconfig}", "--hostname-override=n",
        # Zeros: kube-proxy leaves the host's conntrack sysctls alone.
        "--conntrack-max-per-core=0", "--conntrack-min=0",
        "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
    ]  # fmt: skip
    # Its health and metrics ports are the namespace's own: kube-proxy's defaults are free there.
    with (
        (tmp_path / "kube-proxy.log").open("w") as log,
        forwarded_into(netns, control_plane.apiserver_port),
    ):
        proxy = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not any(c.startswith("KUBE-SEP-") for c in _chains(netns, "iptables-nft-save")):
                assert proxy.poll() is None, (tmp_path / "kube-proxy.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "kube-proxy.log").read_text()
                time.sleep(0.5)
        finally:
            proxy.terminate()
            proxy.wait(timeout=30)
    left = {c for c in _chains(netns, "iptables-nft-save") if c.startswith("KUBE-")}
    assert {"KUBE-SERVICES", "KUBE-PROXY-CANARY", "KUBE-MARK-MASQ"} <= left

    warned = _warnings(_run_backend(netns, services, "to-nft"))
    assert len(warned) == 1, warned
    assert "iptables mode's iptables-nft IPv4 chains: nat KUBE-MARK-MASQ" in warned[0]
    assert "nat KUBE-SEP-" in warned[0]

    done = _kpng(netns, "cleanup", "kube-proxy")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("kube-proxy: removed iptables mode's iptables-nft IPv4 chains")
    left = {c for c in _chains(netns, "iptables-nft-save") if c.startswith("KUBE-")}
    # kubelet's chains, which kube-proxy creates too and its own cleanup leaves.
    assert left <= {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY"}
    assert "table inet kpng" in _ok(netns, "nft", "list", "tables")
