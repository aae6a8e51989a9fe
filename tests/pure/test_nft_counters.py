"""to-nft's per-Service and per-endpoint traffic counters (``--traffic-counters service`` and
``endpoint``): the layout with and without them, what the drift check makes of them, their
reading, and the kernel's counts."""

from __future__ import annotations

import asyncio
import functools
import struct

import pytest

from kpng.backends._netlink import attr, nested
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.counting import (
    CONNECTIONS,
    DROPPED,
    ENDPOINT_CONNECTIONS,
    ENDPOINTS_DROPPED,
    REJECTED,
    SERIES_LIMIT,
    SERVICE_PORTS,
    TrafficCounters,
)
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import Options
from kpng.backends._nftables.netlink import dispatch_key, element_counters
from kpng.backends._traffic import ENDPOINTS
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.testing import states
from kpng.testing.states import keyed_state

_service = functools.partial(states.service, port_name="p", target_port=0)
_ep = functools.partial(states.endpoint, port_name="p")
WEB: ServiceKey = ("ns", "web")
EMPTY: ServiceKey = ("ns", "empty")
OTHER: ServiceKey = ("ns", "other")


def _values(samples: list[object], name: str) -> dict[str, float]:
    return {
        dict(s.labels)["service"]: s.value  # type: ignore[attr-defined]
        for s in samples
        if s.name == name  # type: ignore[attr-defined]
    }


# --- the layout


class _Sink:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def _dry_run(options: Options, *, affinity: int = 0, endpoints: int = 1) -> str:
    sink = _Sink()
    backend = NftBackend(nft=FakeNft(), options=options, dry_run=True, output=sink)  # type: ignore[arg-type]
    web = _service("web", index=1, node_port=30080, external_ips=("192.0.2.1",), affinity=affinity)
    eps = tuple(_ep(f"10.244.1.{2 + i}") for i in range(endpoints))
    services = {WEB: ServiceEndpoints(web, eps)}
    asyncio.run(backend.apply(keyed_state(1, services)))
    return sink.text


def test_the_counted_maps_and_the_cluster_mark_change_only_with_the_flag() -> None:
    cidrs = ("10.244.0.0/16",)
    off = _dry_run(Options(cluster_cidrs=cidrs)).splitlines()
    on = _dry_run(Options(cluster_cidrs=cidrs, traffic_counters=True)).splitlines()
    changed = sorted(set(on) - set(off))
    assert changed == [
        "add map inet kpng cluster-v4 { type ipv4_addr . inet_proto . inet_service : verdict ; "
        "counter ; }",
        "add map inet kpng cluster-v6 { type ipv6_addr . inet_proto . inet_service : verdict ; "
        "counter ; }",
        "add map inet kpng external-v4 { type ipv4_addr . inet_proto . inet_service : verdict ; "
        "counter ; }",
        "add map inet kpng external-v6 { type ipv6_addr . inet_proto . inet_service : verdict ; "
        "counter ; }",
        "add map inet kpng nodeport-v4 { type inet_proto . inet_service : verdict ; counter ; }",
        "add map inet kpng nodeport-v6 { type inet_proto . inet_service : verdict ; counter ; }",
        # The mark no longer looks the counted map up (that would count the connection twice).
        "add rule inet kpng services ip saddr != @cluster-cidrs-v4 ip daddr @cluster-ips-v4 "
        "meta mark set meta mark | 0x4000",
    ]
    assert len(on) == len(off)
    assert not any("counter" in line for line in off)


def test_the_endpoint_level_counts_the_counted_kinds_endpoint_maps_alone() -> None:
    cidrs = ("10.244.0.0/16",)
    service = _dry_run(Options(cluster_cidrs=cidrs, traffic_counters=True)).splitlines()
    endpoint = _dry_run(
        Options(cluster_cidrs=cidrs, traffic_counters=True, endpoint_counters=True)
    ).splitlines()
    assert sorted(set(endpoint) - set(service)) == [
        "add map inet kpng cluster-eps-v4-0 { type ipv4_addr . inet_proto . inet_service : "
        "ipv4_addr . inet_service ; counter ; }",
        "add map inet kpng external-eps-v4-0 { type ipv4_addr . inet_proto . inet_service : "
        "ipv4_addr . inet_service ; counter ; }",
        "add map inet kpng nodeport-eps-v4-0 { type inet_proto . inet_service : "
        "ipv4_addr . inet_service ; counter ; }",
    ]
    assert len(endpoint) == len(service)


