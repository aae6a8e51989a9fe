"""A first sync's bulk elements as nf_tables netlink messages (pure: no I/O).

nft's text parser is most of what loading elements costs: 1.1 million elements into one
verdict map took 17.3 s with ``nft -f`` and 7.5 s as a netlink batch encoded here, at a
quarter of the memory (``bench/bench_nft_netlink.py``). The rest of a transaction (chains, rules,
interval sets) stays text: its grammar lives in ``layout.py`` alone.

One netlink batch cannot join libnftables' own, so a table is only ever built this way where
it does not exist yet, and without a gap for packets: ``split_fresh`` takes a full transaction
that makes the table anew and gives back the same transaction with the table made *dormant*
(its base chains are not attached to netfilter's hooks: no packet sees any of it) and without
the bulk elements, and a netlink batch that adds those elements and wakes the table, in one
kernel transaction. Until that batch commits, the node has no kpng rules at all, as before its
first sync. A refused batch is followed at once by the whole transaction as text, which makes
the table anew. A kpng that ends between the two leaves the dormant table: the next full sync
finds it so (``NetlinkBatches.dormant``) and makes it anew too. Waking the old one would not do:
the kernel takes no new base chain in a transaction that changes a table's flags.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from kpng.backends._netlink import NETLINK_NETFILTER as NETLINK_NETFILTER
from kpng.backends._netlink import NLA_F_NESTED as _NLA_F_NESTED
from kpng.backends._netlink import NLM_F_ACK as NLM_F_ACK
from kpng.backends._netlink import NLM_F_REQUEST as _NLM_F_REQUEST
from kpng.backends._netlink import attr as _attr
from kpng.backends._netlink import messages as messages
from kpng.backends._netlink import nested as _nested
from kpng.backends._netlink import nested_attributes
from kpng.backends._nftables.nftables import (
    ElementFields,
    Elements,
    Map,
    Operation,
    Set,
    Table,
    Transaction,
)

_NFNL_SUBSYS_NFTABLES = 10
_NFNL_MSG_BATCH_BEGIN = 0x10
_NFNL_MSG_BATCH_END = 0x11
_NFT_MSG_NEWTABLE = 0
_NFT_MSG_GETTABLE = 1
TABLE_FLAGS_ATTR = 2  # NFTA_TABLE_FLAGS
TABLE_F_DORMANT = 0x1
_NFT_MSG_NEWSETELEM = 12
_NLM_F_CREATE = 0x400
_FAMILIES = {"inet": 1, "ip": 2, "ip6": 10}  # NFPROTO_*
MESSAGE_ELEMENTS = 60_000
"""Bytes of elements a message holds: their list is one attribute, with a 16-bit length."""
TEXT_OPERATIONS = 10_000
"""Operations of the dormant table's text in one libnftables transaction (``FreshTable``)."""

_VERDICTS = {"accept": 1, "drop": 0, "continue": -1, "return": -5}
_CHAIN_VERDICTS = {"jump": -3, "goto": -4}
_PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132}
_COMMENTED = ' comment "'


def _string(kind: int, value: str) -> bytes:
    return _attr(kind, value.encode() + b"\0")


def _u32(kind: int, value: int) -> bytes:
    return _attr(kind, struct.pack(">I", value & 0xFFFFFFFF))


def _message(kind: int, seq: int, family: int, body: bytes, *, flags: int = 0) -> bytes:
    header = struct.pack("=IHHII", 20 + len(body), kind, _NLM_F_REQUEST | flags, seq, 0)
    return header + struct.pack("=BBH", family, 0, 0) + body


def _batch_edge(kind: int, seq: int) -> bytes:
    """A batch's begin or end: its resource id names the subsystem the batch is for."""
    header = struct.pack("=IHHII", 20, kind, _NLM_F_REQUEST, seq, 0)
    return header + struct.pack("=BBH", 0, 0, socket.htons(_NFNL_SUBSYS_NFTABLES))


