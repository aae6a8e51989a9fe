"""to-nft against the fake nft: what each kind of service becomes, and how changes are applied.

Services are plain data (the node-local messages); the expected elements are tables.
"""

from __future__ import annotations

import asyncio
import functools
import io
import re
from collections.abc import Collection, Sequence
from typing import Any

import msgspec
import pytest

from kpng.backends._conntrack import Conntrack, Flow, Reconciled
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import AFFINITY_SETS, TABLE, Options, affinity_id, contribute
from kpng.backends._nftables.nftables import NftError, Transaction, error_for_line
from kpng.backends.registry import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    ClientIPAffinity,
    Endpoint,
    EndpointAddress,
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
from kpng.testing import states

ALL = EndpointScopes(Internal=True, External=True, Cluster=True)


# Port "p" and no target port: the rule names and goldens below spell them.
_service = functools.partial(states.service, cluster_ip="10.96.0.10", port_name="p", target_port=0)
_ep = functools.partial(states.endpoint, port_name="p", scopes=ALL)


def _elements(se: ServiceEndpoints) -> dict[str, str]:
    # Every service's cluster IPs are in a cluster-ips set: test_nft_layout.py checks them.
    elements = contribute(se).elements.items()
    return {
        f"{c}: {' . '.join(k)}": " . ".join(v)
        for (c, k), v in elements
        if not c.startswith("cluster-ips-")
    }


