"""Why a node uses or skips each endpoint of a Service: the resolver's decisions, in words. Pure.

``explain_service`` takes the resolver's ``Decisions`` (``decide``: what ``resolve_service``
builds its answer from) and words them: which set each endpoint landed in (the categorizer's own
sets, topology and fallbacks), and the scopes the node-local state gives it. Nothing here decides
again; a reason is only ever the wording of a decision already taken, so explain cannot drift
from what backends are served
(tests/pure/test_explain.py checks that on every semantics table).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kpng.model.cluster import ServiceKey, Slice, SliceEndpoint
from kpng.model.messages import PortMapping, Service
from kpng.resolver.resolving import Decisions, PortDecision, decide, resolved


class Reason(msgspec.Struct, frozen=True):
    code: str
    """Stable, for programs: e.g. ``not-ready``, ``hint-for-other-zone``, ``other-node``."""
    text: str


class EndpointExplanation(msgspec.Struct, omit_defaults=True):
    address: str
    port: int
    """The target port number, 0 when the endpoint's slice has no such port."""
    slice: str
    node: str
    ready: bool
    serving: bool
    terminating: bool
    cluster: bool
    """In the port's cluster-wide set: traffic under a Cluster policy may reach it."""
    local: bool
    """In the port's node-local set: traffic under a Local policy may reach it."""
    internal: bool
    """Cluster-IP traffic from this node reaches it (the served Scopes.Internal)."""
    external: bool
    """Node-port, external-IP and load-balancer traffic reaches it (Scopes.External)."""
    reasons: tuple[Reason, ...]
    connections: int | None = None
    """New connections this node sent it, as its backend counted them (the endpoint level of
    ``--traffic-counters``); absent when not counted."""


class PortExplanation(msgspec.Struct, omit_defaults=True):
    name: str
    protocol: str
    port: int
    node_port: int
    target: str
    """The target port: a number, or the name endpoints' slices resolve."""
    internal_policy: str
    external_policy: str
    """Only for a port reached from outside (a node port, external or load-balancer IPs); else
    empty."""
    usable: tuple[str, ...]
    """The families with an endpoint usable anywhere; none means connections are rejected."""
    notes: tuple[Reason, ...]
    endpoints: list[EndpointExplanation]
    connections: int | None = None
    """New connections to the port through this node, refused ones included, as its backend
    counted them (``--traffic-counters``); absent when not counted."""
    refused: int | None = None
    """Of those, the ones refused for want of endpoints."""


class ServiceExplanation(msgspec.Struct):
    namespace: str
    name: str
    node: str
    zone: str
    served: bool
    """Whether kpng serves the Service at all (it knows it, and it is kpng's)."""
    notes: tuple[Reason, ...]
    ports: list[PortExplanation]


_NOT_SERVED = Reason(
    "not-served",
    "kpng has no such Service: it does not exist, or kpng ignores it, as kube-proxy does: it "
    "belongs to another proxy (label service.kubernetes.io/service-proxy-name), it is headless "
    "(clusterIP None, or label service.kubernetes.io/headless), it is of type ExternalName, or "
    "it has no cluster IP yet",
)


def _family(v6: bool) -> str:
    return "IPv6" if v6 else "IPv4"


def _port_label(port: PortMapping) -> str:
    return (
        f"{port.Protocol} port named {port.Name!r}"
        if port.Name
        else f"unnamed {port.Protocol} port"
    )


def _slice_port(sl: Slice, port: PortMapping) -> int:
    # resolving._port_endpoints matches this way; an endpoint it skipped for want of a port has
    # no decision to word, so the reason is stated here.
    for sp in sl.ports:
        if sp.name == port.Name and sp.protocol == port.Protocol:
            return sp.port
    return 0


def _condition(ep: SliceEndpoint, where: str = "") -> Reason:
    """Why an endpoint is left out, when its conditions say so (categorize takes every ready one,
    and the serving terminating ones only when none is ready)."""
    if ep.serving and ep.terminating:
        return Reason("terminating", f"terminating: used only when no endpoint{where} is ready")
    if ep.terminating:
        return Reason("terminating-not-serving", "terminating, and no longer serving")
    return Reason("not-ready", "not ready")


