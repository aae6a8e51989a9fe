"""to-ebpf's per-Service traffic counters (``--traffic-counters service``): the programs'
per-frontend counts folded into totals that never go down, summed with the nftables part's,
and, in the kernel, N connections counted as N, across a restart of kpng. The endpoint level
(``--traffic-counters endpoint``): one entry per endpoint of each set, made and deleted with
the endpoints, never written again while it stays; in the kernel, N connections split between
the endpoints as the servers saw them, the counts never lower across an incremental sync, a
relayout of the slots and a drift repair."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kpng.backends._nftables.counting import CONNECTIONS, DROPPED, REJECTED, SERVICE_PORTS
from kpng.backends._nftables.counting import Sample as PacketsSample
from kpng.backends._node import FromNode, Options
from kpng.backends._traffic import ENDPOINT_CONNECTIONS, ENDPOINTS, ENDPOINTS_DROPPED
from kpng.backends.ebpf import SocketBalancer
from kpng.backends.ebpf.entries import LAYOUT_VERSION
from kpng.backends.ebpf.toolchain import unavailable
from kpng.backends.ebpf.traffic import (
    EndpointEntries,
    FrontendTraffic,
    Labels,
    endpoint_labels,
    labels,
    merged_samples,
)
from kpng.client import NodeState
from kpng.model.messages import Endpoint, ServiceEndpoints
from kpng.testing import states
from kpng.testing.conformance import Cluster, endpoint_slice, port, service
from kpng.testing.netns import ClusterSpec, TestBed, available
from kpng.testing.states import keyed_state
from kpng.testing.waiting import poll
from tests.kernel.test_ebpf_kernel import (
    DNS_IP,
    EMPTY_IP,
    IP,
    METRICS,
    metered_cluster,
    scraped,
)

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


E1, E2, E3 = b"1" * 20, b"2" * 20, b"3" * 20


@pytest.mark.parametrize(
    ("wanted", "set_ids", "made", "deleted", "held"),
    [
        # A newcomer gets an entry; those that stay are not written again.
        ({7: [E1, E2, E3]}, [7], [(7, E3)], [], {7: {E1, E2, E3}, 8: {E1}}),
        # One that left loses its entry; a set left empty is forgotten.
        ({7: [E2], 8: []}, [7, 8], [], [(7, E1), (8, E1)], {7: {E2}}),
        # Only the sets asked about are looked at (an incremental sync's).
        ({}, [9], [], [], {7: {E1, E2}, 8: {E1}}),
        # Every set (a full sync): one no longer wanted loses its entries.
        ({7: [E1, E2]}, None, [], [(8, E1)], {7: {E1, E2}}),
    ],
    ids=["newcomer", "left", "untouched", "full"],
)
def test_an_endpoint_has_an_entry_while_it_is_in_the_set(
    wanted: dict[int, list[bytes]],
    set_ids: list[int] | None,
    made: list[tuple[int, bytes]],
    deleted: list[tuple[int, bytes]],
    held: dict[int, set[bytes]],
) -> None:
    entries = EndpointEntries()
    entries.found([(7, E1), (7, E2), (8, E1)])
    assert entries.changes(wanted, set_ids) == (made, deleted)
    assert entries.held == held


WEB_A = endpoint_labels(WEB, "10.0.0.1:8080")
WEB_B = endpoint_labels(WEB, "10.0.0.2:8080")


def test_an_endpoint_counts_over_its_sets_and_keeps_what_one_it_left_counted() -> None:
    """An endpoint in two sets of its service port (ClusterIP and node port scopes): its
    series sums both; out of one set, what that set's entry counted stays in the series."""
    t = FrontendTraffic()
    t.fold([(A, 3), (B, 4), (C, 2)], {A: WEB_A, B: WEB_A, C: WEB_B})
    assert t.totals == {WEB_A: 7, WEB_B: 2}
    t.fold([(A, 5), (C, 2)], {A: WEB_A, C: WEB_B})
    assert t.totals == {WEB_A: 9, WEB_B: 2}
    # Gone from every set, the endpoint is gone with its series.
    t.fold([(C, 2)], {C: WEB_B})
    assert t.totals == {WEB_B: 2}


