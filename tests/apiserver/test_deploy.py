"""deploy/rbac.yaml against a real kube-apiserver: kpng kube runs with exactly those rights,
and they are no more than it needs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from kpng.testing.recording import KpngUnderTest
from rig import kubeapi as k
from rig.cluster import ControlPlane
from rig.kubeapi import ApiError, KubeApi
from tests.conftest import ROOT

pytestmark = pytest.mark.apiserver

RBAC = ROOT / "deploy" / "rbac.yaml"

_PATHS = {
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
}


def _apply(api: KubeApi, obj: dict[str, Any]) -> None:
    path = _PATHS[obj["kind"]].format(namespace=obj["metadata"].get("namespace", ""))
    try:
        api.request("POST", path, obj)
    except ApiError as exc:
        if exc.status != 409:  # applied by an earlier test on this control plane
            raise
        api.request("PUT", f"{path}/{obj['metadata']['name']}", obj)


def _service_account_token(api: KubeApi, namespace: str, name: str) -> str:
    """A token for the service account, from the TokenRequest API (no controllers needed)."""
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 600},
    }
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
    token: str = api.request("POST", path, request)["status"]["token"]
    return token


@pytest.fixture
def kpng_account(control_plane: ControlPlane, kube_api: KubeApi) -> str:
    """The token of deploy/rbac.yaml's service account, the file applied."""
    documents = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    assert {d["kind"] for d in documents} == set(_PATHS)
    for document in documents:
        _apply(kube_api, document)
    account = next(d for d in documents if d["kind"] == "ServiceAccount")["metadata"]
    return _service_account_token(kube_api, account["namespace"], account["name"])


def test_kpng_kube_runs_with_the_deployed_rights(
    control_plane: ControlPlane,
    kube_api: KubeApi,
    kube_namespace: str,
    kpng_account: str,
    tmp_path: Path,
) -> None:
    ns = kube_namespace
    kube_api.create(k.node(f"{ns}-node", zone="zone-a"))
    kube_api.create(k.service("web", ns))
    kube_api.create(k.endpoint_slice("web-a", ns, "web", [k.endpoint("10.8.0.1")]))
    kubeconfig = k.write_kubeconfig(
        tmp_path / "kubeconfig",
        server=control_plane.server,
        ca=control_plane.pki.ca_cert,
        user={"token": kpng_account},
    )

    async def scenario() -> None:
        async with KpngUnderTest.start(kubeconfig, node_name=f"{ns}-node", namespace=ns) as kpng:
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.8.0.1",)})
            assert kpng.store.nodes[f"{ns}-node"].Labels["topology.kubernetes.io/zone"] == "zone-a"
            await asyncio.to_thread(
                kube_api.create, k.endpoint_slice("web-b", ns, "web", [k.endpoint("10.8.0.2")])
            )
            await kpng.wait_for(lambda v: v == {f"{ns}/web": ("10.8.0.1", "10.8.0.2")})

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/secrets"),
        ("GET", "/api/v1/pods"),
        ("GET", "/api/v1/namespaces/default/services/kubernetes"),  # list and watch, no get
        ("DELETE", "/api/v1/namespaces/default/services/kubernetes"),
        ("POST", "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"),
    ],
)
def test_the_deployed_rights_are_no_more_than_kpng_needs(
    control_plane: ControlPlane, kpng_account: str, method: str, path: str
) -> None:
    api = KubeApi(control_plane.server, kpng_account, control_plane.ssl_context())
    try:
        with pytest.raises(ApiError) as refused:
            api.request(method, path, {} if method == "POST" else None)
    finally:
        api.close()
    assert refused.value.status == 403
