"""The global state as one globalv1 document (``to-file``), and back (``kpng file`` reads it).

The document is ``{"apiVersion": "kpng.io/v1", "kind": "GlobalState", "revision": N, "nodes":
[NodeInfo], "services": [ServiceInfo], "endpoints": [EndpointInfo], "serviceCIDRs":
[ServiceCIDRInfo]}``, each message in protobuf's
canonical JSON mapping, sorted by key, so two dumps of the same state are byte-identical. Each
info carries Go KPNG's Hash: the first 8 bytes of a BLAKE2b digest of the message, stable across
processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import msgspec

from kpng.errors import InputError
from kpng.model.cluster import ServiceCIDR, ServiceKey, Slice, SliceEndpoint, SliceKey, SlicePort
from kpng.model.messages import (
    Endpoint,
    EndpointConditions,
    EndpointInfo,
    IPSet,
    Node,
    NodeInfo,
    PortName,
    Service,
    ServiceCIDRInfo,
    ServiceInfo,
    TopologyHints,
    TopologyInfo,
)

API_VERSION = "kpng.io/v1"
KIND = "GlobalState"

_encoder = msgspec.json.Encoder()


def message_hash(message: msgspec.Struct) -> str:
    """Go KPNG's uint64 Hash, as canonical JSON writes a uint64: a decimal string."""
    digest = hashlib.blake2b(msgspec.msgpack.encode(message), digest_size=8).digest()
    return str(int.from_bytes(digest, "big"))


class GlobalState(
    msgspec.Struct,
    frozen=True,
    rename={"api_version": "apiVersion", "service_cidrs": "serviceCIDRs"},
):
    api_version: str = API_VERSION
    kind: str = KIND
    revision: int = 0
    nodes: tuple[NodeInfo, ...] = ()
    services: tuple[ServiceInfo, ...] = ()
    endpoints: tuple[EndpointInfo, ...] = ()
    service_cidrs: tuple[ServiceCIDRInfo, ...] = ()


def service_cidr_info(cidr: ServiceCIDR) -> ServiceCIDRInfo:
    info = ServiceCIDRInfo(Name=cidr.name, CIDRs=cidr.cidrs)
    return msgspec.structs.replace(info, Hash=message_hash(info))


def endpoint_infos(sl: Slice) -> Iterable[EndpointInfo]:
    """The globalv1 EndpointInfos of a slice: one per endpoint, the slice's ports on each."""
    ports = tuple(PortName(Name=p.name, Port=p.port, Protocol=p.protocol) for p in sl.ports)
    for ep in sl.endpoints:
        yield EndpointInfo(
            Namespace=sl.namespace,
            SourceName=sl.name,
            ServiceName=sl.service,
            Endpoint=Endpoint(
                Hostname=ep.hostname,
                IPs=IPSet(V6=(ep.ip,)) if sl.v6 else IPSet(V4=(ep.ip,)),
                PortOverrides=ports,
            ),
            Conditions=EndpointConditions(
                Ready=ep.ready, Serving=ep.serving, Terminating=ep.terminating
            ),
            PodName=ep.pod,
            Topology=TopologyInfo(Node=ep.node, Zone=ep.zone),
            Hints=TopologyHints(Zones=ep.zone_hints, Nodes=ep.node_hints),
            TriggerTime=sl.trigger_time,
        )


def dump(
    *,
    revision: int,
    services: Mapping[ServiceKey, Service],
    slices: Mapping[SliceKey, Slice],
    nodes: Mapping[str, Node],
    service_cidrs: Mapping[str, ServiceCIDR],
) -> bytes:
    infos = [info for key in sorted(slices) for info in endpoint_infos(slices[key])]
    state = GlobalState(
        revision=revision,
        nodes=tuple(NodeInfo(Hash=message_hash(n), Node=n) for _, n in sorted(nodes.items())),
        services=tuple(
            ServiceInfo(Hash=message_hash(s), Service=s) for _, s in sorted(services.items())
        ),
        endpoints=tuple(msgspec.structs.replace(i, Hash=message_hash(i)) for i in infos),
        service_cidrs=tuple(service_cidr_info(c) for _, c in sorted(service_cidrs.items())),
    )
    return _encoder.encode(state) + b"\n"


def load(data: bytes) -> list[Service | Slice | Node | ServiceCIDR]:
    """The model objects of a dump. Raises InputError if it is not one."""
    try:
        state = msgspec.json.decode(data, type=GlobalState)
    except msgspec.DecodeError as exc:
        raise InputError(f"invalid {KIND} document: {exc}") from None
    if state.api_version != API_VERSION:
        raise InputError(f"unsupported {KIND} apiVersion {state.api_version!r}")
    objects: list[Service | Slice | Node | ServiceCIDR] = [
        n.Node for n in state.nodes if n.Node is not None
    ]
    objects += [ServiceCIDR(name=c.Name, cidrs=c.CIDRs) for c in state.service_cidrs]
    objects += [s.Service for s in state.services if s.Service is not None]
    grouped: dict[SliceKey, list[EndpointInfo]] = {}
    for info in state.endpoints:
        grouped.setdefault((info.Namespace, info.SourceName), []).append(info)
    for (namespace, name), infos in grouped.items():
        objects.append(slice_from_infos(namespace, name, infos))
    return objects


def slice_from_infos(namespace: str, name: str, infos: list[EndpointInfo]) -> Slice:
    """The slice whose endpoints these EndpointInfos are (the inverse of endpoint_infos)."""
    first = infos[0].Endpoint or Endpoint()
    endpoints = []
    v6 = False
    for info in infos:
        ep = info.Endpoint or Endpoint()
        ips = ep.IPs or IPSet()
        if not (ips.V4 or ips.V6):
            raise InputError(f"EndpointSlice {namespace}/{name}: an endpoint has no address")
        v6 = bool(ips.V6)
        cond = info.Conditions or EndpointConditions()
        topo = info.Topology or TopologyInfo()
        hints = info.Hints or TopologyHints()
        endpoints.append(
            SliceEndpoint(
                ip=(ips.V6 or ips.V4)[0],
                hostname=ep.Hostname,
                node=topo.Node,
                zone=topo.Zone,
                pod=info.PodName,
                ready=cond.Ready,
                serving=cond.Serving,
                terminating=cond.Terminating,
                zone_hints=hints.Zones,
                node_hints=hints.Nodes,
            )
        )
    return Slice(
        namespace=namespace,
        name=name,
        service=infos[0].ServiceName,
        v6=v6,
        ports=tuple(
            SlicePort(name=p.Name, protocol=p.Protocol or "TCP", port=p.Port)
            for p in first.PortOverrides
        ),
        endpoints=tuple(sorted(endpoints, key=lambda ep: ep.ip)),
        trigger_time=max(info.TriggerTime for info in infos),
    )
