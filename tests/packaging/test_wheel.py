"""The release artefacts: `python -m build` makes an sdist and a wheel, and the wheel installs
into a fresh virtualenv with plain pip and runs there without the test-only dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import kpng
from tests.conftest import EXAMPLE, ROOT

TIMEOUT_S = 600


def _run(*argv: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The wheel from the sdist, as `python -m build` makes it by default: a wheel built in the
    # tree would also pick up a stale build/ directory's modules (moved ones included).
    _run(sys.executable, "-m", "build", "--outdir", out)
    return out


@pytest.mark.timeout(TIMEOUT_S)
def test_the_sdist_and_the_wheel_carry_the_license_and_the_protos(dist: Path) -> None:
    (wheel,) = dist.glob(f"kpng-{kpng.__version__}-py3-none-any.whl")
    (sdist,) = dist.glob(f"kpng-{kpng.__version__}.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    info = f"kpng-{kpng.__version__}.dist-info"
    assert f"{info}/licenses/LICENSE" in names
    for proto in ("localv1", "globalv1", "batchv1", "pluginv1"):
        assert f"kpng/api/{proto}.proto" in names
    assert "kpng/py.typed" in names
    # to-ebpf's compiled programs, as committed: no node compiles them.
    for name in (
        "sockets.bpf.c",
        "sockets.bpf.o",
        "sockets.bpf.json",
        "udp_destroy.bpf.c",
        "udp_destroy.bpf.o",
        "maps.bpf.h",
    ):
        shipped = zipfile.ZipFile(wheel).read(f"kpng/backends/ebpf/{name}")
        assert shipped == (ROOT / "src/kpng/backends/ebpf" / name).read_bytes(), name
    assert not any(n.startswith("tests/") for n in names)
    # The backend author's test library ships; the project's real-cluster harness does not.
    assert "kpng/testing/conformance.py" in names
    assert "kpng/check.py" in names
    assert not any(n.startswith("rig/") for n in names)
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Provides-Extra: testing" in metadata
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[-1] for m in tar.getmembers()}
    assert {"LICENSE", "README.md", "pyproject.toml"} <= members


@pytest.mark.timeout(TIMEOUT_S)
def test_the_wheel_installs_with_plain_pip_and_runs_without_test_dependencies(
    dist: Path, tmp_path: Path
) -> None:
    (wheel,) = dist.glob("kpng-*.whl")
    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    bin_ = env / "bin"
    _run(bin_ / "pip", "install", "--quiet", wheel)
    version = _run(bin_ / "kpng", "--version").stdout.splitlines()
    assert version[0] == f"kpng {kpng.__version__}"
    assert version[1].startswith("wire API: localv1 globalv1 kpng.batchv1 kpng.pluginv1")
    state = _run(
        bin_ / "kpng", "file", "--input", EXAMPLE, "to-local", "--node-name", "node-2",
        "to-json", "--once", cwd=tmp_path,
    )  # fmt: skip
    assert len(json.loads(state.stdout)["services"]) > 3
    # Every runtime module imports without pytest or cryptography, which are not installed.
    probe = (
        "import importlib, pkgutil, sys, kpng\n"
        "skip = {'kpng.__main__', 'kpng.testing.conformance'}\n"
        "for m in pkgutil.walk_packages(kpng.__path__, 'kpng.'):\n"
        "    if m.name not in skip: importlib.import_module(m.name)\n"
        "bad = sorted(n for n in ('pytest', 'cryptography') if n in sys.modules)\n"
        "print(len(sys.modules), bad)\n"
    )
    assert _run(bin_ / "python", "-c", probe, cwd=tmp_path).stdout.split()[1:] == ["[]"]
    # to-ebpf loads the object the wheel shipped: nothing to compile, no clang asked for.
    shipped = "from kpng.backends.ebpf import toolchain as t; print(t.shipped_object() is not None)"
    assert _run(bin_ / "python", "-c", shipped, cwd=tmp_path).stdout.split() == ["True"]
    missing = subprocess.run(
        [bin_ / "python", "-c", "import pytest"], capture_output=True, check=False
    )
    assert missing.returncode != 0, "pytest is a testing extra, not a runtime dependency"
