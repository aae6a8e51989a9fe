"""Stale UDP conntrack flows, by kube-proxy's rule, and the conntrack tool that deletes them.

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

``parse_flows`` reads ``conntrack -L -p udp`` output; ``stale_filters`` gives the ``conntrack -D``
filters of the flows to delete, one per distinct (frontend, endpoint), as kube-proxy's (both
pure); ``Conntrack`` runs the tool. Every backend that DNATs UDP uses them.

Each reconciliation is timed and its deletions counted per family in ``RECONCILED``, kube-proxy's
``conntrack_reconciler_sync_duration_seconds`` and ``conntrack_reconciler_deleted_entries_total``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kpng.backends._commands import CommandError, run_command

Frontends = Mapping[tuple[str, str], frozenset[tuple[str, str]]]
"""(service address, or "" for a node port; port) -> (endpoint address, port) serving it."""


class Flow(NamedTuple):
    """What the rule reads of a UDP conntrack entry."""

    orig_dst: str
    orig_dport: str
    reply_src: str
    reply_sport: str


def parse_flows(listing: str) -> list[Flow]:
    """The UDP flows of ``conntrack -L`` output: the first ``src``/``dst``/``sport``/``dport`` of a
    line are the original direction, the second the reply."""
    flows = []
    for line in listing.splitlines():
        fields = line.split()
        if not fields or fields[0] != "udp":
            continue
        seen: dict[str, list[str]] = {}
        for item in fields:
            name, eq, value = item.partition("=")
            if eq:
                seen.setdefault(name, []).append(value)
        try:
            flows.append(Flow(seen["dst"][0], seen["dport"][0], seen["src"][1], seen["sport"][1]))
        except (KeyError, IndexError):
            continue  # not a complete entry: nothing to match
    return flows


def stale_filters(
    flows: Iterable[Flow], frontends: Frontends, only: Iterable[tuple[str, str]] | None = None
) -> list[list[str]]:
    """The ``conntrack -D`` filters deleting the stale ``flows`` (sorted, each once), for
    ``only`` these frontends or every one."""
    if only is not None:
        frontends = {front: frontends[front] for front in only if front in frontends}
    filters: set[tuple[str, ...]] = set()
    for flow in flows:
        endpoint = (flow.reply_src, flow.reply_sport)
        family = ("-f", "ipv6") if ":" in flow.reply_src else ()
        port = ("--orig-port-dst", flow.orig_dport)
        reply = ("--reply-src", flow.reply_src, "--reply-port-src", flow.reply_sport)
        serving = frontends.get((flow.orig_dst, flow.orig_dport))
        if serving is not None and endpoint not in serving:
            filters.add((*family, "-p", "udp", "--orig-dst", flow.orig_dst, *port, *reply))
        serving = frontends.get(("", flow.orig_dport))
        if serving and endpoint not in serving:
            filters.add((*family, "-p", "udp", *port, *reply))
    return [list(f) for f in sorted(filters)]


log = logging.getLogger(__name__)

RECONCILE_BUCKETS_S = tuple(0.001 * 2**i for i in range(15))
"""kube-proxy's buckets of ``conntrack_reconciler_sync_duration_seconds``: 1 ms to 16 s,
doubling."""

FAMILIES = (("ipv4", "IPv4"), ("ipv6", "IPv6"))
"""Each family as the conntrack tool names it (``-f``) and as kube-proxy's ``ip_family`` does."""


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

_DELETED = re.compile(r"(\d+) flow entr(?:y|ies) (?:has|have) been deleted")


class Conntrack:
    """Lists and deletes conntrack entries with the ``conntrack`` tool (conntrack-tools), and
    records each family's reconciliations in ``reconciled`` (default: the process's)."""

    def __init__(
        self, conntrack: str = "conntrack", reconciled: dict[str, Reconciled] | None = None
    ) -> None:
        self._conntrack = conntrack
        self._reconciled = RECONCILED if reconciled is None else reconciled

    async def udp_flows(self, family: str) -> list[Flow] | None:
        """The UDP flows of ``family`` (``ipv4``, ``ipv6``); None, logged, if the tool refused
        to list them. Raises ``CommandError`` if it cannot run."""
        rc, out, err = await run_command([self._conntrack, "-L", "-p", "udp", "-f", family])
        if rc != 0:
            log.warning("conntrack -L -f %s failed: %s", family, err.strip())
            return None
        return parse_flows(out)

    async def clean_stale(
        self, frontends: Frontends, only: Iterable[tuple[str, str]] | None = None
    ) -> None:
        """Delete the stale UDP flows of ``only`` these frontends, or of every one: what to-nft
        and to-iptables do after each sync, as kube-proxy does, one family after the other.

        A family whose flows cannot be listed is not reconciled and not counted, as in
        kube-proxy, whose duration would otherwise time a failure that deleted nothing."""
        if not frontends:
            return
        for tool_family, family in FAMILIES:
            started = time.monotonic()
            try:
                flows = await self.udp_flows(tool_family)
            except CommandError as exc:
                log.warning("cannot list the UDP conntrack flows: %s", exc)
                return  # nor the other family: the tool is not there
            if flows is None:
                continue
            filters = stale_filters(flows, frontends, only)
            deleted = 0
            for f in filters:
                deleted += await self.delete(f)
            seconds = time.monotonic() - started
            self._reconciled.setdefault(family, Reconciled()).observe(seconds, deleted)
            log.debug(
                "conntrack: %d %s UDP flows listed, %d filters deleted %d stale ones, in %.3f s",
                len(flows),
                family,
                len(filters),
                deleted,
                seconds,
            )

    async def delete(self, filters: Sequence[str]) -> int:
        """``conntrack -D FILTERS``: the flows it deleted, as it says (0 if it does not).
        Finding nothing to delete is not an error."""
        try:
            rc, _, err = await run_command([self._conntrack, "-D", *filters])
        except CommandError as exc:
            log.warning("cannot delete UDP conntrack flows: %s", exc)
            return 0
        # conntrack exits 1 with "0 flow entries have been deleted" when nothing matched.
        if rc != 0 and "0 flow entries" not in err:
            log.warning("conntrack -D %s failed: %s", " ".join(filters), err.strip())
        said = _DELETED.search(err)
        return int(said.group(1)) if said else 0
