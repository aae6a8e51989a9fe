"""to-iptables' rules and restore plans, as plain data (no kernel:
tests/kernel/test_iptables_kernel.py and the conformance suite run them)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import io

import msgspec
import pytest

from kpng.backends._node import Fam, Options
from kpng.backends.iptables import IptablesBackend
from kpng.backends.iptables.restore import FamilyTables
from kpng.backends.iptables.rules import (
    FILTER,
    NAT,
    chain_name,
    contribute,
    jumps,
    skeleton,
    tail,
)
from kpng.backends.iptables.syncing import rules_by_table
from kpng.model.messages import EndpointScopes, IPFilter, IPSet, ServiceEndpoints, ServiceIPs
from kpng.testing import states

POD_CIDR = Options(cluster_cidrs=("10.244.0.0/16",))
_service = functools.partial(states.service, cluster_ip="10.96.0.10", port_name="p")
_ep = functools.partial(states.endpoint, port_name="p")
REMOTE = EndpointScopes(Internal=False, External=False, Cluster=True)
SVC = chain_name("KUBE-SVC-", "ns/web:p", "tcp")
SVL = chain_name("KUBE-SVL-", "ns/web:p", "tcp")
EXT = chain_name("KUBE-EXT-", "ns/web:p", "tcp")
FW = chain_name("KUBE-FW-", "ns/web:p", "tcp")
COMMENT = '-m comment --comment "ns/web:p"'
TO_CIP = f"{COMMENT} -d 10.96.0.10/32 -p tcp -m tcp --dport 80"


def sep(address: str) -> str:
    return chain_name("KUBE-SEP-", "ns/web:p", "tcp", f"{address}:8080")


def test_a_cluster_ip_balances_over_its_endpoints_and_masquerades_what_is_not_a_pod() -> None:
    se = ServiceEndpoints(_service(), (_ep("10.244.1.2"), _ep("10.244.2.2"), _ep("10.244.3.2")))
    out = contribute(se, "v4", POD_CIDR)
    a, b, c = sep("10.244.1.2"), sep("10.244.2.2"), sep("10.244.3.2")
    assert out.chains[(NAT, SVC)] == (
        f"{TO_CIP} ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ",
        f"{COMMENT} -m statistic --mode random --probability 0.3333333333 -j {a}",
        f"{COMMENT} -m statistic --mode random --probability 0.5000000000 -j {b}",
        f"{COMMENT} -j {c}",
    )
    assert out.chains[(NAT, a)] == (
        f"{COMMENT} -s 10.244.1.2/32 -j KUBE-MARK-MASQ",  # hairpin
        f"{COMMENT} -p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080",
    )
    assert out.shared == {
        (NAT, "KUBE-SERVICES"): [f"{TO_CIP} -j {SVC}"],
        (FILTER, "KUBE-SERVICES"): ["-d 10.96.0.10/32 -j REJECT"],  # a port no service has
    }


# (case, service, endpoints, filter rule for the cluster IP's port or None)
NO_ENDPOINT_CASES = [
    ("none anywhere: refused at once", _service(usable=False), (), "REJECT"),
    (
        "iTP Local and none here: dropped",
        msgspec.structs.replace(_service(), InternalTrafficToLocal=True),
        (_ep("10.244.2.2", scopes=REMOTE),),
        "DROP",
    ),
]


@pytest.mark.parametrize(
    ("service", "endpoints", "verdict"),
    [pytest.param(s, e, v, id=c) for c, s, e, v in NO_ENDPOINT_CASES],
)
def test_a_port_without_endpoints_for_its_traffic_is_refused_or_dropped_in_filter(
    service: object, endpoints: tuple[object, ...], verdict: str
) -> None:
    out = contribute(ServiceEndpoints(service, endpoints), "v4", POD_CIDR)  # type: ignore[arg-type]
    assert (NAT, "KUBE-SERVICES") not in out.shared
    assert out.shared[(FILTER, "KUBE-SERVICES")][0] == f"{TO_CIP} -j {verdict}"


def test_etp_local_short_circuits_pods_and_the_node_and_sends_the_rest_to_local_endpoints() -> None:
    local = _ep("10.244.1.2", local=True)
    remote = _ep("10.244.2.2", scopes=EndpointScopes(Internal=True, Cluster=True))
    service = _service(node_port=30080, etp_local=True)
    out = contribute(ServiceEndpoints(service, (local, remote)), "v4", POD_CIDR)
    assert out.chains[(NAT, EXT)] == (
        f"{COMMENT} -s 10.244.0.0/16 -j {SVC}",
        f"{COMMENT} -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ",
        f"{COMMENT} -m addrtype --src-type LOCAL -j {SVC}",
        f"{COMMENT} -j {SVL}",
    )
    assert out.chains[(NAT, SVL)] == (f"{COMMENT} -j {sep('10.244.1.2')}",)
    assert out.shared[(NAT, "KUBE-NODEPORTS")] == [
        f"{COMMENT} -p tcp -m tcp --dport 30080 -j {EXT}"
    ]


def test_etp_local_without_a_local_endpoint_drops_external_traffic_in_filter() -> None:
    remote = _ep("10.244.2.2", scopes=EndpointScopes(Internal=True, Cluster=True))
    service = _service(node_port=30080, etp_local=True, external_ips=("192.0.2.7",))
    out = contribute(ServiceEndpoints(service, (remote,)), "v4", POD_CIDR)
    assert out.shared[(FILTER, "KUBE-EXTERNAL-SERVICES")] == [
        f"{COMMENT} -d 192.0.2.7/32 -p tcp -m tcp --dport 80 -j DROP",
        f"{COMMENT} -m addrtype --dst-type LOCAL -p tcp -m tcp --dport 30080 -j DROP",
    ]
    # Pods and the node still reach it through the short-circuit.
    assert out.chains[(NAT, EXT)][0] == f"{COMMENT} -s 10.244.0.0/16 -j {SVC}"


def test_client_ip_affinity_checks_then_remembers_each_endpoint() -> None:
    se = ServiceEndpoints(_service(affinity=60), (_ep("10.244.1.2"), _ep("10.244.2.2")))
    out = contribute(se, "v4", Options())
    a, b = sep("10.244.1.2"), sep("10.244.2.2")
    assert out.chains[(NAT, SVC)][:2] == (
        f"{COMMENT} -m recent --name {a} --rsource --rcheck --seconds 60 --reap -j {a}",
        f"{COMMENT} -m recent --name {b} --rsource --rcheck --seconds 60 --reap -j {b}",
    )
    assert out.chains[(NAT, a)][1] == (
        f"{COMMENT} -p tcp -m tcp -m recent --name {a} --rsource --set "
        "-j DNAT --to-destination 10.244.1.2:8080"
    )


def test_load_balancer_source_ranges_let_only_allowed_sources_reach_the_ext_chain() -> None:
    service = _service(
        filters=(IPFilter(TargetIPs=IPSet(V4=("192.0.2.9",)), SourceRanges=("203.0.113.0/24",)),),
    )
    lb = ServiceIPs(ClusterIPs=IPSet(V4=("10.96.0.10",)), LoadBalancerIPs=IPSet(V4=("192.0.2.9",)))
    service = msgspec.structs.replace(service, IPs=lb)
    out = contribute(ServiceEndpoints(service, (_ep("10.244.1.2"),)), "v4", Options())
    to_lb = f"{COMMENT} -d 192.0.2.9/32 -p tcp -m tcp --dport 80"
    assert out.chains[(NAT, FW)] == (f"{COMMENT} -s 203.0.113.0/24 -j {EXT}",)
    assert f"{to_lb} -j {FW}" in out.shared[(NAT, "KUBE-SERVICES")]
    assert out.shared[(FILTER, "KUBE-PROXY-FIREWALL")] == [f"{to_lb} -j DROP"]


def _tables() -> FamilyTables:
    return FamilyTables("v4", POD_CIDR)


def test_a_partial_plan_rewrites_only_the_changed_services_chains_and_deletes_what_went() -> None:
    tables = _tables()
    web = ServiceEndpoints(_service(), (_ep("10.244.1.2"), _ep("10.244.2.2")))
    db = ServiceEndpoints(_service("db", cluster_ip="10.96.0.20"), (_ep("10.244.3.3"),))
    first = {
        ("ns", "web"): contribute(web, "v4", POD_CIDR),
        ("ns", "db"): contribute(db, "v4", POD_CIDR),
    }
    tables.commit(first)
    one_less = ServiceEndpoints(web.service, web.endpoints[:1])
    plan = tables.plan({("ns", "web"): contribute(one_less, "v4", POD_CIDR)})
    lines = plan.text.splitlines()
    assert not plan.full
    # web's SVC chain changed, its first SEP did not, its second went; db is not touched.
    assert f":{SVC} - [0:0]" in lines
    assert f":{sep('10.244.1.2')} - [0:0]" not in lines
    assert f"-X {sep('10.244.2.2')}" in lines
    assert not [line for line in lines if "ns/db" in line and "KUBE-SERVICES" not in line]
    # The shared chains still hold db's rules.
    assert any(line.startswith("-A KUBE-SERVICES") and "ns/db" in line for line in lines)
    assert (plan.written, plan.deleted) == (1, 1)


def test_a_full_plan_deletes_the_service_chains_it_does_not_want_and_nothing_else() -> None:
    tables = _tables()
    web = ServiceEndpoints(_service(), (_ep("10.244.1.2"),))
    stale = chain_name("KUBE-SVC-", "ns/old:p", "tcp")
    plan = tables.plan(
        {("ns", "web"): contribute(web, "v4", POD_CIDR)},
        present={"KUBE-SERVICES", stale, "KUBE-KUBELET-CANARY", "CNI-FORWARD", SVC},
    )
    lines = plan.text.splitlines()
    assert plan.full
    assert [line for line in lines if line.startswith("-X")] == [f"-X {stale}"]
    assert lines.count("COMMIT") == 2


@pytest.mark.parametrize("fam", ["v4", "v6"])
def test_a_change_that_leaves_a_familys_rules_as_they_were_plans_no_restore(fam: Fam) -> None:
    """A v4 service's new endpoint is nothing to the v6 tables: no ip6tables-restore is run
    for it (a partial sync of every family cost twice the restore)."""
    tables = FamilyTables(fam, POD_CIDR)
    web = ServiceEndpoints(_service(), (_ep("10.244.1.2"),))
    tables.commit({("ns", "web"): contribute(web, fam, POD_CIDR)})
    moved = ServiceEndpoints(web.service, (_ep("10.244.9.9"),))
    plan = tables.plan({("ns", "web"): contribute(moved, fam, POD_CIDR)})
    assert (plan.text == "") is (fam == "v6")
    full = tables.plan({}, present=set())
    assert full.full
    assert full.text


def test_a_partial_plan_declares_only_the_shared_chains_whose_rules_change() -> None:
    """An endpoint's change rewrites its service's chains alone; a new service adds its lines
    to KUBE-SERVICES, which is then rewritten whole (nat's, and filter's REJECT of its IP)."""
    tables = _tables()
    web = ServiceEndpoints(_service(), (_ep("10.244.1.2"), _ep("10.244.2.2")))
    first = {("ns", "web"): contribute(web, "v4", POD_CIDR)}
    tables.commit(first, tables.plan(first, present=set()))

    moved = {
        ("ns", "web"): contribute(ServiceEndpoints(web.service, web.endpoints[:1]), "v4", POD_CIDR)
    }
    plan = tables.plan(moved)
    declared = {line for line in plan.text.splitlines() if line.startswith(":")}
    assert declared == {f":{SVC} - [0:0]", f":{sep('10.244.2.2')} - [0:0]"}
    tables.commit(moved, plan)

    db = ServiceEndpoints(_service("db", cluster_ip="10.96.0.20"), (_ep("10.244.3.3"),))
    added = {("ns", "db"): contribute(db, "v4", POD_CIDR)}
    lines = tables.plan(added).text.splitlines()
    assert lines.count(":KUBE-SERVICES - [0:0]") == 2
    assert "-A KUBE-SERVICES -d 10.96.0.20/32 -j REJECT" in lines
    # Every service's lines, not only db's: the chain is flushed and refilled.
    assert any(line.startswith("-A KUBE-SERVICES") and "ns/web" in line for line in lines)
    assert ":KUBE-NODEPORTS - [0:0]" not in lines


@pytest.mark.parametrize(
    "parts", [("ns/web:http", "tcp"), ("ns/web:p", "udp", "10.244.1.2:8080"), ("",), ("é" * 40,)]
)
def test_chain_names_are_kube_proxys_base32_of_a_sha256(parts: tuple[str, ...]) -> None:
    digest = hashlib.sha256("".join(parts).encode()).digest()
    expected = "KUBE-SVC-" + base64.b32encode(digest).decode()[:16]
    assert chain_name("KUBE-SVC-", *parts) == expected


def test_without_comments_the_endpoint_chains_carry_none_and_the_service_rules_keep_them() -> None:
    """kube-proxy's large cluster mode: the KUBE-SVC and KUBE-SEP rules lose their comment,
    KUBE-SERVICES and the masquerade rule keep it."""
    se = ServiceEndpoints(_service(), (_ep("10.244.1.2"), _ep("10.244.2.2")))
    out = contribute(se, "v4", POD_CIDR, comments=False)
    a, b = sep("10.244.1.2"), sep("10.244.2.2")
    assert out.chains[(NAT, SVC)] == (
        f"{TO_CIP} ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ",
        f"-m statistic --mode random --probability 0.5000000000 -j {a}",
        f"-j {b}",
    )
    assert out.chains[(NAT, a)] == (
        "-s 10.244.1.2/32 -j KUBE-MARK-MASQ",
        "-p tcp -m tcp -j DNAT --to-destination 10.244.1.2:8080",
    )
    assert out.shared[(NAT, "KUBE-SERVICES")] == [f"{TO_CIP} -j {SVC}"]


def test_past_a_thousand_endpoints_every_endpoint_chain_is_rewritten_without_comments() -> None:
    """The mode is the whole state's: crossing the threshold either way is a full sync."""
    output = io.StringIO()
    backend = IptablesBackend(iptables=None, options=POD_CIDR, families=("v4",), output=output)

    def services(count: int) -> dict[str, ServiceEndpoints]:
        return {
            f"s{i}": ServiceEndpoints(
                states.service(f"s{i}", index=i),
                tuple(states.endpoint(f"10.244.{i}.{e + 1}") for e in range(10)),
            )
            for i in range(count)
        }

    def sep_rules(revision: int, count: int, updated: list[str]) -> list[str]:
        output.seek(0)
        output.truncate()
        asyncio.run(backend.apply(states.state(revision, services(count), updated=updated)))
        return [r for r in output.getvalue().splitlines() if r.startswith("-A KUBE-SEP-")]

    assert all("--comment" in r for r in sep_rules(1, 100, updated=[]))  # 1,000: with
    large = sep_rules(2, 101, updated=["s100"])
    assert len(large) == 2 * 1010
    assert not any("--comment" in r for r in large)
    small = sep_rules(3, 100, updated=[])
    assert len(small) == 2 * 1000
    assert all("--comment" in r for r in small)


