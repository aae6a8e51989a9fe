"""Health check node ports: what a cloud load balancer asks to find nodes with local endpoints.

Each service with ``HealthCheckNodePort`` gets an HTTP server on that port answering every
request with 200 and ``{"localEndpoints": N}`` when N > 0 local endpoints are ready, else 503
(kube-proxy's contract, which load balancers rely on for eTP=Local services).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping

from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints

log = logging.getLogger(__name__)


def local_ready_endpoints(se: ServiceEndpoints) -> int:
    """Local ready endpoint addresses of the service (each address once)."""
    return len(
        {
            addr
            for ep in se.endpoints
            if ep.Local and ep.Ready and ep.IPs is not None
            for addr in (*ep.IPs.V4, *ep.IPs.V6)
        }
    )


def response(count: int) -> bytes:
    """The whole HTTP response for ``count`` local ready endpoints."""
    body = json.dumps({"localEndpoints": count}).encode()
    status = b"200 OK" if count > 0 else b"503 Service Unavailable"
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    ) + body


class HealthServers:
    """One listening server per health check node port, counts updated on every state.

    ``host`` is the address to listen on; None (the default) is every address of the node, in
    both families where it has IPv6.
    """

    def __init__(self, host: str | None = None) -> None:
        self._host = host
        self._servers: dict[int, asyncio.Server] = {}
        self._counts: dict[int, int] = {}

    async def update(self, services: Mapping[ServiceKey, ServiceEndpoints]) -> None:
        wanted: dict[int, int] = {}
        for se in services.values():
            port = se.service.HealthCheckNodePort
            if port:
                wanted[port] = wanted.get(port, 0) + local_ready_endpoints(se)
        self._counts = wanted
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
                writer.write(response(self._counts.get(port, 0)))
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
