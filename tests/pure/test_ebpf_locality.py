"""Which network namespaces to-ebpf balances at connect under local traffic detection, as plain
data (``locality``, ``rtnetlink``'s parsers), then what rtnetlink and the namespace cookie say of
a namespace in the kernel. The kernel tests of the programs' side are in test_ebpf_kernel.py,
the masquerade itself in the conformance suite."""

from __future__ import annotations

import socket
import struct

import pytest

from kpng.backends import _rtnetlink as rtnetlink
from kpng.backends._node import Options
from kpng.backends._rtnetlink import Address, Link, NetlinkError
from kpng.backends.ebpf.locality import (
    V4,
    V6,
    Namespace,
    arrives_on,
    checked,
    local,
)

CIDRS = Options(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))
V4_ONLY = Options(cluster_cidrs=("10.244.0.0/16",))
PREFIX = Options(pod_interface="vp*")
BRIDGE = Options(pod_interface="cbr0")
POD = Namespace(addresses=("10.244.1.5", "fd00:244:1::5"), arrives_on=("vp5",))
BRIDGED = Namespace(addresses=("10.244.1.6",), arrives_on=("cbr0",))
ELSEWHERE = Namespace(addresses=("192.0.2.9", "2001:db8::9"), arrives_on=("xx1",))


@pytest.mark.parametrize(
    ("options", "families"),
    [
        (Options(), 0),
        (CIDRS, V4 | V6),
        (V4_ONLY, V4),
        (Options(cluster_cidrs=("fd00:244::/32",)), V6),
        (PREFIX, V4 | V6),
        (BRIDGE, V4 | V6),
    ],
)
def test_detection_applies_to_the_families_it_is_set_for(options: Options, families: int) -> None:
    assert checked(options) == families


@pytest.mark.parametrize(
    ("options", "namespace", "families"),
    [
        (CIDRS, POD, V4 | V6),
        (CIDRS, ELSEWHERE, 0),
        # Only its IPv6 address is a pod's: local for IPv6 alone.
        (CIDRS, Namespace(addresses=("192.0.2.9", "fd00:244:1::9")), V6),
        # Detection is not set for IPv6: every namespace is local for it.
        (V4_ONLY, ELSEWHERE, V6),
        # Both inside and outside; no IPv6 address at all.
        (CIDRS, Namespace(addresses=("10.244.1.5", "192.0.2.9")), V4 | V6),
        (PREFIX, POD, V4 | V6),
        (PREFIX, ELSEWHERE, 0),
        (PREFIX, BRIDGED, 0),
        (BRIDGE, BRIDGED, V4 | V6),
        (BRIDGE, POD, 0),
        # "cbr0" is a name, not a prefix.
        (BRIDGE, Namespace(arrives_on=("cbr01",)), 0),
        (Options(), ELSEWHERE, V4 | V6),
    ],
)
def test_a_namespace_is_local_as_detection_would_see_its_traffic(
    options: Options, namespace: Namespace, families: int
) -> None:
    assert local(options, namespace) == families


def test_traffic_arrives_on_the_other_end_of_a_veth_or_on_its_bridge() -> None:
    pod = [
        Link(1, "lo"),
        Link(2, "eth0", "veth", peer=7, peer_elsewhere=True),
        Link(3, "net1", "veth", peer=8, peer_elsewhere=True),
        # A veth pair inside the namespace, a macvlan: not how its traffic reaches the node.
        Link(4, "inner", "veth", peer=5),
        Link(6, "mv0", "macvlan", peer=2, peer_elsewhere=True),
    ]
    node = [
        Link(2, "eth0"),
        Link(7, "vp5", "veth", peer=2, peer_elsewhere=True),
        Link(8, "vb6", "veth", peer=3, peer_elsewhere=True, master=9),
        Link(9, "cbr0", "bridge"),
    ]
    assert arrives_on(pod, node) == ("cbr0", "vp5")
    # The other end is not the node's (index 7 is something else here).
    assert arrives_on(pod[:2], [Link(7, "eth1")]) == ()


def _attr(kind: int, value: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(value), kind) + value
    return raw + b"\0" * (-len(raw) % 4)


def _message(kind: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 2, 1, 0) + body


def test_links_are_parsed_with_their_kind_peer_and_master() -> None:
    info = _attr(rtnetlink.IFLA_INFO_KIND, b"veth\0")
    body = struct.pack("=BxHiII", 0, 1, 7, 0, 0) + b"".join(
        [
            _attr(rtnetlink.IFLA_IFNAME, b"vp5\0"),
            _attr(rtnetlink.IFLA_LINK, struct.pack("=i", 2)),
            _attr(rtnetlink.IFLA_MASTER, struct.pack("=I", 9)),
            _attr(rtnetlink.IFLA_LINK_NETNSID, struct.pack("=i", 0)),
            _attr(rtnetlink.IFLA_LINKINFO | 0x8000, info),  # flagged nested
            _attr(99, b"unknown attributes are skipped"),
        ]
    )
    lo = struct.pack("=BxHiII", 0, 772, 1, 0, 0) + _attr(rtnetlink.IFLA_IFNAME, b"lo\0")
    data = _message(rtnetlink.RTM_NEWLINK, body) + _message(rtnetlink.RTM_NEWLINK, lo)
    assert rtnetlink.parse_links(data + _message(rtnetlink.NLMSG_DONE, b"\0" * 4)) == [
        Link(7, "vp5", "veth", peer=2, peer_elsewhere=True, master=9),
        Link(1, "lo"),
    ]


def test_addresses_are_the_interfaces_own_not_a_point_to_point_peers() -> None:
    def address(family: int, scope: int, index: int, *attrs: bytes) -> bytes:
        return _message(
            rtnetlink.RTM_NEWADDR,
            struct.pack("=BBBBI", family, 32, 0, scope, index) + b"".join(attrs),
        )

    data = address(
        socket.AF_INET, 0, 2,
        _attr(rtnetlink.IFA_ADDRESS, socket.inet_aton("10.0.0.1")),
        _attr(rtnetlink.IFA_LOCAL, socket.inet_aton("10.244.1.5")),
    ) + address(
        socket.AF_INET6, 253, 2,
        _attr(rtnetlink.IFA_ADDRESS, socket.inet_pton(socket.AF_INET6, "fe80::1")),
    )  # fmt: skip
    assert rtnetlink.parse_addresses(data) == [
        Address(2, "10.244.1.5", 0),
        Address(2, "fe80::1", 253),
    ]
    assert [a.is_global for a in rtnetlink.parse_addresses(data)] == [True, False]


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("=IHHII", 64, rtnetlink.RTM_NEWLINK, 0, 0, 0),  # longer than what came
        _message(rtnetlink.RTM_NEWLINK, struct.pack("=BxHiII", 0, 1, 7, 0, 0) + b"\x40\0\3\0"),
        _message(rtnetlink.RTM_NEWLINK, b"\0" * 8),  # shorter than ifinfomsg
    ],
)
def test_a_truncated_answer_is_a_netlink_error(data: bytes) -> None:
    with pytest.raises(NetlinkError):
        rtnetlink.parse_links(data)
