"""Kubernetes objects to the global model: every ignore rule and validation of kube-proxy.

Each converter returns the model object, or None when kube-proxy would ignore the object (that is
not an error: a labelled or headless object is simply not kpng's). Objects kpng cannot use raise
``InvalidObject`` naming the kind, namespace, name and reason. Pure functions, no I/O.
"""

from __future__ import annotations

import datetime
import logging
import re
import sys
from collections.abc import Callable

from kpng.errors import InvalidObject
from kpng.model import k8s
from kpng.model.cluster import ServiceCIDR, Slice, SliceEndpoint, SlicePort
from kpng.model.ips import BadAddress, parse_cidr, parse_cidr_sloppy, parse_ip, parse_ip_sloppy
from kpng.model.messages import (
    ClientIPAffinity,
    IPFilter,
    IPSet,
    Node,
    NodeAddress,
    PortMapping,
    Service,
    ServiceIPs,
    TopologyInfo,
)

log = logging.getLogger(__name__)

LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_HEADLESS = "service.kubernetes.io/headless"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"
"""The cluster autoscaler's taint on a node it is about to remove (kube-proxy's /healthz drains
such nodes, as it does nodes being deleted)."""
LABEL_ZONE = "topology.kubernetes.io/zone"
ANNOTATION_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
# A copy of the whole object that kubectl keeps; carrying it would double kpng's memory.
_DROPPED_ANNOTATIONS = frozenset({"kubectl.kubernetes.io/last-applied-configuration"})

PROTOCOLS = frozenset({"TCP", "UDP", "SCTP"})
SERVICE_TYPES = frozenset({"ClusterIP", "NodePort", "LoadBalancer"})
DEFAULT_AFFINITY_TIMEOUT = 10800
_MAX_AFFINITY_TIMEOUT = 86400


def is_proxied(labels: dict[str, str] | None, *, proxy_name: str | None) -> bool:
    """Whether an object with these labels is this proxy's (the service-proxy-name rule)."""
    value = labels.get(LABEL_SERVICE_PROXY_NAME) if labels else None
    if proxy_name is None:
        return value is None
    return value == proxy_name


def _identity(meta: k8s.ObjectMeta) -> tuple[str, str]:
    return meta.namespace or "default", meta.name


# The API server's name rules (apimachinery's validation). A name it would refuse reaches no
# cluster, and is no name kpng's backends can put in a rule (nftables refused ``Bad_Name!``,
# failing the whole transaction): such an object is refused here, for every source.
_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_LABEL = re.compile(_LABEL)
_DNS1035_LABEL = re.compile("[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_NAME_RULES = {
    "DNS-1123 label": (
        _DNS1123_LABEL,
        63,
        "lowercase letters, digits and '-', starting and ending with a letter or digit",
    ),
    "DNS-1035 label": (
        _DNS1035_LABEL,
        63,
        "lowercase letters, digits and '-', starting with a letter, ending with a letter or digit",
    ),
    "DNS-1123 subdomain": (
        _DNS1123_SUBDOMAIN,
        253,
        "lowercase letters, digits, '-' and '.', each '.'-separated part starting and ending "
        "with a letter or digit",
    ),
}


def name_problem(value: str, rule: str) -> str | None:
    """Why the API server would refuse ``value`` as a name of this ``rule`` ("DNS-1035 label",
    "DNS-1123 label", "DNS-1123 subdomain"), or None if it would take it."""
    pattern, longest, wording = _NAME_RULES[rule]
    if len(value) > longest:
        return f"{value!r} is not a {rule}: {len(value)} characters, more than {longest}"
    if not pattern.fullmatch(value):
        return f"{value!r} is not a {rule}: {wording}"
    return None


SERVICE_NAME_RULE = "DNS-1035 label"
NAMESPACE_RULE = "DNS-1123 label"
OBJECT_NAME_RULE = "DNS-1123 subdomain"
"""The rule of EndpointSlice, Node and ServiceCIDR names."""


def check_identity(kind: str, namespace: str, name: str) -> None:
    """Raise InvalidObject if the API server would refuse this kind's ``name`` or ``namespace``
    ("" for a cluster-scoped kind). For sources whose objects are no Kubernetes objects (kpng's
    dumps, Go KPNG's state files) as for those that are."""
    invalid = InvalidObjectFactory(kind, namespace, name)
    if not name:
        raise invalid("metadata.name is missing")
    problem = name_problem(name, SERVICE_NAME_RULE if kind == "Service" else OBJECT_NAME_RULE)
    if problem is not None:
        raise invalid(f"metadata.name: {problem}")
    if namespace:
        problem = name_problem(namespace, NAMESPACE_RULE)
        if problem is not None:
            raise invalid(f"metadata.namespace: {problem}")


