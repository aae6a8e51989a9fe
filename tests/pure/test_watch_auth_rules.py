"""Who may watch what (kpng.server.auth.decide), as a table: a node's own state only, the global
state only to the relays' accounts, nothing without a valid token. Against a real kube-apiserver's
token reviews: tests/apiserver/test_watch_auth.py."""

from __future__ import annotations

import pytest

from kpng.server.auth import Identity, Refused, decide

AGENT = "system:serviceaccount:kube-system:kpng-node"
RELAY = "system:serviceaccount:kube-system:kpng-relay"


@pytest.mark.parametrize(
    ("identity", "node", "refused"),
    [
        (Identity(AGENT, "node-1"), "node-1", None),
        (Identity(AGENT, "node-1"), "node-2", "runs on node node-1 and may not watch node node-2"),
        (Identity(AGENT, ""), "node-1", "runs on no node"),  # a token bound to no pod
        (Identity("system:serviceaccount:default:web", "node-1"), "node-1", "not a kpng node"),
        (None, "node-1", "no valid token"),
        (Identity(RELAY), None, None),
        (Identity(AGENT, "node-1"), None, "may not watch the global state"),
        (None, None, "no valid token"),
    ],
)
def test_who_may_watch_what(
    identity: Identity | None, node: str | None, refused: str | None
) -> None:
    if refused is None:
        decide(identity, node=node, node_users=frozenset({AGENT}), global_users=frozenset({RELAY}))
        return
    with pytest.raises(Refused, match=refused) as caught:
        decide(identity, node=node, node_users=frozenset({AGENT}), global_users=frozenset({RELAY}))
    assert caught.value.unauthenticated == (identity is None)
