"""A package's ``__init__.py`` is its face: it re-exports names from the named modules beside it,
and holds no logic of its own (issue 44), so that a reader finds each idea in a module named
for it. The public names of each face stay what they were."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

FACES = {
    "kpng.backends.ebpf": {
        "DEFAULT_PIN_DIR",
        "EbpfBackend",
        "PROGRAMS",
        "SPEC",
        "SocketBalancer",
        "cleanup",
        "remove_pins",
    },
    "kpng.backends.iptables": {"FULL_SYNC_PERIOD_S", "IptablesBackend", "SPEC", "cleanup"},
    "kpng.backends._nftables": {
        "FULL_CHECK_PERIOD_S",
        "LeftoverTables",
        "NftBackend",
        "cleanup",
        "has_nft",
        "kube_proxy_leftovers",
        "options_from_args",
    },
    "kpng.status": {
        "FAMILIES",
        "FeedsOthers",
        "ProxyCounters",
        "Reconciles",
        "ReportsSamples",
        "Sample",
        "Sampled",
        "ShowsRules",
        "Status",
        "Verdict",
    },
}
"""Faces that re-export only, and their public names."""


def _statements(package: str) -> list[ast.stmt]:
    spec = importlib.util.find_spec(package)
    assert spec is not None
    assert spec.origin is not None
    return ast.parse(Path(spec.origin).read_text()).body


@pytest.mark.parametrize("package", sorted(FACES))
def test_a_package_face_holds_imports_and_its_all_only(package: str) -> None:
    logic = [
        f"line {s.lineno}: {type(s).__name__}"
        for s in _statements(package)
        if not isinstance(s, ast.Import | ast.ImportFrom)
        and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))  # docstring
        and not (
            isinstance(s, ast.Assign) and [getattr(t, "id", None) for t in s.targets] == ["__all__"]
        )
    ]
    assert logic == []


@pytest.mark.parametrize("package", sorted(FACES))
def test_a_package_face_keeps_its_public_names(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == FACES[package]
    assert all(hasattr(module, name) for name in FACES[package])
