"""to-iptables' backend: its syncs (full and incremental), drift checks, flags and registration."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TextIO

from kpng.backends._conntrack import Conntrack
from kpng.backends._drift import Drift, named
from kpng.backends._healthchecks import UNHEALTHY_AFTER_S, HealthServers
from kpng.backends._kube_proxy import KubeProxyLeftovers
from kpng.backends._nfacct import COUNTERS, INVALID_DROPPED, LOCALHOST_ACCEPTED, Nfacct
from kpng.backends._node import (
    FAMILIES,
    Fam,
    FromNode,
    Options,
    add_arguments,
    add_sync_period,
    node_options,
    options_from_args,
)
from kpng.backends._samples import Sample
from kpng.backends._traffic import SERIES_LIMIT, TrafficCounters, read_paced
from kpng.backends._traffic import add_arguments as add_traffic_arguments
from kpng.backends.iptables.counting import (
    REFUSING_CHAINS,
    Key,
    counted_chain,
    counted_rules,
    saved_from_listing,
)
from kpng.backends.iptables.executing import (
    MODES,
    ROUTE_LOCALNET,
    Iptables,
    IptablesError,
    Tools,
    tools,
)
from kpng.backends.iptables.restore import FamilyTables, Plan, put_all, udp_frontends
from kpng.backends.iptables.rules import (
    FILTER,
    LARGE_CLUSTER_ENDPOINTS,
    NAT,
    TABLES,
    ChainKey,
    Contribution,
    contribute,
    jumps,
    localhost_nodeports,
)
from kpng.client import (
    Backend,
    BackendSpec,
    NodeState,
    NoReporting,
    ServiceEndpoints,
    ServiceKey,
    SyncReporter,
    object_name,
    register,
)

log = logging.getLogger(__name__)

FULL_SYNC_PERIOD_S = 3600.0
"""kube-proxy's: a full resync every hour, for edits to kpng's chains that no check sees."""

Changes = dict[Fam, dict[ServiceKey, Contribution | None]]

NFACCT_METRICS = {
    INVALID_DROPPED: (
        "kubeproxy_iptables_ct_state_invalid_dropped_packets_total",
        "packets dropped by iptables to work around conntrack problems",
    ),
    LOCALHOST_ACCEPTED: (
        "kubeproxy_iptables_localhost_nodeports_accepted_packets_total",
        "Number of packets accepted on nodeports of loopback interface",
    ),
}
"""kube-proxy's series of each nfacct object, with its help text."""


