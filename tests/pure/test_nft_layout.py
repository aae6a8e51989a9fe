"""to-nft's layout against kube-proxy's nftables mode: the fixed skeleton (``layout.skeleton``,
the rules every node gets, by options) and what services add (``layout.contribute``)."""

from __future__ import annotations

import argparse
import asyncio
import io
from collections.abc import Collection

import pytest

from kpng.backends import registry
from kpng.backends._nftables import NftBackend, options_from_args
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import TABLE, Options, contribute, skeleton
from kpng.backends._nftables.nftables import Chain
from kpng.backends.registry import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    Endpoint,
    EndpointScopes,
    IPFamilies,
    IPFilter,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)


def _rules(options: Options, chain: str) -> list[str]:
    return [rule.expr for rule in skeleton(options)[1] if rule.chain == chain]


def _nodeport_dispatch(options: Options) -> list[str]:
    return [r for r in _rules(options, "services") if r.endswith(("@nodeport-v4", "@nodeport-v6"))]


V4_LOCAL = "fib daddr type local ip daddr != 127.0.0.0/8"
V6_LOCAL = "fib daddr type local ip6 daddr != ::1"
PORT_V4 = "meta l4proto . th dport vmap @nodeport-v4"
PORT_V6 = "meta l4proto . th dport vmap @nodeport-v6"


@pytest.mark.parametrize(
    ("addresses", "expected"),
    [
        pytest.param((), [f"{V4_LOCAL} {PORT_V4}", f"{V6_LOCAL} {PORT_V6}"], id="default"),
        pytest.param(
            ("10.0.0.0/8",),
            # Only the node's own addresses in the CIDR (not a pod's, not a forwarded packet's);
            # IPv6, given no CIDR, serves node ports on all its local addresses.
            [f"{V4_LOCAL} ip daddr @nodeport-addresses-v4 {PORT_V4}", f"{V6_LOCAL} {PORT_V6}"],
            id="v4-cidr-is-local-addresses-in-it",
        ),
        pytest.param(
            ("0.0.0.0/0", "127.0.0.0/8", "fd00::/8"),
            # Never loopback ("localhost NodePorts are not supported"), never a non-local address.
            [
                f"{V4_LOCAL} ip daddr @nodeport-addresses-v4 {PORT_V4}",
                f"{V6_LOCAL} ip6 daddr @nodeport-addresses-v6 {PORT_V6}",
            ],
            id="catch-all-and-loopback-cidrs-stay-local-and-not-loopback",
        ),
    ],
)
def test_node_ports_are_served_on_local_non_loopback_addresses_only(
    addresses: tuple[str, ...], expected: list[str]
) -> None:
    assert _nodeport_dispatch(Options(nodeport_addresses=addresses)) == expected


@pytest.mark.parametrize("addresses", [(), ("10.0.0.0/8",), ("::/0", "127.0.0.0/8")])
def test_every_rule_matching_a_node_port_checks_the_address_is_local(
    addresses: tuple[str, ...],
) -> None:
    """Masquerade marks and the eTP=Local short-circuit too: a node port is matched by protocol
    and port, so a rule without the local check would take any destination."""
    options = Options(nodeport_addresses=addresses)
    rules = [r for r in _rules(options, "services") if "nodeport" in r]
    assert len(rules) == 2 * 4  # per family: masquerade, short-circuit x 2, dispatch
    for rule in rules:
        assert f"{V4_LOCAL} " in rule or f"{V6_LOCAL} " in rule, rule


def _dual_stack_lb(source_ranges: tuple[str, ...]) -> ServiceEndpoints:
    lb_ips = IPSet(V4=("192.0.2.9",), V6=("2001:db8:9::9",))
    service = Service(
        Namespace="ns",
        Name="lb",
        Type="LoadBalancer",
        IPs=ServiceIPs(
            ClusterIPs=IPSet(V4=("10.96.0.10",), V6=("fd00:96::10",)), LoadBalancerIPs=lb_ips
        ),
        Ports=(
            PortMapping(
                Name="p", Protocol="TCP", Port=80, UsableEndpoints=IPFamilies(V4=True, V6=True)
            ),
        ),
        IPFilters=(IPFilter(TargetIPs=lb_ips, SourceRanges=source_ranges),),
    )
    endpoint = Endpoint(
        IPs=IPSet(V4=("10.244.1.2",), V6=("fd00:244:1::2",)),
        PortOverrides=(PortName(Name="p", Port=8080, Protocol="TCP"),),
        Scopes=EndpointScopes(Internal=True, External=True, Cluster=True),
        Ready=True,
        Serving=True,
    )
    return ServiceEndpoints(service, (endpoint,))


def _firewall(se: ServiceEndpoints) -> list[str]:
    return sorted(
        f"{c}: {' . '.join(k)}" for c, k in contribute(se).elements if c.startswith("firewall")
    )


