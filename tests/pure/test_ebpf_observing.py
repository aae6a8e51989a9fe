"""to-ebpf's figures for /metrics, as plain data: its counters summed over CPUs, its maps'
occupancy and the warning of a map filling up (the kernel test scrapes a running kpng)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from kpng.backends._samples import Sample as BackendSample
from kpng.backends.ebpf import PROGRAMS, observing
from kpng.backends.ebpf.observing import COUNTERS, Occupancy
from kpng.status import Sample, Status
from tests.pure.test_metrics import _scrape


def test_the_hooks_are_the_programs_enum_hook_in_order() -> None:
    """kpng_counters' keys are ``enum hook`` of sockets.bpf.c; its programs are attached in
    PROGRAMS' order: all three name the hooks alike."""
    source = Path(observing.__file__).with_name("sockets.bpf.c").read_text()
    enum = re.search(r"enum hook \{(.*?)\};", source, re.DOTALL)
    assert enum is not None
    names = [n.strip() for n in enum.group(1).split(",") if n.strip()]
    assert names == [f"HOOK_{h.upper()}" for h in observing.HOOKS] + ["HOOKS"]
    assert [p.removeprefix("kpng_") for p in PROGRAMS] == [
        h.removeprefix("get") for h in observing.HOOKS
    ]


def test_counters_are_summed_over_the_cpus_and_no_endpoint_is_for_forward_hooks() -> None:
    sums = observing.counter_sums(
        {
            "connect4": [COUNTERS.pack(3, 1), COUNTERS.pack(4, 0)],
            "recvmsg4": [COUNTERS.pack(2, 0), COUNTERS.pack(0, 0)],
        }
    )
    assert sums == {"connect4": (7, 1), "recvmsg4": (2, 0)}
    got = {(s.name, s.labels, s.value) for s in observing.counter_samples(sums)}
    assert got == {
        ("kpng_ebpf_translations", (("hook", "connect4"),), 7),
        ("kpng_ebpf_translations", (("hook", "recvmsg4"),), 2),
        ("kpng_ebpf_no_endpoint", (("hook", "connect4"),), 1),
    }


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_map_passing_90_percent_is_warned_of_once_per_crossing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    occupancy = Occupancy(capacity={"kpng_slots": 100, "kpng_sets": 100})
    caplog.set_level(logging.INFO, logger="kpng.backends.ebpf")
    assert occupancy.update({"kpng_slots": 89, "kpng_sets": 1}) == []
    assert occupancy.update({"kpng_slots": 90, "kpng_sets": 1}) == ["kpng_slots"]
    # Later syncs above the bound, or hovering just under it, do not warn again.
    for n in (95, 88, 99, 86):
        assert occupancy.update({"kpng_slots": n, "kpng_sets": 1}) == []
    assert _warnings(caplog) == [
        "to-ebpf: map kpng_slots holds 90 entries of 100 (90%): once full, new services and "
        "endpoints cannot be written"
    ]
    # Back under 85%, then past 90% again: a new crossing.
    assert occupancy.update({"kpng_slots": 84, "kpng_sets": 1}) == []
    assert occupancy.update({"kpng_slots": 97, "kpng_sets": 1}) == ["kpng_slots"]
    assert len(_warnings(caplog)) == 2


def test_no_warning_before_the_capacity_is_known() -> None:
    occupancy = Occupancy()
    assert occupancy.update({"kpng_slots": 10**9}) == []
    assert occupancy.samples() == []


class _Reporting:
    """A backend with figures of its own, as to-ebpf's ``metric_samples``."""

    def __init__(self, occupancy: Occupancy) -> None:
        self.occupancy = occupancy

    def metric_samples(self) -> list[BackendSample]:
        sums = {"connect4": (5, 2), "recvmsg4": (1, 0)}
        return observing.counter_samples(sums) + self.occupancy.samples()

    async def apply(self, state: object) -> None:
        pass


def test_a_backends_own_samples_reach_metrics_as_counters_and_gauges() -> None:
    from kpng.feeding import Fanout, Feeder
    from kpng.status import ReportsSamples

    occupancy = Occupancy(capacity={"kpng_frontends": 262144})
    occupancy.update({"kpng_frontends": 3})
    backend = _Reporting(occupancy)
    assert isinstance(backend, ReportsSamples)
    status = Status(timeout=60.0)
    status.track(Fanout([Feeder("to-ebpf", backend)]))  # type: ignore[arg-type]
    status.samplers.append(lambda: [Sample("kpng_other", "another part's", 1.0)])
    got = _scrape(status)
    assert got[("kpng_ebpf_translations_total", (("hook", "connect4"),))] == 5
    assert got[("kpng_ebpf_no_endpoint_total", (("hook", "connect4"),))] == 2
    assert ("kpng_ebpf_no_endpoint_total", (("hook", "recvmsg4"),)) not in got
    assert got[("kpng_ebpf_map_entries", (("map", "kpng_frontends"),))] == 3
    assert got[("kpng_ebpf_map_capacity", (("map", "kpng_frontends"),))] == 262144
    assert got[("kpng_other", ())] == 1
