"""The traffic counters (``--traffic-counters off|service|endpoint``): what each level costs
to-nft and to-iptables, in one run, with ``off`` as the baseline.

For each backend, size and level, in a network namespace of its own (root, nft and iptables
needed), ``bench_nft``'s generated services (10 endpoints each): the first (full) sync into an
empty table, its time and how much the kernel's slab and per-CPU memory grew
(``/proc/meminfo``: the machine's, so idle is best); with the counters on, a read of every
counter (as a running kpng makes one every read period) and the exposition's size at the
default series limit, and a second read (as every later one: what the first learnt of the
elements' keys kept); each read's time and the process's CPU time in it (the kernel's dump
included: on a shared machine, where waiting for a CPU makes most of a read's time, the
steadier figure); then one change (a service's endpoint moves: an incremental sync),
median of ``--changes``, with no periodic read running meanwhile (a sync waits for one
holding the lock). Ratios are to ``off`` of the same backend and size. to-iptables runs
iptables-legacy by default: iptables-nft 1.8.9 does not restore 10k services x 10 endpoints
in minutes (``docs/design/benchmarks.md``).

    sudo python bench/bench_traffic_counters.py --sizes 10000 --backends nft,iptables
    sudo python bench/bench_traffic_counters.py --sizes 100000 --backends nft

With ``--connect-latency``, to-nft's connect latency instead, as ``bench_ebpf.py`` measures it:
on a test bed with a node per level (each with a client and a server pod), the sizes' generated
services and one at ``bench_nft.TARGET_IP`` served by the node's server pod, programmed at the
node's level; then ``--connects`` connections from each node's client pod to that ClusterIP in
turn, each timed (``connect()`` to the server's answer), ``--rounds`` times; the samples of a
level pooled, p50 and p99 with their ratios to ``off``.

    sudo python bench/bench_traffic_counters.py --connect-latency --sizes 1000 --rounds 20 \
        --connects 50
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

LEVELS = ("off", "service", "endpoint")


def _kernel_kib() -> int:
    """Slab and per-CPU memory, the kernel's share that nftables objects take."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) for name in ("Slab", "Percpu"))


@dataclasses.dataclass
class Run:
    first: float
    change: float
    memory_kib: int
    read: float = 0.0
    read_cpu: float = 0.0
    again: float = 0.0
    again_cpu: float = 0.0
    scrape_kib: float = 0.0


def _scrape(samples: Sequence[Any]) -> bytes:
    from kpng.status.exposition import counter, gauge, render

    families: dict[str, Any] = {}
    for sample in samples:
        family = families.get(sample.name)
        if family is None:
            make = counter if sample.counter else gauge
            labels = [name for name, _ in sample.labels]
            family = families[sample.name] = make(sample.name, sample.help, labels=labels)
        family.add([v for _, v in sample.labels], sample.value)
    return render(families.values())


async def _never(seconds: float) -> None:
    """The backends' sleep: their periodic reads never come (the bench reads once itself)."""
    await asyncio.Event().wait()


async def _timed(read: Awaitable[None]) -> tuple[float, float]:
    """How long ``read`` took, and the process's CPU time in it (its threads included)."""
    start, cpu = time.perf_counter(), time.process_time()
    await read
    return time.perf_counter() - start, time.process_time() - cpu


