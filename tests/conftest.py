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


pytest_plugins = ["kpng.testing.fixtures"]
