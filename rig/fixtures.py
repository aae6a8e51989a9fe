"""pytest fixtures around a real control plane; enable with
``pytest_plugins = ["rig.fixtures"]`` in a conftest.py.

- ``control_plane``: one etcd + kube-apiserver for the whole session (built once, cached);
- ``kube_api``: a ``KubeApi`` client of it;
- ``kube_namespace``: a fresh namespace per test, so tests sharing the control plane do not see
  each other's objects.

Tests that use them should be marked ``@pytest.mark.apiserver`` (registered here), so that
``pytest -m "not apiserver"`` runs the rest without a control plane.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import pytest

from rig.cluster import ControlPlane, ensure_binaries
from rig.kubeapi import KubeApi

_counter = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "apiserver: runs against a real kube-apiserver (rig.cluster)"
    )
    config.addinivalue_line(
        "markers", "realcluster: runs real nodes, kubelets and containerds (rig.nodes)"
    )


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    with ControlPlane(ensure_binaries()) as plane:
        yield plane


@pytest.fixture
def kube_api(control_plane: ControlPlane) -> Iterator[KubeApi]:
    api = KubeApi.of(control_plane)
    yield api
    api.close()


@pytest.fixture
def kube_namespace(kube_api: KubeApi, request: pytest.FixtureRequest) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{next(_counter)}"
    kube_api.ensure_namespace(name)
    return name
