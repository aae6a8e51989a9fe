"""The kernel tier: kpng's backends against the real kernel. Needs root, iproute2 (``ip netns``)
and nft: every test makes network namespaces of its own and programs nftables, iptables or BPF
in them (some need more, iptables-legacy, ipset, bpftool, clang, conntrack, and say so). Without
root or those tools the whole tier is skipped, and the end-of-run summary names the tier."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Callable, Iterator

import pytest

from kpng.testing.netns import available
from tests.tiers import tier_skip_reason

MISSING = available()
"""Why this machine cannot make network namespaces with nft in them (not root, no ip or nft)."""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if MISSING is not None:
        pytest.skip(tier_skip_reason("kernel", MISSING))


@pytest.fixture
def namespaces() -> Iterator[Callable[[], str]]:
    """Makes new, empty network namespaces (loopback up), all deleted afterwards whatever
    happens. Needs root and iproute2."""
    made: list[str] = []

    def make() -> str:
        name = f"kpng-kt-{secrets.token_hex(3)}"
        subprocess.run(["ip", "netns", "add", name], check=True)
        made.append(name)
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        return name

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def netns(namespaces: Callable[[], str]) -> str:
    """One such namespace."""
    return namespaces()
