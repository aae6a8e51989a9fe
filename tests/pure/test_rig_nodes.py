"""The real-node rig's pure parts: what it writes for a node, single- and dual-stack."""

from __future__ import annotations

from pathlib import Path

import pytest

from rig.nodes import NodeLayout, cni_config


def test_single_stack_cni_config_has_one_range_and_an_ipv4_default_route() -> None:
    ipam = cni_config(["10.245.0.0/24"])["plugins"][0]["ipam"]
    assert ipam["ranges"] == [[{"subnet": "10.245.0.0/24"}]]
    assert ipam["routes"] == [{"dst": "0.0.0.0/0"}]


def test_dual_stack_cni_config_has_a_range_and_a_default_route_per_family() -> None:
    ipam = cni_config(["10.245.1.0/24", "fd00:10:245:1::/64"])["plugins"][0]["ipam"]
    assert ipam["ranges"] == [[{"subnet": "10.245.1.0/24"}], [{"subnet": "fd00:10:245:1::/64"}]]
    assert ipam["routes"] == [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]


@pytest.mark.parametrize(
    ("dual_stack", "ips"),
    [(False, ("10.253.0.12",)), (True, ("10.253.0.12", "fd00:10:253::c"))],
)
def test_a_node_has_an_address_per_family_ipv4_first(
    dual_stack: bool, ips: tuple[str, ...]
) -> None:
    assert NodeLayout("node-2", 2, Path("/nowhere"), dual_stack).ips == ips
