"""Manifest documents (YAML or JSON, single objects, ``kind: List``, kpng dumps, Go KPNG's state
files) to model objects.

Pure: bytes in, model objects and error messages out. A malformed object is reported with its
file, kind, namespace and name, and skipped; the rest of the document is still used. A document
that cannot be parsed at all raises ``InputError``, so the caller can keep what it had.

Bounded: whatever a file holds, reading it raises nothing but ``InputError``, and takes memory
in proportion to its size. A number that does not fit the field kpng reads it into (``1e400``, an
integer of a thousand digits) costs its object; nesting past the parsers' depth limits, or YAML
aliases that would expand a document past ``MAX_ALIAS_NODES`` (a "billion laughs"), cost the file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from kpng.errors import InputError, InvalidObject, object_name
from kpng.model import converting, dumping, k8s
from kpng.model.cluster import ServiceCIDR, Slice
from kpng.model.messages import Node, Service

if TYPE_CHECKING:
    import yaml

log = logging.getLogger(__name__)

ObjectKey = tuple[str, str, str]
"""(kind, namespace, name); namespace is "" for Nodes."""


class Ignored(msgspec.Struct, frozen=True):
    """A Service that is there but not kpng's, and why (``kpng explain`` says it)."""

    reason: str


Model = Service | Slice | Node | ServiceCIDR
Entry = Model | Ignored | None
"""What a file holds under a key: the object, or an ignored Service (why), or None (ignored)."""
_KINDS = ("Service", "EndpointSlice", "Node", "ServiceCIDR")

MAX_ALIAS_NODES = 100_000
"""How many nodes YAML aliases may add to a document once expanded, or as many as the document
holds if it holds more: anchors that share a few ports or labels add hundreds; nine levels of
anchors, each naming the one below ten times, add 10^9 from 700 bytes, which every reader of
the document (the JSON encoding of an object, its conversion) would expand."""
MAX_YAML_DEPTH = 1000
"""The deepest a YAML document may nest, aliases expanded: libyaml's own limit for a document as
written, which aliases (each level an alias of the one below) would otherwise get around."""
MAX_INT_CHARS = 100
"""The longest YAML integer kpng converts (its digits, sign and base prefix): every integer kpng
reads fits in 11, and converting one costs time quadratic in its length (Python refuses
past 4300 digits). A longer one is kept as its text, and refused by any field that wants a
number."""

MAX_OBJECT_BYTES = 3 << 19
"""The largest object kpng reads from a manifest, as JSON: 1.5 MiB, etcd's default request limit
(``--max-request-bytes``), so no larger object exists in a Kubernetes cluster. A larger one is
reported, naming it, and skipped; the rest of the file is used."""


class Parsed(msgspec.Struct):
    """One file's objects. ``Ignored`` or None: the object is there but ignored (not kpng's)."""

    objects: dict[ObjectKey, Entry]
    errors: list[str]


class _Envelope(msgspec.Struct):
    kind: str = ""
    items: list[msgspec.Raw] | None = None


class _IdentityMeta(msgspec.Struct):
    name: Any = None
    namespace: Any = None


class _Identity(msgspec.Struct):
    """What names a JSON object that does not decode, read alone: the field that spoils the
    object (a number out of range) is skipped unread here."""

    kind: Any = None
    metadata: _IdentityMeta | None = None


_object_decoder = msgspec.json.Decoder(k8s.Object)
_envelope_decoder = msgspec.json.Decoder(_Envelope)
_identity_decoder = msgspec.json.Decoder(_Identity)


class ItemMemo:
    """The objects a JSON ``kind: List`` file held at its last parse, by the digest of each item's
    bytes. A file rewritten with one object changed (``kubectl get -o json > file``) then
    costs one decode and conversion, not one per object: decoding is most of a parse, and
    hashing an item costs a fraction of decoding it.

    Only a cache: an item is the same object whenever its bytes are, for a given
    ``proxy_name``, so a hit is exactly what a decode would give. Items kpng reports as errors
    are not kept (they are decoded again, and reported again)."""

    def __init__(self) -> None:
        self._last: dict[bytes, tuple[ObjectKey, Entry]] = {}
        self._now: dict[bytes, tuple[ObjectKey, Entry]] = {}

    def _start(self) -> None:
        # What the previous parse saw; items gone from the file since are dropped with it.
        self._last, self._now = self._now, {}

    def _lookup(self, digest: bytes) -> tuple[ObjectKey, Entry] | None:
        hit = self._last.get(digest)
        if hit is not None:
            self._now[digest] = hit
        return hit

    def _remember(self, digest: bytes, key: ObjectKey, model: Entry) -> None:
        self._now[digest] = (key, model)


