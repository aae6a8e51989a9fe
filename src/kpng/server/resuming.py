"""The brain's side of resuming a node watch: its digests of a node state, and the checks of
what a watcher answers. Pure (docs/design/resume.md; the digests are kpng.api.digests')."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kpng.api.digests import (
    ANSWERED_SERVICES_MAX,
    BUCKETS,
    DIGEST_BYTES,
    bucket_digest,
    bucket_of,
    item_digest,
    node_digest,
    service_digest,
)
from kpng.api.ops import EncodeEndpoint, EncodeService, ResolvedMemo
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.model.paths import endpoint_keys, service_path, split_service_path
from kpng.server.zonecaches import ZoneCaches

DIFFERING_BUCKETS_MAX = 32
"""Buckets that may differ for a resume to ask for their services: past that (an eighth of the
state) the whole state costs about as much, and the watcher's answer would grow with it."""
SERVICE_PATH_MAX = 63 + 1 + 253
"""A namespace (a DNS label), ``/``, a Service's name (a DNS subdomain)."""


Digested = tuple[str, int, bytes]
"""A service's path, bucket and digest."""


class BadAnswer(ValueError):
    """A watcher's answer to a digest ask that kpng refuses; the message says what is wrong."""


class ServiceDigests(ResolvedMemo[Digested]):
    """Service digests by resolved value, shared by every stream of one encoding: 5,000
    watchers of one class cost one hash per service (``ResolvedMemo``)."""

    def __init__(
        self,
        encode_service: EncodeService,
        encode_endpoint: EncodeEndpoint,
        size: int = 65_536,
    ) -> None:
        super().__init__(size)
        self._encode_service = encode_service
        self._encode_endpoint = encode_endpoint

    def _compute(self, key: ServiceKey, value: ServiceEndpoints) -> Digested:
        """The service's path, bucket and digest: all a node's digests need of it, so that
        5,000 nodes' digests of a shared value cost a lookup each."""
        path = service_path(key)
        keyed = endpoint_keys(value.endpoints)
        # Path order: ``ns/name`` sorts before every ``ns/name/key``.
        items = [item_digest(path, self._encode_service(value.service))]
        items += (
            item_digest(f"{path}/{k}", self._encode_endpoint(keyed[k])) for k in sorted(keyed)
        )
        return (path, bucket_of(path), service_digest(items))


@dataclass(frozen=True)
class StateDigests:
    """A node state's digests, as the brain computed them for a resuming watcher."""

    node: bytes
    buckets: list[bytes]
    services: list[dict[str, bytes]]
    """Service digests by path, by bucket."""

    @classmethod
    def of(
        cls,
        state: Mapping[ServiceKey, ServiceEndpoints],
        *,
        digest: Callable[[ServiceKey, ServiceEndpoints], Digested],
        facts: bytes,
    ) -> StateDigests:
        """The digests of ``state`` whose facts item has digest ``facts``."""
        services: list[dict[str, bytes]] = [{} for _ in range(BUCKETS)]
        for key, value in state.items():
            path, bucket, service = digest(key, value)
            services[bucket][path] = service
        buckets = [bucket_digest(members) for members in services]
        return cls(node_digest(facts, buckets), buckets, services)


class _ZoneDigests:
    """The digests of one zone's base: its services' by bucket, and the buckets'."""

    __slots__ = ("buckets", "services")

    def __init__(self) -> None:
        self.services: list[dict[str, bytes]] = [{} for _ in range(BUCKETS)]
        """Never changed once made: a changed bucket is a new dict, so that the StateDigests
        a resume holds across its rounds are not moved under it."""
        self.buckets: list[bytes | None] = [None] * BUCKETS
        """None: not computed since the bucket changed."""


