"""Which configurations kpng reads itself (no kubernetes_asyncio import: 0.33 s and 38 MiB), and
that what it reads is what the library reads. Against a real API server:
tests/apiserver/test_kube_apiserver.py; client certificate rotation:
tests/pure/test_kube_certificates.py."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kpng.kubeclient.config import KubeConfigError, PlainSettings, _in_cluster, plain_kubeconfig

CA = "-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n"


def _kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> str:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )
    return str(path)


SERVER = {"server": "https://10.0.0.1:6443"}

# (case, cluster, user): read by the library, not by kpng
LIBRARY_CASES = [
    ("an exec plugin", SERVER, {"exec": {"command": "x", "apiVersion": "v1"}}),
    ("an auth provider", SERVER, {"auth-provider": {"name": "oidc"}}),
    ("basic auth", SERVER, {"username": "a", "password": "b"}),
    ("impersonation", SERVER, {"token": "t", "as": "someone"}),
    ("no server: the library's message", {"server": ""}, {"token": "t"}),
    ("a field kpng does not know", {**SERVER, "disable-compression": True}, {"token": "t"}),
    ("data that is not base64", {**SERVER, "certificate-authority-data": "%%"}, {"token": "t"}),
]


@pytest.mark.parametrize(
    ("cluster", "user"), [pytest.param(c, u, id=n) for n, c, u in LIBRARY_CASES]
)
def test_what_kpng_does_not_read_itself_goes_to_the_library(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any]
) -> None:
    assert plain_kubeconfig(_kubeconfig(tmp_path / "config", cluster, user), None) is None


def test_a_merged_list_and_a_missing_context_go_to_the_library(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "config", SERVER, {"token": "t"})
    assert plain_kubeconfig(f"{path}{os.pathsep}{path}", None) is None
    assert plain_kubeconfig(path, "nope") is None


def test_a_plain_kubeconfig_is_read_with_paths_relative_to_its_directory(tmp_path: Path) -> None:
    cluster = {
        **SERVER,
        "certificate-authority": "ca.crt",
        "tls-server-name": "api.internal",
        "proxy-url": "http://proxy:3128",
        "extensions": [{"name": "kind", "extension": {}}],
    }
    user = {"client-certificate": "/abs/c.crt", "client-key": "k.key", "token": "t"}
    got = plain_kubeconfig(_kubeconfig(tmp_path / "config", cluster, user), None)
    assert got == PlainSettings(
        host="https://10.0.0.1:6443",
        ssl_ca_cert=str(tmp_path / "ca.crt"),
        proxy="http://proxy:3128",
        tls_server_name="api.internal",
        cert_file="/abs/c.crt",
        key_file=str(tmp_path / "k.key"),
        token="t",
    )


def test_data_fields_become_private_files_and_insecure_skips_verification(tmp_path: Path) -> None:
    encoded = base64.b64encode(CA.encode()).decode()
    cluster = {**SERVER, "certificate-authority-data": encoded, "insecure-skip-tls-verify": True}
    got = plain_kubeconfig(_kubeconfig(tmp_path / "config", cluster, {"token": "t"}), None)
    assert got is not None
    assert got.ssl_ca_cert is not None
    assert Path(got.ssl_ca_cert).read_text() == CA
    assert Path(got.ssl_ca_cert).stat().st_mode & 0o077 == 0
    assert got.verify_ssl is False


def test_a_token_file_is_read_again_when_it_is_rotated(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("one\n")
    got = plain_kubeconfig(_kubeconfig(tmp_path / "config", SERVER, {"tokenFile": "token"}), None)
    assert got is not None
    assert asyncio.run(got.get_api_key_with_prefix("BearerToken")) == "Bearer one"
    rotated = tmp_path / "token.new"
    rotated.write_text("two\n")
    os.replace(rotated, token)
    assert asyncio.run(got.get_api_key_with_prefix("BearerToken")) == "Bearer two"
    token.unlink()  # gone: the last token stays in use
    assert asyncio.run(got.get_api_key_with_prefix("BearerToken")) == "Bearer two"


def test_a_plain_kubeconfig_is_loaded_without_importing_kubernetes_asyncio(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "config", SERVER, {"token": "t"})
    script = (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from kpng.kubeclient.config import load_connection\n"
        f"c = asyncio.run(load_connection(Path({path!r})))\n"
        "print(c.server, 'kubernetes_asyncio' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["https://10.0.0.1:6443", "False"]


def test_the_library_and_kpng_read_a_plain_kubeconfig_alike(tmp_path: Path) -> None:
    """The same file through both: the same server, TLS settings, token and client files."""
    from kubernetes_asyncio.client import Configuration
    from kubernetes_asyncio.config import load_kube_config

    cluster = {**SERVER, "certificate-authority": "ca.crt", "tls-server-name": "api.internal"}
    user = {"client-certificate": "c.crt", "client-key": "k.key", "token": "t"}
    for name in ("ca.crt", "c.crt", "k.key"):
        (tmp_path / name).write_text("x")
    path = _kubeconfig(tmp_path / "config", cluster, user)
    plain = plain_kubeconfig(path, None)
    assert plain is not None
    library = Configuration()
    asyncio.run(load_kube_config(config_file=path, client_configuration=library))
    fields = ("host", "ssl_ca_cert", "verify_ssl", "tls_server_name", "cert_file", "key_file")
    assert {f: getattr(plain, f) for f in fields} == {f: getattr(library, f) for f in fields}
    assert asyncio.run(plain.get_api_key_with_prefix("BearerToken")) == asyncio.run(
        library.get_api_key_with_prefix("BearerToken")
    )


def test_in_cluster_without_the_service_environment_is_a_clear_error() -> None:
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST and"):
        _in_cluster({})


def test_a_socks_proxy_is_a_clear_error(tmp_path: Path) -> None:
    """kubectl also takes socks5:// proxies; kpng's client does not, and says so at start rather
    than failing each request."""
    from kpng.kubeclient.config import load_connection

    cluster = {**SERVER, "proxy-url": "socks5://127.0.0.1:1080"}
    path = _kubeconfig(tmp_path / "config", cluster, {"token": "t"})
    with pytest.raises(KubeConfigError, match=r"proxy-url 'socks5://127\.0\.0\.1:1080': only http"):
        asyncio.run(load_connection(Path(path)))


@pytest.mark.parametrize("insecure", [True, False])
def test_an_insecure_kubeconfig_is_warned_about_once_naming_it(
    tmp_path: Path, insecure: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from kpng.kubeclient.config import load_connection

    cluster = {**SERVER, "insecure-skip-tls-verify": insecure}
    path = _kubeconfig(tmp_path / "config", cluster, {"token": "t"})
    asyncio.run(load_connection(Path(path)))
    warned = [
        r.getMessage() for r in caplog.records if "insecure-skip-tls-verify" in r.getMessage()
    ]
    assert len(warned) == int(insecure)
    if insecure:
        assert str(path) in warned[0]
