"""What the brain saves the API server: kube-proxy's shape against kpng's, as the node count grows.

One control plane (``rig.cluster``: etcd and two kube-apiservers on it) holds the
synthetic cluster of ``synthetic.py`` (``--services`` services, 10 endpoints each) and a Node
object per watcher. Apiserver **A** serves every reader and is the one measured; apiserver **B**
takes the benchmark's writes, so that the cost of a write (admission, etcd), the same in both
shapes, stays out of A's figures (A still pays for taking each write's event from etcd into its
watch cache).

For each N of ``--nodes``, two shapes, one after the other:

- **per-node** (kube-proxy's): N node agents, multiplexed in this process, each lists and watches
  what kube-proxy's informers list and watch, with kube-proxy's selectors: Services and
  EndpointSlices (``!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless``),
  its own Node (``metadata.name=NODE``) and ServiceCIDRs; the first list with
  ``resourceVersion=0`` (from the watch cache), watches with bookmarks, and a 410 answered as a
  reflector answers it: a list with ``resourceVersion=""`` in pages of 500, then a new watch.
  Watch events are parsed for their resourceVersion only. HTTP/1.1, one TLS connection per
  watch (client-go multiplexes a client's watches over one HTTP/2 connection: the same bytes,
  fewer connections).
- **brain** (kpng's): one ``kpng kube --kubeconfig A to-api`` in a subprocess, and N node agents
  watching it: raw batched streams over a unix socket (``bench_api.Watcher``).

Measured for each, on A (user + system CPU from ``/proc/PID/stat``; bytes written to its sockets,
TLS included, from ``/proc/PID/io``'s ``wchar``):

1. **one endpoint change**: ``--changes`` times, one EndpointSlice's first endpoint moves to a new
   address (through B); timed until every node agent has it; A's CPU seconds and bytes per change,
   the brain's CPU per change, this process's CPU (the agents) apart;
2. **a forced relist (410)**: A is stopped, a slice changes through B, and A starts again on the
   same port. Every watch then resumes from a resourceVersion older than A's new watch cache:
   410 Gone, and each client lists again. Timed until every node agent has the change; A's CPU
   and bytes over that window, less what a restart costs A with nobody watching (measured first,
   in the same run), and how many 410 relists the clients made.

The brain's peak RSS (VmHWM) closes each brain row. Per-change figures are fitted against N
(least squares) and extrapolated to 5,000 nodes. Every wait is bounded; the processes and the
control plane are stopped at the end, also on failure.

    python bench/bench_apiserver.py [--nodes 100,300,1000] [--services 1000] [--changes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import ipaddress
import math
import os
import random
import resource
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import synthetic
from bench_api import BenchError, Server, Watcher, _all_synced
from bench_kube import APISERVER_ARGS, fill
from bench_kube_proxy import cpu_split

from kpng.testing.ports import free_port
from rig.cluster import ControlPlane, ensure_binaries
from rig.kubeapi import KubeApi

Obj = dict[str, Any]
EXTRAPOLATE_TO = 5_000
LABELS = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
"""kube-proxy's label selector, for its Service and EndpointSlice informers alike."""
SLICES = "/apis/discovery.k8s.io/v1/endpointslices"
START_TIMEOUT_S = 600.0
"""Every agent listed and watching, or every brain watcher synced; and every agent listed
again after a 410. Or ``PER_AGENT_S`` per agent, if longer: 4,500 agents' first lists alone
took more than 600 s of these two cores."""
PER_AGENT_S = 0.3
CHANGE_TIMEOUT_S = 120.0
SETTLE_S = 1.0
"""Quiet time before and after a measured window, so that its figures hold only its own work."""
WATCH_TIMEOUT_S = 3600
_NEW_ADDRESSES = ipaddress.IPv4Network("10.255.0.0/16")  # outside the generator's pod network


# --- the measured processes


@dataclass(frozen=True)
class Usage:
    cpu_s: float
    written_mb: float

    def __sub__(self, other: Usage) -> Usage:
        return Usage(self.cpu_s - other.cpu_s, self.written_mb - other.written_mb)


def cpu_s(pid: int) -> float:
    return cpu_split(pid)[0]


