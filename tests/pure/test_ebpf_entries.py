"""to-ebpf's map entries and the order they are written in, as plain data (no kernel:
tests/kernel/test_ebpf_kernel.py and the conformance suite load them)."""

from __future__ import annotations

import functools
import ipaddress
import struct

import msgspec
import pytest

from kpng.backends._node import Options
from kpng.backends.ebpf import entries
from kpng.backends.ebpf.entries import SocketState, contribute, relayout
from kpng.model.messages import EndpointAddress, EndpointScopes, IPFilter, IPSet, ServiceEndpoints
from kpng.testing import states

_service = functools.partial(states.service, cluster_ip="10.96.0.10", port_name="p")
_ep = functools.partial(states.endpoint, port_name="p")
REMOTE = EndpointScopes(Internal=False, External=False, Cluster=True)
NODE_IP = "10.250.0.1"


def _ip(raw: bytes) -> str:
    ip = ipaddress.ip_address(raw)
    assert isinstance(ip, ipaddress.IPv6Address)
    return str(ip.ipv4_mapped or ip)


def frontends(c: entries.Contribution) -> dict[tuple[str, int, int], tuple[list[str], bool]]:
    """(address, port, protocol): (the endpoints of its set, sticky); set 0 has none."""
    out = {}
    for key, value in c.frontends.items():
        addr, port, proto = struct.unpack("=16s2sBx", key)
        set_id, affinity, _serving, _timeout = struct.unpack("=QQQI4x", value)
        assert set_id in c.sets or (set_id == 0 and value == entries.NO_ENDPOINT)
        eps = [f"{_ip(e[:16])}:{int.from_bytes(e[16:18], 'big')}" for e in c.sets.get(set_id, ())]
        out[(_ip(addr), int.from_bytes(port, "big"), proto)] = (eps, bool(affinity))
    return out


def test_a_cluster_ip_leads_to_its_internal_endpoints() -> None:
    se = ServiceEndpoints(_service(), (_ep("10.244.2.2"), _ep("10.244.1.2")))
    assert frontends(contribute(se, Options())) == {
        ("10.96.0.10", 80, 6): (["10.244.1.2:8080", "10.244.2.2:8080"], False)
    }


CASES = [
    (
        "iTP Local: a ClusterIP has only this node's endpoints",
        _service(),
        (_ep("10.244.1.2", local=True), _ep("10.244.2.2", scopes=REMOTE)),
        Options(),
        {("10.96.0.10", 80, 6): ["10.244.1.2:8080"]},
    ),
    (
        "no endpoint for a kind of traffic: a frontend with none, the nftables part answers",
        _service(),
        (_ep("10.244.2.2", scopes=REMOTE),),
        Options(),
        {("10.96.0.10", 80, 6): []},
    ),
    (
        "eTP Local: a local socket reaching the node port or an external IP is short-circuited",
        _service(node_port=30080, external_ips=("10.251.0.5",), etp_local=True),
        (_ep("10.244.2.2", scopes=REMOTE), _ep("10.244.1.2", local=True)),
        Options(),
        {
            ("10.96.0.10", 80, 6): ["10.244.1.2:8080"],
            ("10.251.0.5", 80, 6): ["10.244.1.2:8080", "10.244.2.2:8080"],
            (NODE_IP, 30080, 6): ["10.244.1.2:8080", "10.244.2.2:8080"],
        },
    ),
    (
        "node ports only on primary IPs inside --nodeport-addresses",
        _service(node_port=30080),
        (_ep("10.244.1.2"),),
        Options(nodeport_addresses=("192.168.0.0/16",)),
        {("10.96.0.10", 80, 6): ["10.244.1.2:8080"]},
    ),
    (
        "--masquerade-all: ClusterIPs are left to the nftables part",
        _service(external_ips=("10.251.0.5",)),
        (_ep("10.244.1.2"),),
        Options(masquerade_all=True),
        {("10.251.0.5", 80, 6): ["10.244.1.2:8080"]},
    ),
    (
        "an LB IP with source ranges is left to the nftables part",
        msgspec.structs.replace(
            _service(external_ips=("10.251.0.5", "10.251.0.6")),
            IPFilters=(IPFilter(TargetIPs=IPSet(V4=("10.251.0.6",)), SourceRanges=("1.0.0.0/8",)),),
        ),
        (_ep("10.244.1.2"),),
        Options(),
        {
            ("10.96.0.10", 80, 6): ["10.244.1.2:8080"],
            ("10.251.0.5", 80, 6): ["10.244.1.2:8080"],
        },
    ),
    (
        "SCTP is left to the nftables part",
        _service(protocol="SCTP"),
        (_ep("10.244.1.2", protocol="SCTP"),),
        Options(),
        {},
    ),
]


