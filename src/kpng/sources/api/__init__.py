"""``kpng api --api TARGET``: the global state of another kpng, for relay tiers.

One kpng watches the API server and serves ``to-api``; others take its global state from the
global watch and serve their own nodes. Reconnects with backoff; while the upstream is away the
last state keeps being served, and after a reconnection only real differences reach the store.
With no first state within ``--connect-timeout`` the source says why it is not synced
(``/healthz``; a ``--once`` run fails), and keeps trying.
"""

from __future__ import annotations

import argparse
import functools
import logging

from kpng.remote import CONNECT_TIMEOUT, add_server_arguments, api_from_args, seconds
from kpng.sources import Runner, SourceSpec
from kpng.store import Store

log = logging.getLogger(__name__)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    parser.add_argument(
        "--connect-timeout",
        type=seconds,
        default=CONNECT_TIMEOUT,
        metavar="SECONDS",
        help=f"after SECONDS with no state (default {CONNECT_TIMEOUT:g}), report the source "
        "blocked and fail --once runs; it keeps trying (0: never report)",
    )


def _create(args: argparse.Namespace, store: Store, _: str | None) -> Runner:
    # Imported here: grpc and protobuf cost other commands 0.1 s to import.
    from kpng.remote.watching import NoStateError, follow, global_rpcs
    from kpng.sources.api.ops import GlobalOps

    api = api_from_args(args)
    handle = store.source("api")
    ops = GlobalOps(handle)
    batched, compatible = global_rpcs()
    watch = functools.partial(
        follow, api, batched=batched, compatible=compatible, handle=ops.handler
    )

    async def run() -> None:
        try:
            await watch(first_state_within=args.connect_timeout or None)
        except NoStateError as exc:
            log.error("%s; still trying", exc)
            handle.block(str(exc))
            await watch()

    return run


SPEC = SourceSpec(
    name="api",
    help="take the global state from another kpng's to-api (relay tiers)",
    add_arguments=_add_arguments,
    create=_create,
)