def test_endpoint_counts_are_summed_with_the_nftables_parts_within_the_limit() -> None:
    web_c = endpoint_labels(WEB, "10.0.0.3:8080")
    packets = [
        *_packets(WEB, 5, 0),
        PacketsSample(ENDPOINT_CONNECTIONS, "", 2, counter=True, labels=WEB_A),
        PacketsSample(ENDPOINT_CONNECTIONS, "", 1, counter=True, labels=web_c),
    ]
    samples = merged_samples({WEB: 10}, packets, 2, {WEB_A: 4, WEB_B: 6})
    values = {(s.name, s.labels): s.value for s in samples}
    assert values[(ENDPOINT_CONNECTIONS, WEB_A)] == 6
    assert values[(ENDPOINT_CONNECTIONS, WEB_B)] == 6
    assert (ENDPOINT_CONNECTIONS, web_c) not in values  # the least traffic, past the limit
    assert values[(ENDPOINTS, ())] == 3
    assert values[(ENDPOINTS_DROPPED, ())] == 1
    # At the service level, no endpoint series at all.
    assert not [s for s in merged_samples({WEB: 10}, packets, 2) if "endpoint" in s.name]


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


@kernel
def test_each_endpoint_counts_the_connections_it_served_across_syncs_and_a_repair() -> None:
    """kpng's sockets part in this process with the endpoint level: N connections to web,
    on a2 and a3, reach each endpoint's total as the servers answered them; a state adding a4
    (incremental: its entry made, the others' left), one taking a2 away (a4 moved into a2's
    slot, its count with it, not a2's) and a repair (every entry written anew, as after a
    drift) leave every remaining endpoint's count where it was, and what follows adds up."""
    web_ip = "10.96.0.42"
    with TestBed(ClusterSpec.parse({"node-1": ["a1", "a2", "a3", "a4"]}), sockets=True) as bed:
        node = bed.nodes["node-1"]
        assert node.cgroup is not None
        assert node.pin_dir is not None
        pin_dir = node.pin_dir
        ips = {name: bed.pod(name).ip4 for name in ("a2", "a3", "a4")}
        web = labels("ns", "web", "http")

        def state(revision: int, *pods: str) -> NodeState:
            current[:] = pods
            eps = tuple(states.endpoint(ips[p]) for p in pods)
            se = ServiceEndpoints(states.service("web", cluster_ip=web_ip), eps)
            return keyed_state(revision, {("ns", "web"): se})

        served: dict[str, int] = {}

        def connect(n: int) -> None:
            answers = bed.probe(bed.pod("a1").netns, "tcp", web_ip, 80, count=n)
            for answer in answers:
                served[answer.split()[0]] = served.get(answer.split()[0], 0) + 1
            assert len(answers) == n
            assert {a.split()[0] for a in answers} <= set(current), answers

        current: list[str] = []

        def expected() -> dict[Labels, int]:
            """Every endpoint of web, those that served nothing yet at 0."""
            return {endpoint_labels(web, f"{ips[p]}:8080"): served.get(p, 0) for p in current}

        async def scenario() -> list[tuple[dict[Labels, int], dict[Labels, int]]]:
            balancer = SocketBalancer(
                options=Options(), from_node=FromNode(), cgroup=node.cgroup,
                pin_dir=pin_dir, bpf_object=None, traffic_counters=True,
                endpoint_counters=True,
            )  # fmt: skip
            seen = []

            async def read() -> None:
                await balancer.read_traffic()
                totals = balancer.endpoint_totals()
                assert totals is not None
                seen.append((dict(totals), expected()))

            # No read between connections and the sync after them: a sync that zeroed an
            # entry would lose them unseen.
            try:
                await balancer.apply(state(1, "a2", "a3"))
                await asyncio.to_thread(connect, 20)
                await read()
                await asyncio.to_thread(connect, 6)
                await balancer.apply(state(2, "a2", "a3", "a4"))
                await read()
                await asyncio.to_thread(connect, 12)
                await balancer.apply(state(3, "a3", "a4"))
                served.pop("a2", None)
                await read()
                await asyncio.to_thread(connect, 8)
                await balancer.repair()
                await read()
            finally:
                balancer.close()
            return seen

        seen = asyncio.run(scenario())
    for i, (totals, wanted) in enumerate(seen):
        assert totals == wanted, (i, seen)
    # Both endpoints served some of the first 20, a4 some of the 12 after it came.
    first = seen[0][1]
    assert sum(first.values()) == 20, seen
    assert all(first.values()), seen
    assert seen[2][1][endpoint_labels(web, f"{ips['a4']}:8080")] > 0, seen


