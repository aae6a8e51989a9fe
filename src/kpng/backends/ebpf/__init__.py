"""``to-ebpf``: services balanced when a socket connects, by cgroup BPF programs.

Two parts, each complete for the traffic it sees:

- **Sockets** (``sockets.bpf.c``, ``entries.py``): programs on the cgroup hooks connect4/6,
  sendmsg4/6, recvmsg4/6 and getpeername4/6 of ``--cgroup`` (by default the whole cgroup2
  hierarchy: every pod and the node) give a TCP socket that connects, or a UDP socket that
  sends unconnected, to a ClusterIP, an external or LB IP, or a node port on the node's own
  primary IPs, an endpoint picked from BPF maps, before any packet exists. Its packets leave
  addressed to the endpoint: no DNAT, no conntrack entry for the translation, a cost that does
  not grow with the number of services.
  getpeername and recvmsg answer with the service's address. A UDP socket that connects is
  left untranslated (``--connected-udp packets``, the default): translated at connect, it would
  stay on its endpoint once that endpoint is gone. With ``--connected-udp destroy``, where the
  kernel and kpng's privileges allow it (``destroying``), it is translated too, and destroyed
  once its endpoint is gone: its next send fails, and an application that does not connect
  again (a metrics client ignoring send errors) never delivers again.
- **Packets** (to-nft's ruleset in ``inet kpng``, unchanged): what no local socket connected
  to: node ports, external and LB IPs reached from outside, ClusterIPs routed to the node, and
  the answers for services without endpoints (REJECT or DROP), which the programs leave
  untranslated on purpose, and connected UDP sockets, which it DNATs as kube-proxy does: once
  their endpoint is gone, their conntrack entry is deleted, and their next datagram reaches
  another endpoint, on the same socket. It also serves the health check node ports.

The maps are pinned under ``--pin-dir`` and the programs attached through pinned BPF links, so
that the data path outlives kpng as rules outlive kube-proxy. A (re)start loads the programs,
reuses the pinned maps (ClientIP affinity memory included), writes every entry, deletes the
stale ones and only then switches the links to the new programs (BPF_LINK_UPDATE, atomic):
connections never find a half-written state, and established ones are never touched. Later
states change only the entries of the services that changed.

With ``--traffic-counters service``, the programs count the connections they translate per
frontend and kpng adds them to what the nftables part counts, per Service port (``traffic.py``).

Every ``--sync-period`` kpng checks that the pins still hold its maps, the links still run its
programs on the cgroup, and the maps hold what it wrote (``auditing.py``); what another program
changed is logged, reported as a divergence, and repaired as a start would.
"""

from kpng.backends.ebpf.balancing import (
    DEFAULT_PIN_DIR,
    PROGRAMS,
    SPEC,
    EbpfBackend,
    SocketBalancer,
    cleanup,
    remove_pins,
)

__all__ = [
    "DEFAULT_PIN_DIR",
    "PROGRAMS",
    "SPEC",
    "EbpfBackend",
    "SocketBalancer",
    "cleanup",
    "remove_pins",
]
