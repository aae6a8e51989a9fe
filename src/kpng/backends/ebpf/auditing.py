"""Drift: whether the kernel still holds to-ebpf's pins, links and entries (pure: no I/O).

Other programs change what to-ebpf left in the kernel: ``rm -r`` of the pin directory (the
links' pins were the programs' last references: they are detached; the maps live on only in
kpng's hands), a link detached (``bpftool link detach``), a map's entries deleted or rewritten
(``bpftool map delete``). ``SocketBalancer.drift`` reads, every sync period and each step only
if the one before found nothing:

1. each map pin: the id of the map pinned there, against the id of the map kpng holds;
2. each link pin: the program it runs and the cgroup it is attached to (0 once detached);
3. how many entries each map kpng writes holds, against how many kpng wrote (the kernel copies
   them in batches; Python never splits them);
4. a few entries of each map, picked at random among those kpng wrote, read back by key.

What it finds is a ``Drift``: a short ``kind`` for metrics and a sentence for the log. The
repair is what a start does: the maps pinned again, the programs attached again, every entry
rewritten.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kpng.backends._drift import Drift, named
from kpng.backends.ebpf.entries import MapName


@dataclass(frozen=True)
class Link:
    """What a pinned link holds."""

    program: int
    """The id of the program it runs."""
    cgroup: int
    """The id of the cgroup it is attached to; 0 once detached."""


def compare_pins(
    expected: Mapping[str, int], found: Mapping[str, int | None], where: Path
) -> Drift | None:
    """Whether each map's pin (``found``: the id of what is pinned there, None: nothing) still
    holds the map kpng holds (``expected``: its id)."""
    gone = sorted(name for name in expected if found.get(name) is None)
    other = sorted(name for name, id_ in expected.items() if found.get(name) not in (None, id_))
    parts = []
    if gone:
        parts.append(f"the pins of maps {named(gone)} in {where} are gone")
    if other:
        parts.append(f"the pins of maps {named(other)} in {where} hold other maps")
    return Drift("pins", "; ".join(parts)) if parts else None


def compare_links(
    expected: Mapping[str, int], found: Mapping[str, Link | None], cgroup: int, where: Path
) -> Drift | None:
    """Whether each program's pinned link (``found``; None: no pin) still runs it
    (``expected``: its id) on ``cgroup`` (its id)."""
    gone, detached, other = [], [], []
    for name, program in sorted(expected.items()):
        link = found.get(name)
        if link is None:
            gone.append(name)
        elif link.cgroup != cgroup:
            detached.append(name)
        elif link.program != program:
            other.append(name)
    parts = []
    if gone:
        parts.append(f"the links of {named(gone)} in {where} are gone")
    if detached:
        parts.append(f"the programs {named(detached)} are detached from the cgroup")
    if other:
        parts.append(f"the links of {named(other)} run other programs")
    return Drift("programs", "; ".join(parts)) if parts else None


def compare_counts(expected: Mapping[str, int], found: Mapping[str, int]) -> Drift | None:
    """Whether each map holds as many entries as kpng wrote."""
    changed = [
        f"{name} holds {found[name]} entries, not {n}"
        for name, n in expected.items()
        if found[name] != n
    ]
    if not changed:
        return None
    return Drift("entries", named(changed))


def compare_entries(
    sampled: Sequence[tuple[MapName, bytes, bytes]], found: Sequence[bytes | None]
) -> Drift | None:
    """Whether the entries read back (``found``: each value, None: no such key) are those kpng
    wrote (``sampled``: map, key, value)."""
    gone: dict[MapName, int] = {}
    changed: dict[MapName, int] = {}
    for (name, _, value), now in zip(sampled, found, strict=True):
        if now is None:
            gone[name] = gone.get(name, 0) + 1
        elif now != value:
            changed[name] = changed.get(name, 0) + 1
    parts = [f"{n} entries of {name} are gone" for name, n in gone.items()]
    parts += [f"{n} entries of {name} hold other values" for name, n in changed.items()]
    return Drift("entries", "; ".join(parts)) if parts else None
