"""to-nft against the kernel, each test in a network namespace of its own (root and nft needed).

What the fake cannot prove: that the kernel accepts the transactions kpng writes, in the order
it writes them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables import syncing as nft_backend
from kpng.backends._nftables.auditing import probes
from kpng.backends._nftables.diffing import TableState, Touched
from kpng.backends._nftables.executing import KernelNft, NetlinkBatches
from kpng.backends._nftables.layout import TABLE, Options, contribute
from kpng.backends._nftables.netlink import ElementEncoder, split_fresh
from kpng.backends._nftables.nftables import (
    Element,
    NftError,
    Operation,
    Transaction,
    error_for_line,
)
from kpng.client import Backoff, NodeState
from kpng.feeding import Fanout, SyncStats
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    EndpointScopes,
    IPFamilies,
    IPFilter,
    IPSet,
    PortMapping,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)
from kpng.testing import states
from kpng.testing.netns import ClusterSpec, TestBed
from kpng.testing.states import keyed_state
from kpng.testing.waiting import poll
from tests.nft_services import churn, generate

ALL = EndpointScopes(Internal=True, External=True, Cluster=True)
WEB: ServiceKey = ("ns", "web")


def _nft(netns: str) -> KernelNft:
    return KernelNft(("ip", "netns", "exec", netns, "nft"))


class RecordingNft(KernelNft):
    """The kernel's nft, remembering every transaction and whether the kernel refused it."""

    def __init__(self, netns: str) -> None:
        super().__init__(("ip", "netns", "exec", netns, "nft"))
        self.runs: list[tuple[Transaction, NftError | None]] = []

    async def run(self, tx: Transaction) -> None:
        try:
            await super().run(tx)
        except NftError as exc:
            self.runs.append((tx, exc))
            raise
        self.runs.append((tx, None))


