"""The collector pause around heavy steps: what a step keeps is frozen out of the collector's
walks, and the steps that pause it make no cycles, so nothing frozen is garbage it would miss."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import Options
from kpng.gcpause import FREEZE_AFTER, THRESHOLDS, collector_paused
from tests.nft_services import churn


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen and the collector on, as it found it."""
    enabled = gc.isenabled()
    gc.unfreeze()
    gc.collect()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


@pytest.mark.slow
def test_what_a_big_paused_step_keeps_is_frozen_and_the_collector_runs_again() -> None:
    with collector_paused():
        assert not gc.isenabled()
        kept = [[i] for i in range(FREEZE_AFTER + 100)]  # lists: always tracked
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)


def test_a_small_step_is_left_to_the_collector() -> None:
    """A change's few objects are not frozen, nor is the garbage made beside them."""
    with collector_paused(), collector_paused():  # nested: the outer one decides, once
        kept = [[i] for i in range(1000)]
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert len(kept) == 1000


def test_a_small_step_after_many_young_objects_is_left_to_the_collector() -> None:
    """With kpng's thresholds, up to 100,000 young objects may wait for the collector when a
    step starts: they are not the step's, and are not frozen with it."""
    thresholds = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    try:
        others = [[i] for i in range(FREEZE_AFTER - 500)]
        with collector_paused():
            kept = [[i] for i in range(1000)]
    finally:
        gc.set_threshold(*thresholds)
    assert gc.get_freeze_count() == 0
    assert len(others) + len(kept) == FREEZE_AFTER + 500


def test_the_collector_left_off_stays_off() -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


@pytest.mark.slow
def test_syncs_of_a_churning_cluster_leave_no_cyclic_garbage_behind_the_freeze() -> None:
    """Full and incremental syncs, services added, changed and deleted: every paused step of
    to-nft makes only what reference counting frees. A cycle made there would be frozen and
    never collected, growing a long-running kpng."""

    async def scenario() -> int:
        backend = NftBackend(nft=FakeNft(), options=Options(cluster_cidrs=("10.244.0.0/16",)))
        for state in churn(60, seed=3, revisions=40, per_revision=8):
            await backend.apply(state)
        # Everything frozen so far goes back to the collector, which must find no garbage
        # that came from kpng.
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            return sum(1 for o in gc.garbage if type(o).__module__.startswith("kpng"))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()

    assert asyncio.run(scenario()) == 0
