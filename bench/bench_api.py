"""The watch API (``to-api``) under load: a big initial state, one change, and fan-out.

Clusters come from ``synthetic.py`` (10 endpoints per service over 100 nodes), written as one
JSON ``kind: List`` file in a directory of its own and served by ``kpng file --input F to-api
--listen unix://...`` in a subprocess, unless said otherwise. Clients run in this process.

1. **Initial state** of 10,000 services to one client (node-000), from its connect to its
   complete state: the compatible RPC (``localv1.Sets/Watch``, one op per message, protobuf
   payloads decoded with ``kpng.api.codec``, ops counted until Sync) and the batched one
   (``kpng.batchv1.Sets/Watch`` with JSON payloads, through ``kpng.client.watch_state`` with
   once semantics). The server is synced first (a warm-up client); then the two alternate, each
   a fresh connection; median of ``--runs``. Target: batched ≤ 1 s.
2. **One EndpointSlice change → the client's sync**, at 1k, 10k and 30k services: a client
   subscribed with ``kpng.client.watch`` and a Sink whose ``sync`` notes ``time.perf_counter()``;
   each change moves one ready endpoint of a service without topology hints to a new address,
   so node-000's state always changes, and the next change waits for the sync.
   (a) **through the file**: the change is written to the input file (a new file renamed over
       it, as an editor or ``kubectl get -o json >`` would), timed from the rename: this includes
       watchfiles' notice and kpng's re-read of the whole file, which grows with the cluster; at
       most ``--changes`` changes or ``--file-budget`` seconds per size, whichever comes first.
   (b) **in process, without the file**: a ``kpng.store.Store`` and ``kpng.server.serving.serve``
       in this process, driven through a ``SourceHandle`` (one new ``Slice`` model object and a
       commit per change), timed from the commit; the client shares this process's event loop,
       so its decoding is counted too. ``--changes`` changes per size.
   Median and p99 (nearest rank) per size. Targets: median ≤ 10 ms, p99 ≤ 50 ms, flat across
   sizes (largest size's median ≤ 2x the smallest's).
3. **Fan-out**: 1,000 services x 10 endpoints over 100 nodes, plus 900 more nodes without
   endpoints, so that 1,000 watchers each follow a node of their own: raw batched streams (JSON
   payloads, op batches parsed, not decoded), multiplexed in this process's event loop, one
   connection each. One change concerns every node: a service's port moves (80 → 81), written
   to the file; timed from the rename to each watcher's Sync. p50/p99/max across watchers
   (target p99 ≤ 2 s), and the server's CPU time (``/proc/PID/stat``) during the fan-out and in
   all, and its peak RSS (``VmHWM``).

Missed targets are reported, not failed; the exit status is non-zero only if something crashed
or timed out.

    python bench/bench_api.py [--sizes 1000,10000,30000] [--changes 100] [--file-budget 90]
        [--initial-services 10000] [--runs 3] [--watchers 1000] [--only initial,change,fanout]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import ipaddress
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgspec
import synthetic
from bench_incremental import Model, model_of, stage_all
from stats import median, p99

from kpng.api import batchv1_pb2, codec, localv1_pb2
from kpng.client import Backoff, Endpoint, NodeState, Service, watch, watch_state
from kpng.model.cluster import Slice, SliceKey
from kpng.server.serving import ListenAddress, serve
from kpng.sources import manifests
from kpng.store import Store

PYTHON = sys.executable
NODE = synthetic.node_name(0)
TARGET_INITIAL_S = 1.0
TARGET_MEDIAN_MS = 10.0
TARGET_P99_MS = 50.0
FLAT_RATIO = 2.0
TARGET_FANOUT_P99_S = 2.0
SERVER_START_S = 120.0  # the server's socket appears before it has read its input
INITIAL_TIMEOUT_S = 300.0  # a first state, or a fan-out's first states
CHANGE_TIMEOUT_S = 30.0  # one change reaching the client
FANOUT_TIMEOUT_S = 120.0
_NEW_ADDRESSES = ipaddress.IPv4Network("10.255.0.0/16")  # outside the generator's pod network
_MAX_MESSAGE = 64 << 20
_OPTIONS = [("grpc.max_receive_message_length", _MAX_MESSAGE)]
_OWN_CONNECTION = [*_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
"""A watcher's channel options: a connection of its own, as a node has. Else gRPC gives every
channel of the process to one target the same connection, and the brain's 100 streams per
connection (``kpng.server.serving.STREAMS_PER_CONNECTION``) leave the 101st watcher waiting."""
_encode = msgspec.json.Encoder().encode


class BenchError(Exception):
    """Something crashed or timed out: the benchmark cannot report."""


# --- figures


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


# --- the cluster file and the server


class ClusterFile:
    """A synthetic cluster as one JSON List file, whose items can be changed one at a time.

    Items are kept encoded; a change re-encodes one item and writes the whole file anew, then
    renames it over the old one, so kpng never reads half a file. With ``files`` > 1 the items
    are split in order over that many List files in a directory (``path``), and a change
    rewrites only the file holding the item: kpng re-reads only that file.
    """

    def __init__(
        self,
        directory: Path,
        services: int,
        *,
        extra_nodes: int = 0,
        nodes: int = synthetic.NODES,
        files: int = 1,
    ) -> None:
        if files > 1:
            self.path = directory / "cluster"
            self.path.mkdir()
            self._files = [self.path / f"part-{k:04d}.json" for k in range(files)]
        else:
            self.path = directory / "cluster.json"
            self._files = [self.path]
        document = synthetic.generate(services, nodes=nodes)
        items: list[dict[str, Any]] = document["items"]
        node_items = [item for item in items if item["kind"] == "Node"]
        for i in range(nodes, nodes + extra_nodes):
            items.append(_node_copy(node_items[i % len(node_items)], synthetic.node_name(i)))
        self.items = [_encode(item) for item in items]
        self.slices = [i for i, item in enumerate(items) if item["kind"] == "EndpointSlice"]
        self.services = [i for i, item in enumerate(items) if item["kind"] == "Service"]
        self.nodes = sum(1 for item in items if item["kind"] == "Node")
        del document, items
        self._per_file = -(-len(self.items) // len(self._files))
        self._dirty = set(range(len(self._files)))
        self.write()

    def write(self) -> None:
        """Write the files whose items changed since the last write."""
        for k in sorted(self._dirty):
            chunk = self.items[k * self._per_file : (k + 1) * self._per_file]
            data = b'{"apiVersion":"v1","items":[%s],"kind":"List"}' % b",".join(chunk)
            path = self._files[k]
            tmp = path.with_name(f".{path.name}.tmp")  # hidden: kpng skips it
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self._dirty.clear()

    def item(self, i: int) -> dict[str, Any]:
        value: dict[str, Any] = msgspec.json.decode(self.items[i])
        return value

    def set_item(self, i: int, item: dict[str, Any]) -> None:
        self.items[i] = _encode(item)
        self._dirty.add(i // self._per_file)

    @property
    def size_mb(self) -> float:
        return sum(path.stat().st_size for path in self._files) / 1e6


def _node_copy(node: dict[str, Any], name: str) -> dict[str, Any]:
    copy: dict[str, Any] = msgspec.json.decode(_encode(node))
    copy["metadata"]["name"] = name
    copy["metadata"]["labels"]["kubernetes.io/hostname"] = name
    return copy


def kpng_command() -> list[str]:
    """kpng as installed beside this interpreter, else ``python -m kpng``."""
    script = Path(PYTHON).parent / "kpng"
    return [str(script)] if script.exists() else [PYTHON, "-m", "kpng"]


class KpngProcess:
    """A kpng command in a subprocess, its stderr in ``log``; stopped by SIGTERM, then killed."""

    def __init__(self, argv: Sequence[str], log: Path) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self._log_path = log
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._log)

    def log_tail(self) -> str:
        return self._log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=15)
        finally:
            self._log.close()


class Server(KpngProcess):
    """``kpng SOURCE... to-api --listen unix://SOCKET`` in a subprocess (``options`` go before
    the source: ``--metrics-address``...; ``sink_options`` after to-api's ``--listen``:
    ``--token-audience``...); under cProfile, writing ``profile`` when it stops, if given;
    ``command``, if given, instead of ``kpng`` (a wrapper that changes kpng's settings first)."""

    def __init__(
        self,
        source: Sequence[str],
        socket: Path,
        log: Path,
        *,
        options: Sequence[str] = (),
        sink_options: Sequence[str] = (),
        profile: Path | None = None,
        command: Sequence[str] | None = None,
    ) -> None:
        self.socket = socket
        self.api = f"unix://{socket}"
        command = list(command) if command is not None else kpng_command()
        if profile is not None:
            command = [PYTHON, "-m", "cProfile", "-o", str(profile), "-m", "kpng"]
        super().__init__(
            [
                *command,
                *("--log-level", "warning", *options, *source),
                *("to-api", "--listen", self.api, *sink_options),
            ],
            log,
        )
        self._clock_ticks = os.sysconf("SC_CLK_TCK")

    def wait_listening(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise BenchError(f"the server exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"the server did not listen within {SERVER_START_S:g} s")
            time.sleep(0.02)

    def cpu_s(self) -> float:
        """User + system CPU seconds so far (``/proc/PID/stat`` fields 14 and 15)."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._clock_ticks

    def peak_rss_mb(self) -> float:
        return self._status_mb("VmHWM:")

    def rss_mb(self) -> float:
        return self._status_mb("VmRSS:")

    def _status_mb(self, field: str) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024
        return math.nan


@contextlib.contextmanager
def served(cluster: ClusterFile, workdir: Path, *, profile: Path | None = None) -> Iterator[Server]:
    source = ("file", "--input", str(cluster.path))
    server = Server(source, workdir / "kpng.sock", workdir / "server.log", profile=profile)
    try:
        server.wait_listening()
        yield server
    except BaseException:
        server.stop()
        print(f"the server's log (tail):\n{server.log_tail()}", file=sys.stderr)
        raise
    finally:
        server.stop()


# --- 1. initial state


@dataclass
class Initial:
    seconds: float
    services: int
    endpoints: int
    ops: int = 0


async def initial_compatible(api: str, node: str) -> Initial:
    """localv1.Sets/Watch: one OpItem per message, protobuf payloads, decoded as they come."""
    start = time.perf_counter()
    services: dict[str, Service] = {}
    endpoints: dict[str, Endpoint] = {}
    ops = 0
    async with grpc.aio.insecure_channel(f"unix:{api.removeprefix('unix://')}", _OPTIONS) as ch:
        call = ch.stream_stream(
            "/localv1.Sets/Watch",
            request_serializer=localv1_pb2.WatchReq.SerializeToString,
            response_deserializer=localv1_pb2.OpItem.FromString,
        )()  # type: ignore[call-arg]  # aio: the call is written to, not given an iterator
        try:
            await call.write(localv1_pb2.WatchReq(NodeName=node))
            async for op in call:
                ops += 1
                kind = op.WhichOneof("Op")
                if kind == "Set":
                    ref = op.Set.Ref
                    if ref.Set == localv1_pb2.ServicesSet:
                        services[ref.Path] = codec.SERVICE.decode(op.Set.Bytes)
                    elif ref.Set == localv1_pb2.EndpointsSet:
                        endpoints[ref.Path] = codec.ENDPOINT.decode(op.Set.Bytes)
                elif kind == "Sync":
                    break
            else:
                raise BenchError("the compatible watch ended before its first Sync")
            elapsed = time.perf_counter() - start
        finally:
            call.cancel()
    return Initial(elapsed, len(services), len(endpoints), ops)


async def initial_batched(api: str, node: str) -> Initial:
    """kpng.batchv1.Sets/Watch with JSON payloads, through kpng.client.watch_state(once=True)."""
    got: list[tuple[float, NodeState]] = []

    def handler(state: NodeState) -> bool:
        got.append((time.perf_counter(), state))
        return True

    start = time.perf_counter()
    await watch_state(handler, api=api, node_name=node, once=True)
    done, state = got[0]
    endpoints = sum(len(entry.endpoints) for entry in state.services.values())
    return Initial(done - start, len(state.services), endpoints)


async def _bounded(coro: Any, seconds: float, what: str) -> Any:
    try:
        async with asyncio.timeout(seconds):
            return await coro
    except TimeoutError:
        raise BenchError(f"{what}: no answer within {seconds:g} s") from None


def bench_initial(services: int, runs: int, workdir: Path) -> dict[str, float]:
    print(f"\n== 1. initial state: {services} services x 10 endpoints to one client ({NODE})")
    cluster = ClusterFile(workdir, services)
    print(f"  {cluster.path.name}: {cluster.size_mb:.1f} MB, {cluster.nodes} nodes")
    compatible: list[Initial] = []
    batched: list[Initial] = []
    with served(cluster, workdir) as server:
        start = time.perf_counter()
        warm = asyncio.run(
            _bounded(initial_batched(server.api, NODE), INITIAL_TIMEOUT_S, "the warm-up client")
        )
        print(
            f"  server synced: a warm-up client had the state {time.perf_counter() - start:.2f} s"
            f" after the server listened ({warm.services} services, {warm.endpoints} endpoints)"
        )
        for _ in range(runs):
            gc.collect()
            compatible.append(
                asyncio.run(
                    _bounded(initial_compatible(server.api, NODE), INITIAL_TIMEOUT_S, "compatible")
                )
            )
            gc.collect()
            batched.append(
                asyncio.run(_bounded(initial_batched(server.api, NODE), INITIAL_TIMEOUT_S, "batch"))
            )
        cpu, rss = server.cpu_s(), server.peak_rss_mb()
    c = compatible[0]
    print(
        f"  compatible: {c.ops} ops, one per message (Reset, {c.services} services, "
        f"{c.endpoints} endpoints, Sync)"
    )
    b = batched[0]
    print(f"  batched:    {b.services} services, {b.endpoints} endpoints in the NodeState")
    print(f"  connect → complete state, {runs} fresh clients each (s):")
    print(f"    {'RPC':44} {'median':>7}  runs")
    rows = (
        ("localv1.Sets/Watch (protobuf, 1 op/message)", compatible),
        ("kpng.batchv1.Sets/Watch (JSON, watch_state)", batched),
    )
    for name, results in rows:
        each = ", ".join(f"{r.seconds:.3f}" for r in results)
        print(f"    {name:44} {median([r.seconds for r in results]):7.3f}  {each}")
    batched_s = median([r.seconds for r in batched])
    compatible_s = median([r.seconds for r in compatible])
    print(
        f"  batched: {batched_s:.3f} s (target ≤ {TARGET_INITIAL_S:g} s: "
        f"{verdict(batched_s <= TARGET_INITIAL_S)}); {compatible_s / batched_s:.1f}x faster than "
        "the compatible RPC"
    )
    print(f"  server: {cpu:.1f} s CPU in all, peak RSS {rss:.0f} MB")
    return {"initial_batched_s": batched_s, "initial_compatible_s": compatible_s}


# --- 2. one change


class SyncClock:
    """A kpng.client.Sink that notes when each sync arrives, and counts ops."""

    def __init__(self) -> None:
        self.syncs: list[float] = []
        self.ops = 0
        self.ops_at_sync: list[int] = []
        self._synced = asyncio.Event()

    def reset(self) -> None:
        self.ops += 1

    def set_service(self, service: Service) -> None:
        self.ops += 1

    def delete_service(self, namespace: str, name: str) -> None:
        self.ops += 1

    def set_endpoint(self, namespace: str, service: str, key: str, endpoint: Endpoint) -> None:
        self.ops += 1

    def delete_endpoint(self, namespace: str, service: str, key: str) -> None:
        self.ops += 1

    def sync(self) -> bool:
        self.syncs.append(time.perf_counter())
        self.ops_at_sync.append(self.ops)
        self._synced.set()
        return False

    def ops_of_sync(self, i: int) -> int:
        """How many ops change set ``i`` carried."""
        return self.ops_at_sync[i] - (self.ops_at_sync[i - 1] if i else 0)

    async def sync_after(self, count: int, seconds: float) -> float:
        """The time of sync number ``count + 1``, waiting at most ``seconds``."""
        async with asyncio.timeout(seconds):
            while len(self.syncs) <= count:
                self._synced.clear()
                await self._synced.wait()
        return self.syncs[count]


@dataclass
class Latencies:
    ms: list[float] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)  # ops per change set
    missed: int = 0  # changes that never reached the client in CHANGE_TIMEOUT_S
    extra_syncs: int = 0

    def summary(self) -> str:
        return (
            f"median {median(self.ms):7.2f} ms  p99 {p99(self.ms):7.2f} ms  "
            f"max {max(self.ms, default=math.nan):7.2f} ms  (n={len(self.ms)}"
            + (f", {self.missed} MISSED" if self.missed else "")
            + f"; {min(self.ops, default=0)}-{max(self.ops, default=0)} ops per change)"
        )


class FileChanges:
    """Moves one ready endpoint of a hint-less slice to a new address, in the JSON items."""

    def __init__(self, cluster: ClusterFile, seed: int) -> None:
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.addresses = iter(_NEW_ADDRESSES.hosts())

    def apply(self) -> str:
        cluster, rng = self.cluster, self.rng
        while True:
            i = cluster.slices[rng.randrange(len(cluster.slices))]
            item = cluster.item(i)
            eps = item["endpoints"]
            if any("hints" in ep for ep in eps):
                continue
            movable = [
                j
                for j, ep in enumerate(eps)
                if ep["conditions"]["ready"] and not ep["conditions"]["terminating"]
            ]
            if not movable:
                continue
            j = movable[rng.randrange(len(movable))]
            eps[j]["addresses"] = [str(next(self.addresses))]
            cluster.set_item(i, item)
            cluster.write()
            return f"{item['metadata']['namespace']}/{item['metadata']['name']}"


async def _changes_through_file(
    cluster: ClusterFile, api: str, changes: int, budget_s: float, seed: int
) -> tuple[Latencies, float, int]:
    """(latencies, first state s, ops in the first state)."""
    clock = SyncClock()
    start = time.perf_counter()
    client = asyncio.create_task(watch(clock, api=api, node_name=NODE))
    result = Latencies()
    try:
        first = await clock.sync_after(0, INITIAL_TIMEOUT_S) - start
        first_ops = clock.ops
        mover = FileChanges(cluster, seed)
        deadline = time.monotonic() + budget_s
        for _ in range(changes):
            if time.monotonic() > deadline:
                break
            seen = len(clock.syncs)
            await asyncio.to_thread(mover.apply)
            t0 = time.perf_counter()
            try:
                t1 = await clock.sync_after(seen, CHANGE_TIMEOUT_S)
            except TimeoutError:
                result.missed += 1
                continue
            result.ms.append((t1 - t0) * 1000)
            result.ops.append(clock.ops_of_sync(seen))
            await asyncio.sleep(0.05)  # a second sync for one change would show here
            result.extra_syncs += len(clock.syncs) - seen - 1
    finally:
        client.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await client
    return result, first, first_ops


def _model(cluster: ClusterFile) -> Model:
    try:
        return model_of(manifests.parse(cluster.path.read_bytes(), filename=str(cluster.path)))
    except RuntimeError as exc:
        raise BenchError(str(exc)) from None


def _model_changes(model: Model, count: int, seed: int) -> list[tuple[SliceKey, Slice]]:
    """``count`` moves of one ready endpoint of a hint-less slice, each on top of the last."""
    rng = random.Random(seed)
    keys = sorted(model.slices)
    current: dict[SliceKey, Slice] = {}
    addresses = iter(_NEW_ADDRESSES.hosts())
    changes: list[tuple[SliceKey, Slice]] = []
    while len(changes) < count:
        key = keys[rng.randrange(len(keys))]
        sl = current.get(key, model.slices[key])
        if any(ep.zone_hints or ep.node_hints for ep in sl.endpoints):
            continue
        movable = [i for i, ep in enumerate(sl.endpoints) if ep.ready and not ep.terminating]
        if not movable:
            continue
        i = movable[rng.randrange(len(movable))]
        moved = msgspec.structs.replace(sl.endpoints[i], ip=str(next(addresses)))
        new = msgspec.structs.replace(
            sl, endpoints=(*sl.endpoints[:i], moved, *sl.endpoints[i + 1 :])
        )
        current[key] = new
        changes.append((key, new))
    return changes


async def _changes_in_process(
    model: Model, socket: Path, changes: list[tuple[SliceKey, Slice]]
) -> tuple[Latencies, float]:
    """(latencies, first state s) with the store and the server in this process."""
    store = Store()
    handle = store.source("bench")
    stage_all(handle, model)
    handle.mark_synced()
    url = f"unix://{socket}"
    server = asyncio.create_task(serve(store, listen=[ListenAddress.parse(url)]))
    clock = SyncClock()
    client: asyncio.Task[None] | None = None
    result = Latencies()
    try:
        async with asyncio.timeout(SERVER_START_S):
            while not await asyncio.to_thread(socket.exists):
                if server.done():
                    server.result()
                await asyncio.sleep(0.01)
        start = time.perf_counter()
        client = asyncio.create_task(watch(clock, api=url, node_name=NODE))
        first = await clock.sync_after(0, INITIAL_TIMEOUT_S) - start
        for key, new in changes:
            seen = len(clock.syncs)
            t0 = time.perf_counter()
            handle.set_slice(key, new)
            handle.commit()
            try:
                t1 = await clock.sync_after(seen, CHANGE_TIMEOUT_S)
            except TimeoutError:
                result.missed += 1
                continue
            result.ms.append((t1 - t0) * 1000)
            result.ops.append(clock.ops_of_sync(seen))
    finally:
        for task in (client, server):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return result, first


def bench_changes(
    sizes: Sequence[int], changes: int, file_budget_s: float, workdir: Path, seed: int
) -> dict[str, float]:
    print(
        f"\n== 2. one EndpointSlice change → the client's sync ({NODE}), by cluster size; "
        f"up to {changes} changes per size"
    )
    file_results: list[tuple[int, Latencies]] = []
    store_results: list[tuple[int, Latencies]] = []
    for services in sizes:
        directory = workdir / f"changes-{services}"
        directory.mkdir()
        cluster = ClusterFile(directory, services)
        print(f"\n-- {services} services: {cluster.size_mb:.1f} MB of JSON")
        with served(cluster, directory) as server:
            via_file, first, first_ops = asyncio.run(
                _changes_through_file(cluster, server.api, changes, file_budget_s, seed)
            )
            rss = server.peak_rss_mb()
        print(f"  client's first state: {first:.2f} s after the server listened, {first_ops} ops")
        print(f"  (a) through the file (kpng re-reads {cluster.size_mb:.0f} MB each time):")
        print(f"      {via_file.summary()}; server peak RSS {rss:.0f} MB")
        if via_file.extra_syncs:
            print(f"      ({via_file.extra_syncs} extra syncs: a change seen more than once)")
        file_results.append((services, via_file))

        model = _model(cluster)
        del cluster
        gc.collect()
        moves = _model_changes(model, changes, seed)
        in_process, first = asyncio.run(
            _changes_in_process(model, directory / "inprocess.sock", moves)
        )
        del model, moves
        gc.collect()
        print(f"  (b) in process, store → to-api → client (first state {first:.2f} s):")
        print(f"      {in_process.summary()}")
        store_results.append((services, in_process))

    figures: dict[str, float] = {}
    print("\n  summary (ms)")
    print(
        f"    {'services':>8}  {'file median':>11} {'p99':>7}  {'in-process median':>17} {'p99':>7}"
    )
    for (services, f), (_, s) in zip(file_results, store_results, strict=True):
        print(
            f"    {services:8d}  {median(f.ms):11.2f} {p99(f.ms):7.2f}  "
            f"{median(s.ms):17.2f} {p99(s.ms):7.2f}"
        )
        figures[f"change_file_{services}_median_ms"] = median(f.ms)
        figures[f"change_file_{services}_p99_ms"] = p99(f.ms)
        figures[f"change_inprocess_{services}_median_ms"] = median(s.ms)
        figures[f"change_inprocess_{services}_p99_ms"] = p99(s.ms)
    for name, results in (("through the file", file_results), ("in process", store_results)):
        worst_median = max(median(r.ms) for _, r in results)
        worst_p99 = max(p99(r.ms) for _, r in results)
        ratio = median(results[-1][1].ms) / median(results[0][1].ms)
        missed = sum(r.missed for _, r in results)
        print(
            f"  {name:16}: worst median {worst_median:.2f} ms (target ≤ {TARGET_MEDIAN_MS:g} ms: "
            f"{verdict(worst_median <= TARGET_MEDIAN_MS)}); worst p99 {worst_p99:.2f} ms "
            f"(target ≤ {TARGET_P99_MS:g} ms: {verdict(worst_p99 <= TARGET_P99_MS)}); "
            f"largest/smallest median {ratio:.2f}x (flat, ≤ {FLAT_RATIO:g}x: "
            f"{verdict(ratio <= FLAT_RATIO)})" + (f"; {missed} changes MISSED" if missed else "")
        )
    return figures


# --- 3. fan-out


class Watcher:
    """One node's raw batched watch: notes when each change set's Sync arrives. Like
    kpng.client, it reconnects with backoff when the server cancels or drops the call."""

    RETRIED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    """INTERNAL too: grpc's asyncio client reports a write to a call the server has just ended
    as INTERNAL ("Internal error from Core", grpc/grpc#36066), which ended a 2,500-watcher run
    of bench_apiserver.py; kpng.client retries every code alike."""

    def __init__(self, node: str, *, packed: bool = True, follow: bool = True) -> None:
        self.node = node
        self.packed = packed
        """Ask for packing, as kpng's node agents do: a first state's base comes compressed
        (kpng.server.firststates), and is not inflated here."""
        self.follow = follow
        """Ask to be sent each change set without a request for it, as kpng's node agents do;
        off, a request asks for each."""
        self.syncs: list[float] = []
        self.bytes = 0
        self.reconnects = 0
        self.ended_by: collections.Counter[str] = collections.Counter()
        """The status codes that ended its calls, by name: why it reconnected."""
        self.synced = asyncio.Event()
        self.keep = False
        """Keep the raw batches of each change set (off for first states: they are big)."""
        self.change_sets: list[list[bytes]] = []
        self._batches: list[bytes] = []

    async def run(self, api: str) -> None:
        backoff = Backoff()
        while True:
            try:
                await self._follow(api)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in self.RETRIED:
                    raise
                self.ended_by[exc.code().name] += 1
            else:
                self.ended_by["the stream ended"] += 1
            self.reconnects += 1
            await backoff.wait()

    async def _follow(self, api: str) -> None:
        request = batchv1_pb2.WatchReq(
            NodeName=self.node, Encoding=batchv1_pb2.JSON, Packed=self.packed, Follow=self.follow
        )
        target = f"unix:{api.removeprefix('unix://')}"
        async with grpc.aio.insecure_channel(target, _OWN_CONNECTION) as channel:
            call = channel.stream_stream(
                "/kpng.batchv1.Sets/Watch",
                request_serializer=batchv1_pb2.WatchReq.SerializeToString,
                response_deserializer=_raw,
            )()  # type: ignore[call-arg]
            try:
                await call.write(request)
                followed = False
                async for data in call:
                    synced, following = self._take(data)
                    followed = followed or following
                    # Held while the watcher idles otherwise: a first state's last batch is
                    # a megabyte, times thousands of watchers.
                    del data
                    if synced and not followed:
                        await call.write(request)  # ask for the next change set
            finally:
                call.cancel()

    def _take(self, data: bytes) -> tuple[bool, bool]:
        """Note one batch: whether it ends a change set, and whether the server follows."""
        batch = batchv1_pb2.OpBatch.FromString(data)
        self.bytes += len(data)
        if self.keep:
            self._batches.append(data)
        if not batch.Ops or batch.Ops[-1].WhichOneof("Op") != "Sync":
            return False, batch.Following
        self.syncs.append(time.perf_counter())
        if self.keep:
            self.change_sets.append(self._batches)
            self._batches = []
        self.synced.set()
        return True, batch.Following


def _raw(data: bytes) -> bytes:
    return data


async def _all_synced(watchers: list[Watcher], count: int, tasks: list[asyncio.Task[None]]) -> None:
    """Until every watcher has ``count`` syncs; a watcher that fails raises."""
    for watcher in watchers:
        while len(watcher.syncs) < count:
            failed = [t for t in tasks if t.done()]
            if failed:
                failed[0].result()
                raise BenchError("a watcher ended")
            watcher.synced.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await watcher.synced.wait()


@dataclass
class Fanout:
    initial_s: float
    initial_mb: float
    initial_reconnects: int
    latencies_s: list[float]
    change_kb: float
    change_reconnects: int
    cpu_change_s: float


async def _fanout(cluster: ClusterFile, server: Server, count: int) -> Fanout:
    watchers = [Watcher(synthetic.node_name(i)) for i in range(count)]
    start = time.perf_counter()
    tasks = [asyncio.create_task(w.run(server.api)) for w in watchers]
    try:
        async with asyncio.timeout(INITIAL_TIMEOUT_S):
            await _all_synced(watchers, 1, tasks)
        initial_s = time.perf_counter() - start
        initial_bytes = sum(w.bytes for w in watchers)
        initial_reconnects = sum(w.reconnects for w in watchers)
        await asyncio.sleep(0.5)  # nothing more is in flight
        cpu_before = server.cpu_s()
        # The change every node sees: the first port of the first service moves (80 → 81).
        i = cluster.services[0]
        item = cluster.item(i)
        item["spec"]["ports"][0]["port"] += 1
        cluster.set_item(i, item)
        await asyncio.to_thread(cluster.write)
        t0 = time.perf_counter()
        async with asyncio.timeout(FANOUT_TIMEOUT_S):
            await _all_synced(watchers, 2, tasks)
        cpu_change = server.cpu_s() - cpu_before
        latencies = [w.syncs[1] - t0 for w in watchers]
        change_bytes = sum(w.bytes for w in watchers) - initial_bytes
        change_reconnects = sum(w.reconnects for w in watchers) - initial_reconnects
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Fanout(
        initial_s=initial_s,
        initial_mb=initial_bytes / 1e6,
        initial_reconnects=initial_reconnects,
        latencies_s=latencies,
        change_kb=change_bytes / 1e3,
        change_reconnects=change_reconnects,
        cpu_change_s=cpu_change,
    )


def bench_fanout(services: int, watchers: int, workdir: Path) -> dict[str, float]:
    extra = max(0, watchers - synthetic.NODES)
    print(
        f"\n== 3. fan-out: {services} services x 10 endpoints over {synthetic.NODES} nodes "
        f"(+{extra} nodes without endpoints), {watchers} node watchers (raw batched streams, "
        "JSON, one connection each) in one process"
    )
    directory = workdir / "fanout"
    directory.mkdir()
    cluster = ClusterFile(directory, services, extra_nodes=extra)
    print(f"  {cluster.path.name}: {cluster.size_mb:.1f} MB, {cluster.nodes} nodes")
    with served(cluster, directory) as server:
        try:
            result = asyncio.run(_fanout(cluster, server, watchers))
        except TimeoutError:
            raise BenchError(f"fan-out timed out:\n{server.log_tail()}") from None
        cpu_total, rss = server.cpu_s(), server.peak_rss_mb()
    lat = result.latencies_s
    p50, p99_, worst = median(lat), p99(lat), max(lat)
    print(
        f"  first states: all {watchers} watchers synced {result.initial_s:.1f} s after "
        f"connecting ({result.initial_mb:.0f} MB received in all)"
    )
    if result.initial_reconnects:
        print(
            f"    ({result.initial_reconnects} calls were cancelled by the server and retried "
            "with backoff: gRPC cancels a call the server has not accepted within 30 s)"
        )
    print(f"  one change (a service port, every node): {result.change_kb:.0f} kB to all watchers")
    print(f"    rename → each watcher's Sync: p50 {p50:.3f} s  p99 {p99_:.3f} s  max {worst:.3f} s")
    if result.change_reconnects:
        print(f"    ({result.change_reconnects} reconnections during the change)")
    met = verdict(p99_ <= TARGET_FANOUT_P99_S)
    print(f"    p99 {p99_:.3f} s (target ≤ {TARGET_FANOUT_P99_S:g} s: {met})")
    print(
        f"  server: {result.cpu_change_s:.2f} s CPU for the change (file re-read included), "
        f"{cpu_total:.1f} s CPU in all; peak RSS (VmHWM) {rss:.0f} MB"
    )
    return {
        "fanout_p50_s": p50,
        "fanout_p99_s": p99_,
        "fanout_max_s": worst,
        "fanout_cpu_change_s": result.cpu_change_s,
        "fanout_server_cpu_s": cpu_total,
        "fanout_server_peak_rss_mb": rss,
    }


# --- main


def _sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or any(not 1 <= s <= 50_000 for s in sizes):
        raise argparse.ArgumentTypeError("sizes: 1 to 50000 services each")
    return sizes


PARTS = ("initial", "change", "fanout")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--initial-services", type=int, default=10_000, help="default: 10000")
    parser.add_argument("--runs", type=int, default=3, help="initial-state runs (default: 3)")
    parser.add_argument("--sizes", type=_sizes, default=[1000, 10_000, 30_000])
    parser.add_argument("--changes", type=int, default=100, help="per size (default: 100)")
    parser.add_argument(
        "--file-budget", type=float, default=90.0, help="seconds of file changes per size"
    )
    parser.add_argument("--fanout-services", type=int, default=1000, help="default: 1000")
    parser.add_argument("--watchers", type=int, default=1000, help="default: 1000")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default=",".join(PARTS), help="comma-separated parts")
    args = parser.parse_args(argv)
    only = [p for p in args.only.split(",") if p]
    if any(p not in PARTS for p in only):
        parser.error(f"--only: {', '.join(PARTS)}")
    if not 1 <= args.runs <= 20 or not 1 <= args.changes <= 10_000:
        parser.error("--runs: 1 to 20; --changes: 1 to 10000")
    if not 1 <= args.watchers <= 5000 or not 1 <= args.initial_services <= 50_000:
        parser.error("--watchers: 1 to 5000; --initial-services: 1 to 50000")
    print("== the watch API (to-api) over a unix socket; kpng file → to-api in a subprocess")
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kpng-api-", dir="/tmp") as tmp:
            workdir = Path(tmp)  # short: a unix socket's path must fit in 108 bytes
            if "initial" in only:
                directory = workdir / "initial"
                directory.mkdir()
                bench_initial(args.initial_services, args.runs, directory)
                gc.collect()
            if "change" in only:
                bench_changes(args.sizes, args.changes, args.file_budget, workdir, args.seed)
                gc.collect()
            if "fanout" in only:
                bench_fanout(args.fanout_services, args.watchers, workdir)
    except (BenchError, TimeoutError, grpc.aio.AioRpcError) as exc:
        print(f"bench_api: {exc!r}", file=sys.stderr)
        return 1
    print(f"\n(bench_api took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
