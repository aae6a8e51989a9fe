"""kpng's nftables layout: the fixed skeleton, and each service as elements of named maps (pure).

One ``inet`` table, ``kpng``, holds both families: one transaction (and so one atomic switch) for
a dual-stack node, one table to take over or clean up, and base chains registered once. Rules use
``ip``/``ip6`` selectors, which match only their family, and per-family maps (``-v4``/``-v6``)
because a map's key has one address type.

Per-service data lives only in **elements** (measured on a 2-core VM: 100k elements load in under a
second where 10k chains take many): a service port is found by a verdict map keyed by
``address . protocol . port`` (``proto . port`` for node ports), whose verdict is ``goto
pick-<kind>-<family>-<N>``, one chain per *endpoint count* N shared by every service with N
endpoints. That chain picks an index i uniformly (rule i, for i < N - 1, takes it with
``numgen random mod (N - i) 0``: probability 1/(N - i) of what is left) and DNATs through
endpoint map ``<kind>-eps-<family>-<i>``, keyed like the verdict map. No chain per service or
per endpoint, except for ClientIP session affinity (below).

One endpoint map per index, with named types, rather than one map with the index in its key:
that key needs ``typeof ... th dport . numgen random mod 1``, which nft 1.0.6 cannot read back
from the kernel ("conflicting protocols specified: ip vs. th"), so every later transaction
adding a rule that used the map was refused (``udp dport`` in its place makes nft add a
``meta l4proto udp`` match to those rules).

A service port with no endpoint for a kind of traffic has the verdict ``goto reject`` (ICMP port
unreachable: the client sees "connection refused" at once) when its family has no usable
endpoint anywhere, else ``drop``.

With ``--traffic-counters service``, the ``cluster``, ``external`` and ``nodeport`` maps give
each element a counter (``COUNTED_KINDS``): the nat hooks see a connection's first packet only,
so an element counts its new connections, refused or dropped ones too when its verdict is
``goto reject`` or ``drop``. Nothing is added to the packet path but that counter, and nothing
to a sync: the counters are part of the elements kpng writes anyway (``counting.py``). With
``--traffic-counters endpoint`` those kinds' endpoint maps count too: a pick chain looks up one
endpoint map per new connection (the ``numgen`` match before it fails for the others), so each
endpoint element counts the connections DNATed to its endpoint. A ClientIP-affinity service
port's chains DNAT through the same counted endpoint maps then (below), so that its endpoints
count too.

A new connection to a ClusterIP on a port no service defines is rejected too, as in kube-proxy:
after DNAT (chains ``filter-forward``, for pods, and ``filter-output-post-dnat``, for the node),
a packet whose destination is still in ``cluster-ips-<f>`` (every service's ClusterIPs) matched
no service port. A new connection to an IP of the cluster's ServiceCIDRs that no service holds
is dropped there too, as in kube-proxy.

Kinds of traffic, each a dispatch map ``<kind>-<f>`` and endpoint maps ``<kind>-eps-<f>-<i>``:

==============  ====================  ============================================
kind            key                   endpoints (``Endpoint.Scopes``)
==============  ====================  ============================================
``cluster``     ClusterIP . proto .   Internal
                port
``external``    externalIP or LB IP   External
``nodeport``    proto . node port     External (to a node address: below)
``external-sc`` like ``external``     Cluster: eTP=Local short-circuit for local
``nodeport-sc`` like ``nodeport``     pods (``--cluster-cidr``) and the node itself
==============  ====================  ============================================

ClientIP session affinity, as kube-proxy: one memory per service port (and family), shared by
every kind of traffic. A sticky service port's dispatch elements go, instead of a pick chain, to
its affinity chain for that kind's endpoints, ``affinity-<id>-<f>-<scope>`` (``<id>`` a hash of
the service port; ``<scope>`` ``internal``, ``external`` or ``cluster``: kinds with the same
endpoints share one chain): first a rule per endpoint sending a client remembered with it
there, then a numgen pick over the same endpoints, as in the pick chains. Every rule that DNATs
also ``update``s the memory with the client and the service's ``timeoutSeconds``, so an entry
lasts that long after the client's last new connection. A client sent to endpoint A through the
cluster IP is then sent to A through a node port, an external or LB IP, or the eTP=Local
short-circuit too, as long as A is an endpoint of that kind; otherwise (eTP=Local external
traffic and a remote A) it gets a new pick among that kind's endpoints, remembered as well (a
client remembered with two goes to the first, as with kube-proxy). An endpoint that goes takes
its rules along: its clients pick again, the others keep theirs, and a new endpoint disturbs no
one. A new ``timeoutSeconds`` rewrites the rules and keeps the memory.

The memory is one dynamic set per family, ``affinity-<f>``, of ``client . endpoint id``: the id
is 64 bits of a hash of the service port and the endpoint, written in the rules as two
``numgen inc mod 1 offset N`` (a constant: nft 1.0.6 cannot parse a literal in a concatenated
key, ``ip saddr . 10.0.0.1 @set``). Why one set: the kernel finds a named set by name in a list,
so loading S sets and the rules naming them costs O(S^2). Measured (nft 1.0.6, kernel 6.18,
``bench/bench_nft.py`` 1b): 10k services x 10 endpoints and 2,000 more with ClientIP affinity
took 47 s with a set per endpoint (kube-proxy's layout) where the 10k alone take 1.5 s; one set
makes it 3.8 s. The set holds at most ``AFFINITY_CLIENTS`` entries per family (a client per
endpoint it was sent to); past that, new clients are not remembered until entries expire. It is
the one thing a full sync keeps: the table is never deleted and recreated, so affinity survives a
restart, a takeover and a refused transaction, as in kube-proxy. An endpoint that goes leaves
its entries to expire; if it comes back before they do, its former clients stick to it again.

With ``--traffic-counters endpoint``, a sticky service port's counted kinds (``COUNTED_KINDS``)
get an affinity chain each, ``affinity-<id>-<f>-by-<kind>``, whose rule for endpoint i DNATs
through endpoint map ``<kind>-eps-<f>-<i>`` (keyed by the frontend, as a pick chain's) instead
of to a literal address: each new connection passes one DNAT, remembered or picked, so the
endpoint element counts it, as it does for a pick chain. The memory is the same, so a client
still sticks to its endpoint whichever kind it comes by. Without the flag, literal DNATs: no
lookup added to the packet path.

Masquerade (the mark bit ``Options.masquerade_bit`` set in the ``services`` chain, SNAT in
``masquerading``): traffic to a ClusterIP from outside ``--cluster-cidr`` (or from elsewhere than
the pods' interfaces; all of it with ``--masquerade-all``); external traffic of eTP=Cluster
services; node-originated short-circuited traffic; hairpin (a pod reaching itself, found with the
``hairpin-<f>`` set of ``addr . addr`` pairs, one per local endpoint address). With
``fully-random`` source ports, as kube-proxy: the kernel otherwise keeps each client's port
where it can, and concurrent connections (DNS over UDP) race for one mapping and lose packets.

Node ports are served on the node's own addresses (``fib daddr type local``), never loopback
by DNAT (kube-proxy's nftables mode does not DNAT them either), in every rule that matches one,
since a node port is matched by protocol and port alone. ``--nodeport-addresses`` narrows a
family to its local addresses inside the given CIDRs (set ``nodeport-addresses-<f>``); a family
given no CIDR keeps every local address, as in kube-proxy. Without the option kpng serves every
local non-loopback address, where kube-proxy's nftables mode defaults to the node's primary IPs.

Localhost node ports (``Options.localhost_nodeports``: kube-proxy 1.37's alpha gate
KubeProxyNFTablesLocalhostNodePorts, KEP-6032) are no DNAT either: ``route_localnet`` would open
127.0.0.0/8 to the network (CVE-2020-8558), and ``::1`` cannot be routed out at all. A family
whose ``--nodeport-addresses`` name loopback itself (``localhost``, ``127.0.0.0/8``, ``::1/128``;
not a catch-all such as ``0.0.0.0/0``) has its TCP node ports served on ``127.0.0.1``/``::1`` by
a proxy in kpng's process (``localhost.py``); the rest of the family's node ports on loopback
(UDP and SCTP; TCP too in a family that does not name loopback) are rejected, as kube-proxy
rejects them, by a rule per protocol looking the port up in the family's ``nodeport-<f>`` map, in
chain ``localhost-nodeports`` jumped to from ``nat-output`` (the first packet of each new
connection). kube-proxy rejects in its filter input chain, from a map of its own; kpng's
``nodeport-<f>`` maps lead to DNAT, which the kernel refuses to see reachable from a filter
chain, and only the node itself reaches its loopback, so its output hook sees every such
packet.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kpng.backends._endpoints import (
    EndpointValue,
    affinity_timeout,
    allowed_from_node,
    allowed_ranges,
    endpoints_by_scope,
    local_endpoint_addresses,
    serving_endpoints,
)
from kpng.backends._nftables.nftables import (
    Chain,
    Element,
    Map,
    Rule,
    Set,
    Table,
    comment_name,
    valid_comment,
)

# The node's options are every node backend's; to-nft's callers find them here too.
from kpng.backends._node import FAMILIES, Fam
from kpng.backends._node import MASQUERADE_BIT as MASQUERADE_BIT
from kpng.backends._node import FromNode as FromNode
from kpng.backends._node import Options as Options
from kpng.client import ServiceEndpoints

TABLE = Table("inet", "kpng", comment="rules for Kubernetes services, managed by kpng")
CHECK_TABLE = Table("inet", "kpng-check")
"""Where kpng asks the kernel whether it takes some services' rules: made and deleted in the
same transaction, without hooks."""
AFFINITY_CLIENTS = 1 << 20
"""The most (client, endpoint) pairs the affinity memory of a family holds: a bound on kernel
memory that spoofed sources could otherwise grow (about 100 bytes each)."""

_IP = {"v4": "ip", "v6": "ip6"}
_ADDR = {"v4": "ipv4_addr", "v6": "ipv6_addr"}
_LOOPBACK = {"v4": "127.0.0.0/8", "v6": "::1"}
_PROTOCOLS = {"TCP": "tcp", "UDP": "udp", "SCTP": "sctp"}

Kind = Literal["cluster", "external", "nodeport", "external-sc", "nodeport-sc"]
KINDS: tuple[Kind, ...] = ("cluster", "external", "nodeport", "external-sc", "nodeport-sc")
_PORT_ONLY: frozenset[Kind] = frozenset({"nodeport", "nodeport-sc"})
COUNTED_KINDS: tuple[Kind, ...] = ("cluster", "external", "nodeport")
"""The dispatch maps that count, with ``--traffic-counters service``: each new connection
(only a connection's first packet passes the nat hooks) looks one of them up once. Not the
short-circuit maps: the node's own traffic to them looks them up twice (its masquerade mark),
and this node's pods' once."""

ElementKey = tuple[str, tuple[str, ...]]
"""(container, key fields): what identifies an element."""


def local_source(options: Options, fam: Fam, *, negate: bool = False) -> str | None:
    """The match for traffic from this node's pods, or from anything else (``negate``);
    None when kpng is not told what is local for ``fam``."""
    op = "!= " if negate else ""
    if options.pod_interface:
        return f'iifname {op}"{options.pod_interface}"'
    if options.cidrs(options.cluster_cidrs, fam):
        return f"{_IP[fam]} saddr {op}@cluster-cidrs-{fam}"
    return None


def _mark(options: Options, expr: str) -> str:
    return f"{expr} meta mark set meta mark | {options.mark:#x}"


def _tuple(fam: Fam) -> str:
    return f"{_IP[fam]} daddr . meta l4proto . th dport"


def _nodeport_match(options: Options, fam: Fam) -> str:
    # A node port is matched by protocol and port alone: without the local check, a CIDR would
    # take every forwarded packet to an address in it (pod to pod on that port number). Never
    # loopback, whatever the CIDRs: kube-proxy does not support localhost node ports either.
    local = f"fib daddr type local {_IP[fam]} daddr != {_LOOPBACK[fam]}"
    if options.cidrs(options.nodeport_addresses, fam):
        return f"{local} {_IP[fam]} daddr @nodeport-addresses-{fam}"
    return local  # as kube-proxy, a family given no CIDR serves all its local addresses


def loopback_served(options: Options, fam: Fam) -> bool:
    """Whether ``fam``'s TCP node ports answer on loopback (kube-proxy's explicit loopback):
    asked for, and a node port CIDR of the family is a loopback network, not one merely holding
    it (a catch-all would otherwise open them on every node that kept the default)."""
    return options.localhost_nodeports and any(
        ipaddress.ip_network(c, strict=False).network_address.is_loopback
        for c in options.cidrs(options.nodeport_addresses, fam)
    )


def loopback_rejected(options: Options, fam: Fam) -> tuple[str, ...]:
    """The protocols whose node ports on ``fam``'s loopback are rejected, as kube-proxy with the
    gate on: those the proxy does not serve. Without the option, none: nothing listens there but
    what the node runs, as kube-proxy without the gate."""
    if not options.localhost_nodeports:
        return ()
    return ("udp", "sctp") if loopback_served(options, fam) else ("tcp", "udp", "sctp")


def skeleton(options: Options) -> tuple[list[Chain | Set | Map], list[Rule], list[Element]]:
    """The fixed objects (chains, sets, maps), their rules and the static elements."""
    objects: list[Chain | Set | Map] = [
        Chain("nat-prerouting", "nat", "prerouting", "dstnat"),
        # nft knows "dstnat" by name only in prerouting; it is -100 in output too.
        Chain("nat-output", "nat", "output", "-100"),
        Chain("nat-postrouting", "nat", "postrouting", "srcnat"),
        Chain("services"),
        Chain("masquerading"),
        Chain("service-reject"),
        # Checked after DNAT, as kube-proxy: forward comes after prerouting's DNAT whatever the
        # priority (kube-proxy's -110 puts it before other tables' filter chains); output's
        # DNAT is at -100, hence -90.
        Chain("filter-forward", "filter", "forward", "-110"),
        Chain("filter-output-post-dnat", "filter", "output", "-90"),
        Chain("cluster-ips-check"),
    ]
    rules = [
        Rule("nat-prerouting", "jump services"),
        Rule("nat-output", "jump services"),
        Rule("nat-postrouting", "jump masquerading"),
        Rule("service-reject", "reject"),
        Rule("filter-forward", "ct state new jump cluster-ips-check"),
        Rule("filter-output-post-dnat", "ct state new jump cluster-ips-check"),
    ]
    elements: list[Element] = []
    for fam in FAMILIES:
        ip, addr, tup = _IP[fam], _ADDR[fam], _tuple(fam)
        three = f"{addr} . inet_proto . inet_service"
        for kind in KINDS:
            port_only = kind in _PORT_ONLY
            key = "inet_proto . inet_service" if port_only else three
            counted = options.traffic_counters and kind in COUNTED_KINDS
            objects.append(Map(f"{kind}-{fam}", "verdict", type=key, counter=counted))
        objects += [
            Set(f"external-masq-{fam}", type=three),
            Set(f"nodeport-masq-{fam}", type="inet_proto . inet_service"),
            Set(f"firewall-{fam}", type=three),
            Set(f"firewall-allow-{fam}", type=f"{three} . {addr}", flags=("interval",)),
            Set(f"hairpin-{fam}", type=f"{addr} . {addr}"),
            Set(f"cluster-cidrs-{fam}", type=addr, flags=("interval",)),
            Set(f"nodeport-addresses-{fam}", type=addr, flags=("interval",)),
            Set(f"cluster-ips-{fam}", type=addr),
            Set(f"service-cidrs-{fam}", type=addr, flags=("interval",)),
        ]
        elements += [
            Element(f"cluster-cidrs-{fam}", (c,)) for c in options.cidrs(options.cluster_cidrs, fam)
        ]
        elements += [
            Element(f"nodeport-addresses-{fam}", (c,))
            for c in options.cidrs(options.nodeport_addresses, fam)
        ]
        # Still the cluster IP after DNAT: no service port matched (an undefined port). Refused
        # at once; else the packet is routed on to an address nothing answers for, and the
        # client waits for a timeout.
        rules.append(Rule("cluster-ips-check", f"{ip} daddr @cluster-ips-{fam} reject"))
        # An IP of the service ranges that no service holds (yet, or any more): dropped, as
        # kube-proxy does, rather than routed on to wherever the node's routes lead.
        service_cidrs = options.cidrs(options.service_cidrs, fam)
        elements += [Element(f"service-cidrs-{fam}", (c,)) for c in service_cidrs]
        if service_cidrs:
            rules.append(Rule("cluster-ips-check", f"{ip} daddr @service-cidrs-{fam} drop"))

        def svc(expr: str) -> None:
            rules.append(Rule("services", expr))

        np = _nodeport_match(options, fam)
        mark = functools.partial(_mark, options)
        remote = local_source(options, fam, negate=True)
        # Masquerade marks first: the DNAT below ends the chain. A counted map's element
        # counts every lookup that finds it: counted, the mark asks for the ClusterIP alone
        # (a ClusterIP on a port no service defines is rejected after DNAT, never masqueraded).
        to_cluster = f"{tup} @cluster-{fam}"
        if options.traffic_counters:
            to_cluster = f"{ip} daddr @cluster-ips-{fam}"
        if options.masquerade_all:
            svc(mark(to_cluster))
        elif remote is not None:
            svc(mark(f"{remote} {to_cluster}"))
        svc(mark(f"{tup} @external-masq-{fam}"))
        svc(mark(f"{np} meta l4proto . th dport @nodeport-masq-{fam}"))
        # loadBalancerSourceRanges, on LB IPs only, of the families ranges are given in.
        svc(f"{tup} @firewall-{fam} {tup} . {ip} saddr != @firewall-allow-{fam} drop")
        # eTP=Local short-circuit: the node's own traffic is masqueraded, as kube-proxy does.
        svc(mark(f"fib saddr type local {tup} @external-sc-{fam}"))
        svc(mark(f"fib saddr type local {np} meta l4proto . th dport @nodeport-sc-{fam}"))
        local = local_source(options, fam)
        for source in ([local] if local is not None else []) + ["fib saddr type local"]:
            svc(f"{source} {tup} vmap @external-sc-{fam}")
            svc(f"{source} {np} meta l4proto . th dport vmap @nodeport-sc-{fam}")
        svc(f"{tup} vmap @cluster-{fam}")
        svc(f"{tup} vmap @external-{fam}")
        svc(f"{np} meta l4proto . th dport vmap @nodeport-{fam}")

        hairpin = f"ct status dnat {ip} saddr . {ip} daddr @hairpin-{fam} masquerade fully-random"
        rules.append(Rule("masquerading", hairpin))
        for proto in loopback_rejected(options, fam):
            rules.append(
                Rule(
                    "localhost-nodeports",
                    f"{ip} daddr {_LOOPBACK[fam]} meta l4proto {proto} "
                    f"meta l4proto . th dport @nodeport-{fam} reject",
                )
            )
    if options.localhost_nodeports:
        # From output only: reject is refused in prerouting before kernel 5.9.
        objects.append(Chain("localhost-nodeports"))
        rules.append(Rule("nat-output", "jump localhost-nodeports"))
    rules.append(
        Rule(
            "masquerading",
            f"meta mark & {options.mark:#x} == {options.mark:#x} "
            f"meta mark set meta mark & {0xFFFFFFFF ^ options.mark:#x} masquerade fully-random",
        )
    )
    return objects, rules, elements


@functools.cache
def pick_chain(
    kind: Kind, fam: Fam, count: int, counted: bool = False
) -> tuple[Chain, tuple[Rule, ...], tuple[Map, ...]]:
    """The chain choosing one of ``count`` endpoints for every service port of ``kind``, and the
    endpoint maps it reads, with element counters if ``counted`` (cached: thousands of services
    share a handful of these)."""
    name = f"pick-{kind}-{fam}-{count}"
    port_only = kind in _PORT_ONLY
    lookup = "meta l4proto . th dport" if port_only else _tuple(fam)
    key = "inet_proto . inet_service" if port_only else f"{_ADDR[fam]} . inet_proto . inet_service"
    ip = _IP[fam]
    maps = tuple(
        Map(endpoint_map(kind, fam, i), f"{_ADDR[fam]} . inet_service", type=key, counter=counted)
        for i in range(count)
    )
    rules = tuple(
        Rule(
            name,
            f"numgen random mod {count - i} 0 dnat {ip} addr . port to {lookup} map @{m.name}"
            if i < count - 1
            else f"dnat {ip} addr . port to {lookup} map @{m.name}",
        )
        for i, m in enumerate(maps)
    )
    return Chain(name), rules, maps


@functools.cache
def endpoint_map(kind: Kind, fam: Fam, index: int) -> str:
    """The map holding endpoint ``index`` of every service port of ``kind`` with more."""
    return f"{kind}-eps-{fam}-{index}"


def counted_endpoint_map(name: str) -> tuple[str, Fam, bool] | None:
    """For an endpoint map of a counted kind (``--traffic-counters endpoint``): the dispatch map
    its keys are found in, its family, and whether its keys are ``proto . port`` alone; else
    None."""
    kind, sep, rest = name.partition("-eps-")
    fam, _, index = rest.partition("-")
    if not sep or kind not in COUNTED_KINDS or fam not in FAMILIES or not index.isdigit():
        return None
    return f"{kind}-{fam}", fam, kind in _PORT_ONLY


@dataclass
class Contribution:
    """What one service puts into the table."""

    elements: dict[ElementKey, tuple[str, ...]] = field(default_factory=dict)
    comments: dict[ElementKey, str] = field(default_factory=dict)
    """The dispatch elements' comments: the service port they send to (``ns/name:port``)."""
    chains: dict[str, tuple[Chain, tuple[Rule, ...]]] = field(default_factory=dict)
    maps: dict[str, Map | Set] = field(default_factory=dict)
    """Named sets and maps, by name."""
    problems: list[str] = field(default_factory=list)
    udp_frontends: dict[tuple[str, str], frozenset[EndpointValue]] = field(default_factory=dict)
    """UDP (service address, port) -> the endpoints serving it anywhere: conntrack flows to the
    address and port going to any other endpoint are stale (kube-proxy's rule). The address is
    empty for a node port (flows to any address on that port)."""


