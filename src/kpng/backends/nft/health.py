"""Health check node ports: what a cloud load balancer asks to find nodes with local endpoints.

Each service with ``HealthCheckNodePort`` gets an HTTP server on that port, answering every
request as kube-proxy does, since load balancers are configured for that contract: 200 when the
service has local ready endpoints and the proxy is healthy, else 503; the JSON body
``{"service": {"namespace", "name"}, "localEndpoints": N, "serviceProxyHealthy": bool}``; and
the headers ``X-Content-Type-Options: nosniff`` and ``X-Load-Balancing-Endpoint-Weight: N``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints

log = logging.getLogger(__name__)


def local_ready_endpoints(se: ServiceEndpoints) -> int:
    """Local ready endpoint addresses of the service, in the family that has more: kube-proxy
    counts per family, so a dual-stack pod is one endpoint, not two."""
    local = [ep for ep in se.endpoints if ep.Local and ep.Ready and ep.IPs is not None]
    v4 = {addr for ep in local if ep.IPs is not None for addr in ep.IPs.V4}
    v6 = {addr for ep in local if ep.IPs is not None for addr in ep.IPs.V6}
    return max(len(v4), len(v6))


@dataclass(frozen=True)
class Answer:
    """What one health check node port says."""

    namespace: str
    name: str
    local_endpoints: int


def response(answer: Answer, *, proxy_healthy: bool) -> bytes:
    """The whole HTTP response for ``answer``."""
    body = json.dumps(
        {
            "service": {"namespace": answer.namespace, "name": answer.name},
            "localEndpoints": answer.local_endpoints,
            "serviceProxyHealthy": proxy_healthy,
        }
    ).encode()
    ok = answer.local_endpoints > 0 and proxy_healthy
    status = b"200 OK" if ok else b"503 Service Unavailable"
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"X-Content-Type-Options: nosniff\r\n"
        b"X-Load-Balancing-Endpoint-Weight: %d\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (answer.local_endpoints, len(body))
    ) + body


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
        self.proxy_healthy = proxy_healthy
        self._servers: dict[int, asyncio.Server] = {}
        self._answers: dict[int, Answer] = {}

    async def update(self, services: Mapping[ServiceKey, ServiceEndpoints]) -> None:
        wanted: dict[int, Answer] = {}
        for (namespace, name), se in services.items():
            port = se.service.HealthCheckNodePort
            if port:
                wanted[port] = Answer(namespace, name, local_ready_endpoints(se))
        self._answers = wanted
        for port in self._servers.keys() - wanted.keys():
            self._servers.pop(port).close()
        for port in wanted.keys() - self._servers.keys():
            try:
                self._servers[port] = await self._listen(port)
            except OSError as exc:
                log.warning("health check node port %d: cannot listen: %s", port, exc)

    async def _listen(self, port: int) -> asyncio.Server:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                # The request line and headers are read to be polite; every path answers alike.
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
                answer = self._answers.get(port)
                if answer is not None:
                    writer.write(response(answer, proxy_healthy=self.proxy_healthy()))
                await writer.drain()
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                pass
            finally:
                writer.close()

        if self._host is not None:
            return await asyncio.start_server(
                answer, host=self._host, port=port, reuse_address=True
            )
        # host=None is a socket per family (asyncio makes IPv6 sockets V6ONLY, so "::" alone
        # would refuse IPv4); a node without IPv6 cannot bind "::", and gets IPv4 only.
        try:
            return await asyncio.start_server(answer, host=None, port=port, reuse_address=True)
        except OSError:
            return await asyncio.start_server(answer, host="0.0.0.0", port=port, reuse_address=True)

    def ports(self) -> list[int]:
        return sorted(self._servers)

    async def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for server in self._servers.values():
            await server.wait_closed()
        self._servers.clear()
