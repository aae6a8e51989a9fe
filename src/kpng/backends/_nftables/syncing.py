"""The nftables engine's backend: ``NftBackend`` applies each node-local state to kpng's table
(``inet kpng``), checks the kernel still holds it, and repairs drift; with the clean-up of the
table and of kube-proxy's leftovers. The package's face (``__init__.py``) says how the engine's
modules fit together."""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TextIO

from kpng.backends._conntrack import Conntrack
from kpng.backends._drift import Drift
from kpng.backends._healthchecks import UNHEALTHY_AFTER_S, HealthServers
from kpng.backends._kube_proxy import KubeProxyLeftovers
from kpng.backends._nftables.auditing import (
    Inspects,
    applied_by_container,
    comparable,
    compare_elements,
    compare_rules,
    compare_shapes,
    expected_elements,
    expected_shape,
    missing_elements,
    probes,
)
from kpng.backends._nftables.counting import SERIES_LIMIT, Sample, TrafficCounters
from kpng.backends._nftables.diffing import Plan, TableState, Touched, check_transaction
from kpng.backends._nftables.executing import KernelNft, NetlinkBatches, default_nft
from kpng.backends._nftables.layout import (
    COUNTED_KINDS,
    TABLE,
    Contribution,
    ElementKey,
    FromNode,
    Options,
    contribute,
    counted_endpoint_map,
)
from kpng.backends._nftables.localhost import LocalhostProxy, listeners
from kpng.backends._nftables.netlink import (
    FreshTable,
    dispatch_key,
    element_counters,
    split_fresh,
)
from kpng.backends._nftables.nftables import Nft, NftError, Table, TableObjects, Transaction
from kpng.backends._node import FAMILIES, node_options
from kpng.backends._node import options_from_args as options_from_args
from kpng.backends._traffic import read_paced
from kpng.client import (
    NodeState,
    NoReporting,
    ServiceEndpoints,
    ServiceKey,
    SyncReporter,
    object_name,
)
from kpng.gcpause import collector_paused

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]

FULL_CHECK_PERIOD_S = 3600.0
"""How often every element of kpng's table is compared with what kpng applied (kube-proxy
rewrites its rules every hour), for the changes the period's checks do not see: an element
deleted, added or changed alone."""


