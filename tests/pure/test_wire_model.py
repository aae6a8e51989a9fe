"""The msgspec model and the .proto files describe the same messages, and encode the same JSON."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from kpng.api import globalv1_pb2, localv1_pb2
from kpng.api.codec import PAIRS
from kpng.model import messages

GO_KPNG_FIELDS = {
    "localv1.Service": {
        "Namespace": 1, "Name": 2, "Type": 3, "IPs": 4, "MapIP": 5, "Ports": 6,
        "ExternalTrafficToLocal": 7, "Labels": 8, "Annotations": 9, "IPFilters": 10,
        "ClientIP": 11, "InternalTrafficToLocal": 12, "HealthCheckNodePort": 13,
    },
    "localv1.ServiceIPs": {"ClusterIPs": 1, "ExternalIPs": 2, "Headless": 3, "LoadBalancerIPs": 4},
    "localv1.IPSet": {"V4": 1, "V6": 2},
    "localv1.IPFilter": {"TargetIPs": 1, "SourceRanges": 2},
    "localv1.PortMapping": {
        "Name": 1, "Protocol": 2, "Port": 3, "NodePort": 4, "TargetPort": 5, "TargetPortName": 6,
    },
    "localv1.ClientIPAffinity": {"TimeoutSeconds": 1},
    "localv1.Endpoint": {"Hostname": 1, "IPs": 2, "Local": 3, "PortOverrides": 4, "Scopes": 5},
    "localv1.PortName": {"Name": 1, "Port": 2},
    "localv1.EndpointScopes": {"Internal": 1, "External": 2},
    "localv1.OpItem": {"Sync": 1, "Set": 2, "Delete": 3, "Reset": 4},
    "localv1.Ref": {"Set": 1, "Path": 2},
    "localv1.Value": {"Ref": 1, "Bytes": 2},
    "localv1.WatchReq": {"NodeName": 1},
    "globalv1.ServiceInfo": {"Hash": 1, "Service": 2},
    "globalv1.EndpointInfo": {
        "Hash": 1, "Namespace": 2, "SourceName": 3, "ServiceName": 4, "Endpoint": 6,
        "Conditions": 7, "PodName": 8, "Topology": 9, "Hints": 10,
    },
    "globalv1.EndpointConditions": {"Ready": 1},
    "globalv1.TopologyInfo": {"Node": 1, "Zone": 2},
    "globalv1.TopologyHints": {"Zones": 1},
    "globalv1.NodeInfo": {"Hash": 1, "Node": 2},
    "globalv1.Node": {"Name": 1, "Labels": 2, "Annotations": 3, "Topology": 4},
}  # fmt: skip


def _descriptor(full_name: str) -> Descriptor:
    package, name = full_name.split(".")
    module = localv1_pb2 if package == "localv1" else globalv1_pb2
    descriptor: Descriptor = module.DESCRIPTOR.message_types_by_name[name]
    return descriptor


@pytest.mark.parametrize("full_name", sorted(GO_KPNG_FIELDS))
def test_go_kpng_fields_keep_their_names_and_numbers(full_name: str) -> None:
    descriptor = _descriptor(full_name)
    for name, number in GO_KPNG_FIELDS[full_name].items():
        assert descriptor.fields_by_name[name].number == number
    extensions = {f.name for f in descriptor.fields} - set(GO_KPNG_FIELDS[full_name])
    assert all(descriptor.fields_by_name[n].number >= 100 for n in extensions), extensions


def test_sets_enum_and_services_match_go_kpng() -> None:
    sets = localv1_pb2.DESCRIPTOR.enum_types_by_name["Set"]
    go_kpng_sets = {
        "UnknownSet": 0,
        "ServicesSet": 1,
        "EndpointsSet": 2,
        "GlobalServiceInfos": 10,
        "GlobalEndpointInfos": 11,
        "GlobalNodeInfos": 12,
    }
    numbers = {v.name: v.number for v in sets.values}
    assert {name: numbers.get(name) for name in go_kpng_sets} == go_kpng_sets
    # kpng's sets are numbered from 100: a Go KPNG consumer skips a Set of a kind it does not know
    assert all(n >= 100 for name, n in numbers.items() if name not in go_kpng_sets)
    protocols = localv1_pb2.DESCRIPTOR.enum_types_by_name["Protocol"]
    assert [(v.name, v.number) for v in protocols.values] == [
        ("UnknownProtocol", 0),
        ("TCP", 1),
        ("UDP", 2),
        ("SCTP", 3),
    ]
    for module, request in ((localv1_pb2, "WatchReq"), (globalv1_pb2, "GlobalWatchReq")):
        watch = module.DESCRIPTOR.services_by_name["Sets"].methods_by_name["Watch"]
        assert watch.input_type.name == request
        assert watch.output_type.full_name == "localv1.OpItem"
        assert watch.client_streaming
        assert watch.server_streaming


@pytest.mark.parametrize(
    ("struct", "proto"), PAIRS, ids=[proto.DESCRIPTOR.full_name for _, proto in PAIRS]
)
def test_struct_fields_are_the_proto_fields(
    struct: type[msgspec.Struct], proto: type[Message]
) -> None:
    fields = {f.name: f for f in proto.DESCRIPTOR.fields}
    assert set(struct.__struct_fields__) == set(fields)
    for name, field in fields.items():
        assert field.json_name == name  # so the Struct's JSON is the canonical mapping
        default = msgspec.structs.fields(struct)[struct.__struct_fields__.index(name)].default
        if _is_repeated(field) and not _is_map(field):
            assert default == ()
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not _is_map(field):
            assert default is None


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)


def _is_map(field: Any) -> bool:
    return field.message_type is not None and bool(field.message_type.GetOptions().map_entry)


FULL_SERVICE = messages.Service(
    Namespace="ns",
    Name="svc",
    Type="LoadBalancer",
    IPs=messages.ServiceIPs(
        ClusterIPs=messages.IPSet(V4=("10.0.0.1",), V6=("fd00::1",)),
        ExternalIPs=messages.IPSet(V4=("192.0.2.1",)),
        LoadBalancerIPs=messages.IPSet(V4=("192.0.2.9",)),
    ),
    Ports=(
        messages.PortMapping(
            Name="http",
            Protocol="TCP",
            Port=80,
            NodePort=30080,
            TargetPortName="web",
            UsableEndpoints=messages.IPFamilies(V4=True),
        ),
        messages.PortMapping(Name="dns", Protocol="UDP", Port=53, TargetPort=5353),
    ),
    ExternalTrafficToLocal=True,
    Labels={"app": "web"},
    Annotations={"a": "b"},
    IPFilters=(
        messages.IPFilter(
            TargetIPs=messages.IPSet(V4=("192.0.2.9",)), SourceRanges=("203.0.113.0/24",)
        ),
    ),
    ClientIP=messages.ClientIPAffinity(TimeoutSeconds=600),
    InternalTrafficToLocal=True,
    HealthCheckNodePort=32000,
    TrafficDistribution="PreferClose",
)
FULL_ENDPOINT = messages.Endpoint(
    Hostname="web-0",
    IPs=messages.IPSet(V6=("fd00::10",)),
    Local=True,
    PortOverrides=(messages.PortName(Name="http", Port=8080, Protocol="SCTP"),),
    Scopes=messages.EndpointScopes(Internal=True, Cluster=True),
    Ready=False,
    Serving=True,
    Terminating=True,
)


@pytest.mark.parametrize(
    ("value", "proto"),
    [
        (FULL_SERVICE, localv1_pb2.Service),
        (FULL_ENDPOINT, localv1_pb2.Endpoint),
        (messages.Service(Name="minimal"), localv1_pb2.Service),
    ],
    ids=["service", "endpoint", "minimal-service"],
)
def test_struct_json_is_protobuf_canonical_json(
    value: msgspec.Struct, proto: type[Message]
) -> None:
    encoded: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(value))
    message = json_format.ParseDict(encoded, proto())  # unknown names would fail here
    assert json_format.MessageToDict(message) == encoded
    # and the binary wire form carries every value through
    again = proto.FromString(message.SerializeToString())
    assert json_format.MessageToDict(again) == encoded


def test_dump_infos_are_globalv1_json() -> None:
    info = messages.EndpointInfo(
        Hash="18446744073709551615",
        Namespace="ns",
        SourceName="svc-abc",
        ServiceName="svc",
        Endpoint=FULL_ENDPOINT,
        Conditions=messages.EndpointConditions(Ready=True, Serving=True),
        PodName="web-0",
        Topology=messages.TopologyInfo(Node="n1", Zone="z1"),
        Hints=messages.TopologyHints(Zones=("z1",), Nodes=("n1",)),
    )
    encoded = msgspec.json.decode(msgspec.json.encode(info))
    message = json_format.ParseDict(encoded, globalv1_pb2.EndpointInfo())
    assert message.Hash == 2**64 - 1
    assert json_format.MessageToDict(message) == encoded


def test_every_model_message_has_its_codec() -> None:
    paired = {struct.__name__ for struct, _ in PAIRS}
    for module in (localv1_pb2, globalv1_pb2):
        for name in module.DESCRIPTOR.message_types_by_name:
            if hasattr(messages, name) and isinstance(getattr(messages, name), type):
                assert name in paired, name


@pytest.mark.parametrize(
    ("codec_name", "value"),
    [
        ("SERVICE", FULL_SERVICE),
        ("ENDPOINT", FULL_ENDPOINT),
        ("SERVICE_INFO", messages.ServiceInfo(Hash="42", Service=FULL_SERVICE)),
        (
            "NODE_INFO",
            messages.NodeInfo(
                Hash="7",
                Node=messages.Node(
                    Name="n1",
                    Labels={"a": "b"},
                    Topology=messages.TopologyInfo(Node="n1", Zone="z"),
                    Addresses=(
                        messages.NodeAddress(Type="InternalIP", Address="10.0.0.1"),
                        messages.NodeAddress(Type="InternalIP", Address="fd00::1"),
                    ),
                    PodCIDRs=("10.244.1.0/24", "fd00:10:244:1::/64"),
                ),
            ),
        ),
        (
            "NODE_FACTS",
            messages.NodeFacts(
                Addresses=(
                    messages.NodeAddress(Type="InternalIP", Address="10.0.0.1"),
                    messages.NodeAddress(Type="Hostname", Address="n1"),
                ),
                PodCIDRs=("10.244.1.0/24",),
                ServiceCIDRs=("10.96.0.0/16", "fd00:96::/112"),
                Draining=True,
            ),
        ),
        ("CHANGE_TRIGGERS", messages.ChangeTriggers(V4=(1764080000.25,), V6=(1.5, 2.0))),
    ],
)
def test_codec_round_trips_through_protobuf_bytes(codec_name: str, value: msgspec.Struct) -> None:
    from kpng.api import codec

    c = getattr(codec, codec_name)
    assert c.decode(c.encode(value)) == value
