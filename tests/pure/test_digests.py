"""Digests of node-local states (kpng.api.digests) and the brain's checks of a resuming watcher's
answers (kpng.server.resuming): tables, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import pytest

from kpng.api import batchv1_pb2, localv1_pb2
from kpng.api.digests import (
    ANSWERED_SERVICES_MAX,
    BUCKETS,
    DIGEST_BYTES,
    Holdings,
    bucket_of,
    item_digest,
)
from kpng.api.ops import local_ops
from kpng.model.cluster import ServiceKey
from kpng.model.messages import Endpoint, IPSet, Service, ServiceEndpoints
from kpng.model.paths import service_path
from kpng.server.resuming import (
    BadAnswer,
    ServiceDigests,
    StateDigests,
    answered_services,
    check_holds,
    differences,
    differing_buckets,
)

_encode = msgspec.json.Encoder().encode


def _value(namespace: str, name: str, *ips: str, type_: str = "ClusterIP") -> ServiceEndpoints:
    return ServiceEndpoints(
        service=Service(Namespace=namespace, Name=name, Type=type_),
        endpoints=tuple(Endpoint(IPs=IPSet(V4=(ip,)), Ready=True) for ip in ips),
    )


def _state(count: int = 40) -> dict[ServiceKey, ServiceEndpoints]:
    return {
        (f"ns{i % 3}", f"svc{i}"): _value(f"ns{i % 3}", f"svc{i}", f"10.0.{i}.1", f"10.0.{i}.2")
        for i in range(count)
    }


def _fed(holdings: Holdings, ops: list[bytes]) -> Holdings:
    """What a watcher's holdings become from a change set's encoded ops (as LocalOps feeds
    them: from the payload bytes as they came)."""
    for data in ops:
        op = localv1_pb2.OpItem.FromString(data)
        kind = op.WhichOneof("Op")
        if kind == "Set":
            path = op.Set.Ref.Path
            service = "/".join(path.split("/", 2)[:2])
            holdings.set(service, path, item_digest(path, op.Set.Bytes))
        elif kind == "Delete":
            path = op.Delete.Path
            service = "/".join(path.split("/", 2)[:2])
            holdings.delete(service, path)
    holdings.complete = True
    return holdings


def _ops(
    updated: Mapping[ServiceKey, ServiceEndpoints],
    deleted: list[ServiceKey] | None = None,
    previous: Mapping[ServiceKey, ServiceEndpoints] | None = None,
) -> list[bytes]:
    return local_ops(
        updated=updated,
        deleted=deleted or [],
        previous=previous or {},
        encode_service=_encode,
        encode_endpoint=_encode,
    )


def _brain(state: Mapping[ServiceKey, ServiceEndpoints]) -> StateDigests:
    return StateDigests.of(state, digest=ServiceDigests(_encode, _encode), facts=b"")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ns/a", b"x"), ("ns/b", b"x")),  # the path counts
        (("ns/a", b"x"), ("ns/a", b"y")),  # the payload counts
        (("ns/a", b"bc"), ("ns/ab", b"c")),  # the boundary between them counts
        (("ns/a", b""), ("ns/a", b"\0")),
    ],
)
def test_item_digests_differ_with_path_payload_or_their_boundary(
    a: tuple[str, bytes], b: tuple[str, bytes]
) -> None:
    assert item_digest(*a) != item_digest(*b)
    assert len(item_digest(*a)) == DIGEST_BYTES


def test_item_digest_is_a_fixed_function_replicas_and_other_languages_can_compute() -> None:
    # blake2b, 16 bytes, personalization "kpng-item", keyed by nothing, over the path's length
    # (4 bytes, big-endian), the path and the payload: pinned, as every replica must agree.
    assert item_digest("ns/a", b"{}").hex() == "c1f9fe74c7c866335b31deea1b0fbd24"


def test_the_watcher_fed_the_whole_state_holds_the_brains_digest() -> None:
    state = _state()
    assert _fed(Holdings(), _ops(state)).digest() == _brain(state).node


def test_the_watcher_fed_changes_holds_the_brains_digest_of_the_new_state() -> None:
    before = _state()
    after = dict(before)
    after[("ns1", "svc1")] = _value("ns1", "svc1", "10.0.1.1", "10.0.1.9")  # one endpoint
    after[("ns2", "new")] = _value("ns2", "new", "10.9.0.1")
    del after[("ns0", "svc3")]
    changed = {k: after[k] for k in [("ns1", "svc1"), ("ns2", "new")]}
    holdings = _fed(Holdings(), _ops(before))
    _fed(holdings, _ops(changed, [("ns0", "svc3")], before))
    assert holdings.digest() == _brain(after).node != _brain(before).node


def test_a_state_fed_in_another_order_has_the_same_digest() -> None:
    state = _state()
    forward = _fed(Holdings(), _ops(state))
    backward = Holdings()
    for data in reversed(_ops(state)):
        _fed(backward, [data])
    assert forward.digest() == backward.digest()
    assert forward.bucket_digests() == backward.bucket_digests()


def test_one_changed_service_changes_one_bucket_and_its_own_digest_only() -> None:
    state = _state()
    key = ("ns2", "svc5")
    other = dict(state)
    other[key] = _value("ns2", "svc5", "10.0.5.1", type_="NodePort")
    ours, theirs = _brain(state), _brain(other)
    answer = b"".join(theirs.buckets)
    assert differing_buckets(ours.buckets, answer) == [bucket_of("ns2/svc5")]
    bucket = bucket_of("ns2/svc5")
    held = dict(theirs.services[bucket])
    assert differences(ours, [bucket], held) == ([key], [])


def test_differences_send_what_differs_or_lacks_and_delete_what_the_brain_lacks() -> None:
    state = _state()
    holdings = _fed(Holdings(), _ops(state))
    brain = dict(state)
    del brain[("ns0", "svc0")]  # the watcher holds it: deleted
    brain[("ns0", "added")] = _value("ns0", "added")  # the watcher lacks it: sent
    brain[("ns1", "svc4")] = _value("ns1", "svc4", "10.0.4.1")  # one endpoint fewer: sent
    ours = _brain(brain)
    asked = differing_buckets(ours.buckets, b"".join(holdings.bucket_digests()))
    theirs = answered_services(
        [batchv1_pb2.ServiceDigest(Path=p, Digest=d) for p, d in holdings.service_digests(asked)],
        asked,
    )
    updated, deleted = differences(ours, asked, theirs)
    assert sorted(updated) == [("ns0", "added"), ("ns1", "svc4")]
    assert deleted == [("ns0", "svc0")]


def test_deleting_every_item_of_a_service_forgets_it() -> None:
    holdings = _fed(Holdings(), _ops(_state(2)))
    empty = _fed(Holdings(), [])
    holdings.drop("ns0/svc0")
    for path in list(holdings.items("ns1/svc1")):
        holdings.delete("ns1/svc1", path)
    assert list(holdings.services()) == []
    assert holdings.digest() == empty.digest() == _brain({}).node


def test_facts_count_in_the_node_digest() -> None:
    a, b = Holdings(), Holdings()
    b.facts = item_digest("node", b"{}")
    assert a.digest() != b.digest()


def test_service_digests_are_shared_per_value_and_forgotten_with_their_service() -> None:
    calls: list[Any] = []

    def counting(value: Any) -> bytes:
        calls.append(value)
        return _encode(value)

    digests = ServiceDigests(counting, counting)
    value = _value("ns", "a", "10.0.0.1")
    first = digests(("ns", "a"), value)
    assert digests(("ns", "a"), value) == first
    assert len(calls) == 2  # the service and its endpoint, once
    digests.forget(("ns", "a"))
    assert len(digests) == 0


@pytest.mark.parametrize(
    ("holds", "message"),
    [(b"", "not 0 bytes"), (b"x" * 15, "not 15 bytes"), (b"x" * 17, "not 17 bytes")],
)
def test_holds_of_the_wrong_size_are_refused(holds: bytes, message: str) -> None:
    with pytest.raises(BadAnswer, match=message):
        check_holds(holds)
    check_holds(b"x" * DIGEST_BYTES)


@pytest.mark.parametrize("size", [0, 16, BUCKETS * DIGEST_BYTES - 1, BUCKETS * DIGEST_BYTES + 1])
def test_bucket_answers_of_the_wrong_size_are_refused(size: int) -> None:
    with pytest.raises(BadAnswer, match=f"not {size} bytes"):
        differing_buckets(_brain({}).buckets, b"\0" * size)


def _asked(path: str) -> list[int]:
    return [bucket_of(path)]


_D = b"d" * DIGEST_BYTES


@pytest.mark.parametrize(
    ("answer", "asked", "message"),
    [
        ([("nons", _D)], _asked("nons"), "is not namespace/name"),
        ([("a/b/c", _D)], _asked("a/b/c"), "is not namespace/name"),
        ([("", _D)], [0], "is not namespace/name"),
        ([("ns/" + "x" * 400, _D)], _asked("ns/" + "x" * 400), "is not namespace/name"),
        ([("ns/a", b"short")], _asked("ns/a"), "must be 16 bytes, not 5"),
        ([("ns/a", _D)], [(bucket_of("ns/a") + 1) % BUCKETS], "in no bucket asked for"),
        ([("ns/a", _D), ("ns/a", _D)], _asked("ns/a"), "given twice"),
        ([("ns/a", _D)] * (ANSWERED_SERVICES_MAX + 1), _asked("ns/a"), "more than 16384"),
    ],
)
def test_malformed_or_oversized_service_answers_are_refused_saying_why(
    answer: list[tuple[str, bytes]], asked: list[int], message: str
) -> None:
    entries = [batchv1_pb2.ServiceDigest(Path=p, Digest=d) for p, d in answer]
    with pytest.raises(BadAnswer, match=message):
        answered_services(entries, asked)


def test_service_paths_are_spread_over_the_buckets() -> None:
    used = {bucket_of(service_path(("ns", f"svc{i}"))) for i in range(2000)}
    assert len(used) == BUCKETS
