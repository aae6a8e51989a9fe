from __future__ import annotations

import asyncio

from kpng.model.messages import Node, Service
from kpng.store import Delta, Store


def _service(name: str, port_name: str = "") -> Service:
    return Service(Namespace="ns", Name=name, Type="ClusterIP", Labels={"p": port_name})


async def _next(store_iter: object) -> Delta:
    return await asyncio.wait_for(anext(store_iter), 5)  # type: ignore[call-overload]


def test_nothing_is_delivered_before_every_source_synced() -> None:
    async def scenario() -> None:
        store = Store()
        files, nodes = store.source("files"), store.source("nodes")
        sub = store.subscribe()
        files.set_service(("ns", "a"), _service("a"))
        files.mark_synced()
        pending = asyncio.ensure_future(anext(sub))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not pending.done()
        assert not store.synced
        nodes.set_node("n1", Node(Name="n1"))
        nodes.mark_synced()
        delta = await asyncio.wait_for(pending, 5)
        assert delta.services == {("ns", "a")}
        assert delta.nodes == {"n1"}

    asyncio.run(scenario())


def test_resending_an_identical_object_makes_no_revision() -> None:
    store = Store()
    src = store.source("files")
    src.set_service(("ns", "a"), _service("a"))
    assert src.commit()
    revision = store.revision
    src.set_service(("ns", "a"), _service("a"))
    assert not src.commit()
    assert store.revision == revision
    src.set_service(("ns", "a"), _service("a", "changed"))
    assert src.commit()
    assert store.revision == revision + 1


def test_deleting_an_absent_object_makes_no_revision() -> None:
    store = Store()
    src = store.source("files")
    src.set_service(("ns", "ghost"), None)
    assert not src.commit()


def test_slow_subscriber_reads_one_coalesced_delta() -> None:
    async def scenario() -> None:
        store = Store()
        src = store.source("files")
        src.mark_synced()
        sub = store.subscribe()
        first = await _next(sub)
        assert first.revision == 1
        for name in ("a", "b", "c"):
            src.set_service(("ns", name), _service(name))
            src.commit()
        src.set_service(("ns", "a"), None)
        src.commit()
        delta = await _next(sub)
        assert delta.revision == 5
        assert store.revision == 5
        assert delta.services == {("ns", "a"), ("ns", "b"), ("ns", "c")}
        assert ("ns", "a") not in store.services

    asyncio.run(scenario())


def test_first_delta_names_everything_even_when_subscribed_late() -> None:
    async def scenario() -> None:
        store = Store()
        src = store.source("files")
        src.set_service(("ns", "a"), _service("a"))
        src.set_node("n1", Node(Name="n1"))
        src.mark_synced()
        sub = store.subscribe()
        delta = await _next(sub)
        assert delta.services == {("ns", "a")}
        assert delta.nodes == {"n1"}

    asyncio.run(scenario())


def test_an_empty_cluster_is_delivered_as_a_complete_state() -> None:
    async def scenario() -> None:
        store = Store()
        sub = store.subscribe()
        store.source("files").mark_synced()
        delta = await _next(sub)
        assert delta.revision == 1
        assert len(delta.services) + len(delta.slices) + len(delta.nodes) == 0

    asyncio.run(scenario())


def test_closed_subscription_stops_iterating() -> None:
    async def scenario() -> None:
        store = Store()
        sub = store.subscribe()
        pending = asyncio.ensure_future(anext(sub))
        await asyncio.sleep(0)
        sub.close()
        done, _ = await asyncio.wait({pending}, timeout=5)
        assert done
        assert isinstance(pending.exception(), StopAsyncIteration)

    asyncio.run(scenario())
