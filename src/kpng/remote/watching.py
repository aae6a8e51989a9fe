"""Watching a kpng (or Go KPNG) server over gRPC, with reconnection."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
import msgspec
from google.protobuf.message import DecodeError

from kpng.api import WARNING_METADATA, batchv1_pb2, codec, globalv1_pb2, localv1_pb2
from kpng.api.digests import (
    ANSWER_BYTES_MAX,
    ANSWERED_SERVICES_MAX,
    BUCKETS,
    Holdings,
    item_digest,
)
from kpng.backoff import Backoff
from kpng.errors import KpngError, WireError
from kpng.model.messages import ChangeTriggers, Endpoint, NodeFacts, Service
from kpng.remote.address import Api
from kpng.remote.sinks import NodeSink, Sink, TriggerSink

log = logging.getLogger(__name__)

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc has it, its type stubs do not
"""What a call's read() gives at the end of the stream."""


class OpHandler(Protocol):
    """Consumes a watch stream's ops. ``op`` takes Set, Delete and Reset (kind, set, path,
    payload) and is synchronous, as ops come by the hundred thousand; ``sync`` closes a change
    set and returns True to stop watching. A handler of a node watch that resumes also has
    ``resumed()``, called before the ops of a resumed change set (LocalOps)."""

    def op(self, kind: str, set_: int, path: str, payload: bytes) -> None: ...

    async def sync(self) -> bool: ...


def _resumed(handle: object) -> None:
    resumed = getattr(handle, "resumed", None)
    if resumed is None:
        raise WireError("the server resumed a watch whose handler cannot resume")
    resumed()


def answer_ask(holdings: Holdings, ask: batchv1_pb2.DigestAsk) -> batchv1_pb2.WatchReq:
    """The answer to a server's ask for digests, from what is held. The server's ask is
    checked, and the answer bounded: a watcher holding too much to answer gives its holdings
    up and starts over with a whole state (WireError ends the stream)."""
    reply = batchv1_pb2.WatchReq()
    if ask.Buckets:
        reply.Buckets = b"".join(holdings.bucket_digests())
    if ask.ServicesIn:
        buckets = set(ask.ServicesIn)
        if len(ask.ServicesIn) > BUCKETS or max(buckets) >= BUCKETS:
            raise WireError(
                f"the server asked for the services of buckets {sorted(buckets)[:8]}..."
            )
        services = holdings.service_digests(sorted(buckets))
        if len(services) > ANSWERED_SERVICES_MAX:
            holdings.complete = False
            raise WireError(f"{len(services)} services to vouch for: too many, starting over")
        reply.Services.extend(
            batchv1_pb2.ServiceDigest(Path=path, Digest=digest) for path, digest in services
        )
    if reply.ByteSize() > ANSWER_BYTES_MAX:
        holdings.complete = False
        raise WireError(f"an answer of {reply.ByteSize()} bytes: too big, starting over")
    return reply


def _batch_ops(message: batchv1_pb2.OpBatch) -> Iterator[localv1_pb2.OpItem]:
    """An OpBatch's ops: those of its Packed entries, in order, then its own."""
    for entry in message.Packed:
        try:
            packed = batchv1_pb2.OpBatch.FromString(codec.unpacked(entry))
        except DecodeError as exc:
            raise WireError(f"a Packed entry that is no OpBatch: {exc}") from None
        yield from packed.Ops
    yield from message.Ops


@dataclass
class WatchRecord:
    """What a node agent's watch went through, for its ``/metrics``: whether it is live, since
    when it is not, how its first states came and why its streams ended."""

    up: bool = False
    """A stream delivered a change set and has not failed since."""
    down_since: float = field(default_factory=time.monotonic)
    """When the watch last stopped being live (monotonic): the start, if it never was."""
    first_states: dict[str, int] = field(default_factory=lambda: {"whole": 0, "resumed": 0})
    """Streams by how their first change set came: a whole state, or resumed from digests."""
    failures: dict[str, int] = field(default_factory=dict)
    """Streams that ended, by cause: a gRPC status code's name, ``ended`` (the server closed
    it), ``wire`` (a message kpng could not read) or ``token`` (the token file)."""

    def down_for(self, now: float) -> float:
        return 0.0 if self.up else now - self.down_since


