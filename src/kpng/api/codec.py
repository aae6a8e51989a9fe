"""The model's msgspec Structs to protobuf wire bytes and back, and the framing of watch ops.

The Structs mirror the proto messages field for field (``tests/pure/test_wire_model.py``), so one
generic codec per message type, planned once from the descriptors, converts either way. Ops are
framed by hand: an OpItem or OpBatch is a few length-delimited fields around a payload that is
encoded once and shared by every stream that sends it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import msgspec
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from kpng.api import globalv1_pb2, localv1_pb2
from kpng.errors import WireError
from kpng.model import messages

S = TypeVar("S", bound=msgspec.Struct)

_MESSAGE = FieldDescriptor.TYPE_MESSAGE
_ENUM = FieldDescriptor.TYPE_ENUM
_UINT64 = FieldDescriptor.TYPE_UINT64


class Codec(Generic[S]):
    """Converts one Struct type to its protobuf message and back."""

    def __init__(self, struct: type[S], proto: type[Message], subcodecs: dict[str, Codec[Any]]):
        self.struct = struct
        self.proto = proto
        descriptor: Any = proto.DESCRIPTOR  # upb's and the pure-Python descriptor types differ
        defaults = {f.name: f.default for f in msgspec.structs.fields(struct)}
        self._to: list[tuple[str, Callable[[Any], Any], Any]] = []
        self._from: list[tuple[str, Callable[[Any], Any], bool]] = []
        field: Any
        for field in descriptor.fields:
            name = field.name
            is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
            to: Callable[[Any], Any]
            back: Callable[[Any], Any]
            presence = False
            if is_map:
                to, back = _same, dict
            elif field.type == _MESSAGE:
                sub = subcodecs[field.message_type.full_name]
                if field.is_repeated:
                    to = _each(sub.to_proto)
                    back = _each(sub.from_proto)
                else:
                    to, back, presence = sub.to_proto, sub.from_proto, True
            elif field.type == _ENUM:
                names = {v.number: v.name for v in field.enum_type.values}
                names[0] = ""  # the zero value is the unset default
                to, back = _same, names.__getitem__
            elif field.type == _UINT64 and isinstance(defaults[name], str):
                to, back = int, str  # Hash: canonical JSON writes a uint64 as a string
            elif field.is_repeated:
                to, back = _same, tuple
            else:
                to, back = _same, _same
            self._to.append((name, to, defaults[name]))
            self._from.append((name, back, presence))

    def to_proto(self, value: S) -> Message:
        kwargs = {}
        for name, to, default in self._to:
            v = getattr(value, name)
            if v != default:
                kwargs[name] = to(v)
        return self.proto(**kwargs)

    def from_proto(self, message: Message) -> S:
        kwargs = {}
        for name, back, presence in self._from:
            if presence:
                if message.HasField(name):
                    kwargs[name] = back(getattr(message, name))
            else:
                kwargs[name] = back(getattr(message, name))
        return self.struct(**kwargs)

    def encode(self, value: S) -> bytes:
        return self.to_proto(value).SerializeToString()

    def decode(self, data: bytes) -> S:
        """The Struct in ``data``; WireError if it is no ``proto`` message (truncated, not
        protobuf) or holds an enum value the model has no name for."""
        try:
            return self.from_proto(self.proto.FromString(data))
        except DecodeError as exc:
            raise WireError(f"not a {self.proto.DESCRIPTOR.full_name}: {exc}") from None
        except KeyError as exc:
            # Proto3 enums are open: an unknown number parses, and the model has no name for it.
            raise WireError(
                f"{self.proto.DESCRIPTOR.full_name}: unknown enum value {exc.args[0]}"
            ) from None


def _same(value: Any) -> Any:
    return value


def _each(convert: Callable[[Any], Any]) -> Callable[[Iterable[Any]], tuple[Any, ...]]:
    return lambda values: tuple(convert(v) for v in values)


# Every model Struct with its proto message (tests/pure/test_wire_model.py holds them to each
# other).
PAIRS: list[tuple[type[msgspec.Struct], type[Message]]] = [
    # leaves first: each codec needs the codecs of its fields' messages
    (messages.IPSet, localv1_pb2.IPSet),
    (messages.ServiceIPs, localv1_pb2.ServiceIPs),
    (messages.IPFilter, localv1_pb2.IPFilter),
    (messages.IPFamilies, localv1_pb2.IPFamilies),
    (messages.EndpointAddress, localv1_pb2.EndpointAddress),
    (messages.PortMapping, localv1_pb2.PortMapping),
    (messages.ClientIPAffinity, localv1_pb2.ClientIPAffinity),
    (messages.Service, localv1_pb2.Service),
    (messages.PortName, localv1_pb2.PortName),
    (messages.EndpointScopes, localv1_pb2.EndpointScopes),
    (messages.Endpoint, localv1_pb2.Endpoint),
    (messages.TopologyInfo, globalv1_pb2.TopologyInfo),
    (messages.TopologyHints, globalv1_pb2.TopologyHints),
    (messages.EndpointConditions, globalv1_pb2.EndpointConditions),
    (messages.NodeAddress, globalv1_pb2.NodeAddress),
    (messages.NodeAddress, localv1_pb2.NodeAddress),
    (messages.NodeFacts, localv1_pb2.NodeFacts),
    (messages.ChangeTriggers, localv1_pb2.ChangeTriggers),
    (messages.Node, globalv1_pb2.Node),
    (messages.ServiceInfo, globalv1_pb2.ServiceInfo),
    (messages.EndpointInfo, globalv1_pb2.EndpointInfo),
    (messages.NodeInfo, globalv1_pb2.NodeInfo),
    (messages.ServiceCIDRInfo, globalv1_pb2.ServiceCIDRInfo),
]


def _plan() -> dict[str, Codec[Any]]:
    codecs: dict[str, Codec[Any]] = {}
    for struct, proto in PAIRS:
        codecs[proto.DESCRIPTOR.full_name] = Codec(struct, proto, codecs)
    return codecs


_CODECS = _plan()
SERVICE: Codec[messages.Service] = _CODECS["localv1.Service"]
ENDPOINT: Codec[messages.Endpoint] = _CODECS["localv1.Endpoint"]
SERVICE_INFO: Codec[messages.ServiceInfo] = _CODECS["globalv1.ServiceInfo"]
ENDPOINT_INFO: Codec[messages.EndpointInfo] = _CODECS["globalv1.EndpointInfo"]
NODE_INFO: Codec[messages.NodeInfo] = _CODECS["globalv1.NodeInfo"]
SERVICE_CIDR_INFO: Codec[messages.ServiceCIDRInfo] = _CODECS["globalv1.ServiceCIDRInfo"]
NODE_FACTS: Codec[messages.NodeFacts] = _CODECS["localv1.NodeFacts"]
CHANGE_TRIGGERS: Codec[messages.ChangeTriggers] = _CODECS["localv1.ChangeTriggers"]


# --- op framing (protobuf wire format, written by hand: see the module docstring)


def _slow_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Tags and the lengths of most payloads: framing a million ops looks these up instead.
_SMALL_VARINTS = [_slow_varint(n) for n in range(1 << 14)]


def _varint(n: int) -> bytes:
    return _SMALL_VARINTS[n] if n < 16384 else _slow_varint(n)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(tag << 3 | 2) + _varint(len(payload)) + payload


def _ref(set_: int, path: str) -> bytes:
    return (_varint(1 << 3) + _varint(set_) if set_ else b"") + (
        _field(2, path.encode()) if path else b""
    )


# OpItem fields: Sync=1, Set=2, Delete=3, Reset=4. Value: Ref=1, Bytes=2.
OP_SYNC = _field(1, b"")
OP_RESET = _field(4, b"")


def op_set(set_: int, path: str, payload: bytes) -> bytes:
    """An encoded OpItem setting ``path`` of ``set_`` to the encoded message ``payload``."""
    value = _field(1, _ref(set_, path)) + (_field(2, payload) if payload else b"")
    return _field(2, value)


def op_delete(set_: int, path: str) -> bytes:
    return _field(3, _ref(set_, path))


def op_batch(ops: Iterable[bytes]) -> bytes:
    """An encoded batchv1.OpBatch of encoded OpItems (Ops=1)."""
    return b"".join(_field(1, op) for op in ops)


PACKED_BYTES_MAX = 64 << 20
"""The most one OpBatch.Packed entry may inflate to (batchv1.proto): a watcher refuses more."""
_PACK_LEVEL = 6
"""zlib's default: a zone's base is packed once for all its nodes, so its ratio (15 times on a
10,000-service state in JSON, against 13 at level 1) matters more than its time."""


def packed(batch: bytes) -> bytes:
    """An encoded OpBatch holding ``batch``, an encoded OpBatch of only Ops, compressed (its
    Packed=4 entry): what a watcher that asked for packing inflates back to ``batch``."""
    if len(batch) > PACKED_BYTES_MAX:
        raise ValueError(f"{len(batch)} bytes of ops: more than a Packed entry may hold")
    return _field(4, zlib.compress(batch, _PACK_LEVEL))


def unpacked(entry: bytes, limit: int = PACKED_BYTES_MAX) -> bytes:
    """What an OpBatch.Packed ``entry`` inflates to, at most ``limit`` bytes: a peer chooses it,
    and a few kB of zeros inflate to gigabytes."""
    inflate = zlib.decompressobj()
    try:
        batch = inflate.decompress(entry, limit)
    except zlib.error as exc:
        raise WireError(f"a Packed entry that does not inflate: {exc}") from None
    if inflate.unconsumed_tail:
        raise WireError(f"a Packed entry that inflates to more than {limit} bytes")
    if not inflate.eof or inflate.unused_data:
        raise WireError("a Packed entry that is not one whole zlib stream")
    return batch


GLOBAL_INFOS: dict[type[msgspec.Struct], Codec[Any]] = {
    messages.ServiceInfo: SERVICE_INFO,
    messages.EndpointInfo: ENDPOINT_INFO,
    messages.NodeInfo: NODE_INFO,
    messages.ServiceCIDRInfo: SERVICE_CIDR_INFO,
}
