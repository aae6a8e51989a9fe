"""Migrating a node from kube-proxy's nftables mode: to-nft says kube-proxy's tables are there,
and ``kpng cleanup kube-proxy`` removes them and says what it removed (the other modes:
tests/kernel/test_kube_proxy_leftovers.py). Real nftables, in a
network namespace of the test's; libnftables and the nft command both list tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, protocol: TCP}]
"""


def _in(netns: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", netns, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_kube_proxys_tables_are_reported_then_cleaned_up(netns: str, tmp_path: Path) -> None:
    for family in ("ip", "ip6"):
        assert _in(netns, "nft", "add", "table", family, "kube-proxy").returncode == 0
    (tmp_path / "web.yaml").write_text(SERVICE)
    kpng = [sys.executable, "-m", "kpng"]
    done = _in(
        netns, *kpng, "file", "--input", str(tmp_path),
        "to-local", "--node-name", "n", "to-nft", "--once", "--no-health-check",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "kube-proxy's leftovers" in line]
    assert len(warned) == 1, done.stderr
    assert "(nftables mode's tables: ip kube-proxy, ip6 kube-proxy)" in warned[0]
    assert "kpng cleanup kube-proxy" in warned[0]

    done = _in(netns, *kpng, "cleanup", "kube-proxy")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout == "kube-proxy: removed nftables mode's tables: ip kube-proxy, ip6 kube-proxy\n"
    )
    listing = _in(netns, "nft", "list", "tables").stdout
    assert "kube-proxy" not in listing
    assert "table inet kpng" in listing  # kpng's own stays
    done = _in(netns, *kpng, "cleanup", "kube-proxy")
    assert done.stdout == "kube-proxy: nothing to remove\n"

    done = _in(
        netns, *kpng, "file", "--input", str(tmp_path),
        "to-local", "--node-name", "n", "to-nft", "--once", "--no-health-check",
    )  # fmt: skip
    assert "kube-proxy's leftovers" not in done.stderr


@pytest.mark.parametrize("executor", ["lib", "command"])
def test_both_executors_list_the_namespaces_tables(netns: str, executor: str) -> None:
    for family, name in (("ip", "kube-proxy"), ("inet", "kpng"), ("bridge", "other")):
        assert _in(netns, "nft", "add", "table", family, name).returncode == 0
    script = (
        "import asyncio\n"
        "from kpng.backends._nftables.executing import KernelNft, LibNft\n"
        f"nft = {'LibNft()' if executor == 'lib' else 'KernelNft()'}\n"
        "print(sorted((t.family, t.name) for t in asyncio.run(nft.list_tables())))\n"
    )
    done = _in(netns, sys.executable, "-c", script)
    assert done.returncode == 0, done.stderr
    # Tables of families kpng has no business with (bridge) are left out.
    assert done.stdout.strip() == "[('inet', 'kpng'), ('ip', 'kube-proxy')]"