@pytest.mark.parametrize(
    ("service", "endpoints", "options", "expected"),
    [pytest.param(s, e, o, x, id=c) for c, s, e, o, x in CASES],
)
def test_frontends_and_their_endpoints(
    service: object, endpoints: tuple[object, ...], options: Options, expected: object
) -> None:
    se = ServiceEndpoints(service, endpoints)  # type: ignore[arg-type]
    got = frontends(contribute(se, options, (NODE_IP,)))
    assert {k: eps for k, (eps, _) in got.items()} == expected


def test_affinity_is_one_memory_per_service_port_across_its_frontends() -> None:
    se = ServiceEndpoints(
        _service(node_port=30080, affinity=60), (_ep("10.244.1.2"), _ep("10.244.2.2"))
    )
    values = contribute(se, Options(), (NODE_IP,)).frontends.values()
    ids = {struct.unpack("=QQQI4x", v)[1:4:2] for v in values}
    assert len(values) == 2
    assert [timeout for _, timeout in ids] == [60]


def test_a_udp_port_keeps_flows_on_endpoints_serving_anywhere() -> None:
    """The set new flows pick from has the ready endpoint; the set a flow may stay on also has
    the terminating one that still serves (states.service lists both as serving)."""
    serving_port = msgspec.structs.replace(
        _service(protocol="UDP").Ports[0],
        ServingEndpoints=(
            EndpointAddress(IP="10.244.1.2", Port=8080),
            EndpointAddress(IP="10.244.2.2", Port=8080),
        ),
    )
    service = msgspec.structs.replace(_service(protocol="UDP"), Ports=(serving_port,))
    se = ServiceEndpoints(service, (_ep("10.244.1.2", protocol="UDP"),))
    c = contribute(se, Options())
    (value,) = c.frontends.values()
    set_id, _, serving, _ = struct.unpack("=QQQI4x", value)
    assert [_ip(e[:16]) for e in c.sets[set_id]] == ["10.244.1.2"]
    assert [_ip(e[:16]) for e in c.sets[serving]] == ["10.244.1.2", "10.244.2.2"]


def test_endpoints_are_counted_in_the_sets_frontends_pick_from_not_the_serving_set() -> None:
    """The programs count an endpoint with the set its frontend points at: those sets alone
    are counted, for their service port; the serving set a UDP flow stays on is not."""
    serving_port = msgspec.structs.replace(
        _service(protocol="UDP").Ports[0],
        ServingEndpoints=(EndpointAddress(IP="10.244.1.2", Port=8080),),
    )
    service = msgspec.structs.replace(_service(protocol="UDP"), Ports=(serving_port,))
    c = contribute(ServiceEndpoints(service, (_ep("10.244.1.2", protocol="UDP"),)), Options())
    (value,) = c.frontends.values()
    set_id, _, serving, _ = struct.unpack("=QQQI4x", value)
    assert c.counted == {set_id: "p"}
    assert serving in c.sets
    state = SocketState()
    state.changes({("ns", "svc"): c})
    assert state.counted == {set_id: (("ns", "svc"), "p")}
    state.changes({("ns", "svc"): None})
    assert state.counted == {}


@pytest.mark.parametrize(
    ("address", "label"),
    [("10.244.1.2", "10.244.1.2:8080"), ("fd00::2", "[fd00::2]:8080")],
)
def test_an_endpoint_key_reads_as_its_set_and_ip_port(address: str, label: str) -> None:
    endpoint = entries.address(address) + (8080).to_bytes(2, "big") + b"\0\0"
    key = entries.endpoint_key(7, endpoint)
    assert len(key) == 32  # struct member_key
    assert entries.split_endpoint_key(key) == (7, endpoint)
    assert entries.describe_endpoint(endpoint) == label


# relayout: (old slots, new endpoints, new slots)
RELAYOUT_CASES = [
    ("a newcomer is appended", "ab", "abc", "abc"),
    ("a newcomer takes a freed slot", "abc", "acd", "adc"),
    ("the last endpoint fills a hole", "abcd", "abd", "abd"),
    ("a middle removal moves the last one there", "abcd", "acd", "adc"),
    ("all go", "ab", "", ""),
    ("from nothing, in the given order", "", "ba", "ba"),
]


