"""Generated node-local services of every shape to-nft handles, for tests that need many.

``generate(n, seed=...)`` is deterministic: services of one or both families, TCP, UDP and SCTP
ports (some with node ports), external and load-balancer IPs (some claimed by two services, so
that elements conflict), source ranges, ClientIP affinity, eTP=Local, endpoints with every mix
of scopes, local and not, some serving two services (shared hairpin pairs), and no endpoints.
"""

from __future__ import annotations

import random

from kpng.client import NodeState
from kpng.model.cluster import ServiceKey
from kpng.model.messages import (
    ClientIPAffinity,
    Endpoint,
    EndpointScopes,
    IPFamilies,
    IPFilter,
    IPSet,
    PortMapping,
    PortName,
    Service,
    ServiceEndpoints,
    ServiceIPs,
)
from kpng.testing.states import keyed_state

_SCOPES = [
    EndpointScopes(Internal=True, External=True, Cluster=True),
    EndpointScopes(Internal=True, Cluster=True),
    EndpointScopes(External=True),
    EndpointScopes(Internal=True),
    EndpointScopes(Cluster=True),
]


def _v4(rng: random.Random, base: int) -> str:
    return f"{base}.{rng.randrange(4)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"


def _v6(rng: random.Random, prefix: str) -> str:
    return f"{prefix}::{rng.randrange(1, 0xFFFF):x}"


def _ipset(v4: list[str], v6: list[str]) -> IPSet:
    return IPSet(V4=tuple(sorted(set(v4))), V6=tuple(sorted(set(v6))))


def generate(count: int, *, seed: int = 1) -> dict[ServiceKey, ServiceEndpoints]:
    """``count`` services keyed by (namespace, name)."""
    rng = random.Random(seed)
    shared_vips = [f"192.0.2.{i}" for i in range(1, 20)]
    out: dict[ServiceKey, ServiceEndpoints] = {}
    for s in range(count):
        fams = rng.choice([("v4",), ("v4",), ("v6",), ("v4", "v6")])
        v4, v6 = "v4" in fams, "v6" in fams
        cluster = _ipset(
            [f"10.96.{s >> 8 & 255}.{s & 255}"] if v4 else [], [f"fd00:96::{s:x}"] if v6 else []
        )
        external = _ipset(
            [rng.choice(shared_vips) for _ in range(rng.choice([0, 0, 1, 2]))] if v4 else [],
            [_v6(rng, "2001:db8:e")] if v6 and rng.random() < 0.2 else [],
        )
        lb = _ipset([_v4(rng, 198)] if v4 and rng.random() < 0.2 else [], [])
        ports = []
        for p in range(rng.choice([1, 1, 1, 2, 3])):
            proto = rng.choice(["TCP", "TCP", "TCP", "UDP", "SCTP"])
            ports.append(
                PortMapping(
                    Name=f"p{p}",
                    Protocol=proto,
                    Port=rng.choice([53, 80, 443, 8080, 9000 + p]),
                    NodePort=rng.choice([0, 0, 30000 + s % 2000 * 3 + p]),
                    UsableEndpoints=IPFamilies(V4=rng.random() < 0.8, V6=rng.random() < 0.8),
                )
            )
        filters: tuple[IPFilter, ...] = ()
        if lb.V4 and rng.random() < 0.5:
            filters = (IPFilter(TargetIPs=lb, SourceRanges=("203.0.113.0/24", "2001:db8::/64")),)
        service = Service(
            Namespace=f"ns{s % 7}",
            Name=f"svc-{s}",
            Type="LoadBalancer" if lb.V4 else "ClusterIP",
            IPs=ServiceIPs(ClusterIPs=cluster, ExternalIPs=external, LoadBalancerIPs=lb),
            Ports=tuple(ports),
            ExternalTrafficToLocal=rng.random() < 0.2,
            IPFilters=filters,
            ClientIP=ClientIPAffinity(TimeoutSeconds=rng.choice([0, 30]))
            if rng.random() < 0.1
            else None,
            HealthCheckNodePort=0,
        )
        endpoints = []
        for _ in range(rng.choice([0, 1, 2, 3, 10])):
            # A small address pool: some addresses serve several services.
            addr4 = f"10.244.{rng.randrange(3)}.{rng.randrange(2, 60)}"
            endpoints.append(
                Endpoint(
                    IPs=_ipset([addr4] if v4 else [], [_v6(rng, "fd00:244")] if v6 else []),
                    Local=rng.random() < 0.3,
                    PortOverrides=tuple(
                        PortName(
                            Name=p.Name, Port=rng.choice([8080, 8081, 5353]), Protocol=p.Protocol
                        )
                        for p in ports
                        if rng.random() < 0.9
                    ),
                    Scopes=rng.choice(_SCOPES),
                    Ready=True,
                    Serving=True,
                )
            )
        out[(service.Namespace, service.Name)] = ServiceEndpoints(service, tuple(endpoints))
    return out


def churn(services: int, *, seed: int, revisions: int, per_revision: int) -> list[NodeState]:
    """An empty first state, then ``revisions - 1`` states that each add, change (to the same
    key's shape in another generation) or delete ``per_revision`` random services of
    ``generate(services)``; the same every time for a seed."""
    rng = random.Random(seed)
    pool, variants = generate(services, seed=seed), generate(services, seed=seed + 100)
    keys = sorted(pool)
    current: dict[ServiceKey, ServiceEndpoints] = {}
    states = [keyed_state(1, current)]
    for revision in range(2, revisions + 1):
        updated, deleted = set(), set()
        for key in rng.sample(keys, per_revision):
            if key in current and rng.random() < 0.3:
                del current[key]
                deleted.add(key)
                updated.discard(key)
            else:
                current[key] = rng.choice([pool, variants])[key]
                updated.add(key)
        states.append(keyed_state(revision, current, updated, deleted))
    return states