def test_the_endpoint_level_sends_client_ip_affinity_through_the_counted_endpoint_maps() -> None:
    """Counted, a sticky service port has an affinity chain per counted kind, each DNAT through
    that kind's endpoint map (whose element counts it); the service level keeps one chain,
    literal DNATs."""
    cidrs = ("10.244.0.0/16",)

    def dnats(options: Options) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for line in _dry_run(options, affinity=60, endpoints=2).splitlines():
            if line.startswith("add rule inet kpng affinity-"):
                chain = line.split()[4].split("-", 2)[2]
                out.setdefault(chain, []).append(line.split(" dnat ", 1)[1])
        return {chain: sorted(lines) for chain, lines in out.items()}

    assert dnats(Options(cluster_cidrs=cidrs, traffic_counters=True)) == {
        "v4-internal": ["ip to 10.244.1.2:8080"] * 2 + ["ip to 10.244.1.3:8080"] * 2,
    }
    endpoint = Options(cluster_cidrs=cidrs, traffic_counters=True, endpoint_counters=True)
    tuple_ = "ip daddr . meta l4proto . th dport"
    assert dnats(endpoint) == {
        f"v4-by-{kind}": [
            f"ip addr . port to {lookup} map @{kind}-eps-v4-{i}" for i in (0, 0, 1, 1)
        ]
        for kind, lookup in (
            ("cluster", tuple_),
            ("external", tuple_),
            ("nodeport", "meta l4proto . th dport"),
        )
    }


# --- reading


def test_a_restarted_or_rewritten_counter_never_lowers_the_total() -> None:
    traffic = TrafficCounters()
    web, empty = (
        ("cluster-v4", ("10.96.0.1", "tcp", "80")),
        ("cluster-v4", ("10.96.0.2", "tcp", "80")),
    )
    nodeport = ("nodeport-v4", ("tcp", "30080"))
    comments = {web: "ns/web:p", nodeport: "ns/web:p", empty: "ns/empty"}
    applied = {
        web: ("goto pick-cluster-v4-1",),
        nodeport: ("goto x",),
        empty: ("goto service-reject",),
    }

    def totals() -> tuple[dict[str, float], dict[str, float]]:
        samples = traffic.samples()
        return _values(samples, CONNECTIONS), _values(samples, REJECTED)  # type: ignore[arg-type]

    traffic.fold_elements(
        [(web, 5), (nodeport, 2), (empty, 3)], applied, comments, traffic.take_rewritten()
    )
    assert totals() == ({"web": 7, "empty": 3}, {"web": 0, "empty": 3})
    # Rewritten with a new endpoint count: it restarts, and has counted 6 since.
    traffic.replaced([web])
    applied[web] = ("goto pick-cluster-v4-2",)
    traffic.fold_elements(
        [(web, 6), (nodeport, 2), (empty, 3)], applied, comments, traffic.take_rewritten()
    )
    assert totals()[0] == {"web": 13, "empty": 3}
    # Found lower than last read (rewritten by another program, say).
    traffic.fold_elements(
        [(web, 1), (nodeport, 2), (empty, 3)], applied, comments, traffic.take_rewritten()
    )
    assert totals()[0] == {"web": 14, "empty": 3}
    # The empty service gets endpoints: what it refused stays refused.
    traffic.replaced([empty])
    applied[empty] = ("goto pick-cluster-v4-1",)
    traffic.fold_elements(
        [(web, 1), (nodeport, 2), (empty, 4)], applied, comments, traffic.take_rewritten()
    )
    assert totals() == ({"web": 14, "empty": 7}, {"web": 0, "empty": 3})
    # A full sync: every counter restarts.
    traffic.replaced(None)
    traffic.fold_elements(
        [(web, 0), (nodeport, 0), (empty, 0)], applied, comments, traffic.take_rewritten()
    )
    assert totals() == ({"web": 14, "empty": 7}, {"web": 0, "empty": 3})
    # A node port that goes keeps its count in the service port's total.
    traffic.fold_elements([(web, 0), (empty, 0)], applied, comments, traffic.take_rewritten())
    assert totals()[0] == {"web": 14, "empty": 7}
    # A service that goes takes its series along.
    traffic.fold_elements([(web, 0)], applied, comments, traffic.take_rewritten())
    assert totals()[0] == {"web": 14}


