from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cluster.yaml"


@pytest.fixture
def kpng_command() -> list[str]:
    """The kpng command as a user runs it, from this interpreter's environment."""
    return [sys.executable, "-m", "kpng"]


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


@pytest.fixture
def namespaces() -> Iterator[Callable[[], str]]:
    """Makes new, empty network namespaces (loopback up), all deleted afterwards whatever
    happens. Needs root and iproute2."""
    made: list[str] = []

    def make() -> str:
        name = f"kpng-kt-{secrets.token_hex(3)}"
        subprocess.run(["ip", "netns", "add", name], check=True)
        made.append(name)
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        return name

    try:
        yield make
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def netns(namespaces: Callable[[], str]) -> str:
    """One such namespace."""
    return namespaces()


pytest_plugins = ["rig.fixtures"]


OPT_IN = ("KPNG_",)
"""Skip reasons that name an environment variable to set are opt-in tests, not missing tools."""


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """End with what did not run and why, loudly: a machine without nft or root passes the
    suite while skipping every data-plane test, which must not look like a full pass."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if not reasons:
        return
    missing = {r: n for r, n in reasons.items() if not any(k in r for k in OPT_IN)}
    total = sum(missing.values())
    if missing:
        terminalreporter.section(
            f"{total} TESTS DID NOT RUN: this machine lacks what they need", sep="!", red=True
        )
        for reason, count in sorted(missing.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:5} {reason}", red=True)
        terminalreporter.write_line(
            "Install what is missing with `sudo make system-packages` (Debian) and run as root: "
            "the data-plane and conformance tests need root, nftables and conntrack.",
            bold=True,
        )
    optional = {r: n for r, n in reasons.items() if r not in missing}
    for reason, count in optional.items():
        terminalreporter.write_line(f"opt-in, not run: {count} ({reason})")
