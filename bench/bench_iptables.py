"""to-iptables on this machine, beside to-nft in the same run, in network namespaces of their own
(root): for each size, the first (full) sync of N services x 10 endpoints, and one endpoint
change (a partial sync: the shared chains and one service's chains), median of ``--changes``.

    python bench/bench_iptables.py [--sizes 1000,10000] [--changes 10] [--variants nft,legacy]

The comparison with kube-proxy's own iptables mode, on the same API server state, is
``bench_kube_proxy.py --mode iptables``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import subprocess
import time

from kpng.backends._nftables import NftBackend
from kpng.backends._nftables.executing import KernelNft
from kpng.backends._node import Options
from kpng.backends.iptables import IptablesBackend
from kpng.backends.iptables.executing import Iptables, Tools
from kpng.client import Backend
from kpng.model.cluster import ServiceKey
from kpng.model.messages import ServiceEndpoints
from kpng.testing import states

ENDPOINTS = 10
OPTIONS = Options(cluster_cidrs=("10.244.0.0/16",))


def _services(count: int) -> dict[ServiceKey, ServiceEndpoints]:
    return {
        ("ns", f"s{i}"): ServiceEndpoints(
            states.service(f"s{i}", index=i),
            tuple(
                states.endpoint(f"10.{100 + e}.{i // 250 % 250}.{i % 250 + 1}")
                for e in range(ENDPOINTS)
            ),
        )
        for i in range(count)
    }


async def _measure(backend: Backend, count: int, changes: int) -> tuple[float, float]:
    services = _services(count)
    started = time.perf_counter()
    await backend.apply(states.keyed_state(1, services))
    full = time.perf_counter() - started
    times = []
    key = ("ns", "s0")
    for n in range(changes):
        se = services[key]
        moved = states.endpoint(f"10.250.{n // 250}.{n % 250 + 1}")
        services[key] = ServiceEndpoints(se.service, (moved, *se.endpoints[1:]))
        started = time.perf_counter()
        await backend.apply(states.keyed_state(n + 2, services, {key}))
        times.append(time.perf_counter() - started)
    await backend.close()
    return full, statistics.median(times)


def _netns() -> str:
    name = f"kpng-bench-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--variants", default="nft,legacy")
    args = parser.parse_args()
    print(f"{'backend':<22} {'services':>8} {'full sync s':>12} {'one change ms':>14}")
    for size in (int(s) for s in args.sizes.split(",")):
        runs: list[tuple[str, Backend]] = []
        made = []
        for variant in args.variants.split(","):
            ns = _netns()
            made.append(ns)
            prefix = ("ip", "netns", "exec", ns)
            runs.append(
                (
                    f"to-iptables ({variant})",
                    IptablesBackend(
                        iptables=Iptables(Tools(variant), prefix=prefix),
                        options=OPTIONS,
                        families=("v4",),
                    ),
                )
            )
        ns = _netns()
        made.append(ns)
        nft = KernelNft(("ip", "netns", "exec", ns, "nft"))
        runs.append(("to-nft (baseline)", NftBackend(nft=nft, options=OPTIONS)))
        try:
            for name, backend in runs:
                full, change = asyncio.run(_measure(backend, size, args.changes))
                print(f"{name:<22} {size:>8} {full:>12.2f} {change * 1000:>14.1f}", flush=True)
        finally:
            for ns in made:
                subprocess.run(["ip", "netns", "delete", ns], check=False)


if __name__ == "__main__":
    main()
