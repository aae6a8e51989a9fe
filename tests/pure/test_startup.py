"""What the kpng command imports: commands that never touch the network do not pay for gRPC.

grpc and protobuf take about 0.1 s to import, a large part of a short command's run, and
importlib.metadata (for installed backends' entry points) 20 ms more. Each check runs in a fresh
interpreter, since this test process has long imported them all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE, ROOT

HEAVY = ("grpc", "google.protobuf", "importlib.metadata")

# Prints, after each stage, the heavy packages imported so far, as one JSON line on stderr (the
# pipeline writes its state to a file, so stdout stays free for it).
_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys

    def heavy():
        return sorted(m for m in {heavy} if m in sys.modules)

    stages = {{}}
    import kpng.cli
    stages["import kpng.cli"] = heavy()
    pipeline = kpng.cli.build(sys.argv[1:]).run
    stages["build"] = heavy()
    asyncio.run(pipeline())
    stages["run"] = heavy()
    print(json.dumps(stages), file=sys.stderr)
    """
).format(heavy=HEAVY)


def _run_python(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def _imported(*argv: str) -> dict[str, list[str]]:
    stages: dict[str, list[str]] = json.loads(_run_python(_SCRIPT, *argv).stderr.splitlines()[-1])
    return stages


@pytest.mark.slow
def test_file_to_local_to_json_imports_no_grpc_protobuf_or_entry_points(tmp_path: Path) -> None:
    out = tmp_path / "state.jsonl"
    stages = _imported(
        "file", "--input", str(EXAMPLE), "to-local", "--node-name", "node-2",
        "to-json", "--once", "--output", str(out),
    )  # fmt: skip
    assert json.loads(out.read_text())["node"] == "node-2"  # the pipeline did run
    assert stages == {"import kpng.cli": [], "build": [], "run": []}


# What a node agent behind a brain never uses: the file source's parsers and file watcher, and
# the resolver (the brain resolves).
NOT_FOR_A_NODE_AGENT = ("yaml", "watchfiles", "kpng.sources.manifests", "kpng.resolver.resolving")


@pytest.mark.slow
def test_kpng_local_to_nft_builds_without_parsers_file_watcher_or_resolver() -> None:
    script = (
        "import json, sys, kpng.cli; kpng.cli.build(sys.argv[1:]); "
        f"print(json.dumps(sorted(m for m in {NOT_FOR_A_NODE_AGENT!r} if m in sys.modules)))"
    )
    argv = ["local", "--api", "unix:///nonexistent.sock", "--node-name", "node-1", "to-nft"]
    assert json.loads(_run_python(script, *argv).stdout) == []


@pytest.mark.slow
def test_kpng_kube_with_status_addresses_builds_without_aiohttp(tmp_path: Path) -> None:
    """The kube source's client and the status server are kpng's own (``kpng.http1``): aiohttp
    alone took about 0.2 s to import (kubernetes_asyncio, for the kubeconfigs kpng does not read
    itself, still brings it, but only then)."""
    script = (
        "import json, sys, kpng.cli; kpng.cli.build(sys.argv[1:]); "
        "print(json.dumps([m for m in ('aiohttp', 'kubernetes_asyncio') if m in sys.modules]))"
    )
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    argv = [
        "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0",
        "kube", "--kubeconfig", str(kubeconfig),
        "to-local", "--node-name", "node-1", "to-nft",
    ]  # fmt: skip
    assert json.loads(_run_python(script, *argv).stdout) == []


@pytest.mark.slow
def test_help_and_other_commands_do_not_import_what_kpng_top_needs() -> None:
    """``kpng top``'s parser (prometheus_client, whose package imports http.server and more)
    and its modules are imported when ``kpng top`` runs, not by ``kpng --help`` nor any
    pipeline."""
    script = (
        "import contextlib, json, sys, kpng.cli\n"
        "with contextlib.redirect_stdout(None), contextlib.suppress(SystemExit):\n"
        "    kpng.cli.main(['--help'])\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('prometheus_client', 'kpng.top')))))"
    )
    assert json.loads(_run_python(script).stdout) == []