def contribute(
    se: ServiceEndpoints, node_ips: Sequence[str] = (), *, count_endpoints: bool = False
) -> Contribution:
    """Every element, chain and map that ``se`` needs on a node with these primary IPs (pure;
    unsupported ports are reported in ``problems`` and left out); with ``count_endpoints``, the
    counted kinds' endpoint maps count (``--traffic-counters endpoint``)."""
    out = Contribution()
    service = se.service
    ips = service.IPs
    if ips is None or ips.ClusterIPs is None:
        return out
    for port in service.Ports:
        name = comment_name(service.Namespace, service.Name, port.Name)
        if not valid_comment(name):
            # The API server admits no such name; a source that does (a hand-written manifest,
            # another brain) gets the service refused, not every service's transaction.
            out.problems.append(f"its name {name!r} is not a Kubernetes name; no rules written")
            return out
    timeout = affinity_timeout(service)
    local = local_endpoint_addresses(se.endpoints)
    for fam in FAMILIES:
        v6 = fam == "v6"
        cluster_ips = ips.ClusterIPs.family(v6)
        if not cluster_ips:
            continue
        for cip in cluster_ips:
            out.elements[(_container("cluster-ips", fam), (cip,))] = ()
        external_ips = list(ips.ExternalIPs.family(v6) if ips.ExternalIPs else ())
        lb_ips = list(ips.LoadBalancerIPs.family(v6) if ips.LoadBalancerIPs else ())
        for port in service.Ports:
            proto = _PROTOCOLS.get(port.Protocol)
            if proto is None or not 0 < port.Port < 65536:
                out.problems.append(f"port {port.Name or port.Port}: unsupported protocol or port")
                continue
            usable = port.UsableEndpoints is not None and bool(
                port.UsableEndpoints.V6 if v6 else port.UsableEndpoints.V4
            )
            p = str(port.Port)
            internal, external, cluster_wide = endpoints_by_scope(se.endpoints, port, v6)
            local_etp = service.ExternalTrafficToLocal

            sticky: _Affinity | None = None
            if timeout:
                port_id = f"{service.Namespace}/{service.Name}/{proto}/{p}"
                sticky = _Affinity(
                    hashlib.sha1(port_id.encode()).hexdigest()[:12], port_id, fam, proto, timeout
                )

            name = comment_name(service.Namespace, service.Name, port.Name)

            def dispatch(kind: Kind, key: tuple[str, ...], eps: list[EndpointValue]) -> None:
                ek = (_container(kind, fam), key)  # noqa: B023
                out.comments[ek] = name  # noqa: B023
                counted = count_endpoints and kind in COUNTED_KINDS
                if sticky is not None and eps:  # noqa: B023
                    _remember(out, sticky, kind, ek, eps, counted=counted)  # noqa: B023
                    return
                _dispatch(out, kind, fam=fam, ek=ek, eps=eps, usable=usable, counted=counted)  # noqa: B023

            for cip in cluster_ips:
                dispatch("cluster", (cip, proto, p), internal)
            for eip in external_ips + lb_ips:
                key = (eip, proto, p)
                dispatch("external", key, external)
                if local_etp:
                    dispatch("external-sc", key, cluster_wide)
                else:
                    out.elements[(_container("external-masq", fam), key)] = ()
            if port.NodePort:
                np_key = (proto, str(port.NodePort))
                dispatch("nodeport", np_key, external)
                if local_etp:
                    dispatch("nodeport-sc", np_key, cluster_wide)
                else:
                    out.elements[(_container("nodeport-masq", fam), np_key)] = ()
            if proto == "udp":
                serving = serving_endpoints(port, (*internal, *external, *cluster_wide))
                # kube-proxy 1.37: an address frontend with no serving endpoint loses all its
                # flows (still DNATed to a deleted endpoint, which the reject rule never sees);
                # a node port frontend then keeps them, as its match is on the port alone.
                for address in (*cluster_ips, *external_ips, *lb_ips):
                    out.udp_frontends[(address, p)] = serving
                if serving and port.NodePort:  # one frontend for both families
                    np_front = ("", str(port.NodePort))
                    out.udp_frontends[np_front] = serving | out.udp_frontends.get(
                        np_front, frozenset()
                    )
            if local:
                for ep_addr, _ in {*internal, *external, *cluster_wide}:
                    if ep_addr in local:
                        out.elements[(_container("hairpin", fam), (ep_addr, ep_addr))] = ()
            for flt in service.IPFilters:
                ranges = allowed_ranges(
                    (*flt.SourceRanges, *allowed_from_node(flt.SourceRanges, node_ips, lb_ips)), v6
                )
                # As kube-proxy: ranges of the other family only leave this one unfiltered (an
                # empty allow set would drop every client).
                targets = flt.TargetIPs.family(v6) if flt.TargetIPs and ranges else ()
                for target in targets:
                    key = (target, proto, p)
                    out.elements[(_container("firewall", fam), key)] = ()
                    for r in ranges:
                        out.elements[(_container("firewall-allow", fam), (*key, r))] = ()
    return out


