"""to-ebpf's fault table against the kernel: a live ``kpng file ... to-ebpf --sync-period 1s``
on a node whose pods are in its cgroup, a ClusterIP, and another program changing the pins, the
links or the maps' entries behind kpng's back. Each fault is found within the sync period,
logged, counted by kind on ``/metrics``, and repaired: connections to the ClusterIP are
translated at connect again (no conntrack entry to the service address: the nftables part, which
answers meanwhile, would leave one), and ``/healthz`` answers 200. A repair that cannot be made
keeps the divergence reported until it can; changes of endpoints are never taken for drift.

tests/pure/test_ebpf_auditing.py checks the comparisons themselves."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kpng.backends.ebpf.entries import LAYOUT_VERSION
from kpng.backends.ebpf.toolchain import unavailable
from kpng.testing.conformance import Cluster, endpoint_slice, node_object, port, service
from kpng.testing.netns import CLUSTER_CIDRS, ClusterSpec, Node, TestBed, available
from kpng.testing.waiting import poll
from tests.kernel.nft_faults import HEALTHZ, METRICS, drift_repairs, http_get

pytestmark = pytest.mark.skipif(
    available() is not None or unavailable() is not None,
    reason=str(available() or unavailable()),
)

IP = "10.96.0.10"
ANSWER = ["a2 10.244.1.2"]
FOUND = "changed by another program"
BACKEND = (
    f"to-ebpf --cluster-cidr {','.join(CLUSTER_CIDRS)} --cgroup {{cgroup}} --pin-dir {{pin_dir}}"
)


@dataclass
class Live:
    cluster: Cluster
    node: Node
    kpng: subprocess.Popen[bytes]

    @property
    def pin_dir(self) -> Path:
        assert self.node.pin_dir is not None
        return self.node.pin_dir

    def log(self) -> str:
        return (self.cluster.logs / "node-1.log").read_text()

    def get(self, address: str, path: str) -> tuple[int, str]:
        return http_get(self.cluster.bed, self.node.netns, address, path)

    def repairs(self, kind: str) -> float:
        return drift_repairs(self.cluster.bed, self.node.netns, "to-ebpf", kind)

    def translated(self) -> bool:
        """A connection from a1 to the ClusterIP reaches a2, translated by the programs."""
        bed = self.cluster.bed
        bed.exec(self.node.netns, ["conntrack", "-F"], check=False)
        if self.cluster.probe("a1", "tcp", IP, 80, timeout=1) != ANSWER:
            return False
        listed = bed.exec(self.node.netns, ["conntrack", "-L", "-d", IP], check=False)
        return not any(line.startswith("tcp") for line in listed.splitlines())


def _bpftool(*argv: str) -> Any:
    done = subprocess.run(["bpftool", "-j", *argv], capture_output=True, text=True, check=True)
    return json.loads(done.stdout) if done.stdout.strip() else None


@pytest.fixture(scope="module", params=["in-process", "behind-kpng-local"])
def live(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    """to-ebpf on a node, in kpng's one process or in a ``kpng local`` agent fed by a brain on
    a unix socket: the repair is the backend's either way."""
    tmp = tmp_path_factory.mktemp("ebpf-faults")
    (tmp / "manifests").mkdir()
    flags = ("--healthz-address", HEALTHZ, "--metrics-address", METRICS, "--healthz-timeout", "5")
    with (
        tempfile.TemporaryDirectory(prefix="kpng-ebpf-") as sockets,
        TestBed(ClusterSpec.parse({"node-1": ["a1", "a2"]}), sockets=True) as bed,
    ):
        c = Cluster(bed, tmp / "manifests", tmp, BACKEND, flags=flags)
        c.write("nodes", *(node_object(n) for n in bed.nodes.values()))
        c.write("web", service("web", IP, [port("http", 80)]), endpoint_slice(c, "web", ["a2"]))
        api = None
        if request.param == "behind-kpng-local":
            api = f"unix://{sockets}/kpng.sock"
            c.start_brain("node-1", api)
        c.start_backend("node-1", "--sync-period", "1s", api=api)
        live = Live(c, bed.nodes["node-1"], c._backends["node-1"])
        assert poll(live.translated, within=30, interval=0.5), live.log()[-3000:]
        assert poll(lambda: live.get(HEALTHZ, "/healthz")[0] == 200, within=10)
        yield live
        assert live.kpng.poll() is None, live.log()[-3000:]


def _remove_pins(live: Live) -> None:
    subprocess.run(["rm", "-r", str(live.pin_dir)], check=True)


def _remove_links(live: Live) -> None:
    subprocess.run(["rm", "-r", str(live.pin_dir / "links")], check=True)


