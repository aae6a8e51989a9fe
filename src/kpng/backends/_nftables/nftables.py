"""A typed nftables transaction, rendered to ``nft -f`` text (pure: no I/O).

Modelled on knftables: a ``Transaction`` collects typed operations on the objects of one table
(chains, rules, sets, maps, elements), validating each object when it is added, and an ``Nft``
(the kernel in ``executing.py``, or ``FakeNft`` in ``fake.py``) runs the whole transaction
atomically. Errors of a run are ``NftError``s carrying the failing line of the rendered text.

Rules are nft expressions as text: the layout that writes them (``layout.py``) is the one place
that knows nft's rule grammar, and the fake checks what a rule refers to (``@set``, ``jump`` and
``goto`` targets) rather than re-implementing the grammar.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, cast, runtime_checkable

from kpng.client import KpngError

Family = Literal["ip", "ip6", "inet"]
Verb = Literal["add", "delete", "flush"]

# nft identifiers: a letter, then letters, digits and a few punctuation marks (NFT_NAME_MAXLEN).
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,255}$")
_BAD_FIELD = re.compile(r"[{},;\n]| \. ")
# What a comment may hold: Kubernetes names (DNS labels and subdomains), "/" and ":" between
# them; at most nft's 128 characters.
_COMMENT = re.compile(r"[A-Za-z0-9._/:-]{0,128}")
_COMMENTED = ' comment "'

_HOOKS = ("prerouting", "input", "forward", "output", "postrouting")
_CHAIN_TYPES = ("filter", "nat", "route")
# Where a batch of elements goes on one line: one `add element` of 1,000 elements loads 10k
# services x 10 endpoints in 0.72 s on this machine, against 1.24 s with one line per element.
ELEMENTS_PER_LINE = 1000


class NftError(KpngError):
    """nft refused a transaction (nothing of it was applied), or could not be run at all.

    ``line_number`` and ``line`` are the rendered line nft reported (0 and "" when it named
    none); ``message`` is nft's own text.
    """

    def __init__(
        self, message: str, *, line_number: int = 0, line: str = "", errno: int = 0
    ) -> None:
        self.message = message
        self.line_number = line_number
        self.line = line
        self.errno = errno
        """The kernel's error number, where it gave one (netlink)."""
        where = f" at line {line_number}: {line[:300]}" if line_number else ""
        super().__init__(f"nft: {message}{where}")


class InvalidNftObject(NftError):
    """An object given to a transaction is not valid nftables (raised by ``Transaction.add``)."""


def _check_name(kind: str, name: str) -> None:
    if not _NAME.match(name):
        raise InvalidNftObject(f"invalid {kind} name {name!r}")


def _check_type(kind: str, type_: str) -> None:
    if not type_ or any(c in type_ for c in "{};\n"):
        raise InvalidNftObject(f"invalid {kind} type {type_!r}")


@dataclass(frozen=True)
class Table:
    """The table every object of a transaction lives in."""

    family: Family
    name: str
    comment: str = ""
    dormant: bool = False
    """Its base chains not attached to netfilter's hooks: no packet sees the table (set when
    it is made, until a netlink batch wakes it: ``netlink.py``)."""

    def __post_init__(self) -> None:
        if self.family not in ("ip", "ip6", "inet"):
            raise InvalidNftObject(f"invalid table family {self.family!r}")
        _check_name("table", self.name)


@dataclass(frozen=True)
class Chain:
    """A chain; a base chain has ``type``, ``hook`` and ``priority`` (e.g. "dstnat - 10")."""

    name: str
    type: str = ""
    hook: str = ""
    priority: str = ""

    def __post_init__(self) -> None:
        _check_name("chain", self.name)
        if self.type or self.hook or self.priority:
            if self.type not in _CHAIN_TYPES or self.hook not in _HOOKS or not self.priority:
                raise InvalidNftObject(
                    f"chain {self.name}: a base chain needs a type {_CHAIN_TYPES}, "
                    f"a hook {_HOOKS} and a priority"
                )
            if not re.match(r"^[a-z0-9 +-]+$", self.priority):
                raise InvalidNftObject(f"chain {self.name}: invalid priority {self.priority!r}")

    @property
    def is_base(self) -> bool:
        return bool(self.hook)


