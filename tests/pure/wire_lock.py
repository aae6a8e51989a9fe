"""The wire API's field numbers, as data: what tests/pure/test_wire_rules.py checks the protos
against.

    python -m tests.pure.wire_lock --update    # after adding a field or an enum value, on purpose

The lock (tests/pure/data/wire-lock.json) names every field and enum value ever released with its
number and type; docs/design/versioning.md says why a number is never reused.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor

from kpng.api import batchv1_pb2, globalv1_pb2, localv1_pb2, pluginv1_pb2

_TYPES = descriptor_pb2.FieldDescriptorProto.Type
LOCK = Path(__file__).parent / "data" / "wire-lock.json"
GO_KPNG = Path(__file__).parent / "data" / "gokpng-fields.json"
"""Go KPNG's localv1 and globalv1 fields (from its api/*/api.proto), which kpng must keep."""
FILES = (localv1_pb2.DESCRIPTOR, globalv1_pb2.DESCRIPTOR, batchv1_pb2.DESCRIPTOR,
         pluginv1_pb2.DESCRIPTOR)  # fmt: skip


def _messages(messages: Iterable[Descriptor]) -> Iterable[Descriptor]:
    for message in messages:
        yield message
        yield from _messages(message.nested_types)


def _enums(files: Iterable[FileDescriptor]) -> Iterable[EnumDescriptor]:
    for file in files:
        yield from file.enum_types_by_name.values()
        for message in _messages(file.message_types_by_name.values()):
            yield from message.enum_types


def entries(files: Iterable[FileDescriptor] = FILES) -> dict[str, dict[str, int | str]]:
    """``package.Message.field`` -> number and type, ``package.Enum.VALUE`` -> number."""
    files = list(files)
    found: dict[str, dict[str, int | str]] = {}
    for file in files:
        for message in _messages(file.message_types_by_name.values()):
            for field in message.fields:
                if field.message_type is not None:
                    kind = field.message_type.full_name
                elif field.enum_type is not None:
                    kind = field.enum_type.full_name
                else:
                    kind = _TYPES.Name(_TYPES.ValueType(field.type)).removeprefix("TYPE_").lower()
                repeated = field.is_repeated
                found[field.full_name] = {
                    "number": field.number,
                    "type": f"{'repeated ' if repeated else ''}{kind}",
                }
    for enum in _enums(files):
        for value in enum.values:
            found[f"{enum.full_name}.{value.name}"] = {"number": value.number, "type": "enum"}
    return found


def reserved(files: Iterable[FileDescriptor] = FILES) -> dict[str, set[int]]:
    """``package.Message`` -> its reserved field numbers."""
    numbers: dict[str, set[int]] = {}
    for file in files:
        proto = descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb)

        def walk(prefix: str, messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
            for message in messages:
                name = f"{prefix}.{message.name}"
                numbers[name] = {n for r in message.reserved_range for n in range(r.start, r.end)}
                walk(name, message.nested_type)

        walk(proto.package, proto.message_type)
    return numbers


def main(argv: list[str]) -> int:
    if argv != ["--update"]:
        print(__doc__, file=sys.stderr)
        return 2
    old = json.loads(LOCK.read_text()) if LOCK.exists() else {}
    LOCK.write_text(json.dumps({**old, **entries()}, indent=1, sort_keys=True) + "\n")
    print(f"{LOCK}: {len(entries())} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
