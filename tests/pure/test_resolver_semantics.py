"""kube-proxy's endpoint selection (Kubernetes 1.37), as tables derived from its rules.

Every expected value below was written from the rules in docs/design/semantics.md and
kube-proxy's CategorizeEndpoints / endpointslicecache / proxier code, not from kpng's output.

Conventions of the tables: this node is ``node-a`` in ``zone-a``. Endpoint addresses say where
they run: ``10.0.1.x`` / ``fd00:1::x`` on node-a (local), ``10.0.2.x`` / ``fd00:2::x`` on node-b,
``10.0.3.x`` / ``fd00:3::x`` on node-c. Expected endpoints are written per service port
(``name/PROTOCOL``) as ``{"ip:port": scopes}`` where scopes holds ``I`` (Internal: cluster-IP
traffic), ``E`` (External: node ports, external and load-balancer IPs) and ``C`` (Cluster: the
cluster-wide set, used by short-circuited traffic). Usable families per port are ``"v4"``,
``"v6"``, ``"v4 v6"`` or ``""`` (no usable endpoint anywhere: REJECT rather than DROP).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import pytest

from kpng.model.cluster import Slice, SliceEndpoint, SlicePort
from kpng.model.messages import (
    IPFamilies,
    IPSet,
    Node,
    PortMapping,
    Service,
    ServiceEndpoints,
    ServiceIPs,
    TopologyInfo,
)
from kpng.resolver import resolving
from kpng.resolver.categorizing import categorize
from kpng.resolver.resolving import NodeResolver, resolve_service

NODE = "node-a"
ZONE = "zone-a"
NS = "ns1"
WEB = "web"

# --- input constructors


def ready(
    ip: str, node: str = "node-b", *, zones: Sequence[str] = (), nodes: Sequence[str] = ()
) -> SliceEndpoint:
    return SliceEndpoint(
        ip=ip,
        node=node,
        ready=True,
        serving=True,
        terminating=False,
        zone_hints=tuple(zones),
        node_hints=tuple(nodes),
    )


def serving_terminating(
    ip: str, node: str = "node-b", *, zones: Sequence[str] = (), nodes: Sequence[str] = ()
) -> SliceEndpoint:
    """A terminating pod that still passes its readiness probe."""
    return SliceEndpoint(
        ip=ip,
        node=node,
        ready=False,
        serving=True,
        terminating=True,
        zone_hints=tuple(zones),
        node_hints=tuple(nodes),
    )


def terminating(ip: str, node: str = "node-b") -> SliceEndpoint:
    """A terminating pod that no longer serves."""
    return SliceEndpoint(ip=ip, node=node, ready=False, serving=False, terminating=True)


def unready(
    ip: str, node: str = "node-b", *, zones: Sequence[str] = (), nodes: Sequence[str] = ()
) -> SliceEndpoint:
    """A running pod that fails its readiness probe."""
    return SliceEndpoint(
        ip=ip,
        node=node,
        ready=False,
        serving=False,
        terminating=False,
        zone_hints=tuple(zones),
        node_hints=tuple(nodes),
    )


HTTP_SLICE_PORT = ("http", "TCP", 8080)


def slice_(
    name: str,
    *endpoints: SliceEndpoint,
    ports: Sequence[tuple[str, str, int]] = (HTTP_SLICE_PORT,),
    v6: bool = False,
    service: str = WEB,
) -> Slice:
    return Slice(
        namespace=NS,
        name=name,
        service=service,
        v6=v6,
        ports=tuple(SlicePort(name=n, protocol=p, port=num) for n, p, num in ports),
        endpoints=endpoints,
    )


def slice6(name: str, *endpoints: SliceEndpoint) -> Slice:
    return slice_(name, *endpoints, v6=True)


HTTP = PortMapping(Name="http", Protocol="TCP", Port=80, TargetPort=8080)
HTTP_NODEPORT = PortMapping(Name="http", Protocol="TCP", Port=80, NodePort=30080, TargetPort=8080)
ADMIN = PortMapping(Name="admin", Protocol="TCP", Port=9000, TargetPort=9000)
METRICS = PortMapping(Name="metrics", Protocol="TCP", Port=9090, TargetPortName="metrics")
DNS_UDP = PortMapping(Name="dns", Protocol="UDP", Port=53, TargetPort=53)
DNS_TCP = PortMapping(Name="dns", Protocol="TCP", Port=53, TargetPort=53)
UNNAMED = PortMapping(Name="", Protocol="TCP", Port=80, TargetPort=8080)


def service(
    *,
    name: str = WEB,
    type_: str = "ClusterIP",
    v4: Sequence[str] = ("10.96.0.10",),
    v6: Sequence[str] = (),
    external_v4: Sequence[str] = (),
    external_v6: Sequence[str] = (),
    lb_v4: Sequence[str] = (),
    lb_v6: Sequence[str] = (),
    ports: Sequence[PortMapping] = (HTTP,),
    itp_local: bool = False,
    etp_local: bool = False,
) -> Service:
    return Service(
        Namespace=NS,
        Name=name,
        Type=type_,
        IPs=ServiceIPs(
            ClusterIPs=IPSet(V4=tuple(v4), V6=tuple(v6)),
            ExternalIPs=IPSet(V4=tuple(external_v4), V6=tuple(external_v6)),
            LoadBalancerIPs=IPSet(V4=tuple(lb_v4), V6=tuple(lb_v6)),
        ),
        Ports=tuple(ports),
        InternalTrafficToLocal=itp_local,
        ExternalTrafficToLocal=etp_local,
    )


def nodeport(*, itp_local: bool = False, etp_local: bool = False) -> Service:
    return service(
        type_="NodePort", ports=(HTTP_NODEPORT,), itp_local=itp_local, etp_local=etp_local
    )


def loadbalancer(
    *,
    ports: Sequence[PortMapping],
    lb_v4: Sequence[str] = (),
    v6: Sequence[str] = (),
    itp_local: bool = False,
    etp_local: bool = False,
) -> Service:
    return service(
        type_="LoadBalancer",
        v6=v6,
        lb_v4=lb_v4,
        ports=ports,
        itp_local=itp_local,
        etp_local=etp_local,
    )


DUAL = ("fd00:96::10",)
LB_IP = "203.0.113.10"
EXTERNAL_IP = "192.0.2.10"

# The usual endpoints: one ready on this node, one ready on node-b, one ready on node-c.
A = ready("10.0.1.1", NODE)
B = ready("10.0.2.1")
C = ready("10.0.3.1", "node-c")
A6 = ready("fd00:1::1", NODE)
B6 = ready("fd00:2::1")

# --- output views


def _scope_letters(internal: bool, external: bool, cluster: bool) -> str:
    return "I" * internal + "E" * external + "C" * cluster


def scopes_by_port(result: ServiceEndpoints) -> dict[str, dict[str, str]]:
    """{"name/PROTO": {"ip:port": "IEC"}} for every service port; checks the output's shape too."""
    view: dict[str, dict[str, str]] = {f"{p.Name}/{p.Protocol}": {} for p in result.service.Ports}
    for ep in result.endpoints:
        assert ep.IPs is not None
        assert len(ep.IPs.V4) + len(ep.IPs.V6) == 1, ep
        assert ep.Scopes is not None, f"an endpoint without scopes is useless: {ep}"
        letters = _scope_letters(ep.Scopes.Internal, ep.Scopes.External, ep.Scopes.Cluster)
        assert letters, f"an endpoint without scopes is useless: {ep}"
        assert ep.PortOverrides, f"an endpoint that serves no port: {ep}"
        address = ep.IPs.V4[0] if ep.IPs.V4 else f"[{ep.IPs.V6[0]}]"
        for port in ep.PortOverrides:
            label = f"{port.Name}/{port.Protocol}"
            assert label in view, f"{ep} serves {label}, which the service does not have"
            key = f"{address}:{port.Port}"
            assert key not in view[label], f"{key} appears twice for {label}"
            view[label][key] = letters
    return view


