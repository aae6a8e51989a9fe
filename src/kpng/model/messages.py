"""The localv1 and globalv1 messages as msgspec Structs.

These mirror ``kpng/api/localv1.proto`` and ``kpng/api/globalv1.proto`` field for field, with the
proto field names, so that ``msgspec.json.encode`` of a Struct is the message in protobuf's
canonical JSON mapping (proto3 leaves default values out, and so does ``omit_defaults``). kpng
computes with these rather than with the generated protobuf classes: they compare and encode in C,
and building them costs a fraction of a protobuf message. ``tests/pure/test_wire_model.py`` holds
the two definitions to each other.
"""

from __future__ import annotations

import msgspec


class _Message(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """gc=False: frozen trees of strings and numbers cannot form reference cycles, and a cluster
    holds millions of them; left tracked, the cyclic collector's passes over them took half of
    kpng's start-up time."""


class IPSet(_Message, frozen=True):
    V4: tuple[str, ...] = ()
    V6: tuple[str, ...] = ()

    def family(self, v6: bool) -> tuple[str, ...]:
        return self.V6 if v6 else self.V4


EMPTY_IPSET = IPSet()


class ServiceIPs(_Message, frozen=True):
    ClusterIPs: IPSet | None = None
    ExternalIPs: IPSet | None = None
    Headless: bool = False
    LoadBalancerIPs: IPSet | None = None


class IPFilter(_Message, frozen=True):
    TargetIPs: IPSet | None = None
    SourceRanges: tuple[str, ...] = ()


class IPFamilies(_Message, frozen=True):
    V4: bool = False
    V6: bool = False


class EndpointAddress(_Message, frozen=True):
    IP: str = ""
    Port: int = 0


class PortMapping(_Message, frozen=True):
    Name: str = ""
    Protocol: str = ""
    Port: int = 0
    NodePort: int = 0
    TargetPort: int = 0
    TargetPortName: str = ""
    UsableEndpoints: IPFamilies | None = None
    ServingEndpoints: tuple[EndpointAddress, ...] = ()
    """UDP ports only: the endpoints serving the port anywhere, whatever this node may use
    (kube-proxy's conntrack cleanup keeps the flows going to them)."""


class ClientIPAffinity(_Message, frozen=True):
    TimeoutSeconds: int = 0


class Service(_Message, frozen=True):
    Namespace: str = ""
    Name: str = ""
    Type: str = ""
    IPs: ServiceIPs | None = None
    MapIP: bool = False
    Ports: tuple[PortMapping, ...] = ()
    ExternalTrafficToLocal: bool = False
    Labels: dict[str, str] = {}
    Annotations: dict[str, str] = {}
    IPFilters: tuple[IPFilter, ...] = ()
    ClientIP: ClientIPAffinity | None = None
    InternalTrafficToLocal: bool = False
    HealthCheckNodePort: int = 0
    TrafficDistribution: str = ""


class PortName(_Message, frozen=True):
    Name: str = ""
    Port: int = 0
    Protocol: str = ""


class EndpointScopes(_Message, frozen=True):
    Internal: bool = False
    External: bool = False
    Cluster: bool = False


class Endpoint(_Message, frozen=True):
    Hostname: str = ""
    IPs: IPSet | None = None
    Local: bool = False
    PortOverrides: tuple[PortName, ...] = ()
    Scopes: EndpointScopes | None = None
    Ready: bool = False
    Serving: bool = False
    Terminating: bool = False


# --- globalv1. Hash is Go KPNG's uint64 change hash, kept as canonical JSON writes a uint64: a
# decimal string. kpng sets it where the messages leave the process (dumps, the global watch).


class TopologyInfo(_Message, frozen=True):
    Node: str = ""
    Zone: str = ""


class TopologyHints(_Message, frozen=True):
    Zones: tuple[str, ...] = ()
    Nodes: tuple[str, ...] = ()


class EndpointConditions(_Message, frozen=True):
    Ready: bool = False
    Serving: bool = False
    Terminating: bool = False


class ServiceInfo(_Message, frozen=True):
    Hash: str = ""
    Service: Service | None = None


class EndpointInfo(_Message, frozen=True):
    Hash: str = ""
    Namespace: str = ""
    SourceName: str = ""
    ServiceName: str = ""
    Endpoint: Endpoint | None = None
    Conditions: EndpointConditions | None = None
    PodName: str = ""
    Topology: TopologyInfo | None = None
    Hints: TopologyHints | None = None
    TriggerTime: float = 0.0


class Node(_Message, frozen=True):
    Name: str = ""
    Labels: dict[str, str] = {}
    Annotations: dict[str, str] = {}
    Topology: TopologyInfo | None = None
    Draining: bool = False
    Addresses: tuple[NodeAddress, ...] = ()
    PodCIDRs: tuple[str, ...] = ()


class NodeAddress(_Message, frozen=True):
    Type: str = ""
    Address: str = ""


class ServiceCIDRInfo(_Message, frozen=True):
    Hash: str = ""
    Name: str = ""
    CIDRs: tuple[str, ...] = ()


class NodeFacts(_Message, frozen=True):
    """localv1.NodeFacts: what a backend reads of its node and the cluster besides services."""

    Addresses: tuple[NodeAddress, ...] = ()
    PodCIDRs: tuple[str, ...] = ()
    ServiceCIDRs: tuple[str, ...] = ()
    Draining: bool = False


class ChangeTriggers(_Message, frozen=True):
    """localv1.ChangeTriggers: EndpointSlice trigger times (seconds since the epoch)."""

    V4: tuple[float, ...] = ()
    V6: tuple[float, ...] = ()

    def followed_by(self, later: ChangeTriggers) -> ChangeTriggers:
        """The triggers of two successive changes, for one change that stands for both."""
        if not (later.V4 or later.V6):
            return self
        if not (self.V4 or self.V6):
            return later
        return ChangeTriggers(V4=self.V4 + later.V4, V6=self.V6 + later.V6)


NO_TRIGGERS = ChangeTriggers()


class NodeInfo(_Message, frozen=True):
    Hash: str = ""
    Node: Node | None = None


class ServiceEndpoints(msgspec.Struct, frozen=True, gc=False):
    """One service of a node-local state, with the endpoints this node may use for it."""

    service: Service
    endpoints: tuple[Endpoint, ...]
