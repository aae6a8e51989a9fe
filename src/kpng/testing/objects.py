"""Kubernetes objects as the API server serves them (plain dicts): Services, EndpointSlices and
Nodes, for manifests, the conformance suite and the real-cluster harness alike."""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]


def service(
    name: str,
    namespace: str,
    *,
    ports: list[Obj] | None = None,
    labels: dict[str, str] | None = None,
    cluster_ip: str | None = None,
    type: str = "ClusterIP",
    **spec: Any,
) -> Obj:
    """A Service; without ``cluster_ip`` the API server allocates one."""
    body: Obj = {"type": type, "ports": ports or [{"name": "http", "port": 80, "protocol": "TCP"}]}
    if cluster_ip is not None:
        body["clusterIP"] = cluster_ip
    body.update(spec)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": body,
    }


def endpoint(
    address: str,
    *,
    node: str | None = None,
    ready: bool = True,
    zone: str | None = None,
    conditions: Obj | None = None,
    pod: str | None = None,
) -> Obj:
    """One endpoint of a slice; ``conditions`` replaces ``{"ready": ready}`` when given."""
    ep: Obj = {"addresses": [address], "conditions": conditions or {"ready": ready}}
    if node is not None:
        ep["nodeName"] = node
    if zone is not None:
        ep["zone"] = zone
    if pod is not None:
        ep["targetRef"] = {"kind": "Pod", "name": pod}
    return ep


def endpoint_slice(
    name: str,
    namespace: str,
    service_name: str,
    endpoints: list[Obj],
    *,
    ports: list[Obj] | None = None,
    labels: dict[str, str] | None = None,
    address_type: str = "IPv4",
) -> Obj:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name, **(labels or {})},
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def node(name: str, *, zone: str | None = None) -> Obj:
    labels = {"topology.kubernetes.io/zone": zone} if zone else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
