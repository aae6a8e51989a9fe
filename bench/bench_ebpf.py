"""to-ebpf side by side with to-nft, in one run, on one test bed (root; clang, libbpf-dev).

For each size (services x 10 endpoints, plus one service whose endpoint is a pod of the bed):

- **first sync**: the whole backend's first state; for to-ebpf also its sockets part alone
  (load, write every map entry, attach) and a **takeover** (a second process's full sync over
  the pinned maps: read their keys, rewrite everything, delete what is stale, switch links);
- **one endpoint change**: the median of ``--changes`` states that each move one endpoint, for
  to-nft's transaction and to-ebpf's map writes;
- **connect latency**: p50 and p99 of ``connect()`` from a pod to the ClusterIP;
- **conntrack entries** whose original destination is the ClusterIP, after those connections.

With ``--traffic-counters service``, to-ebpf runs a second time counting per-Service traffic
(an entry per frontend in ``kpng_traffic``, made with it; one more lookup per translated
connect), its figures compared with to-ebpf's without; with ``endpoint``, a third time counting
per endpoint too (an entry per endpoint of each set in ``kpng_endpoint_traffic``, made with
its slot; one more lookup per translated connect).

    sudo .venv/bin/python bench/bench_ebpf.py --sizes 100,10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench_nft import TARGET_IP, _state
from stats import nearest_rank

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._node import FromNode, Options
from kpng.backends.ebpf import SocketBalancer
from kpng.testing.netns import ClusterSpec, TestBed


def _connects(bed: TestBed, count: int) -> list[float]:
    probe = [sys.executable, "-m", "kpng.testing.probe", "tcp", TARGET_IP, "80"]
    out = json.loads(bed.exec(bed.pod("client").netns, [*probe, "--count", str(count)]))
    failed = [r for r in out["results"] if not r.startswith("server ")]
    if failed:
        raise SystemExit(f"connections failed: {failed[:3]}")
    return list(out["seconds"])


def _conntrack(bed: TestBed) -> int:
    out = bed.exec(bed.nodes["node-1"].netns, ["conntrack", "-L", "-d", TARGET_IP], check=False)
    return sum(1 for line in out.splitlines() if line.startswith("tcp"))


async def _measure(
    bed: TestBed, size: int, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    node = bed.nodes["node-1"]
    assert node.cgroup is not None
    assert node.pin_dir is not None
    nft = KernelNft(("ip", "netns", "exec", node.netns, "nft"))
    target = bed.pod("server").ip4
    changes = [_state(size, 2 + i, changed=i, target=target) for i in range(args.changes)]
    first = _state(size, 1, target=target)
    figures: dict[str, dict[str, float]] = {}

    pin_dir = node.pin_dir

    def balancer(level: str) -> SocketBalancer:
        return SocketBalancer(
            options=Options(), from_node=FromNode(), cgroup=node.cgroup,
            pin_dir=pin_dir, bpf_object=None, traffic_counters=level != "off",
            endpoint_counters=level == "endpoint",
        )  # fmt: skip

    levels = {"off": [], "service": ["service"], "endpoint": ["service", "endpoint"]}
    names = ["to-nft", "to-ebpf"] + [f"to-ebpf {lv}" for lv in levels[args.traffic_counters]]
    for name in names:
        f: dict[str, float] = {}
        packets = NftBackend(nft=nft, options=Options())
        counted = name.removeprefix("to-ebpf ") if name.startswith("to-ebpf ") else "off"
        sockets = balancer(counted) if name != "to-nft" else None
        started = time.perf_counter()
        if sockets is not None:
            await sockets.apply(first)  # type: ignore[arg-type]
            f["sockets first sync s"] = time.perf_counter() - started
        await packets.apply(first)  # type: ignore[arg-type]
        f["first sync s"] = time.perf_counter() - started
        if sockets is not None:
            sockets.close()
            again = balancer(counted)
            started = time.perf_counter()
            await again.apply(first)  # type: ignore[arg-type]
            f["sockets takeover s"] = time.perf_counter() - started
            sockets = again
        took = []
        for state in changes:
            started = time.perf_counter()
            await (sockets or packets).apply(state)  # type: ignore[arg-type]
            took.append(time.perf_counter() - started)
        f["change ms"] = statistics.median(took) * 1e3
        bed.exec(node.netns, ["conntrack", "-F"], check=False)
        seconds = _connects(bed, args.connects)
        f["connect p50 us"] = nearest_rank(seconds, 0.5) * 1e6
        f["connect p99 us"] = nearest_rank(seconds, 0.99) * 1e6
        f["conntrack entries to the ClusterIP"] = _conntrack(bed)
        figures[name] = f
        if sockets is not None:
            sockets.close()
        shutil.rmtree(node.pin_dir, ignore_errors=True)
        bed.exec(node.netns, ["nft", "delete", "table", "inet", "kpng"], check=False)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="100,10000")
    parser.add_argument("--changes", type=int, default=15)
    parser.add_argument("--connects", type=int, default=1000)
    parser.add_argument("--traffic-counters", choices=("off", "service", "endpoint"), default="off")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[int, dict[str, dict[str, float]]] = {}
    with TestBed(ClusterSpec.parse({"node-1": ["server", "client"]}), sockets=True) as bed:
        for size in sizes:
            results[size] = asyncio.run(_measure(bed, size, args))
            print(f"\n{size} services x 10 endpoints, {args.connects} connects:")
            nft, ebpf = results[size]["to-nft"], results[size]["to-ebpf"]
            for key in ebpf:
                base = nft.get(key)
                ratio = f"  (to-ebpf / to-nft {ebpf[key] / base:.2f})" if base else ""
                shown = f"to-nft {base:10.3f}   " if base is not None else " " * 20
                print(f"  {key:38} {shown}to-ebpf {ebpf[key]:10.3f}{ratio}")
            for level in ("service", "endpoint"):
                counted = results[size].get(f"to-ebpf {level}")
                if counted is None:
                    continue
                for key, value in counted.items():
                    base = ebpf[key]
                    ratio = f"  (/ to-ebpf {value / base:.2f})" if base else ""
                    print(f"  {key:38} to-ebpf {level:8} {value:10.3f}{ratio}")
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        for name in ("to-nft", "to-ebpf"):
            for q in ("p50", "p99"):
                key = f"connect {q} us"
                growth = results[large][name][key] / results[small][name][key]
                print(f"{name}: connect {q} at {large} / at {small} services: {growth:.2f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