@dataclass(frozen=True)
class Rule:
    """One rule appended to ``chain``: an nft expression as text, one line."""

    chain: str
    expr: str

    def __post_init__(self) -> None:
        _check_name("chain", self.chain)
        if not self.expr.strip() or "\n" in self.expr or ";" in self.expr:
            raise InvalidNftObject(
                f"rule in {self.chain}: one expression on one line: {self.expr!r}"
            )


@dataclass(frozen=True)
class Set:
    """A named set. ``type`` is nft's (e.g. "ipv4_addr . inet_proto"), or ``typeof`` expressions.
    ``size``: the most elements it holds (0: nft's default, 65535 for a set the packet path
    fills)."""

    name: str
    type: str = ""
    typeof: str = ""
    flags: tuple[str, ...] = ()
    size: int = 0

    def __post_init__(self) -> None:
        _check_name("set", self.name)
        if bool(self.type) == bool(self.typeof):
            raise InvalidNftObject(f"set {self.name}: exactly one of type and typeof")
        _check_type("set", self.type or self.typeof)

    @property
    def key_arity(self) -> int:
        return len((self.type or self.typeof).split(" . "))


@dataclass(frozen=True)
class Map:
    """A named map from ``type`` (or ``typeof``) keys to ``value`` data ("verdict" for a vmap)."""

    name: str
    value: str
    type: str = ""
    typeof: str = ""
    flags: tuple[str, ...] = ()
    timeout_s: int = 0
    """Default element timeout (with flags "timeout"), e.g. for maps the packet path fills."""
    counter: bool = False
    """Every element gets a counter of its own, which each lookup that finds it updates (the
    kernel gives it to elements added without one)."""

    def __post_init__(self) -> None:
        _check_name("map", self.name)
        if bool(self.type) == bool(self.typeof):
            raise InvalidNftObject(f"map {self.name}: exactly one of type and typeof")
        _check_type("map", self.type or self.typeof)
        _check_type("map value", self.value)

    @property
    def key_arity(self) -> int:
        return len((self.type or self.typeof).split(" . "))

    @property
    def value_arity(self) -> int:
        return len(self.value.split(" . "))

    @property
    def is_verdict_map(self) -> bool:
        return self.value == "verdict"


@dataclass(frozen=True)
class Element:
    """An element of set or map ``container``: key fields, and value fields for a map."""

    container: str
    key: tuple[str, ...]
    value: tuple[str, ...] = ()
    comment: str = ""
    """Whose element it is (kube-proxy's ``namespace/name:port``), shown by ``nft list``."""

    def __post_init__(self) -> None:
        _check_name("set", self.container)
        if not self.key:
            raise InvalidNftObject(f"element of {self.container}: empty key")
        if not _COMMENT.fullmatch(self.comment):
            raise InvalidNftObject(f"element of {self.container}: invalid comment {self.comment!r}")
        # One regex over the joined fields: a full sync validates some 100k elements.
        fields = (*self.key, *self.value)
        if "" in fields or _BAD_FIELD.search("\t".join(fields)):
            raise InvalidNftObject(f"element of {self.container}: invalid field in {fields!r}")

    def render(self, *, with_value: bool = True) -> str:
        return render_element(self.key, self.value if with_value else (), self.comment)


def render_element(key: tuple[str, ...], value: tuple[str, ...], comment: str = "") -> str:
    """``key [comment "C"] [: value]``, fields joined by " . "."""
    text = " . ".join(key)
    if comment:
        text += f'{_COMMENTED}{comment}"'
    return f"{text} : {' . '.join(value)}" if value else text


def valid_comment(text: str) -> bool:
    """Whether ``text`` may be an element's comment (what ``Element`` checks)."""
    return _COMMENT.fullmatch(text) is not None


def comment_name(namespace: str, name: str, port: str = "") -> str:
    """kube-proxy's name of a service port in its rules: ``namespace/name:port`` (``:port``
    only for a named port), cut to what an nft comment holds."""
    return f"{namespace}/{name}{':' + port if port else ''}"[:128]


@runtime_checkable
class ElementFields(Protocol):
    """``Elements`` items that also give each element's fields (key, value, comment), in any
    order: what is sent as netlink (``netlink.py``) need not be rendered and parsed back."""

    def fields(self) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], str]]: ...


