"""Kubernetes objects to the global model: kube-proxy's ignore rules, defaults and validation.

Expected values come from kube-proxy's behaviour (its informers' label selectors, the
EndpointSliceCache's defaults and its ServicePort construction), not from kpng's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kpng.errors import InvalidObject
from kpng.model import k8s
from kpng.model.cluster import Slice, SliceEndpoint, SlicePort
from kpng.model.converting import (
    node_from_k8s,
    service_cidr_from_k8s,
    service_from_k8s,
    slice_from_k8s,
)
from kpng.model.messages import ClientIPAffinity, IPFilter, IPSet, PortMapping, Service

PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# --- input constructors


def service_obj(
    *,
    name: str = "web",
    namespace: str | None = "ns1",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    status: dict[str, Any] | None = None,
    **spec: Any,
) -> k8s.Service:
    """A v1 Service as the API serves it; ``spec`` keys (camelCase) override the defaults."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    if labels is not None:
        metadata["labels"] = labels
    if annotations is not None:
        metadata["annotations"] = annotations
    raw: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.10",
            "clusterIPs": ["10.96.0.10"],
            "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}],
            **spec,
        },
    }
    if status is not None:
        raw["status"] = status
    return msgspec.convert(raw, type=k8s.Service)


def lb_status(*ingress: dict[str, Any]) -> dict[str, Any]:
    return {"loadBalancer": {"ingress": list(ingress)}}


def slice_obj(
    *,
    name: str = "web-abcde",
    namespace: str | None = "ns1",
    labels: dict[str, str] | None = None,
    address_type: str = "IPv4",
    endpoints: list[dict[str, Any]] | None = None,
    ports: list[dict[str, Any]] | None = None,
) -> k8s.EndpointSlice:
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {SERVICE_NAME_LABEL: "web"} if labels is None else labels,
    }
    if namespace is not None:
        metadata["namespace"] = namespace
    raw: dict[str, Any] = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata,
        "addressType": address_type,
        "endpoints": [{"addresses": ["10.1.0.1"]}] if endpoints is None else endpoints,
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}] if ports is None else ports,
    }
    return msgspec.convert(raw, type=k8s.EndpointSlice)


def node_obj(name: str, labels: dict[str, str] | None = None) -> k8s.Node:
    metadata: dict[str, Any] = {"name": name}
    if labels is not None:
        metadata["labels"] = labels
    return msgspec.convert(
        {"apiVersion": "v1", "kind": "Node", "metadata": metadata}, type=k8s.Node
    )


# --- ignore rules


SERVICE_IGNORE_CASES = [
    pytest.param(service_obj(), None, True, id="plain_service_is_proxied"),
    pytest.param(
        service_obj(labels={PROXY_NAME_LABEL: "other"}),
        None,
        False,
        id="service_proxy_name_label_ignored_without_proxy_name",
    ),
    pytest.param(
        service_obj(labels={PROXY_NAME_LABEL: ""}),
        None,
        False,
        id="empty_service_proxy_name_label_ignored_without_proxy_name",
    ),
    pytest.param(
        service_obj(labels={PROXY_NAME_LABEL: "kpng"}),
        "kpng",
        True,
        id="service_proxy_name_matching_proxy_name_is_proxied",
    ),
    pytest.param(
        service_obj(labels={PROXY_NAME_LABEL: "other"}),
        "kpng",
        False,
        id="service_proxy_name_not_matching_proxy_name_ignored",
    ),
    pytest.param(
        service_obj(),
        "kpng",
        False,
        id="unlabelled_service_ignored_with_proxy_name",
    ),
    pytest.param(
        service_obj(labels={HEADLESS_LABEL: ""}),
        None,
        False,
        id="service_with_headless_label_ignored_like_kube_proxy_informer_selector",
    ),
    pytest.param(
        service_obj(clusterIP="None", clusterIPs=["None"]),
        None,
        False,
        id="headless_cluster_ip_none_ignored",
    ),
    pytest.param(
        service_obj(clusterIP="None", clusterIPs=None),
        None,
        False,
        id="headless_cluster_ip_none_without_cluster_ips_ignored",
    ),
    pytest.param(
        service_obj(clusterIP="", clusterIPs=None),
        None,
        False,
        id="service_without_cluster_ip_ignored",
    ),
    pytest.param(
        service_obj(type="ExternalName", clusterIP="", clusterIPs=None, externalName="a.b"),
        None,
        False,
        id="external_name_service_ignored",
    ),
    pytest.param(
        service_obj(type="ExternalName"),
        None,
        False,
        id="external_name_service_ignored_even_with_a_cluster_ip",
    ),
]


