"""One brain, thousands of node watchers: an endpoint change's fan-out, and relay tiers.

The cluster: ``synthetic.py``'s 10,000 services x 10 endpoints spread over 5,000 nodes, one per
watcher (``--services``, ``--nodes``), served by one brain, ``kpng file --input DIR to-api
--listen unix://...`` in a subprocess (``bench_api.Server``). The items are split over
``--files`` List files (default 100) in that directory: kpng re-reads only the file a change
touches (some 0.4 MB), which is what a directory of manifests costs; ``--files 1`` makes it one
file that kpng re-reads whole (43 MB) at each change, which then dominates the brain's CPU.

Watchers are ``bench_api.Watcher``: raw batched streams (JSON payloads, op batches parsed, not
decoded), multiplexed in this process's event loop, one connection each, node ``i`` for
watcher ``i``. They connect in waves of ``--wave`` and each wave gets its first states before
the next connects (a thousand first states of 10,000 services at once would only measure the
buffers of the first-state storm).

A change moves one ready endpoint of a service without topology hints to a new address
(``bench_api.FileChanges``), written to its file (a new file renamed over it); every node sees
that service, so every watcher gets a change set. ``--changes`` changes, one after the other:
the next is written once every watcher has the Sync of the last, and half a second later. Each
change is timed from the rename to each watcher's Sync; the brain's (and relays') CPU seconds
per change come from ``/proc/PID/stat`` between the rename and the last watcher's Sync, and
this process's own CPU per change (``time.process_time``, the watchers' side) apart.

1. **By watcher count** (``--watchers 1000,5000``): one brain; watchers are added up to each
   count in turn (same cluster, same nodes), then the changes. Per count: rename → Sync p50, p99
   and max over every watcher and change, and rename → the first watcher's Sync (the file's
   notice and re-read, resolution, first send); the brain's CPU per change (median over the
   changes) and per change per watcher; the distinct change sets the watchers got for one change
   (median over the changes), counted two ways: distinct raw bytes of the change set's batches
   (what the brain could send alike), and distinct service and endpoint ops once the node's own
   ops are dropped (ChangeTriggers and NodeFacts, which node views of one class may still differ
   in). The brain's peak RSS (VmHWM) at the end. Targets: p99 ≤ 2 s, brain peak RSS ≤ 4 GiB,
   brain CPU per change ≤ 1 s (at the largest count).
2. **Relay tiers** (``--relays 0,2,5``): K relays ``kpng api --api unix://BRAIN to-api --listen
   unix://RELAY_k`` in subprocesses, the largest watcher count spread evenly over them (watcher
   i on relay i mod K); K = 0 is the direct figures of 1. The same brain throughout; each K's
   relays and watchers are stopped before the next K starts. Per K: end-to-end p50 and p99, the
   brain's and the relays' CPU per change.

Missed targets are reported, not failed; the exit status is non-zero only if something crashed
or timed out.

    python bench/bench_fanout.py [--services 10000] [--nodes 5000] [--watchers 1000,5000]
        [--relays 0,2,5] [--changes 5] [--files 100] [--wave 500] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import synthetic
from bench_api import (
    INITIAL_TIMEOUT_S,
    BenchError,
    ClusterFile,
    FileChanges,
    Server,
    Watcher,
    _all_synced,
    served,
    verdict,
)
from stats import median, p99

from kpng.api import batchv1_pb2
from kpng.api.localv1_pb2 import EndpointsSet, ServicesSet

TARGET_P99_S = 2.0
TARGET_RSS_MB = 4096.0
WAVE_S_PER_WATCHER = 2.0
TARGET_CPU_S = 1.0
CHANGE_TIMEOUT_S = 120.0  # one change reaching every watcher
SETTLE_S = 0.5  # before a change: nothing in flight, keepalives aside
_SERVICE_SETS = (ServicesSet, EndpointsSet)


@dataclass
class Round:
    """One watcher set's changes."""

    watchers: int
    relays: int
    latencies_s: list[float] = field(default_factory=list)  # every watcher, every change
    first_s: list[float] = field(default_factory=list)  # per change: the first watcher's Sync
    brain_cpu_s: list[float] = field(default_factory=list)  # per change
    relays_cpu_s: list[float] = field(default_factory=list)
    own_cpu_s: list[float] = field(default_factory=list)
    distinct_raw: list[int] = field(default_factory=list)
    distinct_ops: list[int] = field(default_factory=list)
    change_kb: list[float] = field(default_factory=list)
    initial_s: float = 0.0
    rss_mb: float = 0.0  # the brain's (and relays') RSS once the watchers had their first states


