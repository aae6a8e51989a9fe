"""What to-ebpf writes in its BPF maps, and in which order (pure: bytes in, bytes out).

``sockets.bpf.c`` and ``maps.bpf.h`` describe the maps; the packing here is the C structs'
layout, padding included. A service port contributes:

- an **endpoint set** per scope of endpoints it uses (its id, 64 bits of a hash of the service
  port, family and scope, is the same in every kpng process, so a restarted kpng finds its sets
  where it left them), held as a count and one slot per index, and one member per endpoint
  when the programs ask whether a remembered endpoint is still in it (ClientIP affinity, UDP
  flows): most services need no members, and a full sync at 10k services writes a third fewer
  entries;
- a **frontend** per address a local socket may reach it by: each ClusterIP (Internal
  endpoints), each external and LB IP and, on the node's own primary IPs, the node port (the
  External endpoints, or with eTP=Local every endpoint: a local client is short-circuited, as
  kube-proxy does for pods and the node).

A frontend with no endpoint for its traffic points at set 0: the programs leave it
untranslated and count it (``kpng_ebpf_no_endpoint_total``). A frontend is never written for an
LB IP with source ranges and, with ``--masquerade-all``, never for a ClusterIP. What the
programs leave untranslated is answered by the node's nftables rules (REJECT, DROP, source
ranges, masquerade), as for any connection from outside.

A UDP service port also has a set of the endpoints serving anywhere: a flow (one source port
of one network namespace) keeps its endpoint while it is in that set.

MapChanges keep each set's slots in place: an endpoint that stays keeps its index, one that goes
leaves its index to a newcomer or to the last slot's endpoint. A change of one endpoint writes a
few entries, and at no moment does a reader find a slot below the count that holds no endpoint.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import random
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kpng.backends._endpoints import (
    EndpointValue,
    affinity_timeout,
    endpoints_by_scope,
    serving_endpoints,
)
from kpng.backends._node import FAMILIES, Fam, Options
from kpng.client import ServiceEndpoints, ServiceKey

LAYOUT_VERSION = 2
"""Bumped whenever a key or value below changes shape: the pinned maps of another layout are
then left for new ones (``SocketBalancer`` pins each layout's maps in a directory of its own)."""

MapName = Literal["kpng_frontends", "kpng_sets", "kpng_slots", "kpng_members"]
MAPS: tuple[MapName, ...] = ("kpng_frontends", "kpng_sets", "kpng_slots", "kpng_members")
"""The maps kpng writes; the programs alone write affinity, flows and revnat."""

Scope = Literal["internal", "external", "cluster", "serving"]
_PROTOCOLS = {"TCP": 6, "UDP": 17}

_FRONTEND_KEY = struct.Struct("=16s2sBx")
_FRONTEND = struct.Struct("=QQQI4x")
_SET_KEY = struct.Struct("=Q")
_SET_INFO = struct.Struct("=I4x")
_SLOT_KEY = struct.Struct("=QI4x")
_ENDPOINT = struct.Struct("=16s2s2x")
_MEMBER_KEY = struct.Struct("=Q20s4x")
MEMBER_PRESENT = b"\x01"
NO_ENDPOINT = _FRONTEND.pack(0, 0, 0, 0)
"""A frontend's value when its service has no endpoint for that traffic (set 0)."""

KEY_SIZES: Mapping[MapName, int] = {
    "kpng_frontends": _FRONTEND_KEY.size,
    "kpng_sets": _SET_KEY.size,
    "kpng_slots": _SLOT_KEY.size,
    "kpng_members": _MEMBER_KEY.size,
}
VALUE_SIZES: Mapping[MapName, int] = {
    "kpng_frontends": _FRONTEND.size,
    "kpng_sets": _SET_INFO.size,
    "kpng_slots": _ENDPOINT.size,
    "kpng_members": len(MEMBER_PRESENT),
}


_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def address(text: str) -> bytes:
    """16 bytes; IPv4 as IPv4-mapped IPv6, as the programs build their keys. (inet_pton, not
    ipaddress: a full sync packs some 100,000 addresses at 10k services, and ipaddress's parser
    took most of its time.)"""
    if ":" in text:
        return socket.inet_pton(socket.AF_INET6, text)
    return _V4_MAPPED + socket.inet_pton(socket.AF_INET, text)


def _port(number: int) -> bytes:
    return number.to_bytes(2, "big")


def _id(*parts: str) -> int:
    """64 bits of a hash, never 0 (the programs read 0 as "no affinity")."""
    digest = hashlib.blake2b("/".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _endpoint(value: EndpointValue, cache: dict[EndpointValue, bytes]) -> bytes:
    packed = cache.get(value)
    if packed is None:
        # _ENDPOINT's layout, written out: a full sync packs one per endpoint of every set.
        packed = cache[value] = address(value[0]) + int(value[1]).to_bytes(2, "big") + b"\0\0"
    return packed


@dataclass
class Contribution:
    """One service's frontends and endpoint sets, packed."""

    frontends: dict[bytes, bytes] = field(default_factory=dict)
    sets: dict[int, tuple[bytes, ...]] = field(default_factory=dict)
    """Set id: its endpoints, ordered (the slots of a new set)."""
    checked: set[int] = field(default_factory=set)
    """The sets whose members are written: those a remembered endpoint is checked against."""
    ports: dict[bytes, str] = field(default_factory=dict)
    """Frontend key: the name of the service port it serves (its traffic's counter's)."""
    counted: dict[int, str] = field(default_factory=dict)
    """Set id of a frontend (not a serving set): the name of the service port it serves, what
    its endpoints' connections are counted for (``kpng_endpoint_traffic``)."""


def contribute(
    se: ServiceEndpoints,
    options: Options,
    node_ips: tuple[str, ...] = (),
    cache: dict[EndpointValue, bytes] | None = None,
) -> Contribution:
    """The map entries of ``se`` on a node with these primary IPs and options."""
    out = Contribution()
    cache = {} if cache is None else cache
    service = se.service
    ips = service.IPs
    if ips is None or ips.ClusterIPs is None:
        return out
    timeout = affinity_timeout(service)
    firewalled = {
        ip
        for flt in service.IPFilters
        if flt.TargetIPs
        for ip in (*flt.TargetIPs.V4, *flt.TargetIPs.V6)
    }
    for fam in FAMILIES:
        v6 = fam == "v6"
        cluster_ips = ips.ClusterIPs.family(v6)
        if not cluster_ips:
            continue
        outside = [
            ip
            for ip in (
                *(ips.ExternalIPs.family(v6) if ips.ExternalIPs else ()),
                *(ips.LoadBalancerIPs.family(v6) if ips.LoadBalancerIPs else ()),
            )
            if ip not in firewalled
        ]
        own = node_port_addresses(options, node_ips, v6)
        for port in service.Ports:
            proto = _PROTOCOLS.get(port.Protocol)
            if proto is None or not 0 < port.Port < 65536:
                continue  # SCTP and the like stay with the nftables rules
            internal, external, cluster_wide = endpoints_by_scope(se.endpoints, port, v6)
            port_id = (service.Namespace, service.Name, port.Protocol, str(port.Port), fam)
            affinity = _id("affinity", *port_id) if timeout else 0

            serving = 0
            if proto == _PROTOCOLS["UDP"]:
                # A UDP flow keeps its endpoint while it serves anywhere (kube-proxy 1.35+).
                all_used = (*internal, *external, *cluster_wide)
                eps = sorted(e for e in serving_endpoints(port, all_used) if (":" in e[0]) == v6)
                if eps:
                    serving = _id("set", *port_id, "serving")
                    out.sets[serving] = tuple([_endpoint(e, cache) for e in eps])

            def frontend(addr: str, number: int, scope: Scope, eps: list[EndpointValue]) -> None:
                key = _FRONTEND_KEY.pack(address(addr), _port(number), proto)  # noqa: B023
                out.ports[key] = port.Name  # noqa: B023
                if not eps:
                    # Known to the programs, so that they count what finds no endpoint.
                    out.frontends[key] = NO_ENDPOINT
                    return
                set_id = _id("set", *port_id, scope)  # noqa: B023
                out.sets[set_id] = tuple([_endpoint(e, cache) for e in eps])
                out.counted[set_id] = port.Name  # noqa: B023
                out.frontends[key] = _FRONTEND.pack(set_id, affinity, serving, timeout)  # noqa: B023
                # What pick and pick_for_send look a remembered endpoint up in.
                if affinity:  # noqa: B023
                    out.checked.add(set_id)
                if proto == _PROTOCOLS["UDP"]:  # noqa: B023
                    out.checked.add(serving or set_id)  # noqa: B023

            # --masquerade-all: every connection to a ClusterIP is to come from the node's
            # address, which only the nftables part can give it.
            for cip in () if options.masquerade_all else cluster_ips:
                frontend(cip, port.Port, "internal", internal)
            scope: Scope = "cluster" if service.ExternalTrafficToLocal else "external"
            reached = cluster_wide if service.ExternalTrafficToLocal else external
            for ip in outside:
                frontend(ip, port.Port, scope, reached)
            if port.NodePort:
                for ip in own:
                    frontend(ip, port.NodePort, scope, reached)
    return out


def endpoint_key(set_id: int, endpoint: bytes) -> bytes:
    """A ``kpng_endpoint_traffic`` key: the set and the endpoint, ``struct member_key``."""
    return _MEMBER_KEY.pack(set_id, endpoint)


def split_endpoint_key(key: bytes) -> tuple[int, bytes]:
    """A ``kpng_endpoint_traffic`` key's set id and endpoint."""
    set_id, endpoint = _MEMBER_KEY.unpack(key)
    return set_id, endpoint


def set_of_slot(key: bytes) -> int:
    """The set id a ``kpng_slots`` or ``kpng_sets`` key is of."""
    set_id: int = _SET_KEY.unpack_from(key)[0]
    return set_id


def describe_endpoint(endpoint: bytes) -> str:
    """A packed endpoint as the ``endpoint`` label: ``IP:port``, ``[IP]:port`` for IPv6."""
    addr, port = _ENDPOINT.unpack(endpoint)
    if addr.startswith(_V4_MAPPED):
        host = socket.inet_ntop(socket.AF_INET, addr[12:])
    else:
        host = f"[{socket.inet_ntop(socket.AF_INET6, addr)}]"
    return f"{host}:{int.from_bytes(port, 'big')}"


def describe_frontend(key: bytes) -> str:
    """A frontend key as a person reads it: ``10.96.0.10:80/TCP``, ``[fd00::a]:53/UDP``."""
    addr, port, proto = _FRONTEND_KEY.unpack(key)
    ip = ipaddress.IPv6Address(addr)
    text = str(ip.ipv4_mapped) if ip.ipv4_mapped else f"[{ip}]"
    name = next((n for n, p in _PROTOCOLS.items() if p == proto), str(proto))
    return f"{text}:{int.from_bytes(port, 'big')}/{name}"


@functools.lru_cache(maxsize=16)
def node_port_addresses(options: Options, node_ips: tuple[str, ...], v6: bool) -> tuple[str, ...]:
    """The node's primary IPs of a family that serve node ports (``--nodeport-addresses``);
    remembered, since every service of a sync asks the same."""
    fam: Fam = "v6" if v6 else "v4"
    ranges = [
        ipaddress.ip_network(c, strict=False)
        for c in options.cidrs(options.nodeport_addresses, fam)
    ]
    ips = [ipaddress.ip_address(ip) for ip in node_ips if (":" in ip) == v6]
    return tuple(
        str(ip) for ip in ips if not ip.is_loopback and (not ranges or any(ip in r for r in ranges))
    )


# --- changes


@dataclass
class MapChanges:
    """Map operations in the order they are to be made: ``updates`` first, map by map, then
    ``deletes``. Members and slots come before the counts that expose them, and counts before
    the frontends that lead to them; deletes go the other way."""

    updates: list[tuple[MapName, list[tuple[bytes, bytes]]]] = field(default_factory=list)
    deletes: list[tuple[MapName, list[bytes]]] = field(default_factory=list)
    full: bool = False
    """Every entry written anew (``SocketState.full``)."""
    conflicts: list[tuple[bytes, list[ServiceKey]]] = field(default_factory=list)
    """Frontend keys that services want with different values, and those services (the
    first one's value is written)."""

    def __len__(self) -> int:
        return sum(len(u) for _, u in self.updates) + sum(len(d) for _, d in self.deletes)


def relayout(old: Sequence[bytes], new: Iterable[bytes]) -> list[bytes]:
    """The slots of a set that held ``old`` and now holds ``new``: those that stay keep their
    index, newcomers take the freed ones first, and the last slots fill what is left."""
    wanted = list(dict.fromkeys(new))
    keep = set(wanted)
    slots: list[bytes | None] = [ep if ep in keep else None for ep in old]
    newcomers = [ep for ep in wanted if ep not in set(old)]
    for i, ep in enumerate(slots):
        if ep is None and newcomers:
            slots[i] = newcomers.pop(0)
    slots.extend(newcomers)
    # Compact: move the last endpoints into the holes that remain.
    while None in slots:
        hole = slots.index(None)
        last = slots.pop()
        if last is not None and hole < len(slots):
            slots[hole] = last
    return [ep for ep in slots if ep is not None]


class SocketState:
    """The maps' content as written, and the operations from it to a new content (pure).

    Each call records what it returns as written: when the kernel refuses part of it, the
    caller's next sync is ``full``, which starts again from what the maps hold."""

    def __init__(self) -> None:
        self.frontends: dict[bytes, bytes] = {}
        self.sets: dict[int, list[bytes]] = {}
        """Set id: its slots, in index order."""
        self.checked: set[int] = set()
        """The sets whose members are written."""
        self.contributions: dict[ServiceKey, Contribution] = {}
        self.counted: dict[int, tuple[ServiceKey, str]] = {}
        """Set id of a frontend: its service and port name (``Contribution.counted``). A set id
        hashes its service's name: no two services have one."""
        self._owners: dict[bytes, dict[ServiceKey, bytes]] = {}
        """Frontend key: the value each service that has it wants (two services may share an
        external IP and port); the first service's is written, as to-nft does, and deleting
        one service leaves the key to the others."""

    def entries(self) -> dict[str, int]:
        """How many entries each map holds, as written: what ``/metrics`` reports against the
        maps' capacity, without reading the kernel's maps."""
        sets = self.sets
        return {
            "kpng_frontends": len(self.frontends),
            "kpng_sets": len(sets),
            "kpng_slots": sum(len(slots) for slots in sets.values()),
            "kpng_members": sum(len(sets.get(s, ())) for s in self.checked),
        }

    def owners(self) -> dict[bytes, tuple[ServiceKey, str]]:
        """Each frontend written: the service whose value it holds and that service's port
        name (what its traffic is counted for)."""
        contributions = self.contributions
        out = {}
        for key, owners in self._owners.items():
            service = min(owners)
            out[key] = (service, contributions[service].ports.get(key, ""))
        return out

    def sample(self, per_map: int, rng: random.Random) -> list[tuple[MapName, bytes, bytes]]:
        """Up to ``per_map`` entries of each map as written (map, key, value), picked at random:
        read back every sync period, they find a value another program changed wherever it is,
        in time, at a cost that does not grow with the services."""
        out: list[tuple[MapName, bytes, bytes]] = []
        frontends = self.frontends
        for key in rng.sample(list(frontends), min(per_map, len(frontends))):
            out.append(("kpng_frontends", key, frontends[key]))
        sets = self.sets
        for set_id in rng.sample(list(sets), min(per_map, len(sets))):
            slots = sets[set_id]
            index = rng.randrange(len(slots))
            out.append(("kpng_sets", _SET_KEY.pack(set_id), _SET_INFO.pack(len(slots))))
            out.append(("kpng_slots", _SLOT_KEY.pack(set_id, index), slots[index]))
        checked = [s for s in self.checked if sets.get(s)]
        for set_id in rng.sample(checked, min(per_map, len(checked))):
            member = _MEMBER_KEY.pack(set_id, rng.choice(sets[set_id]))
            out.append(("kpng_members", member, MEMBER_PRESENT))
        return out

    def changes(self, updated: Mapping[ServiceKey, Contribution | None]) -> MapChanges:
        """The operations that replace these services' entries (None: the service is gone)."""
        touched: set[bytes] = set()
        sets: dict[int, tuple[bytes, ...] | None] = {}
        checked: set[int] = set()
        for key, new in updated.items():
            old = self.contributions.get(key)
            if old is not None:
                touched.update(old.frontends)
                sets.update(dict.fromkeys(old.sets))
            if new is not None:
                touched.update(new.frontends)
                sets.update(new.sets)
                checked |= new.checked
        self._record(updated)
        frontends = {k: self._wanted(k) for k in touched}
        changes = self._diff(
            {k: v for k, v in frontends.items() if self.frontends.get(k) != v},
            {
                s: eps
                for s, eps in sets.items()
                if eps is None
                or set(eps) != set(self.sets.get(s, ()))
                or (s in checked) != (s in self.checked)
            },
            checked,
        )
        changes.conflicts = self._conflicts(touched)
        return changes

    def full(
        self,
        updated: Mapping[ServiceKey, Contribution | None],
        present: Mapping[MapName, Iterable[bytes]],
    ) -> MapChanges:
        """Every service's entries written anew over maps that hold the keys ``present`` (at
        start, at a takeover, after a refusal); the keys no service wants are deleted."""
        self._record(updated)
        self.frontends, self.sets, self.checked = {}, {}, set()
        frontends = {k: owners[min(owners)] for k, owners in self._owners.items()}
        sets: dict[int, tuple[bytes, ...] | None] = {}
        checked: set[int] = set()
        for c in self.contributions.values():
            sets.update(c.sets)
            checked |= c.checked
        changes = self._diff(frontends, sets, checked)
        changes.full = True
        changes.conflicts = self._conflicts(self._owners)
        written = dict(changes.updates)
        for name in MAPS:
            keys = set(present.get(name, ()))
            if keys:
                keys.difference_update(k for k, _ in written.get(name, ()))
            if keys:
                changes.deletes.append((name, sorted(keys)))
        return changes

    def _record(self, updated: Mapping[ServiceKey, Contribution | None]) -> None:
        owners = self._owners
        for key, new in updated.items():
            old = self.contributions.pop(key, None)
            if old is not None:
                for set_id in old.counted:
                    self.counted.pop(set_id, None)
                for k in old.frontends:
                    wanting = owners[k]
                    del wanting[key]
                    if not wanting:
                        del owners[k]
            if new is not None:
                self.contributions[key] = new
                for set_id, name in new.counted.items():
                    self.counted[set_id] = (key, name)
                for k, v in new.frontends.items():
                    others = owners.get(k)
                    if others is None:
                        owners[k] = {key: v}
                    else:
                        others[key] = v

    def _wanted(self, key: bytes) -> bytes | None:
        owners = self._owners.get(key)
        return owners[min(owners)] if owners else None

    def _conflicts(self, keys: Iterable[bytes]) -> list[tuple[bytes, list[ServiceKey]]]:
        out = []
        for k in keys:
            owners = self._owners.get(k)
            if owners and len(owners) > 1 and len(set(owners.values())) > 1:
                out.append((k, sorted(owners)))
        return sorted(out)

    def _diff(
        self,
        frontends: Mapping[bytes, bytes | None],
        sets: Mapping[int, tuple[bytes, ...] | None],
        checked: set[int],
    ) -> MapChanges:
        """The operations for these frontends and sets (None: gone; members for the sets in
        ``checked``), recorded as written."""
        member_adds: list[tuple[bytes, bytes]] = []
        slot_writes: list[tuple[bytes, bytes]] = []
        counts: list[tuple[bytes, bytes]] = []
        set_deletes: list[bytes] = []
        slot_deletes: list[bytes] = []
        member_deletes: list[bytes] = []
        for set_id, eps in sets.items():
            old = self.sets.get(set_id, [])
            if not old:
                # A new set (every set of a full sync): no slot to keep, nothing to compare.
                if eps:
                    new = list(dict.fromkeys(eps))
                    slot_writes += [(_SLOT_KEY.pack(set_id, i), ep) for i, ep in enumerate(new)]
                    if set_id in checked:
                        member_adds += [
                            (_MEMBER_KEY.pack(set_id, ep), MEMBER_PRESENT) for ep in new
                        ]
                        self.checked.add(set_id)
                    counts.append((_SET_KEY.pack(set_id), _SET_INFO.pack(len(new))))
                    self.sets[set_id] = new
                continue
            new = relayout(old, eps or ())
            for i, ep in enumerate(new):
                if i >= len(old) or old[i] != ep:
                    slot_writes.append((_SLOT_KEY.pack(set_id, i), ep))
            slot_deletes.extend(_SLOT_KEY.pack(set_id, i) for i in range(len(new), len(old)))
            was = set(old) if set_id in self.checked else set()
            now = set(new) if set_id in checked else set()
            joined, left = now - was, was - now
            member_adds.extend(
                (_MEMBER_KEY.pack(set_id, ep), MEMBER_PRESENT) for ep in new if ep in joined
            )
            member_deletes.extend(_MEMBER_KEY.pack(set_id, ep) for ep in old if ep in left)
            if now:
                self.checked.add(set_id)
            else:
                self.checked.discard(set_id)
            if new:
                if len(new) != len(old):
                    counts.append((_SET_KEY.pack(set_id), _SET_INFO.pack(len(new))))
                self.sets[set_id] = new
            else:
                if old:
                    set_deletes.append(_SET_KEY.pack(set_id))
                self.sets.pop(set_id, None)
        frontend_writes = [(k, v) for k, v in frontends.items() if v is not None]
        frontend_deletes = [k for k, v in frontends.items() if v is None and k in self.frontends]
        for k, v in frontends.items():
            if v is None:
                self.frontends.pop(k, None)
            else:
                self.frontends[k] = v
        changes = MapChanges()
        for name, entries in (
            ("kpng_members", member_adds),
            ("kpng_slots", slot_writes),
            ("kpng_sets", counts),
            ("kpng_frontends", frontend_writes),
        ):
            if entries:
                changes.updates.append((name, entries))  # type: ignore[arg-type]
        for name, keys in (
            ("kpng_frontends", frontend_deletes),
            ("kpng_sets", set_deletes),
            ("kpng_slots", slot_deletes),
            ("kpng_members", member_deletes),
        ):
            if keys:
                changes.deletes.append((name, keys))  # type: ignore[arg-type]
        return changes
