"""What a kernel backend's drift check found, as to-nft, to-iptables and to-ebpf report it (pure).

Each backend checks its own objects its own way (``_nftables/auditing.py``, to-iptables' chain
counts, ``ebpf/auditing.py``); what they find is one ``Drift``, reported through
``SyncReporter.diverged`` and counted by its ``kind`` once a sync repairs it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NAMED = 5
"""The most objects a drift's sentence names; more are counted."""


@dataclass(frozen=True)
class Drift:
    kind: str
    """What was found, one short word (``kpng_backend_drift_repairs_total{kind}``): ``table``,
    ``chain``, ``rules``, ``map``, ``elements``, ``jumps``, ``pins``, ``programs``,
    ``entries``."""
    detail: str
    """A sentence for the log and ``/healthz``."""


def named(items: Sequence[str]) -> str:
    """``a, b, c`` for the first ``NAMED`` of ``items``, ``and N more`` for the rest."""
    shown = ", ".join(items[:NAMED])
    return shown + (f" and {len(items) - NAMED} more" if len(items) > NAMED else "")
