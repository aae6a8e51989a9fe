"""kpng's open doors under abuse (issue 40): idle HTTP connections against a node's health port,
gRPC streams that never ask against the brain, and ten thousand authorized watches.

Every process is real: ``python -m kpng`` in a subprocess, its memory read from
``/proc/PID/status`` (VmRSS every 0.2 s, VmHWM), its CPU from ``/proc/PID/stat``; the clients run
in other processes (``multiprocessing``, spawned), so that their CPU, on a two-core machine, does
not stand in for kpng's more than it must. Traffic is on loopback and unix sockets only. Each
figure is compared with a baseline measured in the same run.

1. **health** (``--idle``, ``--wave``, ``--hold``): a node, ``kpng --healthz-address
   127.0.0.1:PORT file --input DIR to-local --node-name node-000 to-json --output /dev/null`` (the
   cheapest real node process with a health port), over a small cluster (``--services``). A
   client process opens ``--idle`` idle connections in waves of ``--wave``, each wave held
   ``--hold`` seconds and closed before the next (the health server keeps 512 per listener, the
   idle longest closed for a newcomer), while this process asks ``/healthz`` on a new connection
   every ``--interval`` seconds, as a load balancer does. Baseline: the same probes with no idle
   connections. Per phase: /healthz p50, p99 and max, failed probes; the node's RSS before, peak
   (sampled) and 5 s after the last wave.
2. **streams** (``--streams``, ``--per-connection``, ``--auth``): a brain, ``kpng file --input DIR
   to-api --listen unix://SOCK`` over the same small cluster; ``--streams`` localv1 Watch streams
   opened and never sent a request, ``--per-connection`` a connection (the server allows 100),
   from ``--clients`` processes. The server ends such a stream after 10 s (set: STREAM_END_S);
   with ``--token-audience`` it refuses one without a token from its metadata at once. Variants
   (``--auth``): ``none`` (no auth), ``anonymous`` (auth, streams without a token), ``token``
   (auth, streams with a valid token but no request). A fresh brain per variant. Per variant: the
   brain's RSS before, peak, 15 s after the server ended the last stream (connections still
   open), and 5 s after the clients closed their connections; how long the streams took to open
   and to be ended, and their status codes. ``--rounds`` repeats the streams on the same brain:
   RSS after each further round tells memory kept for reuse (flat) from a leak (growing). The
   issue's figures before the 10 s limit: 10,000 such streams took the brain from 58 to 281 MiB,
   still held 70 s later.
3. **watches** (``--watches``, ``--nodes``, ``--clients``, ``--watch-per-connection``): a brain
   with ``--token-audience``, over ``--watch-services`` services x 10 endpoints spread over
   ``--nodes`` nodes; ``--watches`` real localv1 watches (``WatchReq``, OpItems read and counted
   until the first Sync), watch i for node i mod ``--nodes`` with that node's token, spread over
   ``--clients`` processes, all started at once. A watch refused (the brain reviews at most 1,000
   new tokens at once, then 100 a second) or dropped retries after a short backoff, as kpng's
   client does. The brain's RSS before, once every watch has its first state, and 5 s after the
   clients closed; its peak RSS and CPU; the time from start to the last first state (p50, p99
   of the watches' own).

Tokens are reviewed by a fake API server on loopback in this process (HTTP, TokenReview only): it
stands for the kube-apiserver, which the bench cannot run cheaply ten thousand times over; it
answers at once, so the figures leave out a real review's latency. A token ``node:NAME`` is the
node agent's ServiceAccount (kpng's default --node-user) on node NAME; any other is unknown.

Every wait is bounded; the exit status is non-zero only if something crashed or timed out.

    python bench/bench_abuse.py [--only health,streams,watches] [--services 100]
        [--idle 10000] [--wave 1000] [--hold 1.0] [--interval 0.02] [--baseline-probes 300]
        [--streams 10000] [--per-connection 100] [--rounds 2] [--auth none,anonymous,token]
        [--watches 10000] [--nodes 1000] [--watch-services 10] [--watch-per-connection 1]
        [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http.server
import json
import math
import multiprocessing
import os
import random
import re
import resource
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import synthetic
from bench_api import BenchError, KpngProcess, Server, kpng_command
from stats import median, p99

from kpng.server.auth import NODE_NAME_EXTRA
from kpng.sinks.api import DEFAULT_NODE_USER
from kpng.testing.ports import free_port

PYTHON = sys.executable
SAMPLE_S = 0.2
START_S = 60.0  # a process started, listening and synced
PROBE_TIMEOUT_S = 5.0
CONNECT_BATCH = 50
"""Idle connections opened at once: at most the listening socket's backlog, past which a
connection waits for the kernel's SYN retry (a second) and the waves would measure that."""
STREAM_END_S = 10.0
"""The brain's ``--first-request-timeout`` here: its silent streams end this soon (kpng's default,
60 s, would make each round wait a minute for them)."""
AFTER_END_S = 15.0
AFTER_CLOSE_S = 5.0
WORKER_S = 300.0  # one step of a client process: opening, ending, first states
AUDIENCE = "kpng"
TOKEN_PREFIX = "node:"
_CHANNEL_OPTIONS = [
    # Channels of one process to one address share a connection unless told otherwise; each
    # must be a connection of its own, as each node agent's is.
    ("grpc.use_local_subchannel_pool", 1),
    # The brain's keepalive pings are answered; no client ping of its own to add load.
    ("grpc.keepalive_time_ms", 600_000),
]


