"""kube-proxy's endpoint selection for one service port in one IP family. Pure.

This is the rule set every backend's conformance rests on (Kubernetes 1.37, unchanged since
1.35; pkg/proxy's CategorizeEndpoints): topology from the ready endpoints' hints, the
serving-and-terminating fallback, the local fallback, and whether the port has any usable
endpoint at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kpng.model.cluster import SliceEndpoint


class Categories(msgspec.Struct, frozen=True):
    """Indexes into the endpoint list, and whether any endpoint is usable anywhere.

    The last three fields say how the sets were chosen, so that ``kpng explain`` words the
    decision this function made rather than making it a second time.
    """

    cluster: frozenset[int]
    local: frozenset[int]
    has_any: bool
    topology: str = ""
    """The cluster set's topology: "node", "zone" or "" (hints not used)."""
    cluster_fallback: bool = False
    """No endpoint is ready: the cluster set is the serving terminating ones."""
    local_fallback: bool = False
    """No local endpoint is ready: the local set is the serving terminating local ones."""


_NONE: frozenset[int] = frozenset()


def _topology_mode(endpoints: Sequence[SliceEndpoint], *, node: str, zone: str) -> str:
    """ "node", "zone" or "" (no topology): from the hints of the ready endpoints only."""
    all_node_hints = all_zone_hints = True
    for_node = for_zone = False
    for ep in endpoints:
        if not ep.ready:
            continue
        if not ep.zone_hints:
            all_zone_hints = False
        elif zone in ep.zone_hints:
            for_zone = True
        if not ep.node_hints:
            all_node_hints = False
        elif node in ep.node_hints:
            for_node = True
    if all_node_hints and for_node:
        return "node"
    if all_zone_hints and for_zone:
        return "zone"
    return ""


def categorize(
    endpoints: Sequence[SliceEndpoint],
    *,
    node: str,
    zone: str,
    uses_cluster: bool,
    uses_local: bool,
) -> Categories:
    """The cluster and local endpoint sets of one service port, for node ``node`` in ``zone``.

    ``uses_cluster``: internalTrafficPolicy is Cluster, or the port is externally accessible
    (short-circuited traffic needs cluster endpoints even under externalTrafficPolicy Local).
    ``uses_local``: internalTrafficPolicy is Local, or externalTrafficPolicy is Local and the port
    is externally accessible.
    """
    cluster = _NONE
    has_any = cluster_fallback = False
    mode = ""
    if uses_cluster:
        mode = _topology_mode(endpoints, node=node, zone=zone)
        if mode == "node":
            cluster = frozenset(
                i for i, ep in enumerate(endpoints) if ep.ready and node in ep.node_hints
            )
        elif mode == "zone":
            cluster = frozenset(
                i for i, ep in enumerate(endpoints) if ep.ready and zone in ep.zone_hints
            )
        else:
            cluster = frozenset(i for i, ep in enumerate(endpoints) if ep.ready)
        if not cluster:
            # No ready endpoint anywhere (topology never empties a non-empty ready set).
            cluster = frozenset(
                i for i, ep in enumerate(endpoints) if ep.serving and ep.terminating
            )
            cluster_fallback = bool(cluster)
        has_any = bool(cluster)
    if not uses_local:
        return Categories(
            cluster=cluster,
            local=_NONE,
            has_any=has_any,
            topology=mode,
            cluster_fallback=cluster_fallback,
        )

    local_ready = []
    local_terminating = []
    for i, ep in enumerate(endpoints):
        if ep.ready:
            has_any = True
            if ep.node == node:
                local_ready.append(i)
        elif ep.serving and ep.terminating:
            has_any = True
            if ep.node == node:
                local_terminating.append(i)
    local = frozenset(local_ready or local_terminating)
    return Categories(
        cluster=cluster,
        local=local,
        has_any=has_any,
        topology=mode,
        cluster_fallback=cluster_fallback,
        local_fallback=not local_ready and bool(local_terminating),
    )
