"""Ports for tests to listen on."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port free now (another process could take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
