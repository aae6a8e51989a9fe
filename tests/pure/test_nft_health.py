"""Health check node ports: what they count, what they answer, on real sockets on loopback."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from kpng.backends._healthchecks import (
    UNHEALTHY_AFTER_S,
    Answer,
    HealthServers,
    local_ready_endpoints,
    response,
)
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import Options
from kpng.backends._nftables.nftables import NftError, Transaction
from kpng.backends.registry import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    Endpoint,
    EndpointScopes,
    IPFamilies,
    IPSet,
    PortMapping,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)
from kpng.testing import states
from kpng.testing.ports import free_port

LB: ServiceKey = ("ns", "lb")


def _ep(addr: str, *, local: bool = True, ready: bool = True) -> Endpoint:
    scopes = EndpointScopes(Internal=True, External=local, Cluster=True)
    return states.endpoint(addr, port_name="p", scopes=scopes, local=local, ready=ready)


def _dual(v4: str, v6: str) -> Endpoint:
    return msgspec.structs.replace(_ep(v4), IPs=IPSet(V4=(v4,), V6=(v6,)))


def _lb(health_port: int, *endpoints: Endpoint) -> ServiceEndpoints:
    service = Service(
        Namespace="ns",
        Name="lb",
        Type="LoadBalancer",
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=("10.96.0.10",))),
        Ports=(
            PortMapping(
                Name="p",
                Protocol="TCP",
                Port=80,
                NodePort=30080,
                UsableEndpoints=IPFamilies(V4=True),
            ),
        ),
        ExternalTrafficToLocal=True,
        HealthCheckNodePort=health_port,
    )
    return ServiceEndpoints(service, endpoints)


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        pytest.param([_ep("10.1.0.2"), _ep("10.1.0.3")], 2, id="local_ready_ones_count"),
        pytest.param([_ep("10.2.0.2", local=False)], 0, id="remote_ones_do_not"),
        pytest.param([_ep("10.1.0.2", ready=False)], 0, id="local_unready_ones_do_not"),
        pytest.param([_ep("10.1.0.2"), _ep("10.1.0.2")], 1, id="an_address_counts_once"),
        pytest.param([], 0, id="no_endpoint"),
        pytest.param([_dual("10.1.0.2", "fd00::2")], 1, id="a_dual_stack_pod_counts_once"),
    ],
)
def test_local_ready_endpoints_are_counted(endpoints: list[Endpoint], expected: int) -> None:
    assert local_ready_endpoints(_lb(30000, *endpoints)) == expected


@pytest.mark.parametrize(
    ("count", "healthy", "status"), [(3, True, 200), (0, True, 503), (3, False, 503)]
)
def test_response_is_kube_proxys(count: int, healthy: bool, status: int) -> None:
    reply = response(Answer("ns", "lb", count), proxy_healthy=healthy)
    assert reply.status == status
    assert reply.content_type == "application/json"
    assert reply.headers == {
        "X-Content-Type-Options": "nosniff",
        "X-Load-Balancing-Endpoint-Weight": str(count),
        "Connection": "close",
    }
    assert json.loads(reply.body) == _body(count, healthy=healthy)


def _body(count: int, *, healthy: bool = True) -> dict[str, object]:
    return {
        "service": {"namespace": "ns", "name": "lb"},
        "localEndpoints": count,
        "serviceProxyHealthy": healthy,
    }


async def _get(port: int) -> tuple[int, object] | str:
    """(status, JSON body) of ``GET /healthz`` on loopback, or "refused"."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return "refused"
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: node\r\n\r\n")
    data = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _state(revision: int, services: dict[ServiceKey, ServiceEndpoints]) -> NodeState:
    return NodeState(
        node="n1",
        revision=revision,
        services=dict(services),
        updated=frozenset(services),
        deleted=frozenset(),
    )


def test_health_check_node_port_answers_on_a_real_socket_and_follows_changes() -> None:
    port = free_port()

    async def scenario() -> None:
        backend = NftBackend(
            nft=FakeNft(), options=Options(), health=HealthServers(host="127.0.0.1")
        )
        try:
            services = {
                LB: _lb(port, _ep("10.1.0.2"), _ep("10.1.0.3"), _ep("10.2.0.2", local=False))
            }
            await backend.apply(_state(1, services))
            assert await _get(port) == (200, _body(2))
            # One local endpoint is no longer ready, the other leaves.
            services = {LB: _lb(port, _ep("10.1.0.2", ready=False), _ep("10.2.0.2", local=False))}
            await backend.apply(_state(2, services))
            assert await _get(port) == (503, _body(0))
            services = {LB: _lb(port, _ep("10.1.0.4"))}
            await backend.apply(_state(3, services))
            assert await _get(port) == (200, _body(1))
            # The service goes: so does its server.
            await backend.apply(
                NodeState(
                    node="n1",
                    revision=4,
                    services={},
                    updated=frozenset(),
                    deleted=frozenset({LB}),
                )
            )
            assert await _get(port) == "refused"
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_health_check_node_port_moves_with_the_service() -> None:
    first, second = free_port(), free_port()

    async def scenario() -> None:
        health = HealthServers(host="127.0.0.1")
        try:
            await health.update({LB: _lb(first, _ep("10.1.0.2"))})
            assert health.ports() == [first]
            await health.update({LB: _lb(second, _ep("10.1.0.2"))})
            assert health.ports() == [second]
            assert await _get(first) == "refused"
            assert await _get(second) == (200, _body(1))
        finally:
            await health.close()

    asyncio.run(scenario())


class _RefusingNft(FakeNft):
    async def run(self, tx: Transaction) -> None:
        raise NftError("Operation not supported", line_number=1, line="add table inet kpng")


def test_health_check_node_port_fails_when_the_kernel_keeps_refusing_the_rules() -> None:
    port = free_port()
    now = [1000.0]

    async def scenario() -> None:
        backend = NftBackend(
            nft=_RefusingNft(),
            options=Options(),
            health=HealthServers(host="127.0.0.1"),
            clock=lambda: now[0],
        )
        try:
            with pytest.raises(NftError):
                await backend.apply(_state(1, {LB: _lb(port, _ep("10.1.0.2"))}))
            assert backend.pending_since == 1000.0
            now[0] += UNHEALTHY_AFTER_S - 1
            assert await _get(port) == (200, _body(1))  # not yet: within the timeout
            now[0] += 2
            assert await _get(port) == (503, _body(1, healthy=False))
        finally:
            await backend.close()

    asyncio.run(scenario())