CASES = [
    pytest.param(
        ServiceEndpoints(_service(), (_ep("10.244.1.2"), _ep("10.244.2.3", local=True))),
        {
            "cluster-v4: 10.96.0.10 . tcp . 80": "goto pick-cluster-v4-2",
            "cluster-eps-v4-0: 10.96.0.10 . tcp . 80": "10.244.1.2 . 8080",
            "cluster-eps-v4-1: 10.96.0.10 . tcp . 80": "10.244.2.3 . 8080",
            "hairpin-v4: 10.244.2.3 . 10.244.2.3": "",
        },
        id="clusterip-spreads-over-endpoints-and-hairpins-local-ones",
    ),
    pytest.param(
        ServiceEndpoints(_service(usable=False), ()),
        {"cluster-v4: 10.96.0.10 . tcp . 80": "goto service-reject"},
        id="no-endpoint-anywhere-rejects",
    ),
    pytest.param(
        ServiceEndpoints(_service(usable=True), ()),
        {"cluster-v4: 10.96.0.10 . tcp . 80": "drop"},
        id="no-endpoint-here-but-elsewhere-drops",
    ),
    pytest.param(
        ServiceEndpoints(
            _service(node_port=30080, external_ips=("192.0.2.1",)), (_ep("10.1.1.1"),)
        ),
        {
            "cluster-v4: 10.96.0.10 . tcp . 80": "goto pick-cluster-v4-1",
            "cluster-eps-v4-0: 10.96.0.10 . tcp . 80": "10.1.1.1 . 8080",
            "external-v4: 192.0.2.1 . tcp . 80": "goto pick-external-v4-1",
            "external-eps-v4-0: 192.0.2.1 . tcp . 80": "10.1.1.1 . 8080",
            "external-masq-v4: 192.0.2.1 . tcp . 80": "",
            "nodeport-v4: tcp . 30080": "goto pick-nodeport-v4-1",
            "nodeport-eps-v4-0: tcp . 30080": "10.1.1.1 . 8080",
            "nodeport-masq-v4: tcp . 30080": "",
        },
        id="external-traffic-policy-cluster-masquerades",
    ),
    pytest.param(
        ServiceEndpoints(
            _service(node_port=30080, etp_local=True),
            (
                _ep("10.1.1.1", scopes=EndpointScopes(Internal=True, Cluster=True)),
                _ep("10.2.2.2", local=True),
            ),
        ),
        {
            "cluster-v4: 10.96.0.10 . tcp . 80": "goto pick-cluster-v4-2",
            "cluster-eps-v4-0: 10.96.0.10 . tcp . 80": "10.1.1.1 . 8080",
            "cluster-eps-v4-1: 10.96.0.10 . tcp . 80": "10.2.2.2 . 8080",
            "nodeport-v4: tcp . 30080": "goto pick-nodeport-v4-1",
            "nodeport-eps-v4-0: tcp . 30080": "10.2.2.2 . 8080",
            "nodeport-sc-v4: tcp . 30080": "goto pick-nodeport-sc-v4-2",
            "nodeport-sc-eps-v4-0: tcp . 30080": "10.1.1.1 . 8080",
            "nodeport-sc-eps-v4-1: tcp . 30080": "10.2.2.2 . 8080",
            "hairpin-v4: 10.2.2.2 . 10.2.2.2": "",
        },
        id="external-traffic-policy-local-short-circuits-to-cluster-endpoints",
    ),
    pytest.param(
        ServiceEndpoints(
            _service(
                external_ips=("192.0.2.9",),
                filters=(
                    IPFilter(
                        TargetIPs=IPSet(V4=("192.0.2.9",)),
                        SourceRanges=("203.0.113.0/24", "2001:db8::/64"),
                    ),
                ),
            ),
            (),
        ),
        {
            "cluster-v4: 10.96.0.10 . tcp . 80": "drop",
            "external-v4: 192.0.2.9 . tcp . 80": "drop",
            "external-masq-v4: 192.0.2.9 . tcp . 80": "",
            "firewall-v4: 192.0.2.9 . tcp . 80": "",
            "firewall-allow-v4: 192.0.2.9 . tcp . 80 . 203.0.113.0/24": "",
        },
        id="load-balancer-source-ranges-only-on-their-target-ips",
    ),
    pytest.param(
        ServiceEndpoints(
            _service(
                external_ips=("192.0.2.9",),
                filters=(
                    IPFilter(
                        TargetIPs=IPSet(V4=("192.0.2.9",)),
                        SourceRanges=("10.0.0.0/8", "10.1.0.0/16", "10.2.3.4/32", "11.0.0.0/8"),
                    ),
                ),
            ),
            (),
        ),
        {
            "cluster-v4: 10.96.0.10 . tcp . 80": "drop",
            "external-v4: 192.0.2.9 . tcp . 80": "drop",
            "external-masq-v4: 192.0.2.9 . tcp . 80": "",
            "firewall-v4: 192.0.2.9 . tcp . 80": "",
            # Merged: overlapping intervals in one set make the kernel refuse them.
            "firewall-allow-v4: 192.0.2.9 . tcp . 80 . 10.0.0.0/7": "",
        },
        id="overlapping-source-ranges-are-merged",
    ),
    pytest.param(
        ServiceEndpoints(_service(affinity=60), (_ep("10.1.1.1"),)),
        {"cluster-v4: 10.96.0.10 . tcp . 80": "goto affinity-2e8c6283dc34-v4-internal"},
        id="client-ip-affinity-picks-and-remembers-in-a-chain-of-the-service-port",
    ),
    pytest.param(
        ServiceEndpoints(
            _service(affinity=60, node_port=30080, external_ips=("192.0.2.1",)),
            (_ep("10.1.1.1"),),
        ),
        {
            # One memory for the service port, whichever way a connection came: the same
            # endpoints for every kind of traffic, so one chain.
            "cluster-v4: 10.96.0.10 . tcp . 80": "goto affinity-2e8c6283dc34-v4-internal",
            "external-v4: 192.0.2.1 . tcp . 80": "goto affinity-2e8c6283dc34-v4-internal",
            "external-masq-v4: 192.0.2.1 . tcp . 80": "",
            "nodeport-v4: tcp . 30080": "goto affinity-2e8c6283dc34-v4-internal",
            "nodeport-masq-v4: tcp . 30080": "",
        },
        id="client-ip-affinity-covers-external-ips-and-node-ports",
    ),
    pytest.param(
        ServiceEndpoints(_service(protocol="ICMP"), (_ep("10.1.1.1"),)),
        {},
        id="unsupported-protocol-is-skipped",
    ),
]


@pytest.mark.parametrize(("se", "expected"), CASES)
def test_service_becomes_these_elements(se: ServiceEndpoints, expected: dict[str, str]) -> None:
    assert _elements(se) == expected


def test_unsupported_port_is_reported() -> None:
    problems = contribute(ServiceEndpoints(_service(protocol="ICMP"), ())).problems
    assert problems == ["port p: unsupported protocol or port"]


