"""Backends out of process, at 10k services: from a change in the source to the backend's
acknowledgement, and what feeding three backends costs against one.

Everything runs as ``to-local`` runs it: a ``Store`` fed the synthetic cluster
(``bench/synthetic.py``), ``kpng.sinks.local.run_local`` resolving one node, and a ``Fanout`` over
the backends. Each change is one EndpointSlice edit (``bench_incremental.make_changes``; changes
that leave the node's state alone are skipped), timed from ``set_slice(...); commit()`` to:

- **to-exec**: the program's acknowledgement. The program (Python, reading stdin) parses every
  line with ``json.loads`` and, at the end of each state, writes the revision to a unix socket
  the benchmark listens on. ``--format ops`` (one line per op) and ``--format full`` (one
  to-json line per state: the whole 10k-service state on every change).
- **to-plugin**: the plugin's answer to Apply (``PluginBackend.apply`` returned). The plugin is
  ``tests/plugin_server.py`` (Python, grpc.aio; it decodes every payload), wanting DIFFS in
  protobuf; and, when Node.js and its dependencies are there, ``examples/plugins/state-summary``
  (FULL states in JSON: the whole state on every change, parsed in JavaScript).
- **to-json x1 and x3** (to /dev/null): until every backend has applied the change, and kpng's
  CPU time per change (``time.process_time``) — the cost of feeding three backends.

    python bench/bench_plugins.py [--services 10000] [--changes 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import synthetic
from bench_incremental import Change, Model, bench_resolver, build_model, make_changes, stage_all

from kpng.backends.exec import ExecBackend
from kpng.backends.exec.formats import FORMATS
from kpng.backends.json import JsonBackend
from kpng.backends.plugin import PluginBackend
from kpng.backends.plugin.config import PluginSpec
from kpng.client import Backend, NodeState
from kpng.feeding import Fanout
from kpng.sinks.local import run_local
from kpng.store import Store

ROOT = Path(__file__).resolve().parent.parent
FIRST_TIMEOUT_S = 300.0
CHANGE_TIMEOUT_S = 60.0

# The to-exec program: parses every line, acknowledges each state's revision on a unix socket.
EXEC_PROGRAM = """
import json, socket, sys
ack = socket.socket(socket.AF_UNIX)
ack.connect(sys.argv[1])
full = sys.argv[2] == "full"
for line in sys.stdin.buffer:
    value = json.loads(line)
    if full:
        ack.sendall(b"%d\\n" % value["revision"])
    elif value["op"] == "sync":
        ack.sendall(b"%d\\n" % value["revision"])
"""


@dataclass
class Result:
    name: str
    first_s: float = math.nan
    ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)

    def row(self) -> str:
        if not self.ms:
            return f"  {self.name:42} (not run)"
        ranked = sorted(self.ms)
        p90 = ranked[math.ceil(0.9 * len(ranked)) - 1]
        cpu = f"{statistics.median(self.cpu_ms):9.2f}" if self.cpu_ms else f"{'':9}"
        return (
            f"  {self.name:42} {self.first_s:8.2f} {statistics.median(self.ms):9.2f} "
            f"{p90:9.2f} {max(self.ms):9.2f} {cpu}"
        )


class Acks:
    """Times at which something acknowledged a state, in order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[float] = asyncio.Queue()

    def note(self) -> None:
        self.queue.put_nowait(time.perf_counter())

    async def next(self, within: float) -> float:
        return await asyncio.wait_for(self.queue.get(), within)


class Acknowledging:
    """A backend that notes when the wrapped one's ``apply`` returned (it took the state)."""

    def __init__(self, backend: Backend, acks: Acks) -> None:
        self.backend = backend
        self.acks = acks

    async def apply(self, state: NodeState) -> bool:
        done = await self.backend.apply(state)
        self.acks.note()
        return done

    async def close(self) -> None:
        await self.backend.close()


async def measure(
    result: Result,
    model: Model,
    changes: Sequence[Change],
    node: str,
    backends: list[tuple[str, Backend]],
    acks: Acks,
    per_change: int = 1,
) -> None:
    """Feed the cluster, then each change; ``per_change`` acknowledgements close each one."""
    store = Store()
    handle = store.source("bench")
    fanout = Fanout(backends)
    sink = asyncio.create_task(run_local(store, node_name=node, backend=fanout))
    try:
        start = time.perf_counter()
        stage_all(handle, model)
        handle.mark_synced()
        for _ in range(per_change):
            await acks.next(FIRST_TIMEOUT_S)
        result.first_s = time.perf_counter() - start
        gc.collect()
        for change in changes:
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            handle.set_slice(change.key, change.new)
            handle.commit()
            t1 = t0
            for _ in range(per_change):
                t1 = await acks.next(CHANGE_TIMEOUT_S)
            result.ms.append((t1 - t0) * 1000)
            result.cpu_ms.append((time.process_time() - cpu0) * 1000)
    finally:
        sink.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sink
        await fanout.close()


