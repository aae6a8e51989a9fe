"""kpng's exception tree. Errors of the libraries kpng uses become these at one boundary each."""

from __future__ import annotations

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
