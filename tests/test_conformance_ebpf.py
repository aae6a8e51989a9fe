"""The backend conformance suite (``kpng.testing.conformance``), run against to-ebpf: each node's
pods and the node itself are in the node's cgroup, where its kpng attaches the programs."""

import pytest

from kpng.backends.ebpf.toolchain import unavailable
from kpng.testing.conformance import *  # noqa: F403
from kpng.testing.netns import available

pytestmark = pytest.mark.skipif(
    available() is not None or unavailable() is not None,
    reason=str(available() or unavailable()),
)


@pytest.fixture(scope="module")  # type: ignore[no-redef]
def backend_command() -> str:
    return "to-ebpf --cluster-cidr {cluster_cidrs} --cgroup {cgroup} --pin-dir {pin_dir}"


NOT_LOCAL = (
    "the programs translate when the socket connects, before it has a source address or an "
    "interface: a pod that local traffic detection does not count as local cannot be "
    "masqueraded (--masquerade-all is honoured: ClusterIPs are then left to the nftables part)"
)


@pytest.fixture(scope="module")  # type: ignore[no-redef]
def known_failures() -> dict[str, str]:
    return {
        "test_local_traffic_detection_decides_what_is_masqueraded[flags3-True]": NOT_LOCAL,
        "test_local_traffic_detection_decides_what_is_masqueraded[flags4-True]": NOT_LOCAL,
        "test_node_cidr_detection_follows_the_node_object": NOT_LOCAL,
    }
