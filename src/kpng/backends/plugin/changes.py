"""A plugin's change sets as encoded ``pluginv1.ApplyRequest`` bytes. Pure.

The ops are framed by hand, as the watch servers do (kpng.api.codec): ``ApplyRequest.Ops`` is
field 1, as ``OpBatch.Ops`` is, so ``codec.op_batch`` frames them, and the Revision and Full
fields are a serialized ApplyRequest appended (protobuf merges concatenated messages).

A whole state is Reset, the node's facts (NodeFacts), then each service's Set followed by its
endpoints' Sets (services by namespace and name, endpoints by key), then Sync; a diff starts
with the node's facts when they changed, as a watch's change set does. Each service's framed
ops are cached while its value is unchanged, so a plugin that wants FULL states costs one join
per change plus the encoding of what changed, not the encoding of every service.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from kpng.api import codec, pluginv1_pb2
from kpng.api.localv1_pb2 import NodeFactsSet
from kpng.api.ops import NODE_FACTS_PATH, local_ops
from kpng.client import Endpoint, NodeFacts, NodeState, Service, ServiceEndpoints, ServiceKey

_JSON = msgspec.json.Encoder()
_RESET = codec.op_batch([codec.OP_RESET])
_SYNC = codec.op_batch([codec.OP_SYNC])


class ChangeSets:
    """Encodes one node's states for one plugin, in one payload encoding."""

    def __init__(self, encoding: int) -> None:
        self.encoding = encoding
        self._service: Callable[[Service], bytes]
        self._endpoint: Callable[[Endpoint], bytes]
        if encoding == pluginv1_pb2.JSON:
            self._service = self._endpoint = _JSON.encode
        else:
            self._service, self._endpoint = codec.SERVICE.encode, codec.ENDPOINT.encode
        self._facts = _JSON.encode if encoding == pluginv1_pb2.JSON else codec.NODE_FACTS.encode
        self._framed: dict[ServiceKey, tuple[ServiceEndpoints, bytes]] = {}
        self._sent_facts: NodeFacts | None = None

    def whole(self, state: NodeState) -> bytes:
        """The whole state: Reset, every service and endpoint, Sync."""
        cache, self._framed = self._framed, {}
        chunks = []
        for key in sorted(state.services):
            value = state.services[key]
            cached = cache.get(key)
            if cached is None or (cached[0] is not value and cached[0] != value):
                ops = self._ops(updated={key: value}, deleted=(), previous={})
                cached = (value, codec.op_batch(ops))
            self._framed[key] = cached
            chunks.append(cached[1])
        self._sent_facts = None
        facts = self._facts_op(state)
        return _RESET + facts + b"".join(chunks) + _SYNC + _tail(state.revision, full=True)

    def diff(self, state: NodeState, previous: Mapping[ServiceKey, ServiceEndpoints]) -> bytes:
        """What turns ``previous`` (what the plugin holds) into ``state``, then Sync."""
        updated = {key: state.services[key] for key in state.updated}
        ops = self._ops(updated=updated, deleted=state.deleted, previous=previous)
        facts = self._facts_op(state)
        return facts + codec.op_batch(ops) + _SYNC + _tail(state.revision, full=False)

    def _facts_op(self, state: NodeState) -> bytes:
        """The node's facts as a framed op, if they changed since the last state encoded."""
        facts = state.facts
        if facts == self._sent_facts:
            return b""
        self._sent_facts = facts
        return codec.op_batch([codec.op_set(NodeFactsSet, NODE_FACTS_PATH, self._facts(facts))])

    def _ops(
        self,
        *,
        updated: Mapping[ServiceKey, ServiceEndpoints],
        deleted: frozenset[ServiceKey] | tuple[()],
        previous: Mapping[ServiceKey, ServiceEndpoints],
    ) -> list[bytes]:
        return local_ops(
            updated=updated,
            deleted=deleted,
            previous=previous,
            encode_service=self._service,
            encode_endpoint=self._endpoint,
        )


def _tail(revision: int, *, full: bool) -> bytes:
    return pluginv1_pb2.ApplyRequest(Revision=revision, Full=full).SerializeToString()
