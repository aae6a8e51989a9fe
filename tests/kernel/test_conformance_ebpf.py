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