_EXPLAIN = """
import json, sys, urllib.request
answer = json.loads(urllib.request.urlopen(sys.argv[1]).read().decode())
endpoints = answer[0]["ports"][0]["endpoints"]
print(json.dumps({ep["address"]: ep.get("connections") for ep in endpoints}))
"""
"""/debug/explain's endpoints of web's one port, with their counted connections."""


@kernel
def test_a_live_kpng_exposes_each_endpoints_connections_as_its_server_saw_them(
    tmp_path: Path,
) -> None:
    """kpng (``to-ebpf --traffic-counters endpoint --sync-period 1s``) in a node: N connections
    to web, on a2 and a3, reach kpng_endpoint_connections_total as the servers answered them
    (the sum N), and /debug/explain and ``kpng explain --metrics-url`` give each endpoint its
    count; a1 added (an incremental sync) and kpng_slots emptied behind kpng's back (found as
    drift, repaired by a full sync) never lower a count, and the connections that follow add
    up."""
    flags = "--traffic-counters endpoint --sync-period 1s"
    with metered_cluster(tmp_path, flags, pods=("a1", "a2", "a3")) as cluster:
        bed = cluster.bed
        ips = {name: bed.pod(name).ip4 for name in ("a1", "a2", "a3")}
        names = {ip: name for name, ip in ips.items()}
        start = _web_on_a2_and_a3(cluster, names)
        served = _connect(cluster, 30)
        assert sum(served.values()) == 30
        assert set(served) == {"a2", "a3"}, served
        wanted = {p: start.get(p, 0) + served.get(p, 0) for p in ("a2", "a3")}
        assert poll(lambda: _endpoint_series(cluster, names) == wanted, within=30), (
            _endpoint_series(cluster, names),
            wanted,
        )
        url = f"http://{METRICS}/debug/explain?service=conformance/web"
        netns = bed.nodes["node-1"].netns
        explained = json.loads(bed.exec(netns, [sys.executable, "-c", _EXPLAIN, url]))
        assert {names[ip]: n for ip, n in explained.items()} == wanted
        argv = [sys.executable, "-m", "kpng", "file", "--input", str(tmp_path / "manifests")]
        argv += ["explain", "--node-name", "node-1", "--service", "conformance/web"]
        text = bed.exec(netns, [*argv, "--metrics-url", METRICS])
        # ENDPOINT NODE CLUSTER LOCAL CONNS WHY: each endpoint's row.
        rows = {
            line.split()[0]: line.split()[4]
            for line in text.splitlines()
            if line.startswith("    10.")
        }
        assert rows == {f"{ips[p]}:8080": str(int(n)) for p, n in wanted.items()}, text

        # An incremental sync adds a1: a2's and a3's entries stay as they are.
        cluster.write(
            "web",
            service("web", IP, [port("http", 80)]),
            endpoint_slice(cluster, "web", ["a1", "a2", "a3"]),
        )
        grown = _monotonic(cluster, names, wanted)
        assert poll(lambda: "a1" in grown(), within=30, interval=0.5)
        wanted = _settled(cluster, names)
        served = _connect(cluster, 30)
        assert "a1" in served, served
        wanted = {p: wanted.get(p, 0) + served.get(p, 0) for p in ("a1", "a2", "a3")}
        assert poll(lambda: grown() == wanted, within=30), (grown(), wanted)

        # Another program empties kpng_slots: the drift check finds it, the repair rewrites
        # every entry of the maps kpng writes, and leaves the counts.
        repaired = _log(cluster).count("hold revision")
        _empty_slots(cluster)
        assert poll(lambda: _log(cluster).count("hold revision") > repaired, within=30)
        grown = _monotonic(cluster, names, wanted)
        served = _connect(cluster, 30)
        wanted = {p: wanted[p] + served.get(p, 0) for p in wanted}
        assert poll(lambda: grown() == wanted, within=30), (grown(), wanted)


def _endpoint_series(cluster: Cluster, names: dict[str, str]) -> dict[str, float]:
    """web's endpoint series, by the pod each endpoint is."""
    out = {}
    for (name, sample_labels), value in scraped(cluster).items():
        found = dict(sample_labels)
        if name == ENDPOINT_CONNECTIONS and found["service"] == "web":
            out[names[found["endpoint"].rsplit(":", 1)[0]]] = value
    return out


def _connect(cluster: Cluster, n: int) -> dict[str, int]:
    """N connections from a1 to web: how many each endpoint served, by its answer."""
    served: dict[str, int] = {}
    for answer in cluster.probe("a1", "tcp", IP, 80, count=n):
        served[answer.split()[0]] = served.get(answer.split()[0], 0) + 1
    return served