# --- kpng processes and their memory


def status_mb(pid: int, field: str) -> float:
    """A ``/proc/PID/status`` field (``VmRSS``, ``VmHWM``) in MiB; NaN once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return math.nan
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return math.nan


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class Sampler:
    """VmRSS of one process every SAMPLE_S seconds, in a thread (the main thread waits on
    clients or probes)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), status_mb(self.pid, "VmRSS")))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, since: float = 0.0) -> float:
        return max((mb for t, mb in self.samples if t >= since), default=math.nan)

    def now(self) -> float:
        return status_mb(self.pid, "VmRSS")


def write_cluster(directory: Path, services: int, nodes: int) -> Path:
    directory.mkdir()
    document = synthetic.generate(services, nodes=nodes)
    (directory / "cluster.json").write_text(json.dumps(document))
    return directory


def _spawned() -> multiprocessing.context.SpawnContext:
    # Spawned, not forked: this process has grpc loaded, and grpc's core does not survive fork.
    return multiprocessing.get_context("spawn")


# --- the fake API server (TokenReview)


class _TokenReviews(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: kpng's client holds one connection
    reviews = 0  # class-wide: the handler is made anew per connection

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        token: str = body["spec"]["token"]
        type(self).reviews += 1
        status: dict[str, Any] = {"authenticated": False}
        if token.startswith(TOKEN_PREFIX):
            status = {
                "authenticated": True,
                "user": {
                    "username": DEFAULT_NODE_USER,
                    "extra": {NODE_NAME_EXTRA: [token.removeprefix(TOKEN_PREFIX)]},
                },
                "audiences": [AUDIENCE],
            }
        answer = json.dumps(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "status": status}
        ).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *_: Any) -> None:
        pass


