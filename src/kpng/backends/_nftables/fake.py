"""``FakeNft``: an in-memory nft with the interface of ``KernelNft``, for fast golden tests.

It applies a transaction to a copy of its state and keeps the copy only if every operation was
valid, as the kernel does, and checks what the kernel would refuse: objects that already exist or
do not, rules and verdicts naming chains, sets or maps that do not exist, elements whose key or
value has the wrong number of fields, deleting what is still referenced. ``dump()`` prints the
state in a deterministic order (sets and elements sorted, rules in order).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kpng.backends._nftables.netlink import (
    Canonical,
    TableShape,
    canonical,
    element_payload,
    encoder,
)
from kpng.backends._nftables.nftables import (
    Chain,
    Element,
    Elements,
    Map,
    Named,
    NftError,
    Operation,
    Rule,
    Set,
    Table,
    TableObjects,
    Transaction,
    parse_tables,
)

if TYPE_CHECKING:
    from kpng.backends._nftables.auditing import Probe

_SET_REF = re.compile(r"@([A-Za-z][A-Za-z0-9_.-]*)")
_CHAIN_REF = re.compile(r"\b(?:jump|goto) ([A-Za-z][A-Za-z0-9_.-]*)")


@dataclass
class _TableState:
    table: Table
    chains: dict[str, Chain] = field(default_factory=dict)
    rules: dict[str, list[str]] = field(default_factory=dict)
    sets: dict[str, Set | Map] = field(default_factory=dict)
    elements: dict[str, dict[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    comments: dict[tuple[str, tuple[str, ...]], str] = field(default_factory=dict)
    """The comment of each element added with one (read only while the element exists)."""

    def chain_references(self, name: str) -> list[str]:
        refs = [
            f"rule in {chain}"
            for chain, rules in self.rules.items()
            for rule in rules
            if name in _CHAIN_REF.findall(rule)
        ]
        refs += [
            f"element of {container}"
            for container, elements in self.elements.items()
            for value in elements.values()
            if name in _CHAIN_REF.findall(" ".join(value))
        ]
        return refs

    def set_references(self, name: str) -> list[str]:
        return [
            f"rule in {chain}"
            for chain, rules in self.rules.items()
            for rule in rules
            if name in _SET_REF.findall(rule)
        ]


class FakeNft:
    """In-memory nftables: ``run`` transactions, ``dump`` the state."""

    def __init__(self) -> None:
        self.tables: dict[tuple[str, str], _TableState] = {}
        self.transactions: list[Transaction] = []
        """Every transaction that was applied, in order (refused ones are not kept)."""
        self._touches = 0

    async def run(self, tx: Transaction) -> None:
        tables = copy.deepcopy(self.tables)
        for n, (line, ops) in enumerate(tx.lines(), start=1):
            for op in ops:
                try:
                    _apply(tables, tx.table, op)
                except NftError as exc:
                    raise NftError(exc.message, line_number=n, line=line) from None
        self.tables = tables
        self.transactions.append(tx)

    async def delete_table(self, table: Table) -> bool:
        return self.tables.pop((table.family, table.name), None) is not None

    async def list_tables(self) -> list[Table]:
        return parse_tables("".join(f"table {f} {n}\n" for f, n in sorted(self.tables)))

    async def list_objects(self, table: Table) -> TableObjects | None:
        state = self.tables.get((table.family, table.name))
        if state is None:
            return None
        sets = frozenset(name for name, obj in state.sets.items() if isinstance(obj, Set))
        return TableObjects(frozenset(state.chains), sets, frozenset(state.sets) - sets)

    async def list_table(self, table: Table) -> str:
        if (table.family, table.name) not in self.tables:
            return ""
        return self.dump(only=table)

    # A drift check's questions (``auditing.Inspects``), as the kernel answers them.

    async def generation(self) -> int:
        """Moved by every transaction applied, as the kernel's by every commit (tests that
        change the state behind kpng's back call ``touched``)."""
        return len(self.transactions) + self._touches

    def touched(self) -> None:
        """Another program committed something."""
        self._touches += 1

    async def shape(self, table: Table) -> TableShape | None:
        state = self.tables.get((table.family, table.name))
        if state is None:
            return None
        return TableShape(
            {name: len(state.rules[name]) for name in state.chains},
            set(state.sets),
            {name: tuple(rule.encode() for rule in rules) for name, rules in state.rules.items()},
        )

    async def elements_of(self, table: Table, container: Set | Map) -> set[Canonical]:
        """The elements of ``container`` as the kernel would answer them (encoded as to-nft
        encodes them; empty for one it cannot encode)."""
        state = self.tables.get((table.family, table.name))
        found = encoder(container)
        if state is None or found is None:
            return set()
        comments = state.comments
        return {
            canonical(
                element_payload(found.element(key, value, comments.get((container.name, key), "")))
            )
            for key, value in state.elements.get(container.name, {}).items()
        }

    async def has_elements(self, table: Table, probes: Iterable[Probe]) -> list[str]:
        state = self.tables.get((table.family, table.name))
        return [
            p.container
            for p in probes
            if state is None or p.key not in state.elements.get(p.container, {})
        ]

    def elements(self, table: Table, container: str) -> dict[tuple[str, ...], tuple[str, ...]]:
        """The elements of a set or map, key -> value (empty tuple for a set)."""
        return dict(self.tables[(table.family, table.name)].elements[container])

    def dump(self, only: Table | None = None) -> str:
        """The whole state (or ``only`` that table) as text, in an order that depends only on
        the state."""
        out: list[str] = []
        for key in sorted(self.tables):
            if only is not None and key != (only.family, only.name):
                continue
            state = self.tables[key]
            out.append(f"table {key[0]} {key[1]}")
            for name in sorted(state.sets):
                obj = state.sets[name]
                kind = "map" if isinstance(obj, Map) else "set"
                out.append(f"  {kind} {name}")
                for k, v in sorted(state.elements[name].items()):
                    out.append("    " + " . ".join(k) + (" : " + " . ".join(v) if v else ""))
            for name in sorted(state.chains):
                chain = state.chains[name]
                hook = f" ({chain.type} {chain.hook} {chain.priority})" if chain.is_base else ""
                out.append(f"  chain {name}{hook}")
                out.extend(f"    {rule}" for rule in state.rules[name])
        return "".join(line + "\n" for line in out)


