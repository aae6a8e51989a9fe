"""``to-api``: the localv1, globalv1 and batchv1 watch services over gRPC (TCP or unix sockets).

Responses are written as pre-encoded bytes (the generic handlers have no response serializer),
so a change set is framed once and the payloads inside it are shared by every stream; watchers
whose views make the same transition share its ops and their framing too (``SharedOps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import AsyncGeneratorType
from typing import Any, TypeVar, cast

import grpc
import msgspec
from google.protobuf.message import DecodeError

from kpng.addresses import check_grpc_url
from kpng.api import WARNING_METADATA, batchv1_pb2, codec, globalv1_pb2, localv1_pb2
from kpng.api.digests import item_digest
from kpng.api.localv1_pb2 import ChangeTriggersSet, NodeFactsSet
from kpng.api.ops import FirstOps
from kpng.errors import UsageError
from kpng.logs import printable
from kpng.model.cluster import NODE_NAME_MAX, unknown_node
from kpng.model.messages import ChangeTriggers, Endpoint, NodeFacts, Service
from kpng.model.paths import NODE_FACTS_PATH, TRIGGERS_PATH
from kpng.resolver.resolving import NodeView
from kpng.server.auth import Refused, WatchAuth
from kpng.server.changesets import (
    ChangeSet,
    GlobalTracker,
    Shared,
    SharedOps,
    batches,
)
from kpng.server.firststates import BaseFrames, corrections
from kpng.server.hub import Hub, PayloadCache, Turn, Turns
from kpng.server.resuming import (
    DIFFERING_BUCKETS_MAX,
    BadAnswer,
    BaseDigests,
    ServiceDigests,
    answered_services,
    check_holds,
    differences,
    differing_buckets,
)
from kpng.store import Store

log = logging.getLogger(__name__)
T = TypeVar("T")


# Batches are cut at about this size: well under gRPC's default 4 MiB receive limit, and small
# enough that the memory a stream keeps after sending its big first state stays small: measured
# with 300 idle watchers of 10,000 services x 10 endpoints, the brain's peak RSS grew 0.98 MB a
# watcher at 256 KiB, 1.27 MB at 1 MiB (and 1.48 MB at 64 KiB, where messages are many).
BATCH_BYTES = 1 << 18
_JSON = msgspec.json.Encoder()
FIRST_REQUEST_S = 60.0
"""How long a new stream may take to send its first request, counted from when the brain takes
the call (its handler begins; the wait in gRPC's queue before is not counted), and a resuming
watcher to answer each digest ask.

kpng's watchers send their request at once, but in a mass connect "at once" is late: in a
5,000-node fail-over on two shared cores the agents' first requests reached the brain's socket
up to 28 s after the stream's HEADERS (their processes were saturated; the brain advertised a
4 MiB window, so nothing held them back), and the brain read them up to 6 s after that. At
10 s, 2,000 of 5,000 streams were ended DEADLINE_EXCEEDED (INTERNAL, if the agent was writing)
and retried, which made the storm longer. 60 s, the fleet's fail-over target, is longer than
any such wait measured, and a stream that never asks still costs the brain little meanwhile:
its token is checked before the wait, and a connection holds at most
``STREAMS_PER_CONNECTION`` (docs/design/mass-connect.md)."""
STREAMS_PER_CONNECTION = 100
"""Streams one connection may have open at once (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS)."""
PENDING_CALLS = 20_000
"""New calls gRPC's core holds for the server before it starts refusing some at random.

grpc.aio takes new calls from the core one at a time, one event-loop turn each, so a mass
connect (a brain restart, every node agent back at once) outruns it and the rest wait in the
core. gRPC's defaults (1,000, and 3,000 past which it refuses all) then cancel calls kpng never
sees: the watcher gets CANCELLED, or INTERNAL if it had sent its request, and retries, which
costs more than waiting would have (docs/design/mass-connect.md: 10,000 watches needed 85,000
retries). 20,000 is two streams (one switching nodes) for each of 10,000 nodes."""
PENDING_CALLS_HARD = 2 * PENDING_CALLS
"""Past this gRPC refuses every new call: a waiting call costs some 13 KiB (measured), so half a
GiB at most."""
WARNED_NODES = 4096
"""Unknown node names remembered, to warn of each once."""


@dataclass(frozen=True)
class ListenAddress:
    """``tcp://HOST:PORT`` or ``unix:///PATH``."""

    url: str

    @property
    def unix_path(self) -> Path | None:
        return Path(self.url.removeprefix("unix://")) if self.url.startswith("unix://") else None

    @property
    def grpc_target(self) -> str:
        path = self.unix_path
        return f"unix:{path}" if path is not None else self.url.removeprefix("tcp://")

    @classmethod
    def parse(cls, text: str) -> ListenAddress:
        return cls(check_grpc_url(text, flag="--listen", listening=True))


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    ca: Path | None = None
    """With a CA, clients must present a certificate it signed (mutual TLS)."""

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if self.ca else None,
            require_client_auth=self.ca is not None,
        )


