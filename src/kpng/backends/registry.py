"""The CLI's side of the backend registry: which ``to-<name>`` exist, built-in or installed, and
importing one on demand. A backend registers itself with ``kpng.client.register``."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from kpng.client import Backend, BackendSpec, NodeState, register
from kpng.client._registering import REGISTERED
from kpng.errors import UsageError

if TYPE_CHECKING:
    import importlib.metadata

ENTRY_POINT_GROUP = "kpng.backends"

__all__ = ["Backend", "BackendSpec", "NodeState", "known", "lookup", "names", "register"]


def _builtin() -> set[str]:
    import kpng.backends

    # Packages only; those named _* are what backends share (the nftables engine), not backends.
    return {
        m.name
        for m in pkgutil.iter_modules(kpng.backends.__path__)
        if m.ispkg and not m.name.startswith("_")
    }


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    # Imported here: importlib.metadata takes 20 ms to import, and running a built-in backend
    # needs no entry point.
    import importlib.metadata

    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Every backend name, built-in or installed, without importing any backend."""
    return sorted(_builtin() | set(_entry_points()))


def known(name: str) -> bool:
    """Whether ``to-<name>`` is a backend, built-in or installed, without importing any."""
    return name in _builtin() or name in _entry_points()


def lookup(name: str) -> BackendSpec:
    """The registered backend ``name``, importing its module on first use.

    A built-in backend wins over an installed one of the same name.
    """
    if name not in REGISTERED:
        module = None
        if name in _builtin():
            module = importlib.import_module(f"kpng.backends.{name}")
        elif (ep := _entry_points().get(name)) is not None:
            module = importlib.import_module(ep.module)  # `module` or `module:attr` both name it
        # Its SPEC, as sources, sinks and subcommands have (kpng.specs); a module that calls
        # register() without naming the result SPEC works too.
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, BackendSpec) and spec.name == name:
            REGISTERED.setdefault(name, spec)
        if name not in REGISTERED:
            raise UsageError(f"unknown backend to-{name} (known: {', '.join(names())})")
    return REGISTERED[name]