class IptablesBackend:
    """Programs the node-local state with iptables-restore, one family at a time.

    ``iptables`` is None for a dry run, which prints each family's restore input instead.
    ``kube_proxy``, if given, is looked at once after the first sync, to warn of kube-proxy's
    leftovers. ``nfacct``, if given, holds the counters of the INVALID drops and the localhost
    node ports (made at each full sync, read by ``metric_samples``), in the namespace
    ``iptables`` writes to.

    With ``options.traffic_counters``, the counted rules' packet counters (``counting.py``)
    are read every ``READ_PERIOD_S`` (one ``iptables-save -c`` per table and family, under the
    sync lock) for ``metric_samples``, at most ``traffic_series_limit`` service ports (and
    endpoints) of them; and a restore that rewrites counted chains of a table the last read
    saw is preceded by a read of that table, so that what its rules counted is not lost.
    """

    def __init__(
        self,
        *,
        iptables: Iptables | None,
        options: Options,
        from_node: FromNode | None = None,
        families: tuple[Fam, ...] = FAMILIES,
        conntrack: Conntrack | None = None,
        health: HealthServers | None = None,
        min_sync_period: float = 0.0,
        sync_period: float = 0.0,
        full_sync_period: float = FULL_SYNC_PERIOD_S,
        once: bool = False,
        output: TextIO | None = None,
        syncs: SyncReporter | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        kube_proxy: KubeProxyLeftovers | None = None,
        nfacct: Nfacct | None = None,
        traffic_series_limit: int = SERIES_LIMIT,
    ) -> None:
        self._iptables = iptables
        self._nfacct = nfacct if iptables is not None else None
        self._nfacct_refused = False
        self._last_rules: dict[Fam, dict[str, int]] = {}
        """Per family, the rules each table got in the last restore (none written: none)."""
        self._traffic = (
            TrafficCounters(traffic_series_limit, endpoints=options.endpoint_counters)
            if options.traffic_counters and iptables is not None
            else None
        )
        self._traffic_reader: asyncio.Task[None] | None = None
        self._kube_proxy = kube_proxy
        self._options = options
        self._from_node = from_node or FromNode()
        self._families = families
        self._conntrack = conntrack
        self._health = health
        self._once = once
        self._output = output or sys.stdout
        self._syncs = syncs or NoReporting()
        self._clock = clock
        self._sleep = sleep
        self._min_sync_period = min_sync_period
        self._sync_period = sync_period
        self._full_sync_period = full_sync_period
        self._last_sync = -math.inf
        self._last_full = -math.inf
        self._revision = 0
        self._lock = asyncio.Lock()
        """One sync at a time: an apply, or a resync of the rules' monitor."""
        self._monitor: asyncio.Task[None] | None = None
        self.pending_since: float | None = None
        """Monotonic time since when the kernel's rules have been behind the state."""
        if health is not None:
            health.proxy_healthy = self._rules_current
        self.tables = {fam: FamilyTables(fam, options) for fam in families}
        self._recorded: dict[ServiceKey, ServiceEndpoints] = {}
        self._node_ips: tuple[str, ...] = ()
        self._needs_full = True
        self._route_localnet = False
        """Whether route_localnet was seen to, once, for node ports on 127.0.0.1."""
        self._comments = True
        """False in kube-proxy's large cluster mode (``rules.LARGE_CLUSTER_ENDPOINTS``)."""

    async def applied_rules(self) -> str:
        """The nat and filter tables of each family as iptables-save prints them: the rules
        the last applied restore left, among the node's others."""
        if self._iptables is None:
            return "# a dry run applies nothing\n"
        parts = []
        for fam in self._families:
            for table in ("nat", "filter"):
                parts.append(f"# {self._iptables.tools.command(fam, 'save')} -t {table}\n")
                parts.append(await self._iptables.save_text(fam, table))
        return "".join(parts)

    def _rules_current(self) -> bool:
        since = self.pending_since
        return since is None or self._clock() - since < UNHEALTHY_AFTER_S

    async def apply(self, state: NodeState) -> bool:
        # kube-proxy's --min-sync-period: the feeder coalesces the states that arrive meanwhile.
        wait = self._last_sync + self._min_sync_period - self._clock()
        if wait > 0 and self._iptables is not None:
            await self._sleep(wait)
        async with self._lock:
            try:
                done = await self._apply(state)
            finally:
                await self._warn_about_kube_proxy()
        if self._sync_period > 0 and self._iptables is not None and self._monitor is None:
            self._monitor = asyncio.create_task(self._watch_rules(), name="iptables-monitor")
        if self._traffic is not None and self._traffic_reader is None:
            self._traffic_reader = asyncio.create_task(self._read_traffic(), name="ipt-counters")
        return done

    async def _warn_about_kube_proxy(self) -> None:
        """Once, after the first sync (done or refused): the first full sync takes kube-proxy's
        chains of kpng's variant over, marking them kpng's, so only what stays kube-proxy's
        (the other variant's chains, its canaries, its other modes' leftovers) is named."""
        if self._kube_proxy is not None:
            leftovers, self._kube_proxy = self._kube_proxy, None
            await leftovers.warn()

    async def _apply(self, state: NodeState) -> bool:
        self._last_sync = self._clock()
        if self._needs_full:
            await self._ensure_counters()
        options = node_options(self._options, self._from_node, state)
        if options != self.tables[self._families[0]].options or state.node_ips != self._node_ips:
            # The node's addresses and pod CIDRs are in every service's rules.
            self._node_ips = state.node_ips
            for tables in self.tables.values():
                tables.options = options
            self._recorded.clear()
            self._needs_full = True
        endpoints = sum(len(se.endpoints) * len(se.service.Ports) for se in state.services.values())
        comments = endpoints <= LARGE_CLUSTER_ENDPOINTS
        if comments != self._comments:
            # In every service's endpoint chains: all are written anew.
            log.info(
                "%d endpoints: endpoint chains %s comments (kube-proxy's large cluster mode "
                "above %d)",
                endpoints,
                "with" if comments else "without",
                LARGE_CLUSTER_ENDPOINTS,
            )
            self._comments = comments
            self._recorded.clear()
            self._needs_full = True
        await self._ensure_route_localnet(options)
        full = self._needs_full
        changes, sources = self._changes(state, everything=full)
        touched = set() if full or self._conntrack is None else self._touched_frontends(changes)
        try:
            await self._sync_families(changes, full=full)
        except IptablesError as exc:
            if self.pending_since is None:
                self.pending_since = self._clock()
            kind = "full" if full else "partial"
            raise IptablesError(
                f"{exc} (the {kind} sync was refused; the previous rules stay, and a "
                "full resync follows)"
            ) from exc
        put_all(self._recorded, sources)
        self._revision = state.revision
        self._syncs.synced(revision=state.revision)
        self.pending_since = None
        if self._health is not None:
            await self._health.follow(options.nodeport_addresses)
            await self._health.update(state.services)
        await self._clean_conntrack(None if full else touched)
        return self._once

    async def _ensure_counters(self) -> None:
        """As kube-proxy at each full sync: make the nfacct objects its rules count into; the
        rules name those the kernel made (none without nfnetlink_acct, said once)."""
        if self._nfacct is None:
            return
        made = set()
        for name in COUNTERS:
            try:
                await asyncio.to_thread(self._nfacct.ensure, name)
            except OSError as exc:
                if not self._nfacct_refused:
                    log.warning(
                        "%s: rules without the nfacct match, and no %s on /metrics",
                        exc,
                        NFACCT_METRICS[name][0],
                    )
                continue
            made.add(name)
        self._nfacct_refused = len(made) < len(COUNTERS)
        if frozenset(made) != self._options.nfacct:
            self._options = dataclasses.replace(self._options, nfacct=frozenset(made))

    def _nfacct_samples(self) -> list[Sample]:
        """kube-proxy's iptables mode's nfacct series, read from the kernel now (a netlink
        request per object: microseconds, on the scrape's thread), for the objects the last
        full sync made; none if a read fails, as kube-proxy skips it."""
        if self._nfacct is None:
            return []
        samples = []
        for name in sorted(self._options.nfacct):
            try:
                packets = self._nfacct.packets(name)
            except OSError as exc:
                log.debug("nfacct %s: %s", name, exc)
                continue
            if packets is not None:
                metric, text = NFACCT_METRICS[name]
                samples.append(Sample(metric, text, packets, counter=True))
        return samples

    async def _ensure_route_localnet(self, options: Options) -> None:
        """As kube-proxy at start: node ports on 127.0.0.1 need route_localnet. Not fatal: an
        unprivileged kpng relies on a privileged init (``kpng kube-proxy --init-only``)."""
        if self._route_localnet or self._iptables is None or "v4" not in self._families:
            return
        if not localhost_nodeports(options, "v4"):
            return
        self._route_localnet = True
        try:
            if await self._iptables.ensure_route_localnet():
                log.info("set %s to 1 for node ports on 127.0.0.1", ROUTE_LOCALNET)
        except IptablesError as exc:
            log.warning("%s: node ports on 127.0.0.1 do not answer", exc)

    def _changes(
        self, state: NodeState, *, everything: bool
    ) -> tuple[Changes, dict[ServiceKey, ServiceEndpoints | None]]:
        """Each family's new contributions of the services that changed (of every one when
        ``everything``), None for a service that went; and what they were made from, to record
        once the kernel has them."""
        changes: Changes = {f: {} for f in self._families}
        sources: dict[ServiceKey, ServiceEndpoints | None] = {}
        gone = set(state.deleted)
        if everything:
            gone |= {key for t in self.tables.values() for key in t.contributions} - set(
                state.services
            )
        for key in gone:
            sources[key] = None
            for fam in self._families:
                changes[fam][key] = None
        for key in state.services if everything else state.updated:
            se = state.services[key]
            if not everything and self._recorded.get(key) == se:
                continue
            sources[key] = se
            problems: set[str] = set()
            for fam in self._families:
                contribution = contribute(
                    se, fam, self.tables[fam].options, self._node_ips, comments=self._comments
                )
                changes[fam][key] = contribution
                problems.update(contribution.problems)
            for problem in sorted(problems):
                log.warning("service %s: %s (skipped)", object_name(*key), problem)
        return changes, sources

    async def _sync_families(self, changes: Changes, *, full: bool) -> None:
        """Every family's sync, reported as one; a failure leaves the next sync full."""
        started = time.monotonic()
        try:
            for fam in self._families:
                await self._sync(fam, changes[fam], full=full)
        except IptablesError:
            self._syncs.failed()
            self._needs_full = True
            raise
        finally:
            self._syncs.attempted(seconds=time.monotonic() - started, full=full)
        self._needs_full = False
        if full:
            self._last_full = self._clock()

    async def _watch_rules(self) -> None:
        """kube-proxy's sync period: every period, check that kpng's chains still hold what kpng
        wrote (``_drift``), and rewrite every rule from the last state when another program
        changed them (or a resync failed, or an hour has passed since the last full sync). A
        state that fails to apply is not this loop's to retry: the Feeder does, with the
        state."""
        assert self._iptables is not None
        while True:
            await asyncio.sleep(self._sync_period)
            try:
                await self.check_kernel(self._iptables)
            except IptablesError as exc:
                log.error("resync of the rules failed: %s; retrying in %gs", exc, self._sync_period)

    async def check_kernel(self, iptables: Iptables) -> Drift | None:
        """One period's check: what another program changed, as (kind, what was found), once
        repaired (or None); the hourly and the failed full syncs run here too."""
        # Under the lock: a sync meanwhile changes how many rules its services' chains hold.
        async with self._lock:
            if self.pending_since is not None:
                return None
            drift = None if self._needs_full else await self._drift(iptables)
            if drift is not None:
                reason = drift.detail
            elif self._needs_full:
                reason = "the last resync failed"
            elif self._clock() - self._last_full >= self._full_sync_period:
                reason = "the hourly full resync"
            else:
                return None
            log.warning("rewriting every rule: %s", reason)
            if drift is not None:
                self._syncs.diverged(kind=drift.kind, detail=drift.detail)
            # A program that flushed kpng's rules may have deleted the objects they name too.
            await self._ensure_counters()
            await self._sync_families({f: {} for f in self._families}, full=True)
            self._syncs.synced(revision=self._revision)
        return drift

    async def _drift(self, iptables: Iptables) -> Drift | None:
        """What another program changed in kpng's rules, from one iptables-save per table (the
        jumps check needs them anyway): a jump gone from a built-in chain, one of kpng's chains
        gone, or one holding more or fewer rules than kpng wrote (flushed, or a foreign rule)."""
        for fam in self._families:
            expected = _expected_counts(self.tables[fam])
            wanted = jumps(self.tables[fam].options, fam)
            for table in TABLES:
                saved = await iptables.save(fam, table)
                if any(j[0] == table and j[1:] not in saved.rules for j in wanted):
                    return Drift(
                        "jumps",
                        f"another program removed kpng's jumps from the {fam} built-in chains",
                    )
                ours = {chain: n for (t, chain), n in expected.items() if t == table}
                gone = sorted(chain for chain in ours if chain not in saved.chains)
                if gone:
                    return Drift("chain", f"{fam} {table} chains {named(gone)} are gone")
                changed = sorted(c for c, n in ours.items() if saved.counts.get(c, 0) != n)
                if changed:
                    counts = named(
                        [f"{c} ({saved.counts.get(c, 0)} rules, not {ours[c]})" for c in changed]
                    )
                    return Drift(
                        "rules",
                        f"rules were added to or removed from {fam} {table} chains {counts}",
                    )
        return None

    async def _sync(
        self, fam: Fam, changes: Mapping[ServiceKey, Contribution | None], *, full: bool
    ) -> None:
        tables = self.tables[fam]
        if self._iptables is None:
            plan = tables.plan(changes, present=set() if full else None)
            if plan.text:
                self._output.write(f"# {fam}\n{plan.text}")
                self._output.flush()
            tables.commit(changes, plan)
            return
        present, missing = None, set()
        if full:
            nat = await self._iptables.save(fam, "nat")
            present = nat.chains
            missing = await self._iptables.missing_jumps(fam, nat, jumps(tables.options, fam))
        plan = tables.plan(changes, present=present, missing_jumps=missing)
        if plan.text:
            await self._count_before(self._iptables, fam, plan)
            await self._iptables.restore(fam, plan.text)
            self._restart_counters(fam, plan)
        tables.commit(changes, plan)
        self._last_rules[fam] = rules_by_table(plan.text)
        log.debug(
            "%s: a %s restore of %d rules (%d service chains written, %d deleted)",
            fam,
            "full" if plan.full else "partial",
            plan.rules,
            plan.written,
            plan.deleted,
        )

    async def _read_traffic(self) -> None:
        # iptables-legacy reads a whole table per save (0.8 s for 10k services' nat table):
        # reads are spaced to hold the sync lock a tenth of the time at most.
        await read_paced(self.read_traffic, sleep=self._sleep, failure=IptablesError, log=log)

    async def read_traffic(self) -> None:
        """Read the counted rules' counters (``counting.py``) of every family and table."""
        if self._traffic is None or self._iptables is None:
            return
        async with self._lock:
            await self._count(self._iptables, [(f, t) for f in self._families for t in TABLES])

    async def _count(self, iptables: Iptables, tables: list[tuple[Fam, str]]) -> None:
        """One read of ``tables`` (family, table), the others' last reads kept."""
        saved = [(f, t, await iptables.save_text(f, t, counters=True)) for f, t in tables]
        scope = set(tables)
        self._fold(saved, lambda key: key[:2] in scope)

    def _fold(self, saved: list[tuple[Fam, str, str]], within: Callable[[Key], bool]) -> None:
        """Fold what ``saved`` (family, table, as ``iptables-save -c`` prints it) counted:
        ``within``, the counters it covers."""
        traffic = self._traffic
        assert traffic is not None
        counts: list[tuple[Key, tuple[str, str], int]] = []
        for fam, table, text in saved:
            chains = {
                chain: port
                for contribution in self.tables[fam].contributions.values()
                for chain, port in contribution.endpoint_chains.items()
            }
            counts += counted_rules(fam, table, text, chains, endpoints=traffic.endpoints)
        traffic.fold(counts, within=within)  # type: ignore[arg-type]

    async def _count_before(self, iptables: Iptables, fam: Fam, plan: Plan) -> None:
        """Read what ``plan`` is about to restart, if a read saw it: before a full restore,
        every counter (rare: at start nothing was read yet, then hourly or after drift); before
        a partial one, the shared chains counting refused connections that it rewrites (any
        Service added or gone rewrites them). Not a service's own KUBE-SEP chains: a read of
        them is one of the whole nat table (seconds at 10k services), and a service's own
        changes lose at most a read period's worth, as to-nft's elements."""
        traffic = self._traffic
        if traffic is None or not traffic.counted():
            return
        if plan.full:
            await self._count(iptables, [(fam, NAT), (fam, FILTER)])
            return
        chains = sorted(REFUSING_CHAINS & plan.declared)
        listed = [
            (fam, t, saved_from_listing(await iptables.list_counted(fam, t, c))) for t, c in chains
        ]
        if listed:
            scope = {(fam, t, c) for t, c in chains}
            self._fold(listed, lambda key: key[:3] in scope)

    def _restart_counters(self, fam: Fam, plan: Plan) -> None:
        """The kernel took ``plan``: the counters of the chains it flushed restarted."""
        traffic = self._traffic
        if traffic is None:
            return
        declared = {(t, c) for t, c in plan.declared if counted_chain((t, c))}
        traffic.restarted(
            [key for key in traffic.counted() if key[0] == fam and key[1:3] in declared]  # type: ignore[index]
        )

    def metric_samples(self) -> list[Sample]:
        """What kpng's ``/metrics`` adds for to-iptables (``kpng.status.ReportsSamples``): the
        rule counts and nfacct series of kube-proxy's iptables mode, and each service port's
        new and refused connections (and each endpoint's) as of the last read (none unless
        ``--traffic-counters``)."""
        traffic = self._traffic.samples() if self._traffic is not None else []
        return [*self._rule_samples(), *self._nfacct_samples(), *traffic]

    def _rule_samples(self) -> list[Sample]:
        """kube-proxy's counts of the rules it owns and of those its last restore wrote, per
        table and family (its filter table's rules are all rewritten at each sync, kpng's
        only when they change: ``_last`` is what kpng's last restore wrote)."""
        samples = []
        for fam, written in sorted(self._last_rules.items()):
            family = "IPv4" if fam == "v4" else "IPv6"
            owned: dict[str, int] = {}
            for (table, _), count in _expected_counts(self.tables[fam]).items():
                owned[table] = owned.get(table, 0) + count
            for table in ("filter", "nat"):
                labels = (("table", table), ("ip_family", family))
                samples.append(
                    Sample(RULES_TOTAL, RULES_TOTAL_HELP, owned.get(table, 0), labels=labels)
                )
                samples.append(
                    Sample(RULES_LAST, RULES_LAST_HELP, written.get(table, 0), labels=labels)
                )
        return samples

    def _touched_frontends(
        self, changes: Mapping[Fam, Mapping[ServiceKey, Contribution | None]]
    ) -> set[tuple[str, str]]:
        """The UDP frontends whose serving endpoints ``changes`` alter (read before they are
        committed), as to-nft finds them."""
        touched: set[tuple[str, str]] = set()
        for fam, new in changes.items():
            old = self.tables[fam].contributions
            for key, contribution in new.items():
                before = old[key].udp_frontends if key in old else {}
                after = contribution.udp_frontends if contribution is not None else {}
                touched.update(f for f, serving in after.items() if before.get(f) != serving)
        return touched

    async def _clean_conntrack(self, only: set[tuple[str, str]] | None) -> None:
        """Delete the stale UDP flows of ``only`` these frontends (of every one after a full
        sync, as kube-proxy at start)."""
        if self._conntrack is None or only == set():
            return
        frontends = udp_frontends(
            c for tables in self.tables.values() for c in tables.contributions.values()
        )
        await self._conntrack.clean_stale(frontends, only)

    async def close(self) -> None:
        for task in (self._monitor, self._traffic_reader):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._health is not None:
            await self._health.close()


