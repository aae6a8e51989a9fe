"""The backend registry. Backends implement ``kpng.client.Backend``, fed ``NodeState``s."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import pkgutil
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kpng.client import Backend, NodeState
from kpng.errors import UsageError

ENTRY_POINT_GROUP = "kpng.backends"

__all__ = ["Backend", "BackendSpec", "NodeState", "lookup", "names", "register"]


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


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Every backend name, built-in or installed, without importing any backend."""
    import kpng.backends

    builtin = {m.name for m in pkgutil.iter_modules(kpng.backends.__path__) if m.ispkg}
    return sorted(builtin | set(_entry_points()))


def lookup(name: str) -> BackendSpec:
    """The registered backend ``name``, importing its module on first use."""
    if name not in _registry:
        if name in names():
            ep = _entry_points().get(name)
            if ep is not None:
                importlib.import_module(ep.module)  # `module` or `module:attr` both name it
            else:
                importlib.import_module(f"kpng.backends.{name}")
        if name not in _registry:
            raise UsageError(f"unknown backend to-{name} (known: {', '.join(names())})")
    return _registry[name]