@pytest.mark.parametrize(
    ("old", "new", "expected"), [pytest.param(o, n, x, id=c) for c, o, n, x in RELAYOUT_CASES]
)
def test_relayout_keeps_the_endpoints_that_stay_in_their_slots(
    old: str, new: str, expected: str
) -> None:
    got = relayout([c.encode() for c in old], [c.encode() for c in new])
    assert b"".join(got).decode() == expected


def _contribution(
    *eps: str, affinity: int = 60
) -> dict[tuple[str, str], entries.Contribution | None]:
    """A service with ClientIP affinity by default: its set's members are written."""
    se = ServiceEndpoints(_service(affinity=affinity), tuple(_ep(e) for e in eps))
    return {("ns", "web"): contribute(se, Options())}


def _written(changes: entries.MapChanges) -> dict[str, int]:
    return {name: len(e) for name, e in changes.updates}


def test_members_are_written_only_for_sets_a_remembered_endpoint_is_checked_against() -> None:
    """Without affinity a TCP set has no members; turning affinity on writes them all, and
    off deletes them, with the slots left alone."""
    state = SocketState()
    plain = state.full(_contribution("10.244.1.2", "10.244.1.3", affinity=0), {})
    assert _written(plain) == {"kpng_slots": 2, "kpng_sets": 1, "kpng_frontends": 1}
    sticky = state.changes(_contribution("10.244.1.2", "10.244.1.3"))
    assert _written(sticky) == {"kpng_members": 2, "kpng_frontends": 1}
    assert sticky.deletes == []
    off = state.changes(_contribution("10.244.1.2", "10.244.1.3", affinity=0))
    assert _written(off) == {"kpng_frontends": 1}
    assert [(name, len(k)) for name, k in off.deletes] == [("kpng_members", 2)]


def test_a_udp_port_checks_flows_against_its_serving_set() -> None:
    se = ServiceEndpoints(_service(protocol="UDP"), (_ep("10.244.1.2", protocol="UDP"),))
    c = contribute(se, Options())
    (value,) = c.frontends.values()
    set_id, _, serving, _ = struct.unpack("=QQQI4x", value)
    assert serving != set_id
    assert c.checked == {serving}


def test_one_endpoint_added_writes_its_slot_member_and_the_count() -> None:
    state = SocketState()
    state.full(_contribution("10.244.1.2", "10.244.1.3"), {})
    changes = state.changes(_contribution("10.244.1.2", "10.244.1.3", "10.244.1.4"))
    assert [(name, len(e)) for name, e in changes.updates] == [
        ("kpng_members", 1),
        ("kpng_slots", 1),
        ("kpng_sets", 1),
    ]
    assert changes.deletes == []
    assert not changes.full


def test_one_endpoint_removed_moves_the_last_into_its_slot_then_deletes() -> None:
    state = SocketState()
    state.full(_contribution("10.244.1.2", "10.244.1.3", "10.244.1.4"), {})
    changes = state.changes(_contribution("10.244.1.3", "10.244.1.4"))
    assert [(name, len(e)) for name, e in changes.updates] == [
        ("kpng_slots", 1),
        ("kpng_sets", 1),
    ]
    assert [(name, len(k)) for name, k in changes.deletes] == [
        ("kpng_slots", 1),
        ("kpng_members", 1),
    ]
    assert len(changes) == 4


def test_a_service_that_goes_deletes_its_frontend_before_its_set() -> None:
    state = SocketState()
    state.full(_contribution("10.244.1.2"), {})
    changes = state.changes({("ns", "web"): None})
    assert changes.updates == []
    assert [name for name, _ in changes.deletes] == [
        "kpng_frontends",
        "kpng_sets",
        "kpng_slots",
        "kpng_members",
    ]


def test_an_unchanged_service_sent_again_changes_nothing() -> None:
    state = SocketState()
    state.full(_contribution("10.244.1.2", "10.244.1.3"), {})
    assert len(state.changes(_contribution("10.244.1.3", "10.244.1.2"))) == 0


def test_a_full_sync_writes_everything_and_deletes_what_no_service_wants() -> None:
    state = SocketState()
    wanted = state.full(_contribution("10.244.1.2"), {})
    written = {name: {k for k, _ in e} for name, e in wanted.updates}
    stale = b"\x01" * entries.KEY_SIZES["kpng_frontends"]
    present = {
        name: [*keys, stale] if name == "kpng_frontends" else [*keys]
        for name, keys in written.items()
    }
    again = SocketState().full(_contribution("10.244.1.2"), present)
    assert [name for name, _ in again.updates] == [
        "kpng_members",
        "kpng_slots",
        "kpng_sets",
        "kpng_frontends",
    ]
    assert again.deletes == [("kpng_frontends", [stale])]
    assert again.full


