"""``to-file``: the global state written to a file (or stdout) at each revision, as a globalv1 dump.

The file is replaced atomically (written aside, then renamed), so a reader never sees half a
dump; ``kpng file --input`` reads it back.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from kpng.feeding import Fanout
from kpng.model import dumping
from kpng.sinks import Runner, SinkSpec
from kpng.status import Status
from kpng.store import Store


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def run_file(store: Store, *, output: Path, once: bool = False) -> None:
    subscription = store.subscribe()
    try:
        async for delta in subscription:
            data = dumping.dump(
                revision=delta.revision,
                services=store.services,
                slices=store.slices,
                nodes=store.nodes,
                service_cidrs=store.service_cidrs,
            )
            if str(output) == "-":
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            else:
                write_atomically(output, data)
            if once:
                return
    finally:
        subscription.close()


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, metavar="FILE", help="the dump (- for stdout)")
    parser.add_argument("--once", action="store_true", help="exit 0 after the first dump")


def _create(
    args: argparse.Namespace, store: Store, _: Callable[[], Fanout] | None, __: Status
) -> Runner:
    return lambda: run_file(store, output=Path(args.output), once=args.once)


SPEC = SinkSpec(
    name="to-file",
    help="write the global state to a file at each revision",
    add_arguments=_add_arguments,
    create=_create,
    once=lambda args: bool(args.once),
)