def test_affinity_checks_each_kind_of_traffic_against_its_own_endpoints() -> None:
    remote = _ep("10.1.1.1", scopes=EndpointScopes(Internal=True, Cluster=True))
    se = ServiceEndpoints(
        _service(affinity=60, node_port=30080, etp_local=True), (remote, _ep("10.2.2.2"))
    )
    contribution = contribute(se)
    a = "affinity-2e8c6283dc34-v4"
    assert _elements(se) == {
        "cluster-v4: 10.96.0.10 . tcp . 80": f"goto {a}-internal",
        # eTP=Local: a client remembered with the remote endpoint gets a new, local pick.
        "nodeport-v4: tcp . 30080": f"goto {a}-external",
        # The short-circuit of pods and the node goes to every endpoint, remembered ones too.
        "nodeport-sc-v4: tcp . 30080": f"goto {a}-internal",
    }
    rules = {name: [r.expr for r in rules] for name, (_, rules) in contribution.chains.items()}
    remote_key, local_key = _key("10.1.1.1"), _key("10.2.2.2")
    remember_remote = f"update @affinity-v4 {{ {remote_key} timeout 60s }} dnat ip to 10.1.1.1:8080"
    remember_local = f"update @affinity-v4 {{ {local_key} timeout 60s }} dnat ip to 10.2.2.2:8080"
    assert rules == {
        f"{a}-internal": [
            f"{remote_key} @affinity-v4 meta l4proto tcp {remember_remote}",
            f"{local_key} @affinity-v4 meta l4proto tcp {remember_local}",
            f"numgen random mod 2 0 meta l4proto tcp {remember_remote}",
            f"meta l4proto tcp {remember_local}",
        ],
        f"{a}-external": [
            f"{local_key} @affinity-v4 meta l4proto tcp {remember_local}",
            f"meta l4proto tcp {remember_local}",
        ],
    }
    assert set(contribution.maps.values()) == {AFFINITY_SETS["v4"]}


def _key(endpoint: str, port_id: str = "ns/web/tcp/80", ip: str = "ip") -> str:
    """The affinity memory's key for a client sent to ``endpoint``:8080 of ``port_id``."""
    high, low = affinity_id(port_id, (endpoint, "8080"))
    return f"{ip} saddr . numgen inc mod 1 offset {high} . numgen inc mod 1 offset {low}"


def test_affinity_ids_differ_by_service_port_and_endpoint_and_stay_the_same() -> None:
    ids = {
        affinity_id(port, (address, "8080"))
        for port in ("ns/web/tcp/80", "ns/web/udp/80", "ns/web/tcp/81", "ns2/web/tcp/80")
        for address in ("10.1.1.1", "10.1.1.2", "fd00::1")
    }
    assert len(ids) == 12
    assert affinity_id("ns/web/tcp/80", ("10.1.1.1", "8080")) == (1175900395, 3928659069)


def test_affinity_sets_of_ipv6_endpoints_have_valid_names() -> None:
    service = Service(
        Namespace="ns",
        Name="web6",
        Type="ClusterIP",
        IPs=ServiceIPs(ClusterIPs=IPSet(V6=("fd00:96::10",))),
        Ports=(
            PortMapping(Name="p", Protocol="TCP", Port=80, UsableEndpoints=IPFamilies(V6=True)),
        ),
        ClientIP=ClientIPAffinity(TimeoutSeconds=60),
    )
    endpoint = Endpoint(
        IPs=IPSet(V6=("fd00:244::5",)),
        PortOverrides=(PortName(Name="p", Port=8080, Protocol="TCP"),),
        Scopes=ALL,
        Ready=True,
        Serving=True,
    )
    contribution = contribute(ServiceEndpoints(service, (endpoint,)))
    (name,) = contribution.chains
    key = _key("fd00:244::5", "ns/web6/tcp/80", ip="ip6")
    assert contribution.chains[name][1][0].expr == (
        f"{key} @affinity-v6 meta l4proto tcp update @affinity-v6 {{ {key} timeout 60s }} "
        "dnat ip6 to [fd00:244::5]:8080"
    )
    assert set(contribution.maps.values()) == {AFFINITY_SETS["v6"]}


# --- the backend over the fake


def _state(
    revision: int,
    services: dict[ServiceKey, ServiceEndpoints],
    *,
    updated: set[ServiceKey] | None = None,
    deleted: set[ServiceKey] = frozenset(),  # type: ignore[assignment]
) -> NodeState:
    return NodeState(
        node="n1",
        revision=revision,
        services=services,
        updated=frozenset(services if updated is None else updated),
        deleted=frozenset(deleted),
    )


async def _no_sleep(_: float) -> None:
    return None


