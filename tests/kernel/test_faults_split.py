"""The fault table behind ``kpng local``: kpng split in two processes, a brain (``kpng file ...
to-api`` on a unix socket) and a node agent (``kpng local ... to-nft --sync-period 1s``), both
in a node's network namespace, traffic through a ClusterIP and a NodePort.

docs/design/guarantees.md promises the same things of a node whichever shape feeds it: the
faults of tests/kernel/test_nft_faults.py are found and repaired by the agent alone; a brain killed
while a change is in flight, then started again, leaves the node with exactly what a fresh full
sync of the final manifest programs, and traffic to the Services the change left alone never
stops; an agent restarted while the brain runs takes its rules over without a failed
connection. "What a fresh full sync programs" is kpng in one process (``--once``) run on the
same manifest in an empty network namespace of its own, compared on the kernel's listing."""

from __future__ import annotations

import contextlib
import json
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

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

KPNG = [sys.executable, "-m", "kpng"]
NODE = "node-1"
OTHER_IP = "10.96.0.11"
"""The ClusterIP of ``ns/api``, the Service the in-flight changes touch (``ns/web`` is left
alone, and probed throughout)."""
SYNCED = "applied a full transaction"
LISTENING = "serving the watch API on"


def _fresh(manifests: Path) -> dict[str, object]:
    """kpng's table as a fresh full sync of ``manifests`` programs it: kpng in one process, once,
    in an empty network namespace made for it and deleted after."""
    netns = f"kpng-kt-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True, timeout=30)
    try:
        done = subprocess.run(
            ["ip", "netns", "exec", netns, *KPNG, "file", "--input", str(manifests),
             "to-local", "--node-name", NODE, "to-nft", "--once", "--no-health-check"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return _table(netns)
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False, timeout=30)


@dataclass
class Split:
    """A brain and a node agent on ``node``; ``live`` sees the agent (its log, /metrics,
    /healthz) as tests/kernel/test_nft_faults.py sees kpng in one process."""

    live: Live
    socket: Path
    logs: Path
    brain: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    _started: dict[str, int] = field(default_factory=dict)

    def _log(self, role: str) -> Path:
        self._started[role] = self._started.get(role, 0) + 1
        return self.logs / f"{role}-{self._started[role]}.log"

    def start_brain(self) -> subprocess.Popen[bytes]:
        """A brain on the socket (a killed one's left in place: the new one replaces it), once
        it listens."""
        log = self._log("brain")
        argv = [*KPNG, "--log-level", "debug", "file", "--input", str(self.live.manifests)]
        argv += ["to-api", "--listen", f"unix://{self.socket}"]
        with log.open("wb") as stderr:
            self.brain = self.live.bed.spawn(self.live.node, argv, stderr=stderr)
        assert poll(lambda: LISTENING in log.read_text(), within=30), log.read_text()[-3000:]
        return self.brain

    def start_agent(self) -> subprocess.Popen[bytes]:
        """An agent, once it programmed its first (full) state; ``live`` reads its log."""
        self.live.log = self._log("agent")
        argv = [*KPNG, "--log-level", "debug", "--healthz-address", HEALTHZ]
        argv += ["--metrics-address", METRICS, "--healthz-timeout", "5"]
        argv += ["local", "--api", f"unix://{self.socket}", "--node-name", NODE]
        argv += ["to-nft", "--sync-period", "1s"]
        with self.live.log.open("wb") as stderr:
            self.agent = self.live.bed.spawn(self.live.node, argv, stderr=stderr)
        assert poll(lambda: SYNCED in self.live.log.read_text(), within=30), self.agent_log()
        return self.agent

    def agent_log(self) -> str:
        return self.live.log.read_text()[-3000:]

    def healthy(self) -> bool:
        return self.live.get(HEALTHZ, "/healthz")[0] == 200


@contextlib.contextmanager
def _split(logs: Path, pods: list[str], manifest: Callable[[TestBed], str]) -> Iterator[Split]:
    """A node with ``pods``, a brain and an agent on it programmed with ``manifest(bed)``: its
    rules those of kpng in one process. Every process and namespace goes with the bed."""
    # A unix socket's path is at most 107 bytes: pytest's temporary paths, named after the test,
    # can be longer.
    with (
        tempfile.TemporaryDirectory(prefix="kpng-split-") as sockets,
        TestBed(ClusterSpec.parse({NODE: pods})) as bed,
    ):
        node = bed.nodes[NODE].netns
        manifests = logs / "cluster.json"
        manifests.write_text(manifest(bed))
        live = Live(bed, node, logs / "agent-0.log", manifests, _fresh(manifests))
        split = Split(live, Path(sockets) / "kpng.sock", logs)
        split.start_brain()
        split.start_agent()
        assert poll(split.healthy, within=10), split.agent_log()
        assert _table(node) == live.fresh
        assert live.answers() == ["p1", "p1"]
        yield split
        assert split.agent is not None
        assert split.agent.poll() is None, split.agent_log()
        assert split.brain is not None
        assert split.brain.poll() is None


def _web(bed: TestBed) -> str:
    """``ns/web`` on p1, a ClusterIP and a NodePort: the fault table's manifest."""
    return with_node_port(_manifest(bed, CLUSTER_IP))


def _with_api(manifest: str, pod: str | None) -> str:
    """``manifest`` with ``ns/api`` (a ClusterIP, port 80) served by ``pod`` (None: without
    ``ns/api``)."""
    if pod is None:
        return manifest
    objects = json.loads(manifest)
    objects["items"] += [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "api", "namespace": "ns"},
            "spec": {
                "clusterIP": OTHER_IP,
                "clusterIPs": [OTHER_IP],
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "api-x",
                "namespace": "ns",
                "labels": {"kubernetes.io/service-name": "api"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [pod], "nodeName": NODE, "conditions": {"ready": True}}],
        },
    ]
    return json.dumps(objects)


