"""The dashboard's API request panels against a real kube-apiserver: what `kpng kube` exports
about its requests (the rest of the dashboard: tests/pure/test_metrics_dashboard.py)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kpng.testing.waiting import until
from rig import kubeapi as k
from rig.cluster import ControlPlane
from rig.kubeapi import KubeApi
from tests.pure.test_metrics_dashboard import READ, _Kpng, _problems, _value


@pytest.mark.apiserver
def test_the_dashboard_reads_kpng_kube_and_its_requests_to_the_api_server(
    tmp_path: Path,
    control_plane: ControlPlane,
    kube_api: KubeApi,
    kube_namespace: str,
    kpng_command: list[str],
    subprocess_env: dict[str, str],
) -> None:
    ns = kube_namespace
    kube_api.create(k.service("web", ns))
    kube_api.create(k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.8.0.1", node="n1")]))
    args = ["kube", "--kubeconfig", str(control_plane.kubeconfig)]
    args += ["to-local", "--node-name", "n1", "to-json", "--output", str(tmp_path / "out")]
    kpng = _Kpng(kpng_command, args, tmp_path / "kpng.log", subprocess_env)
    host = urlsplit(control_plane.server).netloc
    try:
        until(kpng.answers, "/metrics to answer", within=30)
        until(lambda: _value(kpng.scrape(), "kpng_sources_synced") == 1, "the lists", within=30)
        families = kpng.scrape()
    finally:
        kpng.stop()
    problems = [p for read in READ for p in _problems(families, read)]
    assert problems == []
    # Four lists, then four watches, at least: each answered 200, each timed.
    assert _value(families, "rest_client_requests_total", code="200", method="GET", host=host) >= 8
    assert _value(families, "rest_client_requests_total", code="<error>") == 0
    duration = "rest_client_request_duration_seconds"
    assert _value(families, f"{duration}_count", verb="GET", host=host) >= 8
    assert _value(families, f"{duration}_bucket", verb="GET", host=host, le="60") >= 8
    assert _value(families, f"{duration}_sum", verb="GET", host=host) > 0