class Fleet:
    """Watchers and their tasks, in this process's event loop."""

    def __init__(self, *, follow: bool = True) -> None:
        self.follow = follow
        self.watchers: list[Watcher] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def grow(self, count: int, apis: Sequence[str], wave: int) -> float:
        """Connect watchers up to ``count`` (watcher i to ``apis[i % len(apis)]``), wave by
        wave, each wave to its first state; the seconds it took."""
        start = time.perf_counter()
        while len(self.watchers) < count:
            new = [
                Watcher(synthetic.node_name(i), follow=self.follow)
                for i in range(len(self.watchers), min(count, len(self.watchers) + wave))
            ]
            offset = len(self.watchers)
            self.watchers += new
            self.tasks += [
                asyncio.create_task(w.run(apis[(offset + j) % len(apis)]))
                for j, w in enumerate(new)
            ]
            # A bound per wave, longer for a wave of many: a wave of 500 first states took
            # 200 s on two busy cores.
            async with asyncio.timeout(max(INITIAL_TIMEOUT_S, len(new) * WAVE_S_PER_WATCHER)):
                await _all_synced(new, 1, self.tasks)
        for w in self.watchers:
            w.keep = True
        return time.perf_counter() - start

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.watchers, self.tasks = [], []


def _service_ops(change_set: list[bytes]) -> bytes:
    """The change set's service and endpoint ops: what node views of one class share."""
    kept = bytearray()
    for data in change_set:
        for op in batchv1_pb2.OpBatch.FromString(data).Ops:
            kind = op.WhichOneof("Op")
            ref = op.Set.Ref if kind == "Set" else op.Delete if kind == "Delete" else None
            if ref is not None and ref.Set in _SERVICE_SETS:
                kept += op.SerializeToString()
    return bytes(kept)


def _distinct(watchers: list[Watcher]) -> tuple[int, int]:
    """Distinct (raw batches, service ops) among the watchers' last change sets."""
    raw = {hashlib.sha1(b"".join(w.change_sets[-1])).digest() for w in watchers}
    ops = {hashlib.sha1(_service_ops(w.change_sets[-1])).digest() for w in watchers}
    return len(raw), len(ops)


async def _changes(
    fleet: Fleet,
    mover: FileChanges,
    brain: Server,
    relays: Sequence[Server],
    count: int,
    result: Round,
) -> None:
    watchers = fleet.watchers
    for _ in range(count):
        await asyncio.sleep(SETTLE_S)
        seen = [len(w.syncs) for w in watchers]  # watchers added later have had fewer
        by_seen: dict[int, list[Watcher]] = {}
        for w, n in zip(watchers, seen, strict=True):
            by_seen.setdefault(n, []).append(w)
        received = sum(w.bytes for w in watchers)
        brain_before = brain.cpu_s()
        relays_before = sum(r.cpu_s() for r in relays)
        own_before = time.process_time()
        await asyncio.to_thread(mover.apply)
        t0 = time.perf_counter()
        async with asyncio.timeout(CHANGE_TIMEOUT_S):
            for n, group in by_seen.items():
                await _all_synced(group, n + 1, fleet.tasks)
        result.brain_cpu_s.append(brain.cpu_s() - brain_before)
        result.relays_cpu_s.append(sum(r.cpu_s() for r in relays) - relays_before)
        result.own_cpu_s.append(time.process_time() - own_before)
        arrivals = [w.syncs[n] - t0 for w, n in zip(watchers, seen, strict=True)]
        result.latencies_s += arrivals
        result.first_s.append(min(arrivals))
        result.change_kb.append((sum(w.bytes for w in watchers) - received) / 1e3)
        raw, ops = _distinct(watchers)
        result.distinct_raw.append(raw)
        result.distinct_ops.append(ops)
        for w in watchers:
            w.change_sets.clear()