def test_forwarded_packets_conntrack_finds_invalid_are_dropped_first_unless_told_not_to() -> None:
    """kube-proxy's iptables mode drops them in KUBE-FORWARD, before the accepts, unless
    nf_conntrack_tcp_be_liberal is set (then the rule is not installed)."""
    for fam in ("v4", "v6"):
        forward = skeleton(POD_CIDR, fam)[(FILTER, "KUBE-FORWARD")]
        assert forward[0] == "-m conntrack --ctstate INVALID -j DROP"
        liberal = skeleton(dataclasses.replace(POD_CIDR, drop_invalid=False), fam)
        assert not [r for r in liberal[(FILTER, "KUBE-FORWARD")] if "INVALID" in r]


COUNTED = frozenset({"ct_state_invalid_dropped_pkts", "localhost_nps_accepted_pkts"})


@pytest.mark.parametrize(
    ("nfacct", "rule"),
    [
        (frozenset(), "-m conntrack --ctstate INVALID -j DROP"),
        (
            COUNTED,
            "-m conntrack --ctstate INVALID -m nfacct --nfacct-name ct_state_invalid_dropped_pkts "
            "-j DROP",
        ),
    ],
    ids=["no-nfacct", "counted"],
)
def test_the_invalid_drop_counts_into_kube_proxys_nfacct_object_when_the_kernel_made_it(
    nfacct: frozenset[str], rule: str
) -> None:
    forward = skeleton(dataclasses.replace(POD_CIDR, nfacct=nfacct), "v4")
    assert forward[(FILTER, "KUBE-FORWARD")][0] == rule


