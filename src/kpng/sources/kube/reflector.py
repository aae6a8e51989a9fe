"""kpng's reflector: one Kubernetes resource kept in step with the API server by list and watch.

- **List** in pages (``limit``/``continue``); an expired ``continue`` token (410) restarts the list.
  Every list is of the current state (no ``resourceVersion``). client-go's first list asks
  ``resourceVersion=0`` instead, but an API server ignores ``limit`` for it (1.37: one 3 MB answer
  for 1,000 EndpointSlices, some 300 MB for 100,000), and it serves paginated current lists from
  its watch cache too, with one small etcd request for the current resourceVersion (its metrics
  say so on 1.34.4 and 1.37.2, the oldest and newest releases kpng supports).
- **Watch** from the list's resourceVersion with ``allowWatchBookmarks``; the resourceVersion is
  taken from every event, bookmarks included, so a re-watch resumes where the stream stopped.
- A watch that ends cleanly (the server's ``timeoutSeconds``, a closed connection) is resumed at
  once; a failure is retried after a jittered exponential backoff.
- A watch silent for ``watch_idle_s`` (150 s) is taken as dead, ended and resumed at once from its
  resourceVersion: the API server's watch cache sends a bookmark about every minute, so only a
  stream that stopped delivering (a connection that carries nothing, a read that never
  completes) is that quiet. Logged as a warning once a watch of the source has had a bookmark,
  else as information (an API server without a watch cache sends none, and its quiet watches
  are merely idle).
- **410 Gone** (as the HTTP status of a watch or as an ERROR event) means the resourceVersion is
  older than the server's history: list again and diff against what was known, so that objects
  deleted meanwhile become deletes.
- Each object is decoded on its own with msgspec straight into ``kpng.model.k8s`` types; one that
  does not decode is reported by kind, namespace and name and treated as absent, never fatal.

The backoff, the relist diff, the watch timeouts and the idle bound are pure functions below,
tested with plain data; the clock (``sleep``) and the randomness are injected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import msgspec

from kpng.backoff import Backoff
from kpng.gcpause import collector_paused
from kpng.kubeclient.client import (
    ApiClient,
    ApiStatus,
    ApiStatusError,
    StreamIdle,
    TransportError,
)
from kpng.model import k8s
from kpng.store import SourceCounter

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name); namespace is "" for cluster-scoped objects."""


class KubeObject(Protocol):
    metadata: k8s.ObjectMeta


T = TypeVar("T", bound=KubeObject)
T_contra = TypeVar("T_contra", contravariant=True)


# --- pure logic


@dataclass(frozen=True)
class BackoffPolicy:
    """client-go's reflector backoff: 0.8 s doubling to 30 s, each delay stretched by up to
    ``jitter`` times itself so that many proxies do not retry in step after an outage."""

    initial: float = 0.8
    factor: float = 2.0
    maximum: float = 30.0
    jitter: float = 1.0

    def backoff(self, rand: Callable[[], float] = random.random) -> Backoff:
        """kpng's one Backoff, set as client-go's reflector sets wait.Backoff."""
        return Backoff(
            initial=self.initial,
            maximum=self.maximum,
            factor=self.factor,
            spread=(1.0, 1.0 + self.jitter),
            random=rand,
        )


@dataclass(frozen=True)
class RelistDiff:
    added: frozenset[Key]
    changed: frozenset[Key]
    deleted: frozenset[Key]
    unchanged: int


def relist_diff(known: Mapping[Key, str], listed: Mapping[Key, str]) -> RelistDiff:
    """What a relist found, from the resourceVersions of the objects known before it and of the
    objects it listed. An object's resourceVersion changes with every write of it, so an equal
    one means an equal object."""
    added = listed.keys() - known.keys()
    deleted = known.keys() - listed.keys()
    changed = {k for k in listed.keys() & known.keys() if listed[k] != known[k]}
    return RelistDiff(
        added=frozenset(added),
        changed=frozenset(changed),
        deleted=frozenset(deleted),
        unchanged=len(listed) - len(added) - len(changed),
    )


