"""``to-api``: serve the state to backends and relays over gRPC."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kpng.errors import UsageError
from kpng.feeding import Fanout
from kpng.sinks import Runner, SinkSpec
from kpng.status import Sample, Status
from kpng.store import Store

if TYPE_CHECKING:
    from kpng.server.serving import WatchStats


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        action="append",
        required=True,
        metavar="URL",
        help="tcp://HOST:PORT or unix:///PATH (repeatable)",
    )
    parser.add_argument("--tls-cert", type=Path, metavar="FILE", help="server certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE", help="server key (PEM)")
    parser.add_argument(
        "--tls-ca", type=Path, metavar="FILE", help="require client certificates signed by this CA"
    )
    parser.add_argument(
        "--socket-mode",
        type=lambda s: int(s, 8),
        default=0o600,
        metavar="OCTAL",
        help="permissions of unix sockets (default 0600: the owner only)",
    )


def _create(
    args: argparse.Namespace, store: Store, _: Callable[[], Fanout] | None, status: Status
) -> Runner:
    # Imported here: grpc and protobuf cost other commands 0.1 s to import.
    from kpng.server import serving

    listen = [serving.ListenAddress.parse(url) for url in args.listen]
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        tls = serving.TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
    elif args.tls_ca:
        raise UsageError("--tls-ca needs --tls-cert and --tls-key")

    def started(server: serving.Serving) -> None:
        status.samplers.append(functools.partial(_samples, server.watch.stats))

    return lambda: serving.serve(
        store, listen=listen, tls=tls, socket_mode=args.socket_mode, started=started
    )


def _samples(stats: WatchStats) -> Iterator[Sample]:
    for kind in ("local", "global"):
        labels = (("state", kind),)
        yield Sample(
            "kpng_api_watches",
            "watches open now, of node-local (localv1, batchv1 Watch) or global state",
            getattr(stats, f"{kind}_watches"),
            labels=labels,
        )
        yield Sample(
            "kpng_api_change_sets",
            "change sets sent to watchers",
            getattr(stats, f"{kind}_change_sets"),
            counter=True,
            labels=labels,
        )


SPEC = SinkSpec(
    name="to-api",
    help="serve the node-local and global state over gRPC (localv1, globalv1, batchv1)",
    add_arguments=_add_arguments,
    create=_create,
)