def _probing(bed: TestBed, node: str, seconds: float) -> subprocess.Popen[bytes]:
    """Connections to ``ns/web``'s ClusterIP one after the other for ``seconds``."""
    argv = [sys.executable, "-m", "kpng.testing.probe", "tcp", CLUSTER_IP, "80"]
    return bed.spawn(node, [*argv, "--for", str(seconds), "--timeout", "1"], stdout=subprocess.PIPE)


def _answers(client: subprocess.Popen[bytes]) -> list[str]:
    out, _ = client.communicate(timeout=120)
    results: list[str] = json.loads(out)["results"]
    return results


CHANGES = {
    # change: (the pod serving ns/api before, after; None: no ns/api)
    "service-added": (None, "p2"),
    "endpoint-moved": ("p2", "p1"),
    "service-removed": ("p2", None),
}


MOMENTS = {
    "written": "the change only in the file: the brain killed right after the write (it reads a "
    "file once the file has been quiet for 50 ms)",
    "sent": "the change in the agent's socket, unapplied: the agent stopped (SIGSTOP, a node too "
    "busy to run it) before the write, the brain killed once it has read the change and sent it, "
    "then the agent continued",
    "applied": "the change applied by the agent: the brain killed once the agent logged it",
}
"""When the brain is killed, with the change where."""