def test_past_the_limit_the_service_ports_with_the_least_traffic_are_left_out() -> None:
    traffic = TrafficCounters(series_limit=2)
    keys = {f"s{i}": ("cluster-v4", (f"10.96.0.{i}", "tcp", "80")) for i in range(5)}
    traffic.fold_elements(
        [(ek, int(name[1:]) * 10) for name, ek in keys.items()],
        dict.fromkeys(keys.values(), ("goto pick-cluster-v4-1",)),
        {ek: f"ns/{name}" for name, ek in keys.items()},
        (),
    )
    samples = traffic.samples()
    assert _values(samples, CONNECTIONS) == {"s4": 40, "s3": 30}  # type: ignore[arg-type]
    assert [s.value for s in samples if s.name == DROPPED] == [3]


def test_endpoint_counts_follow_their_endpoint_across_moves_rewrites_and_restarts() -> None:
    traffic = TrafficCounters(endpoints=True)
    key = ("10.96.0.1", "tcp", "80")
    np_key = ("tcp", "30080")
    web, np = ("cluster-v4", key), ("nodeport-v4", np_key)
    e0, e1 = ("cluster-eps-v4-0", key), ("cluster-eps-v4-1", key)
    n0 = ("nodeport-eps-v4-0", np_key)
    dispatched_by = {
        "cluster-eps-v4-0": "cluster-v4",
        "cluster-eps-v4-1": "cluster-v4",
        "nodeport-eps-v4-0": "nodeport-v4",
    }
    comments = {web: "ns/web:p", np: "ns/web:p"}
    applied = {
        web: ("goto pick-cluster-v4-2",),
        np: ("goto pick-nodeport-v4-1",),
        e0: ("10.244.1.2", "8080"),
        e1: ("10.244.2.2", "8080"),
        n0: ("fd00::2", "8080"),
    }

    def fold(counts: list[tuple[tuple[str, tuple[str, ...]], int]]) -> dict[str, float]:
        traffic.fold_elements(counts, applied, comments, traffic.take_rewritten(), dispatched_by)
        return {
            dict(s.labels)["endpoint"]: s.value
            for s in traffic.samples()
            if s.name == ENDPOINT_CONNECTIONS
        }

    a, b, c = "10.244.1.2:8080", "10.244.2.2:8080", "[fd00::2]:8080"
    assert fold([(web, 9), (np, 1), (e0, 4), (e1, 5), (n0, 1)]) == {a: 4, b: 5, c: 1}
    # Another endpoint goes before a: a moves to index 1 (its element written again), b to 0.
    traffic.replaced([e0, e1])
    applied[e0], applied[e1] = applied[e1], applied[e0]
    assert fold([(web, 9), (np, 1), (e0, 2), (e1, 3), (n0, 1)]) == {a: 7, b: 7, c: 1}
    # Found lower than last read, and then a full sync: nothing lowers.
    assert fold([(web, 9), (np, 1), (e0, 0), (e1, 3), (n0, 1)]) == {a: 7, b: 7, c: 1}
    traffic.replaced(None)
    assert fold([(web, 0), (np, 0), (e0, 0), (e1, 0), (n0, 0)]) == {a: 7, b: 7, c: 1}
    # The node port goes: its endpoint's series with it; the service port's count stays.
    assert fold([(web, 1), (e0, 1), (e1, 0)]) == {a: 7, b: 8}
    assert _values(traffic.samples(), CONNECTIONS) == {"web": 11}  # type: ignore[arg-type]


