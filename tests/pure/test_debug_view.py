"""The state view on the metrics address: ``/debug/state`` is to-json's line, ``/debug/explain``
is ``kpng explain``'s answer, ``/debug/rules`` is what the kernel holds, ``/livez`` is there too;
and none of them is on a separate health address."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kpng.testing.ports import free_port
from kpng.testing.waiting import until
from tests.pure.test_status import _get as get

EXAMPLE = Path(__file__).parents[2] / "examples" / "cluster.yaml"
WAIT_S = 30.0


def _get(url: str, *, netns: str | None = None) -> tuple[int, str]:
    if netns is not None:
        # From inside the namespace, whose loopback kpng serves on.
        fetch = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            "    r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status); "
            "sys.stdout.write(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code); sys.stdout.write(e.read().decode())\n"
            "except OSError:\n"
            "    print(0)\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", netns, sys.executable, "-c", fetch, url],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        code, _, body = out.partition("\n")
        return int(code), body
    return get(url)


@contextlib.contextmanager
def _kpng(
    argv: list[str], env: dict[str, str], log: Path, *, netns: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    prefix = ["ip", "netns", "exec", netns] if netns is not None else []
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kpng", *argv], stderr=stderr, env=env
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_state_explain_and_livez_on_the_metrics_address_only(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    metrics, healthz = free_port(), free_port()
    output = tmp_path / "state.json"
    argv = [
        "--metrics-bind-address", f"127.0.0.1:{metrics}",
        "--healthz-bind-address", f"127.0.0.1:{healthz}",
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2",
        "to-json", "--output", str(output),
    ]  # fmt: skip
    base = f"http://127.0.0.1:{metrics}"
    with _kpng(argv, subprocess_env, tmp_path / "kpng.log"):
        until(lambda: _get(f"{base}/debug/state")[0] == 200, within=WAIT_S)
        assert json.loads(_get(f"{base}/debug/state")[1]) == json.loads(output.read_text())

        code, body = _get(f"{base}/debug/explain?service=shop/web")
        assert code == 200
        command = subprocess.run(
            [sys.executable, "-m", "kpng", "file", "--input", str(EXAMPLE), "explain",
             "--node-name", "node-2", "--service", "shop/web", "-o", "json"],
            capture_output=True, check=True, timeout=60, env=subprocess_env,
        ).stdout  # fmt: skip
        assert json.loads(body) == json.loads(command)
        assert _get(f"{base}/debug/explain")[0] == 400
        assert _get(f"{base}/livez")[0] == 200
        # to-json programs no kernel.
        assert _get(f"{base}/debug/rules")[0] == 404
        # The health address is what load balancers reach: it shows no state.
        for path in ("/debug/state", "/debug/explain?service=shop/web", "/debug/rules"):
            assert _get(f"http://127.0.0.1:{healthz}{path}")[0] == 404


@pytest.mark.slow
def test_explain_of_a_brain_needs_the_node(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    metrics = free_port()
    argv = [
        "--metrics-bind-address", f"127.0.0.1:{metrics}",
        "file", "--input", str(EXAMPLE), "to-api", "--listen", f"unix://{tmp_path / 'api.sock'}",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{metrics}"
    with _kpng(argv, subprocess_env, tmp_path / "kpng.log"):
        assert _get(f"{base}/debug/explain?service=shop/web")[0] in (0, 400)
        asked = f"{base}/debug/explain?service=shop/web&node=node-3"
        until(lambda: _get(asked)[0] == 200, within=WAIT_S)
        assert _get(f"{base}/debug/explain?service=shop/web")[0] == 400
        code, body = _get(asked)
        assert code == 200
        (explained,) = json.loads(body)
        assert explained["node"] == "node-3"
        assert explained["zone"] == "zone-b"