def usable_by_port(result: ServiceEndpoints) -> dict[str, str]:
    view: dict[str, str] = {}
    for p in result.service.Ports:
        families = p.UsableEndpoints
        names = []
        if families is not None and families.V4:
            names.append("v4")
        if families is not None and families.V6:
            names.append("v6")
        view[f"{p.Name}/{p.Protocol}"] = " ".join(names)
    return view


# --- resolve_service tables


@dataclass(frozen=True)
class Case:
    service: Service
    slices: tuple[Slice, ...]
    expected: dict[str, dict[str, str]]
    usable: dict[str, str]
    zone: str = ZONE


def http(endpoints: dict[str, str]) -> dict[str, dict[str, str]]:
    """The expected endpoints of a service whose only port is http/TCP (slice port 8080)."""
    return {
        "http/TCP": {
            (f"{ip}:8080" if ":" not in ip else f"[{ip}]:8080"): scopes
            for ip, scopes in endpoints.items()
        }
    }


V4 = {"http/TCP": "v4"}
V6 = {"http/TCP": "v6"}
BOTH = {"http/TCP": "v4 v6"}
NONE = {"http/TCP": ""}

TRAFFIC_POLICY_CASES = [
    pytest.param(
        Case(service(), (slice_("s", A, B),), http({"10.0.1.1": "IC", "10.0.2.1": "IC"}), V4),
        id="clusterip_cluster_policy_uses_every_ready_endpoint",
    ),
    pytest.param(
        Case(service(itp_local=True), (slice_("s", A, B),), http({"10.0.1.1": "I"}), V4),
        id="clusterip_itp_local_sends_internal_traffic_to_local_endpoints_only",
    ),
    pytest.param(
        Case(service(itp_local=True), (slice_("s", B, C),), http({}), V4),
        id="clusterip_itp_local_without_local_endpoint_drops_not_rejects",
    ),
    pytest.param(
        Case(
            service(etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="etp_local_ignored_on_clusterip_service_without_external_ips",
    ),
    pytest.param(
        Case(
            service(external_v4=(EXTERNAL_IP,)),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IEC"}),
            V4,
        ),
        id="external_ip_on_clusterip_service_makes_port_external",
    ),
    pytest.param(
        Case(
            service(external_v4=(EXTERNAL_IP,), etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="external_ip_with_etp_local_limits_external_traffic_to_local_endpoints",
    ),
    pytest.param(
        Case(nodeport(), (slice_("s", A, B),), http({"10.0.1.1": "IEC", "10.0.2.1": "IEC"}), V4),
        id="nodeport_etp_cluster_uses_every_endpoint_for_all_traffic",
    ),
    pytest.param(
        Case(
            nodeport(etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="nodeport_etp_local_keeps_remote_endpoints_in_cluster_scope_for_short_circuit",
    ),
    pytest.param(
        Case(
            nodeport(etp_local=True),
            (slice_("s", B, C),),
            http({"10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="nodeport_etp_local_without_local_endpoint_drops_external_but_serves_internal",
    ),
    pytest.param(
        Case(
            nodeport(itp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "EC"}),
            V4,
        ),
        id="nodeport_itp_local_etp_cluster_external_uses_every_endpoint",
    ),
    pytest.param(
        Case(
            nodeport(itp_local=True, etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "C"}),
            V4,
        ),
        id="nodeport_both_policies_local_remote_endpoint_only_for_short_circuit",
    ),
    pytest.param(
        Case(
            nodeport(itp_local=True, etp_local=True),
            (slice_("s", B),),
            http({"10.0.2.1": "C"}),
            V4,
        ),
        id="nodeport_both_policies_local_without_local_endpoint_keeps_short_circuit_set",
    ),
    pytest.param(
        Case(
            loadbalancer(ports=(HTTP,), lb_v4=(LB_IP,), etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="loadbalancer_ingress_ip_without_node_port_is_external_under_etp_local",
    ),
    pytest.param(
        Case(
            loadbalancer(ports=(HTTP_NODEPORT,), lb_v4=(LB_IP,)),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IEC"}),
            V4,
        ),
        id="loadbalancer_with_ingress_ip_etp_cluster_uses_every_endpoint",
    ),
    pytest.param(
        Case(
            loadbalancer(ports=(HTTP,), etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="loadbalancer_without_ingress_ip_or_node_port_is_not_externally_accessible",
    ),
    pytest.param(
        Case(
            loadbalancer(ports=(HTTP_NODEPORT,), etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="loadbalancer_pending_ingress_with_node_port_applies_etp_local",
    ),
    pytest.param(
        Case(
            loadbalancer(ports=(HTTP,), itp_local=True, etp_local=True),
            (slice_("s", A, B),),
            http({"10.0.1.1": "I"}),
            V4,
        ),
        id="loadbalancer_without_external_access_and_itp_local_uses_no_cluster_set",
    ),
]

REJECT_DROP_CASES = [
    pytest.param(
        Case(service(), (), http({}), NONE),
        id="service_without_slices_rejects",
    ),
    pytest.param(
        Case(service(), (slice_("s", unready("10.0.2.1")),), http({}), NONE),
        id="only_unready_endpoints_reject",
    ),
    pytest.param(
        Case(service(), (slice_("s", terminating("10.0.2.1")),), http({}), NONE),
        id="only_not_serving_terminating_endpoints_reject",
    ),
    pytest.param(
        Case(service(), (slice_("s", A, B, ports=(("metrics", "TCP", 9090),)),), http({}), NONE),
        id="slice_without_the_service_port_name_rejects",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (slice_("s", serving_terminating("10.0.2.1")),),
            http({}),
            V4,
        ),
        id="itp_local_remote_serving_terminating_endpoint_is_usable_so_drops",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (slice_("s", terminating("10.0.2.1"), unready("10.0.3.1", "node-c")),),
            http({}),
            NONE,
        ),
        id="itp_local_with_only_unusable_remote_endpoints_rejects",
    ),
    pytest.param(
        Case(
            nodeport(etp_local=True),
            (slice_("s", terminating("10.0.1.2", NODE), B),),
            http({"10.0.2.1": "IC"}),
            V4,
        ),
        id="etp_local_ignores_local_not_serving_terminating_endpoint",
    ),
]

TERMINATING_CASES = [
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    serving_terminating("10.0.1.1", NODE),
                    serving_terminating("10.0.2.1"),
                    terminating("10.0.3.1", "node-c"),
                ),
            ),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="terminating_endpoints_used_when_no_ready_endpoint",
    ),
    pytest.param(
        Case(
            service(),
            (slice_("s", serving_terminating("10.0.1.1", NODE), B),),
            http({"10.0.2.1": "IC"}),
            V4,
        ),
        id="serving_terminating_endpoints_unused_while_a_ready_endpoint_exists",
    ),
    pytest.param(
        Case(
            service(),
            (slice_("s1", serving_terminating("10.0.2.1")), slice_("s2", C)),
            http({"10.0.3.1": "IC"}),
            V4,
        ),
        id="ready_endpoint_in_another_slice_prevents_terminating_fallback",
    ),
    pytest.param(
        Case(
            service(),
            (slice_("s", unready("10.0.1.1", NODE), B),),
            http({"10.0.2.1": "IC"}),
            V4,
        ),
        id="unready_endpoint_excluded_while_ready_ones_used",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (slice_("s", A, serving_terminating("10.0.1.2", NODE), B),),
            http({"10.0.1.1": "I"}),
            V4,
        ),
        id="local_ready_endpoint_preferred_over_local_serving_terminating",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (slice_("s", serving_terminating("10.0.1.2", NODE), B),),
            http({"10.0.1.2": "I"}),
            V4,
        ),
        id="local_serving_terminating_used_when_no_local_ready_even_if_remote_ready",
    ),
    pytest.param(
        Case(
            nodeport(etp_local=True),
            (slice_("s", serving_terminating("10.0.1.2", NODE), B),),
            http({"10.0.1.2": "E", "10.0.2.1": "IC"}),
            V4,
        ),
        id="etp_local_external_uses_local_serving_terminating_while_cluster_uses_remote_ready",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (slice_("s", terminating("10.0.1.2", NODE), B),),
            http({}),
            V4,
        ),
        id="local_not_serving_terminating_endpoint_never_used",
    ),
]

TOPOLOGY_CASES = [
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1", zones=["zone-b"]),
                    ready("10.0.3.1", "node-c", zones=["zone-a"]),
                ),
            ),
            http({"10.0.1.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="zone_hints_on_every_ready_endpoint_keep_same_zone_endpoints",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1"),
                    ready("10.0.3.1", "node-c", zones=["zone-a"]),
                ),
            ),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="zone_hints_ignored_when_one_ready_endpoint_lacks_them",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s1",
                    ready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1", zones=["zone-b"]),
                ),
                slice_("s2", ready("10.0.3.1", "node-c")),
            ),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="zone_hints_ignored_when_an_endpoint_of_another_slice_lacks_them",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.2.1", zones=["zone-b"]),
                    ready("10.0.3.1", "node-c", zones=["zone-c"]),
                ),
            ),
            http({"10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="zone_hints_not_naming_this_zone_disable_topology",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1", zones=["zone-b"]),
                ),
            ),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC"}),
            V4,
            zone="",
        ),
        id="zone_hints_ignored_on_a_node_without_zone",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1", zones=["zone-b"]),
                    unready("10.0.3.1", "node-c"),
                ),
            ),
            http({"10.0.1.1": "IC"}),
            V4,
        ),
        id="unready_endpoint_without_hints_does_not_disable_topology",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    unready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1", zones=["zone-b"]),
                    ready("10.0.3.1", "node-c", zones=["zone-b"]),
                ),
            ),
            http({"10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="unready_endpoint_hinted_for_this_zone_does_not_enable_topology",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-a"], nodes=[NODE]),
                    ready("10.0.2.1", zones=["zone-a"], nodes=["node-b"]),
                    ready("10.0.3.1", "node-c", zones=["zone-b"], nodes=["node-c"]),
                ),
            ),
            http({"10.0.1.1": "IC"}),
            V4,
        ),
        id="node_hints_win_over_zone_hints_when_every_ready_endpoint_has_both",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.2.1", zones=["zone-a"], nodes=["node-b"]),
                    ready("10.0.2.2", zones=["zone-a"], nodes=["node-b"]),
                    ready("10.0.3.1", "node-c", zones=["zone-b"], nodes=["node-c"]),
                ),
            ),
            http({"10.0.2.1": "IC", "10.0.2.2": "IC"}),
            V4,
        ),
        id="node_hints_not_naming_this_node_fall_back_to_zone_hints",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-a"], nodes=[NODE]),
                    ready("10.0.2.1", zones=["zone-a"]),
                    ready("10.0.3.1", "node-c", zones=["zone-b"], nodes=["node-c"]),
                ),
            ),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC"}),
            V4,
        ),
        id="node_hints_missing_on_one_ready_endpoint_fall_back_to_zone_hints",
    ),
    pytest.param(
        Case(
            nodeport(etp_local=True),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-b"]),
                    ready("10.0.2.1", zones=["zone-a"]),
                    ready("10.0.3.1", "node-c", zones=["zone-a"]),
                ),
            ),
            http({"10.0.1.1": "E", "10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="topology_filters_cluster_set_but_never_local_endpoints",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (
                slice_(
                    "s",
                    ready("10.0.1.1", NODE, zones=["zone-b"], nodes=["node-b"]),
                    ready("10.0.2.1", zones=["zone-a"], nodes=[NODE]),
                ),
            ),
            http({"10.0.1.1": "I"}),
            V4,
        ),
        id="itp_local_ignores_hints_that_point_elsewhere",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_(
                    "s",
                    unready("10.0.1.1", NODE, zones=["zone-a"]),
                    serving_terminating("10.0.2.1", zones=["zone-b"]),
                    serving_terminating("10.0.3.1", "node-c", zones=["zone-b"]),
                ),
            ),
            http({"10.0.2.1": "IC", "10.0.3.1": "IC"}),
            V4,
        ),
        id="terminating_fallback_ignores_topology",
    ),
]

