"""The names of to-iptables' chains, in a module of their own so that the module that finds
kube-proxy's leftovers (``_kube_proxy.py``) can tell kpng's chains from kube-proxy's without
importing a backend (backends never import each other, and to-nft looks for leftovers too)."""

from __future__ import annotations

OWNER_CHAIN = "KPNG-IPTABLES"
"""An empty nat chain that says the KUBE- chains are kpng's: kube-proxy's iptables mode has the
same names, and ``kpng cleanup`` must not remove its rules."""

SHARED_CHAINS: dict[str, tuple[str, ...]] = {
    "nat": ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", OWNER_CHAIN),
    "filter": ("KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-PROXY-FIREWALL", "KUBE-FORWARD"),
}
"""Chains every sync rewrites whole: they hold a line or more of every service."""

SERVICE_CHAIN_PREFIXES = (
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SVX-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
)
"""The chains of one service each (nat): kpng's to delete when their service goes."""
