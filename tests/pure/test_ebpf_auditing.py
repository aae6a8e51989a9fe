"""to-ebpf's drift check without a kernel: the comparisons (``ebpf/auditing.py``) as tables, the
counts and samples it reads back against maps that took every change kpng wrote (so that no
change of endpoints is ever taken for drift), and how ``EbpfBackend`` reports a drift, its
repair and a repair that fails. tests/kernel/test_ebpf_faults.py makes the faults in the kernel."""

from __future__ import annotations

import asyncio
import functools
import random
from pathlib import Path
from typing import cast

import pytest

from kpng.backends._drift import Drift
from kpng.backends._nftables import NftBackend
from kpng.backends._node import Options
from kpng.backends.ebpf import EbpfBackend, SocketBalancer
from kpng.backends.ebpf.auditing import (
    Link,
    compare_counts,
    compare_entries,
    compare_links,
    compare_pins,
)
from kpng.backends.ebpf.entries import (
    MAPS,
    Contribution,
    MapChanges,
    MapName,
    SocketState,
    contribute,
)
from kpng.backends.ebpf.libbpf import BpfError
from kpng.client import NodeState, ServiceKey
from kpng.feeding import SyncStats
from kpng.model.messages import ServiceEndpoints
from kpng.testing import states

WHERE = Path("/sys/fs/bpf/kpng/maps-v2")


@pytest.mark.parametrize(
    ("found", "detail"),
    [
        ({"kpng_frontends": 7, "kpng_sets": 8}, None),
        ({"kpng_frontends": None, "kpng_sets": 8}, f"maps kpng_frontends in {WHERE} are gone"),
        ({"kpng_sets": 8}, f"maps kpng_frontends in {WHERE} are gone"),
        ({"kpng_frontends": 7, "kpng_sets": 9}, f"maps kpng_sets in {WHERE} hold other maps"),
        ({}, f"maps kpng_frontends, kpng_sets in {WHERE} are gone"),
    ],
)
def test_map_pins_hold_the_maps_kpng_holds(
    found: dict[str, int | None], detail: str | None
) -> None:
    drift = compare_pins({"kpng_frontends": 7, "kpng_sets": 8}, found, WHERE)
    if detail is None:
        assert drift is None
    else:
        assert drift is not None
        assert drift.kind == "pins"
        assert detail in drift.detail


CGROUP = 880
PROGRAM_IDS = {"kpng_connect4": 41, "kpng_connect6": 42}


@pytest.mark.parametrize(
    ("found", "detail"),
    [
        ({"kpng_connect4": Link(41, CGROUP), "kpng_connect6": Link(42, CGROUP)}, None),
        ({"kpng_connect4": Link(41, CGROUP)}, "the links of kpng_connect6 in"),
        (
            {"kpng_connect4": Link(41, 0), "kpng_connect6": Link(42, CGROUP)},
            "the programs kpng_connect4 are detached from the cgroup",
        ),
        (
            {"kpng_connect4": Link(41, 999), "kpng_connect6": Link(42, CGROUP)},
            "the programs kpng_connect4 are detached from the cgroup",
        ),
        (
            {"kpng_connect4": Link(41, CGROUP), "kpng_connect6": Link(99, CGROUP)},
            "the links of kpng_connect6 run other programs",
        ),
    ],
)
def test_links_run_kpngs_programs_on_the_cgroup(
    found: dict[str, Link | None], detail: str | None
) -> None:
    drift = compare_links(PROGRAM_IDS, found, CGROUP, WHERE)
    if detail is None:
        assert drift is None
    else:
        assert drift is not None
        assert drift.kind == "programs"
        assert detail in drift.detail


@pytest.mark.parametrize(
    ("found", "detail"),
    [
        ({"kpng_frontends": 3, "kpng_slots": 5}, None),
        ({"kpng_frontends": 0, "kpng_slots": 5}, "kpng_frontends holds 0 entries, not 3"),
        ({"kpng_frontends": 3, "kpng_slots": 6}, "kpng_slots holds 6 entries, not 5"),
    ],
)
def test_maps_hold_as_many_entries_as_kpng_wrote(found: dict[str, int], detail: str | None) -> None:
    drift = compare_counts({"kpng_frontends": 3, "kpng_slots": 5}, found)
    assert drift == (None if detail is None else Drift("entries", detail))


SAMPLED: list[tuple[MapName, bytes, bytes]] = [
    ("kpng_frontends", b"k1", b"v1"),
    ("kpng_slots", b"k2", b"v2"),
]


@pytest.mark.parametrize(
    ("found", "detail"),
    [
        ([b"v1", b"v2"], None),
        ([None, b"v2"], "1 entries of kpng_frontends are gone"),
        ([b"v1", b"v9"], "1 entries of kpng_slots hold other values"),
    ],
)
def test_sampled_entries_hold_what_kpng_wrote(
    found: list[bytes | None], detail: str | None
) -> None:
    drift = compare_entries(SAMPLED, found)
    assert drift == (None if detail is None else Drift("entries", detail))


# --- counts and samples against maps that took every change


def _apply(maps: dict[str, dict[bytes, bytes]], changes: MapChanges) -> None:
    for name, pairs in changes.updates:
        maps[name].update(pairs)
    for name, keys in changes.deletes:
        for key in keys:
            maps[name].pop(key, None)


_service = functools.partial(states.service, port_name="p")
_ep = functools.partial(states.endpoint, port_name="p")