DUAL_STACK_CASES = [
    pytest.param(
        Case(
            service(v6=DUAL),
            (
                slice_("s4", B),
                slice6("s6", serving_terminating("fd00:2::1"), unready("fd00:3::1", "node-c")),
            ),
            http({"10.0.2.1": "IC", "fd00:2::1": "IC"}),
            BOTH,
        ),
        id="dual_stack_v6_falls_back_to_terminating_while_v4_has_ready_endpoints",
    ),
    pytest.param(
        Case(
            service(v6=DUAL),
            (slice_("s4", B), slice6("s6", unready("fd00:2::1"))),
            http({"10.0.2.1": "IC"}),
            V4,
        ),
        id="dual_stack_family_without_usable_endpoint_rejects_on_its_own",
    ),
    pytest.param(
        Case(
            service(v6=DUAL),
            (
                slice_(
                    "s4",
                    ready("10.0.1.1", NODE, zones=["zone-a"]),
                    ready("10.0.2.1", zones=["zone-b"]),
                ),
                slice6("s6", A6, B6),
            ),
            http({"10.0.1.1": "IC", "fd00:1::1": "IC", "fd00:2::1": "IC"}),
            BOTH,
        ),
        id="dual_stack_topology_decided_per_family",
    ),
    pytest.param(
        Case(service(), (slice_("s4", B), slice6("s6", B6)), http({"10.0.2.1": "IC"}), V4),
        id="single_stack_v4_service_ignores_v6_slices",
    ),
    pytest.param(
        Case(service(), (slice6("s6", B6),), http({}), NONE),
        id="single_stack_v4_service_with_only_v6_endpoints_rejects",
    ),
    pytest.param(
        Case(
            service(v4=(), v6=DUAL),
            (slice_("s4", B), slice6("s6", B6)),
            http({"fd00:2::1": "IC"}),
            V6,
        ),
        id="single_stack_v6_service_ignores_v4_slices",
    ),
    pytest.param(
        Case(
            loadbalancer(ports=(HTTP,), v6=DUAL, lb_v4=(LB_IP,), etp_local=True),
            (slice_("s4", A, B), slice6("s6", A6, B6)),
            http({"10.0.1.1": "IEC", "10.0.2.1": "IC", "fd00:1::1": "IC", "fd00:2::1": "IC"}),
            BOTH,
        ),
        id="dual_stack_lb_with_v4_ingress_only_is_external_only_in_v4",
    ),
    pytest.param(
        Case(
            service(v6=DUAL, external_v6=("2001:db8::10",), etp_local=True),
            (slice_("s4", A, B), slice6("s6", A6, B6)),
            http({"10.0.1.1": "IC", "10.0.2.1": "IC", "fd00:1::1": "IEC", "fd00:2::1": "IC"}),
            BOTH,
        ),
        id="dual_stack_external_ip_in_v6_only_applies_etp_local_only_in_v6",
    ),
]

