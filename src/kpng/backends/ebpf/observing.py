"""What to-ebpf tells ``/metrics`` (pure): its programs' counters, its maps' occupancy, the
connected UDP sockets it destroyed and the network namespaces it looked at.

The programs count, per hook and per CPU, the addresses they translated and the frontends
they found with no endpoint (``kpng_counters``); kpng sums the CPUs when scraped. How full the
maps kpng writes are comes from what kpng wrote (``SocketState.entries``), not from walking the
kernel's maps at each scrape, against the capacity they were loaded with. A hash map that is
full refuses new entries: kpng warns once a map passes ``WARN_AT`` of its capacity, before it
fills, and again only after it went back under ``REARM_AT``.

These are the figures of kpng's ``/metrics``, as samples with the fields of
``kpng.status.Sample``: kpng reads them structurally (backends do not import kpng's status).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kpng.backends._samples import Sample

log = logging.getLogger("kpng.backends.ebpf")

HOOKS = (
    "connect4",
    "connect6",
    "sendmsg4",
    "sendmsg6",
    "recvmsg4",
    "recvmsg6",
    "getpeername4",
    "getpeername6",
)
"""``kpng_counters``' keys, in order (``enum hook`` of sockets.bpf.c): the cgroup hooks."""
FORWARD_HOOKS = HOOKS[:4]
"""The hooks that look frontends up (the others translate back): only they can find no
endpoint."""

COUNTERS = struct.Struct("=QQ")
"""``struct counters``: translated, no_endpoint."""

WARN_AT = 0.9
REARM_AT = 0.85
"""A map past ``WARN_AT`` of its capacity is warned of once; it must go back under
``REARM_AT`` before the next crossing warns again (a map hovering at the bound warns once)."""

TRANSLATIONS = "kpng_ebpf_translations"
NO_ENDPOINT = "kpng_ebpf_no_endpoint"
MAP_ENTRIES = "kpng_ebpf_map_entries"
MAP_CAPACITY = "kpng_ebpf_map_capacity"
UDP_DESTROYED = "kpng_ebpf_udp_sockets_destroyed"
NAMESPACES = "kpng_ebpf_network_namespaces"
METRICS = (TRANSLATIONS, NO_ENDPOINT, MAP_ENTRIES, MAP_CAPACITY, UDP_DESTROYED, NAMESPACES)
"""The metric families to-ebpf adds (the counters' samples end in ``_total``)."""


def counter_sums(per_hook: Mapping[str, Iterable[bytes]]) -> dict[str, tuple[int, int]]:
    """Each hook's (translated, no endpoint), summed over the CPUs' values of ``struct
    counters``."""
    sums = {}
    for hook, values in per_hook.items():
        translated = no_endpoint = 0
        for raw in values:
            t, n = COUNTERS.unpack(raw)
            translated, no_endpoint = translated + t, no_endpoint + n
        sums[hook] = (translated, no_endpoint)
    return sums


def counter_samples(sums: Mapping[str, tuple[int, int]]) -> list[Sample]:
    out = []
    for hook, (translated, _) in sums.items():
        out.append(
            Sample(
                TRANSLATIONS,
                "addresses the socket programs translated: to an endpoint (connect, sendmsg), "
                "or back to the service (recvmsg, getpeername)",
                translated,
                counter=True,
                labels=(("hook", hook),),
            )
        )
    for hook, (_, no_endpoint) in sums.items():
        if hook in FORWARD_HOOKS:
            out.append(
                Sample(
                    NO_ENDPOINT,
                    "connects and sends to a service address with no endpoint for them, left "
                    "to the nftables rules (REJECT or DROP)",
                    no_endpoint,
                    counter=True,
                    labels=(("hook", hook),),
                )
            )
    return out


@dataclass
class Occupancy:
    """The maps' entries against their capacity, and the warnings of maps filling up."""

    capacity: dict[str, int] = field(default_factory=dict)
    """Each map's ``max_entries``, once the programs are loaded."""
    entries: dict[str, int] = field(default_factory=dict)
    """What each map holds, as of the last state written."""
    _warned: set[str] = field(default_factory=set)

    def update(self, entries: Mapping[str, int]) -> list[str]:
        """Record what the maps hold now; the maps that just passed ``WARN_AT`` (each warned
        of in the log)."""
        self.entries = dict(entries)
        crossed = []
        for name, n in entries.items():
            capacity = self.capacity.get(name)
            if not capacity:
                continue
            if n >= WARN_AT * capacity and name not in self._warned:
                self._warned.add(name)
                crossed.append(name)
                log.warning(
                    "to-ebpf: map %s holds %d entries of %d (%.0f%%): once full, new services "
                    "and endpoints cannot be written",
                    name,
                    n,
                    capacity,
                    100 * n / capacity,
                )
            elif n < REARM_AT * capacity and name in self._warned:
                self._warned.discard(name)
                log.info("to-ebpf: map %s back to %d entries of %d", name, n, capacity)
        return crossed

    def samples(self) -> list[Sample]:
        out = []
        for name, n in self.entries.items():
            if name in self.capacity:
                out.append(
                    Sample(
                        MAP_ENTRIES,
                        "entries kpng wrote in a BPF map",
                        n,
                        labels=(("map", name),),
                    )
                )
        for name, capacity in self.capacity.items():
            out.append(
                Sample(
                    MAP_CAPACITY,
                    "the entries a BPF map can hold (max_entries)",
                    capacity,
                    labels=(("map", name),),
                )
            )
        return out


def destroyed_sample(destroyed: int) -> Sample:
    return Sample(
        UDP_DESTROYED,
        "connected UDP sockets destroyed because their endpoint no longer served the service "
        "they were translated for (the application connects again)",
        destroyed,
        counter=True,
    )


def namespace_samples(local: int, elsewhere: int) -> list[Sample]:
    help = (
        "network namespaces with a process in the cgroup, by whether local traffic detection "
        "counts them as the node's pods' (their sockets balanced at connect) or not (left to "
        "the nftables part)"
    )
    return [
        Sample(NAMESPACES, help, local, labels=(("local", "true"),)),
        Sample(NAMESPACES, help, elsewhere, labels=(("local", "false"),)),
    ]
