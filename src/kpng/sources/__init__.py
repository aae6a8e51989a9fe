"""Sources: where the global state comes from. Each module exposes a ``SPEC`` the CLI lists."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kpng.store import Store

Runner = Callable[[], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class SourceSpec:
    name: str
    """The command word, e.g. ``file``."""
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    create: Callable[[argparse.Namespace, Store, str | None], Runner]
    """Registers the source's handles in the store now (so no sink can see the store synced
    without them), and returns what runs the source until cancelled. The third argument names
    the one node the sink needs, when it needs only one (``to-local``): a source that can filter
    by it need not fetch the others."""
    lists_nodes: bool = False
    """Whether the source always lists every node, so that a node it does not list does not
    exist (``/healthz`` then fails for it, as kube-proxy's)."""
