"""nfnetlink_acct's messages, encoded and parsed (pure), against the bytes the kernel uses."""

from __future__ import annotations

import errno
import struct

import pytest

from kpng.backends._netlink import NLMSG_ERROR, attr
from kpng.backends._nfacct import (
    INVALID_DROPPED,
    NFACCT_NAME,
    NFACCT_PKTS,
    Answer,
    parse,
    request,
)


def _message(kind: int, body: bytes, flags: int = 0) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, flags, 1, 0) + body


def _object(name: str, packets: int) -> bytes:
    body = struct.pack("=BBH", 0, 0, 0) + attr(NFACCT_NAME, name.encode() + b"\0")
    body += attr(NFACCT_PKTS, struct.pack(">Q", packets)) + attr(3, struct.pack(">Q", 40 * packets))
    return _message(7 << 8, body)


def _ack(error: int = 0) -> bytes:
    return _message(NLMSG_ERROR, struct.pack("=i", -error) + bytes(16))


def test_a_get_and_a_new_name_the_object_in_the_acct_subsystem() -> None:
    get = request(1, INVALID_DROPPED)
    length, kind, flags = struct.unpack_from("=IHH", get)
    assert (length, kind, flags) == (len(get), 0x0701, 0x1 | 0x4)
    assert get[16:20] == bytes(4)  # nfgenmsg: AF_UNSPEC, version 0, res_id 0
    assert get[20:] == attr(NFACCT_NAME, b"ct_state_invalid_dropped_pkts\0")
    new = request(0, INVALID_DROPPED, create=True)
    assert struct.unpack_from("=HH", new, 4) == (0x0700, 0x1 | 0x4 | 0x400)


@pytest.mark.parametrize("name", ["", "x" * 32])
def test_a_name_the_kernel_cannot_hold_is_refused_before_it_is_sent(name: str) -> None:
    with pytest.raises(ValueError, match="1 to 31 bytes"):
        request(1, name)


@pytest.mark.parametrize(
    ("reply", "answer"),
    [
        (_object(INVALID_DROPPED, 3) + _ack(), Answer(0, 3)),
        (_object(INVALID_DROPPED, 2**40), Answer(0, 2**40)),
        (_ack(errno.ENOENT), Answer(errno.ENOENT, None)),
        (_ack(), Answer(0, None)),  # a NEW's acknowledgement
        (_ack(errno.EOPNOTSUPP), Answer(errno.EOPNOTSUPP, None)),  # no nfnetlink_acct
        (_object(INVALID_DROPPED, 3)[:-8], Answer(0, 3)),  # the byte count cut off
        (b"\0" * 7, Answer(0, None)),
    ],
    ids=["object", "big", "enoent", "ack", "unsupported", "short", "garbage"],
)
def test_the_kernels_answer_is_read_as_an_errno_and_a_packet_count(
    reply: bytes, answer: Answer
) -> None:
    assert parse(reply) == answer
