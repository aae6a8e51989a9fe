"""Go KPNG's state file, read as kpng's model (pure).

Go KPNG's ``to-file`` job (server/jobs/store2file) writes its global state as YAML, and its
``file`` source (server/jobs/file2store) reads it back: ``{nodes: [globalv1.Node], services:
[{service: localv1.Service, endpoints: [globalv1.EndpointInfo]}]}``, marshalled by
gopkg.in/yaml.v2 from the generated Go structs. So every key is the Go field name lowercased
(``clusterips``, ``targetport``), enums are numbers (``protocol: 1`` is TCP), a uint64 ``hash`` is
a number, and the ``SessionAffinity`` oneof nests as ``sessionaffinity: {clientip: {...}}``. As
file2store does, a service without a namespace is in ``default``, an endpoint without conditions
is ready, and endpoints belong to their service. Older files (Go KPNG's own example) have an
endpoint's node in ``nodename`` and its topology as labels; both are read.

Go KPNG's endpoints carry no ports: the service port's target port applies (its port when none
is given). An endpoint may hold addresses of both families; kpng's slices have one, so a
service's endpoints become a slice per family, named after the service (``-v6`` for IPv6).
An endpoint that cannot be read, or whose first address of a family is not an IP of that family,
is reported and skipped (in that family); the service's other endpoints are kept.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

import msgspec

from kpng.errors import object_name
from kpng.model.cluster import Slice, SliceEndpoint, SlicePort
from kpng.model.ips import BadAddress, parse_ip
from kpng.model.messages import Endpoint, EndpointInfo, Node, Service, TopologyInfo

Model = Service | Slice | Node
_TOP_KEYS = frozenset({"nodes", "services"})
_PROTOCOLS = {0: "", 1: "TCP", 2: "UDP", 3: "SCTP"}
_HOSTNAME_LABEL = "kubernetes.io/hostname"
_ZONE_LABEL = "topology.kubernetes.io/zone"


def is_state(document: object) -> bool:
    """Whether a parsed YAML document has the shape of Go KPNG's state file."""
    if not isinstance(document, dict) or not document or not set(document) <= _TOP_KEYS:
        return False
    services = document.get("services") or []
    return isinstance(services, list) and all(
        isinstance(s, dict) and "service" in s for s in services
    )


def load(document: Mapping[str, Any]) -> tuple[list[Model], list[str]]:
    """The model objects of a state file, and a message for each object skipped or field not
    understood (the rest is still read)."""
    objects: list[Model] = []
    errors: list[str] = []
    nodes = document.get("nodes") or []
    if not isinstance(nodes, list):
        # yaml.v2 writes a list; anything else (`nodes: 1`) is not Go KPNG's, and not iterable.
        errors.append(f"nodes: a list is expected, not {type(nodes).__name__}; skipped")
        nodes = []
    for i, item in enumerate(nodes):
        where = f"nodes[{i}]"
        try:
            node = _convert(item, Node, where, errors)
        except (msgspec.ValidationError, TypeError) as exc:
            errors.append(f"{where}: Node: {exc}; skipped")
            continue
        if not node.Name:
            errors.append(f"{where}: Node without a name; skipped")
            continue
        objects.append(node)
    for i, item in enumerate(document.get("services") or ()):
        where = f"services[{i}]"
        for key in set(item) - {"service", "endpoints", "topologykeys"}:
            errors.append(f"{where}: unknown field {key!r} ignored")
        try:
            service = _convert(item.get("service") or {}, Service, f"{where}.service", errors)
        except (msgspec.ValidationError, TypeError) as exc:
            errors.append(f"{where}: Service: {exc}; skipped")
            continue
        if not service.Name:
            errors.append(f"{where}: Service without a name; skipped")
            continue
        if not service.Namespace:
            service = msgspec.structs.replace(service, Namespace="default")
        objects.append(service)
        try:
            objects += _slices(service, item.get("endpoints") or [], f"{where}.endpoints", errors)
        except (msgspec.ValidationError, TypeError) as exc:
            name = object_name(service.Namespace, service.Name)
            errors.append(f"{where}: endpoints of Service {name}: {exc}; skipped")
    return objects, errors