def _contributions(rng: random.Random) -> dict[ServiceKey, Contribution | None]:
    """Ten services, each with some of six endpoints, affinity or not, TCP or UDP, or gone: a
    new draw at each call."""
    out: dict[ServiceKey, Contribution | None] = {}
    for i in range(10):
        if rng.random() < 0.1:
            out[("ns", f"s{i}")] = None
            continue
        proto = rng.choice(["TCP", "UDP"])
        eps = rng.sample([f"10.244.1.{n}" for n in range(2, 8)], rng.randrange(0, 5))
        se = ServiceEndpoints(
            _service(
                name=f"s{i}",
                cluster_ip=f"10.96.0.{10 + i}",
                affinity=rng.choice([0, 60]),
                protocol=proto,
            ),
            tuple(_ep(e, protocol=proto) for e in eps),
        )
        out[("ns", f"s{i}")] = contribute(se, Options())
    return out


@pytest.mark.parametrize("seed", range(5))
def test_counts_and_samples_match_maps_that_took_every_change(seed: int) -> None:
    """No sequence of changes leaves kpng's record and the maps apart: the check never takes
    kpng's own writes for drift."""
    rng = random.Random(seed)
    state = SocketState()
    maps: dict[str, dict[bytes, bytes]] = {name: {} for name in MAPS}
    _apply(maps, state.full(_contributions(rng), {}))
    for _ in range(30):
        _apply(maps, state.changes(_contributions(rng)))
        found = {name: len(m) for name, m in maps.items()}
        assert compare_counts(state.entries(), found) is None
        sampled = state.sample(8, rng)
        assert sampled
        values = [maps[name].get(key) for name, key, _ in sampled]
        assert compare_entries(sampled, values) is None


def test_a_sample_sees_an_entry_another_program_changed() -> None:
    state = SocketState()
    maps: dict[str, dict[bytes, bytes]] = {name: {} for name in MAPS}
    _apply(maps, state.full(_contributions(random.Random(1)), {}))
    key = next(iter(maps["kpng_frontends"]))
    maps["kpng_frontends"][key] = b"\0" * len(maps["kpng_frontends"][key])
    # Ten frontends, eight sampled at a time: a few checks find it.
    rng = random.Random(2)
    for _ in range(10):
        sampled = state.sample(8, rng)
        drift = compare_entries(sampled, [maps[n].get(k) for n, k, _ in sampled])
        if drift is not None:
            assert drift.detail == "1 entries of kpng_frontends hold other values"
            return
    pytest.fail("the changed entry was never sampled")


# --- reporting


class Sockets:
    """What EbpfBackend asks of its sockets part: a drift to find, a repair that may fail."""

    def __init__(self) -> None:
        self.found: Drift | None = None
        self.failing = False
        self.full = False
        """Whether the next apply is a full sync."""
        self.repairs = 0

    async def apply(self, state: NodeState) -> MapChanges:
        return MapChanges(full=self.full)

    async def drift(self) -> Drift | None:
        found, self.found = self.found, None
        return found

    async def repair(self) -> None:
        self.repairs += 1
        if self.failing:
            raise BpfError("cannot pin at /sys/fs/bpf/kpng: Not a directory")


class Packets:
    async def apply(self, state: NodeState) -> bool:
        return False


def _backend() -> tuple[EbpfBackend, Sockets, SyncStats]:
    sockets, stats = Sockets(), SyncStats()
    backend = EbpfBackend(
        sockets=cast(SocketBalancer, sockets), packets=cast(NftBackend, Packets()), syncs=stats
    )
    return backend, sockets, stats


STATE = states.keyed_state(3, {("ns", "web"): states.entry("web", ["10.244.1.2"])})


def test_a_drift_is_reported_then_repaired_and_counted() -> None:
    backend, sockets, stats = _backend()
    drift = Drift("programs", "the links of kpng_connect4 in /x are gone")

    async def scenario() -> None:
        await backend.apply(STATE)
        assert await backend.check_sockets() is None
        assert sockets.repairs == 0
        sockets.found = drift
        assert await backend.check_sockets() == drift

    asyncio.run(scenario())
    assert sockets.repairs == 1
    assert stats.repairs == {"programs": 1}
    assert stats.diverged_since is None
    assert stats.revision == 3


def test_a_repair_that_fails_stays_reported_and_is_tried_again_each_period() -> None:
    backend, sockets, stats = _backend()

    async def scenario() -> None:
        await backend.apply(STATE)
        sockets.found, sockets.failing = Drift("pins", "the pins ... are gone"), True
        for _ in range(2):
            with pytest.raises(BpfError):
                await backend.check_sockets()
            assert stats.diverged_since is not None
        sockets.failing = False
        # Found no more (the maps are no longer pinned where the check looks): repaired anyway.
        assert await backend.check_sockets() is None

    asyncio.run(scenario())
    assert sockets.repairs == 3
    assert stats.repairs == {"pins": 1}
    assert stats.diverged_since is None


def test_a_full_sync_after_a_failed_repair_ends_the_divergence() -> None:
    """The Feeder's next state, applied in full (a failed repair leaves a full sync due), is
    the repair."""
    backend, sockets, stats = _backend()

    async def scenario() -> None:
        await backend.apply(STATE)
        sockets.found, sockets.failing = Drift("entries", "kpng_slots holds 0 entries, not 1"), True
        with pytest.raises(BpfError):
            await backend.check_sockets()
        sockets.full = True
        await backend.apply(STATE)
        assert await backend.check_sockets() is None

    asyncio.run(scenario())
    assert sockets.repairs == 1
    assert stats.repairs == {"entries": 1}
    assert stats.diverged_since is None


def test_nothing_is_checked_before_a_state_is_applied() -> None:
    backend, sockets, _ = _backend()
    sockets.found = Drift("entries", "kpng_frontends holds 0 entries, not 1")
    assert asyncio.run(backend.check_sockets()) is None
    assert sockets.found is not None
