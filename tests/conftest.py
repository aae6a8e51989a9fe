from __future__ import annotations

import os
import sys
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


pytest_plugins = ["kpng.testing.fixtures"]
