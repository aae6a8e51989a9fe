"""The nodes tier: kpng on real nodes (``rig.nodes``): kubelets, containerd and runc, pods in
network namespaces, a real control plane, deploy/'s manifests applied as an operator applies
them. Needs root, containerd, runc, the CNI plugins and the Go builds of ``make real-nodes``
(kubelet, controllers, CoreDNS...: cached after the first). Every test here is marked
``realcluster``; without root or those tools the whole tier is skipped, and the end-of-run
summary names the tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from rig.nodes import missing_requirements
from tests.tiers import tier_skip_reason

HERE = Path(__file__).parent

MISSING = missing_requirements()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.realcluster)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if MISSING:
        pytest.skip(tier_skip_reason("nodes", MISSING))