@contextlib.contextmanager
def fake_api_server(workdir: Path) -> Iterator[Path]:
    """A TokenReview-only API server on loopback; yields a kubeconfig naming it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TokenReviews)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    kubeconfig = workdir / "review.kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "fake", "user": {"token": "bench"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                "current-context": "fake",
            }
        )
    )
    try:
        yield kubeconfig
    finally:
        server.shutdown()
        server.server_close()


def _auth_options(kubeconfig: Path) -> list[str]:
    return ["--token-audience", AUDIENCE, "--review-kubeconfig", str(kubeconfig)]


# --- figures


def _ms(values: Sequence[float]) -> str:
    if not values:
        return "no answers"
    return (
        f"p50 {median(values) * 1000:7.2f} ms  p99 {p99(values) * 1000:7.2f} ms  "
        f"max {max(values) * 1000:7.2f} ms"
    )


def _s(values: Sequence[float]) -> str:
    if not values:
        return "none"
    return f"p50 {median(values):.2f} s, p99 {p99(values):.2f} s, max {max(values):.2f} s"


# --- client processes: one pipe each, messages as dicts


class Clients:
    """Spawned client processes, each told ``go``/``close`` and answering with dicts."""

    def __init__(self, target: Callable[..., None], shares: Sequence[tuple[Any, ...]]) -> None:
        context = _spawned()
        self.pipes: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for share in shares:
            ours, theirs = context.Pipe()
            proc = context.Process(target=target, args=(*share, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.pipes.append(ours)
            self.procs.append(proc)

    def gather(self, what: str, seconds: float) -> list[dict[str, Any]]:
        """Each process's next message, which must be ``what``."""
        deadline = time.monotonic() + seconds
        answers = []
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                raise BenchError(f"client {proc.pid}: no {what!r} within {seconds:g} s")
            try:
                message: dict[str, Any] = pipe.recv()
            except EOFError:
                raise BenchError(f"client {proc.pid} exited (code {proc.exitcode})") from None
            if message.get("step") != what:
                raise BenchError(f"client {proc.pid}: {message} instead of {what!r}")
            answers.append(message)
        return answers

    def tell(self, what: str) -> None:
        for pipe in self.pipes:
            pipe.send(what)

    def stop(self) -> None:
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for pipe in self.pipes:
            pipe.close()


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (k < total % parts) for k in range(parts)]