async def _one(backend_name: str, services: int, level: str, changes: int, variant: str) -> Run:
    from bench_nft import _state

    from kpng.backends._nftables import NftBackend
    from kpng.backends._nftables.executing import NetlinkBatches, default_nft
    from kpng.backends._nftables.layout import TABLE, Options
    from kpng.backends.iptables import IptablesBackend, cleanup
    from kpng.backends.iptables.executing import Iptables, Tools

    options = Options(
        cluster_cidrs=("10.128.0.0/9",),
        traffic_counters=level != "off",
        endpoint_counters=level == "endpoint",
    )
    nft = default_nft()
    backend: NftBackend | IptablesBackend
    if backend_name == "nft":
        await nft.delete_table(TABLE)
        backend = NftBackend(nft=nft, options=options, netlink=NetlinkBatches(), sleep=_never)
    else:
        await cleanup()
        backend = IptablesBackend(
            iptables=Iptables(Tools(variant)), options=options, families=("v4",), sleep=_never
        )
    before = _kernel_kib()
    start = time.perf_counter()
    await backend.apply(_state(services, 1))  # type: ignore[arg-type]
    first = time.perf_counter() - start
    await asyncio.sleep(1)  # freed per-CPU chunks and RCU callbacks settle
    run = Run(first=first, change=0.0, memory_kib=_kernel_kib() - before)
    if level != "off":
        run.read, run.read_cpu = await _timed(backend.read_traffic())
        run.again, run.again_cpu = await _timed(backend.read_traffic())
        run.scrape_kib = len(_scrape(backend.metric_samples())) / 1024
    times = []
    for n in range(changes):
        start = time.perf_counter()
        await backend.apply(_state(services, n + 2, changed=n))  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
    run.change = statistics.median(times)
    await backend.close()
    if backend_name == "nft":
        await nft.delete_table(TABLE)
    else:
        await cleanup()
    return run


def inside(
    sizes: Sequence[int],
    backends: Sequence[str],
    changes: int,
    variant: str,
    rounds: int,
    levels: Sequence[str] = LEVELS,
) -> int:
    print(
        f"{'backend':<11} {'services':>8} {'level':<9} {'first sync s':>12} {'ratio':>6} "
        f"{'change ms':>9} {'ratio':>6} {'kernel MiB':>10} {'read s':>7} {'cpu s':>6} "
        f"{'again s':>7} {'cpu s':>6} {'scrape KiB':>10}"
    )
    for backend in backends:
        for services in sizes:
            # Levels interleaved, ``rounds`` times, the best of each kept: a shared machine's
            # noise otherwise lands on one level.
            best: dict[str, Run] = {}
            for _ in range(rounds):
                for level in levels:
                    run = asyncio.run(_one(backend, services, level, changes, variant))
                    print(f"# {backend} {services} {level}: {run}", file=sys.stderr, flush=True)
                    kept = best.setdefault(level, run)
                    kept.first = min(kept.first, run.first)
                    kept.change = min(kept.change, run.change)
                    for name in ("read", "read_cpu", "again", "again_cpu"):
                        setattr(kept, name, min(getattr(kept, name), getattr(run, name)))
            base = best[levels[0]]
            for level in levels:
                run = best[level]
                print(
                    f"{'to-' + backend:<11} {services:>8} {level:<9} {run.first:>12.2f} "
                    f"{run.first / base.first:>6.2f} {run.change * 1000:>9.1f} "
                    f"{run.change / base.change:>6.2f} {run.memory_kib / 1024:>+10.1f} "
                    f"{run.read:>7.2f} {run.read_cpu:>6.2f} {run.again:>7.2f} "
                    f"{run.again_cpu:>6.2f} {run.scrape_kib:>10.0f}",
                    flush=True,
                )
    return 0


