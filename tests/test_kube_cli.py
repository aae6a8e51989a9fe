"""`kpng kube` with a configuration it cannot use or a server it cannot reach: a clear error line
and a non-zero exit. No API server needed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kpng.harness.cluster import free_port


def _kpng(
    kpng_command: list[str], env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*kpng_command, "kube", *args, "to-local", "--node-name", "n", "to-json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )


def _kubeconfig(path: Path, server: str, context: str = "c") -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
current-context: {context}
clusters: [{{name: k, cluster: {{server: "{server}", insecure-skip-tls-verify: true}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: c, context: {{cluster: k, user: u}}}}]
"""
    )
    return path


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, [], "kubeconfig {path}: no such file"),
        ("clusters: [\n", [], "kubeconfig {path}: cannot be read"),
        ("ok", ["--context", "nope"], "Expected object with name nope"),
        ("ok-missing-current", [], "Expected object with name gone"),
        ("ok-no-server", [], "kubeconfig {path}: no API server address"),
    ],
    ids=["missing", "not-yaml", "unknown-context", "missing-current-context", "no-server"],
)
def test_bad_kubeconfig_is_a_clear_error(
    tmp_path: Path,
    kpng_command: list[str],
    subprocess_env: dict[str, str],
    content: str | None,
    args: list[str],
    message: str,
) -> None:
    path = tmp_path / "kubeconfig"
    if content == "ok":
        _kubeconfig(path, "https://127.0.0.1:1")
    elif content == "ok-missing-current":
        _kubeconfig(path, "https://127.0.0.1:1", context="gone")
    elif content == "ok-no-server":
        _kubeconfig(path, "")
    elif content is not None:
        path.write_text(content)
    done = _kpng(kpng_command, subprocess_env, "--kubeconfig", str(path), *args)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if " ERROR kpng: " in line]
    assert len(errors) == 1, done.stderr
    assert message.format(path=path) in errors[0]


def test_unreachable_server_with_a_sync_timeout_is_a_clear_error(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    port = free_port()  # nothing listens there
    path = _kubeconfig(tmp_path / "kubeconfig", f"https://127.0.0.1:{port}")
    done = _kpng(
        kpng_command, subprocess_env, "--kubeconfig", str(path), "--initial-sync-timeout", "1.5"
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert f"no complete list from https://127.0.0.1:{port} within 1.5 s" in last
    assert f"cannot connect to https://127.0.0.1:{port}" in last
    # Every attempt said why it failed.
    assert f"Service: cannot list: cannot connect to https://127.0.0.1:{port}" in done.stderr


def test_a_failing_source_leaves_no_socket_and_no_stray_traceback_behind_to_api(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    """The source fails while to-api is still starting: the server is stopped in order."""
    socket = tmp_path / "api.sock"
    done = subprocess.run(
        [*kpng_command, "kube", "--kubeconfig", str(tmp_path / "missing"),
         "to-api", "--listen", f"unix://{socket}"],
        capture_output=True, text=True, env=subprocess_env, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().endswith(f"kubeconfig {tmp_path / 'missing'}: no such file")
    assert "Traceback" not in done.stderr
    assert not socket.exists()