PORT_CASES = [
    pytest.param(
        Case(
            service(),
            (
                slice_("s1", A, ports=[("http", "TCP", 8080)]),
                slice_("s2", B, ports=[("http", "TCP", 9090)]),
            ),
            {"http/TCP": {"10.0.1.1:8080": "IC", "10.0.2.1:9090": "IC"}},
            V4,
        ),
        id="named_port_number_comes_from_each_slice",
    ),
    pytest.param(
        Case(
            service(ports=(HTTP, METRICS)),
            (slice_("s", A, B, ports=[("http", "TCP", 8080), ("metrics", "TCP", 9102)]),),
            {
                "http/TCP": {"10.0.1.1:8080": "IC", "10.0.2.1:8080": "IC"},
                "metrics/TCP": {"10.0.1.1:9102": "IC", "10.0.2.1:9102": "IC"},
            },
            {"http/TCP": "v4", "metrics/TCP": "v4"},
        ),
        id="each_service_port_matched_to_slice_port_by_name",
    ),
    pytest.param(
        Case(
            service(ports=(HTTP, METRICS)),
            (slice_("s", A, ports=[("http", "TCP", 8080)]),),
            {"http/TCP": {"10.0.1.1:8080": "IC"}, "metrics/TCP": {}},
            {"http/TCP": "v4", "metrics/TCP": ""},
        ),
        id="usable_endpoints_decided_per_service_port",
    ),
    pytest.param(
        Case(
            service(ports=(DNS_UDP, DNS_TCP)),
            (slice_("s", B, ports=[("dns", "TCP", 5353)]),),
            {"dns/TCP": {"10.0.2.1:5353": "IC"}, "dns/UDP": {}},
            {"dns/UDP": "", "dns/TCP": "v4"},
        ),
        id="slice_port_with_same_name_but_other_protocol_does_not_match",
    ),
    pytest.param(
        Case(
            service(ports=(UNNAMED,)),
            (slice_("s", B, ports=[("", "TCP", 8080)]),),
            {"/TCP": {"10.0.2.1:8080": "IC"}},
            {"/TCP": "v4"},
        ),
        id="unnamed_service_port_matches_unnamed_slice_port",
    ),
    pytest.param(
        Case(
            service(),
            (slice_("s1", B), slice_("s2", ready("10.0.2.1"))),
            http({"10.0.2.1": "IC"}),
            V4,
        ),
        id="same_address_in_two_slices_is_one_endpoint",
    ),
    # kube-proxy 1.36+: a terminating copy of an address never replaces a running one (a pod
    # network reusing a terminating pod's IP), whichever slice comes first.
    pytest.param(
        Case(
            service(itp_local=True),
            (
                slice_("a", serving_terminating("10.0.9.9", NODE)),
                slice_("b", ready("10.0.9.9", "node-b")),
            ),
            http({}),  # the running copy is not local: nothing local (1.35 kept the local one)
            V4,
        ),
        id="same_address_in_two_slices_keeps_the_running_copy_over_a_local_one",
    ),
    pytest.param(
        Case(
            service(itp_local=True),
            (
                slice_("a", ready("10.0.9.9", NODE)),
                slice_("b", serving_terminating("10.0.9.9", "node-b")),
            ),
            http({"10.0.9.9": "I"}),
            V4,
        ),
        id="same_address_in_two_slices_keeps_the_running_copy_listed_first",
    ),
    pytest.param(
        Case(
            service(),
            (
                slice_("s1", B, ports=[("http", "TCP", 8080)]),
                slice_("s2", ready("10.0.2.1"), ports=[("http", "TCP", 9090)]),
            ),
            {"http/TCP": {"10.0.2.1:8080": "IC", "10.0.2.1:9090": "IC"}},
            V4,
        ),
        id="same_address_with_two_port_numbers_is_two_endpoints",
    ),
    pytest.param(
        Case(
            service(type_="NodePort", ports=(HTTP_NODEPORT, ADMIN), etp_local=True),
            (slice_("s", A, B, ports=[("http", "TCP", 8080), ("admin", "TCP", 9000)]),),
            {
                "http/TCP": {"10.0.1.1:8080": "IEC", "10.0.2.1:8080": "IC"},
                "admin/TCP": {"10.0.1.1:9000": "IC", "10.0.2.1:9000": "IC"},
            },
            {"http/TCP": "v4", "admin/TCP": "v4"},
        ),
        id="port_without_node_port_is_internal_only_under_etp_local",
    ),
]