def _table(netns: str) -> dict[str, object]:
    """kpng's table from the kernel, in an order that depends only on its contents."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-j", "list", "table", "inet", "kpng"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    table: dict[str, object] = {}
    for item in json.loads(out)["nftables"]:
        for kind in ("set", "map", "chain"):
            if kind in item:
                obj = {k: v for k, v in item[kind].items() if k != "handle"}
                obj["elem"] = sorted(json.dumps(e, sort_keys=True) for e in obj.get("elem", []))
                table[f"{kind} {obj['name']}"] = obj
        if "rule" in item:
            rule = item["rule"]
            rules = table.setdefault(f"rules {rule['chain']}", [])
            assert isinstance(rules, list)
            rules.append(json.dumps(rule["expr"], sort_keys=True))
    return table


def _ruleset(netns: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "table", "inet", "kpng"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


_service = functools.partial(states.service, cluster_ip="10.96.0.10", port_name="p", target_port=0)
_ep = functools.partial(states.endpoint, port_name="p")


def test_kernel_takes_a_new_affinity_timeout_incrementally(netns: str) -> None:
    async def scenario() -> None:
        backend = NftBackend(nft=_nft(netns), options=Options())
        services = {WEB: ServiceEndpoints(_service(affinity=60), (_ep("10.244.1.2"),))}
        await backend.apply(keyed_state(1, services))
        services[WEB] = ServiceEndpoints(_service(affinity=30), (_ep("10.244.1.2"),))
        await backend.apply(keyed_state(2, services, updated={WEB}))
        await backend.close()

    asyncio.run(scenario())
    ruleset = _ruleset(netns)
    assert "timeout 30s" in ruleset
    assert "timeout 1m" not in ruleset  # nft lists 60s as 1m


class Killed(BaseException):
    """kpng ending (SIGKILL, a node's reboot) between a first sync's text and its batch."""


class RecordingNetlink(NetlinkBatches):
    """Netlink batches into ``netns``, counted; the first ``refuse`` of them refused as the
    kernel refuses a batch (nothing of it applied), or ended by ``Killed`` (``kill``)."""

    def __init__(self, netns: str, *, refuse: int = 0, kill: bool = False) -> None:
        super().__init__(f"/run/netns/{netns}")
        self.sent = 0
        self._refuse = refuse
        self._kill = kill

    async def send(self, messages: Sequence[bytes]) -> None:
        if self._kill:
            raise Killed
        if self._refuse:
            self._refuse -= 1
            raise NftError("the kernel refused the elements' batch (this test's refusal)")
        await super().send(messages)
        self.sent += 1


def test_a_first_sync_sends_its_elements_as_netlink_and_makes_the_text_paths_table(
    namespaces: Callable[[], str],
) -> None:
    """Where there is no table yet, the elements go as one netlink batch that also wakes the
    table the text made dormant: the kernel then holds what the text alone makes, comments
    (the Services' names) included."""
    by_netlink, by_text = namespaces(), namespaces()
    state = keyed_state(1, generate(300))
    nft = RecordingNft(by_netlink)
    netlink = RecordingNetlink(by_netlink)
    asyncio.run(NftBackend(nft=nft, options=Options(), netlink=netlink).apply(state))
    asyncio.run(NftBackend(nft=_nft(by_text), options=Options()).apply(state))
    assert netlink.sent == 1
    ((text, refused),) = nft.runs
    assert refused is None
    assert "flags dormant" in text.render()
    assert " : goto pick-" not in text.render()  # the dispatch maps' elements went by netlink
    listed = _ruleset(by_netlink)
    assert "dormant" not in listed
    assert 'comment "' in listed.split("map cluster-v4")[1]
    assert listed == _ruleset(by_text)
    assert _table(by_netlink) == _table(by_text)
    # A later full sync (a restart) finds the table and replaces it as text, as before.
    nft.runs.clear()
    asyncio.run(NftBackend(nft=nft, options=Options(), netlink=netlink).apply(state))
    assert netlink.sent == 1
    assert _table(by_netlink) == _table(by_text)  # objects made again list in a new order


def _unencodable(*_: object) -> Iterator[bytes]:
    raise ValueError("element '10.96.0.1 . tcp . 80': this test's")


@pytest.mark.parametrize("failure", ["refused", "unencodable"])
def test_a_failed_netlink_batch_is_followed_at_once_by_the_whole_table_as_text(
    namespaces: Callable[[], str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
) -> None:
    """The kernel refuses the batch, or an element cannot be encoded: the batch is encoded
    while libnftables takes the text, so the dormant table is there either way."""
    netns, expected = namespaces(), namespaces()
    state = keyed_state(1, generate(50))
    netlink = RecordingNetlink(netns, refuse=int(failure == "refused"))
    if failure == "unencodable":
        monkeypatch.setattr(ElementEncoder, "elements", _unencodable)
    backend = NftBackend(nft=_nft(netns), options=Options(), netlink=netlink)
    asyncio.run(backend.apply(state))
    assert "made again with its elements as text" in caplog.text
    asyncio.run(NftBackend(nft=_nft(expected), options=Options()).apply(state))
    listed = _ruleset(netns)
    assert "dormant" not in listed
    assert listed == _ruleset(expected)
    assert netlink.sent == 0


def test_a_dormant_text_in_many_parts_and_a_batch_of_more_messages_than_one_sendmsg_takes(
    namespaces: Callable[[], str],
) -> None:
    """At 100k services a first sync's dormant text goes in 8 parts, and its batch has some
    2,000 messages (a sendmsg takes at most 1,024 buffers, IOV_MAX): the table is the one a
    single text makes."""
    netns = namespaces()
    state = keyed_state(1, generate(300))
    store = TableState(Options())
    for key, se in state.services.items():
        store.update(key, contribute(se, ()), Touched())
    split = split_fresh(store.full(None).tx, message_bytes=1, text_operations=7)
    assert split is not None
    texts, batch = split.texts(), split.batch()
    assert len(texts) > 20
    assert [op for text in texts for op in text.operations] == split.text.operations
    assert len(batch) > 1024
    for text in texts:
        asyncio.run(_nft(netns).run(text))
    asyncio.run(NetlinkBatches(f"/run/netns/{netns}").send(batch))
    expected = namespaces()
    asyncio.run(NftBackend(nft=_nft(expected), options=Options()).apply(state))
    assert _ruleset(netns) == _ruleset(expected)


def test_a_restart_over_a_table_left_dormant_makes_it_anew(
    namespaces: Callable[[], str],
) -> None:
    """kpng ended between a first sync's text and its netlink batch: the next kpng finds the
    dormant table (the kernel takes no new base chain in a transaction that wakes a table) and
    makes it anew, elements by netlink again."""
    netns, expected = namespaces(), namespaces()
    state = keyed_state(1, generate(50))
    left = NftBackend(
        nft=_nft(netns), options=Options(), netlink=RecordingNetlink(netns, kill=True)
    )
    with pytest.raises(Killed):
        asyncio.run(left.apply(state))
    assert "flags dormant" in _ruleset(netns)
    netlink = RecordingNetlink(netns)
    asyncio.run(NftBackend(nft=_nft(netns), options=Options(), netlink=netlink).apply(state))
    asyncio.run(NftBackend(nft=_nft(expected), options=Options()).apply(state))
    assert netlink.sent == 1
    assert _ruleset(netns) == _ruleset(expected)


class RefusingNft(KernelNft):
    """The kernel's nft, but its ``refuse``-th transaction (from 1) is refused."""

    def __init__(self, netns: str, refuse: int) -> None:
        super().__init__(("ip", "netns", "exec", netns, "nft"))
        self._left = refuse

    async def run(self, tx: Transaction) -> None:
        self._left -= 1
        if self._left == 0:
            raise NftError("Operation not supported (this test's refusal)")
        await super().run(tx)


def test_a_refused_part_of_the_dormant_text_fails_the_sync_and_the_retry_makes_the_table_anew(
    namespaces: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dormant table's text goes in parts: one refused leaves a part-made dormant table,
    which no packet sees; the retry finds it dormant and makes it anew."""
    monkeypatch.setattr(
        nft_backend, "split_fresh", functools.partial(split_fresh, text_operations=20)
    )
    netns, expected = namespaces(), namespaces()
    state = keyed_state(1, generate(50))
    netlink = RecordingNetlink(netns)
    backend = NftBackend(nft=RefusingNft(netns, refuse=2), options=Options(), netlink=netlink)
    with pytest.raises(NftError, match="this test's refusal"):
        asyncio.run(backend.apply(state))
    assert "flags dormant" in _ruleset(netns)
    assert netlink.sent == 0
    asyncio.run(backend.apply(state))
    asyncio.run(NftBackend(nft=_nft(expected), options=Options()).apply(state))
    assert netlink.sent == 1
    assert _ruleset(netns) == _ruleset(expected)


def test_kernel_full_sync_over_a_table_keeps_only_the_affinity_memory(
    namespaces: Callable[[], str],
) -> None:
    """A restarted kpng lists what the table holds and replaces all of it but the clients
    remembered for ClientIP affinity, which the kernel's packet path wrote."""
    netns, fresh = namespaces(), namespaces()
    db: ServiceKey = ("ns", "db")
    eps = [_ep(f"10.244.1.{i}") for i in range(1, 4)]
    client = "10.0.0.9 . 1 . 2"

    def services(count: int) -> dict[ServiceKey, ServiceEndpoints]:
        return {
            WEB: ServiceEndpoints(_service(affinity=600), tuple(eps[:count])),
            db: ServiceEndpoints(_service(cluster_ip="10.96.0.20", name="db"), tuple(eps[:count])),
        }

    def apply(where: str, count: int) -> None:
        state = keyed_state(1, services(count))
        asyncio.run(NftBackend(nft=_nft(where), options=Options()).apply(state))

    apply(netns, 3)
    nft = ["ip", "netns", "exec", netns, "nft"]
    add = f"add element inet kpng affinity-v4 {{ {client} timeout 600s }}"
    subprocess.run([*nft, add], check=True)
    listed = asyncio.run(_nft(netns).list_objects(TABLE))
    assert listed is not None
    assert "pick-cluster-v4-3" in listed.chains
    assert "affinity-v4" in listed.sets
    assert "cluster-eps-v4-2" in listed.maps
    # The restart: the endpoints' count changes, so pick chains and endpoint maps go.
    apply(netns, 2)
    apply(fresh, 2)
    memory = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "list", "set", "inet", "kpng", "affinity-v4"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "10.0.0.9 . 1 . 2" in memory
    table = _table(netns)
    affinity = table.pop("set affinity-v4")
    assert isinstance(affinity, dict)
    assert len(affinity["elem"]) == 1
    expected = _table(fresh)
    expected.pop("set affinity-v4")
    assert table == expected


def test_kernel_takes_affinity_endpoint_changes_incrementally(
    namespaces: Callable[[], str],
) -> None:
    """An endpoint going (its clients' set deleted once no rule refers to it) and coming, in
    incremental transactions the kernel takes."""
    changed, fresh = namespaces(), namespaces()
    a, b, c, d = (_ep(f"10.244.1.{i}") for i in range(1, 5))
    revisions = [(a, b, c), (a, b), (a, b, d), (b,), (a, b, c, d)]

    async def scenario() -> None:
        nft = RecordingNft(changed)
        backend = NftBackend(nft=nft, options=Options())
        for revision, eps in enumerate(revisions, 1):
            services = {WEB: ServiceEndpoints(_service(affinity=60, node_port=30080), eps)}
            await backend.apply(keyed_state(revision, services, updated={WEB}))
        await backend.close()
        assert [str(err) for _, err in nft.runs if err is not None] == []
        assert len(nft.runs) == len(revisions)

    asyncio.run(scenario())
    last = {WEB: ServiceEndpoints(_service(affinity=60, node_port=30080), revisions[-1])}
    asyncio.run(NftBackend(nft=_nft(fresh), options=Options()).apply(keyed_state(1, last)))
    assert _table(changed) == _table(fresh)


_HEALTH_CLIENT = """
import asyncio, json
from kpng.backends._healthchecks import HealthServers
from kpng.model.messages import Endpoint, IPSet, Service, ServiceEndpoints

async def get(host):
    reader, writer = await asyncio.open_connection(host, 32000)
    writer.write(b"GET /healthz HTTP/1.1\\r\\nHost: n\\r\\n\\r\\n")
    data = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    return data.split(b"\\r\\n")[0].decode() + " " + data.partition(b"\\r\\n\\r\\n")[2].decode()

async def main():
    health = HealthServers()
    ep = Endpoint(IPs=IPSet(V4=("10.1.0.2",)), Local=True, Ready=True)
    await health.update({("ns", "lb"): ServiceEndpoints(Service(HealthCheckNodePort=32000), (ep,))})
    print(json.dumps([await get("127.0.0.1"), await get("::1")]))
    await health.close()

asyncio.run(main())
"""


def test_health_check_node_port_serves_both_families_on_every_address(netns: str) -> None:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", _HEALTH_CLIENT],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    body = {"service": {"namespace": "ns", "name": "lb"}, "localEndpoints": 1}
    expected = f"HTTP/1.1 200 OK {json.dumps({**body, 'serviceProxyHealthy': True})}"
    assert json.loads(out) == [expected, expected]


def test_kernel_takes_every_incremental_transaction_and_ends_as_a_full_sync(
    namespaces: Callable[[], str],
) -> None:
    """Random changes to generated services of every shape: the kernel refuses none of the
    incremental transactions, and the table ends as one full sync of the last state writes it."""
    states = churn(300, seed=4, revisions=21, per_revision=25)
    options = Options(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))
    changed, fresh = namespaces(), namespaces()

    async def scenario() -> None:
        nft = RecordingNft(changed)
        backend = NftBackend(nft=nft, options=options)
        for state in states:
            await backend.apply(state)
        await backend.close()
        refused = [(tx.render()[:200], str(err)) for tx, err in nft.runs if err is not None]
        assert refused == []
        assert len(nft.runs) == 21

    asyncio.run(scenario())
    last = keyed_state(1, states[-1].services)
    asyncio.run(NftBackend(nft=_nft(fresh), options=options).apply(last))
    assert _table(changed) == _table(fresh)


def _manifest(bed: TestBed, cluster_ip: str) -> str:
    pod = bed.pod("p1")
    objects = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}},
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web", "namespace": "ns"},
            "spec": {
                "clusterIP": cluster_ip,
                "clusterIPs": [cluster_ip],
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "web-x",
                "namespace": "ns",
                "labels": {"kubernetes.io/service-name": "web"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [pod.ip4], "nodeName": "node-1", "conditions": {"ready": True}}
            ],
        },
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