# Partials of C functions: called for every address, they cost no Python frame.
_ipv4: Callable[[str], bytes] = functools.partial(socket.inet_pton, socket.AF_INET)
_ipv6: Callable[[str], bytes] = functools.partial(socket.inet_pton, socket.AF_INET6)


def _protocol(text: str) -> bytes:
    number = _PROTOCOLS.get(text)
    return bytes((int(text) if number is None else number,))


def _port(text: str) -> bytes:
    return struct.pack(">H", int(text))


_FIELDS: dict[str, tuple[Callable[[str], bytes], bool]] = {
    "ipv4_addr": (_ipv4, False),
    "ipv6_addr": (_ipv6, False),
    # Few values, repeated by every service: each encoded once.
    "inet_proto": (_protocol, True),
    "inet_service": (_port, True),
}

Field = Callable[[str], bytes]
Fields = Callable[[Sequence[str]], bytes]


class _Encoded(dict[str, bytes]):
    """Field texts to their encoding, each encoded on first use: a hit is a C-level lookup."""

    def __init__(self, encode: Field, padded: bool) -> None:
        super().__init__()
        self._encode = encode
        self._padded = padded

    def __missing__(self, text: str) -> bytes:
        found = self._encode(text)
        if self._padded:
            found += b"\0" * (-len(found) % 4)
        self[text] = found
        return found


def _field(name: str, *, concatenated: bool) -> Field | None:
    known = _FIELDS.get(name)
    if known is None:
        return None
    encode, repeated = known
    if not repeated:
        return encode  # addresses: 4 or 16 bytes, whole registers already
    # Concatenated, each field takes whole 32-bit registers, as nf_tables lays them out.
    return _Encoded(encode, padded=concatenated).__getitem__


def _fields(type_: str) -> Fields | None:
    """The encoder of a key or value of nft type ``type_`` (None: not one this module knows).
    Unrolled for the arities kpng's maps have: it runs for every element."""
    names = type_.split(" . ")
    each = [_field(name, concatenated=len(names) > 1) for name in names]
    if None in each:
        return None
    fields = [f for f in each if f is not None]
    arity = len(fields)

    def wrong(values: Sequence[str]) -> ValueError:
        return ValueError(f"{len(values)} fields for {type_}")

    if arity == 1:
        (f0,) = fields

        def one(values: Sequence[str]) -> bytes:
            if len(values) != 1:
                raise wrong(values)
            return f0(values[0])

        return one
    if arity == 2:
        f0, f1 = fields

        def two(values: Sequence[str]) -> bytes:
            if len(values) != 2:
                raise wrong(values)
            return f0(values[0]) + f1(values[1])

        return two
    if arity == 3:
        f0, f1, f2 = fields

        def three(values: Sequence[str]) -> bytes:
            if len(values) != 3:
                raise wrong(values)
            return f0(values[0]) + f1(values[1]) + f2(values[2])

        return three

    def many(values: Sequence[str]) -> bytes:
        if len(values) != arity:
            raise wrong(values)
        return b"".join([f(v) for f, v in zip(fields, values, strict=True)])

    return many


def _verdict(text: str) -> bytes:
    word, _, chain = text.partition(" ")
    if chain:
        code = _CHAIN_VERDICTS[word]
        inner = _u32(1, code) + _string(2, chain)
    else:
        inner = _u32(1, _VERDICTS[word])
    return _nested(2, _nested(2, inner))  # NFTA_SET_ELEM_DATA { NFTA_DATA_VERDICT { ... } }


def _value_header(kind: int, length: int) -> bytes:
    """The headers of ``kind`` { NFTA_DATA_VALUE } around a value of ``length`` bytes."""
    padded = length + (-length % 4)
    return struct.pack("=HH", 8 + padded, kind | _NLA_F_NESTED) + struct.pack("=HH", 4 + length, 1)