def parse(
    data: bytes, *, filename: str, proxy_name: str | None = None, memo: ItemMemo | None = None
) -> Parsed:
    """The objects of one file. Raises InputError if the file is not YAML or JSON at all.
    ``memo``, kept from one parse of a file to the next, spares decoding unchanged items."""
    try:
        return _parse(data, filename, proxy_name, memo)
    except RecursionError:
        # msgspec's depth limit (Python's recursion limit, some 1000 levels less the caller's
        # stack): raised wherever a document nests that deep, before anything is kept.
        raise InputError(
            f"{filename}: nested too deeply (some 1000 levels; a Kubernetes object nests 10)"
        ) from None


def _parse(data: bytes, filename: str, proxy_name: str | None, memo: ItemMemo | None) -> Parsed:
    parsed = Parsed(objects={}, errors=[])
    if data.lstrip()[:1] not in (b"{", b"["):
        _parse_yaml(data, filename, proxy_name, parsed)
        return parsed
    try:
        envelope = _envelope_decoder.decode(data)
    except msgspec.DecodeError as exc:
        # Not one JSON document; maybe YAML in flow style, or several documents.
        try:
            _parse_yaml(data, filename, proxy_name, parsed)
        except InputError:
            raise InputError(f"{filename}: invalid JSON: {exc}") from None
        return parsed
    _parse_json(envelope, data, filename, proxy_name, parsed, memo)
    return parsed


def _parse_json(
    envelope: _Envelope,
    data: bytes,
    filename: str,
    proxy_name: str | None,
    parsed: Parsed,
    memo: ItemMemo | None,
) -> None:
    if envelope.kind == dumping.KIND:
        _add_dump(data, filename, parsed)
    elif envelope.kind == "List" or (not envelope.kind and envelope.items is not None):
        if memo is None:
            for i, raw in enumerate(envelope.items or ()):
                _add_json_object(raw, f"{filename}: items[{i}]", proxy_name, parsed)
            return
        memo._start()
        for i, raw in enumerate(envelope.items or ()):
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            hit = memo._lookup(digest)
            if hit is not None:
                _keep(parsed, *hit, f"{filename}: items[{i}]")
                continue
            added = _add_json_object(raw, f"{filename}: items[{i}]", proxy_name, parsed)
            if added is not None:
                memo._remember(digest, *added)
    else:
        _add_json_object(data, filename, proxy_name, parsed)


def _add_json_object(
    raw: msgspec.Raw | bytes, where: str, proxy_name: str | None, parsed: Parsed
) -> tuple[ObjectKey, Entry] | None:
    if len(raw) > MAX_OBJECT_BYTES:
        _report_too_large(_identity_of_json(raw), len(raw), where, parsed)
        return None
    try:
        obj = _object_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        _report_undecodable(_identity_of_json(raw), str(exc), where, parsed)
        return None
    return _add(obj, where, proxy_name, parsed)


def _identity_of_json(raw: msgspec.Raw | bytes) -> tuple[str, str, str]:
    try:
        found = _identity_decoder.decode(raw)
    except msgspec.DecodeError:
        return "", "", ""  # (metadata that is no object, a kind of 1e400)
    meta = found.metadata or _IdentityMeta()
    return _identity_of(
        {"kind": found.kind, "metadata": {"name": meta.name, "namespace": meta.namespace}}
    )


def _parse_yaml(data: bytes, filename: str, proxy_name: str | None, parsed: Parsed) -> None:
    # Imported here: PyYAML, and Go KPNG's format, cost a node agent reading JSON (or a remote
    # kpng) some 13 ms of start-up for nothing.
    import yaml

    from kpng.model import gokpng

    try:
        documents = list(yaml.load_all(data, Loader=_loader()))
    except (yaml.YAMLError, _TooManyAliases) as exc:
        raise InputError(f"{filename}: invalid YAML: {exc}") from None
    for d, doc in enumerate(documents):
        where = f"{filename}: document {d}" if len(documents) > 1 else filename
        if doc is None:
            continue
        if isinstance(doc, dict) and doc.get("kind") == dumping.KIND:
            _add_dump(_to_json(doc), where, parsed)
        elif gokpng.is_state(doc):
            _add_go_kpng_state(doc, where, proxy_name, parsed)
        elif isinstance(doc, dict) and doc.get("kind") == "List":
            for i, item in enumerate(doc.get("items") or ()):
                _add_python_object(item, f"{where}: items[{i}]", proxy_name, parsed)
        else:
            _add_python_object(doc, where, proxy_name, parsed)


