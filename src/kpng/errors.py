"""kpng's exception tree. Errors of the libraries kpng uses become these at one boundary each."""

from __future__ import annotations


class KpngError(Exception):
    """The root of every error kpng raises on purpose."""


class InvalidObject(KpngError):
    """A Kubernetes object kpng cannot use: it is reported and skipped; the rest is served."""

    def __init__(self, kind: str, namespace: str, name: str, reason: str) -> None:
        self.kind = kind
        self.namespace = namespace
        self.name = name
        self.reason = reason
        where = f"{namespace}/{name}" if namespace else name
        super().__init__(f"{kind} {where or '<no name>'}: {reason}")


class InputError(KpngError):
    """A source's input as a whole cannot be read (a missing file, a document that is not YAML)."""


class UsageError(KpngError):
    """The command line asks for something kpng cannot do."""