def connect_latency(
    sizes: Sequence[int], levels: Sequence[str], rounds: int, connects: int, prefix: str | None
) -> int:
    """to-nft's connect latency at each level (the module's docstring)."""
    import json

    from bench_nft import TARGET_IP, _state
    from stats import nearest_rank

    from kpng.backends._nftables import NftBackend
    from kpng.backends._nftables.executing import KernelNft
    from kpng.backends._nftables.layout import Options
    from kpng.testing.netns import ClusterSpec, TestBed

    # A node per level, alike but for it: the levels' connections then alternate every
    # ``connects``, and a shared machine's noise falls on all of them, not on one level's turn.
    nodes = {level: f"node-{i}" for i, level in enumerate(levels, start=1)}
    spec = ClusterSpec.parse({node: [f"server{node}", f"client{node}"] for node in nodes.values()})
    with TestBed(spec, prefix=prefix) if prefix else TestBed(spec) as bed:
        print(f"{'services':>8} {'level':<9} {'p50 us':>8} {'ratio':>6} {'p99 us':>8} {'ratio':>6}")
        for size in sizes:
            for level, node in nodes.items():
                netns = bed.nodes[node].netns
                options = Options(
                    cluster_cidrs=("10.244.0.0/16",),
                    traffic_counters=level != "off",
                    endpoint_counters=level == "endpoint",
                )
                bed.exec(netns, ["nft", "delete", "table", "inet", "kpng"], check=False)
                backend = NftBackend(
                    nft=KernelNft(("ip", "netns", "exec", netns, "nft")), options=options
                )
                state = _state(size, 1, target=bed.pod(f"server{node}").ip4)
                asyncio.run(backend.apply(state))  # type: ignore[arg-type]
                bed.exec(netns, ["conntrack", "-F"], check=False)
            probe = [sys.executable, "-m", "kpng.testing.probe", "tcp", TARGET_IP, "80"]
            probe += ["--count", str(connects), "--timeout", "1"]
            seconds: dict[str, list[float]] = {level: [] for level in levels}
            for _ in range(rounds):
                for level, node in nodes.items():
                    out = json.loads(bed.exec(bed.pod(f"client{node}").netns, probe))
                    failed = [r for r in out["results"] if not r.startswith("server")]
                    if failed:
                        raise SystemExit(f"connections failed at {level}: {failed[:3]}")
                    seconds[level] += out["seconds"]
            base = {q: nearest_rank(seconds[levels[0]], q) for q in (0.5, 0.99)}
            for level in levels:
                p50, p99 = (nearest_rank(seconds[level], q) for q in (0.5, 0.99))
                print(
                    f"{size:>8} {level:<9} {p50 * 1e6:>8.0f} {p50 / base[0.5]:>6.2f} "
                    f"{p99 * 1e6:>8.0f} {p99 / base[0.99]:>6.2f}",
                    flush=True,
                )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="10000", help="comma-separated service counts")
    parser.add_argument("--backends", default="nft,iptables", help="nft, iptables or both")
    parser.add_argument("--changes", type=int, default=5, help="changes timed (median)")
    parser.add_argument("--iptables-variant", default="legacy", choices=("legacy", "nft"))
    parser.add_argument("--rounds", type=int, default=2, help="runs of each level (best kept)")
    parser.add_argument(
        "--levels", default=",".join(LEVELS), help="the levels run (ratios to the first)"
    )
    parser.add_argument(
        "--connect-latency",
        action="store_true",
        help="to-nft's connect latency to a Service at each level instead (needs a test bed)",
    )
    parser.add_argument(
        "--connects", type=int, default=1000, help="connections timed per level and round"
    )
    parser.add_argument(
        "--netns-prefix", help="the test bed's network namespace names' prefix (default: its own)"
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",")]
    backends = args.backends.split(",")
    if args.connect_latency:
        levels = args.levels.split(",")
        return connect_latency(sizes, levels, args.rounds, args.connects, args.netns_prefix)
    if args.inside:
        levels = args.levels.split(",")
        return inside(sizes, backends, args.changes, args.iptables_variant, args.rounds, levels)
    netns = f"kpng-bench-counters-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        cmd = [sys.executable, __file__, "--inside", "--sizes", args.sizes]
        cmd += ["--backends", args.backends, "--changes", str(args.changes)]
        cmd += ["--iptables-variant", args.iptables_variant, "--rounds", str(args.rounds)]
        cmd += ["--levels", args.levels]
        return subprocess.run(["ip", "netns", "exec", netns, *cmd], check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


if __name__ == "__main__":
    raise SystemExit(main())
