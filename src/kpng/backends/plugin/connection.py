"""One plugin, spoken to over its unix socket: a Backend for a Feeder, and a session check.

A session is a connection on which Describe and Configure succeeded; its first Apply carries the
whole state. Any failure ends the session, so the next attempt starts a new one with the whole
state (the Feeder retries with backoff). Every gRPC error becomes a ``PluginError`` here, with a
message saying what went wrong in the plugin's terms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kpng import __version__
from kpng.api import pluginv1_pb2
from kpng.backends.plugin.changes import ChangeSets
from kpng.backends.plugin.config import PluginSpec
from kpng.client import KpngError, NodeState, ServiceEndpoints, ServiceKey
from kpng.logs import printable

log = logging.getLogger(__name__)

SERVICE = "/kpng.pluginv1.Plugin/"
WANTS = {pluginv1_pb2.FULL: "FULL states", pluginv1_pb2.DIFFS: "DIFFS"}
ENCODINGS = {pluginv1_pb2.PROTOBUF: "protobuf", pluginv1_pb2.JSON: "JSON"}
MAX_ANSWER = 16 << 20
"""The largest answer kpng takes from a plugin (its answers are small: a larger one is refused
by the channel, RESOURCE_EXHAUSTED, and ends the session)."""


class PluginError(KpngError):
    """A plugin could not be reached, or did not do what was asked."""


def explain(code: grpc.StatusCode, details: str, *, call: str, timeout: float) -> str:
    """What a failed call means, in a plugin's terms."""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach it, or it does not speak gRPC ({details})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{call} got no answer within {timeout:g} s"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (
            f"it does not serve kpng.pluginv1.Plugin/{call}: not a kpng plugin, or another "
            f"version of the plugin API ({details})"
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return (
            f"{call}: a message was larger than its receiver takes ({details}); kpng takes "
            f"answers up to {MAX_ANSWER >> 20} MiB, and a plugin must raise its own receive "
            "limit for the states of a large cluster"
        )
    if code == grpc.StatusCode.CANCELLED:
        return f"{call} was cancelled (the connection was closed)"
    return f"it refused {call}: {code.name}: {details}"


@dataclass
class _Session:
    channel: grpc.aio.Channel
    description: pluginv1_pb2.DescribeResponse
    config: bytes
    fresh: bool = True
    """Nothing applied yet: the next Apply is the whole state."""
    held: dict[ServiceKey, ServiceEndpoints] = field(default_factory=dict)
    """What the plugin acknowledged (for DIFFS)."""
    unhealthy: str | None = None