def _cluster_reasons(
    ep: SliceEndpoint, chosen: bool, decision: PortDecision, zone: str, node: str
) -> list[Reason]:
    cats = decision.categories
    if chosen:
        if cats.cluster_fallback:
            return [
                Reason(
                    "terminating-fallback",
                    "serving while terminating: used because no endpoint of this port is ready",
                )
            ]
        if cats.topology == "node":
            return [Reason("hint-for-node", "ready, with a topology hint for this node")]
        if cats.topology == "zone":
            return [
                Reason("hint-for-zone", f"ready, with a topology hint for zone {zone}, this node's")
            ]
        if ep.zone_hints or ep.node_hints:
            return [
                Reason(
                    "hints-unused",
                    "ready; topology hints are not used: some ready endpoint has none, or none "
                    f"is for this node ({node}) or its zone ({zone or 'unset'})",
                )
            ]
        return [Reason("ready", "ready")]
    if not ep.ready:
        return [_condition(ep)]
    if cats.topology == "node":
        return [
            Reason(
                "hint-for-other-node",
                f"hint for node {', '.join(ep.node_hints)}; this node is {node}",
            )
        ]
    return [
        Reason(
            "hint-for-other-zone",
            f"hint for zone {', '.join(ep.zone_hints)}; this node is in zone {zone or '(unset)'}",
        )
    ]


def _local_reasons(
    ep: SliceEndpoint, chosen: bool, decision: PortDecision, node: str
) -> list[Reason]:
    if ep.node != node:
        return [Reason("other-node", f"on node {ep.node or '(unknown)'}, not this node")]
    if not chosen:
        return [_condition(ep, " on this node")]
    if decision.categories.local_fallback:
        return [
            Reason(
                "local-terminating-fallback",
                "on this node, serving while terminating: used because no endpoint on this node "
                "is ready",
            )
        ]
    return [Reason("local", "on this node")]


def _explain_endpoint(
    ep: SliceEndpoint,
    number: int,
    slice_name: str,
    decision: PortDecision,
    chosen_from: dict[int, str],
    *,
    node: str,
    zone: str,
) -> EndpointExplanation:
    def verdict(
        cluster: bool, local: bool, internal: bool, external: bool, reasons: Iterable[Reason]
    ) -> EndpointExplanation:
        unique = tuple({r.code: r for r in reasons}.values())
        return EndpointExplanation(
            ep.ip,
            number,
            slice_name,
            ep.node,
            ep.ready,
            ep.serving,
            ep.terminating,
            cluster,
            local,
            internal,
            external,
            unique,
        )

    index = next((i for i, (c, _) in enumerate(decision.candidates) if c is ep), None)
    if index is None:
        # resolving._port_endpoints kept another copy of this address and port.
        other = next(c for c, n in decision.candidates if c.ip == ep.ip and n == number)
        return verdict(
            False,
            False,
            False,
            False,
            [
                Reason(
                    "duplicate",
                    f"the same address and port is in slice {chosen_from[id(other)]}, and that "
                    "copy is used (a running pod's wins over a terminating one's)",
                )
            ],
        )
    cats = decision.categories
    in_cluster, in_local = index in cats.cluster, index in cats.local
    scopes = decision.scopes[index]
    reasons: list[Reason] = []
    if decision.uses_cluster:
        reasons += _cluster_reasons(ep, in_cluster, decision, zone, node)
    if decision.uses_local:
        reasons += _local_reasons(ep, in_local, decision, node)
    return verdict(in_cluster, in_local, scopes.Internal, scopes.External, reasons)


def _port_notes(
    port: PortMapping, decisions: Sequence[PortDecision], trace: Decisions, usable: Sequence[str]
) -> list[Reason]:
    notes = []
    internal = "node-local" if trace.internal_local else "cluster-wide"
    notes.append(
        Reason(
            "internal-policy",
            f"cluster-IP traffic uses the {internal} endpoints "
            f"(internalTrafficPolicy {'Local' if trace.internal_local else 'Cluster'})",
        )
    )
    if any(d.external for d in decisions):
        external = "node-local" if trace.external_local else "cluster-wide"
        notes.append(
            Reason(
                "external-policy",
                f"node-port, external-IP and load-balancer traffic uses the {external} endpoints "
                f"(externalTrafficPolicy {'Local' if trace.external_local else 'Cluster'})",
            )
        )
    if not usable:
        notes.append(
            Reason(
                "rejected",
                "no endpoint is usable anywhere: connections are rejected (ICMP unreachable or "
                "TCP reset)",
            )
        )
    elif trace.internal_local and not any(d.categories.local for d in decisions):
        notes.append(
            Reason(
                "dropped-internal",
                "no endpoint on this node: cluster-IP traffic from this node is dropped",
            )
        )
    if port.TargetPortName:
        notes.append(
            Reason(
                "named-target",
                f"target port {port.TargetPortName!r}: each slice names the number",
            )
        )
    return notes


