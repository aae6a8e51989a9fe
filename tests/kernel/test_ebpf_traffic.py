"""to-ebpf's per-Service traffic counters (``--traffic-counters service``): the programs'
per-frontend counts folded into totals that never go down, summed with the nftables part's,
and, in the kernel, N connections counted as N, across a restart of kpng."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kpng.backends._nftables.counting import CONNECTIONS, DROPPED, REJECTED, SERVICE_PORTS
from kpng.backends._nftables.counting import Sample as PacketsSample
from kpng.backends._node import FromNode, Options
from kpng.backends.ebpf import SocketBalancer
from kpng.backends.ebpf.toolchain import unavailable
from kpng.backends.ebpf.traffic import FrontendTraffic, Labels, labels, merged_samples
from kpng.client import NodeState
from kpng.model.messages import Endpoint, ServiceEndpoints
from kpng.testing import states
from kpng.testing.conformance import Cluster, endpoint_slice, port, service
from kpng.testing.netns import ClusterSpec, TestBed, available
from kpng.testing.states import keyed_state
from kpng.testing.waiting import poll
from tests.kernel.test_ebpf_kernel import DNS_IP, EMPTY_IP, IP, metered_cluster, scraped

WEB = labels("ns", "web", "http")
DNS = labels("ns", "dns", "")
A, B, C = b"a" * 20, b"b" * 20, b"c" * 20


def test_counts_are_summed_per_service_port_over_its_frontends() -> None:
    t = FrontendTraffic()
    t.fold([(A, 3), (B, 4), (C, 5)], {A: WEB, B: WEB, C: DNS})
    assert t.totals == {WEB: 7, DNS: 5}


@pytest.mark.parametrize(
    ("second", "owners", "expected"),
    [
        # An entry deleted and made again (kpng lost track of it) counts from zero.
        ([(A, 2), (B, 4)], {A: WEB, B: WEB}, {WEB: 3 + 2 + 4}),
        # A frontend gone keeps what it counted in its service port's total.
        ([(B, 6)], {B: WEB}, {WEB: 3 + 6}),
        # A frontend another service port took over: what it counted before stays with the
        # first, the new one counts from there.
        ([(A, 10), (B, 4)], {A: DNS, B: WEB}, {WEB: 3 + 4, DNS: 7}),
        # An entry whose frontend kpng no longer writes counts for nobody.
        ([(A, 9), (B, 4)], {B: WEB}, {WEB: 3 + 4}),
    ],
    ids=["made-again", "frontend-gone", "changed-hands", "not-kpngs"],
)
def test_a_total_never_goes_down(
    second: list[tuple[bytes, int]], owners: dict[bytes, Labels], expected: dict[Labels, int]
) -> None:
    t = FrontendTraffic()
    t.fold([(A, 3), (B, 4)], {A: WEB, B: WEB})
    t.fold(second, owners)
    assert t.totals == expected


def test_a_service_port_with_no_frontend_left_is_gone() -> None:
    t = FrontendTraffic()
    t.fold([(A, 3), (C, 1)], {A: WEB, C: DNS})
    t.fold([(C, 1)], {C: DNS})
    assert t.totals == {DNS: 1}
    # Made again, the service port starts from zero, as a new process would.
    t.fold([(A, 2), (C, 1)], {A: WEB, C: DNS})
    assert t.totals == {WEB: 2, DNS: 1}


def _packets(port: Labels, connections: int, rejected: int) -> list[PacketsSample]:
    return [
        PacketsSample(CONNECTIONS, "", connections, counter=True, labels=port),
        PacketsSample(REJECTED, "", rejected, counter=True, labels=port),
    ]


def test_the_programs_and_the_nftables_parts_counts_are_summed() -> None:
    packets = [*_packets(WEB, 5, 2), *_packets(DNS, 1, 1)]
    samples = merged_samples({WEB: 10}, packets, 100)
    values = {(s.name, s.labels): s.value for s in samples}
    assert values[(CONNECTIONS, WEB)] == 15
    assert values[(REJECTED, WEB)] == 2
    assert values[(CONNECTIONS, DNS)] == 1
    assert values[(SERVICE_PORTS, ())] == 2
    assert values[(DROPPED, ())] == 0


def test_past_the_limit_the_service_ports_with_the_least_connections_are_left_out() -> None:
    other = labels("ns", "other", "")
    samples = merged_samples({WEB: 10, DNS: 1}, _packets(other, 5, 0), 2)
    kept = {s.labels for s in samples if s.name == CONNECTIONS}
    assert kept == {WEB, other}
    assert [s.value for s in samples if s.name == DROPPED] == [1]


# --- in the kernel

_UDP = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
for _ in range(int(sys.argv[3])):
    s.sendto(b"hello\\n", (sys.argv[1], int(sys.argv[2])))
    s.recvfrom(4096)
"""
"""Unconnected UDP sends from one socket: one flow, one connection."""

