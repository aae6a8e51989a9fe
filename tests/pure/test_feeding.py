"""Several backends in one process: each fed the same revisions, each failing on its own."""

from __future__ import annotations

import asyncio

import pytest

from kpng.client import Backoff, NodeState, SyncReporter
from kpng.errors import KpngError
from kpng.feeding import Fanout, Feeder, SyncStats, until_done
from kpng.model.messages import Service, ServiceEndpoints
from kpng.testing.waiting import eventually

WAIT_S = 10.0


def _state(
    revision: int, names: list[str], *, updated: list[str], deleted: tuple[str, ...] = ()
) -> NodeState:
    services = {
        ("ns", n): ServiceEndpoints(service=Service(Namespace="ns", Name=n), endpoints=())
        for n in names
    }
    return NodeState(
        node="n1",
        revision=revision,
        services=services,
        updated=frozenset(("ns", n) for n in updated),
        deleted=frozenset(("ns", n) for n in deleted),
    )


class _Backend:
    def __init__(
        self, *, fail_times: int = 0, once: bool = False, gate: asyncio.Event | None = None
    ):
        self.applied: list[NodeState] = []
        self.calls = 0
        """Applies begun, finished or not."""
        self.fail_times = fail_times
        self.once = once
        self.gate = gate
        self.closed = False

    async def apply(self, state: NodeState) -> bool:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_times:
            self.fail_times -= 1
            raise RuntimeError("the kernel said no")
        self.applied.append(state)
        return self.once

    async def close(self) -> None:
        self.closed = True


async def _no_sleep(_: float) -> None:
    await asyncio.sleep(0)


def test_failing_backend_keeps_retrying_with_a_full_resync_and_others_go_on() -> None:
    good, bad = _Backend(), _Backend(fail_times=2)

    async def scenario() -> None:
        fanout = Fanout([("to-good", good), ("to-bad", bad)])
        for feeder in fanout.feeders:
            feeder._backoff = Backoff(initial=0.01, sleep=_no_sleep)
        await fanout.apply(_state(1, ["a", "b"], updated=["a", "b"]))
        # the good one takes it; the bad one fails twice, then takes it
        await eventually(lambda: len(good.applied) == len(bad.applied) == 1, "revision 1")
        await fanout.apply(_state(2, ["a", "b"], updated=["b"]))
        await eventually(lambda: len(good.applied) == len(bad.applied) == 2, "revision 2")
        await fanout.close()

    asyncio.run(scenario())
    assert [s.revision for s in good.applied] == [1, 2]
    assert good.applied[1].updated == {("ns", "b")}
    # the failing one: after its failures, the state again as a full resync, then it keeps up
    assert bad.fail_times == 0
    assert [s.revision for s in bad.applied] == [1, 2]
    assert bad.applied[0].updated == {("ns", "a"), ("ns", "b")}
    assert good.closed
    assert bad.closed


@pytest.mark.parametrize("alone", [True, False], ids=["one backend", "two backends"])
def test_a_one_shot_run_gives_up_at_a_backends_first_failure(alone: bool) -> None:
    """``--once``: nobody waits for a retry (a backend without privilege would retry for ever):
    the failure ends the run, naming the backend and with its message."""
    good, bad = _Backend(), _Backend(fail_times=5)

    async def scenario() -> None:
        backends = [("to-bad", bad)] if alone else [("to-good", good), ("to-bad", bad)]
        fanout = Fanout([Feeder(name, b, once=True) for name, b in backends])

        async def source() -> None:
            await fanout.apply(_state(1, ["a"], updated=["a"]))
            await asyncio.Event().wait()  # a source waits for changes

        try:
            with pytest.raises(KpngError, match=r"^to-bad failed to apply revision 1: the kernel"):
                await asyncio.wait_for(until_done(fanout, source()), WAIT_S)
        finally:
            await fanout.close()

    asyncio.run(scenario())
    assert bad.calls == 1


def test_slow_backend_gets_the_latest_state_with_the_union_of_changes() -> None:
    gate = asyncio.Event()
    slow, fast = _Backend(gate=gate), _Backend()

    async def scenario() -> None:
        fanout = Fanout([("to-slow", slow), ("to-fast", fast)])
        await fanout.apply(_state(1, ["a", "b", "c"], updated=["a", "b", "c"]))
        await eventually(lambda: slow.calls == 1, "slow stuck in its first apply")
        for state in (
            _state(2, ["a", "b"], updated=["a"], deleted=("c",)),
            _state(3, ["a", "b", "d"], updated=["d"]),
            _state(4, ["a", "d"], updated=[], deleted=("b",)),
        ):
            await fanout.apply(state)

            def caught_up(revision: int = state.revision) -> bool:
                return len(fast.applied) == revision

            await eventually(caught_up, "fast keeping up")
        gate.set()
        await eventually(lambda: len(slow.applied) == 2, "slow's coalesced state")
        await fanout.close()

    asyncio.run(scenario())
    assert [s.revision for s in fast.applied] == [1, 2, 3, 4]
    assert [s.revision for s in slow.applied] == [1, 4]
    coalesced = slow.applied[1]
    assert coalesced.updated == {("ns", "a"), ("ns", "d")}
    assert coalesced.deleted == {("ns", "b"), ("ns", "c")}
    assert set(coalesced.services) == {("ns", "a"), ("ns", "d")}


