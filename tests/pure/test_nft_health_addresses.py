"""Health check node ports listen where node ports are served, as kube-proxy's: the node's
addresses inside ``--nodeport-addresses`` (``primary``: its primary IPs), every address of a
family given no CIDR, as a table (a real to-nft in a network namespace:
tests/kernel/test_nft_health_addresses_kernel.py)."""

from __future__ import annotations

import pytest

from kpng.backends._healthchecks import listen_hosts

LOCAL = ["127.0.0.1", "10.0.0.5", "192.0.2.7", "::1", "fd00::5"]


@pytest.mark.parametrize(
    ("cidrs", "hosts"),
    [
        ((), None),
        (("10.0.0.5/32",), ["10.0.0.5", "::"]),
        (("10.0.0.0/8", "fd00::/64"), ["10.0.0.5", "fd00::5"]),
        (("127.0.0.0/8", "192.0.2.0/24"), ["192.0.2.7", "::"]),  # never loopback
        (("198.51.100.0/24",), ["::"]),  # no IPv4 address inside: no IPv4 socket
        (("198.51.100.0/24", "2001:db8::/32"), []),
    ],
)
def test_listen_hosts(cidrs: tuple[str, ...], hosts: list[str] | None) -> None:
    assert listen_hosts(cidrs, LOCAL) == hosts
