"""Stale UDP conntrack flows by kube-proxy's rule (1.37, pkg/proxy/conntrack/cleanup.go): which
flows go, as tables."""

from __future__ import annotations

import pytest

from kpng.backends._conntrack import Flow, Frontends, stale_flows

SERVING = frozenset({("10.244.1.2", "5353"), ("10.244.1.3", "5353")})
FRONTENDS: Frontends = {("10.96.0.10", "53"): SERVING, ("", "30053"): SERVING}


@pytest.mark.parametrize(
    ("flow", "stale"),
    [
        pytest.param(Flow("10.96.0.10", "53", "10.244.1.2", "5353"), False, id="serving-endpoint"),
        pytest.param(
            Flow("10.96.0.10", "53", "10.244.1.9", "5353"), True, id="endpoint-serving-nowhere"
        ),
        pytest.param(Flow("10.96.0.10", "53", "10.244.1.2", "9090"), True, id="old-target-port"),
        pytest.param(
            Flow("10.96.0.10", "53", "10.96.0.10", "53"),
            True,
            id="made-while-the-service-had-no-endpoint",
        ),
        pytest.param(
            Flow("192.0.2.10", "30053", "10.244.1.9", "5353"), True, id="node-port-any-address"
        ),
        pytest.param(Flow("10.96.0.99", "53", "10.244.1.9", "5353"), False, id="not-a-frontend"),
        pytest.param(Flow("10.96.0.10", "54", "10.244.1.9", "5353"), False, id="other-port"),
        pytest.param(
            Flow("fd00:96::10", "53", "fd00:244::9", "5353"), False, id="other-family-frontend"
        ),
    ],
)
def test_stale_flows(flow: Flow, stale: bool) -> None:
    assert stale_flows([flow], FRONTENDS) == ([flow] if stale else [])


def test_an_address_frontend_without_serving_endpoints_loses_its_flows_a_node_port_keeps_them() -> (
    None
):
    """kube-proxy 1.37 (conntrack.CleanStaleEntries): a service address with no serving endpoint
    is reconciled against an empty set; a node port is not (its match is the port alone)."""
    to_address = Flow("10.96.0.10", "53", "10.244.1.9", "5353")
    to_node_port = Flow("192.0.2.10", "30053", "10.244.1.9", "5353")
    frontends: Frontends = {("10.96.0.10", "53"): frozenset(), ("", "30053"): frozenset()}
    assert stale_flows([to_address, to_node_port], frontends) == [to_address]


def test_a_flow_stale_for_two_frontends_is_deleted_once_and_flows_come_sorted() -> None:
    """A flow to a node port on a service address matches both frontends; two clients' flows
    to one gone endpoint are two deletes (each names its own tuple)."""
    flow = Flow("fd00:96::10", "53", "fd00:244::9", "5353", "fd00::2", "4000", 0, 7)
    other = flow._replace(orig_src="fd00::1", id=3)
    serving = frozenset({("fd00:244::2", "5353")})
    frontends = {("fd00:96::10", "53"): serving, ("", "53"): serving}
    assert stale_flows([flow, other, flow], frontends) == [other, flow]


def test_only_the_frontends_asked_for_are_reconciled() -> None:
    stale = Flow("10.96.0.10", "53", "10.244.1.9", "5353")
    assert stale_flows([stale], FRONTENDS, only=[("", "30053")]) == []
    assert stale_flows([stale], FRONTENDS, only=[("10.96.0.10", "53")]) != []
