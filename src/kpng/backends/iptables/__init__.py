"""to-iptables: the node-local state as kube-proxy's iptables rules, synced incrementally.

The layout is kube-proxy's (``rules.py``); each sync is one ``iptables-restore --noflush`` per
family that rewrites only the chains whose rules change (``restore.py``): the changed services'
own, and a shared chain only when a line of it changes. The first sync, the one after a
failure or a change of the node's options, and one an hour are full: every chain is rewritten,
missing jumps are inserted, and the service chains the kernel holds but kpng no longer wants
are deleted. Every sync period the jumps are checked, as kube-proxy's canary, and how many rules
each of kpng's chains holds (from the same iptables-save): a flushed chain or a foreign rule is
rewritten then, reported as a divergence until it is. A refused
restore changes nothing (iptables-restore commits a table whole or not at all), fails
``apply``, and kpng's Feeder retries with a full sync. With ``--traffic-counters``, the rules'
own packet counters are read for ``/metrics`` (``counting.py``).
"""

from kpng.backends.iptables.syncing import FULL_SYNC_PERIOD_S, SPEC, IptablesBackend, cleanup

__all__ = ["FULL_SYNC_PERIOD_S", "SPEC", "IptablesBackend", "cleanup"]