def _start_kpng(bed: TestBed, manifests: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "kpng", "--log-level", "debug", "file", "--input"]
    argv += [str(manifests), "to-local", "--node-name", "node-1", "to-nft"]
    with log.open("wb") as stderr:
        return bed.spawn(bed.nodes["node-1"].netns, argv, stderr=stderr)


def _synced(log: Path) -> bool:
    return "applied a full transaction" in log.read_text()


def test_restart_takes_over_the_rules_without_a_failed_connection(tmp_path: Path) -> None:
    """kpng is stopped (its rules stay) and started again while the node keeps opening
    connections to a service: not one fails."""
    cluster_ip = "10.96.0.10"
    with TestBed(ClusterSpec.parse({"node-1": ["p1"]})) as bed:
        node = bed.nodes["node-1"].netns
        manifests = tmp_path / "manifests"
        manifests.mkdir()
        (manifests / "cluster.json").write_text(_manifest(bed, cluster_ip))
        first = _start_kpng(bed, manifests, tmp_path / "first.log")
        assert poll(lambda: _synced(tmp_path / "first.log"), within=20)
        assert bed.probe(node, "tcp", cluster_ip, 80) == [f"p1 {bed.nodes['node-1'].ip4}"]

        # Connections one after the other for 10 s, the restart in their midst (a loaded
        # machine may take seconds to start the second kpng).
        argv = [sys.executable, "-m", "kpng.testing.probe", "tcp", cluster_ip, "80"]
        client = bed.spawn(node, [*argv, "--for", "10", "--timeout", "1"], stdout=subprocess.PIPE)
        time.sleep(0.5)
        first.terminate()
        assert first.wait(timeout=10) == 0
        assert "chain pick-cluster-v4-1" in bed.exec(node, ["nft", "list", "table", "inet", "kpng"])
        second = _start_kpng(bed, manifests, tmp_path / "second.log")
        assert poll(lambda: _synced(tmp_path / "second.log"), within=20)
        assert client.poll() is None, "the client stopped before the takeover: nothing proven"
        out, _ = client.communicate(timeout=120)
        results = json.loads(out)["results"]
        assert len(results) > 20  # one after the other: hundreds on an idle machine
        failed = [r for r in results if not r.startswith("p1 ")]
        assert failed == []
        assert second.poll() is None