@pytest.mark.parametrize(("obj", "proxy_name", "proxied"), SERVICE_IGNORE_CASES)
def test_service_ignore_rules(obj: k8s.Service, proxy_name: str | None, proxied: bool) -> None:
    result = service_from_k8s(obj, proxy_name=proxy_name)
    if proxied:
        assert isinstance(result, Service)
        assert (result.Namespace, result.Name) == ("ns1", "web")
    else:
        assert result is None


@pytest.mark.parametrize("labels", [{}, {"app": "web"}], ids=["no-labels", "other-labels"])
def test_slice_without_service_name_is_reported_not_silently_dropped(
    labels: dict[str, str],
) -> None:
    """kube-proxy logs such a slice as an error: it belongs to no service."""
    with pytest.raises(
        InvalidObject, match=r"EndpointSlice ns1/web-abcde: no kubernetes\.io/service-name label"
    ):
        slice_from_k8s(slice_obj(labels=labels))


SLICE_IGNORE_CASES = [
    pytest.param(slice_obj(), None, True, id="plain_slice_is_proxied"),
    pytest.param(
        slice_obj(labels={SERVICE_NAME_LABEL: "web", HEADLESS_LABEL: ""}),
        None,
        False,
        id="slice_with_headless_label_ignored",
    ),
    pytest.param(
        slice_obj(labels={SERVICE_NAME_LABEL: "web", HEADLESS_LABEL: ""}),
        "kpng",
        False,
        id="slice_with_headless_label_ignored_with_proxy_name",
    ),
    pytest.param(
        slice_obj(labels={SERVICE_NAME_LABEL: "web", PROXY_NAME_LABEL: "other"}),
        None,
        False,
        id="slice_with_service_proxy_name_ignored_without_proxy_name",
    ),
    pytest.param(
        slice_obj(labels={SERVICE_NAME_LABEL: "web", PROXY_NAME_LABEL: "kpng"}),
        "kpng",
        True,
        id="slice_with_matching_service_proxy_name_is_proxied",
    ),
    pytest.param(
        slice_obj(),
        "kpng",
        False,
        id="unlabelled_slice_ignored_with_proxy_name",
    ),
    pytest.param(
        slice_obj(address_type="FQDN", endpoints=[{"addresses": ["db.example.com"]}]),
        None,
        False,
        id="fqdn_slice_ignored",
    ),
]


@pytest.mark.parametrize(("obj", "proxy_name", "proxied"), SLICE_IGNORE_CASES)
def test_slice_ignore_rules(obj: k8s.EndpointSlice, proxy_name: str | None, proxied: bool) -> None:
    result = slice_from_k8s(obj, proxy_name=proxy_name)
    if proxied:
        assert isinstance(result, Slice)
        assert result.service_key == ("ns1", "web")
        assert [ep.ip for ep in result.endpoints] == ["10.1.0.1"]
    else:
        assert result is None


def _convert_slice(obj: k8s.EndpointSlice) -> Slice:
    result = slice_from_k8s(obj)
    assert result is not None
    return result


SLICE_PART_CASES = [
    pytest.param(
        slice_obj(
            ports=[
                {"name": "http", "protocol": "TCP", "port": 8080},
                {"name": "all", "protocol": "TCP"},
                {"name": "zero", "protocol": "TCP", "port": 0},
            ]
        ),
        [SlicePort(name="http", protocol="TCP", port=8080)],
        ["10.1.0.1"],
        id="slice_ports_without_number_dropped",
    ),
    pytest.param(
        slice_obj(ports=[{"name": "http", "port": 8080}]),
        [SlicePort(name="http", protocol="TCP", port=8080)],
        ["10.1.0.1"],
        id="slice_port_protocol_defaults_to_tcp",
    ),
    pytest.param(
        slice_obj(ports=[{"port": 8080}, {"name": "", "protocol": "UDP", "port": 53}]),
        [SlicePort(name="", protocol="UDP", port=53)],
        ["10.1.0.1"],
        id="slice_port_without_name_dropped_empty_name_kept",
    ),
    pytest.param(
        slice_obj(
            endpoints=[
                {"addresses": ["10.1.0.1"]},
                {"addresses": ["fd00::1"]},
                {"addresses": ["10.1.0.2", "fd00::2"]},
                {"addresses": []},
            ]
        ),
        [SlicePort(name="http", protocol="TCP", port=8080)],
        ["10.1.0.1", "10.1.0.2"],
        id="v4_slice_drops_endpoints_whose_first_address_is_v6_or_missing",
    ),
    pytest.param(
        slice_obj(
            address_type="IPv6",
            endpoints=[
                {"addresses": ["10.1.0.1"]},
                {"addresses": ["FD00:0:0::1"]},
                {"addresses": ["fd00::2", "10.1.0.2"]},
            ],
        ),
        [SlicePort(name="http", protocol="TCP", port=8080)],
        ["fd00::1", "fd00::2"],
        id="v6_slice_drops_v4_endpoints_and_canonicalises_addresses",
    ),
]


