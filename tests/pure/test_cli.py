"""End to end: the kpng command on the bundled example and on files it writes and reads back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kpng.testing.waiting import json_lines, until
from tests.conftest import EXAMPLE, ROOT

TIMEOUT_S = 60


def _run(
    cmd: list[str], *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
    )


def _state(cmd: list[str], node: str, source: Path = EXAMPLE) -> dict[str, Any]:
    done = _run(
        cmd, "file", "--input", str(source), "to-local", "--node-name", node, "to-json", "--once"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    state: dict[str, Any] = json.loads(lines[0])
    return state


def _by_name(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{s['service']['Namespace']}/{s['service']['Name']}": s for s in state["services"]}


def _scopes(entry: dict[str, Any]) -> dict[str, str]:
    """address -> scope letters (I internal, E external, C cluster) of a service's endpoints."""
    out = {}
    for ep in entry["endpoints"]:
        ips = ep["IPs"].get("V4", []) + ep["IPs"].get("V6", [])
        scopes = ep.get("Scopes", {})
        out[ips[0]] = "".join(k[0] for k in ("Internal", "External", "Cluster") if scopes.get(k))
    return out


def test_example_node_local_state_follows_kube_proxy_semantics(kpng_command: list[str]) -> None:
    state = _state(kpng_command, "node-2")
    assert state["node"] == "node-2"
    assert state["revision"] == 1
    services = _by_name(state)
    # ignored: another proxy's, headless, ExternalName
    assert sorted(services) == [
        "edge/ingress",
        "kube-system/dns-cache",
        "monitoring/metrics",
        "shop/api",
        "shop/pending",
        "shop/web",
    ]
    # zone hints: node-2 is in zone-a, so only the zone-a ready endpoint; the terminating one is
    # not needed while a ready endpoint exists
    assert _scopes(services["shop/web"]) == {"10.244.1.11": "IC"}
    # eTP=Local with no local endpoint on node-2: nothing External (dropped), but the cluster set
    # stays for short-circuited traffic
    assert _scopes(services["edge/ingress"]) == {"10.244.1.31": "IC", "10.244.3.32": "IC"}
    ingress = services["edge/ingress"]["service"]
    assert ingress["IPs"]["LoadBalancerIPs"] == {"V4": ["192.0.2.10"]}  # the Proxy-mode IP is not
    assert ingress["HealthCheckNodePort"] == 32000
    # iTP=Local: internal traffic to the local endpoint only; the external IP uses all
    assert _scopes(services["kube-system/dns-cache"]) == {
        "10.244.1.53": "EC",
        "10.244.2.53": "IEC",
        "10.244.3.53": "EC",
    }
    assert _scopes(services["monitoring/metrics"]) == {
        "10.244.1.90": "IC",
        "fd00:10:244:1::90": "IC",
    }
    assert services["monitoring/metrics"]["service"]["Ports"][0]["UsableEndpoints"] == {
        "V4": True,
        "V6": True,
    }
    assert services["shop/api"]["service"]["ClientIP"] == {"TimeoutSeconds": 600}
    # no endpoint anywhere: REJECT, told by UsableEndpoints being absent
    pending = services["shop/pending"]
    assert pending["endpoints"] == []
    assert "UsableEndpoints" not in pending["service"]["Ports"][0]


def test_node_with_local_endpoints_gets_them_for_external_traffic(kpng_command: list[str]) -> None:
    services = _by_name(_state(kpng_command, "node-1"))
    assert _scopes(services["edge/ingress"]) == {"10.244.1.31": "IEC", "10.244.3.32": "IC"}


@pytest.mark.slow
def test_output_is_deterministic(kpng_command: list[str]) -> None:
    assert _state(kpng_command, "node-3") == _state(kpng_command, "node-3")


def test_a_one_shot_run_ends_with_its_output_flushed_and_its_exit_handlers_run(
    tmp_path: Path,
) -> None:
    """``--once`` leaves the interpreter without its teardown: what exit must still do is done.
    Its state goes to a pipe (block-buffered) and its log to stderr; an exit handler, as kpng
    registers to remove a kubeconfig's key files, still runs."""
    marker = tmp_path / "handler-ran"
    script = (
        "import atexit, pathlib, sys, kpng.cli\n"
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
        "sys.exit(kpng.cli.main(sys.argv[1:]))\n"
    )
    argv = ["--log-level", "info", "file", "--input", str(EXAMPLE), "to-local"]
    done = _run(
        [sys.executable, "-c", script],
        *argv,
        *("--node-name", "node-2", "to-json", "--once"),
    )
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "yes"
    (line,) = done.stdout.splitlines()
    assert json.loads(line)["node"] == "node-2"
    assert "source file synced" in done.stderr


