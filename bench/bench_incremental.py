"""The cost of one EndpointSlice change, by cluster size: it should not grow with the cluster.

For each size (1k, 10k and 30k services by default), in this process:

1. the synthetic cluster is generated, encoded and parsed with ``kpng.sources.manifests.parse``
   (the file source's own path) into the global model;
2. **resolver**: a ``NodeResolver`` for one node is fed every object and resolved once; then
   ``--changes`` single-slice changes (one endpoint's ready condition flipped, or its address
   changed, on a random slice; each a new model ``Slice`` built with ``msgspec.structs.replace``)
   are applied one by one, timing ``set_slice`` + ``resolve()``;
3. **store → to-local**: the same cluster in a ``kpng.store.Store`` followed by
   ``kpng.sinks.local.run_local`` and an in-memory backend that notes when ``apply`` is called;
   the same changes, timing from ``handle.set_slice(...); handle.commit()`` to the backend's
   ``apply``. Changes that leave the node's state as it was (e.g. an endpoint that topology keeps
   away from this node) never reach the backend, and are counted instead of timed.

Reports the median and p99 (nearest rank) per size, and the ratio of the medians of the largest
and smallest sizes. Target: a median of at most 5 ms, flat across sizes. Missing it is reported,
not failed.

    python bench/bench_incremental.py [--sizes 1000,10000,30000] [--changes 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import ipaddress
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import synthetic
from inprocess import GcClock

from kpng.backends.registry import NodeState
from kpng.model.cluster import ServiceKey, Slice, SliceKey
from kpng.model.messages import Node, Service, ServiceEndpoints
from kpng.resolver.resolving import NodeResolver
from kpng.sinks.local import run_local
from kpng.sources import manifests
from kpng.store import SourceHandle, Store

TARGET_MEDIAN_MS = 5.0
FLAT_RATIO = 2.0  # "flat": the largest size's median at most this many times the smallest's
FIRST_APPLY_TIMEOUT_S = 300.0
CHANGE_TIMEOUT_S = 5.0
_NEW_ADDRESSES = ipaddress.IPv4Network("10.255.0.0/16")  # outside the generator's pod network


@dataclass(frozen=True)
class Model:
    services: dict[ServiceKey, Service]
    slices: dict[SliceKey, Slice]
    nodes: dict[str, Node]


@dataclass(frozen=True)
class Change:
    key: SliceKey
    new: Slice
    what: str  # "ready" or "address"


@dataclass
class Latencies:
    ns: list[int] = field(default_factory=list)
    unchanged: int = 0  # changes that did not change the node's state
    gc_s: float = 0.0
    gc_collections: list[int] = field(default_factory=lambda: [0, 0, 0])

    def median_ms(self) -> float:
        return statistics.median(self.ns) / 1e6 if self.ns else math.nan

    def p99_ms(self) -> float:
        """Nearest rank: the smallest sample at least 99% of the samples do not exceed."""
        if not self.ns:
            return math.nan
        ranked = sorted(self.ns)
        return ranked[math.ceil(0.99 * len(ranked)) - 1] / 1e6

    def max_ms(self) -> float:
        return max(self.ns) / 1e6 if self.ns else math.nan

    def summary(self) -> str:
        young, middle, full = self.gc_collections
        return (
            f"median {self.median_ms() * 1000:.1f} µs, p99 {self.p99_ms() * 1000:.1f} µs, "
            f"max {self.max_ms() * 1000:.1f} µs\n"
            f"    ({len(self.ns)} timed, {self.unchanged} left the state unchanged; "
            f"GC: {self.gc_s * 1000:.1f} ms in {young} young, {middle} middle, {full} full "
            "collections)"
        )


@dataclass
class SizeResult:
    services: int
    generate_s: float
    parse_s: float
    initial_resolve_s: float
    initial_apply_s: float
    resolver: Latencies
    store: Latencies


def build_model(services: int, *, seed: int) -> tuple[Model, float, float]:
    """The parsed global model of the synthetic cluster: (model, generate s, parse s)."""
    start = time.perf_counter()
    data = msgspec.json.encode(synthetic.generate(services, seed=seed))
    generated = time.perf_counter() - start
    start = time.perf_counter()
    parsed = manifests.parse(data, filename=f"<synthetic {services}>")
    parse_s = time.perf_counter() - start
    del data
    return model_of(parsed), generated, parse_s


def model_of(parsed: manifests.Parsed) -> Model:
    """The objects of a parsed synthetic cluster by kind; RuntimeError if kpng reported or
    ignored any (the benchmarks would then measure less than the file holds)."""
    if parsed.errors:
        raise RuntimeError(f"{len(parsed.errors)} parse errors, first: {parsed.errors[0]}")
    model = Model(services={}, slices={}, nodes={})
    for (kind, namespace, name), obj in parsed.objects.items():
        if isinstance(obj, Service):
            model.services[(namespace, name)] = obj
        elif isinstance(obj, Slice):
            model.slices[(namespace, name)] = obj
        elif isinstance(obj, Node):
            model.nodes[name] = obj
        else:
            raise RuntimeError(f"{kind} {namespace}/{name} is ignored by kpng")
    return model


def make_changes(slices: Mapping[SliceKey, Slice], count: int, *, seed: int) -> list[Change]:
    """``count`` single-endpoint changes on random slices, each on top of the previous ones."""
    rng = random.Random(seed)
    keys = sorted(slices)
    current: dict[SliceKey, Slice] = {}
    addresses = iter(_NEW_ADDRESSES.hosts())
    changes = []
    for _ in range(count):
        key = keys[rng.randrange(len(keys))]
        sl = current.get(key, slices[key])
        i = rng.randrange(len(sl.endpoints))
        ep = sl.endpoints[i]
        if rng.random() < 0.5:
            ready = not ep.ready
            # A pod that fails or passes its readiness probe; serving follows unless terminating.
            new_ep = msgspec.structs.replace(
                ep, ready=ready, serving=ep.serving if ep.terminating else ready
            )
            what = "ready"
        else:
            new_ep = msgspec.structs.replace(ep, ip=str(next(addresses)))
            what = "address"
        endpoints = (*sl.endpoints[:i], new_ep, *sl.endpoints[i + 1 :])
        new = msgspec.structs.replace(sl, endpoints=endpoints)
        current[key] = new
        changes.append(Change(key=key, new=new, what=what))
    return changes


def stage_all(handle: SourceHandle, model: Model) -> None:
    for name, node in model.nodes.items():
        handle.set_node(name, node)
    for key, service in model.services.items():
        handle.set_service(key, service)
    for key, sl in model.slices.items():
        handle.set_slice(key, sl)


def bench_resolver(
    model: Model, changes: Sequence[Change], node: str
) -> tuple[Latencies, float, list[bool], dict[ServiceKey, ServiceEndpoints]]:
    """(latencies, initial resolve s, whether each change changed the state, the final state)."""
    resolver = NodeResolver(node)
    resolver.set_node(model.nodes.get(node))
    for key, service in model.services.items():
        resolver.set_service(key, service)
    for key, sl in model.slices.items():
        resolver.set_slice(key, sl)
    start = time.perf_counter()
    resolver.resolve()
    initial = time.perf_counter() - start

    result = Latencies()
    visible = []
    clock = GcClock().install()
    try:
        for change in changes:
            t0 = time.perf_counter_ns()
            resolver.set_slice(change.key, change.new)
            changed = resolver.resolve()
            t1 = time.perf_counter_ns()
            visible.append(bool(changed))
            if changed:
                result.ns.append(t1 - t0)
            else:
                result.unchanged += 1
    finally:
        gc.callbacks.remove(clock)
    result.gc_s, result.gc_collections = clock.seconds, clock.collections
    return result, initial, visible, dict(resolver.state)


class RecordingBackend:
    """A to-local backend that keeps nothing but when it was called, and the last state."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.last: NodeState | None = None
        self.closed = False
        self._called = asyncio.Event()

    async def apply(self, state: NodeState) -> bool:
        self.calls.append(time.perf_counter_ns())
        self.last = state
        self._called.set()
        return False

    async def close(self) -> None:
        self.closed = True

    def arm(self) -> None:
        self._called.clear()

    async def called(self) -> int:
        """When apply was called since ``arm()`` (perf_counter_ns)."""
        await self._called.wait()
        return self.calls[-1]


