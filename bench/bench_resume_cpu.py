"""The brain's CPU per resume, in process: a node view's first resolution and its digests
(issue 42, finding 1; docs/design/resume.md, "Where the work goes").

The synthetic cluster (``--services`` x 10 endpoints spread over ``--cluster-nodes`` nodes in 3
zones; 5,000 gives some 20 endpoints a node at 10,000 services, as at the issue's scale) is fed
to one ``ClusterResolver`` with the server's JSON ``Encoders`` wired to it as ``serving`` wires
them. One view per zone stays open, as the rest of a fleet would. Then, for ``--resumes``
nodes in turn, what the brain does for a resuming watcher before its first answer: a new view,
its first ``resolve``, the node digest, the view closed. Two ways, alternating, in this run:

- **walk** (kpng before this change): the view resolves every service (``NodeView``'s whole
  path, as a view's first resolve did) and ``StateDigests.of`` digests its whole state;
- **base**: ``NodeView.resolve`` (the zone's base and the node's own services) and
  ``BaseDigests.of`` (the zone's digests, the node's buckets replaced).

Both node digests must be equal (the bench stops otherwise). ``--ways walk`` runs on kpng
before this change too (``PYTHONPATH`` at its ``src``), to time the walk with its own code.
Reported: CPU per resume (the thread's CPU time), median and mean, and for each the share of
the resolution and of the digests. After a warm-up round over the same nodes, as in a
fleet's fail-over where each service's shared values are resolved and digested once.

    python bench/bench_resume_cpu.py [--services 1000,10000] [--resumes 200]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import synthetic

from kpng.api.digests import item_digest
from kpng.model.cluster import Slice
from kpng.model.messages import Node, NodeFacts, Service
from kpng.model.paths import NODE_FACTS_PATH
from kpng.resolver.resolving import ClusterResolver, NodeView
from kpng.server.resuming import StateDigests
from kpng.server.serving import Encoders
from kpng.sources import manifests


@dataclass
class Sample:
    resolve_s: float
    digest_s: float

    @property
    def total_s(self) -> float:
        return self.resolve_s + self.digest_s


def build(
    services: int, cluster_nodes: int, *, bases: bool
) -> tuple[ClusterResolver, Encoders, list[str]]:
    data = msgspec.json.encode(synthetic.generate(services, nodes=cluster_nodes))
    parsed = manifests.parse(data, filename=f"<synthetic {services}>")
    if parsed.errors:
        raise RuntimeError(f"{len(parsed.errors)} parse errors, first: {parsed.errors[0]}")
    cluster = ClusterResolver()
    enc = Encoders.json()
    cluster.on_change.append(enc.first_ops.forget)
    cluster.on_change.append(enc.digests.forget)
    if bases:
        cluster.on_base_change.append(enc.base_digests.changed)
    nodes: list[str] = []
    for (_, namespace, name), obj in parsed.objects.items():
        if isinstance(obj, Node):
            cluster.set_node(name, obj)
            nodes.append(name)
        elif isinstance(obj, Service):
            cluster.set_service((namespace, name), obj)
        elif isinstance(obj, Slice):
            cluster.set_slice((namespace, name), obj)
    return cluster, enc, nodes


def _walk(cluster: ClusterResolver, view: NodeView) -> None:
    """A view's first resolve as kpng made it before: every service resolved, then onto the
    zone's base (what ``NodeView.resolve`` did with everything dirty and no base yet)."""
    view._everything_dirty = False
    cluster._read_log(view)
    view._resolve_whole(set(cluster.services))


def resume(
    cluster: ClusterResolver, enc: Encoders, node: str, facts: bytes, *, walk: bool
) -> tuple[Sample, bytes]:
    """What the brain does for one resuming watcher of ``node`` until it knows whether the
    watcher holds its state: CPU seconds of the resolution and of the digests, and the digest."""
    clock = time.thread_time
    start = clock()
    view = cluster.view(node)
    if walk:
        _walk(cluster, view)
    else:
        view.resolve()
    resolved = clock()
    if walk:
        ours = StateDigests.of(view.state, digest=enc.digests, facts=facts)
    else:
        base, zone, overlay = view.layers()
        ours = enc.base_digests.of(base=base, zone=zone, overlay=overlay, facts=facts)
    view.close()
    done = clock()
    return Sample(resolved - start, done - resolved), ours.node


def _line(name: str, samples: list[Sample]) -> str:
    totals = [s.total_s for s in samples]
    mean = statistics.fmean(totals)
    resolve = statistics.fmean(s.resolve_s for s in samples)
    return (
        f"  {name:5} median {statistics.median(totals) * 1e3:8.3f} ms, mean {mean * 1e3:8.3f} ms "
        f"(resolve {resolve * 1e3:8.3f} ms, digests {(mean - resolve) * 1e3:8.3f} ms)"
    )


def bench(services: int, cluster_nodes: int, resumes: int, ways: Sequence[bool]) -> None:
    """``ways``: True the walk, False the base's."""
    start = time.perf_counter()
    cluster, enc, nodes = build(services, cluster_nodes, bases=False in ways)
    built = time.perf_counter() - start
    print(f"{services:,} services, {cluster_nodes:,} cluster nodes: built in {built:.1f} s")
    facts = item_digest(NODE_FACTS_PATH, enc.facts(NodeFacts()))
    zones: dict[str, str] = {}
    for node in nodes:
        zones.setdefault(cluster.zone(node), node)
    fleet = [cluster.view(node) for node in zones.values()]  # the rest of the fleet, one a zone
    for view in fleet:
        view.resolve()
    chosen = nodes[:: max(1, len(nodes) // resumes)][:resumes]
    samples: dict[bool, list[Sample]] = {way: [] for way in ways}
    gc.collect()
    gc.disable()  # a collection lands on one resume or the other: not what is compared
    try:
        for measured in (False, True):
            for i, node in enumerate(chosen):
                digests = set()
                for walk in ways if i % 2 else reversed(ways):
                    sample, digest = resume(cluster, enc, node, facts, walk=walk)
                    digests.add(digest)
                    if measured:
                        samples[walk].append(sample)
                if len(digests) != 1:
                    raise SystemExit(f"node {node}: the two ways give different digests")
    finally:
        gc.enable()
    for view in fleet:
        view.close()
    for way, name in ((True, "walk"), (False, "base")):
        if way in samples:
            print(_line(name, samples[way]))
    if len(ways) == 2:
        old = statistics.fmean(s.total_s for s in samples[True])
        new = statistics.fmean(s.total_s for s in samples[False])
        print(
            f"  {len(chosen)} resumes each way, equal digests; the base's way is "
            f"{old / new:.1f} times cheaper"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--services",
        default="1000,10000",
        help="sizes, comma-separated (default: 1000,10000)",
    )
    parser.add_argument("--cluster-nodes", type=int, default=5000, help="(default: 5000)")
    parser.add_argument("--resumes", type=int, default=200, help="per size and way (200)")
    parser.add_argument(
        "--ways",
        default="walk,base",
        help="walk, base or both (default): walk alone runs on a kpng without zone bases "
        "(a commit before BaseDigests), to compare the walk with its own code",
    )
    args = parser.parse_args(argv)
    ways = [{"walk": True, "base": False}[way] for way in args.ways.split(",")]
    for size in (int(s) for s in args.services.split(",")):
        bench(size, args.cluster_nodes, args.resumes, ways)
    return 0


if __name__ == "__main__":
    sys.exit(main())