def usage(pid: int) -> Usage:
    written = 0
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            written = int(line.split()[1])
    return Usage(cpu_s(pid), written / 1e6)


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class Cluster:
    """The control plane: A serves, B takes writes."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.a_port = plane.apiserver_port
        self.b_port = plane.start_apiserver()
        self.writer = KubeApi.of(plane, self.b_port)
        self._moves = 0
        self._slices: list[tuple[str, str]] = []

    @property
    def a_pid(self) -> int:
        return self.plane.apiserver_pid(self.a_port)

    def usage(self) -> Usage:
        return usage(self.a_pid)

    def load_slices(self) -> None:
        """The slices whose first endpoint every node uses (ready, no topology hints), so that
        moving it changes every node's state, in both shapes."""
        listed = self.writer.list("EndpointSlice", labelSelector=LABELS)["items"]
        self._slices = [
            (s["metadata"]["namespace"], s["metadata"]["name"])
            for s in listed
            if s["endpoints"][0]["conditions"].get("ready", True)
            and not any("hints" in e for e in s["endpoints"])
        ]

    def move_endpoint(self) -> tuple[str, int]:
        """One slice's first endpoint gets a new address; its name and resourceVersion."""
        namespace, name = self._slices[self._moves % len(self._slices)]
        current = self.writer.get("EndpointSlice", namespace, name)
        endpoints = current["endpoints"]
        endpoints[0]["addresses"] = [str(_NEW_ADDRESSES[1 + self._moves % 65_000])]
        self._moves += 1
        patched = self.writer.patch("EndpointSlice", namespace, name, {"endpoints": endpoints})
        return name, int(patched["metadata"]["resourceVersion"])

    def restart_a(self, between: Callable[[], object]) -> None:
        """Stop A, run ``between`` (writes through B), start A on its port.

        Called in the main thread, blocking an event loop's clients meanwhile (they notice A's
        return at once): A dies with the thread that started it (``Daemon``'s parent-death
        signal), so not from a worker thread."""
        self.plane.stop_apiserver(self.a_port, signal.SIGTERM)
        try:
            between()
        finally:
            self.plane.start_apiserver(self.a_port)


# --- kube-proxy's shape: N node agents on the API server


# msgspec reads only the fields a Struct declares: the rest of an object is skipped, not decoded.
class _Meta(msgspec.Struct):
    name: str = ""
    resourceVersion: str = ""
    continue_: str = msgspec.field(default="", name="continue")  # a list's next page


class _Item(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _ListBody(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    items: list[_Item] = msgspec.field(default_factory=list)


class _Status(msgspec.Struct):
    code: int = 0
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _Event(msgspec.Struct):
    type: str
    object: _Status


_list_decoder = msgspec.json.Decoder(_ListBody)
_event_decoder = msgspec.json.Decoder(_Event)


class _Gone(Exception):
    """410: the resourceVersion is too old; list again."""


@dataclass
class AgentStats:
    bytes: int = 0
    lists: int = 0
    relists_gone: int = 0
    events: int = 0
    errors: int = 0


@dataclass
class Agent:
    """One node's informers, as kube-proxy holds them: four reflectors."""

    node: str
    http: aiohttp.ClientSession
    server: str
    headers: dict[str, str]
    stats: AgentStats
    slices: dict[str, int] = field(default_factory=dict)
    """The resourceVersion of each EndpointSlice this agent last saw, by name."""
    watching: int = 0

    def reflectors(self) -> list[tuple[str, dict[str, str]]]:
        return [
            ("/api/v1/services", {"labelSelector": LABELS}),
            (SLICES, {"labelSelector": LABELS}),
            ("/api/v1/nodes", {"fieldSelector": f"metadata.name={self.node}"}),
            ("/apis/networking.k8s.io/v1/servicecidrs", {}),
        ]

    async def run(self) -> None:
        await asyncio.gather(*(self._reflect(p, s) for p, s in self.reflectors()))

    async def _reflect(self, path: str, selectors: dict[str, str]) -> None:
        backoff = 0.8  # client-go's reflector: 800 ms, doubling, at most 30 s
        version = ""
        listed = False
        while True:
            try:
                if not version:
                    version = await self._list(path, selectors, first=not listed)
                    listed = True
                version = await self._watch(path, selectors, version)
                backoff = 0.8
            except _Gone:
                self.stats.relists_gone += 1
                version = ""
            except (aiohttp.ClientError, OSError, TimeoutError):
                self.stats.errors += 1
                await asyncio.sleep(backoff * (1 + random.random()))
                backoff = min(backoff * 2, 30.0)

    async def _get(self, path: str, params: dict[str, str]) -> aiohttp.ClientResponse:
        return await self.http.get(self.server + path, params=params, headers=self.headers)

    async def _list(self, path: str, selectors: dict[str, str], *, first: bool) -> str:
        # An informer's first list comes from the watch cache (resourceVersion 0, unpaged); a
        # relist after 410 asks for the newest state, in pages.
        params = {**selectors, "resourceVersion": "0"} if first else {**selectors, "limit": "500"}
        while True:
            async with await self._get(path, params) as response:
                body = await response.read()
                if response.status != 200:
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status
                    )
            self.stats.bytes += len(body)
            page = _list_decoder.decode(body)
            if path == SLICES:
                for item in page.items:
                    self.slices[item.metadata.name] = int(item.metadata.resourceVersion)
            if not page.metadata.continue_:
                self.stats.lists += 1
                return page.metadata.resourceVersion
            params["continue"] = page.metadata.continue_

    async def _watch(self, path: str, selectors: dict[str, str], version: str) -> str:
        params = {
            **selectors,
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_TIMEOUT_S),
        }
        async with await self._get(path, params) as response:
            if response.status == 410:
                raise _Gone
            if response.status != 200:
                raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
            self.watching += 1
            try:
                async for line in response.content:
                    self.stats.bytes += len(line)
                    event = _event_decoder.decode(line)
                    if event.type == "ERROR":
                        if event.object.code == 410:
                            raise _Gone
                        raise aiohttp.ClientPayloadError(f"watch error {event.object.code}")
                    self.stats.events += 1
                    meta = event.object.metadata
                    version = meta.resourceVersion or version
                    if path == SLICES and event.type != "BOOKMARK":
                        self.slices[meta.name] = int(meta.resourceVersion)
            finally:
                self.watching -= 1
        return version


