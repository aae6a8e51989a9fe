"""What every backend that programs a node's packet path takes from it and its flags:
kube-proxy's options (local traffic detection, node port addresses, masquerade mark) and what is
filled in from the Node object. Shared by to-nft and to-iptables so that the two mean the same
by the same flag."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from kpng.client import NodeState, UsageError
from kpng.durations import parse_duration

log = logging.getLogger(__name__)

Fam = Literal["v4", "v6"]
FAMILIES: tuple[Fam, ...] = ("v4", "v6")

MASQUERADE_BIT = 14
"""The packet mark bit asking for masquerade by default: kube-proxy's, so that CNI plugins that
know it keep working (``--masquerade-bit`` changes it, as kube-proxy's does)."""


@dataclass(frozen=True)
class Options:
    """The node's settings that shape the skeleton."""

    cluster_cidrs: tuple[str, ...] = ()
    """Pod CIDRs: sources inside are pods (no masquerade to ClusterIPs; eTP=Local
    short-circuit); sources outside reaching a ClusterIP are masqueraded. kube-proxy's
    ``--detect-local-mode`` ClusterCIDR, or NodeCIDR when they are the node's own."""
    pod_interface: str = ""
    """Instead of CIDRs, pods are whatever arrives on this interface (``cbr0``: kube-proxy's
    BridgeInterface mode) or on interfaces named with this prefix (``veth*``:
    InterfaceNamePrefix)."""
    nodeport_addresses: tuple[str, ...] = ()
    """CIDRs of the node addresses that serve node ports: local addresses inside them, never
    loopback (but with ``localhost_nodeports``); a family with none of them: every local address
    of it but loopback."""
    masquerade_all: bool = False
    """Masquerade all traffic to ClusterIPs, pods' included (kube-proxy's --masquerade-all)."""
    service_cidrs: tuple[str, ...] = ()
    """The cluster's ServiceCIDRs: new connections to their IPs that no service holds are
    dropped, as kube-proxy does."""
    masquerade_bit: int = MASQUERADE_BIT
    drop_invalid: bool = True
    """to-iptables: drop forwarded packets conntrack finds INVALID, as kube-proxy's iptables mode
    does unless conntrack is liberal (``nf_conntrack_tcp_be_liberal``); to-nft never does, as
    kube-proxy's nftables mode."""
    localhost_nodeports: bool = False
    """to-iptables: IPv4 node ports also on 127.0.0.0/8, when ``nodeport_addresses`` let
    loopback in (none, or a CIDR holding it), as kube-proxy's iptables mode's
    ``localhostNodePorts``. to-nft: TCP node ports on 127.0.0.1 and ::1 through a proxy, in
    each family whose ``nodeport_addresses`` name loopback itself, and the others refused there,
    as kube-proxy's nftables mode with KubeProxyNFTablesLocalhostNodePorts."""
    nfacct: frozenset[str] = frozenset()
    """to-iptables: the nfacct objects its rules count into, of ``_nfacct.COUNTERS`` (those the
    kernel made): the INVALID drops and the accepted localhost node port packets, as kube-proxy's
    iptables mode counts them for its metrics; none where the kernel has no nfnetlink_acct."""
    traffic_counters: bool = False
    """to-nft: count each service port's new connections and those refused for want of
    endpoints (``--traffic-counters service``)."""
    endpoint_counters: bool = False
    """to-nft, with ``traffic_counters``: count each endpoint's new connections too
    (``--traffic-counters endpoint``)."""

    def cidrs(self, values: Iterable[str], fam: Fam) -> list[str]:
        want = 4 if fam == "v4" else 6
        return [c for c in values if ipaddress.ip_network(c, strict=False).version == want]

    @property
    def mark(self) -> int:
        return 1 << self.masquerade_bit


@dataclass(frozen=True)
class FromNode:
    """Options kube-proxy takes from its Node object, filled in from each state."""

    primary_nodeports: bool = False
    """``--nodeport-addresses primary``: node ports on the node's primary IPs."""
    pod_cidrs: bool = False
    """``--detect-local-mode NodeCIDR``: the node's pod CIDRs are the local pods."""
    bind_address: str = ""
    """kube-proxy's ``--bind-address``: the primary IP of its family, in place of the Node's."""

    def resolve(
        self, options: Options, node_ips: Sequence[str], pod_cidrs: Sequence[str]
    ) -> Options:
        """``options`` for a node with these primary IPs and pod CIDRs (either may be unknown:
        empty, and then node ports stay on every local address, and no source is local)."""
        if self.primary_nodeports:
            if self.bind_address and not ipaddress.ip_address(self.bind_address).is_unspecified:
                v6 = ":" in self.bind_address
                node_ips = [self.bind_address, *(ip for ip in node_ips if (":" in ip) != v6)]
            hosts = tuple(f"{ip}/{128 if ':' in ip else 32}" for ip in node_ips)
            options = dataclasses.replace(
                options, nodeport_addresses=(*options.nodeport_addresses, *hosts)
            )
        if self.pod_cidrs:
            options = dataclasses.replace(options, cluster_cidrs=tuple(pod_cidrs))
        return options


PRIMARY = "primary"
DETECT_LOCAL_MODES = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")


NODEPORT_KEYWORDS = {"all": ("0.0.0.0/0", "::/0"), "localhost": ("127.0.0.0/8", "::1/128")}
"""kube-proxy 1.37's keywords of nodePortAddresses, besides ``primary``: each stands for its CIDRs
(to-nft, as kube-proxy's nftables mode, serves node ports on loopback only with
``--localhost-nodeports``, its alpha gate KubeProxyNFTablesLocalhostNodePorts: without it,
``localhost`` alone serves none)."""


def _cidr_list(value: str, *, keywords: bool = False) -> tuple[str, ...]:
    """CIDRs; with ``keywords``, also ``primary`` (kept as is), ``all`` and ``localhost``
    (expanded), each at most once, in any combination."""
    items = [c.strip() for c in value.split(",") if c.strip()]
    cidrs: list[str] = []
    for c in items:
        if keywords and c in (PRIMARY, *NODEPORT_KEYWORDS):
            if items.count(c) > 1:
                raise argparse.ArgumentTypeError(f"{c!r} is given twice")
            cidrs += NODEPORT_KEYWORDS.get(c, (c,))
            continue
        try:
            ipaddress.ip_network(c, strict=False)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a CIDR: {c!r}") from exc
        cidrs.append(c)
    return tuple(cidrs)


def _ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an IP address: {value!r}") from exc


def add_sync_period(parser: argparse.ArgumentParser, *, checks: str) -> None:
    """``--sync-period``: kube-proxy's, how often a kernel backend checks that its rules are
    still what it applied (``checks``: what it looks at) and rewrites them if not."""
    parser.add_argument(
        "--sync-period",
        type=duration_argument,
        default=30.0,
        metavar="DURATION",
        help=f"how often to check {checks}, and rewrite every rule if another program changed "
        "them, as kube-proxy's syncPeriod (default 30s; 0: never; a full resync also runs "
        "hourly)",
    )


def duration_argument(value: str) -> float:
    """An argparse type: a Go duration (``1s``, ``500ms``) in seconds."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _masquerade_bit(value: str) -> int:
    if not value.isdigit() or int(value) > 31:
        raise argparse.ArgumentTypeError(f"a bit number from 0 to 31, not {value!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """kube-proxy's flags that shape a node's rules, and those every such backend has."""
    # kube-proxy's flag names, meaning what they mean there.
    parser.add_argument(
        "--cluster-cidr",
        type=_cidr_list,
        default=(),
        metavar="CIDR[,CIDR]",
        help="the pods' CIDRs (one per family): traffic from outside them to a ClusterIP is "
        "masqueraded, and pods inside are short-circuited under externalTrafficPolicy Local",
    )
    parser.add_argument(
        "--detect-local-mode",
        choices=DETECT_LOCAL_MODES,
        default="ClusterCIDR",
        help="what traffic comes from this node's pods: sources in --cluster-cidr, sources in "
        "the node's spec.podCIDRs (NodeCIDR), what arrives on --pod-bridge-interface, or on "
        "interfaces named --pod-interface-name-prefix* (default: ClusterCIDR)",
    )
    parser.add_argument("--pod-bridge-interface", metavar="NAME", default="")
    parser.add_argument("--pod-interface-name-prefix", metavar="PREFIX", default="")
    parser.add_argument(
        "--masquerade-all",
        action="store_true",
        help="masquerade all traffic to ClusterIPs, pods' included",
    )
    parser.add_argument(
        "--masquerade-bit",
        "--iptables-masquerade-bit",
        type=_masquerade_bit,
        default=MASQUERADE_BIT,
        metavar="BIT",
        help=f"the packet mark bit that asks for masquerade (default: {MASQUERADE_BIT})",
    )
    parser.add_argument(
        "--nodeport-addresses",
        type=functools.partial(_cidr_list, keywords=True),
        default=(),
        metavar="CIDR|primary|all|localhost[,...]",
        help="serve node ports only on the node's addresses in these CIDRs and keywords, as "
        "kube-proxy 1.37: primary (its primary IPs, from the Node's status), all (0.0.0.0/0, "
        "::/0), localhost (127.0.0.0/8, ::1/128); a family without one keeps every local "
        "address, and loopback never serves them but with --localhost-nodeports "
        "(default: every local address but loopback; kpng kube-proxy defaults to primary in "
        "nftables mode, to every local address in iptables mode, as kube-proxy)",
    )
    parser.add_argument(
        "--bind-address",
        metavar="IP",
        type=_ip,
        help="this node's primary IP of its family, in place of the Node's (for primary)",
    )
    parser.add_argument(
        "--min-sync-period",
        type=duration_argument,
        default=0.0,
        metavar="DURATION",
        help="least time between two transactions; changes meanwhile are applied together "
        "(e.g. 1s; default: 0, each change as soon as the previous one is applied)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print each change of the rules instead of applying it",
    )
    parser.add_argument(
        "--once", action="store_true", help="exit 0 once the first complete state is applied"
    )
    parser.add_argument(
        "--no-conntrack", action="store_true", help="do not delete stale UDP conntrack entries"
    )
    parser.add_argument(
        "--no-health-check", action="store_true", help="do not serve health check node ports"
    )


def options_from_args(args: argparse.Namespace) -> tuple[Options, FromNode]:
    """The layout's options, and what is filled in from the node, that these flags ask for."""
    mode = args.detect_local_mode
    interface = {
        "BridgeInterface": ("--pod-bridge-interface", args.pod_bridge_interface),
        "InterfaceNamePrefix": ("--pod-interface-name-prefix", args.pod_interface_name_prefix),
    }.get(mode)
    if interface is not None and not interface[1]:
        raise UsageError(f"--detect-local-mode {mode} needs {interface[0]}")
    pod_interface = ""
    if interface is not None:
        pod_interface = interface[1] + ("*" if mode == "InterfaceNamePrefix" else "")
    options = Options(
        cluster_cidrs=args.cluster_cidr if mode == "ClusterCIDR" else (),
        pod_interface=pod_interface,
        nodeport_addresses=tuple(c for c in args.nodeport_addresses if c != PRIMARY),
        masquerade_all=args.masquerade_all,
        masquerade_bit=args.masquerade_bit,
    )
    from_node = FromNode(
        primary_nodeports=PRIMARY in args.nodeport_addresses,
        pod_cidrs=mode == "NodeCIDR",
        bind_address=args.bind_address or "",
    )
    return options, from_node


def node_options(options: Options, from_node: FromNode, state: NodeState) -> Options:
    """``options`` completed by what ``state`` says of the node and the cluster; what it does
    not say yet is warned of, each time (a node's addresses come before its first state)."""
    resolved = from_node.resolve(options, state.node_ips, state.pod_cidrs)
    if from_node.primary_nodeports and not state.node_ips:
        log.warning(
            "node %s has no InternalIP or ExternalIP known to the source: node ports are "
            "served on every local address until it has",
            state.node,
        )
    if from_node.pod_cidrs and not state.pod_cidrs:
        log.warning(
            "node %s has no pod CIDRs known to the source: no traffic is detected as local "
            "(--detect-local-mode NodeCIDR) until it has",
            state.node,
        )
    return dataclasses.replace(resolved, service_cidrs=state.service_cidrs)