class FlakyNft(FakeNft):
    """Refuses the next ``failures`` transactions, as a kernel may."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    async def run(self, tx: Transaction) -> None:
        if self.failures:
            self.failures -= 1
            raise NftError("Operation not supported", line_number=1, line="add table inet kpng")
        await super().run(tx)


WEB: ServiceKey = ("ns", "web")
DB: ServiceKey = ("ns", "db")


def test_first_state_replaces_the_table_then_changes_are_incremental() -> None:
    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=Options(cluster_cidrs=("10.244.0.0/16",)))
        services = {
            WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"), _ep("10.244.1.3"))),
            DB: ServiceEndpoints(_service("db", cluster_ip="10.96.0.20", port=5432), ()),
        }
        assert await backend.apply(_state(1, services)) is False
        first = nft.transactions[0].render().splitlines()
        assert first[:3] == [
            'add table inet kpng { comment "rules for Kubernetes services, managed by kpng" ; }',
            "delete table inet kpng",
            'add table inet kpng { comment "rules for Kubernetes services, managed by kpng" ; }',
        ]
        # One endpoint goes: only that service's elements change, in one transaction.
        services[WEB] = ServiceEndpoints(_service(), (_ep("10.244.1.3"),))
        await backend.apply(_state(2, services, updated={WEB}))
        assert nft.transactions[1].render().splitlines() == [
            "add chain inet kpng pick-cluster-v4-1",
            "add rule inet kpng pick-cluster-v4-1 dnat ip addr . port to ip daddr . meta l4proto "
            ". th dport map @cluster-eps-v4-0",
            "delete element inet kpng cluster-eps-v4-0 { 10.96.0.10 . tcp . 80 }",
            "delete element inet kpng cluster-eps-v4-1 { 10.96.0.10 . tcp . 80 }",
            "delete element inet kpng cluster-v4 { 10.96.0.10 . tcp . 80 }",
            "add element inet kpng cluster-eps-v4-0 { 10.96.0.10 . tcp . 80 : 10.244.1.3 . 8080 }",
            'add element inet kpng cluster-v4 { 10.96.0.10 . tcp . 80 comment "ns/web:p" '
            ": goto pick-cluster-v4-1 }",
            "flush chain inet kpng pick-cluster-v4-2",
            "delete chain inet kpng pick-cluster-v4-2",
            "delete map inet kpng cluster-eps-v4-1",  # no service has a second endpoint now
        ]
        # A deleted service leaves nothing behind.
        del services[DB]
        await backend.apply(_state(3, services, updated=set(), deleted={DB}))
        assert "10.96.0.20" not in nft.dump()
        assert nft.elements(TABLE, "cluster-v4") == {
            ("10.96.0.10", "tcp", "80"): ("goto pick-cluster-v4-1",)
        }

    asyncio.run(scenario())


def test_refused_transaction_keeps_rules_and_is_followed_by_a_full_resync(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        nft = FlakyNft()
        backend = NftBackend(nft=nft, options=Options(), sleep=_no_sleep)
        services = {WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),))}
        await backend.apply(_state(1, services))
        before = nft.dump()
        nft.failures = 1
        services[DB] = ServiceEndpoints(_service("db", cluster_ip="10.96.0.20"), (_ep("10.9.9.9"),))
        state = _state(2, services, updated={DB})
        with pytest.raises(NftError) as refused:
            await backend.apply(state)
        assert nft.dump() == before  # the kernel refused: the old rules stay
        assert "the incremental transaction of" in str(refused.value)
        assert "at line 1: add table inet kpng" in str(refused.value)
        # kpng's Feeder retries (test_feeding): the next attempt is a full resync.
        await backend.apply(state)
        assert nft.transactions[-1].render().startswith("add table inet kpng")
        assert ("10.96.0.20", "tcp", "80") in nft.elements(TABLE, "cluster-v4")
        await backend.close()

    asyncio.run(scenario())


AFFINITY = "affinity-2e8c6283dc34-v4"
"""The prefix of the affinity chains of WEB's port (tcp 80) in IPv4."""


def _clients(nft: FakeNft, endpoint: str) -> set[str]:
    """The clients the affinity memory holds for ``endpoint``:8080 of WEB's port."""
    high, low = affinity_id("ns/web/tcp/80", (endpoint, "8080"))
    memory = nft.elements(TABLE, "affinity-v4")
    return {client for client, *id_ in memory if id_ == [str(high), str(low)]}