kernel = pytest.mark.skipif(
    available() is not None or unavailable() is not None,
    reason=str(available() or unavailable()),
)


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[Cluster]:
    with metered_cluster(tmp_path, "--traffic-counters service") as cluster:
        yield cluster


def _series(cluster: Cluster) -> dict[tuple[str, str], float]:
    """kpng's service traffic series, by (metric, service), scraped in the node's namespace."""
    return {
        (name, dict(labels)["service"]): value
        for (name, labels), value in scraped(cluster).items()
        if name in (CONNECTIONS, REJECTED)
    }


_EMPTY = ((CONNECTIONS, "empty"), (REJECTED, "empty"))


def _refused(grown: dict[tuple[str, str], float], n: int) -> bool:
    """The nftables part counts each packet its REJECT answers: a SYN sent again, when the
    kernel's ICMP rate limit left one unanswered, counts twice (as in to-nft)."""
    connections, rejected = (grown[k] for k in _EMPTY)
    return connections == rejected and n <= rejected <= n + 2


@kernel
def test_n_connections_through_the_programs_and_the_nftables_part_count_n(
    counted: Cluster,
) -> None:
    """N TCP connections translated by the programs count N for web; N refused for want of
    endpoints (the nftables part's REJECT) N connections and N rejected for empty; N unconnected
    UDP sends from one socket, one flow, one for dns. An incremental sync that rewrites web's
    frontend loses none of them. After a restart of kpng, the series start from zero and count
    what comes next."""
    before: dict[tuple[str, str], float] = {}

    def read() -> bool:
        nonlocal before
        try:
            before = _series(counted)
        except Exception:  # not listening yet
            return False
        return (CONNECTIONS, "web") in before and (CONNECTIONS, "empty") in before

    assert poll(read, within=30, interval=0.5)
    n = 7
    assert counted.probe("a1", "tcp", IP, 80, count=n) == ["a2 10.244.1.2"] * n
    assert counted.probe("a1", "tcp", EMPTY_IP, 80, count=n) == ["refused"] * n
    a1 = counted.bed.pods["a1"].netns
    counted.bed.exec(a1, [sys.executable, "-c", _UDP, DNS_IP, "53", str(n)])
    expected = {(CONNECTIONS, "web"): n, (REJECTED, "web"): 0, (CONNECTIONS, "dns"): 1}
    grown: dict[tuple[str, str], float] = {}

    def counted_all() -> bool:
        nonlocal grown
        after = _series(counted)
        grown = {k: after[k] - before.get(k, 0) for k in [*expected, *_EMPTY]}
        return all(grown[k] == v for k, v in expected.items()) and _refused(grown, n)

    assert poll(counted_all, within=30, interval=0.5), grown
    # web gets a second endpoint, a1: an incremental sync rewrites its frontend, not its count.
    web = _series(counted)[(CONNECTIONS, "web")]
    counted.write(
        "web", service("web", IP, [port("http", 80)]), endpoint_slice(counted, "web", ["a1", "a2"])
    )
    probes = 0

    def moved() -> bool:
        nonlocal probes
        probes += 1
        return counted.probe("a1", "tcp", IP, 80)[0].startswith("a1 ")

    assert poll(moved, within=30, interval=0.2)
    assert poll(
        lambda: _series(counted)[(CONNECTIONS, "web")] == web + probes, within=30, interval=0.5
    )
    counted.start_backend("node-1")
    after: dict[tuple[str, str], float] = {}

    def restarted() -> bool:
        nonlocal after
        try:
            after = _series(counted)
        except Exception:  # the old process gone, the new one not listening yet
            return False
        return _attach_log_lines(counted) == 2 and (CONNECTIONS, "web") in after

    assert poll(restarted, within=30, interval=0.5)
    # A new process's series start from zero, as to-nft's (the nftables part's counters restart
    # with it); the programs' counts, pinned, go on from there, none lost or counted twice.
    assert after[(CONNECTIONS, "web")] == 0
    answers = counted.probe("a1", "tcp", IP, 80, count=3)
    assert [a.split()[0] in ("a1", "a2") for a in answers] == [True] * 3, answers
    assert poll(lambda: _series(counted)[(CONNECTIONS, "web")] == 3, within=30, interval=0.5)


