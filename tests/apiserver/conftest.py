"""The apiserver tier: kpng against a real kube-apiserver and etcd (``rig.cluster``, through the
``control_plane``, ``kube_api`` and ``kube_namespace`` fixtures of ``rig.fixtures``). They are
built from source with Go on first use (``make control-plane``: a few minutes), then found in
~/.cache/kpng/control-plane. Needs neither root nor network namespaces. Every test here is
marked ``apiserver`` (``-m "not apiserver"`` leaves the tier out); without Go and without a
cached build, the whole tier is skipped and the end-of-run summary names the tier."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rig.cluster import cached_binaries
from tests.tiers import tier_skip_reason

HERE = Path(__file__).parent


def _missing() -> str | None:
    if shutil.which("go") is None and cached_binaries() is None:
        return "no control plane is cached and Go is not on PATH to build one"
    return None


MISSING = _missing()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.apiserver)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if MISSING is not None:
        pytest.skip(tier_skip_reason("apiserver", MISSING))
