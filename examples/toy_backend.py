"""A toy backend: the forwarding table a kernel backend would program, and its changes.

For every service IP and port of the node it keeps where the traffic goes: the endpoints in scope
Internal for cluster IPs, in scope External for external IPs, load-balancer IPs and node ports,
or REJECT / DROP when there are none (see "Reading the node-local state" in
docs/backends/client.md). A DiffStore turns each complete state into the minimal changes,
printed one per line:

    add     10.96.0.10:80/TCP -> 10.244.1.11:8080
    update  10.96.0.20:9000/TCP -> 10.244.1.21:9000
    remove  10.96.0.99:80/TCP

Remotely, against ``kpng <source> to-api``:

    python examples/toy_backend.py --api unix:///tmp/kpng.sock --node-name node-2 [--once]

In process, ``ToyBackend()`` is a ``kpng.client.Backend``: whatever feeds Backends (``to-local``,
``kpng local``) calls ``await backend.apply(state)`` after every change, then ``close()``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TextIO

from kpng.client import DiffStore, Endpoint, IPSet, NodeState, PortMapping, ServiceEndpoints, run

Rule = tuple[str, int, str]
"""(service IP, port, protocol); a node port listens on every address: 0.0.0.0 or ::."""
Targets = tuple[str, ...]
"""The endpoints' "IP:port", sorted; or ("REJECT",) or ("DROP",) when there is none."""


def family(ips: IPSet | None, v6: bool) -> tuple[str, ...]:
    return ips.family(v6) if ips is not None else ()


def targets(endpoints: tuple[Endpoint, ...], port: PortMapping, v6: bool, scope: str) -> Targets:
    """Where traffic of ``scope`` ("Internal" or "External") to ``port`` goes, in one family."""
    found = [
        f"[{ip}]:{override.Port}" if v6 else f"{ip}:{override.Port}"
        for ep in endpoints
        if getattr(ep.Scopes, scope, False)
        for override in ep.PortOverrides  # an endpoint serves exactly these ports
        if (override.Name, override.Protocol) == (port.Name, port.Protocol)
        for ip in family(ep.IPs, v6)
    ]
    if found:
        return tuple(sorted(found))
    # No endpoint for this traffic: DROP if the port has one somewhere in this family (e.g.
    # externalTrafficPolicy Local on a node without a local endpoint), else REJECT.
    usable = port.UsableEndpoints
    return ("DROP",) if usable is not None and (usable.V6 if v6 else usable.V4) else ("REJECT",)


def rules(entry: ServiceEndpoints) -> Iterator[tuple[Rule, Targets]]:
    """The rules of one service. (A real backend would also apply IPFilters, session affinity,
    and send this node's own traffic to external IPs to the Cluster scope when
    ExternalTrafficToLocal: see docs/backends/client.md.)"""
    service = entry.service
    if service.IPs is None:
        return
    ips = service.IPs
    for port in service.Ports:
        for v6 in (False, True):
            frontends = [(ip, port.Port, "Internal") for ip in family(ips.ClusterIPs, v6)]
            if not frontends:
                continue  # the service has no address in this family
            external = (*family(ips.ExternalIPs, v6), *family(ips.LoadBalancerIPs, v6))
            frontends += [(ip, port.Port, "External") for ip in external]
            if port.NodePort:
                frontends.append(("::" if v6 else "0.0.0.0", port.NodePort, "External"))
            for ip, number, scope in frontends:
                yield (ip, number, port.Protocol), targets(entry.endpoints, port, v6, scope)


def show(rule: Rule) -> str:
    ip, port, protocol = rule
    return f"[{ip}]:{port}/{protocol}" if ":" in ip else f"{ip}:{port}/{protocol}"


class ToyBackend:
    """A ``kpng.client.Backend`` that prints the changes to its table after each state."""

    def __init__(self, out: TextIO | None = None, *, once: bool = False) -> None:
        self.table: DiffStore[Rule, Targets] = DiffStore()
        self.out = out
        self.once = once

    async def apply(self, state: NodeState) -> bool:
        for entry in state.services.values():
            for rule, where in rules(entry):
                self.table.set(rule, where)
        diff = self.table.done()  # what changed since the previous state
        out = self.out or sys.stdout
        print(f"# {state.node} revision {state.revision}: {len(self.table)} rules", file=out)
        for verb, changes in (("add", diff.created), ("update", diff.updated)):
            for rule, where in sorted(changes.items()):
                print(f"{verb:7} {show(rule)} -> {', '.join(where)}", file=out)
        for rule in sorted(diff.deleted):
            print(f"remove  {show(rule)}", file=out)
        out.flush()
        return self.once

    async def close(self) -> None:
        return None  # a real backend might remove what it programmed, or leave it in place


if __name__ == "__main__":
    run(ToyBackend().apply, description=__doc__.split("\n\n")[0] if __doc__ else "")
