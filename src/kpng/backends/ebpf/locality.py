"""Which network namespaces' sockets the programs balance, under kube-proxy's local traffic
detection.

kube-proxy treats a connection to a service by where it comes from. From one of the node's pods
(``--detect-local-mode``: a source in the cluster or node CIDRs, or a packet arriving on the pod
bridge or on an interface of the pods' prefix) a ClusterIP keeps its source, and an external IP
or node port with eTP=Local short-circuits to every endpoint; from anything else the first is
masqueraded and the second served by the node's endpoints only. The programs translate when a
socket connects, before it has a source address or its packets an interface, so they cannot
tell by the packet. kpng tells them by the socket's network namespace: it looks once at each
namespace with a process in the cgroup as detection would see its traffic (its addresses, and
the node's interface its traffic arrives on: a veth's other end, or the bridge that end is
enslaved to), and writes, by the namespace's cookie, the families detection counts it local for.

Where detection is set for a family (``kpng_locality``), the programs translate a socket of
that family only in a namespace written local for it (``kpng_local_netns``). Any other socket
is left to the nftables part, which decides by the packet, as kube-proxy does; so is one of a
namespace kpng has not looked at yet (a pod a moment old, until the next look, every
``LOOK_EVERY_S``): correct, only not balanced at connect.

The node's own namespace (its processes, hostNetwork pods) is always translated: masquerade
would give its connections the address the route gives them anyway.

Entering the namespaces takes ``namespaces``' privileges, and the namespace cookie a socket
option of Linux 5.14. Without either, every socket is translated, and pods that detection would
not count as local are not masqueraded: kpng says so at start.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kpng.backends import _rtnetlink as rtnetlink
from kpng.backends._node import Fam, Options
from kpng.backends._rtnetlink import Link
from kpng.backends.ebpf import libbpf, namespaces

log = logging.getLogger(__name__)

V4, V6 = 1, 2
"""The families' bits, in kpng_locality and kpng_local_netns (sockets.bpf.c's LOCAL_V4/V6)."""
LOOK_EVERY_S = 1.0
SO_NETNS_COOKIE = 71
_KEY, _VALUE = struct.Struct("=Q"), struct.Struct("=I")


@dataclass(frozen=True)
class Namespace:
    """A network namespace as local traffic detection sees its traffic."""

    addresses: tuple[str, ...] = ()
    """Its global addresses: the sources its connections leave with."""
    arrives_on: tuple[str, ...] = ()
    """The node's interfaces its packets arrive on: its veths' other ends, or their bridges."""


def checked(options: Options) -> int:
    """The families local traffic detection is set for: the only ones whose sockets depend on
    their namespace."""
    if options.pod_interface:
        return V4 | V6
    return (V4 if options.cidrs(options.cluster_cidrs, "v4") else 0) | (
        V6 if options.cidrs(options.cluster_cidrs, "v6") else 0
    )


def local(options: Options, namespace: Namespace) -> int:
    """The families for which detection counts ``namespace``'s traffic as the node's pods'
    (as ``_nftables.layout.local_source`` matches it): with an interface, where its packets
    arrive; else by its addresses. A family detection is not set for is local."""
    if options.pod_interface:
        pattern = options.pod_interface
        if pattern.endswith("*"):  # nftables' iifname "prefix*"
            arrives = any(n.startswith(pattern[:-1]) for n in namespace.arrives_on)
        else:
            arrives = pattern in namespace.arrives_on
        return V4 | V6 if arrives else 0
    families = 0
    bits: tuple[tuple[int, Fam], ...] = ((V4, "v4"), (V6, "v6"))
    for bit, fam in bits:
        cidrs = options.cidrs(options.cluster_cidrs, fam)
        version = 4 if fam == "v4" else 6
        own = [a for a in map(ipaddress.ip_address, namespace.addresses) if a.version == version]
        # No address of the family: no connection of it leaves, whichever way it goes. Both
        # inside and outside: local, as the route picks the source after the programs ran.
        if (
            not cidrs
            or not own
            or any(a in ipaddress.ip_network(c, strict=False) for a in own for c in cidrs)
        ):
            families |= bit
    return families


def arrives_on(own_links: Sequence[Link], node_links: Sequence[Link]) -> tuple[str, ...]:
    """The node's interfaces a namespace's packets arrive on, from its links and the node's:
    the other end of each of its veths that is a veth of the node, or that end's bridge."""
    node = {link.index: link for link in node_links}
    names = set()
    for link in own_links:
        if link.kind != "veth" or not link.peer_elsewhere or link.peer is None:
            continue
        peer = node.get(link.peer)
        if peer is None or peer.kind != "veth":
            continue
        master = node.get(peer.master) if peer.master is not None else None
        names.add((master or peer).name)
    return tuple(sorted(names))


