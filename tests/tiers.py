"""The test tiers: one folder under tests/ each, named by what its tests need from the machine.
Each folder's conftest.py says so again and skips its tier where the machine lacks it; this module
holds what the root conftest and the pure tier's guard share: which tier a test is in, which
fixtures and markers belong to which tier, and the end-of-run summary of what did not run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

NEEDS: dict[str, str] = {
    "pure": "nothing but this interpreter: no root, no network namespace, no API server, no Go",
    "kernel": "root, network namespaces (iproute2) and nftables, iptables or BPF",
    "apiserver": "a real kube-apiserver and etcd (built with Go by rig.cluster, then cached)",
    "nodes": "root, containerd, runc, the CNI plugins and the kubelet rig.nodes builds",
    "packaging": "the packaging tools: python -m build, make, helm, mkdocs, clang, containerd",
}
"""Each tier, in the order ``make test`` needs more of the machine, with what it needs."""

ELSEWHERE: dict[str, str] = {
    "netns": "kernel",
    "namespaces": "kernel",
    "control_plane": "apiserver",
    "kube_api": "apiserver",
    "kube_namespace": "apiserver",
    "apiserver": "apiserver",
    "realcluster": "nodes",
}
"""Fixtures and markers that only the tier named may use: a pure test asking for one needs root
or a control plane the pure tier does not have."""


def tier_of(nodeid: str) -> str | None:
    """The tier of a test by its node ID (``tests/kernel/test_x.py::test_y``), or None for a
    test outside the tier folders."""
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) >= 3 and parts[0] == "tests" and parts[1] in NEEDS:
        return parts[1]
    return None


def misplaced(names: Iterable[str]) -> dict[str, str]:
    """Of a pure test's fixture and marker ``names``, those of another tier, with that tier."""
    return {name: ELSEWHERE[name] for name in names if name in ELSEWHERE}


def tier_skip_reason(tier: str, why: str) -> str:
    """The reason a tier's conftest skips every test of the tier with: the summary reads the
    tier back from it."""
    return f"the {tier} tier needs {NEEDS[tier]}: {why}"


class Summary:
    """What did not run, from each test's outcome: whole tiers skipped (their count and the
    reason their conftest gave), and the other skips by reason."""

    def __init__(self, outcomes: Mapping[str, str | None]) -> None:
        """``outcomes``: each test's node ID with its skip reason, or None if it ran."""
        ran: dict[str | None, int] = {}
        skipped: dict[str | None, dict[str, int]] = {}
        for nodeid, reason in outcomes.items():
            tier = tier_of(nodeid)
            if reason is None:
                ran[tier] = ran.get(tier, 0) + 1
            else:
                reasons = skipped.setdefault(tier, {})
                reasons[reason] = reasons.get(reason, 0) + 1
        self.tiers: dict[str, tuple[int, str]] = {}
        """Tiers none of whose tests ran: their number of tests and the commonest reason."""
        self.reasons: dict[str, int] = {}
        """The other skips: how many for each reason."""
        for tier, reasons in skipped.items():
            if tier is not None and not ran.get(tier):
                reason = max(reasons, key=lambda r: reasons[r])
                self.tiers[tier] = (sum(reasons.values()), reason)
                continue
            for reason, count in reasons.items():
                self.reasons[reason] = self.reasons.get(reason, 0) + count
