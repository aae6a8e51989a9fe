"""``to-api``: serve the state to backends and relays over gRPC."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kpng.client import Fanout
from kpng.errors import UsageError
from kpng.server import serving
from kpng.sinks import Runner, SinkSpec
from kpng.store import Store


def _create(args: argparse.Namespace, store: Store, _: Callable[[], Fanout] | None) -> Runner:
    listen = [serving.ListenAddress.parse(url) for url in args.listen]
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        tls = serving.TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)
    elif args.tls_ca:
        raise UsageError("--tls-ca needs --tls-cert and --tls-key")
    return lambda: serving.serve(store, listen=listen, tls=tls, socket_mode=args.socket_mode)


SPEC = SinkSpec(
    name="to-api",
    help="serve the node-local and global state over gRPC (localv1, globalv1, batchv1)",
    add_arguments=serving.add_arguments,
    create=_create,
)