def _attach_log_lines(cluster: Cluster) -> int:
    return (cluster.logs / "node-1.log").read_text().count("to-ebpf: programs attached")


def test_what_entries_counted_before_this_process_is_left_out() -> None:
    t = FrontendTraffic()
    t.begin([(A, 5), (B, 9)])
    # B was deleted and made again since: all it holds is this process's.
    t.fold([(A, 8), (B, 2), (C, 1)], {A: WEB, B: WEB, C: DNS})
    assert t.totals == {WEB: 3 + 2, DNS: 1}
    t.fold([(A, 10), (B, 2), (C, 1)], {A: WEB, B: WEB, C: DNS})
    assert t.totals == {WEB: 5 + 2, DNS: 1}


@kernel
def test_the_programs_counts_survive_incremental_syncs_and_a_full_repair() -> None:
    """kpng's sockets part in this process, read at will: connections through a ClusterIP are
    counted once each; a state that changes web's endpoints (its frontend and sets rewritten)
    and a repair (every entry written anew, as after a drift) leave the counts; a service
    gone takes its entries, and its series, with it."""
    web_ip, other_ip = "10.96.0.40", "10.96.0.41"
    with TestBed(ClusterSpec.parse({"node-1": ["a1", "a2", "a3"]}), sockets=True) as bed:
        node = bed.nodes["node-1"]
        assert node.cgroup is not None
        assert node.pin_dir is not None
        pin_dir = node.pin_dir
        a2, a3 = bed.pod("a2").ip4, bed.pod("a3").ip4
        web = labels("ns", "web", "http")
        other = labels("ns", "other", "http")

        def endpoints(*ips: str) -> tuple[Endpoint, ...]:
            return tuple(states.endpoint(ip) for ip in ips)

        def state(revision: int, *web_ips: str, with_other: bool = True) -> NodeState:
            services = {
                ("ns", "web"): ServiceEndpoints(
                    states.service("web", cluster_ip=web_ip), endpoints(*web_ips)
                )
            }
            if with_other:
                services[("ns", "other")] = ServiceEndpoints(
                    states.service("other", cluster_ip=other_ip), endpoints(a3)
                )
            gone = [] if with_other else [("ns", "other")]
            return keyed_state(revision, services, deleted=gone)

        def connect(ip: str, n: int) -> None:
            answers = bed.probe(bed.pod("a1").netns, "tcp", ip, 80, count=n)
            assert [a.split()[0] in ("a2", "a3") for a in answers] == [True] * n, answers

        async def scenario() -> list[dict[Labels, int]]:
            balancer = SocketBalancer(
                options=Options(), from_node=FromNode(), cgroup=node.cgroup,
                pin_dir=pin_dir, bpf_object=None, traffic_counters=True,
            )  # fmt: skip
            seen = []

            async def read() -> None:
                await balancer.read_traffic()
                totals = balancer.traffic_totals()
                assert totals is not None
                seen.append(dict(totals))

            try:
                await balancer.apply(state(1, a2))
                await asyncio.to_thread(connect, web_ip, 5)
                await asyncio.to_thread(connect, other_ip, 2)
                await read()
                await balancer.apply(state(2, a2, a3))
                await read()
                await balancer.repair()
                await asyncio.to_thread(connect, web_ip, 3)
                await read()
                await balancer.apply(state(3, a2, a3, with_other=False))
                await read()
            finally:
                balancer.close()
            return seen

        seen = asyncio.run(scenario())
    assert seen == [
        {web: 5, other: 2},
        {web: 5, other: 2},
        {web: 8, other: 2},
        {web: 8},
    ]
