"""TCP node ports on 127.0.0.1 and ::1, proxied in kpng's process (to-nft's
``--localhost-nodeports``), as kube-proxy 1.37's nftables mode does with its alpha gate
KubeProxyNFTablesLocalhostNodePorts (KEP-6032).

A node port DNATed from loopback needs ``route_localnet``, which opens 127.0.0.0/8 to the
network (CVE-2020-8558), and cannot work for ``::1`` at all; so, as kube-proxy, one listening
socket per family and node port, on ``127.0.0.1`` or ``::1`` only (not the rest of
127.0.0.0/8), relays each connection to one of the port's endpoints, picked at random (ClientIP
affinity: every local client has the same address, so one endpoint is kept for all of them
while connections keep coming within ``timeoutSeconds``). The endpoints are those of external
traffic (the local ones under ``externalTrafficPolicy: Local``); a port with none has no
listener (connection refused). The listeners follow each applied state; a port another program
holds is warned of once and tried again at each state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kpng.backends._endpoints import EndpointValue, affinity_timeout, endpoints_by_scope
from kpng.backends._nftables.layout import Options, loopback_served
from kpng.backends._node import FAMILIES, Fam
from kpng.backends._samples import Sample
from kpng.client import ServiceEndpoints, ServiceKey

log = logging.getLogger(__name__)

LOOPBACK: Mapping[Fam, str] = {"v4": "127.0.0.1", "v6": "::1"}
CONNECT_TIMEOUT_S = 5.0
"""How long a connection to an endpoint may take before the client's is closed (kube-proxy's)."""
_CHUNK = 64 * 1024

ListenerKey = tuple[Fam, int]
"""(family, node port)."""


@dataclass(frozen=True)
class Listener:
    """What one node port's loopback listener relays to."""

    endpoints: tuple[EndpointValue, ...]
    affinity_s: int = 0
    """ClientIP affinity's timeoutSeconds; 0: none."""


def listeners(
    services: Mapping[ServiceKey, ServiceEndpoints], options: Options
) -> dict[ListenerKey, Listener]:
    """The loopback listeners ``services`` need under ``options`` (pure)."""
    families = [fam for fam in FAMILIES if loopback_served(options, fam)]
    out: dict[ListenerKey, Listener] = {}
    if not families:
        return out
    for key in sorted(services):
        se = services[key]
        service = se.service
        ips = service.IPs
        if ips is None or ips.ClusterIPs is None:
            continue
        for port in service.Ports:
            if port.Protocol != "TCP" or not 0 < port.NodePort < 65536:
                continue
            for fam in families:
                v6 = fam == "v6"
                if not ips.ClusterIPs.family(v6):
                    continue
                external = endpoints_by_scope(se.endpoints, port, v6)[1]
                if external:
                    # Two services claiming one node port: the first by name, as the map's.
                    out.setdefault(
                        (fam, port.NodePort),
                        Listener(tuple(external), affinity_timeout(service)),
                    )
    return out


class LocalhostProxy:
    """The loopback listeners of the node ports, kept as ``sync`` is told."""

    def __init__(
        self,
        *,
        addresses: Mapping[Fam, str] = LOOPBACK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._addresses = addresses
        self._clock = clock
        self._active: dict[ListenerKey, _Relay] = {}
        self._failed: set[ListenerKey] = set()
        """Listeners that could not bind, warned of once (until they bind)."""
        self._failures: dict[Fam, int] = {}
        """Failed binds by family, every attempt (kube-proxy's creation failures)."""

    @property
    def active(self) -> frozenset[ListenerKey]:
        return frozenset(self._active)

    async def sync(self, wanted: Mapping[ListenerKey, Listener]) -> None:
        for key in [k for k in self._active if k not in wanted]:
            await self._active.pop(key).close()
        self._failed &= set(wanted)
        for key, listener in wanted.items():
            relay = self._active.get(key)
            if relay is not None:
                relay.update(listener)
                continue
            fam, port = key
            relay = _Relay(listener, self._clock)
            try:
                await relay.listen(self._addresses[fam], port)
            except OSError as exc:
                self._failures[fam] = self._failures.get(fam, 0) + 1
                if key not in self._failed:
                    self._failed.add(key)
                    log.warning(
                        "node port %d does not answer on %s: %s", port, self._addresses[fam], exc
                    )
                continue
            self._failed.discard(key)
            self._active[key] = relay

    def samples(self) -> list[Sample]:
        """kube-proxy's series of its localhost node port listeners, per family: those bound
        now, and the binds that failed."""
        samples = []
        for fam, family in _FAMILY_NAMES.items():
            if fam not in self._addresses:
                continue
            labels = (("ip_family", family),)
            active = sum(1 for key in self._active if key[0] == fam)
            samples.append(Sample(LISTENERS, LISTENERS_HELP, active, labels=labels))
            failed = self._failures.get(fam, 0)
            samples.append(Sample(FAILURES, FAILURES_HELP, failed, counter=True, labels=labels))
        return samples

    async def close(self) -> None:
        await self.sync({})


_FAMILY_NAMES: dict[Fam, str] = {"v4": "IPv4", "v6": "IPv6"}
"""kube-proxy's ``ip_family`` label of each family."""
LISTENERS = "kubeproxy_nftables_localhost_nodeport_listeners"
LISTENERS_HELP = "Number of active localhost NodePort userspace proxy listeners."
FAILURES = "kubeproxy_nftables_localhost_nodeport_listener_creation_failures"
FAILURES_HELP = "Number of localhost NodePort userspace proxy listener creation failures."


class _Relay:
    """One node port's listener and its connections."""

    def __init__(self, listener: Listener, clock: Callable[[], float]) -> None:
        self._listener = listener
        self._clock = clock
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._pinned: EndpointValue | None = None
        self._pinned_at = 0.0

    async def listen(self, address: str, port: int) -> None:
        self._server = await asyncio.start_server(self._accepted, address, port)

    def update(self, listener: Listener) -> None:
        if listener.affinity_s != self._listener.affinity_s:
            self._pinned = None
        self._listener = listener

    def pick(self) -> EndpointValue:
        endpoints = self._listener.endpoints
        now = self._clock()
        timeout = self._listener.affinity_s
        pinned = self._pinned
        fresh = now - self._pinned_at <= timeout
        if timeout and pinned is not None and pinned in endpoints and fresh:
            # A sliding window, as kube-proxy's: each connection keeps the pin.
            self._pinned_at = now
            return pinned
        endpoint = random.choice(endpoints)
        if timeout:
            self._pinned, self._pinned_at = endpoint, now
        return endpoint

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._relay(reader, writer)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address, port = self.pick()
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(address, int(port)), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError) as exc:
            log.debug("node port on loopback: endpoint %s port %s: %s", address, port, exc)
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Open connections go with the listener, as kube-proxy's: their endpoint may be gone.
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the end on (half-close), as TCP would."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