async def _until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise BenchError(f"{what}: not within {seconds:g} s")
        await asyncio.sleep(0.05)


@dataclass
class ShapeResult:
    nodes: int
    change: Usage
    change_s: float
    agents_cpu_change_s: float
    relist: Usage
    relist_s: float
    relists_gone: int
    start_s: float
    brain_cpu_change_s: float = math.nan
    brain_cpu_relist_s: float = math.nan
    brain_peak_rss_mb: float = math.nan


Arrived = Callable[[str, int, float], bool]
"""Whether every node has a change: (its slice's name, its resourceVersion, the
``time.perf_counter()`` before it was made)."""


async def _measure_changes(
    cluster: Cluster, changes: int, arrived: Arrived, brain_pid: int | None
) -> tuple[Usage, float, float, float]:
    """Per change: A's usage, the median seconds, this process's CPU and the brain's CPU."""
    per_change: list[tuple[Usage, float, float, float]] = []
    for _ in range(changes):
        await asyncio.sleep(SETTLE_S)
        before, own, brain = cluster.usage(), own_cpu_s(), cpu_s(brain_pid) if brain_pid else 0.0
        started = time.perf_counter()
        name, version = await asyncio.to_thread(cluster.move_endpoint)
        check = functools.partial(arrived, name, version, started)
        await _until(check, CHANGE_TIMEOUT_S, "a change")
        elapsed = time.perf_counter() - started
        await asyncio.sleep(SETTLE_S)
        brain_used = (cpu_s(brain_pid) - brain) if brain_pid else math.nan
        per_change.append((cluster.usage() - before, elapsed, own_cpu_s() - own, brain_used))
    # CPU and bytes are means: a change costs A a few clock ticks at small N.
    return (
        Usage(
            statistics.fmean(u.cpu_s for u, *_ in per_change),
            statistics.fmean(u.written_mb for u, *_ in per_change),
        ),
        statistics.median(c[1] for c in per_change),
        statistics.fmean(c[2] for c in per_change),
        statistics.fmean(c[3] for c in per_change),
    )


def _start_timeout(nodes: int) -> float:
    return max(START_TIMEOUT_S, PER_AGENT_S * nodes)


