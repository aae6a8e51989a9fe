"""to-nft against kube-proxy's nftables layout, in a network namespace of its own (root).

1. full sync of N services x 10 endpoints with to-nft (``NftBackend.apply`` to the kernel,
   rendering included; target <= 1.5 s at 10,000): the median of ``--repeat`` runs, split into
   Python and ``nft -f``;
2. the same services in kube-proxy's layout (a chain per service with an anonymous
   ``numgen random mod 10 vmap``, a chain per endpoint, a verdict map to the service chains),
   generated here and loaded with ``nft -f`` (``--baseline-services``: it takes minutes at 10k);
3. one endpoint change at N services: the time until the kernel has it.

    python bench/bench_nft.py [--services 10000] [--baseline-services 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kpng.backends.nft.nftables import Table, Transaction

ENDPOINTS = 10


def _ip(base: int, i: int) -> str:
    return f"{base}.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}"


def kube_proxy_layout(services: int) -> str:
    """kube-proxy's nftables proxier layout for ``services`` ClusterIP services."""
    out = [
        "add table ip kube-proxy",
        "add chain ip kube-proxy services",
        "add map ip kube-proxy service-ips "
        "{ type ipv4_addr . inet_proto . inet_service : verdict ; }",
        "add chain ip kube-proxy nat-prerouting "
        "{ type nat hook prerouting priority dstnat ; policy accept ; }",
        "add rule ip kube-proxy nat-prerouting jump services",
        "add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips",
    ]
    for s in range(services):
        svc = f"service-{s}-ns-web-tcp-http"
        eps = []
        for e in range(ENDPOINTS):
            ep = f"endpoint-{s}-{e}-ns-web-tcp-http"
            out.append(f"add chain ip kube-proxy {ep}")
            out.append(
                f"add rule ip kube-proxy {ep} meta l4proto tcp "
                f"dnat to {_ip(11, s * ENDPOINTS + e + 1)}:8080"
            )
            eps.append(f"{e} : goto {ep}")
        out.append(f"add chain ip kube-proxy {svc}")
        out.append(
            f"add rule ip kube-proxy {svc} numgen random mod {ENDPOINTS} "
            f"vmap {{ {', '.join(eps)} }}"
        )
        out.append(
            f"add element ip kube-proxy service-ips {{ {_ip(10, s + 1)} . tcp . 80 : goto {svc} }}"
        )
    return "\n".join(out) + "\n"


def _state(services: int, revision: int, changed: int | None = None) -> object:
    from kpng.backends.registry import NodeState
    from kpng.model.messages import (
        Endpoint,
        EndpointScopes,
        IPFamilies,
        IPSet,
        PortMapping,
        PortName,
        Service,
        ServiceEndpoints,
        ServiceIPs,
    )

    scopes = EndpointScopes(Internal=True, Cluster=True)
    port = PortMapping(Name="http", Protocol="TCP", Port=80, UsableEndpoints=IPFamilies(V4=True))
    state = {}
    for s in range(services):
        svc = Service(
            Namespace="ns",
            Name=f"web-{s}",
            Type="ClusterIP",
            IPs=ServiceIPs(ClusterIPs=IPSet(V4=(_ip(10, s + 1),))),
            Ports=(port,),
        )
        eps = tuple(
            Endpoint(
                IPs=IPSet(
                    V4=(
                        _ip(
                            11, s * ENDPOINTS + e + 1 + (1 << 20 if s == changed and e == 0 else 0)
                        ),
                    )
                ),
                PortOverrides=(PortName(Name="http", Port=8080, Protocol="TCP"),),
                Scopes=scopes,
                Ready=True,
                Serving=True,
            )
            for e in range(ENDPOINTS)
        )
        state[("ns", f"web-{s}")] = ServiceEndpoints(svc, eps)
    updated = set(state) if changed is None else {("ns", f"web-{changed}")}
    return NodeState(
        node="n1",
        revision=revision,
        services=state,
        updated=frozenset(updated),
        deleted=frozenset(),
    )