WATCHED = WatchRecord()
"""The node watch of this process (``kpng local`` follows one brain), as ``/metrics`` shows it."""


@dataclass(frozen=True)
class _Rpc:
    path: str
    request: Any
    response: Any
    batched: bool


async def _follow_once(
    channel: grpc.aio.Channel,
    rpc: _Rpc,
    handle: OpHandler,
    warned: set[str] | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
    holdings: Holdings | None = None,
) -> bool:
    """One stream, until it breaks (False) or the handler asks to stop (True). The server's
    warnings (a node it does not know) are logged, each once in ``warned``. With complete
    ``holdings`` (a batched node watch), the first request says what is held, and the
    server's asks are answered from them (docs/design/resume.md)."""
    call = channel.stream_stream(
        rpc.path,
        request_serializer=type(rpc.request).SerializeToString,
        response_deserializer=rpc.response.FromString,
    )(metadata=metadata or None)  # type: ignore[call-arg]  # aio: written to, not iterated
    message: Any
    resumable = holdings if holdings is not None and holdings.complete else None
    try:
        if resumable is not None:
            first = batchv1_pb2.WatchReq()
            first.CopyFrom(rpc.request)
            first.Holds = resumable.digest()
            await call.write(first)
        else:
            await call.write(rpc.request)
        on_op = handle.op
        followed = False  # the server sends each change set unasked (OpBatch.Following)
        if warned is not None:
            for key, value in await call.initial_metadata() or ():
                if key == WARNING_METADATA and value not in warned:
                    warned.add(str(value))
                    log.warning("the server says: %s", value)
        while (message := await call.read()) is not _EOF:
            _check_read(message, rpc)
            if rpc.batched and message.Following:
                followed = True
            if rpc.batched and (message.HasField("Ask") or message.Resumed):
                if resumable is None:  # no digests offered, or past the first change set
                    raise WireError("the server resumed a watch it was not asked to")
                if message.HasField("Ask"):
                    await call.write(answer_ask(resumable, message.Ask))
                    continue
                _resumed(handle)
            ops = iter(_batch_ops(message) if rpc.batched else (message,))
            while _hand(on_op, ops):
                resumable = None  # only a stream's first change set resumes
                if await handle.sync():
                    return True
                if followed:
                    return await _followed(call, rpc, handle, list(ops))
                await call.write(rpc.request)  # ask for the next change set
        return False
    finally:
        call.cancel()


def _check_read(message: Any, rpc: _Rpc) -> None:
    if message is None:
        # What grpc reads for bytes its deserializer refused (a truncated or foreign message):
        # what it held is unknown, so the stream cannot go on; the next connection starts
        # again with the whole state.
        name = rpc.response.DESCRIPTOR.full_name
        raise WireError(f"the server sent a message that is no {name}")


def _hand(on_op: Callable[[str, int, str, bytes], None], ops: Iterator[Any]) -> bool:
    """Hand ``ops`` on to ``on_op`` up to the next Sync: True if one came (the rest of ``ops``
    follows it), False if they ran out first."""
    for op in ops:
        kind = op.WhichOneof("Op")
        if kind == "Set":
            item = op.Set
            ref = item.Ref
            on_op(kind, ref.Set, ref.Path, item.Bytes)
        elif kind == "Delete":
            on_op(kind, op.Delete.Set, op.Delete.Path, b"")
        elif kind == "Sync":
            return True
        elif kind is not None:
            on_op(kind, 0, "", b"")
    return False


READ_AHEAD_OPS = 65_536
"""Ops a followed watch reads ahead while its handler syncs. Past them it stops reading:
HTTP/2's flow control then holds the server back, which merges what changes meanwhile."""


async def _followed(call: Any, rpc: _Rpc, handle: OpHandler, queued: list[Any]) -> bool:
    """The rest of a stream the server follows, after its first change set (``queued``: ops
    read past that change set's Sync). Ops are handed on as they come, but not while the
    handler syncs: they are read ahead meanwhile, and the change sets complete when the sync
    ends are handed on together, with one sync. So a backend slower than the cluster's changes
    applies the latest state, not each step to it, as when it asked for each change set."""
    on_op = handle.op
    syncing: asyncio.Task[bool] | None = None
    reading: asyncio.Task[Any] | None = None
    try:
        while True:
            if syncing is None and queued:
                synced = _last_sync(queued)
                ops = iter(queued[:synced] if synced else queued)
                while _hand(on_op, ops):  # the Syncs but the last are the change sets' merge
                    pass
                del queued[: synced or len(queued)]
                if synced:
                    syncing = asyncio.ensure_future(handle.sync())
            if reading is None and len(queued) < READ_AHEAD_OPS:
                reading = asyncio.ensure_future(call.read())
            waits = [task for task in (reading, syncing) if task is not None]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if syncing is not None and syncing.done():
                if syncing.result():
                    return True
                syncing = None
            if reading is not None and reading.done():
                try:
                    message = reading.result()
                except Exception:
                    # The stream broke: an apply under way is not cut short for it.
                    if syncing is not None and await syncing:
                        return True
                    raise
                reading = None
                if message is _EOF:
                    return syncing is not None and await syncing
                _check_read(message, rpc)
                if message.HasField("Ask") or message.Resumed:
                    raise WireError("the server resumed a watch past its first change set")
                queued.extend(_batch_ops(message))
    finally:
        for task in (reading, syncing):
            if task is not None:
                task.cancel()


def _last_sync(ops: list[Any]) -> int:
    """The index just past the last Sync of ``ops``, 0 if there is none."""
    for index in range(len(ops) - 1, -1, -1):
        if ops[index].WhichOneof("Op") == "Sync":
            return index + 1
    return 0


async def follow(
    api: Api,
    *,
    batched: _Rpc,
    compatible: _Rpc,
    handle: Callable[[bool], OpHandler],
    backoff: Backoff | None = None,
    first_state_within: float | None = None,
    holdings: Holdings | None = None,
    record: WatchRecord | None = None,
) -> None:
    """Follow a watch RPC until the handler asks to stop, reconnecting with backoff.
    ``holdings``, fed by the batched handler, let a reconnection resume instead of receiving
    the whole state again. ``record`` is kept up to date with the watch's outages.

    The batched RPC is tried first; a server without it (Go KPNG) is spoken to with the
    compatible one. ``handle(json)`` gives the op handler for payloads in JSON or protobuf. A
    sync resets the backoff. Without a first state within ``first_state_within`` seconds,
    raises NoStateError; once a state has come, outages are waited out however long.
    """
    outage = _Outage(api.url, record or WatchRecord())
    deadline = asyncio.timeout(first_state_within)
    try:
        async with deadline:
            await _reconnecting(
                api, batched, compatible, handle, backoff or Backoff(), outage, deadline, holdings
            )
    except TimeoutError:
        if not deadline.expired():
            raise
        raise NoStateError(
            f"no state from {api.url} within {first_state_within:g} s "
            f"(last: {outage.why or 'no answer'})"
        ) from None