class ElementEncoder:
    """One container's elements as the attributes of an element list: from their fields
    (``elements``, ``element``) or from ``Elements`` items, as ``render_element`` writes them
    (calling it). ``ValueError`` for an element it cannot encode. ``key_type``: the nft type of
    its keys; containers with the same one may share the memo of ``elements``."""

    def __init__(self, key_type: str, key: Fields, value: Fields | None, verdict: bool) -> None:
        self.key_type = key_type
        self._key = key
        self._value = value
        self._verdict = verdict
        self._verdicts: dict[str, bytes] = {}
        self._canonical_verdicts: dict[str, bytes] = {}
        self._comments: dict[str, bytes] = {}
        self._headers: dict[tuple[int, int], bytes] = {}

    def __call__(self, item: str) -> bytes:
        key_text, colon, value_text = item.partition(" : ")
        key_text, _, comment = key_text.partition(_COMMENTED)
        value = tuple(value_text.split(" . ")) if colon else ()
        return self.element(tuple(key_text.split(" . ")), tuple(value), comment.removesuffix('"'))

    def element(self, key: tuple[str, ...], value: tuple[str, ...], comment: str = "") -> bytes:
        (encoded,) = self.elements([(key, value, comment)], {})
        return encoded

    def elements(
        self,
        fields: Iterable[tuple[tuple[str, ...], tuple[str, ...], str]],
        keys: dict[tuple[str, ...], bytes],
    ) -> Iterator[bytes]:
        """Each element's attribute. ``keys``: encoded keys by their fields, shared by the
        containers of one ``key_type``: a service's frontend is the key of its element in
        every endpoint map, encoded once."""
        encode_key, encode_value, verdicts, comments = (
            self._key,
            self._value,
            self._verdicts,
            self._comments,
        )
        value_parts: dict[int, tuple[bytes, bytes]] = {}
        """The header and the padding around a value, by its length."""
        key: tuple[str, ...] = ()
        try:
            for key, value, comment in fields:
                k = keys.get(key)
                if k is None:
                    raw = encode_key(key)
                    k = keys[key] = self._header(1, len(raw)) + raw + b"\0" * (-len(raw) % 4)
                if not value:
                    body = k
                elif self._verdict:
                    (verdict,) = value
                    data = verdicts.get(verdict)
                    if data is None:
                        data = verdicts[verdict] = _verdict(verdict)
                    body = k + data
                elif encode_value is not None:
                    raw = encode_value(value)
                    around = value_parts.get(len(raw))
                    if around is None:
                        n = len(raw)
                        around = value_parts[n] = (self._header(2, n), b"\0" * (-n % 4))
                    body = k + around[0] + raw + around[1]
                else:
                    raise ValueError("a value for a set")
                if comment:
                    note = comments.get(comment)
                    if note is None:
                        text = comment.encode() + b"\0"
                        # nftnl's user data: the comment's type (0), its length, the string.
                        note = comments[comment] = _attr(6, bytes((0, len(text))) + text)
                    body += note
                yield _ELEMENT_HEADER(4 + len(body), 1 | _NLA_F_NESTED) + body
        except (OSError, struct.error, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"element {' . '.join(key)!r}: {exc}") from exc

    def canonical(
        self,
        key: tuple[str, ...],
        value: tuple[str, ...],
        comment: str = "",
        keys: dict[tuple[str, ...], bytes] | None = None,
    ) -> tuple[bytes, bytes, bytes]:
        """The element as ``canonical`` reads it back from the kernel, written directly: the
        exact comparison encodes every element kpng applied. ``keys``: encoded keys by their
        fields, shared by the containers of one ``key_type`` (as in ``elements``)."""
        raw = keys.get(key) if keys is not None else None
        if raw is None:
            raw = self._key(key)
            if keys is not None:
                keys[key] = raw
        if not value:
            data = b""
        elif self._verdict:
            (verdict,) = value
            data = self._canonical_verdicts.get(verdict) or b""
            if not data:
                word, _, chain = verdict.partition(" ")
                code = _CHAIN_VERDICTS[word] if chain else _VERDICTS[word]
                data = struct.pack(">I", code & 0xFFFFFFFF) + chain.encode()
                self._canonical_verdicts[verdict] = data
        elif self._value is not None:
            data = self._value(value)
        else:
            raise ValueError("a value for a set")
        note = b""
        if comment:
            text = comment.encode() + b"\0"
            note = bytes((0, len(text))) + text
        return raw, data, note

    def _header(self, kind: int, length: int) -> bytes:
        found = self._headers.get((kind, length))
        if found is None:
            found = self._headers[kind, length] = _value_header(kind, length)
        return found