def test_two_services_sharing_a_frontend_the_first_wins_and_the_other_stays_after_it() -> None:
    """Two services claim one external IP and port, as to-nft resolves it: the first
    service's value is written and reported as a conflict; deleting it hands the frontend to
    the other; deleting the other too removes it."""

    def claim(name: str, cluster_ip: str, ep: str) -> entries.Contribution:
        svc = _service(cluster_ip=cluster_ip, external_ips=("10.251.0.5",))
        svc = msgspec.structs.replace(svc, Name=name)
        return contribute(ServiceEndpoints(svc, (_ep(ep),)), Options())

    a, b = claim("a", "10.96.0.10", "10.244.1.2"), claim("b", "10.96.0.11", "10.244.2.2")
    shared = next(k for k in a.frontends if entries.describe_frontend(k) == "10.251.0.5:80/TCP")
    state = SocketState()
    both = state.full({("ns", "b"): b, ("ns", "a"): a}, {})
    assert state.frontends[shared] == a.frontends[shared]
    assert both.conflicts == [(shared, [("ns", "a"), ("ns", "b")])]

    without_a = state.changes({("ns", "a"): None})
    assert state.frontends[shared] == b.frontends[shared]
    assert [(name, [k for k, _ in e]) for name, e in without_a.updates][-1] == (
        "kpng_frontends",
        [shared],
    )
    assert without_a.conflicts == []

    state.changes({("ns", "b"): None})
    assert state.frontends == {}


def test_a_shared_frontend_whose_first_service_has_no_endpoint_is_left_to_nftables() -> None:
    """As to-nft resolves it, the first service wins even without endpoints: the frontend says
    so (set 0), and the nftables part, which gives that service's answer, handles it."""
    svc = msgspec.structs.replace(_service(external_ips=("10.251.0.5",)), Name="a")
    a = contribute(ServiceEndpoints(svc, ()), Options())
    svc = msgspec.structs.replace(
        _service(cluster_ip="10.96.0.11", external_ips=("10.251.0.5",)), Name="b"
    )
    b = contribute(ServiceEndpoints(svc, (_ep("10.244.2.2"),)), Options())
    shared = next(k for k in a.frontends if entries.describe_frontend(k) == "10.251.0.5:80/TCP")
    state = SocketState()
    both = state.full({("ns", "a"): a, ("ns", "b"): b}, {})
    assert state.frontends[shared] == entries.NO_ENDPOINT
    assert both.conflicts == [(shared, [("ns", "a"), ("ns", "b")])]


def test_frontends_read_as_address_port_and_protocol() -> None:
    key6 = entries._FRONTEND_KEY.pack(entries.address("fd00::a"), (53).to_bytes(2, "big"), 17)
    assert entries.describe_frontend(key6) == "[fd00::a]:53/UDP"


def test_a_service_losing_its_endpoints_keeps_its_frontend_pointing_at_none() -> None:
    """The frontend turns to set 0 before its set goes (updates before deletes): a reader never
    follows it to a missing set, and the programs count what finds no endpoint."""
    state = SocketState()
    state.full(_contribution("10.244.1.2"), {})
    changes = state.changes(_contribution())
    assert [(name, [v for _, v in e]) for name, e in changes.updates] == [
        ("kpng_frontends", [entries.NO_ENDPOINT])
    ]
    assert [name for name, _ in changes.deletes] == ["kpng_sets", "kpng_slots", "kpng_members"]
    assert state.entries() == {
        "kpng_frontends": 1,
        "kpng_sets": 0,
        "kpng_slots": 0,
        "kpng_members": 0,
    }


def test_entries_count_what_was_written_in_each_map() -> None:
    state = SocketState()
    changes = state.full(_contribution("10.244.1.2", "10.244.1.3"), {})
    assert state.entries() == {name: len(e) for name, e in changes.updates}
    state.changes(_contribution("10.244.1.2", "10.244.1.3", affinity=0))
    assert state.entries() == {
        "kpng_frontends": 1,
        "kpng_sets": 1,
        "kpng_slots": 2,
        "kpng_members": 0,
    }
