"""Drift: whether kpng's table still holds what kpng last applied (pure: no I/O).

Other programs change nftables behind kpng's back: a firewall reload flushes the ruleset, an
operator deletes a chain or flushes a map, a tool adds a rule to a chain it should not. to-nft
checks every sync period (``NftBackend.check_kernel``), at a cost that does not grow with the
services:

1. the ruleset's generation, which the kernel moves at every nf_tables commit: if nobody but
   kpng has committed since kpng's own last commit, nothing can have changed;
2. otherwise the table's shape: its chains with how many rules each holds, and its sets and
   maps, against what kpng applied (three netlink dumps, none of elements);
3. and one element of every map and set kpng filled, asked for by its key (a flushed map has
   lost it).

Step 2 also compares each chain's rules, as the kernel holds their expressions, with what
they were right after kpng's last commit that changed a chain: a rule replaced in place shows
there. Every hour (``full_check_period``) a full comparison reads every element of every map
and set netlink can encode and compares them with what kpng applied, exactly
(``expected_elements``, ``compare_elements``): an element deleted, added or changed alone shows
there.

What it finds is a ``Drift``: a short ``kind`` for metrics and a sentence for the log. The
repair is a full sync.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kpng.backends._drift import Drift, named
from kpng.backends._nftables.diffing import TableState
from kpng.backends._nftables.layout import ElementKey, skeleton
from kpng.backends._nftables.netlink import Canonical, ElementEncoder, TableShape, encoder
from kpng.backends._nftables.nftables import Chain, Map, Set, Table


@dataclass(frozen=True)
class Probe:
    """One element kpng applied, to ask the kernel for: by its fields (the fake) or encoded
    (netlink)."""

    container: str
    key: tuple[str, ...]
    encoded: bytes


class Inspects(Protocol):
    """What a drift check asks of the kernel (``executing.NetlinkBatches``; ``FakeNft``)."""

    async def generation(self) -> int:
        """The ruleset's generation, moved by every commit."""
        ...

    async def shape(self, table: Table) -> TableShape | None:
        """``table``'s chains (with rule counts), sets and maps; None: no such table."""
        ...

    async def has_elements(self, table: Table, probes: Iterable[Probe]) -> list[str]:
        """The containers of ``probes`` that lack their element."""
        ...

    async def elements_of(self, table: Table, container: Set | Map) -> set[Canonical]:
        """Every element of ``container``, as ``netlink.canonical`` writes them."""
        ...


def expected_shape(store: TableState) -> TableShape:
    """The shape of the table kpng last applied."""
    objects, rules, _ = skeleton(store.options)
    chains = {obj.name: 0 for obj in objects if isinstance(obj, Chain)}
    for rule in rules:
        chains[rule.chain] += 1
    for name, (_, chain_rules) in store.applied_chains.items():
        chains[name] = len(chain_rules)
    containers = {obj.name for obj in objects if isinstance(obj, Set | Map)}
    containers.update(store.applied_maps)
    return TableShape(chains, containers)


def compare_shapes(expected: TableShape, found: TableShape | None, table: Table) -> Drift | None:
    """The first kind of difference between the two shapes, or None."""
    if found is None:
        return Drift("table", f"table {table.family} {table.name} is gone")
    gone = sorted(expected.chains.keys() - found.chains.keys())
    foreign = sorted(found.chains.keys() - expected.chains.keys())
    if gone or foreign:
        return Drift("chain", _listed("chains", gone, foreign))
    changed = sorted(name for name, n in expected.chains.items() if found.chains[name] != n)
    if changed:
        counts = named(
            [
                f"{name} ({found.chains[name]} rules, not {expected.chains[name]})"
                for name in changed
            ]
        )
        return Drift("rules", f"rules were added to or removed from chains {counts}")
    gone = sorted(expected.containers - found.containers)
    foreign = sorted(found.containers - expected.containers)
    if gone or foreign:
        return Drift("map", _listed("sets and maps", gone, foreign))
    return None


def probes(store: TableState) -> list[Probe]:
    """One applied element of every container whose elements netlink can encode (not the
    interval sets, whose few elements the kernel splits in two, nor the affinity memory,
    which packets fill)."""
    containers = _containers(store)
    encoders = {}
    for name, container in containers.items():
        found = encoder(container)
        if found is not None:
            encoders[name] = found
    picked: dict[str, ElementKey] = {}
    for ek in store.applied_elements:
        if ek[0] not in picked and ek[0] in encoders:
            picked[ek[0]] = ek
            if len(picked) == len(encoders):
                break
    return [
        Probe(name, key, encoders[name].element(key, ()))
        for name, (_, key) in sorted(picked.items())
    ]


def compare_rules(applied: Mapping[str, tuple[bytes, ...]], found: TableShape) -> Drift | None:
    """The chains whose rules differ from what kpng's own commit left (``applied``, read right
    after it): a rule replaced in place, with the same count."""
    changed = sorted(name for name, rules in applied.items() if found.rules.get(name, ()) != rules)
    if not changed:
        return None
    return Drift("rules", f"rules of chains {named(changed)} were changed in place")


def comparable(store: TableState) -> list[tuple[Set | Map, ElementEncoder]]:
    """The containers whose elements netlink can encode, with their encoders: the exact
    comparison's (not the interval sets, whose elements the kernel splits, nor the affinity
    memory, which packets fill)."""
    found = []
    for _, container in sorted(_containers(store).items()):
        encodes = encoder(container)
        if encodes is not None:
            found.append((container, encodes))
    return found


def applied_by_container(store: TableState) -> dict[str, list[tuple[str, ...]]]:
    """The keys of the elements kpng applied, by container (a pass over 1.8 million at 100,000
    services: run it in a thread)."""
    by_container: dict[str, list[tuple[str, ...]]] = {}
    for name, key in store.applied_elements:
        by_container.setdefault(name, []).append(key)
    return by_container


def expected_elements(
    store: TableState,
    container: str,
    encodes: ElementEncoder,
    keys: Iterable[tuple[str, ...]],
    memo: dict[tuple[str, ...], bytes],
) -> set[Canonical]:
    """The elements kpng applied to ``container`` (``keys``), as ``netlink.canonical`` reads
    the kernel's; ``memo``, shared by the containers of one key type: a service's frontend is
    the key of its element in every endpoint map, encoded once."""
    applied, comments, write = store.applied_elements, store.applied_comments, encodes.canonical
    return {
        write(key, applied[container, key], comments.get((container, key), ""), memo)
        for key in keys
    }


def compare_elements(
    container: str, expected: set[Canonical], found: set[Canonical]
) -> Drift | None:
    """A container whose elements differ from what kpng applied."""
    if expected == found:
        return None
    gone, foreign = len(expected - found), len(found - expected)
    return Drift(
        "elements",
        f"{container} lacks {gone} of kpng's elements and holds {foreign} that are not kpng's",
    )


def missing_elements(missing: list[str]) -> Drift | None:
    if not missing:
        return None
    return Drift("elements", _listed("sets and maps emptied:", missing, [], verb=""))


def _containers(store: TableState) -> Mapping[str, Set | Map]:
    objects, _, _ = skeleton(store.options)
    found: dict[str, Set | Map] = {o.name: o for o in objects if isinstance(o, Set | Map)}
    found.update(store.applied_maps)
    return found


def _listed(what: str, gone: list[str], foreign: list[str], *, verb: str = " are gone") -> str:
    parts = []
    if gone:
        parts.append(f"{what} {named(gone)}{verb}")
    if foreign:
        parts.append(f"{what} {named(foreign)} are not kpng's")
    return "; ".join(parts)
