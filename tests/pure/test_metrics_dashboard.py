"""What the kubernetes-mixin's "Proxy" dashboard and its kube-proxy alerts read, against a
running kpng's ``/metrics``, parsed by Prometheus' own text parser.

``READ`` is kpng's statement of those facts (names, types, labels, buckets, as kube-proxy 1.37
exports them and the mixin's queries select them), checked by hand against the mixin's
``dashboards/proxy.libsonnet`` and its alert libraries; it is no copy of them. Neither the mixin
nor promtool can be had here (the Go module proxy does not serve the mixin), so the queries are
not evaluated: what they need of each scrape is checked instead.

kpng runs as an operator runs it: under the file source (no API server: client-go would write
no ``rest_client_*`` series either) and under ``kpng kube`` against a real kube-apiserver, whose
requests the ``rest_client_*`` series must carry.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kpng.testing.ports import free_port
from kpng.testing.waiting import until

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Read:
    """A metric the dashboard or an alert reads, as kube-proxy exports it."""

    name: str
    """As queries write it; a counter's with ``_total``, a histogram's without a suffix."""
    kind: Kind
    labels: frozenset[str]
    """Its own labels (a histogram's ``le`` aside); the scrape adds ``job`` and ``instance``."""
    buckets: tuple[float, ...] = ()
    """A histogram's upper bounds, ``+Inf`` aside: a quantile is read from these."""
    readers: tuple[str, ...] = ()
    """The panels (or template variable, or alert) that read it."""
    api: bool = False
    """Only once the process has sent requests to an API server (client-go's)."""


SYNC_BUCKETS_S = tuple(0.001 * 2**i for i in range(15))
"""kube-proxy's sync latency buckets: 1 ms, doubling, to 16.384 s."""
PROGRAMMING_BUCKETS_S = (
    0.25,
    0.5,
    *range(1, 60),
    *range(60, 120, 5),
    *range(120, 301, 30),
)
"""kube-proxy's network programming buckets: 0.25 s, 0.5 s, each second to 59 s, each 5 s to
115 s, each 30 s to 300 s."""
REST_CLIENT_BUCKETS_S = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
"""client-go's request latency buckets (since Kubernetes 1.24)."""

READ = (
    Read(
        "kubeproxy_sync_proxy_rules_duration_seconds",
        "histogram",
        frozenset({"ip_family"}),
        SYNC_BUCKETS_S,
        ("Rules Sync Rate (_count)", "Rule Sync Latency 99th Quantile (_bucket)"),
    ),
    Read(
        "kubeproxy_network_programming_duration_seconds",
        "histogram",
        frozenset({"ip_family"}),
        PROGRAMMING_BUCKETS_S,
        (
            "the instance variable (the instance label of _bucket: present before any change)",
            "Network Programming Rate (_count)",
            "Network Programming Latency 99th Quantile (_bucket, by instance and le)",
        ),
    ),
    Read(
        "rest_client_requests_total",
        "counter",
        frozenset({"code", "host", "method"}),
        readers=(
            "Kube API Request Rate (code matched as 2.., 3.., 4.., 5..)",
            "KubeClientErrors (code 5.. against all)",
        ),
        api=True,
    ),
    Read(
        "rest_client_request_duration_seconds",
        "histogram",
        frozenset({"host", "verb"}),
        REST_CLIENT_BUCKETS_S,
        (
            "Post Request Latency 99th Quantile (verb POST)",
            "Get Request Latency 99th Quantile (verb GET)",
        ),
        api=True,
    ),
    Read("process_resident_memory_bytes", "gauge", frozenset(), readers=("Memory",)),
    Read("process_cpu_seconds_total", "counter", frozenset(), readers=("CPU usage (rate)",)),
)

NOT_EXPORTED = {
    "go_goroutines": "the Goroutines panel: kpng is not a Go program",
    "up": "the Up panel, KubeProxyDown and KubeProxyInstanceUnreachable: Prometheus writes it "
    "for each scrape, 1 when /metrics answered (as the scrapes here do)",
}
"""Series the dashboard or alerts read that no exporter writes, or kpng cannot."""


def _families(text: str) -> dict[str, Metric]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _problems(families: dict[str, Metric], read: Read) -> Iterator[str]:
    """How a scrape differs from what ``read`` says a query needs of it."""
    family = families.get(read.name.removesuffix("_total") if read.kind == "counter" else read.name)
    if family is None:
        yield f"{read.name}: absent"
        return
    if family.type != read.kind:
        yield f"{read.name}: a {family.type}, not a {read.kind}"
    if not family.samples:
        yield f"{read.name}: no series"
    series: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    for sample in family.samples:
        own = {name: value for name, value in sample.labels.items() if name != "le"}
        if set(own) != read.labels:
            yield f"{sample.name}: labels {sorted(own)}, not {sorted(read.labels)}"
        if read.kind == "histogram" and sample.name == f"{read.name}_bucket":
            series.setdefault(tuple(sorted(own.items())), {})[sample.labels["le"]] = sample.value
    if read.kind != "histogram":
        return
    counts = {
        tuple(sorted(s.labels.items())): s.value
        for s in family.samples
        if s.name == f"{read.name}_count"
    }
    for labels, buckets in series.items():
        bounds = sorted(float(le) for le in buckets)
        if bounds != [*(float(b) for b in read.buckets), float("inf")]:
            yield f"{read.name}{dict(labels)}: buckets {bounds}"
        cumulative = [buckets[le] for le in sorted(buckets, key=float)]
        if cumulative != sorted(cumulative) or counts.get(labels) != cumulative[-1]:
            yield f"{read.name}{dict(labels)}: buckets {cumulative} are not cumulative to _count"


def _scrape(address: str) -> dict[str, Metric]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        assert answer.status == 200
        return _families(answer.read().decode())


def _value(families: dict[str, Metric], sample: str, **labels: str) -> float:
    """The sum of ``sample``'s series that have ``labels`` (0: none)."""
    return sum(
        s.value
        for family in families.values()
        for s in family.samples
        if s.name == sample and labels.items() <= s.labels.items()
    )


def _manifest(generation: int) -> str:
    trigger = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"""---
apiVersion: v1
kind: Node
metadata: {{name: node-1}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: shop}}
spec:
  clusterIP: 10.96.0.10
  ports: [{{name: http, port: 80, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: shop
  labels: {{kubernetes.io/service-name: web}}
  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: "{trigger}"}}
addressType: IPv4
ports: [{{name: http, port: 8080, protocol: TCP}}]
endpoints:
- addresses: [10.244.1.{10 + generation}]
  nodeName: node-1
"""


class _Kpng:
    """kpng as an operator starts it, its metrics on a loopback port of its own."""

    def __init__(self, command: list[str], args: list[str], log: Path, env: dict[str, str]) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self._log = log
        argv = [*command, "--metrics-bind-address", self.address, *args]
        with log.open("wb") as stderr:
            self._proc = subprocess.Popen(argv, stderr=stderr, env=env)

    def scrape(self) -> dict[str, Metric]:
        return _scrape(self.address)

    def answers(self) -> bool:
        try:
            self.scrape()
        except OSError:
            assert self._proc.poll() is None, self._log.read_text()
            return False
        return True

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        assert self._proc.returncode == 0, self._log.read_text()


def test_the_table_names_what_kube_proxy_exports() -> None:
    """The table's own consistency: each name once, histograms with buckets, counters _total."""
    names = [read.name for read in READ]
    assert len(names) == len(set(names))
    for read in READ:
        assert bool(read.buckets) == (read.kind == "histogram"), read.name
        assert read.name.endswith("_total") == (read.kind == "counter"), read.name
        assert list(read.buckets) == sorted(set(read.buckets)), read.name
        assert read.readers, read.name
    assert not set(NOT_EXPORTED) & set(names)


@pytest.mark.slow
def test_the_dashboard_reads_kpng_under_the_file_source(
    tmp_path: Path, kpng_command: list[str], subprocess_env: dict[str, str]
) -> None:
    manifests = tmp_path / "cluster.yaml"
    manifests.write_text(_manifest(0))
    args = ["file", "--input", str(manifests)]
    args += ["to-local", "--node-name", "node-1", "to-json", "--output", str(tmp_path / "out")]
    kpng = _Kpng(kpng_command, args, tmp_path / "kpng.log", subprocess_env)
    try:
        until(kpng.answers, "/metrics to answer")
        programmed = "kubeproxy_network_programming_duration_seconds_count"
        # A change after kpng started (its first state's trigger may predate it): timed.
        time.sleep(1.1)  # a new whole second for the trigger time
        manifests.write_text(_manifest(1))
        until(lambda: _value(kpng.scrape(), programmed, ip_family="IPv4") >= 1, "a change")
        families = kpng.scrape()
    finally:
        kpng.stop()
    problems = [p for read in READ if not read.api for p in _problems(families, read)]
    assert problems == []
    assert _value(families, "kubeproxy_sync_proxy_rules_duration_seconds_count") >= 1
    # kpng has asked no API server anything: no series, as client-go writes none then.
    assert not {r.name.removesuffix("_total") for r in READ if r.api} & set(families)
    assert not set(NOT_EXPORTED) & set(families)