class NftBackend:
    """Programs each state it is given; see the module docstring.

    ``nft`` runs transactions (``LibNft`` or ``KernelNft``, ``FakeNft`` in tests);
    ``conntrack`` deletes stale UDP entries (None: not at all); ``kube_proxy``, if given, is
    looked at once before the first sync, to warn of kube-proxy's leftovers; ``dry_run`` writes each
    transaction to ``output`` instead; ``once`` makes ``apply`` return True once the first
    complete state is applied.

    A refused transaction is followed at once by a full sync without the services the kernel
    refuses on their own (found by bisection, logged by name and reported as refused); if that
    fails too, ``apply`` fails with an ``NftError`` saying what nft refused, the previous rules
    left in place, and kpng's Feeder retries with backoff (or as soon as a newer state comes):
    the next attempt is a full sync from the whole desired state, whatever failed (building the
    transaction included).

    Every ``sync_period`` (0: never) a drift check (``auditing.py``) finds what other programs
    changed in kpng's table and repairs it with a full sync, reporting the divergence until
    then; every ``full_check_period`` every element is compared too, for changes no cheaper
    check sees.
    With ``options.traffic_counters``, the dispatch maps' element counters are read every
    ``READ_PERIOD_S`` (``counting.py``) for ``metric_samples``, at most ``traffic_series_limit``
    service ports of them.
    ``pending_since`` says since when (``time.monotonic()``) the kernel has been behind (None
    when it is not): the health check node ports answer by it.

    ``localhost``, if given, serves TCP node ports on loopback (``localhost.py``): its listeners
    follow each state the kernel took, as kube-proxy's follow its nftables transactions.
    """

    def __init__(
        self,
        *,
        nft: Nft,
        options: Options,
        from_node: FromNode | None = None,
        min_sync_period: float = 0.0,
        conntrack: Conntrack | None = None,
        health: HealthServers | None = None,
        once: bool = False,
        dry_run: bool = False,
        output: TextIO | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        syncs: SyncReporter | None = None,
        kube_proxy: KubeProxyLeftovers | None = None,
        netlink: NetlinkBatches | None = None,
        sync_period: float = 0.0,
        full_check_period: float = FULL_CHECK_PERIOD_S,
        inspect: Inspects | None = None,
        localhost: LocalhostProxy | None = None,
        traffic_series_limit: int = SERIES_LIMIT,
    ) -> None:
        self._nft = nft
        self._localhost = localhost
        self._netlink = netlink
        self._inspect = inspect if inspect is not None else netlink
        self._sync_period = sync_period
        self._full_check_period = full_check_period
        self._monitor: asyncio.Task[None] | None = None
        self._traffic = (
            TrafficCounters(traffic_series_limit, endpoints=options.endpoint_counters)
            if options.traffic_counters
            else None
        )
        self._traffic_reader: asyncio.Task[None] | None = None
        self._traffic_keys: dict[str, dict[bytes, ElementKey | None]] = {}
        """The counted elements' keys by their kernel bytes (``_keyed``)."""
        self._generation: int | None = None
        """The ruleset's generation after kpng's last commit or drift check (None: unknown)."""
        self._applied_rules: dict[str, tuple[bytes, ...]] | None = None
        """Every chain's rules as the kernel held them after kpng's last commit (None:
        unknown)."""
        self._last_full = -math.inf
        self._refused: dict[ServiceKey, str] = {}
        """Services the kernel refused (left out until they change), with its words."""
        self._problems: dict[ServiceKey, str] = {}
        """Services whose rules cannot be written whole, with why (skipped in part or all)."""
        self._elements_by_netlink = True
        self._kube_proxy = kube_proxy
        self._conntrack = conntrack
        self._health = health
        self.pending_since: float | None = None
        self._syncs = syncs or NoReporting()
        """Its syncs as the kernel took them: a refused transaction may get through within the
        same apply, with the services the kernel refused left out."""
        self._revision = 0
        if health is not None:
            health.proxy_healthy = self._rules_current
        self._once = once
        self._dry_run = dry_run
        self._output = output or sys.stdout
        self._sleep = sleep
        self._clock = clock
        """Monotonic time: since when the kernel has been behind, and for how long."""
        # Exact doubling (no jitter spread): one node's kernel, no crowd to spread out.
        self.store = TableState(options)
        self._options = options
        self._count_endpoints = options.traffic_counters and options.endpoint_counters
        self._from_node = from_node or FromNode()
        self._min_sync_period = min_sync_period
        self._last_sync = -math.inf
        self._node_ips: tuple[str, ...] = ()
        self._recontribute = False
        self._recorded: dict[ServiceKey, ServiceEndpoints] = {}
        self._needs_full = True
        self._lock = asyncio.Lock()

    async def apply(self, state: NodeState) -> bool:
        self._follow_node(state)
        # kube-proxy's --min-sync-period: the feeder coalesces the states that arrive meanwhile.
        wait = self._last_sync + self._min_sync_period - time.monotonic()
        if wait > 0 and not self._dry_run:
            await self._sleep(wait)
        self._last_sync = time.monotonic()
        self._revision = state.revision
        with collector_paused():
            touched = self._record(state)
        if self._dry_run:
            plan = self._plan(touched)
            self._output.write(
                f"# revision {state.revision}: {_named(touched.services)}\n{plan.tx.render()}"
            )
            self._output.flush()
            self.store.commit(plan)
            self._needs_full = False
            self._syncs.synced(revision=state.revision)
            return self._once
        if self._kube_proxy is not None:
            # Once, before the first sync: kube-proxy's leftovers would act beside it.
            leftovers, self._kube_proxy = self._kube_proxy, None
            await leftovers.warn()
        refused = await self._sync(touched)
        if self._localhost is not None and refused is None:
            await self._localhost.sync(listeners(state.services, self.store.options))
        if self._sync_period > 0 and self._inspect is not None and self._monitor is None:
            self._monitor = asyncio.create_task(self._watch_kernel(), name="nft-drift-check")
        if self._traffic is not None and self._netlink is not None and self._traffic_reader is None:
            self._traffic_reader = asyncio.create_task(self._read_traffic(), name="nft-counters")
        if self._health is not None:
            await self._health.follow(self.store.options.nodeport_addresses)
            await self._health.update(state.services)
        if refused is not None:
            raise refused
        return self._once

    def _follow_node(self, state: NodeState) -> None:
        """Re-render the skeleton (a full sync) when the node's IPs or pod CIDRs change what it
        holds: kube-proxy restarts for that."""
        options = node_options(self._options, self._from_node, state)
        if state.node_ips != self._node_ips:
            # Load-balancer source ranges holding the node's IP allow its LB IPs too: every
            # service is contributed anew.
            self._node_ips = state.node_ips
            self._recorded.clear()
            self._recontribute = True
        if options != self.store.options:
            if self.store.contributions:
                log.info(
                    "node %s changed its addresses or pod CIDRs, or the ServiceCIDRs changed: "
                    "full resync",
                    state.node,
                )
            self.store.options = options
            self._needs_full = True

    def _record(self, state: NodeState) -> Touched:
        """Record the services of ``state`` that changed in the store; what they touched."""
        touched = Touched(whole=self._needs_full)
        for key in state.deleted:
            self._recorded.pop(key, None)
            self._refused.pop(key, None)
            self._problems.pop(key, None)
            self.store.update(key, None, touched)
        updated = state.services.keys() if self._recontribute else state.updated
        self._recontribute = False
        for key in updated:
            se = state.services[key]
            # A service sent again unchanged (a client's reconnection resends every one) costs
            # a comparison, not a new contribution.
            if self._recorded.get(key) == se:
                continue
            self._recorded[key] = se
            self._refused.pop(key, None)
            try:
                contribution: Contribution | None = contribute(
                    se, self._node_ips, count_endpoints=self._count_endpoints
                )
            except Exception:
                # A service kpng cannot render is one service lost, not the node's rules.
                log.exception("service %s: cannot render its rules (skipped)", object_name(*key))
                contribution = Contribution(problems=["kpng could not render its rules"])
            assert contribution is not None
            for problem in contribution.problems:
                log.warning("service %s: %s (skipped)", object_name(*key), problem)
            if contribution.problems:
                self._problems[key] = "; ".join(contribution.problems)
            else:
                self._problems.pop(key, None)
            self.store.update(key, contribution, touched)
        for (container, ek), owners in self.store.conflicts(touched):
            log.warning(
                "%s element %s wanted differently by %s; %s wins",
                container,
                " . ".join(ek),
                ", ".join(object_name(*o) for o in owners),
                object_name(*owners[0]),
            )
        return touched

    def _plan(self, touched: Touched, present: TableObjects | None = None) -> Plan:
        if self._needs_full:
            return self.store.full(present)
        return self.store.incremental(touched)

    async def _sync(self, touched: Touched) -> NftError | None:
        """Apply ``touched`` (the whole desired state if a full sync is due); what nft refused
        (a full resync comes next), or None.

        A failure, whether nft refused the transaction or kpng could not build it, is
        followed at once by a full sync without the services the kernel refuses on their
        own, if there are any: one bad service never holds back the others' changes."""
        async with self._lock:
            started = time.monotonic()
            plan, error = await self._attempt(touched)
            if error is not None:
                self._syncs.failed()
                # Whatever failed, what follows starts from the whole desired state: the store
                # holds every service's contribution, the kernel may hold none of the change.
                self._needs_full = True
                if await self._leave_out_refused_services():
                    plan, error = await self._attempt(touched)
            full = plan is None or plan.full
            self._syncs.attempted(seconds=time.monotonic() - started, full=full)
            if error is not None:
                # The UDP flows this change makes stale are cleaned by the full resync's
                # reconciliation.
                if self.pending_since is None:
                    self.pending_since = self._clock()
                kind = "full" if full else "incremental"
                size = f" of {len(plan.tx)} operations" if plan is not None else ""
                then = "" if self._once else ", and a full resync follows"
                return NftError(
                    f"{error.message} (the {kind} transaction{size} was refused; the previous "
                    f"rules stay{then})",
                    line_number=error.line_number,
                    line=error.line,
                )
            assert plan is not None
            if self._traffic is not None:
                self._traffic.replaced(None if plan.full else _rewritten(plan, self.store))
            self.store.commit(plan)
            self._needs_full = False
            if plan.full:
                self._last_full = self._clock()
            self.pending_since = None
            await self._remember_kernel(plan)
            self._syncs.refused({**self._problems, **self._refused})
            self._syncs.synced(revision=self._revision)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "applied a %s transaction of %d operations: %s",
                    "full" if plan.full else "incremental",
                    len(plan.tx),
                    _named(touched.services),
                )
        # After a full sync (start, takeover, recovery) every frontend is reconciled, as
        # kube-proxy does at start; after a change, those whose serving endpoints changed.
        await self._clean_conntrack(None if plan.full else touched.udp_frontends)
        return None

    async def _attempt(self, touched: Touched) -> tuple[Plan | None, NftError | None]:
        """Build and run one transaction: the plan (None if it could not be built) and what
        failed (None: the kernel took it)."""
        present: TableObjects | None = None
        if self._needs_full:
            # What the table holds, so that the full sync replaces it but the affinity memory.
            try:
                present = await self._nft.list_objects(TABLE)
                if present is not None and await self._dormant():
                    # Made by a first sync whose elements never came (``netlink.py``): no
                    # packet has seen it, and a dormant table takes no new base chain in the
                    # transaction that wakes it. It is made anew.
                    present = None
            except NftError as exc:
                return None, exc
        try:
            with collector_paused():
                plan = self._plan(touched, present)
        except Exception as exc:
            # A bug or a value no check foresaw: reported as a refusal, so that the services
            # are checked one by one and the rest still goes in.
            log.exception("cannot build the nftables transaction")
            return None, NftError(f"kpng could not build the transaction: {exc}")
        return plan, await self._run(plan, fresh=present is None)

    async def _remember_kernel(self, plan: Plan) -> None:
        """What the kernel holds right after kpng's commit, for the drift checks: the ruleset's
        generation (a check that finds it unchanged knows nobody else has touched nftables
        since), and, after a commit that changed a chain, every chain's rules as the kernel
        encodes them. (Another program committing between the two is seen by the hourly full
        comparison, or not at all if it only edits a rule in place: then by nothing but the
        next change of that chain.)"""
        if self._sync_period <= 0 or self._inspect is None:
            return
        try:
            if plan.full or plan.chains or self._applied_rules is None:
                shape = await self._inspect.shape(TABLE)
                self._applied_rules = shape.rules if shape is not None else None
            self._generation = await self._inspect.generation()
        except NftError as exc:
            log.debug("cannot read what the kernel holds after a commit: %s", exc)
            self._generation = self._applied_rules = None

    async def _watch_kernel(self) -> None:
        """kube-proxy's sync period: a drift check, and its repair, every period. A state
        that fails to apply is not this loop's to retry: the Feeder does, with the state."""
        while True:
            await self._sleep(self._sync_period)
            try:
                await self.check_kernel()
            except NftError as exc:
                log.error("the drift check failed: %s; again in %gs", exc, self._sync_period)

    async def check_kernel(self, *, full: bool = False) -> Drift | None:
        """One drift check (``auditing.py``): what another program changed in kpng's table,
        repaired with a full sync, or None. The hourly comparison of every element runs here
        too (at once if ``full``), and the full sync a failure left due."""
        if self._inspect is None:
            return None
        async with self._lock:
            # A failed sync (an apply, or this check's last repair) is due again in full.
            drift = None
            if not self._needs_full:
                drift = await self._drift(self._inspect)
                due = self._clock() - self._last_full >= self._full_check_period
                if drift is None and (full or due):
                    drift = await self._compare_elements(self._inspect)
                    self._last_full = self._clock()
                if drift is None:
                    return None
            if drift is not None:
                log.warning(
                    "kpng's nftables rules were changed by another program: %s; rewriting them",
                    drift.detail,
                )
                self._syncs.diverged(kind=drift.kind, detail=drift.detail)
            self._needs_full = True
        error = await self._sync(Touched(whole=True))
        if error is not None:
            log.error("the full sync failed: %s", error)
        return drift

    async def _drift(self, inspect: Inspects) -> Drift | None:
        generation = await inspect.generation()
        if generation == self._generation:
            return None
        with collector_paused():
            expected = expected_shape(self.store)
        shape = await inspect.shape(TABLE)
        drift = compare_shapes(expected, shape, TABLE)
        if drift is None and shape is not None and self._applied_rules is not None:
            drift = compare_rules(self._applied_rules, shape)
        if drift is None:
            with collector_paused():
                asked = probes(self.store)
            drift = missing_elements(await inspect.has_elements(TABLE, asked))
        if drift is None:
            # Others' commits, which left kpng's table alone.
            self._generation = generation
        return drift

    async def _compare_elements(self, inspect: Inspects) -> Drift | None:
        """The slow check: every element of every map and set kpng filled, compared exactly
        (``auditing.expected_elements``), one container at a time; the encoding in a thread,
        so that the health port keeps answering. (Under the lock: the applied elements do not
        change meanwhile.)"""
        store = self.store
        keys = await asyncio.to_thread(applied_by_container, store)
        memos: dict[str, dict[tuple[str, ...], bytes]] = {}
        for container, encodes in comparable(store):
            expected = await asyncio.to_thread(
                expected_elements,
                store,
                container.name,
                encodes,
                keys.get(container.name, ()),
                memos.setdefault(encodes.key_type, {}),
            )
            found = await inspect.elements_of(TABLE, container)
            drift = compare_elements(container.name, expected, found)
            if drift is not None:
                return drift
        return None

    async def _read_traffic(self) -> None:
        # The kernel dumps a map's elements in O(n^2) (each part of the dump walks past what
        # went before): 2.7 s under the sync lock at 100k services, 19 s of kernel time at the
        # endpoint level (ten endpoint maps more, of 100k elements each), so reads are spaced
        # to hold it a tenth of the time at most. Decoding and folding the elements, outside
        # the lock, take some 8 us an element after the first read (``_keyed``'s memo).
        await read_paced(self.read_traffic, sleep=self._sleep, failure=NftError, log=log)

    async def read_traffic(self) -> None:
        """Read the dispatch maps' counters (``counting.py``). The dump under the lock, so
        that the elements kpng says it rewrote are those the read saw rewritten; decoded and
        summed after it, in a thread (100k services' elements), syncs going on meanwhile."""
        traffic, netlink = self._traffic, self._netlink
        if traffic is None or netlink is None:
            return
        async with self._lock:
            store = self.store
            containers = _counted(store.applied_maps if traffic.endpoints else ())
            dumps = await netlink.dumps(TABLE, list(containers))
            rewritten = traffic.take_rewritten()
        dispatched_by = {name: c[2] for name, c in containers.items() if c[2]}
        keys = self._traffic_keys

        def fold() -> None:
            # A million elements at 100k services and the endpoint level: with the collector
            # on, its passes over kpng's heap took most of the read (46 s of 65 s).
            with collector_paused():
                traffic.fold_elements(
                    _keyed(dumps, containers, keys),
                    store.applied_elements,
                    store.applied_comments,
                    rewritten,
                    dispatched_by,
                )

        await asyncio.to_thread(fold)

    def metric_samples(self) -> list[Sample]:
        """What kpng's ``/metrics`` adds for to-nft (``kpng.status.ReportsSamples``): each
        service port's new and refused connections, as of the last read (none unless
        ``--traffic-counters``), and kube-proxy's series of the localhost node ports' listeners
        (with ``--localhost-nodeports``)."""
        traffic = self._traffic.samples() if self._traffic is not None else []
        listeners = self._localhost.samples() if self._localhost is not None else []
        return [*traffic, *listeners]

    async def applied_rules(self) -> str:
        """kpng's table as the kernel holds it: what the last applied transaction left."""
        if self._dry_run:
            return f"# table {TABLE.family} {TABLE.name}: a dry run applies nothing\n"
        return await self._nft.list_table(TABLE) or f"# no table {TABLE.family} {TABLE.name}\n"

    def _rules_current(self) -> bool:
        since = self.pending_since
        return since is None or self._clock() - since < UNHEALTHY_AFTER_S

    async def _dormant(self) -> bool:
        return self._netlink is not None and await self._netlink.dormant(TABLE)

    async def _run(self, plan: Plan, *, fresh: bool = False) -> NftError | None:
        """Apply ``plan``; what nft refused, or None. A full sync that makes the table anew
        (``fresh``: there was none) sends its bulk elements as netlink (``netlink.py``). If that
        batch cannot be encoded or fails, the whole plan goes as text at once (it makes the
        dormant table anew), and every later one too."""
        split = None
        if fresh and plan.full and self._netlink is not None and self._elements_by_netlink:
            with collector_paused():
                split = split_fresh(plan.tx)
        try:
            if split is None:
                await self._nft.run(plan.tx)
                return None
            # The batch is encoded in a thread while libnftables takes the text in another:
            # libnftables runs without the GIL, so on two cores the encoding (0.5 s at 10k
            # services) costs no wall time.
            taken, encoded = await asyncio.gather(
                self._run_all(split.texts()),
                asyncio.to_thread(_encoded, split),
                return_exceptions=True,
            )
            if isinstance(taken, BaseException):
                raise taken
            assert self._netlink is not None
            try:
                if isinstance(encoded, BaseException):
                    raise encoded
                await self._netlink.send(encoded)
            except (NftError, ValueError) as exc:
                self._elements_by_netlink = False
                log.warning("%s; the table is made again with its elements as text", exc)
                await self._nft.run(plan.tx)
        except NftError as exc:
            return exc
        return None

    async def _run_all(self, transactions: list[Transaction]) -> None:
        for tx in transactions:
            await self._nft.run(tx)

    async def _leave_out_refused_services(self) -> bool:
        """After a refused full sync: find the services whose rules the kernel refuses on
        their own, log each, and leave it out of the table until it changes. True if any."""
        refused = await self._refused_services()
        for key, error in sorted(refused.items()):
            log.error(
                "service %s: the kernel refuses its rules; it is left out until it changes: %s",
                object_name(*key),
                error,
            )
            # Its ServiceEndpoints stays recorded: sent again unchanged, it stays out.
            self.store.update(key, None, Touched())
            self._refused[key] = f"the kernel refuses its rules: {error.message}"
        return bool(refused)

    async def _refused_services(self) -> dict[ServiceKey, NftError]:
        """Bisection over the services with ``check_transaction`` (nothing is kept, no packet
        sees it): at most two checks per service, far fewer for a few bad ones. Empty if the
        refusal does not show there, or shows with no service at all."""
        contributions = self.store.contributions
        options = self.store.options

        async def check(keys: list[ServiceKey]) -> NftError | None:
            try:
                with collector_paused():
                    tx = check_transaction(options, ((key, contributions[key]) for key in keys))
                await self._nft.run(tx)
            except NftError as exc:
                return exc
            except Exception as exc:
                return NftError(f"kpng could not build its rules: {exc}")
            return None

        keys = sorted(contributions)
        error = await check(keys)
        if error is None or await check([]) is not None:
            return {}
        refused: dict[ServiceKey, NftError] = {}
        suspects = [(keys, error)]  # each refused as a whole
        while suspects:
            part, error = suspects.pop()
            if len(part) == 1:
                refused[part[0]] = error
                continue
            for half in (part[: len(part) // 2], part[len(part) // 2 :]):
                half_error = await check(half)
                if half_error is not None:
                    suspects.append((half, half_error))
        return refused

    async def _clean_conntrack(self, only: set[tuple[str, str]] | None) -> None:
        """Delete the stale UDP flows (``backends/_conntrack.py``) of ``only`` these frontends,
        or of all."""
        if self._conntrack is None or (only is not None and not only):
            return
        await self._conntrack.clean_stale(self.store.udp_frontends(), only)

    async def close(self) -> None:
        for task in (self._monitor, self._traffic_reader):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._health is not None:
            await self._health.close()
        if self._localhost is not None:
            await self._localhost.close()


_Counted = tuple[str, bool, str]
"""A counted map's family, whether its keys are ``proto . port`` alone, and for an endpoint
map the dispatch map its keys are found in ("" for a dispatch map)."""
_COUNTED: dict[str, _Counted] = {
    f"{kind}-{fam}": (fam, kind.startswith("nodeport"), "")
    for kind in COUNTED_KINDS
    for fam in FAMILIES
}
"""The counted dispatch maps."""


def _counted(maps: Iterable[str]) -> dict[str, _Counted]:
    """The counted dispatch maps, and those of ``maps`` that are counted endpoint maps."""
    out = dict(_COUNTED)
    for name in maps:
        found = counted_endpoint_map(name)
        if found is not None:
            dispatch, fam, port_only = found
            out[name] = (fam, port_only, dispatch)
    return out


def _rewritten(plan: Plan, store: TableState) -> list[ElementKey]:
    """The counted elements ``plan`` writes again (their counters restart): those it changes
    (``diffing.incremental`` deletes and adds them) or deletes."""
    applied, comments = store.applied_elements, store.applied_comments
    return [
        ek
        for ek, value in plan.elements.items()
        if (ek[0] in _COUNTED or counted_endpoint_map(ek[0]) is not None)
        and ek in applied
        and (applied[ek] != value or comments.get(ek, "") != plan.comments.get(ek, ""))
    ]


def _keyed(
    dumps: list[tuple[str, list[bytes]]],
    containers: Mapping[str, _Counted],
    memo: dict[str, dict[bytes, ElementKey | None]],
) -> list[tuple[ElementKey, int]]:
    """The counters of the elements dumped, by the keys kpng wrote. ``memo``: each container's
    keys by their kernel bytes (None: no key of kpng's), kept from read to read, as the same
    elements are read every period; a container's is dropped once it holds twice what it read."""
    out: list[tuple[ElementKey, int]] = []
    append = out.append
    for name in [name for name in memo if name not in containers]:
        del memo[name]
    for container, messages in dumps:
        fam, port_only, _ = containers[container]
        known = memo.setdefault(container, {})
        read = 0
        for message in messages:
            for key, packets in element_counters(message):
                ek = known.get(key, _UNKNOWN)
                if ek is _UNKNOWN:
                    fields = dispatch_key(key, fam, port_only=port_only)
                    ek = known[key] = (container, fields) if fields else None
                if ek is not None:
                    append((ek, packets))
                read += 1
        if len(known) > 2 * read + 1024:
            memo[container] = {}
    return out


_UNKNOWN: ElementKey = ("", ())
"""Not in a ``_keyed`` memo."""


_NAMED = 10
"""The most services a log line or dry-run header names; more are counted."""


def _encoded(split: FreshTable) -> list[bytes]:
    with collector_paused():
        return split.batch()


def _named(services: set[ServiceKey]) -> str:
    """``services ns/a, ns/b and 3 more`` (by name), or ``no service changed``."""
    if not services:
        return "no service changed"
    names = [object_name(*key) for key in heapq.nsmallest(_NAMED, services)]
    more = f" and {len(services) - _NAMED} more" if len(services) > _NAMED else ""
    return f"service{'s' if len(services) > 1 else ''} {', '.join(names)}{more}"


async def cleanup(nft: Nft | None = None) -> bool:
    """Remove kpng's table; True if there was one."""
    return await (nft or default_nft()).delete_table(TABLE)


class LeftoverTables:
    """``nft``'s tables as kube-proxy's leftovers module (``backends/_kube_proxy.py``) sees
    them: by family and name, so that it needs nothing of to-nft's types."""

    def __init__(self, nft: Nft) -> None:
        self._nft = nft
        self._listed: dict[tuple[str, str], Table] = {}

    async def list_tables(self) -> list[tuple[str, str]]:
        self._listed = {(t.family, t.name): t for t in await self._nft.list_tables()}
        return list(self._listed)

    async def delete_table(self, family: str, name: str) -> bool:
        table = self._listed.get((family, name))
        return table is not None and await self._nft.delete_table(table)


def kube_proxy_leftovers(nft: Nft | None = None) -> KubeProxyLeftovers:
    """kube-proxy's leftovers of every mode, its nftables tables seen through ``nft`` (default:
    libnftables, else the nft command), which to-nft has even where the command is not
    installed."""
    nft = nft or default_nft()
    if isinstance(nft, KernelNft) and not has_nft():
        # Neither libnftables nor nft: the leftovers module then skips nftables (kube-proxy's
        # nftables mode runs nft; a containerized one leaves tables kpng cannot see either way).
        return KubeProxyLeftovers()
    return KubeProxyLeftovers(nft=LeftoverTables(nft))


def has_nft() -> bool:
    import shutil

    return shutil.which("nft") is not None