def _settled(cluster: Cluster, names: dict[str, str]) -> dict[str, float]:
    """web's endpoint series once two reads 11 s apart (past kpng's read period) agree."""
    last = _endpoint_series(cluster, names)
    while True:
        time.sleep(11)
        now = _endpoint_series(cluster, names)
        if now == last:
            return now
        last = now


def _monotonic(
    cluster: Cluster, names: dict[str, str], floor: dict[str, float]
) -> Callable[[], dict[str, float]]:
    """A read of web's endpoint series that fails the test should one go below ``floor`` or
    below what an earlier read saw."""
    seen = dict(floor)

    def read() -> dict[str, float]:
        now = _endpoint_series(cluster, names)
        for pod, value in seen.items():
            assert now.get(pod, 0) >= value, (pod, now, seen)
        seen.update(now)
        return now

    return read


def _web_on_a2_and_a3(cluster: Cluster, names: dict[str, str]) -> dict[str, float]:
    """Service web written with endpoints a2 and a3, once both are counted and both answer a1:
    each endpoint's count (by pod name) as of a read that saw those probes and the fixture's
    (kpng reads the programs' counts every 10 s)."""
    cluster.write(
        "web",
        service("web", IP, [port("http", 80)]),
        endpoint_slice(cluster, "web", ["a2", "a3"]),
    )
    counted = poll(lambda: len(_endpoint_series(cluster, names)) == 2, within=30, interval=0.5)
    assert counted, _log(cluster)[-3000:]
    assert poll(
        lambda: {a.split()[0] for a in cluster.probe("a1", "tcp", IP, 80, count=4)} == {"a2", "a3"},
        within=30,
        interval=0.5,
    )
    return _settled(cluster, names)


def _log(cluster: Cluster) -> str:
    return (cluster.logs / "node-1.log").read_text()


def _empty_slots(cluster: Cluster) -> None:
    pin_dir = cluster.bed.nodes["node-1"].pin_dir
    assert pin_dir is not None
    path = str(pin_dir / f"maps-v{LAYOUT_VERSION}" / "kpng_slots")
    done = subprocess.run(
        ["bpftool", "-j", "map", "dump", "pinned", path], capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout)
    assert found, "kpng_slots holds nothing to delete"
    for entry in found:
        key = [b.removeprefix("0x") for b in entry["key"]]
        subprocess.run(["bpftool", "map", "delete", "pinned", path, "key", "hex", *key], check=True)


@kernel
def test_connections_behind_kpng_local_are_counted_per_service_and_endpoint(
    tmp_path: Path,
) -> None:
    """A ``kpng local`` agent (``to-ebpf --traffic-counters endpoint``) fed by a brain on a unix
    socket: N connections to web, on a2 and a3, reach its kpng_service_connections_total as N
    and kpng_endpoint_connections_total as the servers answered them; those to empty (no
    endpoint) are refused and counted so. to-nft's and to-iptables' agents:
    tests/kernel/test_traffic_split.py."""
    flags = "--traffic-counters endpoint --sync-period 1s"
    with metered_cluster(tmp_path, flags, pods=("a1", "a2", "a3"), local=True) as cluster:
        bed = cluster.bed
        names = {bed.pod(name).ip4: name for name in ("a2", "a3")}
        start = _web_on_a2_and_a3(cluster, names)
        before = _series(cluster)
        n, refusals = 30, 4
        served = _connect(cluster, n)
        assert sum(served.values()) == n
        assert cluster.probe("a1", "tcp", EMPTY_IP, 80, count=refusals) == ["refused"] * refusals
        wanted = {p: start.get(p, 0) + served.get(p, 0) for p in ("a2", "a3")}
        expected = {(CONNECTIONS, "web"): n, (REJECTED, "web"): 0}
        seen: tuple[dict[tuple[str, str], float], dict[str, float]] = ({}, {})

        def counted() -> bool:
            nonlocal seen
            after = _series(cluster)
            grown = {k: after.get(k, 0) - before.get(k, 0) for k in [*expected, *_EMPTY]}
            seen = (grown, _endpoint_series(cluster, names))
            return (
                all(grown[k] == v for k, v in expected.items())
                and _refused(grown, refusals)
                and seen[1] == wanted
            )

        assert poll(counted, within=30, interval=1), (seen, wanted, served)
