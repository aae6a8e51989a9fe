"""``to-json``: the node-local state as one JSON line per revision.

Each line is ``{"node": NAME, "revision": N, "services": [{"service": <localv1.Service>,
"endpoints": [<localv1.Endpoint>, ...]}, ...]}``, messages in protobuf's canonical JSON mapping,
services by namespace and name, endpoints by key (kpng.model.paths). Each service's JSON is
cached and re-encoded only when it changes, so a revision costs the change plus one join
(kpng.backends._jsonlines, which to-exec shares).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import BinaryIO

from kpng.backends._jsonlines import StateLines
from kpng.client import Backend, BackendSpec, NodeState, SyncReporter, register


class JsonBackend:
    def __init__(self, output: BinaryIO, *, once: bool = False, close_output: bool = False) -> None:
        self._output = output
        self._once = once
        self._close_output = close_output
        self._lines = StateLines()

    async def apply(self, state: NodeState) -> bool:
        self._output.write(self._lines.encode(state))
        self._output.flush()
        return self._once

    async def close(self) -> None:
        if self._close_output:
            self._output.close()
        else:
            with contextlib.suppress(BrokenPipeError):
                self._output.flush()


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--output", default="-", metavar="FILE", help="where to write the lines (- for stdout)"
    )
    parser.add_argument("--once", action="store_true", help="exit 0 after the first complete state")


def _create(args: argparse.Namespace, _syncs: SyncReporter) -> Backend:
    if args.output == "-":
        return JsonBackend(sys.stdout.buffer, once=args.once)
    return JsonBackend(open(args.output, "wb"), once=args.once, close_output=True)


SPEC = register(
    BackendSpec(
        name="json",
        help="write the node-local state as one JSON line per revision",
        add_arguments=_add_arguments,
        create=_create,
        once=lambda args: bool(args.once),
    )
)