async def _measure_relist(
    cluster: Cluster, arrived: Arrived, restart_alone: Usage, nodes: int
) -> tuple[Usage, float]:
    """A restarted with a change made meanwhile: A's usage until every node has the change,
    less a restart's own, and the seconds from A's return."""
    await asyncio.sleep(SETTLE_S)
    moved: list[tuple[str, int]] = []
    started = time.perf_counter()
    cluster.restart_a(lambda: moved.append(cluster.move_endpoint()))
    returned = time.perf_counter()
    name, version = moved[0]
    check = functools.partial(arrived, name, version, started)
    await _until(check, _start_timeout(nodes), "a relist")
    elapsed = time.perf_counter() - returned
    await asyncio.sleep(SETTLE_S)
    return cluster.usage() - restart_alone, elapsed


async def per_node_shape(
    cluster: Cluster, nodes: int, changes: int, restart_alone: Usage
) -> ShapeResult:
    plane = cluster.plane
    server = plane.server_at(cluster.a_port)
    context = plane.ssl_context()
    headers = {"Authorization": f"Bearer {plane.token}", "Accept": "application/json"}
    stats = AgentStats()
    connector = aiohttp.TCPConnector(ssl=context, limit=0, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=None, connect=60, sock_read=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        agents = [Agent(synthetic.node_name(i), http, server, headers, stats) for i in range(nodes)]
        started = time.perf_counter()
        tasks = [asyncio.create_task(a.run()) for a in agents]
        try:

            def alive() -> None:
                for task in tasks:
                    if task.done():
                        task.result()
                        raise BenchError("an agent ended")

            def arrived(name: str, version: int, _since: float) -> bool:
                alive()
                return all(a.slices.get(name, 0) >= version for a in agents)

            def watching() -> bool:
                alive()
                return sum(a.watching for a in agents) == 4 * nodes

            await _until(
                watching,
                _start_timeout(nodes),
                f"{nodes} agents listing and watching",
            )
            start_s = time.perf_counter() - started
            change, change_s, own, _ = await _measure_changes(cluster, changes, arrived, None)
            gone_before = stats.relists_gone
            relist, relist_s = await _measure_relist(cluster, arrived, restart_alone, nodes)
            relists = stats.relists_gone - gone_before
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return ShapeResult(nodes, change, change_s, own, relist, relist_s, relists, start_s)


def _brain_relists(url: str) -> int:
    """The brain's lists caused by 410 Gone, over its four reflectors."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    name = "kpng_source_relists_gone_total"
    return sum(
        int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(name)
    )


async def brain_shape(
    cluster: Cluster, nodes: int, changes: int, restart_alone: Usage, workdir: Path
) -> ShapeResult:
    metrics = f"127.0.0.1:{free_port()}"
    source = ("kube", "--kubeconfig", str(cluster.plane.kubeconfig))
    brain = Server(
        source,
        workdir / "brain.sock",
        workdir / "brain.log",
        options=("--metrics-address", metrics),
    )
    try:
        brain.wait_listening()
        watchers = [Watcher(synthetic.node_name(i)) for i in range(nodes)]
        started = time.perf_counter()
        tasks = [asyncio.create_task(w.run(brain.api)) for w in watchers]
        try:
            async with asyncio.timeout(_start_timeout(nodes)):
                await _all_synced(watchers, 1, tasks)
            start_s = time.perf_counter() - started
            ended = sum((w.ended_by for w in watchers), collections.Counter[str]())
            why = ", ".join(f"{n} {code}" for code, n in ended.most_common()) or "none"
            print(f"  brain:    {nodes} watchers synced in {start_s:.0f} s; calls ended: {why}")

            def arrived(_name: str, _version: int, since: float) -> bool:
                # Each change is one change set for every node (its slice's service is used by
                # every node), and nothing else changes: it has arrived once every watcher has
                # had a Sync since it was made.
                return all(w.syncs and w.syncs[-1] > since for w in watchers)

            change, change_s, own, brain_change = await _measure_changes(
                cluster, changes, arrived, brain.proc.pid
            )
            gone_before = _brain_relists(f"http://{metrics}/metrics")
            brain_before = brain.cpu_s()
            relist, relist_s = await _measure_relist(cluster, arrived, restart_alone, nodes)
            brain_relist = brain.cpu_s() - brain_before
            gone = _brain_relists(f"http://{metrics}/metrics")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        rss = brain.peak_rss_mb()
    except BaseException:
        print(f"the brain's log (tail):\n{brain.log_tail()}", file=sys.stderr)
        raise
    finally:
        brain.stop()
    return ShapeResult(
        nodes,
        change,
        change_s,
        own,
        relist,
        relist_s,
        gone - gone_before,
        start_s,
        brain_cpu_change_s=brain_change,
        brain_cpu_relist_s=brain_relist,
        brain_peak_rss_mb=rss,
    )


# --- figures


def fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares: (slope, intercept)."""
    if len(xs) < 2:
        return math.nan, math.nan
    slope, intercept = statistics.linear_regression(xs, ys)
    return slope, intercept


def report(rows: list[tuple[ShapeResult, ShapeResult]], baseline: Baseline) -> None:
    alone, spread = baseline.median, baseline.spread
    print(
        f"\n== A restarted with nobody watching: {alone.cpu_s:.2f} s CPU, "
        f"{alone.written_mb:.1f} MB written (median of 3, taken off each relist below; spread "
        f"{spread.cpu_s:.2f} s, {spread.written_mb:.1f} MB: a relist below that is noise, and a "
        "ratio against it a lower bound, ≥)"
    )
    print("\n== per endpoint change (means; seconds to all: median), apiserver A")
    print(
        "  nodes | per-node: CPU s    MB     to all s  agents' CPU s | brain: CPU s    MB   "
        "  to all s  brain CPU s | CPU ratio  bytes ratio"
    )
    for kp, kpng in rows:
        print(
            f"  {kp.nodes:5d} | {kp.change.cpu_s:13.3f} {kp.change.written_mb:8.3f} "
            f"{kp.change_s:9.2f} {kp.agents_cpu_change_s:13.2f} | {kpng.change.cpu_s:10.3f} "
            f"{kpng.change.written_mb:8.3f} {kpng.change_s:9.2f} {kpng.brain_cpu_change_s:11.3f} "
            f"| {_ratio(kp.change.cpu_s, kpng.change.cpu_s):>9} "
            f"{_ratio(kp.change.written_mb, kpng.change.written_mb):>11}"
        )
    print("\n== per forced relist (410), apiserver A (less a restart's own cost)")
    print(
        "  nodes | per-node: CPU s     MB   410s  to all s | brain: CPU s     MB  410s  "
        "to all s  brain CPU s  brain peak RSS MB | CPU ratio  bytes ratio"
    )
    for kp, kpng in rows:
        print(
            f"  {kp.nodes:5d} | {kp.relist.cpu_s:13.2f} {kp.relist.written_mb:8.1f} "
            f"{kp.relists_gone:5d} {kp.relist_s:9.1f} | {kpng.relist.cpu_s:10.2f} "
            f"{kpng.relist.written_mb:8.1f} {kpng.relists_gone:4d} {kpng.relist_s:9.1f} "
            f"{kpng.brain_cpu_relist_s:11.2f} {kpng.brain_peak_rss_mb:18.0f} "
            f"| {_ratio(kp.relist.cpu_s, kpng.relist.cpu_s, spread.cpu_s):>9} "
            f"{_ratio(kp.relist.written_mb, kpng.relist.written_mb, spread.written_mb):>11}"
        )
    print(
        "\n  first lists and watches: "
        + ", ".join(f"{kp.nodes} agents {kp.start_s:.1f} s" for kp, _ in rows)
        + "; brain watchers synced: "
        + ", ".join(f"{k.nodes} in {k.start_s:.1f} s" for _, k in rows)
    )
    nodes = [float(kp.nodes) for kp, _ in rows]
    largest = max(nodes)
    print(
        f"\n== extrapolated to {EXTRAPOLATE_TO} nodes (least squares over N = "
        f"{', '.join(str(int(n)) for n in nodes)}; {EXTRAPOLATE_TO / largest:.1f}x the largest "
        "N measured)"
    )
    series: list[tuple[str, Callable[[ShapeResult], float]]] = [
        ("A CPU s per change", lambda r: r.change.cpu_s),
        ("A MB per change", lambda r: r.change.written_mb),
        ("A CPU s per relist", lambda r: r.relist.cpu_s),
        ("A MB per relist", lambda r: r.relist.written_mb),
    ]
    for label, value in series:
        per_node = fit(nodes, [value(kp) for kp, _ in rows])
        brain = fit(nodes, [value(k) for _, k in rows])
        at = [s[0] * EXTRAPOLATE_TO + s[1] for s in (per_node, brain)]
        print(
            f"  {label:20}: per-node {per_node[0] * 1000:9.3f} per 1,000 nodes + {per_node[1]:8.3f}"
            f" → {at[0]:9.2f} | brain {brain[0] * 1000:9.3f} per 1,000 nodes + {brain[1]:8.3f} "
            f"→ {at[1]:8.2f} | {_ratio(at[0], at[1])}"
        )
    brain_cpu = fit(nodes, [k.brain_cpu_change_s for _, k in rows])
    print(
        f"  brain CPU s per change: {brain_cpu[0] * 1000:.3f} per 1,000 nodes + "
        f"{brain_cpu[1]:.3f} → {brain_cpu[0] * EXTRAPOLATE_TO + brain_cpu[1]:.2f} at "
        f"{EXTRAPOLATE_TO}"
    )


def _ratio(a: float, b: float, noise: float = 0.0) -> str:
    if a <= noise:
        return "—"
    if b <= noise:
        return f"≥ {a / noise:.0f}x" if noise > 0 else "—"
    return f"{a / b:.1f}x"


# --- main


def _counts(text: str) -> list[int]:
    counts = sorted({int(s) for s in text.split(",") if s.strip()})
    if not counts or any(not 1 <= n <= 5_000 for n in counts):
        raise argparse.ArgumentTypeError("1 to 5000 nodes each")
    return counts


@dataclass(frozen=True)
class Baseline:
    """What restarting A costs A with no client (its start, its watch cache's first lists): the
    median of a few restarts, and their spread, under which a relist cannot be told apart."""

    median: Usage
    spread: Usage

    @classmethod
    def measure(cls, cluster: Cluster, times: int = 3) -> Baseline:
        runs: list[Usage] = []
        for _ in range(times):
            cluster.restart_a(cluster.move_endpoint)
            time.sleep(5 * SETTLE_S)
            runs.append(cluster.usage())
        cpu = [u.cpu_s for u in runs]
        written = [u.written_mb for u in runs]
        return cls(
            Usage(statistics.median(cpu), statistics.median(written)),
            Usage(max(cpu) - min(cpu), max(written) - min(written)),
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=_counts, default=[100, 300, 1000])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=5)
    parser.add_argument("--fill-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    largest = max(args.nodes)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * largest + 1024  # a connection per watch
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))

    document = synthetic.generate(args.services)
    items: list[Obj] = document["items"]
    template = next(i for i in items if i["kind"] == "Node")
    for i in range(synthetic.NODES, largest):
        node = msgspec.json.decode(msgspec.json.encode(template))
        node["metadata"]["name"] = node["metadata"]["labels"]["kubernetes.io/hostname"] = (
            synthetic.node_name(i)
        )
        items.append(node)
    print(
        f"{args.services} services x 10 endpoints, {max(largest, synthetic.NODES)} nodes; "
        f"N = {', '.join(map(str, args.nodes))}; {os.cpu_count()} CPUs"
    )
    binaries = ensure_binaries()
    with tempfile.TemporaryDirectory(prefix="kpng-bench-apiserver-") as tmp:
        workdir = Path(tmp)
        with ControlPlane(binaries, apiserver_args=APISERVER_ARGS) as plane:
            cluster = Cluster(plane)
            seconds = fill(plane, items, time.monotonic() + args.fill_timeout)
            print(f"  filled in {seconds:.0f} s (through A)")
            cluster.load_slices()
            baseline = Baseline.measure(cluster)
            rows: list[tuple[ShapeResult, ShapeResult]] = []
            for n in args.nodes:
                print(f"\n-- N = {n}", flush=True)
                kp = asyncio.run(per_node_shape(cluster, n, args.changes, baseline.median))
                print(
                    f"  per-node: change {kp.change.cpu_s:.3f} s CPU, {kp.change.written_mb:.2f} "
                    f"MB; relist {kp.relist.cpu_s:.1f} s CPU, {kp.relist.written_mb:.0f} MB "
                    f"({kp.relists_gone} 410s)",
                    flush=True,
                )
                brain_dir = workdir / f"brain-{n}"
                brain_dir.mkdir()
                kpng = asyncio.run(
                    brain_shape(cluster, n, args.changes, baseline.median, brain_dir)
                )
                print(
                    f"  brain:    change {kpng.change.cpu_s:.3f} s CPU, "
                    f"{kpng.change.written_mb:.2f} MB; relist {kpng.relist.cpu_s:.1f} s CPU, "
                    f"{kpng.relist.written_mb:.0f} MB ({kpng.relists_gone} 410s)",
                    flush=True,
                )
                rows.append((kp, kpng))
            report(rows, baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
