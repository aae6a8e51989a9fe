"""Manifest parsing: every format kpng reads, and every kind of bad input reported and skipped."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kpng.errors import InputError
from kpng.model.cluster import Slice
from kpng.model.converting import MAX_SLICE_ENDPOINTS
from kpng.model.messages import Node, Service
from kpng.sources.manifests import MAX_OBJECT_BYTES, Ignored, ItemMemo, parse


def _svc(name: str = "web", namespace: str = "shop", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"name": "http", "port": 80}], **spec},
    }


def _slice(name: str = "web-1", service: str = "web", address: str = "10.1.0.1") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": [address]}],
    }


NODE = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}


def _yaml(*docs: dict[str, Any]) -> bytes:
    # JSON is YAML; joined as a multi-document stream.
    return "\n---\n".join(json.dumps(d) for d in docs).encode()


def test_multi_document_yaml() -> None:
    parsed = parse(_yaml(_svc(), _slice(), NODE), filename="c.yaml")
    assert parsed.errors == []
    assert isinstance(parsed.objects[("Service", "shop", "web")], Service)
    assert isinstance(parsed.objects[("EndpointSlice", "shop", "web-1")], Slice)
    assert isinstance(parsed.objects[("Node", "", "n1")], Node)


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "yaml"])
def test_kind_list_as_kubectl_prints_it(as_json: bool) -> None:
    doc = {"apiVersion": "v1", "kind": "List", "items": [_svc(), _slice(), NODE]}
    data = json.dumps(doc, indent=4).encode() if as_json else _yaml(doc)
    parsed = parse(data, filename="list")
    assert parsed.errors == []
    assert len(parsed.objects) == 3


def test_single_json_object() -> None:
    parsed = parse(json.dumps(_svc()).encode(), filename="svc.json")
    assert list(parsed.objects) == [("Service", "shop", "web")]


def test_missing_namespace_means_default() -> None:
    doc = _svc()
    del doc["metadata"]["namespace"]
    parsed = parse(_yaml(doc), filename="c.yaml")
    assert ("Service", "default", "web") in parsed.objects


def test_ignored_objects_are_known_with_why() -> None:
    labelled = _svc(name="other")
    labelled["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": "x"}
    parsed = parse(_yaml(labelled), filename="c.yaml")
    assert parsed.objects == {
        ("Service", "shop", "other"): Ignored(
            "it belongs to another proxy: labelled service.kubernetes.io/service-proxy-name=x"
        )
    }
    assert parsed.errors == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"kind: Service\nmetadata: {name: [unclosed\n", "invalid YAML"),
        (b'{"kind": "Service", "metadata": ', "invalid JSON"),
    ],
    ids=["malformed-yaml", "malformed-json"],
)
def test_unparseable_file_raises_input_error_naming_the_file(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match=f"broken.yaml: {message}"):
        parse(data, filename="broken.yaml")


def _bad_port(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"]["ports"][0]["port"] = 70000
    return doc


def _no_port_number(doc: dict[str, Any]) -> dict[str, Any]:
    del doc["spec"]["ports"][0]["port"]
    return doc


def _bad_protocol(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"]["ports"][0]["protocol"] = "ICMP"
    return doc


def _wrong_type(doc: dict[str, Any]) -> dict[str, Any]:
    doc["spec"]["ports"][0]["port"] = "eighty"
    return doc


BAD_OBJECTS = [
    pytest.param(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": "shop"}, "spec": {}},
        "Service shop/<no name>",
        "metadata.name is missing",
        id="object-without-name",
    ),
    pytest.param(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "shop"}},
        "Pod shop/p",
        "unsupported kind 'Pod'",
        id="unknown-kind",
    ),
    pytest.param(
        _svc(clusterIP="10.96.0.300"), "Service shop/web", "invalid IP address", id="invalid-ip"
    ),
    pytest.param(
        _svc(externalIPs=["not-an-ip"]), "Service shop/web", "spec.externalIPs", id="external-ip"
    ),
    pytest.param(
        _svc(loadBalancerSourceRanges=["10.0.0.0/33"]),
        "Service shop/web",
        "invalid CIDR",
        id="invalid-cidr",
    ),
    pytest.param(_bad_port(_svc()), "Service shop/web", "out of range", id="port-out-of-range"),
    pytest.param(
        _no_port_number(_svc()), "Service shop/web", "missing port number", id="port-without-number"
    ),
    pytest.param(
        _bad_protocol(_svc()), "Service shop/web", "unknown protocol", id="unknown-protocol"
    ),
    pytest.param(_wrong_type(_svc()), "Service shop/web", "Expected `int", id="mistyped-field"),
    pytest.param(
        _svc(name="Bad_Name!"),
        "Service shop/Bad_Name!",
        "metadata.name: 'Bad_Name!' is not a DNS-1035 label",
        id="service-name-the-api-server-refuses",
    ),
    pytest.param(
        _svc(namespace="Shop"),
        "Service Shop/web",
        "metadata.namespace: 'Shop' is not a DNS-1123 label",
        id="namespace-the-api-server-refuses",
    ),
    pytest.param(
        _slice(name="web_1"),
        "EndpointSlice shop/web_1",
        "metadata.name: 'web_1' is not a DNS-1123 subdomain",
        id="slice-name-the-api-server-refuses",
    ),
]


@pytest.mark.parametrize(("bad", "ident", "reason"), BAD_OBJECTS)
def test_bad_object_is_reported_with_file_kind_namespace_name_and_skipped(
    bad: dict[str, Any], ident: str, reason: str
) -> None:
    good = _svc(name="good")
    parsed = parse(_yaml(good, bad, NODE), filename="cluster.yaml")
    assert len(parsed.errors) == 1
    error = parsed.errors[0]
    assert error.startswith("cluster.yaml: document 1: ")
    assert ident in error
    assert reason in error
    assert error.endswith("skipped")
    # everything else is still there
    assert ("Service", "shop", "good") in parsed.objects
    assert ("Node", "", "n1") in parsed.objects
    assert len(parsed.objects) == 2


def test_a_bad_endpoint_address_costs_that_endpoint_not_its_slice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = _slice()
    bad["endpoints"] = [{"addresses": ["10.1.0.999"]}, {"addresses": ["10.1.0.2"]}]
    with caplog.at_level("WARNING"):
        parsed = parse(_yaml(_svc(), bad), filename="cluster.yaml")
    assert parsed.errors == []
    model = parsed.objects["EndpointSlice", "shop", "web-1"]
    assert isinstance(model, Slice)
    assert [ep.ip for ep in model.endpoints] == ["10.1.0.2"]
    assert any(
        "EndpointSlice shop/web-1" in r.getMessage() and "'10.1.0.999'" in r.getMessage()
        for r in caplog.records
    )


def test_bad_item_in_a_list_names_its_index() -> None:
    doc = {"kind": "List", "items": [_svc(), _svc(name="bad", clusterIP="x")]}
    parsed = parse(json.dumps(doc).encode(), filename="l.json")
    assert parsed.errors == [
        "l.json: items[1]: Service shop/bad: spec.clusterIPs: invalid IP address 'x'; skipped"
    ]
    assert list(parsed.objects) == [("Service", "shop", "web")]


def test_duplicate_object_keeps_the_first_and_says_so() -> None:
    parsed = parse(_yaml(_svc(), _svc(clusterIP="10.96.0.2")), filename="d.yaml")
    assert parsed.errors == [
        "d.yaml: document 1: Service shop/web: duplicate object; the first one is kept"
    ]
    service = parsed.objects[("Service", "shop", "web")]
    assert isinstance(service, Service)
    assert service.IPs is not None
    assert service.IPs.ClusterIPs is not None
    assert service.IPs.ClusterIPs.V4 == ("10.96.0.1",)


def test_yaml_timestamps_do_not_break_decoding() -> None:
    data = (
        b"apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\n"
        b"  creationTimestamp: 2024-01-01T00:00:00Z\n  labels: {built: 2024-01-01}\n"
    )
    parsed = parse(data, filename="n.yaml")
    assert parsed.errors == []
    node = parsed.objects[("Node", "", "n1")]
    assert isinstance(node, Node)
    assert node.Labels == {"built": "2024-01-01"}


# --- a JSON List parsed again with a memo: unchanged items are not decoded again


def _list(*items: dict[str, Any]) -> bytes:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)}).encode()


def test_a_memo_reuses_unchanged_items_and_gives_what_a_full_parse_gives() -> None:
    memo = ItemMemo()
    bad = _svc("bad", ports=[{"port": 70000}])
    first = parse(_list(_svc(), _slice(), bad, NODE), filename="f", memo=memo)
    second_data = _list(_svc(), _slice(address="10.1.0.2"), bad, NODE, _svc())
    second = parse(second_data, filename="f", memo=memo)
    assert second == parse(second_data, filename="f")  # duplicates and errors included
    assert second.errors == [
        "f: items[2]: Service shop/bad: spec.ports[0]: port 70000 out of range; skipped",
        "f: items[4]: Service shop/web: duplicate object; the first one is kept",
    ]
    web, sl, node = (
        ("Service", "shop", "web"),
        ("EndpointSlice", "shop", "web-1"),
        ("Node", "", "n1"),
    )
    assert second.objects[web] is first.objects[web]  # the same bytes: not decoded again
    assert second.objects[node] is first.objects[node]
    assert second.objects[sl] is not first.objects[sl]
    # Items gone from the file are forgotten: the memo holds what the last parse saw.
    third = parse(_list(NODE), filename="f", memo=memo)
    assert third.objects[node] is first.objects[node]
    assert len(memo._now) == 1


def _oversized() -> list[dict[str, Any]]:
    """A Service larger than etcd stores, and a slice of more endpoints than Kubernetes allows."""
    huge = _svc(name="huge")
    huge["metadata"]["annotations"] = {"note": "x" * MAX_OBJECT_BYTES}
    crowded = _slice(name="crowded-1", service="crowded")
    crowded["endpoints"] = [
        {"addresses": [f"10.2.{i // 250}.{i % 250 + 1}"]} for i in range(MAX_SLICE_ENDPOINTS + 1)
    ]
    return [huge, crowded]


@pytest.mark.parametrize("shape", ["yaml", "json list"])
def test_an_object_above_kubernetes_bounds_is_refused_by_name_and_the_rest_served(
    shape: str,
) -> None:
    """Bounds a Kubernetes cluster keeps and a manifest need not: 1.5 MiB per object (etcd's
    request limit) and 1000 endpoints per EndpointSlice (the API server's validation)."""
    docs = [_svc(), *_oversized(), _slice(), NODE]
    if shape == "yaml":
        parsed = parse(_yaml(*docs), filename="c.yaml")
    else:
        parsed = parse(json.dumps({"kind": "List", "items": docs}).encode(), filename="c.json")
    assert len(parsed.errors) == 2, parsed.errors
    too_large, too_many = parsed.errors
    assert "Service shop/huge: " in too_large
    assert f"larger than any object Kubernetes stores ({MAX_OBJECT_BYTES} bytes" in too_large
    assert "EndpointSlice shop/crowded-1: endpoints: 1001 endpoints, more than Kubernetes " in (
        too_many
    )
    assert all(e.endswith("; skipped") for e in parsed.errors)
    assert set(parsed.objects) == {
        ("Service", "shop", "web"),
        ("EndpointSlice", "shop", "web-1"),
        ("Node", "", "n1"),
    }


def test_a_slice_of_exactly_1000_endpoints_is_served() -> None:
    full = _slice()
    full["endpoints"] = [
        {"addresses": [f"10.2.{i // 250}.{i % 250 + 1}"]} for i in range(MAX_SLICE_ENDPOINTS)
    ]
    parsed = parse(_yaml(_svc(), full), filename="c.yaml")
    assert parsed.errors == []
    model = parsed.objects["EndpointSlice", "shop", "web-1"]
    assert isinstance(model, Slice)
    assert len(model.endpoints) == MAX_SLICE_ENDPOINTS


def test_a_dump_s_objects_are_held_to_the_api_server_s_names() -> None:
    """A dump holds model objects, converted by no one: their names are checked as they are
    read, so no source brings a name the backends cannot use."""
    from kpng.model import dumping
    from kpng.model.messages import ServiceIPs

    def service(namespace: str, name: str) -> Service:
        return Service(Namespace=namespace, Name=name, Type="ClusterIP", IPs=ServiceIPs())

    good, bad = service("shop", "web"), service("shop", "Bad_Name!")
    data = dumping.dump(
        revision=1,
        services={("shop", "web"): good, ("shop", "Bad_Name!"): bad},
        slices={},
        nodes={"n_1": Node(Name="n_1")},
        service_cidrs={},
    )
    parsed = parse(data, filename="state.json")
    assert list(parsed.objects) == [("Service", "shop", "web")]
    assert sorted(parsed.errors) == [
        "state.json: Node n_1: metadata.name: 'n_1' is not a DNS-1123 subdomain: lowercase "
        "letters, digits, '-' and '.', each '.'-separated part starting and ending with a "
        "letter or digit; skipped",
        "state.json: Service shop/Bad_Name!: metadata.name: 'Bad_Name!' is not a DNS-1035 "
        "label: lowercase letters, digits and '-', starting with a letter, ending with a "
        "letter or digit; skipped",
    ]