def _add_python_object(item: Any, where: str, proxy_name: str | None, parsed: Parsed) -> None:
    try:
        size = _json_size(item)
    except RecursionError:
        # Within libyaml's 1000 levels, yet deeper than msgspec encodes from this call's stack:
        # this object only.
        _report_undecodable(_identity_of(item), "nested too deeply", where, parsed)
        return
    if size > MAX_OBJECT_BYTES:
        _report_too_large(_identity_of(item), size, where, parsed)
        return
    try:
        obj = msgspec.convert(item, type=k8s.Object, str_keys=True)
    except msgspec.ValidationError as exc:
        _report_undecodable(_identity_of(item), _readable(str(exc)), where, parsed)
        return
    _add(obj, where, proxy_name, parsed)


def _report_undecodable(
    identity: tuple[str, str, str], error: str, where: str, parsed: Parsed
) -> None:
    kind, namespace, name = identity
    if kind not in _KINDS:
        reason = f"unsupported kind {kind!r}" if kind else "object without a kind"
    else:
        reason = error
    parsed.errors.append(
        f"{where}: {kind or 'object'} {object_name(namespace, name)}: {reason}; skipped"
    )


def _json_size(item: Any) -> int:
    """The size of a YAML document's object as JSON (0 if it has none: converting reports it).
    Raises RecursionError if it nests too deeply to encode."""
    if not isinstance(item, dict):
        return 0
    try:
        return len(_to_json(item))
    except (TypeError, ValueError, OverflowError):
        return 0  # (keys JSON has no form for: converting says what is wrong with them)


def _report_too_large(
    identity: tuple[str, str, str], size: int, where: str, parsed: Parsed
) -> None:
    kind, namespace, name = identity
    reason = (
        f"{size} bytes as JSON, larger than any object Kubernetes stores "
        f"({MAX_OBJECT_BYTES} bytes, etcd's request limit)"
    )
    error = InvalidObject(kind or "object", namespace, name, reason)
    parsed.errors.append(f"{where}: {error}; skipped")


def _identity_of(item: Any) -> tuple[str, str, str]:
    if not isinstance(item, dict):
        return "", "", ""
    meta = item.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    return (
        str(item.get("kind") or ""),
        str(meta.get("namespace") or ""),
        str(meta.get("name") or ""),
    )


def _add(
    obj: k8s.Object, where: str, proxy_name: str | None, parsed: Parsed
) -> tuple[ObjectKey, Entry] | None:
    """Convert and keep ``obj``; its key and model, or None if it was reported as an error."""
    model: Entry
    try:
        if isinstance(obj, k8s.Service):
            model = converting.service_from_k8s(obj, proxy_name=proxy_name)
            if model is None:
                reason = converting.ignored_because(obj, proxy_name=proxy_name)
                model = Ignored(reason) if reason is not None else None
        elif isinstance(obj, k8s.EndpointSlice):
            model = converting.slice_from_k8s(obj, proxy_name=proxy_name)
        elif isinstance(obj, k8s.ServiceCIDR):
            model = converting.service_cidr_from_k8s(obj)
        else:
            model = converting.node_from_k8s(obj)
    except InvalidObject as exc:
        parsed.errors.append(f"{where}: {exc}; skipped")
        return None
    kind = type(obj).__name__
    cluster_wide = kind in ("Node", "ServiceCIDR")
    namespace = "" if cluster_wide else obj.metadata.namespace or "default"
    key = (kind, namespace, obj.metadata.name)
    _keep(parsed, key, model, where)
    return key, model


def _keep(parsed: Parsed, key: ObjectKey, model: Entry, where: str) -> None:
    if key in parsed.objects:
        kind, namespace, name = key
        what = f"{kind} {object_name(namespace, name)}"
        parsed.errors.append(f"{where}: {what}: duplicate object; the first one is kept")
        return
    parsed.objects[key] = model


def _add_dump(data: bytes, where: str, parsed: Parsed) -> None:
    try:
        objects = dumping.load(data)
    except InputError as exc:
        parsed.errors.append(f"{where}: {exc}; skipped")
        return
    for model in objects:
        if _named_as_the_api_server_would(model, where, parsed):
            _keep(parsed, model_key(model), model, where)


def _named_as_the_api_server_would(model: Model, where: str, parsed: Parsed) -> bool:
    """Whether a model read as such (a dump, Go KPNG's state) has names a cluster would hold;
    reported if not. A Kubernetes object's names are checked as it is converted."""
    try:
        converting.check_identity(*model_key(model))
    except InvalidObject as exc:
        parsed.errors.append(f"{where}: {exc}; skipped")
        return False
    return True