def _dispatch(
    out: Contribution,
    kind: Kind,
    *,
    fam: Fam,
    ek: ElementKey,
    eps: list[EndpointValue],
    usable: bool,
    counted: bool,
) -> None:
    """Send ``ek`` (an element of ``kind``'s dispatch map) to its endpoints ``eps``, through
    endpoint maps that count if ``counted``."""
    elements = out.elements
    if eps:
        chain, rules, maps = pick_chain(kind, fam, len(eps), counted)
        out.chains[chain.name] = (chain, rules)
        elements[ek] = _goto(chain.name)
        key = ek[1]
        for m, value in zip(maps, eps, strict=True):
            out.maps[m.name] = m
            elements[(m.name, key)] = value
    else:
        elements[ek] = _DROP if usable else _REJECT


_DROP = ("drop",)
_REJECT = ("goto service-reject",)
REFUSING = frozenset({_DROP, _REJECT})
"""The verdicts of a dispatch element with no endpoint: what its counter counts is refused."""


@functools.cache
def _goto(chain: str) -> tuple[str]:
    return (f"goto {chain}",)


@functools.cache
def _container(kind: str, fam: Fam) -> str:
    """``kind-fam``: one string in the key of every element of that container, not one each
    (a 100k-service table has 1.8 million elements)."""
    return f"{kind}-{fam}"


