"""to-nft against kube-proxy's nftables layout, in a network namespace of its own (root).

1. full sync of N services x 10 endpoints with to-nft (``NftBackend.apply`` to the kernel,
   rendering included; target <= 1.5 s at 10,000);
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


async def _to_nft(services: int) -> tuple[float, float, int]:
    from kpng.backends.nft import NftBackend
    from kpng.backends.nft.executing import KernelNft
    from kpng.backends.nft.layout import Options

    backend = NftBackend(nft=KernelNft(), options=Options(cluster_cidrs=("10.128.0.0/9",)))
    first = _state(services, 1)
    start = time.perf_counter()
    await backend.apply(first)  # type: ignore[arg-type]
    full = time.perf_counter() - start
    changed = _state(services, 2, changed=services // 2)
    start = time.perf_counter()
    await backend.apply(changed)  # type: ignore[arg-type]
    one = time.perf_counter() - start
    elements = len(backend.store.applied_elements)
    await backend.close()
    return full, one, elements


def inside(args: argparse.Namespace) -> int:
    full, one, elements = asyncio.run(_to_nft(args.services))
    subprocess.run(["nft", "delete", "table", "inet", "kpng"], check=True)
    print(
        f"to-nft full sync, {args.services} services x {ENDPOINTS} endpoints "
        f"({elements} elements): {full:.3f} s (target <= 1.5 s)"
    )
    print(
        f"to-nft one endpoint change at {args.services} services: {one * 1000:.1f} ms "
        "(target <= 30 ms)"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
        f.write(kube_proxy_layout(args.baseline_services))
        f.flush()
        start = time.perf_counter()
        subprocess.run(["nft", "-f", f.name], check=True)
        baseline = time.perf_counter() - start
    print(
        f"kube-proxy layout, {args.baseline_services} services x {ENDPOINTS} endpoints, "
        f"nft -f: {baseline:.3f} s"
    )
    if args.baseline_services == args.services:
        print(f"ratio kube-proxy / to-nft at {args.services} services: {baseline / full:.1f}x")
    else:
        small = asyncio.run(_to_nft(args.baseline_services))[0]
        subprocess.run(["nft", "delete", "table", "inet", "kpng"], check=True)
        print(
            f"to-nft full sync at {args.baseline_services} services: {small:.3f} s; "
            f"ratio kube-proxy / to-nft there: {baseline / small:.1f}x"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--baseline-services", type=int, default=10000)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        return inside(args)
    netns = f"kpng-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        cmd = [sys.executable, __file__, "--inside", "--services", str(args.services)]
        cmd += ["--baseline-services", str(args.baseline_services)]
        return subprocess.run(["ip", "netns", "exec", netns, *cmd], check=False).returncode
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)


if __name__ == "__main__":
    sys.exit(main())