class PluginBackend:
    """A Backend feeding one plugin (see the module docstring)."""

    def __init__(self, spec: PluginSpec, *, timeout: float) -> None:
        self.spec = spec
        self.timeout = timeout
        self._session: _Session | None = None
        self._changes: ChangeSets | None = None
        self._busy = False

    async def apply(self, state: NodeState) -> bool:
        self._busy = True
        try:
            await self._apply(state)
        finally:
            self._busy = False
        return False

    async def _apply(self, state: NodeState) -> None:
        session = self._session
        if session is None:
            session = await self._open(state.node)
        changes = self._changes
        if changes is None or changes.encoding != session.description.Encoding:
            changes = self._changes = ChangeSets(session.description.Encoding)
        whole = session.fresh or session.description.Wants == pluginv1_pb2.FULL
        request = changes.whole(state) if whole else changes.diff(state, session.held)
        await self._call(session, "Apply", request, pluginv1_pb2.ApplyResponse, raw=True)
        if session.description.Wants == pluginv1_pb2.DIFFS:
            if whole:
                session.held = dict(state.services)
            else:
                for key in state.deleted:
                    session.held.pop(key, None)
                for key in state.updated:
                    session.held[key] = state.services[key]
        session.fresh = False

    async def _open(self, node: str) -> _Session:
        spec = self.spec
        if not spec.socket.exists():
            raise PluginError(f"socket {spec.socket} does not exist (is the plugin running?)")
        config = self._read_config()
        channel = grpc.aio.insecure_channel(
            f"unix:{spec.socket}",
            options=[
                ("grpc.max_receive_message_length", MAX_ANSWER),
                # One connection per session: a reconnection must start a new session.
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        described = pluginv1_pb2.DescribeResponse()
        session = _Session(channel=channel, description=described, config=config)
        try:
            request = pluginv1_pb2.DescribeRequest(KpngVersion=__version__)
            described = await self._call(session, "Describe", request, type(described))
            if described.Wants not in WANTS:
                raise PluginError(f"it wants an unknown kind of state ({described.Wants})")
            if described.Encoding not in ENCODINGS:
                raise PluginError(f"it wants an unknown encoding ({described.Encoding})")
            session.description = described
            configure = pluginv1_pb2.ConfigureRequest(NodeName=node, Config=config)
            await self._call(session, "Configure", configure, pluginv1_pb2.ConfigureResponse)
        except BaseException:
            await channel.close(None)
            raise
        log.info(
            "plugin %s: connected to %s %s at %s; it wants %s in %s",
            spec.name,
            printable(described.Name, 128) or "(no name)",
            printable(described.Version, 128) or "(no version)",
            spec.url,
            WANTS[described.Wants],
            ENCODINGS[described.Encoding],
        )
        self._session = session
        return session

    def _read_config(self) -> bytes:
        path = self.spec.config
        if path is None:
            return b""
        try:
            return path.read_bytes()
        except FileNotFoundError:
            if self.spec.config_optional:
                return b""
            raise PluginError(f"its configuration {path} does not exist") from None
        except OSError as exc:
            raise PluginError(f"cannot read its configuration {path}: {exc.strerror}") from exc

    async def _call(
        self,
        session: _Session,
        name: str,
        request: Any,
        response: Any,
        *,
        raw: bool = False,
    ) -> Any:
        serialize: Callable[[Any], bytes] = _same if raw else type(request).SerializeToString
        method = session.channel.unary_unary(
            SERVICE + name, request_serializer=serialize, response_deserializer=_decoder(response)
        )
        try:
            answer = await method(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            await self._drop(session)
            details = printable(exc.details() or "")
            why = explain(exc.code(), details, call=name, timeout=self.timeout)
            raise PluginError(why) from exc
        if isinstance(answer, _Undecodable):
            await self._drop(session)
            raise PluginError(
                f"its answer to {name} is no {response.DESCRIPTOR.full_name}: {answer.why}"
            )
        return answer

    async def _drop(self, session: _Session) -> None:
        if self._session is session:
            self._session = None
        await session.channel.close(None)

    async def check(self) -> str | None:
        """Between changes: why the session had to end (the plugin is gone or hung, its
        configuration changed), or None while it holds. Logs changes of reported health."""
        session = self._session
        if session is None or self._busy:
            return None
        state = session.channel.get_state(try_to_connect=False)
        if state != grpc.ChannelConnectivity.READY:
            await self._drop(session)
            return f"the connection was lost ({state.name})"
        try:
            config = self._read_config()
        except PluginError as exc:
            await self._drop(session)
            return str(exc)
        if config != session.config:
            await self._drop(session)
            return f"its configuration {self.spec.config} changed"
        try:
            health = await self._call(
                session, "Health", pluginv1_pb2.HealthRequest(), pluginv1_pb2.HealthResponse
            )
        except PluginError as exc:
            return f"Health failed: {exc}"
        if not health.Ok and session.unhealthy != health.Message:
            log.warning(
                "plugin %s reports it is unhealthy: %s", self.spec.name, printable(health.Message)
            )
            session.unhealthy = health.Message
        elif health.Ok and session.unhealthy is not None:
            log.info("plugin %s reports it is healthy again", self.spec.name)
            session.unhealthy = None
        return None

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(session.channel.close(None))


def _same(data: bytes) -> bytes:
    return data


@dataclass(frozen=True)
class _Undecodable:
    """An answer that is no message of the type asked for. grpc would log a deserializer's
    exception and hand the caller None (not an error), so the decoder says it instead."""

    why: str


def _decoder(response: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return response.FromString(data)
        except DecodeError as exc:
            return _Undecodable(str(exc) or "it does not decode")

    return decode