class BaseDigests(ZoneCaches[_ZoneDigests]):
    """The digests of node states read over their zone's base (``NodeView.layers``), shared by
    every stream of one encoding: a zone's base is digested once, and each node's digest is
    its zone's with the buckets of the services it holds otherwise replaced. A resume then
    costs the node's own services and 257 hashes, not a lookup per service of the cluster;
    the digests are those of ``StateDigests.of`` the node's whole state, so replicas agree.

    Follows the bases through ``changed`` (a ``ClusterResolver.on_base_change`` listener)."""

    def __init__(self, digest: Callable[[ServiceKey, ServiceEndpoints], Digested]) -> None:
        super().__init__(_ZoneDigests)
        self._digest = digest

    def of(
        self,
        *,
        base: Mapping[ServiceKey, ServiceEndpoints],
        zone: str | None,
        overlay: Mapping[ServiceKey, ServiceEndpoints | None],
        facts: bytes,
    ) -> StateDigests:
        """The digests of the state ``overlay`` over ``zone``'s ``base`` (None in the overlay:
        a service the state lacks), whose facts item has digest ``facts``. No zone: the
        overlay is the whole state."""
        if zone is None:
            whole = {key: value for key, value in overlay.items() if value is not None}
            return StateDigests.of(whole, digest=self._digest, facts=facts)
        entry = self._current(zone, base)
        services = list(entry.services)
        buckets: list[bytes] = entry.buckets  # type: ignore[assignment]  # all computed
        own: dict[int, dict[str, bytes]] = {}
        for key, value in overlay.items():
            path = service_path(key)
            index = bucket_of(path)
            members = own.get(index)
            if members is None:
                members = own[index] = dict(services[index])
            if value is None:
                members.pop(path, None)
            else:
                members[path] = self._digest(key, value)[2]
        if own:
            buckets = list(buckets)
            for index, members in own.items():
                services[index] = members
                buckets[index] = bucket_digest(members)
        return StateDigests(node_digest(facts, buckets), list(buckets), services)

    def _current(self, zone: str, base: Mapping[ServiceKey, ServiceEndpoints]) -> _ZoneDigests:
        """``zone``'s digests, brought up to its base."""
        entry, stale = self._take(zone)
        if stale is None:
            for key, value in base.items():
                path, index, digest = self._digest(key, value)
                entry.services[index][path] = digest
        else:
            changed: dict[int, dict[str, bytes]] = {}
            for key in stale:
                path = service_path(key)
                index = bucket_of(path)
                members = changed.get(index)
                if members is None:
                    members = changed[index] = dict(entry.services[index])
                now = base.get(key)
                if now is None:
                    members.pop(path, None)
                else:
                    members[path] = self._digest(key, now)[2]
            for index, members in changed.items():
                entry.services[index] = members
                entry.buckets[index] = None
        for index, computed in enumerate(entry.buckets):
            if computed is None:
                entry.buckets[index] = bucket_digest(entry.services[index])
        return entry


def check_holds(holds: bytes) -> None:
    if len(holds) != DIGEST_BYTES:
        raise BadAnswer(f"Holds must be a {DIGEST_BYTES}-byte node digest, not {len(holds)} bytes")


def differing_buckets(ours: Sequence[bytes], answer: bytes) -> list[int]:
    """The buckets whose digests in ``answer`` (a watcher's Buckets) differ from ``ours``."""
    size = BUCKETS * DIGEST_BYTES
    if len(answer) != size:
        raise BadAnswer(
            f"Buckets must be {BUCKETS} digests of {DIGEST_BYTES} bytes ({size} bytes), "
            f"not {len(answer)} bytes"
        )
    return [
        index
        for index, digest in enumerate(ours)
        if answer[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES] != digest
    ]


def answered_services(answer: Sequence[Any], asked: Iterable[int]) -> dict[str, bytes]:
    """A watcher's Services answer (ServiceDigest messages) to an ask for the services in
    buckets ``asked``, checked: digests by path."""
    if len(answer) > ANSWERED_SERVICES_MAX:
        raise BadAnswer(f"Services holds {len(answer)} digests, more than {ANSWERED_SERVICES_MAX}")
    wanted = set(asked)
    found: dict[str, bytes] = {}
    for entry in answer:
        path, digest = entry.Path, entry.Digest
        if not 0 < len(path) <= SERVICE_PATH_MAX or path.count("/") != 1:
            shown = path[:SERVICE_PATH_MAX]
            raise BadAnswer(f"Services path {shown!r} is not namespace/name")
        if len(digest) != DIGEST_BYTES:
            raise BadAnswer(
                f"Services digest of {path} must be {DIGEST_BYTES} bytes, not {len(digest)}"
            )
        if bucket_of(path) not in wanted:
            raise BadAnswer(f"Services path {path} is in no bucket asked for")
        if path in found:
            raise BadAnswer(f"Services path {path} is given twice")
        found[path] = digest
    return found


def differences(
    ours: StateDigests, asked: Iterable[int], theirs: Mapping[str, bytes]
) -> tuple[list[ServiceKey], list[ServiceKey]]:
    """The services to send whole (ours, which the watcher holds otherwise or not at all) and
    to delete (the watcher's, which we lack), in the buckets ``asked``."""
    updated: list[ServiceKey] = []
    for index in asked:
        for path, digest in ours.services[index].items():
            if theirs.get(path) != digest:
                updated.append(split_service_path(path))
    deleted = [
        split_service_path(path) for path in theirs if path not in ours.services[bucket_of(path)]
    ]
    return updated, deleted