class FailingOnceNft(RecordingNft):
    """The kernel's nft; with ``fail_next`` set, the next transaction gets an element the
    kernel refuses (its set does not exist) as its last line."""

    fail_next = False

    async def run(self, tx: Transaction) -> None:
        if self.fail_next:
            self.fail_next = False
            bad = Operation("add", Element("no-such-set", ("10.0.0.1",)))
            tx = Transaction(tx.table, [*tx.operations, bad])
        await super().run(tx)


def test_refused_transaction_keeps_the_rules_is_logged_and_followed_by_a_full_resync(
    netns: str, caplog: pytest.LogCaptureFixture
) -> None:
    db: ServiceKey = ("ns", "db")

    async def scenario() -> None:
        nft = FailingOnceNft(netns)
        gate = asyncio.Event()

        async def backoff(_: float) -> None:
            await gate.wait()  # the retry waits for the test, not for a clock

        backend = NftBackend(nft=nft, options=Options())
        # Fed as kpng feeds it: the Feeder retries, here when the test says.
        fanout = Fanout([("to-nft", backend)])
        fanout.feeders[0]._backoff = Backoff(initial=0.01, sleep=backoff)
        services = {WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),))}
        await fanout.apply(keyed_state(1, services))
        before = _table(netns)
        nft.fail_next = True
        services[db] = ServiceEndpoints(
            _service(cluster_ip="10.96.0.20", name="db"), (_ep("10.244.1.3"),)
        )
        assert await fanout.apply(keyed_state(2, services, updated={db})) is False
        assert nft.runs[1][1] is not None  # refused...
        assert _table(netns) == before  # ...and nothing of it applied
        # The services are checked alone, in a table no packet sees: the kernel takes them,
        # so the refusal was not theirs, and the Feeder retries.
        checked, error = nft.runs[2]
        assert error is None
        assert checked.render().startswith("add table inet kpng-check")
        gate.set()
        assert await _eventually(lambda: len(nft.runs) == 4)
        retried, error = nft.runs[3]
        assert error is None
        assert retried.render().startswith("add table inet kpng")  # a full resync
        assert "10.96.0.20" in _ruleset(netns)
        await fanout.close()

    asyncio.run(scenario())
    assert "the incremental transaction of 3 operations was refused" in caplog.text
    assert "add element inet kpng no-such-set { 10.0.0.1 }" in caplog.text  # the failing line


