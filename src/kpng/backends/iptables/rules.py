"""kube-proxy's iptables layout, rendered from the node-local state (pure: no I/O).

The chains are kube-proxy's, so that an operator's habits (``iptables-save | grep KUBE-SVC``)
and tools keep working. In the ``nat`` table:

- ``KUBE-SERVICES`` (from PREROUTING and OUTPUT): one rule per service address and port, to the
  port's chain; last, the node's local addresses (``--nodeport-addresses``) to ``KUBE-NODEPORTS``.
- ``KUBE-NODEPORTS``: one rule per node port, to the port's ``KUBE-EXT-*``.
- ``KUBE-SVC-*``: a pick among one list of endpoints (``statistic --mode random``, rule i taking
  ``1/(n-i)`` of what is left), after ``recent`` checks for ClientIP affinity; the first rules of
  the chain for ClusterIP traffic mark for masquerade what comes from outside the pods. A port
  has one such chain per distinct list of endpoints it uses: ``KUBE-SVC-*`` for the endpoints of
  cluster-wide traffic (``Endpoint.Scopes.Cluster``), ``KUBE-SVL-*`` for those of a Local
  traffic policy, and ``KUBE-SVX-*`` in the rare case where internal and external traffic both
  have a Local list and the two differ (terminating fallbacks).
- ``KUBE-EXT-*``: external traffic (external IPs, LB IPs, node ports): masquerade under
  ``externalTrafficPolicy: Cluster``; under ``Local``, the short-circuit first (the pods'
  traffic and the node's, the latter masqueraded, go to the cluster-wide endpoints).
- ``KUBE-FW-*``: an LB IP with ``loadBalancerSourceRanges``: one rule per allowed range to
  ``KUBE-EXT-*``; the rest falls through, undNATed, to the filter table's drop.
- ``KUBE-SEP-*``: one endpoint of one service port: hairpin masquerade, then DNAT (and the
  ``recent --set`` of affinity).
- ``KUBE-POSTROUTING`` and ``KUBE-MARK-MASQ``: masquerade of marked packets, random-fully.

In the ``filter`` table, rules match what NAT left alone (a DNATed packet no longer has the
service address): ``KUBE-SERVICES`` (FORWARD, OUTPUT) rejects a ClusterIP port with no endpoint
(REJECT: none anywhere in the family; DROP: a Local policy with none here), rejects a ClusterIP
on a port no service defines, and drops unallocated IPs of the ServiceCIDRs;
``KUBE-EXTERNAL-SERVICES`` (INPUT, FORWARD) does the same for external IPs, LB IPs and node ports;
``KUBE-PROXY-FIREWALL`` drops what ``KUBE-FW-*`` did not let through; ``KUBE-FORWARD`` drops
what conntrack finds INVALID (unless ``--no-drop-invalid``), then accepts marked and established
traffic where FORWARD's policy is DROP.

With ``--localhost-nodeports`` (IPv4 only, as kube-proxy), node ports also answer on 127.0.0.1:
the nat rule that kept loopback out of ``KUBE-NODEPORTS`` goes, and ``KUBE-FIREWALL`` (from
INPUT and OUTPUT) drops what reaches 127.0.0.0/8 from elsewhere, the hole ``route_localnet``
opens otherwise (CVE-2020-8558). That chain and its jumps are kube-proxy's and once kubelet's: a
cleanup leaves them, as kube-proxy's does, and turning the option off leaves the guard in place
(``route_localnet`` stays set too).

As kube-proxy, the INVALID drop and, with ``--localhost-nodeports``, a rule of each node port's
ahead of its own, for 127.0.0.0/8 alone, count into nfacct objects (``Options.nfacct``, those
the kernel made: ``_nfacct``), which ``/metrics`` reads as
``kubeproxy_iptables_ct_state_invalid_dropped_packets_total`` and
``kubeproxy_iptables_localhost_nodeports_accepted_packets_total``. A kernel without
nfnetlink_acct gets the rules without the match, as kube-proxy writes them then.

Rules are written for ``iptables-restore`` (``-A CHAIN ...``, no table option), one family per
rendering: IPv6 goes through ip6tables with the same chains.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from kpng.backends._endpoints import (
    EndpointValue,
    affinity_timeout,
    allowed_from_node,
    allowed_ranges,
    endpoints_by_scope,
    serving_endpoints,
)

# The layout's chain names live beside the backends, where kube-proxy's leftovers are told from
# them; re-exported here with the rest of the layout.
from kpng.backends._iptables_chains import OWNER_CHAIN as OWNER_CHAIN
from kpng.backends._iptables_chains import SERVICE_CHAIN_PREFIXES as SERVICE_CHAIN_PREFIXES
from kpng.backends._iptables_chains import SHARED_CHAINS as SHARED_CHAINS
from kpng.backends._nfacct import INVALID_DROPPED, LOCALHOST_ACCEPTED
from kpng.backends._node import Fam, Options
from kpng.client import PortMapping, ServiceEndpoints

_PROTOCOLS = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}
_LOOPBACK = {"v4": "127.0.0.0/8", "v6": "::1/128"}

NAT, FILTER = "nat", "filter"
TABLES = (NAT, FILTER)

_NEW = "-m conntrack --ctstate NEW"
_FIREWALL = '-m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL'
_EXTERNAL = (
    '-m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES'
)
_PORTALS = '-m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
Jump = tuple[str, str, str]
"""(table, built-in chain, rule)."""
JUMPS: tuple[Jump, ...] = (
    (NAT, "PREROUTING", _PORTALS),
    (NAT, "OUTPUT", _PORTALS),
    (NAT, "POSTROUTING", '-m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING'),
    (FILTER, "INPUT", f"{_NEW} {_FIREWALL}"),
    (FILTER, "INPUT", f"{_NEW} {_EXTERNAL}"),
    (FILTER, "FORWARD", f"{_NEW} {_FIREWALL}"),
    (FILTER, "FORWARD", '-m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD'),
    (FILTER, "FORWARD", f"{_NEW} {_PORTALS}"),
    (FILTER, "FORWARD", f"{_NEW} {_EXTERNAL}"),
    (FILTER, "OUTPUT", f"{_NEW} {_FIREWALL}"),
    (FILTER, "OUTPUT", f"{_NEW} {_PORTALS}"),
)
"""(table, built-in chain, rule): how packets reach kpng's chains; kept in place, never flushed
(other software's rules live in those chains too). Each is kube-proxy's iptables mode's jump,
comment included, as ``iptables-save`` prints it: a node moving between kube-proxy and kpng has
one jump to each chain, whichever of them wrote it, never two."""

LOCALNET_CHAIN = "KUBE-FIREWALL"
LOCALNET_GUARD = (
    '! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" '
    "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
)
"""kube-proxy's rule, as ``iptables-save`` prints it: a packet to 127.0.0.0/8 from elsewhere is
dropped unless NAT made it or it belongs to a connection."""
LOCALNET_JUMPS: tuple[Jump, ...] = (
    (FILTER, "INPUT", f"-j {LOCALNET_CHAIN}"),
    (FILTER, "OUTPUT", f"-j {LOCALNET_CHAIN}"),
)
"""kube-proxy's, without a comment (kubelet's were the same)."""


def drop_invalid(options: Options) -> str:
    """KUBE-FORWARD's first rule: the INVALID drop, counted when the kernel has the object."""
    counted = (
        f"-m nfacct --nfacct-name {INVALID_DROPPED} " if INVALID_DROPPED in options.nfacct else ""
    )
    return f"-m conntrack --ctstate INVALID {counted}-j DROP"