def explain_service(
    key: ServiceKey,
    service: Service | None,
    slices: Iterable[Slice],
    *,
    node: str,
    zone: str,
    ignored: str | None = None,
) -> ServiceExplanation:
    """Every endpoint of every port of Service ``key``, as node ``node`` in ``zone`` uses it.
    ``ignored``: why the source's Service is not kpng's, when the source knows."""
    namespace, name = key
    if service is None:
        note = _NOT_SERVED if ignored is None else Reason("ignored", f"kpng ignores it: {ignored}")
        return ServiceExplanation(namespace, name, node, zone, False, (note,), [])
    ordered = sorted(slices, key=lambda sl: sl.name)
    trace = decide(service, ordered, node=node, zone=zone)
    served = resolved(service, trace, node=node)
    decisions = {(d.port, d.v6): d for d in trace.ports}
    chosen_from = {id(ep): sl.name for sl in ordered for ep in sl.endpoints}
    notes = [] if zone else [Reason("no-zone", f"node {node} has no zone: zone hints never apply")]
    ports = []
    by_port: dict[int, list[PortDecision]] = {}
    for d in trace.ports:
        by_port.setdefault(d.port, []).append(d)
    for p, (port, served_port) in enumerate(zip(service.Ports, served.service.Ports, strict=True)):
        port_decisions = by_port.get(p, [])
        families = served_port.UsableEndpoints
        usable = tuple(
            _family(v6)
            for v6 in (False, True)
            if families is not None and (families.V6 if v6 else families.V4)
        )
        endpoints = []
        for sl in ordered:
            number = _slice_port(sl, port)
            for ep in sl.endpoints:
                if sl.v6 not in trace.families:
                    endpoints.append(
                        _unused(
                            ep,
                            number,
                            sl,
                            Reason(
                                "family",
                                f"an {_family(sl.v6)} endpoint, and the Service has no "
                                f"{_family(sl.v6)} cluster IP",
                            ),
                        )
                    )
                elif not number:
                    endpoints.append(
                        _unused(
                            ep,
                            0,
                            sl,
                            Reason("no-port", f"its slice {sl.name} has no {_port_label(port)}"),
                        )
                    )
                else:
                    endpoints.append(
                        _explain_endpoint(
                            ep,
                            number,
                            sl.name,
                            decisions[(p, sl.v6)],
                            chosen_from,
                            node=node,
                            zone=zone,
                        )
                    )
        ports.append(
            PortExplanation(
                name=port.Name,
                protocol=port.Protocol,
                port=port.Port,
                node_port=port.NodePort,
                target=port.TargetPortName or str(port.TargetPort),
                internal_policy="Local" if trace.internal_local else "Cluster",
                external_policy=(
                    ("Local" if trace.external_local else "Cluster")
                    if any(d.external for d in port_decisions)
                    else ""
                ),
                usable=usable,
                notes=tuple(_port_notes(port, port_decisions, trace, usable)),
                endpoints=endpoints,
            )
        )
    return ServiceExplanation(namespace, name, node, zone, True, tuple(notes), ports)


def _unused(ep: SliceEndpoint, number: int, sl: Slice, reason: Reason) -> EndpointExplanation:
    return EndpointExplanation(
        ep.ip,
        number,
        sl.name,
        ep.node,
        ep.ready,
        ep.serving,
        ep.terminating,
        False,
        False,
        False,
        False,
        (reason,),
    )


def endpoint_name(address: str, port: int) -> str:
    """``IP:port`` (``[IP]:port`` for IPv6; the address alone without a port), as the endpoint
    level of the traffic counters labels an endpoint."""
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}" if port else host


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def render_text(explanations: Iterable[ServiceExplanation]) -> str:
    """The explanations as an operator reads them: one block per Service, a table per port."""
    out: list[str] = []
    for ex in explanations:
        out.append(f"{ex.namespace}/{ex.name} on node {ex.node} (zone {ex.zone or 'unset'})")
        out.extend(f"  {note.text}" for note in ex.notes)
        for port in ex.ports:
            label = f"{port.name or '<unnamed>'} {port.port}/{port.protocol} -> {port.target}"
            if port.node_port:
                label += f", node port {port.node_port}"
            if port.connections is not None:
                label += f"; {port.connections} connections counted, {port.refused or 0} refused"
            out.append(f"  port {label}")
            out.extend(f"    {note.text}" for note in port.notes)
            if not port.endpoints:
                out.append("    no endpoints")
                continue
            counted = any(ep.connections is not None for ep in port.endpoints)
            rows = [("ENDPOINT", "NODE", "CLUSTER", "LOCAL", *(("CONNS",) if counted else ()))]
            whys = ["WHY"]
            for ep in port.endpoints:
                rows.append(
                    (
                        endpoint_name(ep.address, ep.port),
                        ep.node or "-",
                        _yes(ep.cluster),
                        _yes(ep.local),
                        *((str(ep.connections or 0),) if counted else ()),
                    )
                )
                whys.append("; ".join(r.text for r in ep.reasons))
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
            for row, why in zip(rows, whys, strict=True):
                cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
                out.append("    " + "  ".join([*cells, why]).rstrip())
        out.append("")
    return "\n".join(out)