def _raise_nofile(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


# --- 1. /healthz under idle connections


_HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
_LENGTH = re.compile(rb"(?im)^content-length:\s*(\d+)")


def probe(port: int) -> float | None:
    """Seconds from connect to /healthz's whole 200 answer, on a new connection; None if it
    failed or took longer than PROBE_TIMEOUT_S."""
    start = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as sock:
            sock.sendall(_HEALTHZ)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            found = _LENGTH.search(head)
            length = int(found[1]) if found else 0
            while len(body) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                body += chunk
    except OSError:
        return None
    if not head.startswith(b"HTTP/1.1 200"):
        return None
    return time.perf_counter() - start


@dataclass
class Probes:
    took: list[float] = field(default_factory=list)
    failed: int = 0

    def run(self, port: int, interval: float, *, count: int, until: Callable[[], bool]) -> None:
        """One probe every ``interval`` seconds, ``count`` at most, until ``until()``."""
        for _ in range(count):
            if until():
                return
            took = probe(port)
            if took is None:
                self.failed += 1
            else:
                self.took.append(took)
            time.sleep(max(0.0, interval - (took or 0.0)))


def _idle_client(port: int, total: int, wave: int, hold_s: float, pipe: Connection) -> None:
    """Client process: ``total`` idle connections, ``wave`` at a time, each wave held ``hold_s``
    seconds then closed; reports what the server did to them."""
    _raise_nofile(wave + 256)
    pipe.send({"step": "ready"})
    if pipe.recv() != "go":
        return

    async def waves() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        opened = failed = closed_by_server = 0
        open_s: list[float] = []

        async def one(socks: list[socket.socket]) -> bool:
            sock = socket.socket()
            sock.setblocking(False)
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    await loop.sock_connect(sock, ("127.0.0.1", port))
            except (OSError, TimeoutError):
                sock.close()
                return False
            socks.append(sock)
            return True

        done = 0
        while done < total:
            size = min(wave, total - done)
            socks: list[socket.socket] = []
            started = time.perf_counter()
            for start in range(0, size, CONNECT_BATCH):
                results = await asyncio.gather(
                    *(one(socks) for _ in range(start, min(start + CONNECT_BATCH, size)))
                )
                failed += results.count(False)
            open_s.append(time.perf_counter() - started)
            opened += len(socks)
            await asyncio.sleep(hold_s)
            for sock in socks:
                try:
                    closed_by_server += sock.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed_by_server += 1
                sock.close()
            done += size
        return {
            "step": "done",
            "opened": opened,
            "failed": failed,
            "closed_by_server": closed_by_server,
            "wave_open_s": open_s,
        }

    pipe.send(asyncio.run(waves()))


class Node(KpngProcess):
    """``kpng --healthz-address 127.0.0.1:PORT file --input DIR to-local ... to-json``."""

    def __init__(self, cluster: Path, port: int, log: Path) -> None:
        self.port = port
        super().__init__(
            [
                *kpng_command(),
                *("--log-level", "warning", "--healthz-address", f"127.0.0.1:{port}"),
                *("file", "--input", str(cluster)),
                *("to-local", "--node-name", synthetic.node_name(0)),
                *("to-json", "--output", os.devnull),
            ],
            log,
        )

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_S
        while probe(self.port) is None:
            if self.proc.poll() is not None:
                raise BenchError(f"the node exited {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"the node's /healthz did not answer 200 within {START_S:g} s")
            time.sleep(0.1)


def bench_health(args: argparse.Namespace, workdir: Path) -> None:
    print(
        f"\n== 1. /healthz with idle connections coming and going: {args.idle} connections in "
        f"waves of {args.wave}, each held {args.hold:g} s (the server keeps 512), a probe every "
        f"{args.interval * 1000:g} ms"
    )
    cluster = write_cluster(workdir / "health-cluster", args.services, synthetic.NODES)
    node = Node(cluster, free_port(), workdir / "node.log")
    try:
        node.wait_healthy()
        time.sleep(1.0)  # past the start's allocations
        pid = node.proc.pid
        with Sampler(pid) as sampler:
            before = sampler.now()
            baseline = Probes()
            baseline.run(node.port, args.interval, count=args.baseline_probes, until=lambda: False)
            base_peak = sampler.peak()
            clients = Clients(_idle_client, [(node.port, args.idle, args.wave, args.hold)])
            try:
                clients.gather("ready", START_S)
                abused = Probes()
                started = time.monotonic()
                clients.tell("go")
                pipe = clients.pipes[0]
                limit = int(WORKER_S / args.interval)
                abused.run(node.port, args.interval, count=limit, until=pipe.poll)
                report = clients.gather("done", WORKER_S)[0]
                took = time.monotonic() - started
            finally:
                clients.stop()
            peak = sampler.peak(since=started)
            time.sleep(AFTER_CLOSE_S)
            after = sampler.now()
        hwm = status_mb(pid, "VmHWM")
        if node.proc.poll() is not None:
            raise BenchError(f"the node exited {node.proc.returncode}:\n{node.log_tail()}")
    finally:
        node.stop()
    waves = report["wave_open_s"]
    print(
        f"  {report['opened']} idle connections opened in {took:.1f} s ({len(waves)} waves, "
        f"a wave opened in {median(waves):.2f} s median), {report['failed']} failed to connect; "
        f"{report['closed_by_server']} closed by the server before the client closed them"
    )
    print(f"  /healthz on a new connection each    {'probes':>6} {'failed':>6}")
    for name, probes in (("baseline, no idle connections", baseline), ("under waves", abused)):
        print(f"    {name:34} {len(probes.took):6d} {probes.failed:6d}  {_ms(probes.took)}")
    ratio = p99(abused.took) / p99(baseline.took) if baseline.took and abused.took else math.nan
    print(f"    p99 under waves / baseline p99: {ratio:.1f}x")
    print(
        f"  node RSS: {before:.1f} MiB before, {base_peak:.1f} peak during the baseline, "
        f"{peak:.1f} peak under waves, {after:.1f} {AFTER_CLOSE_S:g} s after the last wave "
        f"(VmHWM {hwm:.1f})"
    )


# --- 2. request-less streams


def _stream_client(
    api: str, connections: int, per_connection: int, token: str, pipe: Connection
) -> None:
    """Client process: ``connections`` x ``per_connection`` localv1 Watch streams, opened and
    never sent a request; reports when they are open, how they ended, and when it closed."""
    import grpc

    pipe.send({"step": "ready"})
    if pipe.recv() != "go":
        return

    async def run() -> None:
        target = f"unix:{api.removeprefix('unix://')}"
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        channels = [grpc.aio.insecure_channel(target, _CHANNEL_OPTIONS) for _ in range(connections)]
        calls = [
            channel.stream_stream("/localv1.Sets/Watch")(metadata=metadata)  # type: ignore[call-arg]
            for channel in channels
            for _ in range(per_connection)
        ]

        async def opened(call: Any) -> None:
            # Its headers sent: the server has the stream (or has refused it already).
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call.wait_for_connection()

        async with asyncio.timeout(WORKER_S):
            await asyncio.gather(*(opened(call) for call in calls))
        pipe.send({"step": "opened", "at": time.monotonic()})
        ends: list[float] = []

        async def ended(call: Any) -> str:
            code = await call.code()
            ends.append(time.monotonic())
            return f"{code.name}: {(await call.details() or '')[:60]}"

        async with asyncio.timeout(WORKER_S):
            codes = await asyncio.gather(*(ended(call) for call in calls))
        pipe.send({"step": "ended", "at": max(ends), "codes": dict(collections.Counter(codes))})
        await asyncio.to_thread(pipe.recv)  # "close"
        for channel in channels:
            await channel.close(None)
        pipe.send({"step": "closed", "at": time.monotonic()})

    asyncio.run(run())


@contextlib.contextmanager
def _brain(
    workdir: Path,
    cluster: Path,
    name: str,
    sink_options: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> Iterator[Server]:
    brain = Server(
        ("file", "--input", str(cluster)),
        workdir / f"{name}.sock",
        workdir / f"{name}.log",
        sink_options=("--first-request-timeout", f"{STREAM_END_S:g}", *sink_options),
        command=command,
    )
    try:
        brain.wait_listening()
        yield brain
    except BaseException:
        brain.stop()
        print(f"the brain's log (tail):\n{brain.log_tail()}", file=sys.stderr)
        raise
    finally:
        brain.stop()
    # Warnings and errors only (--log-level warning): a clean run logs nothing.
    logged = brain.log_tail().splitlines()
    if logged:
        print(f"  the brain logged (its last {min(len(logged), 5)} lines):")
        for line in logged[-5:]:
            print(f"    {line[:200]}")


def _first_state(api: str, node: str, token: str | None) -> int:
    """One localv1 watch to its first Sync (the brain synced and serving): its op count."""
    import grpc

    from kpng.api import localv1_pb2

    async def run() -> int:
        target = f"unix:{api.removeprefix('unix://')}"
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.stream_stream(
                "/localv1.Sets/Watch",
                request_serializer=localv1_pb2.WatchReq.SerializeToString,
                response_deserializer=localv1_pb2.OpItem.FromString,
            )(metadata=metadata)  # type: ignore[call-arg]
            await call.write(localv1_pb2.WatchReq(NodeName=node))
            ops = 0
            async for op in call:
                ops += 1
                if op.WhichOneof("Op") == "Sync":
                    call.cancel()
                    return ops
        raise BenchError("the first watch ended before its Sync")

    async def bounded() -> int:
        async with asyncio.timeout(START_S):
            return await run()

    return asyncio.run(bounded())


@dataclass
class StreamRound:
    variant: str
    before: float = 0.0
    peak: float = 0.0
    after_end: float = 0.0
    after_close: float = 0.0
    hwm: float = 0.0
    open_s: float = 0.0
    end_s: float = 0.0
    fds_open: int = 0
    fds_closed: int = 0
    codes: collections.Counter[str] = field(default_factory=collections.Counter)
    cpu_s: float = 0.0
    later_rounds: list[float] = field(default_factory=list)
    """RSS after each further round's close."""


def _stream_round(
    args: argparse.Namespace, workdir: Path, cluster: Path, variant: str, kubeconfig: Path
) -> StreamRound:
    result = StreamRound(variant)
    options = [] if variant == "none" else _auth_options(kubeconfig)
    node_token = f"{TOKEN_PREFIX}{synthetic.node_name(0)}"
    token = node_token if variant == "token" else ""
    connections = -(-args.streams // args.per_connection)
    with _brain(workdir, cluster, f"streams-{variant}", options) as brain:
        # A real watch first: the brain has read its input and serves.
        _first_state(brain.api, synthetic.node_name(0), None if variant == "none" else node_token)
        shares = [
            (brain.api, count, args.per_connection, token)
            for count in _split(connections, args.clients)
            if count
        ]
        _streams_once(brain, shares, result)
        # The same abuse again on the same brain: RSS that stays put was memory kept for reuse
        # (the allocator's); RSS that grows again per round would be a leak.
        for _ in range(1, args.rounds):
            again = StreamRound(variant)
            _streams_once(brain, shares, again)
            result.later_rounds.append(again.after_close)
        result.hwm = brain.peak_rss_mb()
    return result


def _streams_once(brain: Server, shares: list[tuple[Any, ...]], result: StreamRound) -> None:
    clients = Clients(_stream_client, shares)
    try:
        clients.gather("ready", START_S)
        time.sleep(2.0)  # the first watch's garbage, and the clients' start, settled
        pid = brain.proc.pid
        with Sampler(pid) as sampler:
            result.before = sampler.now()
            cpu = brain.cpu_s()
            started = time.monotonic()
            clients.tell("go")
            opened = max(m["at"] for m in clients.gather("opened", WORKER_S))
            result.fds_open = open_fds(pid)
            result.open_s = opened - started
            ended = clients.gather("ended", STREAM_END_S + WORKER_S)
            last = max(m["at"] for m in ended)
            result.end_s = last - opened
            for message in ended:
                result.codes.update(message["codes"])
            time.sleep(max(0.0, last + AFTER_END_S - time.monotonic()))
            result.after_end = sampler.now()
            result.peak = sampler.peak(since=started)
            clients.tell("close")
            clients.gather("closed", WORKER_S)
            time.sleep(AFTER_CLOSE_S)
            result.after_close = sampler.now()
            result.fds_closed = open_fds(pid)
            result.cpu_s = brain.cpu_s() - cpu
    finally:
        clients.stop()


def bench_streams(args: argparse.Namespace, workdir: Path, kubeconfig: Path) -> None:
    connections = -(-args.streams // args.per_connection)
    print(
        f"\n== 2. {connections * args.per_connection} request-less localv1 Watch streams, "
        f"{args.per_connection} on each of {connections} connections, from {args.clients} "
        f"processes; the brain serves {args.services} services"
    )
    cluster = write_cluster(workdir / "streams-cluster", args.services, synthetic.NODES)
    rounds = []
    for variant in args.auth:
        result = _stream_round(args, workdir, cluster, variant, kubeconfig)
        rounds.append(result)
        print(
            f"  {variant:9}: opened in {result.open_s:.1f} s ({result.fds_open} brain fds), all "
            f"ended {result.end_s:.1f} s after ({dict(result.codes)}); brain RSS "
            f"{result.before:.1f} MiB before, peak {result.peak:.1f}, {result.after_end:.1f} "
            f"{AFTER_END_S:g} s after the last end, {result.after_close:.1f} {AFTER_CLOSE_S:g} s "
            f"after the clients closed ({result.fds_closed} fds open) (VmHWM {result.hwm:.1f}); "
            f"brain CPU {result.cpu_s:.1f} s"
        )
    print(f"  {'variant':9} {'before':>7} {'peak':>7} {'+15 s':>7} {'closed':>7}  MiB (RSS)")
    for r in rounds:
        print(
            f"  {r.variant:9} {r.before:7.1f} {r.peak:7.1f} {r.after_end:7.1f} "
            f"{r.after_close:7.1f}  held after the end: {r.after_end - r.before:+.1f} MiB; "
            f"after rounds 2..: {', '.join(f'{mb:.1f}' for mb in r.later_rounds) or '-'}"
        )
    print("  (issue 40, before the 10 s limit: 58 → 281 MiB with 10,000 streams, held 70 s later)")


# --- 3. authorized watches


def _watch_client(api: str, nodes: list[str], per_connection: int, pipe: Connection) -> None:
    """Client process: one localv1 watch per entry of ``nodes``, each with that node's token,
    ``per_connection`` to a connection; each reads to its first Sync, retrying if refused or
    dropped, then holds its stream until told to close."""
    import grpc

    from kpng.api import localv1_pb2

    _raise_nofile(len(nodes) + 256)
    pipe.send({"step": "ready"})
    if pipe.recv() != "go":
        return

    async def run() -> None:
        target = f"unix:{api.removeprefix('unix://')}"
        channels = [
            grpc.aio.insecure_channel(target, _CHANNEL_OPTIONS)
            for _ in range(-(-len(nodes) // per_connection))
        ]
        synced: list[float] = []
        retries: collections.Counter[str] = collections.Counter()
        ops: list[int] = []
        held: list[Any] = []

        async def watch(channel: grpc.aio.Channel, node: str) -> None:
            metadata = (("authorization", f"Bearer {TOKEN_PREFIX}{node}"),)
            delay = 0.5
            while True:
                call = channel.stream_stream(
                    "/localv1.Sets/Watch",
                    request_serializer=localv1_pb2.WatchReq.SerializeToString,
                    response_deserializer=localv1_pb2.OpItem.FromString,
                )(metadata=metadata)  # type: ignore[call-arg]
                try:
                    await call.write(localv1_pb2.WatchReq(NodeName=node))
                    count = 0
                    async for op in call:
                        count += 1
                        if op.WhichOneof("Op") == "Sync":
                            synced.append(time.monotonic())
                            ops.append(count)
                            held.append(call)  # the stream stays open, unread
                            return
                    retries["the stream ended"] += 1
                except grpc.aio.AioRpcError as exc:
                    # The details tell a keepalive's timeout from a reset stream.
                    retries[f"{exc.code().name}: {(exc.details() or '')[:60]}"] += 1
                # As kpng's client: jittered, growing backoff.
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(delay * 2, 8.0)

        async with asyncio.timeout(WORKER_S):
            await asyncio.gather(
                *(watch(channels[i // per_connection], node) for i, node in enumerate(nodes))
            )
        pipe.send({"step": "synced", "times": synced, "ops": median(ops), "retries": dict(retries)})
        await asyncio.to_thread(pipe.recv)  # "close"
        for call in held:
            call.cancel()
        for channel in channels:
            await channel.close(None)
        pipe.send({"step": "closed"})

    asyncio.run(run())


def bench_watches(
    args: argparse.Namespace,
    workdir: Path,
    kubeconfig: Path,
    command: Sequence[str] | None = None,
    name: str = "watches",
) -> collections.Counter[str]:
    """The watches' figures, printed; the retries they needed, by why."""
    print(
        f"\n== 3. {args.watches} authorized localv1 watches to their first state, "
        f"{args.watch_per_connection} to a connection, over {args.nodes} nodes' tokens, from "
        f"{args.clients} processes; {args.watch_services} services x 10 endpoints"
    )
    cluster = write_cluster(workdir / f"{name}-cluster", args.watch_services, args.nodes)
    nodes = [synthetic.node_name(i % args.nodes) for i in range(args.watches)]
    shares = [
        nodes[sum(_split(args.watches, args.clients)[:k]) :][:count]
        for k, count in enumerate(_split(args.watches, args.clients))
        if count
    ]
    reviews = _TokenReviews.reviews
    with _brain(workdir, cluster, name, _auth_options(kubeconfig), command) as brain:
        first_ops = _first_state(brain.api, nodes[0], f"{TOKEN_PREFIX}{nodes[0]}")
        clients = Clients(
            _watch_client, [(brain.api, share, args.watch_per_connection) for share in shares]
        )
        try:
            clients.gather("ready", START_S)
            time.sleep(2.0)
            pid = brain.proc.pid
            with Sampler(pid) as sampler:
                before = sampler.now()
                cpu = brain.cpu_s()
                started = time.monotonic()
                clients.tell("go")
                reports = clients.gather("synced", WORKER_S + 30)
                times = [t - started for m in reports for t in m["times"]]
                cpu_synced = brain.cpu_s() - cpu
                at_synced = sampler.now()
                fds = open_fds(pid)
                time.sleep(AFTER_CLOSE_S)
                settled = sampler.now()
                peak = sampler.peak(since=started)
                clients.tell("close")
                clients.gather("closed", WORKER_S)
                time.sleep(AFTER_CLOSE_S)
                after_close = sampler.now()
                fds_closed = open_fds(pid)
            hwm = brain.peak_rss_mb()
        finally:
            clients.stop()
    retries: collections.Counter[str] = collections.Counter()
    for m in reports:
        retries.update(m["retries"])
    print(
        f"  first state: {first_ops} OpItems for {nodes[0]} (median over the watches: "
        f"{median([m['ops'] for m in reports]):g}); {len(times)} watches with their first state, "
        f"the last {max(times):.1f} s after the start (each watch's: {_s(times)}); retries: "
        f"{dict(retries) or 'none'}; {_TokenReviews.reviews - reviews} TokenReviews"
    )
    print(
        f"  brain: RSS {before:.1f} MiB before, {at_synced:.1f} once all had their first state "
        f"({(at_synced - before) * 1024 / args.watches:.1f} KiB a watch), {settled:.1f} "
        f"{AFTER_CLOSE_S:g} s later, peak {peak:.1f} (VmHWM {hwm:.1f}), {after_close:.1f} "
        f"{AFTER_CLOSE_S:g} s after the clients closed; {fds} fds open, {fds_closed} after the "
        f"close; CPU {cpu_synced:.1f} s "
        f"to the last first state ({cpu_synced / args.watches * 1000:.2f} ms a watch)"
    )
    return retries


# --- main


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [s.strip() for s in text.split(",") if s.strip()]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"comma-separated, of {', '.join(choices)}")
        return names

    return parse


def _terminated(signum: int, _: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    measurements = ("health", "streams", "watches")
    parser.add_argument(
        "--only", type=_names(measurements), default=list(measurements), help=",".join(measurements)
    )
    parser.add_argument("--services", type=int, default=100, help="the cluster's (default: 100)")
    parser.add_argument("--clients", type=int, default=4, help="client processes (default: 4)")
    health = parser.add_argument_group("1. health")
    health.add_argument("--idle", type=int, default=10_000, help="idle connections in all")
    health.add_argument("--wave", type=int, default=1000, help="idle connections at once")
    health.add_argument("--hold", type=float, default=1.0, help="seconds a wave stays open")
    health.add_argument("--interval", type=float, default=0.02, help="seconds between probes")
    health.add_argument("--baseline-probes", type=int, default=300)
    streams = parser.add_argument_group("2. streams")
    streams.add_argument("--streams", type=int, default=10_000)
    streams.add_argument("--per-connection", type=int, default=100, help="at most 100")
    streams.add_argument(
        "--rounds", type=int, default=2, help="the streams again on the same brain (default: 2)"
    )
    streams.add_argument(
        "--auth",
        type=_names(("none", "anonymous", "token")),
        default=["none", "anonymous", "token"],
        help="none,anonymous,token",
    )
    watches = parser.add_argument_group("3. watches")
    watches.add_argument("--watches", type=int, default=10_000)
    watches.add_argument("--nodes", type=int, default=1000, help="distinct nodes and tokens")
    watches.add_argument("--watch-per-connection", type=int, default=1)
    # 100 services x 10 endpoints make a first state of some 1,000 OpItems, one a message, which
    # cost the brain 0.1 s of CPU a watch (measured): 10,000 watches would take 17 minutes on
    # two cores. 10 services keep the run within the 10 minutes each measurement may take.
    watches.add_argument(
        "--watch-services", type=int, default=10, help="the watches' cluster's (default: 10)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 10:
        parser.error("--rounds: 1 to 10")
    if not 1 <= args.per_connection <= 100 or args.watch_per_connection < 1:
        parser.error("--per-connection: 1 to 100 (the brain's cap); --watch-per-connection ≥ 1")
    if min(args.idle, args.wave, args.streams, args.watches, args.nodes, args.clients) < 1:
        parser.error("sizes are at least 1")
    if not 0 < args.interval <= 10 or not 0 <= args.hold <= 60 or args.baseline_probes < 1:
        parser.error("--interval: up to 10 s; --hold: up to 60 s; --baseline-probes ≥ 1")
    signal.signal(signal.SIGTERM, _terminated)
    # kpng raises its own limit to the hard one; this process holds the watches' probes only.
    _raise_nofile(4096)
    start = time.perf_counter()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="kpng-abuse-", dir="/tmp") as tmp,
            fake_api_server(Path(tmp)) as kubeconfig,
        ):
            workdir = Path(tmp)  # short: a unix socket's path must fit in 108 bytes
            if "health" in args.only:
                bench_health(args, workdir)
            if "streams" in args.only:
                bench_streams(args, workdir, kubeconfig)
            if "watches" in args.only:
                bench_watches(args, workdir, kubeconfig)
    except (BenchError, TimeoutError) as exc:
        print(f"bench_abuse: {exc!r}", file=sys.stderr)
        return 1
    print(f"\n(bench_abuse took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
