"""to-nft is never silently wrong (over the fake nft): one bad service never holds back the
others, a retry is a full sync, and what another program changes in kpng's table is found,
reported and repaired. tests/kernel/test_nft_faults.py runs the same faults against the kernel."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import pytest

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.auditing import probes
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import TABLE, Options
from kpng.backends._nftables.nftables import NftError, Transaction
from kpng.feeding import FeederStats, SyncStats
from kpng.model.cluster import ServiceKey
from kpng.model.messages import EndpointScopes, ServiceEndpoints
from kpng.status.health import judge
from kpng.testing import states
from kpng.testing.states import keyed_state

ALL = EndpointScopes(Internal=True, External=True, Cluster=True)
_ep = functools.partial(states.endpoint, port_name="p", scopes=ALL)


def _service(name: str, ip: str, *endpoints: str) -> ServiceEndpoints:
    """A NodePort service: its node port from its cluster IP's last byte."""
    node_port = 30000 + int(ip.rsplit(".", 1)[1])
    service = states.service(name, cluster_ip=ip, port_name="p", target_port=0, node_port=node_port)
    return ServiceEndpoints(service, tuple(_ep(e) for e in endpoints))


WEB: ServiceKey = ("ns", "web")
EXTRA: ServiceKey = ("ns", "extra")
NEW: ServiceKey = ("ns", "new")
BAD: ServiceKey = ("ns", "Bad_Name!")


async def _no_sleep(_: float) -> None:
    return None


def _backend(nft: FakeNft, syncs: SyncStats) -> NftBackend:
    return NftBackend(
        nft=nft, options=Options(), sleep=_no_sleep, syncs=syncs, inspect=nft, sync_period=30
    )


def _services() -> dict[ServiceKey, ServiceEndpoints]:
    return {
        WEB: _service("web", "10.96.0.10", "10.244.1.2", "10.244.1.3"),
        EXTRA: _service("extra", "10.96.0.11", "10.244.1.4"),
    }


async def _fresh_dump(services: dict[ServiceKey, ServiceEndpoints]) -> str:
    """kpng's table as a fresh full sync of ``services`` programs it."""
    nft = FakeNft()
    backend = NftBackend(nft=nft, options=Options(), sleep=_no_sleep)
    await backend.apply(keyed_state(1, services))
    await backend.close()
    return nft.dump(only=TABLE)


def test_a_service_with_a_bad_name_is_refused_and_every_other_change_goes_in() -> None:
    """The issue's first finding: a Service named ``Bad_Name!`` arrived beside a new service
    and a deleted one, and the whole change was lost."""

    async def scenario() -> None:
        nft, syncs = FakeNft(), SyncStats()
        backend = _backend(nft, syncs)
        services = _services()
        await backend.apply(keyed_state(1, services))
        del services[EXTRA]
        services[NEW] = _service("new", "10.96.0.12", "10.244.1.5")
        services[BAD] = _service("Bad_Name!", "10.96.0.13", "10.244.1.6")
        await backend.apply(keyed_state(2, services, {NEW, BAD}, {EXTRA}))
        cluster = set(nft.elements(TABLE, "cluster-v4"))
        assert ("10.96.0.12", "tcp", "80") in cluster  # the new service
        assert ("10.96.0.11", "tcp", "80") not in cluster  # the deleted one
        assert "10.96.0.13" not in nft.dump()  # the bad one, left out
        assert syncs.revision == 2
        assert list(syncs.refused_services) == [BAD]
        assert "not a Kubernetes name" in syncs.refused_services[BAD]
        # Deleted, it is no longer refused.
        del services[BAD]
        await backend.apply(keyed_state(3, services, (), {BAD}))
        assert syncs.refused_services == {}
        await backend.close()

    asyncio.run(scenario())


