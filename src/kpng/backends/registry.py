"""The backend registry. Backends implement ``kpng.client.Backend``, fed ``NodeState``s."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kpng.client import Backend, NodeState
from kpng.errors import UsageError

if TYPE_CHECKING:
    import importlib.metadata

ENTRY_POINT_GROUP = "kpng.backends"

__all__ = ["Backend", "BackendSpec", "NodeState", "known", "lookup", "names", "register"]


@dataclass(frozen=True)
class BackendSpec:
    name: str
    """The backend's command is ``to-<name>``."""
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    create: Callable[[argparse.Namespace], Backend]
    cleanup: Callable[[], Coroutine[Any, Any, bool]] | None = None
    """Removes what the backend leaves on the node (``kpng cleanup``); True if it found any."""


_registry: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Make ``to-<spec.name>`` available; called by a backend module when it is imported."""
    _registry[spec.name] = spec
    return spec


def _builtin() -> set[str]:
    import kpng.backends

    return {m.name for m in pkgutil.iter_modules(kpng.backends.__path__) if m.ispkg}


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
    if name not in _registry:
        if name in _builtin():
            importlib.import_module(f"kpng.backends.{name}")
        elif (ep := _entry_points().get(name)) is not None:
            importlib.import_module(ep.module)  # `module` or `module:attr` both name it
        if name not in _registry:
            raise UsageError(f"unknown backend to-{name} (known: {', '.join(names())})")
    return _registry[name]
