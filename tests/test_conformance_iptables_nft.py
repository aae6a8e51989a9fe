"""The backend conformance suite (``kpng.testing.conformance``), run against to-iptables with
iptables-nft."""

import pytest

from kpng.testing.conformance import *  # noqa: F403


@pytest.fixture(scope="module")  # type: ignore[no-redef]
def backend_command() -> str:
    return "to-iptables --iptables-mode nft --cluster-cidr {cluster_cidrs}"
