"""The pure tier: kpng's logic and its processes on this host alone. Needs nothing but this
interpreter and the development install: no root, no network namespace, no netfilter, no API
server, no Go build. Real sockets on loopback and unix sockets, real kpng subprocesses, real
gRPC are fine: they need no privilege. ``make check`` runs this tier alone.

A test here must never be skipped for lack of root or of the kernel's netfilter: one that needs
them belongs in tests/kernel. The guard below fails a test here that asks for another tier's
fixture or marker (``netns``, ``control_plane``, ``apiserver``...), naming the tier it belongs
in."""

from __future__ import annotations

import pytest

from tests.tiers import misplaced


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    fixtures = item.fixturenames if isinstance(item, pytest.Function) else []
    names = [*fixtures, *(marker.name for marker in item.iter_markers())]
    wrong = misplaced(names)
    if wrong:
        where = ", ".join(f"{name} (tests/{tier})" for name, tier in sorted(wrong.items()))
        pytest.fail(f"a pure test uses what another tier has: {where}; move it there")