def watch_timeout(base: float, rand: Callable[[], float] = random.random) -> int:
    """The server-side timeout of one watch: in [base, 2 base), as client-go spreads them, so
    that the watches of many clients do not all end and restart together."""
    return max(1, int(base * (1.0 + rand())))


def watch_idle_timeout(server_timeout: int, idle: float) -> float:
    """How long a watch may stay silent before it is taken as dead: ``idle``, and never much
    past the server's own end of the watch."""
    return min(idle, server_timeout + 30.0)


# --- wire types


class ListMeta(msgspec.Struct, rename="camel"):
    resource_version: str = ""
    continue_: str = msgspec.field(name="continue", default="")


class ListPage(msgspec.Struct):
    """One page of a list: items kept raw, to decode one by one."""

    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[msgspec.Raw] | None = None


class WatchEvent(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _MetaOnly(msgspec.Struct):
    metadata: k8s.ObjectMeta = msgspec.field(default_factory=k8s.ObjectMeta)


_list_decoder = msgspec.json.Decoder(ListPage)


def _decoded(decoder: msgspec.json.Decoder[ListPage], data: bytes, what: str) -> ListPage:
    """``data`` decoded; a ``msgspec.DecodeError`` for JSON nested deeper than msgspec goes
    (a RecursionError, which the reflector's loop would not expect)."""
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError(f"{what} nested too deeply") from None


_event_decoder = msgspec.json.Decoder(WatchEvent)
_meta_decoder = msgspec.json.Decoder(_MetaOnly)
_status_decoder = msgspec.json.Decoder(ApiStatus)


# --- the reflector


@dataclass(frozen=True)
class Resource(Generic[T]):
    kind: str
    path: str
    """The collection, e.g. ``/api/v1/services`` (all namespaces)."""
    type: type[T]
    label_selector: str = ""
    field_selector: str = ""

    def selectors(self) -> dict[str, str]:
        params = {}
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        if self.field_selector:
            params["fieldSelector"] = self.field_selector
        return params


class ReflectorOutput(Protocol[T_contra]):
    """Where a reflector puts what it learns. Writes are staged until ``commit``."""

    def apply(self, key: Key, obj: T_contra | None) -> None: ...

    def commit(self) -> None: ...

    def mark_synced(self) -> None:
        """The first complete list has been applied."""
        ...


@dataclass(frozen=True)
class ReflectorSettings:
    page_size: int = 500
    watch_timeout_s: float = 300.0
    """Base of the server-side timeout of a watch (spread to up to twice that)."""
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    healthy_watch_s: float = 1.0
    """A watch that ends sooner without an event counts as a failure (backoff), so that a server
    that closes every watch at once is not hammered."""
    watch_idle_s: float = 150.0
    """Silence after which a watch is ended and resumed. The API server sends a bookmark about
    every minute (its watch cache's bookmark frequency) to a watch that allows them; 150 s lets
    one go missing. A stream that stopped delivering then costs that long, not the 5 to 10
    minutes of the server's timeout, every change meanwhile unseen and nothing logged."""


def _counter(help: str) -> int:
    return field(default=0, metadata={"help": help})


@dataclass
class ReflectorStats:
    """What a reflector did; each field is a counter in ``/metrics`` (the help is its text)."""

    lists: int = _counter("complete lists, the initial one included")
    relists_gone: int = _counter("lists caused by 410 Gone (the watch fell too far behind)")
    watches: int = _counter("watches started")
    events: int = _counter("watch events received, bookmarks excluded")
    bookmarks: int = _counter("watch bookmarks received")
    idle_watches: int = _counter("watches ended for a silence longer than the idle bound")
    failures: int = _counter("failed lists and watches (each retried with backoff)")
    undecodable: int = _counter("objects that could not be decoded")

    def counters(self) -> Iterator[SourceCounter]:
        for f in dataclasses.fields(self):
            yield SourceCounter(f.name, f.metadata["help"], getattr(self, f.name))


class Gone(Exception):
    """The resourceVersion is too old for the server (410): list again."""


class WatchFailed(Exception):
    """An ERROR event other than 410."""


def _key(meta: k8s.ObjectMeta) -> Key:
    return (meta.namespace, meta.name)


class Reflector(Generic[T]):
    def __init__(
        self,
        client: ApiClient,
        resource: Resource[T],
        output: ReflectorOutput[T],
        settings: ReflectorSettings | None = None,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
        bookmarks_seen: Callable[[], bool] | None = None,
    ) -> None:
        """``bookmarks_seen``: whether the API server has been seen sending bookmarks (default:
        on this reflector's watches); reflectors of one server may share what they saw."""
        self.client = client
        self.resource: Resource[T] = resource
        self.output: ReflectorOutput[T] = output
        self.settings = settings or ReflectorSettings()
        self._sleep = sleep
        self._rand = rand
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(resource.type)
        self.resource_version = ""
        """Where the next watch starts; "" when a list is needed."""
        self.known: dict[Key, str] = {}
        """resourceVersion of every object the server has and this reflector has seen."""
        self.synced = asyncio.Event()
        self.stats = ReflectorStats()
        self.last_error = ""
        self._listed_at = -math.inf
        self._bookmarks_seen = bookmarks_seen or (lambda: self.stats.bookmarks > 0)

    @property
    def name(self) -> str:
        kind: str = self.resource.kind
        return kind

    async def run(self) -> None:
        """List, then watch, until cancelled."""
        backoff = self.settings.backoff.backoff(self._rand)
        while True:
            try:
                if not self.resource_version:
                    await self._list()
                    backoff.reset()
                started, events = time.monotonic(), self.stats.events
                await self._watch()
                if (
                    self.stats.events > events
                    or time.monotonic() - started >= self.settings.healthy_watch_s
                ):
                    backoff.reset()
                    continue  # a clean end: resume at once
                failure = "the watch ended at once"
            except StreamIdle as exc:
                # The server took the watch, then its stream went quiet: resume from the last
                # resourceVersion, which loses nothing, without a backoff (a server that cannot
                # be reached fails the next watch and gets one).
                self.stats.idle_watches += 1
                self.last_error = str(exc)
                log.log(
                    logging.WARNING if self._bookmarks_seen() else logging.INFO,
                    "%s: %s on the watch, not even a bookmark; watching again from "
                    "resourceVersion %s",
                    self.name,
                    exc,
                    self.resource_version,
                )
                continue
            except Gone as exc:
                log.info("%s: %s; listing again", self.name, exc)
                self.resource_version = ""
                self.stats.relists_gone += 1
                if time.monotonic() - self._listed_at >= self.settings.healthy_watch_s:
                    continue
                # Gone right after a list: relisting at once could spin; pace it.
                failure = str(exc)
            except (TransportError, ApiStatusError, WatchFailed, msgspec.DecodeError) as exc:
                failure = str(exc)
            except Exception as exc:
                # A bug, or an answer no check foresaw: reported with its traceback, and the
                # reflector lists again after its backoff; it never ends silently.
                log.exception("%s: an unexpected failure", self.name)
                self.resource_version = ""
                failure = f"an unexpected {type(exc).__name__}: {exc}"
            self.stats.failures += 1
            self.last_error = failure
            delay = backoff.delay()
            doing = "watch" if self.resource_version else "list"
            if self.synced.is_set():
                log.warning(
                    "%s: cannot %s: %s; serving the last state, retrying in %.1f s",
                    self.name,
                    doing,
                    failure,
                    delay,
                )
            else:
                log.error("%s: cannot %s: %s; retrying in %.1f s", self.name, doing, failure, delay)
            await self._sleep(delay)

    # Listing.

    async def _list(self) -> None:
        params = {"limit": str(self.settings.page_size), **self.resource.selectors()}
        listed: dict[Key, str] = {}
        resource_version = ""
        while True:
            try:
                body = await self.client.get(self.resource.path, params)
            except ApiStatusError as exc:
                if exc.status == 410 and "continue" in params:
                    # The list took longer than the server keeps snapshots: start over.
                    log.info("%s: list continuation expired; listing from the start", self.name)
                    del params["continue"]
                    listed.clear()
                    continue
                raise
            with collector_paused():
                page = _decoded(_list_decoder, body, "a page of the list")
                for raw in page.items or ():
                    self._apply_listed(raw, listed)
            resource_version = page.metadata.resource_version
            if not page.metadata.continue_:
                break
            params["continue"] = page.metadata.continue_
        diff = relist_diff(self.known, listed)
        for key in diff.deleted:
            self.output.apply(key, None)
        self.known = listed
        self.resource_version = resource_version
        self._listed_at = time.monotonic()
        self.stats.lists += 1
        if self.synced.is_set():
            log.info(
                "%s: listed %d at resourceVersion %s: %d added, %d changed, %d deleted",
                self.name,
                len(listed),
                resource_version,
                len(diff.added),
                len(diff.changed),
                len(diff.deleted),
            )
            self.output.commit()
        else:
            log.info(
                "%s: listed %d at resourceVersion %s", self.name, len(listed), resource_version
            )
            self.output.mark_synced()
            self.synced.set()

    def _apply_listed(self, raw: msgspec.Raw, listed: dict[Key, str]) -> None:
        obj = self._decode(raw)
        if obj is None:
            return
        meta = obj.metadata if not isinstance(obj, k8s.ObjectMeta) else obj
        key = _key(meta)
        listed[key] = meta.resource_version
        if self.known.get(key) != meta.resource_version or not meta.resource_version:
            self.output.apply(key, obj if not isinstance(obj, k8s.ObjectMeta) else None)

    def _decode(self, raw: msgspec.Raw) -> T | k8s.ObjectMeta | None:
        """The object; only its metadata if the rest does not decode (it is then reported, and
        treated as absent); None if not even that decodes."""
        try:
            return self._decoder.decode(raw)
        except (msgspec.ValidationError, RecursionError) as exc:
            # RecursionError: nested deeper than msgspec decodes (thousands of levels).
            self.stats.undecodable += 1
            try:
                meta = _meta_decoder.decode(raw).metadata
            except (msgspec.DecodeError, RecursionError):
                log.error("%s: an object that does not decode (%s); skipped", self.name, exc)
                return None
            where = f"{meta.namespace}/{meta.name}" if meta.namespace else meta.name
            log.error("%s %s: %s; skipped", self.name, where, exc)
            return meta

    # Watching.

    async def _watch(self) -> None:
        timeout = watch_timeout(self.settings.watch_timeout_s, self._rand)
        params = {
            "watch": "1",
            "resourceVersion": self.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(timeout),
            **self.resource.selectors(),
        }
        idle = watch_idle_timeout(timeout, self.settings.watch_idle_s)
        try:
            async with self.client.stream_lines(
                self.resource.path, params, idle_timeout=idle
            ) as batches:
                self.stats.watches += 1
                async for lines in batches:
                    try:
                        for line in lines:
                            self._event(line)
                    finally:
                        self.output.commit()
        except ApiStatusError as exc:
            if exc.status == 410:
                raise Gone(f"resourceVersion {self.resource_version}: {exc}") from None
            raise

    def _event(self, line: bytes) -> None:
        try:
            event = _event_decoder.decode(line)
        except (msgspec.DecodeError, RecursionError) as exc:
            # Which object it was is unknown: a relist gets them all again, each decoded on
            # its own (a bad one is then skipped by name).
            self.resource_version = ""
            raise WatchFailed(
                f"a watch event that does not decode ({exc}); listing again"
            ) from None
        kind = event.type
        if kind == "ERROR":
            status = _status_decoder.decode(event.object)
            if status.code == 410:
                raise Gone(f"resourceVersion {self.resource_version}: {status.message}")
            raise WatchFailed(f"watch error {status.code} {status.reason}: {status.message}")
        obj = self._decode(event.object)
        if obj is None:
            return
        meta = obj if isinstance(obj, k8s.ObjectMeta) else obj.metadata
        if meta.resource_version:
            self.resource_version = meta.resource_version
        if kind == "BOOKMARK":
            self.stats.bookmarks += 1
            return
        self.stats.events += 1
        key = _key(meta)
        if kind == "DELETED":
            self.known.pop(key, None)
            self.output.apply(key, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.known[key] = meta.resource_version
            self.output.apply(key, obj if not isinstance(obj, k8s.ObjectMeta) else None)
        else:
            log.warning("%s: unknown watch event type %r; ignored", self.name, kind)
