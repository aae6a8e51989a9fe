"""kube-proxy's metrics as kpng exports them, and the two kpng metrics a refused transaction
used to get wrong. The kernel tests run to-nft in a network namespace of their own."""

from __future__ import annotations

import asyncio
import errno
import logging
import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.layout import Options
from kpng.client import KpngError, NodeState, ProxyMode
from kpng.feeding import Fanout, Feeder, SyncStats, no_local_endpoints
from kpng.model import k8s
from kpng.model.cluster import ServiceKey, Slice
from kpng.model.converting import slice_from_k8s
from kpng.model.messages import (
    Endpoint,
    EndpointScopes,
    IPFamilies,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)
from kpng.status import Status
from kpng.status.metrics import scrape
from kpng.store import Store
from kpng.testing.states import keyed_state
from tests.kernel.test_nft_kernel import WEB, _ep, _service

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
IPV4 = (("ip_family", "IPv4"),)
IPV6 = (("ip_family", "IPv6"),)
TO_NFT = (("backend", "to-nft"),)


def _scrape(status: Status) -> Samples:
    text = scrape(status).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class _Recorder:
    """A backend that takes every state (what is measured here is kpng's bookkeeping)."""

    def __init__(self) -> None:
        self.revisions: list[int] = []

    async def apply(self, state: NodeState) -> bool:
        self.revisions.append(state.revision)
        return False

    async def close(self) -> None:
        pass


class _Refusing(_Recorder):
    """A backend whose every sync fails (the kernel refuses its rules)."""

    async def apply(self, state: NodeState) -> bool:
        raise KpngError("refused")


def _failed_once(modes: dict[str, ProxyMode]) -> Samples:
    """A scrape once each backend named (``to-iptables``, ``to-nft``...), of the kube-proxy mode
    given, failed one sync."""

    async def scenario() -> Samples:
        status = Status(timeout=60.0)
        feeders = [Feeder(n, _Refusing(), proxy_mode=mode) for n, mode in modes.items()]
        status.track(Fanout(feeders))
        for feeder in feeders:
            feeder.offer(keyed_state(1, {}))
            assert not await feeder.feed_pending(stop_on_failure=True)
        return _scrape(status)

    return asyncio.run(scenario())


IPTABLES_FAILURES = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
NFTABLES_FAILURES = "kubeproxy_sync_proxy_rules_nftables_sync_failures_total"


def test_an_iptables_backends_failures_are_iptables_restore_failures_only() -> None:
    """kube-proxy registers its own mode's failure counter alone: an iptables-mode alert reads
    ``iptables_restore_failures_total``, and an nftables counter would be a mode not running."""
    samples = _failed_once({"to-iptables": "iptables"})
    for fam in (IPV4, IPV6):
        assert samples[(IPTABLES_FAILURES, fam)] == 1
    assert not [name for name, _ in samples if "nftables" in name]


def test_each_backend_counts_its_failures_under_its_own_mode() -> None:
    samples = _failed_once({"to-iptables": "iptables", "to-nft": "nftables", "to-x": "nftables"})
    for fam in (IPV4, IPV6):
        assert samples[(IPTABLES_FAILURES, fam)] == 1
        assert samples[(NFTABLES_FAILURES, fam)] == 2


def _slice(name: str, ip: str, trigger: float, *, v6: bool = False) -> Slice:
    meta = k8s.ObjectMeta(
        name=name,
        namespace="ns",
        labels={"kubernetes.io/service-name": "web"},
        annotations={
            "endpoints.kubernetes.io/last-change-trigger-time": time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(trigger)
            )
        },
    )
    obj = k8s.EndpointSlice(
        api_version="discovery.k8s.io/v1",
        metadata=meta,
        address_type="IPv6" if v6 else "IPv4",
        endpoints=[k8s.Endpoint(addresses=[ip])],
    )
    converted = slice_from_k8s(obj)
    assert converted is not None
    return converted