@pytest.mark.parametrize(
    ("localhost", "nfacct", "fam", "counted"),
    [
        (True, COUNTED, "v4", True),
        (True, frozenset(), "v4", False),  # no nfnetlink_acct: kube-proxy's rules then
        (False, COUNTED, "v4", False),  # node ports not on loopback: nothing to count
    ],
    ids=["counted", "no-nfacct", "off"],
)
def test_a_node_port_on_loopback_is_counted_by_a_jump_of_its_own_ahead_of_the_ports(
    localhost: bool, nfacct: frozenset[str], fam: Fam, counted: bool
) -> None:
    options = dataclasses.replace(POD_CIDR, localhost_nodeports=localhost, nfacct=nfacct)
    se = ServiceEndpoints(states.service("web", node_port=30080), (states.endpoint("10.244.1.2"),))
    rules = contribute(se, fam, options).shared[(NAT, "KUBE-NODEPORTS")]
    ext = rules[-1].split(" -j ")[-1]
    port = '-m comment --comment "ns/web:http" -p tcp -m tcp --dport 30080'
    assert rules[-1] == f"{port} -j {ext}"
    loopback = (
        '-m comment --comment "ns/web:http" -d 127.0.0.0/8 -p tcp -m tcp --dport 30080 '
        f"-m nfacct --nfacct-name localhost_nps_accepted_pkts -j {ext}"
    )
    assert rules[:-1] == ([loopback] if counted else [])


