"""Bytes of TCP connections as the kernel counted them: ``ss -ti``'s tcp_info of each
established connection (``bytes_acked`` up, ``bytes_received`` down), so TCP payload with
every framing above it (TLS, HTTP/2, gRPC) and none below (no IP or TCP headers).

The fail-over bench (``bench/bench_failover.py``) reads its agents' connections on loopback;
the real-node central test reads each node agent's connection in that node's network namespace
(``run`` is then the node's ``exec``)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_BYTES = re.compile(r"\bbytes_(acked|received):(\d+)")
_MAPPED = "::ffff:"
"""gRPC's sockets are dual-stack: an IPv4 peer shows as [::ffff:10.0.0.1]:PORT."""


@dataclass(frozen=True)
class Connection:
    """One established TCP connection, from the end ``ss`` ran at."""

    local: str
    peer: str
    up: int
    """Bytes sent and acknowledged (tcp_info's bytes_acked; the SYN counts one)."""
    down: int
    """Bytes received (tcp_info's bytes_received)."""

    @property
    def peer_host(self) -> str:
        """The peer's address without its port, brackets or IPv4-mapped prefix."""
        host = self.peer.rsplit(":", 1)[0].strip("[]")
        return host.removeprefix(_MAPPED) if "." in host else host


def parse(output: str) -> list[Connection]:
    """Connections of ``ss -tinH state established ...``'s output: a line of counts and
    addresses (no state column: one was asked for), then an indented line of tcp_info."""
    connections: list[Connection] = []
    addresses: tuple[str, str] | None = None
    for line in output.splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "\t")):
            fields = line.split()
            if len(fields) < 4:
                raise ValueError(f"not a line of ss's connections: {line!r}")
            if addresses is not None:  # a connection without tcp_info (it closed meanwhile)
                connections.append(Connection(*addresses, up=0, down=0))
            addresses = (fields[2], fields[3])
            continue
        if addresses is None:
            raise ValueError(f"tcp_info before any connection: {line!r}")
        found = dict(_BYTES.findall(line))
        connections.append(
            Connection(
                *addresses, up=int(found.get("acked", 0)), down=int(found.get("received", 0))
            )
        )
        addresses = None
    if addresses is not None:
        connections.append(Connection(*addresses, up=0, down=0))
    return connections


def _run_here(argv: Sequence[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def established(dst: str, *, run: Callable[[Sequence[str]], str] = _run_here) -> list[Connection]:
    """Established TCP connections to ``dst`` (ss's filter: ``127.0.0.1:8080``, or ``:12090``
    for any host's port 12090), as ``run`` (this namespace's ``ss`` by default) reports them."""
    return parse(run(["ss", "-tinH", "state", "established", "dst", dst]))
