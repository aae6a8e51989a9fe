"""Typed raw input: the parts of Kubernetes objects that kpng reads, as the API serves them.

Unknown fields are skipped by the decoder, so decoding costs little more than the fields below.
Fields that some clients write as ``null`` are optional here and normalised by the converters.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
"""Every number kpng reads from an object is an int32 in the API: a wider one (a manifest's
``port: 1`` and 30 zeros) is refused as it is decoded, naming its path, before a check that
prints the number (a port's range) sees its digits."""


class _Raw(msgspec.Struct, rename="camel", omit_defaults=True, gc=False):
    """gc=False: decoded JSON holds no reference cycles, and tracking 100,000s of these during a
    large decode only feeds the cyclic collector."""


class ObjectMeta(_Raw):
    name: str = ""
    namespace: str = ""
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    resource_version: str = ""
    deletion_timestamp: str | None = None


# --- v1 Service


class ServicePort(_Raw):
    name: str = ""
    protocol: str = "TCP"
    port: Int32 | None = None
    node_port: Int32 = 0
    target_port: Int32 | str | None = None


class ClientIPConfig(_Raw):
    timeout_seconds: Int32 | None = None


class SessionAffinityConfig(_Raw):
    client_ip: ClientIPConfig | None = msgspec.field(name="clientIP", default=None)


class ServiceSpec(_Raw):
    type: str = "ClusterIP"
    cluster_ip: str = msgspec.field(name="clusterIP", default="")
    cluster_ips: list[str] | None = msgspec.field(name="clusterIPs", default=None)
    external_ips: list[str] | None = msgspec.field(name="externalIPs", default=None)
    ports: list[ServicePort] | None = None
    session_affinity: str = "None"
    session_affinity_config: SessionAffinityConfig | None = None
    load_balancer_source_ranges: list[str] | None = None
    external_traffic_policy: str = ""
    internal_traffic_policy: str = ""
    health_check_node_port: Int32 = 0
    traffic_distribution: str = ""


class LoadBalancerIngress(_Raw):
    ip: str = ""
    hostname: str = ""
    ip_mode: str | None = None


class LoadBalancerStatus(_Raw):
    ingress: list[LoadBalancerIngress] | None = None


class ServiceStatus(_Raw):
    load_balancer: LoadBalancerStatus | None = None


class Service(_Raw, tag_field="kind", tag="Service"):
    api_version: str = "v1"
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ServiceSpec = msgspec.field(default_factory=ServiceSpec)
    status: ServiceStatus | None = None


# --- discovery.k8s.io/v1 EndpointSlice


class EndpointConditions(_Raw):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class ForZone(_Raw):
    name: str = ""


class ForNode(_Raw):
    name: str = ""


class EndpointHints(_Raw):
    for_zones: list[ForZone] | None = None
    for_nodes: list[ForNode] | None = None


class ObjectReference(_Raw):
    kind: str = ""
    name: str = ""


class Endpoint(_Raw):
    addresses: list[str] | None = None
    conditions: EndpointConditions | None = None
    hostname: str | None = None
    target_ref: ObjectReference | None = None
    node_name: str | None = None
    zone: str | None = None
    hints: EndpointHints | None = None


class EndpointPort(_Raw):
    name: str | None = None
    protocol: str | None = None
    port: Int32 | None = None


class EndpointSlice(_Raw, tag_field="kind", tag="EndpointSlice"):
    api_version: str = "discovery.k8s.io/v1"
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    address_type: str = ""
    endpoints: list[Endpoint] | None = None
    ports: list[EndpointPort] | None = None


# --- v1 Node


class Taint(_Raw):
    key: str = ""
    value: str = ""
    effect: str = ""


class NodeSpec(_Raw):
    taints: list[Taint] | None = None
    pod_cidrs: list[str] | None = msgspec.field(default=None, name="podCIDRs")


class NodeAddress(_Raw):
    type: str = ""
    address: str = ""


class NodeStatus(_Raw):
    addresses: list[NodeAddress] | None = None


class Node(_Raw, tag_field="kind", tag="Node"):
    api_version: str = "v1"
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: NodeSpec = msgspec.field(default_factory=NodeSpec)
    status: NodeStatus = msgspec.field(default_factory=NodeStatus)


# --- networking.k8s.io/v1 ServiceCIDR


class ServiceCIDRSpec(_Raw):
    cidrs: list[str] | None = None


class ServiceCIDR(_Raw, tag_field="kind", tag="ServiceCIDR"):
    api_version: str = "networking.k8s.io/v1"
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: ServiceCIDRSpec = msgspec.field(default_factory=ServiceCIDRSpec)


Object = Service | EndpointSlice | Node | ServiceCIDR

API_VERSIONS: dict[type[Object], str] = {
    Service: "v1",
    EndpointSlice: "discovery.k8s.io/v1",
    Node: "v1",
    ServiceCIDR: "networking.k8s.io/v1",
}