LOCALHOST = dataclasses.replace(POD_CIDR, localhost_nodeports=True)
GUARD = (
    '! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" '
    "-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
)


@pytest.mark.parametrize(
    ("options", "fam", "served"),
    [
        (POD_CIDR, "v4", False),  # not asked
        (LOCALHOST, "v4", True),  # every local address: loopback too
        (dataclasses.replace(LOCALHOST, nodeport_addresses=("127.0.0.0/8",)), "v4", True),
        (dataclasses.replace(LOCALHOST, nodeport_addresses=("0.0.0.0/0",)), "v4", True),
        (dataclasses.replace(LOCALHOST, nodeport_addresses=("10.0.0.0/8",)), "v4", False),
        (LOCALHOST, "v6", False),  # IPv4 only, as kube-proxy
    ],
    ids=["off", "all", "localhost", "0/0", "other-cidr", "v6"],
)
def test_localhost_node_ports_open_loopback_to_them_behind_kube_proxys_guard(
    options: Options, fam: Fam, served: bool
) -> None:
    nat = tail(options, fam)[(NAT, "KUBE-SERVICES")]
    loopback = "127.0.0.0/8" if fam == "v4" else "::1/128"
    assert (f"-d {loopback} -j RETURN" not in nat) is served
    guard = skeleton(options, fam).get((FILTER, "KUBE-FIREWALL"))
    assert guard == ([GUARD] if served else None)
    wanted = jumps(options, fam)
    assert ((FILTER, "INPUT", "-j KUBE-FIREWALL") in wanted) is served
    assert ((FILTER, "OUTPUT", "-j KUBE-FIREWALL") in wanted) is served


