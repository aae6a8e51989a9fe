"""Which proxy reaches the API server when its kubeconfig names none: ``HTTPS_PROXY``,
``HTTP_PROXY`` and ``NO_PROXY``, read as client-go reads them (Go's ``http.ProxyFromEnvironment``,
golang.org/x/net/http/httpproxy). Pure: the caller passes the environment.

- ``HTTPS_PROXY`` (or ``https_proxy``) for an ``https://`` server, ``HTTP_PROXY`` (or
  ``http_proxy``) for ``http://``; the upper-case name wins; a proxy without a scheme is
  ``http://``.
- Never for ``localhost`` or a loopback address.
- ``NO_PROXY`` (or ``no_proxy``): comma-separated; ``*`` bypasses every proxy; an IP address or
  a CIDR bypasses the addresses it names; a name bypasses itself and its subdomains
  (``example.com``), or its subdomains only with a leading dot (``.example.com``; ``*.`` is
  the same); a ``:port`` on a name or address narrows it to that port.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from kpng.http1.client import DEFAULT_PORTS


def proxy_from_environment(server: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The proxy for ``server`` (``scheme://host[:port]``) and the variable that named it, or
    None."""
    scheme, _, rest = server.partition("://")
    host, port = _host_port(rest.split("/", 1)[0], str(DEFAULT_PORTS.get(scheme, "")))
    if host == "localhost" or _loopback(host):
        return None
    names = ("HTTPS_PROXY", "https_proxy") if scheme == "https" else ("HTTP_PROXY", "http_proxy")
    name, proxy = _first(environ, names)
    if not proxy:
        return None
    _, no_proxy = _first(environ, ("NO_PROXY", "no_proxy"))
    if _bypassed(host, port, no_proxy):
        return None
    return (proxy if "://" in proxy else f"http://{proxy}"), name


def _first(environ: Mapping[str, str], names: tuple[str, str]) -> tuple[str, str]:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return names[0], ""


def _host_port(authority: str, default: str) -> tuple[str, str]:
    """(host, port) of ``host[:port]``, ``[v6][:port]``; the host lower-case, unbracketed."""
    authority = authority.rsplit("@", 1)[-1]
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        return host.lower(), rest.removeprefix(":") or default
    if authority.count(":") == 1:
        host, _, port = authority.partition(":")
        return host.lower(), port or default
    return authority.lower(), default


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _loopback(host: str) -> bool:
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def _bypassed(host: str, port: str, no_proxy: str) -> bool:
    ip = _ip(host)
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        if "/" in entry:
            try:
                network = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                continue
            if ip is not None and ip in network:
                return True
            continue
        name, wanted = _host_port(entry, "")
        if wanted and wanted != port:
            continue
        named_ip = _ip(name)
        if named_ip is not None:
            if ip == named_ip:
                return True
            continue
        if name.startswith("*."):
            name = name[1:]
        if name.startswith("."):
            if host.endswith(name):
                return True
        elif host == name or host.endswith(f".{name}"):
            return True
    return False