async def _reconnecting(
    api: Api,
    rpc: _Rpc,
    compatible: _Rpc,
    handle: Callable[[bool], OpHandler],
    backoff: Backoff,
    outage: _Outage,
    deadline: asyncio.Timeout,
    holdings: Holdings | None,
) -> None:
    batched = rpc
    warned: set[str] = set()
    replicas = api.replicas()
    turn = 0
    while True:
        server = replicas[turn % len(replicas)]
        try:
            metadata = server.metadata()
            async with server.channel() as channel:
                handler = _Resetting(backoff, outage, handle(rpc is batched), deadline)
                resume = holdings if rpc is batched else None
                if await _follow_once(channel, rpc, handler, warned, metadata, resume):
                    return
            outage.failed(f"{server.url}: the stream ended", "ended")
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and rpc is batched:
                log.info("%s has no batched watch; using %s", server.url, compatible.path)
                rpc = compatible
                continue
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and holdings is not None:
                # A brain that refuses to resume from these digests (a bug on either side, or
                # too much to vouch for): the next attempt asks for the whole state.
                holdings.complete = False
            outage.failed(f"{server.url}: {exc.code().name}: {exc.details()}", exc.code().name)
        except OSError as exc:
            outage.failed(f"token file {server.token_file}: {exc.strerror or exc}", "token")
        except WireError as exc:
            outage.failed(f"{server.url}: {exc}", "wire")
        except asyncio.InvalidStateError:
            # grpc's asyncio call, asked for the next change set after the server ended it
            # (a brain killed between its change set and the agent's next request), says
            # so with this rather than an AioRpcError: the brain is gone, like any other.
            outage.failed(f"{server.url}: the server ended the call", "ended")
        # The next replica, if any: a state it serves is the same, so nothing changes on the
        # node but what changed meanwhile (the full-state client compares; Sinks see no reset).
        turn += 1
        delay = await backoff.wait()
        log.debug("reconnecting to %s after %.2fs", replicas[turn % len(replicas)].url, delay)


class NoStateError(KpngError):
    """A watch received no first state within its deadline (a wrong or unreachable --api)."""


class _Outage:
    """Logs the start and the end of an outage once each, not every failed retry, and keeps
    ``record`` up to date."""

    def __init__(self, url: str, record: WatchRecord) -> None:
        self.url = url
        self.record = record
        self.down = False
        self.ever_synced = False
        self.why = ""

    def failed(self, why: str, cause: str) -> None:
        self.why = why
        record = self.record
        record.failures[cause] = record.failures.get(cause, 0) + 1
        if record.up:
            record.up = False
            record.down_since = time.monotonic()
        level = logging.DEBUG if self.down else logging.WARNING
        keeping = "the last state stays in force" if self.ever_synced else "no state yet"
        log.log(level, "watch of %s failed (%s); %s; retrying", self.url, why, keeping)
        self.down = True

    def synced(self) -> None:
        self.ever_synced = True
        self.record.up = True
        if self.down:
            log.info("watch of %s is back", self.url)
            self.down = False


class _Resetting:
    """A sync proves the connection works: the next failure starts from a short delay again,
    and the deadline for a first state is met. One per stream."""

    def __init__(
        self, backoff: Backoff, outage: _Outage, handle: OpHandler, deadline: asyncio.Timeout
    ) -> None:
        self.op = handle.op
        self._handle = handle
        self._backoff = backoff
        self._outage = outage
        self._deadline = deadline
        self._first: str | None = "whole"
        """How the stream's first change set came, until its sync is counted."""

    def resumed(self) -> None:
        _resumed(self._handle)
        self._first = "resumed"

    async def sync(self) -> bool:
        if self._first is not None:
            self._outage.record.first_states[self._first] += 1
            self._first = None
        self._backoff.reset()
        self._outage.synced()
        self._deadline.reschedule(None)
        return await self._handle.sync()


_json_service = msgspec.json.Decoder(Service)
_json_endpoint = msgspec.json.Decoder(Endpoint)
_json_facts = msgspec.json.Decoder(NodeFacts)
_json_triggers = msgspec.json.Decoder(ChangeTriggers)

T = TypeVar("T")


def json_decoding(decoder: msgspec.json.Decoder[T]) -> Callable[[bytes], T]:
    """``decoder.decode``, raising WireError for a payload that is not its JSON."""
    name = getattr(decoder.type, "__name__", "message")

    def decode(payload: bytes) -> T:
        try:
            return decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise WireError(f"not a {name} in JSON: {exc}") from None

    return decode


