"""The backend conformance suite (``kpng.testing.conformance``), run against to-iptables with
iptables-legacy."""

import shutil

import pytest

from kpng.testing.conformance import *  # noqa: F403
from kpng.testing.netns import available

pytestmark = pytest.mark.skipif(
    available() is not None or shutil.which("iptables-legacy-restore") is None,
    reason=str(available() or "needs iptables (Debian: apt-get install iptables)"),
)


@pytest.fixture(scope="module")  # type: ignore[no-redef]
def backend_command() -> str:
    return "to-iptables --iptables-mode legacy --cluster-cidr {cluster_cidrs}"
