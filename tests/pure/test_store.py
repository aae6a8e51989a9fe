from __future__ import annotations

import asyncio
import logging

import pytest

from kpng.model.cluster import Slice
from kpng.model.messages import Node, PortMapping, Service
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


def test_a_subscriber_that_does_not_read_costs_the_objects_not_the_churn() -> None:
    """Objects created and deleted under new names since a subscriber's last read (rolling
    deployments) are forgotten once they outnumber the objects; what it saw and what is there
    is still named: the next delta is exact."""

    async def scenario() -> None:
        store = Store()
        source = store.source("churn")
        for name in ("kept", "seen", "changed"):
            source.set_service(("ns", name), _service(name))
        source.mark_synced()
        sub = store.subscribe()
        await _next(sub)
        source.set_service(("ns", "seen"), None)  # it saw it: the deletion is named
        source.set_service(("ns", "changed"), _service("changed", "http"))
        source.commit()
        for i in range(20_000):  # created and deleted since its last read: none of its business
            source.set_service(("ns", f"tmp-{i}"), _service(f"tmp-{i}"))
            source.commit()
            source.set_service(("ns", f"tmp-{i}"), None)
            source.commit()
        source.set_service(("ns", "new"), _service("new"))
        source.set_service(("ns", "seen"), _service("seen"))  # back, then gone again:
        source.commit()
        source.set_service(("ns", "seen"), None)  # the deletion of what it saw still counts
        source.commit()
        assert len(sub._services.keys) < 2048
        delta = await _next(sub)
        named = delta.services - {("ns", f"tmp-{i}") for i in range(20_000)}
        assert named == {("ns", "seen"), ("ns", "changed"), ("ns", "new")}
        assert len(delta.services) < 2048

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


def _node_port_service(
    namespace: str, name: str, *ports: tuple[int, str], label: str = ""
) -> Service:
    return Service(
        Namespace=namespace,
        Name=name,
        Type="NodePort",
        Ports=tuple(
            PortMapping(Name=f"p{i}", Protocol=proto, Port=80 + i, NodePort=node_port)
            for i, (node_port, proto) in enumerate(ports)
        ),
        Labels={"l": label},
    )


def _conflicts(caplog: pytest.LogCaptureFixture) -> list[str]:
    messages = [
        r.getMessage()
        for r in caplog.records
        if r.name == "kpng.store.storing" and r.levelno == logging.WARNING
    ]
    caplog.clear()
    return [m for m in messages if "claimed by" in m]


def test_two_services_claiming_one_node_port_are_reported_and_both_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kpng.store.storing")
    store = Store()
    src = store.source("files")
    src.set_service(("shop", "web"), _node_port_service("shop", "web", (30080, "TCP")))
    src.set_service(("blog", "www"), _node_port_service("blog", "www", (30080, "UDP")))
    src.mark_synced()
    assert _conflicts(caplog) == []  # one number, two protocols: two node ports

    src.set_service(("blog", "api"), _node_port_service("blog", "api", (30080, "TCP")))
    assert src.commit()
    (message,) = _conflicts(caplog)
    assert message.startswith("node port 30080/TCP is claimed by Services blog/api and shop/web;")
    assert "for blog/api" in message
    # The state is still served: both Services are in the store.
    assert set(store.services) == {("shop", "web"), ("blog", "www"), ("blog", "api")}

    # A change of a claimant that leaves its node ports alone reports nothing again...
    src.set_service(
        ("blog", "api"), _node_port_service("blog", "api", (30080, "TCP"), label="changed")
    )
    assert src.commit()
    assert _conflicts(caplog) == []
    # ...a third claimant does, naming all three...
    src.set_service(("zoo", "cam"), _node_port_service("zoo", "cam", (30080, "TCP")))
    assert src.commit()
    (message,) = _conflicts(caplog)
    assert "Services blog/api, shop/web and zoo/cam;" in message
    # ...and once they move apart, nothing is left to report.
    src.set_service(("zoo", "cam"), None)
    src.set_service(("blog", "api"), _node_port_service("blog", "api", (30081, "TCP")))
    assert src.commit()
    assert _conflicts(caplog) == []


def test_a_node_port_moving_between_services_in_one_commit_is_no_conflict(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kpng.store.storing")
    store = Store()
    src = store.source("kube")
    src.set_service(("ns", "a"), _node_port_service("ns", "a", (30080, "TCP")))
    src.mark_synced()
    src.set_service(("ns", "b"), _node_port_service("ns", "b", (30080, "TCP")))
    src.set_service(("ns", "a"), _node_port_service("ns", "a", (30090, "TCP")))
    assert src.commit()
    assert _conflicts(caplog) == []


def test_services_of_two_sources_claiming_one_node_port_are_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kpng.store.storing")
    store = Store()
    files, kube = store.source("files"), store.source("kube")
    files.set_service(("ns", "a"), _node_port_service("ns", "a", (30080, "SCTP")))
    files.mark_synced()
    kube.set_service(("ns", "b"), _node_port_service("ns", "b", (30080, "SCTP")))
    kube.mark_synced()
    (message,) = _conflicts(caplog)
    assert "node port 30080/SCTP is claimed by Services ns/a and ns/b" in message


def test_slices_of_follows_each_slice_to_its_service() -> None:
    def sl(name: str, service: str) -> Slice:
        return Slice(namespace="ns", name=name, service=service, v6=False, ports=(), endpoints=())

    store = Store()
    src = store.source("files")
    src.set_slice(("ns", "a-1"), sl("a-1", "a"))
    src.set_slice(("ns", "a-2"), sl("a-2", "a"))
    src.set_slice(("ns", "b-1"), sl("b-1", "b"))
    src.commit()
    assert sorted(s.name for s in store.slices_of(("ns", "a"))) == ["a-1", "a-2"]
    assert store.slices_of(("other", "a")) == ()
    src.set_slice(("ns", "a-2"), sl("a-2", "b"))  # relabelled to another Service
    src.set_slice(("ns", "b-1"), None)
    src.commit()
    assert [s.name for s in store.slices_of(("ns", "a"))] == ["a-1"]
    assert [s.name for s in store.slices_of(("ns", "b"))] == ["a-2"]
    src.set_slice(("ns", "a-1"), None)
    src.set_slice(("ns", "a-2"), None)
    src.commit()
    assert store.slices_of(("ns", "a")) == store.slices_of(("ns", "b")) == ()
    assert not store._slices_by_service