async def bench_store(
    model: Model, changes: Sequence[Change], visible: Sequence[bool], node: str
) -> tuple[Latencies, float, Mapping[ServiceKey, ServiceEndpoints]]:
    """(latencies, first apply s, the backend's final state), through the store and to-local."""
    store = Store()
    handle = store.source("bench")
    backend = RecordingBackend()
    sink = asyncio.create_task(run_local(store, node_name=node, backend=backend))
    result = Latencies()
    clock = GcClock()
    try:
        backend.arm()
        start = time.perf_counter()
        stage_all(handle, model)
        handle.mark_synced()
        async with asyncio.timeout(FIRST_APPLY_TIMEOUT_S):
            await backend.called()
        first_apply = time.perf_counter() - start

        clock.install()
        for change, expected in zip(changes, visible, strict=True):
            backend.arm()
            t0 = time.perf_counter_ns()
            handle.set_slice(change.key, change.new)
            handle.commit()
            if not expected:
                # Nothing reaches the backend; let to-local take the delta before the next one.
                for _ in range(3):
                    await asyncio.sleep(0)
                result.unchanged += 1
                continue
            async with asyncio.timeout(CHANGE_TIMEOUT_S):
                t1 = await backend.called()
            result.ns.append(t1 - t0)
    finally:
        if clock in gc.callbacks:
            gc.callbacks.remove(clock)
        sink.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sink
        await backend.close()
    result.gc_s, result.gc_collections = clock.seconds, clock.collections
    if backend.last is None:
        raise RuntimeError("the backend was never called")
    return result, first_apply, backend.last.services