def _packet_path_remembers(nft: FakeNft, client: str, endpoint: str) -> None:
    """What the kernel does on a new connection from ``client`` to ``endpoint``: the fake has
    no packet path."""
    high, low = affinity_id("ns/web/tcp/80", (endpoint, "8080"))
    memory = nft.tables[(TABLE.family, TABLE.name)].elements["affinity-v4"]
    memory[(client, str(high), str(low))] = ()


def test_new_affinity_timeout_rewrites_the_rules_and_keeps_the_clients() -> None:
    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=Options())
        services = {WEB: ServiceEndpoints(_service(affinity=60), (_ep("10.244.1.2"),))}
        await backend.apply(_state(1, services))
        _packet_path_remembers(nft, "10.244.9.9", "10.244.1.2")
        services[WEB] = ServiceEndpoints(_service(affinity=30), (_ep("10.244.1.2"),))
        await backend.apply(_state(2, services, updated={WEB}))
        assert len(nft.transactions) == 2  # the change was not refused
        key = _key("10.244.1.2")
        assert nft.transactions[1].render().splitlines() == [
            f"add chain inet kpng {AFFINITY}-internal",
            f"flush chain inet kpng {AFFINITY}-internal",
            f"add rule inet kpng {AFFINITY}-internal {key} @affinity-v4 meta l4proto tcp "
            f"update @affinity-v4 {{ {key} timeout 30s }} dnat ip to 10.244.1.2:8080",
            f"add rule inet kpng {AFFINITY}-internal meta l4proto tcp "
            f"update @affinity-v4 {{ {key} timeout 30s }} dnat ip to 10.244.1.2:8080",
        ]
        assert _clients(nft, "10.244.1.2") == {"10.244.9.9"}

    asyncio.run(scenario())


def test_endpoint_changes_empty_no_affinity_memory() -> None:
    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=Options())
        eps = [_ep("10.244.1.1"), _ep("10.244.1.2"), _ep("10.244.1.3")]
        for revision, endpoints in enumerate((eps, eps[:2], [*eps[:2], _ep("10.244.1.4")]), 1):
            services = {WEB: ServiceEndpoints(_service(affinity=60), tuple(endpoints))}
            await backend.apply(_state(revision, services, updated={WEB}))
        assert len(nft.transactions) == 3
        for tx in nft.transactions[1:]:
            lines = tx.render().splitlines()
            assert [line for line in lines if line.startswith(("flush set", "flush map"))] == []

    asyncio.run(scenario())


def test_affinity_forgets_only_the_clients_of_an_endpoint_that_goes() -> None:
    """kube-proxy's behaviour: clients of the other endpoints keep theirs, and a new endpoint
    disturbs no one."""

    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=Options())
        a, b, c, d = "10.244.1.1", "10.244.1.2", "10.244.1.3", "10.244.1.4"
        services = {WEB: ServiceEndpoints(_service(affinity=60), (_ep(a), _ep(b), _ep(c)))}
        await backend.apply(_state(1, services))
        for client, endpoint in (("10.0.0.1", a), ("10.0.0.2", b), ("10.0.0.3", c)):
            _packet_path_remembers(nft, client, endpoint)

        services[WEB] = ServiceEndpoints(_service(affinity=60), (_ep(a), _ep(b)))
        await backend.apply(_state(2, services, updated={WEB}))
        removal = nft.transactions[-1].render().splitlines()
        assert [line for line in removal if line.startswith(("flush set", "delete set"))] == []
        assert _clients(nft, a) == {"10.0.0.1"}
        assert _clients(nft, b) == {"10.0.0.2"}
        # Nothing reads the memory of the endpoint that went: 10.0.0.3 gets a new pick.
        assert c not in nft.dump()
        assert _key(c) not in nft.dump()

        services[WEB] = ServiceEndpoints(_service(affinity=60), (_ep(a), _ep(b), _ep(d)))
        await backend.apply(_state(3, services, updated={WEB}))
        addition = nft.transactions[-1].render().splitlines()
        assert [line for line in addition if line.startswith(("flush set", "flush map"))] == []
        assert _clients(nft, a) == {"10.0.0.1"}
        assert _clients(nft, b) == {"10.0.0.2"}
        assert _clients(nft, d) == set()

        fresh = FakeNft()
        await NftBackend(nft=fresh, options=Options()).apply(_state(1, services))
        # The same memory (the entry of the endpoint that went expires in the kernel).
        for client, endpoint in (("10.0.0.1", a), ("10.0.0.2", b), ("10.0.0.3", c)):
            _packet_path_remembers(fresh, client, endpoint)
        assert nft.dump() == fresh.dump()

    asyncio.run(scenario())