def test_backends_get_a_snapshot_the_callers_next_state_cannot_change() -> None:
    a, b = _Backend(), _Backend()
    live = _state(1, ["x"], updated=["x"])

    async def scenario() -> None:
        fanout = Fanout([("to-a", a), ("to-b", b)])
        await fanout.apply(live)
        live.services.clear()  # type: ignore[attr-defined]  # the caller's next state
        await eventually(lambda: bool(a.applied and b.applied), "both applies")
        await fanout.close()

    asyncio.run(scenario())
    assert set(a.applied[0].services) == {("ns", "x")}
    assert set(b.applied[0].services) == {("ns", "x")}


def test_done_when_every_backend_is_done() -> None:
    once, forever = _Backend(once=True), _Backend()

    async def scenario() -> bool:
        fanout = Fanout([("to-once", once), ("to-forever", forever)])
        await fanout.apply(_state(1, ["a"], updated=["a"]))
        await eventually(lambda: bool(once.applied and forever.applied), "both applies")
        done_after_one = fanout.all_done.is_set()
        await fanout.close()
        solo = Fanout([("to-once", _Backend(once=True))])
        assert await solo.apply(_state(1, ["a"], updated=["a"]))
        assert solo.all_done.is_set()
        return done_after_one

    assert asyncio.run(scenario()) is False
    assert len(once.applied) == 1


def test_feeder_merges_offers_delete_then_readd() -> None:
    feeder = Feeder("to-x", _Backend())
    feeder.offer(_state(1, ["a"], updated=["a"]))
    feeder.offer(_state(2, [], updated=[], deleted=("a",)))
    feeder.offer(_state(3, ["a"], updated=["a"]))
    state = feeder._take()
    assert state.revision == 3
    assert state.updated == {("ns", "a")}
    assert state.deleted == frozenset()


class _Refusing:
    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    async def apply(self, state: NodeState) -> bool:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return True

    async def close(self) -> None:
        return None


def test_a_failure_the_backend_explains_is_one_line_and_a_bug_has_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def feed(backend: _Refusing) -> None:
        feeder = Feeder("to-x", backend, backoff=Backoff(initial=0.01, sleep=_no_sleep))
        feeder.offer(_state(1, ["a"], updated=["a"]))
        await feeder.feed_pending()

    asyncio.run(feed(_Refusing(KpngError("the plugin said no"))))
    explained = [r for r in caplog.records if "failed to apply" in r.getMessage()]
    assert [r.getMessage() for r in explained] == [
        "to-x failed to apply revision 1: the plugin said no; retrying with the whole state"
    ]
    assert explained[0].exc_info is None
    caplog.clear()
    asyncio.run(feed(_Refusing(ZeroDivisionError("oops"))))
    bug = [r for r in caplog.records if "failed to apply" in r.getMessage()]
    assert len(bug) == 1
    assert bug[0].exc_info is not None


class _RefusesService:
    """Refuses every state holding service ``bad`` (as a kernel refuses a rule)."""

    def __init__(self) -> None:
        self.applied: list[int] = []

    async def apply(self, state: NodeState) -> bool:
        if ("ns", "bad") in state.services:
            raise KpngError("the kernel refused ns/bad")
        self.applied.append(state.revision)
        return False

    async def close(self) -> None:
        return None


def test_a_newer_state_overtakes_the_retry_of_a_refused_one() -> None:
    """The state that deletes what the backend refused is applied when it comes, not after the
    retry's backoff (here an hour)."""
    backend = _RefusesService()
    hour = asyncio.Event()

    async def never(_: float) -> None:
        await hour.wait()

    async def scenario() -> None:
        feeder = Feeder("to-x", backend, backoff=Backoff(initial=3600.0, sleep=never))
        task = asyncio.create_task(feeder.run())
        try:
            feeder.offer(_state(1, ["a", "bad"], updated=["a", "bad"]))
            await eventually(lambda: feeder.stats.failures == 1, "the refusal", within=5)
            feeder.offer(_state(2, ["a"], updated=[], deleted=("bad",)))
            await eventually(lambda: backend.applied == [2], "the newer state", within=5)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


class _Reporting:
    """A backend that, like to-nft, knows when its rules are in place: here, one revision late."""

    def __init__(self, syncs: SyncReporter) -> None:
        self.syncs = syncs
        self.previous = 0

    async def apply(self, state: NodeState) -> bool:
        if self.previous:
            self.syncs.attempted(seconds=0.5, full=False)
            self.syncs.synced(revision=self.previous)
        else:
            self.syncs.failed()
        self.previous = state.revision
        return False

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("reports", [True, False])
def test_a_backend_that_reports_its_syncs_is_believed_and_one_that_does_not_is_timed(
    reports: bool,
) -> None:
    async def scenario() -> SyncStats:
        syncs = SyncStats()
        feeder = Feeder("to-x", _Reporting(syncs), sync=syncs, reports_syncs=reports)
        for revision in (1, 2, 3):
            feeder.offer(_state(revision, ["a"], updated=["a"]))
            assert await feeder.feed_pending(stop_on_failure=True)
        return syncs

    syncs = asyncio.run(scenario())
    if reports:
        assert (syncs.revision, syncs.failures, syncs.partial.count, syncs.full.count) == (
            2,
            1,
            2,
            0,
        )
        assert syncs.partial.sum == 1.0
    else:
        # kpng's own view adds to the backend's: each apply that returned is a sync.
        assert syncs.revision == 3
        assert (syncs.full.count, syncs.partial.count) == (1, 4)
