"""What ``to-exec`` writes to its program's stdin: the state as lines of JSON. Pure.

``full``: one to-json line per state (kpng.backends._jsonlines). ``ops``: one JSON object per line
per incremental op, in the order of the watch API (services before their endpoints, endpoint
deletions before service deletions), each state closed by a ``sync`` line::

    {"op":"reset","node":"node-1"}
    {"op":"set_service","service":<localv1.Service>}
    {"op":"set_endpoint","namespace":"ns","service":"web","key":"10.0.0.1","endpoint":<localv1.Endpoint>}
    {"op":"delete_endpoint","namespace":"ns","service":"web","key":"10.0.0.2"}
    {"op":"delete_service","namespace":"ns","name":"old"}
    {"op":"sync","revision":7}

``service`` is the Service object in ``set_service`` and the name of the endpoint's service in
``set_endpoint`` and ``delete_endpoint``: the fields are the Sink calls' arguments, one to one.
Messages are in protobuf's canonical JSON mapping; endpoint keys are stable within a service
(kpng.model.paths). A new format object starts with ``reset`` and the whole state: it is what a
newly started program gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from kpng.backends._jsonlines import StateLines
from kpng.client import Endpoint, NodeFacts, NodeState, Service, SinkBackend

_encode = msgspec.json.Encoder().encode


class Format(Protocol):
    async def encode(self, state: NodeState) -> bytes:
        """The lines of ``state``, given the states encoded before it by this object."""
        ...


class FullFormat:
    """``--format full``: the whole state, one to-json line per state."""

    def __init__(self) -> None:
        self._lines = StateLines()

    async def encode(self, state: NodeState) -> bytes:
        return self._lines.encode(state)


class _OpLines:
    """A Sink that writes each op as a JSON line."""

    def __init__(self) -> None:
        self.node = ""
        self.revision = 0
        self._out: list[bytes] = []

    def take(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def reset(self) -> None:
        self._out.append(b'{"op":"reset","node":%s}\n' % _encode(self.node))

    def set_node(self, facts: NodeFacts) -> None:
        self._out.append(b'{"op":"set_node","facts":%s}\n' % _encode(facts))

    def set_service(self, service: Service) -> None:
        self._out.append(b'{"op":"set_service","service":%s}\n' % _encode(service))

    def delete_service(self, namespace: str, name: str) -> None:
        self._out.append(
            b'{"op":"delete_service","namespace":%s,"name":%s}\n'
            % (_encode(namespace), _encode(name))
        )

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None:
        self._out.append(
            b'{"op":"set_endpoint","namespace":%s,"service":%s,"key":%s,"endpoint":%s}\n'
            % (_encode(namespace), _encode(service), _encode(key), _encode(endpoint))
        )

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        self._out.append(
            b'{"op":"delete_endpoint","namespace":%s,"service":%s,"key":%s}\n'
            % (_encode(namespace), _encode(service), _encode(key))
        )

    def sync(self) -> None:
        self._out.append(b'{"op":"sync","revision":%d}\n' % self.revision)


class OpsFormat:
    """``--format ops``: what changed, one op per line; the diffing is SinkBackend's."""

    def __init__(self) -> None:
        self._lines = _OpLines()
        self._backend = SinkBackend(self._lines)

    async def encode(self, state: NodeState) -> bytes:
        self._lines.node = state.node
        self._lines.revision = state.revision
        await self._backend.apply(state)
        return self._lines.take()


FORMATS: dict[str, Callable[[], Format]] = {"full": FullFormat, "ops": OpsFormat}