_LOOPBACK_V4 = ipaddress.ip_address("127.0.0.1")


def localhost_nodeports(options: Options, fam: Fam) -> bool:
    """Whether ``fam``'s node ports answer on loopback: IPv4 only (IPv6 cannot route ::1 out),
    when asked and the node port addresses let 127.0.0.1 in (none given: every address)."""
    if fam != "v4" or not options.localhost_nodeports:
        return False
    cidrs = options.cidrs(options.nodeport_addresses, fam)
    return not cidrs or any(_LOOPBACK_V4 in ipaddress.ip_network(c, strict=False) for c in cidrs)


def jumps(options: Options, fam: Fam) -> tuple[Jump, ...]:
    """Every jump ``fam``'s rules need in the built-in chains, in order."""
    return JUMPS + (LOCALNET_JUMPS if localhost_nodeports(options, fam) else ())


ChainKey = tuple[str, str]
"""(table, chain)."""


@dataclass
class Contribution:
    """What one service puts into one family's tables."""

    chains: dict[ChainKey, tuple[str, ...]] = field(default_factory=dict)
    """Its own chains (nat) and their rules."""
    shared: dict[ChainKey, list[str]] = field(default_factory=dict)
    """Its rules in the shared chains, in order."""
    problems: list[str] = field(default_factory=list)
    udp_frontends: dict[tuple[str, str], frozenset[EndpointValue]] = field(default_factory=dict)
    """As to-nft's: UDP (service address or "" for a node port, port) -> the endpoints serving
    it anywhere."""
    endpoint_chains: dict[str, str] = field(default_factory=dict)
    """Its KUBE-SEP chains' service port (``namespace/name:port``), whose traffic their DNAT
    rule counts (``counting.py``; their rules have no comment in large cluster mode)."""

    def add(self, table: str, chain: str, rule: str) -> None:
        self.shared.setdefault((table, chain), []).append(rule)


