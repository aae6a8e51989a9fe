"""Running a backend against a kpng server: flags, signals, the watches.

The gRPC side (kpng.remote.watching) is imported when a watch starts, not with the library: a
backend run in process (``kpng file ... to-local``) never needs it, and grpc and protobuf take
0.1 s to import.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from kpng.backoff import Backoff
from kpng.client._sinks import FilterReset, FullState, _maybe_await
from kpng.client._state import Handler
from kpng.errors import KpngError
from kpng.model.messages import NodeFacts
from kpng.remote import CONNECT_TIMEOUT, add_arguments, api_from_args
from kpng.remote.address import Api
from kpng.remote.sinks import NodeSink, Sink
from kpng.stopping import until_signalled


async def watch(
    sink: Sink,
    *,
    api: Api | str,
    node_name: str,
    once: bool = False,
    backoff: Backoff | None = None,
    connect_timeout: float | None = CONNECT_TIMEOUT,
) -> None:
    """Feed ``sink`` the state of ``node_name`` from a kpng server, until cancelled, until the
    sink's ``sync`` returns True, or after the first ``sync`` with ``once``.

    Reconnects with backoff; after a reconnection the sink sees only what changed meanwhile,
    and no call at all (not even ``sync``) when nothing did (docs/design/resume.md).
    Raises KpngError if no first state comes within ``connect_timeout`` seconds (None: wait).
    """
    from kpng.remote.watching import watch_local

    await watch_local(
        FilterReset(_FirstSyncOnly(sink) if once else sink),
        api=api,
        node_name=node_name,
        backoff=backoff,
        first_state_within=connect_timeout,
    )


async def watch_state(
    handler: Handler,
    *,
    api: Api | str,
    node_name: str,
    once: bool = False,
    backoff: Backoff | None = None,
    connect_timeout: float | None = CONNECT_TIMEOUT,
) -> None:
    """Call ``handler`` with the complete state of ``node_name`` after every change, until
    cancelled, until the handler returns True, or after the first state with ``once``.
    Raises KpngError if no first state comes within ``connect_timeout`` seconds (None: wait)."""
    from kpng.remote.watching import watch_local

    async def call(state: object) -> bool:
        result = handler(state)  # type: ignore[arg-type]
        if asyncio.iscoroutine(result):
            result = await result
        return once or bool(result)

    # No FilterReset: FullState compares each state with the previous one, so after a
    # reconnection the handler hears only of the services that really changed.
    full = FullState(call, node=node_name)
    await watch_local(
        full, api=api, node_name=node_name, backoff=backoff, first_state_within=connect_timeout
    )


class _FirstSyncOnly:
    """A Sink whose first ``sync`` ends the watch."""

    def __init__(self, sink: Sink) -> None:
        self.reset = sink.reset
        self.set_service = sink.set_service
        self.delete_service = sink.delete_service
        self.set_endpoint = sink.set_endpoint
        self.delete_endpoint = sink.delete_endpoint
        self._sink = sink

    def set_node(self, facts: NodeFacts) -> None:
        if isinstance(self._sink, NodeSink):
            self._sink.set_node(facts)

    async def sync(self) -> bool:
        await _maybe_await(self._sink.sync())
        return True


def run(
    backend: Handler | Sink, argv: Sequence[str] | None = None, *, description: str = ""
) -> None:
    """A backend program's main: parse the standard flags from ``argv`` (default: the command
    line), then feed ``backend`` the node state until SIGINT or SIGTERM (or the first state
    with ``--once``), which end it quietly.

    ``backend`` is a handler, called with the complete state after every change, or a Sink
    (an object with ``set_service``...), called once per change as ``watch`` does. Errors (a
    bad --api, no state within --connect-timeout) are one line on stderr and exit status 2
    (usage) or 1."""
    parser = argparse.ArgumentParser(description=description or None)
    add_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        api = api_from_args(args)
    except KpngError as exc:
        parser.error(str(exc))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    options: dict[str, Any] = {
        "api": api,
        "node_name": args.node_name,
        "once": args.once,
        "connect_timeout": args.connect_timeout or None,  # 0: wait forever
    }
    if isinstance(backend, Sink):
        coro = watch(backend, **options)
    else:
        coro = watch_state(backend, **options)
    try:
        asyncio.run(until_signalled(coro))
    except KpngError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:
        # The reader went away (`... | head`): not the program's failure. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