def test_a_full_plan_with_localhost_node_ports_writes_the_guard_and_inserts_its_jumps() -> None:
    tables = FamilyTables("v4", LOCALHOST)
    missing = set(jumps(LOCALHOST, "v4"))
    lines = tables.plan({}, present=set(), missing_jumps=missing).text.splitlines()
    assert ":KUBE-FIREWALL - [0:0]" in lines
    assert f"-A KUBE-FIREWALL {GUARD}" in lines
    assert "-I INPUT 1 -j KUBE-FIREWALL" in lines
    assert "-I OUTPUT 1 -j KUBE-FIREWALL" in lines
    # Off again: the guard is left as it is (route_localnet stays set), never flushed.
    tables.commit({}, tables.plan({}, present=set()))
    tables.options = POD_CIDR
    off = tables.plan({}, present=set())
    assert "KUBE-FIREWALL" not in off.text
    tables.commit({}, off)
    assert (FILTER, "KUBE-FIREWALL") not in tables.shared


@pytest.mark.parametrize(
    ("restore_input", "counts"),
    [
        ("", {}),
        ("*filter\n:KUBE-FORWARD - [0:0]\n-A KUBE-FORWARD -j ACCEPT\nCOMMIT\n", {"filter": 1}),
        (
            "*filter\n-A KUBE-A -j DROP\nCOMMIT\n*nat\n:KUBE-SVC-X - [0:0]\n-X KUBE-SVC-Y\n"
            "-A KUBE-SVC-X -j KUBE-SEP-Z\n-A KUBE-SEP-Z -j DNAT\nCOMMIT\n",
            {"filter": 1, "nat": 2},
        ),
    ],
)
def test_the_rules_a_restore_writes_are_counted_per_table(
    restore_input: str, counts: dict[str, int]
) -> None:
    assert rules_by_table(restore_input) == counts