def _path_parts(path: str) -> list[str]:
    """What sorts paths in the Sink's order: by namespace, name and endpoint key."""
    return path.split("/", 2)


def endpoint_path(path: str) -> tuple[str, str, str]:
    """(namespace, service, key) of an endpoint's path; WireError if it has fewer parts."""
    parts = path.split("/", 2)
    if len(parts) != 3:
        raise WireError(f"endpoint path {path!r} is not namespace/service/key")
    return parts[0], parts[1], parts[2]


def report_skipped(url: str, kind: str, set_: int, path: str, exc: WireError) -> None:
    """An op the server sent that kpng cannot read: it changes nothing, and is said."""
    log.error("%s sent a %s of set %d, path %r, that kpng cannot read (%s); skipped",
              url, kind, set_, path, exc)  # fmt: skip


@dataclass
class _Whole:
    """A whole state's Sets as they came, by path: each item's digest (empty without holdings)
    and what it decoded to, kept until its Sync."""

    services: dict[str, tuple[bytes, Service]] = field(default_factory=dict)
    endpoints: dict[str, tuple[bytes, str, str, str, Endpoint]] = field(default_factory=dict)


class LocalOps:
    """Dispatches node-local ops to an incremental Sink: node facts to a NodeSink, trigger
    times to a TriggerSink, each only if the sink is one.

    With ``holdings`` (a batched watch), it keeps the digests of what the sink was handed, from
    the payload bytes as they came, so that a reconnection can resume; and it applies a resumed
    change set (docs/design/resume.md). Such a change set sends whole each service that differs
    (the server knows only that its digest does), and deletes by service path alone the
    services the node should not hold: here only the items that really differ reach the sink,
    in the Sink's order, the endpoints held but not sent again deleted; and when nothing
    differed, the sink is not even synced.

    A whole state (a change set that starts with Reset) is held here until its Sync and handed
    on in the Sink's order: a packed one comes as its zone's base in bucket order, then the
    node's own services, some set twice (kpng.server.firststates).
    """

    def __init__(
        self,
        sink: Sink,
        *,
        json: bool,
        url: str,
        warned: set[str],
        holdings: Holdings | None = None,
    ) -> None:
        self._sink = sink
        self._service = json_decoding(_json_service) if json else codec.SERVICE.decode
        self._endpoint = json_decoding(_json_endpoint) if json else codec.ENDPOINT.decode
        self._facts = json_decoding(_json_facts) if json else codec.NODE_FACTS.decode
        self._triggers = json_decoding(_json_triggers) if json else codec.CHANGE_TRIGGERS.decode
        self._node_sink = sink if isinstance(sink, NodeSink) else None
        self._trigger_sink = sink if isinstance(sink, TriggerSink) else None
        self._url = url
        self._warned = warned
        self._first = True
        self._facts_seen = False
        self._holdings = holdings
        self._resuming = False
        self._applied = False
        """Whether the resumed change set handed the sink anything."""
        self._resent: set[str] = set()
        """Paths of the items a resumed change set sent."""
        self._gone: list[str] = []
        """Services a resumed change set deleted."""
        self._whole: _Whole | None = None
        """The services and endpoints of a whole state, until its Sync."""

    def resumed(self) -> None:
        """The change set coming resumes what is held."""
        if self._holdings is None:
            raise WireError("the server resumed a watch that offered no digests")
        self._resuming = True
        self._facts_seen = True  # the digests said the facts are held
        self._applied = False

    def op(self, kind: str, set_: int, path: str, payload: bytes) -> None:
        """One op to the sink; one kpng cannot read (a hostile or broken server's) is reported
        and skipped, so that it changes nothing the sink holds."""
        try:
            self._op(kind, set_, path, payload)
        except WireError as exc:
            report_skipped(self._url, kind, set_, path, exc)

    def _op(self, kind: str, set_: int, path: str, payload: bytes) -> None:
        sink = self._sink
        held = self._holdings
        if held is not None:
            held.complete = False  # until this change set's Sync
        whole = self._whole
        if whole is not None and set_ in (localv1_pb2.ServicesSet, localv1_pb2.EndpointsSet):
            # Decoded now: a Set kpng cannot read is skipped, and keeps an earlier one's value.
            if set_ == localv1_pb2.ServicesSet:
                if kind == "Set":
                    service = self._checked_service(path, payload)
                    digest = item_digest(path, payload) if held is not None else b""
                    whole.services[path] = (digest, service)
                elif kind == "Delete":
                    whole.services.pop(path, None)
            elif kind == "Set":
                parts, endpoint = endpoint_path(path), self._endpoint(payload)
                digest = item_digest(path, payload) if held is not None else b""
                whole.endpoints[path] = (digest, *parts, endpoint)
            elif kind == "Delete":
                whole.endpoints.pop(path, None)
            return
        if kind == "Set":
            if set_ == localv1_pb2.EndpointsSet:
                namespace, name, key = endpoint_path(path)
                if held is None:
                    sink.set_endpoint(namespace, name, key, self._endpoint(payload))
                    return
                self._set(held, f"{namespace}/{name}", path, payload)
            elif set_ == localv1_pb2.ServicesSet:
                if held is None:
                    sink.set_service(self._checked_service(path, payload))
                    return
                self._set(held, path, path, payload)
            elif set_ == localv1_pb2.NodeFactsSet:
                self._facts_seen = True
                digest = item_digest(path, payload) if held is not None else b""
                if held is not None and self._resuming and held.facts == digest:
                    return
                if self._node_sink is not None:
                    self._node_sink.set_node(self._facts(payload))
                    self._applied = True
                if held is not None:
                    held.facts = digest
            elif set_ == localv1_pb2.ChangeTriggersSet and self._trigger_sink is not None:
                self._trigger_sink.triggered(self._triggers(payload))
        elif kind == "Delete":
            if set_ == localv1_pb2.EndpointsSet:
                namespace, name, key = endpoint_path(path)
                sink.delete_endpoint(namespace, name, key)
                self._applied = True
                if held is not None:
                    held.delete(f"{namespace}/{name}", path)
            elif set_ == localv1_pb2.ServicesSet:
                if self._resuming:
                    self._gone.append(path)  # after its endpoints, at the Sync
                    return
                namespace, _, name = path.partition("/")
                sink.delete_service(namespace, name)
                if held is not None:
                    held.drop(path)
        elif kind == "Reset":
            sink.reset()
            if held is not None:
                held.clear()
            self._whole = _Whole()

    def _hand_whole(self, whole: _Whole) -> None:
        """A whole state's services and endpoints to the sink, in the Sink's order."""
        sink, held = self._sink, self._holdings
        services, endpoints = whole.services, whole.endpoints
        for path in sorted(services, key=_path_parts):
            digest, service = services[path]
            sink.set_service(service)
            if held is not None:
                held.set(path, path, digest)
        for path in sorted(endpoints, key=_path_parts):
            digest, namespace, name, key, endpoint = endpoints[path]
            sink.set_endpoint(namespace, name, key, endpoint)
            if held is not None:
                held.set(f"{namespace}/{name}", path, digest)

    def _checked_service(self, path: str, payload: bytes) -> Service:
        service = self._service(payload)
        # The path is the service's key: a payload naming another service (or none) would
        # leave the key the server deletes it by with no service.
        if path != f"{service.Namespace}/{service.Name}" or not service.Name:
            raise WireError(f"the payload is service {service.Namespace}/{service.Name}")
        return service

    def _set(self, held: Holdings, service: str, path: str, payload: bytes) -> None:
        """A Set of a service (``path`` is ``service``) or of one of its endpoints."""
        digest = item_digest(path, payload)
        if self._resuming:
            self._resent.add(path)
            if held.items(service).get(path) == digest:
                return  # held already: the sink is not told again
        if path == service:
            self._sink.set_service(self._checked_service(path, payload))
        else:
            namespace, name, key = endpoint_path(path)
            self._sink.set_endpoint(namespace, name, key, self._endpoint(payload))
        self._applied = True
        held.set(service, path, digest)

    def _end_resume(self, held: Holdings) -> None:
        """Delete what a resumed change set did not send again of the services it sent, and
        the services it deleted with their endpoints: endpoints first, each run in order."""
        resent = self._resent
        replaced = {path for path in resent if path.count("/") == 1}
        gone = sorted(set(self._gone))
        endpoints: list[tuple[str, str]] = []
        for service in replaced | set(gone):
            endpoints += (
                (service, path)
                for path in held.items(service)
                if path != service and (service in gone or path not in resent)
            )
        for service, path in sorted(endpoints, key=lambda e: endpoint_path(e[1])):
            namespace, name, key = endpoint_path(path)
            self._sink.delete_endpoint(namespace, name, key)
            held.delete(service, path)
            self._applied = True
        for service in gone:
            if service in held.services():
                namespace, _, name = service.partition("/")
                self._sink.delete_service(namespace, name)
                held.drop(service)
                self._applied = True
        self._resent = set()
        self._gone = []
        self._resuming = False

    async def sync(self) -> bool:
        if self._first:
            self._first = False
            if not self._facts_seen and "facts" not in self._warned:
                # Go KPNG's brain: its backends run as they would under Go KPNG.
                self._warned.add("facts")
                log.warning(
                    "%s sends no node facts (a Go KPNG brain?): the node's addresses, pod "
                    "CIDRs and ServiceCIDRs are unknown here, so --nodeport-addresses primary "
                    "serves every local address and --detect-local-mode NodeCIDR detects "
                    "nothing as local",
                    self._url,
                )
        if self._whole is not None:
            self._hand_whole(self._whole)
            self._whole = None
        held = self._holdings
        if held is not None and self._resuming:
            self._end_resume(held)
            if not self._applied:  # nothing differed: nothing to apply
                held.complete = True
                return False
        done = self._sink.sync()
        if inspect.isawaitable(done):
            done = await done
        if held is not None:
            held.complete = True
        return bool(done)


