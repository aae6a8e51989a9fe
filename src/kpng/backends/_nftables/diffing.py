"""The table state: desired table contents (per service) against what was last applied (pure).

Services may share objects (the pick chain of every service with N endpoints, a hairpin pair
of an address serving two services), so every element, chain and map has a set of owners; it is
desired while it has one. When two services want different values for one element (two
services claiming the same external IP and port), the first owner in sorted order wins, so the
result does not depend on the order of updates. An element with one owner (nearly all of them)
is recorded as that owner's key alone, its value read from the owner's contribution: a full sync
of 100k elements then makes no per-element objects here.

``update`` records a service's new contribution and returns what it touched;
``incremental`` turns the touched objects into a transaction against the applied state, and
``commit`` records that the kernel took it. ``full`` is the whole desired table, replacing
whatever the table holds in one transaction (start-up, takeover, recovery) but the affinity
memory.
``check_transaction`` asks the kernel about some services alone, leaving nothing behind.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, overload

from kpng.backends._nftables.layout import (
    AFFINITY_SETS,
    CHECK_TABLE,
    TABLE,
    Contribution,
    ElementKey,
    Options,
    skeleton,
)
from kpng.backends._nftables.nftables import (
    Chain,
    Element,
    Elements,
    Map,
    Named,
    Operation,
    Rule,
    Set,
    Table,
    TableObjects,
    Transaction,
    render_element,
)
from kpng.client import ServiceKey

ChainDef = tuple[Chain, tuple[Rule, ...]]
K = TypeVar("K")
V = TypeVar("V")


@dataclass
class Touched:
    elements: set[ElementKey] = field(default_factory=set)
    chains: set[str] = field(default_factory=set)
    maps: set[str] = field(default_factory=set)
    shared: set[ElementKey] = field(default_factory=set)
    """Touched elements left with more than one owner: the only ones that can conflict."""
    udp_frontends: set[tuple[str, str]] = field(default_factory=set)
    """UDP frontends whose serving endpoints changed: their stale conntrack flows go."""
    services: set[ServiceKey] = field(default_factory=set)
    """The services whose contribution changed, named in the logs and the dry run."""
    whole: bool = False
    """A full plan follows, which reads no touched element: they are not collected (a set of
    1.8 million at 100k services)."""


@dataclass
class Plan:
    """One transaction and what to record once the kernel has taken it."""

    tx: Transaction
    elements: Mapping[ElementKey, tuple[str, ...] | None]
    chains: dict[str, ChainDef | None]
    maps: dict[str, Map | Set | None]
    table: dict[ElementKey, tuple[str, ...]] | None = None
    """For a full plan, every element of the table (None: an incremental plan)."""
    comments: dict[ElementKey, str] = field(default_factory=dict)
    """The comments of ``elements`` that have one."""

    @property
    def full(self) -> bool:
        return self.table is not None


Owners = ServiceKey | dict[ServiceKey, tuple[str, ...]]
"""An element's owners: one service's key, or the value each of several services wants."""


class TableState:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.contributions: dict[ServiceKey, Contribution] = {}
        self._element_owners: dict[ElementKey, Owners] = {}
        self._chain_owners: dict[str, dict[ServiceKey, ChainDef]] = {}
        self._map_owners: dict[str, dict[ServiceKey, Map | Set]] = {}
        self.applied_elements: dict[ElementKey, tuple[str, ...]] = {}
        self.applied_comments: dict[ElementKey, str] = {}
        """An element whose comment alone changes is replaced too: the listing says whose."""
        self.applied_chains: dict[str, ChainDef] = {}
        self.applied_maps: dict[str, Map | Set] = {}

    def update(self, key: ServiceKey, new: Contribution | None, touched: Touched) -> None:
        """Record service ``key``'s contribution (None: deleted), adding what changed to
        ``touched``."""
        touched.services.add(key)
        old = self.contributions.pop(key, None) or Contribution()
        if new is not None:
            self.contributions[key] = new
        else:
            new = Contribution()
        old_elements, new_elements = old.elements, new.elements
        if old_elements:
            for ek in old_elements.keys() - new_elements.keys():
                touched.elements.add(ek)
                if self._disown(ek, key) > 1:
                    touched.shared.add(ek)
            old_comments, new_comments = old.comments, new.comments
            for ek, value in new_elements.items():
                if old_elements.get(ek) != value:
                    touched.elements.add(ek)
                    self._own(ek, key, value, touched)
                elif old_comments.get(ek) != new_comments.get(ek):
                    touched.elements.add(ek)
        else:
            # A full sync passes here for every element of every service: the common case
            # (no other owner) inline.
            if not touched.whole:
                touched.elements.update(new_elements)
            index = self._element_owners
            for ek, value in new_elements.items():
                if ek in index:
                    self._own(ek, key, value, touched)
                else:
                    index[ek] = key
        if old.chains or new.chains:
            for name in old.chains.keys() - new.chains.keys():
                _disown(self._chain_owners, name, key)
                touched.chains.add(name)
            for name, chain in new.chains.items():
                if old.chains.get(name) != chain:
                    self._chain_owners.setdefault(name, {})[key] = chain
                    touched.chains.add(name)
        if old.maps or new.maps:
            for name in old.maps.keys() - new.maps.keys():
                _disown(self._map_owners, name, key)
                touched.maps.add(name)
            for name, m in new.maps.items():
                if old.maps.get(name) != m:
                    self._map_owners.setdefault(name, {})[key] = m
                    touched.maps.add(name)
        if old.udp_frontends or new.udp_frontends:
            # A frontend that goes keeps its flows, as with kube-proxy: they time out.
            touched.udp_frontends.update(
                front
                for front, serving in new.udp_frontends.items()
                if old.udp_frontends.get(front) != serving
            )

    def _own(self, ek: ElementKey, key: ServiceKey, value: tuple[str, ...], t: Touched) -> None:
        """Make ``key`` an owner of ``ek`` wanting ``value`` (its contribution is recorded)."""
        owners = self._element_owners.get(ek)
        if owners is None:
            self._element_owners[ek] = key
        elif isinstance(owners, dict):
            owners[key] = value
            t.shared.add(ek)
        elif owners != key:
            self._element_owners[ek] = {
                owners: self.contributions[owners].elements[ek],
                key: value,
            }
            t.shared.add(ek)

    def _disown(self, ek: ElementKey, key: ServiceKey) -> int:
        """Remove ``key`` from the owners of ``ek``; how many owners are left."""
        owners = self._element_owners.get(ek)
        if owners is None:
            return 0
        if isinstance(owners, dict):
            owners.pop(key, None)
            if len(owners) == 1:
                self._element_owners[ek] = next(iter(owners))
            return len(owners)
        if owners == key:
            del self._element_owners[ek]
            return 0
        return 1

    def udp_frontends(self) -> dict[tuple[str, str], frozenset[tuple[str, str]]]:
        """Every UDP frontend and the endpoints serving it (two services sharing one: either's
        endpoints)."""
        out: dict[tuple[str, str], frozenset[tuple[str, str]]] = {}
        for contribution in self.contributions.values():
            for front, serving in contribution.udp_frontends.items():
                out[front] = serving | out[front] if front in out else serving
        return out

    def desired_element(self, ek: ElementKey) -> tuple[str, ...] | None:
        owners = self._element_owners.get(ek)
        if owners is None:
            return None
        if isinstance(owners, dict):
            return owners[min(owners)]
        return self.contributions[owners].elements[ek]

    def comment(self, ek: ElementKey) -> str:
        """The comment of element ``ek``: its (first) owner's."""
        owners = self._element_owners.get(ek)
        if owners is None:
            return ""
        owner = min(owners) if isinstance(owners, dict) else owners
        return self.contributions[owner].comments.get(ek, "")

    def desired_chain(self, name: str) -> ChainDef | None:
        return _first_owners(self._chain_owners.get(name))

    def desired_map(self, name: str) -> Map | Set | None:
        return _first_owners(self._map_owners.get(name))

    def conflicts(self, touched: Touched) -> list[tuple[ElementKey, list[ServiceKey]]]:
        """Touched elements that services want with different values (the first owner's value
        is used); only the touched ones, so that a change costs what it touched."""
        out = []
        for ek in sorted(touched.shared):
            owners = self._element_owners.get(ek)
            if isinstance(owners, dict) and len(set(owners.values())) > 1:
                out.append((ek, sorted(owners)))
        return out

    def incremental(self, touched: Touched) -> Plan:
        """The transaction bringing the applied table to the desired one for ``touched``."""
        tx = Transaction(TABLE)
        elements = {ek: self.desired_element(ek) for ek in touched.elements}
        comments = {ek: c for ek in elements if (c := self.comment(ek))}
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
        applied, applied_comments = self.applied_elements, self.applied_comments
        changed = sorted(
            (ek, v)
            for ek, v in elements.items()
            if applied.get(ek) != v
            or (v is not None and applied_comments.get(ek, "") != comments.get(ek, ""))
        )
        for ek, _ in changed:
            if ek in applied:
                tx.delete(Element(ek[0], ek[1]))
        for ek, value in changed:
            if value is not None:
                tx.add(Element(ek[0], ek[1], value, comments.get(ek, "")))
        # Chains and maps last: once nothing refers to them.
        for name, chain in sorted(chains.items()):
            if chain is None and name in self.applied_chains:
                tx.flush(self.applied_chains[name][0])
                tx.delete(self.applied_chains[name][0])
        for name, m in sorted(maps.items()):
            if m is None and name in self.applied_maps:
                tx.delete(self.applied_maps[name])
        return Plan(tx, elements, chains, maps, comments=comments)

    def full(self, present: TableObjects | None = None) -> Plan:
        """The whole desired table, replacing what the table holds atomically (no gap for
        traffic). ``present``: what the table holds now (None: no table). Everything goes but
        the affinity memory, which is why the table itself is not deleted."""
        tx = Transaction(TABLE)
        tx.add(TABLE)
        if present is None:
            # A table made since it was listed (another kpng starting) goes as a whole: `add`
            # then `delete` removes it whether or not it exists, in the transaction that
            # rebuilds it, so packets see the old rules or the new ones.
            tx.delete(TABLE)
            tx.add(TABLE)
        else:
            # Rules first: then only verdict map elements refer to chains, and nothing to sets.
            tx.flush(TABLE)
            kept = {s.name for s in AFFINITY_SETS.values()} & self._map_owners.keys()
            for name in sorted(present.maps):
                tx.delete(Named("map", name))
            for name in sorted(present.sets - kept):
                tx.delete(Named("set", name))
            for name in sorted(present.chains):
                tx.delete(Named("chain", name))
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
        # The bulk of a full sync: every element, in batches per container (see ``Elements``),
        # rendered only when the transaction is (``_Rendered``).
        table: dict[ElementKey, tuple[str, ...]] = {}
        comments: dict[ElementKey, str] = {}
        commented: set[str] = set()
        by_container: dict[str, tuple[list[tuple[str, ...]], list[tuple[str, ...]]]] = {}
        contributions = self.contributions
        for ek, owners in self._element_owners.items():
            if isinstance(owners, dict):
                owner = min(owners)
                value = owners[owner]
            else:
                owner = owners
                value = contributions[owners].elements[ek]
            table[ek] = value
            comment = contributions[owner].comments.get(ek)
            if comment:
                comments[ek] = comment
                commented.add(ek[0])
            lists = by_container.get(ek[0])
            if lists is None:
                lists = by_container[ek[0]] = ([], [])
            lists[0].append(ek[1])
            lists[1].append(value)
        for container in sorted(by_container):
            keys, values = by_container[container]
            items = _Rendered(container, keys, values, table, comments, container in commented)
            tx.add(Elements(container, items))
        return Plan(tx, table, chains, maps, table=table, comments=comments)

    def commit(self, plan: Plan) -> None:
        """Record that the kernel applied ``plan``."""
        if plan.table is not None:
            self.applied_elements = plan.table
            self.applied_comments = plan.comments
            self.applied_chains = {}
            self.applied_maps = {}
        else:
            for ek, value in plan.elements.items():
                _record(self.applied_elements, ek, value)
                _record(self.applied_comments, ek, plan.comments.get(ek))
        for name, chain in plan.chains.items():
            _record(self.applied_chains, name, chain)
        for name, m in plan.maps.items():
            _record(self.applied_maps, name, m)