def test_the_series_limit_bounds_the_endpoints_on_their_own() -> None:
    traffic = TrafficCounters(series_limit=2, endpoints=True)
    key: tuple[str, ...] = ("10.96.0.1", "tcp", "80")
    counts = [(("cluster-v4", key), 60)]
    applied: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {("cluster-v4", key): ("x",)}
    dispatched_by = {}
    for i in range(3):
        ek = (f"cluster-eps-v4-{i}", key)
        dispatched_by[ek[0]] = "cluster-v4"
        applied[ek] = (f"10.244.1.{i}", "80")
        counts.append((ek, 10 * (i + 1)))
    traffic.fold_elements(counts, applied, {("cluster-v4", key): "ns/web:p"}, (), dispatched_by)
    samples = traffic.samples()
    assert [dict(s.labels)["endpoint"] for s in samples if s.name == ENDPOINT_CONNECTIONS] == [
        "10.244.1.1:80",
        "10.244.1.2:80",
    ]
    assert [s.value for s in samples if s.name in (DROPPED, ENDPOINTS_DROPPED)] == [0, 1]
    assert not any(s.name == ENDPOINT_CONNECTIONS for s in TrafficCounters().samples())


def test_kernel_element_bytes_are_read_back_as_kpngs_keys() -> None:
    assert dispatch_key(bytes([10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0]), "v4", port_only=False) == (
        "10.96.0.1",
        "tcp",
        "80",
    )
    assert dispatch_key(bytes([17, 0, 0, 0, 0x75, 0x30, 0, 0]), "v6", port_only=True) == (
        "udp",
        "30000",
    )
    assert dispatch_key(bytes([99, 0, 0, 0, 0, 80, 0, 0]), "v4", port_only=True) is None


def test_the_series_limit_holds_at_100k_service_ports_and_their_endpoints() -> None:
    """100,000 service ports and their endpoints, read as to-nft reads them: the default limit
    exposes the 10,000 busiest service ports and the 10,000 busiest endpoints, and the gauges
    count the rest as dropped."""
    n = 100_000
    traffic = TrafficCounters(endpoints=True)
    applied: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}
    comments: dict[tuple[str, tuple[str, ...]], str] = {}
    counts = []
    for i in range(n):
        key = (f"10.{96 + i // 65536}.{i // 256 % 256}.{i % 256}", "tcp", "80")
        dispatch = ("cluster-v4", key)
        comments[dispatch] = f"ns/s{i}:p"
        applied[dispatch] = ("goto pick-cluster-v4-1",)
        endpoint = ("cluster-eps-v4-0", key)
        applied[endpoint] = (f"10.{244 + i // 65536}.{i // 256 % 256}.{i % 256}", "8080")
        # Service port i took i + 1 connections, all to its endpoint.
        counts += [(dispatch, i + 1), (endpoint, i + 1)]
    dispatched_by = {"cluster-eps-v4-0": "cluster-v4"}

    traffic.fold_elements(counts, applied, comments, None, dispatched_by)
    series: dict[str, list[float]] = {}
    gauges = {}
    for s in traffic.samples():
        if s.counter:
            series.setdefault(s.name, []).append(s.value)
        else:
            gauges[s.name] = s.value
    limit = SERIES_LIMIT
    # Each value belongs to one service port (or endpoint): the busiest are those kept.
    assert sorted(series[CONNECTIONS]) == [i + 1 for i in range(n - limit, n)]
    assert series[REJECTED] == [0] * limit
    assert sorted(series[ENDPOINT_CONNECTIONS]) == [i + 1 for i in range(n - limit, n)]
    assert gauges == {
        SERVICE_PORTS: n,
        DROPPED: n - limit,
        ENDPOINTS: n,
        ENDPOINTS_DROPPED: n - limit,
    }


# --- the counters' decoding: a dump's message bytes in, each counted element's key and packets out


def _counter(packets: int, *, flags: int = 0) -> bytes:
    """A counter expression as the kernel writes it (``flags`` on its data: another layout)."""
    data = attr(1, (packets * 64).to_bytes(8, "big")) + attr(2, packets.to_bytes(8, "big"))
    return attr(1, b"counter\0") + attr(2 | flags, data)


def _element(key: bytes, *attrs: bytes) -> bytes:
    return nested(1, nested(1, attr(1, key)) + b"".join(attrs))


def _message(*elements: bytes) -> bytes:
    body = attr(1, b"kpng\0") + attr(2, b"cluster-v4\0") + nested(3, b"".join(elements))
    return struct.pack("=IHHII", 20 + len(body), 0x0A0C, 2, 1, 0) + bytes(4) + body