def _annotations(meta: k8s.ObjectMeta) -> dict[str, str]:
    if not meta.annotations:
        return {}
    return {k: v for k, v in meta.annotations.items() if k not in _DROPPED_ANNOTATIONS}


def _ip_set(
    ips: list[str], invalid: InvalidObjectFactory, what: str, *, skip_bad: bool = False
) -> IPSet | None:
    """The addresses as an IPSet, None if there are none (proto3 JSON then leaves it out).

    Read as kube-proxy reads a Service's IPs (leading zeros in IPv4 are decimal). With
    ``skip_bad``, an address that is no IP is left out with a warning, as kube-proxy leaves it
    out: the API server does not check every such field (externalIPs may hold blanks), and one
    bad entry must not take the whole Service down.
    """
    if not ips:
        return None
    v4: set[str] = set()
    v6: set[str] = set()
    for i, ip in enumerate(ips):
        try:
            is_v6, text = parse_ip_sloppy(ip)
        except BadAddress as exc:
            if not skip_bad:
                raise invalid(f"{what}: {exc}") from None
            if ip.strip():
                log.warning(
                    "%s; that address is ignored, the rest of the Service is served",
                    invalid(f"{what}[{i}]: {exc}"),
                )
            continue
        (v6 if is_v6 else v4).add(text)
    if not v4 and not v6:
        return None
    return IPSet(V4=tuple(sorted(v4)), V6=tuple(sorted(v6)))


def _source_ranges(ranges: list[str], invalid: InvalidObjectFactory) -> tuple[str, ...]:
    """loadBalancerSourceRanges as kube-proxy reads them: each trimmed, a blank one dropped and a
    bad one dropped with a warning. kube-proxy filters on the ranges that are left, and on none
    if none is left: the warning says so, since the load balancer is then open to all."""
    kept = []
    bad = 0
    for i, text in enumerate(ranges):
        if not text.strip():
            continue
        try:
            kept.append(parse_cidr_sloppy(text)[1])
        except BadAddress as exc:
            bad += 1
            log.warning(
                "%s; that range is ignored, as kube-proxy ignores it",
                invalid(f"spec.loadBalancerSourceRanges[{i}]: {exc}"),
            )
    if bad and not kept:
        log.warning(
            "%s; no source is filtered, as in kube-proxy",
            invalid("spec.loadBalancerSourceRanges: no valid range is left"),
        )
    return tuple(kept)


class InvalidObjectFactory:
    """Builds InvalidObject errors for one object, so each check states only its reason."""

    __slots__ = ("kind", "name", "namespace")

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        self.kind, self.namespace, self.name = kind, namespace, name

    def __call__(self, reason: str) -> InvalidObject:
        return InvalidObject(self.kind, self.namespace, self.name, reason)


def _port_number(value: object, invalid: InvalidObjectFactory, what: str, *, zero: bool) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{what}: missing port number")
    if not (0 if zero else 1) <= value <= 65535:
        raise invalid(f"{what}: port {value} out of range")
    return value


def _traffic_policy_local(value: str, invalid: InvalidObjectFactory, what: str) -> bool:
    if value in ("", "Cluster"):
        return False
    if value == "Local":
        return True
    raise invalid(f"{what}: unknown traffic policy {value!r}")


def _service_port(port: k8s.ServicePort, invalid: InvalidObjectFactory, i: int) -> PortMapping:
    what = f"spec.ports[{i}]"
    number = _port_number(port.port, invalid, what, zero=False)
    if port.protocol not in PROTOCOLS:
        raise invalid(f"{what}: unknown protocol {port.protocol!r}")
    node_port = _port_number(port.node_port, invalid, f"{what}.nodePort", zero=True)
    target = port.target_port
    if target is None or target == 0:
        target = number
    if isinstance(target, str):
        if not target:
            raise invalid(f"{what}.targetPort: empty port name")
        return PortMapping(
            Name=port.name,
            Protocol=port.protocol,
            Port=number,
            NodePort=node_port,
            TargetPortName=target,
        )
    target = _port_number(target, invalid, f"{what}.targetPort", zero=False)
    return PortMapping(
        Name=port.name, Protocol=port.protocol, Port=number, NodePort=node_port, TargetPort=target
    )