_LOOKUP = re.compile(
    r"(ip6? saddr \. numgen inc mod 1 offset \d+ \. numgen inc mod 1 offset \d+) @"
)


def _memory(nft: FakeNft, key: tuple[str, ...]) -> set[str]:
    """The affinity memory's keys that traffic to ``key`` (in the dispatch of the ``services``
    chain) looks up, through every chain it can reach."""
    state = nft.tables[(TABLE.family, TABLE.name)]
    vmaps = {m for rule in state.rules["services"] for m in re.findall(r"vmap @(\S+)", rule)}
    todo = [" ".join(state.elements[m].get(key, ())) for m in vmaps]
    seen: set[str] = set()
    found: set[str] = set()
    while todo:
        for chain in re.findall(r"(?:jump|goto) (\S+)", todo.pop()):
            if chain not in seen:
                seen.add(chain)
                for rule in state.rules[chain]:
                    found |= set(_LOOKUP.findall(rule))
                    todo.append(rule)
    return found


def test_affinity_is_one_memory_for_cluster_ips_node_ports_and_external_ips() -> None:
    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=Options(cluster_cidrs=("10.244.0.0/16",)))
        service = _service(affinity=60, node_port=30080, external_ips=("192.0.2.1",))
        eps = (_ep("10.244.1.1"), _ep("10.244.1.2"))
        await backend.apply(_state(1, {WEB: ServiceEndpoints(service, eps)}))
        through_cluster_ip = _memory(nft, ("10.96.0.10", "tcp", "80"))
        assert _memory(nft, ("tcp", "30080")) == through_cluster_ip
        assert _memory(nft, ("192.0.2.1", "tcp", "80")) == through_cluster_ip
        assert through_cluster_ip == {_key("10.244.1.1"), _key("10.244.1.2")}

    asyncio.run(scenario())


class FakeConntrack(Conntrack):
    """A conntrack table of UDP flows: ``delete`` removes those it is given."""

    def __init__(self, *flows: Flow, reconciled: dict[str, Reconciled] | None = None) -> None:
        super().__init__(reconciled={} if reconciled is None else reconciled)
        self.flows = list(flows)
        self.deleted: list[Flow] = []

    async def udp_flows(self, family: str, frontends: Collection[tuple[str, str]]) -> list[Flow]:
        return [f for f in self.flows if (":" in f.reply_src) == (family == "IPv6")]

    async def delete(self, flows: Sequence[Flow]) -> int:
        self.deleted.extend(flows)
        kept = [f for f in self.flows if f not in flows]
        gone, self.flows = len(self.flows) - len(kept), kept
        return gone


TO_2 = Flow("10.96.0.10", "53", "10.244.1.2", "5353")
"""A client's UDP flow to the cluster IP, DNATed to 10.244.1.2."""


def _udp_service(*endpoints: Endpoint, serving: tuple[str, ...] = (), node_port: int = 0) -> Any:
    service = _service(protocol="UDP", port=53, node_port=node_port)
    if serving:  # what the brain says serves anywhere (else: the endpoints given)
        port = msgspec.structs.replace(
            service.Ports[0],
            ServingEndpoints=tuple(EndpointAddress(IP=ip, Port=5353) for ip in serving),
        )
        service = msgspec.structs.replace(service, Ports=(port,))
    return ServiceEndpoints(service, endpoints)


def test_udp_flows_of_a_refused_change_are_cleaned_once_a_sync_gets_through() -> None:
    async def scenario() -> None:
        nft, conntrack = FlakyNft(), FakeConntrack()
        backend = NftBackend(nft=nft, options=Options(), conntrack=conntrack, sleep=_no_sleep)
        await backend.apply(_state(1, {WEB: _udp_service(_udp_ep("10.244.1.2"))}))
        conntrack.flows.append(TO_2)
        nft.failures = 1  # the change that removes the endpoint is refused
        changed = _state(2, {WEB: _udp_service(_udp_ep("10.244.1.3"))})
        with pytest.raises(NftError):
            await backend.apply(changed)
        assert conntrack.flows == [TO_2]
        await backend.apply(changed)  # the Feeder's retry, a full resync
        assert conntrack.deleted == [TO_2]
        await backend.close()

    asyncio.run(scenario())


