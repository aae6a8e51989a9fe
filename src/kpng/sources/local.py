"""``kpng local --api URL --node-name NAME <backend>...``: backends fed the node-local state of a
remote kpng (its ``to-api``), with no source or sink of this process's own: the brain runs
elsewhere. A source whose output goes to backends directly (``SourceSpec.feeds_backends``).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kpng.client import Api, watch_state
from kpng.feeding import Fanout, until_done
from kpng.remote import add_arguments, api_from_args
from kpng.sources import Runner, SourceSpec
from kpng.status import Sample, Status

if TYPE_CHECKING:
    from kpng.remote.watching import WatchRecord


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


def _create(args: argparse.Namespace, backends: Callable[[], Fanout], status: Status) -> Runner:
    api = api_from_args(args)
    from kpng.remote.watching import WATCHED  # grpc: only when a watch will run

    status.samplers.append(functools.partial(_samples, WATCHED))
    return lambda: run_remote(
        api,
        node_name=args.node_name,
        backends=backends(),
        connect_timeout=args.connect_timeout or None,  # 0: wait forever
    )


def _samples(record: WatchRecord) -> Iterator[Sample]:
    yield Sample("kpng_watch_up", "1 while the watch of the brain is live", int(record.up))
    yield Sample(
        "kpng_watch_down_seconds",
        "how long the node has been without a live watch of the brain (0 while it has one; "
        "since the start before the first state)",
        record.down_for(time.monotonic()),
    )
    for how, n in record.first_states.items():
        yield Sample(
            "kpng_watch_first_states",
            "streams of the watch by how their first change set came: whole, or resumed "
            "from what the node holds",
            n,
            counter=True,
            labels=(("how", how),),
        )
    for cause, n in sorted(record.failures.items()):
        yield Sample(
            "kpng_watch_failures",
            "streams of the watch that ended, by cause: a gRPC code, ended (by the server), "
            "wire (an unreadable message) or token (the token file)",
            n,
            counter=True,
            labels=(("cause", cause),),
        )


SPEC = SourceSpec(
    name="local",
    help="run backends against a remote kpng's node-local state (kpng local --api URL ...)",
    add_arguments=_add_arguments,
    feeds_backends=_create,
)
