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
    # A bad externalIP or source range is no longer one: kube-proxy skips that entry only
    # (tests/pure/test_converting.py).
    pytest.param(
        _svc(sessionAffinity="Cookie"),
        "Service shop/web",
        "spec.sessionAffinity",
        id="unknown-session-affinity",
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


# --- bounds: numbers, nesting and YAML aliases cost their object or their file, never kpng


def _port_text(doc: dict[str, Any], text: str) -> str:
    """``doc`` as JSON with its first port written as ``text`` (a number json.dumps won't write)."""
    return json.dumps(doc).replace('"port": 80', f'"port": {text}', 1)


_LONG = "Expected `int | null`, got an integer of more than 100 characters"
_INT32 = "Expected `int` <= 2147483647"


@pytest.mark.parametrize(
    ("shape", "number", "reason"),
    [
        ("json list", "1e400", "Number out of range"),
        ("json list", "-1e400", "Number out of range"),
        ("yaml", "1.0e+400", "Expected `int | null`, got `float`"),
        ("yaml", ".inf", "Expected `int | null`, got `float`"),
        ("yaml", "1e400", "Expected `int | null`, got `str`"),  # (YAML 1.1: no float)
        ("json list", "1" + "0" * 5000, "Integer value out of range"),
        ("yaml", "1" + "0" * 5000, _LONG),
        ("yaml", "0x" + "f" * 5000, _LONG),
        ("json list", "1" + "0" * 30, _INT32),
        ("yaml", "1" + "0" * 30, _INT32),
        ("json list", "2147483648", _INT32),
        ("yaml", "2147483648", _INT32),
    ],
    ids=[
        "json-1e400",
        "json-minus-1e400",
        "yaml-1e400-float",
        "yaml-infinity",
        "yaml-1e400-string",
        "json-5000-digits",
        "yaml-5000-digits",
        "yaml-5000-hex-digits",
        "json-beyond-int64",
        "yaml-beyond-int64",
        "json-beyond-int32",
        "yaml-beyond-int32",
    ],
)
def test_a_number_out_of_range_costs_its_object_named_with_its_path(
    shape: str, number: str, reason: str
) -> None:
    """Kubernetes' numbers kpng reads are int32: a wider one, an infinite one, or one that no
    integer type holds is reported with the object and the field, and the rest is served."""
    bad = _port_text(_svc("bad"), number)
    if shape == "json list":
        items = ", ".join([json.dumps(_svc()), bad, json.dumps(NODE)])
        data = ('{"kind": "List", "items": [' + items + "]}").encode()
        where = "c: items[1]"
    else:
        data = "\n---\n".join([json.dumps(_svc()), bad, json.dumps(NODE)]).encode()
        where = "c: document 1"
    parsed = parse(data, filename="c")
    assert parsed.errors == [
        f"{where}: Service shop/bad: {reason} - at `$.spec.ports[0].port`; skipped"
    ]
    assert set(parsed.objects) == {("Service", "shop", "web"), ("Node", "", "n1")}


@pytest.mark.parametrize("shape", ["json", "yaml"])
def test_a_huge_number_in_a_field_kpng_does_not_read_costs_nothing(shape: str) -> None:
    doc = _svc()
    doc["spec"]["replicas"] = 80  # a field of no Service: skipped unread
    text = _port_text(doc, "80").replace('"replicas": 80', '"replicas": 1' + "0" * 5000)
    if shape == "json":
        text = text.replace('"replicas": 1', '"replicas": 1e400, "other": 1')
    parsed = parse(text.encode(), filename="c")
    assert parsed.errors == []
    assert list(parsed.objects) == [("Service", "shop", "web")]


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(_port_text(_svc(), _nested(5000)), "nested too deeply", id="json-object"),
        pytest.param(
            '{"kind": "List", "items": [' + _nested(5000) + "]}",
            "nested too deeply",
            id="json-list",
        ),
        pytest.param(
            '{"kind": "GlobalState", "x": ' + _nested(5000) + "}",
            "nested too deeply",
            id="json-dump",
        ),
        pytest.param("kind: Service\nx: " + _nested(5000), "invalid YAML", id="yaml-flow"),
        pytest.param(
            "".join("  " * i + "-\n" for i in range(5000)), "invalid YAML", id="yaml-block"
        ),
        # Within libyaml's 1000 levels, past what msgspec encodes.
        pytest.param("kind: GlobalState\nx: " + _nested(998), "nested too deeply", id="yaml-dump"),
    ],
)
def test_nesting_past_the_parsers_limits_costs_the_file(data: str, message: str) -> None:
    with pytest.raises(InputError, match=f"^c: .*{message}"):
        parse(data.encode(), filename="c")


def test_nesting_that_only_one_yaml_object_holds_costs_that_object() -> None:
    deep = "kind: Service\nmetadata: {name: deep, namespace: shop}\nx: " + _nested(998)
    parsed = parse(_yaml(_svc()) + b"\n---\n" + deep.encode(), filename="c")
    assert parsed.errors == ["c: document 1: Service shop/deep: nested too deeply; skipped"]
    assert list(parsed.objects) == [("Service", "shop", "web")]


def test_yaml_aliases_that_share_a_few_nodes_are_read() -> None:
    data = b"""apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop, labels: &labels {app: web}, annotations: *labels}
spec:
  clusterIP: 10.96.0.1
  ports: [&http {name: http, port: 80}, {<<: *http, name: alt, port: 8080}]
"""
    parsed = parse(data, filename="c.yaml")
    assert parsed.errors == []
    service = parsed.objects["Service", "shop", "web"]
    assert isinstance(service, Service)
    assert [p.Port for p in service.Ports] == [80, 8080]
    assert service.Labels == {"app": "web"}


@pytest.mark.parametrize(
    "doc", ["x: &a [*a]", "x: &a {y: *a}", "x: &a [[[*a]]]"], ids=["list", "map", "deeper"]
)
def test_a_yaml_alias_that_holds_itself_costs_the_file(doc: str) -> None:
    data = f"kind: Service\nmetadata: {{name: web}}\n{doc}\n".encode()
    with pytest.raises(InputError, match=r"^c.yaml: invalid YAML: an alias holds itself, line 3$"):
        parse(data, filename="c.yaml")


_ALIAS_BOMB = """\
import sys

from kpng.errors import InputError
from kpng.sources.manifests import parse

lines = ["apiVersion: v1", "kind: Service", "metadata: {name: web, namespace: shop}", "spec:",
         "  clusterIP: 10.96.0.1", '  lol0: &l0 "lol"']
for i in range(1, 10):
    lines.append(f"  lol{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
data = ("\\n".join(lines) + "\\n").encode()
try:
    parse(data, filename="bomb.yaml")
except InputError as exc:
    print(exc)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so it would count the forking
# pytest process's own size.
with open("/proc/self/status") as status:
    peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print(len(data), peak_kib // 1024)
"""


def test_a_yaml_alias_bomb_is_refused_in_one_line_within_little_memory() -> None:
    """A billion laughs: 9 levels of anchors, each naming the one below 10 times, 10^9 nodes
    expanded (6 GiB as JSON) from 700 bytes. Run under a 1 GiB address-space limit, so that a
    regression fails this test rather than the machine."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = subprocess.run(
        [sys.executable, "-c", _ALIAS_BOMB],
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    error, figures = done.stdout.splitlines()
    assert error == (
        "bomb.yaml: invalid YAML: its aliases expand it from 35 to 1234567925 nodes, more than "
        "100000 added (a YAML alias bomb?)"
    )
    size, max_rss_mib = map(int, figures.split())
    assert size < 1000
    assert max_rss_mib < 200
