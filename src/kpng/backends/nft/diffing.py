"""The diff store: desired table contents (per service) against what was last applied (pure).

Services may share objects (the pick chain of every service with N endpoints, a hairpin pair
of an address serving two services), so every element, chain and map has a set of owners; it is
desired while it has one. When two services want different values for one element (two
services claiming the same external IP and port), the first owner in sorted order wins, so the
result does not depend on the order of updates.

``update`` records a service's new contribution and returns what it touched;
``incremental`` turns the touched objects into a transaction against the applied state, and
``commit`` records that the kernel took it. ``full`` is the whole desired table, replacing
whatever the table holds in one transaction (start-up, takeover, recovery).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from kpng.backends.nft.layout import TABLE, Contribution, ElementKey, Options, skeleton
from kpng.backends.nft.nftables import Chain, Element, Map, Rule, Transaction
from kpng.model.cluster import ServiceKey

ChainDef = tuple[Chain, tuple[Rule, ...]]
K = TypeVar("K")
V = TypeVar("V")


@dataclass
class Touched:
    elements: set[ElementKey] = field(default_factory=set)
    chains: set[str] = field(default_factory=set)
    maps: set[str] = field(default_factory=set)
    flush_maps: set[str] = field(default_factory=set)
    """Affinity maps whose remembered endpoints may be gone: emptied in the same transaction."""
    udp_gone: set[tuple[str, str, str]] = field(default_factory=set)
    udp_new_services: set[tuple[str, str]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.elements or self.chains or self.maps or self.flush_maps)


@dataclass
class Plan:
    """One transaction and what to record once the kernel has taken it."""

    tx: Transaction
    elements: dict[ElementKey, tuple[str, ...] | None]
    chains: dict[str, ChainDef | None]
    maps: dict[str, Map | None]
    full: bool


class DiffStore:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.contributions: dict[ServiceKey, Contribution] = {}
        self._element_owners: dict[ElementKey, dict[ServiceKey, tuple[str, ...]]] = {}
        self._chain_owners: dict[str, dict[ServiceKey, ChainDef]] = {}
        self._map_owners: dict[str, dict[ServiceKey, Map]] = {}
        self.applied_elements: dict[ElementKey, tuple[str, ...]] = {}
        self.applied_chains: dict[str, ChainDef] = {}
        self.applied_maps: dict[str, Map] = {}

    def update(self, key: ServiceKey, new: Contribution | None, touched: Touched) -> None:
        """Record service ``key``'s contribution (None: deleted), adding what changed to
        ``touched``."""
        old = self.contributions.pop(key, None) or Contribution()
        if new is not None:
            self.contributions[key] = new
        else:
            new = Contribution()
        for ek in old.elements.keys() - new.elements.keys():
            _disown(self._element_owners, ek, key)
            touched.elements.add(ek)
        for ek, value in new.elements.items():
            if old.elements.get(ek) != value:
                self._element_owners.setdefault(ek, {})[key] = value
                touched.elements.add(ek)
        for name in old.chains.keys() - new.chains.keys():
            _disown(self._chain_owners, name, key)
            touched.chains.add(name)
        for name, chain in new.chains.items():
            if old.chains.get(name) != chain:
                self._chain_owners.setdefault(name, {})[key] = chain
                touched.chains.add(name)
        for name in old.maps.keys() - new.maps.keys():
            _disown(self._map_owners, name, key)
            touched.maps.add(name)
        for name, m in new.maps.items():
            if old.maps.get(name) != m:
                self._map_owners.setdefault(name, {})[key] = m
                touched.maps.add(name)
        touched.udp_gone |= old.udp_endpoints - new.udp_endpoints
        # A remembered (affinity) endpoint must not outlive the endpoint: when one of the
        # service's endpoint elements goes or changes, its affinity maps are emptied.
        if old.maps.keys() & new.maps.keys() and any(
            "-eps-" in ek[0] and new.elements.get(ek) != value for ek, value in old.elements.items()
        ):
            touched.flush_maps |= old.maps.keys() & new.maps.keys()
        old_services = {(a, p) for a, p, _ in old.udp_endpoints}
        touched.udp_new_services |= {(a, p) for a, p, _ in new.udp_endpoints} - old_services

    def desired_element(self, ek: ElementKey) -> tuple[str, ...] | None:
        owners = self._element_owners.get(ek)
        if not owners:
            return None
        if len(owners) == 1:
            return next(iter(owners.values()))
        return owners[min(owners)]

    def desired_chain(self, name: str) -> ChainDef | None:
        owners = self._chain_owners.get(name)
        return owners[min(owners)] if owners else None

    def desired_map(self, name: str) -> Map | None:
        owners = self._map_owners.get(name)
        return owners[min(owners)] if owners else None

    def conflicts(self, touched: Touched) -> list[tuple[ElementKey, list[ServiceKey]]]:
        """Touched elements that services want with different values (the first owner's value
        is used); only the touched ones, so that a change costs what it touched."""
        out = []
        for ek in sorted(touched.elements):
            owners = self._element_owners.get(ek)
            if owners is not None and len(owners) > 1 and len(set(owners.values())) > 1:
                out.append((ek, sorted(owners)))
        return out

    def incremental(self, touched: Touched) -> Plan:
        """The transaction bringing the applied table to the desired one for ``touched``."""
        tx = Transaction(TABLE)
        elements = {ek: self.desired_element(ek) for ek in touched.elements}
        chains = {name: self.desired_chain(name) for name in touched.chains}
        maps = {name: self.desired_map(name) for name in touched.maps}
        # New maps and chains first: elements and rules refer to them.
        for name, m in sorted(maps.items()):
            if m is not None and self.applied_maps.get(name) != m:
                if name in self.applied_maps:
                    tx.delete(self.applied_maps[name])
                tx.add(m)
        for name, chain in sorted(chains.items()):
            if chain is not None and self.applied_chains.get(name) != chain:
                tx.add(chain[0])
                if name in self.applied_chains:
                    tx.flush(chain[0])
                for rule in chain[1]:
                    tx.add(rule)
        for name in sorted(touched.flush_maps):
            if name in self.applied_maps and maps.get(name, self.applied_maps[name]) is not None:
                tx.flush(self.applied_maps[name])
        changed = sorted(
            (ek, v) for ek, v in elements.items() if self.applied_elements.get(ek) != v
        )
        for ek, _ in changed:
            if ek in self.applied_elements:
                tx.delete(Element(ek[0], ek[1]))
        for ek, value in changed:
            if value is not None:
                tx.add(Element(ek[0], ek[1], value))
        # Chains and maps last: once nothing refers to them.
        for name, chain in sorted(chains.items()):
            if chain is None and name in self.applied_chains:
                tx.flush(self.applied_chains[name][0])
                tx.delete(self.applied_chains[name][0])
        for name, m in sorted(maps.items()):
            if m is None and name in self.applied_maps:
                tx.delete(self.applied_maps[name])
        return Plan(tx, elements, chains, maps, full=False)

    def full(self) -> Plan:
        """The whole desired table, replacing the table atomically (no gap for traffic)."""
        tx = Transaction(TABLE)
        # `add` then `delete` removes the table whether or not it existed, in the same
        # transaction that rebuilds it, so packets see the old rules or the new ones.
        tx.add(TABLE)
        tx.delete(TABLE)
        tx.add(TABLE)
        objects, rules, static = skeleton(self.options)
        maps = {name: self.desired_map(name) for name in self._map_owners}
        chains = {name: self.desired_chain(name) for name in self._chain_owners}
        for obj in objects:
            tx.add(obj)
        for _, m in sorted(maps.items()):
            if m is not None:
                tx.add(m)
        for _, chain in sorted(chains.items()):
            if chain is not None:
                tx.add(chain[0])
        for rule in rules:
            tx.add(rule)
        for _, chain in sorted(chains.items()):
            if chain is not None:
                for rule in chain[1]:
                    tx.add(rule)
        for element in static:
            tx.add(element)
        elements: dict[ElementKey, tuple[str, ...] | None] = {}
        for ek in sorted(self._element_owners):
            value = self.desired_element(ek)
            if value is not None:
                elements[ek] = value
                tx.add(Element(ek[0], ek[1], value))
        return Plan(tx, elements, chains, maps, full=True)

    def commit(self, plan: Plan) -> None:
        """Record that the kernel applied ``plan``."""
        if plan.full:
            self.applied_elements = {}
            self.applied_chains = {}
            self.applied_maps = {}
        for ek, value in plan.elements.items():
            _record(self.applied_elements, ek, value)
        for name, chain in plan.chains.items():
            _record(self.applied_chains, name, chain)
        for name, m in plan.maps.items():
            _record(self.applied_maps, name, m)


def _disown(owners: dict[K, dict[ServiceKey, V]], key: K, service: ServiceKey) -> None:
    entry = owners.get(key)
    if entry is not None:
        entry.pop(service, None)
        if not entry:
            del owners[key]


def _record(applied: dict[K, V], key: K, value: V | None) -> None:
    if value is None:
        applied.pop(key, None)
    else:
        applied[key] = value