@dataclass(frozen=True)
class Encoders:
    """How a stream encodes payloads (protobuf or canonical JSON), shared by every stream that
    chose the same encoding, with the caches that go with it."""

    service: Callable[[Service], bytes]
    endpoint: Callable[[Endpoint], bytes]
    info: Callable[[msgspec.Struct], bytes]
    facts: Callable[[NodeFacts], bytes]
    triggers_op: Callable[[ChangeTriggers], bytes]
    """The framed op: a revision's triggers are one object for every watcher that answers it."""
    first_ops: FirstOps
    shared_ops: SharedOps
    digests: ServiceDigests
    """Service digests for resuming watchers (batchv1's Holds), over this encoding's bytes."""
    base_digests: BaseDigests
    """Node digests from their zone base's, over ``digests``."""
    base_frames: BaseFrames
    """Zone bases packed once for the first states of their nodes, over ``first_ops``."""

    @classmethod
    def protobuf(cls) -> Encoders:
        service = PayloadCache(codec.SERVICE.encode)  # protobuf encoding is costly: cached
        endpoint = PayloadCache(codec.ENDPOINT.encode)
        first_ops = FirstOps(service, endpoint)
        return cls(
            service,
            endpoint,
            _encode_info_protobuf,
            codec.NODE_FACTS.encode,
            _triggers_op(codec.CHANGE_TRIGGERS.encode),
            first_ops,
            SharedOps(service, endpoint, first_ops),
            digests := ServiceDigests(service, endpoint),
            BaseDigests(digests),
            BaseFrames(first_ops, message_bytes=BATCH_BYTES),
        )

    @classmethod
    def json(cls) -> Encoders:
        encode = _JSON.encode
        first_ops = FirstOps(encode, encode)
        return cls(
            encode,
            encode,
            encode,
            encode,
            _triggers_op(encode),
            first_ops,
            SharedOps(encode, encode, first_ops),
            digests := ServiceDigests(encode, encode),
            BaseDigests(digests),
            BaseFrames(first_ops, message_bytes=BATCH_BYTES),
        )


def _triggers_op(encode: Callable[[ChangeTriggers], bytes]) -> PayloadCache[ChangeTriggers]:
    def op(triggers: ChangeTriggers) -> bytes:
        return codec.op_set(ChangeTriggersSet, TRIGGERS_PATH, encode(triggers))

    return PayloadCache(op, size=1024)


def _encode_info_protobuf(info: msgspec.Struct) -> bytes:
    return codec.GLOBAL_INFOS[type(info)].encode(info)


async def _parsed(
    requests: AsyncIterator[bytes],
    message: Any,
    context: Any,
    first_request_s: float,
    call: _Call,
) -> AsyncIterator[Any]:
    """Requests parsed here rather than by gRPC, so a malformed one is answered with
    INVALID_ARGUMENT and a clear message instead of a server-side traceback. The first must come
    within ``first_request_s``: a stream that never asks holds memory and is never checked."""
    incoming = aiter(requests)
    try:
        async with asyncio.timeout(first_request_s):
            first: bytes | None = await anext(incoming)
    except StopAsyncIteration:
        return
    except TimeoutError:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED, f"no request within {first_request_s:g} s"
        )
        return
    call.first_request = time.monotonic()
    while True:
        if first is not None:
            data, first = first, None
        else:
            try:
                data = await anext(incoming)
            except StopAsyncIteration:
                return
        try:
            yield message.FromString(data)
        except DecodeError as exc:
            log.warning(
                "malformed %s from %s: %s", message.DESCRIPTOR.full_name, context.peer(), exc
            )
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message.DESCRIPTOR.full_name}"
            )


@dataclass
class _Call:
    """One watch call as the brain saw it, for the log line and the count of its ending: who,
    and when its handler began (the brain took it), its first request came and its first state
    was written (``time.monotonic``). The peer is read at the start: a generator closed after
    its call ended may no longer ask gRPC."""

    peer: str
    began: float
    first_request: float | None = None
    first_state: float | None = None

    def waits(self, now: float) -> str:
        def since(at: float | None) -> str:
            return "none" if at is None else f"after {at - self.began:.1f} s"

        return (
            f"{now - self.began:.1f} s after the brain took it; first request "
            f"{since(self.first_request)}, first state {since(self.first_state)}"
        )