def ignored_because(obj: k8s.Service, *, proxy_name: str | None = None) -> str | None:
    """Why kube-proxy (and so kpng) ignores this Service, or None: the rule service_from_k8s
    applies, worded for ``kpng explain``."""
    labels = obj.metadata.labels or {}
    owner = labels.get(LABEL_SERVICE_PROXY_NAME)
    if not is_proxied(labels, proxy_name=proxy_name):
        if owner is not None:
            return f"it belongs to another proxy: labelled {LABEL_SERVICE_PROXY_NAME}={owner}"
        return f"kpng serves only Services labelled {LABEL_SERVICE_PROXY_NAME}={proxy_name}"
    # kube-proxy watches Services and EndpointSlices through one label selector, so the headless
    # label hides a Service as well as a slice.
    if LABEL_HEADLESS in labels:
        return f"it is headless: labelled {LABEL_HEADLESS}"
    if obj.spec.type == "ExternalName":
        return "it is an ExternalName Service: DNS answers for it, no proxy"
    cluster_ips = obj.spec.cluster_ips or ([obj.spec.cluster_ip] if obj.spec.cluster_ip else [])
    if "None" in cluster_ips:
        return "it is headless: clusterIP None"
    if not cluster_ips:
        return "it has no cluster IP yet"
    return None


def service_from_k8s(obj: k8s.Service, *, proxy_name: str | None = None) -> Service | None:
    """The localv1 Service for a v1 Service, or None if kube-proxy would ignore it."""
    namespace, name = _identity(obj.metadata)
    invalid = InvalidObjectFactory("Service", namespace, name)
    check_identity("Service", namespace, name)
    if obj.api_version != k8s.API_VERSIONS[k8s.Service]:
        raise invalid(f"unsupported apiVersion {obj.api_version!r}")
    if ignored_because(obj, proxy_name=proxy_name) is not None:
        return None
    spec = obj.spec
    cluster_ips = spec.cluster_ips or ([spec.cluster_ip] if spec.cluster_ip else [])
    if spec.type not in SERVICE_TYPES:
        raise invalid(f"spec.type: unknown service type {spec.type!r}")

    ports = tuple(_service_port(p, invalid, i) for i, p in enumerate(spec.ports or ()))
    seen: set[tuple[str, str]] = set()
    for p in ports:
        if (p.Name, p.Protocol) in seen:
            raise invalid(f"spec.ports: duplicate port {p.Name or '<unnamed>'}/{p.Protocol}")
        seen.add((p.Name, p.Protocol))

    status = obj.status.load_balancer if obj.status is not None else None
    ingress = status.ingress if status is not None else None
    # Only VIP-style ingress IPs are the node's to serve; "Proxy" ones belong to the balancer.
    lb_ips = [ing.ip for ing in ingress or () if ing.ip and ing.ip_mode in (None, "VIP")]
    lb_set = _ip_set(lb_ips, invalid, "status.loadBalancer.ingress", skip_bad=True)

    filters: tuple[IPFilter, ...] = ()
    ranges = _source_ranges(spec.load_balancer_source_ranges or [], invalid)
    if ranges and lb_set is not None:
        filters = (IPFilter(TargetIPs=lb_set, SourceRanges=ranges),)

    affinity = None
    if spec.session_affinity == "ClientIP":
        config = spec.session_affinity_config
        client_ip = config.client_ip if config is not None else None
        timeout = DEFAULT_AFFINITY_TIMEOUT
        if client_ip is not None and client_ip.timeout_seconds is not None:
            timeout = client_ip.timeout_seconds
        if not 0 < timeout <= _MAX_AFFINITY_TIMEOUT:
            raise invalid(f"spec.sessionAffinityConfig: timeoutSeconds {timeout} out of range")
        affinity = ClientIPAffinity(TimeoutSeconds=timeout)
    elif spec.session_affinity not in ("", "None"):
        raise invalid(f"spec.sessionAffinity: unknown value {spec.session_affinity!r}")

    external_local = _traffic_policy_local(
        spec.external_traffic_policy, invalid, "spec.externalTrafficPolicy"
    )
    internal_local = _traffic_policy_local(
        spec.internal_traffic_policy, invalid, "spec.internalTrafficPolicy"
    )
    # kube-proxy serves a health check only where it means something: LoadBalancer with eTP=Local.
    health_port = 0
    if spec.type == "LoadBalancer" and external_local:
        health_port = _port_number(
            spec.health_check_node_port, invalid, "spec.healthCheckNodePort", zero=True
        )

    return Service(
        Namespace=namespace,
        Name=name,
        Type=spec.type,
        IPs=ServiceIPs(
            ClusterIPs=_ip_set(cluster_ips, invalid, "spec.clusterIPs"),
            ExternalIPs=_ip_set(
                spec.external_ips or [], invalid, "spec.externalIPs", skip_bad=True
            ),
            LoadBalancerIPs=lb_set,
        ),
        Ports=ports,
        ExternalTrafficToLocal=external_local,
        Labels=dict(obj.metadata.labels or {}),
        Annotations=_annotations(obj.metadata),
        IPFilters=filters,
        ClientIP=affinity,
        InternalTrafficToLocal=internal_local,
        HealthCheckNodePort=health_port,
        TrafficDistribution=spec.traffic_distribution,
    )