@pytest.mark.parametrize(("obj", "ports", "addresses"), SLICE_PART_CASES)
def test_slice_ports_and_endpoint_families(
    obj: k8s.EndpointSlice, ports: list[SlicePort], addresses: list[str]
) -> None:
    result = _convert_slice(obj)
    assert list(result.ports) == ports
    assert [ep.ip for ep in result.endpoints] == addresses
    assert result.v6 == (obj.address_type == "IPv6")


# --- endpoint defaults


def _one_endpoint(endpoint: dict[str, Any]) -> SliceEndpoint:
    (ep,) = _convert_slice(slice_obj(endpoints=[endpoint])).endpoints
    return ep


CONDITION_CASES = [
    pytest.param(
        {}, (True, True, False), id="conditions_missing_mean_ready_serving_not_terminating"
    ),
    pytest.param({"conditions": {}}, (True, True, False), id="empty_conditions_default_the_same"),
    pytest.param(
        {"conditions": {"ready": False}},
        (False, True, False),
        id="serving_nil_defaults_true_even_when_not_ready",
    ),
    pytest.param(
        {"conditions": {"ready": False, "serving": True, "terminating": True}},
        (False, True, True),
        id="serving_terminating_kept",
    ),
    pytest.param(
        {"conditions": {"ready": False, "serving": False, "terminating": True}},
        (False, False, True),
        id="not_serving_terminating_kept",
    ),
    pytest.param(
        {"conditions": {"serving": False}},
        (True, False, False),
        id="ready_nil_defaults_true_independently_of_serving",
    ),
]


@pytest.mark.parametrize(("extra", "expected"), CONDITION_CASES)
def test_endpoint_condition_defaults(
    extra: dict[str, Any], expected: tuple[bool, bool, bool]
) -> None:
    ep = _one_endpoint({"addresses": ["10.1.0.1"], **extra})
    assert (ep.ready, ep.serving, ep.terminating) == expected


def test_endpoint_topology_fields_and_hints_are_kept() -> None:
    ep = _one_endpoint(
        {
            "addresses": ["10.1.0.1"],
            "hostname": "web-0",
            "nodeName": "node-a",
            "zone": "zone-a",
            "targetRef": {"kind": "Pod", "name": "web-0", "namespace": "ns1"},
            "hints": {
                "forZones": [{"name": "zone-a"}, {"name": "zone-b"}],
                "forNodes": [{"name": "node-a"}],
            },
        }
    )
    assert ep == SliceEndpoint(
        ip="10.1.0.1",
        hostname="web-0",
        node="node-a",
        zone="zone-a",
        pod="web-0",
        zone_hints=("zone-a", "zone-b"),
        node_hints=("node-a",),
    )


def test_slice_namespace_defaults_to_default() -> None:
    result = _convert_slice(slice_obj(namespace=None))
    assert result.key == ("default", "web-abcde")
    assert result.service_key == ("default", "web")


# --- Service fields and defaults


def _convert_service(obj: k8s.Service) -> Service:
    result = service_from_k8s(obj)
    assert result is not None
    return result


def _ports(svc: Service) -> object:
    return svc.Ports


def _cluster_ips(svc: Service) -> object:
    return svc.IPs.ClusterIPs if svc.IPs is not None else None


def _external_ips(svc: Service) -> object:
    return svc.IPs.ExternalIPs if svc.IPs is not None else None


def _lb_ips(svc: Service) -> object:
    return svc.IPs.LoadBalancerIPs if svc.IPs is not None else None


