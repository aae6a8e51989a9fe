"""kpng's nftables engine: the node-local state as rules in kpng's own table (``inet kpng``).

``to-nft`` (kpng.backends.nft) is this engine and its flags; ``to-ebpf`` runs it for the traffic
its socket programs do not see.

The first state (and any state after a refused transaction) replaces what the table holds in one
transaction, taking over what a previous kpng left without a gap and keeping the ClientIP
affinity memory; every later state changes only the elements, chains and maps of the services
that changed, in one atomic transaction.
The layout is described in ``layout.py``; ``nftables.py`` is the typed transaction,
``fake.py`` the in-memory nft for tests, ``executing.py`` what talks to nftables (libnftables
in process, or the ``nft`` command) and runs ``conntrack``.
"""

from kpng.backends._nftables.syncing import (
    FULL_CHECK_PERIOD_S,
    LeftoverTables,
    NftBackend,
    cleanup,
    has_nft,
    kube_proxy_leftovers,
    options_from_args,
)

__all__ = [
    "FULL_CHECK_PERIOD_S",
    "LeftoverTables",
    "NftBackend",
    "cleanup",
    "has_nft",
    "kube_proxy_leftovers",
    "options_from_args",
]