CALL_CODES = (
    "OK",
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "UNKNOWN",
)
"""How the brain's watch calls end: the codes ``kpng_api_calls_ended_total`` always shows."""
QUIET_CODES = frozenset({"OK", "CANCELLED"})
"""Endings that are the watcher's own doing (a node agent switching replicas or stopping),
logged at debug level only: OK, it ended its stream while the brain read it; CANCELLED, while
the brain waited for a change to send or wrote one."""
ENDINGS_LOG_S = 10.0
"""Calls the brain ends early are logged once in this long, with how many more: a storm ends
them by the thousand."""


class _Stream:
    """A node-local watch stream as its first state's turn sees it: what ends it from outside
    its handler, while a write is pending."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.body: AsyncGeneratorType[bytes, None] | None = None
        self.ended = False

    async def end(self, why: str) -> None:
        """End the watch with RESOURCE_EXHAUSTED and ``why``, and free its first state now.

        gRPC refuses a status while a write is pending (TOO_MANY_OPERATIONS), and cancelling
        the handler's task sends none: the watcher, reading at last, would wait forever. So the
        body is closed, which frees its state, and the status set here is sent once the pending
        write completes and the handler finds its body done."""
        self.ended = True
        self.context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.context.set_details(why)
        # A body running is past its write (or before its first): it sees ``ended`` itself.
        if self.body is not None and not self.body.ag_running:
            await self.body.aclose()


@dataclass
class _Resume:
    """What the rounds of a resume decided."""

    shared: Shared | None = None
    """The ops that bring the watcher's state to the brain's; None: send it whole."""
    ended: bool = False
    """The watcher ended its stream instead of answering."""


_RESUMED = batchv1_pb2.OpBatch(Resumed=True).SerializeToString()
"""Appended to the first OpBatch of a resumed change set (encoded messages concatenate)."""
_FOLLOWING = batchv1_pb2.OpBatch(Following=True).SerializeToString()
"""Appended to the first OpBatch of a following watcher's first change set."""
_ASK_BUCKETS = batchv1_pb2.OpBatch(Ask=batchv1_pb2.DigestAsk(Buckets=True)).SerializeToString()

RESUME_OUTCOMES = ("unchanged", "changed", "whole", "refused")
"""How a resume ends: nothing differed, only what differed was sent, too much differed for
anything but a whole state, or a malformed answer ended the stream."""


@dataclass
class WatchStats:
    """What the watch API is serving, for ``/metrics``: watches open now and change sets sent,
    of node-local state (localv1 and batchv1 Watch) and of the global state."""

    local_watches: int = 0
    global_watches: int = 0
    local_change_sets: int = 0
    global_change_sets: int = 0
    refused: int = 0
    """Watches refused: no valid token, or a token asking for what is not its own."""
    resumes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESUME_OUTCOMES, 0))
    """Node watches that said what they hold, by outcome (``RESUME_OUTCOMES``)."""
    calls_ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CALL_CODES, 0))
    """Watch calls ended, by the status code they ended with (``CALL_CODES``, and any other)."""