@pytest.mark.slow
def test_network_programming_runs_from_the_trigger_time_to_the_rules_applied() -> None:
    async def scenario() -> None:
        store = Store()
        status = Status(timeout=60.0)
        status.store = store
        status.started = time.time() - 60
        source = store.source("kube")
        source.set_service(WEB, Service(Namespace="ns", Name="web"))
        # Changed before kpng started: not kpng's to time, as in kube-proxy.
        source.set_slice(("ns", "old"), _slice("old", "10.244.0.9", time.time() - 3600))
        changes = store.subscribe()  # what to-local reads: the triggers come with the changes
        source.mark_synced()
        recorder = _Recorder()
        fanout = status.track(Fanout([("to-x", recorder)]))

        async def next_state() -> NodeState:
            delta = await anext(changes)
            return msgspec.structs.replace(keyed_state(delta.revision, {}), triggers=delta.triggers)

        await fanout.apply(await next_state())
        before = _scrape(status)
        assert before[("kubeproxy_network_programming_duration_seconds_count", IPV4)] == 0
        assert before[("kubeproxy_sync_proxy_rules_service_changes_total", ())] == 1
        assert before[("kubeproxy_sync_proxy_rules_endpoint_changes_total", ())] == 1
        assert before[("kubeproxy_sync_proxy_rules_endpoint_changes_pending", ())] == 0

        triggered = time.time() - 3
        source.set_slice(("ns", "a"), _slice("a", "10.244.0.1", triggered))
        source.set_slice(("ns", "b"), _slice("b", "fd00::1", triggered, v6=True))
        source.commit()
        pending = _scrape(status)
        assert pending[("kubeproxy_sync_proxy_rules_endpoint_changes_pending", ())] == 2
        assert pending[("kubeproxy_sync_proxy_rules_endpoint_changes_total", ())] == 3
        assert pending[("kubeproxy_network_programming_duration_seconds_count", IPV4)] == 0

        await fanout.apply(await next_state())
        after = _scrape(status)
        assert after[("kubeproxy_sync_proxy_rules_endpoint_changes_pending", ())] == 0
        for fam in (IPV4, IPV6):
            assert after[("kubeproxy_network_programming_duration_seconds_count", fam)] == 1
            seconds = after[("kubeproxy_network_programming_duration_seconds_sum", fam)]
            assert 2.0 <= seconds < 60.0
            # kube-proxy's buckets: 3 s and more, not 2 s (the annotation has whole seconds).
            within_2s = (*fam, ("le", "2"))
            assert after[("kubeproxy_network_programming_duration_seconds_bucket", within_2s)] == 0
        assert recorder.revisions == [1, 2]

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_change_waits_for_every_backend_before_it_counts_as_programmed() -> None:
    async def scenario() -> None:
        store = Store()
        status = Status(timeout=60.0, started=time.time() - 60)
        status.store = store
        source = store.source("kube")
        source.set_slice(("ns", "a"), _slice("a", "10.244.0.1", time.time() - 1))
        changes = store.subscribe()
        source.mark_synced()
        fanout = status.track(Fanout([("to-x", _Recorder()), ("to-y", _Recorder())]))
        fast, slow = fanout.feeders
        delta = await anext(changes)
        state = msgspec.structs.replace(keyed_state(delta.revision, {}), triggers=delta.triggers)
        # the state as to-local hands it to the fanout, which tells its listeners first
        for listener in fanout.listeners:
            listener(state)
        fast.offer(state)
        await fast.feed_pending()
        programmed = ("kubeproxy_network_programming_duration_seconds_count", IPV4)
        assert _scrape(status)[programmed] == 0
        assert _scrape(status)[("kubeproxy_sync_proxy_rules_endpoint_changes_pending", ())] == 1
        slow.offer(state)
        await slow.feed_pending()
        assert _scrape(status)[programmed] == 1
        await fanout.close()

    asyncio.run(scenario())


def test_a_trigger_time_that_is_not_rfc3339_is_ignored_and_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    meta = k8s.ObjectMeta(
        name="a",
        namespace="ns",
        labels={"kubernetes.io/service-name": "web"},
        annotations={"endpoints.kubernetes.io/last-change-trigger-time": "yesterday"},
    )
    obj = k8s.EndpointSlice(api_version="discovery.k8s.io/v1", metadata=meta, address_type="IPv4")
    with caplog.at_level(logging.WARNING):
        converted = slice_from_k8s(obj)
    assert converted is not None
    assert converted.trigger_time == 0.0
    assert "EndpointSlice ns/a: annotation" in caplog.text
    assert "'yesterday'" in caplog.text