async def _eventually(condition: Callable[[], bool]) -> bool:
    """Await until ``condition`` holds (checked every 10 ms), for 10 s at most."""
    for _ in range(1000):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


class SctpLessKernelNft(RecordingNft):
    """The kernel's nft, as if the kernel lacked SCTP: a transaction with an SCTP element is
    refused, naming its first such line."""

    async def run(self, tx: Transaction) -> None:
        for n, (line, _) in enumerate(tx.lines(), start=1):
            if " . sctp . " in line:
                raise error_for_line(tx, line_number=n, message="Operation not supported")
        await super().run(tx)


def test_services_the_kernel_refuses_are_found_and_left_out_and_the_rest_programmed(
    namespaces: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    services = generate(150, seed=8)
    sctp = {
        key for key, se in services.items() if any(p.Protocol == "SCTP" for p in se.service.Ports)
    }
    assert 0 < len(sctp) < len(services)
    options = Options(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))
    refusing, fresh = namespaces(), namespaces()

    syncs = SyncStats()

    async def scenario() -> None:
        backend = NftBackend(nft=SctpLessKernelNft(refusing), options=options, syncs=syncs)
        await backend.apply(keyed_state(1, services))
        await backend.close()

    asyncio.run(scenario())
    rest = {key: se for key, se in services.items() if key not in sctp}
    asyncio.run(NftBackend(nft=_nft(fresh), options=options).apply(keyed_state(1, rest)))
    assert _table(refusing) == _table(fresh)
    left_out = {
        r.getMessage().split(":")[0].removeprefix("service ")
        for r in caplog.records
        if "left out until it changes" in r.getMessage()
    }
    assert left_out == {f"{ns}/{name}" for ns, name in sctp}
    # One apply, two transactions: only to-nft knows the first failed (kube-proxy's failure
    # count) and the second put revision 1 in place.
    assert (syncs.failures, syncs.full.count, syncs.revision) == (1, 1, 1)