class BrokenOnce(FakeNft):
    """Refuses the next transaction whatever it holds: a kernel that says no once (EPERM, a
    busy netlink socket)."""

    broken = False

    async def run(self, tx: Transaction) -> None:
        if self.broken:
            self.broken = False
            raise NftError("Operation not permitted")
        await super().run(tx)


def test_the_retry_after_any_failure_is_a_full_sync_of_the_whole_state() -> None:
    """A retry sends every service again, unchanged: the backend must not find them all
    recorded already and apply an empty diff."""

    async def scenario() -> None:
        nft, syncs = BrokenOnce(), SyncStats()
        backend = _backend(nft, syncs)
        services = _services()
        await backend.apply(keyed_state(1, services))
        del services[EXTRA]
        services[NEW] = _service("new", "10.96.0.12", "10.244.1.5")
        nft.broken = True
        state = keyed_state(2, services, {NEW}, {EXTRA})
        with pytest.raises(NftError):
            await backend.apply(state)
        assert syncs.revision == 1  # never claimed
        # kpng's Feeder retries with the whole state (every service in ``updated``).
        await backend.apply(keyed_state(2, services))
        assert nft.dump(only=TABLE) == await _fresh_dump(services)
        assert syncs.revision == 2
        await backend.close()

    asyncio.run(scenario())


def _flush_map(nft: FakeNft) -> None:
    nft.tables[("inet", "kpng")].elements["cluster-v4"].clear()


def _delete_table(nft: FakeNft) -> None:
    del nft.tables[("inet", "kpng")]


def _foreign_rule(nft: FakeNft) -> None:
    nft.tables[("inet", "kpng")].rules["services"].append("ip saddr 10.9.9.9 accept")


def _delete_chain(nft: FakeNft) -> None:
    state = nft.tables[("inet", "kpng")]
    del state.chains["pick-cluster-v4-2"], state.rules["pick-cluster-v4-2"]


def _delete_map(nft: FakeNft) -> None:
    state = nft.tables[("inet", "kpng")]
    del state.sets["nodeport-masq-v4"], state.elements["nodeport-masq-v4"]