def _local_service(*, itp: bool, etp: bool, node_port: int, v4: bool, v6: bool) -> Service:
    return Service(
        Namespace="ns",
        Name="web",
        Type="NodePort" if node_port else "ClusterIP",
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=("10.96.0.10",), V6=("fd00::10",))),
        Ports=(
            PortMapping(
                Name="p",
                Protocol="TCP",
                Port=80,
                NodePort=node_port,
                UsableEndpoints=IPFamilies(V4=v4, V6=v6),
            ),
        ),
        InternalTrafficToLocal=itp,
        ExternalTrafficToLocal=etp,
    )


def _endpoint(ip: str, *, internal: bool, external: bool) -> Endpoint:
    v6 = ":" in ip
    return Endpoint(
        IPs=IPSet(V6=(ip,)) if v6 else IPSet(V4=(ip,)),
        PortOverrides=(PortName(Name="p", Port=8080, Protocol="TCP"),),
        Scopes=EndpointScopes(Internal=internal, External=external, Cluster=True),
    )


REMOTE_ONLY = _endpoint("10.244.1.2", internal=False, external=False)
LOCAL = _endpoint("10.244.0.2", internal=True, external=True)

# (iTP Local, eTP Local, node port, usable v4, usable v6, endpoints, expected counts)
NO_LOCAL_CASES: dict[
    str, tuple[bool, bool, int, bool, bool, tuple[Endpoint, ...], dict[tuple[str, str], int]]
] = {
    "cluster policies: never counted": (False, False, 30080, True, True, (REMOTE_ONLY,), {}),
    "iTP Local, endpoints elsewhere only": (
        True, False, 0, True, False, (REMOTE_ONLY,), {("internal", "IPv4"): 1},
    ),
    "iTP Local, no endpoint anywhere: rejected, not counted": (
        True, False, 0, False, False, (), {},
    ),
    "iTP Local with a local endpoint": (True, False, 0, True, False, (LOCAL,), {}),
    "eTP Local on a ClusterIP service: no external traffic": (
        False, True, 0, True, False, (REMOTE_ONLY,), {},
    ),
    "eTP Local node port, endpoints elsewhere, both families": (
        False, True, 30080, True, True,
        (REMOTE_ONLY, _endpoint("fd00::2", internal=False, external=False)),
        {("external", "IPv4"): 1, ("external", "IPv6"): 1},
    ),
    "both Local, a local endpoint in IPv4 only": (
        True, True, 30080, True, True,
        (LOCAL, _endpoint("fd00::2", internal=False, external=False)),
        {("internal", "IPv6"): 1, ("external", "IPv6"): 1},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", NO_LOCAL_CASES)
def test_no_local_endpoints_counts_the_ports_whose_local_policy_drops(case: str) -> None:
    itp, etp, node_port, v4, v6, endpoints, expected = NO_LOCAL_CASES[case]
    service = _local_service(itp=itp, etp=etp, node_port=node_port, v4=v4, v6=v6)
    assert dict(no_local_endpoints(ServiceEndpoints(service, endpoints))) == expected


@pytest.mark.slow
def test_no_local_endpoints_follow_the_services_changed_and_deleted() -> None:
    async def scenario() -> None:
        status = Status(timeout=60.0)
        fanout = status.track(Fanout([("to-x", _Recorder())]))
        dropping = ServiceEndpoints(
            _local_service(itp=True, etp=False, node_port=0, v4=True, v6=False), (REMOTE_ONLY,)
        )
        served = ServiceEndpoints(dropping.service, (LOCAL,))
        other: ServiceKey = ("ns", "other")
        labels = (("ip_family", "IPv4"), ("traffic_policy", "internal"))
        key = ("kubeproxy_sync_proxy_rules_no_local_endpoints_total", labels)
        await fanout.apply(keyed_state(1, {WEB: dropping, other: dropping}))
        assert _scrape(status)[key] == 2
        await fanout.apply(keyed_state(2, {WEB: served, other: dropping}, updated={WEB}))
        assert _scrape(status)[key] == 1
        await fanout.apply(keyed_state(3, {WEB: served}, updated=(), deleted={other}))
        assert _scrape(status)[key] == 0

    asyncio.run(scenario())


@pytest.mark.slow
def test_refused_services_and_drift_repairs_are_on_metrics_and_in_the_state_view() -> None:
    """A service to-nft cannot write is counted and named; another program's change to its
    table is reported while it lasts, and counted by kind once repaired."""
    from kpng.backends._nftables.fake import FakeNft
    from kpng.status.serving import _debug_handlers

    async def scenario() -> tuple[Samples, Samples, Samples, dict[str, object]]:
        nft = FakeNft()
        syncs = SyncStats()
        backend = NftBackend(nft=nft, options=Options(), syncs=syncs, inspect=nft, sync_period=30)
        status = Status(timeout=60.0)
        status.track(Fanout([Feeder("to-nft", backend, sync=syncs, reports_syncs=True)]))
        bad: ServiceKey = ("ns", "Bad_Name!")
        services = {
            WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),)),
            bad: ServiceEndpoints(_service(name="Bad_Name!", cluster_ip="10.96.0.20"), ()),
        }
        await status.fanouts[0].apply(keyed_state(1, services))
        applied = _scrape(status)
        del nft.tables[("inet", "kpng")]
        nft.touched()
        syncs.diverged(kind="table", detail="found by hand")  # as a check finds it, before
        diverged = _scrape(status)
        await backend.check_kernel()
        repaired = _scrape(status)
        reply = await _debug_handlers(status)["/debug/state"](None)  # type: ignore[arg-type]
        await backend.close()
        return applied, diverged, repaired, msgspec.json.decode(reply.body)

    applied, diverged, repaired, state = asyncio.run(scenario())
    assert applied[("kpng_backend_refused_services", TO_NFT)] == 1
    assert applied[("kpng_backend_diverged", TO_NFT)] == 0
    assert diverged[("kpng_backend_diverged", TO_NFT)] == 1
    assert repaired[("kpng_backend_diverged", TO_NFT)] == 0
    table = (("backend", "to-nft"), ("kind", "table"))
    assert repaired[("kpng_backend_drift_repairs_total", table)] == 1
    refused = state["refused"]
    assert isinstance(refused, dict)
    assert list(refused["to-nft"]) == ["ns/Bad_Name!"]
    assert "not a Kubernetes name" in refused["to-nft"]["ns/Bad_Name!"]


