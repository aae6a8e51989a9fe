"""A client for test beds: connect N times, print what answered, as one JSON line.

    python -m kpng.testing.probe tcp|udp|http HOST PORT [--count N] [--timeout S] [--hold S]
        [--source ADDRESS] [--for S] [--ports]

Each attempt (``--count`` of them, or as many as fit in ``--for`` seconds, one after the other)
is a new connection (TCP) or a new socket (UDP) sending one line, from ``--source``
if given (an address of the namespace: one client host among several); its result is the
answer (``"NAME CLIENT"``), ``"refused"``, ``"timeout"`` or ``"error: ..."``. ``--hold`` keeps
one TCP connection (or one connected UDP socket) open for S seconds, asking every 0.2 s, and
reports every answer (to see that a connection survives changes, or that a UDP socket moves:
one that fails is replaced, as a resolver replaces it); it says ``connected`` on stderr after
its first answer.
``http`` asks ``GET /healthz`` and answers ``"STATUS BODY"``.
``--ports`` (tcp, udp) asks the echo server for the source port it saw and adds the one the
probe sent from: ``"NAME CLIENT SEEN_PORT SENT_PORT"``, to tell how the port was translated.
Output: ``{"results": [...], "seconds": [...]}``.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import sys
import time
from collections.abc import Callable, Sequence


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tcp_once(
    host: str, port: int, timeout: float, source: str | None = None, *, ports: bool = False
) -> str:
    try:
        with socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        ) as sock:
            sock.sendall(b"port\n" if ports else b"hello\n")
            return _with_port(_read_line(sock), sock, ports)
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"


def http_once(host: str, port: int, timeout: float, source: str | None = None) -> str:
    try:
        with socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        ) as sock:
            sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"
    head, _, body = data.decode(errors="replace").partition("\r\n\r\n")
    status = head.split(" ", 2)[1] if head.startswith("HTTP/") else "malformed"
    return f"{status} {body}"


def _with_port(answer: str, sock: socket.socket, ports: bool) -> str:
    return f"{answer} {sock.getsockname()[1]}" if ports else answer


def _read_line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode().strip() or "closed"


def udp_once(
    host: str, port: int, timeout: float, source: str | None = None, *, ports: bool = False
) -> str:
    with socket.socket(_family(host), socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            if source:
                sock.bind((source, 0))
            sock.connect((host, port))
            sock.send(b"port\n" if ports else b"hello\n")
            return _with_port(sock.recv(4096).decode().strip(), sock, ports)
        except ConnectionRefusedError:
            return "refused"
        except TimeoutError:
            return "timeout"
        except OSError as exc:
            return f"error: {exc}"


def udp_same_source(
    host: str, port: int, count: int, timeout: float, source_port: int = 0
) -> list[str]:
    """``count`` datagrams from one socket (one conntrack entry), 0.2 s apart; from
    ``source_port``, the same entry across runs."""
    out = []
    with socket.socket(_family(host), socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if ":" in host else "0.0.0.0", source_port))
        for _ in range(count):
            out.append(_ask(sock, lambda: sock.sendto(b"hello\n", (host, port))))
            time.sleep(0.2)
    return out


def _ask(sock: socket.socket, send: Callable[[], object]) -> str:
    """One datagram sent and its answer; a datagram that gets none is ``timeout``."""
    try:
        send()
        return sock.recv(4096).decode().strip()
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return f"error: {exc}"


def hold(host: str, port: int, seconds: float, timeout: float) -> list[str]:
    out = []
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                sock.sendall(b"hello\n")
                out.append(_read_line(sock))
                if len(out) == 1:
                    # For whoever waits for the connection to stand before changing things.
                    print("connected", file=sys.stderr, flush=True)
                time.sleep(0.2)
    except OSError as exc:
        out.append(f"error: {exc}")
    return out


def hold_udp(host: str, port: int, seconds: float, timeout: float) -> list[str]:
    """One connected UDP socket (as a resolver or a metrics agent keeps one), a datagram every
    0.2 s; a datagram that gets no answer is ``timeout`` and the socket goes on. One that fails
    (``error: ...``: a proxy destroyed the socket, its endpoint gone) has the socket replaced by
    a new one, connected anew, as glibc's resolver does."""
    out: list[str] = []

    def connected() -> socket.socket:
        sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        sock.settimeout(timeout)
        sock.connect((host, port))
        return sock

    sock = connected()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            answer = _ask(sock, functools.partial(sock.send, b"hello\n"))
            out.append(answer)
            if len(out) == 1 and answer != "timeout" and not answer.startswith("error: "):
                print("connected", file=sys.stderr, flush=True)
            if answer.startswith("error: "):
                sock.close()
                sock = connected()
            time.sleep(0.2)
    finally:
        sock.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe", description=__doc__)
    parser.add_argument("proto", choices=["tcp", "udp", "udp-same-source", "http"])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("--source", default=None)
    parser.add_argument("--for", dest="duration", type=float, default=0.0)
    parser.add_argument("--ports", action="store_true")
    parser.add_argument("--source-port", type=int, default=0, help="for udp-same-source")
    args = parser.parse_args(argv)
    if args.ports and (args.proto not in ("tcp", "udp") or args.hold):
        parser.error("--ports is for tcp and udp, without --hold")
    results: list[str] = []
    seconds: list[float] = []
    if args.hold:
        held = {"tcp": hold, "udp": hold_udp}.get(args.proto)
        if held is None:
            parser.error("--hold is for tcp and udp")
        results = held(args.host, args.port, args.hold, args.timeout)
    elif args.proto == "udp-same-source":
        results = udp_same_source(args.host, args.port, args.count, args.timeout, args.source_port)
    else:
        once = {"tcp": tcp_once, "udp": udp_once, "http": http_once}[args.proto]
        if args.ports:
            once = functools.partial({"tcp": tcp_once, "udp": udp_once}[args.proto], ports=True)
        deadline = time.monotonic() + args.duration
        while len(results) < args.count if not args.duration else time.monotonic() < deadline:
            start = time.monotonic()
            results.append(once(args.host, args.port, args.timeout, args.source))
            seconds.append(round(time.monotonic() - start, 6))
    print(json.dumps({"results": results, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