def chain_name(prefix: str, *parts: str) -> str:
    """kube-proxy's scheme: a prefix and 16 base32 characters of a SHA-256 of what the chain is
    for, within iptables' 28 characters."""
    # The first 16 base32 characters are those of the first 10 bytes (80 bits): encoding only
    # those cut chain naming, a fifth of a 10,000-service full sync, to a tenth of that.
    digest = hashlib.sha256("".join(parts).encode()).digest()
    return prefix + base64.b32encode(digest[:10]).decode()


def _host(address: str) -> str:
    return f"{address}/128" if ":" in address else f"{address}/32"


def _to(address: str, port: str) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def local_source(options: Options, fam: Fam, *, negate: bool = False) -> str | None:
    """The match for traffic from this node's pods (or, ``negate``, from anything else); None
    when kpng is not told what is local for ``fam``. One pod CIDR per family, as kube-proxy's
    iptables mode: the first of a family is the one matched."""
    op = "! " if negate else ""
    if options.pod_interface:
        return f"{op}-i {options.pod_interface.replace('*', '+')}"
    cidrs = options.cidrs(options.cluster_cidrs, fam)
    return f"{op}-s {cidrs[0]}" if cidrs else None


def skeleton(options: Options, fam: Fam) -> dict[ChainKey, list[str]]:
    """The shared chains' fixed rules: those before every service's (masquerade) and after
    (node ports, unallocated service IPs)."""
    mark = f"{options.mark:#x}"
    rules: dict[ChainKey, list[str]] = {
        (NAT, "KUBE-MARK-MASQ"): [f"-j MARK --or-mark {mark}"],
        (NAT, "KUBE-POSTROUTING"): [
            f"-m mark ! --mark {mark}/{mark} -j RETURN",
            f"-j MARK --xor-mark {mark}",
            '-m comment --comment "kubernetes service traffic requiring SNAT" '
            "-j MASQUERADE --random-fully",
        ],
        (FILTER, "KUBE-FORWARD"): [
            *([drop_invalid(options)] if options.drop_invalid else []),
            f"-m mark --mark {mark}/{mark} -j ACCEPT",
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        ],
        # What NAT translated no longer has a service address: it need not walk the REJECT of
        # every ClusterIP below, which would cost every new connection a rule per service.
        (FILTER, "KUBE-SERVICES"): ["-m conntrack --ctstate DNAT -j RETURN"],
    }
    if localhost_nodeports(options, fam):
        rules[(FILTER, LOCALNET_CHAIN)] = [LOCALNET_GUARD]
    return rules


def tail(options: Options, fam: Fam) -> dict[ChainKey, list[str]]:
    """The shared chains' last rules, after every service's."""
    nat = [] if localhost_nodeports(options, fam) else [f"-d {_LOOPBACK[fam]} -j RETURN"]
    cidrs = options.cidrs(options.nodeport_addresses, fam)
    local = "-m addrtype --dst-type LOCAL"
    nat += [f"-d {c} {local} -j KUBE-NODEPORTS" for c in cidrs] or [f"{local} -j KUBE-NODEPORTS"]
    drop = [f"-d {c} -j DROP" for c in options.cidrs(options.service_cidrs, fam)]
    return {(NAT, "KUBE-SERVICES"): nat, (FILTER, "KUBE-SERVICES"): drop}


LARGE_CLUSTER_ENDPOINTS = 1000
"""kube-proxy's large cluster mode: above this many endpoints (service ports' endpoints,
summed), the rules of the KUBE-SVC and KUBE-SEP chains carry no comment. iptables-legacy reads
and writes the whole table at every restore, and a comment match is some 256 bytes a rule: at
10k services x 10, one endpoint's change took 1.2 s instead of 1.9 s without them."""


