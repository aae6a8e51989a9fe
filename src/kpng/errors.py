"""kpng's exception tree. Errors of the libraries kpng uses become these at one boundary each."""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

EXIT_ERROR = 1
"""kpng's exit status when it fails: a KpngError at run time."""
EXIT_USAGE = 2
"""kpng's exit status for a command line it cannot use (argparse's own)."""


class KpngError(Exception):
    """The root of every error kpng raises on purpose."""


class InvalidObject(KpngError):
    """A Kubernetes object kpng cannot use: it is reported and skipped; the rest is served."""

    def __init__(self, kind: str, namespace: str, name: str, reason: str) -> None:
        self.kind = kind
        self.namespace = namespace
        self.name = name
        self.reason = reason
        super().__init__(f"{kind} {object_name(namespace, name)}: {reason}")


def object_name(namespace: str, name: str) -> str:
    """How kpng names an object in messages: namespace/name, or name alone for Nodes."""
    name = name or "<no name>"
    return f"{namespace}/{name}" if namespace else name


class WireError(KpngError):
    """A message from a kpng server that kpng cannot read (a payload that does not decode, a path
    that names nothing): the op is reported and skipped; the rest of the stream is used."""


class InputError(KpngError):
    """A source's input as a whole cannot be read (a missing file, a document that is not YAML)."""


class UsageError(KpngError):
    """The command line asks for something kpng cannot do."""


@dataclass(frozen=True)
class FieldProblem:
    """What a ``msgspec.ValidationError`` of a decoded document says, in parts, so that each
    reader words it as its users know the document (one reader of msgspec's text, here)."""

    path: tuple[str | int, ...]
    """Field names and list indexes from the document's root to the field; for an unknown
    field or a key that is no string, to the mapping holding it."""
    unknown: str | None = None
    """The unknown field's name."""
    key: bool = False
    """A key of the mapping at ``path`` is no string."""
    expected: str | None = None
    """The JSON type the field must hold (msgspec's words: str, int, bool, array, object)."""
    detail: str = ""
    """msgspec's message, for what is none of the above."""

    @property
    def dotted(self) -> str:
        """``path`` as written in messages: ``clusters[0].cluster.server``."""
        return "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" if i else p for i, p in enumerate(self.path)
        )

    def value(self, document: object) -> object:
        """The value at ``path`` in ``document`` (None if there is none)."""
        for part in self.path:
            if isinstance(part, int):
                document = document[part] if isinstance(document, list) else None
            else:
                document = document.get(part) if isinstance(document, dict) else None
        return document

    def bad_key(self, document: object) -> object:
        """With ``key``: the first key of the mapping at ``path`` that is no string."""
        held = self.value(document)
        keys = held if isinstance(held, dict) else {}
        return next((k for k in keys if not isinstance(k, str)), "?")


# "Expected `int | null`, got `str` - at `$.conntrack.min`";
# "Object contains unknown field `minimum` - at `$.conntrack`" (at the root, no " - at ...");
# "Expected `str` - at `key` in `$.conntrack`" (a key that is no string).
_VALIDATION = re.compile(r"^(?P<what>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.S)
_EXPECTED = re.compile(r"^Expected `(?P<type>[a-z]+)")
_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def field_problem(exc: msgspec.ValidationError) -> FieldProblem:
    """``exc`` read into its parts."""
    match = _VALIDATION.match(str(exc))
    if match is None:  # a message without a path: none is known today
        return FieldProblem(path=(), detail=str(exc))
    path = tuple(name if name else int(index) for name, index in _PART.findall(match["path"] or ""))
    if match["key"]:
        return FieldProblem(path=path, key=True)
    if unknown := _UNKNOWN.match(match["what"]):
        return FieldProblem(path=path, unknown=unknown["name"])
    if expected := _EXPECTED.match(match["what"]):
        return FieldProblem(path=path, expected=expected["type"])
    return FieldProblem(path=path, detail=match["what"])
