"""Whether this node is eligible for load-balancer traffic (``/healthz``'s nodeEligible), as
kube-proxy decides: a node being deleted, drained, or unknown to a source that lists nodes is
not."""

from __future__ import annotations

import pytest

from kpng.model.cluster import unknown_node
from kpng.model.messages import Node
from kpng.status import Status
from kpng.store import Store


@pytest.mark.parametrize(
    ("nodes", "nodes_listed", "eligible"),
    [
        ({"n1": Node(Name="n1")}, True, True),
        ({"n1": Node(Name="n1", Draining=True)}, True, False),
        ({"n2": Node(Name="n2")}, True, False),  # kpng kube, n1 not (or no longer) a node
        ({}, True, False),
        ({"n2": Node(Name="n2")}, False, False),  # manifests listing nodes, n1 not among them
        ({}, False, True),  # manifests without nodes: nothing says n1 does not exist
    ],
    ids=["known", "draining", "unknown-listed", "none-listed", "unknown-in-files", "no-nodes"],
)
def test_node_eligibility(nodes: dict[str, Node], nodes_listed: bool, eligible: bool) -> None:
    store = Store()
    handle = store.source("nodes")
    for name, node in nodes.items():
        handle.set_node(name, node)
    handle.mark_synced()
    status = Status(timeout=60.0, store=store, node="n1", nodes_listed=nodes_listed)
    assert status.node_eligible is eligible
    assert status.verdict({}).body["nodeEligible"] is eligible


@pytest.mark.parametrize(
    ("name", "known", "all_listed", "warning"),
    [
        ("node-1", {"node-1", "node-2"}, False, None),
        ("node-9", set(), False, None),  # manifests that list no node say nothing of nodes
        ("node-9", set(), True, "node 'node-9' does not exist; nothing is local to it"),
        (
            "node-9",
            {"node-1", "worker-2"},
            False,
            "node 'node-9' is not among the 2 nodes the sources list, so nothing is local to it"
            " (did you mean node-1?)",
        ),
        (
            "Node-1",
            {"node-1"},
            False,
            "node 'Node-1' is not among the 1 node the sources list, so nothing is local to it"
            " (node names are lowercase: node-1)",
        ),
        (
            "worker",
            {"node-1"},
            False,
            "node 'worker' is not among the 1 node the sources list, so nothing is local to it",
        ),
        # Longer than any node's name can be (a watcher's choice): quoted only so far.
        (
            "w" * 5000,
            set(),
            True,
            f"node {'w' * 253!r}... (5000 characters) does not exist; nothing is local to it",
        ),
    ],
)
def test_a_node_no_source_knows_is_warned_of(
    name: str, known: set[str], all_listed: bool, warning: str | None
) -> None:
    assert unknown_node(name, known, all_listed=all_listed) == warning