@pytest.mark.parametrize(
    "case",
    [
        *TRAFFIC_POLICY_CASES,
        *REJECT_DROP_CASES,
        *TERMINATING_CASES,
        *TOPOLOGY_CASES,
        *DUAL_STACK_CASES,
        *PORT_CASES,
    ],
)
def test_resolve_service(case: Case) -> None:
    result = resolve_service(case.service, case.slices, node=NODE, zone=case.zone)
    assert scopes_by_port(result) == {
        **{f"{p.Name}/{p.Protocol}": {} for p in case.service.Ports},
        **case.expected,
    }
    assert usable_by_port(result) == case.usable


def test_resolve_service_keeps_the_service_and_its_port_fields() -> None:
    svc = loadbalancer(ports=(HTTP_NODEPORT, METRICS), lb_v4=(LB_IP,), etp_local=True)
    result = resolve_service(svc, (slice_("s", A),), node=NODE, zone=ZONE)
    ports = tuple(msgspec.structs.replace(p, UsableEndpoints=None) for p in result.service.Ports)
    assert ports == svc.Ports
    assert [p.UsableEndpoints for p in result.service.Ports] == [IPFamilies(V4=True), None]
    assert result.service.Name == WEB
    assert result.service.IPs == svc.IPs
    assert result.service.ExternalTrafficToLocal


