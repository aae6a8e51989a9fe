"""to-nft on this machine, the issue's figures, in network namespaces of their own (root).

1. full sync of N services x 10 endpoints with to-nft (``NftBackend.apply`` to the kernel,
   rendering included; target <= 1.5 s at 10,000): the median of ``--repeat`` runs, split into
   Python and ``nft -f``, and a second backend's full sync over that table (a restart);
   1b. the same with ``--affinity-services`` more services with ClientIP affinity (target
   <= 2 s for 2,000 on top of 10,000);
2. the same services in kube-proxy's layout (a chain per service with an anonymous
   ``numgen random mod 10 vmap``, a chain per endpoint, a verdict map to the service chains),
   generated here and loaded with ``nft -f`` (``--baseline-services``), and the ratio;
3. one endpoint change at each of ``--change-sizes`` services: the time until the kernel has
   it, median, p99 and worst of ``--changes`` changes (target <= 30 ms, flat);
1c. what the element comments (``namespace/name:port``) cost: figure 1's full sync with and
   without them, runs interleaved, and the ratio;
4. connection latency through a service with 100 and with 10,000 services programmed
   (``--latency-sizes``): a test bed node whose pod opens connections to a service served by
   another pod, rounds alternating the sizes, median per size (target: ratio <= 1.2).

Figures 1 and 3 run transactions the way to-nft does (libnftables in process, or the nft
command without it); ``--nft command`` runs the nft command, ``--nft lib`` libnftables.

    python bench/bench_nft.py [--services 10000] [--baseline-services 10000] [--repeat 5]
        [--change-sizes 1000,10000,30000] [--latency-sizes 100,10000] [--no-latency]
        [--no-baseline] [--nft default|lib|command]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import unittest.mock
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from stats import nearest_rank

if TYPE_CHECKING:
    from kpng.backends._nftables.nftables import Nft, Table, TableObjects, Transaction

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


TARGET_IP = "10.96.0.10"
"""The cluster IP of the service the latency figure connects to (outside 10.0/16, where the
generated services are)."""


def _state(
    services: int,
    revision: int,
    changed: int | None = None,
    target: str | None = None,
    affinity: int = 0,
) -> object:
    """``services`` generated services (all updated, or only the one ``changed``, whose first
    endpoint moves), then ``affinity`` more with ClientIP affinity, and with ``target`` a
    service at ``TARGET_IP`` served by that address."""
    from kpng.backends.registry import NodeState
    from kpng.model.messages import (
        ClientIPAffinity,
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
    sticky = ClientIPAffinity(TimeoutSeconds=10800)
    for s in range(services + affinity):
        svc = Service(
            Namespace="ns",
            Name=f"web-{s}",
            Type="ClusterIP",
            IPs=ServiceIPs(ClusterIPs=IPSet(V4=(_ip(10, s + 1),))),
            Ports=(port,),
            ClientIP=sticky if s >= services else None,
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
    if target is not None:
        svc = Service(
            Namespace="ns",
            Name="target",
            Type="ClusterIP",
            IPs=ServiceIPs(ClusterIPs=IPSet(V4=(TARGET_IP,))),
            Ports=(port,),
        )
        endpoint = Endpoint(
            IPs=IPSet(V4=(target,)),
            Local=True,
            PortOverrides=(PortName(Name="http", Port=8080, Protocol="TCP"),),
            Scopes=scopes,
            Ready=True,
            Serving=True,
        )
        state[("ns", "target")] = ServiceEndpoints(svc, (endpoint,))
    updated = set(state) if changed is None else {("ns", f"web-{changed}")}
    return NodeState(
        node="n1",
        revision=revision,
        services=state,
        updated=frozenset(updated),
        deleted=frozenset(),
    )


def _executor(kind: str) -> Nft:
    """What runs the transactions: ``default`` (as to-nft), ``lib`` or ``command``."""
    from kpng.backends._nftables.executing import KernelNft, LibNft, default_nft

    return {"default": default_nft, "lib": LibNft, "command": KernelNft}[kind]()


class TimedNft:
    """An executor of ``_executor``, timing each transaction (its rendering included)."""

    def __init__(self, kind: str) -> None:
        self._nft = _executor(kind)
        self.seconds = 0.0

    async def run(self, tx: Transaction) -> None:
        start = time.perf_counter()
        try:
            await self._nft.run(tx)
        finally:
            self.seconds += time.perf_counter() - start

    async def delete_table(self, table: Table) -> bool:
        return await self._nft.delete_table(table)

    async def list_tables(self) -> list[Table]:
        return await self._nft.list_tables()

    async def list_objects(self, table: Table) -> TableObjects | None:
        return await self._nft.list_objects(table)

    async def list_table(self, table: Table) -> str:
        return await self._nft.list_table(table)


class FullSync(NamedTuple):
    seconds: float
    nft_seconds: float
    elements: int
    takeover_seconds: float
    """A second backend's full sync over the table the first left (a restart)."""


