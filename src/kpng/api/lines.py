"""``to-json``'s line: one node-local state as one line of protobuf's canonical JSON. Pure.

Written by to-json and to-exec (kpng.backends._jsonlines, which caches each service's JSON) and by
``/debug/state``; docs/reference/wire.md describes it.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kpng.model.messages import NodeFacts


def node_state_line(node: str, revision: int, facts: NodeFacts, services: Iterable[bytes]) -> bytes:
    """``{"node", "revision", "facts", "services"}`` and a newline, the services already encoded
    (each a ``{"service", "endpoints"}`` object, in namespace and name order)."""
    return b'{"node":%s,"revision":%d,"facts":%s,"services":[%s]}\n' % (
        msgspec.json.encode(node),
        revision,
        msgspec.json.encode(facts),
        b",".join(services),
    )
