"""`kpng kube` with a configuration it cannot use or a server it cannot reach: a clear error line
and a non-zero exit. No API server needed."""

from __future__ import annotations

import argparse
import contextlib
import http.server
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kpng.testing.ports import free_port
from kpng.testing.waiting import until


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


class _FakeApi(http.server.BaseHTTPRequestHandler):
    """Lists answer an empty list after ``padding`` bytes of blanks (valid JSON, only longer);
    watches send one line of ``event`` bytes, then nothing until the client hangs up."""

    protocol_version = "HTTP/1.1"
    padding = 0
    event = 0

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if "watch=" not in self.path:
            body = b" " * self.padding + b'{"metadata": {"resourceVersion": "1"}, "items": []}'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        line = b"x" * self.event + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()
        self.rfile.read(1)  # until the client goes
        self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


@contextlib.contextmanager
def _fake_api(padding: int = 0, event: int = 0) -> Iterator[str]:
    handler = type("Handler", (_FakeApi,), {"padding": padding, "event": event})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_size_flags_default_to_the_clients_bounds() -> None:
    from kpng.kubeclient.client import MAX_BODY, MAX_LINE
    from kpng.quantities import parse_bytes
    from kpng.sources.kube import SPEC

    parser = argparse.ArgumentParser()
    SPEC.add_arguments(parser)
    assert parse_bytes(parser.get_default("max_list_bytes")) == MAX_BODY
    assert parse_bytes(parser.get_default("max_event_bytes")) == MAX_LINE


@pytest.mark.slow
def test_max_list_bytes_fails_a_larger_page(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    with _fake_api(padding=4096) as server:
        path = _kubeconfig(tmp_path / "kubeconfig", server)
        done = _kpng(
            kpng_command, subprocess_env, "--kubeconfig", str(path),
            "--initial-sync-timeout", "1.5", "--max-list-bytes", "1Ki",
        )  # fmt: skip
    assert done.returncode == 1
    assert "a body larger than 1024 bytes" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_max_event_bytes_ends_a_watch_with_a_longer_event(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    with _fake_api(event=100_000) as server:
        path = _kubeconfig(tmp_path / "kubeconfig", server)
        log = tmp_path / "kpng.log"
        argv = [*kpng_command, "kube", "--kubeconfig", str(path), "--max-event-bytes", "64Ki"]
        with log.open("wb") as stderr:
            proc = subprocess.Popen(
                [*argv, "to-local", "--node-name", "n", "to-json", "--output", str(tmp_path / "s")],
                stderr=stderr,
                env=subprocess_env,
            )
        try:
            until(
                lambda: (
                    "cannot watch: " + server + ": a watch event longer than 65536 bytes"
                    in log.read_text()
                ),
                "the watch to end at the limit",
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.parametrize(
    ("text", "size"),
    [("1048576", 1 << 20), ("512Ki", 512 << 10), ("16Mi", 16 << 20), ("1Gi", 1 << 30), ("0", 0)],
)
def test_sizes_are_bytes_or_binary_quantities(text: str, size: int) -> None:
    from kpng.quantities import parse_bytes

    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "Mi", "16M", "16MB", "1.5Mi", "-1", "16 Mi", "1e6"])
def test_other_sizes_are_refused(text: str) -> None:
    from kpng.quantities import parse_bytes

    with pytest.raises(ValueError, match="not a size in bytes"):
        parse_bytes(text)
