"""``/metrics``: kpng's state in Prometheus' text format.

Values are read when scraped, from the store, the backends' ``FeederStats`` and ``SyncStats``
and ``Status.counters``: nothing is counted twice and a scrape walks no service. kpng's own
``kpng_*`` names are per backend; kube-proxy's ``kubeproxy_*`` names, with their labels, types,
buckets and meanings (Kubernetes 1.37, nftables mode, but for the failures of a backend that
programs as iptables mode does), describe the node's rules as a whole, so kube-proxy's
dashboards and alerts read kpng unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from kpng.client import ProxyMode
from kpng.feeding import FeederStats, Histogram
from kpng.kubeclient import metrics as kubeclient
from kpng.status.exposition import Family, counter, gauge, histogram, process_families, render
from kpng.status.gathering import FAMILIES, Status
from kpng.status.health import Verdict
from kpng.status.reports import Reconciles


def scrape(status: Status) -> bytes:
    """The text of ``/metrics`` now: kpng's metrics, then the process' (CPU, memory, file
    descriptors), the interpreter's and its garbage collector's."""
    return render([*_StatusFamilies(status).collect(), *process_families()])


class _StatusFamilies:
    def __init__(self, status: Status) -> None:
        self._status = status

    def collect(self) -> Iterator[Family]:
        backends = self._status.backends
        verdict = self._status.verdict(backends)
        yield from self._store()
        yield from self._sources()
        yield from self._backends(backends, verdict)
        yield gauge("kpng_healthy", "1 when /healthz answers 200", value=int(verdict.healthy))
        yield gauge(
            "kpng_node_eligible",
            "0 while the node is being deleted or tainted ToBeDeletedByClusterAutoscaler",
            value=int(verdict.body["nodeEligible"]),
        )
        yield from self._samples()
        yield from self._kube_proxy()
        yield from _rest_client()

    def _kube_proxy(self) -> Iterator[Family]:
        """kube-proxy's metrics. A sync counts once the rules of every backend fed directly
        are in place: the oldest backend's time, every backend's attempts."""
        status = self._status
        counters = status.counters
        syncs = status.syncs
        family = ["ip_family"]
        if syncs:
            full, partial = _merged(s.full for s in syncs), _merged(s.partial for s in syncs)
            every = _merged((full, partial))
            for name, text, observed in (
                ("sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", every),
                ("sync_full_proxy_rules_duration_seconds",
                 "SyncProxyRules latency in seconds for full resyncs", full),
                ("sync_partial_proxy_rules_duration_seconds",
                 "SyncProxyRules latency in seconds for partial resyncs", partial),
            ):  # fmt: skip
                yield _histogram(f"kubeproxy_{name}", text, observed)
            synced = [s.last_synced for s in syncs]
            if None not in synced:
                yield _per_family(
                    gauge(
                        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
                        "The last time proxy rules were successfully synced",
                        labels=family,
                    ),
                    min(t for t in synced if t is not None),
                )
            queued = [s.last_queued for s in syncs if s.last_queued is not None]
            yield _per_family(
                gauge(
                    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
                    "The last time a sync of proxy rules was queued",
                    labels=family,
                ),
                # As kube-proxy, which sets it when it starts waiting for its informers.
                max(queued, default=status.started),
            )
            failed: dict[ProxyMode, int] = {}
            for feeder in status.direct:
                failed[feeder.proxy_mode] = failed.get(feeder.proxy_mode, 0) + feeder.sync.failures
            for mode, n in sorted(failed.items()):
                name, text = _SYNC_FAILURES[mode]
                yield _per_family(counter(name, text, labels=family), n)
            no_local = gauge(
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                "Number of services with a Local traffic policy and no endpoints",
                labels=["traffic_policy", "ip_family"],
            )
            for policy in ("internal", "external"):
                for fam in FAMILIES:
                    # Every backend is given the same states: the counts of the one that
                    # applied the latest.
                    latest = max(syncs, key=lambda s: s.revision)
                    no_local.add([policy, fam], latest.no_local_endpoints.get((policy, fam), 0))
            yield no_local
        yield from _conntrack(status.conntrack)
        programming = histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            labels=family,
        )
        for fam, observed in counters.programming.items():
            programming.add_histogram([fam], *_buckets(observed))
        yield programming
        for kind, total, pending in (
            ("endpoint", counters.endpoint_changes, counters.endpoint_changes_pending),
            ("service", counters.service_changes, counters.service_changes_pending),
        ):
            title = kind.capitalize()
            yield gauge(
                f"kubeproxy_sync_proxy_rules_{kind}_changes_pending",
                f"Pending proxy rules {title} changes",
                value=pending,
            )
            yield counter(
                f"kubeproxy_sync_proxy_rules_{kind}_changes",
                f"Cumulative proxy rules {title} changes",
                value=total,
            )
        for path, answers in (("healthz", counters.healthz), ("livez", counters.livez)):
            family_ = counter(
                f"kubeproxy_proxy_{path}", f"Cumulative proxy {path} HTTP status", labels=["code"]
            )
            for code, n in sorted(answers.items()):
                family_.add([str(code)], n)
            yield family_

    def _samples(self) -> Iterator[Family]:
        families: dict[str, Family] = {}
        for sample in self._status.samples():
            family = families.get(sample.name)
            if family is None:
                kind = counter if sample.counter else gauge
                labels = [name for name, _ in sample.labels]
                family = families[sample.name] = kind(sample.name, sample.help, labels=labels)
            family.add([value for _, value in sample.labels], sample.value)
        yield from families.values()

    def _store(self) -> Iterator[Family]:
        store = self._status.store
        if store is None:
            return
        yield gauge(
            "kpng_sources_synced", "1 once every source has delivered its initial state",
            value=int(store.synced),
        )  # fmt: skip
        yield gauge("kpng_store_revision", "the revision of the global state", value=store.revision)
        objects = gauge(
            "kpng_store_objects", "objects in the global state, by kind", labels=["kind"]
        )
        objects.add(["Service"], len(store.services))
        objects.add(["EndpointSlice"], len(store.slices))
        objects.add(["Node"], len(store.nodes))
        yield objects

    def _sources(self) -> Iterator[Family]:
        store = self._status.store
        if store is None:
            return
        label = ["source"]
        synced = gauge("kpng_source_synced", "1 once the source synced", labels=label)
        skipped = counter(
            "kpng_source_skipped_objects",
            "objects reported as unusable (invalid, or kpng cannot serve them) and skipped",
            labels=label,
        )
        counters: dict[str, Family] = {}
        for handle in store.sources:
            synced.add([handle.name], int(handle.synced))
            skipped.add([handle.name], handle.skipped)
            if handle.counters is None:
                continue
            for count in handle.counters():
                name = f"kpng_source_{count.name}"
                if name not in counters:
                    counters[name] = counter(name, count.help, labels=label)
                counters[name].add([handle.name], count.value)
        yield synced
        yield skipped
        yield from counters.values()

    def _backends(self, backends: Mapping[str, FeederStats], verdict: Verdict) -> Iterator[Family]:
        if not backends:
            return
        label = ["backend"]
        revision = gauge(
            "kpng_backend_applied_revision", "revision of the last state applied", labels=label
        )
        services = gauge(
            "kpng_backend_services", "services in the last state applied", labels=label
        )
        last = gauge(
            "kpng_backend_last_applied_timestamp_seconds",
            "when the last state was applied (kube-proxy: sync_proxy_rules_last_timestamp_seconds)",
            labels=label,
        )
        pending = gauge(
            "kpng_backend_pending_seconds",
            "how long the oldest state not yet applied has waited (0: up to date)",
            labels=label,
        )
        duration = histogram(
            "kpng_backend_apply_duration_seconds",
            "time taken by successful applies (kube-proxy: sync_proxy_rules_duration_seconds)",
            labels=label,
        )
        failures = counter(
            "kpng_backend_apply_failures", "applies that failed (and were retried)", labels=label
        )
        for name, stats in backends.items():
            revision.add([name], stats.applied_revision)
            services.add([name], stats.applied_services)
            last.add([name], stats.last_applied or 0.0)
            pending.add([name], verdict.body["backends"][name]["pendingSeconds"])
            bounds = zip(FeederStats.BUCKETS_S, stats.apply_buckets, strict=True)
            buckets = [(f"{bound:g}", n) for bound, n in bounds]
            duration.add_histogram([name], [*buckets, ("+Inf", stats.applies)], stats.apply_seconds)
            failures.add([name], stats.failures)
        yield from (revision, services, last, pending, duration, failures)
        yield from self._kernel_truth()

    def _kernel_truth(self) -> Iterator[Family]:
        """What backends that program a kernel say of it: the services it refused, and the
        changes other programs made to their rules that a sync repaired."""
        label = ["backend"]
        refused = gauge(
            "kpng_backend_refused_services",
            "services the backend left out of the kernel, or holds only in part, in the last "
            "state (/debug/state lists them and why)",
            labels=label,
        )
        repairs = counter(
            "kpng_backend_drift_repairs",
            "times another program had changed the backend's rules and a sync put them back, by "
            "what was found",
            labels=["backend", "kind"],
        )
        diverged = gauge(
            "kpng_backend_diverged",
            "1 while the backend knows the kernel differs from the rules it applied",
            labels=label,
        )
        for feeder in self._status.feeders():
            sync = feeder.sync
            refused.add([feeder.name], len(sync.refused_services))
            diverged.add([feeder.name], int(sync.diverged_since is not None))
            for kind, n in sorted(sync.repairs.items()):
                repairs.add([feeder.name, kind], n)
        yield from (refused, repairs, diverged)


def _rest_client() -> Iterator[Family]:
    """client-go's metrics of the requests to the API server, as kube-proxy exports them;
    none before kpng's first request (a kpng without an API server has none), as client-go
    writes no family that has no series."""
    hosts = list(kubeclient.HOSTS.values())
    if not hosts:
        return
    results = counter(
        "rest_client_requests_total",
        "Requests to the API server, by HTTP status of the answer (<error>: none came), "
        "method and host",
        labels=["code", "method", "host"],
    )
    durations = histogram(
        "rest_client_request_duration_seconds",
        "Seconds from a request to the API server to its whole answer (a watch: to the "
        "answer's head), by verb and host",
        labels=["verb", "host"],
    )
    for requests in hosts:
        # Copied first: the pipeline's thread may count a new method or status meanwhile.
        for method, by_status in list(requests.results.items()):
            for status, n in sorted(by_status.copy().items()):
                results.add([kubeclient.code_label(status), method, requests.host], n)
        for method, observed in list(requests.durations.items()):
            counts = observed.cumulative()
            bounds = [*(f"{b:g}" for b in kubeclient.BUCKETS_S), "+Inf"]
            buckets = list(zip(bounds, counts, strict=True))
            durations.add_histogram([method, requests.host], buckets, observed.sum)
    yield results
    yield durations


_SYNC_FAILURES: dict[ProxyMode, tuple[str, str]] = {
    "nftables": (
        "kubeproxy_sync_proxy_rules_nftables_sync_failures",
        "Cumulative proxy nftables sync failures",
    ),
    "iptables": (
        "kubeproxy_sync_proxy_rules_iptables_restore_failures",
        "Cumulative proxy iptables restore failures",
    ),
}
"""Each mode's counter of failed syncs, as kube-proxy registers only its own mode's: an alert
written for iptables mode must see to-iptables' refused restores. (nftables mode's other
counter, ``nftables_cleanup_failures_total``, counts the separate transaction deleting stale
chains: to-nft deletes them in the sync's own transaction, so it has no such failure to count,
and kube-proxy shows no series before its first.)"""


def _conntrack(reconciled: Mapping[str, Reconciles]) -> Iterator[Family]:
    """kube-proxy's conntrack reconciler, as the backends' clean-up of stale UDP flows ran."""
    if not reconciled:
        return
    seconds = histogram(
        "kubeproxy_conntrack_reconciler_sync_duration_seconds",
        "ReconcileConntrackFlowsLatency latency in seconds",
        labels=["ip_family"],
    )
    deleted = counter(
        "kubeproxy_conntrack_reconciler_deleted_entries",
        "Cumulative conntrack flows deleted by conntrack reconciler",
        labels=["ip_family"],
    )
    for fam in FAMILIES:
        if (done := reconciled.get(fam)) is not None:
            seconds.add_histogram([fam], *_buckets(done))
            deleted.add([fam], done.deleted)
    yield from (seconds, deleted)


def _merged(histograms: Iterable[Histogram]) -> Histogram:
    merged = Histogram()
    for h in histograms:
        merged.count += h.count
        merged.sum += h.sum
        merged.buckets = [a + b for a, b in zip(merged.buckets, h.buckets, strict=True)]
    return merged


def _buckets(observed: Histogram | Reconciles) -> tuple[list[tuple[str, float]], float]:
    bounds = zip(observed.bounds, observed.buckets, strict=True)
    return [*((f"{b:g}", n) for b, n in bounds), ("+Inf", observed.count)], observed.sum


def _histogram(name: str, text: str, observed: Histogram) -> Family:
    family = histogram(name, text, labels=["ip_family"])
    for fam in FAMILIES:
        family.add_histogram([fam], *_buckets(observed))
    return family


def _per_family(family: Family, value: float) -> Family:
    for fam in FAMILIES:
        family.add([fam], value)
    return family