class WatchServer:
    """The three watch services over one Hub."""

    def __init__(
        self,
        store: Store,
        *,
        auth: WatchAuth | None = None,
        first_request_s: float = FIRST_REQUEST_S,
    ) -> None:
        self.store = store
        self.auth = auth
        self.first_request_s = first_request_s
        self.hub = Hub(store)
        self.first_states = Turns()
        self.stats = WatchStats()
        self._warned: OrderedDict[tuple[str, int], None] = OrderedDict()
        """Unknown node names warned about, the newest ``WARNED_NODES``, each as its first
        ``NODE_NAME_MAX`` characters and its length: a name may be megabytes."""
        self._endings_quiet_until = 0.0
        self._endings_unlogged = 0
        self._encoders: dict[int, Encoders] = {
            batchv1_pb2.PROTOBUF: Encoders.protobuf(),
            batchv1_pb2.JSON: Encoders.json(),
        }
        for encoders in self._encoders.values():
            self.hub.cluster.on_change.append(encoders.first_ops.forget)
            self.hub.cluster.on_change.append(encoders.digests.forget)
            self.hub.cluster.on_base_change.append(encoders.base_digests.changed)
            self.hub.cluster.on_base_change.append(encoders.base_frames.changed)

    # --- every call's ending

    async def _counted(
        self, call: _Call, context: Any, body: AsyncGenerator[bytes]
    ) -> AsyncIterator[bytes]:
        """``body``'s messages; its ending counted by code and logged with ``call``'s waits."""
        code: str | None = None
        try:
            async with contextlib.aclosing(body):
                async for message in body:
                    yield message
        except grpc.aio.AbortError:
            raise  # the code is the one the context was given
        except (asyncio.CancelledError, GeneratorExit):
            # The watcher ended its stream while the handler waited or wrote (gRPC cancels the
            # handler, or drops this generator mid-write), or the server is stopping.
            code = "CANCELLED"
            raise
        except Exception:
            code = "UNKNOWN"  # what gRPC answers an exception with
            raise
        finally:
            if code is None:
                given = context.code()
                code = "OK" if given is None else given.name
            self._ended(call, code, context.details() or "")

    def _ended(self, call: _Call, code: str, details: str) -> None:
        ended = self.stats.calls_ended
        ended[code] = ended.get(code, 0) + 1
        now = time.monotonic()
        if code in QUIET_CODES or now < self._endings_quiet_until:
            if code not in QUIET_CODES:
                self._endings_unlogged += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("a watch from %s ended %s, %s", call.peer, code, call.waits(now))
            return
        more = self._endings_unlogged
        log.warning(
            "ended a watch from %s with %s (%s), %s%s",
            call.peer,
            code,
            details,
            call.waits(now),
            f" ({more} more ended early since the last report)" if more else "",
        )
        self._endings_quiet_until = now + ENDINGS_LOG_S
        self._endings_unlogged = 0

    def _call(self, context: Any) -> _Call:
        return _Call(peer=context.peer(), began=time.monotonic())

    # --- node-local watches

    async def _local_stream(
        self,
        requests: AsyncIterator[Any],
        encoders: Callable[[Any], Encoders],
        context: Any,
        messages: Callable[[ChangeSet], Iterable[bytes]],
        call: _Call,
        *,
        batched: bool = False,
    ) -> AsyncGenerator[bytes]:
        """The messages of a node-local watch, in a stream its first state's turn can end;
        ``batched``, a batchv1 watch: its first request may say what the watcher holds (Holds)
        and ask for packing, and its first states come over their zone's base."""
        stream = _Stream(context)
        body = self._local_messages(requests, encoders, context, messages, stream, batched, call)
        stream.body = cast(AsyncGeneratorType[bytes, None], body)
        try:
            while True:
                try:
                    # Not kept in a variable: a stream stuck on this write holds nothing more.
                    yield await anext(body)
                except StopAsyncIteration:
                    return
        finally:
            await body.aclose()

    async def _local_messages(
        self,
        requests: AsyncIterator[Any],
        encoders: Callable[[Any], Encoders],
        context: Any,
        messages: Callable[[ChangeSet], Iterable[bytes]],
        stream: _Stream,
        batched: bool,
        call: _Call,
    ) -> AsyncGenerator[bytes]:
        # Who it is, from the stream's metadata, before anything else: whether it may watch
        # the node it names is checked at each request (the review is cached).
        await self._authorize(context, node=None, identity_only=True)
        view: NodeView | None = None
        answered = False
        sent: NodeFacts | None = None
        revision = 0  # the brain's revision of the last change set sent
        turn: Turn | None = None
        packs = follows = False
        request: Any = None
        self.stats.local_watches += 1
        try:
            while True:
                # A following watcher asks once: each next change set is its first request's.
                if not follows or request is None:
                    try:
                        request = await anext(requests)
                    except StopAsyncIteration:
                        return
                holds: bytes = request.Holds if batched and view is None else b""
                if batched and view is None:
                    packs, follows = request.Packed, request.Follow
                first = view is None or view.node_name != request.NodeName
                if first:
                    await self._authorize(context, node=request.NodeName)
                    if holds:
                        await self._check(context, check_holds, holds)
                    if view is not None:
                        view.close()
                    # Waits for the store's sync first: turns are for sending, not waiting.
                    await self.hub.wait_revision(-1)
                    if turn is not None:
                        turn.end()
                    turn = await self.first_states.take(stream.end, context.peer())
                    view = self.hub.cluster.view(request.NodeName)
                    enc = encoders(request)
                    sent = None
                assert view is not None
                changes, facts, now = await self.hub.next_change_set(view, sent=sent)
                head: list[bytes] = []
                tail: list[bytes] = []
                if first and (warning := unknown_node(view.node_name, self.store.nodes)):
                    # Before any answer: the warning goes in the initial metadata.
                    await self._warn(context, view.node_name, warning, tell=not answered)
                answered = True
                resumed: Shared | None = None
                if holds:
                    # The rounds wait for the watcher outside any turn: turns are for sending.
                    assert turn is not None
                    turn.end()
                    turn = None
                    resume = _Resume()
                    async for ask in self._resume(
                        requests, context, view, enc, facts, holds, resume
                    ):
                        yield ask
                    if resume.ended:
                        return
                    resumed = resume.shared
                    if resumed is not None and not resumed.ops:
                        sent = facts  # the digests say the watcher holds them too
                    else:  # a whole state, or a part of one
                        turn = await self.first_states.take(stream.end, context.peer())
                base: list[bytes] = []
                if resumed is not None:
                    shared = resumed
                elif first and packs and (layers := view.layers())[1] is not None:
                    # The zone's base, packed once for all its nodes, and this node's own
                    # services after it: some 20 of 10,000.
                    zone_base, zone, overlay = layers
                    assert zone is not None
                    base = enc.base_frames.messages(zone, zone_base)
                    shared = corrections(zone_base, overlay, enc.shared_ops)
                else:
                    # A first state is not remembered: its key would name every service, and a
                    # whole state is rarely another view's (a node hosting any endpoint has its
                    # own resolutions); FirstOps shares its framing per service instead.
                    shared = enc.shared_ops(
                        updated=changes.updated,
                        deleted=changes.deleted,
                        previous=changes.previous,
                        remember=not first,
                    )
                del changes
                if first and resumed is None:
                    head.append(codec.OP_RESET)
                if facts != sent:
                    head.append(codec.op_set(NodeFactsSet, NODE_FACTS_PATH, enc.facts(facts)))
                    sent = facts
                if not first:  # a first state is not timed: its triggers predate the watcher
                    triggers = self.hub.triggers(after=revision, upto=now)
                    if triggers.V4 or triggers.V6:
                        tail.append(enc.triggers_op(triggers))
                revision = now
                tail.append(codec.OP_SYNC)
                self.stats.local_change_sets += 1
                # The turn is told of every write: a write that does not complete is a
                # watcher that does not read.
                change_set = ChangeSet(head, shared, tail, base)
                for index, message in enumerate(messages(change_set)):
                    if index == 0 and resumed is not None:
                        message += _RESUMED
                    if index == 0 and follows and first:
                        message += _FOLLOWING
                    if turn is not None:
                        turn.writing()
                    yield message
                    if stream.ended:  # by its turn, while this write waited: frees the rest
                        return
                    if turn is not None:
                        turn.wrote()
                # Not held while the watcher waits for its next change: a first state's changes
                # and ops are megabytes, times thousands of watchers.
                del shared, head, tail, base, change_set
                if turn is not None:  # every message of the first state is written
                    turn.end()
                    turn = None
                if call.first_state is None:
                    call.first_state = time.monotonic()
        finally:
            if turn is not None:
                turn.end()
            self.stats.local_watches -= 1
            if view is not None:
                view.close()

    async def _resume(
        self,
        requests: AsyncIterator[Any],
        context: Any,
        view: NodeView,
        enc: Encoders,
        facts: NodeFacts,
        holds: bytes,
        resume: _Resume,
    ) -> AsyncIterator[bytes]:
        """The rounds of a resuming watch: the asks to send, and in ``resume`` the ops that
        bring what the watcher holds to ``view``'s state (None: send it whole)."""
        facts_digest = item_digest(NODE_FACTS_PATH, enc.facts(facts))
        base, zone, overlay = view.layers()
        ours = enc.base_digests.of(base=base, zone=zone, overlay=overlay, facts=facts_digest)
        if ours.node == holds:
            self.stats.resumes["unchanged"] += 1
            resume.shared = Shared([])
            log.debug("%s resumed %s: nothing differs", context.peer(), printable(view.node_name))
            return
        yield _ASK_BUCKETS
        answer = await self._answer(requests, context)
        if answer is None:
            resume.ended = True
            return
        differing = await self._check(context, differing_buckets, ours.buckets, answer.Buckets)
        if len(differing) > DIFFERING_BUCKETS_MAX:
            self.stats.resumes["whole"] += 1
            log.debug(
                "%s resumes %s with %d buckets differing: a whole state",
                context.peer(),
                printable(view.node_name),
                len(differing),
            )
            return
        yield batchv1_pb2.OpBatch(
            Ask=batchv1_pb2.DigestAsk(ServicesIn=differing)
        ).SerializeToString()
        answer = await self._answer(requests, context)
        if answer is None:
            resume.ended = True
            return
        theirs = await self._check(context, answered_services, answer.Services, differing)
        updated, deleted = differences(ours, differing, theirs)
        self.stats.resumes["changed"] += 1
        state = view.state
        # From nothing (no previous): the watcher holds what it holds of these services,
        # and drops the endpoints of theirs it is not sent again (kpng.remote.watching).
        resume.shared = enc.shared_ops(
            updated={key: state[key] for key in updated},
            deleted=deleted,
            previous={},
            remember=False,
        )
        log.debug(
            "%s resumed %s: %d services sent, %d deleted",
            context.peer(),
            printable(view.node_name),
            len(updated),
            len(deleted),
        )

    async def _answer(self, requests: AsyncIterator[Any], context: Any) -> Any:
        """The watcher's answer to an ask, None if its stream ended first."""
        try:
            async with asyncio.timeout(self.first_request_s):
                return await anext(requests)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no answer to the digest ask within {self.first_request_s:g} s",
            )
            raise  # abort raises; this only tells the type checker

    async def _check(self, context: Any, check: Callable[..., T], *args: Any) -> T:
        """``check(*args)``, or the stream ended with INVALID_ARGUMENT saying what is wrong."""
        try:
            return check(*args)
        except BadAnswer as exc:
            self.stats.resumes["refused"] += 1
            log.warning("refused a resume from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raises; this only tells the type checker

    async def _authorize(
        self, context: Any, *, node: str | None, identity_only: bool = False
    ) -> None:
        """Abort the stream unless its token may watch ``node`` (None: the global state), or,
        ``identity_only``, unless it carries a valid token at all."""
        if self.auth is None:
            return
        try:
            metadata = context.invocation_metadata() or ()
            if identity_only:
                await self.auth.identify(metadata)
            else:
                await self.auth.check(metadata, node=node)
        except Refused as exc:
            self.stats.refused += 1
            log.warning("refused a watch from %s: %s", context.peer(), exc)
            status = grpc.StatusCode
            await context.abort(
                status.UNAUTHENTICATED if exc.unauthenticated else status.PERMISSION_DENIED,
                str(exc),
            )

    async def _warn(self, context: Any, node_name: str, warning: str, *, tell: bool) -> None:
        """Log an unknown node once per name; ``tell`` the watcher too, in the initial metadata
        (the warning channel of Kubernetes' API, as HTTP headers are there): only possible
        before the stream's first response."""
        key = (node_name[:NODE_NAME_MAX], len(node_name))
        if key not in self._warned:
            # Bounded in names and in each name's size: an unauthenticated watcher chooses them.
            self._warned[key] = None
            if len(self._warned) > WARNED_NODES:
                self._warned.popitem(last=False)
            log.warning("a watcher at %s: %s", context.peer(), warning)
        if tell:
            ascii_only = warning.encode("ascii", "backslashreplace").decode()
            await context.send_initial_metadata(((WARNING_METADATA, ascii_only),))

    async def watch_local(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        def encoders(_: Any) -> Encoders:
            return self._encoders[batchv1_pb2.PROTOBUF]

        call = self._call(context)
        parsed = _parsed(requests, localv1_pb2.WatchReq, context, self.first_request_s, call)
        body = self._local_stream(parsed, encoders, context, ChangeSet.ops, call)
        async for message in self._counted(call, context, body):
            yield message

    async def watch_local_batched(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        def encoders(request: Any) -> Encoders:
            return self._encoders.get(int(request.Encoding), self._encoders[batchv1_pb2.PROTOBUF])

        def messages(change_set: ChangeSet) -> Iterable[bytes]:
            return change_set.batches(BATCH_BYTES)

        call = self._call(context)
        parsed = _parsed(requests, batchv1_pb2.WatchReq, context, self.first_request_s, call)
        body = self._local_stream(parsed, encoders, context, messages, call, batched=True)
        async for message in self._counted(call, context, body):
            yield message

    # --- global watches

    async def _global_changesets(
        self,
        requests: AsyncIterator[Any],
        encoding: Callable[[Any], int],
        context: Any,
        call: _Call,
    ) -> AsyncIterator[list[bytes]]:
        await self._authorize(context, node=None)
        subscription = self.store.subscribe()
        tracker: GlobalTracker | None = None
        self.stats.global_watches += 1
        try:
            async for request in requests:
                first = tracker is None
                if tracker is None:
                    encoders = self._encoders.get(
                        encoding(request), self._encoders[batchv1_pb2.PROTOBUF]
                    )
                    tracker = GlobalTracker(encoders.info)
                while True:
                    delta = await anext(subscription)
                    ops = tracker.ops(
                        services=self.store.services,
                        slices=self.store.slices,
                        nodes=self.store.nodes,
                        changed_services=delta.services,
                        changed_slices=delta.slices,
                        changed_nodes=delta.nodes,
                        service_cidrs=self.store.service_cidrs,
                        changed_service_cidrs=delta.service_cidrs,
                    )
                    if ops or first:
                        break
                if first:
                    ops.insert(0, codec.OP_RESET)
                ops.append(codec.OP_SYNC)
                self.stats.global_change_sets += 1
                yield ops
                if call.first_state is None:
                    call.first_state = time.monotonic()
        finally:
            self.stats.global_watches -= 1
            subscription.close()

    async def watch_global(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        call = self._call(context)
        parsed = _parsed(requests, globalv1_pb2.GlobalWatchReq, context, self.first_request_s, call)
        async for message in self._counted(call, context, self._global_ops(parsed, context, call)):
            yield message

    async def _global_ops(
        self, parsed: AsyncIterator[Any], context: Any, call: _Call
    ) -> AsyncGenerator[bytes]:
        changesets = self._global_changesets(parsed, lambda _: batchv1_pb2.PROTOBUF, context, call)
        async for ops in changesets:
            for op in ops:
                yield op

    async def watch_global_batched(
        self, requests: AsyncIterator[bytes], context: Any
    ) -> AsyncIterator[bytes]:
        call = self._call(context)
        parsed = _parsed(requests, batchv1_pb2.GlobalWatchReq, context, self.first_request_s, call)
        async for message in self._counted(
            call, context, self._global_batches(parsed, context, call)
        ):
            yield message

    async def _global_batches(
        self, parsed: AsyncIterator[Any], context: Any, call: _Call
    ) -> AsyncGenerator[bytes]:
        changesets = self._global_changesets(parsed, lambda r: int(r.Encoding), context, call)
        async for ops in changesets:
            for batch in batches(ops, BATCH_BYTES):
                yield batch

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        def stream(handler: Callable[..., AsyncIterator[bytes]]) -> grpc.RpcMethodHandler[Any, Any]:
            # Bytes in, bytes out: requests are parsed by _parsed, responses are pre-encoded.
            return grpc.stream_stream_rpc_method_handler(handler)

        return [
            grpc.method_handlers_generic_handler(
                "localv1.Sets", {"Watch": stream(self.watch_local)}
            ),
            grpc.method_handlers_generic_handler(
                "globalv1.Sets", {"Watch": stream(self.watch_global)}
            ),
            grpc.method_handlers_generic_handler(
                "kpng.batchv1.Sets",
                {
                    "Watch": stream(self.watch_local_batched),
                    "WatchGlobal": stream(self.watch_global_batched),
                },
            ),
        ]


@dataclass(frozen=True)
class Serving:
    addresses: list[str]
    watch: WatchServer


async def serve(
    store: Store,
    *,
    listen: list[ListenAddress],
    tls: TlsFiles | None = None,
    socket_mode: int = 0o600,
    auth: WatchAuth | None = None,
    started: Callable[[Serving], None] | None = None,
    first_request_s: float = FIRST_REQUEST_S,
    streams_per_connection: int = STREAMS_PER_CONNECTION,
) -> None:
    """Serve the watches until cancelled, to the watchers ``auth`` allows (None: any).
    ``started`` is called once listening, with the bound addresses (ports resolved)."""
    watch = WatchServer(store, auth=auth, first_request_s=first_request_s)
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", 64 << 20),
            # A thousand nodes may connect at once (a relay restart); gRPC cancels calls the
            # server has not picked up within 30 s by default, which turns one busy minute into
            # a reconnection storm.
            ("grpc.server_max_unrequested_time_in_server", 600),
            # kpng's clients ping every 10 s (kpng.remote.address.KEEPALIVE) to notice a dead
            # connection: allowed, as often as every 5 s. The server pings too, to free the
            # views of watchers that vanished.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            # A watcher needs one stream (two while it switches nodes), a relay two: a
            # connection may not open thousands, each holding memory until it is checked.
            ("grpc.max_concurrent_streams", streams_per_connection),
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_HARD),
        ]
    )
    server.add_generic_rpc_handlers(watch.handlers())
    hub_task: asyncio.Future[None] | None = None
    sockets = [UnixSocket(address) for address in listen if address.unix_path is not None]
    # Everything from the first bound port on is undone on the way out, also when the pipeline
    # is cancelled mid-start (a source failing at once): no socket file left behind, no server
    # collected after the event loop closed.
    try:
        for unix in sockets:
            unix.check_free()  # before binding anything: a refused start changes nothing
        # Sockets are born with the right mode (gRPC makes the file when it binds).
        previous_umask = os.umask(0o777 & ~socket_mode)
        try:
            bound = _bind(server, listen, tls, {unix.address: unix for unix in sockets})
            await server.start()
        finally:
            os.umask(previous_umask)
        for unix in sockets:
            os.chmod(unix.private, socket_mode)
            unix.publish()
        for url in bound:
            log.info("serving the watch API on %s", url)
        if started is not None:
            started(Serving(addresses=bound, watch=watch))
        hub_task = asyncio.ensure_future(watch.hub.run())
        await asyncio.get_running_loop().create_future()  # serve until cancelled
    finally:
        if hub_task is not None:
            hub_task.cancel()
        # Stopping must finish even though this task is being cancelled: streams left open
        # would keep clients attached to a server that no longer answers.
        stopping = asyncio.ensure_future(server.stop(grace=1))
        while not stopping.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(stopping)
        if hub_task is not None:
            await asyncio.gather(hub_task, return_exceptions=True)
        await watch.first_states.close()
        for unix in sockets:
            unix.remove()


class UnixSocket:
    """A ``unix://`` address this server owns while it runs, and only then.

    gRPC binds a unix socket by unlinking whatever socket is at the path first, and unlinks the
    path again when the server stops: a second server would take a live one's path, and either
    one's exit would remove the other's socket. So gRPC binds a private name beside the path;
    once listening, that socket is linked at the path, which fails rather than replace a file
    (``link`` never overwrites); and the path is removed on exit only if it is still that socket
    (same device and inode)."""

    def __init__(self, address: ListenAddress) -> None:
        path = address.unix_path
        assert path is not None
        self.address = address
        self.path = path
        # Short: a unix socket's path is limited to 107 bytes, and the path's own may be long.
        self.private = path.with_name(f".kpng-{os.getpid()}-{secrets.token_hex(2)}")
        self._owned: tuple[int, int] | None = None

    def check_free(self) -> None:
        """Refuse a path another process serves, or that is not a socket; a stale socket (a
        run that was killed) is left for ``publish`` to replace."""
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise UsageError(
                f"--listen {self.address.url}: {self.path} exists and is not a socket; "
                "refusing to replace it"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(_PROBE_S)
        try:
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            return  # nobody listens: stale
        except OSError as exc:
            # A timeout is a listener with a full backlog; a refusal to even try (EACCES) is
            # someone else's socket: either way, not ours to take.
            raise UsageError(
                f"--listen {self.address.url}: {self.path} is a socket kpng cannot probe "
                f"({exc}); refusing to replace it"
            ) from None
        finally:
            probe.close()
        raise UsageError(
            f"--listen {self.address.url}: another process is serving on {self.path}; "
            "stop it first, or listen elsewhere"
        )

    def publish(self) -> None:
        """Link the listening socket at its path, replacing only a stale socket."""
        for _ in range(3):
            try:
                os.link(self.private, self.path)
                break
            except FileExistsError:
                self.check_free()  # raises unless stale; someone may have raced us since
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
        else:
            raise UsageError(f"--listen {self.address.url}: {self.path} keeps being recreated")
        self.private.unlink()
        found = self.path.lstat()
        self._owned = (found.st_dev, found.st_ino)

    def remove(self) -> None:
        """Remove what this server made: its private name, and its path if still its socket."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.private.lstat().st_mode):
                self.private.unlink()
        if self._owned is None:
            return
        with contextlib.suppress(FileNotFoundError):
            found = self.path.lstat()
            if (found.st_dev, found.st_ino) == self._owned:
                self.path.unlink()
            else:
                log.info("%s is another process's socket now: left in place", self.path)
        self._owned = None


_PROBE_S = 1.0
"""How long a probe of an existing socket may take to connect: a live server accepts at once."""


def _bind(
    server: grpc.aio.Server,
    listen: list[ListenAddress],
    tls: TlsFiles | None,
    sockets: dict[ListenAddress, UnixSocket],
) -> list[str]:
    """Add a port per address (a unix one at its private name); the URLs bound, TCP ports
    resolved."""
    bound: list[str] = []
    credentials = tls.credentials() if tls is not None else None
    for address in listen:
        unix = sockets.get(address)
        target = f"unix:{unix.private}" if unix is not None else address.grpc_target
        try:
            port = (
                server.add_secure_port(target, credentials)
                if credentials is not None
                else server.add_insecure_port(target)
            )
        except RuntimeError as exc:
            raise UsageError(f"--listen {address.url}: cannot listen: {exc}") from None
        if unix is not None:
            bound.append(address.url)
        else:
            host = target.rpartition(":")[0]
            bound.append(f"tcp://{host}:{port}")
    return bound
