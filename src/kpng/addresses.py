"""The addresses kpng's flags name, parsed one way for every flag: gRPC servers and listeners
(``tcp://HOST:PORT``, ``unix:///PATH``) and HTTP listeners (``HOST:PORT``)."""

from __future__ import annotations

from kpng.errors import UsageError

GRPC_FORMS = "tcp://HOST:PORT or unix:///PATH"


def host_port(text: str, *, port_zero: bool = False) -> tuple[str, int] | None:
    """``HOST:PORT`` or ``[IPV6]:PORT`` as (host, port); None if it is not one. An empty host
    stays empty (every address, for a listener); port 0 only with ``port_zero``."""
    host, sep, port = text.rpartition(":")
    if not (sep and port.isdigit()) or "/" in host:
        return None
    number = int(port)
    if number > 65535 or (number == 0 and not port_zero):
        return None
    return host.removeprefix("[").removesuffix("]"), number


def check_grpc_url(text: str, *, flag: str, listening: bool = False) -> str:
    """``text`` if it names a gRPC server (``listening``: a place to serve, where port 0 picks
    a free one), else a UsageError saying what would. A server may also be given as
    ``HOST:PORT``; a listener needs its scheme."""
    scheme, sep, rest = text.partition("://")
    if sep and scheme == "unix":
        if not rest.startswith("/"):
            raise UsageError(f"{flag} {text}: a unix socket needs an absolute path")
        return text
    forms = GRPC_FORMS if listening else "tcp://HOST:PORT, HOST:PORT or unix:///PATH"
    if sep and scheme != "tcp":
        # grpc would take http://... as a DNS name and retry it forever.
        raise UsageError(f"{flag} {text}: kpng speaks gRPC, not {scheme}; expected {forms}")
    if listening and not sep:
        raise UsageError(f"{flag} {text}: expected {forms}")
    parsed = host_port(rest if sep else text, port_zero=listening)
    if parsed is None or not parsed[0]:
        raise UsageError(f"{flag} {text}: expected {forms}")
    return text