@dataclass(frozen=True)
class Elements:
    """Many elements of set or map ``container`` added at once, each already rendered as
    ``Element.render`` writes it (``key`` or ``key : value``).

    What a full sync uses instead of one ``Element`` per element: 100k ``Element``s cost more
    to make, validate and render than nft takes to load them. ``items`` are not validated one by
    one; they come from kpng's layout, which writes only addresses, protocols and numbers that
    the model parsed (a malformed one makes nft refuse the transaction). ``expand()`` gives the
    same elements as validated ``Element``s, and a transaction renders the same text either way
    (tests hold the two to each other).
    """

    container: str
    items: Sequence[str]

    def __post_init__(self) -> None:
        _check_name("set", self.container)

    def expand(self) -> list[Element]:
        """The items as ``Element``s (``InvalidNftObject`` for the first invalid one)."""
        out = []
        for item in self.items:
            key, colon, value = item.partition(" : ")
            key, commented, comment = key.partition(_COMMENTED)
            fields = tuple(value.split(" . ")) if colon else ()
            out.append(
                Element(
                    self.container,
                    tuple(key.split(" . ")),
                    fields,
                    comment.removesuffix('"') if commented else "",
                )
            )
        return out

    def render(self) -> str:
        """The items as the body of an ``add element`` command."""
        return ", ".join(self.items)


@dataclass(frozen=True)
class Named:
    """A chain, set or map known by its name alone, as a listing gives it: what a transaction
    flushes or deletes without knowing its definition."""

    kind: Literal["chain", "set", "map"]
    name: str

    def __post_init__(self) -> None:
        _check_name(self.kind, self.name)


Object = Table | Chain | Rule | Set | Map | Element | Elements | Named


@dataclass(frozen=True)
class Operation:
    verb: Verb
    obj: Object


@dataclass
class Transaction:
    """Operations on the objects of ``table``, in order, applied all-or-nothing by ``Nft.run``."""

    table: Table
    operations: list[Operation] = field(default_factory=list)

    def add(self, obj: Object) -> Transaction:
        """Create ``obj`` (a no-op for an existing table, chain, set or map, as in nft)."""
        if isinstance(obj, Table) and replace(obj, dormant=False) != self.table:
            raise InvalidNftObject(f"table {obj.name} is not this transaction's table")
        self.operations.append(Operation("add", obj))
        return self

    def delete(self, obj: Table | Chain | Set | Map | Element | Named) -> Transaction:
        """Delete ``obj``; nft fails the whole transaction if it does not exist."""
        self.operations.append(Operation("delete", obj))
        return self

    def flush(self, obj: Table | Chain | Set | Map | Named) -> Transaction:
        """Remove every rule of a chain, or every element of a set or map; of a table, every
        rule of its chains (and no element: the kernel's ``flush table``)."""
        self.operations.append(Operation("flush", obj))
        return self

    def __len__(self) -> int:
        return len(self.operations)

    def render(self) -> str:
        """The transaction as ``nft -f`` text, one command a line (elements batched per line)."""
        return "".join(line + "\n" for line, _ in self.lines())

    def lines(self) -> Iterator[tuple[str, Sequence[Operation]]]:
        """(text, the operations it holds) for each rendered line, for error reports."""
        ops = self.operations
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op.obj, Elements):
                many = op.obj
                prefix = f"add element {self._prefix()} {many.container} {{ "
                for start in range(0, len(many.items), ELEMENTS_PER_LINE):
                    chunk = Elements(many.container, many.items[start : start + ELEMENTS_PER_LINE])
                    yield f"{prefix}{chunk.render()} }}", (Operation("add", chunk),)
                i += 1
            elif isinstance(op.obj, Element):
                j = i + 1
                while (
                    j < len(ops)
                    and j - i < ELEMENTS_PER_LINE
                    and ops[j].verb == op.verb
                    and isinstance(ops[j].obj, Element)
                    and ops[j].obj.container == op.obj.container  # type: ignore[union-attr]
                ):
                    j += 1
                batch = ops[i:j]
                yield self._render_elements(op.verb, op.obj.container, batch), batch
                i = j
            else:
                yield self._render_one(op), (op,)
                i += 1

    def _prefix(self) -> str:
        return f"{self.table.family} {self.table.name}"

    def _render_elements(self, verb: Verb, container: str, batch: Sequence[Operation]) -> str:
        body = ", ".join(cast(Element, op.obj).render(with_value=verb == "add") for op in batch)
        return f"{verb} element {self._prefix()} {container} {{ {body} }}"

    def _render_one(self, op: Operation) -> str:
        obj, verb, t = op.obj, op.verb, self._prefix()
        if isinstance(obj, Table):
            body = ""
            if verb == "add":
                body = f'comment "{obj.comment}" ; ' if obj.comment else ""
                body += "flags dormant ; " if obj.dormant else ""
            return f"{verb} table {t}" + (f" {{ {body}}}" if body else "")
        if isinstance(obj, Named):
            if verb == "add":
                raise InvalidNftObject(f"{obj.kind} {obj.name}: only its definition can be added")
            return f"{verb} {obj.kind} {t} {obj.name}"
        if isinstance(obj, Chain):
            if verb == "add" and obj.is_base:
                return (
                    f"add chain {t} {obj.name} {{ type {obj.type} hook {obj.hook} "
                    f"priority {obj.priority} ; policy accept ; }}"
                )
            return f"{verb} chain {t} {obj.name}"
        if isinstance(obj, Rule):
            if verb != "add":
                raise InvalidNftObject("rules are removed by flushing their chain")
            return f"add rule {t} {obj.chain} {obj.expr}"
        if isinstance(obj, Set | Map):
            kind = "set" if isinstance(obj, Set) else "map"
            if verb != "add":
                return f"{verb} {kind} {t} {obj.name}"
            key = f"type {obj.type}" if obj.type else f"typeof {obj.typeof}"
            if isinstance(obj, Map):
                key += f" : {obj.value}"
            flags = f" flags {','.join(obj.flags)} ;" if obj.flags else ""
            if isinstance(obj, Set) and obj.size:
                flags += f" size {obj.size} ;"
            timeout = ""
            if isinstance(obj, Map) and obj.timeout_s:
                timeout = f" timeout {obj.timeout_s}s ;"
            if isinstance(obj, Map) and obj.counter:
                timeout += " counter ;"
            return f"add {kind} {t} {obj.name} {{ {key} ;{flags}{timeout} }}"
        raise InvalidNftObject(f"cannot render {obj!r}")