def test_duplicate_address_prefers_the_running_pod_over_a_terminating_one() -> None:
    """kube-proxy 1.36+ (endpointslicecache.addEndpoints): a pod network may give a new pod the IP
    of one still terminating; whatever the slices' order, the running pod's copy is used, with
    its own fields. (kube-proxy 1.35 kept the local copy instead.)"""
    old = SliceEndpoint(
        ip="10.0.9.9", hostname="old", node=NODE, ready=False, serving=True, terminating=True
    )
    new = SliceEndpoint(ip="10.0.9.9", hostname="new", node="node-b")
    for slices in ((slice_("a", old), slice_("b", new)), (slice_("a", new), slice_("b", old))):
        result = resolve_service(service(), slices, node=NODE, zone=ZONE)
        (endpoint,) = result.endpoints
        assert (endpoint.Hostname, endpoint.Local, endpoint.Ready) == ("new", False, True)


def test_endpoint_whose_scopes_differ_between_ports_appears_as_two_endpoints() -> None:
    svc = service(type_="NodePort", ports=(HTTP_NODEPORT, ADMIN), etp_local=True)
    sl = slice_("s", A, ports=[("http", "TCP", 8080), ("admin", "TCP", 9000)])
    result = resolve_service(svc, (sl,), node=NODE, zone=ZONE)
    assert sorted(
        (
            [(p.Name, p.Protocol, p.Port) for p in ep.PortOverrides],
            _scope_letters(ep.Scopes.Internal, ep.Scopes.External, ep.Scopes.Cluster),
        )
        for ep in result.endpoints
        if ep.Scopes is not None
    ) == [([("admin", "TCP", 9000)], "IC"), ([("http", "TCP", 8080)], "IEC")]
    assert len(result.endpoints) == 2


def test_endpoint_carries_its_conditions_and_local_flag() -> None:
    result = resolve_service(
        service(), (slice_("s", serving_terminating("10.0.1.1", NODE)),), node=NODE, zone=ZONE
    )
    (endpoint,) = result.endpoints
    assert (endpoint.Local, endpoint.Ready, endpoint.Serving, endpoint.Terminating) == (
        True,
        False,
        True,
        True,
    )
    assert endpoint.IPs == IPSet(V4=("10.0.1.1",))


# --- categorize: the topology and fallback rules on their own


@dataclass(frozen=True)
class CategorizeCase:
    endpoints: tuple[SliceEndpoint, ...]
    uses_cluster: bool
    uses_local: bool
    cluster: frozenset[str]
    local: frozenset[str]
    has_any: bool
    zone: str = ZONE


def ips(*addresses: str) -> frozenset[str]:
    return frozenset(addresses)