def test_kernel_takes_overlapping_source_ranges(netns: str) -> None:
    lb = Service(
        Namespace="ns",
        Name="lb",
        Type="LoadBalancer",
        IPs=ServiceIPs(
            ClusterIPs=IPSet(V4=("10.96.0.10",)), LoadBalancerIPs=IPSet(V4=("192.0.2.9",))
        ),
        Ports=(
            PortMapping(Name="p", Protocol="TCP", Port=80, UsableEndpoints=IPFamilies(V4=True)),
        ),
        IPFilters=(
            IPFilter(
                TargetIPs=IPSet(V4=("192.0.2.9",)),
                SourceRanges=("10.0.0.0/8", "10.1.0.0/16", "192.168.1.0/24", "192.168.0.0/23"),
            ),
        ),
    )
    nft = RecordingNft(netns)
    services = {("ns", "lb"): ServiceEndpoints(lb, (_ep("10.244.1.2"),))}
    asyncio.run(NftBackend(nft=nft, options=Options()).apply(keyed_state(1, services)))
    assert [error for _, error in nft.runs] == [None]
    allowed = _ruleset(netns).split("set firewall-allow-v4")[1].split("}")[0]
    assert "10.0.0.0/8" in allowed
    assert "192.168.0.0/23" in allowed


