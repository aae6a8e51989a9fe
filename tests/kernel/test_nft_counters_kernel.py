"""to-nft's traffic counters in the kernel: new and refused connections per service port, and
each endpoint's, counted across syncs in a network-namespace cluster (the counters' logic:
tests/pure/test_nft_counters.py)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.counting import (
    CONNECTIONS,
    ENDPOINT_CONNECTIONS,
    REJECTED,
)
from kpng.backends._nftables.executing import KernelNft, NetlinkBatches
from kpng.backends._nftables.layout import Options
from kpng.model.messages import ServiceEndpoints
from kpng.testing.netns import ClusterSpec, TestBed
from kpng.testing.states import keyed_state
from tests.pure.test_nft_counters import (
    EMPTY,
    OTHER,
    WEB,
    _ep,
    _service,
    _values,
)


def _kernel_backend(netns: str, options: Options) -> NftBackend:
    """to-nft on ``netns``'s kernel; its counters are read when a test says, not on a timer."""
    return NftBackend(
        nft=KernelNft(("ip", "netns", "exec", netns, "nft")),
        options=options,
        netlink=NetlinkBatches(f"/run/netns/{netns}"),
        sync_period=30,
    )


async def _web_counts(backend: NftBackend) -> dict[str, float]:
    """One read of ``backend``'s counters: each endpoint of ns/web's connections, and the
    service's own (key ``web``)."""
    await backend.read_traffic()
    samples = backend.metric_samples()
    endpoints = {
        dict(s.labels)["endpoint"]: s.value
        for s in samples
        if s.name == ENDPOINT_CONNECTIONS and dict(s.labels)["service"] == "web"
    }
    return {**endpoints, "web": _values(samples, CONNECTIONS)["web"]}  # type: ignore[arg-type]


def test_kernel_counts_new_and_refused_connections_per_service_port_across_syncs() -> None:
    """N connections to a Service (from the node, through its ClusterIP, and from outside,
    through a node port) and M to a Service with no endpoint are counted as such; an unrelated
    incremental sync and one rewriting the Service's elements lower nothing; the drift checks
    see no drift in counters that moved."""
    with TestBed(ClusterSpec.parse({"node-1": ["p1", "p2"]})) as bed:
        node = bed.nodes["node-1"]
        p1, p2 = bed.pod("p1"), bed.pod("p2")
        web_ip, empty_ip = "10.96.0.10", "10.96.0.11"
        services = {
            WEB: ServiceEndpoints(
                _service("web", cluster_ip=web_ip, node_port=30080), (_ep(p1.ip4, 8080),)
            ),
            EMPTY: ServiceEndpoints(_service("empty", cluster_ip=empty_ip, usable=False), ()),
        }
        options = Options(cluster_cidrs=("10.244.0.0/16",), traffic_counters=True)

        async def scenario() -> list[dict[str, dict[str, float]]]:
            backend = _kernel_backend(node.netns, options)
            seen = []

            async def read() -> None:
                await backend.read_traffic()
                samples = backend.metric_samples()
                seen.append(
                    {
                        name: _values(samples, name)  # type: ignore[arg-type]
                        for name in (CONNECTIONS, REJECTED)
                    }
                )

            def probe(netns: str, host: str, port: int, count: int) -> list[str]:
                return bed.probe(netns, "tcp", host, port, count=count, timeout=1)

            await backend.apply(keyed_state(1, services))
            assert [r.split()[0] for r in probe(node.netns, web_ip, 80, 5)] == ["p1"] * 5
            assert bed.external is not None
            assert len(probe(bed.external.netns, node.ip4, 30080, 2)) == 2
            refused = probe(node.netns, empty_ip, 80, 3)
            assert not any(r.startswith("p1") for r in refused)
            await read()
            # An unrelated service comes: an incremental sync.
            other = ServiceEndpoints(_service("other", cluster_ip="10.96.0.12"), (_ep(p2.ip4),))
            await backend.apply(keyed_state(2, {**services, OTHER: other}, updated=[OTHER]))
            await read()
            # web gets a second endpoint: its elements are written again.
            services[WEB] = ServiceEndpoints(
                services[WEB].service, (_ep(p1.ip4, 8080), _ep(p2.ip4, 8080))
            )
            await backend.apply(keyed_state(3, {**services, OTHER: other}, updated=[WEB]))
            await read()
            assert len(probe(node.netns, web_ip, 80, 4)) == 4
            await read()
            assert await backend.check_kernel(full=True) is None
            await backend.close()
            return seen

        seen = asyncio.run(scenario())
    assert seen[0] == {
        CONNECTIONS: {"web": 7, "empty": 3},
        REJECTED: {"web": 0, "empty": 3},
    }
    assert seen[1] == {
        CONNECTIONS: {"web": 7, "empty": 3, "other": 0},
        REJECTED: {"web": 0, "empty": 3, "other": 0},
    }
    assert seen[2] == seen[1]
    assert seen[3][CONNECTIONS] == {"web": 11, "empty": 3, "other": 0}


