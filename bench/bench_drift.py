"""What to-nft's drift check costs, and how long a flushed ruleset takes to come back.

For each size (services x 10 endpoints, ClusterIP), in a network namespace of its own: to-nft
programs the services (a full sync, the baseline), then the bench times, each as the median of
``--repeat`` runs, CPU (this process and its children) and wall time:

- ``idle``: the check of a period when nobody else has committed (the ruleset's generation
  alone), the cost of nearly every period;
- ``others``: the check after another program committed to a table of its own (the table's
  shape and one element per map, over netlink, nothing repaired);
- ``hourly``: the exact comparison of every element with what kpng applied, nothing to
  repair (what replaced kube-proxy's hourly full sync);
- ``repair``: from ``nft flush ruleset`` to kpng's rules back in the kernel (the check that
  finds it and the full sync that repairs it; traffic flows once that transaction commits),
  against the first full sync.

    sudo .venv/bin/python bench/bench_drift.py --sizes 10000,100000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft, NetlinkBatches
from kpng.backends._nftables.layout import Options
from kpng.client import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.testing import states


def _address(base: int, n: int) -> str:
    return f"10.{base + (n >> 16)}.{(n >> 8) & 255}.{n & 255}"


def services(count: int) -> dict[ServiceKey, ServiceEndpoints]:
    """``count`` ClusterIP services with 10 endpoints each."""
    return {
        ("ns", f"s{i}"): ServiceEndpoints(
            states.service(f"s{i}", cluster_ip=_address(96, i), port_name="http"),
            tuple(states.endpoint(_address(128, i * 10 + j)) for j in range(10)),
        )
        for i in range(count)
    }


def _cpu() -> float:
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def _timed(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    cpu, wall = _cpu(), time.perf_counter()
    await work()
    return _cpu() - cpu, time.perf_counter() - wall


def _nft(netns: str, command: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "nft", command], check=True)


async def measure(netns: str, count: int, repeat: int) -> dict[str, tuple[float, float]]:
    """The figures of ``count`` services in ``netns`` (empty)."""
    backend = NftBackend(
        nft=KernelNft(("ip", "netns", "exec", netns, "nft")),
        options=Options(),
        netlink=NetlinkBatches(f"/run/netns/{netns}"),
        sync_period=30,
    )
    found = services(count)
    state = NodeState(
        node="n1", revision=1, services=found, updated=frozenset(found), deleted=frozenset()
    )
    first = await _timed(lambda: backend.apply(state))
    runs: dict[str, list[tuple[float, float]]] = {
        "idle": [],
        "others": [],
        "hourly": [],
        "repair": [],
    }
    _nft(netns, "add table ip other")
    for i in range(repeat):
        runs["idle"].append(await _timed(backend.check_kernel))
        _nft(netns, f"add chain ip other c{i}")
        runs["others"].append(await _timed(backend.check_kernel))
    for _ in range(max(1, repeat // 5)):
        runs["hourly"].append(await _timed(lambda: backend.check_kernel(full=True)))
    for _ in range(max(1, repeat // 5)):
        _nft(netns, "flush ruleset")
        runs["repair"].append(await _timed(backend.check_kernel))
    await backend.close()
    medians = {
        name: (statistics.median(c for c, _ in found), statistics.median(w for _, w in found))
        for name, found in runs.items()
    }
    return {"first full sync": first, **medians}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", default="10000", help="services, comma-separated")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces, nftables)", file=sys.stderr)
        return 1
    print(f"{'services':>9} {'what':<16} {'CPU s':>8} {'wall s':>8} {'/ full sync':>12}")
    for size in (int(s) for s in args.sizes.split(",")):
        netns = f"kpng-drift-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", netns], check=True)
        try:
            results = asyncio.run(measure(netns, size, args.repeat))
        finally:
            subprocess.run(["ip", "netns", "del", netns], check=False)
        full = results["first full sync"][1]
        for name, (cpu, wall) in results.items():
            print(f"{size:>9} {name:<16} {cpu:>8.4f} {wall:>8.4f} {wall / full:>12.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
