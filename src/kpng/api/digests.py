"""Digests of a node-local state, as a batched watch carries it: what lets a watcher that
reconnects, to the same brain or another replica, receive only what differs (batchv1's
``Holds``, docs/design/resume.md). Pure.

Everything is hashed from what the stream carries, so that the brain and its watchers compute
the same digests without sending any in a change set, and replicas that resolved the same state
agree without sharing revisions:

- an item (a service, an endpoint, the node's facts): blake2b of its path and its payload bytes
  in the stream's encoding;
- a service: blake2b of the digests of its items (``ns/name`` and ``ns/name/...``) in path
  order;
- a bucket (one of 256, by a hash of the service's path): blake2b of its services' digests in
  path order;
- the node: blake2b of the facts item's digest and the 256 bucket digests.

A tree of hashes, not a sum: a sum of digests is cheaper to update, but one whose terms an
author of Services picks can be made to collide (Wagner's generalized birthday), and a watcher
holding a stale state it believes current would keep it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from hashlib import blake2b

__all__ = [
    "ANSWERED_SERVICES_MAX",
    "ANSWER_BYTES_MAX",
    "BUCKETS",
    "DIGEST_BYTES",
    "Holdings",
    "bucket_digest",
    "bucket_of",
    "item_digest",
    "node_digest",
    "service_digest",
]

DIGEST_BYTES = 16
BUCKETS = 256
ANSWERED_SERVICES_MAX = 16_384
"""Service digests a watcher may answer one ask with (the brain refuses more): 32 buckets of a
130,000-service state. A watcher holding more starts over with a whole state instead."""
ANSWER_BYTES_MAX = 1 << 20
"""The size of a watcher's answer, likewise: well under gRPC's 4 MiB limit on what a server
receives."""
_EMPTY = b"\0" * DIGEST_BYTES
"""The facts digest of a state without facts."""


def item_digest(path: str, payload: bytes) -> bytes:
    """One Set item's digest: its path and its payload, as the stream carries them."""
    encoded = path.encode()
    h = blake2b(len(encoded).to_bytes(4, "big"), digest_size=DIGEST_BYTES, person=b"kpng-item")
    h.update(encoded)
    h.update(payload)
    return h.digest()


def service_digest(items: Iterable[bytes]) -> bytes:
    """A service's digest from its items' digests, in path order (the service's own first)."""
    h = blake2b(digest_size=DIGEST_BYTES, person=b"kpng-service")
    for digest in items:
        h.update(digest)
    return h.digest()


def bucket_of(service_path: str) -> int:
    """The bucket of a service (0-255): a hash of its path, so that both ends agree."""
    return blake2b(service_path.encode(), digest_size=1, person=b"kpng-bucket").digest()[0]


def bucket_digest(services: Mapping[str, bytes]) -> bytes:
    """A bucket's digest from its services' digests by path."""
    h = blake2b(digest_size=DIGEST_BYTES, person=b"kpng-bucket")
    for path in sorted(services):
        h.update(services[path])
    return h.digest()


def node_digest(facts: bytes | None, buckets: Iterable[bytes]) -> bytes:
    """The node's digest from its facts item's digest (None: no facts) and its bucket digests."""
    h = blake2b(facts or _EMPTY, digest_size=DIGEST_BYTES, person=b"kpng-node")
    for digest in buckets:
        h.update(digest)
    return h.digest()


class Holdings:
    """What a watcher holds, as digests: each item's, by service, and the tree above them.

    Fed the items of each change set as they come (``set``, ``delete``, ``clear`` at a Reset);
    service and bucket digests are recomputed only for what changed since they were last asked
    for. ``complete`` says whether the last change set was seen to its Sync: a stream that
    broke in the middle of one (a Reset half sent) leaves digests nobody can vouch for.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Hold nothing (a Reset)."""
        self._items: dict[str, dict[str, bytes]] = {}
        """Item digests by service path, then by item path."""
        self.facts: bytes | None = None
        self.complete = False
        self._services: dict[str, bytes] = {}
        """Service digests still valid."""
        self._buckets: list[dict[str, bytes]] = [{} for _ in range(BUCKETS)]
        """Service paths by bucket, with their digests once computed."""
        self._bucket_digests: list[bytes | None] = [None] * BUCKETS
        self._bucket: dict[str, int] = {}

    def items(self, service: str) -> Mapping[str, bytes]:
        """The digests of the items held of ``service``, by path (read-only)."""
        return self._items.get(service, {})

    def services(self) -> Iterable[str]:
        return self._items.keys()

    def set(self, service: str, path: str, digest: bytes) -> None:
        self._items.setdefault(service, {})[path] = digest
        self._touch(service)

    def delete(self, service: str, path: str) -> None:
        items = self._items.get(service)
        if items is None or items.pop(path, None) is None:
            return
        if not items:
            del self._items[service]
        self._touch(service)

    def drop(self, service: str) -> None:
        """Forget ``service`` and its endpoints."""
        if self._items.pop(service, None) is not None:
            self._touch(service)

    def _touch(self, service: str) -> None:
        self._services.pop(service, None)
        bucket = self._bucket.get(service)
        if bucket is None:
            bucket = self._bucket[service] = bucket_of(service)
        self._bucket_digests[bucket] = None
        if service in self._items:
            self._buckets[bucket][service] = b""
        else:
            self._buckets[bucket].pop(service, None)
            del self._bucket[service]

    def service_digest(self, service: str) -> bytes:
        digest = self._services.get(service)
        if digest is None:
            items = self._items[service]
            digest = self._services[service] = service_digest(items[p] for p in sorted(items))
        return digest

    def bucket_digests(self) -> list[bytes]:
        """The 256 bucket digests, in bucket order."""
        digests = self._bucket_digests
        for index, digest in enumerate(digests):
            if digest is None:
                members = self._buckets[index]
                for service in members:
                    members[service] = self.service_digest(service)
                digests[index] = bucket_digest(members)
        return digests  # type: ignore[return-value]  # every None was filled just now

    def service_digests(self, buckets: Iterable[int]) -> list[tuple[str, bytes]]:
        """(path, digest) of every service held in ``buckets``, by bucket then path."""
        return [
            (service, self.service_digest(service))
            for index in buckets
            for service in sorted(self._buckets[index])
        ]

    def digest(self) -> bytes:
        """The node digest of what is held."""
        return node_digest(self.facts, self.bucket_digests())
