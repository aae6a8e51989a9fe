"""What to-iptables holds of each family, and the ``iptables-restore --noflush`` input that brings
the kernel to it (pure: no I/O).

``--noflush`` leaves every chain the input does not name as it is: that is how other software's
rules survive, and how a partial sync (kube-proxy's since 1.28) rewrites only what changed. A
chain declared in the input (``:KUBE-SVC-... - [0:0]``) is flushed and refilled; one declared and
then ``-X``ed is deleted. Each sync declares the chains of the services that changed and the
shared chains (which hold every service's rules) whose rules change; a full sync (at start,
after a failure) declares every chain it wants and deletes every service chain the kernel holds
but it does not.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kpng.backends._endpoints import EndpointValue
from kpng.backends._node import Fam, Options
from kpng.backends.iptables.rules import (
    SERVICE_CHAIN_PREFIXES,
    SHARED_CHAINS,
    TABLES,
    ChainKey,
    Contribution,
    Jump,
    jumps,
    skeleton,
    tail,
)
from kpng.client import ServiceKey

K = TypeVar("K")
V = TypeVar("V")


@dataclass
class Plan:
    """One family's restore input, and what it changes."""

    text: str
    full: bool
    written: int
    """Service chains declared and refilled."""
    deleted: int
    """Service chains deleted."""
    rules: int
    shared: dict[ChainKey, tuple[str, ...]] = field(default_factory=dict)
    """The shared chains the input rewrites, with their rules."""
    declared: frozenset[ChainKey] = frozenset()
    """Every chain the input flushes (rewrites or deletes): their rules' counters restart."""


@dataclass
class FamilyTables:
    """What kpng last put into one family's tables: its contributions by service, and the
    shared chains' rules as last written."""

    fam: Fam
    options: Options
    contributions: dict[ServiceKey, Contribution] = field(default_factory=dict)
    shared: dict[ChainKey, tuple[str, ...]] = field(default_factory=dict)
    """What the kernel holds in the shared chains; a partial sync leaves those that would not
    change undeclared (``--noflush`` keeps them), so an endpoint's change restores its
    service's chains alone rather than a line of every service. Empty: unknown, all written."""

    def plan(
        self,
        new: Mapping[ServiceKey, Contribution | None],
        *,
        present: Collection[str] | None = None,
        missing_jumps: Collection[Jump] = (),
    ) -> Plan:
        """The input that replaces the contributions of the services in ``new`` (None: the
        service goes). ``present``, the nat chains the kernel holds, makes it a full sync;
        ``missing_jumps`` (of a full sync) are inserted first in their built-in chains, in the
        same transaction as the chains they jump to."""
        full = present is not None
        if not full and all(self.contributions.get(key) == c for key, c in new.items()):
            # Nothing of this family changes (the v6 tables when a v4 slice changed, or an
            # endpoint this node's rules leave out): no restore at all.
            return Plan("", full=False, written=0, deleted=0, rules=0)
        contributions = dict(self.contributions)
        put_all(contributions, new)
        write: dict[ChainKey, tuple[str, ...]] = {}
        delete: set[ChainKey] = set()
        if full:
            for contribution in contributions.values():
                write.update(contribution.chains)
            assert present is not None
            delete = {
                ("nat", name)
                for name in present
                if name.startswith(SERVICE_CHAIN_PREFIXES) and ("nat", name) not in write
            }
        else:
            for key in new:
                old_chains = self.contributions[key].chains if key in self.contributions else {}
                new_chains = contributions[key].chains if key in contributions else {}
                write.update((k, v) for k, v in new_chains.items() if old_chains.get(k) != v)
                delete.update(k for k in old_chains if k not in new_chains)
        shared = _shared(self.fam, self.options, contributions)
        if not full:
            shared = {k: rules for k, rules in shared.items() if self.shared.get(k) != rules}
        order = jumps(self.options, self.fam)
        text, rules = _render(shared, write, delete, [j for j in order if j in missing_jumps])
        return Plan(
            text,
            full,
            written=len(write),
            deleted=len(delete),
            rules=rules,
            shared=shared,
            declared=frozenset((*shared, *write, *delete)),
        )

    def commit(
        self, new: Mapping[ServiceKey, Contribution | None], plan: Plan | None = None
    ) -> None:
        """The kernel took ``plan``, of ``new`` (without a plan: the shared chains are unknown
        and the next plan writes them all)."""
        put_all(self.contributions, new)
        if plan is None or plan.full:
            # A full plan writes every shared chain there is: one the options no longer have
            # (KUBE-FIREWALL, left in place) is no longer kpng's to count.
            self.shared.clear()
        if plan is not None:
            self.shared.update(plan.shared)


def put_all(target: dict[K, V], new: Mapping[K, V | None]) -> None:
    """``target`` updated with ``new``, where None removes the key."""
    for key, value in new.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


def udp_frontends(
    contributions: Iterable[Contribution],
) -> dict[tuple[str, str], frozenset[EndpointValue]]:
    """Every UDP frontend of ``contributions``, with the endpoints that serve it in any."""
    frontends: dict[tuple[str, str], frozenset[EndpointValue]] = {}
    for contribution in contributions:
        for front, serving in contribution.udp_frontends.items():
            frontends[front] = frontends.get(front, frozenset()) | serving
    return frontends


def _shared(
    fam: Fam, options: Options, contributions: Mapping[ServiceKey, Contribution]
) -> dict[ChainKey, tuple[str, ...]]:
    """Every shared chain's rules: the skeleton's (which may name a chain of its own, such as
    KUBE-FIREWALL), every service's, the tail's."""
    head, last = skeleton(options, fam), tail(options, fam)
    shared: dict[ChainKey, list[str]] = {
        (table, chain): [] for table in TABLES for chain in SHARED_CHAINS[table]
    }
    for where, rules in head.items():
        shared[where] = list(rules)
    # Sorted: the same state renders the same rules, whatever the order changes came in.
    for key in sorted(contributions):
        for where, rules in contributions[key].shared.items():
            shared[where] += rules
    for where, rules in last.items():
        shared[where] += rules
    return {where: tuple(rules) for where, rules in shared.items()}


def _render(
    shared: Mapping[ChainKey, tuple[str, ...]],
    write: Mapping[ChainKey, tuple[str, ...]],
    delete: Iterable[ChainKey],
    missing_jumps: Sequence[Jump] = (),
) -> tuple[str, int]:
    """``missing_jumps`` in the order they are to have."""
    deleting = sorted(delete)
    # Each inserted first, in reverse: they end up in their order, before other software's.
    inserts = list(reversed(missing_jumps))
    lines: list[str] = []
    count = 0
    for table in TABLES:
        lines.append(f"*{table}")
        declared = [c for t, c in shared if t == table]
        declared += sorted(c for t, c in write if t == table)
        declared += [c for t, c in deleting if t == table]
        lines += [f":{chain} - [0:0]" for chain in declared]
        for (t, chain), shared_rules in shared.items():
            if t == table:
                lines += [f"-A {chain} {rule}" for rule in shared_rules]
                count += len(shared_rules)
        for (t, chain), own_rules in sorted(write.items()):
            if t == table:
                lines += [f"-A {chain} {rule}" for rule in own_rules]
                count += len(own_rules)
        lines += [f"-X {chain}" for t, chain in deleting if t == table]
        lines += [f"-I {chain} 1 {rule}" for t, chain, rule in inserts if t == table]
        lines.append("COMMIT")
    return "\n".join(lines) + "\n", count
