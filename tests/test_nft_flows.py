"""Stale UDP conntrack flows by kube-proxy's rule (1.37, pkg/proxy/conntrack/cleanup.go): which
flows go, as tables, and ``conntrack -L`` output as conntrack-tools 1.4.7 writes it."""

from __future__ import annotations

import pytest

from kpng.backends._conntrack import Flow, Frontends, parse_flows, stale_filters

LISTING = """\
udp      17 29 src=10.0.0.1 dst=10.96.0.10 sport=40000 dport=53 src=10.244.1.2 dst=10.0.0.1 \
sport=5353 dport=40000 [ASSURED] mark=0 use=1
udp      17 29 src=10.0.0.1 dst=10.96.0.11 sport=40001 dport=53 [UNREPLIED] src=10.96.0.11 \
dst=10.0.0.1 sport=53 dport=40001 mark=0 use=1
udp      17 29 src=::1 dst=fd00:96::10 sport=40001 dport=5353 [UNREPLIED] src=fd00:244::2 \
dst=::1 sport=5353 dport=40001 mark=0 use=1
tcp      6 431999 ESTABLISHED src=10.0.0.1 dst=10.96.0.10 sport=40000 dport=80 src=10.244.1.2 \
dst=10.0.0.1 sport=8080 dport=40000 [ASSURED] mark=0 use=1
udp      17 29 src=10.0.0.1 dst=10.96.0.10
"""


def test_parse_flows_reads_the_original_destination_and_the_reply_source_of_udp_lines() -> None:
    assert parse_flows(LISTING) == [
        Flow("10.96.0.10", "53", "10.244.1.2", "5353"),
        Flow("10.96.0.11", "53", "10.96.0.11", "53"),
        Flow("fd00:96::10", "5353", "fd00:244::2", "5353"),
    ]


SERVING = frozenset({("10.244.1.2", "5353"), ("10.244.1.3", "5353")})
FRONTENDS: Frontends = {("10.96.0.10", "53"): SERVING, ("", "30053"): SERVING}


@pytest.mark.parametrize(
    ("flow", "expected"),
    [
        pytest.param(Flow("10.96.0.10", "53", "10.244.1.2", "5353"), [], id="serving-endpoint"),
        pytest.param(
            Flow("10.96.0.10", "53", "10.244.1.9", "5353"),
            [
                [
                    "-p",
                    "udp",
                    "--orig-dst",
                    "10.96.0.10",
                    "--orig-port-dst",
                    "53",
                    "--reply-src",
                    "10.244.1.9",
                    "--reply-port-src",
                    "5353",
                ]
            ],
            id="endpoint-serving-nowhere",
        ),
        pytest.param(
            Flow("10.96.0.10", "53", "10.244.1.2", "9090"),
            [
                [
                    "-p",
                    "udp",
                    "--orig-dst",
                    "10.96.0.10",
                    "--orig-port-dst",
                    "53",
                    "--reply-src",
                    "10.244.1.2",
                    "--reply-port-src",
                    "9090",
                ]
            ],
            id="old-target-port",
        ),
        pytest.param(
            Flow("10.96.0.10", "53", "10.96.0.10", "53"),
            [
                [
                    "-p",
                    "udp",
                    "--orig-dst",
                    "10.96.0.10",
                    "--orig-port-dst",
                    "53",
                    "--reply-src",
                    "10.96.0.10",
                    "--reply-port-src",
                    "53",
                ]
            ],
            id="made-while-the-service-had-no-endpoint",
        ),
        pytest.param(
            Flow("192.0.2.10", "30053", "10.244.1.9", "5353"),
            [
                [
                    "-p",
                    "udp",
                    "--orig-port-dst",
                    "30053",
                    "--reply-src",
                    "10.244.1.9",
                    "--reply-port-src",
                    "5353",
                ]
            ],
            id="node-port-any-address",
        ),
        pytest.param(Flow("10.96.0.99", "53", "10.244.1.9", "5353"), [], id="not-a-frontend"),
        pytest.param(Flow("10.96.0.10", "54", "10.244.1.9", "5353"), [], id="other-port"),
        pytest.param(
            Flow("fd00:96::10", "53", "fd00:244::9", "5353"), [], id="other-family-frontend"
        ),
    ],
)
def test_stale_filters(flow: Flow, expected: list[list[str]]) -> None:
    assert stale_filters([flow], FRONTENDS) == expected


def test_an_address_frontend_without_serving_endpoints_loses_its_flows_a_node_port_keeps_them() -> (
    None
):
    """kube-proxy 1.37 (conntrack.CleanStaleEntries): a service address with no serving endpoint
    is reconciled against an empty set; a node port is not (its match is the port alone)."""
    to_address = Flow("10.96.0.10", "53", "10.244.1.9", "5353")
    to_node_port = Flow("192.0.2.10", "30053", "10.244.1.9", "5353")
    frontends: Frontends = {("10.96.0.10", "53"): frozenset(), ("", "30053"): frozenset()}
    assert stale_filters([to_address, to_node_port], frontends) == [
        ["-p", "udp", "--orig-dst", "10.96.0.10", "--orig-port-dst", "53",
         "--reply-src", "10.244.1.9", "--reply-port-src", "5353"],
    ]  # fmt: skip


def test_ipv6_filters_name_the_family_and_repeated_flows_give_one_filter() -> None:
    flow = Flow("fd00:96::10", "53", "fd00:244::9", "5353")
    frontends = {("fd00:96::10", "53"): frozenset({("fd00:244::2", "5353")})}
    assert stale_filters([flow, flow._replace()], frontends) == [
        ["-f", "ipv6", "-p", "udp", "--orig-dst", "fd00:96::10", "--orig-port-dst", "53",
         "--reply-src", "fd00:244::9", "--reply-port-src", "5353"],
    ]  # fmt: skip


def test_only_the_frontends_asked_for_are_reconciled() -> None:
    stale = Flow("10.96.0.10", "53", "10.244.1.9", "5353")
    assert stale_filters([stale], FRONTENDS, only=[("", "30053")]) == []
    assert stale_filters([stale], FRONTENDS, only=[("10.96.0.10", "53")]) != []