V4_FIREWALL = ["firewall-v4: 192.0.2.9 . tcp . 80"]
V6_FIREWALL = ["firewall-v6: 2001:db8:9::9 . tcp . 80"]


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        pytest.param(
            ("203.0.113.0/24",),
            # IPv6 clients of the IPv6 LB IP are not filtered: no IPv6 range was given.
            ["firewall-allow-v4: 192.0.2.9 . tcp . 80 . 203.0.113.0/24", *V4_FIREWALL],
            id="v4-ranges-filter-v4-only",
        ),
        pytest.param(
            ("2001:db8:1::/48",),
            ["firewall-allow-v6: 2001:db8:9::9 . tcp . 80 . 2001:db8:1::/48", *V6_FIREWALL],
            id="v6-ranges-filter-v6-only",
        ),
        pytest.param(
            ("203.0.113.0/24", "2001:db8:1::/48"),
            [
                "firewall-allow-v4: 192.0.2.9 . tcp . 80 . 203.0.113.0/24",
                "firewall-allow-v6: 2001:db8:9::9 . tcp . 80 . 2001:db8:1::/48",
                *V4_FIREWALL,
                *V6_FIREWALL,
            ],
            id="both-families",
        ),
    ],
)
def test_source_ranges_filter_only_the_families_they_are_given_in(
    ranges: tuple[str, ...], expected: list[str]
) -> None:
    assert _firewall(_dual_stack_lb(ranges)) == expected


@pytest.mark.parametrize(
    ("node_ips", "allowed"),
    [
        (("203.0.113.7",), ["192.0.2.9/32", "203.0.113.0/24"]),  # the node is in the ranges
        (("198.51.100.7",), ["203.0.113.0/24"]),
        ((), ["203.0.113.0/24"]),
    ],
)
def test_ranges_holding_the_node_allow_the_lb_ips_too(
    node_ips: tuple[str, ...], allowed: list[str]
) -> None:
    """kube-proxy's allowFromNode: a VIP-like LB IP that is a local address of the node is
    reached from the node with that IP as its source."""
    elements = contribute(_dual_stack_lb(("203.0.113.0/24",)), node_ips).elements
    got = sorted(k[3] for c, k in elements if c == "firewall-allow-v4")
    assert got == allowed


def test_new_connections_to_a_cluster_ip_left_undnated_are_rejected() -> None:
    """kube-proxy's rule for a ClusterIP on a port no service defines: checked after DNAT (in
    forward for pods, after output's DNAT for the node), so a packet still carrying the cluster
    IP as its destination matched no service port; ICMP port unreachable, not a timeout."""
    objects, rules, _ = skeleton(Options())
    assert Chain("filter-forward", "filter", "forward", "-110") in objects
    assert Chain("filter-output-post-dnat", "filter", "output", "-90") in objects
    assert Chain("cluster-ips-check") in objects
    assert [(r.chain, r.expr) for r in rules if "cluster-ips" in r.expr] == [
        ("filter-forward", "ct state new jump cluster-ips-check"),
        ("filter-output-post-dnat", "ct state new jump cluster-ips-check"),
        ("cluster-ips-check", "ip daddr @cluster-ips-v4 reject"),
        ("cluster-ips-check", "ip6 daddr @cluster-ips-v6 reject"),
    ]


def test_every_cluster_ip_is_in_its_familys_set_while_its_service_is() -> None:
    se = _dual_stack_lb(())
    elements = {k: v for k, v in contribute(se).elements.items() if k[0].startswith("cluster-ips")}
    assert elements == {
        ("cluster-ips-v4", ("10.96.0.10",)): (),
        ("cluster-ips-v6", ("fd00:96::10",)): (),
    }
    key = ("ns", "lb")

    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=Options())
        await backend.apply(_state(1, {key: se}, updated={key}))
        assert nft.elements(TABLE, "cluster-ips-v6") == {("fd00:96::10",): ()}
        await backend.apply(_state(2, {}, deleted={key}))
        assert nft.elements(TABLE, "cluster-ips-v4") == {}
        assert nft.elements(TABLE, "cluster-ips-v6") == {}

    asyncio.run(scenario())


def _state(
    revision: int,
    services: dict[ServiceKey, ServiceEndpoints],
    *,
    updated: Collection[ServiceKey] = (),
    deleted: Collection[ServiceKey] = (),
) -> NodeState:
    return NodeState(
        node="n1",
        revision=revision,
        services=services,
        updated=frozenset(updated),
        deleted=frozenset(deleted),
    )


def test_masquerade_picks_source_ports_fully_randomly() -> None:
    """As kube-proxy. Without it the kernel keeps a client's source port when it can and else
    searches from there, so concurrent connections masqueraded to one address race for the
    same mapping and lose packets (conntrack insert_failed, notably DNS over UDP)."""
    rules = [r for r in _rules(Options(), "masquerading") if "masquerade" in r]
    assert rules == [
        "ct status dnat ip saddr . ip daddr @hairpin-v4 masquerade fully-random",
        "ct status dnat ip6 saddr . ip6 daddr @hairpin-v6 masquerade fully-random",
        "meta mark & 0x4000 == 0x4000 meta mark set meta mark & 0xffffbfff masquerade fully-random",
    ]


