"""The to-json line: one node-local state as one line of JSON. Pure.

Shared by ``to-json`` and ``to-exec --format full`` (a helper module, not a backend: the registry
lists packages only, and backends do not import each other).
"""

from __future__ import annotations

import msgspec

from kpng.api.lines import node_state_line
from kpng.client import NodeState, ServiceKey

_encoder = msgspec.json.Encoder()


class StateLines:
    """Encodes successive states of one node as to-json lines.

    Each line is ``{"node": NAME, "revision": N, "facts": <localv1.NodeFacts>, "services":
    [{"service": <localv1.Service>, "endpoints": [<localv1.Endpoint>, ...]}, ...]}``, messages
    in protobuf's canonical JSON
    mapping, services by namespace and name, endpoints by key (kpng.model.paths). Each service's
    JSON is cached and re-encoded only when it changes, so a state costs its change plus one
    join; the states must be given in order, each naming what changed since the previous one.
    """

    def __init__(self) -> None:
        self._encoded: dict[ServiceKey, bytes] = {}

    def encode(self, state: NodeState) -> bytes:
        for key in state.deleted:
            self._encoded.pop(key, None)
        for key in state.updated:
            self._encoded[key] = _encoder.encode(state.services[key])
        encoded = self._encoded
        return node_state_line(
            state.node, state.revision, state.facts, (encoded[key] for key in sorted(encoded))
        )
