"""One brain, thousands of nodes connecting at once: how long until each has its first state?
(issue 42, item 2's first target: 5,000 nodes, every first state within 300 s, 0 calls ended
early.)

The cluster: ``synthetic.py``'s ``--services`` services x ``--endpoints`` endpoints over
``--nodes`` nodes, as List files in a directory, served by one brain, ``kpng
--metrics-bind-address 127.0.0.1:PORT file --input DIR to-api --listen unix://SOCK`` in a
subprocess (``bench_api.Server``). One warm-up watcher gets a first state first, so the brain has
read its input before the storm (its call is then ended, and not counted).

``--watchers`` N watchers, watcher i following node i, are spread over ``--processes`` spawned
child processes (watcher i in process i mod P), so that their parsing shares the two cores with
the brain as real nodes' would not more than it must. Each is a raw batched watch
(``bench_api.Watcher``: op batches parsed, not decoded, packed ones not inflated), asking for
JSON payloads and packing as node agents do (``kpng.remote.watching.watch_local``), so the bytes
are a node's; ``--no-packing`` asks for none, as a watcher from before packing did. Every
process makes its watchers, says it is ready, and waits; they are released at once (the same
instant, a ``time.monotonic`` reading sent to all: the clock is system-wide). Each watcher then
connects and calls, and notes the time from the release to its first Sync, the bytes it
received, and the codes that ended its calls before it (it calls again after a backoff, as
``kpng.client`` does, whatever the code).

Reported: per-watcher release → first Sync p50, p99 and max (the last watcher's: the storm's
length); the brain's CPU seconds over the storm (``/proc/PID/stat``, release → last first state)
and per first state; the watchers' processes' CPU over the same time, apart (if they are near
their share of the cores, they, not the brain, are the bottleneck); the brain's peak RSS
(``VmHWM``); the calls that ended early, by code, as the watchers saw them and as the brain's
``kpng_api_calls_ended_total{code}`` counted them during the storm. With ``--py-spy SECONDS``,
py-spy samples the brain for that long from the release and the top functions by own time are
printed. The machine's available memory is watched during the storm: under ``--min-free-gb``
the run is abandoned.

Missed targets are reported, not failed; the exit status is non-zero only if something crashed
or timed out (``--timeout``, the whole run: then the first states that came are reported, and
the watchers without one counted); child processes are stopped on any failure.

    python bench/bench_first_states.py [--services 10000] [--endpoints 10] [--nodes 5000]
        [--watchers 5000] [--processes 4] [--timeout 900] [--py-spy 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import multiprocessing
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import synthetic
from bench_api import BenchError, ClusterFile, Server, Watcher
from stats import median, p99

from kpng.backoff import Backoff
from kpng.testing.ports import free_port

PYTHON = sys.executable
TARGET_LAST_S = 300.0
READY_S = 120.0  # a child process to start and make its watchers
WARM_UP_S = 300.0  # the brain to read its input and send the warm-up watcher its first state
POLL_S = 1.0
FILES = 20  # the cluster's List files (the brain reads a directory, as from manifests)
_LINE = re.compile(r":\d+\)$")
_CALLS_ENDED = re.compile(r'^kpng_api_calls_ended_total\{code="([A-Z_]+)"\} ([0-9.e+]+)$', re.M)


class StormWatcher(Watcher):
    """A watcher that calls again whatever code ended its call, as ``kpng.client`` does (the
    brain's RESOURCE_EXHAUSTED, a bound on first states, included), counting each code."""

    async def run(self, api: str) -> None:
        backoff = Backoff()
        while True:
            try:
                await self._follow(api)
            except grpc.aio.AioRpcError as exc:
                self.ended_by[exc.code().name] += 1
            else:
                self.ended_by["the stream ended"] += 1
            self.reconnects += 1
            await backoff.wait()


# --- the child processes


def _watch(api: str, nodes: Sequence[int], packed: bool, pipe: Connection) -> None:
    """A child process: ``nodes``' watchers, released by the parent's ``go``, each to its first
    state; then their figures, and the calls are held open until ``close``."""
    _raise_nofile(2 * len(nodes) + 256)
    watchers = [StormWatcher(synthetic.node_name(i), packed=packed) for i in nodes]
    pipe.send({"step": "ready"})
    message = pipe.recv()
    if message.get("step") != "go":
        return
    asyncio.run(_storm(api, watchers, message["release"], message["deadline"], pipe))


async def _storm(
    api: str, watchers: list[StormWatcher], release: float, deadline: float, pipe: Connection
) -> None:
    cpu_before = time.process_time()
    tasks = [asyncio.create_task(w.run(api)) for w in watchers]
    try:
        pending = list(watchers)
        while pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            pending = [w for w in pending if not w.syncs]
            failed = next((t for t in tasks if t.done()), None)
            if failed is not None:
                failed.result()  # raises what ended it
                raise BenchError("a watcher ended")
        cpu = time.process_time() - cpu_before
        # perf_counter is CLOCK_MONOTONIC on Linux, as is time.monotonic: one system-wide clock.
        firsts = [w.syncs[0] - release if w.syncs else math.nan for w in watchers]
        ended: collections.Counter[str] = collections.Counter()
        for w in watchers:
            ended.update(w.ended_by)
        pipe.send(
            {
                "step": "synced",
                "firsts": firsts,
                "bytes": [w.bytes for w in watchers],
                "ended": dict(ended),
                "early": sum(1 for w in watchers if w.ended_by),
                "cpu_s": cpu,
            }
        )
        # Held open until told: the brain's count of ended calls is read meanwhile.
        await asyncio.to_thread(pipe.recv)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _raise_nofile(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


class Children:
    """The spawned watcher processes (spawned, not forked: grpc's core does not survive a
    fork), stopped (terminated, then killed) on leaving, whatever happened."""

    def __init__(self, api: str, shares: Sequence[Sequence[int]], packed: bool) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipes: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for share in shares:
            ours, theirs = context.Pipe()
            proc = context.Process(
                target=_watch, args=(api, list(share), packed, theirs), daemon=True
            )
            proc.start()
            theirs.close()
            self.pipes.append(ours)
            self.procs.append(proc)

    def gather(self, what: str, deadline: float) -> list[dict[str, Any]]:
        answers = []
        for pipe, proc in zip(self.pipes, self.procs, strict=True):
            while not pipe.poll(POLL_S):
                if time.monotonic() > deadline:
                    raise BenchError(f"watcher process {proc.pid}: no {what!r} in time")
                _check_memory()
            try:
                message: dict[str, Any] = pipe.recv()
            except EOFError:
                raise BenchError(f"watcher process {proc.pid} exited ({proc.exitcode})") from None
            if message.get("step") != what:
                raise BenchError(f"watcher process {proc.pid}: {message} instead of {what!r}")
            answers.append(message)
        return answers

    def tell(self, message: dict[str, Any]) -> None:
        for pipe in self.pipes:
            pipe.send(message)

    def cpu_s(self) -> float:
        return sum(_cpu_s(proc.pid) for proc in self.procs if proc.pid is not None)

    def stop(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send({"step": "close"})
        # One bound for all: a child still in its storm does not read the pipe.
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for pipe in self.pipes:
            pipe.close()


@contextlib.contextmanager
def _children(api: str, shares: Sequence[Sequence[int]], packed: bool) -> Iterator[Children]:
    children = Children(api, shares, packed)
    try:
        yield children
    finally:
        children.stop()


# --- the brain's side


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds so far (``/proc/PID/stat`` fields 14 and 15); NaN if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return math.nan
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calls_ended(metrics_port: int) -> dict[str, float]:
    """The brain's ``kpng_api_calls_ended_total`` by code."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    return {code: float(value) for code, value in _CALLS_ENDED.findall(text)}


def _available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return math.nan


MIN_FREE_GB = 3.0


def _check_memory() -> None:
    free = _available_gb()
    if free < MIN_FREE_GB:
        raise BenchError(f"the machine has {free:.1f} GB available, under {MIN_FREE_GB:g} GB")


async def _warm_up(api: str) -> None:
    """One watcher (node 0's) to its first state: the brain has read its input."""
    watcher = StormWatcher(synthetic.node_name(0))
    task = asyncio.create_task(watcher.run(api))
    try:
        async with asyncio.timeout(WARM_UP_S):
            await watcher.synced.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class PySpy:
    """py-spy sampling a process for some seconds, in raw (collapsed stacks) form."""

    def __init__(self, pid: int, seconds: int, output: Path) -> None:
        spy = Path(PYTHON).parent / "py-spy"
        self.output = output
        self.proc = subprocess.Popen(
            [
                *(str(spy), "record", "--pid", str(pid), "--duration", str(seconds)),
                *("--format", "raw", "--rate", "50", "--nonblocking", "--output", str(output)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # py-spy writes what it has
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def top(self, count: int) -> list[tuple[str, float]]:
        """The functions with the most samples as the innermost Python frame, by share of
        samples (native code, gRPC's core included, counts for the Python frame calling it)."""
        own: collections.Counter[str] = collections.Counter()
        total = 0
        if not self.output.exists():
            return []
        for line in self.output.read_text().splitlines():
            stack, _, samples = line.rpartition(" ")
            if not stack or not samples.isdigit():
                continue
            # "function (file:line)": by function, whichever of its lines
            own[_LINE.sub(")", stack.split(";")[-1])] += int(samples)
            total += int(samples)
        return [(frame, n / total) for frame, n in own.most_common(count)]


# --- the run


@dataclass
class Storm:
    firsts_s: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    ended: collections.Counter[str] = field(default_factory=collections.Counter)
    early_watchers: int = 0
    brain_ended: dict[str, float] = field(default_factory=dict)
    brain_cpu_s: float = 0.0
    watchers_cpu_s: float = 0.0  # as the children count it (release → their last first state)
    watchers_cpu_wall_s: float = 0.0  # /proc, release → the last first state, all processes
    wall_s: float = 0.0
    rss_mb: float = 0.0
    spy_top: list[tuple[str, float]] = field(default_factory=list)


def _storm_run(args: argparse.Namespace, brain: Server, metrics_port: int) -> Storm:
    deadline = args.start + args.timeout
    shares = [range(k, args.watchers, args.processes) for k in range(args.processes)]
    result = Storm()
    with _children(brain.api, shares, not args.no_packing) as children:
        children.gather("ready", min(deadline, time.monotonic() + READY_S))
        ended_before = calls_ended(metrics_port)
        brain_before = brain.cpu_s()
        children_before = children.cpu_s()
        release = time.monotonic()
        children.tell({"step": "go", "release": release, "deadline": deadline})
        spy = PySpy(brain.proc.pid, args.py_spy, args.workdir / "spy.txt") if args.py_spy else None
        try:
            answers = children.gather("synced", deadline + 30)
        finally:
            if spy is not None:
                spy.stop()
                result.spy_top = spy.top(10)
        result.wall_s = time.monotonic() - release
        result.brain_cpu_s = brain.cpu_s() - brain_before
        result.watchers_cpu_wall_s = children.cpu_s() - children_before
        result.brain_ended = _diff(calls_ended(metrics_port), ended_before)
        result.rss_mb = brain.peak_rss_mb()
    for answer in answers:
        result.firsts_s += answer["firsts"]
        result.bytes += answer["bytes"]
        result.ended.update(answer["ended"])
        result.early_watchers += answer["early"]
        result.watchers_cpu_s += answer["cpu_s"]
    return result


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {code: n - before.get(code, 0.0) for code, n in after.items() if n > before.get(code, 0)}


def _report(args: argparse.Namespace, storm: Storm) -> None:
    got = [t for t in storm.firsts_s if not math.isnan(t)]
    missing = len(storm.firsts_s) - len(got)
    last = max(got, default=math.nan)
    per_state_ms = storm.brain_cpu_s / max(1, len(got)) * 1000
    cores = storm.wall_s * (os.cpu_count() or 1)
    print(f"\n== {args.watchers} first states at once, {args.processes} watcher processes")
    if missing:
        print(f"  --timeout came first: the times are those of the {len(got)} that had one")
    print(f"  {'':34} {'value':>12}")
    rows = [
        ("first states", f"{len(got)} of {len(storm.firsts_s)}"),
        (f"first states within {TARGET_LAST_S:g} s", f"{sum(t <= TARGET_LAST_S for t in got)}"),
        ("release → first Sync p50 s", f"{median(got):.1f}"),
        ("release → first Sync p99 s", f"{p99(got):.1f}"),
        ("release → first Sync max s (last)", f"{last:.1f}"),
        ("brain CPU s over the storm", f"{storm.brain_cpu_s:.1f}"),
        ("brain CPU per first state ms", f"{per_state_ms:.1f}"),
        ("brain CPU share", f"{storm.brain_cpu_s / storm.wall_s:.2f} cores"),
        ("watchers' CPU s (all processes)", f"{storm.watchers_cpu_wall_s:.1f}"),
        ("watchers' CPU share", f"{storm.watchers_cpu_wall_s / storm.wall_s:.2f} cores"),
        ("machine's cores x storm s", f"{cores:.0f}"),
        ("brain peak RSS MB", f"{storm.rss_mb:.0f}"),
        ("MB per first state (mean)", f"{sum(storm.bytes) / max(1, len(got)) / 1e6:.2f}"),
        ("MB to all watchers", f"{sum(storm.bytes) / 1e6:.0f}"),
        ("watchers with a call ended early", f"{storm.early_watchers}"),
    ]
    for name, value in rows:
        print(f"  {name:34} {value:>12}")
    ended = ", ".join(f"{code} {n}" for code, n in sorted(storm.ended.items())) or "none"
    print(f"  calls ended early, as the watchers saw them: {ended}")
    brain = ", ".join(f"{code} {n:g}" for code, n in sorted(storm.brain_ended.items())) or "none"
    print(f"  calls ended during the storm, the brain's kpng_api_calls_ended_total: {brain}")
    print(
        f"  every first state within {TARGET_LAST_S:g} s: "
        f"{'met' if not missing and last <= TARGET_LAST_S else 'MISSED'}; 0 calls ended early: "
        f"{'met' if not storm.ended and not storm.brain_ended else 'MISSED'}"
    )
    if storm.spy_top:
        print(f"  the brain's top functions by own time (py-spy, the first {args.py_spy} s):")
        for frame, share in storm.spy_top:
            print(f"    {share * 100:5.1f} %  {frame}")


def _terminated(signum: int, _: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    global MIN_FREE_GB
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000, help="default: 10000")
    parser.add_argument("--endpoints", type=int, default=10, help="per service (default: 10)")
    parser.add_argument("--nodes", type=int, default=5000, help="default: 5000")
    parser.add_argument("--watchers", type=int, default=5000, help="at most --nodes (5000)")
    parser.add_argument("--processes", type=int, default=4, help="watcher processes (4)")
    parser.add_argument("--timeout", type=float, default=900.0, help="whole run, s (900)")
    parser.add_argument("--py-spy", type=int, default=0, metavar="SECONDS", help="sample brain")
    parser.add_argument(
        "--no-packing", action="store_true", help="watchers do not ask for packed first states"
    )
    parser.add_argument("--min-free-gb", type=float, default=MIN_FREE_GB, help="default: 3")
    args = parser.parse_args(argv)
    if not 1 <= args.watchers <= args.nodes or not 1 <= args.processes <= 64:
        parser.error("--watchers: 1 to --nodes; --processes: 1 to 64")
    if args.services < 1 or not 1 <= args.endpoints <= 1000 or args.timeout <= 0:
        parser.error("--services: at least 1; --endpoints: 1 to 1000; --timeout: above 0")
    MIN_FREE_GB = args.min_free_gb
    args.start = time.monotonic()
    signal.signal(signal.SIGTERM, _terminated)
    # SIGALRM bounds what the polling cannot: the cluster's writing, the brain's start.
    signal.signal(signal.SIGALRM, _terminated)
    signal.alarm(math.ceil(args.timeout) + 60)
    _raise_nofile(2 * args.watchers + 1024)
    print(
        f"== first states: {args.services} services x {args.endpoints} endpoints over "
        f"{args.nodes} nodes, {args.watchers} watchers in {args.processes} processes"
        f"{', not asking for packing' if args.no_packing else ''}"
    )
    synthetic.ENDPOINTS_PER_SERVICE = args.endpoints
    try:
        with tempfile.TemporaryDirectory(prefix="kpng-first-", dir="/tmp") as tmp:
            args.workdir = Path(tmp)  # short: a unix socket's path must fit in 108 bytes
            cluster = ClusterFile(args.workdir, args.services, nodes=args.nodes, files=FILES)
            print(f"  {cluster.size_mb:.1f} MB of JSON in {FILES} files")
            port = free_port()
            brain = Server(
                ("file", "--input", str(cluster.path)),
                args.workdir / "kpng.sock",
                args.workdir / "brain.log",
                options=("--metrics-bind-address", f"127.0.0.1:{port}"),
            )
            try:
                brain.wait_listening()
                asyncio.run(_warm_up(brain.api))
                print(f"  the brain is ready, RSS {brain.rss_mb():.0f} MB")
                storm = _storm_run(args, brain, port)
            except BaseException:
                print(f"the brain's log (tail):\n{brain.log_tail()}", file=sys.stderr)
                raise
            finally:
                brain.stop()
        _report(args, storm)
        missing = sum(1 for t in storm.firsts_s if math.isnan(t))
        if missing:
            raise BenchError(f"{missing} watchers had no first state within --timeout")
    except (BenchError, TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
        print(f"bench_first_states: {exc!r}", file=sys.stderr)
        return 1
    print(f"\n(bench_first_states took {time.monotonic() - args.start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