@pytest.mark.parametrize(
    ("given", "cidrs", "primary"),
    [
        ("10.0.0.0/8", ("10.0.0.0/8",), False),
        ("primary", (), True),
        ("all", ("0.0.0.0/0", "::/0"), False),
        ("localhost,10.0.0.0/8", ("127.0.0.0/8", "::1/128", "10.0.0.0/8"), False),
        ("primary,all", ("0.0.0.0/0", "::/0"), True),
    ],
)
def test_nodeport_addresses_take_kube_proxy_1_37_keywords(
    given: str, cidrs: tuple[str, ...], primary: bool
) -> None:
    """kube-proxy 1.37's nodePortAddresses: CIDRs and the keywords primary, all and localhost,
    in any combination."""
    parser = argparse.ArgumentParser()
    registry.lookup("nft").add_arguments(parser)
    options, from_node = options_from_args(parser.parse_args(["--nodeport-addresses", given]))
    assert options.nodeport_addresses == cidrs
    assert from_node.primary_nodeports is primary


@pytest.mark.parametrize("given", ["all,all", "primary,primary", "everything", "10.0.0.0/33"])
def test_nodeport_addresses_refuse_repeated_keywords_and_unknown_words(given: str) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    registry.lookup("nft").add_arguments(parser)
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--nodeport-addresses", given])


def _loopback_rejects(options: Options) -> list[str]:
    return _rules(options, "localhost-nodeports")


REJECT_V4 = "ip daddr 127.0.0.0/8 meta l4proto {} meta l4proto . th dport @nodeport-v4 reject"
REJECT_V6 = "ip6 daddr ::1 meta l4proto {} meta l4proto . th dport @nodeport-v6 reject"


@pytest.mark.parametrize(
    ("addresses", "v4", "v6"),
    [
        # kube-proxy's explicit loopback: TCP is proxied, the rest refused.
        pytest.param(("127.0.0.0/8", "::1/128"), ("udp", "sctp"), ("udp", "sctp"), id="localhost"),
        pytest.param(("127.0.0.1/32",), ("udp", "sctp"), ("tcp", "udp", "sctp"), id="v4-only"),
        # A catch-all holds loopback but does not name it: every protocol refused there.
        pytest.param(
            ("0.0.0.0/0", "::/0"), ("tcp", "udp", "sctp"), ("tcp", "udp", "sctp"), id="all"
        ),
        pytest.param((), ("tcp", "udp", "sctp"), ("tcp", "udp", "sctp"), id="default"),
    ],
)
def test_localhost_nodeports_refuse_on_loopback_what_the_proxy_does_not_serve(
    addresses: tuple[str, ...], v4: tuple[str, ...], v6: tuple[str, ...]
) -> None:
    options = Options(nodeport_addresses=addresses, localhost_nodeports=True)
    assert _loopback_rejects(options) == [REJECT_V4.format(p) for p in v4] + [
        REJECT_V6.format(p) for p in v6
    ]
    # Loopback is never DNATed: the dispatch rules are the same as without the option.
    assert _nodeport_dispatch(options) == _nodeport_dispatch(Options(nodeport_addresses=addresses))


def test_without_localhost_nodeports_loopback_is_left_alone() -> None:
    """As kube-proxy without its gate: loopback is left to whatever the node runs there."""
    options = Options(nodeport_addresses=("127.0.0.0/8",))
    assert "localhost-nodeports" not in [o.name for o in skeleton(options)[0]]
    assert _rules(options, "nat-output") == ["jump services"]


def test_localhost_nodeports_render_a_chain_of_rejects_from_nat_output() -> None:
    """The transaction's text (a dry run), as nft takes it. From nat-output: the nodeport maps
    lead to DNAT, which the kernel refuses to see reachable from a filter chain."""
    out = io.StringIO()
    options = Options(nodeport_addresses=("127.0.0.0/8",), localhost_nodeports=True)
    backend = NftBackend(nft=FakeNft(), options=options, dry_run=True, output=out)
    asyncio.run(backend.apply(_state(1, {})))
    text = out.getvalue().splitlines()
    assert "add rule inet kpng nat-output jump localhost-nodeports" in text
    lines = [line for line in text if line.startswith("add rule inet kpng localhost-nodeports")]
    assert lines == [
        *(f"add rule inet kpng localhost-nodeports {REJECT_V4.format(p)}" for p in ("udp", "sctp")),
        *(
            f"add rule inet kpng localhost-nodeports {REJECT_V6.format(p)}"
            for p in ("tcp", "udp", "sctp")
        ),
    ]