SERVICE_FIELD_CASES: list[Any] = [
    pytest.param(
        service_obj(ports=[{"name": "dns", "port": 53}]),
        _ports,
        (PortMapping(Name="dns", Protocol="TCP", Port=53, TargetPort=53),),
        id="port_protocol_defaults_to_tcp_and_target_port_to_port",
    ),
    pytest.param(
        service_obj(ports=[{"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 0}]),
        _ports,
        (PortMapping(Name="dns", Protocol="UDP", Port=53, TargetPort=53),),
        id="target_port_zero_defaults_to_port",
    ),
    pytest.param(
        service_obj(ports=[{"name": "http", "port": 80, "targetPort": "web"}]),
        _ports,
        (PortMapping(Name="http", Protocol="TCP", Port=80, TargetPortName="web"),),
        id="named_target_port_kept_as_name",
    ),
    pytest.param(
        service_obj(
            type="NodePort",
            ports=[{"name": "http", "protocol": "SCTP", "port": 80, "nodePort": 30080}],
        ),
        _ports,
        (PortMapping(Name="http", Protocol="SCTP", Port=80, NodePort=30080, TargetPort=80),),
        id="node_port_and_sctp_kept",
    ),
    pytest.param(
        service_obj(clusterIP="10.96.0.10", clusterIPs=None),
        _cluster_ips,
        IPSet(V4=("10.96.0.10",)),
        id="cluster_ip_used_when_cluster_ips_missing",
    ),
    pytest.param(
        service_obj(clusterIP="fd00:96::10", clusterIPs=["FD00:96:0::10", "10.96.0.10"]),
        _cluster_ips,
        IPSet(V4=("10.96.0.10",), V6=("fd00:96::10",)),
        id="dual_stack_cluster_ips_split_by_family_and_canonicalised",
    ),
    pytest.param(
        service_obj(externalIPs=["192.0.2.2", "192.0.2.1", "192.0.2.2", "2001:DB8::1"]),
        _external_ips,
        IPSet(V4=("192.0.2.1", "192.0.2.2"), V6=("2001:db8::1",)),
        id="external_ips_sorted_unique_per_family",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            status=lb_status(
                {"ip": "203.0.113.2", "ipMode": "VIP"},
                {"ip": "203.0.113.1"},
                {"ip": "203.0.113.3", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
            ),
        ),
        _lb_ips,
        IPSet(V4=("203.0.113.1", "203.0.113.2")),
        id="lb_ingress_vip_and_unset_ip_mode_kept_proxy_and_hostname_dropped",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            loadBalancerSourceRanges=[" 10.0.0.0/8 ", "192.168.1.7/24", "2001:db8::/32"],
            status=lb_status({"ip": "203.0.113.1"}),
        ),
        lambda svc: svc.IPFilters,
        (
            IPFilter(
                TargetIPs=IPSet(V4=("203.0.113.1",)),
                SourceRanges=("10.0.0.0/8", "192.168.1.0/24", "2001:db8::/32"),
            ),
        ),
        id="source_ranges_trimmed_and_masked_and_applied_to_lb_ips",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            loadBalancerSourceRanges=["10.0.0.0/8"],
            status=lb_status({"ip": "203.0.113.3", "ipMode": "Proxy"}),
        ),
        lambda svc: svc.IPFilters,
        (),
        id="source_ranges_without_vip_ingress_filter_nothing",
    ),
    pytest.param(
        service_obj(sessionAffinity="ClientIP"),
        lambda svc: svc.ClientIP,
        ClientIPAffinity(TimeoutSeconds=10800),
        id="client_ip_affinity_timeout_defaults_to_10800",
    ),
    pytest.param(
        service_obj(
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        lambda svc: svc.ClientIP,
        ClientIPAffinity(TimeoutSeconds=60),
        id="client_ip_affinity_timeout_kept",
    ),
    pytest.param(
        service_obj(sessionAffinity="None"),
        lambda svc: svc.ClientIP,
        None,
        id="no_session_affinity",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000,
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        lambda svc: (svc.HealthCheckNodePort, svc.ExternalTrafficToLocal),
        (32000, True),
        id="health_check_node_port_kept_for_loadbalancer_etp_local",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            externalTrafficPolicy="Cluster",
            healthCheckNodePort=32000,
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        lambda svc: (svc.HealthCheckNodePort, svc.ExternalTrafficToLocal),
        (0, False),
        id="health_check_node_port_dropped_for_loadbalancer_etp_cluster",
    ),
    pytest.param(
        service_obj(
            type="NodePort",
            externalTrafficPolicy="Local",
            healthCheckNodePort=32000,
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        ),
        lambda svc: (svc.HealthCheckNodePort, svc.ExternalTrafficToLocal),
        (0, True),
        id="health_check_node_port_dropped_for_nodeport_etp_local",
    ),
    pytest.param(
        service_obj(internalTrafficPolicy="Local"),
        lambda svc: (svc.InternalTrafficToLocal, svc.ExternalTrafficToLocal),
        (True, False),
        id="internal_traffic_policy_local",
    ),
    pytest.param(
        service_obj(namespace=None),
        lambda svc: (svc.Namespace, svc.Name),
        ("default", "web"),
        id="namespace_defaults_to_default",
    ),
    pytest.param(
        service_obj(
            labels={"app": "web"},
            annotations={
                "team": "a",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
            },
        ),
        lambda svc: (svc.Labels, svc.Annotations),
        ({"app": "web"}, {"team": "a"}),
        id="labels_kept_last_applied_configuration_dropped",
    ),
    pytest.param(
        service_obj(trafficDistribution="PreferClose"),
        lambda svc: svc.TrafficDistribution,
        "PreferClose",
        id="traffic_distribution_kept",
    ),
]


@pytest.mark.parametrize(("obj", "field", "expected"), SERVICE_FIELD_CASES)
def test_service_fields(
    obj: k8s.Service, field: Callable[[Service], object], expected: object
) -> None:
    assert field(_convert_service(obj)) == expected


def test_node_zone_comes_from_the_zone_label() -> None:
    node = node_from_k8s(node_obj("node-a", {"topology.kubernetes.io/zone": "zone-a"}))
    assert node.Name == "node-a"
    assert node.Topology is not None
    assert node.Topology.Zone == "zone-a"


NODE_DRAINING_CASES = {
    "plain": ({}, {}, False),
    "being deleted": ({"deletionTimestamp": "2026-11-22T10:00:00Z"}, {}, True),
    "autoscaler will delete it": (
        {},
        {
            "taints": [
                {
                    "key": "ToBeDeletedByClusterAutoscaler",
                    "value": "1700000000",
                    "effect": "NoSchedule",
                }
            ]
        },
        True,
    ),
    "only a candidate for deletion": (
        {},
        {"taints": [{"key": "DeletionCandidateOfClusterAutoscaler", "effect": "PreferNoSchedule"}]},
        False,
    ),
    "cordoned (kube-proxy keeps serving it)": (
        {},
        {
            "unschedulable": True,
            "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
        },
        False,
    ),
}


@pytest.mark.parametrize("case", NODE_DRAINING_CASES)
def test_node_draining(case: str) -> None:
    metadata, spec, draining = NODE_DRAINING_CASES[case]
    obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", **metadata}, "spec": spec}
    assert node_from_k8s(msgspec.convert(obj, type=k8s.Node)).Draining is draining


# --- bad input


INVALID_SERVICE_CASES = [
    pytest.param(
        service_obj(clusterIP="10.96.0.300", clusterIPs=["10.96.0.300"]),
        "10.96.0.300",
        id="invalid_cluster_ip",
    ),
    pytest.param(
        # Lenient is decimal only: inet_aton's hex and short forms stay refused.
        service_obj(clusterIP="0x0a.96.0.10", clusterIPs=["0x0a.96.0.10"]),
        "0x0a.96.0.10",
        id="cluster_ip_in_hex",
    ),
    pytest.param(
        service_obj(ports=[{"name": "http", "port": 70000}]), "70000", id="port_out_of_range"
    ),
    pytest.param(service_obj(ports=[{"name": "http", "port": 0}]), "ports", id="port_zero"),
    pytest.param(
        service_obj(ports=[{"name": "http", "port": 80, "targetPort": 65536}]),
        "65536",
        id="target_port_out_of_range",
    ),
    pytest.param(
        service_obj(type="NodePort", ports=[{"name": "http", "port": 80, "nodePort": 99999}]),
        "99999",
        id="node_port_out_of_range",
    ),
    pytest.param(
        service_obj(ports=[{"name": "http", "targetPort": 8080}]),
        "ports",
        id="service_port_without_number",
    ),
    pytest.param(
        service_obj(ports=[{"name": "http", "protocol": "ICMP", "port": 80}]),
        "ICMP",
        id="unknown_protocol",
    ),
    pytest.param(service_obj(type="Magic"), "Magic", id="unknown_service_type"),
    pytest.param(service_obj(sessionAffinity="Cookie"), "Cookie", id="unknown_session_affinity"),
    pytest.param(
        service_obj(externalTrafficPolicy="Nearby"), "Nearby", id="unknown_traffic_policy"
    ),
]


@pytest.mark.parametrize(("obj", "detail"), INVALID_SERVICE_CASES)
def test_invalid_service_raises_naming_the_object(obj: k8s.Service, detail: str) -> None:
    with pytest.raises(InvalidObject) as info:
        service_from_k8s(obj)
    message = str(info.value)
    assert (info.value.kind, info.value.namespace, info.value.name) == ("Service", "ns1", "web")
    assert "Service" in message
    assert "ns1/web" in message
    assert detail in message


LB_VIP = lb_status({"ip": "203.0.113.3"})
V4_LB = IPSet(V4=("203.0.113.3",), V6=())

# kube-proxy reads a stored Service leniently (netutils.ParseIPSloppy / ParseCIDRSloppy, then
# MapIPsByIPFamily / MapCIDRsByIPFamily): IPv4 parts with leading zeros are decimal (Kubernetes
# before 1.20 stored them), and an externalIP, ingress IP or source range it cannot read is
# skipped, logged, while the rest of the Service is served. kpng refused such a Service whole.
LENIENT_SERVICE_CASES = [
    pytest.param(
        service_obj(clusterIP="010.096.000.010", clusterIPs=["010.096.000.010"]),
        lambda svc: svc.IPs.ClusterIPs,
        IPSet(V4=("10.96.0.10",), V6=()),
        [],
        id="cluster_ip_leading_zeros_are_decimal",
    ),
    pytest.param(
        service_obj(externalIPs=["010.000.001.002", "192.168.001.020"]),
        lambda svc: svc.IPs.ExternalIPs,
        IPSet(V4=("10.0.1.2", "192.168.1.20"), V6=()),
        [],
        id="external_ips_leading_zeros_are_decimal",
    ),
    pytest.param(
        service_obj(externalIPs=["2001:db8::010.000.000.001"]),
        lambda svc: svc.IPs.ExternalIPs,
        IPSet(V4=(), V6=("2001:db8::a00:1",)),
        [],
        id="embedded_ipv4_leading_zeros_are_decimal",
    ),
    pytest.param(
        service_obj(externalIPs=["192.0.2", "198.51.100.7", "1.2.3.256"]),
        lambda svc: svc.IPs.ExternalIPs,
        IPSet(V4=("198.51.100.7",), V6=()),
        ["spec.externalIPs[0]: invalid IP address '192.0.2'",
         "spec.externalIPs[2]: invalid IP address '1.2.3.256'"],
        id="bad_external_ip_skipped",
    ),
    pytest.param(
        service_obj(externalIPs=["", " ", "198.51.100.7"]),
        lambda svc: svc.IPs.ExternalIPs,
        IPSet(V4=("198.51.100.7",), V6=()),
        [],
        id="blank_external_ips_skipped_silently",
    ),
    pytest.param(
        service_obj(externalIPs=["192.0.2"]),
        lambda svc: svc.IPs.ExternalIPs,
        None,
        ["spec.externalIPs[0]"],
        id="no_external_ip_left",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer", status=lb_status({"ip": "203.000.113.003"}, {"ip": "not-an-ip"})
        ),
        lambda svc: svc.IPs.LoadBalancerIPs,
        V4_LB,
        ["status.loadBalancer.ingress[1]: invalid IP address 'not-an-ip'"],
        id="lb_ingress_leading_zeros_read_bad_one_skipped",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            loadBalancerSourceRanges=["10.0.0.0/33", "192.168.0.0/16", "pods"],
            status=LB_VIP,
        ),
        lambda svc: svc.IPFilters,
        (IPFilter(TargetIPs=V4_LB, SourceRanges=("192.168.0.0/16",)),),
        ["spec.loadBalancerSourceRanges[0]: invalid CIDR '10.0.0.0/33'",
         "spec.loadBalancerSourceRanges[2]: invalid CIDR 'pods'"],
        id="bad_source_range_skipped_the_others_filter",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            loadBalancerSourceRanges=["010.000.000.000/008", " 172.16.1.0/24 ", ""],
            status=LB_VIP,
        ),
        lambda svc: svc.IPFilters,
        (IPFilter(TargetIPs=V4_LB, SourceRanges=("10.0.0.0/8", "172.16.1.0/24")),),
        [],
        id="source_ranges_leading_zeros_trimmed_blank_skipped",
    ),
    pytest.param(
        service_obj(
            type="LoadBalancer",
            loadBalancerSourceRanges=["10.0.0.1", "10.0.0.0/255.0.0.0"],
            status=LB_VIP,
        ),
        lambda svc: svc.IPFilters,
        (),
        ["spec.loadBalancerSourceRanges[0]: invalid CIDR '10.0.0.1'",
         "spec.loadBalancerSourceRanges[1]: invalid CIDR '10.0.0.0/255.0.0.0'",
         "spec.loadBalancerSourceRanges: no valid range is left"],
        id="no_range_left_filters_nothing_as_kube_proxy",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("obj", "field", "expected", "warned"), LENIENT_SERVICE_CASES)