CATEGORIZE_CASES = [
    pytest.param(
        CategorizeCase(
            (
                ready("10.0.1.1", NODE, zones=["zone-a"], nodes=[NODE]),
                ready("10.0.2.1", zones=["zone-a"], nodes=["node-b"]),
            ),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.1.1"),
            local=ips(),
            has_any=True,
        ),
        id="node_hints_on_every_ready_endpoint_select_this_node",
    ),
    pytest.param(
        CategorizeCase(
            (
                ready("10.0.1.1", NODE, zones=["zone-b"]),
                ready("10.0.2.1", zones=["zone-a"]),
                ready("10.0.3.1", "node-c", zones=["zone-a", "zone-c"]),
            ),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.2.1", "10.0.3.1"),
            local=ips(),
            has_any=True,
        ),
        id="zone_hints_select_endpoints_hinted_for_this_zone_even_remote_ones",
    ),
    pytest.param(
        CategorizeCase(
            (
                ready("10.0.1.1", NODE, zones=["zone-a"], nodes=[NODE]),
                ready("10.0.2.1", zones=["zone-a"], nodes=["node-b"]),
                unready("10.0.3.1", "node-c"),
            ),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.1.1"),
            local=ips(),
            has_any=True,
        ),
        id="unready_endpoint_without_node_hints_does_not_disable_node_topology",
    ),
    pytest.param(
        CategorizeCase(
            (
                unready("10.0.1.1", NODE, nodes=[NODE]),
                ready("10.0.2.1", nodes=["node-b"]),
                ready("10.0.3.1", "node-c", nodes=["node-c"]),
            ),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.2.1", "10.0.3.1"),
            local=ips(),
            has_any=True,
        ),
        id="unready_endpoint_hinted_for_this_node_does_not_enable_node_topology",
    ),
    pytest.param(
        CategorizeCase(
            (
                ready("10.0.1.1", NODE, zones=["zone-a"]),
                ready("10.0.2.1", zones=["zone-b"]),
            ),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.1.1", "10.0.2.1"),
            local=ips(),
            has_any=True,
            zone="",
        ),
        id="zone_hints_ignored_without_a_node_zone",
    ),
    pytest.param(
        CategorizeCase(
            (
                ready("10.0.2.1", zones=["zone-b"], nodes=["node-b"]),
                ready("10.0.3.1", "node-c", zones=["zone-c"], nodes=["node-c"]),
            ),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.2.1", "10.0.3.1"),
            local=ips(),
            has_any=True,
        ),
        id="hints_naming_neither_this_node_nor_zone_select_every_ready_endpoint",
    ),
    pytest.param(
        CategorizeCase(
            (
                serving_terminating("10.0.1.1", NODE),
                serving_terminating("10.0.2.1", zones=["zone-b"]),
                terminating("10.0.3.1", "node-c"),
                unready("10.0.3.2", "node-c"),
            ),
            uses_cluster=True,
            uses_local=True,
            cluster=ips("10.0.1.1", "10.0.2.1"),
            local=ips("10.0.1.1"),
            has_any=True,
        ),
        id="serving_terminating_fallback_for_cluster_and_local_sets",
    ),
    pytest.param(
        CategorizeCase(
            (
                ready("10.0.1.1", NODE, zones=["zone-b"]),
                serving_terminating("10.0.1.2", NODE),
                ready("10.0.2.1", zones=["zone-a"]),
            ),
            uses_cluster=True,
            uses_local=True,
            cluster=ips("10.0.2.1"),
            local=ips("10.0.1.1"),
            has_any=True,
        ),
        id="local_set_is_local_ready_endpoints_regardless_of_topology",
    ),
    pytest.param(
        CategorizeCase(
            (terminating("10.0.1.1", NODE), unready("10.0.1.2", NODE), ready("10.0.2.1")),
            uses_cluster=False,
            uses_local=True,
            cluster=ips(),
            local=ips(),
            has_any=True,
        ),
        id="local_only_usage_counts_remote_ready_endpoint_as_usable",
    ),
    pytest.param(
        CategorizeCase(
            (serving_terminating("10.0.2.1"),),
            uses_cluster=False,
            uses_local=True,
            cluster=ips(),
            local=ips(),
            has_any=True,
        ),
        id="local_only_usage_counts_remote_serving_terminating_as_usable",
    ),
    pytest.param(
        CategorizeCase(
            (terminating("10.0.1.1", NODE), unready("10.0.2.1")),
            uses_cluster=False,
            uses_local=True,
            cluster=ips(),
            local=ips(),
            has_any=False,
        ),
        id="local_only_usage_with_nothing_serving_has_no_usable_endpoint",
    ),
    pytest.param(
        CategorizeCase(
            (A, B),
            uses_cluster=True,
            uses_local=False,
            cluster=ips("10.0.1.1", "10.0.2.1"),
            local=ips(),
            has_any=True,
        ),
        id="cluster_only_usage_leaves_local_set_empty",
    ),
    pytest.param(
        CategorizeCase(
            (),
            uses_cluster=True,
            uses_local=True,
            cluster=ips(),
            local=ips(),
            has_any=False,
        ),
        id="no_endpoints_nothing_usable",
    ),
]


@pytest.mark.parametrize("case", CATEGORIZE_CASES)
def test_categorize(case: CategorizeCase) -> None:
    cats = categorize(
        case.endpoints,
        node=NODE,
        zone=case.zone,
        uses_cluster=case.uses_cluster,
        uses_local=case.uses_local,
    )
    assert frozenset(case.endpoints[i].ip for i in cats.cluster) == case.cluster
    assert frozenset(case.endpoints[i].ip for i in cats.local) == case.local
    assert cats.has_any == case.has_any


# --- NodeResolver: incremental recomputation


def this_node(zone: str) -> Node:
    return Node(Name=NODE, Topology=TopologyInfo(Node=NODE, Zone=zone))


WEB_KEY = (NS, WEB)
API_KEY = (NS, "api")


def two_service_resolver() -> NodeResolver:
    resolver = NodeResolver(NODE)
    resolver.set_node(this_node(ZONE))
    resolver.set_service(WEB_KEY, service())
    resolver.set_service(API_KEY, service(name="api", v4=("10.96.0.11",)))
    resolver.set_slice((NS, "web-1"), slice_("web-1", B))
    resolver.set_slice((NS, "api-1"), slice_("api-1", C, service="api"))
    first = resolver.resolve()
    assert set(first.updated) == {WEB_KEY, API_KEY}
    assert not first.deleted
    return resolver


def test_node_resolver_first_resolve_yields_every_service() -> None:
    resolver = two_service_resolver()
    assert scopes_by_port(resolver.state[WEB_KEY]) == http({"10.0.2.1": "IC"})
    assert scopes_by_port(resolver.state[API_KEY]) == http({"10.0.3.1": "IC"})


def test_node_resolver_slice_change_updates_only_its_service() -> None:
    resolver = two_service_resolver()
    resolver.set_slice((NS, "web-1"), slice_("web-1", A, B))
    changes = resolver.resolve()
    assert set(changes.updated) == {WEB_KEY}
    assert not changes.deleted
    assert scopes_by_port(changes.updated[WEB_KEY]) == http({"10.0.1.1": "IC", "10.0.2.1": "IC"})
    assert resolver.state[WEB_KEY] == changes.updated[WEB_KEY]


def test_node_resolver_slice_change_recomputes_only_its_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resolver = two_service_resolver()
    computed: list[str] = []
    real = resolving.resolve_service

    def spy(svc: Service, slices: Iterable[Slice], *, node: str, zone: str) -> ServiceEndpoints:
        computed.append(svc.Name)
        return real(svc, slices, node=node, zone=zone)

    monkeypatch.setattr(resolving, "resolve_service", spy)
    resolver.set_slice((NS, "api-1"), slice_("api-1", A, service="api"))
    resolver.resolve()
    assert computed == ["api"]


