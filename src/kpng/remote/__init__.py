"""What a watcher of a kpng server is made of, shared by ``kpng.client``'s ``run``, ``watch``
and ``watch_state``, by ``kpng local`` and by the ``api`` source: the command-line flags here,
the gRPC watching in ``kpng.remote.watching``, imported when a watch starts (grpc and protobuf
take 0.1 s to import, which a backend fed in process never needs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kpng.remote.address import Api

DEFAULT_API = "tcp://127.0.0.1:12090"
CONNECT_TIMEOUT = 30.0
"""Seconds a client waits for its first state before it gives up (a wrong or dead --api)."""


def add_arguments(parser: argparse.ArgumentParser, *, once: bool = True) -> None:
    """The standard flags of a kpng client: the server's (``add_server_arguments``),
    --node-name, --connect-timeout, and --once unless the program has its own notion of done."""
    add_server_arguments(parser)
    parser.add_argument("--node-name", required=True, help="the node whose state to receive")
    if once:
        parser.add_argument("--once", action="store_true", help="stop after the first state")
    parser.add_argument(
        "--connect-timeout",
        type=seconds,
        default=CONNECT_TIMEOUT,
        metavar="SECONDS",
        help=f"exit 1 if no state has come SECONDS after start (default {CONNECT_TIMEOUT:g}; "
        "0: wait forever); later outages are always waited out, the last state in force",
    )


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the kpng server is and how to reach it: --api, TLS, --token-file."""
    parser.add_argument(
        "--api",
        default=DEFAULT_API,
        metavar="URL[,URL...]",
        help=f"the kpng server: tcp://HOST:PORT or unix:///PATH (default {DEFAULT_API}); "
        "several, comma-separated: replicas of one brain, each tried in turn when one fails",
    )
    parser.add_argument(
        "--tls-ca", type=Path, metavar="FILE", help="verify the server with this CA"
    )
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="client certificate")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="client key")
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help="send this token to the server (authorization: Bearer), read again at each "
        "connection: a projected ServiceAccount token, for a brain run with --token-audience",
    )


def seconds(value: str) -> float:
    """A command-line duration in seconds, 0 or more."""
    parsed = float(value)
    if parsed < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be 0 or more")
    return parsed


def api_from_args(args: argparse.Namespace) -> Api:
    """The server the flags name (a UsageError if they name none)."""
    from kpng.remote.address import Api, ClientTls

    tls = None
    if args.tls_ca or args.tls_cert or args.tls_key:
        tls = ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    return Api.parse(args.api, tls=tls, token_file=args.token_file).check()
