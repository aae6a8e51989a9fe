"""ctnetlink's messages as ``_ctnetlink`` writes and reads them, over bytes (no kernel)."""

from __future__ import annotations

import socket
import struct

import pytest

from kpng.backends import _ctnetlink as ct
from kpng.backends._ctnetlink import Flow, Wanted
from kpng.backends._netlink import attr, nested, nested_attributes


def _answer(request: bytes, *extra: bytes) -> bytes:
    """A dump's answer made of a NEW request: the kernel writes the tuples the same way, then
    more attributes (``extra``)."""
    body = request[20:] + b"".join(extra)
    return struct.pack("=IHHII", 20 + len(body), ct._NEW, 2, 1, 0) + request[16:20] + body


V4 = _answer(
    ct.new(socket.AF_INET, "10.0.0.1", "10.96.0.10", 40000, 53, "10.244.1.2", 5353),
    attr(ct.CTA_ZONE, struct.pack(">H", 3)),
    attr(ct.CTA_ID, struct.pack(">I", 77)),
)
V4_FLOW = Flow("10.96.0.10", "53", "10.244.1.2", "5353", "10.0.0.1", "40000", 3, 77)
V6 = _answer(ct.new(socket.AF_INET6, "fd00::1", "fd00:96::10", 40001, 53, "fd00:244::2", 5353))
V6_FLOW = Flow("fd00:96::10", "53", "fd00:244::2", "5353", "fd00::1", "40001", 0, None)


def test_a_dump_answer_reads_as_the_flows_of_both_families_with_zone_and_id() -> None:
    assert list(ct.parse(V4 + V6)) == [V4_FLOW, V6_FLOW]


def _reordered(message: bytes) -> bytes:
    """The same message with its top-level attributes in reverse order and its tuples'
    protocol before their addresses: not where ``parse`` looks first."""
    attrs = []
    for kind, payload in nested_attributes(message[20:]):
        if kind in (ct.CTA_TUPLE_ORIG, ct.CTA_TUPLE_REPLY):
            parts = list(nested_attributes(payload))[::-1]
            payload = b"".join(nested(k, p) for k, p in parts)
            attrs.append(nested(kind, payload))
        else:
            attrs.append(attr(kind, payload))
    body = b"".join(attrs[::-1])
    return struct.pack("=IHHII", 20 + len(body), ct._NEW, 2, 1, 0) + message[16:20] + body


@pytest.mark.parametrize("layout", [lambda m: m, _reordered], ids=["kernel", "other"])
@pytest.mark.parametrize(
    ("wanted", "expected"),
    [
        pytest.param(None, [V4_FLOW, V6_FLOW], id="all"),
        pytest.param(Wanted.of([("10.96.0.10", "53")]), [V4_FLOW], id="address"),
        pytest.param(Wanted.of([("fd00:96::10", "53")]), [V6_FLOW], id="v6-address"),
        pytest.param(Wanted.of([("", "53")]), [V4_FLOW, V6_FLOW], id="node-port"),
        pytest.param(Wanted.of([("10.96.0.10", "54"), ("10.96.0.11", "53")]), [], id="others"),
    ],
)
def test_only_flows_to_a_wanted_destination_are_decoded(
    layout: object, wanted: Wanted | None, expected: list[Flow]
) -> None:
    assert callable(layout)
    assert list(ct.parse(layout(V4) + layout(V6), wanted)) == expected


def test_other_protocols_done_errors_and_cut_messages_are_skipped() -> None:
    tcp = bytearray(V4)
    tcp[tcp.index(attr(ct.CTA_PROTO_NUM, b"\x11")) + 4] = 6  # the original tuple's protocol
    done = struct.pack("=IHHII", 20, 3, 2, 1, 0) + b"\0" * 4
    assert list(ct.parse(bytes(tcp) + done + V6 + V4[:60])) == [V6_FLOW]


def test_a_delete_names_the_original_tuple_zone_and_id() -> None:
    request = ct.delete(V4_FLOW)
    length, kind, flags = struct.unpack_from("=IHH", request)
    assert (length, kind, flags) == (len(request), (1 << 8) | 2, 1)
    assert request[16] == socket.AF_INET
    attrs = dict(nested_attributes(request[20:]))
    assert attrs[ct.CTA_ZONE] == struct.pack(">H", 3)
    assert attrs[ct.CTA_ID] == struct.pack(">I", 77)
    orig = dict(nested_attributes(attrs[ct.CTA_TUPLE_ORIG]))
    addresses = dict(nested_attributes(orig[ct.CTA_TUPLE_IP]))
    assert addresses == {1: bytes([10, 0, 0, 1]), 2: bytes([10, 96, 0, 10])}
    ports = dict(nested_attributes(orig[ct.CTA_TUPLE_PROTO]))
    assert ports == {1: b"\x11", 2: struct.pack(">H", 40000), 3: struct.pack(">H", 53)}
    # Zone 0 and no id: neither is sent (an id would have to match).
    assert set(dict(nested_attributes(ct.delete(V6_FLOW)[20:]))) == {ct.CTA_TUPLE_ORIG}


@pytest.mark.parametrize(
    ("destination", "flags", "tuple_ip"),
    [
        pytest.param(None, ct.FILTER_PROTO_NUM, None, id="every-udp-flow"),
        pytest.param(
            ("10.96.0.10", "53"),
            ct.FILTER_PROTO_NUM | ct.FILTER_PROTO_DST_PORT | ct.FILTER_IP_DST,
            {2: bytes([10, 96, 0, 10])},
            id="address",
        ),
        pytest.param(
            ("", "30053"), ct.FILTER_PROTO_NUM | ct.FILTER_PROTO_DST_PORT, None, id="port"
        ),
        pytest.param(
            ("fd00:96::10", "53"),
            ct.FILTER_PROTO_NUM | ct.FILTER_PROTO_DST_PORT,
            None,
            id="v6-address-left-to-kpng",
        ),
    ],
)
def test_a_dump_asks_the_kernel_to_filter(
    destination: tuple[str, str] | None, flags: int, tuple_ip: dict[int, bytes] | None
) -> None:
    """Filtered to UDP, and to one destination if asked: an IPv6 one by its port alone, the
    kernel's address test being inverted (``dump_udp``)."""
    family = socket.AF_INET6 if destination and ":" in destination[0] else socket.AF_INET
    request = ct.dump_udp(family, destination)
    assert struct.unpack_from("=HH", request, 4) == ((1 << 8) | 1, 0x301)  # GET, a dump
    assert request[16] == family
    attrs = dict(nested_attributes(request[20:]))
    filters = dict(nested_attributes(attrs[ct.CTA_FILTER]))
    assert filters == {1: struct.pack("=I", flags), 2: struct.pack("=I", 0)}
    orig = dict(nested_attributes(attrs[ct.CTA_TUPLE_ORIG]))
    assert (dict(nested_attributes(orig[1])) if 1 in orig else None) == tuple_ip
    assert dict(nested_attributes(orig[ct.CTA_TUPLE_PROTO]))[1] == b"\x11"


def test_any_cut_or_corrupted_answer_reads_without_an_error() -> None:
    """The parser trusts no length: a short read or a wrong byte loses flows, never raises."""
    data = V4 + V6
    for cut in range(len(data)):
        list(ct.parse(data[:cut], Wanted.of([("", "53")])))
    for at in range(len(data)):
        for value in (0, 3, 5, 9, 0x14, 0xFF):
            corrupted = data[:at] + bytes((value,)) + data[at + 1 :]
            list(ct.parse(corrupted))
            list(ct.parse(corrupted, Wanted.of([("10.96.0.10", "53")])))