def test_node_resolver_slice_moved_to_another_service_updates_both() -> None:
    resolver = two_service_resolver()
    resolver.set_slice((NS, "web-1"), slice_("web-1", B, service="api"))
    changes = resolver.resolve()
    assert set(changes.updated) == {WEB_KEY, API_KEY}
    assert scopes_by_port(changes.updated[WEB_KEY]) == http({})
    assert usable_by_port(changes.updated[WEB_KEY]) == NONE
    assert scopes_by_port(changes.updated[API_KEY]) == http({"10.0.2.1": "IC", "10.0.3.1": "IC"})


def test_node_resolver_deleting_a_slice_leaves_the_service_rejecting() -> None:
    resolver = two_service_resolver()
    resolver.set_slice((NS, "web-1"), None)
    changes = resolver.resolve()
    assert set(changes.updated) == {WEB_KEY}
    assert changes.updated[WEB_KEY].endpoints == ()
    assert usable_by_port(changes.updated[WEB_KEY]) == NONE


def test_node_resolver_deleting_a_service_yields_deleted() -> None:
    resolver = two_service_resolver()
    resolver.set_service(WEB_KEY, None)
    changes = resolver.resolve()
    assert changes.deleted == frozenset({WEB_KEY})
    assert dict(changes.updated) == {}
    assert WEB_KEY not in resolver.state
    assert API_KEY in resolver.state


def test_node_resolver_deleting_an_unknown_service_changes_nothing() -> None:
    resolver = two_service_resolver()
    resolver.set_service((NS, "nope"), None)
    assert not resolver.resolve()


def test_node_resolver_slice_before_its_service_is_used_once_the_service_arrives() -> None:
    resolver = NodeResolver(NODE)
    resolver.set_slice((NS, "web-1"), slice_("web-1", B))
    assert not resolver.resolve()
    resolver.set_service(WEB_KEY, service())
    changes = resolver.resolve()
    assert scopes_by_port(changes.updated[WEB_KEY]) == http({"10.0.2.1": "IC"})


def test_node_resolver_unchanged_reset_yields_no_changes() -> None:
    resolver = two_service_resolver()
    resolver.set_service(WEB_KEY, service())
    resolver.set_slice((NS, "web-1"), slice_("web-1", B))
    resolver.set_node(this_node(ZONE))
    changes = resolver.resolve()
    assert not changes
    assert dict(changes.updated) == {}
    assert changes.deleted == frozenset()


def test_node_resolver_zone_change_re_resolves_topology() -> None:
    resolver = NodeResolver(NODE)
    resolver.set_node(this_node("zone-a"))
    resolver.set_service(WEB_KEY, service())
    resolver.set_service(API_KEY, service(name="api", v4=("10.96.0.11",)))
    resolver.set_slice(
        (NS, "web-1"),
        slice_(
            "web-1",
            ready("10.0.1.1", NODE, zones=["zone-a"]),
            ready("10.0.2.1", zones=["zone-b"]),
        ),
    )
    resolver.set_slice((NS, "api-1"), slice_("api-1", C, service="api"))
    first = resolver.resolve()
    assert scopes_by_port(first.updated[WEB_KEY]) == http({"10.0.1.1": "IC"})

    resolver.set_node(this_node("zone-b"))
    changes = resolver.resolve()
    assert set(changes.updated) == {WEB_KEY}
    assert scopes_by_port(changes.updated[WEB_KEY]) == http({"10.0.2.1": "IC"})


def test_node_resolver_ignores_other_nodes() -> None:
    resolver = NodeResolver(NODE)
    resolver.set_node(this_node("zone-a"))
    resolver.set_service(WEB_KEY, service())
    resolver.set_slice(
        (NS, "web-1"),
        slice_(
            "web-1",
            ready("10.0.1.1", NODE, zones=["zone-a"]),
            ready("10.0.2.1", zones=["zone-b"]),
        ),
    )
    resolver.resolve()
    resolver.set_node(Node(Name="node-b", Topology=TopologyInfo(Node="node-b", Zone="zone-b")))
    assert not resolver.resolve()
    assert scopes_by_port(resolver.state[WEB_KEY]) == http({"10.0.1.1": "IC"})


def _serving(result: ServiceEndpoints) -> dict[str, list[str]]:
    return {
        f"{p.Name}/{p.Protocol}": [f"{e.IP}:{e.Port}" for e in p.ServingEndpoints]
        for p in result.service.Ports
    }


def test_udp_ports_list_every_endpoint_serving_anywhere_for_conntrack_cleanup() -> None:
    """kube-proxy 1.35+ (pkg/proxy/conntrack/cleanup.go) keeps a UDP flow while its endpoint
    serves, whatever traffic policy, topology or termination say about new flows: the port
    lists those endpoints, the ready ones and the serving terminating ones of every node and
    family, and never one that no longer serves. Only UDP ports: only UDP flows are cleaned."""
    ports = (("dns", "UDP", 5353), ("dns", "TCP", 5353))
    slices = (
        slice_(
            "v4",
            ready("10.0.1.1", NODE),
            ready("10.0.2.1", zones=("zone-b",)),  # topology keeps node-a away from it
            serving_terminating("10.0.2.2"),  # unused while a ready endpoint exists
            terminating("10.0.2.3"),
            ports=ports,
        ),
        slice_("v6", ready("fd00:2::1"), ports=ports, v6=True),
    )
    svc = service(ports=(DNS_UDP, DNS_TCP), v6=("fd00:96::10",), itp_local=True)
    result = resolve_service(svc, slices, node=NODE, zone=ZONE)
    assert _serving(result) == {
        "dns/UDP": ["10.0.1.1:5353", "10.0.2.1:5353", "10.0.2.2:5353", "fd00:2::1:5353"],
        "dns/TCP": [],
    }
    assert scopes_by_port(result)["dns/UDP"] == {"10.0.1.1:5353": "I"}  # the only one for new flows