def _slice_ports(obj: k8s.EndpointSlice, invalid: InvalidObjectFactory) -> tuple[SlicePort, ...]:
    ports = []
    for i, port in enumerate(obj.ports or ()):
        if port.name is None:
            # kube-proxy drops a slice port without a name (the API always writes one, maybe "").
            log.warning(
                "EndpointSlice %s/%s: ports[%d] has no name; ignored, as kube-proxy does",
                invalid.namespace,
                invalid.name,
                i,
            )
            continue
        if port.port is None or port.port == 0:
            continue  # kube-proxy: a port without a number is ignored
        number = _port_number(port.port, invalid, f"ports[{i}]", zero=False)
        protocol = port.protocol or "TCP"
        if protocol not in PROTOCOLS:
            raise invalid(f"ports[{i}]: unknown protocol {protocol!r}")
        ports.append(SlicePort(name=port.name, protocol=protocol, port=number))
    return tuple(ports)


def _slice_endpoint(
    ep: k8s.Endpoint, *, v6: bool, invalid: InvalidObjectFactory, i: int
) -> SliceEndpoint | None:
    if not ep.addresses:
        return None
    try:
        is_v6, ip = parse_ip(ep.addresses[0])
    except BadAddress as exc:
        # One endpoint kpng cannot parse costs that endpoint only, as in kube-proxy (it ignores
        # the endpoints it cannot use and keeps the others): failing the slice would take every
        # other endpoint of the service down with it.
        log.warning(
            "%s; endpoint skipped, the rest of the slice is served",
            invalid(f"endpoints[{i}].addresses[0]: {exc}"),
        )
        return None
    if is_v6 != v6:
        return None  # wrong family for the slice's addressType: ignored, as kube-proxy does
    cond = ep.conditions
    hints = ep.hints
    ref = ep.target_ref
    return SliceEndpoint(
        ip=ip,
        hostname=ep.hostname or "",
        # A few names, each decoded afresh for every endpoint: one string each (interned),
        # not a million copies at 100k services.
        node=sys.intern(ep.node_name or ""),
        zone=sys.intern(ep.zone or ""),
        pod=ref.name if ref is not None and ref.kind == "Pod" else "",
        ready=cond is None or cond.ready is None or cond.ready,
        serving=cond is None or cond.serving is None or cond.serving,
        terminating=cond is not None and cond.terminating is not None and cond.terminating,
        zone_hints=tuple(z.name for z in hints.for_zones or ()) if hints is not None else (),
        node_hints=tuple(n.name for n in hints.for_nodes or ()) if hints is not None else (),
    )


MAX_SLICE_ENDPOINTS = 1000
"""The most endpoints an EndpointSlice holds: the API server refuses more (discovery/v1
validation), so more come from a hand-written manifest or a hostile source only, and such a
slice is refused whole."""