@contextlib.contextmanager
def _relays(brain: Server, count: int, workdir: Path) -> Iterator[list[Server]]:
    relays: list[Server] = []
    try:
        for k in range(count):
            source = ("api", "--api", brain.api)
            sock, log = workdir / f"relay-{k}.sock", workdir / f"relay-{k}.log"
            relays.append(Server(source, sock, log))
        for relay in relays:
            relay.wait_listening()
        yield relays
    except BaseException:
        for relay in relays:
            print(f"relay {relay.api}'s log (tail):\n{relay.log_tail()}", file=sys.stderr)
        raise
    finally:
        for relay in relays:
            relay.stop()


def _print_round(r: Round) -> None:
    lat = r.latencies_s
    where = f"via {r.relays} relays" if r.relays else "direct"
    print(
        f"  {r.watchers} watchers {where}: first states in {r.initial_s:.1f} s, then RSS "
        f"{r.rss_mb:.0f} MB (brain{' and relays' if r.relays else ''}); "
        f"{len(r.brain_cpu_s)} changes, {median(r.change_kb):.0f} kB to all watchers each"
    )
    print(
        f"    rename → Sync over {len(lat)} arrivals: p50 {median(lat):.3f} s  "
        f"p99 {p99(lat):.3f} s  max {max(lat, default=float('nan')):.3f} s; "
        f"rename → first watcher's Sync {median(r.first_s):.3f} s (median)"
    )
    per_watcher_ms = median(r.brain_cpu_s) / r.watchers * 1000
    print(
        f"    brain CPU per change {median(r.brain_cpu_s):.3f} s (median; each: "
        + ", ".join(f"{c:.2f}" for c in r.brain_cpu_s)
        + f"), {per_watcher_ms:.3f} ms per watcher"
        + (f"; relays' CPU per change {median(r.relays_cpu_s):.3f} s" if r.relays else "")
        + f"; watchers' process CPU per change {median(r.own_cpu_s):.3f} s"
    )
    print(
        f"    distinct change sets per change: {median(r.distinct_raw):g} raw "
        f"(each: {r.distinct_raw}), {median(r.distinct_ops):g} counting service and endpoint "
        f"ops only (each: {r.distinct_ops})"
    )


def _print_summary(rounds: list[Round], rss_mb: float) -> None:
    direct = [r for r in rounds if not r.relays]
    print("\n== summary")
    print(
        f"  {'watchers':>8} {'relays':>6} {'p50 s':>7} {'p99 s':>7} {'max s':>7} "
        f"{'brain CPU/chg s':>15} {'per watcher ms':>14} {'relays CPU/chg s':>16} "
        f"{'own CPU/chg s':>13} {'distinct':>8}"
    )
    for r in rounds:
        lat = r.latencies_s
        print(
            f"  {r.watchers:8d} {r.relays:6d} {median(lat):7.3f} {p99(lat):7.3f} "
            f"{max(lat):7.3f} {median(r.brain_cpu_s):15.3f} "
            f"{median(r.brain_cpu_s) / r.watchers * 1000:14.3f} "
            f"{median(r.relays_cpu_s):16.3f} {median(r.own_cpu_s):13.3f} "
            f"{median(r.distinct_raw):8g}"
        )
    if direct:
        top = max(direct, key=lambda r: r.watchers)
        worst = p99(top.latencies_s)
        cpu = median(top.brain_cpu_s)
        print(
            f"  {top.watchers} direct watchers: p99 {worst:.3f} s (target ≤ {TARGET_P99_S:g} s: "
            f"{verdict(worst <= TARGET_P99_S)}); brain CPU per change {cpu:.3f} s (target ≤ "
            f"{TARGET_CPU_S:g} s: {verdict(cpu <= TARGET_CPU_S)})"
        )
    if len(direct) > 1:
        low, high = direct[0], direct[-1]
        per_high = median(high.brain_cpu_s) / high.watchers
        ratio = per_high / (median(low.brain_cpu_s) / low.watchers)
        print(
            f"  brain CPU per change per watcher, {high.watchers} over {low.watchers} watchers: "
            f"{ratio:.2f}x (below 1: the cost grows slower than the watchers); distinct change "
            f"sets {median(low.distinct_raw):g} → {median(high.distinct_raw):g}"
        )
    print(
        f"  brain peak RSS (VmHWM) {rss_mb:.0f} MB (target ≤ {TARGET_RSS_MB:g} MB: "
        f"{verdict(rss_mb <= TARGET_RSS_MB)})"
    )