def _detach_connect4(live: Live) -> None:
    [link] = live.pin_dir.glob("links/*/kpng_connect4")
    found = _bpftool("link", "show", "pinned", str(link))
    subprocess.run(["bpftool", "link", "detach", "id", str(found["id"])], check=True)


def _empty(name: str) -> Callable[[Live], None]:
    def empty(live: Live) -> None:
        path = str(live.pin_dir / f"maps-v{LAYOUT_VERSION}" / name)
        entries = _bpftool("map", "dump", "pinned", path)
        assert entries, f"{name} holds nothing to delete"
        for entry in entries:
            key = [b.removeprefix("0x") for b in entry["key"]]
            subprocess.run(["bpftool", "map", "delete", "pinned", path, "key", "hex", *key],
                           check=True)  # fmt: skip

    return empty


FAULTS: dict[str, tuple[str, Callable[[Live], None]]] = {
    "pins-removed": ("pins", _remove_pins),
    "links-removed": ("programs", _remove_links),
    "link-detached": ("programs", _detach_connect4),
    "frontends-emptied": ("entries", _empty("kpng_frontends")),
    "slots-emptied": ("entries", _empty("kpng_slots")),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_is_found_within_the_sync_period_and_repaired(live: Live, fault: str) -> None:
    kind, make = FAULTS[fault]
    before = live.repairs(kind)
    logged = live.log().count(FOUND)
    make(live)
    assert poll(lambda: live.repairs(kind) == before + 1, within=15), live.log()[-3000:]
    # Logged once, unless the same finding was logged less than 10 s ago: kpng's log lets one
    # of identical warnings through per 10 s (kpng.logs.RepeatFilter); the metric counts all.
    assert live.log().count(FOUND) in (logged, logged + 1)
    assert f"kpng's BPF {kind} were {FOUND}" in live.log()
    assert poll(live.translated, within=5, interval=0.5)
    status, body = live.get(HEALTHZ, "/healthz")
    assert status == 200, body


def test_a_flushed_ruleset_is_the_packets_parts_to_repair_and_is_counted_as_to_ebpfs(
    live: Live,
) -> None:
    """The nftables part (to-nft's table) checks its own table in the same period; its repair
    is to-ebpf's on /metrics, and the programs, untouched, keep translating."""
    before = live.repairs("table")
    live.cluster.bed.exec(live.node.netns, ["nft", "flush", "ruleset"])
    assert poll(lambda: live.repairs("table") == before + 1, within=15), live.log()[-3000:]
    assert "kpng's nftables rules were changed by another program" in live.log()
    tables = live.cluster.bed.exec(live.node.netns, ["nft", "list", "tables"])
    assert "table inet kpng" in tables
    assert poll(live.translated, within=5, interval=0.5)
    status, body = live.get(HEALTHZ, "/healthz")
    assert status == 200, body


def test_a_repair_that_fails_keeps_the_divergence_until_it_can_be_made(live: Live) -> None:
    """The pin directory removed and a map pinned in its place: kpng cannot make the directory
    again, so /healthz fails once the divergence outlasts its timeout (5 s); once the map is
    gone, the next period repairs."""
    before = live.repairs("pins")
    blocker, aside = live.pin_dir.with_name("blocker"), live.pin_dir.with_name("aside")
    subprocess.run(["bpftool", "map", "create", str(blocker), "type", "array", "key", "4",
                    "value", "4", "entries", "1", "name", "blocker"], check=True)  # fmt: skip
    # Two renames, microseconds apart: no check can repair in between.
    live.pin_dir.rename(aside)
    blocker.rename(live.pin_dir)
    subprocess.run(["rm", "-r", str(aside)], check=True)
    try:
        assert poll(lambda: live.get(HEALTHZ, "/healthz")[0] == 503, within=15)
        assert live.repairs("pins") == before
        assert "drift check or repair of the maps and programs failed" in live.log()
    finally:
        live.pin_dir.unlink(missing_ok=True)
    assert poll(lambda: live.repairs("pins") == before + 1, within=15), live.log()[-3000:]
    assert poll(live.translated, within=5, interval=0.5)
    assert live.get(HEALTHZ, "/healthz")[0] == 200


def test_changes_of_endpoints_are_not_taken_for_drift(live: Live) -> None:
    c = live.cluster
    logged = live.log().count(FOUND)
    c.write("web", service("web", IP, [port("http", 80)]), endpoint_slice(c, "web", ["a1", "a2"]))
    c.eventually("a1", "tcp", IP, 80, lambda r: len(set(r)) == 2, count=20)
    c.write("web", service("web", IP, [port("http", 80)]), endpoint_slice(c, "web", ["a2"]))
    c.eventually("a1", "tcp", IP, 80, lambda r: r == ANSWER * 10, count=10)
    time.sleep(3)  # three sync periods
    assert live.log().count(FOUND) == logged
    assert poll(live.translated, within=5, interval=0.5)
