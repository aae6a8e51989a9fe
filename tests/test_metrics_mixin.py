"""The kubernetes-mixin's "Proxy" dashboard and kube-proxy alerts, unchanged, against a real
kpng: ``kpng file ... to-local ... to-nft`` in a network namespace of its own, its endpoints
churned so that histograms have samples, scraped as Prometheus would, and every query evaluated
by promtool (built from the Prometheus module) on those scrapes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.harness import mixin
from kpng.testing.netns import available
from kpng.testing.waiting import until

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))

METRICS = "127.0.0.1:10249"
HEALTHZ = "127.0.0.1:10256"
CHANGES = 3
PROGRAMMED = ("kubeproxy_network_programming_duration_seconds_count", (("ip_family", "IPv4"),))

NOT_SERVED = {
    "Kube API Request Rate": "client-go's rest_client_requests_total: the file source asks no API",
    "Post Request Latency 99th Quantile": "client-go's rest_client_request_duration_seconds",
    "Get Request Latency 99th Quantile": "client-go's rest_client_request_duration_seconds",
    "Goroutines": "go_goroutines: kpng is not a Go program",
}
"""Panels whose metrics kpng does not export, and why; asserted empty, so that exporting them
makes this test say so."""


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
  internalTrafficPolicy: Local
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


def _get(netns: str, url: str) -> tuple[int, str]:
    """GET ``url`` from inside ``netns`` (kpng listens on its loopback)."""
    script = (
        "import sys, urllib.request, urllib.error\n"
        "try:\n"
        f"    r = urllib.request.urlopen({url!r}, timeout=5); code, body = r.status, r.read()\n"
        "except urllib.error.HTTPError as e:\n"
        "    code, body = e.code, e.read()\n"
        "except OSError:\n"
        "    code, body = 0, b''\n"
        "sys.stdout.write(str(code) + '\\n' + body.decode())\n"
    )
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    code, _, body = out.partition("\n")
    return int(code), body


def _scrape(netns: str) -> dict[mixin.Sample, float]:
    code, text = _get(netns, f"http://{METRICS}/metrics")
    assert code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_mixin_proxy_dashboard_and_alerts_read_kpng_unchanged(
    tmp_path: Path,
    namespaces: Callable[[], str],
    kpng_command: list[str],
    subprocess_env: dict[str, str],
) -> None:
    try:
        source = mixin.ensure_mixin()
    except mixin.MixinUnavailable as exc:
        pytest.skip(str(exc))
    queries = mixin.dashboard_queries(source, instance=METRICS)
    alerts = mixin.alert_expressions(source)
    promtool = mixin.ensure_promtool()
    assert promtool.exists()

    netns = namespaces()
    manifests = tmp_path / "cluster.yaml"
    manifests.write_text(_manifest(0))
    argv = ["ip", "netns", "exec", netns, *kpng_command]
    argv += ["--healthz-address", HEALTHZ, "--metrics-address", METRICS]
    argv += ["file", "--input", str(manifests), "to-local", "--node-name", "node-1", "to-nft"]
    log = tmp_path / "kpng.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(argv, stderr=stderr, env=subprocess_env)
    try:
        until(lambda: _get(netns, f"http://{HEALTHZ}/healthz")[0] == 200, "/healthz 200")
        # kube-proxy's metrics port answers /healthz too, as its HTTP server's own check.
        assert _get(netns, f"http://{METRICS}/healthz") == (200, "ok")
        assert _get(netns, f"http://{HEALTHZ}/livez")[0] == 200
        scrapes = [_scrape(netns)]
        for generation in range(1, CHANGES):
            time.sleep(1.1)  # a new whole second for the trigger time
            manifests.write_text(_manifest(generation))
            expected = float(generation)
            until(lambda: _scrape(netns)[PROGRAMMED] >= expected, f"change {generation}")  # noqa: B023
            scrapes.append(_scrape(netns))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()

    last = scrapes[-1]
    assert last[("kubeproxy_proxy_healthz_total", (("code", "200"),))] >= 1
    assert last[("kubeproxy_proxy_livez_total", (("code", "200"),))] == 1
    internal_v4 = (("ip_family", "IPv4"), ("traffic_policy", "internal"))
    assert last[("kubeproxy_sync_proxy_rules_no_local_endpoints_total", internal_v4)] == 0

    served = [q.expr for q in queries if q.panel not in NOT_SERVED]
    missing = [q.expr for q in queries if q.panel in NOT_SERVED]
    assert {q.panel for q in queries} >= set(NOT_SERVED)
    # While kpng is scraped, the alerts stay silent.
    document = mixin.promtool_tests(
        scrapes,
        job="kube-proxy",
        instance=METRICS,
        nonempty=served,
        empty=[*missing, *alerts.values()],
    )
    result = mixin.run_promtool_tests(document, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
