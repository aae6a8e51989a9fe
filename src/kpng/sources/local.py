"""``kpng local --api URL --node-name NAME <backend>...``: backends fed the node-local state of a
remote kpng (its ``to-api``), with no source or sink of this process's own: the brain runs
elsewhere. A source whose output goes to backends directly (``SourceSpec.feeds_backends``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kpng.client import Api, watch_state
from kpng.feeding import Fanout, until_done
from kpng.remote import add_arguments, api_from_args
from kpng.sources import Runner, SourceSpec


async def run_remote(
    api: Api, *, node_name: str, backends: Fanout, connect_timeout: float | None
) -> None:
    """Feed ``backends`` the state of ``node_name`` from a kpng server until they are done."""
    watching = watch_state(
        backends.apply, api=api, node_name=node_name, connect_timeout=connect_timeout
    )
    try:
        await until_done(backends, watching)
    finally:
        await backends.close()


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    # --once belongs to the backend (e.g. to-json --once), as with to-local.
    add_arguments(parser, once=False)


def _create(args: argparse.Namespace, backends: Callable[[], Fanout]) -> Runner:
    api = api_from_args(args)
    return lambda: run_remote(
        api,
        node_name=args.node_name,
        backends=backends(),
        connect_timeout=args.connect_timeout or None,  # 0: wait forever
    )


SPEC = SourceSpec(
    name="local",
    help="run backends against a remote kpng's node-local state (kpng local --api URL ...)",
    add_arguments=_add_arguments,
    feeds_backends=_create,
)