def _add_go_kpng_state(
    doc: dict[str, Any], where: str, proxy_name: str | None, parsed: Parsed
) -> None:
    from kpng.model import gokpng

    objects, errors = gokpng.load(doc)
    parsed.errors += [f"{where}: {_readable(error)}" for error in errors]
    ignored: set[tuple[str, str]] = set()
    for model in objects:
        if not _named_as_the_api_server_would(model, where, parsed):
            continue
        # The service-proxy-name rule, as for a Service manifest (Go KPNG's file has no headless
        # services: its store never held them).
        if isinstance(model, Service) and not converting.is_proxied(
            model.Labels, proxy_name=proxy_name
        ):
            ignored.add((model.Namespace, model.Name))
            _keep(parsed, model_key(model), None, where)
            continue
        if isinstance(model, Slice) and model.service_key in ignored:
            _keep(parsed, model_key(model), None, where)
            continue
        _keep(parsed, model_key(model), model, where)


def model_key(model: Model) -> ObjectKey:
    if isinstance(model, Service):
        return ("Service", model.Namespace, model.Name)
    if isinstance(model, Slice):
        return ("EndpointSlice", model.namespace, model.name)
    if isinstance(model, ServiceCIDR):
        return ("ServiceCIDR", "", model.name)
    return ("Node", "", model.Name)


class _LongInteger:
    """A YAML integer longer than ``MAX_INT_CHARS``, as written: no number kpng reads is one, so
    the field that holds it refuses it (naming its path), and a field kpng skips costs nothing."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<an integer of {len(self.text)} characters>"


def _readable(error: str) -> str:
    """msgspec's error, ``_LongInteger`` said as what it is."""
    return error.replace(
        f"got `{_LongInteger.__name__}`", f"got an integer of more than {MAX_INT_CHARS} characters"
    )


def _to_json(item: Any) -> bytes:
    # A long integer as its text: the object's size stays what it is, and a dump's field that
    # wants a number refuses it.
    return msgspec.json.encode(item, enc_hook=_long_integer_text)


def _long_integer_text(value: Any) -> str:
    if isinstance(value, _LongInteger):
        return value.text
    raise TypeError(f"{type(value).__name__} has no JSON form")


class _TooManyAliases(Exception):
    """A YAML document whose aliases expand past the bounds: the file is refused."""


def _check_aliases(root: yaml.Node) -> None:
    """Raise _TooManyAliases if ``root``'s document, its aliases expanded, would hold more than
    ``MAX_ALIAS_NODES`` nodes beyond its own (or as many as it holds, if more), nest deeper than
    ``MAX_YAML_DEPTH``, or hold itself. Counted on the composed nodes, where an alias is one
    node reachable twice: the count costs one visit per node written, whatever the expansion."""
    import yaml

    expanded: dict[int, tuple[int, int]] = {}
    """For each node visited (by id): its node count and depth, aliases expanded."""
    open_: set[int] = set()
    """The nodes being counted: one reached again before it is counted holds itself."""
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted_children = stack.pop()
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if counted_children:
            open_.discard(id(node))
            below = [expanded[id(child)] for child in children]
            expanded[id(node)] = (
                1 + sum(count for count, _ in below),
                1 + max((depth for _, depth in below), default=0),
            )
            continue
        if id(node) in expanded:
            continue
        if id(node) in open_:
            raise _TooManyAliases(f"an alias holds itself, line {node.start_mark.line + 1}")
        open_.add(id(node))
        stack.append((node, True))
        stack += ((child, False) for child in children if id(child) not in expanded)
    written = len(expanded)
    count, depth = expanded[id(root)]
    if count - written > max(MAX_ALIAS_NODES, written):
        raise _TooManyAliases(
            f"its aliases expand it from {written} to {count} nodes, more than "
            f"{max(MAX_ALIAS_NODES, written)} added (a YAML alias bomb?)"
        )
    if depth > MAX_YAML_DEPTH:
        raise _TooManyAliases(
            f"its aliases nest it {depth} levels deep, more than {MAX_YAML_DEPTH}"
        )


@functools.cache
def _loader() -> type[yaml.SafeLoader]:
    """Safe YAML with timestamps left as strings (kpng reads none, and msgspec wants str keys),
    long integers left as text (``_LongInteger``), and aliases bounded (``_check_aliases``)."""
    import yaml

    base = yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader

    def __init__(self: Any, stream: bytes) -> None:
        base.__init__(self, stream)
        # Without an anchor and an alias, nothing expands: kubectl writes neither, and a 10k
        # services file is spared a walk of its million nodes.
        self.may_alias = b"&" in stream and b"*" in stream

    def construct_document(self: Any, node: yaml.Node) -> Any:
        if self.may_alias:
            _check_aliases(node)
        return base.construct_document(self, node)

    def construct_int(self: Any, node: yaml.ScalarNode) -> int | _LongInteger:
        if len(node.value) > MAX_INT_CHARS:
            return _LongInteger(node.value)
        return base.construct_yaml_int(self, node)

    loader: type[yaml.SafeLoader] = type(
        "_Loader", (base,), {"__init__": __init__, "construct_document": construct_document}
    )
    loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    return loader
