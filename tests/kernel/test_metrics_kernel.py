"""A transaction the kernel refuses, as kpng's and kube-proxy's metrics count it: to-nft in a
network namespace of its own (the rest of the metrics: tests/pure/test_metrics.py)."""

from __future__ import annotations

import asyncio

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.layout import Options
from kpng.client import Backoff
from kpng.feeding import Fanout, Feeder, SyncStats
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    ServiceEndpoints,
)
from kpng.status import Status
from kpng.testing.states import keyed_state
from tests.kernel.test_nft_kernel import WEB, FailingOnceNft, _ep, _eventually, _service
from tests.pure.test_metrics import IPV4, IPV6, TO_NFT, _scrape


def test_a_refused_transaction_is_an_apply_failure_and_its_retry_a_new_last_applied(
    netns: str,
) -> None:
    """A refusal counts as a failure, and the retry's success (the Feeder's, in the background,
    once the backoff ends) moves the last-applied time."""

    async def scenario() -> None:
        nft = FailingOnceNft(netns)
        gate = asyncio.Event()

        async def backoff(_: float) -> None:
            await gate.wait()

        # Wired as the CLI wires it: to-nft reports its syncs into the stats kpng reads.
        syncs = SyncStats()
        backend = NftBackend(nft=nft, options=Options(), syncs=syncs)
        status = Status(timeout=60.0)
        feeder = Feeder("to-nft", backend, sync=syncs, reports_syncs=True)
        fanout = status.track(Fanout([feeder]))
        fanout.feeders[0]._backoff = Backoff(initial=0.01, sleep=backoff)
        services = {WEB: ServiceEndpoints(_service(), (_ep("10.244.1.2"),))}
        await fanout.apply(keyed_state(1, services))
        first = _scrape(status)
        assert first[("kpng_backend_apply_failures_total", TO_NFT)] == 0
        applied_at = first[("kpng_backend_last_applied_timestamp_seconds", TO_NFT)]
        assert applied_at > 0
        assert first[("kubeproxy_sync_full_proxy_rules_duration_seconds_count", IPV4)] == 1

        nft.fail_next = True
        db: ServiceKey = ("ns", "db")
        services[db] = ServiceEndpoints(
            _service(cluster_ip="10.96.0.20", name="db"), (_ep("10.244.1.3"),)
        )
        await fanout.apply(keyed_state(2, services, updated={db}))
        refused = _scrape(status)
        assert refused[("kpng_backend_apply_failures_total", TO_NFT)] == 1
        for fam in (IPV4, IPV6):
            assert refused[("kubeproxy_sync_proxy_rules_nftables_sync_failures_total", fam)] == 1
        # Nothing got through: neither kpng's nor kube-proxy's last sync moved.
        assert refused[("kpng_backend_last_applied_timestamp_seconds", TO_NFT)] == applied_at
        assert refused[("kpng_backend_applied_revision", TO_NFT)] == 1
        assert refused[("kubeproxy_sync_proxy_rules_last_timestamp_seconds", IPV4)] == applied_at
        assert refused[("kubeproxy_sync_partial_proxy_rules_duration_seconds_count", IPV4)] == 1

        gate.set()
        assert await _eventually(lambda: backend.pending_since is None)
        retried = _scrape(status)
        assert retried[("kpng_backend_last_applied_timestamp_seconds", TO_NFT)] > applied_at
        assert retried[("kpng_backend_applied_revision", TO_NFT)] == 2
        assert retried[("kpng_backend_apply_failures_total", TO_NFT)] == 1
        # The retry is a full resync: full and partial add up to every attempt.
        assert retried[("kubeproxy_sync_full_proxy_rules_duration_seconds_count", IPV4)] == 2
        assert retried[("kubeproxy_sync_proxy_rules_duration_seconds_count", IPV4)] == 3
        await fanout.close()

    asyncio.run(scenario())