@pytest.mark.parametrize("moment", sorted(MOMENTS))
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_brain_killed_with_a_change_in_flight_leaves_the_node_as_a_fresh_sync(
    tmp_path: Path, change: str, moment: str
) -> None:
    """The manifest changes and the brain is killed (SIGKILL) with the change in flight:
    whatever of it reached the agent, the next brain's state is what the agent ends with, and
    ``ns/web``, which the change leaves alone, answers throughout."""
    before, after = CHANGES[change]

    def manifest(bed: TestBed, pod: str | None) -> str:
        return _with_api(_web(bed), bed.pod(pod).ip4 if pod else None)

    with _split(tmp_path, ["p1", "p2"], lambda bed: manifest(bed, before)) as split:
        live = split.live
        bed, node = live.bed, live.node
        final = tmp_path / "final.json"
        final.write_text(manifest(bed, after))
        fresh = _fresh(final)
        assert fresh != live.fresh  # the change changes the rules: else nothing is proven

        # 15 s of connections: the kill, a new brain's start and the agent's reconnection (its
        # backoff) in their midst, on a loaded machine.
        client = _probing(bed, node, 15)
        time.sleep(0.5)
        assert split.brain is not None
        brain, agent = split.brain, split.agent
        assert agent is not None
        brain_log = split.logs / "brain-1.log"
        try:
            if moment == "sent":
                agent.send_signal(signal.SIGSTOP)
            live.manifests.write_text(final.read_text())
            if moment == "sent":
                assert poll(lambda: "revision 2:" in brain_log.read_text(), within=10)
                time.sleep(0.5)  # the brain writes the change set into the socket
            elif moment == "applied":
                assert poll(lambda: "incremental" in live.log.read_text(), within=10)
            brain.send_signal(signal.SIGKILL)
            assert brain.wait(timeout=10) == -signal.SIGKILL
        finally:
            agent.send_signal(signal.SIGCONT)
        split.start_brain()
        converged = poll(lambda: _table(node) == fresh, within=12)
        running = client.poll() is None
        results = _answers(client)
        assert converged, split.agent_log()
        assert running, "the client stopped before the agent converged: nothing proven"
        assert len(results) > 20  # one after the other: hundreds on an idle machine
        assert [r for r in results if not r.startswith("p1 ")] == []
        if after is not None:
            assert [a.split()[0] for a in bed.probe(node, "tcp", OTHER_IP, 80)] == [after]
        assert live.answers() == ["p1", "p1"]
        # The rules outlive the agent: that it still runs is not implied by the above.
        assert split.agent is not None
        assert split.agent.poll() is None, split.agent_log()
        assert poll(split.healthy, within=5), live.get(HEALTHZ, "/healthz")
        # The outage as the agent's /metrics tells it: live again, one stream ended, and the
        # second stream's first state (whole, or resumed from what the agent held).
        watch = _watch_metrics(live)
        assert watch["kpng_watch_up"] == 1
        assert watch["kpng_watch_down_seconds"] == 0
        assert sum(v for k, v in watch.items() if k.startswith("kpng_watch_failures_total")) >= 1
        states = {k: v for k, v in watch.items() if k.startswith("kpng_watch_first_states_total")}
        assert sum(states.values()) == 2, states


def _watch_metrics(live: Live) -> dict[str, float]:
    """The agent's ``kpng_watch_*`` samples, by name and labels."""
    code, text = live.get(METRICS, "/metrics")
    assert code == 200
    return {
        f"{sample.name}{sorted(sample.labels.items()) if sample.labels else ''}": sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("kpng_watch_")
    }


def test_an_agent_restarted_while_the_brain_runs_takes_over_without_a_failed_connection(
    tmp_path: Path,
) -> None:
    """The agent is stopped (its rules stay) and started again: the brain sends it the whole
    state, and it ends as a fresh sync, not one connection failing meanwhile."""
    with _split(tmp_path, ["p1"], _web) as split:
        live = split.live
        client = _probing(live.bed, live.node, 12)
        time.sleep(0.5)
        assert split.agent is not None
        split.agent.terminate()
        assert split.agent.wait(timeout=10) == 0
        assert _table(live.node) == live.fresh  # the rules outlive the agent
        split.start_agent()
        running = client.poll() is None
        results = _answers(client)
        assert running, "the client stopped before the takeover: nothing proven"
        assert len(results) > 20
        assert [r for r in results if not r.startswith("p1 ")] == []
        assert _table(live.node) == live.fresh
        assert live.answers() == ["p1", "p1"]
        assert poll(split.healthy, within=5), live.get(HEALTHZ, "/healthz")


# Last in the file: the module's node is made once its tests start, and is not left running
# beside the other tests' nodes.
@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Split]:
    with _split(tmp_path_factory.mktemp("split-faults"), ["p1"], _web) as split:
        yield split


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_is_repaired_by_the_agent_within_the_sync_period(split: Split, fault: str) -> None:
    assert_found_and_repaired(split.live, fault)
    # The agent repaired it alone: the brain is not asked again for a state it already sent.
    assert split.brain is not None
    assert split.brain.poll() is None
