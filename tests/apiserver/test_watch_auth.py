"""Nodes authenticated the Kubernetes way: a projected ServiceAccount token with kpng's audience,
reviewed by a real kube-apiserver (TokenReview), over TLS and real gRPC. A watcher without such a
token is refused; a node asking for another node's state is refused."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kpng.client import Api, ClientTls, NodeState, watch_state
from kpng.errors import KpngError
from kpng.kubeclient.client import ApiClient
from kpng.kubeclient.config import load_connection
from kpng.remote.watching import _follow_once, global_rpcs
from kpng.server.auth import TokenReviews, WatchAuth
from kpng.server.serving import ListenAddress, Serving, TlsFiles, serve
from kpng.store import Store
from rig import kubeapi as k
from rig.cluster import ControlPlane, make_pki
from rig.kubeapi import KubeApi


def _token(api: KubeApi, namespace: str, account: str, *, audience: str, pod: Any = None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 600, "audiences": [audience]}
    if pod is not None:
        spec["boundObjectRef"] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        }
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token"
    token: str = api.request("POST", path, request)["status"]["token"]
    return token


@contextlib.asynccontextmanager
async def _brain(
    control_plane: ControlPlane, tmp_path: Path, *, node_user: str
) -> AsyncIterator[tuple[Serving, Path]]:
    """``kpng ... to-api --token-audience kpng`` on TLS: the server, and its CA."""
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    store = Store()
    handle = store.source("test")
    handle.mark_synced()
    connection = await load_connection(control_plane.kubeconfig)
    async with ApiClient(connection) as client:
        auth = WatchAuth(
            TokenReviews(client, audience="kpng"),
            node_users=frozenset({node_user}),
            global_users=frozenset(),
        )
        ready: asyncio.Future[Serving] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            serve(
                store,
                listen=[ListenAddress.parse("tcp://127.0.0.1:0")],
                tls=TlsFiles(cert=pki.serving_cert, key=pki.serving_key),
                auth=auth,
                started=ready.set_result,
            )
        )
        try:
            yield await asyncio.wait_for(asyncio.shield(ready), 20), pki.ca_cert
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _first_state(api: Api, node: str) -> NodeState | str:
    """The first state the server gives ``node``, or the status code it refuses with."""
    states: list[NodeState] = []
    try:
        await asyncio.wait_for(
            watch_state(states.append, api=api, node_name=node, once=True, connect_timeout=2), 10
        )
    except KpngError as exc:
        for code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            if code in str(exc):
                return code
        raise
    return states[0]


@pytest.mark.apiserver
def test_a_node_gets_its_own_state_and_nothing_else(
    control_plane: ControlPlane, kube_api: KubeApi, kube_namespace: str, tmp_path: Path
) -> None:
    ns = kube_namespace
    node_user = f"system:serviceaccount:{ns}:kpng-node"
    for node in ("node-a", "node-b"):
        kube_api.create(k.node(f"{ns}-{node}"))
    kube_api.request(
        "POST",
        f"/api/v1/namespaces/{ns}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "kpng-node"}},
    )
    # A node agent's pod on node-a (no kubelet runs it: its token is all that matters).
    agent = k.pod(
        "agent", ns, "kpng", ["pause"], node=f"{ns}-node-a", serviceAccountName="kpng-node"
    )
    pod = kube_api.request("POST", f"/api/v1/namespaces/{ns}/pods", agent)
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    bound = tokens / "bound"
    bound.write_text(_token(kube_api, ns, "kpng-node", audience="kpng", pod=pod))
    other_audience = tokens / "audience"
    other_audience.write_text(_token(kube_api, ns, "kpng-node", audience="api", pod=pod))

    async def scenario() -> dict[str, NodeState | str]:
        async with _brain(control_plane, tmp_path, node_user=node_user) as (serving, ca):
            url = serving.addresses[0]
            tls = ClientTls(ca=ca)
            seen: dict[str, NodeState | str] = {}
            seen["own"] = await _first_state(Api(url, tls=tls, token_file=bound), f"{ns}-node-a")
            seen["other"] = await _first_state(Api(url, tls=tls, token_file=bound), f"{ns}-node-b")
            seen["none"] = await _first_state(Api(url, tls=tls), f"{ns}-node-a")
            wrong = Api(url, tls=tls, token_file=other_audience)
            seen["audience"] = await _first_state(wrong, f"{ns}-node-a")
            async with Api(url, tls=tls, token_file=bound).channel() as channel:
                batched, _ = global_rpcs()

                class _Ops:
                    def op(self, *_: Any) -> None: ...

                    async def sync(self) -> bool:
                        return True

                try:
                    await _follow_once(channel, batched, _Ops(), metadata=Api(
                        url, token_file=bound).metadata())  # fmt: skip
                    seen["global"] = "served"
                except grpc.aio.AioRpcError as exc:
                    seen["global"] = exc.code().name
            seen["refused"] = str(serving.watch.stats.refused)
            return seen

    seen = asyncio.run(scenario())
    own = seen["own"]
    assert isinstance(own, NodeState)
    assert own.node == f"{ns}-node-a"
    assert seen["other"] == "PERMISSION_DENIED"
    assert seen["none"] == "UNAUTHENTICATED"
    assert seen["audience"] == "UNAUTHENTICATED"
    assert seen["global"] == "PERMISSION_DENIED"
    assert int(str(seen["refused"])) >= 4