def contribute(
    se: ServiceEndpoints,
    fam: Fam,
    options: Options,
    node_ips: Sequence[str] = (),
    *,
    comments: bool = True,
) -> Contribution:
    """Every chain and shared rule of ``se`` in family ``fam`` (pure); ``comments``: on the
    rules of its endpoint chains too (not in large cluster mode)."""
    out = Contribution()
    service = se.service
    ips = service.IPs
    v6 = fam == "v6"
    if ips is None or ips.ClusterIPs is None or not ips.ClusterIPs.family(v6):
        return out
    cluster_ips = list(ips.ClusterIPs.family(v6))
    external_ips = list(ips.ExternalIPs.family(v6) if ips.ExternalIPs else ())
    lb_ips = list(ips.LoadBalancerIPs.family(v6) if ips.LoadBalancerIPs else ())
    timeout = affinity_timeout(service)
    name = f"{service.Namespace}/{service.Name}"
    for port in service.Ports:
        proto = _PROTOCOLS.get(port.Protocol)
        if proto is None or not 0 < port.Port < 65536:
            out.problems.append(f"port {port.Name or port.Port}: unsupported protocol or port")
            continue
        _port(
            out,
            se,
            port,
            fam=fam,
            options=options,
            proto=proto,
            name=name,
            timeout=timeout,
            addresses=(cluster_ips, external_ips, lb_ips),
            node_ips=node_ips,
            comments=comments,
        )
    for cip in cluster_ips:
        # Still the cluster IP after NAT: a port no service defines. Refused at once.
        out.add(FILTER, "KUBE-SERVICES", f"-d {_host(cip)} -j REJECT")
    return out