async def bench_exec(
    form: str, model: Model, changes: Sequence[Change], node: str, tmp: Path
) -> Result:
    result = Result(f"to-exec --format {form} (Python reader)")
    acks = Acks()

    async def acked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            acks.note()
        writer.close()

    path = tmp / f"ack-{form}.sock"
    server = await asyncio.start_unix_server(acked, path=str(path))
    argv = [sys.executable, "-c", EXEC_PROGRAM, str(path), form]
    backend = ExecBackend(argv, make_format=FORMATS[form])
    try:
        await measure(result, model, changes, node, [("to-exec", backend)], acks)
    finally:
        server.close()
    result.cpu_ms = []  # kpng's share is not the program's: not comparable
    return result


async def bench_plugin(
    name: str,
    argv: list[str],
    socket: Path,
    model: Model,
    changes: Sequence[Change],
    node: str,
) -> Result:
    result = Result(name)
    acks = Acks()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(200):
            if await asyncio.to_thread(socket.exists):
                break
            await asyncio.sleep(0.05)
        plugin = PluginBackend(PluginSpec("bench", socket), timeout=CHANGE_TIMEOUT_S)
        await measure(
            result, model, changes, node, [("to-plugin", Acknowledging(plugin, acks))], acks
        )
    finally:
        proc.terminate()
        await proc.wait()
    result.cpu_ms = []
    return result


async def bench_json(count: int, model: Model, changes: Sequence[Change], node: str) -> Result:
    result = Result(f"to-json --output /dev/null x{count}")
    acks = Acks()
    with contextlib.ExitStack() as stack:
        backends: list[tuple[str, Backend]] = []
        for i in range(count):
            out = stack.enter_context(_devnull())
            backends.append((f"to-json#{i + 1}", Acknowledging(JsonBackend(out), acks)))
        await measure(result, model, changes, node, backends, acks, per_change=count)
    return result


def _devnull() -> BinaryIO:
    return open(os.devnull, "wb")  # the caller's ExitStack closes it


def _node_plugin(tmp: Path) -> list[str] | None:
    summary = ROOT / "examples" / "plugins" / "state-summary"
    if shutil.which("node") is None or not (summary / "node_modules").is_dir():
        return None
    socket = tmp / "summary.sock"
    return ["node", str(summary / "index.js"), "--socket", str(socket), "--output", os.devnull]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    node = synthetic.node_name(0)
    model, _, _ = build_model(args.services, seed=args.seed)
    candidates = make_changes(model.slices, args.changes * 4, seed=args.seed)
    _, _, visible, _ = bench_resolver(model, candidates, node)
    changes = [c for c, seen in zip(candidates, visible, strict=True) if seen][: args.changes]
    print(
        f"== {args.services} services, node {node}: {len(changes)} changes that reach it, "
        "each timed from the source's commit to the backend's acknowledgement"
    )

    async def run_all() -> list[Result]:
        results = []
        with tempfile.TemporaryDirectory(prefix="kpng-bench-plugins-") as tmp_dir:
            tmp = Path(tmp_dir)
            for form in ("ops", "full"):
                results.append(await bench_exec(form, model, changes, node, tmp))
            socket = tmp / "recorder.sock"
            recorder = [sys.executable, "-m", "tests.plugin_server", "--socket", str(socket)]
            recorder += ["--record", os.devnull, "--wants", "diffs"]
            results.append(
                await bench_plugin(
                    "to-plugin DIFFS protobuf (Python plugin)",
                    recorder,
                    socket,
                    model,
                    changes,
                    node,
                )
            )
            summary = _node_plugin(tmp)
            name = "to-plugin FULL JSON (Node.js state-summary)"
            if summary is None:
                print(f"  ({name}: node or its node_modules missing; skipped)")
            else:
                socket = Path(summary[3])
                results.append(await bench_plugin(name, summary, socket, model, changes, node))
            for count in (1, 3):
                results.append(await bench_json(count, model, changes, node))
        return results

    results = asyncio.run(run_all())
    print(
        f"\n  {'backend':42} {'first s':>8} {'median ms':>9} {'p90 ms':>9} {'max ms':>9} "
        f"{'kpng cpu ms':>9}"
    )
    for result in results:
        print(result.row())
    one, three = results[-2], results[-1]
    if one.cpu_ms and three.cpu_ms:
        latency = statistics.median(three.ms) / statistics.median(one.ms)
        cpu = statistics.median(three.cpu_ms) / statistics.median(one.cpu_ms)
        print(
            f"\n  three backends against one: latency {latency:.2f}x, kpng CPU per change "
            f"{cpu:.2f}x, first state {three.first_s / one.first_s:.2f}x"
        )
    print(f"\n(bench_plugins took {time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
