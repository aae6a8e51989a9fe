"""Sources: where the global state comes from. A module of this package that defines a
``SPEC`` is a source, the command word ``SPEC.name``: the CLI finds it here (``registered``),
with no edit of its own."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kpng.specs import Runner, find_specs
from kpng.store import Store

if TYPE_CHECKING:
    from kpng.feeding import Fanout
    from kpng.status import Status

__all__ = ["Runner", "SourceSpec", "registered"]


@dataclass(frozen=True)
class SourceSpec:
    name: str
    """The command word, e.g. ``file``."""
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    create: Callable[[argparse.Namespace, Store, str | None], Runner] | None = None
    """Registers the source's handles in the store now (so no sink can see the store synced
    without them), and returns what runs the source until cancelled. The third argument names
    the one node the sink needs, when it needs only one (``to-local``): a source that can filter
    by it need not fetch the others."""
    lists_nodes: bool = False
    """Whether the source always lists every node, so that a node it does not list does not
    exist (``/healthz`` then fails for it, as kube-proxy's)."""
    feeds_backends: Callable[[argparse.Namespace, Callable[[], Fanout], Status], Runner] | None = (
        None
    )
    """For a source whose output is node-local states (``local``: a remote kpng's) rather than
    the global state: no sink follows it on the command line, but backends, and this makes what
    feeds them (instead of ``create``), adding what it reports to ``Status.samplers``."""


_NOT_SOURCES = frozenset({"manifests"})
"""Modules here that are no source: the file source's parser, imported once a file is read (it
costs a node agent behind a brain 11 ms of start-up)."""


def registered() -> dict[str, SourceSpec]:
    """Every source, by name: the modules of this package with a ``SPEC``."""
    return find_specs(__name__, SourceSpec, skip=_NOT_SOURCES)
