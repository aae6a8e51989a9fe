"""kpng's Prometheus text against prometheus_client's, the library it replaced: the same families
must give the same bytes, and the process' metrics the same names, types, labels and values."""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families

from kpng.status.exposition import (
    CONTENT_TYPE,
    Family,
    counter,
    gauge,
    histogram,
    process_families,
    render,
)
from kpng.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

NUMBERS = [
    0, 1, -1, 0.5, 7, 100000, 999999, 1e6, 1234567.25, 1764229123.45, -2e6, 1e-4, 1e-5, 3e-9,
    1e16, 2.5e22, math.inf, -math.inf, math.nan,
]  # fmt: skip
"""Where Python's ``repr`` and Go's shortest format part: the exponent from 10^6 up, and the
infinities' and NaN's names."""

ODD_TEXT = ["plain", 'a "quoted" word', "back\\slash", "two\nlines", "ünïcödé", ""]


class _Fixed:
    """A collector giving prometheus_client's families as they are."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _reference(families: list[Metric]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry).decode()


def test_gauges_and_counters_are_written_as_prometheus_client_wrote_them() -> None:
    ours: list[Family] = []
    theirs: list[Metric] = []
    for i, value in enumerate(NUMBERS):
        ours.append(gauge(f"kpng_g{i}", f"gauge {i}", value=value))
        theirs.append(GaugeMetricFamily(f"kpng_g{i}", f"gauge {i}", value=value))
        ours.append(counter(f"kpng_c{i}", "counter\nwith \\ lines", value=abs(value)))
        theirs.append(CounterMetricFamily(f"kpng_c{i}", "counter\nwith \\ lines", value=abs(value)))
    labelled = gauge("kpng_labelled", "labels out of order", labels=("zone", "backend", "code"))
    reference = GaugeMetricFamily(
        "kpng_labelled", "labels out of order", labels=["zone", "backend", "code"]
    )
    for i, text in enumerate(ODD_TEXT):
        labelled.add((text, f"b{i}", str(200 + i)), i)
        reference.add_metric([text, f"b{i}", str(200 + i)], i)
    ours.append(labelled)
    theirs.append(reference)
    assert render(ours).decode() == _reference(theirs)


def test_histograms_are_written_as_prometheus_client_wrote_them() -> None:
    buckets = [("0.001", 0.0), ("0.5", 3.0), ("1", 4.0), ("1e+06", 9.0), ("+Inf", 12.0)]
    ours = histogram("kpng_h_seconds", "a histogram", labels=("ip_family",))
    theirs = HistogramMetricFamily("kpng_h_seconds", "a histogram", labels=["ip_family"])
    for fam, scale in (("IPv4", 1.0), ("IPv6", 2.0)):
        scaled = [(bound, n * scale) for bound, n in buckets]
        ours.add_histogram((fam,), scaled, 17.25 * scale)
        theirs.add_metric([fam], scaled, sum_value=17.25 * scale)
    assert render([ours]).decode() == _reference([theirs])


def test_a_counter_named_with_total_keeps_one_total() -> None:
    ours = counter("kpng_drops_total", "drops", value=3)
    theirs = CounterMetricFamily("kpng_drops_total", "drops", value=3)
    assert render([ours]).decode() == _reference([theirs])
    assert "kpng_drops_total 3" in render([ours]).decode()


def test_the_text_parses_back_to_every_value() -> None:
    family = gauge("kpng_values", "every number", labels=("i",))
    for i, value in enumerate(NUMBERS):
        family.add((str(i),), value)
    (parsed,) = text_string_to_metric_families(render([family]).decode())
    for sample in parsed.samples:
        expected = NUMBERS[int(sample.labels["i"])]
        assert sample.value == expected or (math.isnan(sample.value) and math.isnan(expected))


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (lambda: gauge("kpng_x", "h", labels=("a", "b")).add(("1",), 1), "labels ('a', 'b')"),
        (lambda: gauge("kpng_x", "h", labels=("a",), value=1), "labels ('a',), values ()"),
    ],
)
def test_a_family_refuses_what_would_write_a_wrong_sample(build: object, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        build()  # type: ignore[operator]


def _signature(text: str) -> dict[str, tuple[str, tuple[tuple[str, ...], ...]]]:
    """Each family's type and the label names of its samples."""
    return {
        family.name: (family.type, tuple(sorted(tuple(s.labels) for s in family.samples)))
        for family in text_string_to_metric_families(text)
    }


def test_the_process_metrics_are_prometheus_clients_names_and_values() -> None:
    registry = CollectorRegistry(auto_describe=False)
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    before = resource.getrusage(resource.RUSAGE_SELF)
    theirs = generate_latest(registry).decode()
    ours = render(process_families()).decode()
    after = resource.getrusage(resource.RUSAGE_SELF)

    assert _signature(ours) == _signature(theirs)
    values = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(ours)
        for s in f.samples
    }
    reference = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(theirs)
        for s in f.samples
    }
    # Read one after the other: what cannot move in between is equal.
    for name in ("process_start_time_seconds{}", "process_max_fds{}"):
        assert values[name] == reference[name]
    python = [k for k in values if k.startswith("python_info")]
    assert python == [k for k in reference if k.startswith("python_info")]
    assert values[python[0]] == 1
    cpu = values["process_cpu_seconds_total{}"]
    assert before.ru_utime + before.ru_stime - 0.02 <= cpu <= after.ru_utime + after.ru_stime + 0.02
    assert values["process_open_fds{}"] == pytest.approx(len(os.listdir("/proc/self/fd")), abs=2)
    rss = values["process_resident_memory_bytes{}"]
    assert rss == pytest.approx(reference["process_resident_memory_bytes{}"], rel=0.1)
    assert values["process_virtual_memory_bytes{}"] >= rss


def test_a_metrics_scrape_over_http_does_not_import_prometheus_client() -> None:
    """What a node agent serves is kpng's own text; prometheus_client is a test dependency."""
    script = """
import asyncio, json, sys, urllib.request
from kpng.status import Status
from kpng.status.serving import HttpAddress, serve

async def main():
    status = Status(timeout=60.0)
    task = asyncio.create_task(
        serve(status, healthz=None, metrics=HttpAddress("127.0.0.1", int(sys.argv[1])))
    )
    await asyncio.sleep(0.3)
    url = f"http://127.0.0.1:{sys.argv[1]}/metrics"
    with await asyncio.to_thread(urllib.request.urlopen, url, timeout=10) as answer:
        body = answer.read().decode()
        kind = answer.headers["Content-Type"]
    task.cancel()
    print(json.dumps([kind, "prometheus_client" in sys.modules, body]))

asyncio.run(main())
"""
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-c", script, str(port)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kind, imported, body = json.loads(done.stdout)
    assert kind == CONTENT_TYPE
    assert imported is False
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {"process_cpu_seconds", "python_gc_collections", "kubeproxy_proxy_healthz"} <= names