@dataclass(frozen=True)
class TableObjects:
    """The names of the chains, sets and maps a table holds."""

    chains: frozenset[str] = frozenset()
    sets: frozenset[str] = frozenset()
    maps: frozenset[str] = frozenset()


class Nft(Protocol):
    """Runs transactions: the kernel (``executing.KernelNft``) or the in-memory ``FakeNft``."""

    async def run(self, tx: Transaction) -> None:
        """Apply ``tx`` atomically; raise ``NftError`` (nothing applied) if it is refused."""
        ...

    async def delete_table(self, table: Table) -> bool:
        """Remove ``table`` if it exists; True if it did."""
        ...

    async def list_tables(self) -> list[Table]:
        """Every table of the network namespace, kpng's or not."""
        ...

    async def list_objects(self, table: Table) -> TableObjects | None:
        """The chains, sets and maps of ``table`` (None: there is no such table)."""
        ...

    async def list_table(self, table: Table) -> str:
        """``table`` with its rules and elements as ``nft list table`` prints it ("" if none)."""
        ...


def parse_tables(listing: str) -> list[Table]:
    """The ``ip``, ``ip6`` and ``inet`` tables of ``nft list tables`` output (``table FAMILY
    NAME`` lines)."""
    found = []
    for line in listing.splitlines():
        match line.split():
            case ["table", ("ip" | "ip6" | "inet") as family, name]:
                found.append(Table(family, name))
    return found


def parse_objects(listing: str, table: Table) -> TableObjects | None:
    """The chains, sets and maps of ``table`` in ``nft -t list chains|sets|maps FAMILY`` output
    (None if the table is not in it). Only the ``table``, ``chain``, ``set`` and ``map`` lines
    opening a block are read: rules and set bodies are skipped whatever they hold."""
    found: dict[str, set[str]] | None = None
    current = False
    for line in listing.splitlines():
        match line.split():
            case ["table", family, name, "{"]:
                current = (family, name) == (table.family, table.name)
                if current and found is None:
                    found = {"chain": set(), "set": set(), "map": set()}
            case [("chain" | "set" | "map") as kind, name, "{"] if current and found is not None:
                found[kind].add(name)
    if found is None:
        return None
    return TableObjects(frozenset(found["chain"]), frozenset(found["set"]), frozenset(found["map"]))


def error_for_line(tx: Transaction, *, line_number: int, message: str) -> NftError:
    """The ``NftError`` naming rendered line ``line_number`` (1-based) of ``tx``."""
    for n, (text, _) in enumerate(tx.lines(), start=1):
        if n == line_number:
            return NftError(message, line_number=n, line=text)
    return NftError(message, line_number=line_number)
