"""Which proxy reaches the API server from the environment, as client-go (Go's
httpproxy) decides: a table."""

from __future__ import annotations

import pytest

from kpng.kubeclient.proxies import proxy_from_environment

PROXY = {"HTTPS_PROXY": "proxy:3128", "HTTP_PROXY": "http://plain:3128"}
VIA = ("http://proxy:3128", "HTTPS_PROXY")


@pytest.mark.parametrize(
    ("server", "environ", "expected"),
    [
        ("https://api.example.com:6443", PROXY, VIA),
        ("http://api.example.com:8080", PROXY, ("http://plain:3128", "HTTP_PROXY")),
        ("https://api.example.com", {"https_proxy": "https://p:1"}, ("https://p:1", "https_proxy")),
        (
            "https://api.example.com",
            {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:1"},
            ("http://upper:1", "HTTPS_PROXY"),
        ),
        ("https://api.example.com", {"HTTP_PROXY": "http://plain:1"}, None),
        ("https://localhost:6443", PROXY, None),
        ("https://127.0.0.1:6443", PROXY, None),
        ("https://[::1]:6443", PROXY, None),
        ("https://api.example.com", {**PROXY, "NO_PROXY": "*"}, None),
        ("https://api.example.com", {**PROXY, "NO_PROXY": "example.com"}, None),
        ("https://example.com", {**PROXY, "NO_PROXY": "example.com"}, None),
        ("https://example.com", {**PROXY, "no_proxy": ".example.com"}, VIA),
        ("https://api.example.com", {**PROXY, "NO_PROXY": ".example.com"}, None),
        ("https://api.example.com", {**PROXY, "NO_PROXY": "*.example.com"}, None),
        ("https://badexample.com", {**PROXY, "NO_PROXY": "example.com"}, VIA),
        ("https://10.1.2.3:6443", {**PROXY, "NO_PROXY": "10.0.0.0/8"}, None),
        ("https://10.1.2.3:6443", {**PROXY, "NO_PROXY": "10.1.2.3"}, None),
        ("https://10.1.2.3:6443", {**PROXY, "NO_PROXY": "10.1.2.4, 192.168.0.0/16"}, VIA),
        ("https://[fd00::5]:6443", {**PROXY, "NO_PROXY": "fd00::/8"}, None),
        ("https://api.example.com:6443", {**PROXY, "NO_PROXY": "api.example.com:6443"}, None),
        ("https://api.example.com:6443", {**PROXY, "NO_PROXY": "api.example.com:443"}, VIA),
        ("https://api.example.com", {**PROXY, "NO_PROXY": "api.example.com:443"}, None),
        ("https://API.Example.com", {**PROXY, "NO_PROXY": "api.example.COM"}, None),
    ],
)  # fmt: skip
def test_the_environment_names_the_proxy_as_client_go_reads_it(
    server: str, environ: dict[str, str], expected: tuple[str, str] | None
) -> None:
    assert proxy_from_environment(server, environ) == expected