KUBE_PROXY_SYNC_BUCKETS = [
    "0.001", "0.002", "0.004", "0.008", "0.016", "0.032", "0.064", "0.128", "0.256", "0.512",
    "1.024", "2.048", "4.096", "8.192", "16.384", "+Inf",
]  # fmt: skip
"""kube-proxy's ExponentialBuckets(0.001, 2, 15), of its sync and reconciler durations."""
RECONCILED_S = "kubeproxy_conntrack_reconciler_sync_duration_seconds"
RECONCILED_DELETED = "kubeproxy_conntrack_reconciler_deleted_entries_total"


@pytest.mark.slow
def test_the_udp_conntrack_cleanup_is_kube_proxys_conntrack_reconciler() -> None:
    """Each family's reconciliation after a sync is timed, in kube-proxy's buckets, and its
    deleted flows counted; before the first there is no series, as in kube-proxy."""
    from kpng.backends._conntrack import Flow, Reconciled
    from kpng.backends._nftables.fake import FakeNft
    from tests.pure.test_nft_backend import TO_2, FakeConntrack, _state, _udp_ep, _udp_service

    async def scenario() -> tuple[Samples, Samples]:
        reconciled: dict[str, Reconciled] = {}
        v6 = Flow("fd00::10", "53", "fd00:244::9", "5353")  # to an endpoint gone
        conntrack = FakeConntrack(TO_2, v6, reconciled=reconciled)
        syncs = SyncStats()
        backend = NftBackend(nft=FakeNft(), options=Options(), conntrack=conntrack, syncs=syncs)
        status = Status(timeout=60.0, conntrack=reconciled)
        status.track(Fanout([Feeder("to-nft", backend, sync=syncs, reports_syncs=True)]))
        before = _scrape(status)
        await status.fanouts[0].apply(_state(1, {WEB: _udp_service(_udp_ep("10.244.1.3"))}))
        return before, _scrape(status)

    before, after = asyncio.run(scenario())
    assert not [name for name, _ in before if name.startswith("kubeproxy_conntrack_")]
    # The v6 flow's service has no IPv6 frontend: that family is reconciled, nothing deleted.
    assert after[(RECONCILED_DELETED, IPV4)] == 1
    assert after[(RECONCILED_DELETED, IPV6)] == 0
    for fam in (IPV4, IPV6):
        assert after[(f"{RECONCILED_S}_count", fam)] == 1
        bounds = [labels for name, labels in after if name == f"{RECONCILED_S}_bucket"]
        les = [dict(labels)["le"] for labels in bounds if dict(labels)["ip_family"] == fam[0][1]]
        assert les == KUBE_PROXY_SYNC_BUCKETS