def test_a_new_target_port_deletes_the_udp_flows_to_the_old_one() -> None:
    """Upstream e2e "should be able to cleanup conntrack entries when UDP service target port
    changes" (v1.35): the endpoint's address stays, its port changes, and a client that keeps
    sending from one source port would otherwise keep reaching the old port."""

    async def scenario() -> None:
        via_node_port = Flow("192.0.2.10", "30053", "10.244.1.2", "5353")
        conntrack = FakeConntrack(TO_2, via_node_port)
        backend = NftBackend(nft=FakeNft(), options=Options(), conntrack=conntrack)
        old = _udp_ep("10.244.1.2")
        await backend.apply(_state(1, {WEB: _udp_service(old, node_port=30053)}))
        assert conntrack.deleted == []  # the start reconciles: nothing is stale
        moved = Endpoint(
            IPs=old.IPs,
            PortOverrides=(PortName(Name="p", Port=9090, Protocol="UDP"),),
            Scopes=ALL,
            Ready=True,
        )
        await backend.apply(_state(2, {WEB: _udp_service(moved, node_port=30053)}))
        assert conntrack.flows == []
        assert conntrack.deleted == [TO_2, via_node_port]
        await backend.close()

    asyncio.run(scenario())


def test_a_takeover_deletes_only_the_udp_flows_whose_endpoint_serves_nowhere() -> None:
    """kube-proxy's reconciliation at start (1.37): not every flow of every service (a full sync
    touches them all), only those going elsewhere than an endpoint serving their frontend; a
    service address with no serving endpoint at all loses every flow."""
    db: ServiceKey = ("ns", "db")
    to_terminating = Flow("10.96.0.10", "53", "10.244.1.4", "5353")
    to_gone = Flow("10.96.0.10", "53", "10.244.1.9", "5353")
    unanswered = Flow("10.96.0.10", "53", "10.96.0.10", "53")  # made while it had no endpoint
    to_db = Flow("10.96.0.20", "53", "10.244.1.9", "5353")  # db has no endpoint: it goes
    conntrack = FakeConntrack(TO_2, to_terminating, to_gone, unanswered, to_db)
    # 10.244.1.4 is terminating and still serving: the brain lists it, no scope uses it.
    web = _udp_service(_udp_ep("10.244.1.2"), serving=("10.244.1.2", "10.244.1.4"))
    dbs = ServiceEndpoints(_service("db", cluster_ip="10.96.0.20", protocol="UDP", port=53), ())
    nft = FakeNft()

    async def scenario() -> None:
        await NftBackend(nft=nft, options=Options()).apply(_state(1, {WEB: web, db: dbs}))
        takeover = NftBackend(nft=nft, options=Options(), conntrack=conntrack)
        await takeover.apply(_state(1, {WEB: web, db: dbs}))
        assert sorted(conntrack.flows) == sorted([TO_2, to_terminating])
        # Once it no longer serves, its flows go too.
        gone = _udp_service(_udp_ep("10.244.1.2"), serving=("10.244.1.2",))
        await takeover.apply(_state(2, {WEB: gone, db: dbs}, updated={WEB}))
        assert sorted(conntrack.flows) == sorted([TO_2])

    asyncio.run(scenario())


def _udp_ep(addr: str) -> Endpoint:
    return Endpoint(
        IPs=IPSet(V4=(addr,)),
        PortOverrides=(PortName(Name="p", Port=5353, Protocol="UDP"),),
        Scopes=ALL,
        Ready=True,
        Serving=True,
    )


class SctpLessNft(FakeNft):
    """A fake kernel without SCTP: it refuses any transaction with an SCTP element, naming the
    first line that has one."""

    async def run(self, tx: Transaction) -> None:
        for n, (line, _) in enumerate(tx.lines(), start=1):
            if " . sctp . " in line:
                raise error_for_line(tx, line_number=n, message="Operation not supported")
        await super().run(tx)


SCTP: ServiceKey = ("ns", "sctp")