async def _bench(args: argparse.Namespace, cluster: ClusterFile, brain: Server) -> list[Round]:
    mover = FileChanges(cluster, args.seed)
    rounds: list[Round] = []
    top = max(args.watchers)
    for relays in args.relays:
        fleet = Fleet(follow=not args.no_follow)
        try:
            if relays == 0:
                for count in args.watchers:
                    result = Round(count, 0)
                    result.initial_s = await fleet.grow(count, [brain.api], args.wave)
                    result.rss_mb = brain.rss_mb()
                    await _changes(fleet, mover, brain, [], args.changes, result)
                    _print_round(result)
                    rounds.append(result)
                continue
            with _relays(brain, relays, args.workdir) as servers:
                result = Round(top, relays)
                apis = [s.api for s in servers]
                result.initial_s = await fleet.grow(top, apis, args.wave)
                result.rss_mb = brain.rss_mb() + sum(s.rss_mb() for s in servers)
                await _changes(fleet, mover, brain, servers, args.changes, result)
                await fleet.close()
            _print_round(result)
            rounds.append(result)
        finally:
            await fleet.close()
            gc.collect()
    return rounds


def _counts(text: str) -> list[int]:
    counts = sorted({int(s) for s in text.split(",") if s.strip()})
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError("comma-separated counts")
    return counts


def _terminated(signum: int, _: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10_000, help="default: 10000")
    parser.add_argument("--nodes", type=int, default=5000, help="default: 5000")
    parser.add_argument("--watchers", type=_counts, default=[1000, 5000], help="1000,5000")
    parser.add_argument("--relays", type=_counts, default=[0, 2, 5], help="default: 0,2,5")
    parser.add_argument("--changes", type=int, default=5, help="per round (default: 5)")
    parser.add_argument("--files", type=int, default=100, help="cluster files (default: 100)")
    parser.add_argument("--wave", type=int, default=500, help="watchers connecting at once")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", type=Path, help="cProfile the brain into this file")
    parser.add_argument(
        "--no-follow",
        action="store_true",
        help="watchers ask for each change set (no WatchReq.Follow), as Go KPNG's do",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.changes <= 100 or not 1 <= args.files <= 10_000 or args.wave < 1:
        parser.error("--changes: 1 to 100; --files: 1 to 10000; --wave: at least 1")
    if max(args.watchers) > args.nodes or min(args.watchers) < 1 or max(args.relays) > 50:
        parser.error("--watchers: 1 to --nodes each; --relays: 0 to 50 each")
    # SIGTERM unwinds like an error: the servers' context managers stop them.
    signal.signal(signal.SIGTERM, _terminated)
    # A connection per watcher, here and in the servers (children inherit the limit).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4 * max(args.watchers) + 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    print(
        f"== fan-out: {args.services} services x 10 endpoints over {args.nodes} nodes, "
        f"watchers {args.watchers}, relays {args.relays}, {args.changes} changes each, "
        f"{'a request per change set' if args.no_follow else 'following'}"
    )
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="kpng-fan-", dir="/tmp") as tmp:
            args.workdir = Path(tmp)  # short: a unix socket's path must fit in 108 bytes
            cluster = ClusterFile(args.workdir, args.services, nodes=args.nodes, files=args.files)
            print(
                f"  {cluster.size_mb:.1f} MB of JSON in {args.files} file(s), {cluster.nodes} nodes"
            )
            with served(cluster, args.workdir, profile=args.profile) as brain:
                rounds = asyncio.run(_bench(args, cluster, brain))
                rss = brain.peak_rss_mb()
            _print_summary(rounds, rss)
    except (BenchError, TimeoutError, grpc.aio.AioRpcError) as exc:
        print(f"bench_fanout: {exc!r}", file=sys.stderr)
        return 1
    print(f"\n(bench_fanout took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
