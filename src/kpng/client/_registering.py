"""How a backend makes ``to-<name>`` a command of kpng: a spec, registered on import.

The CLI's side (finding built-in and installed backends, importing one on demand) is
kpng.backends.registry; what a backend module itself calls lives here, with the rest of what a
backend author imports.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from kpng.client._reporting import SyncReporter
from kpng.client._state import Backend

ProxyMode = Literal["nftables", "iptables"]
"""kube-proxy's modes whose metrics a backend's syncs can stand for."""


@dataclass(frozen=True)
class BackendSpec:
    name: str
    """The backend's command is ``to-<name>``."""
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    create: Callable[[argparse.Namespace, SyncReporter], Backend]
    """Makes the backend from its parsed arguments. The reporter is where it reports its syncs,
    if it says it does (``reports_syncs``); other backends ignore it."""
    reports_syncs: bool = False
    """The backend reports its syncs itself: kpng does not infer them from ``apply``."""
    proxy_mode: ProxyMode = "nftables"
    """The kube-proxy mode whose metrics its syncs are counted under: its failures are
    ``sync_proxy_rules_iptables_restore_failures_total`` for ``iptables``,
    ``sync_proxy_rules_nftables_sync_failures_total`` for ``nftables``. Alerts written for one
    mode read that mode's names only, so a backend writing iptables rules must say so; the
    default is the mode of kpng's own ``inet`` table."""
    cleanup: Callable[[], Coroutine[Any, Any, bool]] | None = None
    """Removes what the backend leaves on the node (``kpng cleanup``); True if it found any."""
    once: Callable[[argparse.Namespace], bool] | None = None
    """Whether these arguments make the backend stop after its first state (a ``--once`` flag):
    kpng then fails when a source cannot sync, rather than wait for a state it would not
    program anyway."""


REGISTERED: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> BackendSpec:
    """Make ``to-<spec.name>`` available; called by a backend module when it is imported."""
    REGISTERED[spec.name] = spec
    return spec