def test_stored_service_ips_are_read_leniently_as_kube_proxy_reads_them(
    caplog: pytest.LogCaptureFixture,
    obj: k8s.Service,
    field: Callable[[Service], object],
    expected: object,
    warned: list[str],
) -> None:
    with caplog.at_level("WARNING", logger="kpng.model.converting"):
        converted = service_from_k8s(obj)
    assert converted is not None
    assert field(converted) == expected
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == len(warned), messages
    for message, detail in zip(messages, warned, strict=True):
        assert message.startswith(f"Service ns1/web: {detail}")


def test_service_without_name_raises_naming_kind_and_namespace() -> None:
    with pytest.raises(InvalidObject) as info:
        service_from_k8s(service_obj(name=""))
    assert (info.value.kind, info.value.namespace, info.value.name) == ("Service", "ns1", "")
    assert "Service" in str(info.value)
    assert "ns1" in str(info.value)
    assert "name" in info.value.reason


INVALID_SLICE_CASES = [
    pytest.param(
        slice_obj(ports=[{"name": "http", "port": 65536}]), "65536", id="slice_port_out_of_range"
    ),
    pytest.param(
        slice_obj(ports=[{"name": "http", "protocol": "ICMP", "port": 8080}]),
        "ICMP",
        id="slice_port_unknown_protocol",
    ),
    pytest.param(slice_obj(address_type="IPv5"), "IPv5", id="unknown_address_type"),
    pytest.param(slice_obj(name=""), "name", id="slice_without_name"),
]


