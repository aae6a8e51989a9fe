"""One wide Service against the same ports and endpoints spread over many narrow ones.

A Service may have 20,000 ports (the API server bounds only the object's size) in 200
EndpointSlices of 100 ports each. Every stage that reads it, the resolver, to-nft's,
to-iptables' and to-ebpf's renderers and the no-local-endpoints count, should cost what the
same ports and endpoints cost as 20,000 one-port Services: the ratio wide / narrow should stay
near 1 as the width grows. Before the port indexes, one Service of 20,000 ports took 15 s to
resolve and over 40 s to render in to-nft, the narrow equivalent under a second.

    python bench/bench_wide_service.py [--ports 2000,20000] [--slices-of 100] [--endpoints 10]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

from kpng.backends._nftables import layout
from kpng.backends._node import Options
from kpng.backends.ebpf import entries
from kpng.backends.iptables import rules
from kpng.feeding import no_local_endpoints
from kpng.gcpause import collector_paused
from kpng.model.cluster import Slice, SliceEndpoint, SlicePort
from kpng.model.messages import IPSet, PortMapping, Service, ServiceEndpoints, ServiceIPs
from kpng.resolver.resolving import resolve_service

NODE = "n0"


def _service(name: str, index: int, ports: range) -> Service:
    return Service(
        Namespace="bench",
        Name=name,
        Type="ClusterIP",
        IPs=ServiceIPs(ClusterIPs=IPSet(V4=(f"10.96.{index // 250}.{index % 250 + 1}",))),
        Ports=tuple(
            PortMapping(Name=f"p{i}", Protocol="TCP", Port=1000 + i, TargetPort=1000 + i)
            for i in ports
        ),
        # The Local policy is what the no-local-endpoints count reads.
        InternalTrafficToLocal=True,
    )


def _slice(name: str, service: str, index: int, ports: range, endpoints: int) -> Slice:
    return Slice(
        namespace="bench",
        name=name,
        service=service,
        v6=False,
        ports=tuple(SlicePort(name=f"p{i}", protocol="TCP", port=1000 + i) for i in ports),
        endpoints=tuple(
            SliceEndpoint(ip=f"10.{1 + index // 250}.{index % 250}.{e + 1}", node=f"n{e % 5}")
            for e in range(endpoints)
        ),
    )


def wide(ports: int, slices_of: int, endpoints: int) -> list[tuple[Service, list[Slice]]]:
    slices = [
        _slice(f"wide-{s}", "wide", s, range(s * slices_of, (s + 1) * slices_of), endpoints)
        for s in range(ports // slices_of)
    ]
    return [(_service("wide", 0, range(ports)), slices)]


def narrow(ports: int, slices_of: int, endpoints: int) -> list[tuple[Service, list[Slice]]]:
    """The same ports and endpoint addresses, one Service per port."""
    return [
        (
            _service(f"s{i}", i, range(i, i + 1)),
            [_slice(f"s{i}", f"s{i}", i // slices_of, range(i, i + 1), endpoints)],
        )
        for i in range(ports)
    ]


def _timed(stage: Callable[[], object]) -> float:
    # As kpng resolves and renders: without the collector's passes over a growing heap.
    with collector_paused():
        start = time.perf_counter()
        stage()
        return time.perf_counter() - start


def stages(cluster: list[tuple[Service, list[Slice]]]) -> dict[str, float]:
    resolved: list[ServiceEndpoints] = []
    options = Options(cluster_cidrs=("10.0.0.0/8",))
    return {
        "resolve": _timed(
            lambda: resolved.extend(
                resolve_service(svc, slices, node=NODE, zone="") for svc, slices in cluster
            )
        ),
        "to-nft": _timed(lambda: [layout.contribute(se) for se in resolved]),
        "to-iptables": _timed(lambda: [rules.contribute(se, "v4", options) for se in resolved]),
        "to-ebpf": _timed(lambda: [entries.contribute(se, options) for se in resolved]),
        "no-local count": _timed(lambda: [no_local_endpoints(se) for se in resolved]),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", default="2000,20000")
    parser.add_argument("--slices-of", type=int, default=100, help="ports per EndpointSlice")
    parser.add_argument("--endpoints", type=int, default=10, help="endpoints per EndpointSlice")
    args = parser.parse_args(argv)
    print(f"{'ports':>6} {'stage':<15} {'wide s':>8} {'narrow s':>9} {'ratio':>6}")
    for ports in (int(p) for p in args.ports.split(",")):
        shape = (ports, args.slices_of, args.endpoints)
        wide_s, narrow_s = stages(wide(*shape)), stages(narrow(*shape))
        for stage, took in wide_s.items():
            ratio = took / narrow_s[stage] if narrow_s[stage] else float("nan")
            print(f"{ports:>6} {stage:<15} {took:>8.3f} {narrow_s[stage]:>9.3f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