async def _full_sync(
    services: int, kind: str, affinity: int = 0, *, comments: bool = True
) -> FullSync:
    """One full sync of ``services``, and ``affinity`` with ClientIP affinity, into an empty
    table; without ``comments``, the elements name no service."""
    from kpng.backends._nftables import NftBackend, layout
    from kpng.backends._nftables.layout import Options

    if not comments:
        with unittest.mock.patch.object(layout, "comment_name", return_value=""):
            return await _full_sync(services, kind, affinity)

    nft = TimedNft(kind)
    backend = NftBackend(nft=nft, options=Options(cluster_cidrs=("10.128.0.0/9",)))
    first = _state(services, 1, affinity=affinity)
    start = time.perf_counter()
    await backend.apply(first)  # type: ignore[arg-type]
    seconds, nft_seconds = time.perf_counter() - start, nft.seconds
    await backend.close()
    # A restart: the table is listed and replaced but the affinity memory.
    backend = NftBackend(nft=nft, options=Options(cluster_cidrs=("10.128.0.0/9",)))
    start = time.perf_counter()
    await backend.apply(first)  # type: ignore[arg-type]
    takeover = time.perf_counter() - start
    await backend.close()
    return FullSync(seconds, nft_seconds, len(backend.store.applied_elements), takeover)