def bench_size(services: int, *, changes: int, seed: int) -> SizeResult:
    node = synthetic.node_name(0)
    model, generate_s, parse_s = build_model(services, seed=seed)
    endpoints = sum(len(sl.endpoints) for sl in model.slices.values())
    print(
        f"\n-- {services} services, {len(model.slices)} slices, {endpoints} endpoints, "
        f"{len(model.nodes)} nodes; node {node}"
    )
    print(f"  generated in {generate_s:.2f} s, parsed (manifests.parse) in {parse_s:.2f} s")
    change_list = make_changes(model.slices, changes, seed=seed)
    kinds = {k: sum(1 for c in change_list if c.what == k) for k in ("ready", "address")}
    print(f"  {changes} changes: {kinds['ready']} ready flips, {kinds['address']} address changes")

    gc.collect()
    resolver, initial_resolve, visible, expected = bench_resolver(model, change_list, node)
    print(f"  resolver: initial resolve of every service in {initial_resolve:.3f} s")
    print(f"  resolver, set_slice + resolve(): {resolver.summary()}")

    gc.collect()
    store, first_apply, final = asyncio.run(bench_store(model, change_list, visible, node))
    print(f"  store: first apply (the complete state) {first_apply:.3f} s after the first write")
    print(f"  store, set_slice + commit → apply: {store.summary()}")
    if dict(final) != expected:
        raise RuntimeError("the store path ended in another state than the resolver alone")
    return SizeResult(
        services=services,
        generate_s=generate_s,
        parse_s=parse_s,
        initial_resolve_s=initial_resolve,
        initial_apply_s=first_apply,
        resolver=resolver,
        store=store,
    )


def _verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def report(results: Sequence[SizeResult]) -> None:
    print("\nsummary (ms; p99 by nearest rank):")
    print(
        f"  {'services':>9} {'resolver median':>16} {'p99':>8} "
        f"{'store median':>13} {'p99':>8} {'initial resolve':>16}"
    )
    for r in results:
        print(
            f"  {r.services:9d} {r.resolver.median_ms():16.3f} {r.resolver.p99_ms():8.3f} "
            f"{r.store.median_ms():13.3f} {r.store.p99_ms():8.3f} "
            f"{r.initial_resolve_s * 1000:16.1f}"
        )
    if len(results) < 2:
        return
    small, large = results[0], results[-1]
    label = f"{large.services // 1000}k/{small.services // 1000}k"
    paths: tuple[tuple[str, Callable[[SizeResult], Latencies]], ...] = (
        ("resolver", lambda r: r.resolver),
        ("store → to-local", lambda r: r.store),
    )
    for name, path in paths:
        ratio = path(large).median_ms() / path(small).median_ms()
        worst = max(path(r).median_ms() for r in results)
        print(
            f"  {name:17} medians {label}: {ratio:5.2f}x (flat, ≤ {FLAT_RATIO:g}x: "
            f"{_verdict(ratio <= FLAT_RATIO)}); worst median {worst:.3f} ms "
            f"(≤ {TARGET_MEDIAN_MS:g} ms: {_verdict(worst <= TARGET_MEDIAN_MS)})"
        )


def _sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or any(not 1 <= s <= 50_000 for s in sizes):
        raise argparse.ArgumentTypeError("sizes: 1 to 50000 services each")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sizes", type=_sizes, default=[1000, 10_000, 30_000])
    parser.add_argument("--changes", type=int, default=200, help="per size (default: 200)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not 1 <= args.changes <= 10_000:
        parser.error("--changes: 1 to 10000")
    sizes = ", ".join(map(str, args.sizes))
    print(f"== one EndpointSlice change, by cluster size ({sizes} services)")
    start = time.perf_counter()
    results = []
    try:
        for services in args.sizes:
            results.append(bench_size(services, changes=args.changes, seed=args.seed))
            gc.collect()
    except (RuntimeError, TimeoutError) as exc:
        print(f"bench_incremental: {exc!r}", file=sys.stderr)
        return 1
    report(results)
    print(f"\n(bench_incremental took {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