def test_the_drift_checks_find_nothing_after_kpngs_own_changes_and_what_another_program_did(
    netns: str,
) -> None:
    """Against the kernel's own answers: after a full sync and twenty incremental ones of
    generated services of every shape (dual stack, SCTP, affinity, source ranges...), neither the
    period's check nor the exact comparison of every element sees a difference; an element
    deleted alone, then a rule replaced in place, are each found and repaired."""
    states = churn(300, seed=5, revisions=21, per_revision=25)
    options = Options(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))

    def nft(command: str) -> None:
        subprocess.run(["ip", "netns", "exec", netns, "nft", command], check=True)

    async def scenario() -> list[str | None]:
        syncs = SyncStats()
        backend = NftBackend(
            nft=_nft(netns),
            options=options,
            netlink=NetlinkBatches(f"/run/netns/{netns}"),
            sync_period=30,
            full_check_period=0.0,  # every check compares every element
            syncs=syncs,
        )
        found: list[str | None] = []
        for state in states:
            await backend.apply(state)
            nft("add table ip other")  # another program's commit: every check runs in full
            drift = await backend.check_kernel()
            found.append(None if drift is None else drift.detail)
        # Not the element the period's check asks for: only the exact comparison sees it.
        asked = {(p.container, p.key) for p in probes(backend.store)}
        element = next(
            e
            for e in backend.store.applied_elements
            if e[0] == "cluster-eps-v4-1" and e not in asked
        )
        nft(f"delete element inet kpng {element[0]} {{ {' . '.join(element[1])} }}")
        drift = await backend.check_kernel()
        found.append(None if drift is None else drift.kind)
        handle = _last_rule_handle(netns, "services")
        nft(f"replace rule inet kpng services handle {handle} ip daddr 10.9.9.9 accept")
        drift = await backend.check_kernel()
        found.append(None if drift is None else drift.kind)
        assert syncs.repairs == {"elements": 1, "rules": 1}
        await backend.close()
        return found

    assert asyncio.run(scenario()) == [None] * 21 + ["elements", "rules"]
    fresh = keyed_state(1, states[-1].services)
    assert _table(netns) == _table_of(fresh, options)


def _last_rule_handle(netns: str, chain: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "nft", "-j", "-a", "list", "chain", "inet", "kpng", chain],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(json.loads(out)["nftables"][-1]["rule"]["handle"])


def _table_of(state: NodeState, options: Options) -> dict[str, object]:
    """kpng's table as a fresh full sync of ``state`` writes it, in a namespace of its own."""
    name = f"kpng-fresh-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        asyncio.run(NftBackend(nft=_nft(name), options=options).apply(state))
        return _table(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