async def _changes(services: int, count: int, kind: str) -> list[float]:
    """Seconds each of ``count`` endpoint changes (one service each) takes, at ``services``."""
    from kpng.backends._nftables import NftBackend
    from kpng.backends._nftables.layout import Options

    backend = NftBackend(nft=_executor(kind), options=Options(cluster_cidrs=("10.128.0.0/9",)))
    await backend.apply(_state(services, 1))  # type: ignore[arg-type]
    seconds = []
    for i in range(count):
        changed = _state(services, 2 + i, changed=(services // 2 + 97 * i) % services)
        start = time.perf_counter()
        await backend.apply(changed)  # type: ignore[arg-type]
        seconds.append(time.perf_counter() - start)
    await backend.close()
    return seconds


def _delete_table() -> None:
    subprocess.run(["nft", "delete", "table", "inet", "kpng"], check=True)


def _median(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2]


def inside(args: argparse.Namespace) -> int:
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores; other work skews timings)")
    print(f"transactions run by: {type(_executor(args.nft)).__name__}")
    fulls = []
    for _ in range(args.repeat):
        fulls.append(asyncio.run(_full_sync(args.services, args.nft)))
        _delete_table()
    fulls.sort(key=lambda f: f.seconds)
    median = fulls[len(fulls) // 2]
    print(
        f"1. to-nft full sync, {args.services} services x {ENDPOINTS} endpoints "
        f"({median.elements} elements), {args.repeat} runs: median {median.seconds:.3f} s "
        f"(Python {median.seconds - median.nft_seconds:.3f} s, nft with rendering "
        f"{median.nft_seconds:.3f} s), best {fulls[0].seconds:.3f} s, worst "
        f"{fulls[-1].seconds:.3f} s (target <= 1.5 s); over the full table (a restart): "
        f"{median.takeover_seconds:.3f} s"
    )
    if not args.no_baseline:
        _baseline(args, median)
    timed: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeat):
        for comments in (False, True):
            timed[comments].append(
                asyncio.run(_full_sync(args.services, args.nft, comments=comments)).seconds
            )
            _delete_table()
    with_, without = _median(timed[True]), _median(timed[False])
    print(
        f"1c. full sync of {args.services} services with element comments: median "
        f"{with_:.3f} s, without: {without:.3f} s, ratio {with_ / without:.3f} "
        f"({args.repeat} runs each, interleaved)"
    )
    if args.affinity_services:
        sticky = []
        for _ in range(args.repeat):
            sticky.append(asyncio.run(_full_sync(args.services, args.nft, args.affinity_services)))
            _delete_table()
        sticky.sort(key=lambda f: f.seconds)
        mid = sticky[len(sticky) // 2]
        print(
            f"1b. full sync, {args.services} services and {args.affinity_services} more with "
            f"ClientIP affinity, x {ENDPOINTS} endpoints: median {mid.seconds:.3f} s "
            f"(nft with rendering {mid.nft_seconds:.3f} s), ratio to figure 1: "
            f"{mid.seconds / median.seconds:.2f} (target <= 2 s); over the full table: "
            f"{mid.takeover_seconds:.3f} s"
        )
    medians = []
    for size in args.change_sizes:
        seconds = asyncio.run(_changes(size, args.changes, args.nft))
        _delete_table()
        medians.append(_median(seconds))
        print(
            f"3. one endpoint change at {size} services: median {medians[-1] * 1000:.1f} ms, "
            f"p99 {nearest_rank(seconds, 0.99) * 1000:.1f} ms, worst {max(seconds) * 1000:.1f} ms "
            f"of {args.changes} (target <= 30 ms)"
        )
    print(f"   largest / smallest median: {max(medians) / min(medians):.2f} (flat: about 1)")
    return 0


def _baseline(args: argparse.Namespace, median: FullSync) -> None:
    """Figure 2."""
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
        f.write(kube_proxy_layout(args.baseline_services))
        f.flush()
        start = time.perf_counter()
        subprocess.run(["nft", "-f", f.name], check=True)
        baseline = time.perf_counter() - start
    subprocess.run(["nft", "delete", "table", "ip", "kube-proxy"], check=True)
    print(
        f"2. kube-proxy layout, {args.baseline_services} services x {ENDPOINTS} endpoints, "
        f"nft -f: {baseline:.3f} s"
    )
    if args.baseline_services == args.services:
        ratio = baseline / median.seconds
        print(f"   ratio kube-proxy / to-nft at {args.services} services: {ratio:.1f}x")
    else:
        small = asyncio.run(_full_sync(args.baseline_services, args.nft)).seconds
        _delete_table()
        print(
            f"   to-nft full sync at {args.baseline_services} services: {small:.3f} s; "
            f"ratio kube-proxy / to-nft there: {baseline / small:.1f}x"
        )


def latency(args: argparse.Namespace) -> None:
    """Figure 4, in a test bed of its own: rounds alternate the sizes, so that what else the
    machine does weighs on each alike."""
    import json

    from kpng.backends._nftables import NftBackend
    from kpng.backends._nftables.executing import KernelNft
    from kpng.backends._nftables.layout import Options
    from kpng.testing.netns import ClusterSpec, TestBed

    rounds = 3
    seconds: dict[int, list[float]] = {size: [] for size in args.latency_sizes}
    with TestBed(ClusterSpec.parse({"node-1": ["server", "client"]})) as bed:
        nft = KernelNft(("ip", "netns", "exec", bed.nodes["node-1"].netns, "nft"))
        probe = [sys.executable, "-m", "kpng.testing.probe", "tcp", TARGET_IP, "80"]
        probe += ["--count", str(args.connections), "--timeout", "1"]
        for _ in range(rounds):
            for size in args.latency_sizes:
                state = _state(size, 1, target=bed.pod("server").ip4)
                asyncio.run(NftBackend(nft=nft, options=Options()).apply(state))  # type: ignore[arg-type]
                out = json.loads(bed.exec(bed.pod("client").netns, probe))
                failed = [r for r in out["results"] if not r.startswith("server ")]
                if failed:
                    raise SystemExit(f"connections failed at {size} services: {failed[:5]}")
                seconds[size] += out["seconds"]
    medians = {size: _median(values) for size, values in seconds.items()}
    for size, value in medians.items():
        p90 = sorted(seconds[size])[len(seconds[size]) * 9 // 10]
        print(
            f"4. connection latency with {size} services: median {value * 1e6:.0f} us, "
            f"p90 {p90 * 1e6:.0f} us ({len(seconds[size])} connections)"
        )
    small, large = min(medians), max(medians)
    print(
        f"   ratio {large} / {small} services: {medians[large] / medians[small]:.2f} "
        "(target <= 1.2)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--baseline-services", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=5, help="full syncs to take the median of")
    parser.add_argument(
        "--affinity-services",
        type=int,
        default=2000,
        help="ClientIP services added to --services for figure 1b (0: skip it)",
    )
    parser.add_argument("--change-sizes", type=_sizes, default=[1000, 10000, 30000])
    parser.add_argument("--changes", type=int, default=15, help="endpoint changes per size")
    parser.add_argument("--latency-sizes", type=_sizes, default=[100, 10000])
    parser.add_argument("--connections", type=int, default=1000, help="per size and round")
    parser.add_argument("--no-latency", action="store_true", help="skip figure 4")
    parser.add_argument("--no-baseline", action="store_true", help="skip figure 2")
    parser.add_argument(
        "--nft",
        choices=("default", "lib", "command"),
        default="default",
        help="what runs the transactions of figures 1 and 3 (default: as to-nft)",
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    netns = f"kpng-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        cmd = [sys.executable, __file__, "--inside", "--services", str(args.services)]
        cmd += ["--baseline-services", str(args.baseline_services), "--repeat", str(args.repeat)]
        cmd += ["--affinity-services", str(args.affinity_services)]
        cmd += ["--change-sizes", ",".join(map(str, args.change_sizes))]
        cmd += ["--changes", str(args.changes), "--nft", args.nft]
        cmd += ["--no-baseline"] if args.no_baseline else []
        rc = subprocess.run(["ip", "netns", "exec", netns, *cmd], check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)
    if rc == 0 and not args.no_latency:
        latency(args)
    return rc


def _sizes(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


if __name__ == "__main__":
    sys.exit(main())
