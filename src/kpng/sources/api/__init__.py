"""``kpng api --api TARGET``: the global state of another kpng, for relay tiers.

One kpng watches the API server and serves ``to-api``; others take its global state from the
global watch and serve their own nodes. Reconnects with backoff; while the upstream is away the
last state keeps being served, and after a reconnection only real differences reach the store.
"""

from __future__ import annotations

import argparse

from kpng.client import Api
from kpng.client._running import DEFAULT_API
from kpng.sources import Runner, SourceSpec
from kpng.store import Store


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api", default=DEFAULT_API, metavar="URL", help="the upstream kpng's to-api address"
    )


def _create(args: argparse.Namespace, store: Store, _: str | None) -> Runner:
    # Imported here: grpc and protobuf cost other commands 0.1 s to import.
    from kpng.client._remote import follow, global_rpcs
    from kpng.sources.api.ops import GlobalOps

    api = Api(args.api).check()
    ops = GlobalOps(store.source("api"))
    batched, compatible = global_rpcs()
    return lambda: follow(api, batched=batched, compatible=compatible, handle=ops.handler)


SPEC = SourceSpec(
    name="api",
    help="take the global state from another kpng's to-api (relay tiers)",
    add_arguments=_add_arguments,
    create=_create,
)
