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


# What `kubectl config view --raw` shows for a minikube cluster, and every other field of
# client-go's clientcmd/api/v1 types, some null as a hand-written file may leave them.
EVERY_FIELD = """\
apiVersion: v1
kind: Config
preferences: {colors: true, extensions: [{name: p, extension: {a: 1}}]}
current-context: c
extensions: [{name: top, extension: null}]
clusters:
- name: k
  cluster:
    server: https://10.0.0.1:6443
    certificate-authority: ca.crt
    tls-server-name: api.internal
    proxy-url: null
    extensions:
    - name: cluster_info
      extension: {last-update: 'Mon, 01 Jan 2024 00:00:00 UTC', provider: minikube.sigs.k8s.io}
- name: other
  cluster:
    server: https://10.0.0.2:6443
    certificate-authority-data: eA==
    insecure-skip-tls-verify: false
    disable-compression: true
-
contexts:
- name: c
  context: {cluster: k, user: u, namespace: default, extensions: [{name: e, extension: x}]}
- name: other
  context: {cluster: other, user: plugin}
users:
- name: u
  user: {token: t, tokenFile: null}
- name: plugin
  user:
    exec:
      command: aws
      args: [eks, get-token]
      env: [{name: AWS_PROFILE, value: p}]
      apiVersion: client.authentication.k8s.io/v1
      installHint: install aws
      provideClusterInfo: true
      interactiveMode: Never
    auth-provider: {name: oidc, config: {client-id: kpng, id-token: null}}
    as: someone
    as-uid: '1'
    as-groups: [a, null]
    as-user-extra: {scopes: [x]}
    username: a
    password: b
    client-certificate: c.crt
    client-certificate-data: eA==
    client-key: k.key
    client-key-data: eA==
"""


def test_a_kubeconfig_with_every_field_kubectl_knows_is_read(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(EVERY_FIELD)
    got = plain_kubeconfig(str(path), None)
    assert got == PlainSettings(
        host="https://10.0.0.1:6443",
        ssl_ca_cert=str(tmp_path / "ca.crt"),
        tls_server_name="api.internal",
        token="t",
    )
    # The other context needs the library (an exec plugin): no refusal on the way.
    assert plain_kubeconfig(str(path), "other") is None


def _edited(old: str, new: str) -> str:
    assert old in EVERY_FIELD
    return EVERY_FIELD.replace(old, new, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_edited("    server: https://10.0.0.1", "    sever: https://10.0.0.1"),
         'unknown field "clusters[0].cluster.sever" (in cluster \'k\')'),
        (_edited("tokenFile: null", "tokenfile: /t"),
         'unknown field "users[0].user.tokenfile" (in user \'u\')'),
        (_edited("namespace: default", "namspace: default"),
         'unknown field "contexts[0].context.namspace" (in context \'c\')'),
        (_edited("      args: [eks", "      arg: [eks"),
         'unknown field "users[1].user.exec.arg" (in user \'plugin\')'),
        (_edited("colors: true", "colours: true"), 'unknown field "preferences.colours"'),
        (_edited("current-context: c", "current_context: c"), 'unknown field "current_context"'),
        (_edited("current-context: c", "1: c"), 'unknown field "1"'),
        (_edited("insecure-skip-tls-verify: false", "insecure-skip-tls-verify: 'false'"),
         "field \"clusters[1].cluster.insecure-skip-tls-verify\" must be true or false, not "
         "'false' (in cluster 'other')"),
        (_edited("    server: https://10.0.0.1:6443", "    server: 6443"),
         "field \"clusters[0].cluster.server\" must be a string, not 6443 (in cluster 'k')"),
        (_edited("  user: {token: t, tokenFile: null}", "  user: [token]"),
         "field \"users[0].user\" must be a mapping, not ['token'] (in user 'u')"),
    ],
)  # fmt: skip
def test_a_field_no_kubeconfig_has_is_refused_naming_it_and_its_entry(
    tmp_path: Path, text: str, message: str
) -> None:
    """kubectl's decoder drops a misspelt field silently; kpng refuses it rather than run
    against the wrong server or without credentials."""
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(KubeConfigError) as raised:
        plain_kubeconfig(str(path), None)
    assert str(raised.value) == f"kubeconfig {path}: {message}"


def test_a_misspelt_field_is_refused_in_each_file_of_a_merged_list(tmp_path: Path) -> None:
    from kpng.kubeclient.config import load_connection

    good = _kubeconfig(tmp_path / "good", SERVER, {"token": "t"})
    bad = tmp_path / "bad"
    bad.write_text(json.dumps({"clusters": [{"name": "x", "cluster": {"sever": "https://x"}}]}))
    environ = {"KUBECONFIG": f"{good}{os.pathsep}{bad}"}
    with pytest.raises(KubeConfigError) as raised:
        asyncio.run(load_connection(environ=environ))
    assert str(raised.value) == (
        f"kubeconfig {bad}: unknown field \"clusters[0].cluster.sever\" (in cluster 'x')"
    )
