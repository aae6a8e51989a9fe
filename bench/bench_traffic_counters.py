"""to-nft's traffic counters (``--traffic-counters service``): what they cost a full sync and the
kernel's memory, and what a read of them and a scrape cost.

For each size, in a network namespace of its own (root and nft needed), one full sync of
``bench_nft``'s generated services into an empty table with the counters off then on: its time,
and how much the kernel's slab and per-CPU memory grew (``/proc/meminfo``: the machine's, so
idle is best); with them on, a read of every counter (``NftBackend.read_traffic``) and the
exposition's size at the default series limit.

    sudo python bench/bench_traffic_counters.py --sizes 10000,100000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _kernel_kib() -> int:
    """Slab and per-CPU memory, the kernel's share that nftables objects take."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[name].split()[0]) for name in ("Slab", "Percpu"))


async def _one(services: int, counters: bool) -> str:
    from bench_nft import _state

    from kpng.backends._nftables import NftBackend
    from kpng.backends._nftables.executing import NetlinkBatches, default_nft
    from kpng.backends._nftables.layout import TABLE, Options
    from kpng.status.exposition import counter, gauge, render

    nft = default_nft()
    await nft.delete_table(TABLE)
    state = _state(services, 1)
    options = Options(cluster_cidrs=("10.128.0.0/9",), traffic_counters=counters)
    backend = NftBackend(nft=nft, options=options, netlink=NetlinkBatches())
    before = _kernel_kib()
    start = time.perf_counter()
    await backend.apply(state)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    await asyncio.sleep(1)  # freed per-CPU chunks and RCU callbacks settle
    grown = _kernel_kib() - before
    line = f"{services:>7} services, counters {'on ' if counters else 'off'}: "
    line += f"full sync {seconds:6.2f} s, kernel memory +{grown / 1024:6.1f} MiB"
    if counters:
        start = time.perf_counter()
        await NetlinkBatches().dumps(TABLE, ["cluster-v4", "external-v4", "nodeport-v4"])
        locked = time.perf_counter() - start
        start = time.perf_counter()
        await backend.read_traffic()
        read = time.perf_counter() - start
        line += f"; read {read:5.2f} s (dump under the sync lock {locked:5.2f} s)"
        start = time.perf_counter()
        families: dict[str, object] = {}
        for sample in backend.metric_samples():
            family = families.get(sample.name)
            if family is None:
                make = counter if sample.counter else gauge
                labels = [name for name, _ in sample.labels]
                family = families[sample.name] = make(sample.name, sample.help, labels=labels)
            family.add([v for _, v in sample.labels], sample.value)  # type: ignore[attr-defined]
        text = render(families.values())  # type: ignore[arg-type]
        scrape = time.perf_counter() - start
        line += f", scrape {scrape * 1000:5.1f} ms, {len(text) / 1024:6.0f} KiB"
    await backend.close()
    await nft.delete_table(TABLE)
    return line


def inside(sizes: Sequence[int]) -> int:
    for services in sizes:
        for counters in (False, True):
            print(asyncio.run(_one(services, counters)), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="10000", help="comma-separated service counts")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(v) for v in args.sizes.split(",")]
    if args.inside:
        return inside(sizes)
    netns = f"kpng-bench-counters-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        cmd = [sys.executable, __file__, "--inside", "--sizes", args.sizes]
        return subprocess.run(["ip", "netns", "exec", netns, *cmd], check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


if __name__ == "__main__":
    raise SystemExit(main())
