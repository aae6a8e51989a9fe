"""The kube source's counts on /metrics, against a real kube-apiserver (the rest of /healthz,
/livez and /metrics: tests/pure/test_status.py)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kpng.status import Status
from kpng.status.metrics import scrape
from kpng.testing.recording import KpngUnderTest
from rig import kubeapi as k
from rig.cluster import ControlPlane
from rig.kubeapi import KubeApi


@pytest.mark.apiserver
def test_the_kube_source_counts_its_lists_and_events(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str
) -> None:
    ns = kube_namespace

    def samples(status: Status) -> dict[tuple[str, str], float]:
        text = scrape(status).decode()
        return {
            (sample.name, sample.labels.get("source", "")): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    async def scenario() -> None:
        async with KpngUnderTest.start(control_plane.kubeconfig, namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {})
            status = Status(timeout=60.0, store=kpng.store)
            before = samples(status)
            for source in ("kube-services", "kube-slices", "kube-nodes"):
                assert before[("kpng_source_synced", source)] == 1
                assert before[("kpng_source_lists_total", source)] >= 1
            await asyncio.to_thread(kube_api.create, k.service("web", ns))
            await kpng.wait_for(lambda v: f"{ns}/web" in v)
            after = samples(status)
            events = ("kpng_source_events_total", "kube-services")
            # At least ours: the apiserver itself updates the default "kubernetes" Service.
            assert after[events] >= before[events] + 1

    asyncio.run(asyncio.wait_for(scenario(), 60))
