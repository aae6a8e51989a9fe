"""kpng's backends fed by a Go KPNG brain: what its to-api server sends (server/pkg/endpoints/
node.go: ready endpoints with Local and Scopes Internal/External, overrides by name and number)
or its file source makes (no overrides), and none of kpng's extension fields. The client library
fills in what those semantics imply, once, before any full-state backend sees the state."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kpng.api import localv1_pb2
from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.fake import FakeNft
from kpng.backends._nftables.layout import TABLE, Options
from kpng.client import NodeState, watch_state
from kpng.client._compat import complete, from_go_kpng
from kpng.model.messages import (
    Endpoint,
    EndpointAddress,
    EndpointScopes,
    IPFamilies,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)

HTTP = PortMapping(Name="http", Protocol="TCP", Port=80, TargetPort=8080)
DNS = PortMapping(Name="dns", Protocol="UDP", Port=53, TargetPort=5353)
WEB = Service(
    Namespace="shop",
    Name="web",
    Type="ClusterIP",
    IPs=ServiceIPs(ClusterIPs=IPSet(V4=("10.96.0.10",))),
    Ports=(HTTP, DNS),
)


def _go_ep(ip: str, *, overrides: tuple[PortName, ...], internal: bool = True) -> Endpoint:
    return Endpoint(
        IPs=IPSet(V6=(ip,)) if ":" in ip else IPSet(V4=(ip,)),
        PortOverrides=overrides,
        Scopes=EndpointScopes(Internal=internal, External=True),
    )


TO_API = (PortName(Name="http", Port=8080), PortName(Name="dns", Port=5353))
"""Overrides as Go KPNG's to-api sends them: by name and number, no protocol."""


def test_overrides_without_protocol_get_their_ports_protocol_and_the_cluster_scope() -> None:
    se = ServiceEndpoints(WEB, (_go_ep("10.244.1.2", overrides=TO_API, internal=False),))
    assert from_go_kpng(se)
    (ep,) = complete(se).endpoints
    assert ep.PortOverrides == (
        PortName(Name="http", Port=8080, Protocol="TCP"),
        PortName(Name="dns", Port=5353, Protocol="UDP"),
    )
    # Every endpoint Go KPNG sends is of kube-proxy's cluster-wide set.
    assert ep.Scopes == EndpointScopes(Internal=False, External=True, Cluster=True)


def test_endpoints_without_overrides_serve_the_target_ports() -> None:
    named = PortMapping(Name="admin", Protocol="TCP", Port=9000, TargetPortName="admin")
    bare = PortMapping(Name="plain", Protocol="TCP", Port=7000)
    service = Service(Namespace="shop", Name="web", Ports=(HTTP, named, bare))
    (ep,) = complete(ServiceEndpoints(service, (_go_ep("10.244.1.2", overrides=()),))).endpoints
    # A named target port cannot be resolved from the service alone; no target: the port.
    assert ep.PortOverrides == (
        PortName(Name="http", Port=8080, Protocol="TCP"),
        PortName(Name="plain", Port=7000, Protocol="TCP"),
    )


def test_ports_get_their_usable_families_and_udp_serving_endpoints() -> None:
    se = ServiceEndpoints(
        WEB,
        (
            _go_ep("10.244.1.2", overrides=TO_API),
            _go_ep("fd00:244::2", overrides=(PortName(Name="http", Port=8080),)),
        ),
    )
    http, dns = complete(se).service.Ports
    assert http.UsableEndpoints == IPFamilies(V4=True, V6=True)
    assert http.ServingEndpoints == ()  # UDP ports only
    assert dns.UsableEndpoints == IPFamilies(V4=True)
    assert dns.ServingEndpoints == (EndpointAddress(IP="10.244.1.2", Port=5353),)


def test_a_state_from_kpngs_brain_is_left_as_it_is() -> None:
    ep = Endpoint(
        IPs=IPSet(V4=("10.244.1.2",)),
        PortOverrides=(PortName(Name="http", Port=8080, Protocol="TCP"),),
        Scopes=EndpointScopes(Internal=True),
    )
    se = ServiceEndpoints(WEB, (ep,))
    assert not from_go_kpng(se)
    assert complete(se) is se
    empty = ServiceEndpoints(WEB, ())
    assert complete(empty) is empty


# --- over the network: a server that speaks only Go KPNG's API and fields


def _op(**kw: Any) -> bytes:
    return localv1_pb2.OpItem(**kw).SerializeToString()


def _go_kpng_change_set() -> list[bytes]:
    service = localv1_pb2.Service(
        Namespace="shop",
        Name="web",
        Type="ClusterIP",
        IPs=localv1_pb2.ServiceIPs(ClusterIPs=localv1_pb2.IPSet(V4=["10.96.0.10"])),
        Ports=[
            localv1_pb2.PortMapping(Name="http", Protocol=localv1_pb2.TCP, Port=80, TargetPort=8080)
        ],
    )
    endpoint = localv1_pb2.Endpoint(
        IPs=localv1_pb2.IPSet(V4=["10.244.1.2"]),
        Local=True,
        PortOverrides=[localv1_pb2.PortName(Name="http", Port=8080)],
        Scopes=localv1_pb2.EndpointScopes(Internal=True, External=True),
    )

    def set_(kind: localv1_pb2.Set.ValueType, path: str, message: Any) -> bytes:
        ref = localv1_pb2.Ref(Set=kind, Path=path)
        return _op(Set=localv1_pb2.Value(Ref=ref, Bytes=message.SerializeToString()))

    return [
        _op(Reset=localv1_pb2.EmptyOp()),
        set_(localv1_pb2.ServicesSet, "shop/web", service),
        set_(localv1_pb2.EndpointsSet, "shop/web/10.244.1.2", endpoint),
        _op(Sync=localv1_pb2.EmptyOp()),
    ]


