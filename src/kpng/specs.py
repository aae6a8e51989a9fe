"""How the CLI finds its command words: every one is a module that defines ``SPEC``.

Sources (``kpng.sources``), sinks (``kpng.sinks``) and subcommands (``kpng.subcommands``) are the
modules of their package with a ``SPEC``, found here, so adding one is adding a module, with no
edit elsewhere. Backends are the same: a package of ``kpng.backends`` (or an installed module
named in the ``kpng.backends`` entry point group) whose ``SPEC`` is a ``kpng.client.BackendSpec``
(``SPEC = register(BackendSpec(...))``, as a third party's backend writes it). Only backends are
looked up by name without importing the others (kpng.backends.registry): there are more of them,
some heavy, and a third party's may be installed.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

Runner = Callable[[], Coroutine[Any, Any, None]]
"""What runs a source, a sink or a whole pipeline, until it is done or cancelled."""

S = TypeVar("S")


def find_specs(package: str, kind: type[S], *, skip: frozenset[str] = frozenset()) -> dict[str, S]:
    """The ``SPEC`` of each module of ``package`` (but those named in ``skip``) that is a
    ``kind``, by its ``name``, sorted."""
    found: dict[str, S] = {}
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if module.name in skip or module.name.startswith("_"):
            continue
        spec = getattr(importlib.import_module(f"{package}.{module.name}"), "SPEC", None)
        if isinstance(spec, kind):
            found[spec.name] = spec  # type: ignore[attr-defined]
    return dict(sorted(found.items()))
