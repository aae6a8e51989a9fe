"""to-python: a backend in a Python file, loaded in process, in each of the shapes it accepts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE

TIMEOUT_S = 60

SHAPES = {
    "handler": """
import json, sys

def backend(state):
    print(json.dumps(sorted(f"{ns}/{name}" for ns, name in state.services)))
    return True
""",
    "async-handler-by-name": """
import json

async def mine(state):
    print(json.dumps(sorted(f"{ns}/{name}" for ns, name in state.services)))
    return True
""",
    "sink-class": """
import json
from kpng.client import Service

class backend:
    def __init__(self):
        self.names = []
    def reset(self): pass
    def set_service(self, service: Service):
        self.names.append(f"{service.Namespace}/{service.Name}")
    def delete_service(self, namespace, name): pass
    def set_endpoint(self, namespace, service, key, endpoint): pass
    def delete_endpoint(self, namespace, service, key): pass
    def sync(self):
        print(json.dumps(sorted(self.names)), flush=True)
        return True
""",
    "backend-object": """
import json

class Printer:
    async def apply(self, state):
        print(json.dumps(sorted(f"{ns}/{name}" for ns, name in state.services)))
        return True
    async def close(self): pass

backend = Printer()
""",
}


def _kpng(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kpng", *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=cwd, check=False,
    )  # fmt: skip


def _expected(tmp_path: Path) -> list[str]:
    done = _kpng(
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2", "to-json", "--once",
        cwd=tmp_path,
    )  # fmt: skip
    state = json.loads(done.stdout)
    return sorted(f"{s['service']['Namespace']}/{s['service']['Name']}" for s in state["services"])


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_each_shape_gets_the_node_state(tmp_path: Path, shape: str) -> None:
    (tmp_path / "mine.py").write_text(SHAPES[shape])
    module = "./mine.py:mine" if shape == "async-handler-by-name" else "./mine.py"
    done = _kpng(
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2",
        "to-python", "--module", module,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0]) == _expected(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "module", "message"),
    [
        (None, "nope.py", "--module nope.py: nope.py: no such file"),
        ("def handle(state): pass\n", "m.py", "m.py has no 'backend'; it defines handle"),
        ("def backend(state)\n", "m.py", "--module m.py: SyntaxError: expected ':'"),
        ("backend = 3\n", "m.py", "int is neither a Backend (apply, close), a Sink"),
    ],
    ids=["missing-file", "wrong-name", "syntax-error", "not-a-backend"],
)
def test_a_bad_module_is_one_clear_line(
    tmp_path: Path, source: str | None, module: str, message: str
) -> None:
    if source is not None:
        (tmp_path / module).write_text(source)
    done = _kpng(
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2",
        "to-python", "--module", module,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


FOLLOWERS = {
    # Shapes that never end kpng themselves: without --once they would follow the file forever.
    "handler": """
import json

def backend(state):
    print(json.dumps(sorted(f"{ns}/{name}" for ns, name in state.services)), flush=True)
""",
    "sink": """
import json

class backend:
    def __init__(self):
        self.names = set()
    def reset(self): pass
    def set_service(self, service):
        self.names.add(f"{service.Namespace}/{service.Name}")
    def delete_service(self, namespace, name): pass
    def set_endpoint(self, namespace, service, key, endpoint): pass
    def delete_endpoint(self, namespace, service, key): pass
    def sync(self):
        print(json.dumps(sorted(self.names)), flush=True)
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", FOLLOWERS)
def test_once_exits_after_the_first_state(tmp_path: Path, shape: str) -> None:
    (tmp_path / "follow.py").write_text(FOLLOWERS[shape])
    done = _kpng(
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2",
        "to-python", "--module", "./follow.py", "--once",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert json.loads(line) == _expected(tmp_path)


@pytest.mark.slow
def test_once_fails_on_a_file_that_never_parsed(tmp_path: Path) -> None:
    (tmp_path / "follow.py").write_text(FOLLOWERS["handler"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Service\nmetadata: {name: [half-written\n")
    done = _kpng(
        "file", "--input", str(broken), "to-local", "--node-name", "node-2",
        "to-python", "--module", "./follow.py", "--once",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no usable state until these files parse" in done.stderr
    assert done.stdout == ""