def netns_cookie() -> int:
    """The cookie of the calling thread's network namespace, as bpf_get_netns_cookie gives the
    programs that of a socket's."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        (cookie,) = _KEY.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, _KEY.size))
        return int(cookie)


def look(node_links: Sequence[Link]) -> Namespace:
    """The calling thread's network namespace as detection sees it (``node_links``: the node's,
    read in its own namespace)."""
    return Namespace(
        addresses=tuple(a.address for a in rtnetlink.addresses() if a.is_global),
        arrives_on=arrives_on(rtnetlink.links(), node_links),
    )


def unavailable() -> str | None:
    """Why this kernel cannot tell kpng the namespace cookies the programs see, or None (kpng
    must also be able to enter the namespaces: ``namespaces.unavailable``)."""
    try:
        netns_cookie()
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            return "this kernel has no SO_NETNS_COOKIE (Linux 5.14)"
        raise
    return None


class LocalNamespaces:
    """kpng_locality and kpng_local_netns kept in step with the namespaces of ``cgroup``: each
    namespace is entered once, when first seen, and forgotten when its last process goes."""

    def __init__(self, locality_fd: int, local_fd: int, cgroup: Path, why_not: str | None) -> None:
        self._locality_fd, self._local_fd, self._cgroup = locality_fd, local_fd, cgroup
        self._why_not = why_not
        self._own = netns_cookie() if why_not is None else 0
        self._known: dict[int, tuple[int, Namespace]] = {}  # by inode: cookie, what it is
        self._written: dict[int, int] | None = None  # by cookie: families; None: not read
        self._families: int | None = None  # what kpng_locality holds; None: not written
        self._classified: Options | None = None  # what the namespaces were last written for
        self._dirty = True  # a namespace came or went since
        self._failed: set[int] = set()
        self._told = False
        self.counts: tuple[int, int] | None = None
        """Namespaces local for every family detection is set for, and the others (the node's
        own among the first); None while detection is not set or kpng cannot look."""
        self._lock = threading.Lock()  # the periodic look and a full sync's

    def refresh(self, options: Options) -> None:
        """Look at the namespaces not seen yet and write what changed (blocking: in a thread)."""
        with self._lock:
            families = checked(options)
            if families and not self._told:
                self._told = True
                self._tell()
            if self._why_not is not None:
                families = 0
            # Once a second: the namespaces are classified and written again only when one came
            # or went, or the options changed (the Node's pod CIDRs).
            if families and self._look():
                self._dirty = True
            if not self._dirty and options == self._classified and families == self._families:
                return
            wanted: dict[int, int] = {}
            if families:
                wanted = {cookie: local(options, ns) for cookie, ns in self._known.values()}
                wanted[self._own] = V4 | V6
            in_full = sum(1 for f in wanted.values() if f & families == families)
            self.counts = (in_full, len(wanted) - in_full) if wanted else None
            self._write(wanted, families)
            # Only once written: after a failed write, the next look writes again.
            self._classified, self._dirty = options, False

    def _tell(self) -> None:
        if self._why_not is None:
            log.info(
                "to-ebpf: sockets of network namespaces that local traffic detection does not "
                "count as the node's pods' are left to the nftables part"
            )
        else:
            log.warning(
                "to-ebpf: every socket is balanced at connect, and pods that local traffic "
                "detection does not count as local are not masqueraded as kube-proxy would: %s",
                self._why_not,
            )

    def _look(self) -> bool:
        """Forget the namespaces gone, look at the new ones; whether any went or came."""
        found = namespaces.found(self._cgroup)
        gone = set(self._known) - set(found)
        for inode in gone:
            del self._known[inode]
        new = {inode: pid for inode, pid in found.items() if inode not in self._known}
        if not new:
            return bool(gone)
        before = len(self._known)
        node = rtnetlink.links()

        def enter(inode: int) -> None:
            self._known[inode] = (netns_cookie(), look(node))

        failures = namespaces.visit(new, enter)
        fresh = {i: why for i, why in failures.items() if i not in self._failed}
        self._failed = set(failures)
        for why in fresh.values():
            log.warning(
                "to-ebpf: a network namespace of cgroup %s left to the nftables part: %s",
                self._cgroup,
                why,
            )
        return bool(gone) or len(self._known) > before

    def _write(self, wanted: dict[int, int], families: int) -> None:
        if self._written is None:
            present = libbpf.keys(self._local_fd, _KEY.size, _VALUE.size)
            self._written = {_KEY.unpack(k)[0]: -1 for k in present}
        written = self._written
        updates = [(c, f) for c, f in wanted.items() if written.get(c) != f]
        gone = [c for c in written if c not in wanted]
        # Namespaces first, then the families that depend on them: a socket never finds its
        # family checked before its namespace is written. Deletes last, once unchecked.
        if updates:
            pairs = [(_KEY.pack(c), _VALUE.pack(f)) for c, f in updates]
            libbpf.update_batch(self._local_fd, "kpng_local_netns", pairs)
        if families != self._families:
            libbpf.update_batch(
                self._locality_fd, "kpng_locality", [(_VALUE.pack(0), _VALUE.pack(families))]
            )
            self._families = families
        if gone:
            libbpf.delete_batch(self._local_fd, "kpng_local_netns", [_KEY.pack(c) for c in gone])
        written.update(updates)
        for cookie in gone:
            del written[cookie]