KEY = bytes([10, 96, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0])
OTHER_KEY = bytes([10, 96, 0, 2, 6, 0, 0, 0, 0, 80, 0, 0])
VERDICT = attr(2, nested(2, attr(1, (0xFFFFFFFC).to_bytes(4, "big")) + attr(2, b"pick\0")))
NOTE = attr(6, b"\0\x09ns/web:p\0")


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # The kernel's layout: key, verdict, one expression, comment.
        (_message(_element(KEY, VERDICT, attr(7, _counter(5)), NOTE)), [(KEY, 5)]),
        (_message(_element(KEY, attr(7, _counter(2**40 + 3)))), [(KEY, 2**40 + 3)]),
        # Nested flags, the expression list, another expression first: read all the same.
        (_message(_element(KEY, attr(7, _counter(7, flags=0x8000)))), [(KEY, 7)]),
        (
            _message(
                _element(KEY, attr(11, nested(1, attr(1, b"limit\0")) + nested(1, _counter(4))))
            ),
            [(KEY, 4)],
        ),
        # No counter, or another expression alone: not counted.
        (_message(_element(KEY, VERDICT, NOTE)), []),
        (_message(_element(KEY, attr(7, attr(1, b"limit\0") + attr(2, b"")))), []),
        # Several elements, several per message.
        (
            _message(
                _element(KEY, attr(7, _counter(1))), _element(OTHER_KEY, attr(7, _counter(9)))
            ),
            [(KEY, 1), (OTHER_KEY, 9)],
        ),
        # Cut short (a counter's packets, an element, the message): what is whole is read.
        (_message(_element(KEY, attr(7, _counter(5)[:-4]))), []),
        (
            _message(_element(KEY, attr(7, _counter(1))))
            + _message(_element(OTHER_KEY, attr(7, _counter(2))))[:40],
            [(KEY, 1)],
        ),
        (b"", []),
        (bytes(20), []),
    ],
    ids=[
        "kernel-layout",
        "large",
        "nested-flags",
        "expression-list",
        "no-counter",
        "other-expression",
        "two-elements",
        "short-counter",
        "short-message",
        "empty",
        "header-only",
    ],
)
def test_each_counted_elements_key_and_packets_are_read_from_a_dump_message(
    message: bytes, expected: list[tuple[bytes, int]]
) -> None:
    assert element_counters(message) == expected


def test_an_endpoints_connections_follow_its_service_port_when_another_service_takes_the_ip() -> (
    None
):
    # Only the dispatch element is written again (its comment): the endpoint element, the
    # same, now counts for the other service's port.
    traffic = TrafficCounters(endpoints=True)
    key: tuple[str, ...] = ("10.96.0.1", "tcp", "80")
    web, e0 = ("cluster-v4", key), ("cluster-eps-v4-0", key)
    dispatched_by = {"cluster-eps-v4-0": "cluster-v4"}
    comments = {web: "ns/web:p"}
    applied: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {
        web: ("goto pick-cluster-v4-1",),
        e0: ("10.244.1.2", "8080"),
    }

    def fold(counts: list[tuple[tuple[str, tuple[str, ...]], int]]) -> dict[str, float]:
        traffic.fold_elements(counts, applied, comments, traffic.take_rewritten(), dispatched_by)
        return {
            dict(s.labels)["service"]: s.value
            for s in traffic.samples()
            if s.name == ENDPOINT_CONNECTIONS
        }

    assert fold([(web, 4), (e0, 4)]) == {"web": 4}
    assert fold([(web, 5), (e0, 5)]) == {"web": 5}
    traffic.replaced([web])
    comments[web] = "ns/other:p"
    assert fold([(web, 1), (e0, 6)]) == {"other": 6}
    assert fold([(web, 2), (e0, 7)]) == {"other": 7}
    # And the endpoint's own rewrite (another endpoint, starting from zero) is seen as well.
    traffic.replaced([e0])
    applied[e0] = ("10.244.9.9", "8080")
    assert fold([(web, 3), (e0, 1)]) == {"other": 1}
    assert [
        dict(s.labels)["endpoint"] for s in traffic.samples() if s.name == ENDPOINT_CONNECTIONS
    ] == ["10.244.9.9:8080"]