RULES_TOTAL = "kubeproxy_sync_proxy_rules_iptables_total"
RULES_TOTAL_HELP = "Total number of iptables rules owned by kube-proxy"
RULES_LAST = "kubeproxy_sync_proxy_rules_iptables_last"
RULES_LAST_HELP = "Number of iptables rules written by kube-proxy in last sync"


def rules_by_table(restore_input: str) -> dict[str, int]:
    """How many rules (``-A`` lines) an iptables-restore input appends to each table."""
    counts: dict[str, int] = {}
    table = ""
    for line in restore_input.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith("-A "):
            counts[table] = counts.get(table, 0) + 1
    return counts


def _expected_counts(tables: FamilyTables) -> dict[ChainKey, int]:
    """How many rules kpng last wrote into each of its chains of one family (the shared
    chains only once a sync has written them all: unknown before)."""
    expected = {key: len(rules) for key, rules in tables.shared.items()}
    for contribution in tables.contributions.values():
        expected.update((key, len(rules)) for key, rules in contribution.chains.items())
    return expected


async def cleanup(prefix: Sequence[str] = ()) -> bool:
    """Remove kpng's chains and jumps from both variants and both families; True if any."""
    found = False
    for variant in ("nft", "legacy"):
        iptables = Iptables(Tools(variant), prefix=prefix)
        for fam in FAMILIES:
            try:
                found = await iptables.remove(fam) or found
            except IptablesError as exc:
                log.debug("iptables-%s %s: %s", variant, fam, exc)
    return found


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument(
        "--iptables-mode",
        choices=MODES,
        default="auto",
        help="iptables-nft or iptables-legacy: the one the node's other rules are in "
        "(default: auto, what the iptables command is)",
    )
    parser.add_argument(
        "--localhost-nodeports",
        action="store_true",
        help="serve IPv4 node ports on 127.0.0.1 too, as kube-proxy's iptables mode "
        "(localhostNodePorts): sets net.ipv4.conf.all.route_localnet to 1 and drops what "
        "reaches 127.0.0.0/8 from elsewhere; only when --nodeport-addresses lets loopback in "
        "(as it does when not given)",
    )
    parser.add_argument(
        "--no-drop-invalid",
        action="store_true",
        help="do not drop forwarded packets conntrack finds INVALID, as kube-proxy's iptables "
        "mode when nf_conntrack_tcp_be_liberal is set (conntrack.tcpBeLiberal)",
    )
    add_sync_period(parser, checks="that kpng's jumps are still in the built-in chains")
    add_traffic_arguments(
        parser,
        where="from the packet counters of the KUBE-SEP chains' DNAT rules and the "
        "filter table's REJECT and DROP rules",
    )


