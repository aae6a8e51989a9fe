"""Which Services claim each node port, so that two claiming one are reported whatever the source.

The API server's allocator gives each node port to one Service, but a manifest file, a Go KPNG
state file or a relay's upstream is not checked by it: two Services may then ask every node to
serve one port and protocol for both. That cannot be programmed, so it is worth a warning; the
state is still served as it is (no source can be told which Service is right). Each backend that
programs node ports keeps one deterministically: to-nft, to-iptables and to-ebpf let the Service
whose namespace/name sorts first have the port (their shared elements and rules go in that
order), and to-nft and to-ebpf warn about the element too.

Pure and incremental: a Service's claims are updated when it changes, and only node ports whose
claimants changed are checked, so a change costs what it touched.
"""

from __future__ import annotations

from typing import NamedTuple

from kpng.model.cluster import ServiceKey
from kpng.model.messages import Service

NodePort = tuple[int, str]
"""(port, protocol): what a node serves. The same number for TCP and UDP is two node ports."""


class Conflict(NamedTuple):
    """A node port and the Services claiming it, sorted: the first is the one backends serve."""

    port: int
    protocol: str
    services: tuple[ServiceKey, ...]


def claims(service: Service | None) -> frozenset[NodePort]:
    """The node ports a Service asks every node to serve."""
    if service is None:
        return frozenset()
    return frozenset((p.NodePort, p.Protocol) for p in service.Ports if p.NodePort)


class NodePortClaims:
    def __init__(self) -> None:
        self._claimants: dict[NodePort, set[ServiceKey]] = {}
        self._claims: dict[ServiceKey, frozenset[NodePort]] = {}
        self._changed: set[NodePort] = set()

    def update(self, key: ServiceKey, service: Service | None) -> None:
        """Record the Service's node ports as they now are (None: it is gone)."""
        new = claims(service)
        old = self._claims.get(key, frozenset())
        if new == old:
            return
        for port in old - new:
            owners = self._claimants[port]
            owners.discard(key)
            if not owners:
                del self._claimants[port]
            self._changed.add(port)
        for port in new - old:
            self._claimants.setdefault(port, set()).add(key)
            self._changed.add(port)
        if new:
            self._claims[key] = new
        else:
            self._claims.pop(key, None)

    def new_conflicts(self) -> list[Conflict]:
        """The node ports claimed by more than one Service whose claimants changed since the last
        call: a conflict is reported when it forms or changes, not again at each unrelated
        change of one of its Services."""
        out = []
        for port in sorted(self._changed):
            owners = self._claimants.get(port, ())
            if len(owners) > 1:
                out.append(Conflict(port[0], port[1], tuple(sorted(owners))))
        self._changed.clear()
        return out