@pytest.mark.parametrize(("obj", "detail"), INVALID_SLICE_CASES)
def test_invalid_slice_raises_naming_the_object(obj: k8s.EndpointSlice, detail: str) -> None:
    with pytest.raises(InvalidObject) as info:
        slice_from_k8s(obj)
    assert info.value.kind == "EndpointSlice"
    assert info.value.namespace == "ns1"
    assert info.value.name == obj.metadata.name
    assert "EndpointSlice" in str(info.value)
    assert f"ns1/{obj.metadata.name}" in str(info.value)
    assert detail in str(info.value)


@pytest.mark.parametrize(
    ("address_type", "good", "bad"),
    [
        pytest.param("IPv4", ["10.1.0.1", "10.1.0.3"], "10.1.0.256", id="v4"),
        pytest.param("IPv6", ["fd00::1", "fd00::3"], "fd00::1::2", id="v6"),
    ],
)
def test_a_bad_endpoint_address_drops_that_endpoint_not_the_slice(
    caplog: pytest.LogCaptureFixture, address_type: str, good: list[str], bad: str
) -> None:
    obj = slice_obj(
        address_type=address_type,
        endpoints=[{"addresses": [good[0]]}, {"addresses": [bad]}, {"addresses": [good[1]]}],
    )
    with caplog.at_level("WARNING", logger="kpng.model.converting"):
        result = slice_from_k8s(obj)
    assert result is not None
    assert [ep.ip for ep in result.endpoints] == good
    assert result.ports == (SlicePort(name="http", protocol="TCP", port=8080),)
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    message = record.getMessage()
    assert message.startswith("EndpointSlice ns1/web-abcde: endpoints[1]")
    assert repr(bad) in message