def _port(
    out: Contribution,
    se: ServiceEndpoints,
    port: PortMapping,
    *,
    fam: Fam,
    options: Options,
    proto: str,
    name: str,
    timeout: int,
    addresses: tuple[list[str], list[str], list[str]],
    node_ips: Sequence[str],
    comments: bool,
) -> None:
    """``port``'s chains and shared rules; ``addresses``: the service's cluster, external and
    LB IPs of the family."""
    service = se.service
    cluster_ips, external_ips, lb_ips = addresses
    v6 = fam == "v6"
    p = str(port.Port)
    port_id = f"{name}:{port.Name}"
    comment = f'-m comment --comment "{port_id}"'
    ep_comment = f"{comment} " if comments else ""
    """The endpoint chains' own: none in large cluster mode."""
    match = f"-p {proto} -m {proto}"
    usable = port.UsableEndpoints is not None and bool(
        port.UsableEndpoints.V6 if v6 else port.UsableEndpoints.V4
    )
    internal, external, cluster_wide = endpoints_by_scope(se.endpoints, port, v6)
    no_endpoints = "DROP" if usable else "REJECT"

    def sep(ep: EndpointValue) -> str:
        return chain_name("KUBE-SEP-", port_id, proto, _to(*ep))

    def pick_chain(eps: list[EndpointValue]) -> str | None:
        """The chain balancing over ``eps`` (made once per list), or None when empty."""
        if not eps:
            return None
        if eps == cluster_wide:
            prefix = "KUBE-SVC-"
        elif eps == internal or internal == cluster_wide:
            prefix = "KUBE-SVL-"
        else:
            prefix = "KUBE-SVX-"
        chain = chain_name(prefix, port_id, proto)
        key = (NAT, chain)
        if key in out.chains:
            return chain
        rules: list[str] = []
        if timeout:
            rules += [
                f"{ep_comment}-m recent --name {sep(ep)} --rsource "
                f"--rcheck --seconds {timeout} --reap -j {sep(ep)}"
                for ep in eps
            ]
        n = len(eps)
        for i, ep in enumerate(eps):
            chance = f"-m statistic --mode random --probability {1 / (n - i):.10f} "
            rules.append(f"{ep_comment}{chance if i < n - 1 else ''}-j {sep(ep)}")
            address, target = ep
            remember = f" -m recent --name {sep(ep)} --rsource --set" if timeout else ""
            out.endpoint_chains[sep(ep)] = port_id
            out.chains[(NAT, sep(ep))] = (
                f"{ep_comment}-s {_host(address)} -j KUBE-MARK-MASQ",
                f"{ep_comment}{match}{remember} -j DNAT --to-destination {_to(address, target)}",
            )
        out.chains[key] = tuple(rules)
        return chain

    internal_chain = pick_chain(internal)
    if internal_chain is not None:
        remote = local_source(options, fam, negate=True)
        masq: list[str] = []
        for cip in cluster_ips:
            dest = f"{comment} -d {_host(cip)} {match} --dport {p}"
            if options.masquerade_all:
                masq.append(f"{dest} -j KUBE-MARK-MASQ")
            elif remote is not None:
                masq.append(f"{dest} {remote} -j KUBE-MARK-MASQ")
        out.chains[(NAT, internal_chain)] = (*masq, *out.chains[(NAT, internal_chain)])
    for cip in cluster_ips:
        dest = f"{comment} -d {_host(cip)} {match} --dport {p}"
        if internal_chain is not None:
            out.add(NAT, "KUBE-SERVICES", f"{dest} -j {internal_chain}")
        else:
            out.add(FILTER, "KUBE-SERVICES", f"{dest} -j {no_endpoints}")

    reached = bool(external_ips or lb_ips or port.NodePort)
    ext_chain: str | None = None
    if reached and usable:
        external_chain = pick_chain(external)
        rules: list[str] = []
        if service.ExternalTrafficToLocal:
            short = pick_chain(cluster_wide)
            if short is not None:
                pods = local_source(options, fam)
                if pods is not None:
                    rules.append(f"{comment} {pods} -j {short}")
                rules += [
                    f"{comment} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
                    f"{comment} -m addrtype --src-type LOCAL -j {short}",
                ]
        else:
            rules.append(f"{comment} -j KUBE-MARK-MASQ")
        if external_chain is not None:
            rules.append(f"{comment} -j {external_chain}")
        if rules:
            ext_chain = chain_name("KUBE-EXT-", port_id, proto)
            out.chains[(NAT, ext_chain)] = tuple(rules)
    external_filter = None if external else no_endpoints

    firewalled: dict[str, tuple[str, ...]] = {}
    for flt in service.IPFilters:
        ranges = allowed_ranges(
            (*flt.SourceRanges, *allowed_from_node(flt.SourceRanges, node_ips, lb_ips)), v6
        )
        if flt.TargetIPs and ranges:
            for target in flt.TargetIPs.family(v6):
                firewalled[target] = ranges
    for address in external_ips + lb_ips:
        dest = f"{comment} -d {_host(address)} {match} --dport {p}"
        allowed = firewalled.get(address)
        if allowed is not None:
            out.add(FILTER, "KUBE-PROXY-FIREWALL", f"{dest} -j DROP")
            if ext_chain is not None:
                fw = chain_name("KUBE-FW-", port_id, proto)
                out.chains[(NAT, fw)] = tuple(f"{comment} -s {r} -j {ext_chain}" for r in allowed)
                out.add(NAT, "KUBE-SERVICES", f"{dest} -j {fw}")
        elif ext_chain is not None:
            out.add(NAT, "KUBE-SERVICES", f"{dest} -j {ext_chain}")
        if external_filter is not None:
            out.add(FILTER, "KUBE-EXTERNAL-SERVICES", f"{dest} -j {external_filter}")
    if port.NodePort:
        np = f"{comment} {match} --dport {port.NodePort}"
        if ext_chain is not None:
            if LOCALHOST_ACCEPTED in options.nfacct and localhost_nodeports(options, fam):
                # kube-proxy's: the same jump, for loopback alone, counting what it accepts.
                out.add(
                    NAT,
                    "KUBE-NODEPORTS",
                    f"{comment} -d {_LOOPBACK[fam]} {match} --dport {port.NodePort} "
                    f"-m nfacct --nfacct-name {LOCALHOST_ACCEPTED} -j {ext_chain}",
                )
            out.add(NAT, "KUBE-NODEPORTS", f"{np} -j {ext_chain}")
        if external_filter is not None:
            out.add(
                FILTER,
                "KUBE-EXTERNAL-SERVICES",
                f"{comment} -m addrtype --dst-type LOCAL {match} --dport {port.NodePort} "
                f"-j {external_filter}",
            )
    if proto == "udp":
        serving = serving_endpoints(port, (*internal, *external, *cluster_wide))
        for address in (*cluster_ips, *external_ips, *lb_ips):
            out.udp_frontends[(address, p)] = serving
        if serving and port.NodePort:
            front = ("", str(port.NodePort))
            out.udp_frontends[front] = serving | out.udp_frontends.get(front, frozenset())
