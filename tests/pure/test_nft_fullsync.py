"""The full sync's fast path against the typed one, and the diff store against full syncs.

A full sync renders its elements in batches (``Elements``) without making an ``Element`` each;
these tests hold it to the typed path on thousands of generated services of every shape: the
same text, every field valid, and the same table as any sequence of incremental changes that
reaches the same state.
"""

from __future__ import annotations

import asyncio

import pytest

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.diffing import TableState, Touched
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import AFFINITY_SETS, TABLE, Options, contribute
from kpng.backends._nftables.nftables import Elements, Operation, TableObjects, Transaction
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.testing.states import keyed_state
from tests.nft_services import churn, generate

# Thousands of generated services a test: `make check` leaves them to `make test`.
pytestmark = pytest.mark.slow

OPTIONS = Options(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))


def _typed(tx: Transaction) -> Transaction:
    """``tx`` with every ``Elements`` made into validated ``Element``s, one operation each."""
    typed = Transaction(tx.table)
    for op in tx.operations:
        if isinstance(op.obj, Elements):
            typed.operations += [Operation("add", element) for element in op.obj.expand()]
        else:
            typed.operations.append(op)
    return typed


def _store(services: dict[ServiceKey, ServiceEndpoints]) -> TableState:
    store = TableState(OPTIONS)
    touched = Touched()
    for key, se in services.items():
        store.update(key, contribute(se), touched)
    return store


def test_full_sync_renders_exactly_what_the_typed_transaction_renders() -> None:
    plan = _store(generate(3000, seed=11)).full()
    assert any(isinstance(op.obj, Elements) for op in plan.tx.operations)
    fast = plan.tx.render()
    assert _typed(plan.tx).render() == fast  # expand() also validated every field
    assert fast.count("\n") > 60  # batches of ELEMENTS_PER_LINE: many lines


def test_full_sync_orders_elements_by_container_then_key() -> None:
    plan = _store(generate(500, seed=3)).full()
    elements = [
        (element.container, element.key)
        for op in plan.tx.operations
        if isinstance(op.obj, Elements)
        for element in op.obj.expand()
    ]
    assert elements == sorted(elements)
    assert set(elements) == {(c, k) for c, k in plan.elements}


def test_fake_accepts_the_full_sync_of_generated_services() -> None:
    nft = FakeNft()
    asyncio.run(nft.run(_store(generate(2000, seed=5)).full().tx))
    assert "cluster-eps-v6" in nft.dump()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_changes_reach_the_table_a_full_sync_writes(seed: int) -> None:
    """Services added, changed and deleted in random batches, on one backend; a second backend
    programs the final state in one full sync: both tables must be equal, element for element,
    shared and conflicting elements included."""
    states = churn(600, seed=seed, revisions=39, per_revision=40)

    async def scenario() -> None:
        nft, fresh = FakeNft(), FakeNft()
        backend = NftBackend(nft=nft, options=OPTIONS)
        for state in states:
            await backend.apply(state)
        await NftBackend(nft=fresh, options=OPTIONS).apply(keyed_state(1, states[-1].services))
        assert nft.dump() == fresh.dump()
        # One full sync, then incremental transactions only: none was refused.
        assert len(nft.transactions) == 39
        assert not any(tx.render().startswith("add table") for tx in nft.transactions[1:])

    asyncio.run(scenario())


def test_services_sent_again_unchanged_cost_no_operation() -> None:
    async def scenario() -> None:
        nft = FakeNft()
        backend = NftBackend(nft=nft, options=OPTIONS)
        services = generate(300, seed=9)
        await backend.apply(keyed_state(1, services))
        # A client that reconnects is sent every service again, as equal copies.
        copies = {key: ServiceEndpoints(se.service, se.endpoints) for key, se in services.items()}
        await backend.apply(keyed_state(2, copies))
        assert len(nft.transactions[-1]) == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", [4, 5])
def test_full_sync_over_a_table_replaces_everything_but_the_affinity_memory(seed: int) -> None:
    """A restart (or a resync after a refused transaction) finds the table a former state
    left: what that state had and this one has not must go, the clients remembered for
    ClientIP affinity must stay, and the table is never deleted."""
    states = churn(600, seed=seed, revisions=30, per_revision=40)
    remembered = ("10.0.0.9", "1", "2")

    async def scenario() -> None:
        nft, fresh = FakeNft(), FakeNft()
        before = NftBackend(nft=nft, options=OPTIONS)
        for state in states[:15]:
            await before.apply(state)
        # The same memory in a table that holds nothing else.
        await fresh.run(Transaction(TABLE).add(TABLE).add(AFFINITY_SETS["v4"]))
        for memory in (nft, fresh):
            memory.tables[(TABLE.family, TABLE.name)].elements["affinity-v4"][remembered] = ()
        final = keyed_state(1, states[-1].services)
        await NftBackend(nft=nft, options=OPTIONS).apply(final)
        await NftBackend(nft=fresh, options=OPTIONS).apply(final)
        takeover = nft.transactions[-1].render()
        assert "delete table" not in takeover
        assert "flush table inet kpng" in takeover
        assert nft.dump() == fresh.dump()
        assert remembered in nft.elements(TABLE, "affinity-v4")

    asyncio.run(scenario())


def test_full_sync_drops_the_affinity_memory_once_no_service_has_affinity() -> None:
    async def scenario() -> None:
        nft = FakeNft()
        sticky = {k: se for k, se in generate(200, seed=7).items() if se.service.ClientIP}
        assert sticky
        await NftBackend(nft=nft, options=OPTIONS).apply(keyed_state(1, sticky))
        assert "affinity-v4" in (await nft.list_objects(TABLE) or TableObjects()).sets
        await NftBackend(nft=nft, options=OPTIONS).apply(keyed_state(1, {}))
        assert "affinity-v4" not in (await nft.list_objects(TABLE) or TableObjects()).sets

    asyncio.run(scenario())