def _flush_rules(nft: FakeNft) -> None:
    state = nft.tables[("inet", "kpng")]
    for rules in state.rules.values():
        rules.clear()


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        (_delete_table, "table"),
        (_flush_rules, "rules"),
        (_delete_chain, "chain"),
        (_flush_map, "elements"),
        (_foreign_rule, "rules"),
        (_delete_map, "map"),
    ],
    ids=["table-deleted", "ruleset-flushed", "chain-deleted", "map-flushed", "foreign-rule",
         "map-deleted"],
)  # fmt: skip
def test_drift_is_found_reported_and_repaired(
    fault: Callable[[FakeNft], None], kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        nft, syncs = FakeNft(), SyncStats()
        backend = _backend(nft, syncs)
        services = _services()
        await backend.apply(keyed_state(1, services))
        expected = nft.dump(only=TABLE)
        assert expected == await _fresh_dump(services)
        assert await backend.check_kernel() is None  # nobody else committed
        fault(nft)
        nft.touched()
        drift = await backend.check_kernel()
        assert drift is not None
        assert drift.kind == kind
        assert nft.dump(only=TABLE) == expected
        assert syncs.repairs == {kind: 1}
        assert syncs.diverged_since is None
        assert await backend.check_kernel() is None
        await backend.close()

    asyncio.run(scenario())
    repairs = [r for r in caplog.records if "changed by another program" in r.getMessage()]
    assert len(repairs) == 1


def test_others_commits_that_leave_kpngs_table_alone_are_not_drift() -> None:
    async def scenario() -> None:
        nft, syncs = FakeNft(), SyncStats()
        backend = _backend(nft, syncs)
        await backend.apply(keyed_state(1, _services()))
        applied = len(nft.transactions)
        nft.touched()  # another program's table changed
        assert await backend.check_kernel() is None
        assert len(nft.transactions) == applied  # nothing rewritten
        assert syncs.repairs == {}
        await backend.close()

    asyncio.run(scenario())


class Refusing(FakeNft):
    refuse = False

    async def run(self, tx: Transaction) -> None:
        if self.refuse:
            raise NftError("Cannot allocate memory")
        await super().run(tx)


def test_a_divergence_kpng_cannot_repair_turns_healthz_and_livez_false_after_the_timeout() -> None:
    async def scenario() -> None:
        nft, syncs = Refusing(), SyncStats()
        backend = _backend(nft, syncs)
        await backend.apply(keyed_state(1, _services()))
        _delete_table(nft)
        nft.touched()
        nft.refuse = True
        drift = await backend.check_kernel()
        assert drift is not None
        assert drift.kind == "table"
        assert syncs.diverged_since is not None  # not repaired: still diverged
        assert syncs.repairs == {}
        stats = FeederStats(
            last_applied=1.0,
            diverged_since=syncs.diverged_since,
            diverged_why=syncs.diverged_why,
        )
        within = judge(
            backends={"to-nft": stats},
            sources_synced=True,
            node_eligible=True,
            timeout=60,
            monotonic=syncs.diverged_since + 10,
            wall=100.0,
        )
        assert within.healthy
        assert within.live
        late = judge(
            backends={"to-nft": stats},
            sources_synced=True,
            node_eligible=True,
            timeout=60,
            monotonic=syncs.diverged_since + 61,
            wall=100.0,
        )
        assert not late.healthy
        assert not late.live
        assert any("table inet kpng is gone" in r for r in late.body["reasons"])
        # The kernel takes transactions again: the next check repairs it.
        nft.refuse = False
        await backend.check_kernel()
        assert syncs.diverged_since is None
        assert syncs.repairs == {"table": 1}
        await backend.close()

    asyncio.run(scenario())


def _delete_one_element(nft: FakeNft, backend: NftBackend) -> None:
    """One element of a map, not the one the period's check asks for."""
    asked = {(p.container, p.key) for p in probes(backend.store)}
    elements = nft.tables[("inet", "kpng")].elements["cluster-eps-v4-1"]
    (key,) = [k for k in elements if ("cluster-eps-v4-1", k) not in asked][:1]
    del elements[key]


def _edit_rule_in_place(nft: FakeNft, _: NftBackend) -> None:
    rules = nft.tables[("inet", "kpng")].rules["services"]
    rules[-1] = "ip daddr 10.9.9.9 accept"


@pytest.mark.parametrize(
    ("fault", "kind", "slow"),
    [(_delete_one_element, "elements", True), (_edit_rule_in_place, "rules", False)],
    ids=["one-element-deleted", "rule-edited-in-place"],
)
def test_what_no_count_sees_is_found_by_comparing_exactly(
    fault: Callable[[FakeNft, NftBackend], None], kind: str, slow: bool
) -> None:
    """An element deleted alone passes the period's checks (one element is asked for per
    map): the hourly comparison of every element finds it. A rule edited in place keeps the
    counts: its expressions, compared with what kpng's commit left, do not."""

    async def scenario() -> None:
        nft, syncs = FakeNft(), SyncStats()
        backend = _backend(nft, syncs)
        services = {
            WEB: _service("web", "10.96.0.10", "10.244.1.2", "10.244.1.3"),
            NEW: _service("new", "10.96.0.12", "10.244.1.5", "10.244.1.6"),
        }
        await backend.apply(keyed_state(1, services))
        expected = nft.dump(only=TABLE)
        fault(nft, backend)
        nft.touched()
        if slow:
            assert await backend.check_kernel() is None  # not due yet: the fault stays
            assert nft.dump(only=TABLE) != expected
        drift = await backend.check_kernel(full=slow)  # the hour has passed
        assert drift is not None
        assert drift.kind == kind
        assert nft.dump(only=TABLE) == expected
        assert syncs.repairs == {kind: 1}
        assert await backend.check_kernel() is None
        await backend.close()

    asyncio.run(scenario())