_SCOPES: dict[Kind, str] = {
    "cluster": "internal",
    "external": "external",
    "nodeport": "external",
    "external-sc": "cluster",
    "nodeport-sc": "cluster",
}
"""The endpoints (``Endpoint.Scopes``) each kind of traffic goes to, as affinity chains are
named."""


def affinity_id(port_id: str, endpoint: EndpointValue) -> tuple[int, int]:
    """The id of ``endpoint`` of service port ``port_id`` (``namespace/name/proto/port``) in the
    affinity memory, as two 32-bit halves: the same in every kpng, so that a restart finds the
    clients remembered before."""
    address, port = endpoint
    digest = hashlib.sha1(f"{port_id} {address} {port}".encode()).digest()
    return int.from_bytes(digest[:4], "big"), int.from_bytes(digest[4:8], "big")


def _affinity_set(fam: Fam) -> Set:
    return Set(
        f"affinity-{fam}",
        typeof=f"{_IP[fam]} saddr . numgen inc mod 1 . numgen inc mod 1",
        flags=("dynamic", "timeout"),
        size=AFFINITY_CLIENTS,
    )


AFFINITY_SETS = {fam: _affinity_set(fam) for fam in FAMILIES}
"""The affinity memory of each family: kept by a full sync (see the module docstring)."""


