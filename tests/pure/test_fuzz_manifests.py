"""Fuzzing the manifest and state-file readers (kpng.sources.manifests, kpng.model.gokpng) and
the converters under them (kpng.model.converting): whatever a file holds, reading it raises
nothing but ``InputError`` (the file as a whole is unreadable), every object that parsed can be
served (resolved for a node and encoded for the wire), and an object that is rejected changes
nothing of what the others give.

Bounded: see tests/pure/fuzzing.py (``KPNG_FUZZ_EXAMPLES`` runs a longer campaign).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kpng.api import codec
from kpng.errors import InputError
from kpng.model import dumping
from kpng.model.cluster import ServiceCIDR, Slice
from kpng.model.messages import Node, Service
from kpng.resolver.resolving import ClusterResolver
from kpng.sources import manifests
from tests.pure.fuzzing import (
    fuzz_settings,
    ips,
    json_values,
    k8s_objects,
    names,
    perturbed,
    ports,
    protocols,
)


def _parse(data: bytes) -> manifests.Parsed | None:
    """The parse of ``data``, None if the file as a whole is refused (InputError, named)."""
    refusal = None
    try:
        return manifests.parse(data, filename="fuzz.yaml")
    except InputError as exc:
        refusal = str(exc)
    assert refusal.startswith("fuzz.yaml: ")
    return None


def _assert_servable(parsed: manifests.Parsed) -> None:
    """What parsed can be served: the resolver takes it for any node, its results and the
    global infos encode for the wire, and the errors are one line each, naming the file."""
    assert all(e.startswith("fuzz.yaml") for e in parsed.errors)
    resolver = ClusterResolver()
    nodes = []
    for key, model in parsed.objects.items():
        if model is None or isinstance(model, manifests.Ignored):
            assert key[0] in ("Service", "EndpointSlice"), key
            continue
        assert manifests.model_key(model) == key
        if isinstance(model, Service):
            resolver.set_service((model.Namespace, model.Name), model)
            codec.SERVICE.encode(model)
        elif isinstance(model, Slice):
            resolver.set_slice((model.namespace, model.name), model)
            for info in dumping.endpoint_infos(model):
                codec.ENDPOINT_INFO.encode(info)
        elif isinstance(model, Node):
            resolver.set_node(model.Name, model)
            nodes.append(model.Name)
        else:
            assert isinstance(model, ServiceCIDR)
            codec.SERVICE_CIDR_INFO.encode(dumping.service_cidr_info(model))
    for node in [*nodes, "some-node"]:
        for service_key in list(resolver.services):
            resolved = resolver.resolve(service_key, node)
            assert resolved is not None
            codec.SERVICE.encode(resolved.service)
            for endpoint in resolved.endpoints:
                codec.ENDPOINT.encode(endpoint)
    # kpng's own dump (to-file) of what parsed reads back as the same objects. Slices travel
    # as their endpoints: one without any is not in a dump.
    served = {
        k: m
        for k, m in parsed.objects.items()
        if m is not None and not isinstance(m, manifests.Ignored)
    }
    slices = {(m.namespace, m.name): m for m in served.values() if isinstance(m, Slice)}
    data = dumping.dump(
        revision=1,
        services={(m.Namespace, m.Name): m for m in served.values() if isinstance(m, Service)},
        slices=slices,
        nodes={m.Name: m for m in served.values() if isinstance(m, Node)},
        service_cidrs={m.name: m for m in served.values() if isinstance(m, ServiceCIDR)},
    )
    again = _parse(data)
    assert again is not None
    assert again.errors == []
    expected = {k: m for k, m in served.items() if not isinstance(m, Slice) or m.endpoints}
    assert again.objects == expected


@fuzz_settings(300)
@given(st.binary(max_size=300))
def test_any_bytes_are_read_or_refused_as_a_whole(data: bytes) -> None:
    parsed = _parse(data)
    if parsed is not None:
        _assert_servable(parsed)


_yaml_fragments = st.lists(
    st.sampled_from(
        [
            "kind: Service\n", "kind: List\n", "items:\n", "- ", "  ", "metadata: {name: a}\n",
            "apiVersion: v1\n", "---\n", "&a [*a]\n", "!!python/object:os.system\n", "{", "}",
            "[", "]", ": ", "nodes:\n", "services:\n", "service: {name: s}\n", "endpoints:\n",
            "? [a]\n", "- *a\n", "&b {x: *b}\n", "1e999\n", "~\n", "\t", "\xff", "kind: KpngDump\n",
            "port: 1" + "0" * 5000 + "\n", "0x" + "f" * 300 + "\n", "1.0e+400\n", "[" * 1200,
            "&c [*a, *a, *a, *a, *a, *a, *a, *a]\n", "<<: *a\n", "&d [*c, *c, *c, *c, *c]\n",
        ]
    ),
    max_size=12,
).map("".join)  # fmt: skip


@fuzz_settings(300)
@given(_yaml_fragments)
def test_yaml_fragments_are_read_or_refused_as_a_whole(text: str) -> None:
    parsed = _parse(text.encode())
    if parsed is not None:
        _assert_servable(parsed)


def _documents(objects: list[Any], form: str) -> bytes:
    if form == "json-list":
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}).encode()
    if form == "yaml-list":
        return yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": objects}).encode()
    return yaml.safe_dump_all(objects).encode()


def _finite(value: Any) -> bool:
    """JSON has no NaN or infinity: a document holding one is not a JSON document."""
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


@fuzz_settings(200)
@given(
    st.lists(st.one_of(k8s_objects(), json_values), min_size=1, max_size=4),
    st.sampled_from(["json-list", "yaml-list", "yaml-documents"]),
)
def test_each_object_is_read_as_it_would_be_alone(objects: list[Any], form: str) -> None:
    """A rejected object changes nothing of what the others give: the objects of a file are
    those its items give each alone (the first of two with one key)."""
    if form == "json-list" and not _finite(objects):
        form = "yaml-list"
    parsed = _parse(_documents(objects, form))
    assert parsed is not None  # a document kpng wrote itself is always YAML or JSON
    _assert_servable(parsed)
    alone: dict[manifests.ObjectKey, Any] = {}
    for obj in objects:
        one = _parse(_documents([obj], form))
        assert one is not None
        for key, model in one.objects.items():
            alone.setdefault(key, model)
    assert parsed.objects == alone


_HOSTILE_JSON = [
    "1e400", "-1e400", "1" + "0" * 5000, "-9223372036854775809", "18446744073709551616",
    "[" * 5000 + "]" * 5000, "{\"a\": " * 3000 + "1" + "}" * 3000,
]  # fmt: skip
_HOSTILE_YAML = [
    *_HOSTILE_JSON, "0x" + "f" * 5000, "1.0e+400", ".inf", "&a [*a]",
    "&a [&b [&c [x, x, x], *c, *c, *c], *b, *b, *b]",
]  # fmt: skip


def _hostile(value: str, size: int) -> str:
    """``value``, or for a nesting, ``size`` levels of it (the limits lie near 1000)."""
    if value.startswith("[" * 10):
        return "[" * size + "]" * size
    return value


@fuzz_settings(100)
@given(
    st.lists(k8s_objects(), min_size=1, max_size=3),
    st.sampled_from(["json-list", "yaml-documents"]),
    st.data(),
)
def test_hostile_numbers_nesting_and_aliases_cost_at_most_their_object_or_file(
    objects: list[Any], form: str, data: st.DataObject
) -> None:
    """An out-of-range number, a nesting past the parsers' limits or a YAML alias (of itself, or
    expanding) put in any object: the file is refused as a whole, or what parsed is servable;
    nothing else is raised."""
    values = _HOSTILE_JSON if form == "json-list" else _HOSTILE_YAML
    hostile = _hostile(data.draw(st.sampled_from(values)), data.draw(st.integers(900, 5000)))
    i = data.draw(st.integers(0, len(objects) - 1))
    if isinstance(objects[i], dict):
        key = data.draw(st.sampled_from(["spec", "metadata", "x", "ports", "kind"]))
        objects[i][key] = "@hostile@"
    else:
        objects[i] = "@hostile@"
    if form == "json-list":
        text = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
    else:
        text = "\n---\n".join(json.dumps(o) for o in objects)
    parsed = _parse(text.replace('"@hostile@"', hostile).encode())
    if parsed is not None:
        _assert_servable(parsed)


# --- Go KPNG's state files


@st.composite
def _go_kpng_state(draw: st.DrawFn) -> Any:
    def ipset() -> dict[str, Any]:
        return {"v4": draw(st.lists(ips, max_size=2)), "v6": draw(st.lists(ips, max_size=2))}

    services = []
    for _ in range(draw(st.integers(0, 3))):
        service = {
            "namespace": draw(names),
            "name": draw(names),
            "type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer", ""])),
            "ips": {"clusterips": ipset(), "externalips": ipset()},
            "ports": [
                {"name": draw(names), "protocol": draw(st.integers(0, 5) | protocols),
                 "port": draw(ports), "targetport": draw(ports), "nodeport": draw(ports),
                 "targetportname": draw(names)}
                for _ in range(draw(st.integers(0, 2)))
            ],
            "sessionaffinity": {"clientip": {"timeoutseconds": draw(st.integers(-5, 90000))}},
            "labels": {"app": draw(names)},
            "hash": draw(st.integers(0, 2**64 - 1)),
        }  # fmt: skip
        endpoints = [
            {
                "endpoint": {"ips": ipset(), "hostname": draw(names)},
                "conditions": {"ready": draw(st.booleans())},
                "topology": draw(
                    st.sampled_from(
                        [{"node": "n1", "zone": "z"}, {"kubernetes.io/hostname": "n2"}, {}]
                    )
                ),
                "nodename": draw(names),
                "podname": draw(names),
                "hints": {"zones": draw(st.lists(names, max_size=2))},
            }
            for _ in range(draw(st.integers(0, 3)))
        ]
        services.append({"service": service, "endpoints": endpoints})
    nodes = [
        {"name": draw(names), "labels": {"topology.kubernetes.io/zone": draw(names)},
         "topology": {"node": draw(names), "zone": draw(names)}}
        for _ in range(draw(st.integers(0, 2)))
    ]  # fmt: skip
    return perturbed({"nodes": nodes, "services": services}, draw)


@fuzz_settings(300)
@given(_go_kpng_state())
def test_go_kpng_state_files_are_read_or_reported(state: Any) -> None:
    parsed = _parse(yaml.safe_dump(state).encode())
    if parsed is not None:
        _assert_servable(parsed)


def test_a_dump_of_nothing_is_empty() -> None:
    """The servable check's own footing: an empty dump reads back as no objects."""
    data = dumping.dump(revision=1, services={}, slices={}, nodes={}, service_cidrs={})
    parsed = _parse(data)
    assert parsed is not None
    assert (parsed.objects, parsed.errors) == ({}, [])
    assert msgspec.json.decode(data)["kind"] == dumping.KIND
