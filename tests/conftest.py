"""What every tier shares: the kpng command's fixtures, the rig's pytest plugin (the control plane
fixtures, the ``apiserver`` and ``realcluster`` markers) and the end-of-run summary of what did not
run. Each tier's own tests/<tier>/conftest.py says what the tier needs (tests/tiers.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.tiers import Summary

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cluster.yaml"


@pytest.fixture
def kpng_command() -> list[str]:
    """The kpng command as a user runs it, from this interpreter's environment."""
    return [sys.executable, "-m", "kpng"]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


pytest_plugins = ["rig.fixtures"]


OPT_IN = ("KPNG_",)
"""Skip reasons that name an environment variable to set are opt-in tests, not missing tools."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """End with what did not run and why, loudly: a machine without nft or root passes the
    suite while skipping every data-plane test, which must not look like a full pass. A tier
    none of whose tests ran is one line that names the tier (tests/<tier>/conftest.py says what
    it needs); the other skips are counted by reason."""
    outcomes: dict[str, str | None] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        outcomes[report.nodeid] = reason.removeprefix("Skipped: ")
    for category in ("passed", "failed", "error", "xfailed", "xpassed"):
        for report in terminalreporter.stats.get(category, []):
            outcomes[report.nodeid] = None
    summary = Summary(outcomes)
    if not summary.tiers and not summary.reasons:
        return
    missing = {r: n for r, n in summary.reasons.items() if not any(k in r for k in OPT_IN)}
    total = sum(missing.values()) + sum(count for count, _ in summary.tiers.values())
    if total:
        terminalreporter.section(
            f"{total} TESTS DID NOT RUN: this machine lacks what they need", sep="!", red=True
        )
        for tier, (count, reason) in summary.tiers.items():
            terminalreporter.write_line(
                f"{count:5} tests/{tier}, the whole tier: {reason}", red=True
            )
        for reason, count in sorted(missing.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:5} {reason}", red=True)
        terminalreporter.write_line(
            "Install what is missing with `sudo make system-packages` (Debian) and run as root: "
            "the data-plane and conformance tests need root, nftables and conntrack.",
            bold=True,
        )
    optional = {r: n for r, n in summary.reasons.items() if r not in missing}
    for reason, count in optional.items():
        terminalreporter.write_line(f"opt-in, not run: {count} ({reason})")