async def _watch(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    request = localv1_pb2.WatchReq.FromString(await anext(aiter(requests)))
    assert request.NodeName == "node-a"
    for op in _go_kpng_change_set():
        yield op
    async for _ in requests:  # the next change set is asked for and never comes
        pass


async def _served_state(socket: Path) -> NodeState:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "localv1.Sets", {"Watch": grpc.stream_stream_rpc_method_handler(_watch)}
            )
        ]
    )
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    states: list[NodeState] = []
    try:
        await asyncio.wait_for(
            watch_state(states.append, api=f"unix://{socket}", node_name="node-a", once=True),
            timeout=30,
        )
    finally:
        await server.stop(grace=None)
    return states[0]


def test_to_nft_programs_a_go_kpng_brains_services_instead_of_rejecting_them(
    tmp_path: Path,
) -> None:
    """Go KPNG's server has no batched watch: the client falls back to localv1.Sets/Watch."""

    async def scenario() -> FakeNft:
        state = await _served_state(tmp_path / "go-kpng.sock")
        nft = FakeNft()
        await NftBackend(nft=nft, options=Options()).apply(state)
        return nft

    nft = asyncio.run(scenario())
    dispatch = nft.elements(TABLE, "cluster-v4")
    assert dispatch == {("10.96.0.10", "tcp", "80"): ("goto pick-cluster-v4-1",)}
    assert nft.elements(TABLE, "cluster-eps-v4-0") == {
        ("10.96.0.10", "tcp", "80"): ("10.244.1.2", "8080")
    }


@pytest.mark.skipif(
    not os.environ.get("KPNG_GO_KPNG"),
    reason="set KPNG_GO_KPNG to a Go KPNG binary (built by hand: it is not on the module proxy)",
)
def test_against_go_kpngs_own_server(tmp_path: Path) -> None:
    """Go KPNG's ``kpng file --input F to-api`` serving a state file, read by kpng's client."""
    import subprocess

    import yaml

    # Go KPNG reads its file strictly: only the fixture's entries with Go KPNG's own fields, and
    # no session affinity (its reader panics on the oneof its writer writes).
    state = yaml.safe_load((Path(__file__).parent / "data" / "gokpng-state.yaml").read_text())
    state["services"] = state["services"][:1]
    del state["services"][0]["service"]["sessionaffinity"]
    fixture = tmp_path / "state.yaml"
    fixture.write_text(yaml.safe_dump(state))
    socket = tmp_path / "go-kpng.sock"
    binary = os.environ["KPNG_GO_KPNG"]
    argv = [binary, "file", f"--input={fixture}", "to-api", f"--listen=unix://{socket}"]
    with subprocess.Popen(argv, stderr=subprocess.PIPE) as server:
        try:
            for _ in range(100):
                if socket.exists():
                    break
                asyncio.run(asyncio.sleep(0.1))

            async def read() -> NodeState:
                states: list[NodeState] = []
                await asyncio.wait_for(
                    watch_state(
                        states.append, api=f"unix://{socket}", node_name="node-a", once=True
                    ),
                    timeout=30,
                )
                return states[0]

            state = asyncio.run(read())
        finally:
            server.terminate()
    web = state.services[("shop", "web")]
    assert {p.Protocol for ep in web.endpoints for p in ep.PortOverrides} == {"TCP", "UDP"}
    assert all(ep.Scopes is not None and ep.Scopes.Cluster for ep in web.endpoints)
    assert web.service.Ports[0].UsableEndpoints is not None


@pytest.mark.skipif(
    not os.environ.get("KPNG_GO_KPNG_NODELOG"),
    reason="set KPNG_GO_KPNG_NODELOG to Go KPNG's kpng-nodelog (go build ./kpng-nodelog in its "
    "cmd module, by hand: it is not on the module proxy)",
)
def test_go_kpngs_own_client_reads_kpngs_stream_node_facts_and_all(tmp_path: Path) -> None:
    """Go KPNG's localv1 client (its kpng-nodelog) against kpng's brain: the node facts, a set
    kind it does not know, are skipped, and every service and endpoint reaches it."""
    import subprocess

    from kpng.testing.ports import free_port

    cluster = Path(__file__).parents[2] / "examples" / "cluster.yaml"
    port = free_port()
    brain = subprocess.Popen(
        [sys.executable, "-m", "kpng", "file", "--input", str(cluster), "to-api",
         "--listen", f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    log = tmp_path / "nodelog.txt"
    try:
        with log.open("w") as out:
            client = subprocess.Popen(
                [os.environ["KPNG_GO_KPNG_NODELOG"], f"--api=127.0.0.1:{port}",
                 "--node-name=node-1"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                deadline = time.monotonic() + 30
                while "> sync" not in log.read_text():
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
            finally:
                client.terminate()
                client.wait(timeout=10)
    finally:
        brain.terminate()
        brain.wait(timeout=10)
    text = log.read_text()
    assert "unknown set: 100" in text  # the node facts, skipped
    for path in ("shop/web", "shop/api", "edge/ingress", "shop/web/10.244.1.11"):
        assert f'Path:"{path}"' in text, path