@pytest.mark.slow
def test_to_file_dump_reads_back_to_the_same_node_state(
    kpng_command: list[str], tmp_path: Path
) -> None:
    dump = tmp_path / "state.json"
    done = _run(
        kpng_command, "file", "--input", str(EXAMPLE), "to-file", "--output", str(dump), "--once"
    )
    assert done.returncode == 0, done.stderr
    document = json.loads(dump.read_text())
    assert document["kind"] == "GlobalState"
    assert {n["Node"]["Name"] for n in document["nodes"]} == {"node-1", "node-2", "node-3"}
    assert all(int(info["Hash"]) > 0 for info in document["services"])
    for node in ("node-1", "node-2", "node-3"):
        assert (
            _state(kpng_command, node, dump)["services"] == _state(kpng_command, node)["services"]
        )


def test_missing_input_exits_non_zero_with_a_clear_error(
    kpng_command: list[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.yaml"
    done = _run(
        kpng_command, "file", "--input", str(missing), "to-local", "--node-name", "n", "to-json"
    )
    assert done.returncode != 0
    assert f"--input {missing}: no such file or directory" in done.stderr


@pytest.mark.slow
def test_no_external_ips_serves_services_without_them(kpng_command: list[str]) -> None:
    """kube-proxy 1.36+'s AllowServiceExternalIPs=false: no externalIP reaches the backends, nor
    makes a service externally accessible (so no External scope comes of it)."""

    def dns(*flags: str) -> dict[str, Any]:
        done = _run(
            kpng_command, "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2",
            *flags, "to-json", "--once",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return _by_name(json.loads(done.stdout))["kube-system/dns-cache"]

    assert dns()["service"]["IPs"]["ExternalIPs"] == {"V4": ["198.51.100.53"]}
    assert "ExternalIPs" not in dns("--no-external-ips")["service"]["IPs"]


def test_a_node_no_source_knows_is_warned_of_once(kpng_command: list[str]) -> None:
    done = _run(
        kpng_command, "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-9",
        "to-json", "--once",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    warning = "node 'node-9' is not among the 3 nodes the sources list, so nothing is local to it"
    assert done.stderr.count(warning) == 1


def test_two_services_claiming_one_node_port_are_warned_of_and_both_served(
    kpng_command: list[str], tmp_path: Path
) -> None:
    source = tmp_path / "cluster.yaml"
    source.write_text(
        EXAMPLE.read_text()
        + "---\napiVersion: v1\nkind: Service\nmetadata: {name: copy, namespace: tools}\n"
        "spec: {type: NodePort, clusterIP: 10.96.0.77, ports: [{port: 80, nodePort: 30900}]}\n"
    )
    done = _run(
        kpng_command, "file", "--input", str(source), "to-local", "--node-name", "node-2",
        "to-json", "--once",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("WARNING") == 1, done.stderr
    assert (
        "node port 30900/TCP is claimed by Services shop/api and tools/copy; all are kept in the "
        "state, and kpng's backends program the port for shop/api" in done.stderr
    )
    services = _by_name(json.loads(done.stdout))
    for name in ("shop/api", "tools/copy"):
        assert 30900 in [p.get("NodePort") for p in services[name]["service"]["Ports"]]


def test_json_logs_are_one_object_a_line(kpng_command: list[str], tmp_path: Path) -> None:
    source = tmp_path / "cluster.yaml"
    source.write_text(
        EXAMPLE.read_text() + "---\napiVersion: v1\nkind: Service\nmetadata: {namespace: x}\n"
    )
    done = _run(
        kpng_command, "--log-format", "json", "file", "--input", str(source),
        "to-local", "--node-name", "node-2", "to-json", "--once",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    entries = [json.loads(line) for line in done.stderr.splitlines()]
    assert {e["level"] for e in entries} == {"error", "info"}
    (error,) = [e for e in entries if e["level"] == "error"]
    assert error["logger"] == "kpng.sources.file"
    assert "Service x/<no name>: metadata.name is missing; skipped" in error["msg"]
    assert all(isinstance(e["ts"], float) for e in entries)


@pytest.mark.parametrize(
    "sink", [["to-local", "--node-name", "n", "to-json"], ["to-file", "--output", "-"]]
)
def test_once_fails_on_a_file_that_never_parsed(
    kpng_command: list[str], tmp_path: Path, sink: list[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Service\nmetadata: {name: [half-written\n")
    done = _run(kpng_command, "file", "--input", str(broken), *sink, "--once")
    assert done.returncode == 1
    assert f"source file: no usable state until these files parse: {broken}" in done.stderr
    assert done.stdout == ""


# Root reads any file: as root, kpng runs as nobody; any other user cannot read a mode 0 file.
AS_NOBODY = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []


@pytest.mark.skipif(
    bool(AS_NOBODY) and shutil.which("runuser") is None, reason="needs runuser to drop root"
)
def test_unreadable_input_exits_non_zero_with_a_clear_error(
    kpng_command: list[str], tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    secret = tmp_path / "secret.yaml"
    shutil.copy(EXAMPLE, secret)
    secret.chmod(0o000)
    tmp_path.chmod(0o755)
    done = _run(
        [*AS_NOBODY, *kpng_command],
        "file", "--input", str(secret), "to-local", "--node-name", "n", "to-json", "--once",
        env=subprocess_env,
    )  # fmt: skip
    assert done.returncode != 0
    assert "Permission denied" in done.stderr


TO_API = ["file", "--input", "x", "to-api", "--listen", "unix:///tmp/x.sock"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["file", "--input", "x"], "a sink is required"),
        (
            ["file", "--input", "x", "to-local", "--node-name", "n"],
            "to-local takes one or more backends",
        ),
        (["to-local"], "unknown source 'to-local' (sources: api, file, kube, local)"),
        ([], "a source is required"),
        (
            ["file", "--input", "x", "to-file", "--output", "-", "to-json"],
            "to-file takes no backend",
        ),
        (
            ["file", "--input", "x", "to-local", "--node-name", "n", "to-jsno", "--once"],
            "unknown backend 'to-jsno'; did you mean to-json? "
            "(backends: to-ebpf, to-exec, to-iptables, to-json,",
        ),
        (
            ["file", "--input", "x", "to-local", "--node-name", "n", "to-json", "to-nfft"],
            "unknown backend 'to-nfft'; did you mean to-nft?",
        ),
        (["local", "--api", "unix:///x", "to-zzz"], "unknown backend 'to-zzz' (backends:"),
        (
            ["local", "--api", "http://127.0.0.1:12090", "--node-name", "n", "to-json"],
            "--api http://127.0.0.1:12090: kpng speaks gRPC, not http",
        ),
        (
            ["api", "--api", "127.0.0.1", "to-file", "--output", "-"],
            "--api 127.0.0.1: expected tcp://HOST:PORT, HOST:PORT or unix:///PATH",
        ),
        (
            ["local", "--api", "tcp://127.0.0.1:1,127.0.0.1", "--node-name", "n", "to-json"],
            "--api 127.0.0.1: expected tcp://HOST:PORT, HOST:PORT or unix:///PATH",
        ),
        (
            [
                "file",
                "--input",
                "x",
                "to-api",
                "--listen",
                "tcp://127.0.0.1:0",
                "--token-audience",
                "kpng",
            ],
            "--token-audience on TCP needs --tls-cert and --tls-key: tokens are secrets",
        ),
        (
            [
                "file",
                "--input",
                "x",
                "to-api",
                "--listen",
                "unix:///tmp/x.sock",
                "--node-user",
                "u",
            ],
            "--node-user, --global-user and --review-kubeconfig need --token-audience",
        ),
        (
            ["--http-max-connections", "0", "file", "--input", "x", "to-file", "--output", "-"],
            "--http-max-connections must be positive, got 0",
        ),
        (
            ["--http-request-timeout", "nan", "file", "--input", "x", "to-file", "--output", "-"],
            "--http-request-timeout must be a positive number of seconds, got nan",
        ),
        (
            [*TO_API, "--first-request-timeout", "0"],
            "--first-request-timeout must be positive, got 0.0",
        ),
        (
            [*TO_API, "--token-review-burst", "10"],
            "--token-reviews-per-second and --token-review-burst need --token-audience",
        ),
        (
            ["kube", "--max-list-bytes", "0", "to-file", "--output", "-"],
            "--max-list-bytes must be positive, got '0'",
        ),
        (
            ["kube", "--max-event-bytes", "16MB", "to-file", "--output", "-"],
            "--max-event-bytes: not a size in bytes: '16MB' (e.g. 1048576, 512Ki, 16Mi, 1Gi)",
        ),
    ],
    ids=[
        "no-sink",
        "no-backend",
        "not-a-source",
        "nothing",
        "backend-after-to-file",
        "misspelt-backend",
        "misspelt-second-backend",
        "unknown-backend-of-local",
        "http-api-url",
        "api-url-without-port",
        "a-replica-url-without-port",
        "tokens-in-clear",
        "token-flags-without-audience",
        "no-http-connections",
        "http-request-timeout-nan",
        "no-first-request-time",
        "review-burst-without-audience",
        "no-list-bytes",
        "event-bytes-not-a-size",
    ],
)
def test_usage_errors_exit_2(kpng_command: list[str], args: list[str], message: str) -> None:
    done = _run(kpng_command, *args)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["local"], "kpng: no state from unix://{tmp}/none.sock within 0.5 s"),
        (["api"], "kpng: source api: no state from unix://{tmp}/none.sock within 0.5 s"),
        ([], "error: no state from unix://{tmp}/none.sock within 0.5 s"),
    ],
    ids=["kpng-local", "kpng-api-source", "client-library"],
)
def test_once_without_a_server_gives_up_after_the_connect_timeout(
    kpng_command: list[str], tmp_path: Path, args: list[str], message: str
) -> None:
    flags = ["--api", f"unix://{tmp_path}/none.sock", "--connect-timeout", "0.5"]
    if args == ["local"]:
        command = [*kpng_command, "local", *flags, "--node-name", "n", "to-json", "--once"]
    elif args == ["api"]:
        command = [
            *kpng_command,
            "api",
            *flags,
            "to-local",
            "--node-name",
            "n",
            "to-json",
            "--once",
        ]
    else:
        command = [sys.executable, str(ROOT / "examples" / "print_state.py"), *flags,
                   "--node-name", "n", "--once"]  # fmt: skip
    done = _run(command)
    assert done.returncode == 1, done.stderr
    assert message.format(tmp=tmp_path) in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_help_lists_sources_sinks_and_registered_backends(kpng_command: list[str]) -> None:
    done = _run(kpng_command, "--help")
    assert done.returncode == 0
    for name in ("file", "to-local", "to-file", "to-json"):
        assert name in done.stdout
    assert "to-json    write the node-local state as one JSON line per revision" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "usage"),
    [
        (["file", "to-local", "--help"], "usage: kpng <source> to-local"),
        (["file", "to-local", "to-nft", "--help"], "usage: kpng ... to-nft"),
        (["kube", "to-local", "--node-name", "n", "to-json", "-h"], "usage: kpng ... to-json"),
    ],
)
def test_help_of_a_sink_or_backend_needs_nothing_before_it(
    kpng_command: list[str], args: list[str], usage: str
) -> None:
    """What `kpng --help` suggests works, though the source has none of its required flags."""
    done = _run(kpng_command, *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage)


@pytest.mark.slow
@pytest.mark.parametrize(
    "given",
    ["ABSOLUTE", "sub/cluster.yaml", "./sub/cluster.yaml", "sub", "./sub/../sub/"],
    ids=["absolute", "relative", "dot-relative", "relative-directory", "unnormalized"],
)
def test_following_a_file_prints_a_line_per_change(
    kpng_command: list[str], tmp_path: Path, subprocess_env: dict[str, str], given: str
) -> None:
    """As the docs' examples write it: relative paths too (inotify reports absolute ones)."""
    source = tmp_path / "sub" / "cluster.yaml"
    source.parent.mkdir()
    shutil.copy(EXAMPLE, source)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [*kpng_command, "file", "--input", str(source) if given == "ABSOLUTE" else given,
         "to-local", "--node-name", "node-2", "to-json", "--output", str(out)],
        stderr=subprocess.PIPE, text=True, env=subprocess_env, cwd=tmp_path,
    )  # fmt: skip
    try:
        _wait_for_lines(out, 1)
        # the watch is armed before the first state is written; change the web service's port
        source.write_text(
            source.read_text().replace("port: 80, targetPort: http", "port: 81, targetPort: http")
        )
        lines = _wait_for_lines(out, 2)
        web = _by_name(lines[1])["shop/web"]
        assert web["service"]["Ports"][0]["Port"] == 81
        assert lines[1]["revision"] == 2
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, stderr


def _wait_for_lines(path: Path, count: int) -> list[dict[str, Any]]:
    until(lambda: len(json_lines(path)) >= count, f"{count} lines in {path}", within=TIMEOUT_S)
    return json_lines(path)
