"""Where a kpng server is, and with which TLS files to reach it.

grpc is imported by the methods that open a channel, not with this module: programs that only
name a server (parsing ``--api``) or never connect (``kpng file ... to-local``) skip its 0.1 s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kpng.addresses import check_grpc_url
from kpng.errors import UsageError

if TYPE_CHECKING:
    import grpc


KEEPALIVE = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
"""A watch is mostly silent, so without pings a server that vanished without a word (a network
cut, a node powered off) leaves the client waiting on a dead connection for good: pinged every
10 s, a connection unanswered for 10 more is given up, and the next replica tried. (A server
that wants fewer pings, Go's default policy, says so with GOAWAY, and gRPC doubles the
interval.)"""


@dataclass(frozen=True)
class ClientTls:
    ca: Path | None = None
    """Verify the server with this CA (PEM); without it, the system's roots."""
    cert: Path | None = None
    key: Path | None = None
    """A client certificate and key, for servers that require one (mutual TLS)."""

    def credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


MAX_MESSAGE = 64 << 20
"""The largest message a watcher takes (a change set of some 100,000 services): a larger one ends
the connection (RESOURCE_EXHAUSTED), and the watcher connects again."""


@dataclass(frozen=True)
class Api:
    """Where a kpng server is: ``tcp://HOST:PORT``, ``HOST:PORT`` or ``unix:///PATH``; with
    ``fallbacks``, other servers of the same state (replicas of a brain), tried in turn when
    one fails. ``token_file``: a token sent to the server as ``authorization: Bearer``, read
    again at each connection (projected tokens rotate)."""

    url: str
    tls: ClientTls | None = None
    fallbacks: tuple[str, ...] = ()
    token_file: Path | None = None

    @classmethod
    def parse(cls, urls: str, **kwargs: Any) -> Api:
        """``URL[,URL...]``: the first, then its fallbacks."""
        first, *rest = [u.strip() for u in urls.split(",") if u.strip()] or [""]
        return cls(first, fallbacks=tuple(rest), **kwargs)

    def replicas(self) -> list[Api]:
        """This server and each fallback, as servers of their own."""
        return [self, *(dataclasses.replace(self, url=u, fallbacks=()) for u in self.fallbacks)]

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a call sends: the token, if any (read now)."""
        if self.token_file is None:
            return ()
        return (("authorization", f"Bearer {self.token_file.read_text().strip()}"),)

    @property
    def grpc_target(self) -> str:
        if self.url.startswith("unix://"):
            return f"unix:{self.url.removeprefix('unix://')}"
        return self.url.removeprefix("tcp://")

    def check(self) -> Api:
        """This address, if it names a kpng server; else a UsageError saying what would. A
        token is never sent in the clear over a network: over ``tcp://`` it needs TLS."""
        for url in (self.url, *self.fallbacks):
            check_grpc_url(url, flag="--api")
            if self.token_file is not None and self.tls is None and not url.startswith("unix://"):
                raise UsageError(
                    f"--token-file would send its token in the clear to {url}: give the "
                    "server's CA (--tls-ca) so that it goes over TLS, or use a unix:// socket"
                )
        return self

    def channel(self) -> grpc.aio.Channel:
        import grpc

        options = [("grpc.max_receive_message_length", MAX_MESSAGE), *KEEPALIVE]
        if self.tls is not None:
            return grpc.aio.secure_channel(self.grpc_target, self.tls.credentials(), options)
        return grpc.aio.insecure_channel(self.grpc_target, options)
