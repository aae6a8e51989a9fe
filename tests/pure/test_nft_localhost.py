"""to-nft's node ports on loopback (``--localhost-nodeports``, ``_nftables/localhost.py``): which
listeners a state needs, and the relay itself, on this host's loopback (no namespace)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kpng.backends._nftables.layout import Options
from kpng.backends._nftables.localhost import (
    FAILURES,
    LISTENERS,
    Listener,
    ListenerKey,
    LocalhostProxy,
    listeners,
)
from kpng.model.messages import EndpointScopes, ServiceEndpoints
from kpng.testing import states

SERVED = Options(nodeport_addresses=("127.0.0.0/8",), localhost_nodeports=True)
LOCAL_ONLY = EndpointScopes(Internal=True, External=False, Cluster=True)


def _np(protocol: str = "TCP", *eps: str, etp_local: bool = False) -> ServiceEndpoints:
    return ServiceEndpoints(
        states.service(node_port=30080, protocol=protocol, etp_local=etp_local),
        tuple(states.endpoint(a, protocol=protocol) for a in eps),
    )


@pytest.mark.parametrize(
    ("options", "se", "expected"),
    [
        pytest.param(
            SERVED,
            _np("TCP", "10.244.1.2", "10.244.2.3"),
            {("v4", 30080): Listener((("10.244.1.2", "8080"), ("10.244.2.3", "8080")))},
            id="tcp",
        ),
        pytest.param(SERVED, _np("UDP", "10.244.1.2"), {}, id="udp-is-refused-not-proxied"),
        pytest.param(SERVED, _np("TCP"), {}, id="no-endpoint-no-listener"),
        pytest.param(
            Options(nodeport_addresses=("0.0.0.0/0",), localhost_nodeports=True),
            _np("TCP", "10.244.1.2"),
            {},
            id="a-catch-all-names-no-loopback",
        ),
        pytest.param(
            Options(nodeport_addresses=("127.0.0.0/8",)),
            _np("TCP", "10.244.1.2"),
            {},
            id="not-asked",
        ),
    ],
)
def test_listeners_are_the_tcp_node_ports_of_families_naming_loopback(
    options: Options, se: ServiceEndpoints, expected: dict[object, Listener]
) -> None:
    assert listeners({("ns", "web"): se}, options) == expected


def test_external_traffic_policy_local_relays_to_local_endpoints_only() -> None:
    se = ServiceEndpoints(
        states.service(node_port=30080, etp_local=True),
        (
            states.endpoint("10.244.1.2", local=True),
            states.endpoint("10.244.2.3", scopes=LOCAL_ONLY),
        ),
    )
    assert listeners({("ns", "web"): se}, SERVED) == {
        ("v4", 30080): Listener((("10.244.1.2", "8080"),))
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _ask(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hello\n")
    await writer.drain()
    writer.write_eof()
    answer = await reader.read()
    writer.close()
    return answer


def test_the_relay_carries_a_connection_both_ways_until_its_port_goes() -> None:
    async def scenario() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # Reads to the client's end: the relay passes half-closes on.
            writer.write(b"echo " + await reader.read())
            writer.write_eof()
            writer.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        endpoint = ("127.0.0.1", str(upstream.sockets[0].getsockname()[1]))
        node_port = _free_port()
        proxy = LocalhostProxy(addresses={"v4": "127.0.0.1", "v6": "::1"})
        try:
            await proxy.sync({("v4", node_port): Listener((endpoint,))})
            assert await _ask(node_port) == b"echo hello\n"
            await proxy.sync({})
            with pytest.raises(ConnectionRefusedError):
                await _ask(node_port)
        finally:
            await proxy.close()
            upstream.close()
            await upstream.wait_closed()

    asyncio.run(scenario())


def _series(proxy: LocalhostProxy) -> dict[tuple[str, str], float]:
    """The proxy's samples for IPv4, by name and family."""
    return {
        (sample.name, dict(sample.labels)["ip_family"]): sample.value
        for sample in proxy.samples()
        if dict(sample.labels)["ip_family"] == "IPv4"
    }


def test_a_port_held_by_another_program_is_skipped_and_taken_once_free() -> None:
    async def scenario() -> None:
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        port: int = held.getsockname()[1]
        proxy = LocalhostProxy()
        wanted: dict[ListenerKey, Listener] = {("v4", port): Listener((("127.0.0.1", "9"),))}
        try:
            await proxy.sync(wanted)
            assert proxy.active == frozenset()
            assert _series(proxy) == {(LISTENERS, "IPv4"): 0, (FAILURES, "IPv4"): 1}
            held.close()
            await proxy.sync(wanted)
            assert proxy.active == {("v4", port)}
            # kube-proxy's series: one listener bound, the failed bind still counted.
            assert _series(proxy) == {(LISTENERS, "IPv4"): 1, (FAILURES, "IPv4"): 1}
        finally:
            held.close()
            await proxy.close()

    asyncio.run(scenario())


def test_client_ip_affinity_keeps_one_endpoint_while_connections_keep_coming() -> None:
    """Every local client is 127.0.0.1: one pin for all, sliding, as kube-proxy's."""

    async def scenario() -> None:
        now = [0.0]
        proxy = LocalhostProxy(clock=lambda: now[0])
        endpoints = tuple((f"10.244.1.{i}", "8080") for i in range(2, 12))
        port = _free_port()
        try:
            await proxy.sync({("v4", port): Listener(endpoints, affinity_s=10)})
            relay = proxy._active[("v4", port)]
            first = relay.pick()
            for _ in range(20):
                now[0] += 9
                assert relay.pick() == first
            # Without affinity, each connection is a new pick.
            await proxy.sync({("v4", port): Listener(endpoints)})
            assert len({relay.pick() for _ in range(50)}) > 1
        finally:
            await proxy.close()

    asyncio.run(scenario())
