"""Child processes of the benchmarks: kpng run in-process, with its garbage collections timed.

    python bench/inprocess.py phases FILE NODE [--no-gc]
        kpng's cold start in phases (imports, read, parse, store, resolve, to-json), as the file
        source, the store, to-local and to-json run them minus asyncio and the file watcher.
    python bench/inprocess.py run [--no-gc] -- KPNG-ARGS...
        ``kpng KPNG-ARGS`` itself (kpng.cli.main), timed from before its imports.

Each prints one JSON object: seconds per phase, and the seconds spent in Python's cyclic garbage
collector (timed with ``gc.callbacks``) with the number of collections per generation. ``--no-gc``
disables the collector first: what kpng would cost if the collector never ran.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class GcClock:
    """Accumulates the time the cyclic garbage collector runs (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1

    def install(self) -> GcClock:
        gc.callbacks.append(self)
        return self


class Phases:
    """Wall and GC seconds of consecutive phases."""

    def __init__(self, clock: GcClock) -> None:
        self.clock = clock
        self.report: dict[str, dict[str, float]] = {}
        self._name = ""
        self._t = self._gc = 0.0

    def start(self, name: str) -> None:
        self._name, self._t, self._gc = name, time.perf_counter(), self.clock.seconds

    def stop(self) -> None:
        self.report[self._name] = {
            "s": time.perf_counter() - self._t,
            "gc_s": self.clock.seconds - self._gc,
        }


def phases(path: Path, node: str) -> dict[str, Any]:
    phase = Phases(GcClock().install())
    phase.start("imports")
    from kpng.backends.json import JsonBackend
    from kpng.backends.registry import NodeState
    from kpng.resolver.resolving import NodeResolver
    from kpng.sinks.local import apply_delta
    from kpng.sources import manifests
    from kpng.sources.file import stage
    from kpng.store import Delta, Store

    phase.stop()

    phase.start("read")
    data = path.read_bytes()
    phase.stop()

    phase.start("parse (decode + convert)")
    parsed = manifests.parse(data, filename=str(path))
    phase.stop()
    if parsed.errors:
        raise SystemExit(f"{path}: {len(parsed.errors)} errors, first: {parsed.errors[0]}")

    store = Store()
    handle = store.source("file")
    subscription = store.subscribe()
    phase.start("store")
    for key, model in parsed.objects.items():
        stage(handle, key, model)
    handle.mark_synced()
    phase.stop()

    async def first_delta() -> Delta:
        return await anext(subscription)

    delta = asyncio.run(first_delta())
    resolver = NodeResolver(node)
    phase.start("resolve")
    apply_delta(resolver, store, delta)
    changes = resolver.resolve()
    phase.stop()

    state = NodeState(
        node=node,
        revision=delta.revision,
        services=resolver.state,
        updated=frozenset(changes.updated),
        deleted=changes.deleted,
    )
    out = io.BytesIO()
    phase.start("to-json (encode + write)")
    asyncio.run(JsonBackend(out).apply(state))
    phase.stop()
    return {
        "phases": phase.report,
        "gc_collections": phase.clock.collections,
        "services": len(resolver.state),
        "bytes_out": out.tell(),
    }


def run(args: Sequence[str]) -> dict[str, Any]:
    clock = GcClock().install()
    start = time.perf_counter()
    from kpng.cli import main

    rc = main(list(args))
    return {
        "rc": rc,
        "s": time.perf_counter() - start,
        "gc_s": clock.seconds,
        "gc_collections": clock.collections,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("phases")
    p.add_argument("file", type=Path)
    p.add_argument("node")
    p.add_argument("--no-gc", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("--no-gc", action="store_true")
    r.add_argument("kpng_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.no_gc:
        gc.disable()
    if args.command == "phases":
        report = phases(args.file, args.node)
    else:
        kpng_args = args.kpng_args[1:] if args.kpng_args[:1] == ["--"] else args.kpng_args
        report = run(kpng_args)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