def _slices(service: Service, items: object, where: str, errors: list[str]) -> list[Slice]:
    ports: list[SlicePort] = []
    name = object_name(service.Namespace, service.Name)
    for port in service.Ports:
        if port.TargetPortName and not port.TargetPort:
            errors.append(
                f"{where}: Service {name} port {port.Name or port.Port}: a named target port "
                f"({port.TargetPortName}) cannot be resolved without the endpoints' ports; skipped"
            )
            continue
        ports.append(SlicePort(port.Name, port.Protocol, port.TargetPort or port.Port))
    if not isinstance(items, list):
        raise TypeError(f"expected a list of endpoints, got {type(items).__name__}")
    by_family: dict[bool, list[SliceEndpoint]] = {False: [], True: []}
    for i, raw in enumerate(items):
        # As for an EndpointSlice (converting.slice_from_k8s), what cannot be read costs that
        # endpoint only, not the service's other endpoints.
        legacy_node = raw.get("nodename", "") if isinstance(raw, dict) else ""
        try:
            info = _convert(raw, EndpointInfo, f"{where}[{i}]", errors, legacy=True)
        except (msgspec.ValidationError, TypeError) as exc:
            errors.append(f"{where}[{i}]: endpoint of Service {name}: {exc}; endpoint skipped")
            continue
        endpoint = info.Endpoint or Endpoint()
        topology = info.Topology or TopologyInfo()
        node = topology.Node or str(legacy_node or "")
        ready = info.Conditions.Ready if info.Conditions is not None else True
        hints = info.Hints
        for v6, addresses in ((False, endpoint.IPs.V4 if endpoint.IPs else ()),
                              (True, endpoint.IPs.V6 if endpoint.IPs else ())):  # fmt: skip
            if not addresses:
                continue
            ip = _address(addresses[0], v6)
            if ip is None:
                family = "IPv6" if v6 else "IPv4"
                errors.append(
                    f"{where}[{i}]: endpoint of Service {name}: {addresses[0]!r} is not an "
                    f"{family} address; endpoint skipped in {family}"
                )
                continue
            by_family[v6].append(
                SliceEndpoint(
                    ip=ip,
                    hostname=endpoint.Hostname,
                    node=node,
                    zone=topology.Zone,
                    pod=info.PodName,
                    ready=ready,
                    serving=ready,
                    zone_hints=hints.Zones if hints else (),
                    node_hints=hints.Nodes if hints else (),
                )
            )
    return [
        Slice(
            namespace=service.Namespace,
            name=f"{service.Name}-v6" if v6 else service.Name,
            service=service.Name,
            v6=v6,
            ports=tuple(ports),
            endpoints=tuple(endpoints),
        )
        for v6, endpoints in by_family.items()
        if endpoints
    ]


def _address(text: str, v6: bool) -> str | None:
    """The canonical form of an address of the family, None for anything else: Go KPNG passes
    addresses through unchecked, but a backend cannot program one that is not an IP."""
    try:
        is_v6, ip = parse_ip(text)
    except BadAddress:
        return None
    return ip if is_v6 == v6 else None


T = typing.TypeVar("T", bound=msgspec.Struct)


def _convert(
    value: Any, struct: type[T], where: str, errors: list[str], *, legacy: bool = False
) -> T:
    """``value``, a yaml.v2 rendering of a Go struct, as the model struct of that message."""
    return msgspec.convert(_renamed(value, struct, where, errors, legacy), type=struct)


def _renamed(
    value: Any, struct: type[msgspec.Struct], where: str, errors: list[str], legacy: bool
) -> Any:
    """The keys of ``value`` renamed to ``struct``'s fields, recursively, with Go KPNG's
    encodings (enum numbers, oneofs, legacy topology) turned into the model's."""
    if not isinstance(value, dict):
        return value
    hints = typing.get_type_hints(struct)
    fields = {name.lower(): name for name in struct.__struct_fields__}
    out: dict[str, Any] = {}
    for key, item in value.items():
        lowered = str(key).lower()
        if struct is Service and lowered == "sessionaffinity":
            target, item = "ClientIP", item.get("clientip") if isinstance(item, dict) else None
        elif legacy and struct is EndpointInfo and lowered == "nodename":
            continue  # read by the caller
        elif lowered not in fields:
            errors.append(f"{where}: unknown field {key!r} ignored")
            continue
        else:
            target = fields[lowered]
            if legacy and target == "Topology" and _is_labels(item):
                item = {"node": item.get(_HOSTNAME_LABEL, ""), "zone": item.get(_ZONE_LABEL, "")}
        if item is None:
            continue
        if target == "Hash":
            item = str(item)
        elif target == "Protocol":
            item = _PROTOCOLS.get(item, item) if isinstance(item, int) else item
            if item not in _PROTOCOLS.values():
                # Only localv1's Protocol names can be served: the wire has no other.
                raise msgspec.ValidationError(f"{where}: unknown protocol {item!r}")
        out[target] = _nested(item, hints[target], f"{where}.{lowered}", errors, legacy)
    return out


def _nested(value: Any, hint: Any, where: str, errors: list[str], legacy: bool) -> Any:
    struct = _struct_of(hint)
    if struct is None:
        return value
    if isinstance(value, list):
        return [_renamed(v, struct, f"{where}[{i}]", errors, legacy) for i, v in enumerate(value)]
    return _renamed(value, struct, where, errors, legacy)


def _struct_of(hint: Any) -> type[msgspec.Struct] | None:
    """The Struct type in ``X | None`` or ``tuple[X, ...]``, if any."""
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return hint
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and issubclass(arg, msgspec.Struct):
            return arg
    return None


def _is_labels(value: Any) -> bool:
    return isinstance(value, dict) and any("/" in str(k) for k in value)
