"""Health check node ports, for every backend that programs a node: what a cloud load balancer
asks to find nodes with local endpoints.

Each service with ``HealthCheckNodePort`` gets an HTTP server on that port, answering every
request as kube-proxy does, since load balancers are configured for that contract: 200 when the
service has local ready endpoints and the proxy is healthy, else 503; the JSON body
``{"service": {"namespace", "name"}, "localEndpoints": N, "serviceProxyHealthy": bool}``; and
the headers ``X-Content-Type-Options: nosniff`` and ``X-Load-Balancing-Endpoint-Weight: N``.
kpng.http1's server answers, with its bounds (connections, request deadlines), as it answers
``/healthz``: a load balancer's port faces the same strangers.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kpng.backends import _rtnetlink
from kpng.client import ServiceEndpoints, ServiceKey
from kpng.http1.server import Listener, Reply, Request, serve_address

log = logging.getLogger(__name__)


UNHEALTHY_AFTER_S = 60.0
"""How long the rules may stay behind the state (the kernel refusing them) before health check
node ports answer 503: kube-proxy's default (twice its 30 s sync period), so a load balancer
drains a node after as long."""


def local_ready_endpoints(se: ServiceEndpoints) -> int:
    """Local ready endpoint addresses of the service, in the family that has more: kube-proxy
    counts per family, so a dual-stack pod is one endpoint, not two."""
    local = [ep for ep in se.endpoints if ep.Local and ep.Ready and ep.IPs is not None]
    v4 = {addr for ep in local if ep.IPs is not None for addr in ep.IPs.V4}
    v6 = {addr for ep in local if ep.IPs is not None for addr in ep.IPs.V6}
    return max(len(v4), len(v6))


def listen_hosts(cidrs: Sequence[str], local: Sequence[str]) -> list[str] | None:
    """Where health check node ports listen, as kube-proxy: the node's ``local`` addresses
    inside the node-port ``cidrs`` of their family, and every address of a family given none
    (None: every address of every family)."""
    if not cidrs:
        return None
    nets = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    hosts: list[str] = []
    for version, anywhere in ((4, "0.0.0.0"), (6, "::")):
        family = [n for n in nets if n.version == version]
        if not family:
            hosts.append(anywhere)
            continue
        for text in local:
            address = ipaddress.ip_address(text)
            inside = any(address in n for n in family if n.version == address.version)
            if inside and not address.is_loopback:
                hosts.append(text)
    return hosts


async def interface_addresses() -> list[str]:
    """The addresses of this network namespace's interfaces, over rtnetlink (as to-ebpf reads
    them), not by running ``ip``."""
    return [a.address for a in _rtnetlink.addresses()]


@dataclass(frozen=True)
class Answer:
    """What one health check node port says."""

    namespace: str
    name: str
    local_endpoints: int


def response(answer: Answer, *, proxy_healthy: bool) -> Reply:
    """The answer for ``answer``."""
    body = json.dumps(
        {
            "service": {"namespace": answer.namespace, "name": answer.name},
            "localEndpoints": answer.local_endpoints,
            "serviceProxyHealthy": proxy_healthy,
        }
    )
    ok = answer.local_endpoints > 0 and proxy_healthy
    headers = {
        "X-Content-Type-Options": "nosniff",
        "X-Load-Balancing-Endpoint-Weight": str(answer.local_endpoints),
        # Load balancers check on a new connection each time: one kept open would only hold a
        # descriptor (and probes that read to the end of the stream would wait on it).
        "Connection": "close",
    }
    return Reply(200 if ok else 503, body, "application/json", headers)


class HealthServers:
    """One listening server per health check node port, counts updated on every state.

    ``host`` is the address to listen on; None (the default) is every address of the node, in
    both families where it has IPv6. ``proxy_healthy`` tells whether the backend keeps the
    node's rules up to date (the answers are 503 while it does not).
    """

    def __init__(
        self, host: str | None = None, *, proxy_healthy: Callable[[], bool] = lambda: True
    ) -> None:
        self._host = host
        self._hosts: list[str] | None = None
        self._cidrs: tuple[str, ...] | None = None
        self.proxy_healthy = proxy_healthy
        self._servers: dict[int, Listener] = {}
        self._answers: dict[int, Answer] = {}

    async def follow(self, cidrs: tuple[str, ...]) -> None:
        """Listen where node ports are served (``--nodeport-addresses``), as kube-proxy's: the
        addresses are looked up when the CIDRs change, as kube-proxy does at start."""
        if cidrs == self._cidrs:
            return
        self._cidrs = cidrs
        local: list[str] = []
        if any(ipaddress.ip_network(c, strict=False).num_addresses > 1 for c in cidrs):
            try:
                local = await interface_addresses()
            except OSError as exc:
                log.warning("health check node ports listen everywhere: %s", exc)
                self.listen_on(None)
                return
        else:  # host CIDRs (primary) name the addresses themselves
            local = [c.split("/")[0] for c in cidrs]
        self.listen_on(listen_hosts(cidrs, local))

    def listen_on(self, hosts: list[str] | None) -> None:
        """Listen on these addresses (None: every address) from the next ``update``."""
        if self._host is None and hosts != self._hosts:
            self._hosts = hosts
            for listener in self._servers.values():
                listener.close()
            self._servers.clear()

    async def update(self, services: Mapping[ServiceKey, ServiceEndpoints]) -> None:
        wanted: dict[int, Answer] = {}
        for (namespace, name), se in services.items():
            port = se.service.HealthCheckNodePort
            if port:
                wanted[port] = Answer(namespace, name, local_ready_endpoints(se))
        self._answers = wanted
        for port in self._servers.keys() - wanted.keys():
            self._servers.pop(port).close()
        if self._hosts == []:
            return  # node ports are served on no address of this node: neither are these
        for port in wanted.keys() - self._servers.keys():
            try:
                self._servers[port] = await self._listen(port)
            except OSError as exc:
                log.warning("health check node port %d: cannot listen: %s", port, exc)

    async def _listen(self, port: int) -> Listener:
        async def answer(_: Request) -> Reply:
            # Every method and path answers alike, as kube-proxy's.
            answer = self._answers.get(port)
            if answer is None:  # the service went while this request was read
                return Reply(503, "this port serves no service now\n")
            return response(answer, proxy_healthy=self.proxy_healthy())

        host = self._host if self._host is not None else self._hosts
        if host is not None:
            return await serve_address(host, port, {}, default=answer)
        # A socket per family (asyncio makes IPv6 sockets V6ONLY, so "::" alone would refuse
        # IPv4), named by address: host=None asked getaddrinfo in a thread for each port, 0.4 s
        # of a start with 250 of them. A node without IPv6 cannot bind "::", and gets IPv4 only.
        try:
            return await serve_address(["0.0.0.0", "::"], port, {}, default=answer)
        except OSError:
            return await serve_address("0.0.0.0", port, {}, default=answer)

    def ports(self) -> list[int]:
        return sorted(self._servers)

    async def close(self) -> None:
        for listener in self._servers.values():
            listener.close()
        for listener in self._servers.values():
            await listener.wait_closed()
        self._servers.clear()
