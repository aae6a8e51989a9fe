"""An independent reading of the protobuf wire format, by field number only.

It shares no code with kpng's codec or the generated classes: the numbers below are Go KPNG's
(tests/pure/data/gokpng-fields.json, from its api/*/api.proto), so a stream these functions read
correctly is one a Go KPNG client reads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

Fields = dict[int, list[int | bytes]]


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def fields(data: bytes) -> Fields:
    """Every field of a message, by number: ints for varints, bytes for length-delimited."""
    out: Fields = defaultdict(list)
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = _varint(data, i)
            out[number].append(value)
        elif wire_type == 2:
            length, i = _varint(data, i)
            out[number].append(data[i : i + length])
            i += length
        else:
            raise ValueError(f"unexpected wire type {wire_type} for field {number}")
    return out


def one(f: Fields, number: int, default: int | bytes = b"") -> int | bytes:
    values = f.get(number)
    return values[-1] if values else default


def text(f: Fields, number: int) -> str:
    value = one(f, number)
    assert isinstance(value, bytes)
    return value.decode()


def strings(f: Fields, number: int) -> list[str]:
    return [v.decode() for v in f.get(number, []) if isinstance(v, bytes)]


def sub(f: Fields, number: int) -> Fields:
    value = one(f, number)
    assert isinstance(value, bytes)
    return fields(value)


@dataclass(frozen=True)
class Op:
    kind: str  # Sync, Set, Delete, Reset
    set: int = 0
    path: str = ""
    payload: bytes = b""


def op(data: bytes) -> Op:
    """localv1.OpItem{oneof Op {Sync=1; Set=2 (Value{Ref=1; Bytes=2}); Delete=3 (Ref); Reset=4}}
    with Ref{Set=1; Path=2}."""
    f = fields(data)
    if 1 in f:
        return Op("Sync")
    if 4 in f:
        return Op("Reset")
    if 2 in f:
        value = sub(f, 2)
        ref = sub(value, 1)
        payload = one(value, 2)
        assert isinstance(payload, bytes)
        set_ = one(ref, 1, 0)
        assert isinstance(set_, int)
        return Op("Set", set_, text(ref, 2), payload)
    ref = sub(f, 3)
    set_ = one(ref, 1, 0)
    assert isinstance(set_, int)
    return Op("Delete", set_, text(ref, 2))
