"""Stale UDP conntrack flows, by kube-proxy's rule, and their deletion over ctnetlink.

UDP has no connection end: a flow DNATed to an endpoint that is gone keeps sending there, and a
flow made while a service had no endpoint keeps bypassing it. kube-proxy (1.37,
pkg/proxy/conntrack/cleanup.go) deletes exactly the UDP flows whose original destination is a
service frontend (an address and port, or any address on a node port) and whose reply source is
not one of the endpoints serving that frontend anywhere. An address frontend with no serving
endpoint loses every flow (new in 1.37: before, it kept them, and one-way flows such as statsd's
kept going to a deleted endpoint); a node port frontend with none keeps them, since its match,
on the port alone, would take unrelated flows too. Flows going to endpoints that still serve
though this node would not pick them for a new flow (terminating, another zone, a Local policy)
stay: changes to a service must not break its existing flows, as with TCP.

``stale_flows`` is the rule (pure); ``Conntrack`` lists the flows and deletes the stale ones
over ctnetlink (``_ctnetlink``), as kube-proxy does since 1.32: no conntrack tool on the node,
no process per sync, and a listing the kernel restricts to UDP of one family, or, when a sync
touched only a few frontends, to those frontends. Every backend that DNATs UDP uses them.

Each reconciliation is timed and its deletions counted per family in ``RECONCILED``, kube-proxy's
``conntrack_reconciler_sync_duration_seconds`` and ``conntrack_reconciler_deleted_entries_total``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kpng.backends import _ctnetlink as ctnetlink
from kpng.backends._ctnetlink import Flow as Flow

Frontends = Mapping[tuple[str, str], frozenset[tuple[str, str]]]
"""(service address, or "" for a node port; port) -> (endpoint address, port) serving it."""


def stale_flows(
    flows: Iterable[Flow], frontends: Frontends, only: Iterable[tuple[str, str]] | None = None
) -> list[Flow]:
    """The stale ``flows`` (sorted, each once), for ``only`` these frontends or every one."""
    if only is not None:
        frontends = {front: frontends[front] for front in only if front in frontends}
    stale: set[Flow] = set()
    for flow in flows:
        endpoint = (flow.reply_src, flow.reply_sport)
        serving = frontends.get((flow.orig_dst, flow.orig_dport))
        if serving is not None and endpoint not in serving:
            stale.add(flow)
        serving = frontends.get(("", flow.orig_dport))
        if serving and endpoint not in serving:
            stale.add(flow)
    return sorted(stale, key=_order)


def _order(flow: Flow) -> tuple[str, ...]:
    return tuple("" if part is None else str(part) for part in flow)


log = logging.getLogger(__name__)

RECONCILE_BUCKETS_S = tuple(0.001 * 2**i for i in range(15))
"""kube-proxy's buckets of ``conntrack_reconciler_sync_duration_seconds``: 1 ms to 16 s,
doubling."""

FAMILIES = ("IPv4", "IPv6")
"""As kube-proxy's ``ip_family`` names them, in the order they are reconciled."""

FEW_FRONTENDS = 4
"""Up to this many frontends of a family are listed with a kernel-filtered dump each, above it
with one dump of every UDP flow: on a node of 101,000 UDP flows, one filtered dump took 0.1 s
and the whole one 0.7 s, most of it the kernel's (``bench/bench_conntrack.py``)."""


@dataclass
class Reconciled:
    """One family's reconciliations: their durations, counted under each of ``bounds`` as
    Prometheus counts them, and the flows they deleted."""

    bounds: tuple[float, ...] = RECONCILE_BUCKETS_S
    buckets: list[int] = field(default_factory=lambda: [0] * len(RECONCILE_BUCKETS_S))
    count: int = 0
    sum: float = 0.0
    deleted: int = 0

    def observe(self, seconds: float, deleted: int) -> None:
        self.count += 1
        self.sum += seconds
        self.deleted += deleted
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.buckets[i] += 1


RECONCILED: dict[str, Reconciled] = {}
"""By ``ip_family``, for the whole process, as kube-proxy's metrics are: whichever backend
reconciles (to-nft, to-iptables, to-ebpf's nftables part), ``/metrics`` reads the sum. A family
appears at its first reconciliation, as kube-proxy's series do."""


class Conntrack:
    """Lists and deletes UDP conntrack entries over ctnetlink, in this process's network
    namespace or in the one at path ``netns``, and records each family's reconciliations in
    ``reconciled`` (default: the process's)."""

    def __init__(
        self, netns: str | None = None, reconciled: dict[str, Reconciled] | None = None
    ) -> None:
        self._netns = netns
        self._reconciled = RECONCILED if reconciled is None else reconciled

    async def udp_flows(self, family: str, frontends: Collection[tuple[str, str]]) -> list[Flow]:
        """The UDP flows of ``family`` (``IPv4``, ``IPv6``) that may go to ``frontends``
        (others may come too). Raises ``OSError`` if the kernel refuses to list them."""
        return await asyncio.to_thread(self._udp_flows, family, frontends)

    def _udp_flows(self, family: str, frontends: Collection[tuple[str, str]]) -> list[Flow]:
        number = ctnetlink.FAMILIES[family]
        with ctnetlink.CtSocket(self._netns) as sock:
            if len(frontends) > FEW_FRONTENDS:
                return sock.flows(number, ctnetlink.Wanted.of(frontends))
            found: dict[Flow, None] = {}  # a node port's dump and an address's may overlap
            for frontend in frontends:
                found.update(dict.fromkeys(sock.flows_to(number, frontend)))
            return list(found)

    async def delete(self, flows: Sequence[Flow]) -> int:
        """Delete ``flows``: how many the kernel deleted (one gone meanwhile is not). Raises
        ``OSError`` if it refuses to delete one for another reason."""
        return await asyncio.to_thread(self._delete, flows)

    def _delete(self, flows: Sequence[Flow]) -> int:
        with ctnetlink.CtSocket(self._netns) as sock:
            deleted, errors = sock.delete(flows)
        if errors:
            number = errors[0]
            log.warning("conntrack: %d UDP flows not deleted: %s", len(errors), os.strerror(number))
        return deleted

    async def clean_stale(
        self, frontends: Frontends, only: Iterable[tuple[str, str]] | None = None
    ) -> None:
        """Delete the stale UDP flows of ``only`` these frontends, or of every one: what to-nft
        and to-iptables do after each sync, as kube-proxy does, one family after the other.

        A family whose flows cannot be listed is not reconciled and not counted, as in
        kube-proxy, whose duration would otherwise time a failure that deleted nothing."""
        if not frontends:
            return
        asked = list(frontends) if only is None else [f for f in only if f in frontends]
        for family in FAMILIES:
            started = time.monotonic()
            six = family == "IPv6"
            wanted = [f for f in asked if not f[0] or (":" in f[0]) == six]
            try:
                flows = await self.udp_flows(family, wanted) if wanted else []
            except OSError as exc:
                log.warning("conntrack: cannot list the %s UDP flows: %s", family, exc)
                continue
            stale = stale_flows(flows, frontends, only)
            deleted = await self.delete(stale) if stale else 0
            seconds = time.monotonic() - started
            self._reconciled.setdefault(family, Reconciled()).observe(seconds, deleted)
            log.debug(
                "conntrack: %d %s UDP flows listed, %d stale, %d deleted, in %.3f s",
                len(flows),
                family,
                len(stale),
                deleted,
                seconds,
            )