async def watch_local(
    sink: Sink,
    *,
    api: Api | str,
    node_name: str,
    backoff: Backoff | None = None,
    first_state_within: float | None = None,
) -> None:
    target = Api(api) if isinstance(api, str) else api
    warned: set[str] = set()
    # Kept across reconnections, to any replica: what lets them resume.
    holdings = Holdings()
    await follow(
        target.check(),
        batched=_Rpc(
            "/kpng.batchv1.Sets/Watch",
            batchv1_pb2.WatchReq(
                NodeName=node_name, Encoding=batchv1_pb2.JSON, Packed=True, Follow=True
            ),
            batchv1_pb2.OpBatch,
            batched=True,
        ),
        compatible=_Rpc(
            "/localv1.Sets/Watch",
            localv1_pb2.WatchReq(NodeName=node_name),
            localv1_pb2.OpItem,
            batched=False,
        ),
        handle=lambda json: LocalOps(
            sink, json=json, url=target.url, warned=warned, holdings=holdings if json else None
        ),
        backoff=backoff,
        first_state_within=first_state_within,
        holdings=holdings,
        record=WATCHED,
    )


def global_rpcs() -> tuple[_Rpc, _Rpc]:
    """The batched and compatible global watch RPCs."""
    return (
        _Rpc(
            "/kpng.batchv1.Sets/WatchGlobal",
            batchv1_pb2.GlobalWatchReq(Encoding=batchv1_pb2.JSON),
            batchv1_pb2.OpBatch,
            batched=True,
        ),
        _Rpc(
            "/globalv1.Sets/Watch",
            globalv1_pb2.GlobalWatchReq(),
            localv1_pb2.OpItem,
            batched=False,
        ),
    )