@dataclass
class _Affinity:
    """One service port's ClientIP affinity in one family."""

    id: str
    port_id: str
    fam: Fam
    proto: str
    timeout: int
    chains: dict[tuple[str, tuple[EndpointValue, ...]], str] = field(default_factory=dict)
    """The chain of each list of endpoints: kinds of traffic with the same endpoints (all of
    them, without traffic policies) share one; a counted kind (its own endpoint maps) has its
    own, keyed by its name (else "")."""

    def key(self, endpoint: EndpointValue) -> str:
        """The memory's key for a client sent to ``endpoint`` of this service port."""
        high, low = affinity_id(self.port_id, endpoint)
        return (
            f"{_IP[self.fam]} saddr . numgen inc mod 1 offset {high} "
            f". numgen inc mod 1 offset {low}"
        )


def _remember(
    out: Contribution,
    sticky: _Affinity,
    kind: Kind,
    ek: ElementKey,
    eps: list[EndpointValue],
    *,
    counted: bool,
) -> None:
    """Dispatch ``ek``'s ``kind`` traffic to the service port's affinity chain for ``eps``, the
    endpoints of that kind: a client remembered with one of them goes there again, any other
    gets a new pick, and either is remembered. ``counted``: through ``kind``'s endpoint maps,
    whose elements for ``ek`` count (``--traffic-counters endpoint``)."""
    fam, ip, proto = sticky.fam, _IP[sticky.fam], sticky.proto
    memory = AFFINITY_SETS[fam]
    timeout = f"timeout {sticky.timeout}s"
    endpoints = tuple(eps)
    maps: tuple[Map, ...] = ()
    if counted:
        maps = pick_chain(kind, fam, len(endpoints), True)[2]
        for m, ep in zip(maps, endpoints, strict=True):
            out.maps[m.name] = m
            out.elements[(m.name, ek[1])] = ep
    chain_key = (kind if counted else "", endpoints)
    name = sticky.chains.get(chain_key)
    if name is None:
        suffix = f"by-{kind}" if counted else _SCOPES[kind]
        name = sticky.chains[chain_key] = f"affinity-{sticky.id}-{fam}-{suffix}"
        out.maps[memory.name] = memory
        lookup = "meta l4proto . th dport" if kind in _PORT_ONLY else _tuple(fam)
        remembered, picks = [], []
        for i, ep in enumerate(endpoints):
            client = sticky.key(ep)
            address, port = ep
            to = f"[{address}]:{port}" if fam == "v6" else f"{address}:{port}"
            if maps:
                to = f"{lookup} map @{maps[i].name}"
                dnat = f"dnat {ip} addr . port to"
            else:
                dnat = f"dnat {ip} to"
            # The timeout in the rule rather than the set: each service has its own, and a new
            # timeoutSeconds is then new rules, the clients remembered so far kept. Refreshed
            # by every new connection, as kube-proxy does.
            then = (
                f"meta l4proto {proto} update @{memory.name} {{ {client} {timeout} }} {dnat} {to}"
            )
            # A client remembered with two endpoints (a pick among another kind's endpoints)
            # goes to the first, as with kube-proxy.
            remembered.append(Rule(name, f"{client} @{memory.name} {then}"))
            n = len(endpoints)
            picks.append(Rule(name, f"numgen random mod {n - i} 0 {then}" if i < n - 1 else then))
        out.chains[name] = (Chain(name), (*remembered, *picks))
    out.elements[ek] = (f"goto {name}",)