def test_node_without_name_raises() -> None:
    with pytest.raises(InvalidObject) as info:
        node_from_k8s(node_obj(""))
    assert info.value.kind == "Node"
    assert "Node" in str(info.value)


def test_node_addresses_and_pod_cidrs_are_kept_canonical() -> None:
    node = msgspec.convert(
        {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {"name": "n1"},
            "spec": {"podCIDRs": ["10.244.1.7/24", "fd00:0:0:1::/64"]},
            "status": {
                "addresses": [
                    {"type": "Hostname", "address": "n1"},
                    {"type": "InternalIP", "address": "fd00:0::5"},
                    {"type": "ExternalIP", "address": "192.0.2.1"},
                ]
            },
        },
        k8s.Node,
    )
    converted = node_from_k8s(node)
    assert converted.PodCIDRs == ("10.244.1.0/24", "fd00:0:0:1::/64")
    assert [(a.Type, a.Address) for a in converted.Addresses] == [
        ("InternalIP", "fd00::5"),
        ("ExternalIP", "192.0.2.1"),
    ]


@pytest.mark.parametrize(
    ("kind", "body", "message"),
    [
        ("Node", {"status": {"addresses": [{"type": "InternalIP", "address": "10.0.0"}]}},
         "Node n1: invalid IP address '10.0.0'"),
        ("Node", {"spec": {"podCIDRs": ["10.244.1.0/33"]}}, "Node n1: invalid CIDR"),
        ("ServiceCIDR", {"spec": {"cidrs": ["10.96.0.0/12", "nope"]}},
         "ServiceCIDR n1: invalid CIDR 'nope'"),
    ],
)  # fmt: skip
def test_bad_node_and_service_cidr_addresses_are_reported_by_name(
    kind: str, body: dict[str, Any], message: str
) -> None:
    api = {"Node": "v1", "ServiceCIDR": "networking.k8s.io/v1"}[kind]
    raw = {"kind": kind, "apiVersion": api, "metadata": {"name": "n1"}, **body}

    def convert() -> object:
        if kind == "Node":
            return node_from_k8s(msgspec.convert(raw, k8s.Node))
        return service_cidr_from_k8s(msgspec.convert(raw, k8s.ServiceCIDR))

    with pytest.raises(InvalidObject) as raised:
        convert()
    assert message in str(raised.value)


# --- names, as the API server's validation takes them

LONGEST_LABEL = "a" * 63
LONGEST_SUBDOMAIN = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters
assert len(LONGEST_SUBDOMAIN) == 253

