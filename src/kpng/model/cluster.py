"""The global model: what kpng keeps of the cluster, in the shape the resolver reads fastest.

Services are kept as localv1 ``Service`` messages; EndpointSlices as ``Slice`` below, one
``SliceEndpoint`` per endpoint address; Nodes as globalv1 ``Node`` messages. Every value is frozen,
so the store can compare an object with its previous version in C and keep references safely, and
untracked by the cyclic garbage collector (gc=False), as frozen trees of strings cannot form
cycles.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence

import msgspec

from kpng.model.messages import Node, NodeAddress

ServiceKey = tuple[str, str]
"""(namespace, name) of a Service."""

SliceKey = tuple[str, str]
"""(namespace, name) of an EndpointSlice."""


class SlicePort(msgspec.Struct, frozen=True, gc=False):
    name: str
    protocol: str
    port: int


class SliceEndpoint(msgspec.Struct, frozen=True, gc=False):
    """One endpoint of a slice: its first address, conditions with Kubernetes' defaults applied."""

    ip: str
    hostname: str = ""
    node: str = ""
    zone: str = ""
    pod: str = ""
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    zone_hints: tuple[str, ...] = ()
    node_hints: tuple[str, ...] = ()


class Slice(msgspec.Struct, frozen=True, gc=False):
    namespace: str
    name: str
    service: str
    v6: bool
    ports: tuple[SlicePort, ...]
    endpoints: tuple[SliceEndpoint, ...]
    trigger_time: float = 0.0
    """Wall time of the change that made this version (``endpoints.kubernetes.io/
    last-change-trigger-time``; 0: not given): the start of kube-proxy's network programming
    latency."""

    @property
    def key(self) -> SliceKey:
        return (self.namespace, self.name)

    @property
    def service_key(self) -> ServiceKey:
        return (self.namespace, self.service)


class ServiceCIDR(msgspec.Struct, frozen=True, gc=False):
    """A networking.k8s.io/v1 ServiceCIDR: ranges ClusterIPs are allocated from."""

    name: str
    cidrs: tuple[str, ...]


def node_zone(node: Node | None) -> str:
    return node.Topology.Zone if node is not None and node.Topology is not None else ""


def primary_ips(addresses: Sequence[NodeAddress]) -> tuple[str, ...]:
    """A node's primary IPs, as kube-proxy finds them in its addresses: the first InternalIP
    (else ExternalIP), then the first address of the other family, if any."""
    ordered = [a.Address for t in ("InternalIP", "ExternalIP") for a in addresses if a.Type == t]
    if not ordered:
        return ()
    first = ordered[0]
    other = next((ip for ip in ordered if (":" in ip) != (":" in first)), None)
    return (first,) if other is None else (first, other)


NODE_NAME_MAX = 253
"""The longest name a Kubernetes node can have (a DNS subdomain)."""


def _quoted(name: str) -> str:
    """A node name as a warning quotes it: whole, up to the longest a node's can be. A watcher
    chooses the name, unchecked: the brain's warning is a log line and the watcher's stream
    metadata, which gRPC clients refuse past 8 KiB (the watch then fails, its state unread)."""
    if len(name) <= NODE_NAME_MAX:
        return repr(name)
    return f"{name[:NODE_NAME_MAX]!r}... ({len(name)} characters)"


def unknown_node(name: str, known: Collection[str], *, all_listed: bool = False) -> str | None:
    """A warning for a node name no source knows, or None. Sources that list no node at all say
    nothing (manifests need not list nodes), unless they always list every node (``all_listed``).
    A node that is not known is served as one without labels: nothing is local to it."""
    if name in known or not (known or all_listed):
        return None
    if not known:
        return f"node {_quoted(name)} does not exist; nothing is local to it"
    if name.lower() in known:
        hint = f" (node names are lowercase: {name.lower()})"
    else:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
    count = f"{len(known)} node{'s' if len(known) > 1 else ''}"
    return (
        f"node {_quoted(name)} is not among the {count} the sources list, so nothing is local to"
        f" it{hint}"
    )
