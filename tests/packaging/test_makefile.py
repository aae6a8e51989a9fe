"""What the Makefile installs for each target, read from ``make --dry-run`` into a throwaway
virtualenv path: ``make example`` installs kpng's runtime only, everything else kpng's development
tools too, and ``make example`` then ``make test`` in one tree adds the tools without starting
over. Installing for real takes a minute and the network, so a stamp the dry run names is made
by touching it, as its recipe's last line does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(target: str, venv: Path) -> list[str]:
    """The commands ``make TARGET`` would run, one a line."""
    done = subprocess.run(
        ["make", "--dry-run", "-C", str(ROOT), f"VENV={venv}", target],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if not line.startswith("make")]


def pip_installs(commands: list[str]) -> list[str]:
    return [c for c in commands if "pip install " in c]


def run_stamps(commands: list[str]) -> None:
    """Does what the install recipes leave behind: the stamps they touch last."""
    for command in commands:
        if command.startswith("touch "):
            stamp = Path(command.removeprefix("touch "))
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.touch()


def test_example_installs_the_runtime_only(tmp_path: Path) -> None:
    commands = dry_run("example", tmp_path / "venv")
    installs = pip_installs(commands)
    assert any(c.endswith("pip install --quiet -e .") for c in installs), commands
    assert not any("dev" in c for c in installs), installs


@pytest.mark.parametrize("target", ["check", "test", "lint", "typecheck", "unit", "dev"])
def test_the_development_targets_install_the_tools_on_a_fresh_machine(
    tmp_path: Path, target: str
) -> None:
    venv = tmp_path / "venv"
    commands = dry_run(target, venv)
    assert any(c.endswith(f"-m venv {venv}") for c in commands), commands
    assert any(c.endswith("pip install --quiet -e '.[dev]'") for c in pip_installs(commands))


def test_example_then_test_adds_the_tools_to_the_same_virtualenv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run_stamps(dry_run("example", venv))

    commands = dry_run("test", venv)
    assert not any(c.endswith(f"-m venv {venv}") for c in commands), commands
    assert [c.split("pip install ")[1] for c in pip_installs(commands)] == ["--quiet -e '.[dev]'"]
    # The tools come before their first use.
    install = next(i for i, c in enumerate(commands) if "'.[dev]'" in c)
    ruff = next(i for i, c in enumerate(commands) if "/ruff " in c)
    assert install < ruff

    run_stamps(commands)
    assert pip_installs(dry_run("test", venv)) == []
    # The runtime install is complete already: example does not install again after the tools.
    assert pip_installs(dry_run("example", venv)) == []
