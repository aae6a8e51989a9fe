"""The rig's reading of ``ss -ti``: each established connection's bytes, from tcp_info."""

from __future__ import annotations

import pytest

from rig.tcpinfo import Connection, parse

INFO = "\t cubic rto:204 bytes_sent:{sent} bytes_acked:{up} bytes_received:{down} segs_out:4"


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ("", []),
        (
            "0      0      127.0.0.1:43982 127.0.0.1:51395\n"
            + INFO.format(sent=100, up=101, down=7),
            [Connection("127.0.0.1:43982", "127.0.0.1:51395", up=101, down=7)],
        ),
        (  # gRPC's dual-stack sockets, two of them
            "0 0 [::ffff:10.253.0.11]:40000 [::ffff:10.253.0.12]:12090\n"
            + INFO.format(sent=900, up=901, down=2000)
            + "\n0 0 [::ffff:10.253.0.11]:40002 [::ffff:10.253.0.11]:12090\n"
            + INFO.format(sent=5, up=6, down=0),
            [
                Connection(
                    "[::ffff:10.253.0.11]:40000", "[::ffff:10.253.0.12]:12090", up=901, down=2000
                ),
                Connection(
                    "[::ffff:10.253.0.11]:40002", "[::ffff:10.253.0.11]:12090", up=6, down=0
                ),
            ],
        ),
        (  # closed before its tcp_info was read: no bytes known
            "0 0 127.0.0.1:1 127.0.0.1:2\n",
            [Connection("127.0.0.1:1", "127.0.0.1:2", up=0, down=0)],
        ),
    ],
)
def test_each_connection_gets_the_bytes_of_its_tcp_info(
    output: str, expected: list[Connection]
) -> None:
    assert parse(output) == expected


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("[::ffff:10.253.0.12]:12090", "10.253.0.12"),
        ("10.253.0.12:12090", "10.253.0.12"),
        ("[fd00:10:253::c]:12090", "fd00:10:253::c"),
    ],
)
def test_the_peer_host_drops_the_port_and_the_ipv4_mapping(peer: str, host: str) -> None:
    assert Connection("l", peer, up=0, down=0).peer_host == host


@pytest.mark.parametrize(
    ("output", "message"),
    [("garbage\n", "not a line of ss's connections: 'garbage'"), ("\t x\n", "before any")],
)
def test_output_that_is_not_ss_connections_is_refused_naming_the_line(
    output: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse(output)