def slice_from_k8s(obj: k8s.EndpointSlice, *, proxy_name: str | None = None) -> Slice | None:
    """The model of a discovery.k8s.io/v1 EndpointSlice, or None if kube-proxy would ignore it."""
    namespace, name = _identity(obj.metadata)
    invalid = InvalidObjectFactory("EndpointSlice", namespace, name)
    check_identity("EndpointSlice", namespace, name)
    if obj.api_version != k8s.API_VERSIONS[k8s.EndpointSlice]:
        raise invalid(f"unsupported apiVersion {obj.api_version!r}")
    labels = obj.metadata.labels or {}
    if LABEL_HEADLESS in labels or not is_proxied(labels, proxy_name=proxy_name):
        return None
    service = labels.get(LABEL_SERVICE_NAME)
    if not service:
        # kube-proxy logs it as an error too: no service to attach the endpoints to.
        raise invalid(f"no {LABEL_SERVICE_NAME} label: it belongs to no service")
    if obj.address_type == "FQDN":
        return None
    if obj.address_type not in ("IPv4", "IPv6"):
        raise invalid(f"addressType: unknown value {obj.address_type!r}")
    v6 = obj.address_type == "IPv6"
    if len(obj.endpoints or ()) > MAX_SLICE_ENDPOINTS:
        raise invalid(
            f"endpoints: {len(obj.endpoints or ())} endpoints, more than Kubernetes allows in a "
            f"slice ({MAX_SLICE_ENDPOINTS})"
        )
    endpoints = []
    for i, ep in enumerate(obj.endpoints or ()):
        converted = _slice_endpoint(ep, v6=v6, invalid=invalid, i=i)
        if converted is not None:
            endpoints.append(converted)
    # Sorted, so a slice is one value whatever order its source listed endpoints in (a relay
    # rebuilds slices from per-endpoint items).
    endpoints.sort(key=_by_address)
    return Slice(
        namespace=namespace,
        name=name,
        service=service,
        v6=v6,
        ports=_slice_ports(obj, invalid),
        endpoints=tuple(endpoints),
        trigger_time=_trigger_time(obj.metadata, namespace, name),
    )


def _trigger_time(meta: k8s.ObjectMeta, namespace: str, name: str) -> float:
    """The slice's last-change-trigger-time as a wall time; 0 when absent or unreadable (it only
    feeds a metric: the slice is served either way)."""
    text = (meta.annotations or {}).get(ANNOTATION_TRIGGER_TIME)
    if not text:
        return 0.0
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        log.warning(
            "EndpointSlice %s/%s: annotation %s=%r is not an RFC 3339 time; ignored",
            namespace,
            name,
            ANNOTATION_TRIGGER_TIME,
            text,
        )
        return 0.0


def _by_address(ep: SliceEndpoint) -> str:
    return ep.ip


def _cluster_scoped(obj: k8s.Node | k8s.ServiceCIDR, kind: str) -> tuple[str, InvalidObjectFactory]:
    """The name of a cluster-scoped object, and what reports it invalid; checked."""
    name = obj.metadata.name
    invalid = InvalidObjectFactory(kind, "", name)
    check_identity(kind, "", name)
    if obj.api_version != k8s.API_VERSIONS[type(obj)]:
        raise invalid(f"unsupported apiVersion {obj.api_version!r}")
    return name, invalid


def node_from_k8s(obj: k8s.Node) -> Node:
    """The globalv1 Node for a v1 Node."""
    name, invalid = _cluster_scoped(obj, "Node")
    labels = dict(obj.metadata.labels or {})
    return Node(
        Name=name,
        Labels=labels,
        Annotations=_annotations(obj.metadata),
        Topology=TopologyInfo(Node=name, Zone=labels.get(LABEL_ZONE, "")),
        Draining=obj.metadata.deletion_timestamp is not None
        or any(t.key == TAINT_TO_BE_DELETED for t in obj.spec.taints or ()),
        Addresses=_node_addresses(obj, invalid),
        PodCIDRs=tuple(_checked(parse_cidr, c, invalid) for c in obj.spec.pod_cidrs or ()),
    )


def service_cidr_from_k8s(obj: k8s.ServiceCIDR) -> ServiceCIDR:
    """A networking.k8s.io/v1 ServiceCIDR's ranges, canonical."""
    name, invalid = _cluster_scoped(obj, "ServiceCIDR")
    return ServiceCIDR(
        name=name, cidrs=tuple(_checked(parse_cidr, c, invalid) for c in obj.spec.cidrs or ())
    )


NODE_IP_TYPES = ("InternalIP", "ExternalIP")
"""The node address types that are IPs, in kube-proxy's order of preference."""


def _node_addresses(obj: k8s.Node, invalid: InvalidObjectFactory) -> tuple[NodeAddress, ...]:
    # Host names (type Hostname, InternalDNS...) name no address a rule can match: left out.
    return tuple(
        NodeAddress(Type=a.type, Address=_checked(parse_ip, a.address, invalid))
        for a in obj.status.addresses or ()
        if a.type in NODE_IP_TYPES
    )


def _checked(
    parse: Callable[[str], tuple[bool, str]], text: str, invalid: InvalidObjectFactory
) -> str:
    try:
        return parse(text)[1]
    except BadAddress as exc:
        raise invalid(str(exc)) from None