def test_kernel_counts_each_endpoints_connections_across_syncs() -> None:
    """N connections to a Service with two endpoints are counted per endpoint as they went
    (summing to N); an incremental sync adding an endpoint, and a full resync repairing
    drift, lower nothing."""
    with TestBed(ClusterSpec.parse({"node-1": ["p1", "p2", "p3"]})) as bed:
        node = bed.nodes["node-1"]
        pods = {name: bed.pod(name) for name in ("p1", "p2", "p3")}
        web_ip, other_ip = "10.96.0.20", "10.96.0.21"
        web = _service("web", cluster_ip=web_ip)
        other = ServiceEndpoints(_service("other", cluster_ip=other_ip), (_ep(pods["p3"].ip4),))
        services = {
            WEB: ServiceEndpoints(web, (_ep(pods["p1"].ip4, 8080), _ep(pods["p2"].ip4, 8080))),
            OTHER: other,
        }
        options = Options(
            cluster_cidrs=("10.244.0.0/16",), traffic_counters=True, endpoint_counters=True
        )
        # Every endpoint's count, zeros included (the kernel's are there from the start).
        answered = {f"{pods[name].ip4}:8080": 0 for name in ("p1", "p2")}
        split: dict[str, int] = {}

        async def scenario() -> list[dict[str, float]]:
            backend = _kernel_backend(node.netns, options)
            seen = []

            async def read() -> None:
                seen.append(await _web_counts(backend))

            def connect(count: int) -> None:
                for answer in bed.probe(node.netns, "tcp", web_ip, 80, count=count, timeout=1):
                    name = answer.split()[0]
                    address = f"{pods[name].ip4}:8080"
                    answered[address] = answered.get(address, 0) + 1

            await backend.apply(keyed_state(1, services))
            connect(20)
            split.update(answered)
            await read()
            # An incremental sync: web gets a third endpoint (its dispatch element and a new
            # endpoint element are written).
            services[WEB] = ServiceEndpoints(
                web, (*services[WEB].endpoints, _ep(pods["p3"].ip4, 8080))
            )
            await backend.apply(keyed_state(2, services, updated=[WEB]))
            answered[f"{pods['p3'].ip4}:8080"] = 0
            await read()
            connect(10)
            await read()
            assert await backend.check_kernel(full=True) is None
            # Another program deletes an element of kpng's: the drift check repairs it with a
            # full resync, which writes every counter again.
            bed.exec(
                node.netns,
                ["nft", "delete", "element", "inet", "kpng", "cluster-v4",
                 f"{{ {other_ip} . tcp . 80 }}"],
            )  # fmt: skip
            assert await backend.check_kernel(full=True) is not None
            await read()
            await backend.close()
            return seen

        seen = asyncio.run(scenario())
    assert {k: v for k, v in seen[0].items() if k != "web"} == split
    assert sum(split.values()) == 20 == seen[0]["web"]
    assert seen[1] == {**seen[0], f"{pods['p3'].ip4}:8080": 0}
    assert {k: v for k, v in seen[2].items() if k != "web"} == answered
    assert seen[2]["web"] == 30
    assert seen[3] == seen[2]


EXTERNAL_IP = "10.251.0.30"
"""In the bed's VIP range: the external client routes it to the node."""


def test_kernel_counts_client_ip_affinity_connections_on_the_endpoint_they_stick_to() -> None:
    """A ClientIP-affinity Service's connections are counted on the endpoint that took them:
    N from one client through its ClusterIP, all to one endpoint, count N there (none on the
    other); M from another client through its node port count on the endpoint that client
    sticks to, and so do K more from it through an external IP. Its dispatch elements count them
    all. An incremental sync taking an endpoint away lowers nothing of the other's."""
    with TestBed(
        ClusterSpec.parse({"node-1": ["p1", "p2"]}), prefix=f"ktlocalcount{secrets.token_hex(2)}"
    ) as bed:
        node = bed.nodes["node-1"]
        pods = {name: bed.pod(name).ip4 for name in ("p1", "p2")}
        web_ip = "10.96.0.30"
        web = _service(
            "web", cluster_ip=web_ip, node_port=30081, external_ips=(EXTERNAL_IP,), affinity=60
        )
        services = {
            WEB: ServiceEndpoints(web, tuple(_ep(ip, 8080) for ip in pods.values())),
        }
        options = Options(
            cluster_cidrs=("10.244.0.0/16",), traffic_counters=True, endpoint_counters=True
        )
        answered: Counter[str] = Counter()
        first: Counter[str] = Counter()
        """``answered`` as of the first read."""

        def connect(netns: str, host: str, port: int, count: int) -> set[str]:
            names = {a.split()[0] for a in bed.probe(netns, "tcp", host, port, count=count)}
            answered.update({f"{pods[name]}:8080": count for name in names})
            return names

        async def scenario() -> list[dict[str, float]]:
            backend = _kernel_backend(node.netns, options)
            seen = []

            async def read() -> None:
                seen.append(await _web_counts(backend))

            await backend.apply(keyed_state(1, services))
            assert len(connect(node.netns, web_ip, 80, 12)) == 1  # it sticks
            assert bed.external is not None
            outside = connect(bed.external.netns, node.ip4, 30081, 5)
            assert len(outside) == 1
            # The same client through an external IP (another kind, another chain) sticks too.
            assert connect(bed.external.netns, EXTERNAL_IP, 80, 3) == outside
            assert await backend.check_kernel(full=True) is None
            await read()
            first.update(answered)
            # An incremental sync takes p2 away: its clients pick p1, p1's count goes on.
            services[WEB] = ServiceEndpoints(web, (_ep(pods["p1"], 8080),))
            await backend.apply(keyed_state(2, services, updated=[WEB]))
            assert await backend.check_kernel(full=True) is None
            assert connect(node.netns, web_ip, 80, 4) == {"p1"}
            await read()
            await backend.close()
            return seen

        seen = asyncio.run(scenario())
    p1, p2 = (f"{pods[name]}:8080" for name in ("p1", "p2"))
    assert seen[0] == {p1: first[p1], p2: first[p2], "web": 20}
    assert seen[1] == {p1: answered[p1], "web": 24}
    assert answered[p1] == first[p1] + 4