def _apply(tables: dict[tuple[str, str], _TableState], table: Table, op: Operation) -> None:
    key = (table.family, table.name)
    obj = op.obj
    if isinstance(obj, Table):
        if op.verb == "add":
            tables.setdefault(key, _TableState(table))
        elif op.verb == "delete":
            if tables.pop(key, None) is None:
                raise NftError("No such file or directory (table)")
        else:  # as the kernel: every rule, and no element of any set or map
            state = _state(tables, key)
            state.rules = {name: [] for name in state.rules}
        return
    state = _state(tables, key)
    if isinstance(obj, Named):
        known = state.chains if obj.kind == "chain" else state.sets
        found = known.get(obj.name)
        if found is None or (obj.kind != "chain" and isinstance(found, Map) != (obj.kind == "map")):
            raise NftError(f"No such file or directory ({obj.kind} {obj.name})")
        obj = found
    if isinstance(obj, Chain):
        _apply_chain(state, op.verb, obj)
    elif isinstance(obj, Rule):
        if obj.chain not in state.chains:
            raise NftError(f"No such file or directory (chain {obj.chain})")
        for name in _SET_REF.findall(obj.expr):
            if name not in state.sets:
                raise NftError(f"No such file or directory (set {name})")
        for name in _CHAIN_REF.findall(obj.expr):
            if name not in state.chains:
                raise NftError(f"No such file or directory (chain {name})")
        state.rules[obj.chain].append(obj.expr)
    elif isinstance(obj, Set | Map):
        _apply_set(state, op.verb, obj)
    elif isinstance(obj, Elements):
        # The kernel checks every element of a batch; so does the fake, as typed ones.
        try:
            elements = obj.expand()
        except NftError as exc:
            raise NftError(f"syntax error: {exc.message}") from None
        for element in elements:
            _apply_element(state, op.verb, element)
    else:
        _apply_element(state, op.verb, obj)


def _state(tables: dict[tuple[str, str], _TableState], key: tuple[str, str]) -> _TableState:
    if key not in tables:
        raise NftError(f"No such file or directory (table {key[0]} {key[1]})")
    return tables[key]


def _apply_chain(state: _TableState, verb: str, chain: Chain) -> None:
    if verb == "add":
        existing = state.chains.get(chain.name)
        if existing is not None and existing != chain:
            raise NftError(f"Device or resource busy (chain {chain.name} redefined)")
        state.chains.setdefault(chain.name, chain)
        state.rules.setdefault(chain.name, [])
        return
    if chain.name not in state.chains:
        raise NftError(f"No such file or directory (chain {chain.name})")
    if verb == "flush":
        state.rules[chain.name] = []
        return
    if state.rules[chain.name]:
        raise NftError(f"Device or resource busy (chain {chain.name} has rules)")
    refs = state.chain_references(chain.name)
    if refs:
        raise NftError(f"Device or resource busy (chain {chain.name} used by {refs[0]})")
    del state.chains[chain.name]
    del state.rules[chain.name]


def _apply_set(state: _TableState, verb: str, obj: Set | Map) -> None:
    if verb == "add":
        existing = state.sets.get(obj.name)
        if existing is not None and existing != obj:
            raise NftError(f"File exists (set {obj.name} redefined)")
        state.sets.setdefault(obj.name, obj)
        state.elements.setdefault(obj.name, {})
        return
    if obj.name not in state.sets:
        raise NftError(f"No such file or directory (set {obj.name})")
    if verb == "flush":
        state.elements[obj.name] = {}
        return
    refs = state.set_references(obj.name)
    if refs:
        raise NftError(f"Device or resource busy (set {obj.name} used by {refs[0]})")
    del state.sets[obj.name]
    del state.elements[obj.name]


def _apply_element(state: _TableState, verb: str, element: Element) -> None:
    container = state.sets.get(element.container)
    if container is None:
        raise NftError(f"No such file or directory (set {element.container})")
    if len(element.key) != container.key_arity:
        raise NftError(
            f"Error: key of {element.container} has {container.key_arity} fields, "
            f"element {element.render()} has {len(element.key)}"
        )
    elements = state.elements[element.container]
    if verb == "delete":
        if element.key not in elements:
            missing = element.render(with_value=False)
            raise NftError(f"No such file or directory (element {missing})")
        del elements[element.key]
        return
    if isinstance(container, Map):
        if len(element.value) != container.value_arity:
            raise NftError(f"Error: value of {element.container}: {element.render()}")
        if container.is_verdict_map:
            verdict = element.value[0]
            target = _CHAIN_REF.findall(verdict)
            if not target and verdict not in ("accept", "drop", "return", "continue"):
                raise NftError(f"Error: not a verdict: {verdict}")
            if target and target[0] not in state.chains:
                raise NftError(f"No such file or directory (chain {target[0]})")
    elif element.value:
        raise NftError(f"Error: set {element.container} takes no value")
    existing = elements.get(element.key)
    if existing is not None and existing != element.value:
        raise NftError(f"File exists (element {element.render(with_value=False)})")
    elements[element.key] = element.value
    state.comments[(element.container, element.key)] = element.comment