# (name, valid as a Service's (DNS-1035 label), as a slice's / node's / ServiceCIDR's
# (DNS-1123 subdomain))
NAME_CASES = [
    pytest.param("web", True, True, id="plain"),
    pytest.param("web-2", True, True, id="with-dash-and-digit"),
    pytest.param("a", True, True, id="one-letter"),
    pytest.param(LONGEST_LABEL, True, True, id="63-characters"),
    pytest.param("a" * 64, False, True, id="64-characters"),
    pytest.param("2web", False, True, id="starts-with-a-digit"),
    pytest.param("web.shop", False, True, id="dotted"),
    pytest.param(LONGEST_SUBDOMAIN, False, True, id="253-characters-dotted"),
    pytest.param(LONGEST_SUBDOMAIN + "a", False, False, id="254-characters-dotted"),
    pytest.param("Bad_Name!", False, False, id="upper-case-underscore-bang"),
    pytest.param("Web", False, False, id="upper-case"),
    pytest.param("web-", False, False, id="ends-with-a-dash"),
    pytest.param("-web", False, False, id="starts-with-a-dash"),
    pytest.param("web..shop", False, False, id="empty-dotted-part"),
    pytest.param("web.-shop", False, False, id="dotted-part-starts-with-a-dash"),
    pytest.param(".web", False, False, id="starts-with-a-dot"),
    pytest.param("web shop", False, False, id="space"),
    pytest.param("web\n", False, False, id="trailing-newline"),
    pytest.param("wéb", False, False, id="non-ascii"),
]


def _raised(convert: Callable[[], object]) -> InvalidObject | None:
    try:
        convert()
    except InvalidObject as exc:
        return exc
    return None


@pytest.mark.parametrize(("name", "service_ok", "subdomain_ok"), NAME_CASES)
def test_object_names_are_checked_as_the_api_server_does(
    name: str, service_ok: bool, subdomain_ok: bool
) -> None:
    def cidr() -> object:
        raw = {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR"}
        return service_cidr_from_k8s(
            msgspec.convert({**raw, "metadata": {"name": name}}, k8s.ServiceCIDR)
        )

    cases: list[tuple[str, str, bool, Callable[[], object]]] = [
        ("Service", "ns1", service_ok, lambda: service_from_k8s(service_obj(name=name))),
        ("EndpointSlice", "ns1", subdomain_ok, lambda: slice_from_k8s(slice_obj(name=name))),
        ("Node", "", subdomain_ok, lambda: node_from_k8s(node_obj(name))),
        ("ServiceCIDR", "", subdomain_ok, cidr),
    ]
    for kind, namespace, ok, convert in cases:
        error = _raised(convert)
        if ok:
            assert error is None, (kind, error)
            continue
        assert error is not None, kind
        assert (error.kind, error.namespace, error.name) == (kind, namespace, name)
        assert error.reason.startswith(f"metadata.name: {name!r} is not a DNS-"), error.reason


NAMESPACE_CASES = [
    pytest.param("ns1", True, id="plain"),
    pytest.param("1ns", True, id="starts-with-a-digit"),
    pytest.param(LONGEST_LABEL, True, id="63-characters"),
    pytest.param("a" * 64, False, id="64-characters"),
    pytest.param("kube.system", False, id="dotted"),
    pytest.param("Shop", False, id="upper-case"),
    pytest.param("shop_1", False, id="underscore"),
    pytest.param("shop-", False, id="ends-with-a-dash"),
]


@pytest.mark.parametrize(("namespace", "ok"), NAMESPACE_CASES)
def test_namespaces_are_checked_as_the_api_server_does(namespace: str, ok: bool) -> None:
    for kind, convert in [
        ("Service", lambda: service_from_k8s(service_obj(namespace=namespace))),
        ("EndpointSlice", lambda: slice_from_k8s(slice_obj(namespace=namespace))),
    ]:
        error = _raised(convert)
        if ok:
            assert error is None, (kind, error)
            continue
        assert error is not None, kind
        assert (error.kind, error.namespace) == (kind, namespace)
        assert error.reason.startswith(f"metadata.namespace: {namespace!r} is not a DNS-1123 label")


def test_a_name_too_long_says_how_long() -> None:
    error = _raised(lambda: service_from_k8s(service_obj(name="a" * 64)))
    assert error is not None
    assert str(error) == (
        f"Service ns1/{'a' * 64}: metadata.name: {'a' * 64!r} is not a DNS-1035 label: "
        "64 characters, more than 63"
    )


def test_a_bad_name_is_refused_even_on_an_object_kpng_would_ignore() -> None:
    """The API server refuses it whatever its labels: no cluster holds it."""
    obj = service_obj(name="Bad_Name!", labels={PROXY_NAME_LABEL: "other"})
    assert _raised(lambda: service_from_k8s(obj)) is not None