def _create(args: argparse.Namespace, syncs: SyncReporter) -> Backend:
    options, from_node = options_from_args(args)
    # kube-proxy's "primary" never holds loopback: with it alone, no node port on 127.0.0.1.
    loopback = not (from_node.primary_nodeports and not options.nodeport_addresses)
    localhost = args.localhost_nodeports and loopback
    options = dataclasses.replace(
        options,
        drop_invalid=not args.no_drop_invalid,
        localhost_nodeports=localhost,
        traffic_counters=args.traffic_counters != "off",
        endpoint_counters=args.traffic_counters == "endpoint",
    )
    if args.localhost_nodeports and not localhost_nodeports(options, "v4"):
        log.warning(
            "--localhost-nodeports: --nodeport-addresses leaves 127.0.0.1 out; no node port "
            "answers there"
        )
    iptables = None
    if not args.dry_run:
        iptables = Iptables(tools(args.iptables_mode))
    return IptablesBackend(
        iptables=iptables,
        options=options,
        from_node=from_node,
        conntrack=None if args.no_conntrack or args.dry_run else Conntrack(),
        health=None if args.no_health_check or args.dry_run else HealthServers(),
        min_sync_period=args.min_sync_period,
        sync_period=0.0 if args.once else args.sync_period,
        once=args.once,
        syncs=syncs,
        kube_proxy=None if args.dry_run else KubeProxyLeftovers(),
        nfacct=None if args.dry_run else Nfacct(),
        traffic_series_limit=args.traffic_series_limit,
    )


SPEC = register(
    BackendSpec(
        name="iptables",
        help="program the node-local state as kube-proxy's iptables rules (iptables-nft or "
        "-legacy), rewriting only the chains of the services that changed",
        add_arguments=_add_arguments,
        create=_create,
        reports_syncs=True,
        proxy_mode="iptables",
        cleanup=cleanup,
        once=lambda args: bool(args.once),
    )
)