class TimedNft:
    """The kernel's nft, timing each transaction (its rendering included)."""

    def __init__(self) -> None:
        from kpng.backends.nft.executing import KernelNft

        self._nft = KernelNft()
        self.seconds = 0.0

    async def run(self, tx: Transaction) -> None:
        start = time.perf_counter()
        try:
            await self._nft.run(tx)
        finally:
            self.seconds += time.perf_counter() - start

    async def delete_table(self, table: Table) -> bool:
        return await self._nft.delete_table(table)


class FullSync(NamedTuple):
    seconds: float
    nft_seconds: float
    elements: int


async def _full_sync(services: int) -> tuple[FullSync, float]:
    """One full sync of ``services`` into an empty table, then one endpoint change."""
    from kpng.backends.nft import NftBackend
    from kpng.backends.nft.layout import Options

    nft = TimedNft()
    backend = NftBackend(nft=nft, options=Options(cluster_cidrs=("10.128.0.0/9",)))
    first = _state(services, 1)
    start = time.perf_counter()
    await backend.apply(first)  # type: ignore[arg-type]
    full = FullSync(time.perf_counter() - start, nft.seconds, len(backend.store.applied_elements))
    changed = _state(services, 2, changed=services // 2)
    start = time.perf_counter()
    await backend.apply(changed)  # type: ignore[arg-type]
    one = time.perf_counter() - start
    await backend.close()
    return full, one


def _measure(services: int) -> tuple[FullSync, float]:
    result = asyncio.run(_full_sync(services))
    subprocess.run(["nft", "delete", "table", "inet", "kpng"], check=True)
    return result


def inside(args: argparse.Namespace) -> int:
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores; other work skews timings)")
    runs = [_measure(args.services) for _ in range(args.repeat)]
    fulls = sorted(runs, key=lambda r: r[0].seconds)
    median = fulls[len(fulls) // 2][0]
    print(
        f"to-nft full sync, {args.services} services x {ENDPOINTS} endpoints "
        f"({median.elements} elements), {args.repeat} runs: median {median.seconds:.3f} s "
        f"(Python {median.seconds - median.nft_seconds:.3f} s, nft -f with rendering "
        f"{median.nft_seconds:.3f} s), best {fulls[0][0].seconds:.3f} s (target <= 1.5 s)"
    )
    changes = sorted(one for _, one in runs)
    print(
        f"to-nft one endpoint change at {args.services} services: median "
        f"{changes[len(changes) // 2] * 1000:.1f} ms (target <= 30 ms)"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
        f.write(kube_proxy_layout(args.baseline_services))
        f.flush()
        start = time.perf_counter()
        subprocess.run(["nft", "-f", f.name], check=True)
        baseline = time.perf_counter() - start
    subprocess.run(["nft", "delete", "table", "ip", "kube-proxy"], check=True)
    print(
        f"kube-proxy layout, {args.baseline_services} services x {ENDPOINTS} endpoints, "
        f"nft -f: {baseline:.3f} s"
    )
    if args.baseline_services == args.services:
        ratio = baseline / median.seconds
        print(f"ratio kube-proxy / to-nft at {args.services} services: {ratio:.1f}x")
    else:
        small = _measure(args.baseline_services)[0].seconds
        print(
            f"to-nft full sync at {args.baseline_services} services: {small:.3f} s; "
            f"ratio kube-proxy / to-nft there: {baseline / small:.1f}x"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--baseline-services", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5, help="full syncs to take the median of")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    netns = f"kpng-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        cmd = [sys.executable, __file__, "--inside", "--services", str(args.services)]
        cmd += ["--baseline-services", str(args.baseline_services), "--repeat", str(args.repeat)]
        return subprocess.run(["ip", "netns", "exec", netns, *cmd], check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


if __name__ == "__main__":
    sys.exit(main())