def _joined(fields: tuple[str, ...]) -> str:
    return " . ".join(fields)


class _Rendered(Sequence[str]):
    """The elements of one container, as ``Elements`` items (``key : value`` text), each
    rendered when read, in the order of ``sorted(keys)``; and their fields, in no particular
    order (``fields``).

    A full sync's texts are written once, into the file libnftables reads; held from the plan
    to the commit, 100k services' 1.8 million texts sat in memory beside libnftables' parse of
    them. Its elements sent as netlink are never rendered, nor sorted: their fields are read
    in the order the plan found them, with their values beside them."""

    __slots__ = ("_commented", "_comments", "_container", "_keys", "_table", "_values")

    def __init__(
        self,
        container: str,
        keys: list[tuple[str, ...]],
        values: list[tuple[str, ...]],
        table: Mapping[ElementKey, tuple[str, ...]],
        comments: Mapping[ElementKey, str],
        commented: bool,
    ) -> None:
        self._container = container
        self._keys = keys
        self._values: list[tuple[str, ...]] | None = values
        """The value of each of ``keys``, until they are sorted (then None)."""
        self._table = table
        self._comments = comments
        self._commented = commented
        """Whether any element has a comment: most containers have none to look up."""

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        keys = self._sorted_keys()
        if isinstance(index, slice):
            return [self._render(key) for key in keys[index]]
        return self._render(keys[index])

    def __iter__(self) -> Iterator[str]:
        return map(self._render, self._sorted_keys())

    def _sorted_keys(self) -> list[tuple[str, ...]]:
        if self._values is not None:
            # Sorting by the rendered keys gives the order of ``sorted(keys)`` (fields hold no
            # space, which sorts before anything they hold) at half the cost of sorting tuples.
            self._keys.sort(key=_joined)
            self._values = None
        return self._keys

    def _render(self, key: tuple[str, ...]) -> str:
        ek = (self._container, key)
        return render_element(key, self._table[ek], self._comments.get(ek, ""))

    def fields(self) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], str]]:
        """Each element's key, value and comment (``nftables.ElementFields``)."""
        container, keys, table, comments = self._container, self._keys, self._table, self._comments
        if self._values is not None and not self._commented:
            return zip(keys, self._values, itertools.repeat(""))
        if self._values is not None:
            return (
                (key, value, comments.get((container, key), ""))
                for key, value in zip(keys, self._values, strict=True)
            )
        return ((key, table[container, key], comments.get((container, key), "")) for key in keys)


def check_transaction(
    options: Options, contributions: Iterable[tuple[ServiceKey, Contribution]]
) -> Transaction:
    """What a full sync of ``contributions`` alone writes, in ``CHECK_TABLE`` with its base
    chains made plain (no packet sees them), and that table deleted at the end: the kernel
    checks every object and element and keeps nothing, whether it takes the transaction or
    not. Refusals that depend on a hook do not show here."""
    store = TableState(options)
    touched = Touched()
    for key, contribution in contributions:
        store.update(key, contribution, touched)
    tx = Transaction(CHECK_TABLE)
    for op in store.full().tx.operations:
        obj = op.obj
        if isinstance(obj, Table):
            obj = CHECK_TABLE
        elif isinstance(obj, Chain) and obj.is_base:
            obj = Chain(obj.name)
        tx.operations.append(Operation(op.verb, obj))
    return tx.delete(CHECK_TABLE)


def _first_owners(owners: dict[ServiceKey, V] | None) -> V | None:
    """The value of the first owner in sorted order. Thousands of services own each pick chain
    and endpoint map, all with the one cached definition: then any owner's will do."""
    if not owners:
        return None
    values = iter(owners.values())
    first = next(values)
    if all(value is first for value in values):
        return first
    return owners[min(owners)]


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