_ELEMENT_HEADER = struct.Struct("=HH").pack


def encoder(container: Set | Map) -> ElementEncoder | None:
    """How to encode ``container``'s elements; None where they stay text: ``typeof`` keys,
    flags (intervals, timeouts, what the packet path fills) and types not known here."""
    if container.typeof or container.flags:
        return None
    key = _fields(container.type)
    if key is None:
        return None
    if isinstance(container, Set):
        return ElementEncoder(container.type, key, None, verdict=False)
    if container.timeout_s:
        return None
    if container.is_verdict_map:
        return ElementEncoder(container.type, key, None, verdict=True)
    value = _fields(container.value)
    return None if value is None else ElementEncoder(container.type, key, value, verdict=False)


@dataclass(frozen=True)
class FreshTable:
    """A full transaction that makes its table anew, split in two (``split_fresh``): ``text``
    makes the table dormant and without its bulk elements; ``batch`` encodes the netlink batch
    that adds them and wakes the table. Apart, so that the batch is encoded while libnftables
    takes the text."""

    text: Transaction
    family: int
    moved: tuple[tuple[str, ElementEncoder, Sequence[str]], ...]
    message_bytes: int = MESSAGE_ELEMENTS
    """Of elements in one message, at most."""
    text_operations: int = TEXT_OPERATIONS
    """Of ``text`` in one of ``texts``, at most."""

    def texts(self) -> list[Transaction]:
        """``text`` as transactions of ``text_operations`` each, to run in order: the first
        makes the table, dormant, so no packet sees the parts between them. libnftables then
        holds one part's parse at a time: 100k services' rules took 450 MB as one. Each
        operation refers only to what earlier ones made, so any cut keeps the order valid."""
        ops, size = self.text.operations, self.text_operations
        return [
            Transaction(self.text.table, ops[start : start + size])
            for start in range(0, len(ops), size)
        ]

    def batch(self) -> list[bytes]:
        """The batch's messages. ``ValueError``: an element it cannot encode (the caller applies
        the whole transaction as text instead)."""
        names = _string(1, self.text.table.name)
        messages = [_batch_edge(_NFNL_MSG_BATCH_BEGIN, 0)]
        seq = 1
        keys: dict[str, dict[tuple[str, ...], bytes]] = {}
        for container, encode, items in self.moved:
            head = names + _string(2, container)
            chunk: list[bytes] = []
            size = 0
            # Items that hold their fields are encoded from them: rendering each as text only
            # to parse it again took most of the encoding's time.
            elements: Iterable[bytes] = (
                encode.elements(items.fields(), keys.setdefault(encode.key_type, {}))
                if isinstance(items, ElementFields)
                else map(encode, items)
            )
            for element in elements:
                if chunk and size + len(element) > self.message_bytes:
                    messages.append(_elements_message(seq, self.family, head, chunk, size))
                    seq += 1
                    chunk, size = [], 0
                chunk.append(element)
                size += len(element)
            if chunk:
                messages.append(_elements_message(seq, self.family, head, chunk, size))
                seq += 1
        # The table's flags set to none: awake, its base chains attached, with every element in.
        wake = _message(
            (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWTABLE,
            seq,
            self.family,
            names + _u32(TABLE_FLAGS_ATTR, 0),
            flags=_NLM_F_CREATE | NLM_F_ACK,
        )
        messages.append(wake)
        messages.append(_batch_edge(_NFNL_MSG_BATCH_END, seq + 1))
        return messages


def split_fresh(
    tx: Transaction,
    *,
    message_bytes: int = MESSAGE_ELEMENTS,
    text_operations: int = TEXT_OPERATIONS,
) -> FreshTable | None:
    """``tx``, a full transaction that makes its table anew (``add``, ``delete``, ``add`` of the
    table first), as a ``FreshTable``; None if ``tx`` is not such a transaction or has no
    element this module encodes."""
    ops = tx.operations
    table = tx.table
    fresh = [Operation("add", table), Operation("delete", table), Operation("add", table)]
    if ops[:3] != fresh:
        return None
    containers: dict[str, ElementEncoder | None] = {}
    text: list[Operation] = [*fresh[:2], Operation("add", replace(table, dormant=True))]
    moved: list[tuple[str, ElementEncoder, Sequence[str]]] = []
    for op in ops[3:]:
        obj = op.obj
        if isinstance(obj, Set | Map) and op.verb == "add":
            containers[obj.name] = encoder(obj)
        if isinstance(obj, Elements):
            encode = containers.get(obj.container)
            if encode is not None:
                moved.append((obj.container, encode, obj.items))
                continue
        text.append(op)
    if not moved:
        return None
    return FreshTable(
        Transaction(table, text),
        _FAMILIES[table.family],
        tuple(moved),
        message_bytes,
        text_operations,
    )


def _elements_message(seq: int, family: int, head: bytes, chunk: list[bytes], size: int) -> bytes:
    body = head + struct.pack("=HH", 4 + size, 3 | _NLA_F_NESTED) + b"".join(chunk)
    return _message(
        (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWSETELEM,
        seq,
        family,
        body,
        flags=_NLM_F_CREATE | NLM_F_ACK,
    )


def get_table(table: Table) -> bytes:
    """The request for ``table``'s attributes (its flags among them)."""
    return _message(
        (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETTABLE,
        1,
        _FAMILIES[table.family],
        _string(1, table.name),
        flags=NLM_F_ACK,
    )


# What a drift check asks the kernel (``executing.NetlinkBatches``, ``auditing.py``): none of
# it reads a set's elements, so its cost does not grow with the services.
_NFT_MSG_GETCHAIN = 4
_NFT_MSG_GETRULE = 7
_NFT_MSG_GETSET = 10
_NFT_MSG_GETSETELEM = 13
_NFT_MSG_GETGEN = 16
_NLM_F_DUMP = 0x300
_NFT_SET_ANONYMOUS = 0x1
_NFT_SET_MAP = 0x4
NLMSG_DONE = 3


def get_generation() -> bytes:
    """The request for the ruleset's generation: the kernel counts every nf_tables commit."""
    return _message((_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETGEN, 1, 0, b"")


def dump_objects(kind: str, table: Table) -> bytes:
    """The request for every ``chain``, ``rule`` or ``set`` (maps included) of ``table``'s
    family; the kernel filters rules and sets by the table, chains are filtered here."""
    message = {"chain": _NFT_MSG_GETCHAIN, "rule": _NFT_MSG_GETRULE, "set": _NFT_MSG_GETSET}[kind]
    return _message(
        (_NFNL_SUBSYS_NFTABLES << 8) | message,
        1,
        _FAMILIES[table.family],
        _string(1, table.name),  # NFTA_{CHAIN,RULE,SET}_TABLE
        flags=_NLM_F_DUMP,
    )


def get_element(table: Table, container: str, element: bytes) -> bytes:
    """The request for one element (``element``: its ``NFTA_LIST_ELEM`` with the key alone,
    as ``ElementEncoder.element(key, ())`` writes it); the kernel answers ENOENT if it has none."""
    body = (
        _string(1, table.name)  # NFTA_SET_ELEM_LIST_TABLE
        + _string(2, container)  # NFTA_SET_ELEM_LIST_SET
        + _nested(3, element)  # NFTA_SET_ELEM_LIST_ELEMENTS
    )
    return _message(
        (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETSETELEM,
        1,
        _FAMILIES[table.family],
        body,
        flags=NLM_F_ACK,
    )


def attributes(message: bytes) -> dict[int, bytes]:
    """The top-level attributes of one nf_tables message (header and nfgenmsg skipped), by
    type without its flags."""
    (length,) = struct.unpack_from("=I", message, 0)
    return dict(nested_attributes(message[20:length]))


def generation(message: bytes) -> int:
    """``NFTA_GEN_ID`` of a NEWGEN message."""
    return int(struct.unpack(">I", attributes(message)[1][:4])[0])


def _text(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode()


@dataclass
class TableShape:
    """What a table holds but its elements: the rules of each chain, its sets and maps."""

    chains: dict[str, int]
    """Each chain and how many rules it holds."""
    containers: set[str]
    """Its named sets and maps (anonymous ones, which rules own, are not counted)."""
    rules: dict[str, tuple[bytes, ...]] = field(default_factory=dict)
    """Each chain's rules, in order, as the kernel holds their expressions: what kpng's own
    commit left is compared with what a check finds (a rule edited in place)."""


def shape_of(
    table: Table, chains: Iterable[bytes], rules: Iterable[bytes], sets: Iterable[bytes]
) -> TableShape:
    """The shape of ``table`` from the messages of the three dumps (``dump_objects``)."""
    shape = TableShape({}, set())
    for message in chains:
        attrs = attributes(message)
        if _text(attrs.get(1, b"")) == table.name:
            shape.chains.setdefault(_text(attrs.get(3, b"")), 0)  # NFTA_CHAIN_NAME
    listed: dict[str, list[bytes]] = {}
    for message in rules:
        attrs = attributes(message)
        if _text(attrs.get(1, b"")) == table.name:
            chain = _text(attrs.get(2, b""))  # NFTA_RULE_CHAIN
            shape.chains[chain] = shape.chains.get(chain, 0) + 1
            listed.setdefault(chain, []).append(attrs.get(4, b""))  # NFTA_RULE_EXPRESSIONS
    shape.rules = {chain: tuple(found) for chain, found in listed.items()}
    for message in sets:
        attrs = attributes(message)
        flags = struct.unpack(">I", attrs[3][:4])[0] if 3 in attrs else 0  # NFTA_SET_FLAGS
        if _text(attrs.get(1, b"")) == table.name and not flags & _NFT_SET_ANONYMOUS:
            shape.containers.add(_text(attrs.get(2, b"")))  # NFTA_SET_NAME
    return shape


# The slow, exact comparison (``auditing.compare_elements``): every element of a container, as
# the kernel holds it, against the same element as kpng encodes it.


def dump_elements(table: Table, container: str) -> bytes:
    """The request for every element of ``container``."""
    body = _string(1, table.name) + _string(2, container)  # NFTA_SET_ELEM_LIST_{TABLE,SET}
    return _message(
        (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETSETELEM,
        1,
        _FAMILIES[table.family],
        body,
        flags=_NLM_F_DUMP,
    )


Canonical = tuple[bytes, bytes, bytes]
"""An element as both sides can write it: its key's bytes, its value's (or its verdict's code
and chain), its comment's (nftnl's user data)."""


def canonical(element: bytes) -> Canonical:
    """One ``NFTA_LIST_ELEM``'s payload as ``Canonical``: what kpng writes and what the kernel
    answers differ in flags and padding, never in these. Unrolled: it runs for every element
    of the table."""
    key = value = note = b""
    offset, end = 0, len(element)
    while offset + 4 <= end:
        size, kind = _HEADER(element, offset)
        kind &= 0x7FFF
        if kind == 1:  # NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE }
            inner, _ = _HEADER(element, offset + 4)
            key = element[offset + 8 : offset + 4 + inner]
        elif kind == 2:  # NFTA_SET_ELEM_DATA { NFTA_DATA_VALUE | NFTA_DATA_VERDICT {...} }
            inner, data = _HEADER(element, offset + 4)
            payload = element[offset + 8 : offset + 4 + inner]
            verdict = data & 0x7FFF != 1
            value = (_verdicts.get(payload) or _verdict_of(payload)) if verdict else payload
        elif kind == 6:  # NFTA_SET_ELEM_USERDATA
            note = element[offset + 4 : offset + size]
        if size < 4:
            break
        offset += (size + 3) & ~3
    return key, value, note


_HEADER = struct.Struct("=HH").unpack_from
_verdicts: dict[bytes, bytes] = {}
"""Verdicts as ``canonical`` writes them, by their attributes: a table has a few hundred."""


def _verdict_of(payload: bytes) -> bytes:
    value = b"".join(
        p.split(b"\0", 1)[0] if k == 2 else p for k, p in sorted(nested_attributes(payload))
    )
    if len(_verdicts) < 65536:
        _verdicts[payload] = value
    return value


def elements_in(message: bytes) -> Iterator[bytes]:
    """The ``NFTA_LIST_ELEM`` payloads of one NEWSETELEM message of a dump."""
    listed = attributes(message).get(3, b"")  # NFTA_SET_ELEM_LIST_ELEMENTS
    for kind, payload in nested_attributes(listed):
        if kind == 1:
            yield payload


def element_payload(encoded: bytes) -> bytes:
    """The payload of an ``NFTA_LIST_ELEM`` attribute ``ElementEncoder`` wrote."""
    (size,) = struct.unpack_from("=H", encoded, 0)
    return encoded[4:size]


# The traffic counters (``counting.py``): each counted element's key and its counter's packets,
# read from the same dump as the exact comparison's.

_PROTOCOL_NAMES = {6: "tcp", 17: "udp", 132: "sctp"}
_ADDRESS_BYTES = {"v4": 4, "v6": 16}


def element_counters(message: bytes) -> list[tuple[bytes, int]]:
    """Each counted element of one NEWSETELEM message of a dump: its key's bytes and its
    counter's packets (elements without a counter are left out). Walks the message in place,
    reading only the key and the counter: it runs for every element of every counted map, a
    million at 100k services and the endpoint level (the generic attribute walk took 20 us an
    element)."""
    out: list[tuple[bytes, int]] = []
    end = min(len(message), _U32(message, 0)[0]) if len(message) >= 4 else 0
    offset = 20  # nlmsghdr, nfgenmsg
    while offset + 4 <= end:
        size, kind = _HEADER(message, offset)
        if size < 4:
            break
        if kind & 0x3FFF == 3:  # NFTA_SET_ELEM_LIST_ELEMENTS
            _list_counters(message, offset + 4, min(offset + size, end), out)
        offset += (size + 3) & ~3
    return out


def _list_counters(buf: bytes, offset: int, end: int, out: list[tuple[bytes, int]]) -> None:
    append = out.append
    while offset + 4 <= end:
        size, kind = _HEADER(buf, offset)
        if size < 4:
            return
        stop = min(offset + size, end)
        if kind & 0x3FFF == 1:  # NFTA_LIST_ELEM
            key: bytes | None = None
            packets: int | None = None
            at = offset + 4
            while at + 4 <= stop:
                attr_size, attr = _HEADER(buf, at)
                if attr_size < 4:
                    break
                attr &= 0x3FFF
                if attr == 1 and at + 8 <= stop:  # NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE }
                    inner, _ = _HEADER(buf, at + 4)
                    key = buf[at + 8 : min(at + 4 + inner, at + attr_size, stop)]
                elif attr == 7:  # NFTA_SET_ELEM_EXPR: its one expression
                    # The kernel writes a counter so: its name, its bytes, its packets.
                    if buf.startswith(_COUNTER_HEAD, at + 4) and buf.startswith(
                        _PACKETS_HEAD, at + 32
                    ):
                        if at + 44 <= stop:
                            packets = _U64(buf, at + 36)[0]
                    else:
                        found = _packets(buf, at + 4, min(at + attr_size, stop))
                        packets = packets if found is None else found
                elif attr == 11:  # NFTA_SET_ELEM_EXPRESSIONS { NFTA_LIST_ELEM { expression } }
                    each, after = at + 4, min(at + attr_size, stop)
                    while each + 4 <= after:
                        each_size, _ = _HEADER(buf, each)
                        if each_size < 4:
                            break
                        found = _packets(buf, each + 4, min(each + each_size, after))
                        packets = packets if found is None else found
                        each += (each_size + 3) & ~3
                at += (attr_size + 3) & ~3
            if key is not None and packets is not None:
                append((key, packets))
        offset += (size + 3) & ~3


def _packets(buf: bytes, offset: int, end: int) -> int | None:
    """``NFTA_COUNTER_PACKETS`` of the ``counter`` expression at ``offset`` (None: another
    expression, or none)."""
    counter = False
    while offset + 4 <= end:
        size, kind = _HEADER(buf, offset)
        if size < 4:
            return None
        kind &= 0x3FFF
        if kind == 1:  # NFTA_EXPR_NAME
            counter = size == 12 and buf.startswith(_COUNTER_NAME, offset + 4)
        elif kind == 2 and counter:  # NFTA_EXPR_DATA
            at, stop = offset + 4, min(offset + size, end)
            while at + 4 <= stop:
                data_size, data = _HEADER(buf, at)
                if data_size < 4:
                    return None
                if data & 0x3FFF == 2:  # NFTA_COUNTER_PACKETS, big-endian u64
                    return _U64(buf, at + 4)[0] if data_size >= 12 and at + 12 <= stop else None
                at += (data_size + 3) & ~3
            return None
        offset += (size + 3) & ~3
    return None


_U32 = struct.Struct("=I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_COUNTER_NAME = b"counter\0"
_COUNTER_HEAD = b"\x0c\x00\x01\x00counter\x00\x1c\x00\x02\x00\x0c\x00\x01\x00"
"""A counter expression's name and data, up to the packets: NFTA_EXPR_NAME, NFTA_EXPR_DATA {
NFTA_COUNTER_BYTES ..., as the kernel writes them (``_packets`` reads any other layout)."""
_PACKETS_HEAD = b"\x0c\x00\x02\x00"


def dispatch_key(key: bytes, fam: str, *, port_only: bool) -> tuple[str, ...] | None:
    """A dispatch element's key fields as kpng writes them (``address . proto . port``, or
    ``proto . port`` for a node port) from the kernel's bytes, each field padded to 4 bytes;
    None for bytes no kpng element has."""
    start = 0 if port_only else _ADDRESS_BYTES[fam]
    if len(key) != start + 8:
        return None
    proto = _PROTOCOL_NAMES.get(key[start])
    if proto is None:
        return None
    port = str(int.from_bytes(key[start + 4 : start + 6], "big"))
    if port_only:
        return (proto, port)
    # inet_ntop writes IPv4 as ipaddress does, and faster; IPv6 goes through ipaddress, whose
    # text kpng writes (inet_ntop's differs for IPv4-mapped addresses).
    address = _ipv4_text(key[:4]) if start == 4 else str(ipaddress.ip_address(key[:start]))
    return (address, proto, port)


_ipv4_text: Callable[[bytes], str] = functools.partial(socket.inet_ntop, socket.AF_INET)