def test_service_the_kernel_refuses_is_left_out_and_named_and_the_rest_programmed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        nft = SctpLessNft()
        backend = NftBackend(nft=nft, options=Options(), sleep=_no_sleep)
        services = {
            WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),)),
            DB: ServiceEndpoints(_service("db", cluster_ip="10.96.0.20"), (_ep("10.244.1.3"),)),
            SCTP: ServiceEndpoints(
                _service("sctp", cluster_ip="10.96.0.30", protocol="SCTP"), (_ep("10.244.1.4"),)
            ),
        }
        await backend.apply(_state(1, services))
        assert set(nft.elements(TABLE, "cluster-v4")) == {
            ("10.96.0.10", "tcp", "80"),
            ("10.96.0.20", "tcp", "80"),
        }
        assert "10.96.0.30" not in nft.dump()
        # Sent again unchanged, it stays out without another refusal.
        applied = len(nft.transactions)
        await backend.apply(_state(2, services))
        assert len(nft.transactions) == applied + 1
        # Changed into something the kernel takes, it is programmed.
        services[SCTP] = ServiceEndpoints(
            _service("sctp", cluster_ip="10.96.0.30"), (_ep("10.244.1.4"),)
        )
        await backend.apply(_state(3, services, updated={SCTP}))
        assert ("10.96.0.30", "tcp", "80") in nft.elements(TABLE, "cluster-v4")
        assert not nft.transactions[-1].render().startswith("add table")  # incremental
        await backend.close()

    asyncio.run(scenario())
    refusals = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(refusals) == 1
    assert refusals[0].startswith(
        "service ns/sctp: the kernel refuses its rules; it is left out until it changes: "
        "nft: Operation not supported at line "
    )
    assert "10.96.0.30 . sctp . 80" in refusals[0]  # the failing line


def test_once_returns_true_when_the_first_state_is_applied() -> None:
    nft = FakeNft()
    backend = NftBackend(nft=nft, options=Options(), once=True)
    services = {WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),))}
    assert asyncio.run(backend.apply(_state(1, services))) is True
    assert len(nft.transactions) == 1


def test_dry_run_prints_transactions_and_touches_nothing() -> None:
    nft = FakeNft()
    out = io.StringIO()
    backend = NftBackend(nft=nft, options=Options(), dry_run=True, output=out)
    services = {WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),))}
    asyncio.run(backend.apply(_state(7, services)))
    text = out.getvalue()
    # It names the services the transaction is for, and each of their elements names its own.
    assert text.startswith("# revision 7: service ns/web\nadd table inet kpng")
    assert (
        'add element inet kpng cluster-v4 { 10.96.0.10 . tcp . 80 comment "ns/web:p" '
        ": goto pick-cluster-v4-1 }" in text
    )
    assert nft.transactions == []
    services[DB] = ServiceEndpoints(_service("db", cluster_ip="10.96.0.11"), ())
    del services[WEB]
    asyncio.run(backend.apply(_state(8, services, updated={DB}, deleted={WEB})))
    assert "# revision 8: services ns/db, ns/web\n" in out.getvalue()


def test_full_table_is_accepted_by_the_fake() -> None:
    """Every reference of the skeleton and of each kind of service resolves."""
    nft = FakeNft()
    backend = NftBackend(
        nft=nft,
        options=Options(cluster_cidrs=("10.244.0.0/16",), nodeport_addresses=("10.0.0.0/8",)),
    )
    services = {(f"ns{i}", "s"): case.values[0] for i, case in enumerate(CASES)}
    asyncio.run(backend.apply(_state(1, services)))  # type: ignore[arg-type]
    assert len(nft.transactions) == 1


def test_a_renamed_port_renames_its_elements_comment() -> None:
    """The comment names the service port: a port renamed with the same number and endpoints
    replaces its elements, so the rules never name a port that is gone."""
    nft = FakeNft()
    backend = NftBackend(nft=nft, options=Options())
    services = {WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),))}
    asyncio.run(backend.apply(_state(1, services)))
    renamed = _service(port_name="q")
    services[WEB] = ServiceEndpoints(renamed, (_ep("10.244.1.2", port_name="q"),))
    asyncio.run(backend.apply(_state(2, services)))
    text = nft.transactions[-1].render()
    assert "delete element inet kpng cluster-v4 { 10.96.0.10 . tcp . 80 }" in text
    assert 'cluster-v4 { 10.96.0.10 . tcp . 80 comment "ns/web:q" : goto' in text
    # Applied again unchanged, nothing is replaced.
    asyncio.run(backend.apply(_state(3, services, updated=set())))
    assert nft.transactions[-1].operations == []
