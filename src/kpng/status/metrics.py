"""``/metrics``: kpng's state in Prometheus' text format.

Values are read when scraped, from the store and the backends' ``FeederStats``: nothing is
counted twice and nothing costs anything between scrapes. The names follow kube-proxy's where
the meaning is the same (its ``sync_proxy_rules_*`` are kpng's per-backend applies), so
dashboards carry over with a renamed prefix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kpng.client import FeederStats
from kpng.status import Status, Verdict


class _StatusCollector(Collector):
    def __init__(self, status: Status) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        backends = self._status.backends
        verdict = self._status.verdict(backends)
        yield from self._store()
        yield from self._sources()
        yield from self._backends(backends, verdict)
        yield GaugeMetricFamily(
            "kpng_healthy", "1 when /healthz answers 200", value=int(verdict.healthy)
        )
        yield GaugeMetricFamily(
            "kpng_node_eligible",
            "0 while the node is being deleted or tainted ToBeDeletedByClusterAutoscaler",
            value=int(verdict.body["nodeEligible"]),
        )
        yield from self._samples()

    def _samples(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for sampler in self._status.samplers:
            for sample in sampler():
                family = families.get(sample.name)
                if family is None:
                    kind = CounterMetricFamily if sample.counter else GaugeMetricFamily
                    labels = [name for name, _ in sample.labels]
                    family = families[sample.name] = kind(sample.name, sample.help, labels=labels)
                family.add_metric([value for _, value in sample.labels], sample.value)
        yield from families.values()

    def _store(self) -> Iterator[Metric]:
        store = self._status.store
        if store is None:
            return
        yield GaugeMetricFamily(
            "kpng_sources_synced", "1 once every source has delivered its initial state",
            value=int(store.synced),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kpng_store_revision", "the revision of the global state", value=store.revision
        )
        objects = GaugeMetricFamily(
            "kpng_store_objects", "objects in the global state, by kind", labels=["kind"]
        )
        objects.add_metric(["Service"], len(store.services))
        objects.add_metric(["EndpointSlice"], len(store.slices))
        objects.add_metric(["Node"], len(store.nodes))
        yield objects

    def _sources(self) -> Iterator[Metric]:
        store = self._status.store
        if store is None:
            return
        label = ["source"]
        synced = GaugeMetricFamily("kpng_source_synced", "1 once the source synced", labels=label)
        skipped = CounterMetricFamily(
            "kpng_source_skipped_objects",
            "objects reported as unusable (invalid, or kpng cannot serve them) and skipped",
            labels=label,
        )
        counters: dict[str, CounterMetricFamily] = {}
        for handle in store.sources:
            synced.add_metric([handle.name], int(handle.synced))
            skipped.add_metric([handle.name], handle.skipped)
            if handle.stats is None or not dataclasses.is_dataclass(handle.stats):
                continue
            for f in dataclasses.fields(handle.stats):
                name = f"kpng_source_{f.name}"
                if name not in counters:
                    text = f.metadata.get("help", f.name.replace("_", " "))
                    counters[name] = CounterMetricFamily(name, text, labels=label)
                counters[name].add_metric([handle.name], getattr(handle.stats, f.name))
        yield synced
        yield skipped
        yield from counters.values()

    def _backends(self, backends: Mapping[str, FeederStats], verdict: Verdict) -> Iterator[Metric]:
        if not backends:
            return
        label = ["backend"]
        revision = GaugeMetricFamily(
            "kpng_backend_applied_revision", "revision of the last state applied", labels=label
        )
        services = GaugeMetricFamily(
            "kpng_backend_services", "services in the last state applied", labels=label
        )
        last = GaugeMetricFamily(
            "kpng_backend_last_applied_timestamp_seconds",
            "when the last state was applied (kube-proxy: sync_proxy_rules_last_timestamp_seconds)",
            labels=label,
        )
        pending = GaugeMetricFamily(
            "kpng_backend_pending_seconds",
            "how long the oldest state not yet applied has waited (0: up to date)",
            labels=label,
        )
        duration = HistogramMetricFamily(
            "kpng_backend_apply_duration_seconds",
            "time taken by successful applies (kube-proxy: sync_proxy_rules_duration_seconds)",
            labels=label,
        )
        failures = CounterMetricFamily(
            "kpng_backend_apply_failures", "applies that failed (and were retried)", labels=label
        )
        for name, stats in backends.items():
            revision.add_metric([name], stats.applied_revision)
            services.add_metric([name], stats.applied_services)
            last.add_metric([name], stats.last_applied or 0.0)
            pending.add_metric([name], verdict.body["backends"][name]["pendingSeconds"])
            bounds = zip(FeederStats.BUCKETS_S, stats.apply_buckets, strict=True)
            buckets = [(f"{bound:g}", n) for bound, n in bounds]
            duration.add_metric(
                [name], [*buckets, ("+Inf", stats.applies)], sum_value=stats.apply_seconds
            )
            failures.add_metric([name], stats.failures)
        yield from (revision, services, last, pending, duration, failures)


def registry(status: Status) -> CollectorRegistry:
    """kpng's own registry (not the library's global one): its metrics, and the process'
    (CPU, memory, file descriptors), the platform's and the garbage collector's."""
    reg = CollectorRegistry()
    reg.register(_StatusCollector(status))
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg
