"""A node agent failing over between two brains: what a resumed watch costs against a whole state
(issue 42, item 1; docs/design/resume.md).

Two brains, ``kpng file --input DIR to-api --listen unix://...`` in subprocesses
(``bench_api.Server``), read the same ``synthetic.py`` cluster (10,000 services x 10 endpoints,
``--services``; split over ``--files`` List files, so a change re-reads one). Each is reached
through a ``kpng.testing.relay.Relay`` that counts every connection's bytes both ways (HTTP/2
and gRPC framing included). kpng's node agent (``kpng.client.watch``, a Sink that counts its
calls) runs in this process with both relays as its replicas, A first.

1. **Whole state**: the agent's first state from A (what every reconnection cost before
   resuming): bytes on A's relay, and seconds from the agent's start to its Sync.
2. **Unchanged fail-over**: A is stopped (SIGTERM); the agent reconnects to B and resumes. Bytes
   on B's relay for that connection, its duration (first to last byte: the brain's digests,
   the Sync, the agent's next request), B's CPU seconds across it, and the Sink's calls
   (target: none, and ≤ 1 KB).
3. **One change while away**: B's relay cuts the agent off and refuses it; one endpoint of a
   service every node sees moves (``bench_api.FileChanges``), and a raw watcher on B's own
   socket says when B has it; then the relay lets the agent back. Bytes and duration of that
   connection, B's CPU, and the Sink's calls (target: that change alone, once).

Also the agent's own cost of keeping digests: hashing a whole state's items into
``Holdings`` (``--services`` x 11 items of typical size), and the digest of it.

Missed targets are reported, not failed; the exit status is non-zero only if something crashed
or timed out.

    python bench/bench_resume.py [--services 10000] [--files 100]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import synthetic
from bench_api import (
    INITIAL_TIMEOUT_S,
    BenchError,
    ClusterFile,
    FileChanges,
    Server,
    Watcher,
    verdict,
)

from kpng.api.digests import Holdings, item_digest
from kpng.client import Api, Backoff, Endpoint, Service, watch
from kpng.testing.relay import Connection, Relay
from kpng.testing.waiting import eventually

NODE = synthetic.node_name(0)
TARGET_BYTES = 1024
STEP_TIMEOUT_S = 120.0
QUIET_S = 1.0
"""No byte for this long: the exchange is over (keepalive pings come every 10 s)."""


class Back(logging.Handler):
    """When the agent says its watch is back (kpng.remote.watching, at its first Sync after
    an outage): with nothing to apply, the one sign that a resumed watch is live again."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "is back" in record.getMessage():
            self.times.append(time.monotonic())


class CountingSink:
    """A kpng.client Sink that counts its calls, by change set."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.syncs = 0
        self._synced = asyncio.Event()

    def reset(self) -> None:
        self.calls.append("reset")

    def set_service(self, service: Service) -> None:
        self.calls.append("set_service")

    def delete_service(self, namespace: str, name: str) -> None:
        self.calls.append("delete_service")

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None:
        self.calls.append("set_endpoint")

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        self.calls.append("delete_endpoint")

    def sync(self) -> None:
        self.calls.append("sync")
        self.syncs += 1
        self._synced.set()

    async def wait_syncs(self, count: int) -> None:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            while self.syncs < count:
                self._synced.clear()
                await self._synced.wait()

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


async def _new_connection(relay: Relay, before: int) -> Connection:
    """The agent's next connection through ``relay`` once the exchange is over: a copy, as
    the connection goes on counting its keepalive pings."""
    await eventually(
        lambda: len(relay.connections) > before, "the agent's connection", within=STEP_TIMEOUT_S
    )
    await relay.quiet(QUIET_S, within=STEP_TIMEOUT_S)
    return dataclasses.replace(relay.connections[-1])


def _counted(calls: list[str]) -> str:
    if not calls:
        return "none"
    kinds = sorted(set(calls))
    return ", ".join(f"{calls.count(k)} {k}" for k in kinds)


async def _bench(services: int, files: int, workdir: Path) -> dict[str, Any]:
    print(f"generating {services} services x 10 endpoints ...", flush=True)
    cluster = ClusterFile(workdir, services, files=files)
    source = ("file", "--input", str(cluster.path))
    a = Server(source, workdir / "a.sock", workdir / "a.log")
    b = Server(source, workdir / "b.sock", workdir / "b.log")
    ra, rb = Relay(a.api), Relay(b.api)
    agent: asyncio.Task[None] | None = None
    probe_task: asyncio.Task[None] | None = None
    try:
        a.wait_listening()
        b.wait_listening()
        await ra.start(f"unix://{workdir}/ra.sock")
        await rb.start(f"unix://{workdir}/rb.sock")
        sink = CountingSink()
        back = Back()
        watching = logging.getLogger("kpng.remote.watching")
        watching.addHandler(back)
        watching.setLevel(logging.INFO)
        start = time.perf_counter()
        agent = asyncio.create_task(
            watch(
                sink,
                api=Api.parse(f"{ra.url},{rb.url}"),
                node_name=NODE,
                backoff=Backoff(initial=0.05, maximum=0.5),
                connect_timeout=INITIAL_TIMEOUT_S,
            )
        )
        await sink.wait_syncs(1)
        whole_s = time.perf_counter() - start
        whole = await _new_connection(ra, 0)
        first_calls = len(sink.take())
        print(f"whole state: {whole.total:,} bytes, {whole_s:.2f} s ({first_calls:,} calls)")

        # 2. unchanged fail-over
        cpu = b.cpu_s()
        stopping = time.monotonic()
        await asyncio.to_thread(a.stop)
        await eventually(lambda: bool(back.times), "the agent back", within=STEP_TIMEOUT_S)
        unchanged = await _new_connection(rb, 0)
        unchanged_cpu = b.cpu_s() - cpu
        unchanged_calls = sink.take()
        print(
            f"unchanged fail-over: {unchanged.total:,} bytes ({unchanged.up} up, "
            f"{unchanged.down} down), {unchanged.last - unchanged.opened:.3f} s on the "
            f"connection, {back.times[0] - stopping:.3f} s from A's SIGTERM to the agent's "
            f"Sync, "
            f"B's CPU {unchanged_cpu:.2f} s, sink calls: {_counted(unchanged_calls)}"
        )

        # 3. one change while away
        probe = Watcher(NODE)
        probe_task = asyncio.create_task(probe.run(b.api))
        await eventually(lambda: len(probe.syncs) >= 1, "B's state", within=STEP_TIMEOUT_S)
        rb.accepting = False
        rb.cut()
        await asyncio.sleep(0.5)
        changed = FileChanges(cluster, seed=1).apply()
        await eventually(lambda: len(probe.syncs) >= 2, "B's change", within=STEP_TIMEOUT_S)
        probe_task.cancel()
        await asyncio.gather(probe_task, return_exceptions=True)
        await asyncio.sleep(QUIET_S)
        cpu = b.cpu_s()
        before, syncs = len(rb.connections), sink.syncs
        reopened = time.perf_counter()
        rb.accepting = True
        await sink.wait_syncs(syncs + 1)
        delivered_s = time.perf_counter() - reopened
        one = await _new_connection(rb, before)
        one_cpu = b.cpu_s() - cpu
        one_calls = sink.take()
        print(
            f"fail-over with one change ({changed}): {one.total:,} bytes ({one.up} up, "
            f"{one.down} down), {one.last - one.opened:.3f} s on the connection, "
            f"{delivered_s:.3f} s from the relay's opening to the sink's sync, "
            f"B's CPU {one_cpu:.2f} s, sink calls: {_counted(one_calls)}"
        )
    except BaseException:
        for server in (a, b):
            print(f"{server.api}'s log (tail):\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        for task in (agent, probe_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await ra.close()
        await rb.close()
        a.stop()
        b.stop()

    # The agent's cost of digests: a whole state's items hashed as they come.
    payload = b"x" * 180  # a JSON endpoint's typical size
    items = [
        (f"ns{i // 50}/svc{i}", f"ns{i // 50}/svc{i}/10.0.{i % 250}.{j}")
        for i in range(services)
        for j in range(10)
    ]
    clock = time.perf_counter()
    holdings = Holdings()
    for service, path in items:
        holdings.set(service, path, item_digest(path, payload))
    hashed_s = time.perf_counter() - clock
    clock = time.perf_counter()
    holdings.digest()
    digest_s = time.perf_counter() - clock
    print(
        f"the agent's digests: {len(items):,} items hashed in {hashed_s:.2f} s, "
        f"the node digest of them in {digest_s * 1000:.0f} ms"
    )
    return {
        "whole": whole.total,
        "whole_s": whole_s,
        "unchanged": unchanged.total,
        "unchanged_calls": unchanged_calls,
        "one": one.total,
        "one_calls": one_calls,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--files", type=int, default=100)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        try:
            result = asyncio.run(_bench(args.services, args.files, Path(tmp)))
        except (BenchError, TimeoutError) as exc:
            print(f"bench_resume: {exc or 'timed out'}", file=sys.stderr)
            return 1
    unchanged_ok = result["unchanged"] <= TARGET_BYTES and not result["unchanged_calls"]
    one_calls = result["one_calls"]
    one_ok = one_calls.count("sync") == 1 and len(one_calls) <= 4
    print()
    print("| reconnection | bytes on the socket | vs a whole state |")
    print("|---|---|---|")
    for name, key in (
        ("whole state (before)", "whole"),
        ("unchanged", "unchanged"),
        ("one change", "one"),
    ):
        print(f"| {name} | {result[key]:,} | {result[key] / result['whole']:.4%} |")
    print()
    print(f"unchanged ≤ {TARGET_BYTES} bytes, nothing applied: {verdict(unchanged_ok)}")
    print(f"one change delivered alone, once: {verdict(one_ok)}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
