"""The fault table against the kernel: a live ``kpng file ... to-nft`` in a node's network
namespace, traffic through a ClusterIP and a NodePort, and another program changing kpng's
table behind its back. Each fault is found within the sync period (1 s here), logged, counted
by kind on ``/metrics``, and repaired to what a fresh full sync programs (compared on the
kernel's own listing); traffic flows again and ``/healthz`` answers 200.

tests/pure/test_nft_drift.py has the same faults over the fake, and the divergence kpng cannot
repair (``/healthz`` 503 after its timeout)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from kpng.testing.netns import ClusterSpec, TestBed
from kpng.testing.waiting import poll
from tests.kernel.nft_faults import (
    CLUSTER_IP,
    FAULTS,
    HEALTHZ,
    METRICS,
    Live,
    assert_found_and_repaired,
    with_node_port,
)
from tests.kernel.test_nft_kernel import _manifest, _table


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("faults")
    with TestBed(ClusterSpec.parse({"node-1": ["p1"]})) as bed:
        node = bed.nodes["node-1"].netns
        manifests = tmp / "cluster.json"
        manifests.write_text(with_node_port(_manifest(bed, CLUSTER_IP)))
        log = tmp / "kpng.log"
        argv = [sys.executable, "-m", "kpng", "--log-level", "debug"]
        argv += ["--healthz-address", HEALTHZ, "--metrics-address", METRICS]
        argv += ["--healthz-timeout", "5", "file", "--input", str(manifests), "--removal-delay"]
        argv += ["3s", "to-local", "--node-name", "node-1", "to-nft", "--sync-period", "1s"]
        with log.open("wb") as stderr:
            kpng = bed.spawn(node, argv, stderr=stderr)
        assert poll(lambda: "applied a full transaction" in log.read_text(), within=30)
        live = Live(bed, node, log, manifests, _table(node))
        assert poll(lambda: live.get(HEALTHZ, "/healthz")[0] == 200, within=10)
        assert live.answers() == ["p1", "p1"]
        yield live
        assert kpng.poll() is None, live.log.read_text()[-3000:]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_is_found_within_the_sync_period_and_repaired(live: Live, fault: str) -> None:
    assert_found_and_repaired(live, fault)


def test_a_file_truncated_then_written_again_keeps_every_rule(live: Live) -> None:
    """``kubectl get ... > cluster.json`` truncates the file before it writes it: within the
    removal delay, nothing is removed."""
    content = live.manifests.read_text()
    transactions = live.log.read_text().count("applied a")
    live.manifests.write_text("")
    assert poll(
        lambda: "would" in live.log.read_text() or "removed if" in live.log.read_text(), within=5
    )
    assert live.answers() == ["p1", "p1"]
    live.manifests.write_text(content)
    time.sleep(4)  # past the removal delay
    assert _table(live.node) == live.fresh
    assert live.answers() == ["p1", "p1"]
    assert live.log.read_text().count("applied a") == transactions