def test_the_reconciler_counts_what_the_kernel_deleted_and_skips_an_unlisted_family() -> None:
    """The deleted count is the kernel's own (a flow that expired meanwhile is not counted); a
    family it refuses to list (no IPv6 conntrack on the node) is neither timed nor counted, as
    kube-proxy returns before observing."""
    from collections.abc import Collection, Sequence

    from kpng.backends._conntrack import Conntrack, Flow, Reconciled

    class Table(Conntrack):
        async def udp_flows(
            self, family: str, frontends: Collection[tuple[str, str]]
        ) -> list[Flow]:
            if family == "IPv6":
                raise OSError(errno.EAFNOSUPPORT, "no IPv6 conntrack")
            gone = Flow("10.96.0.10", "53", "10.244.1.2", "5353", "10.0.0.1", "1000")
            return [gone, gone._replace(orig_sport="1001"), gone._replace(orig_sport="1002")]

        async def delete(self, flows: Sequence[Flow]) -> int:
            return len(flows) - 1

    reconciled: dict[str, Reconciled] = {}
    frontends = {
        ("10.96.0.10", "53"): frozenset({("10.244.1.3", "5353")}),
        ("", "30053"): frozenset(),
    }
    asyncio.run(Table(reconciled=reconciled).clean_stale(frontends))
    assert list(reconciled) == ["IPv4"]
    assert (reconciled["IPv4"].count, reconciled["IPv4"].deleted) == (1, 2)
    samples = _scrape(Status(timeout=60.0, conntrack=reconciled))
    assert samples[(RECONCILED_DELETED, IPV4)] == 2
    assert (RECONCILED_DELETED, IPV6) not in samples


def test_the_sync_durations_have_kube_proxys_ip_family_and_buckets() -> None:
    """All three (every sync, full, partial) are per ``ip_family`` in 1.37, a sync of kpng's
    ``inet`` table counting for both; nftables mode's cleanup counter is absent, as kube-proxy
    shows none before a failure of a cleanup transaction kpng does not have."""

    async def scenario() -> Samples:
        status = Status(timeout=60.0)
        fanout = status.track(Fanout([("to-x", _Recorder())]))
        await fanout.apply(keyed_state(1, {}))
        await fanout.apply(keyed_state(2, {}, updated=()))
        return _scrape(status)

    samples = asyncio.run(scenario())
    for name, count in (
        ("kubeproxy_sync_proxy_rules_duration_seconds", 2),
        ("kubeproxy_sync_full_proxy_rules_duration_seconds", 1),
        ("kubeproxy_sync_partial_proxy_rules_duration_seconds", 1),
    ):
        for fam in (IPV4, IPV6):
            assert samples[(f"{name}_count", fam)] == count
            les = [
                dict(labels)["le"]
                for n, labels in samples
                if n == f"{name}_bucket" and dict(labels)["ip_family"] == fam[0][1]
            ]
            assert les == KUBE_PROXY_SYNC_BUCKETS
    assert not [n for n, _ in samples if "cleanup_failures" in n]
